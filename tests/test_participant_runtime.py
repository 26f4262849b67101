"""The participant runtime against the real broker: commands in, ledger records out.

These drive a runtime directly with commands (as the coordinator would), so each
behaviour of the runtime is checked on its own: R10 intent before effect, R11 unknown
outcome then reconciliation, deduplication across restarts, compensation context.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka.admin import NewTopic

from participants import (
    CompensationContext,
    LookupResult,
    compensable,
    tool,
    wrap,
)
from participants.context import current_call
from participants.runtime import ParticipantRuntime
from sagaline.kafka import (
    KafkaError,
    KafkaException,
    LedgerReader,
    Producer,
    create_admin,
    create_producer,
    ensure_topics,
    headers_of,
)
from sagaline.ops.metrics import ParticipantMetrics
from schemas import (
    CompensateStep,
    CompensationCommitted,
    ExecuteStep,
    ReconcileResult,
    ReconcileStep,
    Record,
    StepCommitted,
    StepIntentRecorded,
    StepOutcomeUnknown,
    StepReconciled,
    canonical_json,
    compensation_key,
    derived_event_id,
    envelope_for,
    idempotency_key,
)
from schemas.settings import Settings
from schemas.wire import from_message, read_dead_letter, to_message
from tests.system import wait_until

pytestmark = pytest.mark.kafka

PARTICIPANT = "shop"


class Shop:
    """A provider with real (in-memory) state that honours idempotency keys."""

    def __init__(self, intent_seen: Callable[[str], bool]) -> None:
        self._intent_seen = intent_seen
        self.effects: list[tuple[str, Any]] = []
        self.reservations: dict[str, str] = {}
        # Set by the deadline tests, per sku: the tool commits, then answers only once
        # released, i.e. after the test has seen the deadline pass. No race with a sleep.
        self.answer_gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    # A deadline no busy machine misses: only the deadline test sets a short one.
    @tool(description="Reserve stock", lookup="find_reservation", deadline=60.0)
    @compensable(by="release")
    def reserve(self, sku: str, quantity: int) -> dict[str, str]:
        key = current_call().idempotency_key
        with self.lock:
            # What the world saw: was the intent already durable on the broker?
            self.effects.append(("reserve", {"key": key, "intent_durable": self._intent_seen(key)}))
            reservation = self.reservations.setdefault(key, f"res-{len(self.reservations) + 1}")
        gate = self.answer_gates.get(sku)
        if gate is not None:
            gate.wait(60)  # committed; answers after the deadline
        return {"reservation": reservation, "sku": sku}

    def release(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.effects.append(("release", {"input": ctx.input, "result": ctx.result}))

    def find_reservation(self, key: str) -> LookupResult | None:
        found = self.reservations.get(key)
        if found is None:
            return None
        return LookupResult.committed({"reservation": found}, provider_operation_id=found)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.effects if k == kind)


class Harness:
    def __init__(self, bootstrap: str, prefix: str, state_dir: Path) -> None:
        self.bootstrap = bootstrap
        self.settings = Settings(
            bootstrap=bootstrap, topic_prefix=prefix, partitions=1, state_dir=state_dir
        )
        ensure_topics(bootstrap, self.settings.topics, [PARTICIPANT], 1)
        self.shop = Shop(self.intent_seen)
        self.catalogue = wrap(self.shop, name=PARTICIPANT)
        self.producer = create_producer(bootstrap)
        self.saga_id = f"saga-{prefix.strip('.')}"
        self.runtime: ParticipantRuntime | None = None
        self.thread: threading.Thread | None = None

    def intent_seen(self, key: str) -> bool:
        return any(
            isinstance(r, StepIntentRecorded) and r.idempotency_key == key for r in self.records()
        )

    def records(self) -> list[Record]:
        return LedgerReader(self.bootstrap).saga_records(
            self.settings.topics.events, self.saga_id, self.settings.signer()
        )

    def start(
        self,
        producer: Callable[[Producer], Any] | None = None,
        metrics: ParticipantMetrics | None = None,
    ) -> None:
        """``producer``: wraps the runtime's producer (a stand-in that refuses some)."""
        self.runtime = ParticipantRuntime(
            self.catalogue, self.settings, self.bootstrap, participant=PARTICIPANT, metrics=metrics
        )
        if producer is not None:
            self.runtime._writer.producer = producer(self.runtime._writer.producer)
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self.runtime.run, kwargs={"ready": ready}, daemon=True
        )
        self.thread.start()
        assert ready.wait(60), "participant runtime did not start"

    def stop(self) -> None:
        assert self.runtime is not None and self.thread is not None
        self.runtime.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()

    def send(self, command: Record) -> None:
        key, value, headers = to_message(command, self.settings.signer())
        self.producer.produce(
            self.settings.topics.commands(PARTICIPANT), key=key, value=value, headers=headers
        )
        assert self.producer.flush(30) == 0

    def execute(
        self, step_id: str, args: dict[str, Any], attempt: int = 1, deadline_ms: int = 60_000
    ) -> ExecuteStep:
        body = canonical_json(args)
        return ExecuteStep(
            envelope=self._envelope(ExecuteStep, f"exec/{step_id}/{attempt}"),
            step_id=step_id,
            tool="reserve",
            args=body,
            idempotency_key=idempotency_key(self.saga_id, step_id, "reserve", body),
            attempt=attempt,
            deadline_ms=deadline_ms,
            principal="agent",
        )

    def _envelope(self, cls: type[Record], seed: str) -> Any:
        return envelope_for(
            cls,
            saga_id=self.saga_id,
            tenant_id="t",
            producer="coordinator",
            now=int(time.time() * 1000),
            event_id=derived_event_id(self.saga_id, seed),
        )

    def wait_for(
        self, check: Callable[[list[Record]], bool], timeout_s: float = 30
    ) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = self.records()
            if check(records):
                return records
            time.sleep(0.2)  # polling the broker for a condition, with a deadline
        raise AssertionError(f"condition not met within {timeout_s} s: {self.records()}")


