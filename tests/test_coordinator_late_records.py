"""Property tests of the pure coordinator core: answers that arrive late, about an
attempt or a dependency the saga has moved past (hypothesis; no Kafka).

A participant answers under the attempt of the command it answers, and the same answer
can come again with an id the saga no longer remembers (a participant re-running a
command after a restart, a redelivery past the de-duplication memory). Each test plays
a saga up to the point where such an answer can arrive, drawn by hypothesis, and checks
that it cannot make the coordinator act on a fact that is no longer true.
"""

from __future__ import annotations

from coordinator_ledger import Harness, Ledger, executes, fresh, incidents, receipt_of
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import ReconcileResult, RetryPolicy, TerminalStatus
from schemas.receipt import Disposition

SETTINGS = settings(max_examples=150, deadline=None)


def _retry(attempts: int) -> RetryPolicy:
    return RetryPolicy(max_attempts=attempts, initial_backoff_ms=10, max_backoff_ms=10)


def _unknown_through(ledger: Ledger, h: Harness, current: int) -> None:
    """Attempts 1..current-1 of ``charge`` timed out and a lookup found nothing (each
    retried with the same key); attempt ``current`` timed out too and is being looked
    up now."""
    for attempt in range(1, current):
        h.feed(ledger.unknown("charge", attempt))
        h.feed(ledger.reconciled("charge", ReconcileResult.NOT_FOUND, attempt))
        h.run_timers()
        assert h.s.steps["charge"].attempt == attempt + 1
    h.feed(ledger.unknown("charge", current))
    assert h.status("charge") == "RECONCILING"


@SETTINGS
@given(
    attempts=st.integers(2, 4),
    data=st.data(),
    stale=st.sampled_from([ReconcileResult.NOT_FOUND, ReconcileResult.PENDING]),
    pending_first=st.booleans(),
)
def test_a_lookup_answer_for_an_earlier_attempt_does_not_settle_the_current_one_R11(
    attempts: int,
    data: st.DataObject,
    stale: ReconcileResult,
    pending_first: bool,
) -> None:
    """Only the current attempt's lookup may say "not found": an earlier one looked
    before the current attempt ran. Taken for the current attempt, it retried or failed
    a step whose effect may exist, and the saga went on (or unwound) past an unknown
    outcome; the lookup that then found the effect was ignored and the receipt said
    NOT_COMMITTED for an effect left in the world."""
    current = data.draw(st.integers(2, attempts), label="current attempt")
    earlier = data.draw(st.integers(1, current - 1), label="attempt the late answer is for")
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("charge", has_lookup=True, retry=_retry(attempts)))
    h.feed(ledger.scheduled("email"))
    _unknown_through(ledger, h, current)
    if pending_first:  # the current lookup said PENDING: a timer looks again
        h.feed(ledger.reconciled("charge", ReconcileResult.PENDING, current))
    before = h.s.model_dump(exclude={"seen"})

    out = h.feed(ledger.reconciled("charge", stale, earlier))

    assert out == [], [o.record.envelope.type for o in out]
    assert h.s.model_dump(exclude={"seen"}) == before
    h.run_timers()  # a PENDING of the current lookup looks again
    h.feed(ledger.reconciled("charge", ReconcileResult.COMMITTED, current))
    assert h.status("charge") == "COMMITTED"
    assert executes(h.outputs)[-1] == "email"
    h.feed(ledger.committed("email"))
    receipt = receipt_of(h.feed(ledger.end()))
    assert receipt.status is TerminalStatus.COMPLETED
    assert {s.step_id: s.disposition for s in receipt.steps}["charge"] is Disposition.RETAINED


@SETTINGS
@given(attempts=st.integers(1, 3), data=st.data())
def test_a_lookup_finding_an_earlier_attempt_committed_still_counts_R11(
    attempts: int, data: st.DataObject
) -> None:
    """The same key runs every attempt: a commit found for any of them is the effect."""
    current = data.draw(st.integers(1, attempts), label="current attempt")
    earlier = data.draw(st.integers(1, current), label="attempt the answer is for")
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("charge", has_lookup=True, retry=_retry(attempts)))
    _unknown_through(ledger, h, current)
    h.feed(ledger.reconciled("charge", ReconcileResult.COMMITTED, earlier))
    assert h.status("charge") == "COMMITTED"
    assert incidents(h.outputs) == []
