"""The dashboard's pure parts: the ledger fold, the timeline picture, the receipt words,
the metrics derived from the ledger, and the operator-decision records.

No broker here: these are folds and renderers of records built from the contract.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest
from coordinator_ledger import approval_requests, compensates, fresh, incidents, rejections
from dashboard_scenarios import (
    ALL,
    T0,
    SagaScript,
    awaiting_approval,
    compensated,
    completed,
    escalated,
    running,
    unknown_outcome,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from coordinator.core import CorePolicy, decide
from coordinator.state import SagaState
from sagaline.ops.actions import (
    ApprovalExpired,
    MissingOperatorIdentity,
    OperatorActionError,
    OperatorChannel,
    approval_denied,
    approval_granted,
    incident_resolved,
)
from sagaline.ops.metrics import CoordinatorMetrics, SagalineMetrics
from sagaline.ops.receipts import (
    describe_receipt,
    format_ms,
    render_receipt_html,
    render_receipt_text,
)
from schemas import (
    ApprovalGranted,
    ApprovalRequested,
    CompensationApproval,
    FailureKind,
    IncidentRaised,
    Receipt,
    Reversibility,
    SagaOutcome,
    SagaStarted,
    SagaTerminal,
    TerminalStatus,
)
from schemas.signing import Signer
from schemas.topics import TopicNames
from services.dashboard.app import create_app
from services.dashboard.timeline import render_timeline_svg
from services.dashboard.view import DashboardState, SagaFilter, SagaStatus, Span, SpanKind
from services.refund import economic_effect

EXPECTED = {
    "completed": SagaStatus.COMPLETED,
    "compensated": SagaStatus.COMPENSATED,
    "escalated": SagaStatus.ESCALATED,
    "awaiting_approval": SagaStatus.AWAITING_APPROVAL,
    "unknown_outcome": SagaStatus.UNKNOWN_OUTCOME,
    "running": SagaStatus.RUNNING,
    "compensating": SagaStatus.COMPENSATING,
}


def _state(*names: str) -> DashboardState:
    state = DashboardState(SagalineMetrics("dashboard"))
    for name in names or tuple(ALL):
        for record in ALL[name]().records:
            state.apply(record)
    return state


class RecordingChannel:
    """Stands in for an OperatorChannel: keeps what would be published."""

    def __init__(self) -> None:
        self.published: list[object] = []

    def producer_for(self, operator: str, via: str) -> str | None:
        return None

    def publish(self, record: object) -> None:
        self.published.append(record)


def _receipt(script_records: list[object]) -> Receipt:
    terminal = next(r for r in script_records if isinstance(r, SagaTerminal))
    return Receipt.from_json(terminal.receipt)


# ------------------------------------------------------------------- the fold


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_saga_gets_the_status_its_ledger_implies(name: str) -> None:
    """R14: terminal records decide; otherwise unknown > approval > compensating > running."""
    state = _state(name)
    (saga,) = state.sagas.values()
    assert saga.status is EXPECTED[name]


def test_counts_have_one_saga_per_status_and_every_status_listed() -> None:
    counts = _state().counts()
    assert counts == dict.fromkeys(SagaStatus, 1)


def test_a_duplicate_ledger_record_changes_nothing_and_is_counted() -> None:
    """R15: the same event twice in the ledger is folded once."""
    records = compensated().records
    state = DashboardState()
    for record in [*records[:5], records[4], *records[5:]]:
        state.apply(record)
    saga = state.sagas["s-compensated"]
    assert saga.record_count == len(records)
    assert state.ledger_duplicates == 1
    assert saga.status is SagaStatus.COMPENSATED


def test_the_same_record_on_the_terminal_topic_and_the_ledger_is_not_a_duplicate() -> None:
    records = completed().records
    state = DashboardState()
    state.apply(records[-1], from_ledger=False)  # sagaline.terminal read first
    for record in records:
        state.apply(record)
    assert state.ledger_duplicates == 0
    assert state.sagas["s-completed"].status is SagaStatus.COMPLETED
    assert state.sagas["s-completed"].workflow == "refund"


def test_a_terminal_record_alone_is_enough_to_show_the_saga() -> None:
    """When the ledger has expired, the compacted terminal topic still tells the story."""
    state = DashboardState()
    state.apply(escalated().records[-1], from_ledger=False)
    saga = state.sagas["s-escalated"]
    assert saga.status is SagaStatus.ESCALATED
    assert [s.tool for s in saga.steps.values()] == [
        "place_hold",
        "restock_inventory",
        "issue_credit",
    ]


def test_records_of_a_superseded_generation_are_ignored() -> None:
    """R15: a stale generation does not overwrite the current run."""
    script = running()
    state = DashboardState()
    newer = script.records[0].model_copy(
        update={"envelope": script.records[0].envelope.model_copy(
            update={"generation": 2, "event_id": "gen2-start"})}
    )  # fmt: skip
    assert isinstance(newer, SagaStarted)
    state.apply(newer)
    for record in script.records[1:]:
        state.apply(record)
    assert state.stale_records == len(script.records) - 1
    assert state.sagas["s-running"].steps == {}


def test_filters_by_tenant_workflow_and_tool() -> None:
    state = _state()
    by_tenant = {s.saga_id for s in state.select(SagaFilter(tenant="globex"))}
    assert by_tenant == {"s-compensated", "s-unknown"}
    by_workflow = {s.saga_id for s in state.select(SagaFilter(workflow="notify"))}
    assert by_workflow == {"s-awaiting", "s-compensating"}
    by_tool = {s.saga_id for s in state.select(SagaFilter(tool="send_email"))}
    assert by_tool == {"s-completed", "s-awaiting"}


def test_pending_approvals_and_open_incidents_are_listed_until_decided() -> None:
    state = _state()
    assert [(s.saga_id, a.step_id) for s, a in state.pending_approvals()] == [("s-awaiting", "2")]
    assert {s.saga_id for s, _ in state.open_incidents()} == {"s-escalated", "s-unknown"}

    _, request = state.pending_approvals()[0]
    state.apply(approval_granted(request, operator="bob", now=request.expires_at - 1))
    assert state.pending_approvals() == []
    assert state.sagas["s-awaiting"].status is SagaStatus.RUNNING


def test_resolving_an_unknown_outcome_settles_the_step() -> None:
    """R11: a person saying COMMITTED ends the unknown state."""
    state = _state("unknown_outcome")
    saga, incident = state.open_incidents()[0]
    state.apply(
        incident_resolved(
            incident, operator="carol", resolution="committed", now=saga.last_at + 5_000
        )
    )
    assert saga.steps["2"].state == "committed"
    assert saga.status is SagaStatus.RUNNING
    assert state.open_incidents() == []


# ------------------------------------------------------------------ timeline


def test_timeline_is_wellformed_svg_with_the_pivot_line_after_the_pivot_commits() -> None:
    """R6 / seed 003: the picture splits reversible from forward-only at the pivot."""
    state = _state("completed")
    saga = state.sagas["s-completed"]
    svg = render_timeline_svg(saga, now=saga.last_at)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    pivot = [e for e in root.iter(f"{ns}line") if e.get("class") == "pivot-line"]
    assert len(pivot) == 1
    assert "PIVOT: issue_credit committed" in svg
    assert root.find(f".//{ns}rect[@class='zone-irreversible']") is not None


def test_timeline_without_a_committed_pivot_is_all_reversible_zone() -> None:
    saga = _state("compensated").sagas["s-compensated"]
    svg = render_timeline_svg(saga, now=saga.last_at)
    assert "pivot-line" not in svg
    assert "zone-reversible" in svg


def test_timeline_draws_retries_compensations_and_approvals() -> None:
    state = _state("compensated", "completed")
    comp = render_timeline_svg(state.sagas["s-compensated"], now=0)
    assert comp.count('class="span span-compensation') == 2
    assert comp.count('class="span span-retry-wait') == 1
    assert "release_hold #1: verified" in comp  # verified compensation (R12)
    done = render_timeline_svg(state.sagas["s-completed"], now=0)
    assert "granted by lead@ops" in done


def test_timeline_axis_stays_a_few_ticks_however_far_apart_the_records_are() -> None:
    """One record dated by a broken clock (here 1000 days after the rest) made the axis
    one tick per day: with a timestamp in microseconds, millions of ticks, rendered on
    the event loop while holding the state lock, so every page and the follower hung."""
    saga = _state("completed").sagas["s-completed"]
    saga.steps["1"].spans.append(Span(SpanKind.ATTEMPT, saga.last_at + 1000 * 86_400_000))
    svg = render_timeline_svg(saga, now=saga.last_at)
    ET.fromstring(svg)
    assert svg.count('stroke="#cfd8dc"') <= 10  # one grid line per tick


def test_a_saga_dated_beyond_the_calendar_still_gets_its_page() -> None:
    """A producer writing microseconds (or garbage) into occurred_at: the page of that
    saga answered 500 (datetime: year out of range); the value is shown as is."""
    assert format_ms(2**62) == f"{2**62} ms since the epoch (not a valid time)"
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in completed("s-future").records:
        env = record.envelope.model_copy(update={"occurred_at": 2**62})
        state.apply(record.model_copy(update={"envelope": env}))
    client = TestClient(create_app(state, clock=lambda: 1_760_000_100_000))
    response = client.get("/sagas/s-future")
    assert response.status_code == 200 and "not a valid time" in response.text


# ------------------------------------------------------------------- receipts


def test_receipt_text_says_what_was_undone_and_verified() -> None:
    """R12/R14: a compensated receipt tells what was undone, and which undo was verified."""
    text = render_receipt_text(_receipt(compensated().records))
    assert "was compensated: every effect it made was undone" in text
    assert "place_hold (step 1): undone and verified." in text
    assert "restock_inventory (step 2): undone (the tool declares no verification)." in text
    assert "issue_credit (step 3) never took effect" in text


def test_receipt_text_names_the_owner_of_what_is_still_pending() -> None:
    """R8: what is inconsistent, where, and whose it is."""
    text = render_receipt_text(_receipt(escalated().records))
    assert "Pending: needs a person:" in text
    assert "restock_inventory (step 2) is still in effect and needs inventory-team" in text
    assert "3 units still in stock" in text


def test_receipt_calls_an_irreversible_effect_not_undoable() -> None:
    story = describe_receipt(_receipt(completed().records))
    irreversible = next(s for s in story.sections if s.key == "irreversible")
    assert [i.text.split(" ")[0] for i in irreversible.items] == ["send_email"]


def test_receipt_html_tells_the_same_story_escaped() -> None:
    receipt = _receipt(escalated().records).model_copy(update={"workflow": "<refund>"})
    page = render_receipt_html(receipt)
    assert "&lt;refund&gt;" in page and "<refund>" not in page
    for section in describe_receipt(receipt).sections:
        assert f"section-{section.key}" in page


# -------------------------------------------------------------------- metrics


def _fed(*names: str) -> SagalineMetrics:
    metrics = CoordinatorMetrics(effect=economic_effect)
    for name in names:
        for record in ALL[name]().records:
            metrics.observe_record(record)
    return metrics


def test_compensation_outcomes_by_tool_match_the_receipts() -> None:
    snap = _fed("compensated", "escalated").snapshot()
    assert snap.compensation_outcomes == {
        ("place_hold", "succeeded"): 2,
        ("restock_inventory", "succeeded"): 1,
        ("restock_inventory", "failed"): 1,
    }
    assert snap.compensation_success_by_tool() == {
        "place_hold": (2, 2),
        "restock_inventory": (1, 2),
    }


def test_a_record_observed_twice_is_measured_once() -> None:
    """R15: an echo of our own output or a redelivery does not double the measures."""
    metrics = _fed("compensated")
    for record in compensated().records:
        metrics.observe_output(record)
    assert sum(metrics.snapshot().compensation_outcomes.values()) == 2


def test_without_an_effect_measure_no_economic_effect_is_claimed() -> None:
    """Shared metrics do not know what a tool's arguments mean: the deployable says."""
    metrics = CoordinatorMetrics()
    for record in escalated().records:
        metrics.observe_record(record)
    assert metrics.snapshot().remaining_effect_cents == {}


