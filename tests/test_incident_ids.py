"""Incident ids within a saga (R8, R14, R15): each names one incident. No broker.

A person resolves an incident by its id, the receipt lists incidents by id, and the
coordinator counts the first resolution of an id. Two different incidents under one
id would share a resolution: one settled by an answer meant for the other, or an
incident dropped unseen because its id was taken. A participant chooses the id of an
incident it raises (the protocol lets it), so the coordinator must not take one a
participant already used, and must refuse (visibly) a participant's incident that
names an id the saga already holds for another incident.
"""

from __future__ import annotations

from coordinator_ledger import Ledger, fresh, incidents, rejections

from sagaline.ops.metrics import SagalineMetrics
from schemas import FailureKind, IncidentRaised, derived_event_id
from services.dashboard.view import DashboardState
from tests.test_approval_generations import _open_no_compensation_incident


def _no_compensation_id(saga_id: str, step_id: str, index: int) -> str:
    """The id the coordinator derives for its ``no-compensation`` incident of
    ``step_id`` when the saga holds ``index`` incidents (anyone can compute it)."""
    return "inc-" + derived_event_id(saga_id, "incident", "no-compensation", step_id, index)


def _mail_incident(ledger: Ledger, incident_id: str) -> IncidentRaised:
    """The mail participant's own incident (another kind than the coordinator's)
    under ``incident_id``."""
    return ledger.participant_incident("mail", incident_id).model_copy(
        update={"kind": "manual-check", "inconsistency": "bounced, resend by hand"}
    )


def test_the_coordinator_never_raises_an_incident_under_an_id_a_participant_took_R8() -> None:
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("mail", compensation=None),
        ledger.committed("mail"),
        ledger.scheduled("hold"),
        ledger.committed("hold"),
    )
    # the mail participant raises an incident of its own under the id the coordinator
    # will give its next one (the saga will hold one incident when it is raised)
    taken = _no_compensation_id(ledger.saga_id, "mail", 1)
    own = _mail_incident(ledger, taken)
    assert rejections(h.feed(own)) == []
    h.feed(ledger.scheduled("pay"))
    [raised] = incidents(h.feed(ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION)))
    assert raised.kind == "no-compensation"
    ids = [i.incident_id for i in h.s.incidents]
    assert len(ids) == len(set(ids)), f"two incidents share an id: {ids}"
    assert raised.incident_id != taken
    # (hold is still being undone) resolving the participant's incident leaves ours open
    assert rejections(h.feed(ledger.resolve(taken, "resent"))) == []
    assert [i.incident_id for i in h.s.open_incidents()] == [raised.incident_id]


def test_a_participant_incident_under_an_id_the_saga_holds_is_refused_not_dropped_R8_R16() -> None:
    ledger, h, raised = _open_no_compensation_incident()
    other = _mail_incident(ledger, raised.incident_id)
    out = h.feed(other)
    assert [(o.reason, o.record.event_id) for o in rejections(out)] == [
        ("invalid-transition", other.event_id)
    ], "a second incident under a taken id was dropped unseen"
    [refusal] = rejections(out)
    assert raised.incident_id in refusal.detail and "another incident" in refusal.detail
    [kept] = [i for i in h.s.incidents if i.incident_id == raised.incident_id]
    assert kept.kind == "no-compensation"
    # the same incident written again (another event id, its text redone) is no conflict
    again = ledger.participant_incident("mail", "inc-p").model_copy(update={"kind": "manual-check"})
    h.feed(again)
    copy = again.model_copy(
        update={
            "envelope": again.envelope.model_copy(update={"event_id": "copy"}),
            "inconsistency": "said again",
        }
    )
    assert rejections(h.feed(copy)) == []
    assert [i.incident_id for i in h.s.incidents].count("inc-p") == 1


def test_the_dashboard_keeps_the_incident_whose_id_a_participant_reused_R8() -> None:
    ledger, h, raised = _open_no_compensation_incident()
    other = _mail_incident(ledger, raised.incident_id)
    h.feed(other)
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    [(_saga, shown)] = dashboard.open_incidents()
    assert shown.kind == "no-compensation", shown


def test_the_dashboard_refuses_a_participant_incident_under_a_resolved_incidents_id_R8() -> None:
    """As the coordinator: an id names one incident, resolved or not. A participant's
    incident of another kind under the id of one already resolved is refused there,
    and the dashboard shows it refused, not folded into the saga's view."""
    ledger, h, raised = _open_no_compensation_incident()
    assert rejections(h.feed(ledger.resolve(raised.incident_id, "sent a letter"))) == []
    other = _mail_incident(ledger, raised.incident_id)
    assert [o.reason for o in rejections(h.feed(other))] == ["invalid-transition"]
    dashboard = DashboardState(SagalineMetrics("dashboard"))
    for record in h.log:
        dashboard.apply(record)
    saga = dashboard.sagas[ledger.saga_id]
    assert [r for r in saga.refused if other.event_id in r], saga.refused
    assert "manual-check" not in [kind for _at, kind in saga.step("mail").incidents], (
        "the dashboard folded an incident the coordinator refused"
    )