@pytest.fixture
def harness(transport: str, unique_prefix: str, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(transport, unique_prefix, tmp_path)
    h.start()
    yield h
    if h.thread is not None and h.thread.is_alive():
        h.stop()


def _of(records: list[Record], cls: type[Any]) -> list[Any]:
    return [r for r in records if isinstance(r, cls)]


def serving(runtime: ParticipantRuntime) -> tuple[threading.Thread, list[BaseException]]:
    """``runtime``'s loop in a thread, once its command partition is assigned (or it
    failed first), and what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            runtime.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: runtime._assigned_end or raised, 60, "the command partition assigned")
    return thread, raised


def test_intent_is_acknowledged_before_the_side_effect_R10(harness: Harness) -> None:
    harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
    records = harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    assert harness.shop.effects == [
        (
            "reserve",
            {"key": _of(records, StepIntentRecorded)[0].idempotency_key, "intent_durable": True},
        )
    ]
    types = [r.TYPE for r in records]
    assert types.index("StepIntentRecorded") < types.index("StepCommitted")


def test_commit_after_deadline_is_unknown_then_reconciled_without_rerun_R11(
    harness: Harness,
) -> None:
    harness.shop.answer_gates["a"] = gate = threading.Event()
    command = harness.execute("s1", {"sku": "a", "quantity": 1}, deadline_ms=1000)
    harness.send(command)
    harness.wait_for(lambda rs: bool(_of(rs, StepOutcomeUnknown)))
    gate.set()  # the provider answers now, late: the outcome stays unknown until reconciled
    harness.send(
        ReconcileStep(
            envelope=harness._envelope(ReconcileStep, "reconcile/s1"),
            step_id="s1",
            tool="reserve",
            idempotency_key=command.idempotency_key,
            attempt=1,
        )
    )
    records = harness.wait_for(lambda rs: bool(_of(rs, StepReconciled)))
    reconciled = _of(records, StepReconciled)[0]
    assert reconciled.outcome is ReconcileResult.COMMITTED
    assert orjson.loads(reconciled.result or b"null") == {"reservation": "res-1"}
    assert harness.shop.count("reserve") == 1
    assert not _of(records, StepCommitted)


def test_a_tool_past_its_deadline_holds_up_neither_its_saga_nor_a_stop_R11(
    harness: Harness,
) -> None:
    # The tool runs on the saga's worker thread; at the deadline the watchdog answers
    # for it and a fresh worker carries on with the saga while the late call hangs.
    harness.shop.answer_gates["a"] = gate = threading.Event()
    harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}, deadline_ms=1000))
    harness.wait_for(lambda rs: bool(_of(rs, StepOutcomeUnknown)))
    harness.send(harness.execute("s2", {"sku": "b", "quantity": 1}))  # same saga
    records = harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    assert not gate.is_set()  # s1's call still hangs while s2 ran and committed
    assert [c.step_id for c in _of(records, StepCommitted)] == ["s2"]
    assert [u.step_id for u in _of(records, StepOutcomeUnknown)] == ["s1"]
    harness.stop()  # does not wait for the late call (stop() asserts the loop ended)
    gate.set()


def test_the_same_command_twice_runs_the_tool_once_even_across_a_restart_R15(
    harness: Harness,
) -> None:
    command = harness.execute("s1", {"sku": "a", "quantity": 2})
    harness.send(command)
    harness.send(command)
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 1)
    harness.stop()
    harness.send(command)  # redelivered while the participant is down
    harness.start()
    # The restarted runtime answers the redelivery from its journal: the outcome is
    # re-sent with the same event id, and the tool is not called again.
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 3)
    records = harness.records()
    assert harness.shop.count("reserve") == 1
    assert len({r.event_id for r in _of(records, StepCommitted)}) == 1


def test_the_same_compensation_twice_compensates_once_across_a_restart_R8(
    harness: Harness,
) -> None:
    forward = harness.execute("s1", {"sku": "a", "quantity": 1})
    harness.send(forward)
    committed = _of(harness.wait_for(lambda rs: bool(_of(rs, StepCommitted))), StepCommitted)[0]
    compensate = CompensateStep(
        envelope=harness._envelope(CompensateStep, "compensate/s1/1"),
        step_id="s1",
        tool="reserve",
        compensation="release",
        args=forward.args,
        result=committed.result,
        idempotency_key=forward.idempotency_key,
        compensation_key=compensation_key(forward.idempotency_key),
        attempt=1,
    )
    harness.send(compensate)
    harness.send(compensate)
    harness.wait_for(lambda rs: len(_of(rs, CompensationCommitted)) >= 1)
    harness.stop()
    harness.send(compensate)
    harness.start()
    harness.wait_for(lambda rs: len(_of(rs, CompensationCommitted)) >= 3)
    assert harness.shop.count("release") == 1


def test_a_compensation_receives_exactly_the_input_and_the_result(harness: Harness) -> None:
    args = {"sku": "sku-9", "quantity": 3}
    forward = harness.execute("s1", args)
    harness.send(forward)
    committed = _of(harness.wait_for(lambda rs: bool(_of(rs, StepCommitted))), StepCommitted)[0]
    harness.send(
        CompensateStep(
            envelope=harness._envelope(CompensateStep, "compensate/s1/1"),
            step_id="s1",
            tool="reserve",
            compensation="release",
            args=forward.args,
            result=committed.result,
            idempotency_key=forward.idempotency_key,
            compensation_key=compensation_key(forward.idempotency_key),
            attempt=1,
        )
    )
    harness.wait_for(lambda rs: bool(_of(rs, CompensationCommitted)))
    released = [v for k, v in harness.shop.effects if k == "release"]
    assert released == [{"input": args, "result": {"reservation": "res-1", "sku": "sku-9"}}]


def test_a_stop_before_run_reaches_its_loop_is_kept(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    """A SIGTERM while a participant is still starting must not be lost: ``run`` then
    starts, finds it stopped, and returns (here on the test's own thread, so a lost
    stop would hang the test until pytest-timeout)."""
    harness = Harness(transport, unique_prefix, tmp_path)
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT
    )
    runtime.stop()
    ready = threading.Event()
    runtime.run(ready=ready)
    assert ready.is_set()  # it did start, then honoured the stop


def test_a_command_fetched_before_its_partition_was_revoked_is_left_to_the_new_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R15: the run loop takes a command with ``poll()`` and more with ``consume()``;
    a rebalance served inside that ``consume()`` revokes the first one's partition
    (drained, committed, forgotten) and gives it to another member, which reads it
    from the committed offset. This replica must not run it as well."""
    import uuid

    from sagaline.kafka import create_consumer

    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=bootstrap, topic_prefix="t.", partitions=2, state_dir=tmp_path)
    topic = settings.topics.commands(PARTICIPANT)
    ensure_topics(bootstrap, settings.topics, [PARTICIPANT], 2)
    shop = Shop(lambda key: True)
    group = f"{settings.topics.prefix}sagaline-participant-{PARTICIPANT}"
    other = create_consumer(bootstrap, group)
    rebalanced = threading.Event()
    polls_after = threading.Semaphore(0)

    class JoinedWhilePolling:
        """The runtime's consumer; the other member joins right after the first
        poll() that returns a command, so the next consume() serves the rebalance."""

        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

        def poll(self, timeout: float = -1) -> Any:
            if rebalanced.is_set():
                polls_after.release()
            msg = self._consumer.poll(timeout)
            if msg is not None and not rebalanced.is_set():
                other.subscribe([topic])
                rebalanced.set()
            return msg

    runtime, submitted = _submits_recorded(
        monkeypatch, JoinedWhilePolling, shop, settings, bootstrap
    )
    # partition 1: the other member's once it joins (partitions go round-robin)
    _produce_reserve(bootstrap, settings, topic, "saga-moved", partition=1)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    assert polls_after.acquire(timeout=60), "the loop did not poll again after the rebalance"
    runtime.stop()
    thread.join(30)
    assert not thread.is_alive()
    assert submitted == [], "a command of a partition revoked from this replica was taken"
    assert shop.count("reserve") == 0
    moved = other.poll(30)  # the partition's owner reads it, from the committed offset
    assert moved is not None and (moved.partition(), moved.offset()) == (1, 0)
    other.close()


