"""Existing topics whose replication breaks what ``acks=all`` promises (R10) are not
started on: a replication factor below ``SAGALINE_REPLICATION_FACTOR``, a
``min.insync.replicas`` above the topic's replication factor (every write refused)
or below ``SAGALINE_MIN_INSYNC_REPLICAS``. A replicated topic on the broker's
``min.insync.replicas=1`` is started on with a warning.

The local broker is a single node, so the real-broker tests show what one node can
(a topic of one replica against a factor of 2, a ``min.insync.replicas`` of 2 on it);
the decision itself is tested without a broker."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from sagaline.kafka import TopicSetupError, create_admin, ensure_topics
from sagaline.kafka._topics import _broker_defaults, _default_factor_verdict, _replication_verdict
from schemas.settings import Settings
from schemas.topics import Replication, TopicNames
from tests.system import wait_until


def _create(bootstrap: str, name: str, partitions: int, config: dict[str, str]) -> None:
    admin = create_admin(bootstrap)
    futures = admin.create_topics([NewTopic(name, partitions, 1, config=config)])
    futures[name].result(timeout=60)


# ----------------------------------------------------------------- the decision


def test_a_replication_factor_below_the_configured_one_is_refused() -> None:
    refusal, warning = _replication_verdict("t", 1, 1, Replication(factor=3, min_insync=2))
    assert refusal is not None and warning is None
    assert "replication factor 1" in refusal and "SAGALINE_REPLICATION_FACTOR=3" in refusal


def test_min_insync_above_the_replication_factor_is_refused_whatever_is_configured() -> None:
    refusal, _ = _replication_verdict("t", 1, 2, Replication())
    assert refusal is not None
    assert "min.insync.replicas=2" in refusal and "replication factor 1" in refusal
    assert "NOT_ENOUGH_REPLICAS" in refusal


def test_min_insync_above_the_replicas_advises_more_replicas_not_only_a_lower_min_insync() -> None:
    """A cluster whose brokers default to min.insync.replicas=2, and one-replica topics
    (made by a start without SAGALINE_REPLICATION_FACTOR): lowering min.insync.replicas
    to 1 would make them writable but keep every record on one broker. The advice
    names the fix that keeps what acks=all promises: more replicas."""
    refusal, _ = _replication_verdict("t", 1, 2, Replication())
    assert refusal is not None
    assert "SAGALINE_REPLICATION_FACTOR" in refusal
    assert "at least 2 replicas" in refusal


def test_min_insync_below_the_configured_one_is_refused() -> None:
    refusal, _ = _replication_verdict("t", 3, 1, Replication(factor=3, min_insync=2))
    assert refusal is not None
    assert "min.insync.replicas=1" in refusal and "SAGALINE_MIN_INSYNC_REPLICAS=2" in refusal


def test_a_replicated_topic_on_min_insync_one_is_only_warned_about() -> None:
    refusal, warning = _replication_verdict("t", 3, 1, Replication(factor=3))
    assert refusal is None and warning is not None
    assert "min.insync.replicas=1" in warning and "SAGALINE_MIN_INSYNC_REPLICAS" in warning


@pytest.mark.parametrize(
    ("replicas", "min_insync", "wanted"),
    [
        (1, 1, Replication()),  # the development broker
        (3, 2, Replication(factor=3, min_insync=2)),  # the production advice
        (3, 2, Replication()),  # more than asked for
        (5, 3, Replication(factor=3, min_insync=2)),
        (3, 1, Replication(factor=3, min_insync=1)),  # asked for, on purpose
        (3, None, Replication(factor=3, min_insync=2)),  # not described: unchecked
    ],
)
def test_topics_that_keep_what_acks_all_promises_pass(
    replicas: int, min_insync: int | None, wanted: Replication
) -> None:
    assert _replication_verdict("t", replicas, min_insync, wanted) == (None, None)


def test_an_unset_replication_factor_is_the_brokers_default() -> None:
    """Like SAGALINE_MIN_INSYNC_REPLICAS (and kafka-topics.sh without
    --replication-factor): unset, the cluster's default.replication.factor applies,
    not a fixed 1 that a cluster defaulting to min.insync.replicas=2 refuses."""
    assert Settings.from_env({}).replication.factor is None
    assert Settings.from_env({"SAGALINE_REPLICATION_FACTOR": "3"}).replication.factor == 3
    assert Replication(min_insync=2).topic_config() == {"min.insync.replicas": "2"}


def test_a_default_factor_below_the_brokers_min_insync_is_refused_with_the_factor_to_set() -> None:
    """Three brokers defaulting to min.insync.replicas=2 but default.replication.factor=1:
    topics made with the default could take no acks=all write. Refused before any is
    made, naming the setting that fixes it (not a lower min.insync.replicas)."""
    refusal = _default_factor_verdict(3, 1, 2, Replication())
    assert refusal is not None
    assert "SAGALINE_REPLICATION_FACTOR=3" in refusal
    assert "default.replication.factor=1" in refusal and "min.insync.replicas=2" in refusal


def test_a_default_factor_below_the_configured_min_insync_is_refused() -> None:
    refusal = _default_factor_verdict(5, 2, 1, Replication(min_insync=3))
    assert refusal is not None
    assert "SAGALINE_REPLICATION_FACTOR=3" in refusal
    assert "SAGALINE_MIN_INSYNC_REPLICAS=3" in refusal


def test_a_cluster_smaller_than_its_min_insync_is_refused_without_a_factor_to_set() -> None:
    refusal = _default_factor_verdict(1, 1, 2, Replication())
    assert refusal is not None
    assert "1 broker" in refusal and "SAGALINE_REPLICATION_FACTOR=" not in refusal


@pytest.mark.parametrize(
    ("brokers", "default_factor", "min_insync", "wanted"),
    [
        (1, 1, 1, Replication()),  # the development broker, no settings
        (3, 3, 2, Replication()),  # `sagaline kafka up --brokers 3`, a managed cluster
        (3, 1, 1, Replication()),  # Kafka's own defaults: made as before
        (3, 3, 1, Replication(min_insync=2)),
    ],
)
def test_a_default_factor_that_takes_acks_all_writes_passes(
    brokers: int, default_factor: int, min_insync: int, wanted: Replication
) -> None:
    assert _default_factor_verdict(brokers, default_factor, min_insync, wanted) is None


# ------------------------------------------------------------- on the broker


@pytest.mark.kafka
def test_an_existing_topic_with_fewer_replicas_than_configured_is_refused_before_creating(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A deployment set to SAGALINE_REPLICATION_FACTOR=2 started on a ledger made
    with one replica (an earlier start without the setting, a broker's
    auto.create.topics.enable): it started silently, its acknowledged records on one
    broker only. Now refused, naming the topic and both factors, before any missing
    topic is made."""
    names = TopicNames(unique_prefix)
    _create(kafka_bootstrap, names.events, 1, {"cleanup.policy": "delete"})
    admin = create_admin(kafka_bootstrap)  # listed a moment after its creation's answer
    wait_until(lambda: names.events in admin.list_topics(timeout=30).topics, what="listed")
    with pytest.raises(TopicSetupError) as caught:
        ensure_topics(kafka_bootstrap, names, ["p"], 1, replication=Replication(factor=2))
    text = str(caught.value)
    assert repr(names.events) in text
    assert "replication factor 1" in text and "SAGALINE_REPLICATION_FACTOR=2" in text
    listed = admin.list_topics(timeout=30).topics
    assert names.state not in listed and names.commands("p") not in listed


