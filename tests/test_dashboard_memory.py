"""The dashboard's memory bound: it keeps every saga in flight or still needing a person,
and at most ``ended_sagas`` ended, settled ones (oldest-ended dropped first, with their
event ids). Pure folds of records, in the orders the follower reads them: live (each
saga's ledger record first, its terminal and incident copies after) and on a restart
(the short terminal topic read far ahead of the ledger).
"""

from __future__ import annotations

import pytest
from dashboard_scenarios import (
    APPROVAL_TTL_MS,
    T0,
    awaiting_approval,
    completed,
    copies_to,
    escalated,
    running,
)
from starlette.testclient import TestClient

from coordinator.core import COORDINATOR_PRODUCER
from sagaline.kafka import create_producer, ensure_topics
from sagaline.ops.actions import incident_resolved
from sagaline.ops.metrics import SagalineMetrics
from schemas import IncidentRaised, Record, TerminalStatus, derived_event_id, envelope_for
from schemas.limits import PARKED_INCIDENT
from schemas.settings import Settings
from schemas.wire import to_message
from services.dashboard import (
    DEFAULT_ENDED_SAGAS,
    Dashboard,
    DashboardConfigError,
    ended_sagas_from_env,
)
from services.dashboard.app import create_app
from services.dashboard.view import DashboardState, SagaStatus

MINUTE = 60_000


def _ended(n: int) -> list[list[Record]]:
    """``n`` completed sagas, ``s-done-0`` ended first."""
    return [completed(f"s-done-{i}", start=T0 + i * MINUTE).records for i in range(n)]


def _live(state: DashboardState, records: list[Record]) -> None:
    for record in records:
        state.apply(record)
        for _copy in copies_to(record):
            state.apply(record, from_ledger=False)


def test_ended_settled_sagas_are_bounded_oldest_ended_first() -> None:
    """Every saga read since offset 0 was kept for the ledger's 365 days: memory grew
    without limit. Ended, settled sagas are now bounded; in flight and escalated ones
    with an open incident are always kept."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=3)
    _live(state, escalated("s-esc", start=T0 - MINUTE).records)  # ended first, still open
    _live(state, running("s-run").records)
    for records in _ended(6):
        _live(state, records)
    assert set(state.sagas) == {"s-esc", "s-run", "s-done-3", "s-done-4", "s-done-5"}
    assert state.evicted_sagas == 3
    # Their event ids left the dedup memory with them.
    kept = sum(s.record_count for s in state.sagas.values())
    assert len(state._seen) == kept
    assert len(state._seen_on_ledger) == kept


def test_with_a_trust_file_the_dedup_memory_is_bounded_and_still_deduplicates() -> None:
    """With bound writers the view remembers each event id within its writer's name (as
    the coordinator does, ``coordinator.core.dedup_key``): those keys leave with their
    saga, and a kept saga's record read again is still a duplicate."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=2, bind_writers=True)
    sagas = _ended(4)
    for records in sagas:
        _live(state, records)
    assert set(state.sagas) == {"s-done-2", "s-done-3"}
    kept = sum(s.record_count for s in state.sagas.values())
    assert kept and len(state._seen) == kept and len(state._seen_on_ledger) == kept
    folded = state.sagas["s-done-3"].record_count
    for record in sagas[3]:
        assert state.apply(record) is False
    # Its folded records (the scenario's participant outcomes, written by "test", are
    # refused and so not remembered) are duplicates now, and nothing is folded twice.
    assert state.ledger_duplicates == folded
    assert state.sagas["s-done-3"].record_count == folded


