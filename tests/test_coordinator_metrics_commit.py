"""The coordinator's metrics count what its transactions committed, once: a batch
whose transaction failed (aborted, rewound and decided again) or that a rebalance
moved to another owner before it committed is counted by whoever commits it, not
also by the attempt that did not. Counters summed over the coordinators (records
processed and emitted, DLQ records, duplicates prevented) and the measures folded
from the records (terminal sagas, interventions, recoveries) would otherwise count
a batch once per attempt. Run on both transports."""

from __future__ import annotations

from collections import Counter
from typing import Any

from coordinator.core import Destination, Output
from coordinator.shell import Coordinator
from sagaline.kafka import KafkaError, KafkaException, Producer, create_producer
from sagaline.ops.metrics import CoordinatorMetrics
from schemas import Record
from tests.coordinator_turns import append, executes, one_saga, turn_until
from tests.test_coordinator_carry import _committed


class _Recorder:
    """A ``ShellMetrics`` that remembers every call."""

    def __init__(self) -> None:
        self.records: Counter[str] = Counter()
        self.outputs: Counter[str] = Counter()
        self.duplicates = 0
        self.dlqs: Counter[str] = Counter()
        self.commits = 0

    def observe_record(self, record: Record) -> None:
        self.records[record.event_id] += 1

    def observe_output(self, output: Output) -> None:
        assert output.destination is not Destination.REJECTED
        self.outputs[output.record.event_id] += 1

    def duplicate_prevented(self, count: int = 1) -> None:
        self.duplicates += count

    def dlq(self, reason: str) -> None:
        self.dlqs[reason] += 1

    def transaction_committed(self, seconds: float, records: int) -> None:
        self.commits += 1

    def in_flight(self, sagas: int) -> None:
        pass


class _FirstCommitFails:
    """A producer whose first commit fails with an error that aborts the transaction."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def commit_transaction(self, timeout: float) -> None:
        if self.failed == 0:
            self.failed += 1
            raise KafkaException(
                KafkaError(KafkaError._FAIL, "the broker aborted it", txn_requires_abort=True)
            )
        self._producer.commit_transaction(timeout)


def test_a_batch_whose_transaction_failed_is_counted_once_when_it_commits(
    transport: str, unique_prefix: str
) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, "saga-counted")
    started = ledger.started()
    append(settings, transport, started, first, first)  # the second one: a duplicate
    producer = create_producer(transport)
    producer.produce(settings.topics.events, key=b"saga-junk", value=b"not a record")
    assert producer.flush(30) == 0

    metrics = _Recorder()
    one = Coordinator(
        settings, transport, instance_id="counted-1", carry_ms=0, linger_ms=0, metrics=metrics
    )
    one._join()
    failing = _FirstCommitFails(one._producer)
    one._producer = failing  # type: ignore[assignment]
    group = f"{unique_prefix}sagaline-coordinator"

    def all_committed() -> bool:
        if one._carry is not None or _committed(settings, transport, group) < 4:
            return False
        one._settle()
        return not one._rewind

    turn_until(one, all_committed)
    one._consumer.close()
    assert failing.failed == 1, "no commit failed"
    assert executes(settings, transport, participant) == ["reserve"]
    # Each record (the step twice: it came twice), output, DLQ copy and duplicate
    # once: as committed.
    assert dict(metrics.records) == {started.event_id: 1, first.event_id: 2}
    assert set(metrics.outputs.values()) == {1}
    assert sum(metrics.dlqs.values()) == 1, metrics.dlqs
    assert metrics.duplicates == 1


def _in_flight(metrics: CoordinatorMetrics) -> float | None:
    return metrics.registry.get_sample_value(
        "sagaline_sagas_in_flight", {"component": "coordinator"}
    )


def test_sagas_in_flight_follows_the_partitions_a_rebalance_takes_and_gives(
    transport: str, unique_prefix: str
) -> None:
    """``sagaline_sagas_in_flight`` is what this instance holds: a revoke that takes
    its partitions takes their sagas off the gauge, and an assignment that restores
    sagas puts them on it, before any batch commits (an instance whose partitions went
    elsewhere commits no batch again, and summed over the group it counted them twice)."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-gauge")
    append(settings, transport, ledger.started(), first)
    group = f"{unique_prefix}sagaline-coordinator"

    before = CoordinatorMetrics()
    one = Coordinator(
        settings, transport, instance_id="gauge-1", carry_ms=0, linger_ms=0, metrics=before
    )
    one._join()

    def committed() -> bool:
        if one._carry is not None or _committed(settings, transport, group) < 2:
            return False
        one._settle()
        return not one._rewind

    turn_until(one, committed)
    assert _in_flight(before) == 1
    one._consumer.close()  # serves the revoke: the partition (and its saga) goes
    assert _in_flight(before) == 0

    after = CoordinatorMetrics()
    two = Coordinator(
        settings, transport, instance_id="gauge-2", carry_ms=0, linger_ms=0, metrics=after
    )
    two._join()
    try:
        turn_until(two, lambda: two._assigned == {0})  # assigned and restored, nothing new read
        assert two.in_flight == 1
        assert _in_flight(after) == 1
    finally:
        two._consumer.close()
