"""The dashboard's ledger follower rides out a partition whose leader is not known yet.

CI saw it: right after the topics were created, ``get_watermark_offsets`` answered
NOT_LEADER_FOR_PARTITION, the follower thread stopped for good and the page never
showed a record. A stand-in consumer (no broker) raises that once for one partition.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import OFFSET_INVALID, KafkaError, KafkaException, TopicPartition
from dashboard_scenarios import SagaScript, awaiting_approval, completed, running
from starlette.testclient import TestClient

from schemas import ApprovalRequested
from schemas.models import Record
from schemas.signing import Signer
from schemas.topics import TopicNames
from schemas.wire import to_message
from services.dashboard import consumer as consumer_module
from services.dashboard import view as view_module
from services.dashboard.app import create_app
from services.dashboard.consumer import LedgerFollower
from services.dashboard.view import DashboardState, SagaView

TOPICS = TopicNames("t.")


class LeaderlessOnce:
    """Three topics of two partitions; the events topic's partition 1 has no known
    leader the first time its watermarks are asked for."""

    def __init__(self) -> None:
        self.assigned: list[tuple[str, int]] = []
        self.failed = False
        self.high = 7

    def list_topics(self, timeout: float) -> Any:
        names = (TOPICS.events, TOPICS.terminal, TOPICS.incidents)
        topic = SimpleNamespace(error=None, partitions={0: None, 1: None})
        return SimpleNamespace(topics=dict.fromkeys(names, topic))

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        if (tp.topic, tp.partition) == (TOPICS.events, 1) and not self.failed:
            self.failed = True
            raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
        return 0, self.high

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.assigned += [(tp.topic, tp.partition) for tp in tps]

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, 0) for tp in tps]


def test_a_partition_without_a_leader_is_followed_at_the_next_refresh() -> None:
    follower = LedgerFollower("unused:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = LeaderlessOnce()

    follower._refresh(consumer)  # type: ignore[arg-type]
    assert consumer.failed
    assert (TOPICS.events, 1) not in consumer.assigned and len(consumer.assigned) == 5
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert not follower.caught_up.is_set()  # a partition of the start is still unread

    consumer.high = 9
    follower._refresh(consumer)  # type: ignore[arg-type]
    assert sorted(consumer.assigned) == sorted(
        (t, p) for t in (TOPICS.events, TOPICS.terminal, TOPICS.incidents) for p in (0, 1)
    )
    # Its target is what it held when it could first be read.
    assert follower._targets[(TOPICS.events, 1)] == 9
    assert follower._targets[(TOPICS.events, 0)] == 7


class RetentionEmptied:
    """One partition (of the incidents topic) whose every record the broker has
    deleted (retention): watermarks (3, 3). librdkafka then never reports a position
    for it (OFFSET_INVALID: nothing was consumed), as it does for a real broker after
    ``delete_records`` up to the end. The other partitions hold nothing."""

    def list_topics(self, timeout: float) -> Any:
        names = (TOPICS.events, TOPICS.terminal, TOPICS.incidents)
        topic = SimpleNamespace(error=None, partitions={0: None})
        return SimpleNamespace(topics=dict.fromkeys(names, topic))

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return (3, 3) if tp.topic == TOPICS.incidents else (0, 0)

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        pass

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, OFFSET_INVALID) for tp in tps]


def test_a_partition_whose_records_all_expired_does_not_hold_back_caught_up() -> None:
    """A quiet partition of sagaline.incidents (90 days' retention) ends up empty but
    with a high watermark above 0: there is nothing to read, so the dashboard is caught
    up (it was not: /healthz answered 503 for good)."""
    follower = LedgerFollower("unused:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = RetentionEmptied()

    follower._refresh(consumer)  # type: ignore[arg-type]
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert follower.caught_up.is_set()


class TopicsOf:
    """A broker holding only ``names`` (of two partitions each, empty)."""

    def __init__(self, *names: str) -> None:
        self.names = list(names)

    def list_topics(self, timeout: float) -> Any:
        topic = SimpleNamespace(error=None, partitions={0: None, 1: None})
        return SimpleNamespace(topics=dict.fromkeys(self.names, topic))

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return 0, 0

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        pass

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, 0) for tp in tps]


def test_topics_missing_at_start_are_named_in_the_log_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dashboard pointed at topics that do not exist (a wrong SAGALINE_TOPIC_PREFIX,
    or started before the coordinator made them) followed nothing, its /healthz 503
    for good, and said nothing of why in its log. It names the missing topics and
    what to check now, once (not at every refresh), and says when they appear."""
    follower = LedgerFollower("broker:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = TopicsOf("other.sagaline.events")
    with caplog.at_level(logging.INFO, logger="sagaline.dashboard"):
        follower._refresh(consumer)  # type: ignore[arg-type]
        follower._refresh(consumer)  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    for name in (TOPICS.events, TOPICS.terminal, TOPICS.incidents):
        assert name in warnings[0], warnings[0]
    assert "broker:9092" in warnings[0] and "SAGALINE_TOPIC_PREFIX" in warnings[0], warnings[0]

    caplog.clear()
    consumer.names += [TOPICS.events, TOPICS.terminal, TOPICS.incidents]
    with caplog.at_level(logging.INFO, logger="sagaline.dashboard"):
        follower._refresh(consumer)  # type: ignore[arg-type]
    assert any("following" in r.getMessage() for r in caplog.records), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# ------------------------------------------- one bad record, and a follower that died


class Message:
    """What ``consume`` hands over: one record of the events topic."""

    def __init__(
        self, key: bytes, value: bytes, headers: list[tuple[str, str | bytes | None]]
    ) -> None:
        self._key, self._value, self._headers = key, value, headers

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return TOPICS.events

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, str | bytes | None]]:
        return self._headers


