"""Resolutions on the operators' incident feed (``sagaline.incidents``): the
coordinator forwards only those it accepts, so ``sagaline incidents list`` (which
keeps the first resolution of an incident) never shows an open incident resolved,
and a refused resolution never blocks the genuine one. Run on both transports."""

from __future__ import annotations

from coordinator.shell import Coordinator
from sagaline.kafka import LedgerReader
from schemas import IncidentRaised, IncidentResolved
from schemas.codec import decode
from schemas.settings import Settings
from tests.coordinator_turns import append, one_saga, turn_until


def _feed(settings: Settings, bootstrap: str) -> list[str]:
    """Event ids of the resolutions on the incidents topic, in order."""
    found = []
    for _k, value, _h in LedgerReader(bootstrap).records(settings.topics.incidents):
        record = decode(value or b"")
        if isinstance(record, IncidentResolved):
            found.append(record.event_id)
    return found


def _dlq(settings: Settings, bootstrap: str) -> int:
    return sum(1 for _ in LedgerReader(bootstrap).records(settings.topics.dlq))


def _other_tenant(record: IncidentResolved) -> IncidentResolved:
    env = record.envelope.model_copy(update={"tenant_id": "globex"})
    return record.model_copy(update={"envelope": env})


def test_only_resolutions_the_coordinator_accepts_reach_the_incident_feed(
    transport: str, unique_prefix: str
) -> None:
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-res")
    raised = ledger.participant_incident("reserve", "inc-1")
    raised = raised.model_copy(update={"kind": "manual-check"})
    assert isinstance(raised, IncidentRaised)
    coordinator = Coordinator(settings, transport, instance_id="res-1", carry_ms=0)
    coordinator._join()
    append(settings, transport, ledger.started(), first, raised)
    turn_until(coordinator, lambda: coordinator.positions().get(0, -1) >= 3)

    foreign = _other_tenant(ledger.resolve("inc-1", "done"))  # another tenant's operator
    unknown = ledger.resolve("inc-nope", "done")  # no such incident in this saga
    genuine = ledger.resolve("inc-1", "refunded by hand")
    append(settings, transport, foreign, unknown, genuine)
    turn_until(coordinator, lambda: coordinator.positions().get(0, -1) >= 6)

    assert _dlq(settings, transport) == 2  # both refused resolutions are kept there
    assert _feed(settings, transport) == [genuine.event_id]
    state = coordinator.state_of("saga-res")
    assert state is not None
    incident = state.incident("inc-1")
    assert incident is not None and incident.resolved


def test_a_resolution_of_an_old_runs_incident_still_reaches_the_feed(
    transport: str, unique_prefix: str
) -> None:
    """Refused only as stale (the saga moved to a new generation, and an incident of
    this kind is never raised again): the feed is where a person sees it settled."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-old")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    coordinator = Coordinator(settings, transport, instance_id="res-2", carry_ms=0)
    coordinator._join()
    append(settings, transport, ledger.started(), first, raised, ledger.started(generation=2))
    turn_until(coordinator, lambda: coordinator.positions().get(0, -1) >= 4)
    old = ledger.resolve("inc-1", "done")  # generation 1
    append(settings, transport, old)
    turn_until(coordinator, lambda: coordinator.positions().get(0, -1) >= 5)
    assert _dlq(settings, transport) == 1  # refused stale-generation
    assert _feed(settings, transport) == [old.event_id]
