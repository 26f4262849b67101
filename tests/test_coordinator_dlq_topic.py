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
