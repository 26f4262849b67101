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

from schemas import FailureKind, ReconcileResult, RetryPolicy, TerminalStatus
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


@st.composite
def _after_the_pivot(draw: st.DrawFn) -> tuple[list[list[str] | None], int]:
    """Steps scheduled after a committed pivot (each with the implicit chain or an
    explicit list of earlier ones), and the one whose forward work fails."""
    n = draw(st.integers(2, 5))
    deps: list[list[str] | None] = []
    for i in range(n):
        earlier = ["credit", *(f"s{j}" for j in range(i))]
        explicit = draw(st.booleans())
        deps.append(
            sorted(draw(st.sets(st.sampled_from(earlier), min_size=1))) if explicit else None
        )
    return deps, draw(st.integers(0, n - 2))


@SETTINGS
@given(
    plan=_after_the_pivot(),
    kind=st.sampled_from([FailureKind.BUSINESS_REJECTION, FailureKind.TRANSIENT]),
)
def test_work_cancelled_for_an_escalated_step_runs_once_that_step_commits_after_all_R6_R14(
    plan: tuple[list[list[str] | None], int], kind: FailureKind
) -> None:
    """Past the pivot the saga only goes forward (R6). A step whose dependency was
    escalated is not run (the escalation carries the incident); when the ledger then
    shows the dependency committed after all, its incident is settled, so nothing
    carried the work cancelled for it any more: the saga ended COMPLETED with steps
    the agent asked for never run and nobody told."""
    deps, failing = plan
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("credit", pivot=True), ledger.committed("credit"))
    steps = [f"s{i}" for i in range(len(deps))]
    for step_id, depends_on in zip(steps, deps, strict=True):
        h.feed(ledger.scheduled(step_id, depends_on=depends_on, retry=_retry(1)))
    answered: set[str] = set()
    for _ in range(4 * len(steps)):
        ready = [s for s in executes(h.outputs) if s in steps and s not in answered]
        if not ready:
            break
        step_id = ready[0]
        answered.add(step_id)
        if step_id == steps[failing]:
            h.feed(ledger.failed(step_id, kind=kind))
            assert h.status(step_id) == "ESCALATED"
        else:
            h.feed(ledger.committed(step_id))
    h.feed(ledger.committed(steps[failing]))  # the provider did it after all
    for _ in range(4 * len(steps)):
        ready = [s for s in executes(h.outputs) if s in steps and s not in answered]
        if not ready:
            break
        answered.add(ready[0])
        h.feed(ledger.committed(ready[0]))
    receipt = receipt_of(h.feed(ledger.end()))
    assert answered == set(steps)
    assert receipt.status is TerminalStatus.COMPLETED
    assert {s.disposition for s in receipt.steps} == {Disposition.RETAINED}


def test_work_still_blocked_by_another_escalated_step_stays_cancelled_R6() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("credit", pivot=True), ledger.committed("credit"))
    for step_id in ("a", "b"):
        h.feed(ledger.scheduled(step_id, depends_on=["credit"], retry=_retry(1)))
    h.feed(ledger.scheduled("c", depends_on=["a", "b"]))
    h.feed(ledger.failed("a", kind=FailureKind.BUSINESS_REJECTION))
    h.feed(ledger.failed("b", kind=FailureKind.BUSINESS_REJECTION))
    assert h.status("c") == "CANCELLED"
    h.feed(ledger.committed("a"))  # a did it after all; b still did not
    assert (h.status("a"), h.status("c")) == ("COMMITTED", "CANCELLED")
    assert "c" not in executes(h.outputs)
    receipt = receipt_of(h.feed(ledger.end()))
    assert receipt.status is TerminalStatus.ESCALATED and receipt.unresolved == ["b"]