def test_a_reread_copy_or_duplicate_of_an_evicted_saga_does_not_bring_it_back() -> None:
    """Live, a saga's terminal copy or a redelivered ledger record may be read after it
    was dropped: it must not come back as a saga of one record, shown running."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    sagas = _ended(3)
    for records in sagas:
        for record in records:
            state.apply(record)  # the ledger only: the copies come late
    assert set(state.sagas) == {"s-done-2"}
    for records in sagas[:2]:
        state.apply(records[-1], from_ledger=False)  # the terminal topic's copy
        state.apply(records[3])  # a redelivered ledger record
    assert set(state.sagas) == {"s-done-2"}
    assert state.counts()[SagaStatus.RUNNING] == 0
    assert state.evicted_records == 4


def test_a_restart_reading_the_terminal_topic_first_keeps_whole_sagas() -> None:
    """On a restart the compacted terminal topic is read far ahead of the ledger: a saga
    is dropped only once its ledger's terminal record is read (all its records before
    it are), so no kept saga lacks its ledger and no dropped one comes back."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=2)
    sagas = _ended(4)
    for records in sagas:
        state.apply(records[-1], from_ledger=False)
    assert len(state.sagas) == 4  # none is known to be settled yet
    for records in sagas:
        for record in records:
            state.apply(record)
    assert set(state.sagas) == {"s-done-2", "s-done-3"}
    for saga in state.sagas.values():
        assert saga.workflow == "refund" and saga.record_count == len(sagas[0])
    assert state.counts()[SagaStatus.COMPLETED] == 2


def test_an_escalated_saga_is_kept_until_its_incidents_are_resolved() -> None:
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    esc = escalated("s-esc").records
    _live(state, esc)
    for records in _ended(2):
        _live(state, records)
    assert "s-esc" in state.sagas
    incident = next(r for r in esc if isinstance(r, IncidentRaised))
    state.apply(
        incident_resolved(incident, operator="dan", resolution="restocked", now=T0 + 9 * MINUTE)
    )
    assert "s-esc" not in state.sagas  # settled now, and the oldest ended
    state.apply(incident, from_ledger=False)  # the incident feed's copy, read late
    assert state.open_incidents() == []


