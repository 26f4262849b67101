"""Read the ledger: one saga's records, or a whole compacted topic, up to its end now.

Operators' tools (CLI, dashboard actions) need "what does the log say about saga X"
without joining a consumer group. A saga's records all live on one partition
(murmur2 of its id), so only that partition is read.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from confluent_kafka import Consumer

from schemas.errors import CodecError
from schemas.models import Record
from schemas.partitioning import partition_for
from schemas.signing import HeaderList, Signer
from schemas.wire import consumer_config, from_message, read_to_end


class TopicMissing(LookupError):
    """The topic does not exist: usually a wrong bootstrap or topic prefix."""


def _reader(bootstrap: str) -> Consumer:
    return Consumer(
        consumer_config(
            bootstrap, f"sagaline-reader-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": True}
        )
    )


def partition_count(consumer: Consumer, topic: str) -> int:
    meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise TopicMissing(
            f"topic {topic!r} does not exist on this broker: check KAFKA_BOOTSTRAP_SERVERS "
            "and SAGALINE_TOPIC_PREFIX, or create the topics (sagaline coordinator run does)"
        )
    return len(meta.partitions)


def read_partitions(
    bootstrap: str, topic: str, partitions: list[int] | None = None
) -> Iterator[tuple[bytes | None, bytes | None, HeaderList | None]]:
    """Yield (key, value, headers) of committed records from the start to the current
    end of the given partitions (all of them when None)."""
    if partitions is None:
        consumer = _reader(bootstrap)
        try:
            partitions = list(range(partition_count(consumer, topic)))
        finally:
            consumer.close()
    group = f"sagaline-reader-{uuid.uuid4().hex[:8]}"
    for msg in read_to_end(bootstrap, topic, partitions, group):
        yield msg.key(), msg.value(), msg.headers()


def saga_records(bootstrap: str, topic: str, saga_id: str, signer: Signer) -> list[Record]:
    """Every decodable record of one saga on ``topic``, in log order."""
    consumer = _reader(bootstrap)
    try:
        count = partition_count(consumer, topic)
    finally:
        consumer.close()
    key = saga_id.encode()
    out: list[Record] = []
    for k, value, headers in read_partitions(bootstrap, topic, [partition_for(key, count)]):
        if k != key or value is None:
            continue
        try:
            out.append(from_message(k, value, headers, signer))
        except CodecError:
            continue  # the coordinator has already sent it to the DLQ
    return out


def latest_by_key(bootstrap: str, topic: str, signer: Signer) -> dict[str, Record]:
    """The latest decodable record per key of a compacted topic (e.g. terminal)."""
    latest: dict[str, Record] = {}
    for k, value, headers in read_partitions(bootstrap, topic):
        if k is None:
            continue
        if value is None:
            latest.pop(k.decode(), None)
            continue
        try:
            latest[k.decode()] = from_message(k, value, headers, signer)
        except CodecError:
            continue
    return latest
