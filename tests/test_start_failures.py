"""A start that fails before the loop closes what was opened for it, once.

A participant runtime whose ``ensure_topics``, journal retention lookup, poll
interval lookup or consumer creation raised left its tool pool, its ledger writer
(its producer) and its journal (a SQLite handle) open; a coordinator whose checks
before joining (topic sizes, terminal memory, fencing, subscribe) raised left its
consumer and its commit thread pool open. A long-lived process that retries the
start (``sagaline.connect()`` in a loop, the MCP proxy, ``SagaClient(local)``)
leaked threads, sockets and file handles at every failed try. Real broker."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException

import coordinator.shell as shell_module
import participants.client as client_module
import participants.runtime as runtime_module
import sagaline
from coordinator.shell import Coordinator
from participants import ParticipantRuntime, wrap
from participants.client import ClientStopped, SagaClient
from sagaline.kafka import ensure_topics
from schemas.settings import Settings

pytestmark = pytest.mark.kafka


def _release(reservation_id: str) -> None:
    pass


@sagaline.compensable(by=_release, args=lambda c: {"reservation_id": c.result})
def reserve(flight: str) -> str:
    """Reserve a seat."""
    return f"r-{flight}"


SEATS = wrap(reserve, name="seats")


def _settings(bootstrap: str, prefix: str, state: Path) -> Settings:
    return Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=1, state_dir=state)


def _refused(*args: object, **kwargs: object) -> object:
    raise KafkaException("start refused: TOPIC_AUTHORIZATION_FAILED")


def _record_close(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, closes: list[str]
) -> None:
    """``owner.close()`` appends ``name`` to ``closes``, then closes as before."""
    close = owner.close

    def recorded(*args: Any, **kwargs: Any) -> Any:
        closes.append(name)
        return close(*args, **kwargs)

    monkeypatch.setattr(owner, "close", recorded)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


@pytest.mark.parametrize(
    "step", ["ensure_topics", "journal_keep_ms", "_max_poll_interval_s", "create_consumer"]
)
def test_a_runtime_whose_start_fails_before_its_loop_closes_what_it_opened(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    before = _threads()
    runtime = ParticipantRuntime(
        SEATS, _settings(kafka_bootstrap, unique_prefix, tmp_path), kafka_bootstrap
    )
    closes: list[str] = []
    _record_close(monkeypatch, runtime._writer, "writer", closes)
    _record_close(monkeypatch, runtime.handler, "handler", closes)
    monkeypatch.setattr(runtime_module, step, _refused)
    with pytest.raises(KafkaException, match="start refused"):
        runtime.run()
    with pytest.raises(sqlite3.ProgrammingError):  # the journal is closed
        runtime.journal.get("c")
    assert sorted(closes) == ["handler", "writer"]  # each once
    assert runtime._writer._closed.is_set()
    assert _threads() - before == set()


@pytest.mark.parametrize("step", ["topic sizes", "terminal memory"])
def test_a_coordinator_whose_start_fails_before_its_loop_closes_what_it_opened(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    before = _threads()
    coordinator = Coordinator(
        _settings(kafka_bootstrap, unique_prefix, tmp_path), kafka_bootstrap, instance_id="sf-1"
    )
    if step == "topic sizes":
        monkeypatch.setattr(shell_module, "topics_max_message_bytes", _refused)
    else:
        monkeypatch.setattr(coordinator, "_check_terminal_memory", _refused)
    closes: list[str] = []
    consumer = coordinator._consumer

    class Recorded:
        def __getattr__(self, name: str) -> object:
            return getattr(consumer, name)

        def close(self) -> None:
            closes.append("consumer")
            consumer.close()

    coordinator._consumer = Recorded()  # type: ignore[assignment]
    with pytest.raises(KafkaException, match="start refused"):
        coordinator.run()
    assert closes == ["consumer"]
    with pytest.raises(RuntimeError):  # the commit thread pool is shut down
        coordinator._sender.submit(lambda: None)
    assert _threads() - before == set()


@pytest.mark.parametrize("failure", ["ledger missing", "listener refused", "local tools"])
def test_a_saga_client_whose_start_fails_closes_what_it_opened_once(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
) -> None:
    """A ``SagaClient`` whose start() raised (the ledger topic missing, its listener's
    consumer refused, its local tools' runtime refused) left its ledger writer (a
    producer and its poll thread) open: ``with SagaClient(...)`` never reaches
    ``__exit__`` when ``__enter__`` raises, so a process retrying leaked one per try.
    Now the failed start closes it, once, and a second start() on that client is
    refused (``ClientStopped``, naming a new client) instead of running half-closed."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    if failure != "ledger missing":
        ensure_topics(kafka_bootstrap, settings.topics, ["seats"], 1)
    if failure == "listener refused":
        monkeypatch.setattr(client_module, "create_consumer", _refused)
    if failure == "local tools":
        monkeypatch.setattr(runtime_module, "ensure_topics", _refused)
    before = _threads()
    local = SEATS if failure == "local tools" else None
    client = SagaClient(settings, kafka_bootstrap, local=local)
    closes: list[str] = []
    _record_close(monkeypatch, client._writer, "writer", closes)
    with pytest.raises(Exception) as raised, client:  # each failure its own type
        pytest.fail("the start should have failed")
    assert not isinstance(raised.value, ClientStopped)
    assert closes == ["writer"]
    assert client._writer._closed.is_set()
    assert _threads() - before == set()
    with pytest.raises(ClientStopped, match="use a new client"):
        client.start()
    client.close()  # as a caller's own clean-up: nothing closed twice
    assert closes == ["writer"]
