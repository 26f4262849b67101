"""Records to Kafka messages and back: the one place every service goes through.

A message is ``key = saga id (UTF-8)``, ``value = codec.encode(record)`` and headers
carrying the HMAC signature (when a key is configured). Reading verifies first, then
decodes; every failure is a :class:`~schemas.errors.CodecError` whose ``reason`` and
message go, with the untouched original bytes, to the DLQ (R16).

Example::

    producer = confluent_kafka.Producer(producer_config(bootstrap))
    key, value, headers = to_message(event, signer)
    producer.produce(topics.events, key=key, value=value, headers=headers)
    ...
    try:
        record = from_message(msg.key(), msg.value(), msg.headers(), signer)
    except CodecError as exc:
        producer.produce(topics.dlq, *dlq_message(msg.key(), msg.value(), msg.headers(),
                         exc.reason, str(exc), msg.topic(), msg.partition(), msg.offset()))
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from schemas.codec import decode, encode
from schemas.errors import MalformedRecord
from schemas.models import Record
from schemas.signing import HeaderList, Headers, Signer, header_value

R = TypeVar("R", bound=Record)


DLQ_REASON = "sagaline-dlq-reason"
DLQ_DETAIL = "sagaline-dlq-detail"
DLQ_TOPIC = "sagaline-dlq-topic"
DLQ_PARTITION = "sagaline-dlq-partition"
DLQ_OFFSET = "sagaline-dlq-offset"
_DLQ_HEADERS = frozenset({DLQ_REASON, DLQ_DETAIL, DLQ_TOPIC, DLQ_PARTITION, DLQ_OFFSET})
_MAX_DETAIL = 2000


def producer_config(bootstrap: str, **overrides: Any) -> dict[str, Any]:
    """Producer settings every Sagaline producer uses (override per call).

    ``murmur2_random`` matches the Java client's partitioner, so a saga id maps to
    the same partition number on every co-partitioned topic whoever produced it.
    Idempotence and ``acks=all``: an acknowledged intent is durable (R10).
    """
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "partitioner": "murmur2_random",
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "compression.type": "lz4",
    }
    config.update(overrides)
    return config


def consumer_config(bootstrap: str, group_id: str, **overrides: Any) -> dict[str, Any]:
    """Consumer settings: manual commits after processing, committed reads only
    (so aborted coordinator transactions are never seen)."""
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": group_id,
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
    }
    config.update(overrides)
    return config


def watermarks(consumer: Any, tp: Any, timeout_s: float = 60.0) -> tuple[int, int]:
    """Low and high watermarks of ``tp``, retried while the partition has no leader
    yet (a topic created a moment ago, a broker restarting)."""
    from confluent_kafka import KafkaError, KafkaException

    retry_codes = (
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            return int(low), int(high)
        except KafkaException as exc:
            error = exc.args[0]
            retriable = error.retriable() or error.code() in retry_codes
            if not retriable or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_to_end(
    bootstrap: str, topic: str, partitions: list[int], group_id: str = "sagaline-reader"
) -> Iterator[Any]:
    """Yield the committed messages of ``partitions`` of ``topic`` from the start up
    to their end as of now, then stop. The one reader behind state restore, the
    ledger tools and ``saga show``: no group membership, no commits."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException
    from confluent_kafka import TopicPartition as TP

    consumer = Consumer(consumer_config(bootstrap, group_id, **{"enable.partition.eof": True}))
    try:
        live = [n for n in partitions if _has_records(consumer, TP(topic, n))]
        if not live:
            return
        consumer.assign([TP(topic, n, OFFSET_BEGINNING) for n in live])
        remaining = set(live)
        while remaining:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    remaining.discard(msg.partition())
                    continue
                raise KafkaException(err)
            yield msg
    finally:
        consumer.close()


def _has_records(consumer: Any, tp: Any) -> bool:
    low, high = watermarks(consumer, tp)
    return high > low


def to_message(record: Record, signer: Signer) -> tuple[bytes, bytes, Headers]:
    """``(key, value, headers)`` for producing ``record``."""
    key = record.envelope.saga_id.encode("utf-8")
    value = encode(record)
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
    """Verify the signature, decode, and check the key is the record's saga id.

    Raises a :class:`~schemas.errors.CodecError` subclass on any problem.
    """
    if value is None:
        raise MalformedRecord("record has no value (a tombstone on a record topic)")
    signer.verify(key, value, headers)
    record = decode(value, expected) if expected is not None else decode(value)
    saga_key = record.envelope.saga_id.encode("utf-8")
    if key is not None and key != saga_key:
        raise MalformedRecord(
            f"{record.TYPE} {record.event_id} is keyed {key!r} but belongs to saga "
            f"{record.envelope.saga_id!r}: producers must key by saga id"
        )
    return record


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
    the original headers, plus why and where from (``sagaline-dlq-*`` headers)."""
    kept: Headers = [
        (name, v.encode() if isinstance(v, str) else v)
        for name, v in (headers.items() if isinstance(headers, dict) else headers or ())
        if v is not None and name not in _DLQ_HEADERS
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


@dataclass(frozen=True)
class DeadLetter:
    """Where a DLQ record came from and why it was rejected."""

    reason: str
    detail: str
    source_topic: str
    partition: int
    offset: int


def read_dead_letter(headers: HeaderList | None) -> DeadLetter:
    """Parse the ``sagaline-dlq-*`` headers of a DLQ record."""

    def text(name: str) -> str:
        value = header_value(headers, name)
        if value is None:
            raise MalformedRecord(f"DLQ record lacks header {name!r}")
        return value.decode("utf-8", "replace")

    return DeadLetter(
        reason=text(DLQ_REASON),
        detail=text(DLQ_DETAIL),
        source_topic=text(DLQ_TOPIC),
        partition=int(text(DLQ_PARTITION)),
        offset=int(text(DLQ_OFFSET)),
    )


__all__ = [
    "DLQ_DETAIL",
    "DLQ_OFFSET",
    "DLQ_PARTITION",
    "DLQ_REASON",
    "DLQ_TOPIC",
    "DeadLetter",
    "Headers",
    "consumer_config",
    "dlq_message",
    "from_message",
    "producer_config",
    "read_dead_letter",
    "to_message",
]
