"""Redaction of secret tool arguments before they reach a topic.

A tool's argument schema marks secret fields with :data:`Secret` (or
``Annotated[T, SECRET]``; pydantic's ``SecretStr``/``SecretBytes``/``Secret[T]``
and their subclasses count too).
:func:`secret_paths` lists them as dotted paths (``*`` = every list item or dict
value), and :func:`redact` replaces each secret value with a marker that gives
nothing of the value away:

- with a marker key (derived from ``SAGALINE_SECRET_KEY``, see
  :meth:`schemas.sealing.Sealer.marker`): ``"[redacted hmac:<first 12 hex>]"``, an
  HMAC-SHA256 of the clear value, so whoever holds the key can tell two values apart
  or match one they hold, and nobody else can test guesses against it;
- without one: ``"[redacted]"``, the same for every value (an unkeyed digest of a
  PIN or a CVV would be undone by hashing its 10,000 candidates).

Markers written before this (``"[redacted sha256:<12 hex>]"``) still count as
redacted (:func:`is_redacted`).

Example::

    class Charge(BaseModel):
        amount: int
        card: Annotated[str, SECRET]

    args_json = redacted_json({"amount": 5, "card": "4111..."}, secret_paths(Charge))
"""

from __future__ import annotations

import collections.abc
import hashlib
import hmac
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import is_dataclass
from typing import Annotated, Any, Final, TypeVar

import orjson
from pydantic import AliasChoices, BaseModel, SecretBytes, SecretStr
from pydantic import Secret as PydanticSecret
from pydantic.fields import FieldInfo

from schemas.keys import canonical_json

T = TypeVar("T")


class _SecretMarker:
    """Metadata marker: the annotated field holds a secret."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SECRET"


SECRET: Final = _SecretMarker()
"""Put in ``Annotated[..., SECRET]`` to mark any field secret."""

Secret = Annotated[str, SECRET]
"""A secret string argument (the common case)."""

REDACTED_PREFIX = "[redacted "
REDACTED = "[redacted]"
"""The marker of every secret when no marker key is configured."""

_SECRET_TYPES = (SecretStr, SecretBytes, PydanticSecret)


def reveal(value: Any) -> Any:
    """``default=`` for orjson: a pydantic secret (``SecretStr``...) as its clear value,
    for serialising a secret argument that holds one (to seal or to fingerprint it)."""
    if isinstance(value, _SECRET_TYPES):
        clear = value.get_secret_value()
        return clear.decode("utf-8", "replace") if isinstance(clear, bytes) else clear
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def redaction_marker(value: Any, key: bytes | None = None) -> str:
    """What replaces a secret: with a marker ``key``, a short HMAC-SHA256 of the clear
    value (equal values, equal markers, for whoever holds the key); without one,
    :data:`REDACTED`, which carries nothing of the value."""
    if not key:
        return REDACTED
    if isinstance(value, _SECRET_TYPES):
        value = value.get_secret_value()
    if isinstance(value, str):
        data = value.encode("utf-8")
    elif isinstance(value, bytes):
        data = value
    else:
        data = orjson.dumps(value, default=reveal, option=orjson.OPT_SORT_KEYS)
    digest = hmac.new(key, data, hashlib.sha256).hexdigest()[:12]
    return f"{REDACTED_PREFIX}hmac:{digest}]"


def is_redacted(value: Any) -> bool:
    return isinstance(value, str) and (
        value == REDACTED or (value.startswith(REDACTED_PREFIX) and value.endswith("]"))
    )


def secret_paths(model: type[BaseModel]) -> tuple[str, ...]:
    """Dotted paths of every secret field of ``model``, nested models included."""
    paths: list[str] = []
    _walk_model(model, "", paths, set())
    return tuple(paths)


def _walk_model(model: type[BaseModel], prefix: str, out: list[str], stack: set[type]) -> None:
    if model in stack:  # recursive model: its secrets are already listed at this level
        return
    stack = stack | {model}
    for name, info in model.model_fields.items():
        # Arguments carry a field under its name or its alias (a model's JSON schema
        # shows the alias): list the secret under each key it can arrive as.
        for key in _keys(name, info):
            path = f"{prefix}{key}"
            if any(isinstance(m, _SecretMarker) for m in info.metadata):
                out.append(path)
                continue
            _walk_type(info.annotation, path, out, stack)


def spelled_paths(model: type[BaseModel], path: str) -> tuple[str, ...]:
    """A declared secret path (``card.card_number``) under every key each of its parts
    can arrive as: a field comes under its alias (what the model's JSON schema shows,
    so what an agent sends) as well as its name. A part that names no field is kept."""
    return tuple(dict.fromkeys(".".join(p) for p in _spell(model, path.split("."))))


def _spell(tp: Any, parts: list[str]) -> list[list[str]]:
    if not parts:
        return [[]]
    head, rest = parts[0], parts[1:]
    found = [[key, *tail] for key, sub in _children(tp, head) for tail in _spell(sub, rest)]
    return found or [parts]


def _children(tp: Any, head: str) -> list[tuple[str, Any]]:
    """The keys ``head`` may arrive as inside a value of type ``tp``, with the type
    of the value under each."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _children(typing.get_args(tp)[0], head)
    if origin in (typing.Union, types.UnionType):
        return [c for branch in typing.get_args(tp) for c in _children(branch, head)]
    if isinstance(origin, type) and issubclass(origin, collections.abc.Mapping):
        args = typing.get_args(tp)
        return [(head, args[1] if len(args) == 2 else Any)]
    if (
        isinstance(origin, type)
        and issubclass(origin, collections.abc.Iterable)
        and not issubclass(origin, str | bytes)
    ):
        items = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return [(head, item) for item in items or [Any]]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [
            (key, info.annotation)
            for name, info in tp.model_fields.items()
            if head in (keys := _keys(name, info))
            for key in keys
        ]
    if isinstance(tp, type) and (_is_typeddict(tp) or is_dataclass(tp)):
        hints = typing.get_type_hints(tp, include_extras=True)
        return [(head, hints[head])] if head in hints else []
    return []


