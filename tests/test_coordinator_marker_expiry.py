"""Terminal markers are tombstoned once ``limits.terminal_memory_ms`` has passed since
their saga ended, whatever order the coordinator came to know them in: partitions
assigned one after another (a cooperative rebalance hands over only the partitions
that move) restore older markers behind newer ones. Run on both transports."""

from __future__ import annotations

import time
from typing import Any

import pytest

import coordinator.shell as shell
from coordinator.shell import Coordinator
from coordinator.state import MarkerKind, SagaMarker, load_changelog
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


PARKED = 500


def test_finding_expired_markers_does_not_walk_past_every_parked_saga(
    transport: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parked markers never expire. Kept among the terminal ones (which expiry reads
    from the front, oldest first), every batch walked past all of them: a cost per
    batch that grows with the number of parked sagas. Counted here as the parked
    markers each search reads; the terminal marker behind them is still tombstoned."""
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(transport, settings.topics, [], settings.partitions)
    now = int(time.time() * 1000)
    memory = settings.limits.terminal_memory_ms
    producer = create_producer(transport)
    for n in range(PARKED):  # parked long ago: in front of every terminal marker
        parked = SagaMarker(
            marker=MarkerKind.PARKED, saga_id=f"parked-{n}", status="PARKED", at=1_000 + n
        )
        producer.produce(
            settings.topics.state, key=parked.saga_id.encode(), value=parked.to_bytes()
        )
    old = SagaMarker(
        marker=MarkerKind.TERMINAL, saga_id="old", status="COMPLETED", at=now - memory - DAY_MS
    )
    producer.produce(settings.topics.state, key=b"old", value=old.to_bytes())
    assert producer.flush(30) == 0

    read: list[str] = []

    class _Counted(SagaMarker):
        def __getattribute__(self, name: str) -> Any:
            if name != "__dict__" and not name.startswith("__pydantic"):
                saga_id = object.__getattribute__(self, "__dict__").get("saga_id", "")
                if saga_id.startswith("parked-"):
                    read.append(saga_id)
            return super().__getattribute__(name)

    def counted(value: bytes) -> Any:
        restored = load_changelog(value)
        if isinstance(restored, SagaMarker):
            return _Counted.model_validate(restored.model_dump())
        return restored

    monkeypatch.setattr(shell, "load_changelog", counted)
    one = Coordinator(settings, transport, instance_id="expiry-2", clock=lambda: now)
    try:
        one._on_assign(one._consumer, [TopicPartition(settings.topics.events, 0)])
        assert one.marker_of("parked-7") is not None
        read.clear()
        assert one._expired_markers(now) == ["old"]
        assert read == [], f"{len(set(read))} parked markers read to find one expired"
    finally:
        one._consumer.close()