@pytest.mark.kafka
@pytest.mark.parametrize("topic", ["events", "commands"])
def test_an_existing_topic_whose_min_insync_exceeds_its_replicas_is_refused(
    kafka_bootstrap: str, unique_prefix: str, topic: str
) -> None:
    """min.insync.replicas=2 on a topic of one replica: the broker refuses every
    acks=all write to it (NOT_ENOUGH_REPLICAS, retried until the delivery times
    out), so the service would run and write nothing. Refused at start instead."""
    names = TopicNames(unique_prefix)
    name = names.events if topic == "events" else names.commands("p")
    _create(kafka_bootstrap, name, 1, {"cleanup.policy": "delete", "min.insync.replicas": "2"})
    with pytest.raises(TopicSetupError) as caught:
        ensure_topics(kafka_bootstrap, names, ["p"], 1)
    text = str(caught.value)
    assert repr(name) in text and "min.insync.replicas=2" in text


@pytest.mark.kafka
def test_topics_on_the_single_node_broker_pass_without_a_warning(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, ["p"], 1)
    with caplog.at_level(logging.INFO, logger="sagaline.kafka"):
        assert ensure_topics(kafka_bootstrap, names, ["p"], 1) == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not [r for r in caplog.records if "not checked" in r.getMessage()]


@pytest.mark.kafka
def test_without_a_factor_topics_get_the_brokers_default(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """No replication settings: the broker's defaults are read before creating, and
    the topics made have its default.replication.factor (1 on the development broker,
    which keeps working with no settings)."""
    admin = create_admin(kafka_bootstrap)
    defaults = _broker_defaults(admin, admin.list_topics(timeout=30).brokers, 30.0)
    assert defaults is not None, "the broker's defaults are readable here"
    _, default_factor, _ = defaults
    names = TopicNames(unique_prefix)
    created = ensure_topics(kafka_bootstrap, names, ["p"], 1)
    assert names.events in created
    listed = admin.list_topics(timeout=30).topics
    assert {len(p.replicas) for p in listed[names.events].partitions.values()} == {default_factor}


@pytest.mark.kafka
def test_a_configured_min_insync_above_the_default_factor_is_refused_before_creating(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """SAGALINE_MIN_INSYNC_REPLICAS=2 without SAGALINE_REPLICATION_FACTOR on a
    broker whose default.replication.factor is 1: refused naming the factor to set,
    and no topic is made (none would take an acks=all write)."""
    admin = create_admin(kafka_bootstrap)
    defaults = _broker_defaults(admin, admin.list_topics(timeout=30).brokers, 30.0)
    assert defaults is not None
    _, default_factor, _ = defaults
    wanted = Replication(min_insync=default_factor + 1)
    names = TopicNames(unique_prefix)
    with pytest.raises(TopicSetupError) as caught:
        ensure_topics(kafka_bootstrap, names, ["p"], 1, replication=wanted)
    assert "SAGALINE_REPLICATION_FACTOR" in str(caught.value)
    assert f"default.replication.factor={default_factor}" in str(caught.value)
    listed = admin.list_topics(timeout=30).topics
    assert names.events not in listed and names.commands("p") not in listed
