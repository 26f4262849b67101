"""Resolutions on the operators' incident feed (``sagaline.incidents``): the
coordinator forwards only those it accepts, so ``sagaline incidents list`` (which
keeps the first resolution of an incident) never shows an open incident resolved,
and a refused resolution never blocks the genuine one. Run on both transports."""

from __future__ import annotations

from typing import Any

from coordinator.shell import Coordinator
from coordinator.state import SagaMarker, load_changelog
from sagaline.kafka import KafkaError, KafkaException, LedgerReader
from schemas import IncidentRaised, IncidentResolved
from schemas.codec import decode
from schemas.settings import Settings
from schemas.signing import header_value
from schemas.wire import DLQ_DETAIL, DLQ_REASON
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


def _dlq_reasons(settings: Settings, bootstrap: str) -> list[str]:
    return [
        (header_value(h, DLQ_REASON) or b"").decode()
        for _k, _v, h in LedgerReader(bootstrap).records(settings.topics.dlq)
    ]


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
    """The saga moved to a new generation, and an incident of this kind is never
    raised again: its resolution (which copies the incident's generation) counts, in
    the coordinator's state as on the feed, where a person sees it settled."""
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
    assert _dlq(settings, transport) == 0  # not refused as stale-generation
    assert _feed(settings, transport) == [old.event_id]
    state = coordinator.state_of("saga-old")
    incident = state.incident("inc-1") if state is not None else None
    assert incident is not None and incident.resolved, incident


def test_an_ended_sagas_incident_is_resolved_only_by_its_own_tenant(
    transport: str, unique_prefix: str
) -> None:
    """The saga has ended (the coordinator keeps only its marker, also after a
    restart): a resolution from another tenant, or of an incident the saga did not
    leave open, is refused as for a saga in flight; the genuine one is forwarded."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-end")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    ended = [ledger.intent("reserve"), ledger.committed("reserve"), ledger.end()]
    one = Coordinator(settings, transport, instance_id="res-3", carry_ms=0)
    one._join()
    append(settings, transport, ledger.started(), first, raised, *ended)
    turn_until(one, lambda: one.marker_of("saga-end") is not None)
    marker = one.marker_of("saga-end")
    assert marker is not None and marker.tenant_id == "acme"
    assert marker.incidents == ["inc-1"]
    one._consumer.close()

    # A successor restores the marker from the changelog.
    two = Coordinator(settings, transport, instance_id="res-3", carry_ms=0)
    two._join()
    foreign = _other_tenant(ledger.resolve("inc-1", "done"))
    unknown = ledger.resolve("inc-nope", "done")
    genuine = ledger.resolve("inc-1", "refunded by hand")
    append(settings, transport, foreign, unknown, genuine)
    turn_until(two, lambda: two.positions().get(0, -1) >= 9)
    assert _dlq_reasons(settings, transport) == ["tenant-mismatch", "invalid-transition"]
    assert _feed(settings, transport) == [genuine.event_id]


def test_a_marker_written_before_it_kept_the_tenant_still_restores() -> None:
    old = b'{"marker":"TERMINAL","saga_id":"s","status":"ESCALATED","at":5,"reason":""}'
    marker = load_changelog(old)
    assert isinstance(marker, SagaMarker)
    assert marker.tenant_id is None and marker.incidents is None


def _dlq_details(settings: Settings, bootstrap: str) -> list[tuple[str, str]]:
    return [
        (
            (header_value(h, DLQ_REASON) or b"").decode(),
            (header_value(h, DLQ_DETAIL) or b"").decode(),
        )
        for _k, _v, h in LedgerReader(bootstrap).records(settings.topics.dlq)
    ]


def _by(record: IncidentResolved, who: str) -> IncidentResolved:
    return record.model_copy(update={"resolved_by": who})


def test_an_ended_sagas_incident_counts_its_first_resolution_only(
    transport: str, unique_prefix: str
) -> None:
    """After the end, as while the saga runs: a second, conflicting resolution by
    another operator is refused invalid-transition naming the one that counted, and
    stays off the incident feed; also once a successor restores the marker. A repeat
    of the first (same event id) changes nothing."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-two")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    ended = [ledger.intent("reserve"), ledger.committed("reserve"), ledger.end()]
    one = Coordinator(settings, transport, instance_id="res-5", carry_ms=0)
    one._join()
    append(settings, transport, ledger.started(), first, raised, *ended)
    turn_until(one, lambda: one.marker_of("saga-two") is not None)
    counted = _by(ledger.resolve("inc-1", "refunded by hand"), "carol")
    other = _by(ledger.resolve("inc-1", "nothing to do"), "dave")
    append(settings, transport, counted, other, counted)
    turn_until(one, lambda: one.positions().get(0, -1) >= 9)
    assert _feed(settings, transport) == [counted.event_id]
    (refusal,) = _dlq_details(settings, transport)
    assert refusal[0] == "invalid-transition"
    assert "already resolved (refunded by hand (by carol))" in refusal[1]
    assert "by dave (nothing to do) does not count" in refusal[1]
    one._consumer.close()

    # A successor restores the marker, with what was resolved.
    two = Coordinator(settings, transport, instance_id="res-5", carry_ms=0)
    two._join()
    late = _by(ledger.resolve("inc-1", "written off"), "erin")
    append(settings, transport, late)
    turn_until(two, lambda: two.positions().get(0, -1) >= 10)
    assert _feed(settings, transport) == [counted.event_id]
    reasons = [reason for reason, _detail in _dlq_details(settings, transport)]
    assert reasons == ["invalid-transition", "invalid-transition"]


