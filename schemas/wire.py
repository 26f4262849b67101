"""Records to Kafka messages and back: pure framing, no I/O.

A message is ``key = saga id (UTF-8)``, ``value = codec.encode(record)`` and headers
carrying the HMAC signature (when a key is configured). Reading verifies first, then
decodes; every failure is a :class:`~schemas.errors.CodecError` whose ``reason`` and
message go, with the untouched original bytes, to the DLQ (R16).

The transport (:mod:`sagaline.kafka`) moves these bytes; this module only says
what they are.

Example::

    key, value, headers = to_message(event, signer)
    record = from_message(key, value, headers, signer)
    # a rejected message's DLQ copy, with why and where from:
    key, value, headers = dlq_message(key, value, headers, "bad-signature", "...",
                                      "sagaline.events", 3, 42)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from schemas.codec import decode, encode
from schemas.errors import MalformedRecord
from schemas.models import Record
from schemas.signing import HeaderList, Headers, Signer, header_value, shown

R = TypeVar("R", bound=Record)


DLQ_REASON = "sagaline-dlq-reason"
DLQ_DETAIL = "sagaline-dlq-detail"
DLQ_TOPIC = "sagaline-dlq-topic"
DLQ_PARTITION = "sagaline-dlq-partition"
DLQ_OFFSET = "sagaline-dlq-offset"
DLQ_OMITTED = "sagaline-dlq-omitted"
_DLQ_HEADERS = frozenset(
    {DLQ_REASON, DLQ_DETAIL, DLQ_TOPIC, DLQ_PARTITION, DLQ_OFFSET, DLQ_OMITTED}
)
_MAX_DETAIL = 2000
_MAX_SUMMARY_KEY = 1024


def to_message(
    record: Record, signer: Signer, encoded: bytes | None = None
) -> tuple[bytes, bytes, Headers]:
    """``(key, value, headers)`` for producing ``record``; ``encoded``: its bytes
    (``encode(record)``) when the caller has them already."""
    value = encode(record) if encoded is None else encoded  # first: says what cannot be written
    key = record.envelope.saga_id.encode("utf-8")
    return key, value, signer.headers(key, value)


@overload
def from_message(
    key: bytes | None,
    value: bytes | None,
    headers: HeaderList | None,
    signer: Signer,
    expected: None = None,
) -> Record: ...


@overload
def from_message(
    key: bytes | None,
    value: bytes | None,
    headers: HeaderList | None,
    signer: Signer,
    expected: type[R],
) -> R: ...


def from_message(
    key: bytes | None,
    value: bytes | None,
    headers: HeaderList | None,
    signer: Signer,
    expected: type[Record] | None = None,
) -> Record:
    """Verify the signature, decode, check the writer may write it (with a trust
    file: :mod:`schemas.trust`), and check the key is the record's saga id.

    Raises a :class:`~schemas.errors.CodecError` subclass on any problem.
    """
    if value is None:
        raise MalformedRecord("record has no value (a tombstone on a record topic)")
    writer = signer.verify(key, value, headers)
    record = decode(value, expected) if expected is not None else decode(value)
    # Who wrote it may write it (schemas.trust), judged as the writer whose key verified
    # it: one reading of the trust file for both steps.
    signer.authorize(record, headers, writer)
    saga_key = record.envelope.saga_id.encode("utf-8")
    if key is None:
        # Without a key the record lands on any partition, away from the rest of its
        # saga (and from the coordinator that holds the saga's state).
        raise MalformedRecord(
            f"{record.TYPE} {record.event_id} of saga {record.envelope.saga_id!r} has no key: "
            "producers must key by saga id"
        )
    if key != saga_key:
        raise MalformedRecord(
            f"{record.TYPE} {record.event_id} is keyed {shown(key)} but belongs to saga "
            f"{record.envelope.saga_id!r}: producers must key by saga id"
        )
    return record


def message_size(key: bytes | None, value: bytes | None, headers: Iterable[Any] | None) -> int:
    """A record's bytes as the size limits count them: key, value, and each header's
    name and value (the broker's framing aside)."""
    size = len(key or b"") + len(value or b"")
    return size + sum(len(name) + len(v or b"") for name, v in headers or ())


def dlq_message(
    key: bytes | None,
    value: bytes | None,
    headers: HeaderList | None,
    reason: str,
    detail: str,
    source_topic: str | None,
    partition: int | None,
    offset: int | None,
) -> tuple[bytes | None, bytes | None, Headers]:
    """The DLQ copy of a rejected message: key and value byte-for-byte as received,
    the original headers (one with a null value too; ``sagaline-dlq-*`` ones it
    already carried are replaced), plus why and where from (``sagaline-dlq-*``)."""
    kept: Headers = [
        (name, v.encode() if isinstance(v, str) else v)
        for name, v in (headers.items() if isinstance(headers, dict) else headers or ())
        if name not in _DLQ_HEADERS
    ]
    kept += [
        (DLQ_REASON, reason.encode("utf-8")),
        (DLQ_DETAIL, detail[:_MAX_DETAIL].encode("utf-8", "replace")),
        (DLQ_TOPIC, (source_topic or "").encode("utf-8")),
        # -1: the position is unknown (confluent-kafka's stubs allow None).
        (DLQ_PARTITION, str(-1 if partition is None else partition).encode("ascii")),
        (DLQ_OFFSET, str(-1 if offset is None else offset).encode("ascii")),
    ]
    return key, value, kept


def dlq_summary(
    key: bytes | None,
    value: bytes | None,
    headers: HeaderList | None,
    reason: str,
    detail: str,
    source_topic: str | None,
    partition: int | None,
    offset: int | None,
) -> tuple[bytes | None, None, Headers]:
    """The DLQ copy of a message too large to copy whole (the copy adds headers to a
    record that may already be at the producer's or the topic's size limit).

    Nothing of it may be lost without a trace (R16): this copy has no value and
    none of the original headers, but the usual why and where-from headers plus
    ``sagaline-dlq-omitted``, which gives the size and SHA-256 of what is missing, so
    the original can be found at its source offset (while retention keeps it) and
    checked. The key is kept (a saga id) unless it is over 1 KiB itself, when its
    size and digest are given instead."""
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    header_bytes = sum(len(name) + len(v or b"") for name, v in pairs)
    body = value or b""
    size = len(key or b"") + len(body) + header_bytes
    omitted = (
        f"too large to copy whole: the value ({len(body)} bytes, sha256 "
        f"{hashlib.sha256(body).hexdigest()}) and headers ({header_bytes} bytes) are "
        f"omitted; {size} bytes in all"
    )
    kept = key
    if key is not None and len(key) > _MAX_SUMMARY_KEY:
        kept = None
        omitted += f"; the key too ({len(key)} bytes, sha256 {hashlib.sha256(key).hexdigest()})"
    _key, _value, copy = dlq_message(
        kept, None, None, reason, detail, source_topic, partition, offset
    )
    copy.append((DLQ_OMITTED, omitted.encode("utf-8")))
    return kept, None, copy


@dataclass(frozen=True)
class DeadLetter:
    """Where a DLQ record came from and why it was rejected; ``omitted``: what a copy
    too large to write whole leaves out (:func:`dlq_summary`), else ``None``."""

    reason: str
    detail: str
    source_topic: str
    partition: int
    offset: int
    omitted: str | None = None


def read_dead_letter(headers: HeaderList | None) -> DeadLetter:
    """Parse the ``sagaline-dlq-*`` headers of a DLQ record; :class:`MalformedRecord`
    when one is missing or a position is not an integer."""

    def text(name: str) -> str:
        value = header_value(headers, name)
        if value is None:
            raise MalformedRecord(f"DLQ record lacks header {name!r}")
        return value.decode("utf-8", "replace")

    def number(name: str) -> int:
        value = text(name)
        try:
            return int(value)
        except ValueError:
            raise MalformedRecord(
                f"DLQ record's header {name!r} is {shown(value)}, not an integer"
            ) from None

    omitted = header_value(headers, DLQ_OMITTED)
    return DeadLetter(
        reason=text(DLQ_REASON),
        detail=text(DLQ_DETAIL),
        source_topic=text(DLQ_TOPIC),
        partition=number(DLQ_PARTITION),
        offset=number(DLQ_OFFSET),
        omitted=None if omitted is None else omitted.decode("utf-8", "replace"),
    )


__all__ = [
    "DLQ_DETAIL",
    "DLQ_OFFSET",
    "DLQ_OMITTED",
    "DLQ_PARTITION",
    "DLQ_REASON",
    "DLQ_TOPIC",
    "DeadLetter",
    "Headers",
    "dlq_message",
    "dlq_summary",
    "from_message",
    "read_dead_letter",
    "to_message",
]
