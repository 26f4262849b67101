"""The worked examples of seeds 003 (refund saga) and 004 (saga-ledger fixture), played
against the pure coordinator core, the coordinator acting alone and the test playing
every participant."""

from __future__ import annotations

from coordinator_ledger import (
    Harness,
    Ledger,
    approval_requests,
    compensates,
    executes,
    fresh,
    incidents,
    receipt_of,
    rejections,
    terminal,
)

from schemas import FailureKind, RetryPolicy, Reversibility, SagaOutcome, TerminalStatus
from schemas.receipt import Disposition


def refund_saga_to_the_pivot() -> tuple[Ledger, Harness]:
    """place_hold and return_to_inventory committed; issue_credit (the pivot) scheduled."""
    ledger, h = fresh(saga_id="ticket-8823")
    h.feed(ledger.started(workflow="refund"))
    h.feed(
        ledger.scheduled("hold", "place_hold", participant="orders", compensation="release_hold")
    )
    h.feed(ledger.committed("hold"))
    h.feed(
        ledger.scheduled(
            "restock",
            "return_to_inventory",
            participant="inventory",
            compensation="remove_from_inventory",
            owner="warehouse",
            compensation_retry=RetryPolicy(max_attempts=3, initial_backoff_ms=100),
        )
    )
    h.feed(ledger.committed("restock"))
    h.feed(
        ledger.scheduled(
            "credit", "issue_credit", participant="billing", pivot=True, args={"cents": 400_000}
        )
    )
    return ledger, h


# ------------------------------------------------------------------ seed 003


def test_refund_failure_before_the_pivot_unwinds_restock_then_hold_R2_R9() -> None:
    ledger, h = refund_saga_to_the_pivot()
    out = h.feed(ledger.failed("credit", kind=FailureKind.BUSINESS_REJECTION, message="limit"))
    assert compensates(out) == ["restock"]  # hold waits: restock depends on it
    out = h.feed(ledger.comp_committed("restock"))
    assert compensates(out) == ["hold"]
    out = h.feed(ledger.comp_committed("hold"))
    assert compensates(h.outputs) == ["restock", "hold"]
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert {s.step_id: s.disposition for s in receipt.steps} == {
        "hold": Disposition.COMPENSATED,
        "restock": Disposition.COMPENSATED,
        "credit": Disposition.NOT_COMMITTED,
    }


def test_the_receipt_names_no_pivot_when_the_pivot_never_committed_R6_R14() -> None:
    """The receipt's ``pivot_step`` named the declared pivot whatever became of it:
    a saga unwound because its pivot was refused said (and ``saga show`` printed)
    "pivot: credit", as if the saga had gone past it. It names the pivot that
    committed, past which the saga went forward only; none when none did."""
    ledger, h = refund_saga_to_the_pivot()
    h.feed(ledger.failed("credit", kind=FailureKind.BUSINESS_REJECTION, message="limit"))
    h.feed(ledger.comp_committed("restock"))
    receipt = receipt_of(h.feed(ledger.comp_committed("hold")))
    assert receipt.status is TerminalStatus.COMPENSATED
    assert receipt.pivot_step is None, receipt.pivot_step
    # A pivot that never ran (the step before it failed): no pivot either.
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.scheduled("credit", pivot=True))
    out = h.feed(ledger.failed("hold", kind=FailureKind.BUSINESS_REJECTION), ledger.end())
    receipt = receipt_of(out)
    assert {s.step_id: s.forward_attempts for s in receipt.steps} == {"hold": 1, "credit": 0}
    assert receipt.pivot_step is None


def test_refund_email_failure_after_the_pivot_is_retried_and_credit_kept_R6() -> None:
    ledger, h = refund_saga_to_the_pivot()
    h.feed(ledger.committed("credit"))
    h.feed(ledger.scheduled("email", "send_reply", participant="mail"))
    h.feed(ledger.failed("email", attempt=1))
    h.run_timers()
    h.feed(ledger.failed("email", attempt=2))
    h.run_timers()
    assert executes(h.outputs).count("email") == 3
    out = h.feed(ledger.committed("email", attempt=3), ledger.end())
    assert compensates(h.outputs) == []  # the credit is never clawed back
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.COMPLETED
    assert receipt.pivot_step == "credit"
    email = next(s for s in receipt.steps if s.step_id == "email")
    assert email.forward_attempts == 3 and email.disposition is Disposition.RETAINED