def test_an_ended_sagas_resolution_under_anothers_event_id_does_not_hide_the_real_one(
    transport: str, unique_prefix: str
) -> None:
    """An operator's resolution has a deterministic event id derived from what every
    reader sees (saga, incident, who resolved and how). Another operator who writes a
    resolution of their own under that id first gets theirs counted (it came first),
    but the real one is no repeat of it: it is refused naming the one that counted,
    not dropped unseen as a duplicate (which `--wait` reports as counted)."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-squat")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    ended = [ledger.intent("reserve"), ledger.committed("reserve"), ledger.end()]
    one = Coordinator(settings, transport, instance_id="res-7", carry_ms=0)
    one._join()
    append(settings, transport, ledger.started(), first, raised, *ended)
    turn_until(one, lambda: one.marker_of("saga-squat") is not None)
    real = _by(ledger.resolve("inc-1", "refunded by hand"), "carol")
    squat = _by(ledger.resolve("inc-1", "nothing to do"), "dave")
    squat = squat.model_copy(
        update={"envelope": squat.envelope.model_copy(update={"event_id": real.event_id})}
    )
    append(settings, transport, squat, real)
    end = LedgerReader(transport).end_offsets(settings.topics.events)[0]
    turn_until(one, lambda: one.positions().get(0, -1) >= end)
    details = _dlq_details(settings, transport)
    assert [reason for reason, _d in details] == ["invalid-transition"], (
        "carol's resolution was taken for a repeat of dave's"
    )
    assert "by carol (refunded by hand) does not count" in details[0][1]
    one._consumer.close()


def test_a_saga_ending_in_the_batch_of_its_resolutions_counts_the_first_only(
    transport: str, unique_prefix: str
) -> None:
    """The saga ends in the same batch as two resolutions of its open incident: the
    same answer as for its marker."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-one")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    ended = [ledger.intent("reserve"), ledger.committed("reserve"), ledger.end()]
    counted = _by(ledger.resolve("inc-1", "refunded by hand"), "carol")
    other = _by(ledger.resolve("inc-1", "nothing to do"), "dave")
    coordinator = Coordinator(settings, transport, instance_id="res-6", carry_ms=0)
    coordinator._join()
    append(settings, transport, ledger.started(), first, raised, *ended, counted, other)
    turn_until(coordinator, lambda: coordinator.positions().get(0, -1) >= 8)
    assert _feed(settings, transport) == [counted.event_id]
    assert [reason for reason, _d in _dlq_details(settings, transport)] == ["invalid-transition"]


