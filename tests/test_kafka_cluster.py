"""The local launcher's three-node KRaft cluster (``sagaline kafka up --brokers 3``).

The config test is pure. The cluster test starts three JVMs of its own (state dir
under ``tmp_path``, ports chosen free), so it is marked ``soak``: it checks that the
cluster forms, that topics created from settings get replication factor 3 and
``min.insync.replicas`` 2 (and so do topics created with no replication settings:
the brokers' defaults, not one replica the brokers' ``min.insync.replicas=2``
refuses every write to), that a node killed with SIGKILL leaves the cluster
writable with ``acks=all``, and that the node comes back on its ports and data.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from sagaline.kafka import ensure_topics
from schemas.settings import Settings
from schemas.topics import Replication
from services import kafka_cli, kafka_local
from tests.system import wait_until


def test_a_cluster_node_config_names_every_voter_and_replicates_internal_topics() -> None:
    text = kafka_local.render_server_properties(
        port=9001,
        controller_port=9101,
        data_dir=Path("/tmp/x"),
        node_id=2,
        voters="1@127.0.0.1:9100,2@127.0.0.1:9101,3@127.0.0.1:9102",
        replication=3,
    )
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9100,2@127.0.0.1:9101,3@127.0.0.1:9102"
    assert props["offsets.topic.replication.factor"] == "3"
    assert props["transaction.state.log.replication.factor"] == "3"
    assert props["transaction.state.log.min.isr"] == "2"
    assert props["default.replication.factor"] == "3"
    assert props["min.insync.replicas"] == "2"


def test_the_single_broker_config_is_unchanged_by_default() -> None:
    text = kafka_local.render_server_properties(
        port=9001, controller_port=9101, data_dir=Path("/tmp/x")
    )
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert props["node.id"] == "1"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9101"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["min.insync.replicas"] == "1"


def test_cluster_commands_never_default_to_the_shared_broker_dir() -> None:
    parser = argparse.ArgumentParser(prog="sagaline")
    kafka_cli.register(parser.add_subparsers())
    args = parser.parse_args(["kafka", "down", "--brokers", "3"])
    assert kafka_cli._state_dir(args) == str(kafka_local.default_cluster_dir(3))
    assert kafka_local.default_cluster_dir(3) != kafka_local.default_state_dir()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Path]:
    if os.environ.get("SAGALINE_NO_OWN_BROKER") == "1":
        pytest.skip("SAGALINE_NO_OWN_BROKER=1: this machine cannot run a cluster of its own")
    state = tmp_path / "cluster"
    first = kafka_local.ensure_cluster(state, brokers=3)
    assert first.started
    yield state
    kafka_local.down(state)


@pytest.mark.kafka
@pytest.mark.soak
def test_a_three_node_cluster_survives_a_killed_node(cluster: Path) -> None:
    again = kafka_local.ensure_cluster(cluster, brokers=3)
    assert not again.started, "a running cluster is reused"
    bootstrap = again.bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert set(admin.list_topics(timeout=30).brokers) == {1, 2, 3}

    # No SAGALINE_REPLICATION_FACTOR: the brokers' default.replication.factor (3), not
    # one replica under their min.insync.replicas=2 (refused at start, never writable).
    plain = Settings(topic_prefix="d.")
    ensure_topics(bootstrap, plain.topics, ["payments"], 3, replication=plain.replication)
    md = admin.list_topics(plain.topics.events, timeout=30).topics[plain.topics.events]
    assert all(len(p.replicas) == 3 for p in md.partitions.values())

    settings = Settings(topic_prefix="c.", replication=Replication(factor=3, min_insync=2))
    ensure_topics(
        bootstrap,
        settings.topics,
        ["payments"],
        3,
        replication=settings.replication,
    )
    events = settings.topics.events
    md = admin.list_topics(events, timeout=30).topics[events]
    assert all(len(p.replicas) == 3 for p in md.partitions.values())
    resource = ConfigResource(ConfigResource.Type.TOPIC, events)

    def described() -> dict[str, Any] | None:
        # The node that answers may not have the new topic's metadata yet
        # (UNKNOWN_TOPIC_OR_PART): ask again until it has.
        try:
            config: dict[str, Any] = admin.describe_configs([resource])[resource].result(30)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
            return None
        return config

    config = wait_until(described, 60, "the new topic's configs on every node")
    assert config["min.insync.replicas"].value == "2"

    assert kafka_local.kill_node(cluster, 2)
    status = kafka_local.status(cluster)
    assert not status.running and "down: [2]" in status.detail
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    delivered: list[object] = []
    for i in range(30):  # every partition, acknowledged by the 2 in-sync replicas left
        producer.produce(
            events, key=f"k{i}".encode(), value=b"v", on_delivery=lambda e, _m: delivered.append(e)
        )
    assert producer.flush(120) == 0
    assert delivered == [None] * 30

    pid = kafka_local.start_node(cluster, 2)
    assert pid > 0
    assert kafka_local.status(cluster).running
    assert kafka_local.cluster_nodes(cluster)[1].bootstrap in bootstrap, "same ports again"
