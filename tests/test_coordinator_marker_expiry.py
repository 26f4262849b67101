"""Terminal markers are tombstoned once ``limits.terminal_memory_ms`` has passed since
their saga ended, whatever order the coordinator came to know them in: partitions
assigned one after another (a cooperative rebalance hands over only the partitions
that move) restore older markers behind newer ones. Run on both transports."""

from __future__ import annotations

import time

from coordinator.shell import Coordinator
from coordinator.state import MarkerKind, SagaMarker
from sagaline.kafka import TopicPartition, create_producer, ensure_topics
from schemas.settings import Settings

DAY_MS = 24 * 3600 * 1000


def test_an_old_marker_restored_behind_a_newer_one_is_still_tombstoned_in_time(
    transport: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix, partitions=2)
    ensure_topics(transport, settings.topics, [], settings.partitions)
    now = int(time.time() * 1000)
    memory = settings.limits.terminal_memory_ms
    fresh = SagaMarker(marker=MarkerKind.TERMINAL, saga_id="fresh", status="COMPLETED", at=now)
    old = SagaMarker(
        marker=MarkerKind.TERMINAL, saga_id="old", status="COMPLETED", at=now - memory - DAY_MS
    )
    producer = create_producer(transport)
    for partition, marker in ((0, fresh), (1, old)):
        producer.produce(
            settings.topics.state,
            key=marker.saga_id.encode(),
            value=marker.to_bytes(),
            partition=partition,
        )
    assert producer.flush(30) == 0

    one = Coordinator(settings, transport, instance_id="expiry-1", clock=lambda: now)
    try:
        # Partition 0 first, then partition 1 (as a cooperative rebalance assigns them).
        events = settings.topics.events
        one._on_assign(one._consumer, [TopicPartition(events, 0)])
        one._on_assign(one._consumer, [TopicPartition(events, 1)])
        assert one.marker_of("old") == old and one.marker_of("fresh") == fresh
        assert one._expired_markers(now) == ["old"]
        # ... and its tombstone goes to the changelog partition it was restored from.
        assert one._partition_of["old"] == 1
    finally:
        one._consumer.close()
