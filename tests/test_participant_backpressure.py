"""The participant runtime's backpressure keeps its group membership.

With ``2 * max_in_flight`` commands taken and not done, the loop takes no more. If
that lasts longer than ``max.poll.interval.ms`` (tools with long deadlines and
commands queued behind them), a loop that stopped polling the consumer is pushed out
of its group and gives up everything it holds (``on_lost``). On a real broker: a
small ``max.poll.interval.ms``, tools the test holds well past it, then every command
must run exactly once, in its saga's order, with no partition lost or revoked.
"""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

import participants.runtime as runtime_module
from participants import compensable, tool, wrap
from participants.context import current_call
from participants.runtime import ParticipantRuntime, _Backpressure
from sagaline.kafka import (
    LedgerReader,
    Message,
    TopicPartition,
    create_consumer,
    create_producer,
    ensure_topics,
)
from schemas import (
    ExecuteStep,
    Record,
    StepCommitted,
    canonical_json,
    envelope_for,
    idempotency_key,
)
from schemas.settings import Settings
from schemas.wire import from_message, to_message
from tests.system import wait_until

NAME = "held"
MAX_POLL_INTERVAL_MS = 10_000  # also the session timeout: kept by a busy broker
SAGAS, STEPS, MAX_IN_FLIGHT = 4, 3, 2  # 12 commands: over the limit of 4 taken


class Held:
    """``step`` waits until the test opens ``gate``; records who ran, in order."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.ran: list[tuple[str, str]] = []

    @tool(description="Wait until released", deadline=3600.0)
    @compensable(by="undo")
    def step(self, n: int) -> int:
        ctx = current_call()
        with self.lock:
            self.ran.append((ctx.saga_id, ctx.step_id))
        assert self.gate.wait(300)
        return n

    def undo(self) -> None:
        pass


def _command(saga: str, step: int) -> ExecuteStep:
    body = canonical_json({"n": step})
    step_id = f"s{step}"
    return ExecuteStep(
        envelope=envelope_for(ExecuteStep, saga_id=saga, tenant_id="t", producer="c", now=1),
        step_id=step_id,
        tool="step",
        args=body,
        idempotency_key=idempotency_key(saga, step_id, "step", body),
        attempt=1,
        deadline_ms=3_600_000,
        principal="agent",
    )


@pytest.mark.kafka
def test_backpressure_longer_than_the_poll_interval_loses_no_partition(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The client configuration every consumer of the runtime is built from.
    monkeypatch.setenv("SAGALINE_KAFKA_MAX_POLL_INTERVAL_MS", str(MAX_POLL_INTERVAL_MS))
    monkeypatch.setenv("SAGALINE_KAFKA_SESSION_TIMEOUT_MS", str(MAX_POLL_INTERVAL_MS))
    caplog.set_level(logging.INFO, logger="sagaline.participant")
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=2, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, settings.topics, [NAME], 2)
    moved: list[str] = []  # every revoke or loss the runtime's consumer served
    lost = threading.Event()

    def counting(kind: str, callback: Any) -> Any:
        def served(consumer: Any, partitions: Any) -> None:
            if partitions:
                moved.append(kind)
                lost.set()
            callback(consumer, partitions)

        return served

    class Counted:
        """The runtime's consumer, counting the revokes and losses it serves."""

        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

        def subscribe(self, topics: list[str], **callbacks: Any) -> None:
            for kind in ("on_revoke", "on_lost"):
                callbacks[kind] = counting(kind, callbacks[kind])
            self._consumer.subscribe(topics, **callbacks)

        def close(self) -> None:
            moved.append("closed")
            self._consumer.close()

    monkeypatch.setattr(
        runtime_module, "create_consumer", lambda *a, **k: Counted(create_consumer(*a, **k))
    )
    held = Held()
    runtime = ParticipantRuntime(
        wrap(held, name=NAME), settings, kafka_bootstrap, max_in_flight=MAX_IN_FLIGHT
    )
    thread = threading.Thread(target=runtime.run, kwargs={"ready": threading.Event()}, daemon=True)
    commands = [_command(f"saga-{i}", s) for s in range(1, STEPS + 1) for i in range(SAGAS)]
    try:
        thread.start()
        producer = create_producer(kafka_bootstrap)
        for command in commands:  # a saga's commands in order, sagas interleaved
            key, value, headers = to_message(command, settings.signer())
            producer.produce(settings.topics.commands(NAME), key=key, value=value, headers=headers)
        assert producer.flush(30) == 0
        wait_until(
            lambda: runtime._work.pending >= 2 * MAX_IN_FLIGHT, what="the limit of taken commands"
        )
        # Held at the limit for twice the poll interval: a loop that stops polling the
        # consumer is out of its group by then (served as a loss at its next poll).
        lost.wait(2 * MAX_POLL_INTERVAL_MS / 1000)  # something that must not happen
        held.gate.set()
        wait_until(
            lambda: len(_outcomes(kafka_bootstrap, settings)) >= len(commands),
            timeout_s=120,
            what="an outcome for every command",
        )
    finally:
        held.gate.set()
        runtime.stop()
        thread.join(60)
    assert not thread.is_alive()
    served = moved[: moved.index("closed")]  # the revoke of the close is not counted
    assert served == [], f"partitions revoked or lost under backpressure: {served}"
    assert any("paused" in r.getMessage() for r in caplog.records), "backpressure not reported"
    outcomes = _outcomes(kafka_bootstrap, settings)
    assert all(isinstance(r, StepCommitted) for r in outcomes.values()), outcomes
    assert set(outcomes) == {c.event_id for c in commands}
    assert sorted(held.ran) == sorted({(c.envelope.saga_id, c.step_id) for c in commands})
    for i in range(SAGAS):  # each saga's commands once each, in order
        assert [s for saga, s in held.ran if saga == f"saga-{i}"] == ["s1", "s2", "s3"]


