"""Approvals across a saga's generations (R7, R15), with the operator's own record
builders and the dashboard fold: no broker.

A higher-generation ``SagaStarted`` supersedes the run, so every record of the old
generation is stale from then on. An approval the step still waits on must therefore
be asked again under the new generation, with ids of its own: otherwise the operator
can only grant the old request (the grant inherits its stale generation and is
rejected), and a retried grant has the event id of the rejected one (a duplicate).
"""

from __future__ import annotations

import pytest
from coordinator_ledger import (
    Harness,
    Ledger,
    approval_requests,
    executes,
    fresh,
    incidents,
    receipt_of,
    rejections,
)

from coordinator import Output, fold
from sagaline.ops.actions import approval_granted, incident_resolved
from sagaline.ops.metrics import SagalineMetrics
from schemas import (
    ApprovalPurpose,
    ApprovalRequested,
    CompensationApproval,
    CompensationRequested,
    ExecuteStep,
    FailureKind,
    IncidentRaised,
    IncidentResolved,
    Record,
    Reversibility,
    derived_event_id,
)
from schemas.settings import Settings
from services import coordinator_cli
from services.cli import main
from services.coordinator_cli import _pending_request, superseded_incidents
from services.dashboard.view import DashboardState


def _awaiting_wire() -> tuple[Ledger, Harness, ApprovalRequested]:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.committed("hold"))
    [request] = approval_requests(
        h.feed(ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE))
    )
    return ledger, h, request


def _new_generation(ledger: Ledger, h: Harness, generation: int = 2) -> None:
    """The agent restarts the saga as a new run; its later records carry it."""
    ledger.generation = generation
    h.feed(ledger.started())


def _what_the_operator_sees(h: Harness, step_id: str) -> ApprovalRequested:
    """The request ``sagaline approve`` picks: the coordinator's fold of the ledger."""
    state = fold(h.log).get(h.s.saga_id)
    request = _pending_request(h.log, state, step_id, h.now)
    assert isinstance(request, ApprovalRequested), request
    return request


def _why(out: list[Output]) -> str:
    return repr([(o.reason, o.detail) for o in rejections(out)])


def test_first_generation_approval_ids_are_what_they_always_were_R15() -> None:
    """A ledger written before this change folds to the same pending approval."""
    ledger, _h, request = _awaiting_wire()
    assert request.approval_id == "appr-" + derived_event_id(
        ledger.saga_id, "approval", "wire", ApprovalPurpose.FORWARD.value
    )
    assert request.event_id == derived_event_id(
        ledger.saga_id, "ApprovalRequested", request.approval_id
    )


def test_grant_after_a_new_generation_releases_the_step_R7_R15() -> None:
    ledger, h, first = _awaiting_wire()
    _new_generation(ledger, h)
    request = _what_the_operator_sees(h, "wire")
    grant = approval_granted(request, operator="bob", now=h.now + 1)
    out = h.feed(grant)
    assert executes(out) == ["wire"], f"grant not counted: {_why(out)}"
    assert request.envelope.generation == 2 and request.approval_id != first.approval_id
    [command] = [o.record for o in out if isinstance(o.record, ExecuteStep)]
    assert command.envelope.generation == 2 and command.approval_id == request.approval_id


def test_grant_rejected_as_stale_does_not_shadow_the_next_grant_R7_R15() -> None:
    """The operator approved the request they had on screen just as the saga moved to
    a new generation: that grant is stale. Approving again what is pending now counts."""
    ledger, h, first = _awaiting_wire()
    _new_generation(ledger, h)
    stale = approval_granted(first, operator="bob", now=h.now + 1)
    assert [o.reason for o in rejections(h.feed(stale))] == ["stale-generation"]
    again = approval_granted(_what_the_operator_sees(h, "wire"), operator="bob", now=h.now + 1)
    out = h.feed(again)
    assert executes(out) == ["wire"], (
        f"grant not counted: {_why(out)}; its event id {again.event_id} is "
        f"{'that of the rejected grant' if again.event_id == stale.event_id else 'new'}"
    )


def test_identical_grant_replayed_or_double_clicked_still_dedups_R15() -> None:
    _ledger, h, request = _awaiting_wire()
    grant = approval_granted(request, operator="bob", now=h.now + 1)
    click = approval_granted(request, operator="bob", now=h.now + 2)
    assert click.event_id == grant.event_id  # a double click or CLI retry: one fact
    assert executes(h.feed(grant)) == ["wire"]
    before = h.s.to_bytes()
    assert h.feed(grant) == [] and h.feed(click) == []
    assert h.s.to_bytes() == before


