"""What an operator types that the system cannot take ends an operator command with one
line and exit code 2, nothing written: never a traceback. On the real broker.

Arguments that are not UTF-8 (a terminal in another encoding, a paste of raw bytes)
reach Python as lone surrogates (``$'\\xff'`` is ``'\\udcff'``): they cannot be
encoded into a record or a Kafka key."""

from __future__ import annotations

import time

import pytest
from coordinator_ledger import Harness, Ledger, approval_requests

from participants import Reversibility
from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas import ApprovalDenied, ApprovalGranted, ApprovalRequested, IncidentResolved, Record
from schemas.codec import decode
from schemas.settings import Settings
from schemas.wire import to_message
from services.cli import main
from tests.coordinator_turns import append

pytestmark = pytest.mark.kafka

NOT_UTF8 = b"caf\xe9".decode("utf-8", "surrogateescape")  # what argv gives for $'caf\xe9'


def _settings(bootstrap: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", prefix)
    monkeypatch.delenv("SAGALINE_HMAC_KEY", raising=False)
    monkeypatch.delenv("SAGALINE_OPERATOR", raising=False)
    return Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=1)


def _awaiting_approval(
    bootstrap: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Settings, ApprovalRequested]:
    """A saga whose irreversible step ``wire`` waits for an operator, on the ledger."""
    settings = _settings(bootstrap, prefix, monkeypatch)
    now = int(time.time() * 1000)
    ledger = Ledger(saga_id="saga-ask", t0=now)
    h = Harness(ledger, now=now)
    records: list[Record] = [ledger.started(), ledger.scheduled("hold"), ledger.committed("hold")]
    h.feed(*records)
    wire = ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE)
    [request] = approval_requests(h.feed(wire))
    ensure_topics(bootstrap, settings.topics, [wire.contract.participant], 1)
    append(settings, bootstrap, *records, wire, request)
    return settings, request


def _open_incident(
    bootstrap: str, prefix: str, monkeypatch: pytest.MonkeyPatch, hmac_key: bytes | None = None
) -> Settings:
    """A saga with incident inc-1 open, on the ledger and on the incident feed (signed
    with ``hmac_key``, given)."""
    settings = _settings(bootstrap, prefix, monkeypatch)
    settings = Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=1, hmac_key=hmac_key)
    ledger = Ledger(saga_id="saga-inc", t0=int(time.time() * 1000))
    first = ledger.scheduled("reserve")
    ensure_topics(bootstrap, settings.topics, [first.contract.participant], 1)
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(
        update={"kind": "manual-check"}
    )
    append(settings, bootstrap, ledger.started(), first, raised)
    producer = create_producer(bootstrap)
    key, value, headers = to_message(raised, settings.signer())
    producer.produce(settings.topics.incidents, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0
    return settings


def _decisions(settings: Settings, bootstrap: str) -> list[Record]:
    kinds = (ApprovalGranted, ApprovalDenied, IncidentResolved)
    return [
        r
        for _k, v, _h in LedgerReader(bootstrap).records(settings.topics.events)
        if isinstance(r := decode(v or b""), kinds)
    ]


def _one_line(err: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_operator_text_that_is_not_utf8_is_refused_in_one_line(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, request = _awaiting_approval(kafka_bootstrap, unique_prefix, monkeypatch)
    saga, step = request.saga_id, request.step_id
    for argv in (
        ["deny", saga, step, "--operator", "alice", "--reason", NOT_UTF8],
        ["deny", saga, step, "--operator", NOT_UTF8, "--reason", "no"],
        ["approve", saga, step, "--operator", NOT_UTF8],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        _one_line(err)
        assert "not valid UTF-8" in err, err
    monkeypatch.setenv("SAGALINE_OPERATOR", NOT_UTF8)
    assert main(["approve", saga, step]) == 2
    err = capsys.readouterr().err
    _one_line(err)
    assert "not valid UTF-8" in err and "operator" in err, err
    assert _decisions(settings, kafka_bootstrap) == []


def test_incident_resolution_text_that_is_not_utf8_is_refused_in_one_line(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _open_incident(kafka_bootstrap, unique_prefix, monkeypatch)
    base = ["incidents", "resolve", "inc-1", "--operator", "bob"]
    for extra in (
        ["--note", NOT_UTF8],
        ["--resolution", NOT_UTF8],
    ):
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        _one_line(err)
        assert "not valid UTF-8" in err, err
    assert _decisions(settings, kafka_bootstrap) == []


def test_an_id_that_is_not_utf8_is_refused_in_one_line(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, request = _awaiting_approval(kafka_bootstrap, unique_prefix, monkeypatch)
    for argv in (
        ["saga", "show", NOT_UTF8],
        ["saga", "wait", NOT_UTF8, "--timeout", "0"],
        ["approve", NOT_UTF8, request.step_id, "--operator", "alice"],
        ["deny", NOT_UTF8, request.step_id, "--operator", "alice", "--reason", "no"],
        ["incidents", "resolve", NOT_UTF8, "--operator", "alice"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        _one_line(err)
        assert "not valid UTF-8" in err, (argv, err)
    assert _decisions(settings, kafka_bootstrap) == []


def test_show_and_wait_say_when_no_record_of_the_saga_verifies_with_this_key(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A command holding another key than the services (a typo in SAGALINE_HMAC_KEY)
    passed over every record of the saga: `saga show` said there was no such saga
    (exit 1) and `saga wait` waited out its whole timeout for a saga that had ended."""
    settings = _settings(kafka_bootstrap, unique_prefix, monkeypatch)
    signed = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, hmac_key=b"right"
    )
    ledger = Ledger(saga_id="saga-key", t0=int(time.time() * 1000))
    first = ledger.scheduled("reserve")
    ensure_topics(kafka_bootstrap, settings.topics, [first.contract.participant], 1)
    append(signed, kafka_bootstrap, ledger.started(), first)
    monkeypatch.setenv("SAGALINE_HMAC_KEY", "wrong")
    for argv in (
        ["saga", "show", "saga-key"],
        ["saga", "wait", "saga-key", "--timeout", "0"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        _one_line(err)
        assert "2 record(s) of saga 'saga-key'" in err and "SAGALINE_HMAC_KEY" in err, err


def test_incidents_say_when_no_record_of_the_feed_verifies_with_this_key(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With another key than the coordinator's, every incident failed verification:
    `incidents list` printed "0 incident(s) open" (exit 0) while one was open, and
    `incidents resolve` said there was no such incident."""
    settings = _open_incident(kafka_bootstrap, unique_prefix, monkeypatch, hmac_key=b"right")
    monkeypatch.setenv("SAGALINE_HMAC_KEY", "right")
    assert main(["incidents", "list"]) == 0
    assert "inc-1" in capsys.readouterr().out
    monkeypatch.setenv("SAGALINE_HMAC_KEY", "wrong")
    for argv in (
        ["incidents", "list"],
        ["incidents", "resolve", "inc-1", "--operator", "bob"],
    ):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        _one_line(captured.err)
        assert "1 record(s)" in captured.err and "SAGALINE_HMAC_KEY" in captured.err, captured
        assert "0 incident(s)" not in captured.out
    assert _decisions(settings, kafka_bootstrap) == []
