"""A decision too large to be a record is refused in one line (CLI) or a 4xx page
(dashboard), naming what is too long and by how much; nothing is written. On the
real broker: the producer's own size check is librdkafka's."""

from __future__ import annotations

import logging
import time

import pytest
from coordinator_ledger import Ledger
from starlette.testclient import TestClient

from sagaline.kafka import (
    KafkaError,
    KafkaException,
    LedgerReader,
    create_producer,
    ensure_topics,
)
from sagaline.ops.actions import OperatorChannel
from sagaline.ops.metrics import SagalineMetrics
from schemas import IncidentRaised, IncidentResolved
from schemas.codec import decode
from schemas.limits import MAX_OPERATOR_TEXT_BYTES, MIN_RECORD_BYTES
from schemas.settings import Settings
from schemas.wire import to_message
from services.cli import main
from services.dashboard.app import create_app
from services.dashboard.view import DashboardState
from tests.coordinator_turns import append

pytestmark = pytest.mark.kafka


def _incident(
    bootstrap: str, prefix: str, monkeypatch: pytest.MonkeyPatch, kind: str = "manual-check"
) -> tuple[Settings, Ledger, IncidentRaised]:
    """One saga with one open incident, on the ledger and on the incident feed."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", prefix)
    monkeypatch.delenv("SAGALINE_HMAC_KEY", raising=False)
    settings = Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=1)
    ledger = Ledger(saga_id="saga-big", t0=int(time.time() * 1000))
    first = ledger.scheduled("reserve")
    ensure_topics(bootstrap, settings.topics, [first.contract.participant], 1)
    raised = ledger.participant_incident("reserve", "inc-1").model_copy(update={"kind": kind})
    append(settings, bootstrap, ledger.started(), first, raised)
    producer = create_producer(bootstrap)  # the incident feed's copy, as the coordinator's
    key, value, headers = to_message(raised, settings.signer())
    producer.produce(settings.topics.incidents, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0
    return settings, ledger, raised


def _resolutions(settings: Settings, bootstrap: str) -> list[IncidentResolved]:
    return [
        r
        for _k, v, _h in LedgerReader(bootstrap).records(settings.topics.events)
        if isinstance(r := decode(v or b""), IncidentResolved)
    ]


def test_a_note_over_the_producers_limit_is_one_line_and_nothing_written(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, _ledger, _raised = _incident(kafka_bootstrap, unique_prefix, monkeypatch)
    monkeypatch.setenv("SAGALINE_KAFKA_MESSAGE_MAX_BYTES", "2000")  # the producer's limit
    note = "x" * 5000  # under MAX_OPERATOR_TEXT_BYTES, over the producer's limit
    rc = main(["incidents", "resolve", "inc-1", "--operator", "bob", "--note", note])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "note alone is 5000 bytes" in err and "Nothing was recorded" in err
    assert _resolutions(settings, kafka_bootstrap) == []


def test_a_decision_over_the_record_limit_is_refused_before_it_is_written(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SAGALINE_MAX_RECORD_BYTES is what the coordinator takes: a larger decision
    would be written and then copied into the saga's state and the incident feed."""
    settings, _ledger, _raised = _incident(
        kafka_bootstrap, unique_prefix, monkeypatch, kind="unknown-outcome"
    )
    limit = MIN_RECORD_BYTES  # the least it may be; a result under its own limit
    monkeypatch.setenv("SAGALINE_MAX_RECORD_BYTES", str(limit))
    result = '{"blob":"' + "y" * limit + '"}'  # canonical JSON, as written
    args = ["--operator", "bob", "--resolution", "COMMITTED", "--result", result]
    rc = main(["incidents", "resolve", "inc-1", *args])
    err = capsys.readouterr().err
    assert rc == 2 and f"over the limit of {limit} bytes (SAGALINE_MAX_RECORD_BYTES)" in err
    assert f"result alone is {len(result)} bytes" in err
    assert _resolutions(settings, kafka_bootstrap) == []


