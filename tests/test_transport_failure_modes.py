"""The Kafka transport under failure: topics that exist with the wrong settings, a
producer that failed for good, and what a writer reports then."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import NewTopic

from sagaline.kafka import TopicSetupError, create_admin, ensure_topics
from schemas.topics import TopicNames


def _create(bootstrap: str, name: str, partitions: int, config: dict[str, str]) -> None:
    admin = create_admin(bootstrap)
    futures = admin.create_topics([NewTopic(name, partitions, 1, config=config)])
    futures[name].result(timeout=60)


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("topic", "given", "expected"),
    [("catalogue", "delete", "compact"), ("events", "compact", "delete")],
)
def test_an_existing_topic_with_another_cleanup_policy_is_a_setup_error_naming_both(
    kafka_bootstrap: str, unique_prefix: str, topic: str, given: str, expected: str
) -> None:
    """A topic made before the coordinator ran (a broker's auto.create.topics.enable
    on a first write, or an admin's script) with another cleanup.policy is not left
    as it is: a catalogue on ``delete`` loses every tool's contract to retention, a
    ledger on ``compact`` keeps one record per saga. ensure_topics refuses it, naming
    the topic and both policies."""
    names = TopicNames(unique_prefix)
    name = getattr(names, topic)
    _create(kafka_bootstrap, name, 1, {"cleanup.policy": given})
    with pytest.raises(TopicSetupError) as caught:
        ensure_topics(kafka_bootstrap, names, [], 1)
    text = str(caught.value)
    assert repr(name) in text and "cleanup.policy" in text
    assert f"={given}" in text and expected in text


@pytest.mark.kafka
def test_existing_topics_with_the_expected_cleanup_policies_pass(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, ["p"], 1)
    assert ensure_topics(kafka_bootstrap, names, ["p"], 1) == []


@pytest.mark.kafka
def test_a_compacted_command_topic_is_still_accepted(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """docs/operating.md: a compacted command topic only means the journal is never
    pruned; it is not refused."""
    names = TopicNames(unique_prefix)
    _create(kafka_bootstrap, names.commands("p"), 1, {"cleanup.policy": "compact"})
    assert names.commands("p") not in ensure_topics(kafka_bootstrap, names, ["p"], 1)
