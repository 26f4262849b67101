"""The receipt tells the truth (R14), without a broker: what the pure core puts in it,
and what the text rendering (``saga show``, the dashboard) makes of it."""

from __future__ import annotations

from coordinator_ledger import (
    Ledger,
    approval_requests,
    fresh,
    incidents,
    receipt_of,
    rejections,
    terminal,
)

from sagaline.ops.actions import incident_resolved
from sagaline.ops.receipts import format_ms, render_receipt_text
from schemas import FailureKind, IncidentRaised, Reversibility, SagaOutcome, TerminalStatus


def test_an_unknown_outcome_settled_by_a_person_names_them_on_every_incident_R11_R14() -> None:
    """A new generation asked again about the unknown step; carol settles the new
    incident COMMITTED. The old incident is resolved with it: by carol, not "observed in
    the ledger" (nothing in the ledger but carol's word says it committed)."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("pay"))
    [first] = incidents(h.feed(ledger.unknown("pay")))
    ledger.generation = 2
    [again] = incidents(h.feed(ledger.started()))
    h.feed(incident_resolved(again, operator="carol", resolution="COMMITTED", now=h.now))
    receipt = receipt_of(h.feed(ledger.end(SagaOutcome.COMPLETE)))
    resolutions = {i.incident_id: i.resolution for i in receipt.incidents}
    assert resolutions == {
        first.incident_id: "COMMITTED (by carol)",
        again.incident_id: "COMMITTED (by carol)",
    }


def _result_too_large(ledger: Ledger, step_id: str) -> IncidentRaised:
    """What a participant's runtime raises when a tool's result is over the limit."""
    return IncidentRaised(
        envelope=ledger.env(IncidentRaised, "svc"),
        incident_id=f"inc-large-{step_id}",
        kind="result-too-large",
        step_id=step_id,
        tool=step_id,
        inconsistency=f"{step_id} committed but returned too many bytes",
        effect="committed; result not recorded",
        owner="storage",
    )


def test_every_open_incident_of_an_escalated_saga_is_listed_unresolved_once_R14() -> None:
    """hold's participant raised an incident of its own when hold committed; then the
    saga unwound and hold's compensation failed (a second incident, the step's). Both
    are open: both must be in ``unresolved`` (and ``SagaTerminal.unresolved``), and the
    text names each once."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("hold"),
        _result_too_large(ledger, "hold"),
        ledger.committed("hold"),
        ledger.scheduled("pay"),
        ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION),
    )
    out = h.feed(ledger.comp_failed("hold", kind=FailureKind.BUSINESS_REJECTION))
    receipt = receipt_of(out)
    record = terminal(out)
    assert record is not None and receipt.status is TerminalStatus.ESCALATED
    [failed] = [i.incident_id for i in receipt.incidents if i.kind == "compensation-failed"]
    assert h.s.steps["hold"].incident_id == failed
    assert receipt.unresolved == ["hold", "incident:inc-large-hold"]
    assert record.unresolved == receipt.unresolved
    text = render_receipt_text(receipt)
    assert text.count("inc-large-hold") == 1, text
    assert text.count(failed) == 1, text


def test_a_grant_that_did_not_count_shows_the_principal_it_named_R7_R14() -> None:
    """mallory's grant names another principal than the saga's: the coordinator does
    not count it. The receipt must show it under the principal it named (why it did
    not count), not under the saga's, where it reads like alice's own approval."""
    ledger, h = fresh()
    h.feed(ledger.started())
    [request] = approval_requests(
        h.feed(ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE))
    )
    bad = ledger.grant(request, principal="mallory", granted_by="mallory")
    assert [o.reason for o in rejections(h.feed(bad))] == ["approval-mismatch"]
    h.feed(ledger.grant(request), ledger.committed("wire"))
    receipt = receipt_of(h.feed(ledger.end(SagaOutcome.COMPLETE)))
    assert [(a.decision, a.by, a.principal) for a in receipt.approvals] == [
        ("REJECTED_MISMATCH", "mallory", "mallory"),
        ("GRANTED", "bob", "alice"),
    ]
    text = render_receipt_text(receipt)
    assert "principal mallory" in text, text


def test_saga_show_text_names_every_intent_and_verification_like_the_json_R10_R14() -> None:
    """``saga show`` (and the dashboard) print the receipt for a person; what --json
    says about each intent and each verification must be there too."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("hold", has_verify=True),
        ledger.intent("hold"),
        ledger.committed("hold"),
        ledger.scheduled("pay"),
        ledger.intent("pay"),
        ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION),
    )
    receipt = receipt_of(h.feed(ledger.comp_committed("hold", verified=False)))
    hold, pay = receipt.steps
    assert hold.intent_at is not None and pay.intent_at is not None
    assert hold.verification == "FAILED"
    text = render_receipt_text(receipt)
    for step in (hold, pay):
        assert f"intent recorded at {format_ms(step.intent_at)}" in text, text
    assert "compensation verification: FAILED" in text, text


def test_an_approval_request_nobody_answered_is_not_shown_as_a_grant_R7_R14() -> None:
    """The request expired with no answer: the receipt records it EXPIRED by "-". The
    text must not call that an (expired) grant by "-": nobody granted anything."""
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE))
    h.feed(ledger.end(SagaOutcome.COMPLETE))
    receipt = receipt_of(h.run_timers())
    assert [(a.decision, a.by) for a in receipt.approvals] == [("EXPIRED", "-")]
    text = render_receipt_text(receipt)
    assert "grant" not in text.lower(), text
    assert "request for step wire (forward) EXPIRED unanswered" in text, text


def test_a_compensation_verified_after_its_window_passed_is_not_also_still_changed_R13_R14() -> (
    None
):
    """booking's compensation was in flight when its reversal window passed, then
    committed and its verification passed. ``saga show`` listed it as undone and
    verified and, in the same receipt, as "Still changed: ... effect remains in the
    world" under a pending incident."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("booking", reversal_window_ms=1_000, has_verify=True),
        ledger.committed("booking"),
        ledger.scheduled("boom"),
        ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION),
    )
    deadline = h.s.steps["booking"].reversal_deadline
    assert deadline is not None
    [raised] = incidents(h.advance(deadline - h.now))
    assert raised.kind == "reversal-window-expired"
    receipt = receipt_of(h.feed(ledger.comp_committed("booking", verified=True)))
    text = render_receipt_text(receipt)
    assert "Still changed" not in text, text
    assert receipt.status is TerminalStatus.COMPENSATED, text


def test_a_step_that_failed_after_the_pivot_is_told_as_owed_not_in_effect_R6_R14() -> None:
    """``email`` failed finally after the pivot committed: escalated, never took
    effect. ``saga show`` said it "is still in effect" and listed the incident's
    effect as "Still changed", while the incident itself says it did not take effect
    and is still owed."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("credit", pivot=True))
    h.feed(ledger.committed("credit"), ledger.scheduled("email", owner="support"))
    [incident] = incidents(h.feed(ledger.failed("email", kind=FailureKind.BUSINESS_REJECTION)))
    assert "did not take effect" in incident.effect
    receipt = receipt_of(h.feed(ledger.end(SagaOutcome.COMPLETE)))
    assert receipt.status is TerminalStatus.ESCALATED
    text = render_receipt_text(receipt)
    assert "is still in effect" not in text, text
    assert "Still changed" not in text, text
    assert (
        f"email (step email) did not take effect and is still owed; it needs support "
        f"(incident {incident.incident_id})" in text
    ), text
