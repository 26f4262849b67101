"""A record the coordinator fetched before a rebalance is decided only by its
partition's owner after it. ``_next_batch`` takes the first record with ``poll()``
and the rest with ``consume()``; a rebalance that ``consume()`` serves revokes the
first record's partition (its sagas dropped) and may give it to another instance,
which reads the record from the committed offset. Deciding it here as well would
write outputs and a changelog record for a saga this instance no longer owns, from
a state it no longer holds.

In-process transport only: the other member must join between the ``poll()`` and the
``consume()`` right after it, which only a transport served in this thread makes
certain without waiting on a broker's rebalance."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from coordinator_ledger import Ledger

import coordinator.shell as shell
from coordinator.shell import Coordinator
from sagaline.kafka import create_consumer, ensure_topics
from schemas.partitioning import partition_for
from schemas.settings import Settings
from tests.coordinator_turns import append, executes, turn_until
from tests.test_coordinator_carry import _changelog


def _saga_on(partition: int, partitions: int) -> str:
    """A saga id whose records land on ``partition`` (murmur2, as producers place them)."""
    return next(
        saga_id
        for n in range(1000)
        if partition_for((saga_id := f"saga-moved-{n}").encode(), partitions) == partition
    )


def test_a_record_fetched_before_its_partition_was_revoked_is_left_to_the_new_owner_R15(
    unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=bootstrap, topic_prefix=unique_prefix, partitions=2)
    saga_id = _saga_on(1, 2)  # partition 1: the other member's once it joins (round-robin)
    ledger = Ledger(saga_id=saga_id)
    first = ledger.scheduled("reserve")
    participant = first.contract.participant
    ensure_topics(bootstrap, settings.topics, [participant], settings.partitions)
    other = create_consumer(bootstrap, f"{unique_prefix}sagaline-coordinator")
    joined: list[bool] = []

    class JoinedWhilePolling:
        """The coordinator's consumer; the other member joins right after the first
        poll() that returns a record, so the consume() after it serves the rebalance."""

        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

        def poll(self, timeout: float = -1) -> Any:
            msg = self._consumer.poll(timeout)
            if msg is not None and not joined:
                other.subscribe([settings.topics.events])
                joined.append(True)
            return msg

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return JoinedWhilePolling(create_consumer(*args, **kwargs))

    monkeypatch.setattr(shell, "create_consumer", wrapped)
    one = Coordinator(settings, bootstrap, instance_id="moved-1", carry_ms=0, linger_ms=0)
    one._join()
    append(settings, bootstrap, ledger.started(), first)

    turn_until(one, lambda: bool(joined))  # the turn that polled, rebalanced and decided
    one._settle()  # whatever that turn committed is written
    assert one._assigned == {0}
    assert _changelog(settings, bootstrap, saga_id) == 0, "a saga of a revoked partition"
    assert executes(settings, bootstrap, participant) == []
    assert one.state_of(saga_id) is None
    one._consumer.close()

    moved = other.poll(30)  # the partition's owner reads it, from the committed offset
    assert moved is not None and (moved.partition(), moved.offset()) == (1, 0)
    other.close()
