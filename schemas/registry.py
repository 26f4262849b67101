"""The Avro schemas of the contract, parsed once, found by name or by fingerprint.

``schemas/avsc/`` holds one file per named type (records, commands, the shared
``Envelope``, ``RetryPolicy``, ``StepContract`` and the enums), all in namespace
``sagaline``. A record type's *full* schema is its file with every named type it uses
inlined at first use, so its parsing canonical form, and therefore its CRC-64-AVRO
fingerprint, changes whenever anything it contains changes.

The registry knows the current (reader) schema of every record type and any extra
writer schemas registered for evolution: a record framed with an older or newer
writer's fingerprint is resolved to the current reader of the same name. Earlier
versions shipped in ``schemas/avsc/history/`` are registered as writers at start.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

from schemas.errors import UnknownFingerprint

AVSC_DIR = Path(__file__).resolve().parent / "avsc"
NAMESPACE = "sagaline"

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})


@dataclass(frozen=True)
class RegisteredSchema:
    """One parsed schema: ``name`` is the short record name (``"StepCommitted"``),
    ``fingerprint`` the 8 framing bytes (CRC-64-AVRO, little-endian)."""

    name: str
    fingerprint: bytes
    canonical: str = field(repr=False)
    schema: dict[str, Any] = field(repr=False)
    parsed: dict[str, Any] = field(repr=False)

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    def __repr__(self) -> str:
        return f"RegisteredSchema({self.name!r}, fingerprint={self.fingerprint.hex()})"


def _full_name(name: str, namespace: str | None) -> str:
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def _inline(node: Any, defs: Mapping[str, Any], seen: set[str], namespace: str | None) -> Any:
    """Return ``node`` with references to ``defs`` replaced by their definitions at
    first use (Avro allows a named type to be defined once per schema)."""
    if isinstance(node, str):
        if node in _PRIMITIVES:
            return node
        full = _full_name(node, namespace)
        if full in seen:
            return full
        if full not in defs:
            raise ValueError(f"schema refers to unknown named type {full!r}")
        return _inline(defs[full], defs, seen, namespace)
    if isinstance(node, list):
        return [_inline(branch, defs, seen, namespace) for branch in node]
    if isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            ns = node.get("namespace", namespace)
            full = _full_name(node["name"], ns)
            seen.add(full)
            out = dict(node)
            if kind in ("record", "error"):
                out["fields"] = [
                    {**f, "type": _inline(f["type"], defs, seen, ns)} for f in node["fields"]
                ]
            return out
        if kind == "array":
            return {**node, "items": _inline(node["items"], defs, seen, namespace)}
        if kind == "map":
            return {**node, "values": _inline(node["values"], defs, seen, namespace)}
        return {**node, "type": _inline(kind, defs, seen, namespace)}
    raise ValueError(f"not an Avro schema node: {node!r}")


def _short_name(schema: Mapping[str, Any]) -> str:
    return str(schema["name"]).rsplit(".", 1)[-1]


class SchemaRegistry:
    """Reader schemas by record name, and every known schema by fingerprint.

    Thread-safe for registration; lookups are plain dict reads.
    """

    def __init__(self, avsc_dir: Path = AVSC_DIR) -> None:
        self._defs: dict[str, dict[str, Any]] = {}
        for path in sorted(avsc_dir.glob("*.avsc")):
            schema = json.loads(path.read_text(encoding="utf-8"))
            full = _full_name(schema["name"], schema.get("namespace"))
            self._defs[full] = schema
        self._lock = threading.Lock()
        self._readers: dict[str, RegisteredSchema] = {}
        self._by_fingerprint: dict[bytes, RegisteredSchema] = {}
        for schema in self._defs.values():
            if schema.get("type") == "record" and _is_record_type(schema):
                registered = self._register(schema)
                self._readers[registered.name] = registered
        # Earlier versions of record types (``avsc/history/<Name>.vN.avsc``): records
        # written by a not yet upgraded process stay decodable during a rollout.
        for path in sorted((avsc_dir / "history").glob("*.avsc")):
            self.register_writer(json.loads(path.read_text(encoding="utf-8")))

    # ------------------------------------------------------------------ lookup

    @property
    def record_names(self) -> tuple[str, ...]:
        """Every record type with a reader schema (events and commands)."""
        return tuple(sorted(self._readers))

    def definitions(self) -> Mapping[str, Mapping[str, Any]]:
        """The raw ``.avsc`` documents by full name, as read from disk."""
        return self._defs

    def reader(self, name: str) -> RegisteredSchema:
        """The current schema of record type ``name`` (e.g. ``"StepCommitted"``)."""
        try:
            return self._readers[name]
        except KeyError:
            raise KeyError(
                f"no reader schema for record type {name!r}; known: {', '.join(self.record_names)}"
            ) from None

    def by_fingerprint(self, fp: bytes) -> RegisteredSchema:
        """The schema (reader or registered writer) whose fingerprint is ``fp``."""
        try:
            return self._by_fingerprint[fp]
        except KeyError:
            raise UnknownFingerprint(bytes(fp)) from None

    def fingerprints(self) -> Iterable[bytes]:
        return tuple(self._by_fingerprint)

    # ------------------------------------------------------------ registration

    def register_writer(self, schema: Mapping[str, Any] | str) -> RegisteredSchema:
        """Make another version of a record schema decodable (schema evolution).

        ``schema`` is a record schema (dict or JSON text); references to named types
        it does not define itself (``"sagaline.Envelope"``) resolve to the current
        definitions. Its name must be a known record type, since decoding resolves a
        writer to the current reader of the same name. Idempotent.
        """
        doc = json.loads(schema) if isinstance(schema, str) else dict(schema)
        name = _short_name(doc)
        if name not in self._readers:
            raise ValueError(
                f"cannot register writer schema {name!r}: no current record type of that name"
            )
        return self._register(doc)

    def _register(self, schema: Mapping[str, Any]) -> RegisteredSchema:
        full_schema = _inline(dict(schema), self._defs, set(), schema.get("namespace"))
        parsed = parse_schema(full_schema, named_schemas={})
        assert isinstance(parsed, dict)  # a record schema parses to a dict
        canonical = to_parsing_canonical_form(parsed)
        fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
        registered = RegisteredSchema(
            name=_short_name(schema),
            fingerprint=fp,
            canonical=canonical,
            schema=full_schema,
            parsed=parsed,
        )
        with self._lock:
            existing = self._by_fingerprint.get(fp)
            if existing is not None:
                return existing
            self._by_fingerprint[fp] = registered
        return registered


def _is_record_type(schema: Mapping[str, Any]) -> bool:
    """Events and commands start with an ``envelope`` field; shared types do not."""
    fields = schema.get("fields") or []
    return bool(fields) and fields[0].get("name") == "envelope"


@functools.cache
def default_registry() -> SchemaRegistry:
    """The process-wide registry over ``schemas/avsc`` (parsed once)."""
    return SchemaRegistry()


__all__ = ["AVSC_DIR", "NAMESPACE", "RegisteredSchema", "SchemaRegistry", "default_registry"]
