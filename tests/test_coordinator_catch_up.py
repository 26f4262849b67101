"""A partition's new owner fires no timer of its sagas before it has read the
partition's backlog: the ledger may already hold the record that beats the deadline.

The coordinator was down (or the partition moved) past a saga's deadline while the
record that settles it in time (a ``CompensationCommitted`` dated within the
completion wait) was written. The new owner restored the saga's timer and fired it
with its first batch, before that record was read: the step failed
``compensation-not-completed`` and the saga ended ESCALATED, although the ledger says
COMPENSATED. The same without a rebalance: a coordinator that keeps its partition
through a stall reads that record after the deadline came due; its due timer now waits
while the partition has records unread, for at most ``LAG_HOLD_MS``. Run on both
transports."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import pytest
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message
from coordinator_ledger import Ledger

from coordinator.shell import LAG_HOLD_MS, Coordinator
from coordinator.state import SagaMarker, SagaStatus, StepStatus
from sagaline.kafka import TopicPartition, create_consumer, ensure_topics, watermarks
from schemas import FailureKind, StepScheduled
from schemas.settings import Settings
from tests.coordinator_turns import append, turn_until
from tests.system import wait_until

WAIT_MS = 5_000


def _clock_ahead(ms: int) -> int:
    return int(time.time() * 1000) + ms


def _coordinator(
    settings: Settings, transport: str, instance_id: str, clock: Callable[[], int]
) -> Coordinator:
    """A coordinator that reads one record a batch and carries nothing over, joined."""
    coordinator = Coordinator(
        settings,
        transport,
        instance_id=instance_id,
        clock=clock,
        batch_size=1,
        carry_ms=0,
        linger_ms=0,
    )
    coordinator._join()
    return coordinator


def _marker(coordinator: Coordinator, saga_id: str) -> SagaMarker:
    """Turn the loop until the coordinator has ended (or parked) ``saga_id``."""
    turn_until(coordinator, lambda: coordinator.marker_of(saga_id) is not None)
    marker = coordinator.marker_of(saga_id)
    assert marker is not None
    return marker


def _append_accepted(
    settings: Settings, transport: str, ledger: Ledger, refund: StepScheduled
) -> None:
    """Append a saga whose ``refund`` committed, then, a later step rejected, whose
    compensation was accepted: its completion deadline is running."""
    append(
        settings,
        transport,
        ledger.started(),
        refund,
        ledger.committed("refund"),
        ledger.scheduled("boom"),
        ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION),
        ledger.comp_accepted("refund"),
    )


def _accepted(coordinator: Coordinator, saga_id: str) -> bool:
    """The coordinator holds ``saga_id``'s refund as accepted, not completed yet."""
    state = coordinator.state_of(saga_id)
    return state is not None and state.steps["refund"].status is StepStatus.COMPENSATION_ACCEPTED


def _restarted_past_the_deadline(
    transport: str, unique_prefix: str, completed: bool
) -> tuple[str, str]:
    """The saga's end (status, reason) as a coordinator restarted past its
    completion deadline decides it, the completion in its backlog or not."""
    settings, ledger, one = _accepted_and_waiting(
        transport, unique_prefix, _Clock(), saga_id="saga-late", instance_id="catch-up"
    )
    one._consumer.close()

    # While no coordinator runs, the completion is recorded within the wait (and some
    # other saga's record lands before it); the coordinator comes back after the
    # deadline, the backlog unread.
    if completed:
        other = Ledger(saga_id="saga-other", t0=ledger.clock)
        append(settings, transport, other.started(), ledger.comp_committed("refund"))
    two = _coordinator(settings, transport, "catch-up", lambda: _clock_ahead(10 * WAIT_MS))
    try:
        marker = _marker(two, "saga-late")
    finally:
        two._consumer.close()
    return marker.status, marker.reason


def test_a_completion_in_the_backlog_beats_a_deadline_that_passed_while_down_R12(
    transport: str, unique_prefix: str
) -> None:
    status, reason = _restarted_past_the_deadline(transport, unique_prefix, completed=True)
    assert status == SagaStatus.COMPENSATED.value, reason