def _outcomes(bootstrap: str, settings: Settings) -> dict[str, Record]:
    """Each command's outcome on the ledger, by the command's event id."""
    out: dict[str, Record] = {}
    for msg in LedgerReader(bootstrap).read(settings.topics.events):
        record = from_message(msg.key(), msg.value(), msg.headers(), settings.signer())
        if type(record).__name__ in ("StepCommitted", "StepFailed", "StepOutcomeUnknown"):
            out[record.envelope.causation_id or ""] = record
    return out


class _Consumer:
    """A consumer's pause/resume/poll, recorded; ``served`` runs inside the next
    poll() (a rebalance's callbacks), ``fetched`` is what poll() hands out."""

    def __init__(self, owned: list[int]) -> None:
        self.owned = owned
        self.calls: list[tuple[str, list[int]]] = []
        self.fetched: collections.deque[Message] = collections.deque()
        self.served: Any = None

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition("c", p) for p in self.owned]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("pause", sorted(tp.partition for tp in partitions)))

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("resume", sorted(tp.partition for tp in partitions)))

    def poll(self, timeout: float) -> Message | None:
        served, self.served = self.served, None
        if served is not None:
            served()
        return self.fetched.popleft() if self.fetched else None


def _message(partition: int, offset: int) -> Message:
    return Message(topic="c", partition=partition, offset=offset, key=b"k", value=b"v")


def test_a_paused_consumer_pauses_what_a_rebalance_assigns_and_keeps_what_it_returned() -> None:
    consumer = _Consumer([0, 1])
    backpressure = _Backpressure(consumer, 0.0)  # type: ignore[arg-type]
    assert not backpressure.due(2)  # the limit is reached: from now on
    assert backpressure.due(2) and backpressure.paused
    assert consumer.calls == [("pause", [0, 1])]
    # librdkafka returns what it had fetched before the pause: held, in order
    consumer.fetched.extend([_message(0, 5), _message(1, 7), _message(0, 6)])
    for _ in range(3):
        backpressure.poll(0)
    assert [(m.partition(), m.offset()) for m in backpressure.held] == [(0, 5), (1, 7), (0, 6)]

    def rebalance() -> None:  # partition 1 moves away, partition 2 comes
        consumer.owned = [0, 2]
        backpressure.moved([TopicPartition("c", 1)])
        backpressure.assigned([TopicPartition("c", 2)])

    consumer.served = rebalance
    backpressure.poll(0)
    assert consumer.calls == [("pause", [0, 1]), ("pause", [2])]  # the new one paused too
    # what was held of the partition gone is left to its next owner
    assert [(m.partition(), m.offset()) for m in backpressure.held] == [(0, 5), (0, 6)]
    backpressure.off()
    backpressure.off()
    assert consumer.calls[2:] == [("resume", [0, 2])]  # once, everything assigned
    assert not backpressure.paused
    assert [(m.offset()) for m in backpressure.take(1)] == [5]  # before anything newer
    assert [(m.offset()) for m in backpressure.take(5)] == [6]
    assert not backpressure.due(2)  # a new period at the limit starts from zero
