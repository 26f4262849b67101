"""Shared, generic pytest fixtures: a real Kafka broker and per-test topic names.

* ``kafka_bootstrap`` (session): the broker chosen by
  :func:`services.broker.choose_broker` -- ``KAFKA_BOOTSTRAP_SERVERS``, else the
  local JVM broker (started once, then reused across sessions), else
  testcontainers. The broker is left running at the end (it is cached and the
  next run reuses it in a fraction of a second) unless ``SAGALINE_STOP_BROKER=1``
  (not in a pytest-xdist worker: the others still use it).
* ``unique_prefix``: a fresh topic-name prefix per test, so tests never share
  topics. ``new_topic_prefix(kind)`` makes more (``kind`` = lower-case letters);
  ``tests.topic_cleanup.record_prefix`` records one a test learned (a demo run's).
  Every topic and consumer group whose name starts with a prefix the session handed
  out is deleted when the session (each pytest-xdist worker's) ends: a long-lived
  broker would otherwise pile up every run's topics until it runs out of open files,
  and every run's groups (tests/topic_cleanup.py; ``SAGALINE_KEEP_TEST_TOPICS=1``
  keeps them). A group a member is still in is left, and named in the report.
* ``admin``: a confluent_kafka ``AdminClient`` on that broker.
* ``transport``: for behaviour suites written once and run twice, the bootstrap of
  the real broker and of a fresh in-process transport (``memory://...``,
  :mod:`sagaline.kafka._memory`); ``-k memory`` runs the fast tier alone.

Keep this file generic; fixtures for one area belong in that area's test files.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka.admin import AdminClient

from services import broker, kafka_local
from tests.topic_cleanup import SESSION

_chosen: list[broker.BrokerChoice] = []
_topics = SESSION
_cleanup_report: list[str] = []
_CLEANUP_KEY = "sagaline_cleanup"  # a pytest-xdist worker's cleanup lines, for the controller


def pytest_report_header(config: pytest.Config) -> str:
    return f"kafka: {broker.describe_configured()}"


# The longest tests, started first: in a parallel run (pytest-xdist, scripts/test.sh)
# none of them is left to run alone at the end while the other workers sit idle.
SLOW_FIRST = (
    "test_scale_out.py",
    "test_broker_failure.py",
    "test_demo_e2e.py",
    "test_fuzz_consumers.py",
    "test_drill.py",
    "test_soak.py",
    "test_kafka_cluster.py",
    "test_kafka_sasl.py",
    "test_operator_acls.py",
    "test_compose_services.py",
)


def _order(item: pytest.Item) -> tuple[bool, int]:
    name = item.path.name
    return (
        item.get_closest_marker("secretscan") is not None,
        SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``secretscan`` read what every other test left on the broker:
    they run last. In a parallel run nothing is "last", so there they are left out
    when other tests are selected too (scripts/test.sh runs them in a second, serial
    pytest after the parallel one)."""
    items.sort(key=_order)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        scans = [i for i in items if i.get_closest_marker("secretscan") is not None]
        if scans and len(scans) < len(items):
            config.hook.pytest_deselected(items=scans)
            items[:] = [i for i in items if i not in scans]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    for choice in _chosen:
        terminalreporter.write_line(f"kafka: {choice.description}")
    for line in _cleanup_report:
        terminalreporter.write_line(line)
    parallel = config.getoption("numprocesses", None)
    if parallel and "secretscan" not in (config.getoption("markexpr") or ""):
        terminalreporter.write_line(
            "secretscan tests do not run in a parallel run, and its sessions delete their "
            "topics at the end: scripts/test.sh scans them before deleting them (by hand: "
            "SAGALINE_KEEP_TEST_TOPICS=1, then `pytest -m secretscan`)"
        )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist: a worker's cleanup line (it cannot print one itself), for the
    run's summary."""
    output = getattr(node, "workeroutput", {})
    worker = getattr(node, "workerinput", {}).get("workerid", "?")
    for line in output.get(_CLEANUP_KEY, []):
        _cleanup_report.append(line.replace("kafka: ", f"kafka: [{worker}] ", 1))


@pytest.fixture(scope="session")
def kafka_bootstrap(pytestconfig: pytest.Config) -> Iterator[str]:
    choice = broker.choose_broker()
    _chosen.append(choice)
    yield choice.bootstrap
    # This session's topics and groups go (only those: their names carry its unique
    # prefixes).
    try:
        line = _topics.finish(choice.bootstrap)
    except Exception as exc:  # a broker already gone must not fail the last test
        line = f"could not delete this session's test topics and groups: {exc}"
    if line:
        _cleanup_report.append(f"kafka: {line}")
        # A pytest-xdist worker's summary is never shown: its controller prints it.
        workeroutput = getattr(pytestconfig, "workeroutput", None)
        if workeroutput is not None:
            workeroutput.setdefault(_CLEANUP_KEY, []).append(f"kafka: {line}")
    # Each pytest-xdist worker has a session of its own: the first to finish must not
    # stop the broker under the others (scripts/test.sh stops it after the run).
    if (
        choice.source == "local-jvm"
        and os.environ.get("SAGALINE_STOP_BROKER") == "1"
        and "PYTEST_XDIST_WORKER" not in os.environ
    ):
        kafka_local.down()


@pytest.fixture
def unique_prefix() -> str:
    """E.g. ``t3f9a0c1d.``: prepend it to every topic (and group id) a test creates.
    Its topics and groups are deleted when the session ends."""
    return _topics.new_prefix()


@pytest.fixture(scope="session")
def new_topic_prefix() -> Callable[..., str]:
    """``new_topic_prefix("drill")`` -> ``drill3f9a0c1d.``; deleted like ``unique_prefix``."""
    return _topics.new_prefix


@pytest.fixture
def admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture(params=["kafka", "memory"])
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "kafka":
        bootstrap: str = request.getfixturevalue("kafka_bootstrap")
        return bootstrap
    return f"memory://{uuid.uuid4().hex[:12]}"