def test_once_the_backlog_is_read_the_overdue_deadline_fires_R12(
    transport: str, unique_prefix: str
) -> None:
    """No completion anywhere, and no record after the last one the previous owner
    read (at most its own echoes and transaction markers, which the consumer passes
    without a record): the partition counts as caught up and the deadline fires as
    before."""
    status, reason = _restarted_past_the_deadline(transport, unique_prefix, completed=False)
    assert status == SagaStatus.ESCALATED.value, reason


# ------------------------------------------------------------ lag without a rebalance


class _Clock:
    """The coordinator's clock, moved by the test (real time until then)."""

    def __init__(self) -> None:
        self.ahead_ms = 0

    def __call__(self) -> int:
        return _clock_ahead(self.ahead_ms)


def _accepted_and_waiting(
    transport: str,
    unique_prefix: str,
    clock: _Clock,
    saga_id: str = "saga-lag",
    instance_id: str = "lag",
) -> tuple[Settings, Ledger, Coordinator]:
    """A coordinator that keeps its partition, having decided ``saga_id`` up to its
    refund's ``CompensationAccepted`` (a completion deadline WAIT_MS away), and
    every record it wrote since then read: nothing left behind on the partition."""
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix, partitions=1)
    ledger = Ledger(saga_id=saga_id, t0=int(time.time() * 1000))
    refund = ledger.scheduled("refund", completion_within_ms=WAIT_MS)
    ensure_topics(transport, settings.topics, [refund.contract.participant], 1)
    one = _coordinator(settings, transport, instance_id, clock)
    _append_accepted(settings, transport, ledger, refund)
    turn_until(one, lambda: one._committing is None and _accepted(one, saga_id))
    return settings, ledger, one


def _fetched(transport: str, settings: Settings, coordinator: Coordinator) -> int:
    """Wait until the coordinator's consumer has fetched (not yet returned) what the
    partition holds now, as its first fetch after a broker outage would have; the
    partition's end then."""
    tp = TopicPartition(settings.topics.events, 0)
    probe = create_consumer(transport, f"{settings.topic_prefix}probe")
    try:
        end = watermarks(probe, tp)[1]
    finally:
        probe.close()
    wait_until(
        lambda: coordinator._consumer.get_watermark_offsets(tp, cached=True)[1] >= end,
        what="the consumer's fetch of the backlog",
    )
    return end


def test_a_completion_read_after_an_outage_beats_the_deadline_that_passed_R12(
    transport: str, unique_prefix: str
) -> None:
    """No rebalance: the coordinator keeps its partition through a broker outage (it
    reads nothing meanwhile), and the completion, recorded within the wait, is in the
    backlog it reads when the broker is back, past the deadline. Its first batch fired
    the overdue deadline before that record: ESCALATED, although the ledger says
    COMPENSATED. Now the due timer waits while the partition has records unread."""
    clock = _Clock()
    settings, ledger, one = _accepted_and_waiting(transport, unique_prefix, clock)
    try:
        other = Ledger(saga_id="saga-other", t0=ledger.clock)
        append(settings, transport, other.started(), ledger.comp_committed("refund"))
        _fetched(transport, settings, one)
        clock.ahead_ms = 10 * WAIT_MS
        marker = _marker(one, "saga-lag")
    finally:
        one._consumer.close()
    assert marker.status == SagaStatus.COMPENSATED.value, marker.reason


def test_a_due_deadline_fires_at_once_with_nothing_unread_R12(
    transport: str, unique_prefix: str
) -> None:
    """Caught up (the coordinator's own records and transaction markers read), a due
    timer is not held: the deadline fires before the hold's bound could pass."""
    clock = _Clock()
    _settings, _ledger, one = _accepted_and_waiting(transport, unique_prefix, clock)
    try:
        clock.ahead_ms = 2 * WAIT_MS  # past the deadline; far from LAG_HOLD_MS
        assert 2 * WAIT_MS < LAG_HOLD_MS
        marker = _marker(one, "saga-lag")
    finally:
        one._consumer.close()
    assert marker.status == SagaStatus.ESCALATED.value, marker.reason