def test_a_marker_without_resolutions_restores_and_is_written_unchanged() -> None:
    """A marker written before it kept resolutions restores as it was, and one with
    none is written as before (an older coordinator still reads it)."""
    old = (
        b'{"marker":"TERMINAL","saga_id":"s","status":"ESCALATED","at":5,"reason":"",'
        b'"tenant_id":"acme","incidents":["inc-1"]}'
    )
    marker = load_changelog(old)
    assert isinstance(marker, SagaMarker) and marker.incidents == ["inc-1"]
    assert marker.to_bytes() == old


class _OffsetsRefused:
    """A producer whose transactions take no offsets (the group moved on, say): the
    transaction that ends a saga-by-saga commit fails."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def send_offsets_to_transaction(self, *args: Any) -> None:
        self.refused += 1
        raise KafkaException(KafkaError(KafkaError._FAIL, "offsets refused"))


def test_a_resolution_committed_saga_by_saga_reaches_the_feed_though_the_last_transaction_fails(
    transport: str, unique_prefix: str
) -> None:
    """After three failed transactions a batch is committed saga by saga: each saga's
    outputs and changelog record in a transaction of its own, then one with the
    records of no saga and the offsets. The copy of an accepted resolution for the
    incident feed went in that last one: when it failed and the coordinator stopped
    (or the partition moved), the successor restored the saga with the incident
    resolved and took the record read again for a repeat, so the feed never showed
    the resolution. The copy goes with its saga's records."""
    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-iso")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    one = Coordinator(settings, transport, instance_id="iso-1", carry_ms=0, linger_ms=0)
    one._join()
    append(settings, transport, ledger.started(), first, raised)
    turn_until(one, lambda: one.positions().get(0, -1) >= 3)

    genuine = ledger.resolve("inc-1", "refunded by hand")
    append(settings, transport, genuine)
    one._failures = 3  # the next batch is committed saga by saga
    refusing = _OffsetsRefused(one._producer)
    one._producer = refusing
    turn_until(one, lambda: refusing.refused == 1)
    one._consumer.close()  # it stops before the batch is tried again

    two = Coordinator(settings, transport, instance_id="iso-2", carry_ms=0, linger_ms=0)
    two._join()
    turn_until(two, lambda: two.positions().get(0, -1) >= 4)
    state = two.state_of("saga-iso")
    two._consumer.close()
    incident = state.incident("inc-1") if state is not None else None
    assert incident is not None and incident.resolved
    assert _feed(settings, transport) == [genuine.event_id]


def _generation(record: IncidentResolved, generation: int) -> IncidentResolved:
    env = record.envelope.model_copy(update={"generation": generation})
    return record.model_copy(update={"envelope": env})


def test_an_ended_sagas_resolution_older_than_its_incident_is_refused_as_stale(
    transport: str, unique_prefix: str
) -> None:
    """The incident was raised by the saga's second run, which ended with it open. A
    resolution copies its incident's generation, so one of generation 1 answers no
    incident of that id: refused stale-generation saying why (also once a successor
    restores the marker), kept off the feed; the genuine one counts."""
    settings, ledger, _first, _participant = one_saga(transport, unique_prefix, "saga-gen")
    started = ledger.started()
    ledger.generation = 2
    restarted, first = ledger.started(), ledger.scheduled("reserve")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    ended = [ledger.intent("reserve"), ledger.committed("reserve"), ledger.end()]
    one = Coordinator(settings, transport, instance_id="res-8", carry_ms=0)
    one._join()
    append(settings, transport, started, restarted, first, raised, *ended)
    turn_until(one, lambda: one.marker_of("saga-gen") is not None)
    stale = _generation(_by(ledger.resolve("inc-1", "done"), "carol"), 1)
    append(settings, transport, stale)
    turn_until(one, lambda: one.positions().get(0, -1) >= 8)
    one._consumer.close()

    two = Coordinator(settings, transport, instance_id="res-8", carry_ms=0)
    two._join()
    again = _generation(_by(ledger.resolve("inc-1", "done again"), "carol"), 1)
    genuine = _by(ledger.resolve("inc-1", "refunded by hand"), "dave")
    append(settings, transport, again, genuine)
    turn_until(two, lambda: two.positions().get(0, -1) >= 10)
    details = _dlq_details(settings, transport)
    assert [reason for reason, _d in details] == ["stale-generation", "stale-generation"], details
    assert "incident inc-1 of saga saga-gen was raised at generation 2" in details[0][1]
    assert _feed(settings, transport) == [genuine.event_id]