def test_a_result_over_the_result_limit_is_refused(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A COMMITTED resolution's result goes into the step as a tool's would: it is
    held to SAGALINE_MAX_RESULT_BYTES as a tool's is."""
    settings, _ledger, _raised = _incident(
        kafka_bootstrap, unique_prefix, monkeypatch, kind="unknown-outcome"
    )
    monkeypatch.setenv("SAGALINE_MAX_RESULT_BYTES", "1000")
    result = '{"blob": "' + "z" * 2000 + '"}'
    args = ["--operator", "bob", "--resolution", "COMMITTED", "--result", result]
    rc = main(["incidents", "resolve", "inc-1", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "over the limit of 1000 bytes" in err and "RESULT" in err
    assert _resolutions(settings, kafka_bootstrap) == []


def test_the_dashboard_answers_a_decision_over_the_producers_limit_with_a_4xx_page(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, _ledger, raised = _incident(kafka_bootstrap, unique_prefix, monkeypatch)
    monkeypatch.setenv("SAGALINE_KAFKA_MESSAGE_MAX_BYTES", "2000")  # the producer's limit
    state = DashboardState(SagalineMetrics("dashboard"))
    for _k, value, _h in LedgerReader(kafka_bootstrap).records(settings.topics.events):
        state.apply(decode(value or b""))
    channel = OperatorChannel(kafka_bootstrap, settings.topics, settings.signer())
    try:
        client = TestClient(create_app(state, channel))
        response = client.post(
            f"/incidents/{raised.saga_id}/inc-1/resolve",
            data={"operator": "carol", "resolution": "done", "note": "n" * 5000},
            follow_redirects=False,
        )
    finally:
        channel.close()
    assert response.status_code == 400
    assert "note alone is 5000 bytes" in response.text
    assert _resolutions(settings, kafka_bootstrap) == []


def test_an_operators_text_over_its_cap_is_refused_before_it_is_written(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The coordinator copies a resolution or a denial's reason into the saga's state
    and receipt (and a refusal's detail): far under SAGALINE_MAX_RECORD_BYTES, a few
    pasted logs could still push the saga over it and park it. Operator text is held
    to MAX_OPERATOR_TEXT_BYTES, refused in one line, nothing written."""
    settings, _ledger, _raised = _incident(kafka_bootstrap, unique_prefix, monkeypatch)
    text = "r" * (MAX_OPERATOR_TEXT_BYTES + 1)
    rc = main(["incidents", "resolve", "inc-1", "--operator", "bob", "--resolution", text])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"resolution is {MAX_OPERATOR_TEXT_BYTES + 1} bytes" in err
    assert f"limit of {MAX_OPERATOR_TEXT_BYTES} bytes" in err and "Nothing was recorded" in err
    assert _resolutions(settings, kafka_bootstrap) == []


def test_the_dashboard_refuses_a_note_over_the_operator_text_cap_with_a_4xx_page(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, _ledger, raised = _incident(kafka_bootstrap, unique_prefix, monkeypatch)
    state = DashboardState(SagalineMetrics("dashboard"))
    for _k, value, _h in LedgerReader(kafka_bootstrap).records(settings.topics.events):
        state.apply(decode(value or b""))
    channel = OperatorChannel(kafka_bootstrap, settings.topics, settings.signer())
    note = "log line\n" * 2_000  # 18 KB of pasted logs: under every other limit
    try:
        client = TestClient(create_app(state, channel))
        response = client.post(
            f"/incidents/{raised.saga_id}/inc-1/resolve",
            data={"operator": "carol", "resolution": "done", "note": note},
            follow_redirects=False,
        )
    finally:
        channel.close()
    assert response.status_code == 400
    assert f"note is {len(note)} bytes" in response.text
    assert "Nothing was recorded" in response.text
    assert _resolutions(settings, kafka_bootstrap) == []


class _RefusingProducer:
    """A producer whose ``produce`` raises what librdkafka raises at once for a
    reason other than size (an unknown topic, a fatal producer error)."""

    def __init__(self, real: object) -> None:
        self._real = real

    def produce(self, *_args: object, **_kwargs: object) -> None:
        raise KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC, "Unknown topic"))

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_the_dashboard_answers_a_producer_error_with_a_page_not_a_traceback(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A KafkaException from produce that is not about size was a 500 with a
    traceback: the operator could not tell whether the decision counted."""
    settings, _ledger, raised = _incident(kafka_bootstrap, unique_prefix, monkeypatch)
    state = DashboardState(SagalineMetrics("dashboard"))
    for _k, value, _h in LedgerReader(kafka_bootstrap).records(settings.topics.events):
        state.apply(decode(value or b""))
    channel = OperatorChannel(kafka_bootstrap, settings.topics, settings.signer())
    channel._writer.producer = _RefusingProducer(channel._writer.producer)  # type: ignore[assignment]
    try:
        client = TestClient(create_app(state, channel))
        with caplog.at_level(logging.WARNING, logger="sagaline.dashboard"):
            response = client.post(
                f"/incidents/{raised.saga_id}/inc-1/resolve",
                data={"operator": "carol", "resolution": "done"},
                follow_redirects=False,
            )
    finally:
        channel.close()
    assert response.status_code == 502
    assert "Not recorded" in response.text and "nothing was recorded" in response.text
    assert "Unknown topic" in response.text and "Traceback" not in response.text
    logged = [r for r in caplog.records if "Unknown topic" in r.getMessage()]
    assert len(logged) == 1
    assert _resolutions(settings, kafka_bootstrap) == []