def test_refund_irreversible_reply_waits_for_a_grant_for_its_own_arguments_R7() -> None:
    ledger, h = refund_saga_to_the_pivot()
    h.feed(ledger.committed("credit"))
    out = h.feed(
        ledger.scheduled(
            "email",
            "send_reply",
            participant="mail",
            reversibility=Reversibility.IRREVERSIBLE,
            compensation=None,
            args={"to": "customer@example.com", "credit": "op-credit"},
        )
    )
    [request] = approval_requests(out)
    assert "email" not in executes(h.outputs)
    other_args = ledger.grant(request, args_fingerprint="fingerprint-of-other-arguments")
    out = h.feed(other_args)
    assert [r.reason for r in rejections(out)] == ["approval-mismatch"]
    assert "email" not in executes(h.outputs)
    out = h.feed(ledger.grant(request))
    assert executes(out) == ["email"]
    out = h.feed(ledger.committed("email"), ledger.end())
    receipt = receipt_of(out)
    assert [a.decision for a in receipt.approvals] == ["REJECTED_MISMATCH", "GRANTED"]
    assert receipt.status is TerminalStatus.COMPLETED


def test_refund_compensation_that_keeps_failing_is_escalated_while_others_run_R3_R8() -> None:
    ledger, h = refund_saga_to_the_pivot()
    h.feed(ledger.failed("credit", kind=FailureKind.BUSINESS_REJECTION))
    for attempt in (1, 2):
        h.feed(ledger.comp_failed("restock", attempt=attempt))
        h.run_timers()
    out = h.feed(ledger.comp_failed("restock", attempt=3))
    [incident] = incidents(out)
    assert incident.owner == "warehouse"
    assert incident.step_id == "restock" and "return_to_inventory" in incident.inconsistency
    assert "op-restock" in incident.effect
    assert compensates(out) == ["hold"]  # the unwind goes on
    out = h.feed(ledger.comp_committed("hold"))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert receipt.unresolved == ["restock"] and receipt.owner == "warehouse"
    restock = next(s for s in receipt.steps if s.step_id == "restock")
    assert restock.compensation_attempts == 3 and restock.incident_id == incident.incident_id


# ------------------------------------------------------------------ seed 004 fixture


def test_fixture_reserve_charge_email_fails_undoes_charge_then_reserve() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    for step in ("reserve", "charge"):
        h.feed(ledger.scheduled(step), ledger.committed(step))
    h.feed(ledger.scheduled("email"))
    out = h.feed(ledger.failed("email", kind=FailureKind.BUSINESS_REJECTION, message="email"))
    for step in ("charge", "reserve"):
        out = h.feed(ledger.comp_committed(step))
    assert executes(h.outputs) == ["reserve", "charge", "email"]
    assert compensates(h.outputs) == ["charge", "reserve"]
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.COMPENSATED
    committed = [s.step_id for s in receipt.steps if s.committed_at is not None]
    assert committed == ["reserve", "charge"]
    assert "email" in receipt.end_reason


def test_fixture_clean_two_step_saga_completes() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    for step in ("a", "b"):
        h.feed(ledger.scheduled(step), ledger.committed(step))
    out = h.feed(ledger.end(SagaOutcome.COMPLETE))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.disposition for s in receipt.steps] == [Disposition.RETAINED] * 2
    assert executes(h.outputs) == ["a", "b"] and compensates(h.outputs) == []


def test_fixture_empty_saga_completes() -> None:
    ledger, h = fresh()
    out = h.feed(ledger.started(), ledger.end())
    record = terminal(out)
    assert record is not None and record.status is TerminalStatus.COMPLETED
    assert receipt_of(out).steps == []
