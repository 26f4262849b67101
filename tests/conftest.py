"""Shared, generic pytest fixtures: a real Kafka broker and per-test topic names.

* ``kafka_bootstrap`` (session): the broker chosen by
  :func:`services.broker.choose_broker` -- ``KAFKA_BOOTSTRAP_SERVERS``, else the
  local JVM broker (started once, then reused across sessions), else
  testcontainers. The broker is left running at the end (it is cached and the
  next run reuses it in a fraction of a second) unless ``SAGALINE_STOP_BROKER=1``.
* ``unique_prefix``: a fresh topic-name prefix per test, so tests never share
  topics and need no cleanup between runs on the shared broker.
* ``admin``: a confluent_kafka ``AdminClient`` on that broker.
* ``transport``: for behaviour suites written once and run twice, the bootstrap of
  the real broker and of a fresh in-process transport (``memory://...``,
  :mod:`sagaline.kafka._memory`); ``-k memory`` runs the fast tier alone.

Keep this file generic; fixtures for one area belong in that area's test files.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient

from services import broker, kafka_local

_chosen: list[broker.BrokerChoice] = []


def pytest_report_header(config: pytest.Config) -> str:
    return f"kafka: {broker.describe_configured()}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``secretscan`` read what every other test left on the broker:
    they run last."""
    items.sort(key=lambda item: item.get_closest_marker("secretscan") is not None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for choice in _chosen:
        terminalreporter.write_line(f"kafka: {choice.description}")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    choice = broker.choose_broker()
    _chosen.append(choice)
    yield choice.bootstrap
    if choice.source == "local-jvm" and os.environ.get("SAGALINE_STOP_BROKER") == "1":
        kafka_local.down()


@pytest.fixture
def unique_prefix() -> str:
    """E.g. ``t3f9a0c1d.``: prepend it to every topic (and group id) a test creates."""
    return f"t{uuid.uuid4().hex[:8]}."


@pytest.fixture
def admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture(params=["kafka", "memory"])
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "kafka":
        bootstrap: str = request.getfixturevalue("kafka_bootstrap")
        return bootstrap
    return f"memory://{uuid.uuid4().hex[:12]}"