def test_each_generation_asks_again_with_its_own_ids_R15() -> None:
    ledger, h, _first = _awaiting_wire()
    _new_generation(ledger, h, 2)
    _new_generation(ledger, h, 3)
    requests = [r for r in h.log if isinstance(r, ApprovalRequested)]
    assert [r.envelope.generation for r in requests] == [1, 2, 3]
    assert len({r.approval_id for r in requests}) == 3
    assert len({r.event_id for r in requests}) == 3
    pending = h.s.steps["wire"].approval
    assert pending is not None and pending.approval_id == requests[-1].approval_id
    # a grant of a superseded request never counts (stale), the current one does
    for old in requests[:-1]:
        out = h.feed(approval_granted(old, operator="bob", now=h.now + 1))
        assert [o.reason for o in rejections(out)] == ["stale-generation"]
    out = h.feed(approval_granted(requests[-1], operator="bob", now=h.now + 1))
    assert executes(out) == ["wire"], _why(out)


def test_compensation_approval_is_asked_again_in_a_new_generation_R13_R15() -> None:
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("hold", compensation_approval=CompensationApproval.REQUIRE),
        ledger.committed("hold"),
        ledger.scheduled("charge"),
    )
    [first] = approval_requests(
        h.feed(ledger.failed("charge", kind=FailureKind.BUSINESS_REJECTION))
    )
    assert first.purpose is ApprovalPurpose.COMPENSATION
    _new_generation(ledger, h)
    request = _what_the_operator_sees(h, "hold")
    assert request.envelope.generation == 2 and request.purpose is ApprovalPurpose.COMPENSATION
    out = h.feed(approval_granted(request, operator="bob", now=h.now + 1))
    assert [o.record.step_id for o in out if isinstance(o.record, CompensationRequested)] == [
        "hold"
    ], _why(out)


def test_dashboard_offers_the_new_generation_request_and_its_grant_counts_R7_R15() -> None:
    ledger, h, _first = _awaiting_wire()
    _new_generation(ledger, h)
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    pending = [req for _saga, req in dashboard.pending_approvals()]
    assert [r.envelope.generation for r in pending] == [2], (
        f"the dashboard offers {[(r.approval_id, r.envelope.generation) for r in pending]} "
        f"while the coordinator waits on {h.s.steps['wire'].approval}"
    )
    grant = approval_granted(pending[0], operator="bob", now=h.now + 1)
    out = h.feed(grant)
    assert executes(out) == ["wire"], _why(out)
    records: list[Record] = [grant, *(o.record for o in out if o.appends_to_events)]
    assert all(dashboard.apply(r) for r in records)
    assert dashboard.pending_approvals() == []


def _unknown_pay() -> tuple[Ledger, Harness, IncidentRaised]:
    """Step pay (no lookup) timed out: a person is asked to settle it (R11)."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("pay"))
    [incident] = incidents(h.feed(ledger.unknown("pay")))
    assert h.status("pay") == "UNKNOWN"
    return ledger, h, incident


def _incident_the_operator_sees(h: Harness, step_id: str) -> IncidentRaised:
    """The incident the coordinator's fold of the ledger waits on for the step."""
    state = fold(h.log)[h.s.saga_id]
    incident_id = state.steps[step_id].incident_id
    [incident] = [
        r for r in h.log if isinstance(r, IncidentRaised) and r.incident_id == incident_id
    ]
    return incident


def test_first_generation_incident_ids_are_what_they_always_were_R15() -> None:
    ledger, _h, incident = _unknown_pay()
    assert incident.incident_id == "inc-" + derived_event_id(
        ledger.saga_id, "incident", "unknown-outcome", "pay", 0
    )
    assert incident.event_id == derived_event_id(
        ledger.saga_id, "IncidentRaised", incident.incident_id
    )


