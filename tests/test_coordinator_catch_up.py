"""A partition's new owner fires no timer of its sagas before it has read the
partition's backlog: the ledger may already hold the record that beats the deadline.

The coordinator was down (or the partition moved) past a saga's deadline while the
record that settles it in time (a ``CompensationCommitted`` dated within the
completion wait) was written. The new owner restored the saga's timer and fired it
with its first batch, before that record was read: the step failed
``compensation-not-completed`` and the saga ended ESCALATED, although the ledger says
COMPENSATED. Run on both transports."""

from __future__ import annotations

import time

from coordinator_ledger import Ledger

from coordinator.shell import Coordinator
from coordinator.state import SagaStatus, StepStatus
from sagaline.kafka import ensure_topics
from schemas import FailureKind
from schemas.settings import Settings
from tests.coordinator_turns import append, turn_until

WAIT_MS = 5_000


def _clock_ahead(ms: int) -> int:
    return int(time.time() * 1000) + ms


def _restarted_past_the_deadline(
    transport: str, unique_prefix: str, completed: bool
) -> tuple[str, str]:
    """The saga's end (status, reason) as a coordinator restarted past its
    completion deadline decides it, the completion in its backlog or not."""
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix, partitions=1)
    ledger = Ledger(saga_id="saga-late", t0=int(time.time() * 1000))
    refund = ledger.scheduled("refund", completion_within_ms=WAIT_MS)
    ensure_topics(transport, settings.topics, [refund.contract.participant], 1)
    one = Coordinator(settings, transport, instance_id="catch-up", carry_ms=0, linger_ms=0)
    one._join()
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

    def accepted() -> bool:
        state = one.state_of("saga-late")
        return (
            one._committing is None
            and state is not None
            and state.steps["refund"].status is StepStatus.COMPENSATION_ACCEPTED
        )

    turn_until(one, accepted)
    one._consumer.close()

    # While no coordinator runs, the completion is recorded within the wait (and some
    # other saga's record lands before it); the coordinator comes back after the
    # deadline, the backlog unread.
    if completed:
        other = Ledger(saga_id="saga-other", t0=ledger.clock)
        append(settings, transport, other.started(), ledger.comp_committed("refund"))
    two = Coordinator(
        settings,
        transport,
        instance_id="catch-up",
        clock=lambda: _clock_ahead(10 * WAIT_MS),
        batch_size=1,
        carry_ms=0,
        linger_ms=0,
    )
    two._join()
    try:
        turn_until(two, lambda: two.marker_of("saga-late") is not None)
        marker = two.marker_of("saga-late")
    finally:
        two._consumer.close()
    assert marker is not None
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
