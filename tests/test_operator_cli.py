"""The operator commands against a live system on the real broker: approve, deny,
saga show, incidents list and resolve all go through the ledger (R7, R8, R14)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import sagaline.kafka._clients
from participants import (
    BusinessRejection,
    CompensationContext,
    Reversibility,
    compensable,
    tool,
    wrap,
)
from participants.client import ApprovalDeniedError, BusinessRejected
from sagaline.kafka import LedgerReader
from sagaline.ops.metrics import SagalineMetrics
from schemas import ApprovalRequested, IncidentResolved, TerminalStatus
from services.cli import main
from tests.system import DrivenClock, RetryDriver, System, wait_until

pytestmark = pytest.mark.kafka


class Office:
    def __init__(self) -> None:
        self.sent: list[str] = []

    @tool(description="Send a letter", owner="post-room")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def send_letter(self, to: str) -> str:
        self.sent.append(to)
        return f"letter-{to}"

    @tool(description="Reserve a room", owner="facilities")
    @compensable(by="free_room")
    def reserve_room(self, room: str) -> str:
        return room

    def free_room(self, ctx: CompensationContext) -> None:
        raise RuntimeError(f"room {ctx.result} is locked")

    @tool(description="Always says no")
    @compensable(by="nothing")
    def refuse(self) -> None:
        raise BusinessRejection("no")

    def nothing(self) -> None:
        return None


@pytest.fixture
def office(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[System, Office]]:
    desk = Office()
    catalogue = wrap(desk, name="office")
    # Driven time: a retry's backoff passes when a RetryDriver moves the clock to it.
    clock = DrivenClock()
    with System(kafka_bootstrap, unique_prefix, tmp_path, [catalogue], clock=clock) as system:
        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
        monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
        monkeypatch.setenv("SAGALINE_HMAC_KEY", "test-key")
        yield system, desk


def _run_in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def _await_request(system: System, saga_id: str) -> ApprovalRequested:
    found: ApprovalRequested = wait_until(
        lambda: next(
            (r for r in system.records(saga_id) if isinstance(r, ApprovalRequested)), None
        ),
        what="an approval request",
    )
    return found


def test_approve_on_the_cli_lets_the_irreversible_step_run_and_show_prints_the_receipt(
    office: tuple[System, Office], capsys: pytest.CaptureFixture[str]
) -> None:
    system, desk = office
    saga = system.client.saga("letters", "agent")

    def agent() -> Any:
        with saga:
            return saga.call("send_letter", to="ada")

    thread, out = _run_in_thread(agent)
    request = _await_request(system, saga.saga_id)
    assert main(["approve", saga.saga_id, request.step_id, "--operator", "alice"]) == 0
    thread.join(60)
    assert out == {"result": "letter-ada"} and desk.sent == ["ada"]
    assert saga.wait(60).status is TerminalStatus.COMPLETED

    capsys.readouterr()
    assert main(["saga", "show", saga.saga_id]) == 0
    text = capsys.readouterr().out
    assert "completed" in text.lower() and "send_letter" in text and "alice" in text
    assert main(["saga", "show", saga.saga_id, "--json"]) == 0
    receipt = orjson.loads(capsys.readouterr().out)
    assert receipt["status"] == "COMPLETED" and receipt["approvals"][0]["by"] == "alice"

    # docs/operating.md: a grant that would not count for the saga is refused with one
    # line and exit code 1 (exit code 2 is for the key), and nothing is written.
    before = len(system.records(saga.saga_id))
    assert main(["approve", saga.saga_id, request.step_id, "--operator", "alice"]) == 1
    err = capsys.readouterr().err
    assert "is not awaiting approval" in err and err.count("\n") == 1, err
    assert main(["approve", "no-such-saga", request.step_id, "--operator", "alice"]) == 1
    assert "no saga 'no-such-saga'" in capsys.readouterr().err
    assert len(system.records(saga.saga_id)) == before


def test_deny_on_the_cli_is_a_business_rejection_R7(
    office: tuple[System, Office],
) -> None:
    system, desk = office
    saga = system.client.saga("letters", "agent")

    def agent() -> Any:
        with saga:
            return saga.call("send_letter", to="bob")

    thread, out = _run_in_thread(agent)
    request = _await_request(system, saga.saga_id)
    code = main(
        ["deny", saga.saga_id, request.step_id, "--operator", "carol", "--reason", "wrong person"]
    )
    assert code == 0
    thread.join(60)
    assert isinstance(out.get("error"), ApprovalDeniedError)
    assert desk.sent == []
    assert saga.wait(60).status is TerminalStatus.COMPENSATED


def test_approve_says_a_record_of_the_saga_could_not_be_read_not_that_there_is_no_request(
    office: tuple[System, Office],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    new_topic_prefix: Any,
) -> None:
    """A command line older than the coordinator could not read the approval request
    it wrote (a schema it does not know) and said the step was not awaiting approval;
    ``find_approval_request`` said there was no such request. Both say that a record
    of the saga could not be read (position, schema) and to upgrade the command line."""
    from sagaline.kafka import create_producer, ensure_topics
    from sagaline.ops.actions import UnknownRequest, find_approval_request
    from schemas.settings import Settings
    from schemas.wire import to_message
    from tests.newer_version import framed_by_a_newer_version

    system, _desk = office
    saga = system.client.saga("letters", "agent")

    def agent() -> Any:
        with saga:
            return saga.call("send_letter", to="eve")

    thread, out = _run_in_thread(agent)
    request = _await_request(system, saga.saga_id)
    records = system.records(saga.saga_id)
    # The same saga on a ledger where a newer coordinator wrote the request.
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", new_topic_prefix("newer"))
    settings = Settings.from_env()
    ensure_topics(system.bootstrap, settings.topics, [], settings.partitions)
    signer = settings.signer()
    producer = create_producer(system.bootstrap)
    newer = b""
    for record in records[: records.index(request) + 1]:
        key, value, headers = to_message(record, signer)
        if record == request:
            value = newer = framed_by_a_newer_version(record)
            headers = signer.headers(key, value)
        producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0
    capsys.readouterr()
    assert main(["approve", saga.saga_id, request.step_id, "--operator", "alice"]) == 1
    err = capsys.readouterr().err
    assert "could not be read" in err and newer[2:10].hex() in err, err
    assert "upgrade" in err, err

    unreadable: list[str] = []
    found = LedgerReader(system.bootstrap).saga_records(
        settings.topics.events, saga.saga_id, signer, unreadable=unreadable
    )
    with pytest.raises(UnknownRequest, match="could not be read") as refused:
        find_approval_request(found, request.approval_id, unreadable=unreadable)
    assert newer[2:10].hex() in str(refused.value)

    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", system.settings.topic_prefix)
    assert (
        main(["deny", saga.saga_id, request.step_id, "--operator", "carol", "--reason", "x"]) == 0
    )
    thread.join(60)
    assert isinstance(out.get("error"), ApprovalDeniedError)


def test_incidents_resolve_says_an_incident_could_not_be_read_not_that_there_is_none(
    kafka_bootstrap: str,
    unique_prefix: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command line older than the coordinator could not read an incident it raised
    (a schema it does not know) and said there was no such incident; `incidents list`
    left it out in silence. Both say a record could not be read and to upgrade."""
    from sagaline.kafka import create_producer, ensure_topics
    from schemas import IncidentRaised, envelope_for
    from schemas.settings import Settings
    from tests.newer_version import framed_by_a_newer_version

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_HMAC_KEY", "test-key")
    settings = Settings.from_env()
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    signer = settings.signer()
    incident = IncidentRaised(
        envelope=envelope_for(
            IncidentRaised,
            saga_id="s-newer",
            tenant_id="default",
            producer="sagaline-coordinator",
            now=1_700_000_000_000,
        ),
        incident_id="inc-newer",
        kind="unknown-outcome",
        inconsistency="i",
        effect="e",
        owner="o",
    )
    newer = framed_by_a_newer_version(incident)
    producer = create_producer(kafka_bootstrap)
    key = b"s-newer"
    producer.produce(
        settings.topics.incidents, key=key, value=newer, headers=signer.headers(key, newer)
    )
    assert producer.flush(30) == 0

    code = main(["incidents", "resolve", "inc-newer", "--operator", "alice", "--resolution", "x"])
    assert code == 1
    err = capsys.readouterr().err
    assert "could not be read" in err and newer[2:10].hex() in err and "upgrade" in err, err
    assert main(["incidents", "list"]) == 0
    out = capsys.readouterr().out
    assert "could not be read" in out and newer[2:10].hex() in out, out


