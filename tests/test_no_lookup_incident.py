"""R11 when the participant cannot look an unknown outcome up: no broker.

The contract a step was scheduled under is the catalogue's snapshot at the time: it
may say the tool has a lookup while the participant now serving it (redeployed, or an
older replica) declares none. The coordinator then sends a ``ReconcileStep`` and the
participant's runtime answers with an incident of kind ``unknown-outcome-no-lookup``
instead of a ``StepReconciled``. The step must not move on until a person settles it,
and the person's COMMITTED or NOT_FOUND must settle it, as it does for the incident
the coordinator raises itself. These tests walk the real records: the core's command,
the runtime's answer (the real ``CommandHandler``), the operator's resolution (the
builder the CLI and the dashboard use).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from coordinator_ledger import (
    Harness,
    Ledger,
    commands,
    compensates,
    executes,
    fresh,
    incidents,
    rejections,
    terminal,
)

from coordinator import fold
from participants import CompensationContext, LookupResult, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal
from sagaline.ops.actions import OperatorActionError, incident_resolved
from schemas import (
    ExecuteStep,
    IncidentRaised,
    ReconcileStep,
    Record,
    SagaOutcome,
    StepReconciled,
    StepRetryScheduled,
)
from services.dashboard.app import _incident_html
from services.dashboard.view import DashboardState

NO_LOOKUP = "unknown-outcome-no-lookup"


class _PaymentsV1:
    """The payments participant when the step was scheduled: it had a lookup."""

    @tool(description="Take a payment", lookup="find_payment")
    @compensable(by="refund")
    def pay(self, cents: int) -> dict[str, str]:
        return {"payment": "p-1"}

    def refund(self, ctx: CompensationContext) -> None:
        pass

    def find_payment(self, idempotency_key: str) -> LookupResult | None:
        return None


class _PaymentsV2:
    """The payments participant now serving the command: its lookup is gone."""

    @tool(description="Take a payment")
    @compensable(by="refund")
    def pay(self, cents: int) -> dict[str, str]:
        return {"payment": "p-1"}

    def refund(self, ctx: CompensationContext) -> None:
        pass


def _payments_now(tmp_path: Path) -> tuple[CommandHandler, list[Record]]:
    out: list[Record] = []
    handler = CommandHandler(
        wrap(_PaymentsV2(), name="payments"),
        "payments",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
        ledger=None,
    )
    return handler, out


def _scheduled_with_lookup(ledger: Ledger, h: Harness) -> None:
    """pay (scheduled under the catalogue that had a lookup), then email after it."""
    pay = ledger.scheduled("pay", args={"cents": 500})
    pay = pay.model_copy(
        update={"contract": wrap(_PaymentsV1(), name="payments")["pay"].contract()}
    )
    ledger.steps["pay"] = pay
    assert pay.contract.has_lookup and pay.contract.participant == "payments"
    out = h.feed(ledger.started(), pay, ledger.scheduled("email", depends_on=["pay"]))
    assert executes(out) == ["pay"]


def _participant_cannot_look_up(
    tmp_path: Path, generation: int = 1
) -> tuple[Ledger, Harness, IncidentRaised]:
    """pay timed out; the core asks payments to look it up; payments has no lookup."""
    ledger, h = fresh(generation=generation)
    _scheduled_with_lookup(ledger, h)
    h.feed(ledger.intent("pay"))
    out = h.feed(ledger.unknown("pay"))
    [reconcile] = commands(out, ReconcileStep)
    assert h.status("pay") == "RECONCILING"
    handler, answers = _payments_now(tmp_path)
    try:
        assert isinstance(reconcile, ReconcileStep)
        handler.handle(reconcile)
    finally:
        handler.close()
    # What the runtime writes for a reconcile it cannot do: one incident, no reconciled.
    assert [type(r) for r in answers] == [IncidentRaised]
    [incident] = answers
    assert isinstance(incident, IncidentRaised)
    assert incident.kind == NO_LOOKUP and incident.step_id == "pay"
    assert incident.envelope.causation_id == reconcile.event_id
    out = h.feed(incident)
    assert rejections(out) == [], out
    return ledger, h, incident


def test_the_step_waits_for_a_person_while_nobody_can_look_it_up_R11(tmp_path: Path) -> None:
    ledger, h, incident = _participant_cannot_look_up(tmp_path)
    out = h.feed(ledger.end())
    assert executes(out) == [] and terminal(h.outputs) is None
    assert h.status("pay") == "UNKNOWN"
    assert h.s.steps["pay"].incident_id == incident.incident_id
    assert incidents(h.outputs) == []  # the participant asked; the core does not ask twice
    assert h.s.next_due_at() is None  # nothing but the person's answer moves it


def test_resolving_the_no_lookup_incident_committed_lets_the_saga_go_on_R11(
    tmp_path: Path,
) -> None:
    ledger, h, incident = _participant_cannot_look_up(tmp_path)
    resolution = incident_resolved(
        incident,
        operator="carol",
        resolution="committed",
        now=h.now,
        operation_id="pay-op-7",
        result_json='{"payment": "p-7"}',
    )
    out = h.feed(resolution)
    assert rejections(out) == [], out
    assert h.status("pay") == "COMMITTED", h.s.steps["pay"]
    assert h.s.steps["pay"].observation == "RESOLVED_COMMITTED"
    assert h.s.steps["pay"].provider_operation_id == "pay-op-7"
    assert h.s.open_incidents() == []
    assert executes(out) == ["email"]
    # Committed means it is compensated (after email, which depends on it) on an abort.
    assert compensates(h.feed(ledger.committed("email"), ledger.end(SagaOutcome.ABORT))) == [
        "email"
    ]
    assert compensates(h.feed(ledger.comp_committed("email"))) == ["pay"]


def test_resolving_the_no_lookup_incident_not_found_retries_with_the_same_key_R11(
    tmp_path: Path,
) -> None:
    ledger, h, incident = _participant_cannot_look_up(tmp_path)
    out = h.feed(incident_resolved(incident, operator="carol", resolution="NOT_FOUND", now=h.now))
    assert rejections(out) == [], out
    assert h.status("pay") == "RETRY_WAIT", h.s.steps["pay"]
    assert [o.record.attempt for o in out if isinstance(o.record, StepRetryScheduled)] == [2]
    assert h.s.open_incidents() == []
    retry = [r for r in commands(h.run_timers(), ExecuteStep) if isinstance(r, ExecuteStep)]
    assert [(r.step_id, r.attempt, r.idempotency_key) for r in retry] == [
        ("pay", 2, ledger.key("pay"))
    ]


def test_the_no_lookup_incident_takes_only_committed_or_not_found(tmp_path: Path) -> None:
    """The CLI and the dashboard build the resolution with ``incident_resolved``; it and
    the dashboard's form offer only the two answers that settle the step."""
    _ledger, h, incident = _participant_cannot_look_up(tmp_path)
    with pytest.raises(OperatorActionError, match="COMMITTED"):
        incident_resolved(incident, operator="carol", resolution="looked fine", now=h.now)
    dashboard = DashboardState()
    assert all(dashboard.apply(r) for r in h.log)
    saga = dashboard.sagas[h.s.saga_id]
    html = _incident_html(saga, incident, "/")
    assert 'value="COMMITTED"' in html and 'value="NOT_FOUND"' in html
    # A raw free-text resolution (not via the CLI) does not pass for a settlement.
    out = h.feed(_ledger.resolve(incident.incident_id, "looked fine"))
    assert h.status("pay") == "UNKNOWN"
    assert [o.reason for o in rejections(out)] == ["invalid-transition"]