def test_a_saga_known_only_from_the_terminal_topic_is_dropped_once_caught_up() -> None:
    """Its ledger expired (365 days) while the compacted terminal topic keeps it: once
    everything has been read, it is settled too."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    for records in _ended(3):
        state.apply(records[-1], from_ledger=False)
    assert len(state.sagas) == 3
    state.mark_caught_up()
    assert set(state.sagas) == {"s-done-2"}


def test_the_bound_is_read_from_the_environment_and_a_bad_value_refused() -> None:
    assert ended_sagas_from_env({}) == DEFAULT_ENDED_SAGAS
    assert ended_sagas_from_env({"SAGALINE_DASHBOARD_ENDED_SAGAS": " 25 "}) == 25
    for bad in ("ten", "-1", "1.5"):
        with pytest.raises(DashboardConfigError, match="SAGALINE_DASHBOARD_ENDED_SAGAS"):
            ended_sagas_from_env({"SAGALINE_DASHBOARD_ENDED_SAGAS": bad})


@pytest.mark.kafka
def test_a_restarted_dashboard_keeps_the_bound_on_the_topics(
    transport: str, unique_prefix: str
) -> None:
    """The follower reads every topic from offset 0; the three sagas' ledgers, terminal
    and incident copies in any interleaving leave the newest ended one and the
    escalated one, each whole, and nothing half."""
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix,
                        hmac_key=b"dashboard-test-key", partitions=3)  # fmt: skip
    ensure_topics(transport, settings.topics, partitions=3)
    producer = create_producer(transport)
    signer, topics = settings.signer(), settings.topics
    sagas = [*_ended(3), escalated("s-esc").records]
    for record in [r for records in sagas for r in records]:
        key, value, headers = to_message(record, signer)
        for attr in ["events", *copies_to(record)]:
            producer.produce(getattr(topics, attr), key=key, value=value, headers=headers)
    assert producer.flush(30) == 0
    dashboard = Dashboard(transport, settings, ended_sagas=1)
    with TestClient(dashboard.app, base_url="http://localhost") as client:
        assert dashboard.follower.caught_up.wait(30), "the dashboard did not catch up"
        body = client.get("/api/state").json()
    assert {s["saga_id"]: s["status"] for s in body["sagas"]} == {
        "s-done-2": "completed",
        "s-esc": "escalated",
    }
    assert {s["saga_id"]: s["records"] for s in body["sagas"]} == {
        "s-done-2": len(sagas[2]),
        "s-esc": len(sagas[3]),
    }


def test_the_dashboard_refuses_a_bound_it_cannot_read_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    monkeypatch.setenv("SAGALINE_DASHBOARD_ENDED_SAGAS", "lots")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    assert main(["dashboard", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "SAGALINE_DASHBOARD_ENDED_SAGAS='lots'" in err and len(err.strip().splitlines()) == 1


def test_api_state_returns_one_page_of_sagas_and_where_the_next_begins() -> None:
    """/api/state listed every saga in one response, built under the view's lock while
    the Kafka thread waited for it."""
    state = DashboardState(SagalineMetrics("dashboard"))
    for i in range(7):
        _live(state, running(f"s-run-{i}").records)
    client = TestClient(create_app(state, clock=lambda: T0))
    every = [s.saga_id for s in state.select()]
    first = client.get("/api/state?limit=3").json()
    assert [s["saga_id"] for s in first["sagas"]] == every[:3]
    assert (first["total"], first["next_offset"]) == (7, 3)
    last = client.get("/api/state?limit=3&offset=6").json()
    assert [s["saga_id"] for s in last["sagas"]] == every[6:]
    assert last["next_offset"] is None
    assert first["counts"]["running"] == 7  # counts stay whole
    assert len(client.get("/api/state").json()["sagas"]) == 7  # default: 500
    for bad in ("limit=0", "limit=5001", "limit=x", "offset=-1"):
        answer = client.get(f"/api/state?{bad}")
        assert answer.status_code == 400 and bad.split("=")[0] in answer.json()["error"]


def test_only_sagas_awaiting_an_approval_are_scanned_for_its_expiry() -> None:
    """Every page and live region ran the approval-expiry scan over every saga, under
    the lock; an index of the sagas with a pending request bounds it."""
    state = DashboardState(SagalineMetrics("dashboard"))
    _live(state, awaiting_approval("s-wait").records)
    for records in _ended(3):
        _live(state, records)
    assert state.awaiting_approval_ids() == {"s-wait"}
    state.expire_approvals(T0 + APPROVAL_TTL_MS + MINUTE)
    assert state.sagas["s-wait"].status is SagaStatus.RUNNING
    assert state.awaiting_approval_ids() == set()


def test_an_ended_saga_with_a_request_left_pending_is_still_dropped() -> None:
    """A request of an ended saga waits for no one (a decision after the end does not
    count, and pages show none): it must not keep the saga in memory for good."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    left = awaiting_approval("s-left")
    left.terminal(TerminalStatus.ESCALATED)
    _live(state, left.records)
    for records in _ended(1):
        _live(state, records)
    assert set(state.sagas) == {"s-done-0"}
    assert state.awaiting_approval_ids() == set()


def test_a_record_reusing_another_sagas_event_id_changes_nothing_and_stops_nothing() -> None:
    """Event ids are the writers' (a buggy or forged one may reuse one under another
    saga id): the ledger's duplicate of a seen event id for a saga never seen must be
    dropped as a duplicate, not stop the dashboard's reader with a KeyError."""
    state = DashboardState(SagalineMetrics("dashboard"))
    records = completed("s-one").records
    terminal = records[-1]
    state.apply(terminal, from_ledger=False)  # a restart: the terminal topic read first
    forged = terminal.model_copy(
        update={"envelope": terminal.envelope.model_copy(update={"saga_id": "s-other"})}
    )
    assert forged.event_id == terminal.event_id and forged.saga_id == "s-other"

    assert state.apply(forged) is False

    assert set(state.sagas) == {"s-one"}
    for record in records:  # the ledger's own records still fold
        state.apply(record)
    assert state.sagas["s-one"].status is SagaStatus.COMPLETED


