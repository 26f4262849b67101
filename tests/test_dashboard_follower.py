"""The dashboard's ledger follower rides out a partition whose leader is not known yet.

CI saw it: right after the topics were created, ``get_watermark_offsets`` answered
NOT_LEADER_FOR_PARTITION, the follower thread stopped for good and the page never
showed a record. A stand-in consumer (no broker) raises that once for one partition.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from confluent_kafka import OFFSET_INVALID, KafkaError, KafkaException, TopicPartition

from schemas.signing import Signer
from schemas.topics import TopicNames
from services.dashboard.consumer import LedgerFollower
from services.dashboard.view import DashboardState

TOPICS = TopicNames("t.")


class LeaderlessOnce:
    """Three topics of two partitions; the events topic's partition 1 has no known
    leader the first time its watermarks are asked for."""

    def __init__(self) -> None:
        self.assigned: list[tuple[str, int]] = []
        self.failed = False
        self.high = 7

    def list_topics(self, timeout: float) -> Any:
        names = (TOPICS.events, TOPICS.terminal, TOPICS.incidents)
        topic = SimpleNamespace(error=None, partitions={0: None, 1: None})
        return SimpleNamespace(topics=dict.fromkeys(names, topic))

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        if (tp.topic, tp.partition) == (TOPICS.events, 1) and not self.failed:
            self.failed = True
            raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
        return 0, self.high

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.assigned += [(tp.topic, tp.partition) for tp in tps]

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, 0) for tp in tps]


def test_a_partition_without_a_leader_is_followed_at_the_next_refresh() -> None:
    follower = LedgerFollower("unused:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = LeaderlessOnce()

    follower._refresh(consumer)  # type: ignore[arg-type]
    assert consumer.failed
    assert (TOPICS.events, 1) not in consumer.assigned and len(consumer.assigned) == 5
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert not follower.caught_up.is_set()  # a partition of the start is still unread

    consumer.high = 9
    follower._refresh(consumer)  # type: ignore[arg-type]
    assert sorted(consumer.assigned) == sorted(
        (t, p) for t in (TOPICS.events, TOPICS.terminal, TOPICS.incidents) for p in (0, 1)
    )
    # Its target is what it held when it could first be read.
    assert follower._targets[(TOPICS.events, 1)] == 9
    assert follower._targets[(TOPICS.events, 0)] == 7


class RetentionEmptied:
    """One partition (of the incidents topic) whose every record the broker has
    deleted (retention): watermarks (3, 3). librdkafka then never reports a position
    for it (OFFSET_INVALID: nothing was consumed), as it does for a real broker after
    ``delete_records`` up to the end. The other partitions hold nothing."""

    def list_topics(self, timeout: float) -> Any:
        names = (TOPICS.events, TOPICS.terminal, TOPICS.incidents)
        topic = SimpleNamespace(error=None, partitions={0: None})
        return SimpleNamespace(topics=dict.fromkeys(names, topic))

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return (3, 3) if tp.topic == TOPICS.incidents else (0, 0)

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        pass

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, OFFSET_INVALID) for tp in tps]


def test_a_partition_whose_records_all_expired_does_not_hold_back_caught_up() -> None:
    """A quiet partition of sagaline.incidents (90 days' retention) ends up empty but
    with a high watermark above 0: there is nothing to read, so the dashboard is caught
    up (it was not: /healthz answered 503 for good)."""
    follower = LedgerFollower("unused:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = RetentionEmptied()

    follower._refresh(consumer)  # type: ignore[arg-type]
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert follower.caught_up.is_set()