def _keys(name: str, info: FieldInfo) -> list[str]:
    """The keys a field's value may arrive under: its name and its aliases."""
    keys = [name]
    aliases: list[object] = [info.alias, info.validation_alias]
    if isinstance(info.validation_alias, AliasChoices):
        aliases += info.validation_alias.choices
    keys += [a for a in aliases if isinstance(a, str)]
    return list(dict.fromkeys(keys))


def _walk_hints(tp: type, prefix: str, out: list[str], stack: set[type]) -> None:
    """A TypedDict's or a dataclass's fields, by name (``Annotated`` kept)."""
    if tp in stack:
        return
    stack = stack | {tp}
    for name, hint in typing.get_type_hints(tp, include_extras=True).items():
        _walk_type(hint, f"{prefix}{name}", out, stack)


def _walk_type(tp: Any, path: str, out: list[str], stack: set[type]) -> None:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        if any(isinstance(m, _SecretMarker) for m in meta):
            out.append(path)
            return
        _walk_type(base, path, out, stack)
    elif origin in (typing.Union, types.UnionType):
        before = len(out)
        for branch in typing.get_args(tp):
            _walk_type(branch, path, out, stack)
        # Two branches may list the same path.
        out[before:] = list(dict.fromkeys(out[before:]))
    # get_origin gives the runtime class (collections.abc.Sequence for typing.Sequence
    # and for Sequence[...] alike): match by class, so every collection is walked.
    elif isinstance(origin, type) and issubclass(origin, collections.abc.Mapping):
        args = typing.get_args(tp)
        if len(args) == 2:
            _walk_type(args[1], f"{path}.*", out, stack)
    elif (
        isinstance(origin, type)
        and issubclass(origin, collections.abc.Iterable)
        and not issubclass(origin, str | bytes)
    ):
        for item in typing.get_args(tp):
            if item is not Ellipsis:
                _walk_type(item, f"{path}.*", out, stack)
    elif _is_secret_type(origin if isinstance(origin, type) else tp):
        out.append(path)
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        _walk_model(tp, f"{path}.", out, stack)
    elif isinstance(tp, type) and (_is_typeddict(tp) or is_dataclass(tp)):
        _walk_hints(tp, f"{path}.", out, stack)


def _is_secret_type(tp: Any) -> bool:
    """pydantic's secret types: ``SecretStr``, ``SecretBytes``, ``Secret[T]`` and
    their subclasses."""
    return isinstance(tp, type) and issubclass(tp, _SECRET_TYPES)


