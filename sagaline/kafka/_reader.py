"""Reading the ledger without joining a consumer group: to its end, per saga, from an
offset or a point in time.

State restore, operator tools and ``saga show`` need "what does the log say, as of
now" and never commit offsets. A saga's records all live on one partition (murmur2
of its id), so reading one saga reads one partition.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from sagaline.kafka._clients import create_consumer, watermarks
from sagaline.kafka._config import ClientConfig, client_config
from sagaline.kafka._headers import readable_headers
from schemas.errors import CodecError, SchemaMismatch, UnknownFingerprint
from schemas.models import Record
from schemas.partitioning import partition_for
from schemas.signing import HeaderList, Signer
from schemas.wire import from_message


class TopicMissing(LookupError):
    """The topic does not exist: usually a wrong bootstrap or topic prefix."""


class TopicNotAuthorized(TopicMissing):
    """The broker will not describe the topic to this principal (no ACL on it), so
    whether it exists, and what it holds, is unknown. A :class:`TopicMissing` to the
    callers that only report it; catch it first where "missing" would mean "empty"."""


# A consumer's error events that say a broker connection dropped or is not up yet
# (a broker restarting, a leader moving): librdkafka reconnects and goes on fetching,
# so a reader waits for it instead of giving up. Any other error is raised.
_PASSING = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TIMED_OUT,
        KafkaError._RESOLVE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
    }
)


def _passing(err: KafkaError) -> bool:
    """``err`` is a dropped connection the consumer recovers from by itself."""
    return not err.fatal() and err.code() in _PASSING


def _reader(config: ClientConfig, group_id: str | None = None) -> Consumer:
    group = group_id or f"sagaline-reader-{uuid.uuid4().hex[:8]}"
    return create_consumer(config, group, **{"enable.partition.eof": True})


def partition_count(consumer: Consumer, topic: str) -> int:
    """Partitions of ``topic``; :class:`TopicMissing` when it does not exist,
    :class:`TopicNotAuthorized` when the broker will not say."""
    meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
    error = None if meta is None else meta.error
    if error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        raise TopicNotAuthorized(
            f"not authorized to describe topic {topic!r}: grant this principal Read on"
            " it (docs/security.md)"
        )
    if meta is None or meta.error is not None or not meta.partitions:
        raise TopicMissing(
            f"topic {topic!r} does not exist on this broker: check KAFKA_BOOTSTRAP_SERVERS "
            "and SAGALINE_TOPIC_PREFIX, or create the topics (sagaline coordinator run does)"
        )
    return len(meta.partitions)


def read_to_end(
    bootstrap: str | ClientConfig,
    topic: str,
    partitions: list[int],
    group_id: str = "sagaline-reader",
    *,
    start: dict[int, int] | None = None,
) -> Iterator[Message]:
    """Yield the committed messages of ``partitions`` of ``topic`` from the start (or
    from ``start[partition]``) up to their end as of now, then stop. The one reader
    behind state restore, the ledger tools and ``saga show``: no commits.

    "As of now" is each partition's end offset when the call starts: records written
    while it reads are not yielded, so a caller that writes back to the topic it reads
    (the drill re-producing a saga's records) cannot chase its own writes.

    A dropped broker connection (librdkafka's ``_TRANSPORT``, ``_ALL_BROKERS_DOWN``
    error events) is waited out, as the consumer reconnects by itself; any other
    consumer error is raised as ``KafkaException``."""
    consumer = _reader(client_config(bootstrap), group_id)
    try:
        begin = start or {}
        end: dict[int, int] = {}
        for n in partitions:
            low, high = watermarks(consumer, TopicPartition(topic, n))
            if high > max(begin.get(n, 0), low):
                end[n] = high
        if not end:
            return
        consumer.assign([TopicPartition(topic, n, begin.get(n, OFFSET_BEGINNING)) for n in end])
        while end:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            n = msg.partition() or 0
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    end.pop(n, None)
                    continue
                if _passing(err):
                    continue
                raise KafkaException(err)
            offset = msg.offset() or 0
            if n not in end or offset >= end[n]:
                end.pop(n, None)  # written after the call started
                continue
            yield msg
            if offset >= end[n] - 1:
                end.pop(n)
    finally:
        consumer.close()


class LedgerReader:
    """Reads topics up to their current end.

    Example::

        reader = LedgerReader(bootstrap)
        records = reader.saga_records(topics.events, "saga-1", signer)
        since = reader.offsets_for_time(topics.events, one_hour_ago_ms)
        for msg in reader.read(topics.events, start=since): ...
    """

    def __init__(self, bootstrap: str | ClientConfig) -> None:
        self.config = client_config(bootstrap)

    def partition_count(self, topic: str) -> int:
        consumer = _reader(self.config)
        try:
            return partition_count(consumer, topic)
        finally:
            consumer.close()

    def end_offsets(self, topic: str) -> dict[int, int]:
        """The next offset to be written, per partition: "now", for a listener."""
        consumer = _reader(self.config)
        try:
            count = partition_count(consumer, topic)
            return {n: watermarks(consumer, TopicPartition(topic, n))[1] for n in range(count)}
        finally:
            consumer.close()

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        """Per partition, the first offset whose record is at or after ``timestamp_ms``
        (the partition's end when none is): seek by time."""
        consumer = _reader(self.config)
        try:
            count = partition_count(consumer, topic)
            found = consumer.offsets_for_times(
                [TopicPartition(topic, n, timestamp_ms) for n in range(count)], timeout=30
            )
            out: dict[int, int] = {}
            for tp in found:
                if tp.offset < 0:  # no record that late: start at the end
                    tp.offset = watermarks(consumer, TopicPartition(topic, tp.partition))[1]
                out[tp.partition] = tp.offset
            return out
        finally:
            consumer.close()

    def read(
        self,
        topic: str,
        partitions: list[int] | None = None,
        *,
        start: dict[int, int] | None = None,
    ) -> Iterator[Message]:
        """Messages of ``partitions`` (all when None) from the start, or from the
        offsets in ``start`` (seek by offset; see :meth:`offsets_for_time`), to now."""
        if partitions is None:
            partitions = sorted(start) if start else list(range(self.partition_count(topic)))
        group = f"sagaline-reader-{uuid.uuid4().hex[:8]}"
        yield from read_to_end(self.config, topic, partitions, group, start=start)

    def message_at(
        self, topic: str, partition: int, offset: int, timeout_s: float = 30.0
    ) -> Message | None:
        """The committed message at ``offset`` of ``partition``, or None when it is
        gone (retention) or is not a record (an aborted write or a transaction
        marker). One point read, behind ledger references (``schemas.LedgerRef``)."""
        consumer = _reader(self.config)
        try:
            low, high = watermarks(consumer, TopicPartition(topic, partition))
            if not low <= offset < high:
                return None
            consumer.assign([TopicPartition(topic, partition, offset)])
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                msg = consumer.poll(1.0)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return None
                    if _passing(err):
                        continue
                    raise KafkaException(err)
                # read_committed skips aborted records: the first one read is the one
                # asked for only if the offsets agree.
                return msg if msg.offset() == offset else None
            raise TimeoutError(f"no answer reading {topic}[{partition}]@{offset} in {timeout_s} s")
        finally:
            consumer.close()

    def records(
        self, topic: str, partitions: list[int] | None = None
    ) -> Iterator[tuple[bytes | None, bytes | None, HeaderList | None]]:
        """(key, value, headers) of every committed message, from the start to now."""
        for msg in self.read(topic, partitions):
            # Headers that cannot be read (a name not UTF-8) as none: no signature.
            yield msg.key(), msg.value(), readable_headers(msg)

    def saga_records(
        self,
        topic: str,
        saga_id: str,
        signer: Signer,
        *,
        unreadable: list[str] | None = None,
    ) -> list[Record]:
        """Every decodable record of one saga on ``topic``, in log order.

        ``unreadable``, given, gets a line for each record of the saga written under a
        schema this version cannot read (``unknown-fingerprint``, ``schema-mismatch``:
        a newer writer, which reads it itself, so it is in no DLQ): what the records
        returned lack."""
        key = saga_id.encode()
        partition = partition_for(key, self.partition_count(topic))
        out: list[Record] = []
        for msg in self.read(topic, [partition]):
            k, value = msg.key(), msg.value()
            if k != key or value is None:
                continue
            try:
                out.append(from_message(k, value, readable_headers(msg), signer))
            except (UnknownFingerprint, SchemaMismatch) as exc:
                if unreadable is not None:
                    unreadable.append(
                        f"{topic}[{msg.partition()}]@{msg.offset()} (schema "
                        f"{bytes(value[2:10]).hex()}): {exc.reason}"
                    )
            except CodecError:
                continue  # the coordinator has already sent it to the DLQ
        return out

    def latest_by_key(self, topic: str, signer: Signer) -> dict[str, Record]:
        """The latest decodable record per key of a compacted topic (e.g. terminal); a
        key that is not UTF-8 (no saga's) is passed over."""
        latest: dict[str, Record] = {}
        for k, value, headers in self.records(topic):
            if k is None:
                continue
            try:
                key = k.decode()
            except UnicodeDecodeError:
                continue  # no saga's key (hand-written or corrupted): no record of one
            if value is None:
                latest.pop(key, None)
                continue
            try:
                latest[key] = from_message(k, value, headers, signer)
            except CodecError:
                continue
        return latest