def test_remaining_effect_counts_escalated_amounts_until_resolved() -> None:
    metrics = _fed("escalated")
    assert metrics.snapshot().remaining_effect_cents == {"acme": 2_500}
    incident = next(r for r in escalated().records if isinstance(r, IncidentRaised))
    metrics.observe_record(
        incident_resolved(
            incident,
            operator="dan",
            resolution="restocked by hand",
            now=incident.envelope.occurred_at + 60_000,
        )
    )
    snap = metrics.snapshot()
    assert snap.remaining_effect_cents == {"acme": 0}
    assert snap.manual_interventions == {"incident_resolved": 1}
    assert snap.time_to_recovery["ESCALATED"].count == 1


def test_unknown_time_manual_interventions_and_disclosure_latency() -> None:
    metrics = _fed("unknown_outcome", "completed", "compensated")
    saga_records = unknown_outcome().records
    incident = next(r for r in saga_records if isinstance(r, IncidentRaised))
    unknown_at = saga_records[-2].envelope.occurred_at
    metrics.observe_record(
        incident_resolved(incident, operator="eve", resolution="NOT_FOUND", now=unknown_at + 90_000)
    )
    snap = metrics.snapshot()
    assert snap.time_in_unknown["restock_inventory"].count == 1
    assert snap.time_in_unknown["restock_inventory"].sum_seconds == pytest.approx(90.0)
    assert snap.manual_interventions == {"approval_granted": 1, "incident_resolved": 1}
    assert snap.disclosure_latency["COMPENSATED"].count == 1
    assert "COMPLETED" not in snap.disclosure_latency  # nothing failed, nothing to disclose


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = _fed("compensated"), CoordinatorMetrics()
    b.duplicate_prevented()
    assert a.snapshot().duplicates_prevented == {}
    assert b.snapshot().duplicates_prevented == {"coordinator": 1}


# ----------------------------------------------------------- operator records


def _request() -> ApprovalRequested:
    return next(r for r in awaiting_approval().records if isinstance(r, ApprovalRequested))


def test_a_grant_is_bound_to_exactly_what_was_requested() -> None:
    """R7: principal, step, fingerprint, scope and expiry copied from the request."""
    req = _request()
    grant = approval_granted(req, operator="  alice@ops ", now=req.envelope.occurred_at + 10)
    assert grant.granted_by == "alice@ops"
    for name in ("step_id", "approval_id", "purpose", "principal", "args_fingerprint", "scope",
                 "expires_at"):  # fmt: skip
        assert getattr(grant, name) == getattr(req, name)
    assert grant.envelope.causation_id == req.event_id
    assert grant.envelope.saga_id == req.saga_id


