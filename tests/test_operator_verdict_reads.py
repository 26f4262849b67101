"""`--wait`'s verdict when the watch cannot read what it needs: no verdict (exit 124,
"the decision is on the ledger"), never "accepted" for a refused decision. On the real
broker; the one thing it cannot be made to do here (refuse this principal Read on
``sagaline.dlq``: ACLs need a broker of their own) is the error handed to the watch."""

from __future__ import annotations

import time
from typing import Any

import pytest
from coordinator_ledger import Ledger

from sagaline.kafka import (
    KafkaError,
    KafkaException,
    TopicPartition,
    create_consumer,
    create_producer,
    ensure_topics,
)
from sagaline.ops import actions
from schemas.settings import Settings
from schemas.wire import dlq_message, to_message
from tests.coordinator_turns import append

pytestmark = pytest.mark.kafka

GROUP_SUFFIX = "verdict-coordinator"


class _DeniedMessage:
    """What a consumer's poll hands back when the broker refuses it the topic."""

    def error(self) -> KafkaError:
        return KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed")

    def key(self) -> None:
        return None


class _NoReadOnDlq:
    """A consumer of the real broker whose polls the broker refuses (no Read ACL)."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def poll(self, timeout: float) -> _DeniedMessage:
        return _DeniedMessage()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _refused_decision(bootstrap: str, prefix: str) -> tuple[actions.VerdictWatch, Any]:
    """A decision on the ledger that the coordinator refused: its DLQ copy is there and
    the coordinator's group committed past it."""
    settings = Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=1)
    ledger = Ledger(saga_id="saga-v", t0=int(time.time() * 1000))
    first = ledger.scheduled("reserve")
    ensure_topics(bootstrap, settings.topics, [first.contract.participant], 1)
    group = f"{prefix}{GROUP_SUFFIX}"
    watch = actions.VerdictWatch(bootstrap, settings.topics, "saga-v", group)
    decision = ledger.resolve("inc-1", "by hand")
    append(settings, bootstrap, decision)  # offset 0 of the saga's events partition
    producer = create_producer(bootstrap)
    key, value, headers = to_message(decision, settings.signer())
    dead_key, dead_value, dead_headers = dlq_message(
        key, value, headers, "invalid-transition", "already resolved", settings.topics.events, 0, 0
    )
    producer.produce(settings.topics.dlq, key=dead_key, value=dead_value, headers=dead_headers)
    assert producer.flush(30) == 0
    committer = create_consumer(bootstrap, group)
    try:
        committer.commit(offsets=[TopicPartition(settings.topics.events, 0, 1)], asynchronous=False)
    finally:
        committer.close()
    return watch, decision


def test_the_refusal_is_read_from_the_dlq(kafka_bootstrap: str, unique_prefix: str) -> None:
    watch, decision = _refused_decision(kafka_bootstrap, unique_prefix)
    verdict = watch.wait(decision, timeout_s=60)
    assert verdict == actions.Verdict(False, "invalid-transition", "already resolved")


def test_a_dlq_this_principal_may_not_read_gives_no_verdict_not_accepted(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DLQ's polls all failed (no Read on it): the watch ran out its time and
    reported the refused decision as accepted by the coordinator (exit 0)."""
    watch, decision = _refused_decision(kafka_bootstrap, unique_prefix)

    def consumer(bootstrap: str, group_id: str, **overrides: Any) -> Any:
        real = create_consumer(bootstrap, group_id, **overrides)
        return _NoReadOnDlq(real) if group_id.startswith("sagaline-reader-") else real

    monkeypatch.setattr(actions, "create_consumer", consumer)
    verdict = watch.wait(decision, timeout_s=1)
    assert verdict.accepted is None, verdict
    assert "sagaline.dlq" in verdict.detail and "Read" in verdict.detail, verdict


class _NoDescribeOnGroup:
    """A consumer of the real broker that may not describe the coordinator's group."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def committed(self, partitions: Any, timeout: float) -> Any:
        raise KafkaException(
            KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "Group authorization failed")
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def test_a_coordinator_group_this_principal_may_not_describe_gives_no_verdict(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the decision was written, the KafkaException escaped the watch: the CLI
    said "the broker did not answer ... then retry" (exit 2, the code of a decision
    refused before anything was written) for a decision that was on the ledger."""
    watch, decision = _refused_decision(kafka_bootstrap, unique_prefix)

    def consumer(bootstrap: str, group_id: str, **overrides: Any) -> Any:
        real = create_consumer(bootstrap, group_id, **overrides)
        return _NoDescribeOnGroup(real) if group_id.endswith(GROUP_SUFFIX) else real

    monkeypatch.setattr(actions, "create_consumer", consumer)
    verdict = watch.wait(decision, timeout_s=1)
    assert verdict.accepted is None, verdict
    assert "Describe" in verdict.detail and GROUP_SUFFIX in verdict.detail, verdict
    assert "on the ledger" in verdict.detail, verdict