def test_a_command_fetched_before_its_partition_was_revoked_and_assigned_back_runs_once(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R15: a rebalance served inside the ``consume()`` right after a ``poll()`` may
    revoke the polled command's partition and assign it back here (the eager protocol
    revokes everything). The partition is then fetched again from the committed
    offset, so the polled copy must be left out: taken twice, the command would run
    twice and leave one copy in the partition's offsets, whose commits would stop."""
    from sagaline.kafka import create_consumer

    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    topic = settings.topics.commands(PARTICIPANT)
    ensure_topics(kafka_bootstrap, settings.topics, [PARTICIPANT], 1)
    shop = Shop(lambda key: True)
    group = f"{settings.topics.prefix}sagaline-participant-{PARTICIPANT}"
    # Joins the group for another topic: the rebalance gives this replica its
    # partition back.
    other = create_consumer(kafka_bootstrap, group)
    other_stop = threading.Event()
    assigns: list[int] = []  # partitions per assign served, in order

    def other_polls() -> None:
        while not other_stop.is_set():
            other.poll(0.1)

    class RebalancedWhileConsuming:
        """The runtime's consumer; the other member joins right after the first poll()
        that returns a command, and the consume() after it returns once the rebalance
        has been served (its assign)."""

        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer
            self._joined = False
            self._rebalanced_after = -1  # the assigns served when the other joined

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

        def subscribe(self, topics: list[str], **callbacks: Any) -> None:
            on_assign = callbacks["on_assign"]

            def counted(c: Any, partitions: list[Any]) -> None:
                on_assign(c, partitions)
                assigns.append(len(partitions))

            self._consumer.subscribe(topics, **{**callbacks, "on_assign": counted})

        def poll(self, timeout: float = -1) -> Any:
            msg = self._consumer.poll(timeout)
            if msg is not None and msg.error() is None and not self._joined:
                self._joined = True
                self._rebalanced_after = len(assigns)
                other.subscribe([settings.topics.events])
                threading.Thread(target=other_polls, daemon=True).start()
            return msg

        def consume(self, num_messages: int = 1, timeout: float = -1) -> Any:
            if len(assigns) != self._rebalanced_after:
                return self._consumer.consume(num_messages, timeout)
            out: list[Any] = []
            deadline = time.monotonic() + 60
            while len(assigns) == self._rebalanced_after:  # until the rebalance is served
                assert time.monotonic() < deadline, "no rebalance within 60 s"
                out += self._consumer.consume(num_messages, 0.1)
            assert assigns[-1] == 1, "the partition did not come back to this replica"
            return out

    runtime, submitted = _submits_recorded(
        monkeypatch, RebalancedWhileConsuming, shop, settings, kafka_bootstrap
    )
    committed = threading.Event()
    committable = runtime._work.committable

    def watched_committable() -> dict[int, int]:
        out = committable()
        if out.get(0) == 1:
            committed.set()
        return out

    monkeypatch.setattr(runtime._work, "committable", watched_committable)
    _produce_reserve(
        kafka_bootstrap, settings, topic, f"saga-{unique_prefix.strip('.')}", partition=0
    )
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    try:
        assert committed.wait(60), f"offset 1 never committed (taken: {submitted})"
    finally:
        runtime.stop()
        thread.join(30)
        other_stop.set()
    assert submitted == [(0, 0)], "the command was taken more than once"
    assert shop.count("reserve") == 1
    assert not thread.is_alive(), "the revoke on close did not drain"
    other.close()


def _produce_reserve(
    bootstrap: str, settings: Settings, topic: str, saga: str, *, partition: int
) -> None:
    """One signed ``ExecuteStep`` of ``reserve`` for ``saga``, on ``partition``."""
    body = canonical_json({"sku": "a", "quantity": 1})
    command = ExecuteStep(
        envelope=envelope_for(
            ExecuteStep, saga_id=saga, tenant_id="t", producer="coordinator", now=1
        ),
        step_id="s1",
        tool="reserve",
        args=body,
        idempotency_key=idempotency_key(saga, "s1", "reserve", body),
        attempt=1,
        deadline_ms=60_000,
        principal="agent",
    )
    producer = create_producer(bootstrap)
    key, value, headers = to_message(command, settings.signer())
    producer.produce(topic, key=key, value=value, headers=headers, partition=partition)
    assert producer.flush(30) == 0


def _submits_recorded(
    monkeypatch: pytest.MonkeyPatch,
    wrapper: Callable[[Any], Any],
    shop: Shop,
    settings: Settings,
    bootstrap: str,
) -> tuple[ParticipantRuntime, list[tuple[int, int]]]:
    """A runtime whose consumer is ``wrapper(consumer)``, and the (partition, offset)
    of every command its loop submits."""
    import participants.runtime as runtime_module
    from sagaline.kafka import create_consumer

    monkeypatch.setattr(
        runtime_module, "create_consumer", lambda *a, **k: wrapper(create_consumer(*a, **k))
    )
    runtime = ParticipantRuntime(
        wrap(shop, name=PARTICIPANT), settings, bootstrap, participant=PARTICIPANT
    )
    submitted: list[tuple[int, int]] = []
    submit = runtime._work.submit

    def recording_submit(msg: Any) -> None:
        submitted.append((msg.partition(), msg.offset()))
        submit(msg)

    monkeypatch.setattr(runtime._work, "submit", recording_submit)
    return runtime, submitted