def test_a_grant_after_the_request_expired_is_refused_not_recorded() -> None:
    """R7: the coordinator rejects a grant made after ``expires_at`` (EXPIRED), so the
    builder refuses it instead of writing it and telling the operator it was granted."""
    req = _request()
    assert approval_granted(req, operator="alice", now=req.expires_at).granted_by == "alice"
    with pytest.raises(ApprovalExpired, match="expired"):
        approval_granted(req, operator="alice", now=req.expires_at + 1)


def test_the_dashboard_refuses_to_grant_an_expired_approval() -> None:
    """The page said "granted (recorded on Kafka)" for a grant the coordinator drops."""
    state = _state("awaiting_approval")
    _, req = state.pending_approvals()[0]
    channel = RecordingChannel()
    client = TestClient(
        create_app(state, channel, clock=lambda: req.expires_at + 60_000)  # type: ignore[arg-type]
    )
    page = client.get("/").text
    assert f'id="approve-{req.approval_id}"' not in page  # listed as expired instead
    response = client.post(
        f"/approvals/{req.saga_id}/{req.approval_id}/grant",
        data={"operator": "alice"},
        follow_redirects=False,
    )
    assert response.status_code == 400 and "expired" in response.text
    assert channel.published == []


def test_a_double_click_produces_the_same_event_id() -> None:
    """R15: a repeated decision deduplicates downstream."""
    req = _request()
    first = approval_granted(req, operator="alice", now=1)
    second = approval_granted(req, operator="alice", now=2)
    assert first.event_id == second.event_id


def test_conflicting_decisions_on_one_request_are_distinct_records_R15() -> None:
    """Two operators deciding the same request (or one changing their mind) wrote one
    event id, so the coordinator dropped the later decision as a duplicate while its
    operator was told it was recorded. Now only a repeat of the same decision by the same
    operator shares an id; any other is a record of its own, which the coordinator
    refuses visibly as already decided."""
    req = _request()
    alice = approval_granted(req, operator="alice", now=1)
    assert approval_granted(req, operator="bob", now=2).event_id != alice.event_id
    denied = approval_denied(req, operator="bob", reason="no", now=2)
    assert approval_denied(req, operator="bob", reason="no", now=3).event_id == denied.event_id
    assert approval_denied(req, operator="bob", reason="fraud", now=3).event_id != denied.event_id

    incident = next(r for r in unknown_outcome().records if isinstance(r, IncidentRaised))
    gone = incident_resolved(incident, operator="alice", resolution="NOT_FOUND", now=1)
    happened = incident_resolved(incident, operator="bob", resolution="COMMITTED", now=2)
    assert happened.event_id != gone.event_id
    again = incident_resolved(incident, operator="alice", resolution="not_found", now=3)
    assert again.event_id == gone.event_id  # a double click still deduplicates


def test_a_second_resolution_of_a_settled_incident_is_listed_as_refused_R11() -> None:
    """The coordinator acts on the first resolution of an incident and refuses a later
    one; the view showed the later one as the resolution."""
    script = unknown_outcome()
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in script.records:
        state.apply(record)
    incident = next(r for r in script.records if isinstance(r, IncidentRaised))
    gone = incident_resolved(incident, operator="alice", resolution="NOT_FOUND", now=T0 + 1)
    happened = incident_resolved(incident, operator="bob", resolution="COMMITTED", now=T0 + 2)
    state.apply(gone)
    state.apply(happened)
    saga = state.sagas[incident.saga_id]
    assert saga.resolved_incidents[incident.incident_id].resolved_by == "alice"
    assert saga.steps[incident.step_id or ""].state == "failed"
    assert any(happened.event_id in why and "already resolved" in why for why in saga.refused)

    channel = RecordingChannel()
    client = TestClient(create_app(state, channel))  # type: ignore[arg-type]
    response = client.post(
        f"/incidents/{incident.saga_id}/{incident.incident_id}/resolve",
        data={"operator": "carol", "resolution": "COMMITTED"},
        follow_redirects=False,
    )
    assert response.status_code == 400 and "already resolved by alice" in response.text
    assert channel.published == []


def test_an_unacknowledged_decision_is_not_called_undecided() -> None:
    """No acknowledgement is no proof of absence: the producer may still deliver the
    record. The message said "nothing was decided, try again"; it now says the
    decision may or may not be recorded, and that repeating it is safe (same id)."""
    req = _request()
    channel = OperatorChannel("127.0.0.1:1", TopicNames("t."), Signer(None))  # nobody there
    try:
        with pytest.raises(OperatorActionError) as raised:
            channel.publish(approval_granted(req, operator="alice", now=1), timeout_s=1.0)
    finally:
        channel.close()
    message = str(raised.value)
    assert "nothing was decided" not in message
    assert "may or may not" in message and "same event id" in message


@pytest.mark.parametrize("who", ["", "   "])
def test_a_decision_without_an_operator_is_refused(who: str) -> None:
    req = _request()
    with pytest.raises(MissingOperatorIdentity, match="operator identity is required"):
        approval_granted(req, operator=who, now=1)
    with pytest.raises(MissingOperatorIdentity):
        approval_denied(req, operator=who, reason="no", now=1)


def test_an_unknown_outcome_incident_needs_committed_or_not_found() -> None:
    """R11: a free-text answer cannot settle whether an effect happened."""
    incident = next(r for r in unknown_outcome().records if isinstance(r, IncidentRaised))
    with pytest.raises(OperatorActionError, match=r"COMMITTED.*NOT_FOUND"):
        incident_resolved(incident, operator="x", resolution="looked fine", now=1)


# ----------------------------------------------------------------- the pages


def test_overview_page_lists_every_saga_with_its_status() -> None:
    client = TestClient(create_app(_state(), clock=lambda: 1_760_000_100_000))
    page = client.get("/").text
    for name, status in EXPECTED.items():
        saga_id = ALL[name]().saga_id
        assert f'data-saga="{saga_id}" data-status="{status.slug}"' in page
    state = client.get("/api/state").json()
    assert state["counts"] == {s.slug: 1 for s in SagaStatus}


def test_saga_page_shows_timeline_and_receipt() -> None:
    client = TestClient(create_app(_state(), clock=lambda: 1_760_000_100_000))
    page = client.get("/sagas/s-escalated").text
    assert "<svg" in page and "receipt-escalated" in page
    assert client.get("/sagas/nope").status_code == 200  # a friendly page, not a stack trace


def test_posting_a_decision_without_operator_is_refused_with_a_reason() -> None:
    client = TestClient(create_app(_state()))
    response = client.post(
        "/approvals/s-awaiting/apr-s-awaiting-2/grant", data={"operator": " "},
        follow_redirects=False,
    )  # fmt: skip
    assert response.status_code == 400
    assert "operator field is required" in response.text


# ------------------------------------------- decisions the coordinator would not count