class Scripted:
    """The events topic, one partition (the other two topics exist, empty and with no
    partition to follow), delivered one batch per ``consume``: the first
    batch is all that existed at start (so the follower is caught up after it), the
    others arrive later. ``done`` is set once the follower asks for more after the last
    batch, or when it closes the consumer (its thread is ending): no sleeps, no polls."""

    def __init__(self, batches: list[list[Message]], then: Exception | None = None) -> None:
        self.batches = batches
        self.then = then  # raised by the consume after the last batch
        self.delivered = 0
        self.produced = len(batches[0])
        self.done = threading.Event()
        self.closed = False
        self._idle = threading.Event()

    def list_topics(self, timeout: float) -> Any:
        events = SimpleNamespace(error=None, partitions={0: None})
        others = SimpleNamespace(error=None, partitions={})
        return SimpleNamespace(
            topics={TOPICS.events: events, TOPICS.terminal: others, TOPICS.incidents: others}
        )

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return 0, self.produced

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        pass

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.delivered) for tp in tps]

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        if self.batches:
            batch = self.batches.pop(0)
            self.delivered += len(batch)
            self.produced = max(self.produced, self.delivered)
            return batch
        if self.then is not None:
            raise self.then
        self.done.set()
        self._idle.wait(timeout)  # an empty poll, as a real consumer's
        return []

    def close(self) -> None:
        self.closed = True
        self.done.set()

    def settle(self, follower: LedgerFollower) -> threading.Thread:
        """Wait until the follower asked for more or is ending (then until it ended)."""
        assert self.done.wait(120), "the follower neither read everything nor ended"
        thread = follower._thread
        assert thread is not None
        if self.closed:
            thread.join()
        return thread


def _messages(signer: Signer, *scripts: SagaScript) -> list[Message]:
    return [Message(*to_message(r, signer)) for s in scripts for r in s.records]


def _follow(
    monkeypatch: pytest.MonkeyPatch, consumer: Scripted, signer: Signer
) -> tuple[LedgerFollower, DashboardState]:
    monkeypatch.setattr(consumer_module, "create_consumer", lambda *a, **k: consumer)
    state = DashboardState()
    return LedgerFollower("unused:9092", TOPICS, signer, state), state