def test_a_backlog_holds_a_due_deadline_at_most_lag_hold_ms_R12(
    transport: str, unique_prefix: str
) -> None:
    """An overloaded coordinator, always behind: the deadline is held while records
    are unread, but fires LAG_HOLD_MS after it was first held, backlog or not."""
    clock = _Clock()
    settings, ledger, one = _accepted_and_waiting(transport, unique_prefix, clock)
    tp = TopicPartition(settings.topics.events, 0)
    try:
        others = [Ledger(saga_id=f"saga-busy-{i}", t0=ledger.clock) for i in range(30)]
        append(settings, transport, *(o.started() for o in others))
        backlog_end = _fetched(transport, settings, one)
        clock.ahead_ms = 2 * WAIT_MS
        one._process_batch(one._next_batch())  # one record read, the deadline held
        one._process_batch(one._next_batch())
        assert one.marker_of("saga-lag") is None
        clock.ahead_ms = 2 * WAIT_MS + LAG_HOLD_MS
        marker = _marker(one, "saga-lag")
        (position,) = one._consumer.position([tp])
    finally:
        one._consumer.close()
    assert marker.status == SagaStatus.ESCALATED.value, marker.reason
    assert position.offset < backlog_end  # fired with the backlog not yet read


def test_a_held_deadline_waits_for_what_was_unread_not_for_what_came_since_R12(
    transport: str, unique_prefix: str
) -> None:
    """Under steady load a coordinator is never caught up: a due timer held for its
    partition's lag waits for the records unread when its hold began, then fires,
    though newer records are still unread. Held until the partition was caught up,
    every due timer (a retry's backoff too) waited LAG_HOLD_MS under load."""
    clock = _Clock()
    settings, ledger, one = _accepted_and_waiting(transport, unique_prefix, clock)
    tp = TopicPartition(settings.topics.events, 0)
    try:
        first = [Ledger(saga_id=f"saga-first-{i}", t0=ledger.clock) for i in range(10)]
        append(settings, transport, *(o.started() for o in first))
        _fetched(transport, settings, one)
        clock.ahead_ms = 2 * WAIT_MS  # due; far from LAG_HOLD_MS
        assert 2 * WAIT_MS < LAG_HOLD_MS
        one._process_batch(one._next_batch())  # one record read, the deadline held
        assert one.marker_of("saga-lag") is None
        then = [Ledger(saga_id=f"saga-then-{i}", t0=ledger.clock) for i in range(30)]
        append(settings, transport, *(o.started() for o in then))
        end = _fetched(transport, settings, one)
        marker = _marker(one, "saga-lag")
        (position,) = one._consumer.position([tp])
    finally:
        one._consumer.close()
    assert marker.status == SagaStatus.ESCALATED.value, marker.reason
    assert position.offset < end  # fired with the later records not yet read


