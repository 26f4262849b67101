"""The coordinator's Kafka shell: exactly-once read-process-write around the pure core.

One loop, one transactional producer, one consumer in the ``sagaline-coordinator``
group on ``sagaline.events``. Per batch, a single Kafka transaction holds

* every output the core decided (commands, ledger events, terminal records,
  incidents, DLQ records),
* the changelog record of every saga whose state changed (``sagaline.coordinator.state``,
  compacted; a tombstone once the saga is terminal),
* the consumed offsets.

So either the whole batch happened or none of it did: after a crash the new owner
restores state from the changelog and resumes from the committed offsets, and the
core's deterministic event ids make any re-decided output identical.

State for a partition is restored from the changelog when the partition is assigned,
before any of its records is processed; timers live in that state, so retries,
approval expiries and reversal windows fire after a restart too.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from coordinator.core import (
    COORDINATOR_PRODUCER,
    CorePolicy,
    Decision,
    Destination,
    Output,
    decide,
    tick,
)
from coordinator.state import SagaState
from coordinator.watchdog import deadline
from sagaline.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    DeadLetterWriter,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
    create_consumer,
    create_producer,
    ensure_topics,
    read_to_end,
)
from schemas import IncidentResolved, Record
from schemas.errors import CodecError
from schemas.settings import Settings
from schemas.trust import IdentitySigner
from schemas.wire import from_message, to_message

log = logging.getLogger("sagaline.coordinator")


class ShellMetrics(Protocol):
    """What the shell reports. The Prometheus implementation
    (``sagaline.ops.metrics.CoordinatorMetrics``) sits in a layer above and is passed in
    by the process that runs the coordinator."""

    def observe_record(self, record: Record) -> None: ...

    def observe_output(self, output: Output) -> None: ...

    def duplicate_prevented(self, count: int = 1) -> None: ...

    def dlq(self, reason: str) -> None: ...

    def transaction_committed(self, seconds: float, records: int) -> None: ...

    def in_flight(self, sagas: int) -> None: ...


class NoMetrics:
    """The default: report nothing."""

    def observe_record(self, record: Record) -> None:
        pass

    def observe_output(self, output: Output) -> None:
        pass

    def duplicate_prevented(self, count: int = 1) -> None:
        pass

    def dlq(self, reason: str) -> None:
        pass

    def transaction_committed(self, seconds: float, records: int) -> None:
        pass

    def in_flight(self, sagas: int) -> None:
        pass

# Records the coordinator emitted itself come back to it on the events topic; for a
# saga whose state is already tombstoned they are history, not input.
_RECENTLY_TERMINATED_MAX = 100_000


@dataclass
class _Pending:
    """What one batch changed, applied to memory only after its transaction commits."""

    states: dict[str, SagaState | None] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)
    first_offsets: dict[tuple[str, int], int] = field(default_factory=dict)


class Coordinator:
    """Runs the core over ``sagaline.events`` until :meth:`stop` (or SIGTERM)."""

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        *,
        instance_id: str = "coordinator-0",
        group_id: str | None = None,
        clock: Callable[[], int] | None = None,
        batch_size: int = 500,
        transaction_timeout_ms: int = 10_000,
        metrics: ShellMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.topics = settings.topics
        self.signer = settings.signer()
        # Identity keys make envelope.producer the verified writer (schemas.trust).
        self._policy = CorePolicy(bind_writers=isinstance(self.signer, IdentitySigner))
        self.instance_id = instance_id
        self.group_id = group_id or f"{settings.topic_prefix}sagaline-coordinator"
        self._clock = clock or (lambda: int(time.time() * 1000))
        self._batch_size = batch_size
        self._running = False
        self._states: dict[str, SagaState] = {}
        self._partition_of: dict[str, int] = {}
        self._terminated: OrderedDict[str, None] = OrderedDict()
        self._assigned: set[int] = set()
        self._known_participants: set[str] = set()
        self.metrics: ShellMetrics = metrics or NoMetrics()

        self._producer = create_producer(
            bootstrap,
            **{
                "transactional.id": f"{self.group_id}-{instance_id}",
                "transaction.timeout.ms": transaction_timeout_ms,
            },
        )
        # Static membership: a restarted instance (same id) takes its partitions back
        # at once instead of waiting for the dead one's session to time out.
        self._consumer = create_consumer(
            bootstrap, self.group_id, **{"group.instance.id": f"{self.group_id}-{instance_id}"}
        )
        # Inside the batch transaction: its commit acknowledges the DLQ copies too.
        self._dead_letters = DeadLetterWriter(self._producer, self.topics.dlq, acknowledged=False)

    # ------------------------------------------------------------------ lifecycle

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT finish the current batch, then close cleanly."""

        def _stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: stopping after the current batch", signum)
            self.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def stop(self) -> None:
        self._running = False

    def run(self, *, until: Callable[[], bool] | None = None) -> None:
        """The loop. ``until`` lets tests and benchmarks stop it on a condition."""
        self._producer.init_transactions(30)
        self._consumer.subscribe(
            [self.topics.events],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self._running = True
        log.info("coordinator %s consuming %s", self.instance_id, self.topics.events)
        try:
            while self._running and not (until is not None and until()):
                messages = self._consumer.consume(self._batch_size, 0.1)
                self._process_batch(messages)
        finally:
            self._consumer.close()
            self._producer.flush(10)

    # ----------------------------------------------------------------- the batch

    def _process_batch(self, messages: list[Message]) -> None:
        now = self._clock()
        due = [s for s, st in self._states.items() if _due(st, now)]
        records = [m for m in messages if m.error() is None]
        for m in messages:
            err = m.error()
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err)
        if not records and not due:
            return

        pending = _Pending()
        started = time.perf_counter()
        self._producer.begin_transaction()
        try:
            for msg in records:
                self._handle_message(msg, now, pending)
            for saga_id in due:
                state = self._current(saga_id, pending)
                if state is not None:
                    self._apply(tick(state, now, self._policy), saga_id, pending, None)
            self._write_changelog(pending)
            with deadline("send_offsets_to_transaction", 30):
                self._producer.send_offsets_to_transaction(
                    self._consumer.position(self._consumer.assignment()),
                    self._consumer.consumer_group_metadata(),
                    30,
                )
            self._producer.commit_transaction(30)
        except KafkaException as exc:
            self._recover(exc, pending)
            return
        self.metrics.transaction_committed(time.perf_counter() - started, len(records))
        self._commit_pending(pending)

    def _handle_message(self, msg: Message, now: int, pending: _Pending) -> None:
        try:
            record = from_message(msg.key(), msg.value(), msg.headers(), self.signer)
        except CodecError as exc:
            self._reject(msg, exc.reason, str(exc))
            return
        if isinstance(record, IncidentResolved):
            # The operators' incident feed shows each resolution next to its incident,
            # also for sagas that have already ended ESCALATED (the usual case).
            self._producer.produce(
                self.topics.incidents, key=msg.key(), value=msg.value(), headers=msg.headers()
            )
        saga_id = record.saga_id
        pending.partitions.setdefault(saga_id, msg.partition() or 0)
        state = self._current(saga_id, pending)
        if state is None and saga_id in self._terminated:
            return  # history of a saga that ended here (late echo or duplicate)
        try:
            decision = decide(state, record, now, self._policy)
        except Exception as exc:  # a bug must not stop the service or lose the record
            log.exception("decide failed for %s", record.event_id)
            self._reject(msg, "apply-error", f"{type(exc).__name__}: {exc}")
            return
        self.metrics.observe_record(record)
        if not decision.changed and record.envelope.producer != COORDINATOR_PRODUCER:
            self.metrics.duplicate_prevented()
        self._apply(decision, saga_id, pending, msg)

    def _apply(
        self, decision: Decision, saga_id: str, pending: _Pending, source: Message | None
    ) -> None:
        for output in decision.outputs:
            self._emit(output, source)
        if decision.changed:
            pending.states[saga_id] = decision.state

    def _emit(self, output: Output, source: Message | None) -> None:
        if output.destination is Destination.REJECTED:
            if source is not None:
                self._reject(source, output.reason or "rejected", output.detail)
            return
        key, value, headers = to_message(output.record, self.signer)
        for topic in self._topics_for(output):
            self._producer.produce(topic, value=value, key=key, headers=headers)
        self.metrics.observe_output(output)

    def _topics_for(self, output: Output) -> list[str]:
        if output.destination is Destination.COMMAND:
            assert output.participant is not None
            self._ensure_command_topic(output.participant)
            return [self.topics.commands(output.participant)]
        if output.destination is Destination.TERMINAL:
            return [self.topics.events, self.topics.terminal]
        if output.destination is Destination.INCIDENT:
            return [self.topics.events, self.topics.incidents]
        return [self.topics.events]

    def _ensure_command_topic(self, participant: str) -> None:
        """A command to a participant whose topic does not exist yet would abort every
        transaction; create it (idempotent, outside the transaction's concern)."""
        if participant not in self._known_participants:
            ensure_topics(
                self.bootstrap,
                self.topics,
                [participant],
                self.settings.partitions,
                replication=self.settings.replication,
            )
            self._known_participants.add(participant)

    def _reject(self, msg: Message, reason: str, detail: str) -> None:
        """R16: bad input goes to the DLQ with its reason; the loop goes on."""
        log.warning(
            "dlq: %s at %s[%s]@%s: %s", reason, msg.topic(), msg.partition(), msg.offset(), detail
        )
        self._dead_letters.write(msg, reason, detail)
        self.metrics.dlq(reason)

    def _write_changelog(self, pending: _Pending) -> None:
        for saga_id, state in pending.states.items():
            partition = pending.partitions.get(saga_id, self._partition_of.get(saga_id))
            value = None if state is None or state.is_terminal else state.to_bytes()
            kwargs: dict[str, Any] = {"key": saga_id.encode(), "value": value}
            if partition is not None:
                kwargs["partition"] = partition
            self._producer.produce(self.topics.state, **kwargs)

    def _commit_pending(self, pending: _Pending) -> None:
        for saga_id, state in pending.states.items():
            if state is None or state.is_terminal:
                self._states.pop(saga_id, None)
                self._partition_of.pop(saga_id, None)
                self._terminated[saga_id] = None
                if len(self._terminated) > _RECENTLY_TERMINATED_MAX:
                    self._terminated.popitem(last=False)
            else:
                self._states[saga_id] = state
                if saga_id in pending.partitions:
                    self._partition_of[saga_id] = pending.partitions[saga_id]
        self.metrics.in_flight(len(self._states))

    def _current(self, saga_id: str, pending: _Pending) -> SagaState | None:
        if saga_id in pending.states:
            return pending.states[saga_id]
        return self._states.get(saga_id)

    def _recover(self, exc: KafkaException, pending: _Pending) -> None:
        """Abort the batch and rewind, so nothing is half-applied (memory untouched)."""
        error: KafkaError = exc.args[0]
        log.warning("transaction failed (%s); aborting the batch and rewinding", error)
        if error.fatal():
            raise exc  # fenced by a newer instance with our transactional.id
        try:
            self._producer.abort_transaction(30)
        except KafkaException:
            log.exception("abort failed")
        # Rewind to the committed offsets: re-reading the batch re-decides it identically.
        assignment = self._consumer.assignment()
        committed = self._consumer.committed(assignment, 30)
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    # -------------------------------------------------------------- rebalancing

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = [p.partition for p in partitions]
        restored = self._restore(numbers)
        self._assigned.update(numbers)
        log.info("assigned %s; restored %d sagas", numbers, restored)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop({p.partition for p in partitions})

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop({p.partition for p in partitions})

    def _drop(self, numbers: set[int]) -> None:
        for saga_id in [s for s, p in self._partition_of.items() if p in numbers]:
            self._states.pop(saga_id, None)
            self._partition_of.pop(saga_id, None)
        self._assigned -= numbers

    def _restore(self, numbers: list[int]) -> int:
        """Read the compacted changelog partitions to their end (R5: state is a fold)."""
        if not numbers:
            return 0
        group = f"{self.group_id}-restore"
        for msg in read_to_end(self.bootstrap, self.topics.state, numbers, group):
            saga_id = (msg.key() or b"").decode()
            value = msg.value()
            if value is None:
                self._states.pop(saga_id, None)
                self._partition_of.pop(saga_id, None)
            else:
                self._states[saga_id] = SagaState.from_bytes(value)
                self._partition_of[saga_id] = msg.partition() or 0
        return sum(1 for p in self._partition_of.values() if p in numbers)

    # ----------------------------------------------------------------- inspection

    @property
    def in_flight(self) -> int:
        return len(self._states)

    def state_of(self, saga_id: str) -> SagaState | None:
        return self._states.get(saga_id)

    def positions(self) -> dict[int, int]:
        """Next offset to read per assigned events partition (negative before the first
        fetch). Between batches every offset below it is processed and committed, so
        an ``until`` callback can tell when a backlog is consumed. Call it from the
        thread running :meth:`run` (e.g. inside ``until``)."""
        assignment = self._consumer.assignment()
        if not assignment:
            return {}
        return {tp.partition: tp.offset for tp in self._consumer.position(assignment)}


def _due(state: SagaState, now: int) -> bool:
    due_at = state.next_due_at()
    return due_at is not None and due_at <= now