def _late(grant: ApprovalGranted) -> ApprovalGranted:
    env = grant.envelope.model_copy(update={"occurred_at": grant.expires_at + 1})
    return grant.model_copy(update={"envelope": env})


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda g: g.model_copy(update={"args_fingerprint": "0" * 32}), "arguments"),
        (lambda g: g.model_copy(update={"approval_id": "apr-another"}), "approval id"),
        (lambda g: g.model_copy(update={"principal": "agent-evil"}), "principal"),
        (lambda g: g.model_copy(update={"scope": "notify:charge_card"}), "scope"),
        (_late, "after expiry"),
    ],
    ids=["fingerprint", "approval-id", "principal", "scope", "expired"],
)
def test_a_grant_the_coordinator_would_not_count_leaves_the_approval_pending(
    spoil: Any, why: str
) -> None:
    """R7: the coordinator rejects a grant bound to anything but what was asked
    (APPROVAL_MISMATCH) and the step goes on waiting; the page showed it granted, so
    the operator believed the step released."""
    state = _state("awaiting_approval")
    saga = state.sagas["s-awaiting"]
    _, req = state.pending_approvals()[0]
    grant = spoil(approval_granted(req, operator="bob", now=req.expires_at - 10))
    state.apply(grant)
    assert [a.approval_id for _, a in state.pending_approvals()] == [req.approval_id]
    assert saga.status is SagaStatus.AWAITING_APPROVAL
    assert saga.steps[req.step_id].state == "awaiting approval"
    (uncounted,) = saga.uncounted_decisions
    assert uncounted.by == "bob" and why in uncounted.reason
    page = TestClient(create_app(state, clock=lambda: req.expires_at - 5)).get("/sagas/s-awaiting")
    assert "not counted" in page.text and why in page.text


def test_a_denial_of_another_approval_does_not_deny_the_step() -> None:
    """The coordinator rejects a denial whose approval id is not the pending one."""
    state = _state("awaiting_approval")
    saga = state.sagas["s-awaiting"]
    _, req = state.pending_approvals()[0]
    denial = approval_denied(req, operator="bob", reason="no", now=req.expires_at - 10)
    state.apply(denial.model_copy(update={"approval_id": "apr-another"}))
    assert saga.status is SagaStatus.AWAITING_APPROVAL
    assert saga.steps[req.step_id].state == "awaiting approval"
    assert saga.failure_at is None
    assert "approval" in saga.uncounted_decisions[0].reason


# ------------------------------------------------------------- expired requests


def test_an_expired_approval_request_is_shown_as_expired_not_pending() -> None:
    """After ``expires_at`` the coordinator no longer waits for a decision (the step
    failed, R7): the page listed the request as pending and the saga as awaiting
    approval, with only its Approve button disabled."""
    state = _state("awaiting_approval")
    _, req = state.pending_approvals()[0]
    client = TestClient(create_app(state, clock=lambda: req.expires_at + 60_000))
    api = client.get("/api/state").json()
    assert api["pending_approvals"] == []
    assert api["counts"]["awaiting_approval"] == 0
    assert api["expired_approvals"] == [
        {"saga_id": req.saga_id, "approval_id": req.approval_id, "step_id": req.step_id}
    ]
    page = client.get("/").text
    assert "Pending approvals (0)" in page and "Expired approvals (1)" in page
    assert f'id="approve-{req.approval_id}"' not in page
    saga_page = client.get(f"/sagas/{req.saga_id}").text
    assert "approval expired" in saga_page and f'id="deny-{req.approval_id}"' not in saga_page


def test_a_grant_made_in_time_counts_even_when_read_after_the_request_expired() -> None:
    """The coordinator judges a grant by its own time, not by when it is read."""
    state = _state("awaiting_approval")
    saga = state.sagas["s-awaiting"]
    _, req = state.pending_approvals()[0]
    state.expire_approvals(req.expires_at + 1)
    state.apply(approval_granted(req, operator="bob", now=req.expires_at))
    assert saga.steps[req.step_id].state == "approved"
    assert saga.expired_approvals == {} and saga.uncounted_decisions == []
    span = saga.steps[req.step_id].open_span(SpanKind.APPROVAL)
    assert span is None and saga.steps[req.step_id].spans[-1].outcome == "granted by bob"


def test_a_forward_approval_is_no_longer_pending_once_the_saga_compensates() -> None:
    """When a saga turns around before its pivot, the coordinator cancels every step
    still awaiting a forward approval (never dispatched) without a record of its own;
    the page kept the approval pending, with live buttons, and the saga "awaiting
    approval" while it compensated."""
    script = awaiting_approval()
    script.schedule("3", "issue_credit", amount_cents=2_500)
    script.intent("3")
    script.fail("3", FailureKind.BUSINESS_REJECTION)
    script.compensate("1")
    state = DashboardState()
    for record in script.records:
        state.apply(record)
    saga = state.sagas["s-awaiting"]
    assert state.pending_approvals() == [] and state.expired_approvals() == []
    assert saga.status is SagaStatus.COMPENSATING
    assert saga.steps["2"].state == "cancelled"
    assert saga.steps["2"].open_span(SpanKind.APPROVAL) is None


def test_the_view_agrees_with_the_coordinator_on_approvals() -> None:
    """The ledger the real coordinator core writes, folded by the dashboard: a grant it
    rejects leaves the step waiting in both, and an abort cancels the approval in both."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.intent("hold"))
    h.feed(ledger.committed("hold"))
    [req] = approval_requests(
        h.feed(ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE))
    )
    h.feed(ledger.grant(req, args_fingerprint="other-args"))
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    saga = state.sagas[ledger.saga_id]
    assert h.status("wire") == "AWAITING_APPROVAL"
    assert saga.status is SagaStatus.AWAITING_APPROVAL and saga.uncounted_decisions

    h.feed(ledger.end(SagaOutcome.ABORT, "the agent gave up"))
    for record in h.log:
        state.apply(record)
    assert h.status("wire") == "CANCELLED"
    assert state.sagas[ledger.saga_id].status is SagaStatus.COMPENSATING
    assert state.pending_approvals() == []


@settings(max_examples=40, deadline=None)
@given(
    turn=st.sampled_from(["abort", "rejected"]),
    in_flight=st.sampled_from(["dispatched", "running", "unknown"]),
)
def test_an_approval_cancelled_while_other_work_is_in_flight_is_not_pending_R7_R11(
    turn: str, in_flight: str
) -> None:
    """A saga turns around (the agent aborts, or a parallel step is rejected) while an
    IRREVERSIBLE step waits for its approval and another branch is still in flight. The
    coordinator cancels the waiting step, but no compensation can be asked yet (the
    in-flight step may still commit, R11), so no CompensationRequested tells the view.
    The dashboard listed the request as pending, with an Approve button, for as long as
    the other step stayed unsettled (for an unknown outcome: until a person answers),
    and a grant made there was refused as invalid-transition."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold", depends_on=[]))
    if in_flight != "dispatched":
        h.feed(ledger.intent("hold"))
    if in_flight == "unknown":
        assert incidents(h.feed(ledger.unknown("hold")))
    [req] = approval_requests(
        h.feed(ledger.scheduled("wire", depends_on=[], reversibility=Reversibility.IRREVERSIBLE))
    )
    if turn == "abort":
        h.feed(ledger.end(SagaOutcome.ABORT, "the agent gave up"))
    else:
        h.feed(ledger.scheduled("check", depends_on=[]), ledger.intent("check"))
        h.feed(ledger.failed("check", kind=FailureKind.BUSINESS_REJECTION))
    assert h.status("wire") == "CANCELLED" and not h.s.is_terminal
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    saga = state.sagas[ledger.saga_id]
    assert state.pending_approvals() == [] and state.expired_approvals() == []
    assert saga.status is not SagaStatus.AWAITING_APPROVAL
    assert saga.steps["wire"].state == "cancelled"
    assert saga.steps["wire"].open_span(SpanKind.APPROVAL) is None
    # A grant sent anyway is refused by the coordinator, and the view says it did not count.
    grant = ledger.grant(req)
    assert [o.reason for o in rejections(h.feed(grant))] == ["invalid-transition"]
    state.apply(grant)
    assert [u.approval_id for u in saga.uncounted_decisions] == [req.approval_id]