def _is_typeddict(tp: type) -> bool:
    # typing.is_typeddict misses typing_extensions.TypedDict (pydantic's on 3.11).
    return issubclass(tp, dict) and hasattr(tp, "__total__")


def redact(
    args: Mapping[str, Any], secret_paths: Iterable[str], key: bytes | None = None
) -> dict[str, Any]:
    """A copy of ``args`` with the value at every secret path replaced by its marker
    (keyed by the marker ``key``, if any: :func:`redaction_marker`).

    Paths that are absent (an optional field left out) are skipped; already-redacted
    values are left alone, so redacting twice changes nothing.
    """
    return map_secrets(
        args, secret_paths, lambda v: v if is_redacted(v) else redaction_marker(v, key)
    )


def map_secrets(
    args: Mapping[str, Any], secret_paths: Iterable[str], fn: Callable[[Any], Any]
) -> dict[str, Any]:
    """A copy of ``args`` with ``fn`` applied to the value at every secret path (the
    one walker behind redaction and sealing)."""
    result: Any = dict(args)
    for path in secret_paths:
        result = _map_at(result, path.split("."), fn)
    return dict(result)


def _map_at(node: Any, parts: list[str], fn: Callable[[Any], Any]) -> Any:
    if not parts:
        return fn(node)
    head, rest = parts[0], parts[1:]
    if isinstance(node, Mapping):
        if head == "*":
            return {k: _map_at(v, rest, fn) for k, v in node.items()}
        if head not in node:
            return node
        copy = dict(node)
        copy[head] = _map_at(node[head], rest, fn)
        return copy
    if isinstance(node, list | tuple):
        if head == "*":
            return [_map_at(v, rest, fn) for v in node]
        if head.isdigit() and int(head) < len(node):
            items = list(node)
            items[int(head)] = _map_at(items[int(head)], rest, fn)
            return items
    return node


def scrub(
    text: str, args: Mapping[str, Any], secret_paths: Iterable[str], key: bytes | None = None
) -> str:
    """``text`` (an error message bound for the ledger) with every clear secret value
    of ``args`` replaced by its marker (keyed by the marker ``key``, if any).

    Tools and provider SDKs quote their input in errors ("No such token: 'tok_...'");
    redacting the arguments alone would let the secret reach the ledger there.
    """
    found: list[Any] = []

    def collect(value: Any) -> Any:
        found.append(value)
        return value

    map_secrets(args, secret_paths, collect)
    clear: dict[str, str] = {}
    for value in found:
        for leaf in _leaves(value):
            if isinstance(leaf, _SECRET_TYPES):
                leaf = leaf.get_secret_value()
            if isinstance(leaf, bytes):
                shown = leaf.decode("utf-8", "replace")
            elif isinstance(leaf, str | int | float) and not isinstance(leaf, bool):
                shown = str(leaf)
            else:
                continue
            if shown and not is_redacted(shown):
                marker = redaction_marker(leaf, key)
                # Errors quote their input as JSON or as a repr: every escaped spelling.
                for spelling in _spellings(shown):
                    clear.setdefault(spelling, marker)
    for shown in sorted(clear, key=len, reverse=True):  # a longer secret holding a shorter
        text = text.replace(shown, clear[shown])
    return text


def _spellings(text: str) -> tuple[str, ...]:
    """``text`` as it is, and as JSON and Python reprs quote it (escapes differ)."""
    return tuple(
        dict.fromkeys(
            (
                text,
                json.dumps(text)[1:-1],
                json.dumps(text, ensure_ascii=False)[1:-1],
                repr(text)[1:-1],
                ascii(text)[1:-1],
            )
        )
    )


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list | tuple | set | frozenset):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def redacted_json(
    args: Mapping[str, Any], secret_paths: Iterable[str], key: bytes | None = None
) -> bytes:
    """Canonical JSON of ``redact(args, secret_paths, key)``: what goes into a record's
    ``args`` bytes (``StepScheduled``, ``ExecuteStep``, ...)."""
    return canonical_json(redact(args, secret_paths, key))


__all__ = [
    "REDACTED",
    "SECRET",
    "Secret",
    "is_redacted",
    "map_secrets",
    "redact",
    "redacted_json",
    "redaction_marker",
    "reveal",
    "scrub",
    "secret_paths",
    "spelled_paths",
]