@pytest.mark.parametrize(
    ("resolution", "status"), [("COMMITTED", "COMMITTED"), ("NOT_FOUND", "RETRY_WAIT")]
)
def test_incident_of_an_old_generation_can_be_resolved_R11_R15(
    resolution: str, status: str
) -> None:
    """The operator resolved the incident they had on screen just as the saga moved to
    a new generation: that resolution is stale (R15). The new run asks again; resolving
    what is open now settles the step."""
    ledger, h, first = _unknown_pay()
    ledger.generation = 2
    out = h.feed(ledger.started())
    [again] = incidents(out)
    assert again.envelope.generation == 2 and again.step_id == "pay"
    assert again.kind == first.kind and again.incident_id != first.incident_id
    assert _incident_the_operator_sees(h, "pay") == again
    stale = incident_resolved(first, operator="carol", resolution=resolution, now=h.now)
    assert [o.reason for o in rejections(h.feed(stale))] == ["stale-generation"]
    assert h.status("pay") == "UNKNOWN"
    current = incident_resolved(again, operator="carol", resolution=resolution, now=h.now)
    assert current.event_id != stale.event_id and current.envelope.generation == 2
    out = h.feed(current)
    assert h.status("pay") == status, _why(out)
    assert h.s.open_incidents() == []  # the superseded incident is settled with it


def test_identical_resolution_replayed_or_double_clicked_still_dedups_R15() -> None:
    ledger, h, _first = _unknown_pay()
    _new_generation(ledger, h)
    incident = _incident_the_operator_sees(h, "pay")
    resolution = incident_resolved(incident, operator="carol", resolution="COMMITTED", now=h.now)
    click = incident_resolved(incident, operator="carol", resolution="COMMITTED", now=h.now + 5)
    assert click.event_id == resolution.event_id
    h.feed(resolution)
    assert h.status("pay") == "COMMITTED"
    before = h.s.to_bytes()
    assert h.feed(resolution) == [] and h.feed(click) == []
    assert h.s.to_bytes() == before


def test_each_generation_asks_once_per_unsettled_step_with_its_own_ids_R11_R15() -> None:
    ledger, h, _first = _unknown_pay()
    _new_generation(ledger, h, 2)
    _new_generation(ledger, h, 3)
    raised = [r for r in h.log if isinstance(r, IncidentRaised)]
    assert [r.envelope.generation for r in raised] == [1, 2, 3]
    assert len({r.incident_id for r in raised}) == 3 and len({r.event_id for r in raised}) == 3
    assert h.s.steps["pay"].incident_id == raised[-1].incident_id
    for old in raised[:-1]:
        out = h.feed(incident_resolved(old, operator="carol", resolution="COMMITTED", now=h.now))
        assert [o.reason for o in rejections(out)] == ["stale-generation"]
    h.feed(incident_resolved(raised[-1], operator="carol", resolution="COMMITTED", now=h.now))
    assert h.status("pay") == "COMMITTED"
    # a settled step is not asked again by a later run
    assert incidents(h.feed(ledger.started(generation=4))) == []


def test_a_new_generation_raises_no_other_incident_again_R15() -> None:
    """Only an unknown outcome waits on a person; the other incidents record an effect
    left in the world and move nothing when resolved, so they are not paged again."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("mail", compensation=None),
        ledger.committed("mail"),
        ledger.scheduled("hold"),
        ledger.committed("hold"),
        ledger.scheduled("pay"),
    )
    out = h.feed(ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION))
    assert [i.kind for i in incidents(out)] == ["no-compensation"]
    assert h.status("hold") == "COMPENSATING"  # the saga is still running its unwind
    assert incidents(h.feed(ledger.started(generation=2))) == []


def test_dashboard_offers_the_new_generation_incident_and_its_resolution_counts_R11_R15() -> None:
    ledger, h, _first = _unknown_pay()
    _new_generation(ledger, h)
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    offered = [inc for _saga, inc in dashboard.open_incidents()]
    assert [(i.incident_id, i.envelope.generation) for i in offered] == [
        (h.s.steps["pay"].incident_id, 2)
    ]
    resolution = incident_resolved(offered[0], operator="carol", resolution="COMMITTED", now=h.now)
    out = h.feed(resolution)
    assert h.status("pay") == "COMMITTED", _why(out)
    assert all(
        dashboard.apply(r) for r in [resolution, *(o.record for o in out if o.appends_to_events)]
    )
    assert dashboard.open_incidents() == []


def test_cli_lists_the_superseded_incident_as_such_and_refuses_to_resolve_it_R15(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sagaline incidents`` reads the incidents topic, where the first run's incident
    stays: it is marked superseded, and resolving it (stale) is refused, naming the
    incident to resolve instead."""
    ledger, h, first = _unknown_pay()
    _new_generation(ledger, h)
    again = _incident_the_operator_sees(h, "pay")
    feed = {first.incident_id: first, again.incident_id: again}
    assert superseded_incidents(feed) == {first.incident_id: again}
    monkeypatch.setattr(
        coordinator_cli, "configured_broker", lambda _c, **_kw: (Settings(), "unused:1")
    )
    monkeypatch.setattr(coordinator_cli, "incident_feed", lambda _s, _b, **_kw: (feed, {}))
    assert main(["incidents", "list"]) == 0
    listing = capsys.readouterr().out
    assert f"{again.incident_id}  saga=" in listing and f"{first.incident_id}  saga=" not in listing
    assert main(["incidents", "list", "--all"]) == 0
    assert f"superseded by {again.incident_id}" in capsys.readouterr().out
    argv = ["incidents", "resolve", first.incident_id, "--operator", "carol"]
    assert main([*argv, "--resolution", "COMMITTED"]) == 1
    assert again.incident_id in capsys.readouterr().err


