"""Operator resolutions as the dashboard reads them: its view and its measures must
agree with the coordinator's, whatever order the topics are read in.

The coordinator copies every resolution it accepts to ``sagaline.incidents`` (the
operators' incident feed) next to the ledger's record. A restarted dashboard reads all
three topics at once, so the feed's copy is often folded before the ledger's record
(the ledger is by far the longer topic).
"""

from __future__ import annotations

import pytest
from dashboard_scenarios import SagaScript, escalated, unknown_outcome
from starlette.testclient import TestClient

from sagaline.kafka import create_producer, ensure_topics
from schemas import (
    FailureKind,
    IncidentRaised,
    IncidentResolved,
    Record,
    SagaEndRequested,
    SagaOutcome,
    SagaStarted,
    TerminalStatus,
)
from schemas.receipt import Disposition
from schemas.settings import Settings
from schemas.wire import to_message
from services.dashboard import Dashboard
from services.dashboard.view import DashboardState
from tests.system import wait_until


def _publish(bootstrap: str, settings: Settings, placed: list[tuple[Record, list[str]]]) -> None:
    producer = create_producer(bootstrap)
    for record, topics in placed:
        key, value, headers = to_message(record, settings.signer())
        for attr in topics:
            producer.produce(getattr(settings.topics, attr), key=key, value=value, headers=headers)
    assert producer.flush(30) == 0


@pytest.mark.kafka
def test_a_resolution_read_first_on_the_incident_feed_is_still_measured(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The ledger's record of a resolution the view had already folded from the feed
    was taken for a second resolution of a resolved incident: not measured, so after a
    restart the dashboard's /metrics lost the operator's intervention and the step's
    time in the unknown state."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix,
                        hmac_key=b"dashboard-test-key", partitions=1)  # fmt: skip
    ensure_topics(kafka_bootstrap, settings.topics, partitions=1)
    saga = unknown_outcome("s-feed-first")
    incident_id = saga.incidents[0].incident_id
    _publish(
        kafka_bootstrap,
        settings,
        [(r, ["events", "incidents"] if r.TYPE == "IncidentRaised" else ["events"])
         for r in saga.records],
    )  # fmt: skip
    resolved = saga.add(
        IncidentResolved, incident_id=incident_id, resolved_by="carol", resolution="COMMITTED"
    )
    ended = saga.add(SagaEndRequested, outcome=SagaOutcome.COMPLETE)
    dashboard = Dashboard(kafka_bootstrap, settings)
    state = dashboard.state
    with TestClient(dashboard.app, base_url="http://localhost"):
        wait_until(dashboard.follower.caught_up.is_set, what="the dashboard to catch up")
        # The feed's copy first, as a restart often reads it (another saga's incident
        # after it on the feed, to know it was read) ...
        other = unknown_outcome("s-other").records
        later = next(r for r in other if isinstance(r, IncidentRaised))
        _publish(kafka_bootstrap, settings, [(resolved, ["incidents"]), (later, ["incidents"])])
        wait_until(lambda: "s-other" in state.sagas, what="the feed's copy to be read")
        # ... then the ledger's record (and the agent's next one, to know it was read).
        _publish(kafka_bootstrap, settings, [(resolved, ["events"]), (ended, ["events"])])
        wait_until(lambda: state.sagas["s-feed-first"].end_requested, what="the ledger to be read")
        measures = state.metrics.snapshot()
        assert measures.manual_interventions == {"incident_resolved": 1}
        assert measures.time_in_unknown["restock_inventory"].count == 1
        assert state.sagas["s-feed-first"].refused == []


def test_resolutions_the_coordinator_refuses_after_the_end_are_not_counted() -> None:
    """An ESCALATED saga's incident counts its first resolution only, and one naming no
    incident of the saga counts none (``coordinator.shell._resolve_ended`` refuses
    them invalid-transition, off the feed and the measures). The view took every one
    once the saga had ended: /metrics counted each as an intervention and the page did
    not list them as refused."""
    saga = escalated("s-resolved-twice")
    incident_id = saga.incidents[0].incident_id
    first = saga.add(
        IncidentResolved, incident_id=incident_id, resolved_by="alice", resolution="restocked"
    )
    saga.add(IncidentResolved, incident_id=incident_id, resolved_by="bob", resolution="written off")
    saga.add(IncidentResolved, incident_id="inc-none", resolved_by="bob", resolution="done")
    state = DashboardState()
    for record in saga.records:
        state.apply(record)
    view = state.sagas["s-resolved-twice"]
    assert state.metrics.snapshot().manual_interventions == {"incident_resolved": 1}
    assert view.resolved_incidents[incident_id] == first
    assert len(view.refused) == 2, view.refused
    assert "already resolved (restocked (by alice))" in view.refused[0]