class Stuck:
    """``hold`` never returns by itself (its deadline is an hour); ``note`` does."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.held = 0

    @tool(description="Hold until released", deadline=3600.0)
    @compensable(by="undo")
    def hold(self, sku: str, quantity: int) -> str:
        self.held += 1
        self.entered.set()
        assert self.gate.wait(120)
        return "held"

    @tool(description="Answer at once")
    @compensable(by="undo")
    def note(self, sku: str, quantity: int) -> str:
        return "noted"

    def undo(self) -> None:
        pass


def test_a_revoke_gives_up_a_tool_that_does_not_return_and_leaves_its_command_to_the_next_owner(
    tmp_path: Path,
) -> None:
    """R10/R11/R15: a partition revoke drains the commands taken from it, but only for
    ``revoke_drain_s``: a tool that does not return must not hold the rebalance (and
    with it every other saga of the participant). Past it the command is given up:
    its offset is not committed, so the partition's next owner reads it again; its
    intent is on the ledger and its journal mark says started, so that owner reports
    an unknown outcome (R11) instead of running it again; and what the tool returns
    late is never published."""
    import uuid

    from sagaline.kafka import TopicPartition, create_consumer

    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=bootstrap, topic_prefix="t.", partitions=2, state_dir=tmp_path)
    topic = settings.topics.commands("stuck")
    ensure_topics(bootstrap, settings.topics, ["stuck"], 2)
    stuck = Stuck()
    runtime = ParticipantRuntime(wrap(stuck, name="stuck"), settings, bootstrap)
    runtime.revoke_drain_s = 0.0  # give up at once: no race with a clock
    late = threading.Event()
    tool_done = runtime._work._tool_done

    def watched_tool_done(job: Any, outcome: Any, error: BaseException | None) -> None:
        tool_done(job, outcome, error)
        if job.command is not None and job.command.tool == "hold":
            late.set()

    runtime._work._tool_done = watched_tool_done  # type: ignore[method-assign]
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    other = create_consumer(bootstrap, f"{settings.topics.prefix}sagaline-participant-stuck")
    try:
        assert ready.wait(60)
        held = _command("hold", "saga-held")
        _produce(bootstrap, settings, topic, held, partition=1)
        assert stuck.entered.wait(60), "the tool did not start"
        # Another replica joins: partition 1 (the stuck command's) moves to it.
        other.subscribe([topic])
        noted = _command("note", "saga-noted")
        _produce(bootstrap, settings, topic, noted, partition=0)
        reader = LedgerReader(bootstrap)

        def on_ledger(saga: str) -> list[Record]:
            return reader.saga_records(settings.topics.events, saga, settings.signer())

        wait_until(
            lambda: any(isinstance(r, StepCommitted) for r in on_ledger("saga-noted")),
            what="another saga served after the rebalance (the drain waits for the "
            "tool that does not return)",
        )
        assert runtime.journal.get(held.event_id) == ("started", None)
        assert other.committed([TopicPartition(topic, 1)])[0].offset < 0  # nothing committed
        moved = other.poll(30)  # the next owner reads the command again
        assert moved is not None and (moved.partition(), moved.offset()) == (1, 0)
        assert [type(r) for r in on_ledger("saga-held")] == [StepIntentRecorded]
        stuck.gate.set()  # the tool returns, late: what it returned is dropped
        assert late.wait(60)
    finally:
        stuck.gate.set()
        runtime.stop()
        thread.join(30)
        other.close()
    assert not thread.is_alive()
    records = LedgerReader(bootstrap).saga_records(
        settings.topics.events, "saga-held", settings.signer()
    )
    assert [type(r) for r in records] == [StepIntentRecorded]
    assert stuck.held == 1


def _command(tool_name: str, saga: str) -> ExecuteStep:
    body = canonical_json({"sku": "a", "quantity": 1})
    return ExecuteStep(
        envelope=envelope_for(
            ExecuteStep, saga_id=saga, tenant_id="t", producer="coordinator", now=1
        ),
        step_id="s1",
        tool=tool_name,
        args=body,
        idempotency_key=idempotency_key(saga, "s1", tool_name, body),
        attempt=1,
        deadline_ms=3_600_000,
        principal="agent",
    )


def _produce(
    bootstrap: str, settings: Settings, topic: str, command: Record, *, partition: int
) -> None:
    producer = create_producer(bootstrap)
    key, value, headers = to_message(command, settings.signer())
    producer.produce(topic, key=key, value=value, headers=headers, partition=partition)
    assert producer.flush(30) == 0


class _Refusing:
    """The runtime's producer, refusing with ``error`` the events records that
    ``refused(n)`` names (``n``: how many events records it was handed before)."""

    def __init__(
        self, producer: Producer, topic: str, error: Exception, refused: Callable[[int], bool]
    ) -> None:
        self._producer = producer
        self._topic = topic
        self._error = error
        self._refused = refused
        self.seen = 0
        self.refusals = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
        if topic == self._topic:
            self.seen += 1
            if self._refused(self.seen - 1):
                self.refusals += 1
                raise self._error
        self._producer.produce(topic, *args, **kwargs)


def _dead_letters(harness: Harness) -> list[tuple[str, str]]:
    letters = []
    for msg in LedgerReader(harness.bootstrap).read(harness.settings.topics.dlq):
        letter = read_dead_letter(msg.headers())
        letters.append((letter.reason, letter.detail))
    return letters


@pytest.mark.parametrize("sent", ["before-start", "after-start"])
def test_a_full_local_queue_tries_the_command_again_and_loses_nothing_R16(
    transport: str, unique_prefix: str, tmp_path: Path, sent: str
) -> None:
    # librdkafka's BufferError from produce(): the intent was never sent. Sent before
    # the start, the command goes the blocking way (a ledger probe first); after it,
    # the loop's own once the partition was assigned before it arrived (in-memory:
    # always). Either way it is tried again, not dead-lettered.
    harness = Harness(transport, unique_prefix, tmp_path)
    command = harness.execute("s1", {"sku": "a", "quantity": 1})
    if sent == "before-start":
        harness.send(command)
    full: list[_Refusing] = []

    def queue_full_once(producer: Producer) -> _Refusing:
        full.append(
            _Refusing(
                producer, harness.settings.topics.events, BufferError("Local: Queue full"),
                lambda n: n == 0,
            )
        )  # fmt: skip
        return full[0]

    harness.start(queue_full_once)
    try:
        if sent == "after-start":
            harness.send(command)
        records = harness.wait_for(
            lambda rs: bool(_of(rs, StepCommitted)) or bool(_dead_letters(harness))
        )
        assert _dead_letters(harness) == []
        assert full[0].refusals == 1, "the queue was never full"
        assert [type(r) for r in records] == [StepIntentRecorded, StepCommitted]
        assert harness.shop.count("reserve") == 1
    finally:
        harness.stop()


def test_a_journal_that_cannot_write_for_a_while_holds_the_commands_and_loses_nothing_R16(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R10/R16: a full disk (SQLite's OperationalError) for the journal's first three
    # writes. The commands wait for it instead of going to the DLQ: each tool runs
    # once, after its "started" mark is on disk, and each outcome reaches the ledger.
    import sqlite3

    assert harness.runtime is not None
    journal = harness.runtime.journal
    write = journal.write
    failed: list[int] = []

    def full_disk_three_times(rows: list[Any]) -> None:
        if len(failed) < 3:
            failed.append(len(rows))
            raise sqlite3.OperationalError("database or disk is full")
        write(rows)

    monkeypatch.setattr(journal, "write", full_disk_three_times)
    # sent once the partition is assigned: the loop's way (one sent before would be
    # handled whole on a tool thread, after a ledger probe)
    runtime = harness.runtime
    wait_until(lambda: runtime._assigned_end, 60, "the command partition assigned")
    first = harness.execute("s1", {"sku": "a", "quantity": 1})
    harness.send(first)
    harness.send(harness.execute("s2", {"sku": "b", "quantity": 1}))  # same saga
    records = harness.wait_for(
        lambda rs: len(_of(rs, StepCommitted)) == 2 or bool(_dead_letters(harness))
    )
    assert _dead_letters(harness) == []
    assert len(failed) == 3
    assert [c.step_id for c in _of(records, StepCommitted)] == ["s1", "s2"]
    assert harness.shop.count("reserve") == 2  # each once
    seen = journal.get(first.event_id)
    assert seen is not None and seen[0] == "done"


def test_a_journal_that_cannot_be_read_for_a_while_holds_the_command_not_the_DLQ_R16(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The journal lookup that starts every command fails as SQLite fails for a while
    # (an I/O error, a lock another replica sharing the journal holds too long): the
    # same OperationalError the journal's writes wait out. The command is tried again,
    # as it is on the tool-thread path, not dead-lettered (its saga would wait on a
    # command nobody answers).
    import sqlite3

    assert harness.runtime is not None
    journal = harness.runtime.journal
    get = journal.get
    failed: list[str] = []

    def unreadable_twice(command_id: str) -> tuple[str, bytes | None] | None:
        if len(failed) < 2:
            failed.append(command_id)
            raise sqlite3.OperationalError("disk I/O error")
        return get(command_id)

    monkeypatch.setattr(journal, "get", unreadable_twice)
    runtime = harness.runtime
    wait_until(lambda: runtime._assigned_end, 60, "the command partition assigned")
    harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
    records = harness.wait_for(
        lambda rs: bool(_of(rs, StepCommitted)) or bool(_dead_letters(harness))
    )
    assert _dead_letters(harness) == []
    assert len(failed) == 2
    assert [c.step_id for c in _of(records, StepCommitted)] == ["s1"]
    assert harness.shop.count("reserve") == 1


def test_a_journal_that_cannot_be_read_for_a_while_is_logged_once_not_at_every_retry(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The lookup is tried again every half second for each command it holds, for as
    # long as SQLite fails (a lock another replica holds, a failing disk): a line at
    # every retry is two lines a second per saga in flight. Like a journal write that
    # fails, it is logged when it starts failing and then once a minute at most.
    import sqlite3

    import participants.runtime as runtime_module

    assert harness.runtime is not None
    journal = harness.runtime.journal
    get = journal.get
    failed: list[str] = []

    def unreadable_five_times(command_id: str) -> tuple[str, bytes | None] | None:
        if len(failed) < 5:
            failed.append(command_id)
            raise sqlite3.OperationalError("database is locked")
        return get(command_id)

    monkeypatch.setattr(journal, "get", unreadable_five_times)
    monkeypatch.setattr(runtime_module, "_JOURNAL_NAG_S", 3600.0)
    runtime = harness.runtime
    wait_until(lambda: runtime._assigned_end, 60, "the command partition assigned")
    with caplog.at_level("WARNING", logger="sagaline.participant"):
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        records = harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    assert len(failed) == 5
    assert [c.step_id for c in _of(records, StepCommitted)] == ["s1"]
    lines = [r.getMessage() for r in caplog.records if "database is locked" in r.getMessage()]
    assert len(lines) == 1, lines


def test_an_outcome_too_large_for_the_producer_dead_letters_its_command_not_retried_forever(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    # Permanent: the same outcome is refused every time, so it is not sent again and
    # again; the command goes to the DLQ saying what was too large.
    harness = Harness(transport, unique_prefix, tmp_path)
    too_large = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    refusing: list[_Refusing] = []

    def outcome_too_large(producer: Producer) -> _Refusing:
        refusing.append(
            _Refusing(producer, harness.settings.topics.events, too_large, lambda n: n >= 1)
        )
        return refusing[0]

    harness.start(outcome_too_large)
    try:
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        wait_until(lambda: _dead_letters(harness), what="the command dead-lettered")
        [(reason, detail)] = _dead_letters(harness)
        assert reason == "handler-error"
        assert "RecordTooLarge" in detail and "StepCommitted" in detail, detail
        assert refusing[0].refusals == 1
        assert harness.shop.count("reserve") == 1
    finally:
        harness.stop()


@pytest.mark.kafka
def test_a_command_whose_dlq_copy_is_too_large_is_still_dead_lettered_not_lost_R16(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    # A record on the command topic that fits under the producer's message.max.bytes
    # but whose DLQ copy (with the why and where-from headers) does not: its offset
    # must not be committed past it with nothing in the DLQ.
    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)
    topic = harness.settings.topics.commands(PARTICIPANT)
    # As close to the limit as the producer takes (it counts some overhead too).
    junk = b"\x00" + b"j" * (999_850 - len(harness.saga_id))
    harness.producer.produce(topic, key=harness.saga_id.encode(), value=junk)
    assert harness.producer.flush(30) == 0
    harness.start()
    try:
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)), timeout_s=60)
        letters = [
            (msg.key(), read_dead_letter(msg.headers()))
            for msg in LedgerReader(harness.bootstrap).read(harness.settings.topics.dlq)
        ]
        assert [(key, letter.source_topic, letter.offset) for key, letter in letters] == [
            (harness.saga_id.encode(), topic, 0)
        ], letters
        assert letters[0][1].omitted is not None and str(len(junk)) in letters[0][1].omitted
    finally:
        harness.stop()


class Bulky:
    """A tool whose answer is larger than the events topic takes."""

    def __init__(self) -> None:
        self.runs = 0

    @tool(description="Reserve stock, with a large receipt")
    @compensable(by="release")
    def reserve(self, sku: str, quantity: int) -> dict[str, str]:
        self.runs += 1
        # Random hex (lz4 cannot shrink it under the topic's limit) for sku "a" only.
        return {"receipt": os.urandom(4_000 if sku == "a" else 8).hex(), "sku": sku}

    def release(self, ctx: CompensationContext) -> None:
        pass


@pytest.mark.kafka
@pytest.mark.parametrize("path", ["loop", "blocking"])
@pytest.mark.parametrize("refused", ["outcome", "intent"])
def test_a_record_the_events_topic_refuses_for_its_size_is_dead_lettered_not_retried_forever(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, refused: str, path: str
) -> None:
    # The client takes the record (under its message.max.bytes), the broker refuses
    # it (the topic's max.message.bytes is smaller): MSG_SIZE_TOO_LARGE in the
    # delivery report, every time. As RecordTooLarge: the command goes to the DLQ
    # saying why, and its saga's next command is served. Commands already on the
    # partition when it is assigned take the blocking way (a ledger probe first);
    # later ones the loop's own.
    names = Settings(topic_prefix=unique_prefix).topics
    admin = create_admin(kafka_bootstrap)
    small = NewTopic(names.events, 1, 1, config={"max.message.bytes": "3000"})
    [created] = admin.create_topics([small]).values()
    created.result(30)
    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)
    bulky = Bulky()
    harness.catalogue = wrap(bulky, name=PARTICIPANT)
    # The intent carries the step id (random hex: lz4 cannot shrink it).
    step = "s1-" + os.urandom(2_000).hex() if refused == "intent" else "s1"
    commands = [
        harness.execute(step, {"sku": "a", "quantity": 1}),
        harness.execute("s2", {"sku": "b", "quantity": 1}),
    ]
    for command in commands if path == "blocking" else []:
        harness.send(command)
    harness.start()
    try:
        if path == "loop":
            wait_until(lambda: harness.runtime and harness.runtime._assigned_end, what="assigned")
            for command in commands:
                harness.send(command)
        # The saga's next command is not held behind it.
        wait_until(
            lambda: [r.step_id for r in _of(harness.records(), StepCommitted)] == ["s2"],
            what="the next command served (not held behind one retried forever)",
        )
        [(reason, detail)] = _dead_letters(harness)
        assert reason == "handler-error"
        assert "max.message.bytes" in detail, detail
        expected = "StepCommitted" if refused == "outcome" else "StepIntentRecorded"
        assert expected in detail, detail
        assert bulky.runs == (1 if refused == "outcome" else 0) + 1
    finally:
        harness.stop()


@pytest.mark.kafka
@pytest.mark.parametrize("path", ["loop", "blocking"])
def test_intents_that_fit_alone_are_written_when_their_batch_is_refused_not_dead_lettered(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, path: str
) -> None:
    # Commands of many sagas at once: their intents (about 3 KB each) go to the
    # broker in one record batch, over the events topic's 10 000 bytes, and librdkafka
    # does not split a refused batch (each record gets MSG_SIZE_TOO_LARGE). Each fits
    # alone: every command is served, none dead-lettered as too large.
    names = Settings(topic_prefix=unique_prefix).topics
    admin = create_admin(kafka_bootstrap)
    small = NewTopic(names.events, 1, 1, config={"max.message.bytes": "10000"})
    [created] = admin.create_topics([small]).values()
    created.result(30)
    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)
    harness.catalogue = wrap(Bulky(), name=PARTICIPANT)  # small answers for sku "b"
    signer = harness.settings.signer()
    commands = []
    sagas = [f"saga-{unique_prefix.strip('.')}-{n}" for n in range(16)]
    for saga in sagas:
        harness.saga_id = saga
        # The intent carries the step id (random hex: lz4 cannot shrink it).
        commands.append(
            harness.execute("s-" + os.urandom(1_400).hex(), {"sku": "b", "quantity": 1})
        )

    def send_all() -> None:
        for command in commands:
            key, value, headers = to_message(command, harness.settings.signer())
            harness.producer.produce(
                names.commands(PARTICIPANT), key=key, value=value, headers=headers
            )
        assert harness.producer.flush(30) == 0

    if path == "blocking":
        send_all()
    harness.start()
    try:
        if path == "loop":
            wait_until(lambda: harness.runtime and harness.runtime._assigned_end, what="assigned")
            send_all()

        def settled() -> bool:
            committed = {
                (m.key() or b"").decode()
                for m in LedgerReader(kafka_bootstrap).read(names.events)
                if from_message(m.key(), m.value(), headers_of(m), signer).TYPE == "StepCommitted"
            }
            return committed == set(sagas) or bool(_dead_letters(harness))

        wait_until(settled, what="every command committed or one dead-lettered")
        assert _dead_letters(harness) == []
    finally:
        harness.stop()


def test_a_lost_partition_starts_none_of_its_queued_commands_and_drops_late_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R15: partitions *lost* (session timed out, poll interval exceeded) may already
    be another member's, which reads their commands from the committed offset and
    runs them. Unlike a revoke, no drain may run them here as well: a saga's queued
    command started here would race the new owner (both probing the ledger before
    either's intent is on it: the tool runs twice). So nothing of a lost partition
    starts here any more, and what a running tool returns is dropped (its intent is
    on the ledger: the owner reports an unknown outcome, R11)."""
    import uuid

    import participants.runtime as runtime_module
    from sagaline.kafka import TopicPartition, create_consumer

    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=bootstrap, topic_prefix="t.", partitions=1, state_dir=tmp_path)
    topic = settings.topics.commands("stuck")
    ensure_topics(bootstrap, settings.topics, ["stuck"], 1)
    lose = threading.Event()
    lost = threading.Event()

    class LosesWhenTold:
        """The runtime's consumer; once told, its next poll() serves a lost
        assignment (on the loop's thread, as librdkafka does)."""

        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer
            self._on_lost: Callable[..., Any] | None = None

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

        def subscribe(self, topics: list[str], **callbacks: Any) -> None:
            self._on_lost = callbacks["on_lost"]
            self._consumer.subscribe(topics, **callbacks)

        def poll(self, timeout: float = -1) -> Any:
            if lose.is_set() and not lost.is_set():
                lost.set()
                assert self._on_lost is not None
                self._on_lost(self, [TopicPartition(topic, 0)])
            return self._consumer.poll(timeout)

    monkeypatch.setattr(
        runtime_module, "create_consumer", lambda *a, **k: LosesWhenTold(create_consumer(*a, **k))
    )
    stuck = Stuck()
    runtime = ParticipantRuntime(wrap(stuck, name="stuck"), settings, bootstrap)
    runtime.revoke_drain_s = 120.0  # a revoke would wait for the held tool
    late = threading.Event()
    tool_done = runtime._work._tool_done

    def watched_tool_done(job: Any, outcome: Any, error: BaseException | None) -> None:
        tool_done(job, outcome, error)
        if job.command is not None and job.command.tool == "hold":
            late.set()

    runtime._work._tool_done = watched_tool_done  # type: ignore[method-assign]
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    held, queued = _command("hold", "saga-x"), _command("note", "saga-x")
    queued = queued.model_copy(update={"step_id": "s2"})
    try:
        assert ready.wait(60)
        _produce(bootstrap, settings, topic, held, partition=0)
        _produce(bootstrap, settings, topic, queued, partition=0)  # behind it: same saga
        assert stuck.entered.wait(60), "the tool did not start"
        wait_until(lambda: runtime._work.pending == 2, what="the saga's next command queued")
        lose.set()
        assert lost.wait(60), "the loop did not poll"
        stuck.gate.set()  # the held tool returns while (or after) the loss is served
        assert late.wait(60)
    finally:
        stuck.gate.set()
        runtime.stop()
        thread.join(30)
    assert not thread.is_alive()
    records = LedgerReader(bootstrap).saga_records(
        settings.topics.events, "saga-x", settings.signer()
    )
    assert [(type(r), r.envelope.causation_id) for r in records] == [
        (StepIntentRecorded, held.event_id)
    ], "a command of a lost partition was run (or answered) here"


