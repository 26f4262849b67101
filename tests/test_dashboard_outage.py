"""What the dashboard's pages say while the view does not follow Kafka.

The page refreshes its regions every two seconds whatever happens; while the broker
cannot be reached, or the follower thread has stopped, it showed the last view it had
as if it were live (only /healthz, which no operator looks at, said anything).
"""

from __future__ import annotations

import logging
import re
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from sagaline.kafka import Consumer, KafkaError, KafkaException, ensure_topics
from schemas.settings import Settings
from schemas.signing import Signer
from services.dashboard import Dashboard
from services.dashboard.app import create_app
from services.dashboard.consumer import LedgerFollower
from services.dashboard.view import DashboardState
from tests.system import wait_until
from tests.test_dashboard_follower import TOPICS, stopped


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _state_once(client: TestClient, key: str, what: str) -> dict[str, Any]:
    """/api/state's answer once its ``key`` says something (polled, for up to 60 s)."""
    state: dict[str, Any] = wait_until(
        lambda: (body := client.get("/api/state").json()).get(key) and body, 60, what
    )
    return state


def test_the_pages_say_kafka_cannot_be_reached_rather_than_showing_a_view_as_live() -> None:
    bootstrap = f"127.0.0.1:{_closed_port()}"  # nothing listens: a broker outage
    settings = Settings(bootstrap=bootstrap, topic_prefix="outage.", hmac_key=b"k" * 32)
    dashboard = Dashboard(bootstrap, settings)
    with TestClient(dashboard.app, base_url="http://localhost") as client:
        state = _state_once(client, "kafka", "the dashboard to notice Kafka cannot be reached")
        assert bootstrap in state["kafka"], state["kafka"]
        assert state["caught_up"] is False
        for path in ("/", "/fragment/overview"):
            page = client.get(path).text
            assert 'class="notice error stale"' in page, path
            assert "cannot read from Kafka" in page and bootstrap in page, path
        assert bootstrap in client.get("/healthz").json()["kafka"]


def test_the_pages_say_the_view_no_longer_moves_once_the_follower_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with stopped(monkeypatch) as (client, _, _):
        for path in ("/", "/fragment/overview", "/sagas/s-1", "/fragment/saga/s-1"):
            page = client.get(path).text
            assert 'class="notice error stale"' in page, path
            assert "the consumer is broken" in page, path
            assert "restart the dashboard" in page.lower(), path


def test_while_catching_up_the_pages_say_the_view_is_incomplete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = DashboardState()
    follower = LedgerFollower("unused:9092", TOPICS, Signer(b"k" * 32), state)
    monkeypatch.setattr(LedgerFollower, "alive", property(lambda self: True))
    client = TestClient(create_app(state, follower=follower))  # no lifespan: not started
    page = client.get("/").text
    assert 'class="notice stale"' in page and "still reading" in page
    follower.caught_up.set()
    page = client.get("/").text
    assert "still reading" not in page and "stale" not in page


@pytest.mark.kafka
def test_while_its_topics_are_missing_the_pages_and_healthz_name_them(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    # A wrong SAGALINE_TOPIC_PREFIX, or a coordinator that never started: the page only
    # said it was "still reading", for good, and /healthz answered 503 with no word of
    # why (an orchestrator's probe log showed "not ready"); the log alone named them.
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, hmac_key=b"k" * 32)
    topics = settings.topics
    names = [topics.events, topics.terminal, topics.incidents]
    dashboard = Dashboard(kafka_bootstrap, settings)
    with TestClient(dashboard.app, base_url="http://localhost") as client:
        state = _state_once(client, "missing_topics", "the dashboard to find its topics missing")
        assert [m.split(" ")[0] for m in state["missing_topics"]] == names, state
        assert state["caught_up"] is False
        for path in ("/", "/fragment/overview"):
            page = client.get(path).text
            assert 'class="notice error stale"' in page, path
            assert all(name in page for name in names), path
            assert "SAGALINE_TOPIC_PREFIX" in page, path
        health = client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["missing_topics"] == state["missing_topics"], health.json()

        ensure_topics(kafka_bootstrap, topics, partitions=1)
        wait_until(
            lambda: client.get("/api/state").json()["caught_up"],
            60,
            "the dashboard to follow the topics once created",
        )
        assert client.get("/api/state").json()["missing_topics"] == []
        page = client.get("/").text
        assert "stale" not in page and topics.events not in page
        health = client.get("/healthz")
        assert health.status_code == 200 and "missing_topics" not in health.json()