def _restamped(saga: SagaScript, generation: int) -> None:
    """The record just added, written under ``generation`` (a later run of the saga)."""
    last = saga.records[-1]
    envelope = last.envelope.model_copy(update={"generation": generation})
    saga.records[-1] = last.model_copy(update={"envelope": envelope})


def test_a_superseded_runs_late_records_are_not_measured() -> None:
    """The agent restarted the saga (generation 2) while a step's first run was in
    flight; that run's failure arrived after the restart. The coordinator refuses it
    stale-generation and measures nothing; the view left it out too, but the
    dashboard's measures took it as the saga's first failure signal: a failure-free
    completed saga showed a disclosure latency and a recovery time."""
    saga = SagaScript("s-rerun").start()
    saga.schedule("1", "place_hold", amount_cents=500)
    saga.intent("1")
    saga.add(SagaStarted, workflow=saga.workflow, principal=saga.principal)
    _restamped(saga, 2)
    saga.fail("1", FailureKind.TRANSIENT)  # the first run's late answer: generation 1
    saga.intent("1", attempt=2)
    _restamped(saga, 2)
    saga.commit("1", attempt=2)
    _restamped(saga, 2)
    saga.add(SagaEndRequested, outcome=SagaOutcome.COMPLETE)
    _restamped(saga, 2)
    saga.step_receipt("1", Disposition.RETAINED, forward_attempts=2)
    saga.terminal(TerminalStatus.COMPLETED)
    _restamped(saga, 2)
    state = DashboardState()
    for record in saga.records:
        state.apply(record)
    assert state.sagas["s-rerun"].status.slug == "completed"
    assert state.stale_records == 1
    measures = state.metrics.snapshot()
    assert measures.disclosure_latency == {}
    assert measures.time_to_recovery == {}


@pytest.mark.kafka
def test_an_unknown_outcome_resolved_committed_is_not_shown_unknown_after_a_restart(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A restart reads the short incident feed long before the ledger's records of the
    saga: the feed's copy of a COMMITTED resolution was folded while the step was not
    yet unknown in the view (its StepOutcomeUnknown still unread), so it settled
    nothing; the ledger's record was then a duplicate, and the saga, which the
    coordinator had moved on, showed "unknown outcome" until it ended."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix,
                        hmac_key=b"dashboard-test-key", partitions=1)  # fmt: skip
    ensure_topics(kafka_bootstrap, settings.topics, partitions=1)
    saga = unknown_outcome("s-restarted")
    incident_id = saga.incidents[0].incident_id
    saga.add(IncidentResolved, incident_id=incident_id, resolved_by="carol", resolution="COMMITTED")
    saga.add(SagaEndRequested, outcome=SagaOutcome.COMPLETE)
    feed = [r for r in saga.records if isinstance(r, IncidentRaised | IncidentResolved)]
    dashboard = Dashboard(kafka_bootstrap, settings)
    state = dashboard.state
    with TestClient(dashboard.app, base_url="http://localhost"):
        wait_until(dashboard.follower.caught_up.is_set, what="the dashboard to start")
        _publish(kafka_bootstrap, settings, [(r, ["incidents"]) for r in feed])
        wait_until(lambda: "s-restarted" in state.sagas, what="the feed to be read")
        _publish(kafka_bootstrap, settings, [(r, ["events"]) for r in saga.records])
        wait_until(lambda: state.sagas["s-restarted"].end_requested, what="the ledger to be read")
        view = state.sagas["s-restarted"]
        assert (view.status.slug, view.steps["2"].state) == ("running", "committed")
        assert view.open_incidents == {}
