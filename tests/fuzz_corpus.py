"""Generated and mutated Kafka records for the consumer fuzz tests (not a test module).

:func:`corpus` draws ``n`` messages with hypothesis: valid records of every type
(from :func:`schemas.examples.example_records`, with drawn ids), records whose fields
hypothesis rewrote (re-encoded and signed, so they reach the decoder and the
consumer's logic), and byte-level mutations (bit flips, truncation, appended or
random bytes, re-signed garbage, missing or forged signatures, wrong keys).
Each item says whether the consumer's own decoder accepts it, so a test can demand
that every rejected one lands in the DLQ.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from schemas import Record
from schemas.errors import CodecError
from schemas.examples import example_records
from schemas.signing import Signer
from schemas.wire import from_message, to_message

AVRO_LONG = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TEXT = st.text(max_size=40)


@dataclass(frozen=True)
class Item:
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    mutation: str
    decodable: bool
    saga_id: str | None = None


MUTATIONS = (
    "valid",
    "fields",
    "flip",
    "truncate",
    "extend",
    "random",
    "resigned-garbage",
    "no-signature",
    "forged-signature",
    "wrong-key",
    "empty",
)


def corpus(
    n: int,
    signer: Signer,
    *,
    kinds: Sequence[type[Record]] | None = None,
    valid: Callable[[str], list[Record]] | None = None,
) -> list[Item]:
    """``n`` items drawn by hypothesis. ``kinds`` limits the base records' types;
    ``valid(saga_id)`` builds the base records (default: the example saga)."""
    build = valid or (lambda saga_id: example_records(saga_id))
    out: list[Item] = []

    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        saga_id = data.draw(st.sampled_from(["", "s"]) | st.uuids().map(str), label="saga")
        bases = [r for r in build(saga_id or "x") if kinds is None or isinstance(r, tuple(kinds))]
        base = data.draw(st.sampled_from(bases), label="base")
        mutation = data.draw(st.sampled_from(MUTATIONS), label="mutation")
        out.append(_mutate(data, base, mutation, signer))

    while len(out) < n:
        draw()
    return out[:n]


def _item(
    key: bytes | None, value: bytes | None, headers: Any, mutation: str, signer: Signer
) -> Item:
    hdrs = [(k, v) for k, v in headers]
    try:
        record = from_message(key, value, hdrs, signer)
    except CodecError:
        return Item(key, value, hdrs, mutation, False)
    return Item(key, value, hdrs, mutation, True, record.saga_id)


def _mutate(data: st.DataObject, base: Record, mutation: str, signer: Signer) -> Item:
    key, value, headers = to_message(base, signer)
    if mutation == "valid":
        return _item(key, value, headers, mutation, signer)
    if mutation == "fields":
        changed = _rewrite_fields(data, base)
        if changed is not None:
            with contextlib.suppress(Exception):  # a value Avro cannot carry: keep the original
                key, value, headers = to_message(changed, signer)
        return _item(key, value, headers, mutation, signer)
    raw = bytearray(value)
    if mutation == "flip":
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        resign = data.draw(st.booleans(), label="resign")
        value = bytes(raw)
        return _item(
            key, value, signer.headers(key, value) if resign else headers, mutation, signer
        )
    if mutation == "truncate":
        value = bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")])
        return _item(key, value, signer.headers(key, value), mutation, signer)
    if mutation == "extend":
        value = bytes(raw) + data.draw(st.binary(min_size=1, max_size=64), label="tail")
        return _item(key, value, signer.headers(key, value), mutation, signer)
    if mutation == "random":
        value = data.draw(st.binary(max_size=512), label="random")
        return _item(key, value, headers, mutation, signer)
    if mutation == "resigned-garbage":
        value = b"\xc3\x01" + data.draw(st.binary(max_size=256), label="garbage")
        return _item(key, value, signer.headers(key, value), mutation, signer)
    if mutation == "no-signature":
        return _item(key, bytes(raw), [], mutation, signer)
    if mutation == "forged-signature":
        forged = Signer(data.draw(st.binary(min_size=1, max_size=32), label="forger"))
        return _item(key, bytes(raw), forged.headers(key, bytes(raw)), mutation, signer)
    if mutation == "wrong-key":
        other = data.draw(st.binary(max_size=40), label="key")
        return _item(other, bytes(raw), signer.headers(other, bytes(raw)), mutation, signer)
    return _item(key, None, headers, "empty", signer)


def _rewrite_fields(data: st.DataObject, record: Record) -> Record | None:
    """The record with some of its (and its envelope's) scalar fields redrawn."""
    envelope = record.envelope
    env_updates: dict[str, Any] = {}
    for name in ("event_id", "saga_id", "type", "producer", "tenant_id"):
        if data.draw(st.booleans(), label=f"env.{name}"):
            env_updates[name] = data.draw(TEXT, label=name)
    for name in ("generation", "occurred_at"):
        if data.draw(st.booleans(), label=f"env.{name}"):
            env_updates[name] = data.draw(AVRO_LONG, label=name)
    updates: dict[str, Any] = {}
    for name in type(record).model_fields:
        if name == "envelope" or not data.draw(st.booleans(), label=f"rewrite.{name}"):
            continue
        current = getattr(record, name)
        if isinstance(current, (bool, enum.Enum)):
            continue
        if isinstance(current, str):
            updates[name] = data.draw(TEXT, label=name)
        elif isinstance(current, int):
            updates[name] = data.draw(AVRO_LONG, label=name)
        elif isinstance(current, bytes):
            updates[name] = data.draw(st.binary(max_size=200), label=name)
    if not env_updates and not updates:
        return None
    return record.model_copy(
        update={**updates, "envelope": envelope.model_copy(update=env_updates)}
    )
