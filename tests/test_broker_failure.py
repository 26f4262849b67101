"""The broker is a failure domain too (issue 11, item 4).

Each test runs the refund demo (coordinator and five participants as real processes)
on a broker of its OWN (a state dir and ports under ``tmp_path``; never the shared
broker other tests and people use), and hurts the broker mid-run:

* a single broker killed with SIGKILL and started again on the same data and ports;
* a three-node KRaft cluster (topics with replication factor 3 and
  ``min.insync.replicas`` 2, from ``SAGALINE_REPLICATION_FACTOR`` /
  ``SAGALINE_MIN_INSYNC_REPLICAS``) with one node stopped for the rest of the run.

Then nothing is lost and nothing is stuck: every saga terminal, and each provider's
own SQLite file agrees with the receipts (every effect exactly once). Marked
``soak``: the sagas per run come from ``SAGALINE_BROKER_SAGAS`` (default 24); the
counts are printed for the issue note (``-s``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from services import kafka_local
from services.demo import DemoFault
from services.demo_processes import Supervisor, release_in_background
from tests.fault_runs import RestartOnFailure, counts, env_int
from tests.test_demo_e2e import assert_world_agrees_with_receipts, run

pytestmark = [pytest.mark.kafka, pytest.mark.soak]

SAGAS = env_int("SAGALINE_BROKER_SAGAS", 24)
TIMEOUT_S = max(300.0, SAGAS * 3.0)


def _own(what: str) -> None:
    if os.environ.get("SAGALINE_NO_OWN_BROKER") == "1":
        pytest.skip(f"SAGALINE_NO_OWN_BROKER=1: this machine cannot run {what}")


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Path]:
    """A single broker of this test's own (state dir under tmp_path)."""
    _own("a broker of its own")
    state = tmp_path / "broker"
    kafka_local.ensure_running(state)
    yield state
    kafka_local.down(state)


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[Path]:
    """A three-node KRaft cluster of this test's own."""
    _own("a cluster of its own")
    state = tmp_path / "cluster"
    kafka_local.ensure_cluster(state, brokers=3)
    yield state
    kafka_local.down(state)


@pytest.mark.timeout(int(TIMEOUT_S) + 300)
def test_a_broker_killed_mid_run_and_restarted_loses_nothing(
    own_broker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = kafka_local.status(own_broker)
    assert before.running and before.bootstrap and before.pid

    restarter: list[RestartOnFailure] = []

    def kill_and_restart(supervisor: Supervisor) -> str:
        restarter.append(RestartOnFailure(supervisor))
        pid = kafka_local.kill(own_broker)
        assert pid is not None, "the broker was not running"
        again = kafka_local.ensure_running(own_broker)  # same data dir, same ports
        return f"kill -9 broker pid {pid}; restarted as pid {again.pid} on {again.bootstrap}"

    result = run(
        tmp_path,
        monkeypatch,
        before.bootstrap,
        sagas=SAGAS,
        seed=11,
        faults=(DemoFault(max(1, SAGAS // 3), "broker", kill_and_restart),),
        timeout_s=TIMEOUT_S,
    )
    for r in restarter:
        r.stop()
    print("\n" + counts(result).line("broker kill -9 + restart"))
    for fault in result.faults:
        print(f"  fault: {fault}")
    for line in (r for w in restarter for r in w.restarts):
        print(f"  restart policy: {line}")
    assert [f.service for f in result.faults] == ["broker"]
    assert result.faults[0].terminal_before < SAGAS, "the kill happened mid-run"
    after = kafka_local.status(own_broker)
    assert after.bootstrap == before.bootstrap and after.pid != before.pid
    assert result.exit_code == 0, result.violations
    assert_world_agrees_with_receipts(result)


@pytest.mark.timeout(int(TIMEOUT_S) + 300)
def test_a_cluster_node_stopped_mid_run_loses_nothing_and_nothing_sticks(
    own_cluster: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = kafka_local.status(own_cluster).bootstrap
    assert bootstrap is not None and len(bootstrap.split(",")) == 3
    monkeypatch.setenv("SAGALINE_REPLICATION_FACTOR", "3")
    monkeypatch.setenv("SAGALINE_MIN_INSYNC_REPLICAS", "2")
    stopped: list[int] = []

    restarter: list[RestartOnFailure] = []

    def stop_a_node(supervisor: Supervisor) -> str:
        restarter.append(RestartOnFailure(supervisor))
        # The node leading the most partitions of the ledger: the worst one to lose.
        leaders = _ledger_leaders(bootstrap)
        node = max(leaders, key=lambda n: leaders[n])
        kafka_local.stop_node(own_cluster, node, kill=True)
        stopped.append(node)
        return f"kill -9 node {node} (leader of {leaders[node]} ledger partitions), left down"

    result = run(
        tmp_path,
        monkeypatch,
        bootstrap,
        sagas=SAGAS,
        seed=11,
        faults=(DemoFault(max(1, SAGAS // 3), "broker-node", stop_a_node),),
        timeout_s=TIMEOUT_S,
    )
    for r in restarter:
        r.stop()
    print("\n" + counts(result).line("3-node cluster, one node killed"))
    for fault in result.faults:
        print(f"  fault: {fault}")
    for line in (r for w in restarter for r in w.restarts):
        print(f"  restart policy: {line}")
    assert len(stopped) == 1 and result.faults[0].terminal_before < SAGAS
    assert not kafka_local.status(own_cluster).running, "the node stayed down to the end"
    topic = f"{result.prefix}sagaline.events"
    # A node is down, so the client is destroyed off this thread (release_in_background).
    admin = [AdminClient({"bootstrap.servers": bootstrap})]
    md = admin[0].list_topics(topic, timeout=30)
    release_in_background(admin)
    assert all(len(p.replicas) == 3 for p in md.topics[topic].partitions.values())
    assert result.exit_code == 0, result.violations
    assert_world_agrees_with_receipts(result)


def _ledger_leaders(bootstrap: str) -> dict[int, int]:
    """Node id -> how many partitions of any ``*sagaline.events`` topic it leads."""
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    leaders: dict[int, int] = {n: 0 for n in md.brokers}
    for name, topic in md.topics.items():
        if name.endswith("sagaline.events"):
            for partition in topic.partitions.values():
                leaders[partition.leader] = leaders.get(partition.leader, 0) + 1
    return leaders
