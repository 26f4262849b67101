"""`sagaline approve/deny/incidents resolve --wait`: the coordinator's verdict on the
decision, not only that it was written. On the real broker (the verdict is read from
the coordinator's committed offsets and the DLQ)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from coordinator_ledger import Ledger

from coordinator.shell import Coordinator
from sagaline.kafka import create_producer
from sagaline.ops import actions
from schemas import IncidentRaised, IncidentResolved, Record
from schemas.settings import Settings
from schemas.wire import to_message
from services.cli import main
from tests.coordinator_turns import append, one_saga, turn_until

pytestmark = pytest.mark.kafka


@pytest.fixture
def ended(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Settings, Ledger, Coordinator]]:
    """A saga that ended with incident inc-1 open (on the ledger and the feed), and
    its coordinator, stopped: the test runs it while the CLI waits."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.delenv("SAGALINE_HMAC_KEY", raising=False)
    settings, ledger, first, _participant = one_saga(kafka_bootstrap, unique_prefix, "saga-w")
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    assert isinstance(raised, IncidentRaised)
    ended = [ledger.intent("reserve"), ledger.committed("reserve"), ledger.end()]
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="wait-1", carry_ms=0)
    coordinator._join()
    append(settings, kafka_bootstrap, ledger.started(), first, raised, *ended)
    turn_until(coordinator, lambda: coordinator.marker_of("saga-w") is not None)
    producer = create_producer(kafka_bootstrap)  # the feed's copy of the incident
    key, value, headers = to_message(raised, settings.signer())
    producer.produce(settings.topics.incidents, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0
    yield settings, ledger, coordinator


def _run_while_waiting(monkeypatch: pytest.MonkeyPatch, coordinator: Coordinator) -> None:
    """Once the CLI has published and waits, run the coordinator until the CLI has
    its verdict."""
    waited = actions.VerdictWatch.wait
    done = threading.Event()

    def wait(self: actions.VerdictWatch, record: Record, timeout_s: float) -> actions.Verdict:
        def loop() -> None:
            while not done.is_set():
                coordinator._process_batch(coordinator._next_batch())

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            return waited(self, record, timeout_s)
        finally:
            done.set()
            thread.join(60)

    monkeypatch.setattr(actions.VerdictWatch, "wait", wait)


def test_resolve_wait_says_the_coordinator_accepted_it(
    ended: tuple[Settings, Ledger, Coordinator],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _settings, _ledger, coordinator = ended
    _run_while_waiting(monkeypatch, coordinator)
    rc = main(
        [
            "incidents",
            "resolve",
            "inc-1",
            "--operator",
            "carol",
            "--resolution",
            "by hand",
            "--wait",
            "120",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "accepted by the coordinator" in out


def test_resolve_wait_says_the_coordinator_refused_it_and_why(
    ended: tuple[Settings, Ledger, Coordinator],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another operator resolved it a moment earlier (not on the feed yet when the
    CLI looked): the CLI reports the coordinator's refusal, exit 1."""
    settings, ledger, coordinator = ended
    first = ledger.resolve("inc-1", "refunded by hand")  # by carol
    append(settings, coordinator.bootstrap, first)  # not read by the coordinator yet
    _run_while_waiting(monkeypatch, coordinator)
    rc = main(
        [
            "incidents",
            "resolve",
            "inc-1",
            "--operator",
            "dave",
            "--resolution",
            "nothing",
            "--wait",
            "120",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "refused it (invalid-transition)" in err
    assert "already resolved (refunded by hand (by carol))" in err


def test_wait_without_a_coordinator_ends_with_124(
    ended: tuple[Settings, Ledger, Coordinator], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "incidents",
            "resolve",
            "inc-1",
            "--operator",
            "carol",
            "--resolution",
            "by hand",
            "--wait",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 124 and "no verdict yet" in err and "is it running" in err


def test_wait_judges_the_decision_written_not_another_record_with_its_event_id(
    ended: tuple[Settings, Ledger, Coordinator],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A decision's event id is derived from what anyone can see (saga, incident,
    operator): a writer of sagaline.events can put another record under it just before
    the operator's. The coordinator refuses that one and takes the operator's (a refused
    record's id is not remembered), but --wait found the first record with the id and
    reported the other's refusal as the operator's."""
    settings, _ledger, coordinator = ended
    publish = actions.OperatorChannel.publish

    def squatted(self: actions.OperatorChannel, record: Record, timeout_s: float = 30.0) -> None:
        assert isinstance(record, IncidentResolved)
        append(settings, coordinator.bootstrap, record.model_copy(update={"incident_id": "inc-9"}))
        publish(self, record, timeout_s)

    monkeypatch.setattr(actions.OperatorChannel, "publish", squatted)
    _run_while_waiting(monkeypatch, coordinator)
    rc = main(
        [
            "incidents",
            "resolve",
            "inc-1",
            "--operator",
            "carol",
            "--resolution",
            "by hand",
            "--wait",
            "120",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0 and "accepted by the coordinator" in captured.out, captured.err