@contextmanager
def stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[TestClient, LedgerFollower, DashboardState]]:
    """The app over a follower whose consumer broke ("the consumer is broken") once it
    had read saga s-1 and caught up: its thread has ended when this yields."""
    signer = Signer(b"k" * 32)
    consumer = Scripted(
        [_messages(signer, running("s-1"))], then=RuntimeError("the consumer is broken")
    )
    follower, state = _follow(monkeypatch, consumer, signer)
    with TestClient(create_app(state, follower=follower)) as client:
        assert not consumer.settle(follower).is_alive()
        yield client, follower, state


def test_a_record_whose_fold_raises_is_counted_and_the_follower_goes_on_R16(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug folding one record type stopped the follower thread for good: the page
    showed the view as it was at that record for ever, and /healthz still said 200."""
    real_fold = view_module._fold

    def fold(saga: SagaView, record: Record) -> None:
        if isinstance(record, ApprovalRequested):
            raise ValueError("a fold bug for approval requests")
        real_fold(saga, record)

    monkeypatch.setattr(view_module, "_fold", fold)
    signer = Signer(b"k" * 32)
    consumer = Scripted(
        [
            _messages(signer, running("s-before")),
            _messages(signer, awaiting_approval("s-bad")),
            _messages(signer, running("s-after")),
        ]
    )
    follower, state = _follow(monkeypatch, consumer, signer)
    with TestClient(create_app(state, follower=follower)) as client:
        thread = consumer.settle(follower)
        health = client.get("/healthz")
        # (follower alive, the later saga shown, /healthz) -- it was (False, False, 200).
        assert (thread.is_alive(), "s-after" in state.sagas, health.status_code) == (
            True,
            True,
            200,
        )
        assert follower.fold_errors == 1
        assert health.json()["fold_errors"] == 1
        assert client.get("/api/state").json()["fold_errors"] == 1
    assert "s-bad" in caplog.text and "a fold bug for approval requests" in caplog.text
    assert "ApprovalRequested" in caplog.text


def test_healthz_answers_503_with_the_reason_once_the_follower_thread_has_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever ends the follower (here its consumer breaks after it caught up), the
    page would show a frozen view: /healthz must not keep answering 200."""
    with stopped(monkeypatch) as (client, follower, state):
        assert follower.caught_up.is_set() and "s-1" in state.sagas
        health = client.get("/healthz")
        assert health.status_code == 503, health.text
        assert "the consumer is broken" in health.json()["follower"]


def test_a_record_written_by_a_newer_version_is_reported_not_skipped_in_silence(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator already on a later contract version wrote a saga's terminal record
    under a schema this dashboard does not know. The follower skipped it with a DEBUG
    line and a count nobody could see: the saga stayed "running" on the page for good
    while /healthz said all was well, and nobody sends such a record to the DLQ (its
    writer reads it). Now it is logged at WARNING (what to upgrade) and counted in
    /healthz and /api/state."""
    from schemas import SagaTerminal
    from tests.newer_version import framed_by_a_newer_version

    signer = Signer(b"k" * 32)
    script = completed("s-newer")
    *readable, terminal = script.records
    assert isinstance(terminal, SagaTerminal)
    key = terminal.saga_id.encode()
    value = framed_by_a_newer_version(terminal)
    messages = [Message(*to_message(r, signer)) for r in readable]
    messages.append(Message(key, value, signer.headers(key, value)))
    consumer = Scripted([messages])
    follower, state = _follow(monkeypatch, consumer, signer)
    with caplog.at_level("INFO"), TestClient(create_app(state, follower=follower)) as client:
        consumer.settle(follower)
        health = client.get("/healthz").json()
        api = client.get("/api/state").json()
    assert (health.get("unreadable_records"), api.get("unreadable_records")) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(value[2:10].hex() in w and "upgrade" in w for w in warnings), warnings


def test_records_that_fail_verification_are_counted_and_reported_not_skipped_in_silence(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A dashboard given another key than the services' (or a record tampered with, or
    bytes that are no record) skipped every such record with a DEBUG line and a count
    nobody could see: the page showed no sagas, or a saga without its records, while
    /healthz said all was well and the log said nothing. Now they are counted in
    /healthz and /api/state, and the first of each kind is logged at WARNING."""
    ours, theirs = Signer(b"k" * 32), Signer(b"x" * 32)
    forged = _messages(theirs, running("s-forged"))
    garbage = Message(b"s-junk", b"\x00\x01 not a record", [])
    consumer = Scripted([[*_messages(ours, running("s-good")), *forged, garbage]])
    follower, state = _follow(monkeypatch, consumer, ours)
    with caplog.at_level("INFO"), TestClient(create_app(state, follower=follower)) as client:
        consumer.settle(follower)
        health = client.get("/healthz").json()
        api = client.get("/api/state").json()
    assert set(state.sagas) == {"s-good"}
    rejected = len(forged) + 1
    assert (health.get("rejected_records"), api.get("rejected_records")) == (rejected, rejected)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("signature" in w for w in warnings), warnings
    assert len(warnings) == 2, warnings  # once per kind, not once per record


@pytest.mark.parametrize("why", ["forged", "newer"])
def test_a_live_saga_whose_start_was_skipped_unread_is_still_shown(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Once caught up, the view drops a ledger record of a saga it does not know (a
    late record of a forgotten one). A saga whose SagaStarted the follower skipped
    unread (it fails verification, or a newer agent wrote it under a schema this
    dashboard cannot read) is no forgotten saga: its later records must still show it,
    as the skip warning says ("sagas are shown without them")."""
    from schemas import SagaStarted
    from tests.newer_version import framed_by_a_newer_version

    signer = Signer(b"k" * 32)
    script = running("s-live")
    start, *rest = script.records
    assert isinstance(start, SagaStarted)
    if why == "forged":
        first = Message(*to_message(start, Signer(b"x" * 32)))
    else:
        key = start.saga_id.encode()
        value = framed_by_a_newer_version(start)
        first = Message(key, value, signer.headers(key, value))
    later = [Message(*to_message(r, signer)) for r in rest]
    # Nothing at start (caught up at once), then the saga, live.
    consumer = Scripted([[], [first, *later]])
    follower, state = _follow(monkeypatch, consumer, signer)
    with TestClient(create_app(state, follower=follower)):
        consumer.settle(follower)
    assert (follower.rejected, "s-live" in state.sagas) == (1, True)
    assert state.late_records_of_forgotten_sagas == 0


class TopicsHolding(TopicsOf):
    """A broker holding ``names``, each partition with ``high`` records not read yet."""

    high = 5

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return 0, self.high


@pytest.mark.parametrize("present_at_start", [(), (TOPICS.events,)])
def test_topics_created_after_start_are_read_before_caught_up(
    present_at_start: tuple[str, ...],
) -> None:
    """A dashboard started before the coordinator made the topics (all of them, or all
    but the ledger) said caught up (/healthz 200) as soon as they appeared, before it
    had read a record of what they already held: the page showed an empty or partial
    view as complete. What they hold when first followed is read first."""
    follower = LedgerFollower("broker:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = TopicsHolding(*present_at_start)
    follower._refresh(consumer)  # type: ignore[arg-type]
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert not follower.caught_up.is_set()  # the topics are not all there yet

    consumer.names = [TOPICS.events, TOPICS.terminal, TOPICS.incidents]
    follower._refresh(consumer)  # type: ignore[arg-type]
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert not follower.caught_up.is_set(), "caught up before reading the new topics"
    assert follower._targets[(TOPICS.terminal, 1)] == 5

    consumer.position = lambda tps: [  # type: ignore[method-assign]
        TopicPartition(tp.topic, tp.partition, 5) for tp in tps
    ]
    follower._check_caught_up(consumer)  # type: ignore[arg-type]
    assert follower.caught_up.is_set()