def _refreshes_of_a_follower_of(
    bootstrap: str, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """Runs a follower of ``bootstrap`` until it has refreshed its metadata ``count``
    times (each of them a failed attempt and librdkafka's retries while none answers)."""
    done: list[None] = []
    refresh = LedgerFollower._refresh

    def counted(self: LedgerFollower, consumer: Consumer) -> None:
        refresh(self, consumer)
        done.append(None)

    monkeypatch.setattr(LedgerFollower, "_refresh", counted)
    follower = LedgerFollower(bootstrap, TOPICS, Signer(b"k" * 32), DashboardState())
    follower.start()
    try:
        wait_until(lambda: len(done) >= count, 60, f"{count} metadata refreshes")
    finally:
        follower.stop()


def _librdkafka_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "|rdkafka#consumer" in line]


def test_a_broker_outage_is_logged_once_not_at_each_of_librdkafkas_retries(
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # librdkafka wrote a "Connect ... failed: Connection refused" line to stderr every
    # 50 ms or so, and the follower a WARNING each second, for as long as the broker
    # was down: the operator's log drowned; the pages already say it (kafka_problem).
    monkeypatch.delenv("SAGALINE_KAFKA_LOG_LEVEL", raising=False)
    caplog.set_level(logging.INFO, logger="sagaline.dashboard")
    bootstrap = f"127.0.0.1:{_closed_port()}"
    _refreshes_of_a_follower_of(bootstrap, monkeypatch, 3)
    retries = _librdkafka_lines(capfd.readouterr().err)
    assert len(retries) <= 1, retries[:5]
    said = [r for r in caplog.records if "cannot reach Kafka" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text[:2000]
    assert bootstrap in said[0].getMessage()


def test_a_log_level_the_deployment_sets_still_shows_librdkafkas_retries(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # SAGALINE_KAFKA_LOG_LEVEL is how an operator asks for librdkafka's own log: the
    # dashboard's quieter default must not override it.
    monkeypatch.setenv("SAGALINE_KAFKA_LOG_LEVEL", "3")
    _refreshes_of_a_follower_of(f"127.0.0.1:{_closed_port()}", monkeypatch, 2)
    assert len(_librdkafka_lines(capfd.readouterr().err)) > 1


class DownThenUp:
    """A broker that cannot be reached for ``down`` metadata requests, then holds the
    three topics (empty, one partition each)."""

    def __init__(self, down: int) -> None:
        self.down = down

    def list_topics(self, timeout: float) -> Any:
        if self.down > 0:
            self.down -= 1
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Connection refused"))
        topic = SimpleNamespace(error=None, partitions={0: None})
        names = (TOPICS.events, TOPICS.terminal, TOPICS.incidents)
        return SimpleNamespace(topics=dict.fromkeys(names, topic))

    def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
        return 0, 0

    def incremental_assign(self, tps: list[Any]) -> None:
        pass

    def position(self, tps: list[Any]) -> list[Any]:
        return tps


def test_the_end_of_an_outage_is_logged_once_with_how_long_it_lasted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sagaline.dashboard")
    follower = LedgerFollower("b:9092", TOPICS, Signer(b"k" * 32), DashboardState())
    consumer = DownThenUp(down=4)
    for _ in range(6):
        follower._refresh(consumer)  # type: ignore[arg-type]
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "cannot reach Kafka" in m]) == 1, messages
    back = [m for m in messages if "answers again" in m]
    assert len(back) == 1 and re.search(r"after \d+ s", back[0]), messages
    assert follower.kafka_problem is None
