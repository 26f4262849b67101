"""A transaction the broker aborted for its age (open longer than
``transaction.timeout.ms``: a slow batch, a long pause) fails with librdkafka's fatal
``_FENCED``, the very error a newer instance with the same ``transactional.id``
causes. Only the latter must end the process: after a timeout, a new producer (whose
``init_transactions`` bumps the epoch) starts clean, and the batch is rewound and
decided again, instead of an exit and a restart that stop every saga meanwhile. A
transaction younger than the timeout cannot have been aborted for its age, so a
fencing then still ends the process. Real broker: the timeout and the fencing are
the broker's."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import pytest

import coordinator.shell as shell
from coordinator.shell import Coordinator
from sagaline.kafka import (
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
    create_consumer,
    create_producer,
)
from tests.coordinator_turns import append, executes, one_saga, turn_until
from tests.test_coordinator_carry import _committed

pytestmark = pytest.mark.kafka

CHECKS = 1_200  # a bound on watermark checks (about 0.1 s apart), not a deadline


def _aborted_by_the_broker(bootstrap: str, topic: str) -> None:
    """Wait until the open transaction's changelog record is there and aborted: a
    read_committed consumer's last stable offset reaches the high watermark (the
    abort marker). The broker aborts a transaction past its timeout by itself."""
    committed = create_consumer(bootstrap, f"lso-{uuid.uuid4().hex}")  # read_committed
    uncommitted = create_consumer(
        bootstrap, f"hw-{uuid.uuid4().hex}", **{"isolation.level": "read_uncommitted"}
    )
    tp = TopicPartition(topic, 0)
    try:
        for _ in range(CHECKS):
            high = uncommitted.get_watermark_offsets(tp, timeout=10)[1]
            stable = committed.get_watermark_offsets(tp, timeout=10)[1]
            if high > 0 and stable == high:
                return
            time.sleep(0.1)
        raise AssertionError("the broker never aborted the transaction")
    finally:
        committed.close()
        uncommitted.close()


def _first_commit_after(monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> list[bool]:
    """Run ``before`` ahead of the coordinator's first commit."""
    original = shell._commit
    done: list[bool] = []

    def commit(producer: Producer, offsets: Future[None]) -> float:
        if not done:
            done.append(True)
            offsets.result()
            before()
        return original(producer, offsets)

    monkeypatch.setattr(shell, "_commit", commit)
    return done


def test_a_transaction_the_broker_aborted_for_its_age_replaces_the_producer_not_the_process(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-slow")
    append(settings, bootstrap, ledger.started(), first)
    one = Coordinator(
        settings,
        bootstrap,
        instance_id="aged-1",
        carry_ms=0,
        linger_ms=0,
        transaction_timeout_ms=1_000,
    )
    one._join()
    timed_out = _first_commit_after(
        monkeypatch, lambda: _aborted_by_the_broker(bootstrap, settings.topics.state)
    )
    group = f"{unique_prefix}sagaline-coordinator"
    try:
        turn_until(one, lambda: _committed(settings, bootstrap, group) == 2)
    finally:
        one._consumer.close()
    assert timed_out == [True], "the first transaction was never held past its timeout"
    assert executes(settings, bootstrap, participant) == ["reserve"]


def test_a_young_transaction_fenced_by_a_newer_instance_still_ends_the_process(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, _participant = one_saga(bootstrap, unique_prefix, "saga-fenced")
    append(settings, bootstrap, ledger.started(), first)
    one = Coordinator(settings, bootstrap, instance_id="fenced-1", carry_ms=0, linger_ms=0)
    one._join()
    newer: list[Producer] = []

    def another_instance_takes_over() -> None:
        txid = one._producer_config["transactional.id"]
        newer.append(create_producer(bootstrap, **{"transactional.id": txid}))
        newer[0].init_transactions(60)

    _first_commit_after(monkeypatch, another_instance_takes_over)
    try:
        with pytest.raises(KafkaException) as raised:
            turn_until(one, lambda: False)
    finally:
        one._consumer.close()
    error = raised.value.args[0]
    assert isinstance(error, KafkaError) and error.fatal()
    assert error.code() == KafkaError._FENCED
    assert len(newer) == 1