def test_a_failed_start_up_closes_the_consumer_and_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R16: publishing the catalogue can fail (the broker refuses the write, no Write
    ACL on the catalogue topic). ``run`` then raises, and must close what it opened
    (the group member, the journal's SQLite file) like any other way out: an embedding
    process that retries ``run`` must not leak a consumer in the group each time."""
    import sqlite3
    import uuid

    import participants.runtime as runtime_module

    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=bootstrap, topic_prefix="t.", partitions=1, state_dir=tmp_path)
    closed: list[str] = []
    create = runtime_module.create_consumer

    class Recorded:
        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

        def close(self) -> None:
            closed.append("consumer")
            self._consumer.close()

    def recorded(*args: Any, **kwargs: Any) -> Any:
        return Recorded(create(*args, **kwargs))

    monkeypatch.setattr(runtime_module, "create_consumer", recorded)
    runtime = ParticipantRuntime(
        wrap(Shop(lambda key: True), name=PARTICIPANT), settings, bootstrap
    )

    def refused() -> None:
        raise KafkaException("catalogue write refused: TOPIC_AUTHORIZATION_FAILED")

    monkeypatch.setattr(runtime, "publish_catalogue", refused)
    with pytest.raises(KafkaException, match="catalogue write refused"):
        runtime.run()
    assert closed == ["consumer"]
    with pytest.raises(sqlite3.ProgrammingError):  # closed
        runtime.journal.get("c")


def test_a_stop_with_a_command_queued_ends_and_leaves_it_to_the_next_run(
    harness: Harness,
) -> None:
    """A stop finishes the running command and drops the queued ones, their offsets
    uncommitted (read again by the next run). consumer.close() then revokes the
    partitions (librdkafka's close() serves on_revoke): that revoke must not wait for
    the dropped command, which never finishes here (the stop hung for revoke_drain_s),
    nor commit past it."""
    runtime, thread = harness.runtime, harness.thread
    assert runtime is not None and thread is not None
    runtime.revoke_drain_s = 3600.0  # a drain waiting for the dropped command never ends
    harness.shop.answer_gates["a"] = gate = threading.Event()
    harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
    harness.send(harness.execute("s2", {"sku": "b", "quantity": 1}))  # same saga: queued
    wait_until(
        lambda: harness.shop.count("reserve") == 1 and runtime._work.pending == 2,
        what="s1's tool running and s2 queued behind it",
    )
    runtime.stop()
    wait_until(lambda: runtime._work._closing, what="the loop closing its work")
    gate.set()  # s1 finishes; s2 was dropped
    thread.join(120)
    assert not thread.is_alive(), "the stop waited for the command it dropped"
    assert [c.step_id for c in _of(harness.records(), StepCommitted)] == ["s1"]
    harness.start()  # the next run reads s2 again (its offset was not committed)
    records = harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) == 2)
    assert [c.step_id for c in _of(records, StepCommitted)] == ["s1", "s2"]
    assert harness.shop.count("reserve") == 2


def test_a_poll_interval_not_above_the_revoke_drain_bounds_the_drain_below_it_and_says_so(
    transport: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The revoke drain runs inside the rebalance callback, between two polls: an
    operator who tuned ``max.poll.interval.ms`` down to near ``revoke_drain_s`` (here
    50 s against 30 s, a drain and its commit) would have the replica expelled during a
    revoke while a tool hangs, losing all it holds. The runtime says so at start,
    naming both values, and drains for at most half the interval."""
    monkeypatch.setenv("SAGALINE_KAFKA_MAX_POLL_INTERVAL_MS", "50000")
    h = Harness(transport, unique_prefix, tmp_path)
    with caplog.at_level("WARNING", logger="sagaline.participant"):
        h.start()
    try:
        assert h.runtime is not None
        assert h.runtime.revoke_drain_s == 30.0  # what was asked for
        assert h.runtime.revoke_drain_bound_s == 25.0  # what a revoke waits at most
        warned = [r.getMessage() for r in caplog.records if "revoke_drain_s" in r.getMessage()]
        assert warned and "50000" in warned[0] and "30" in warned[0], warned
    finally:
        h.stop()


def test_the_default_poll_interval_keeps_the_revoke_drain_asked_for(harness: Harness) -> None:
    assert harness.runtime is not None
    assert harness.runtime.revoke_drain_bound_s == harness.runtime.revoke_drain_s == 30.0


class Till:
    """Money as ``Decimal`` (as most money code keeps it), a set of tags: not plain
    JSON types, which orjson refuses."""

    def __init__(self) -> None:
        self.charged = 0
        self.refunded = 0

    @tool(description="Charge")
    @compensable(by="refund")
    def charge(self, sku: str, quantity: int) -> dict[str, Any]:
        from decimal import Decimal

        self.charged += 1
        return {"amount": Decimal("10.50"), "tags": {"card"}}

    def refund(self, ctx: CompensationContext) -> dict[str, Any]:
        from decimal import Decimal

        self.refunded += 1
        return {"refunded": Decimal("10.50")}


def test_a_result_of_decimals_and_sets_is_committed_not_dead_lettered_after_the_tool_acted(
    tmp_path: Path,
) -> None:
    """The tool acted (it returned): its commit must reach the ledger, or the saga
    waits for good and the effect is never compensated. A ``Decimal`` or a ``set`` in
    its result is written as JSON the way pydantic writes it (a string, a list)."""
    import uuid

    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=bootstrap, topic_prefix="t.", partitions=1, state_dir=tmp_path)
    topic = settings.topics.commands("till")
    ensure_topics(bootstrap, settings.topics, ["till"], 1)
    till = Till()
    runtime = ParticipantRuntime(wrap(till, name="till"), settings, bootstrap)
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    reader = LedgerReader(bootstrap)
    forward = _command("charge", "saga-till")

    def on_ledger() -> list[Record]:
        return reader.saga_records(settings.topics.events, "saga-till", settings.signer())

    def dead_letters() -> list[str]:
        return [read_dead_letter(m.headers()).detail for m in reader.read(settings.topics.dlq)]

    try:
        assert ready.wait(60)
        _produce(bootstrap, settings, topic, forward, partition=0)
        wait_until(
            lambda: any(isinstance(r, StepCommitted) for r in on_ledger()) or dead_letters(),
            what="the charge committed (or dead-lettered)",
        )
        assert dead_letters() == []
        committed = _of(on_ledger(), StepCommitted)[0]
        assert orjson.loads(committed.result) == {"amount": "10.50", "tags": ["card"]}
        compensate = CompensateStep(
            envelope=envelope_for(
                CompensateStep, saga_id="saga-till", tenant_id="t", producer="coordinator", now=2
            ),
            step_id="s1",
            tool="charge",
            compensation="refund",
            args=forward.args,
            result=committed.result,
            idempotency_key=forward.idempotency_key,
            compensation_key=compensation_key(forward.idempotency_key),
            attempt=1,
        )
        _produce(bootstrap, settings, topic, compensate, partition=0)
        wait_until(
            lambda: (
                any(isinstance(r, CompensationCommitted) for r in on_ledger()) or dead_letters()
            ),
            what="the refund committed (or dead-lettered)",
        )
        assert dead_letters() == []
        assert (till.charged, till.refunded) == (1, 1)
    finally:
        runtime.stop()
        thread.join(30)
    assert not thread.is_alive()


class _Unacknowledged:
    """The runtime's producer; the events records that ``refused(n)`` names are not
    written and their delivery report says the broker never acknowledged them."""

    def __init__(self, producer: Producer, topic: str, refused: Callable[[int], bool]) -> None:
        self._producer = producer
        self._topic = topic
        self._refused = refused
        self.seen = 0
        self.refusals = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
        if topic == self._topic:
            self.seen += 1
            if self._refused(self.seen - 1):
                self.refusals += 1
                kwargs["on_delivery"](KafkaError(KafkaError._MSG_TIMED_OUT), None)
                return
        self._producer.produce(topic, *args, **kwargs)


def test_an_outcome_sent_again_after_no_acknowledgement_is_counted_once(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    """R16's retry of an unacknowledged outcome is the runtime's own: the command was
    consumed once, its outcome reached the ledger once, and no duplicate came in.
    The metrics say so (they counted each retry as a command processed again, a
    duplicate prevented and a record emitted again, every 0.5 s of a broker outage)."""
    harness = Harness(transport, unique_prefix, tmp_path)
    metrics = ParticipantMetrics(PARTICIPANT)
    lost: list[_Unacknowledged] = []

    def outcome_lost_once(producer: Producer) -> _Unacknowledged:
        lost.append(_Unacknowledged(producer, harness.settings.topics.events, lambda n: n == 1))
        return lost[0]

    harness.start(outcome_lost_once, metrics)
    try:
        runtime = harness.runtime
        assert runtime is not None
        wait_until(lambda: runtime._assigned_end, 60, "the command partition assigned")
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        records = harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    finally:
        harness.stop()  # its commands finished: nothing more is counted
    assert lost[0].refusals == 1, "no outcome went unacknowledged"
    assert [type(r) for r in records] == [StepIntentRecorded, StepCommitted]
    assert harness.shop.count("reserve") == 1
    component = f"participant:{PARTICIPANT}"

    def count(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, {"component": component, **labels})
        return value or 0.0

    assert count("sagaline_records_processed_total", type="ExecuteStep") == 1
    assert count("sagaline_records_emitted_total", type="StepCommitted") == 1
    assert count("sagaline_duplicates_prevented_total") == 0


@pytest.mark.parametrize("path", ["loop", "tool-thread", "lookup"])
def test_health_says_not_ready_while_the_journal_is_waited_on_and_ready_after(
    transport: str, unique_prefix: str, tmp_path: Path, path: str
) -> None:
    # /healthz (ParticipantRuntime.health) answered ok while every command waited on
    # a journal SQLite could not write (a full disk): an orchestrator kept routing to
    # a replica doing nothing. It says why while the journal is waited on, on the
    # loop's way (a command sent once the partition is assigned) and on a tool
    # thread's (one sent before the start: a ledger probe first), or while its
    # lookup fails (every command's first read), and ok once the journal takes the
    # writes (or reads) again.
    import sqlite3

    harness = Harness(transport, unique_prefix, tmp_path)
    command = harness.execute("s1", {"sku": "a", "quantity": 1})
    if path == "tool-thread":
        harness.send(command)
    full = threading.Event()
    full.set()
    tried: list[int] = []
    harness.start()
    runtime = harness.runtime
    assert runtime is not None
    journal = runtime.journal
    write, mark, get = journal.write, journal.mark, journal.get

    def full_disk_write(rows: list[Any]) -> None:
        if full.is_set():
            tried.append(len(rows))
            raise sqlite3.OperationalError("database or disk is full")
        write(rows)

    def full_disk_mark(*args: Any, **kwargs: Any) -> None:
        if full.is_set():
            tried.append(1)
            raise RuntimeError("journal write failed") from sqlite3.OperationalError(
                "database or disk is full"
            )
        mark(*args, **kwargs)

    def unreadable_get(command_id: str) -> tuple[str, bytes | None] | None:
        if full.is_set():
            tried.append(1)
            raise sqlite3.OperationalError("disk I/O error")
        return get(command_id)

    if path == "lookup":
        setattr(journal, "get", unreadable_get)  # noqa: B010
    else:
        setattr(journal, "write", full_disk_write)  # noqa: B010
        setattr(journal, "mark", full_disk_mark)  # noqa: B010
    said = "disk I/O error" if path == "lookup" else "disk is full"
    try:
        assert runtime.health() is None
        if path in ("loop", "lookup"):
            wait_until(lambda: runtime._assigned_end, 60, "the command partition assigned")
            harness.send(command)
        wait_until(lambda: len(tried) >= 2, 60, "the journal failing again")
        why = wait_until(runtime.health, 60, "/healthz saying not ready")
        assert why is not None and "journal" in why and said in why, why
        full.clear()
        harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
        wait_until(lambda: runtime.health() is None, 60, "ready again")
        assert harness.shop.count("reserve") == 1
    finally:
        full.clear()
        harness.stop()


def test_more_commands_in_flight_than_the_kafka_client_fetches_at_once_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --max-in-flight / SAGALINE_MAX_IN_FLIGHT of 1000001 was taken: the runtime
    # started and served, and the first command it read stopped it with a traceback
    # (confluent-kafka's consume(): "ValueError: num_messages must be between 0 and
    # 1000000 (1M)"). Refused at start now: a usage error naming the option and the
    # range, and ParticipantRuntime's own ValueError naming the most.
    from services.cli import build_parser

    most = 1_000_000
    settings = Settings(bootstrap="memory://in-flight", partitions=1, state_dir=tmp_path)
    catalogue = wrap(Shop(lambda key: False), name=PARTICIPANT)
    with pytest.raises(ValueError, match=f"at most {most}"):
        ParticipantRuntime(
            catalogue, settings, "memory://in-flight", participant=PARTICIPANT,
            max_in_flight=most + 1,
        )  # fmt: skip
    monkeypatch.setenv("SAGALINE_MAX_IN_FLIGHT", str(most + 1))
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["participant", "run", "seats"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-in-flight" in err and f"between 1 and {most}" in err, err
    monkeypatch.setenv("SAGALINE_MAX_IN_FLIGHT", str(most))
    assert build_parser().parse_args(["participant", "run", "seats"]).max_in_flight == most