def test_the_fold_of_the_ledger_settles_the_step_the_same_way_R11(tmp_path: Path) -> None:
    _ledger, h, incident = _participant_cannot_look_up(tmp_path)
    h.feed(incident_resolved(incident, operator="carol", resolution="COMMITTED", now=h.now))
    assert fold(h.log)[h.s.saga_id].to_bytes() == h.s.to_bytes()


def test_a_new_generation_asks_again_for_the_no_lookup_step_R11_R15(tmp_path: Path) -> None:
    ledger, h, first = _participant_cannot_look_up(tmp_path)
    ledger.generation = 2
    out = h.feed(ledger.started())
    [again] = incidents(out)
    assert again.envelope.generation == 2 and again.step_id == "pay"
    assert again.kind == first.kind  # the CLI shows the old one superseded by this one
    assert commands(out, ReconcileStep) == []  # nobody can look it up: a person is asked
    stale = incident_resolved(first, operator="carol", resolution="COMMITTED", now=h.now)
    assert [o.reason for o in rejections(h.feed(stale))] == ["stale-generation"]
    out = h.feed(incident_resolved(again, operator="carol", resolution="COMMITTED", now=h.now))
    assert h.status("pay") == "COMMITTED" and executes(out) == ["email"]
    assert h.s.open_incidents() == []


def test_a_late_reconciled_answer_still_settles_the_step_R11(tmp_path: Path) -> None:
    """A replica that still had the lookup answers after the one that had none: its
    answer settles the step and the incident with it."""
    from schemas import ReconcileResult

    ledger, h, _incident = _participant_cannot_look_up(tmp_path)
    late = ledger.reconciled("pay", ReconcileResult.COMMITTED)
    assert isinstance(late, StepReconciled)
    out = h.feed(late)
    assert h.status("pay") == "COMMITTED" and executes(out) == ["email"]
    assert h.s.open_incidents() == []
