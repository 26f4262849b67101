"""A consumer's fatal error ends the coordinator and the participant; it is not logged
and idled on.

CI saw it: after a broker restart the coordinator's consumer was fenced ("Static
consumer fenced by other consumer with same group.instance.id", a fatal error in
librdkafka); the coordinator logged it as a warning and then polled a dead consumer
for good, so no saga moved and no supervisor restarted it. The fatal error is
injected into the coordinator and the runtime (before the fix each run would loop
until pytest-timeout instead of raising); the last test has a real twin fence a
consumer on the broker, for the error exactly as poll hands it over.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from coordinator.shell import Coordinator
from participants import runtime as runtime_module
from participants.runtime import ParticipantRuntime
from tests.coordinator_turns import one_saga
from tests.system import wait_until
from tests.test_participant_runtime import PARTICIPANT, Harness, serving

FENCED = "Static consumer fenced by other consumer with same group.instance.id"


class FatalMessage:
    """What librdkafka's poll hands over once a consumer has a fatal error: code
    ``_FATAL``, ``fatal()`` False (as a real fencing gives it, the last test below)."""

    def error(self) -> KafkaError:
        return KafkaError(KafkaError._FATAL, FENCED)

    def topic(self) -> str:
        return ""

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return -1


class FencedOnFirstPoll:
    """A real consumer whose first poll returns the fatal error."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.fenced = False

    def poll(self, timeout: float = -1) -> Any:
        if not self.fenced:
            self.fenced = True
            return FatalMessage()
        return self._consumer.poll(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def test_a_fatal_consumer_error_ends_the_coordinator(transport: str, unique_prefix: str) -> None:
    settings, _ledger, _first, _participant = one_saga(transport, unique_prefix, "saga-fatal")
    coordinator = Coordinator(settings, transport, instance_id="fatal-1")
    coordinator._join()
    try:
        with pytest.raises(KafkaException, match="fenced"):
            coordinator._process_batch([FatalMessage()])  # type: ignore[list-item]
    finally:
        coordinator._consumer.close()


def test_a_fatal_consumer_error_ends_the_participant(
    transport: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(transport, unique_prefix, tmp_path)
    made: list[FencedOnFirstPoll] = []
    create = runtime_module.create_consumer

    def fenced_consumer(*args: Any, **kwargs: Any) -> FencedOnFirstPoll:
        made.append(FencedOnFirstPoll(create(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(runtime_module, "create_consumer", fenced_consumer)
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT
    )
    # On the test's own thread: returning at all is what the fix changed.
    with pytest.raises(KafkaException, match="fenced"):
        runtime.run()
    assert [c.fenced for c in made] == [True]


class FencedWhen(FencedOnFirstPoll):
    """A real consumer whose poll returns the fatal error once ``when`` is set."""

    def __init__(self, consumer: Any, when: threading.Event) -> None:
        super().__init__(consumer)
        self._when = when

    def poll(self, timeout: float = -1) -> Any:
        if self._when.is_set() and not self.fenced:
            self.fenced = True
            return FatalMessage()
        return self._consumer.poll(timeout)


def test_a_fatal_consumer_error_ends_the_participant_without_waiting_for_a_hung_tool(
    transport: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop is dead (the consumer fenced: nothing can be committed any more), so
    run() must not wait for a running tool up to its deadline before raising: the
    process would sit alive doing nothing, its metrics port answering. The tool's
    command is left to the next run (its intent is on the ledger)."""
    harness = Harness(transport, unique_prefix, tmp_path)
    harness.shop.answer_gates["a"] = gate = threading.Event()  # answers only when set
    running = threading.Event()
    create = runtime_module.create_consumer
    monkeypatch.setattr(
        runtime_module,
        "create_consumer",
        lambda *args, **kwargs: FencedWhen(create(*args, **kwargs), running),
    )
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT
    )
    thread, raised = serving(runtime)
    harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
    wait_until(lambda: harness.shop.count("reserve") == 1, what="the tool running")
    running.set()
    thread.join(45)  # the tool's deadline is 60 s; it answers only once the gate is set
    hung = thread.is_alive()
    gate.set()
    assert not hung, "run() waited for the hung tool after its consumer was fenced"
    assert len(raised) == 1 and "fenced" in str(raised[0])


@pytest.mark.kafka
def test_a_consumer_fenced_by_the_broker_is_fatal_to_raise_if_fatal(
    kafka_bootstrap: str, unique_prefix: str, admin: Any
) -> None:
    """The error above is injected with ``fatal=True``; the one librdkafka's poll hands
    over when a real twin with the same ``group.instance.id`` joins has code
    ``_FATAL`` but ``fatal()`` False. raise_if_fatal let it through: the coordinator and
    participants logged "consumer error: ..._FATAL..." and polled a dead consumer for
    good, though docs/operating.md says a fenced consumer ends them."""
    from confluent_kafka import Consumer
    from confluent_kafka.admin import NewTopic

    from sagaline.kafka import raise_if_fatal

    topic = f"{unique_prefix}fenced"
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()

    def member() -> Consumer:
        consumer = Consumer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "group.id": f"{unique_prefix}fenced-group",
                "group.instance.id": "twin",
                "auto.offset.reset": "earliest",
            }
        )
        consumer.subscribe([topic])
        return consumer

    def assigned(consumer: Consumer) -> bool:
        consumer.poll(0.2)
        return bool(consumer.assignment())

    first = member()
    wait_until(lambda: assigned(first), what="the first member's assignment")
    twin = member()
    try:
        wait_until(lambda: assigned(twin), what="the twin's assignment")
        errors: list[KafkaError] = []

        def fenced() -> bool:
            message = first.poll(0.2)
            error = message.error() if message is not None else None
            if error is not None:
                errors.append(error)
            return any(e.code() == KafkaError._FATAL for e in errors)

        wait_until(fenced, what="the first member to be fenced")
        error = next(e for e in errors if e.code() == KafkaError._FATAL)
        with pytest.raises(KafkaException, match="fenced"):
            raise_if_fatal(error)
    finally:
        twin.close()
        first.close()