def test_catching_up_does_not_bring_back_a_saga_it_dropped_meanwhile() -> None:
    """On a restart a saga known only from the terminal topic (its ledger expired) may
    be settled at catch-up after a saga read whole from the ledger that ended before
    it: settling the first drops the second, which the catch-up pass then took up
    again from its list, as a kept saga no longer in the view. Dropping it once more
    stopped the ledger follower (KeyError), and so did every restart after."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    newer, older = _ended(2)[1], _ended(1)[0]
    state.apply(newer[-1], from_ledger=False)  # its ledger expired: the copy alone
    for record in older:
        state.apply(record)  # read whole from the ledger, ended before it
    assert set(state.sagas) == {"s-done-0", "s-done-1"}

    state.mark_caught_up()

    assert set(state.sagas) == {"s-done-1"}
    for records in _ended(4)[2:]:  # later sagas drop it in turn, as they should
        _live(state, records)
    assert set(state.sagas) == {"s-done-3"}
    assert state.evicted_sagas == 3


def test_live_a_terminal_copy_read_before_its_ledger_does_not_drop_the_saga() -> None:
    """Live, the terminal topic (one record a saga) is read ahead of the ledger (many):
    once caught up, a saga known from its terminal copy alone was taken as settled, as
    if its ledger had expired, and dropped when sagas ending after it were read; its
    ledger records then counted as a dropped saga's, and an escalated saga vanished
    with the incident still open."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    state.mark_caught_up()  # a dashboard started on empty topics, then live
    esc = escalated("s-esc").records
    state.apply(esc[-1], from_ledger=False)  # its terminal copy, its ledger behind
    for records in _ended(12)[10:]:  # sagas ending after it, read whole
        _live(state, records)
    for record in esc:
        state.apply(record)  # its ledger, read now
    assert "s-esc" in state.sagas
    assert [s.saga_id for s, _ in state.open_incidents()] == ["s-esc"]
    assert state.sagas["s-esc"].record_count == len(esc)
    assert state.evicted_records == 0


def test_the_page_of_a_dropped_saga_says_where_to_read_it() -> None:
    """A link to a saga dropped from memory (an alert, a receipt, a bookmark) said "No
    saga ... in the ledger (yet)": an operator took an ended saga for one never started."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    for records in _ended(2):
        _live(state, records)
    client = TestClient(create_app(state, clock=lambda: T0))
    page = client.get("/sagas/s-done-0").text
    assert "in the ledger (yet)" not in page
    assert "sagaline saga show s-done-0" in page and "SAGALINE_DASHBOARD_ENDED_SAGAS" in page
    assert "in the ledger (yet)" in client.get("/sagas/s-never").text


def _parked(saga_id: str, at: int) -> IncidentRaised:
    """The incident the coordinator writes when it parks a saga (``Coordinator._park``):
    e.g. an ended saga whose changelog marker it cannot read on a restore."""
    incident_id = derived_event_id(saga_id, "incident", PARKED_INCIDENT)
    return IncidentRaised(
        envelope=envelope_for(
            IncidentRaised,
            saga_id=saga_id,
            tenant_id="acme",
            producer=COORDINATOR_PRODUCER,
            now=at,
            event_id=derived_event_id(saga_id, "SagaParked"),
        ),
        incident_id=incident_id,
        kind=PARKED_INCIDENT,
        inconsistency=f"the coordinator parked saga {saga_id}: its marker is unreadable",
        effect="saga not decided any further; see `sagaline saga show`",
        owner="operations",
    )


def test_an_incident_raised_after_a_dropped_saga_ended_brings_it_back_until_resolved() -> None:
    """The coordinator can raise an incident for a saga after its SagaTerminal (it parks
    an ended saga whose changelog marker it cannot read). When the dashboard had already
    dropped that saga, the incident was counted in ``evicted_records`` and never shown:
    an incident that needs a person was invisible. It now brings the saga back, with the
    incident under "Needs a person" and a word that its history was dropped, until it is
    resolved; a later copy of it does not bring the saga back again."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1)
    for records in _ended(3):
        _live(state, records)
    assert state.dropped("s-done-0")
    parked = _parked("s-done-0", at=T0 + 9 * MINUTE)
    _live(state, [parked])  # the ledger's record, then the incident feed's copy
    assert [(s.saga_id, i.incident_id) for s, i in state.open_incidents()] == [
        ("s-done-0", parked.incident_id)
    ]
    assert not state.dropped("s-done-0") and state.evicted_records == 0
    assert state.sagas["s-done-0"].status is SagaStatus.COMPLETED  # as it ended
    client = TestClient(create_app(state, clock=lambda: T0 + 10 * MINUTE))
    overview = client.get("/").text
    assert f'data-incident="{parked.incident_id}"' in overview
    page = client.get("/sagas/s-done-0").text
    assert f'id="resolve-{parked.incident_id}"' in page
    assert "dropped from memory" in page and "sagaline saga show s-done-0" in page

    state.apply(
        incident_resolved(parked, operator="dan", resolution="restored", now=T0 + 11 * MINUTE)
    )
    assert state.open_incidents() == [] and state.dropped("s-done-0")
    _live(state, [parked])  # read again (a redelivery): it was resolved
    assert state.open_incidents() == [] and state.dropped("s-done-0")