def _raised_on_feed(settings: Settings, bootstrap: str) -> list[str]:
    """Event ids of the incidents on the incidents topic, in order."""
    found = []
    for _k, value, _h in LedgerReader(bootstrap).records(settings.topics.incidents):
        record = decode(value or b"")
        if isinstance(record, IncidentRaised):
            found.append(record.event_id)
    return found


def test_a_participants_incident_reaches_the_feed_the_cli_resolves_from(
    transport: str, unique_prefix: str
) -> None:
    """`sagaline incidents list` and `incidents resolve` read the incident feed: an
    incident a participant raised (no lookup, a result too large) that the coordinator
    accepts must be on it, or the operator is told there is no such incident. One the
    coordinator refuses (under an id the saga holds for another incident) is not."""
    from services.coordinator_cli import incident_feed

    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-own")
    raised = ledger.participant_incident("reserve", "inc-p").model_copy(
        update={"kind": "unknown-outcome-no-lookup"}
    )
    clash = ledger.participant_incident("reserve", "inc-p").model_copy(
        update={"kind": "manual-check", "inconsistency": "another one"}
    )
    coordinator = Coordinator(settings, transport, instance_id="res-9", carry_ms=0)
    coordinator._join()
    append(settings, transport, ledger.started(), first, raised, clash)
    turn_until(coordinator, lambda: coordinator.positions().get(0, -1) >= 4)
    assert _raised_on_feed(settings, transport) == [raised.event_id]
    listed, _resolved = incident_feed(settings, transport)
    assert listed["inc-p"].kind == "unknown-outcome-no-lookup"


def test_an_incident_the_ledger_settles_shows_settled_in_incidents_list(
    transport: str,
    unique_prefix: str,
    monkeypatch: Any,
    capsys: Any,
) -> None:
    """A step timed out (no lookup: a person is asked, R11), then its commit arrived
    after all: the coordinator marks the incident resolved in its state, but wrote
    nothing to the incident feed, so `sagaline incidents list` went on showing it OPEN
    and operators chased an incident that needed nothing. The feed now says it was
    settled, and why."""
    from services.cli import main
    from services.coordinator_cli import incident_feed

    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-late")
    coordinator = Coordinator(settings, transport, instance_id="res-10", carry_ms=0)
    coordinator._join()
    append(settings, transport, ledger.started(), first, ledger.intent("reserve"))
    append(settings, transport, ledger.unknown("reserve"))
    turn_until(coordinator, lambda: len(_raised_on_feed(settings, transport)) == 1)
    raised, resolved = incident_feed(settings, transport)
    [incident_id] = raised
    assert resolved == {}

    append(settings, transport, ledger.committed("reserve"))

    def settled() -> bool:
        state = coordinator.state_of("saga-late")
        return state is not None and state.open_incidents() == []

    turn_until(coordinator, settled)
    raised, resolved = incident_feed(settings, transport)
    assert incident_id in resolved, "the settled incident is not on the incident feed"
    assert resolved[incident_id].resolution == "COMMITTED (observed in the ledger)"

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", transport)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_PARTITIONS", "1")
    capsys.readouterr()
    assert main(["incidents", "list"]) == 0
    assert incident_id not in capsys.readouterr().out
    assert main(["incidents", "list", "--all"]) == 0
    listing = capsys.readouterr().out
    assert "[settled by the coordinator: COMMITTED (observed in the ledger)]" in listing