def test_a_compensation_approval_past_its_reversal_window_is_not_pending_R13() -> None:
    """R13: the reversal window of a step awaiting its compensation approval passes; the
    coordinator hands the step to a person and no longer waits for a grant. Another
    compensation is still out, so the saga has not ended, and the dashboard kept the
    request among the pending ones, with an Approve button whose grant was refused."""
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(
        ledger.scheduled(
            "hold",
            depends_on=[],
            reversal_window_ms=1_000,
            compensation_approval=CompensationApproval.REQUIRE,
        ),
        ledger.committed("hold"),
    )
    h.feed(
        ledger.scheduled("ship", depends_on=[], completion_within_ms=10**9),
        ledger.committed("ship"),
    )
    h.feed(ledger.scheduled("check", depends_on=[]), ledger.intent("check"))
    out = h.feed(ledger.failed("check", kind=FailureKind.BUSINESS_REJECTION))
    [req] = approval_requests(out)
    assert req.step_id == "hold" and compensates(out) == ["ship"]
    h.feed(ledger.comp_accepted("ship"))
    h.advance(2_000)  # past hold's reversal window
    assert h.status("hold") == "COMPENSATION_FAILED" and not h.s.is_terminal
    assert [(a.decision, a.step_id) for a in h.s.approvals] == [("WITHDRAWN", "hold")]
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    assert state.pending_approvals() == [] and state.expired_approvals() == []
    assert state.sagas[ledger.saga_id].steps["hold"].open_span(SpanKind.APPROVAL) is None
    assert [o.reason for o in rejections(h.feed(ledger.grant(req)))] == ["invalid-transition"]


def test_the_client_knows_the_coordinator_by_its_producer_name() -> None:
    """The agent's client tells a request the coordinator withdrew from a person's denial
    by the coordinator's producer name, which it cannot import (layers)."""
    from coordinator import COORDINATOR_PRODUCER
    from participants import client

    assert client._COORDINATOR == COORDINATOR_PRODUCER


def test_an_unknown_outcome_settled_by_the_ledger_closes_its_incident() -> None:
    """R11: once the step's commit is read (or a lookup answers), the coordinator marks
    the open unknown-outcome incidents of that step resolved without writing a record;
    the page went on listing the incident, asking a person whether the effect happened."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.intent("hold"))
    [incident] = incidents(h.feed(ledger.unknown("hold")))
    h.feed(ledger.committed("hold"))
    assert [i.resolved for i in h.s.incidents] == [True]
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    assert state.open_incidents() == []
    saga = state.sagas[ledger.saga_id]
    assert "COMMITTED" in saga.settled_incidents[incident.incident_id]
    page = TestClient(create_app(state, clock=lambda: ledger.clock)).get("/").text
    assert f'id="resolve-{incident.incident_id}"' not in page


def test_a_person_settling_one_unknown_outcome_closes_every_incident_of_the_step() -> None:
    """A participant's no-lookup incident and one asked again stand for one question."""
    script = unknown_outcome()
    first = next(r for r in script.records if isinstance(r, IncidentRaised))
    second = script.incident("2", "unknown-outcome-no-lookup", owner="warehouse-oncall")
    state = DashboardState()
    for record in script.records:
        state.apply(record)
    assert len(state.open_incidents()) == 2
    state.apply(incident_resolved(first, operator="bob", resolution="NOT_FOUND", now=T0 + 9_000))
    assert state.open_incidents() == []
    assert "NOT_FOUND" in state.sagas["s-unknown"].settled_incidents[second]


