"""A record whose header name is not UTF-8, on the real broker (R16).

Kafka does not check header names. confluent-kafka cannot turn such a name into a
``str``: ``msg.headers()`` raises ``SystemError`` (from a ``UnicodeDecodeError``) and
leaves a half-built list on the message, which the next ``msg.headers()`` hands out:
touching its bad entry crashes the interpreter. Every consumer must send such a record
to the DLQ (key and value as they were; its headers cannot be copied) and go on.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.shell import Coordinator
from participants.client import SagaClient
from sagaline.kafka import LedgerReader, ensure_topics
from schemas import StepCommitted, StepFailed, envelope_for
from schemas.models import FailureKind
from schemas.settings import Settings
from schemas.wire import read_dead_letter, to_message
from services.dashboard.consumer import LedgerFollower
from services.dashboard.view import DashboardState
from tests.raw_headers import produce_raw
from tests.system import wait_until
from tests.test_participant_runtime import Harness, _of

pytestmark = pytest.mark.kafka

WAIT_S = 120.0  # a generous bound for a busy machine; never a timing claim
BAD_NAME = b"\xff\xfetrace"


def _poisoned(headers: list[tuple[str, bytes | str | None]]) -> list[tuple[bytes, bytes]]:
    """The record's own (signature) headers behind one whose name is not UTF-8."""
    out = [(BAD_NAME, b"x")]
    for name, value in headers:
        assert isinstance(value, bytes)
        out.append((name.encode(), value))
    return out


def _dead_letters(bootstrap: str, dlq: str) -> list[tuple[bytes | None, bytes | None, str, str]]:
    out = []
    for key, value, headers in LedgerReader(bootstrap).records(dlq):
        letter = read_dead_letter(headers)
        out.append((key, value, letter.reason, letter.detail))
    return out


@pytest.fixture
def events(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> Iterator[tuple[Settings, threading.Thread, SagaClient, LedgerFollower]]:
    settings = Settings(
        bootstrap=kafka_bootstrap,
        topic_prefix=unique_prefix,
        partitions=1,
        hmac_key=b"header-test-key",
        state_dir=tmp_path,
    )
    ensure_topics(kafka_bootstrap, settings.topics, [], 1)
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id=f"hdr-{uuid.uuid4().hex[:6]}")
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    client = SagaClient(settings, kafka_bootstrap, call_timeout_s=WAIT_S).start()
    follower = LedgerFollower(kafka_bootstrap, settings.topics, settings.signer(), DashboardState())
    follower.start()
    try:
        yield settings, thread, client, follower
    finally:
        follower.stop()
        client.close()
        coordinator.stop()
        thread.join(30)


def test_the_coordinator_client_and_dashboard_dead_letter_a_header_name_that_is_not_utf8(
    kafka_bootstrap: str,
    events: tuple[Settings, threading.Thread, SagaClient, LedgerFollower],
) -> None:
    """It stopped the coordinator (a restart stops on it again: every saga stalls),
    the agent's listener (every wait of the client failed) and the dashboard."""
    settings, coordinator, client, follower = events
    with client.saga("headers", "tester") as saga:
        failed = StepFailed(
            envelope=envelope_for(
                StepFailed,
                saga_id=saga.saga_id,
                tenant_id=saga.tenant_id,
                producer="payments",
                now=1_700_000_000_000,
            ),
            step_id="01-x",
            tool="x",
            idempotency_key="k",
            attempt=1,
            kind=FailureKind.TRANSIENT,
            error_type="E",
            message="m",
        )
        key, value, headers = to_message(failed, settings.signer())
        produce_raw(kafka_bootstrap, settings.topics.events, key, value, _poisoned(headers))
    # The saga ends behind the record: the coordinator decided on, the listener heard it.
    receipt = saga.wait(WAIT_S)
    assert receipt.status.value == "COMPLETED"
    assert coordinator.is_alive()

    def letter() -> list[tuple[bytes | None, bytes | None, str, str]]:
        return [d for d in _dead_letters(kafka_bootstrap, settings.topics.dlq) if d[1] == value]

    [(dlq_key, _value, reason, detail)] = wait_until(letter, WAIT_S, "the record in the DLQ")
    assert (dlq_key, reason) == (key, "malformed")
    assert "not UTF-8" in detail

    wait_until(
        lambda: follower.rejected >= 1 or not follower.alive, WAIT_S, "the dashboard to skip it"
    )
    assert follower.alive, follower.health()
    assert follower.rejected == 1