def _open_no_compensation_incident() -> tuple[Ledger, Harness, IncidentRaised]:
    """Step mail committed with no compensation declared; the saga failed, so a person
    is told the effect stays in the world (an incident that settles no step)."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("mail", compensation=None),
        ledger.committed("mail"),
        ledger.scheduled("hold"),
        ledger.committed("hold"),
        ledger.scheduled("pay"),
    )
    [incident] = incidents(h.feed(ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION)))
    assert incident.kind == "no-compensation" and incident.envelope.generation == 1
    return ledger, h, incident


class _Channel:
    """What ``resolve_incident`` needs of an ``OperatorChannel``: the records it would
    publish are kept instead."""

    def __init__(self) -> None:
        self.published: list[Record] = []

    def producer_for(self, operator: str, via: str) -> str | None:
        return None

    def publish(self, record: Record) -> None:
        self.published.append(record)


def test_open_incident_of_an_earlier_generation_can_still_be_resolved_R14_R15() -> None:
    """An incident no later run raises again (it settles no step) stays open across a
    new generation; the person who deals with it must be able to say so, or the saga's
    receipt lists it unresolved for good."""
    ledger, h, incident = _open_no_compensation_incident()
    _new_generation(ledger, h)
    resolution = incident_resolved(
        incident, operator="carol", resolution="told the customer", now=h.now
    )
    out = h.feed(resolution)
    assert rejections(out) == [], _why(out)
    assert h.s.open_incidents() == []
    # the saga ends with the incident resolved, as the receipt says
    ledger.generation = 2
    receipt = receipt_of(h.feed(ledger.comp_committed("hold")))
    [listed] = [i for i in receipt.incidents if i.incident_id == incident.incident_id]
    assert listed.resolved and listed.resolution == "told the customer (by carol)", listed


def test_operator_action_resolves_an_earlier_generations_incident_R15() -> None:
    """Through the operator path (the CLI's and the dashboard's ``resolve_incident``):
    the record it publishes counts, and a repeat of it is still one fact."""
    from sagaline.ops.actions import resolve_incident

    ledger, h, incident = _open_no_compensation_incident()
    _new_generation(ledger, h, 3)
    channel = _Channel()
    record = resolve_incident(
        channel,  # type: ignore[arg-type]
        incident,
        operator="carol",
        resolution="refund mailed by hand",
        now=h.now,
    )
    assert channel.published == [record]
    out = h.feed(record)
    assert rejections(out) == [], _why(out)
    resolved = h.s.incident(incident.incident_id)
    assert resolved is not None and resolved.resolved, resolved
    before = h.s.to_bytes()
    assert h.feed(record) == [] and h.s.to_bytes() == before
    # a second person's answer is refused as for any resolved incident, not as stale
    other = incident_resolved(incident, operator="dave", resolution="also done", now=h.now)
    assert [o.reason for o in rejections(h.feed(other))] == ["invalid-transition"]


def test_dashboard_agrees_an_earlier_generations_incident_is_resolved_R15() -> None:
    ledger, h, incident = _open_no_compensation_incident()
    _new_generation(ledger, h)
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    offered = [inc.incident_id for _saga, inc in dashboard.open_incidents()]
    assert offered == [incident.incident_id]
    resolution = incident_resolved(incident, operator="carol", resolution="done", now=h.now)
    out = h.feed(resolution)
    assert rejections(out) == [], _why(out)
    assert dashboard.apply(resolution), dashboard.sagas[h.s.saga_id].refused
    assert dashboard.open_incidents() == []
    assert dashboard.sagas[h.s.saga_id].refused == []


def test_only_an_unknown_outcome_asked_again_is_superseded_R15(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A participant's incident of the same step and kind from a later run does not
    replace the earlier one: the coordinator holds both open and resolves each on its
    own, so ``sagaline incidents`` lists and resolves both, and the dashboard offers
    both."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("reserve"))
    first = ledger.participant_incident("reserve", "inc-a").model_copy(
        update={"kind": "manual-check"}
    )
    h.feed(first)
    ledger.generation = 2
    h.feed(ledger.started())
    second = ledger.participant_incident("reserve", "inc-b").model_copy(
        update={"kind": "manual-check"}
    )
    h.feed(second)
    assert {i.incident_id for i in h.s.open_incidents()} == {"inc-a", "inc-b"}
    feed = {first.incident_id: first, second.incident_id: second}
    assert superseded_incidents(feed) == {}
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    assert sorted(i.incident_id for _s, i in dashboard.open_incidents()) == ["inc-a", "inc-b"]
    out = h.feed(incident_resolved(first, operator="carol", resolution="checked", now=h.now))
    assert rejections(out) == [], _why(out)


def test_dashboard_agrees_an_ended_sagas_earlier_incident_is_resolved_R14_R15() -> None:
    """The saga ended (its later run unwound) leaving the earlier run's incident open:
    the coordinator takes its resolution whatever its generation (the ended saga's
    marker), so the dashboard must stop showing it open."""
    ledger, h, incident = _open_no_compensation_incident()
    _new_generation(ledger, h)
    ledger.generation = 2
    receipt = receipt_of(h.feed(ledger.comp_committed("hold")))
    [listed] = [i for i in receipt.incidents if i.incident_id == incident.incident_id]
    assert not listed.resolved
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    assert [i.incident_id for _s, i in dashboard.open_incidents()] == [incident.incident_id]
    resolution = incident_resolved(incident, operator="carol", resolution="done", now=h.now)
    assert rejections(h.feed(resolution)) == []  # the shell's marker decides it
    assert dashboard.apply(resolution)
    assert dashboard.open_incidents() == []


def _incident_of_the_second_run() -> tuple[Ledger, Harness, IncidentRaised]:
    """The saga restarted as generation 2, and that run's unwind raised an incident
    that settles no step (mail has no compensation), while hold is still undone."""
    ledger, h = fresh()
    h.feed(ledger.started())
    _new_generation(ledger, h)
    h.feed(
        ledger.scheduled("mail", compensation=None),
        ledger.committed("mail"),
        ledger.scheduled("hold"),
        ledger.committed("hold"),
        ledger.scheduled("pay"),
    )
    [incident] = incidents(h.feed(ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION)))
    assert incident.kind == "no-compensation" and incident.envelope.generation == 2
    return ledger, h, incident


def _as_generation(record: IncidentResolved, generation: int) -> IncidentResolved:
    env = record.envelope.model_copy(update={"generation": generation})
    return record.model_copy(update={"envelope": env})


def test_a_resolution_older_than_its_incident_is_refused_as_stale_R15() -> None:
    """A resolution copies its incident's generation, so one of generation 1 for an
    incident generation 2 raised is no answer to it (a superseded run's record, a
    replay, a forgery): refused stale-generation, saying why, the incident open."""
    _ledger, h, incident = _incident_of_the_second_run()
    stale = _as_generation(
        incident_resolved(incident, operator="carol", resolution="done", now=h.now), 1
    )
    out = h.feed(stale)
    assert [o.reason for o in rejections(out)] == ["stale-generation"], _why(out)
    [refusal] = rejections(out)
    assert f"incident {incident.incident_id} of saga saga-1 was raised at generation 2" in (
        refusal.detail
    )
    assert [i.incident_id for i in h.s.open_incidents()] == [incident.incident_id]
    # a resolution carrying its incident's generation counts
    out = h.feed(incident_resolved(incident, operator="dave", resolution="told", now=h.now))
    assert rejections(out) == [] and h.s.open_incidents() == [], _why(out)


def test_dashboard_agrees_a_resolution_older_than_its_incident_does_not_count_R15() -> None:
    _ledger, h, incident = _incident_of_the_second_run()
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    stale = _as_generation(
        incident_resolved(incident, operator="carol", resolution="done", now=h.now), 1
    )
    assert not dashboard.apply(stale)
    assert [i.incident_id for _s, i in dashboard.open_incidents()] == [incident.incident_id]