def test_a_deadline_due_during_another_hold_waits_for_what_was_unread_when_it_came_due_R12(
    transport: str, unique_prefix: str
) -> None:
    """A timer comes due while the partition is already held for an earlier one: it
    waits for what is unread when it comes due, not only for the end noted at the
    earlier hold. It waited only for that older end, so it fired before a completion
    written after that end but within its own wait: ESCALATED, although the ledger
    says COMPENSATED."""
    clock = _Clock()
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix, partitions=1)
    early = Ledger(saga_id="saga-early", t0=int(time.time() * 1000))
    late = Ledger(saga_id="saga-late", t0=early.clock)
    early_refund = early.scheduled("refund", completion_within_ms=WAIT_MS)
    late_refund = late.scheduled("refund", completion_within_ms=3 * WAIT_MS)
    ensure_topics(transport, settings.topics, [early_refund.contract.participant], 1)
    one = _coordinator(settings, transport, "lag-two", clock)
    try:
        _append_accepted(settings, transport, early, early_refund)
        _append_accepted(settings, transport, late, late_refund)
        turn_until(
            one,
            lambda: (
                one._committing is None
                and _accepted(one, "saga-early")
                and _accepted(one, "saga-late")
            ),
        )
        # Behind: the early deadline comes due and is held for what is unread now.
        first = [Ledger(saga_id=f"saga-first-{i}", t0=late.clock) for i in range(5)]
        append(settings, transport, *(o.started() for o in first))
        _fetched(transport, settings, one)
        clock.ahead_ms = 2 * WAIT_MS  # the early deadline due, the late one not
        one._process_batch(one._next_batch())
        assert one.marker_of("saga-early") is None
        # Still behind, more records come, the late saga's completion (within its
        # wait) among them but not first; then its deadline comes due too.
        then = [Ledger(saga_id=f"saga-then-{i}", t0=late.clock) for i in range(5)]
        append(settings, transport, *(o.started() for o in then), late.comp_committed("refund"))
        _fetched(transport, settings, one)
        clock.ahead_ms = 4 * WAIT_MS  # the late deadline due; within LAG_HOLD_MS of both
        assert 4 * WAIT_MS - 2 * WAIT_MS < LAG_HOLD_MS
        marker = _marker(one, "saga-late")
    finally:
        one._consumer.close()
    assert marker.status == SagaStatus.COMPENSATED.value, marker.reason


# ------------------------------------------------------- a cached watermark not fresh


class _StaleWatermark:
    """The coordinator's consumer as it is before its next fetch returns: librdkafka's
    cached high watermark is ``high`` (unknown, -1001, before the first fetch; where the
    consumer was before a broker outage), ``lost`` says it first reports a dropped
    broker connection, as it does when the broker goes away, and the broker does not
    answer the first ``unanswered`` asks for a partition's end (still away)."""

    def __init__(self, consumer: Consumer, high: int, lost: bool, unanswered: int) -> None:
        self._consumer = consumer
        self._high = high
        self._lost = lost
        self._unanswered = unanswered

    def get_watermark_offsets(
        self, tp: TopicPartition, timeout: float = 10, cached: bool = False
    ) -> tuple[int, int]:
        if cached:
            return self._high, self._high
        if self._unanswered > 0:
            self._unanswered -= 1
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        low, high = self._consumer.get_watermark_offsets(tp, timeout=timeout)
        return int(low), int(high)

    def poll(self, timeout: float = -1) -> Message | None:
        if self._lost:
            self._lost = False
            return Message(error=KafkaError(KafkaError._TRANSPORT, "broker: Disconnected"))
        return self._consumer.poll(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


@pytest.mark.parametrize(
    ("lost", "unanswered"),
    [(True, 0), (False, 0), (True, 2)],
    ids=["after-an-outage", "before-the-first-fetch", "broker-not-back-yet"],
)
def test_a_completion_not_yet_fetched_beats_a_deadline_due_meanwhile_R12(
    transport: str, unique_prefix: str, lost: bool, unanswered: int
) -> None:
    """The deadline comes due before the consumer's next fetch returned: after a broker
    outage (its cached high watermark is where it was before) or before its first fetch
    (no cached watermark). The cached watermark showed nothing unread, so the deadline
    fired before the completion (recorded within the wait) was read: ESCALATED,
    although the ledger says COMPENSATED. Now such a watermark is not trusted: the
    broker is asked for the partition's end, and until it answers the deadline is held."""
    clock = _Clock()
    settings, ledger, one = _accepted_and_waiting(transport, unique_prefix, clock)
    real = one._consumer
    try:
        tp = TopicPartition(settings.topics.events, 0)
        (position,) = real.position([tp])
        high = position.offset if lost else OFFSET_INVALID
        one._consumer = cast(Consumer, _StaleWatermark(real, high, lost, unanswered))
        other = Ledger(saga_id="saga-other", t0=ledger.clock)
        append(settings, transport, other.started(), ledger.comp_committed("refund"))
        clock.ahead_ms = 10 * WAIT_MS
        marker = _marker(one, "saga-lag")
    finally:
        real.close()
    assert marker.status == SagaStatus.COMPENSATED.value, marker.reason