def test_the_participant_runtime_dead_letters_a_header_name_that_is_not_utf8(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Dead-lettering it read the half-built headers again: the process crashed
    (SIGSEGV), and every restart crashed on the same command."""
    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)
    harness.start()
    try:
        poisoned = harness.execute("s1", {"sku": "a", "quantity": 1})
        key, value, headers = to_message(poisoned, harness.settings.signer())
        topic = harness.settings.topics.commands("shop")
        produce_raw(kafka_bootstrap, topic, key, value, _poisoned(headers))
        harness.send(harness.execute("s2", {"sku": "b", "quantity": 1}))
        records = harness.wait_for(
            lambda rs: any(r.step_id == "s2" for r in _of(rs, StepCommitted)), WAIT_S
        )
        assert not [r for r in _of(records, StepCommitted) if r.step_id == "s1"]
        assert harness.shop.count("reserve") == 1
        dead = [d for d in _dead_letters(kafka_bootstrap, harness.settings.topics.dlq)]
        assert [(d[0], d[1], d[2]) for d in dead] == [(key, value, "malformed")]
        assert "not UTF-8" in dead[0][3]
    finally:
        harness.stop()


def test_an_oversized_key_id_header_is_refused_in_a_few_lines_not_copied_into_every_log_line(
    kafka_bootstrap: str,
    events: tuple[Settings, threading.Thread, SagaClient, LedgerFollower],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A forged record whose sagaline-kid header is 200 KB: the refusal quoted the whole
    header, so the coordinator wrote a 200 KB WARNING line per such record (a few
    thousand of them fill a disk) and the DLQ detail, cut at 2000 characters, lost
    what it was about to say (which key id this service holds)."""
    from sagaline.kafka import create_producer

    settings, coordinator, _client, _follower = events
    huge = b"k" * 200_000
    producer = create_producer(kafka_bootstrap)
    failed = StepFailed(
        envelope=envelope_for(
            StepFailed, saga_id="s-forged", tenant_id="default", producer="p", now=1
        ),
        step_id="01-x",
        tool="x",
        idempotency_key="k",
        attempt=1,
        kind=FailureKind.TRANSIENT,
        error_type="E",
        message="m",
    )
    key, value, _headers = to_message(failed, settings.signer())
    with caplog.at_level("WARNING"):
        producer.produce(
            settings.topics.events,
            key=key,
            value=value,
            headers=[("sagaline-sig", b"00" * 32), ("sagaline-kid", huge)],
        )
        assert producer.flush(30) == 0

        def letter() -> list[tuple[bytes | None, bytes | None, str, str]]:
            return [d for d in _dead_letters(kafka_bootstrap, settings.topics.dlq) if d[1] == value]

        [(_key, _value, reason, detail)] = wait_until(letter, WAIT_S, "the record in the DLQ")
    assert coordinator.is_alive()
    assert reason == "bad-signature"
    assert "this service holds 'k1'" in detail
    longest = max(len(r.getMessage()) for r in caplog.records if r.name.startswith("sagaline"))
    assert longest < 10_000, f"a log line of {longest} characters"


def test_latest_by_key_skips_a_key_that_is_not_utf8(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """``LedgerReader.latest_by_key`` decoded each key strictly: a tombstone on the
    topic whose key is not UTF-8 raised UnicodeDecodeError, and no latest record of
    any key could be read. Such a key keys no saga: skipped."""
    from sagaline.kafka import create_producer
    from schemas import SagaStarted

    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    signer = settings.signer()
    started = SagaStarted(
        envelope=envelope_for(
            SagaStarted, saga_id="s-good", tenant_id="default", producer="agent", now=1
        ),
        workflow="w",
        principal="p",
    )
    key, value, headers = to_message(started, signer)
    producer = create_producer(kafka_bootstrap)
    producer.produce(settings.topics.terminal, key=key, value=value, headers=headers)
    producer.produce(settings.topics.terminal, key=b"\xff\xfe", value=value)
    producer.produce(settings.topics.terminal, key=b"\xff\xfe", value=None)
    assert producer.flush(30) == 0

    latest = LedgerReader(kafka_bootstrap).latest_by_key(settings.topics.terminal, signer)
    assert list(latest) == ["s-good"] and latest["s-good"] == started
