"""A DLQ topic that takes smaller records than the coordinator writes to it stops the
coordinator at start-up with an error naming both sizes, not at the first large bad
record: the DLQ copies are no saga's records (no saga can be parked for them), so a
refusal would abort and rewind every batch for ever and no saga would be decided."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from coordinator.shell import Coordinator
from sagaline.kafka import TopicSetupError, ensure_topics
from schemas.limits import Limits
from schemas.settings import Settings

pytestmark = pytest.mark.kafka


def test_a_dlq_topic_smaller_than_the_record_limit_is_refused_at_start_naming_both_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    dlq = settings.topics.dlq
    admin.create_topics([NewTopic(dlq, 1, 1, config={"max.message.bytes": "3000"})])[dlq].result(30)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="small-dlq")
    try:
        with pytest.raises(TopicSetupError) as refused:
            coordinator._join()
    finally:
        coordinator._consumer.close()
    message = str(refused.value)
    assert dlq in message
    assert "3000" in message and str(Limits().max_record_bytes) in message
    assert "SAGALINE_MAX_RECORD_BYTES" in message and "max.message.bytes" in message


def test_a_dlq_topic_at_the_broker_default_is_accepted(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id=f"ok-{uuid.uuid4().hex[:6]}")
    try:
        coordinator._join()  # no error
    finally:
        coordinator._consumer.close()


def test_coordinator_run_says_so_in_one_line_and_exits_2(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import main

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    dlq = f"{unique_prefix}sagaline.dlq"
    admin.create_topics([NewTopic(dlq, 1, 1, config={"max.message.bytes": "3000"})])[dlq].result(30)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_PARTITIONS", "1")
    # The process's signal handlers are pytest's, not the coordinator's.
    monkeypatch.setattr(Coordinator, "install_signal_handlers", lambda self: None)

    assert main(["coordinator", "run", "--instance-id", "small-dlq-cli"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("coordinator run: the DLQ topic") and "3000" in err, err


@pytest.mark.parametrize("which", ["incidents", "events", "state"])
def test_an_undersized_topic_the_coordinator_writes_no_sagas_records_to_is_refused_at_start(
    kafka_bootstrap: str, unique_prefix: str, which: str
) -> None:
    """Besides DLQ copies, the transaction that ends every batch carries records that
    are no saga's to park: copies of resolutions on the incident feed, the saga-parked
    incidents on ``sagaline.events`` and ``sagaline.incidents``, parked markers and
    tombstones on the changelog. A topic that refuses them stalls the coordinator
    the same way, so it is refused at start the same way."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    topic = getattr(settings.topics, which)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    config = {"max.message.bytes": "3000"}
    if which == "state":
        config["cleanup.policy"] = "compact"
    admin.create_topics([NewTopic(topic, 1, 1, config=config)])[topic].result(30)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id=f"small-{which}")
    try:
        with pytest.raises(TopicSetupError) as refused:
            coordinator._join()
    finally:
        coordinator._consumer.close()
    message = str(refused.value)
    assert repr(topic) in message and "3000" in message, message
    assert f"SAGALINE_MAX_RECORD_BYTES={Limits().max_record_bytes}" in message, message
    assert "batch.size" in message and "max.message.bytes" in message, message


def test_an_undersized_terminal_topic_is_not_refused_it_parks_one_saga_at_most(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """``sagaline.terminal`` only takes sagas' own outputs: a refused one parks its
    saga (saga by saga after repeated failures), the others go on; no reason to refuse
    to start."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    topic = settings.topics.terminal
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    config = {"max.message.bytes": "3000", "cleanup.policy": "compact"}  # as ensure_topics'
    admin.create_topics([NewTopic(topic, 1, 1, config=config)])[topic].result(30)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="small-terminal")
    try:
        coordinator._join()  # no error
    finally:
        coordinator._consumer.close()