def test_a_new_generation_keeps_the_saga_as_the_coordinator_does_R15() -> None:
    """A new run (generation) of a saga continues its steps: the coordinator keeps them
    and asks again who must settle an unknown outcome. The view started the saga afresh:
    the committed step vanished and the saga showed "running" while a person was asked."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.intent("hold"))
    h.feed(ledger.committed("hold"), ledger.scheduled("wire"), ledger.intent("wire"))
    [old] = incidents(h.feed(ledger.unknown("wire")))
    [new] = incidents(h.feed(ledger.started(generation=2)))
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    saga = state.sagas[ledger.saga_id]
    assert h.status("hold") == "COMMITTED" and h.status("wire") == "UNKNOWN"
    assert saga.generation == 2
    assert {k: v.state for k, v in saga.steps.items()} == {"hold": "committed", "wire": "unknown"}
    assert saga.status is SagaStatus.UNKNOWN_OUTCOME
    # The old run's incident is superseded (its resolution would be stale): only the new.
    assert [i.incident_id for _, i in state.open_incidents()] == [new.incident_id]
    assert new.incident_id in saga.settled_incidents[old.incident_id]


def test_a_record_of_a_later_generation_alone_does_not_make_the_current_run_stale() -> None:
    """Only a SagaStarted begins a new generation (the coordinator's rule); a copy read
    early from another topic moved the view's generation and every record of the current
    run read after it was dropped as stale."""
    script = running()
    early = script.records[-1].model_copy(
        update={"envelope": script.records[-1].envelope.model_copy(
            update={"generation": 2, "event_id": "gen2-early"})}
    )  # fmt: skip
    state = DashboardState()
    for record in [*script.records[:2], early, *script.records[2:]]:
        state.apply(record)
    assert state.stale_records == 0
    assert state.sagas["s-running"].steps["2"].state == "running"


def test_a_commit_after_an_escalation_past_the_pivot_closes_its_incident() -> None:
    """R6, R14: a step escalated after the pivot ("forward-failed-after-pivot": still
    owed) that commits after all is settled by the ledger; the coordinator marks the
    incident resolved without a record (coordinator 32ddeca), the page kept it open."""
    s = SagaScript("s-late").start()
    s.run("1", "issue_credit", amount_cents=2_500)
    s.schedule("2", "restock_inventory")
    s.intent("2")
    s.fail("2", FailureKind.TRANSIENT)
    incident_id = s.incident("2", "forward-failed-after-pivot")
    s.commit("2")
    state = DashboardState()
    for record in s.records:
        state.apply(record)
    assert state.open_incidents() == []
    assert "COMMITTED" in state.sagas["s-late"].settled_incidents[incident_id]


# ------------------------------------------------------ records the coordinator refuses


def _forged(record: Any, **envelope: Any) -> Any:
    return record.model_copy(
        update={"envelope": record.envelope.model_copy(update={"event_id": "forged", **envelope})}
    )


@pytest.mark.parametrize(
    ("forge", "bound"),
    [
        (lambda ledger: _forged(ledger.committed("hold"), producer="mallory"), True),
        (lambda ledger: _forged(ledger.committed("hold"), tenant_id="globex"), False),
        (lambda ledger: _forged(ledger.end(SagaOutcome.ABORT), producer="mallory"), True),
    ],
    ids=["other-participant", "other-tenant", "other-agent"],
)
def test_a_record_the_coordinator_refuses_is_not_shown_as_fact(forge: Any, bound: bool) -> None:
    """With a trust file the coordinator takes a step's outcome only from the step's
    participant and the saga's course only from the agent that started it, and any
    record only for the saga's tenant (FORBIDDEN_WRITER / TENANT_MISMATCH, to the DLQ);
    the page showed such a record as what happened."""
    ledger, _ = fresh()
    records = [ledger.started(), ledger.scheduled("hold"), ledger.intent("hold")]
    forged = forge(ledger)
    policy = CorePolicy(bind_writers=bound)
    saga_state = None
    for i, record in enumerate([*records, forged]):
        decision = decide(saga_state, record, ledger.clock + i, policy)
        saga_state = decision.state
    assert saga_state is not None and saga_state.steps["hold"].status.value != "COMMITTED"
    assert saga_state.status.value == "RUNNING"
    assert {"forbidden-writer", "tenant-mismatch"} & {o.reason for o in decision.outputs}
    state = DashboardState(bind_writers=bound)
    for record in [*records, forged]:
        state.apply(record)
    saga = state.sagas[ledger.saga_id]
    assert saga.steps["hold"].state == "running" and saga.end_requested is None
    assert saga.status is SagaStatus.RUNNING and len(saga.refused) == 1
    page = TestClient(create_app(state, clock=lambda: ledger.clock)).get(f"/sagas/{ledger.saga_id}")
    assert "refused by the coordinator" in page.text and "forged" in page.text


@pytest.mark.parametrize(
    "spoil",
    [
        lambda g: g.model_copy(update={"args_fingerprint": "0" * 32}),
        lambda g: g.model_copy(update={"principal": "agent-evil"}),
        _late,
    ],
    ids=["fingerprint", "principal", "expired"],
)
def test_a_decision_the_view_marks_not_counted_is_not_measured_either(spoil: Any) -> None:
    """The coordinator rejects such a grant (APPROVAL_MISMATCH, to the DLQ) and its
    measures do not fold it; the dashboard listed it as "not counted" yet its
    ``sagaline_manual_interventions`` counted an ``approval_granted``."""
    state = _state("awaiting_approval")
    _, req = state.pending_approvals()[0]
    before = state.metrics.snapshot().manual_interventions.get("approval_granted", 0)
    state.apply(spoil(approval_granted(req, operator="bob", now=req.expires_at - 10)))
    denial = approval_denied(req, operator="bob", reason="no", now=req.expires_at - 10)
    state.apply(denial.model_copy(update={"approval_id": "apr-another"}))
    assert len(state.sagas["s-awaiting"].uncounted_decisions) == 2
    measured = state.metrics.snapshot().manual_interventions
    assert measured.get("approval_granted", 0) == before
    assert measured.get("approval_denied", 0) == 0
    # A grant the coordinator counts is still measured (its own event id: the
    # spoiled copy above took the one derived from the request).
    state.apply(_forged(approval_granted(req, operator="bob", now=req.expires_at - 10)))
    assert state.metrics.snapshot().manual_interventions["approval_granted"] == before + 1


@pytest.mark.parametrize(
    ("resolution", "settled"),
    [(" committed ", "committed"), ("rebooted the box", None)],
    ids=["lower-case-committed", "free-text"],
)
def test_an_unknown_outcome_resolution_is_read_as_the_coordinator_reads_it(
    resolution: str, settled: str | None
) -> None:
    """R11: the coordinator reads a resolution of an unknown outcome case-blind
    (" committed " commits the step) and rejects any other text while the step is
    unsettled, so the incident stays open. The page kept the step "unknown outcome"
    for the first, and for the second dropped the incident (and its Resolve button)
    while the coordinator went on waiting for a person."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.intent("hold"))
    [incident] = incidents(h.feed(ledger.unknown("hold")))
    out = h.feed(ledger.resolve(incident.incident_id, resolution))
    assert bool(rejections(out)) is (settled is None)
    coordinator_open = [i.incident_id for i in h.s.incidents if not i.resolved]
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    saga = state.sagas[ledger.saga_id]
    assert [i.incident_id for _, i in state.open_incidents()] == coordinator_open
    assert saga.steps["hold"].state == (settled or "unknown")
    assert saga.status is (SagaStatus.UNKNOWN_OUTCOME if settled is None else SagaStatus.RUNNING)
    measured = state.metrics.snapshot().manual_interventions
    assert measured.get("incident_resolved", 0) == (0 if settled is None else 1)


def test_a_terminal_copy_read_early_does_not_uncount_a_grant_made_before_it() -> None:
    """The compacted terminal topic is read alongside the ledger, so on a restart a
    saga's SagaTerminal can arrive between its ApprovalRequested and the grant (both
    earlier in the ledger). The grant, counted by the coordinator, was then listed as
    "not counted" (and left out of the measures)."""
    records = completed().records
    requested = next(i for i, r in enumerate(records) if isinstance(r, ApprovalRequested))
    term = next(r for r in records if isinstance(r, SagaTerminal))
    state = DashboardState()
    for i, record in enumerate(records):
        state.apply(record)
        if i == requested:
            state.apply(term, from_ledger=False)  # the terminal topic's copy, read early
    saga = state.sagas["s-completed"]
    assert saga.status is SagaStatus.COMPLETED and saga.uncounted_decisions == []
    assert state.metrics.snapshot().manual_interventions == {"approval_granted": 1}


def test_a_grant_after_the_saga_ended_in_the_ledger_is_not_counted() -> None:
    """The coordinator leaves a record of a saga that has ended alone."""
    script = awaiting_approval()
    req = next(r for r in script.records if isinstance(r, ApprovalRequested))
    script.terminal(TerminalStatus.COMPLETED)
    state = DashboardState()
    for record in script.records:
        state.apply(record)
    state.apply(approval_granted(req, operator="bob", now=req.expires_at - 10))
    saga = state.sagas["s-awaiting"]
    assert [u.kind for u in saga.uncounted_decisions] == ["grant"]
    assert state.metrics.snapshot().manual_interventions.get("approval_granted", 0) == 0


def test_a_saga_whose_id_has_a_slash_gets_its_page_and_its_actions() -> None:
    """Agents choose saga ids (``client.saga(..., saga_id="orders/42")``): with a ``/``
    in it the saga's links, its timeline and the Approve / Deny / Resolve buttons all
    answered 404, so a person could not decide for it from the dashboard."""
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in [*awaiting_approval("orders/42").records, *unknown_outcome("io/7").records]:
        state.apply(record)
    channel = RecordingChannel()
    client = TestClient(create_app(state, channel, clock=lambda: T0))  # type: ignore[arg-type]
    overview = client.get("/").text
    page = client.get("/sagas/orders/42")
    assert page.status_code == 200 and "<svg" in page.text and 'data-step="2"' in page.text
    assert client.get("/sagas/orders/42/timeline.svg").text.startswith("<svg")
    assert 'data-step="2"' in client.get("/fragment/saga/orders/42").text
    actions = re.findall(r'(?:action|formaction)="(/(?:approvals|incidents)/[^"]+)"', overview)
    assert len(actions) == 3, actions  # grant, deny, resolve
    forms = {"grant": {}, "deny": {"reason": "no"}, "resolve": {"resolution": "NOT_FOUND"}}
    for path in actions:
        form = {"operator": "alice", **forms[path.rsplit("/", 1)[1]]}
        response = client.post(html.unescape(path), data=form, follow_redirects=False)
        assert response.status_code == 303, (path, response.status_code)
    assert [r.saga_id for r in channel.published] == ["orders/42", "orders/42", "io/7"]  # type: ignore[attr-defined]


def _two_runs_ended() -> list[Any]:
    """A saga whose agent restarted (generation 2) while a step's outcome was unknown:
    the new run asks a person again, who settles it, and the saga completes."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.intent("hold"))
    h.feed(ledger.committed("hold"), ledger.scheduled("wire"), ledger.intent("wire"))
    incidents(h.feed(ledger.unknown("wire")))
    ledger.generation = 2
    [asked_again] = incidents(h.feed(ledger.started(generation=2)))
    h.feed(ledger.resolve(asked_again.incident_id, "COMMITTED"))
    h.feed(ledger.end(SagaOutcome.COMPLETE))
    assert isinstance(h.log[-1], SagaTerminal) and h.log[-1].envelope.generation == 2
    return h.log


@pytest.mark.parametrize("early", ["terminal", "incidents", "terminal-mid-ledger"])
def test_a_restart_shows_a_saga_of_two_runs_as_it_was_before(early: str) -> None:
    """A restarted dashboard reads the short terminal and incident topics alongside the
    ledger, so their copies of a saga's later records arrive before its earlier ledger
    records. A copy of generation 2 read first made every record of the first run stale
    (its steps shown only from the receipt, its time in unknown state lost), and a
    terminal copy read before the ledger's second SagaStarted made that start look like
    a late start of an ended saga (the page said generation 1)."""
    log = _two_runs_ended()

    def fold(order: list[tuple[Any, bool]]) -> tuple[Any, ...]:
        state = DashboardState(SagalineMetrics("dashboard"))
        for record, from_ledger in order:
            state.apply(record, from_ledger=from_ledger)
        (saga,) = state.sagas.values()
        steps = {k: (v.state, v.attempts, len(v.spans)) for k, v in saga.steps.items()}
        measures = state.metrics.snapshot()
        return (
            saga.status,
            saga.generation,
            saga.record_count,
            steps,
            state.stale_records,
            measures.time_in_unknown,
            measures.manual_interventions,
        )

    ledger = [(r, True) for r in log]
    if early == "terminal-mid-ledger":
        restart = [*ledger[:5], (log[-1], False), *ledger[5:]]
    else:
        kind = SagaTerminal if early == "terminal" else IncidentRaised
        restart = [*[(r, False) for r in log if isinstance(r, kind)][-1:], *ledger]
    live = fold(ledger)
    assert live[:2] == (SagaStatus.COMPLETED, 2) and live[4] == 0
    assert fold(restart) == live
    # The terminal topic alone (the ledger expired) still says which run ended.
    state = DashboardState()
    state.apply(log[-1], from_ledger=False)
    page = TestClient(create_app(state)).get(f"/sagas/{log[-1].saga_id}").text
    # (the saga's facts, then the receipt's)
    assert re.findall(r"<tr><th>generation</th><td>(\d+)</td></tr>", page) == ["2", "2"]


def test_an_effect_measure_that_raises_neither_hides_the_step_nor_stops_the_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """R16: the deployment's effect measure reads a tool's arguments; one that raised on
    arguments it did not expect made ``observe_record`` raise: the dashboard skipped the
    StepScheduled as a fold error (the step was missing from the saga's page) and the
    coordinator's loop, which calls it outside its per-record guard, stopped on it."""

    def broken(step: Any) -> int | None:
        raise KeyError("amount")

    state = DashboardState(SagalineMetrics("dashboard", effect=broken))
    for record in completed().records:
        state.apply(record)
    saga = state.sagas["s-completed"]
    assert saga.status is SagaStatus.COMPLETED
    assert "?" not in {s.tool for s in saga.steps.values()}
    coordinator = CoordinatorMetrics(effect=broken)
    for record in escalated().records:
        coordinator.observe_record(record)
    assert coordinator.snapshot().sagas_terminal == {"ESCALATED": 1}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "KeyError" in warnings[0].getMessage()  # once each


def test_the_overview_lists_a_bounded_number_of_open_incidents() -> None:
    """Escalated sagas' incidents stay open until a person resolves them, and every
    open page fetches the "Needs a person" region again every two seconds: it listed
    every one of them (20 000 escalations: 14 MB per fetch, per page), while the saga
    list beside it stops at 500. It lists the oldest 200 (``ACTIONS_SHOWN``) and counts
    all."""
    shown = 200  # services.dashboard.app.ACTIONS_SHOWN
    state = DashboardState(SagalineMetrics("dashboard"))
    for n in range(shown + 30):
        for record in escalated(f"s-esc-{n:04d}").records:
            state.apply(record)
    total = len(state.open_incidents())
    assert total > shown
    client = TestClient(create_app(state, clock=lambda: T0))
    region = client.get("/fragment/actions").text
    assert region.count('<li class="incident"') == shown
    assert f"Open incidents ({total})" in region
    assert f"{total - shown} more not shown" in region
    oldest = state.open_incidents()[0][1].incident_id
    assert f'data-incident="{oldest}"' in region
    # A saga's own page still offers each of its incidents.
    last = f"s-esc-{shown + 29:04d}"
    own = [i for s, i in state.open_incidents() if s.saga_id == last]
    page = client.get(f"/sagas/{last}").text
    assert own and all(f'data-incident="{i.incident_id}"' in page for i in own)


def test_a_verification_not_reported_is_not_shown_as_compensated_R12() -> None:
    """R12: a tool that declares a verification is undone only once it passes. A
    completion reported without one (the participant no longer serves the tool when
    the provider's receipt arrives) is a failed compensation for the coordinator: an
    incident, the saga ESCALATED. The dashboard's steps table and timeline said
    "compensated", beside the receipt saying its verification FAILED."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold", has_verify=True), ledger.intent("hold"))
    h.feed(ledger.committed("hold"))
    assert compensates(h.feed(ledger.end(SagaOutcome.ABORT, "the agent gave up"))) == ["hold"]
    h.feed(ledger.comp_committed("hold", verified=None))
    assert h.status("hold") == "COMPENSATION_FAILED"
    assert h.s.is_terminal and h.s.status.value == "ESCALATED"
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    step = state.sagas[ledger.saga_id].steps["hold"]
    assert step.state == "compensation failed"
    assert [s.outcome for s in step.spans if s.kind is SpanKind.COMPENSATION] == [
        "verification failed"
    ]


def test_a_completion_after_the_coordinator_gave_up_is_not_shown_as_compensated_R12() -> None:
    """R12: an accepted compensation whose completion does not come within the declared
    wait is handed to a person (an incident; the saga ends ESCALATED). The provider's
    completion read after that changes nothing for the coordinator: the incident stays
    open for a person. The dashboard kept the step "compensating" once the coordinator
    had given up, then showed it "compensated" on the late completion, while the same
    page listed it as escalated and its incident as open."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("ship", completion_within_ms=1_000))
    h.feed(ledger.intent("ship"), ledger.committed("ship"))
    assert compensates(h.feed(ledger.end(SagaOutcome.ABORT, "the agent gave up"))) == ["ship"]
    h.feed(ledger.comp_accepted("ship"))
    assert [i.kind for i in incidents(h.advance(2_000))] == ["compensation-not-completed"]
    assert h.status("ship") == "COMPENSATION_FAILED" and h.s.is_terminal
    state = DashboardState()
    for record in h.log:
        state.apply(record)
    step = state.sagas[ledger.saga_id].steps["ship"]
    assert step.state == "compensation failed"
    assert step.open_span(SpanKind.COMPENSATION) is None
    late = ledger.comp_committed("ship")
    h.feed(late)
    assert h.status("ship") == "COMPENSATION_FAILED"
    assert [i.resolved for i in h.s.incidents] == [False]
    state.apply(late)
    assert step.state == "compensation failed"
    assert len(state.open_incidents()) == 1
    # A restart reads the incident feed's copy before the ledger's earlier records.
    restarted = DashboardState()
    for record in incidents(h.outputs):
        restarted.apply(record, from_ledger=False)
    for record in h.log:
        restarted.apply(record)
    assert restarted.sagas[ledger.saga_id].steps["ship"].state == "compensation failed"


class _BoundCore:
    """The coordinator's core with a trust file (records told apart by their writer),
    fed one record at a time at its own time; ``log``: what the ledger then holds."""

    def __init__(self) -> None:
        self.policy = CorePolicy(bind_writers=True)
        self.log: list[Any] = []
        self.state: SagaState | None = None

    def feed(self, record: Any) -> list[Any]:
        self.log.append(record)
        taken = decide(self.state, record, record.envelope.occurred_at, self.policy)
        self.state = taken.state
        self.log.extend(o.record for o in taken.outputs if o.appends_to_events)
        return taken.outputs

    def view(self) -> DashboardState:
        """The dashboard's view (writers bound too) of the ledger so far."""
        state = DashboardState(bind_writers=True)
        for record in self.log:
            state.apply(record)
        return state


@pytest.mark.parametrize("decision", ["grant", "denial"])
def test_a_writer_cannot_hide_an_operators_decision_from_the_page_R7_R15(decision: str) -> None:
    """An operator's decision has an event id derived from what every reader of the saga
    sees (saga, approval id, operator), so the saga's own agent can write a record of its
    own (a harmless repeat of its step) under that id first. With a trust file the
    coordinator remembers event ids per verified writer (``coordinator.core.dedup_key``)
    and acts on the operator's decision; the dashboard deduplicated by bare event id, so
    it dropped the real decision as a duplicate, kept the request pending (with its
    Approve button) and did not measure the intervention."""
    ledger, _ = fresh()
    core = _BoundCore()
    core.feed(ledger.started())
    wire = ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE)
    [req] = approval_requests(core.feed(wire))
    now = req.envelope.occurred_at + 1
    real = (
        approval_granted(req, operator="alice", now=now, producer="alice")
        if decision == "grant"
        else approval_denied(req, operator="alice", reason="no", now=now, producer="alice")
    )
    assert rejections(core.feed(_forged(wire, event_id=real.event_id))) == []
    core.feed(real)
    core.feed(real)  # a retry of the same decision: still one
    assert core.state is not None
    acted = core.state.steps["wire"].status.value
    assert acted != "AWAITING_APPROVAL"

    state = core.view()
    saga = state.sagas[ledger.saga_id]
    assert state.pending_approvals() == [], "the operator's decision was dropped"
    assert saga.steps["wire"].state == ("approved" if decision == "grant" else "denied")
    assert state.ledger_duplicates == 1  # the retry, and nothing else
    measured = state.metrics.snapshot().manual_interventions
    assert measured == {f"approval_{'granted' if decision == 'grant' else 'denied'}": 1}


def test_another_writers_resolution_under_the_operators_id_is_listed_as_refused_R11_R15() -> None:
    """With a trust file a record is the same fact only when its writer is the same
    (``coordinator.core.dedup_key``). A resolution written by the saga's agent under the
    (predictable) id of the operator's resolution, after it, is another record, which
    the coordinator refuses (the incident is already resolved). The view took it for the
    incident feed's copy of the operator's resolution (same event id): not listed as
    refused, and measured as a second manual intervention."""
    ledger, _ = fresh()
    core = _BoundCore()

    def answering(record: Any, command: Any) -> Any:
        envelope = record.envelope.model_copy(update={"causation_id": command.event_id})
        return record.model_copy(update={"envelope": envelope})

    core.feed(ledger.started())
    [execute] = [o.record for o in core.feed(ledger.scheduled("hold")) if o.participant]
    core.feed(answering(ledger.intent("hold"), execute))
    [incident] = incidents(core.feed(answering(ledger.unknown("hold"), execute)))
    real = incident_resolved(
        incident, operator="alice", resolution="NOT_FOUND", now=ledger.clock + 1, producer="alice"
    )
    core.feed(real)
    forged = _forged(ledger.resolve(incident.incident_id, "COMMITTED"), event_id=real.event_id)
    forged = forged.model_copy(
        update={"envelope": forged.envelope.model_copy(update={"producer": "agent"})}
    )
    assert [o.reason for o in rejections(core.feed(forged))] == ["invalid-transition"]

    state = core.view()
    saga = state.sagas[ledger.saga_id]
    assert saga.steps["hold"].state == "failed"
    assert len(saga.refused) == 1 and "already resolved" in saga.refused[0]
    assert state.metrics.snapshot().manual_interventions == {"incident_resolved": 1}


def _window_settled_after_it_passed() -> tuple[Any, Any, str]:
    """booking's compensation is in flight when its reversal window passes (an
    incident), then completes, verified: the coordinator settles the incident (R13,
    ``coordinator.core._undone_after_window``) and the saga ends COMPENSATED."""
    from coordinator_ledger import receipt_of

    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("booking", reversal_window_ms=1_000, has_verify=True),
        ledger.committed("booking"),
        ledger.scheduled("boom"),
        ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION),
    )
    window = h.s.steps["booking"].reversal_deadline
    assert window is not None
    [raised] = incidents(h.advance(window - h.now))
    assert raised.kind == "reversal-window-expired"
    receipt = receipt_of(h.feed(ledger.comp_committed("booking", verified=True)))
    assert receipt.status is TerminalStatus.COMPENSATED
    return ledger, h, raised.incident_id