def test_the_memory_of_dropped_sagas_is_bounded_oldest_dropped_forgotten_first() -> None:
    """A dropped saga's id, how it ended and its incidents' ids were remembered for as
    long as the dashboard ran (about 100 bytes a saga, over a year's ledger): memory
    grew without bound after all. Only the ``dropped_sagas`` dropped last are
    remembered now; an older one is forgotten, incidents and all."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1, dropped_sagas=2)
    escalated_first = escalated("s-esc", start=T0 - MINUTE).records
    _live(state, escalated_first)
    incident = next(r for r in escalated_first if isinstance(r, IncidentRaised))
    state.apply(incident_resolved(incident, operator="dan", resolution="restocked", now=T0 - 1))
    for records in _ended(5):
        _live(state, records)
    assert set(state.sagas) == {"s-done-4"}
    assert state.evicted_sagas == 5
    once = ["s-esc", "s-done-0", "s-done-1", "s-done-2", "s-done-3"]
    assert [saga_id for saga_id in once if state.dropped(saga_id)] == ["s-done-2", "s-done-3"]
    assert state.forgotten_sagas == 3
    assert len(state._evicted) == 2  # every dropped saga's memory in one bounded place
    client = TestClient(create_app(state, clock=lambda: T0))
    page = client.get("/sagas/s-done-0").text  # forgotten: it may still be in the ledger
    assert "sagaline saga show s-done-0" in page


def test_a_revived_saga_dropped_again_remembers_the_incidents_it_had_before() -> None:
    """The incidents a dropped saga had are remembered with it (one entry a saga); a
    saga brought back by a later incident and dropped again still does not come back
    for a copy of one of its first incidents."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1, dropped_sagas=10)
    esc = escalated("s-esc", start=T0 - MINUTE).records
    _live(state, esc)
    first = next(r for r in esc if isinstance(r, IncidentRaised))
    state.apply(incident_resolved(first, operator="dan", resolution="restocked", now=T0))
    _live(state, _ended(1)[0])
    assert state.dropped("s-esc")
    parked = _parked("s-esc", at=T0 + 9 * MINUTE)
    _live(state, [parked])
    assert not state.dropped("s-esc")
    state.apply(
        incident_resolved(parked, operator="dan", resolution="restored", now=T0 + 10 * MINUTE)
    )
    assert state.dropped("s-esc")
    first_copy = first.model_copy(
        update={"envelope": first.envelope.model_copy(update={"producer": COORDINATOR_PRODUCER})}
    )
    _live(state, [first_copy])  # a copy of its first incident, read again
    assert state.dropped("s-esc") and state.open_incidents() == []