def test_an_approval_needs_an_operator_identity(
    office: tuple[System, Office], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SAGALINE_OPERATOR", raising=False)
    assert main(["approve", "any-saga", "any-step"]) == 2


def test_incidents_list_and_resolve_on_the_cli_R8(
    office: tuple[System, Office], capsys: pytest.CaptureFixture[str]
) -> None:
    system, _desk = office
    with RetryDriver(system):
        with pytest.raises(BusinessRejected), system.client.saga("rooms", "agent") as saga:
            saga.call("reserve_room", room="blue")
            saga.call("refuse")
        # free_room always fails: after its (generous) retries an incident names the owner.
        receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.ESCALATED

    capsys.readouterr()
    assert main(["incidents", "list"]) == 0
    listing = capsys.readouterr().out
    incident_id = receipt.incidents[0].incident_id
    assert incident_id in listing and "owner=facilities" in listing and "OPEN" in listing

    code = main(
        ["incidents", "resolve", incident_id, "--operator", "dave", "--resolution", "unlocked"]
    )
    assert code == 0
    wait_until(
        lambda: any(
            b"IncidentResolved" in (v or b"")
            for _k, v, _h in LedgerReader(system.bootstrap).records(system.topics.incidents)
        ),
        what="the resolution on the incidents topic",
    )
    capsys.readouterr()
    assert main(["incidents", "list"]) == 0
    assert incident_id not in capsys.readouterr().out
    assert main(["incidents", "list", "--all"]) == 0
    assert "resolved by dave: unlocked" in capsys.readouterr().out
    resolutions = [r for r in system.records(saga.saga_id) if isinstance(r, IncidentResolved)]
    assert [r.resolved_by for r in resolutions] == ["dave"]

    # Resolving it again would be ignored (the coordinator acts on the first resolution):
    # refused, saying so, instead of reporting a resolution that never counts.
    capsys.readouterr()
    code = main(["incidents", "resolve", incident_id, "--operator", "erin", "--resolution", "redo"])
    assert code == 1
    err = capsys.readouterr().err
    assert "already resolved by dave: unlocked" in err and err.count("\n") == 1
    resolutions = [r for r in system.records(saga.saga_id) if isinstance(r, IncidentResolved)]
    assert [r.resolved_by for r in resolutions] == ["dave"]


def test_reading_commands_say_in_one_line_when_the_broker_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """saga show, saga wait and incidents list fail like approve does: exit 2 and one
    line naming the broker, not a librdkafka traceback."""
    from sagaline.kafka import KafkaError, KafkaException, LedgerReader
    from services.cli import main

    def unreachable(self: LedgerReader, *args: object, **kwargs: object) -> object:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    # The broker answered at start, then went away: the read fails, not the probe.
    monkeypatch.setattr(sagaline.kafka._clients, "require_broker_answers", lambda *a: None)
    monkeypatch.setattr(LedgerReader, "records", unreachable)
    monkeypatch.setattr(LedgerReader, "partition_count", unreachable)
    for argv in (
        ["saga", "show", "saga-1"],
        ["saga", "wait", "saga-1", "--timeout", "0"],
        ["incidents", "list"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the broker did not answer" in err, (argv, err)


def test_resolving_an_ended_sagas_incident_shows_in_the_coordinators_metrics(
    office: tuple[System, Office],
) -> None:
    """The usual case: the saga ended ESCALATED, then a person resolves its incident.
    The coordinator's /metrics must count the intervention and the recovery, as the
    dashboard's measures do (docs/operations-dashboard.md)."""
    system, _desk = office
    assert system.coordinator is not None
    metrics = system.coordinator.metrics
    assert isinstance(metrics, SagalineMetrics)
    with RetryDriver(system):
        with pytest.raises(BusinessRejected), system.client.saga("rooms", "agent") as saga:
            saga.call("reserve_room", room="green")
            saga.call("refuse")
        receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.ESCALATED
    before = metrics.snapshot()
    assert before.manual_interventions.get("incident_resolved", 0) == 0
    assert "ESCALATED" not in before.time_to_recovery  # an incident is still open

    incident_id = receipt.incidents[0].incident_id
    argv = ["incidents", "resolve", incident_id, "--operator", "dave", "--resolution", "done"]
    assert main(argv) == 0
    # Forwarded to the incidents topic in the transaction that consumed it: once it is
    # there, the coordinator has folded it.
    wait_until(
        lambda: any(
            b"IncidentResolved" in (v or b"")
            for _k, v, _h in LedgerReader(system.bootstrap).records(system.topics.incidents)
        ),
        what="the resolution on the incidents topic",
    )
    after = metrics.snapshot()
    assert after.manual_interventions.get("incident_resolved", 0) == 1
    assert after.time_to_recovery["ESCALATED"].count == 1


def test_saga_wait_and_show_say_when_a_record_of_the_saga_cannot_be_read(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A coordinator already on a later contract version wrote the saga's terminal
    record; this (older) command line cannot read it. `saga wait` waited out its
    timeout and said "not terminal", `saga show` listed the saga as running: both as
    if the record were not there. They must say a record could not be read, and why."""
    from sagaline.kafka import create_producer, ensure_topics
    from schemas import Record, SagaStarted, SagaTerminal, envelope_for
    from schemas.settings import Settings
    from schemas.wire import to_message
    from services.cli import main
    from tests.newer_version import framed_by_a_newer_version

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    settings = Settings.from_env()
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    signer = settings.signer()

    def envelope(cls: type[Record], producer: str) -> Any:
        return envelope_for(
            cls, saga_id="s-newer", tenant_id="default", producer=producer, now=1_700_000_000_000
        )

    started = SagaStarted(envelope=envelope(SagaStarted, "agent"), workflow="w", principal="p")
    terminal = SagaTerminal(
        envelope=envelope(SagaTerminal, "sagaline-coordinator"),
        status=TerminalStatus.COMPLETED,
        receipt=b"{}",
    )
    producer = create_producer(kafka_bootstrap)
    key, value, headers = to_message(started, signer)
    producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    newer = framed_by_a_newer_version(terminal)
    producer.produce(
        settings.topics.events, key=key, value=newer, headers=signer.headers(key, newer)
    )
    assert producer.flush(30) == 0

    assert main(["saga", "wait", "s-newer", "--timeout", "0"]) == 124
    err = capsys.readouterr().err
    assert "could not be read" in err and newer[2:10].hex() in err, err
    assert main(["saga", "show", "s-newer"]) == 0
    out = capsys.readouterr().out
    assert "could not be read" in out and newer[2:10].hex() in out, out


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["saga", "show", "saga-1"],
        ["saga", "wait", "saga-1", "--timeout", "0"],
        ["incidents", "list"],
        ["approve", "saga-1", "01-send_letter", "--operator", "dave"],
        ["catalogue", "withdraw", "post-room"],
        ["topics", "create"],
    ],
    ids=lambda argv: "-".join(argv[:2]),
)
def test_with_no_broker_at_the_address_an_operator_command_says_so_in_one_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Nothing listening at KAFKA_BOOTSTRAP_SERVERS (the broker not started, a wrong
    port): `sagaline status`, `saga show`, `topics create` printed a librdkafka FAIL line every
    50 ms (hundreds of lines over 30 to 60 s) before their own line, which for `status`
    was the bare KafkaError. Now: one line naming the address and what to do, exit 2, no
    client log lines. (The probe's wait is lowered here.)"""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setattr(sagaline.kafka._clients, "BROKER_PROBE_TIMEOUT_S", 3.0, raising=False)
    assert main(argv) == 2, argv
    err = capfd.readouterr().err
    assert "rdkafka" not in err, err[:2000]
    assert err.count("\n") == 1, err
    assert "no Kafka broker answered at 127.0.0.1:1" in err and "sagaline kafka up" in err, err


def test_a_broker_that_refuses_the_clients_security_settings_is_named_not_called_absent(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The broker answers but the client's SASL settings do not match its listener (a
    wrong protocol, mechanism or password): the probe said "no Kafka broker answered at
    ADDRESS ...: start one (`sagaline kafka up` ...)", sending the operator to start a
    broker that runs. It now says the broker refused the client and which settings to
    check; the Kafka client's log stays off stderr."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("SAGALINE_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("SAGALINE_KAFKA_SASL_USERNAME", "operator")
    monkeypatch.setenv("SAGALINE_KAFKA_SASL_PASSWORD", "not-the-password")
    monkeypatch.setattr(sagaline.kafka._clients, "BROKER_PROBE_TIMEOUT_S", 3.0, raising=False)
    assert main(["status"]) == 2
    err = capfd.readouterr().err
    assert "rdkafka" not in err and err.count("\n") == 1, err
    assert f"the Kafka broker at {kafka_bootstrap} refused this client" in err, err
    assert "SASL" in err and "SAGALINE_KAFKA_" in err and "start one" not in err, err
    assert "not-the-password" not in err, err


def test_a_log_level_the_deployment_sets_is_used_by_the_broker_probe_not_overridden(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The probe keeps librdkafka's log of each attempt off stderr by its own
    log_level 0. A deployment that sets SAGALINE_KAFKA_LOG_LEVEL (to see why the
    client cannot connect) got that log hidden and, on every command, a warning that
    its setting "is not used ...: Sagaline sets log_level=0". Its level now wins."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("SAGALINE_KAFKA_LOG_LEVEL", "7")
    monkeypatch.setattr(sagaline.kafka._clients, "BROKER_PROBE_TIMEOUT_S", 3.0, raising=False)
    assert main(["status"]) == 2
    err = capfd.readouterr().err
    assert "log_level=0" not in err, err[:2000]
    assert "rdkafka" in err and "Connection refused" in err, err[:2000]
    assert "no Kafka broker answered at 127.0.0.1:1" in err.splitlines()[-1], err[-2000:]