def test_an_incident_the_coordinator_settled_is_not_left_needing_a_person_R13_R14() -> None:
    """The coordinator settled the reversal window's incident itself (the compensation
    completed after all) and the saga ended COMPENSATED, its receipt saying so. The
    view settled it only for the cases it mirrors (an unknown outcome's commit), so the
    incident stayed under "Needs a person" with its Resolve button, the saga was never
    dropped from memory, and operators chased an incident that needed nothing."""
    ledger, h, incident_id = _window_settled_after_it_passed()
    how = "COMPENSATED and verified (observed in the ledger)"

    # From the ledger alone (the incident feed expired, or not read yet).
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        state.apply(record)
    assert state.open_incidents() == []
    assert state.sagas[ledger.saga_id].settled_incidents == {incident_id: how}

    # Live: the incident feed (the coordinator's note that it settled the incident) is
    # read before the ledger's last records.
    feed = [o.record for o in h.outputs if o.destination.value.startswith("INCIDENT")]
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log[:-1]:  # all but the SagaTerminal
        state.apply(record)
    for record in feed:
        state.apply(record, from_ledger=False)
    saga = state.sagas[ledger.saga_id]
    assert state.open_incidents() == [] and saga.settled_incidents == {incident_id: how}
    page = TestClient(create_app(state)).get(f"/sagas/{ledger.saga_id}").text
    assert f"{incident_id}" in page and "settled by the coordinator" in page
    assert html.escape(how) in page