def test_api_state_refuses_a_status_it_does_not_know_rather_than_listing_every_saga() -> None:
    """``/api/state?status=escalted`` (a typo) answered 200 with every saga, as if each
    were escalated: a script counting them got every saga. A 400 names the statuses."""
    state = DashboardState(SagalineMetrics("dashboard"))
    _live(state, running("s-run").records)
    _live(state, escalated("s-esc").records)
    client = TestClient(create_app(state, clock=lambda: T0))
    known = client.get("/api/state?status=escalated").json()
    assert [s["saga_id"] for s in known["sagas"]] == ["s-esc"]
    answer = client.get("/api/state?status=escalted")
    assert answer.status_code == 400
    assert "status" in answer.json()["error"] and "escalated" in answer.json()["error"]


def _forgotten_after_catch_up() -> tuple[DashboardState, list[Record]]:
    """A dashboard caught up (then live) that dropped ``s-done-0`` and then so many other
    sagas that it no longer remembers it (``dropped_sagas``)."""
    state = DashboardState(SagalineMetrics("dashboard"), ended_sagas=1, dropped_sagas=1)
    state.mark_caught_up()  # started on empty topics, then live
    sagas = _ended(4)
    for records in sagas:
        _live(state, records)
    assert not state.dropped("s-done-0") and state.forgotten_sagas == 2
    return state, sagas[0]


def test_a_late_record_of_a_forgotten_saga_is_counted_not_shown_running_for_good() -> None:
    """Once caught up, every saga read live begins with its SagaStarted in the ledger; a
    record of a saga the view no longer knows (dropped, then forgotten after 100 000
    others were dropped) is a late one (a redelivery, a late decision). It was folded as
    the saga's first: an ended saga showed as RUNNING and was kept in memory for good,
    as it never ends in the ledger again. It is now counted and dropped."""
    state, forgotten = _forgotten_after_catch_up()
    late_commit = next(r for r in forgotten if r.TYPE == "StepCommitted")
    late_grant = next(r for r in forgotten if r.TYPE == "ApprovalGranted")

    assert state.apply(late_commit) is False  # a redelivered ledger record
    assert state.apply(late_grant) is False  # a late decision

    assert "s-done-0" not in state.sagas
    assert state.counts()[SagaStatus.RUNNING] == 0
    assert state.late_records_of_forgotten_sagas == 2
    body = TestClient(create_app(state, clock=lambda: T0)).get("/api/state").json()
    assert body["late_records_of_forgotten_sagas"] == 2


def test_after_catch_up_a_new_saga_and_an_incident_raised_for_a_forgotten_one_still_show() -> None:
    """What is not a late record still shows once caught up: a saga that starts, a
    terminal copy read ahead of its saga's ledger, and an incident the coordinator
    raises for a saga it ended long ago (a person must see it)."""
    state, _forgotten = _forgotten_after_catch_up()
    new = running("s-new").records
    state.apply(new[0])
    parked = _parked("s-done-0", at=T0 + 90 * MINUTE)
    _live(state, [parked])
    assert state.sagas["s-new"].status is SagaStatus.RUNNING
    assert [(s.saga_id, i.incident_id) for s, i in state.open_incidents()] == [
        ("s-done-0", parked.incident_id)
    ]
    assert state.late_records_of_forgotten_sagas == 0


def test_before_catch_up_a_saga_whose_first_records_expired_is_still_shown() -> None:
    """Before the view has caught up, a saga's first record read may follow records the
    ledger's retention deleted: it is folded as the saga's first, as before."""
    state = DashboardState(SagalineMetrics("dashboard"))
    records = running("s-old").records
    for record in records[2:]:  # its SagaStarted and first record expired
        state.apply(record)
    state.mark_caught_up()
    assert state.sagas["s-old"].status is SagaStatus.RUNNING
    assert state.late_records_of_forgotten_sagas == 0
