"""The coordinator remembers an ended saga (its terminal marker) for at least as long
as ``sagaline.events`` can deliver that saga's history again.

Kafka deletes a topic's records a whole segment at a time, once the segment's newest
record is older than ``retention.ms``: a record stays readable for up to
``retention.ms + segment.ms``. A marker tombstoned before that (the former default:
exactly the ledger's 365 days' retention) let a replay in the gap (an offset reset,
expired group offsets) read a ``SagaStarted`` with nothing left to say the saga ended,
and run it again. So the events topic is created with its ``segment.ms`` set, the
default memory covers retention + segment + a margin, and a coordinator whose memory
is shorter than what the broker says its events topic keeps refuses to start."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from coordinator.shell import Coordinator
from sagaline.kafka import TopicSetupError, ensure_topics
from sagaline.kafka._topics import topic_retention
from schemas.limits import DAY_MS, RETENTION_MARGIN_MS, Limits
from schemas.settings import Settings

pytestmark = pytest.mark.kafka


def _events_topic(bootstrap: str, settings: Settings, config: dict[str, str]) -> None:
    """The events topic as an operator (or an earlier version) made it."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    name = settings.topics.events
    admin.create_topics([NewTopic(name, 1, 1, config=config)])[name].result(30)
    ensure_topics(bootstrap, settings.topics, [], settings.partitions)


def _join(settings: Settings, bootstrap: str, instance: str) -> None:
    coordinator = Coordinator(settings, bootstrap, instance_id=instance)
    try:
        coordinator._join()
    finally:
        coordinator._consumer.close()


def test_the_default_memory_outlasts_everything_the_events_topic_keeps(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    resource = ConfigResource(ResourceType.TOPIC, settings.topics.events)
    entries = admin.describe_configs([resource])[resource].result(30)
    # Set on the topic, not inherited from whatever the broker's log.roll.ms is.
    assert not entries["segment.ms"].is_default
    retention = topic_retention(kafka_bootstrap, settings.topics.events)
    assert retention is not None
    kept = retention[0] + retention[1]
    assert Limits().terminal_memory_ms >= kept + RETENTION_MARGIN_MS, (kept, Limits())
    _join(settings, kafka_bootstrap, "memory-default")  # and it starts


def test_an_events_topic_of_an_earlier_version_starts_with_the_default_memory(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """Upgrading: an existing topic keeps its config (no segment.ms of its own: the
    broker's 7-day default) and the coordinator starts as before."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    _events_topic(
        kafka_bootstrap,
        settings,
        {"cleanup.policy": "delete", "retention.ms": str(365 * DAY_MS)},
    )
    _join(settings, kafka_bootstrap, "memory-upgrade")


def test_a_memory_shorter_than_the_events_topic_keeps_a_record_is_refused_at_start(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    # The operator keeps the ledger two years; the memory was left at its default.
    _events_topic(
        kafka_bootstrap,
        settings,
        {"retention.ms": str(730 * DAY_MS), "segment.ms": str(7 * DAY_MS)},
    )
    with pytest.raises(TopicSetupError) as refused:
        _join(settings, kafka_bootstrap, "memory-short")
    message = str(refused.value)
    needed = (730 + 7) * DAY_MS + RETENTION_MARGIN_MS
    assert "SAGALINE_TERMINAL_MEMORY_MS" in message and str(needed) in message, message
    assert settings.topics.events in message and "retention.ms" in message, message


def test_coordinator_run_refuses_a_short_memory_in_one_line_and_exits_2(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import main

    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    _events_topic(kafka_bootstrap, settings, {"retention.ms": str(30 * DAY_MS)})
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_PARTITIONS", "1")
    monkeypatch.setenv("SAGALINE_TERMINAL_MEMORY_MS", str(30 * DAY_MS))
    # Not pytest's signal handlers; and a coordinator that got past its start stops at
    # once instead of serving for ever.
    monkeypatch.setattr(Coordinator, "install_signal_handlers", lambda self: self.stop())

    assert main(["coordinator", "run", "--instance-id", "memory-cli"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("coordinator run: SAGALINE_TERMINAL_MEMORY_MS="), err


def test_an_events_topic_kept_for_ever_starts_with_a_warning(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No memory is long enough then; the operator is told, the coordinator starts."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    _events_topic(kafka_bootstrap, settings, {"retention.ms": "-1"})
    with caplog.at_level(logging.WARNING, logger="sagaline.coordinator"):
        _join(settings, kafka_bootstrap, "memory-forever")
    said = [m for r in caplog.records if "SAGALINE_TERMINAL_MEMORY_MS" in (m := r.getMessage())]
    assert len(said) == 1 and "retention.ms=-1" in said[0], said
