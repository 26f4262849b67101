"""Coordinator throughput, compensation latency and memory, on the real broker.

Run: ``python bench/coordinator.py`` (a few minutes at most; ``--quick`` for a short
check). One run, on a fresh uniquely prefixed set of topics of the project's broker
(``services.broker.resolve_bootstrap``), measures:

1. **Throughput with transactions.** A synthetic ledger (sagas of two compensatable
   steps: started, scheduled, intent, committed, ..., ended; a share fails with a
   business rejection and is compensated) is produced first; the coordinator
   (``coordinator.shell.Coordinator``, exactly-once batches) then consumes it from the
   start, and events/s is counted from the batch that brought the first record to the
   one that reached the end of the input. Nobody answers the commands it sends.
2. **Baseline in the same run.** A raw transactional pass-through over the same input:
   a read_committed consumer and a transactional producer that, per batch of the same
   size, copies the same bytes to the same partition of another topic, sends the
   offsets and commits. The ratio says what deciding costs on top of EOS itself.
   Both run ``--rounds`` times (default 3), alternated (pass-through, coordinator,
   pass-through, ...), each round on its own copy of the input; the table shows each
   one's median and the ratio of the medians. One pass-through takes a second or so,
   and on a busy 2-core machine a single one moved by a factor of five from run to
   run, so a ratio from one round of each says more about the moment than the code.
3. **Compensation latency.** The real coordinator process (``sagaline coordinator
   run``) takes over the group (restoring state from the changelog), and for sagas
   with a committed step and a second one in flight a ``StepFailed``
   (BUSINESS_REJECTION) is produced, one at a time at a random phase; the latency is
   the time from producing it to a separate read_committed consumer seeing the first
   ``CompensationRequested`` of that saga on the events topic (one monotonic clock).
4. **Memory per in-flight saga.** Python heap retained per saga (tracemalloc) when the
   pure core folds N in-flight sagas into a dict, as the shell holds them, and the
   size of the state's changelog record (``SagaState.to_bytes()``), taken from the
   states the coordinator above actually holds.

The synthetic ledger this process holds is frozen out of the garbage collector
(``gc.freeze``) before the timed phases: a coordinator process does not hold it.

A benchmark, not a test: nothing here asserts on time. Topics are deleted at the end
unless ``--keep-topics``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import heapq
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from bench._common import (
    REPO_ROOT,
    machine_description,
    markdown_table,
    require_broker,
    write_docs_section,
)
from coordinator.core import decide
from coordinator.shell import DECODED_STATES, Coordinator, _due_headers, _PackedStates
from coordinator.state import SagaState, SagaStatus
from sagaline.kafka import consumer_config, ensure_topics, producer_config, watermarks
from schemas.keys import args_fingerprint, derived_event_id, fingerprint, idempotency_key
from schemas.models import (
    CompensationRequested,
    Envelope,
    FailureKind,
    Record,
    SagaEndRequested,
    SagaOutcome,
    SagaStarted,
    StepCommitted,
    StepContract,
    StepFailed,
    StepIntentRecorded,
    StepScheduled,
)
from schemas.settings import Settings
from schemas.signing import Signer
from schemas.wire import from_message, to_message

PARTICIPANTS = ("payments", "inventory")
CONTRACTS = (
    StepContract(
        tool="payments.charge",
        participant="payments",
        compensation="refund",
        has_lookup=True,
        resources=["payments:card"],
        reversal_window_ms=7 * 86_400_000,
    ),
    StepContract(
        tool="inventory.reserve",
        participant="inventory",
        compensation="release",
        has_lookup=True,
        resources=["inventory:sku"],
    ),
)


class BenchError(RuntimeError):
    """A phase could not finish (broker unreachable, a deadline passed)."""


# ------------------------------------------------------------------ the synthetic ledger


class _SagaWriter:
    """Writes one saga's records the way the agent and participants would."""

    def __init__(self, saga_id: str, t0: int) -> None:
        self.saga_id = saga_id
        self.clock = t0
        self.n = 0
        self.order = f"o-{saga_id[-8:]}"

    def env(self, record_type: type[Record], producer: str) -> Envelope:
        self.n += 1
        self.clock += 3
        return Envelope(
            event_id=derived_event_id(self.saga_id, "bench", self.n),
            saga_id=self.saga_id,
            tenant_id="acme",
            type=record_type.TYPE,
            occurred_at=self.clock,
            producer=producer,
        )

    def args(self, step: int) -> bytes:
        return orjson.dumps({"order": self.order, "line": step, "amount_cents": 1999 + step})

    def key(self, step: int) -> str:
        return idempotency_key(self.saga_id, f"s{step}", CONTRACTS[step].tool, self.args(step))

    def started(self) -> SagaStarted:
        return SagaStarted(
            envelope=self.env(SagaStarted, "agent"), workflow="checkout", principal="alice"
        )

    def scheduled(self, step: int) -> StepScheduled:
        args = self.args(step)
        return StepScheduled(
            envelope=self.env(StepScheduled, "agent"),
            step_id=f"s{step}",
            args=args,
            args_fingerprint=args_fingerprint(args),
            contract=CONTRACTS[step],
        )

    def intent(self, step: int) -> StepIntentRecorded:
        return StepIntentRecorded(
            envelope=self.env(StepIntentRecorded, CONTRACTS[step].participant),
            step_id=f"s{step}",
            tool=CONTRACTS[step].tool,
            idempotency_key=self.key(step),
            args_fingerprint=args_fingerprint(self.args(step)),
            attempt=1,
            principal="alice",
        )

    def committed(self, step: int) -> StepCommitted:
        result = orjson.dumps({"id": f"op-{self.order}-{step}", "status": "ok"})
        return StepCommitted(
            envelope=self.env(StepCommitted, CONTRACTS[step].participant),
            step_id=f"s{step}",
            tool=CONTRACTS[step].tool,
            idempotency_key=self.key(step),
            attempt=1,
            provider_operation_id=f"op-{self.order}-{step}",
            result=result,
            response_fingerprint=fingerprint(result),
        )

    def failed(self, step: int) -> StepFailed:
        return StepFailed(
            envelope=self.env(StepFailed, CONTRACTS[step].participant),
            step_id=f"s{step}",
            tool=CONTRACTS[step].tool,
            idempotency_key=self.key(step),
            attempt=1,
            kind=FailureKind.BUSINESS_REJECTION,
            error_type="OutOfStock",
            message="sku sold out",
        )

    def end(self, outcome: SagaOutcome) -> SagaEndRequested:
        return SagaEndRequested(envelope=self.env(SagaEndRequested, "agent"), outcome=outcome)

    def open_records(self) -> list[Record]:
        """Step s0 committed, s1 in flight (intent recorded): 6 records."""
        return [
            self.started(),
            self.scheduled(0),
            self.intent(0),
            self.committed(0),
            self.scheduled(1),
            self.intent(1),
        ]

    def completing(self) -> list[Record]:
        """Both steps commit, the agent completes: 8 records, the saga ends COMPLETED."""
        return [*self.open_records(), self.committed(1), self.end(SagaOutcome.COMPLETE)]

    def failing(self) -> list[Record]:
        """s1 is rejected, the agent aborts: 8 records; s0 is compensated (nobody answers
        the command, so the saga stays in flight, COMPENSATING)."""
        return [*self.open_records(), self.failed(1), self.end(SagaOutcome.ABORT)]


@dataclass
class Ledger:
    records: list[Record]
    sagas: int
    failing: list[str]
    open: list[_SagaWriter]  # in flight, for the latency phase (StepFailed sent later)


def build_ledger(sagas: int, failing_share: float, open_sagas: int, seed: int) -> Ledger:
    """Interleave sagas as concurrent agents would (windows of 200 sagas advancing
    together); each saga's own records stay in order."""
    rng = random.Random(seed)
    t0 = int(time.time() * 1000)
    streams: list[list[Record]] = []
    failing: list[str] = []
    opened: list[_SagaWriter] = []
    for i in range(sagas + open_sagas):
        writer = _SagaWriter(f"saga-{uuid.UUID(int=rng.getrandbits(128))}", t0 + i)
        if i >= sagas:
            streams.append(writer.open_records())
            opened.append(writer)
        elif rng.random() < failing_share:
            streams.append(writer.failing())
            failing.append(writer.saga_id)
        else:
            streams.append(writer.completing())
    records: list[Record] = []
    for start in range(0, len(streams), 200):
        window = [iter(s) for s in streams[start : start + 200]]
        while window:
            rng.shuffle(window)
            nxt: list[Iterator[Record]] = []
            for it in window:
                record = next(it, None)
                if record is not None:
                    records.append(record)
                    nxt.append(it)
            window = nxt
    return Ledger(records, sagas + open_sagas, failing, opened)


# ------------------------------------------------------------------------- kafka helpers


def _produce_all(bootstrap: str, topic: str, records: list[Record], signer: Signer) -> int:
    producer = Producer(producer_config(bootstrap, **{"linger.ms": 20}))
    for i, record in enumerate(records):
        key, value, headers = to_message(record, signer)
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 1000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    if left:
        raise BenchError(f"{left} input records were not acknowledged by the broker in 60 s")
    return len(records)


def _end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    reader = Consumer(consumer_config(bootstrap, f"bench-watermarks-{uuid.uuid4().hex[:6]}"))
    try:
        return {p: watermarks(reader, TopicPartition(topic, p))[1] for p in range(partitions)}
    finally:
        reader.close()


def _create_topic(bootstrap: str, name: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[
        name
    ].result(30)
    deadline = time.monotonic() + 30
    while True:
        topic = admin.list_topics(timeout=10).topics.get(name)
        if topic is not None and topic.error is None and len(topic.partitions) == partitions:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"topic {name} is not visible on {bootstrap} 30 s after creation")
        time.sleep(0.1)


def _delete_topics(bootstrap: str, prefix: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    if names:
        for future in admin.delete_topics(names, operation_timeout=30).values():
            try:
                future.result(30)
            except KafkaException as exc:
                print(f"warning: could not delete a bench topic: {exc}", file=sys.stderr)


class _Stopwatch:
    """An ``until`` callback, called before each consume: notes the time before the
    consume that brought the first input record, and stops once every partition's
    position reached the end of the input."""

    def __init__(
        self, ends: dict[int, int], positions: Callable[[], dict[int, int]], limit_s: float
    ) -> None:
        self.ends = {p: e for p, e in ends.items() if e > 0}
        self.positions = positions
        self.started: float | None = None
        self.finished: float | None = None
        self.read = 0  # every record read, including any past the input (echoes)
        self.batches = 0  # consumes that advanced the input
        self._consumed = 0
        self._previous = time.perf_counter()
        self._deadline = time.monotonic() + limit_s

    def __call__(self) -> bool:
        now = time.perf_counter()
        pos = self.positions()
        consumed = sum(max(0, min(pos.get(p, 0), end)) for p, end in self.ends.items())
        if self.started is None and consumed > 0:
            self.started = self._previous
        if consumed > self._consumed:
            self.batches += 1
            self._consumed = consumed
        self._previous = now
        if all(pos.get(p, -1) >= end for p, end in self.ends.items()):
            self.finished = now
            self.read = sum(max(0, o) for o in pos.values())
            return True
        return time.monotonic() > self._deadline

    def elapsed(self, what: str) -> float:
        if self.started is None or self.finished is None:
            raise BenchError(f"{what} did not consume the whole input before its deadline")
        return self.finished - self.started


# -------------------------------------------------------------------------- the phases


@dataclass
class Throughput:
    records: int
    seconds: float
    read: int
    batches: int

    @property
    def per_second(self) -> float:
        return self.records / self.seconds


def _median(runs: list[Throughput]) -> Throughput:
    """The run of median speed (the middle one; of two, the slower)."""
    ordered = sorted(runs, key=lambda t: t.per_second)
    return ordered[(len(ordered) - 1) // 2]


def run_coordinator(
    settings: Settings,
    bootstrap: str,
    ends: dict[int, int],
    batch_size: int,
    ledger: Ledger,
    limit_s: float,
) -> tuple[Throughput, dict[str, SagaState]]:
    """Returns the throughput and the in-flight states the coordinator held at the end
    (taken before ``run`` returns: closing the consumer revokes and drops them)."""
    coordinator = Coordinator(settings, bootstrap, instance_id="bench-0", batch_size=batch_size)
    watch = _Stopwatch(ends, coordinator.positions, limit_s)
    held: dict[str, SagaState] = {}

    def until() -> bool:
        if not watch():
            return False
        for saga_id in [w.saga_id for w in ledger.open] + ledger.failing:
            state = coordinator.state_of(saga_id)
            if state is not None:
                held[saga_id] = state
        return True

    coordinator.run(until=until)
    seconds = watch.elapsed("the coordinator")
    return Throughput(sum(ends.values()), seconds, watch.read, watch.batches), held


def run_passthrough(
    settings: Settings,
    bootstrap: str,
    ends: dict[int, int],
    batch_size: int,
    out_topic: str,
    limit_s: float,
) -> Throughput:
    """The same loop as the shell minus decoding and deciding: consume, copy the bytes
    to the same partition, send offsets, commit."""
    group = f"{settings.topic_prefix}bench-passthrough"
    consumer = Consumer(consumer_config(bootstrap, group))
    producer = Producer(
        producer_config(
            bootstrap, **{"transactional.id": f"{group}-0", "transaction.timeout.ms": 10_000}
        )
    )
    producer.init_transactions(30)
    consumer.subscribe([settings.topics.events])

    def positions() -> dict[int, int]:
        assignment = consumer.assignment()
        return (
            {tp.partition: tp.offset for tp in consumer.position(assignment)} if assignment else {}
        )

    watch = _Stopwatch(ends, positions, limit_s)
    try:
        while not watch():
            records = [m for m in consumer.consume(batch_size, 0.1) if m.error() is None]
            if not records:
                continue
            producer.begin_transaction()
            for m in records:
                producer.produce(
                    out_topic,
                    key=m.key(),
                    value=m.value(),
                    headers=m.headers(),
                    partition=m.partition() or 0,
                )
            producer.send_offsets_to_transaction(
                consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30
            )
            producer.commit_transaction(30)
    finally:
        consumer.close()
        producer.flush(10)
    seconds = watch.elapsed("the pass-through")
    return Throughput(sum(ends.values()), seconds, watch.read, watch.batches)


@dataclass
class Latency:
    samples_ms: list[float]

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile."""
        ordered = sorted(self.samples_ms)
        return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))]


def _await_compensation(reader: Consumer, key: bytes, signer: Signer, limit_s: float) -> float:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        msg = reader.poll(0.05)
        if msg is None or msg.error() is not None or msg.key() != key:
            continue
        seen = time.perf_counter()
        if isinstance(
            from_message(msg.key(), msg.value(), msg.headers(), signer), CompensationRequested
        ):
            return seen
    raise BenchError(
        f"no CompensationRequested for {key.decode()} within {limit_s:.0f} s: is the "
        "coordinator process running? (its log is printed below)"
    )


def run_latency(
    settings: Settings, bootstrap: str, ledger: Ledger, warmup: int, seed: int, log_path: Path
) -> Latency:
    """Start the real coordinator process, then time StepFailed -> CompensationRequested."""
    topic = settings.topics.events
    signer = settings.signer()
    reader = Consumer(consumer_config(bootstrap, f"{settings.topic_prefix}bench-latency-reader"))
    reader.assign(
        [
            TopicPartition(topic, p, off)
            for p, off in _end_offsets(bootstrap, topic, settings.partitions).items()
        ]
    )
    producer = Producer(producer_config(bootstrap, **{"linger.ms": 0}))
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=bootstrap,
        SAGALINE_TOPIC_PREFIX=settings.topic_prefix,
        SAGALINE_PARTITIONS=str(settings.partitions),
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "coordinator",
                "run",
                "--instance-id",
                "bench-live",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    rng = random.Random(seed)
    samples: list[float] = []
    try:
        for i, writer in enumerate(ledger.open):
            key, value, headers = to_message(writer.failed(1), signer)
            sent = time.perf_counter()
            producer.produce(topic, key=key, value=value, headers=headers)
            producer.flush(10)
            # The first sample waits for the process to start, join and restore.
            seen = _await_compensation(reader, key, signer, 120 if i == 0 else 30)
            if i >= warmup:
                samples.append((seen - sent) * 1000)
            # Pacing, not synchronisation: a random gap puts each StepFailed at a
            # random phase of the coordinator's 100 ms consume wait.
            time.sleep(rng.uniform(0, 0.1))
    except BenchError:
        print(log_path.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        reader.close()
    return Latency(samples)


@dataclass
class Memory:
    heap_bytes: dict[str, float]  # shape -> retained Python heap per saga (tracemalloc)
    changelog_bytes: dict[str, float]  # shape -> mean SagaState.to_bytes() of live states
    sagas: int
    cache_bytes: float  # a full decoded-state cache (DECODED_STATES running sagas), in all


def _fold(records: list[Record]) -> SagaState:
    state: SagaState | None = None
    for record in records:
        state = decide(state, record, record.envelope.occurred_at).state
    assert state is not None and not state.is_terminal
    return state


def measure_memory(n: int, held: dict[str, SagaState]) -> Memory:
    """Heap per in-flight saga as the shell holds it (``coordinator.shell._PackedStates``:
    each state as its changelog bytes plus its next timer; its partition; its timer)."""
    shapes: dict[str, Callable[[_SagaWriter], list[Record]]] = {
        "running": _SagaWriter.open_records,
        "compensating": _SagaWriter.failing,
    }
    heap: dict[str, float] = {}
    cache = 0.0
    t0 = int(time.time() * 1000)
    for shape, build in shapes.items():
        _fold(build(_SagaWriter("saga-warmup", t0)))  # warm caches before counting
        folded = [_fold(build(_SagaWriter(f"saga-{uuid.uuid4()}", t0 + i))) for i in range(n)]
        gc.collect()
        tracemalloc.start()
        # What the shell keeps per in-flight saga: the packed state (changelog bytes
        # and next timer) under a saga id of its own, its partition, its timer entry.
        states = _PackedStates(DECODED_STATES)
        partition_of: dict[str, int] = {}
        timers: list[tuple[int, str]] = []
        for i, state in enumerate(folded):
            saga_id = state.saga_id.encode().decode()  # a string not shared with `folded`
            due_at = state.next_due_at()
            states.put(saga_id, state.to_bytes(), due_at)
            partition_of[saga_id] = i % 6
            if due_at is not None:
                heapq.heappush(timers, (due_at, saga_id))
        gc.collect()
        retained, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        heap[shape] = retained / n
        if shape == "running":
            cache = _cache_heap(states, [s.saga_id for s in folded])
        del states, partition_of, timers, folded
    live: dict[str, list[int]] = {"running": [], "compensating": []}
    for state in held.values():
        shape = "compensating" if state.status is SagaStatus.COMPENSATING else "running"
        live[shape].append(len(state.to_bytes()))
    changelog = {s: sum(v) / len(v) for s, v in live.items() if v}
    return Memory(heap, changelog, n, cache)


def _cache_heap(states: _PackedStates, saga_ids: list[str]) -> float:
    """What the shell's decoded-state cache holds beside the bytes once full: the
    decoded objects of its last ``DECODED_STATES`` committed sagas. A fixed cost, not
    one per in-flight saga (measured over the sagas there are, scaled to a full cache)."""
    kept = saga_ids[:DECODED_STATES]
    gc.collect()
    tracemalloc.start()
    for saga_id in kept:
        decoded = states.get(saga_id)
        assert decoded is not None
        states.give_back(saga_id, decoded)
    gc.collect()
    retained, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return retained / len(kept) * DECODED_STATES


@dataclass
class Restore:
    sagas: int
    seconds: float
    changelog_mb: float


def measure_restore(settings: Settings, bootstrap: str, n: int) -> Restore:
    """A fresh coordinator restores ``n`` in-flight sagas from the changelog: the
    time from reading the first record to holding every state, timers scheduled."""
    template = _fold(_SagaWriter("saga-restore-template-0000", 0).open_records())
    packed = template.to_bytes()
    due = template.next_due_at()
    headers = _due_headers(due)  # as the shell writes them
    producer = Producer(producer_config(bootstrap))
    for i in range(n):
        saga_id = f"saga-restore-{i:014d}"
        producer.produce(
            settings.topics.state,
            key=saga_id.encode(),
            value=packed.replace(b"saga-restore-template-0000", saga_id.encode()),
            headers=headers,
        )
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0
    coordinator = Coordinator(settings, bootstrap, instance_id="bench-restore")
    started = time.perf_counter()
    restored = coordinator._restore(list(range(settings.partitions)))
    seconds = time.perf_counter() - started
    assert restored == n, f"restored {restored} of {n}"
    if due is not None:  # every timer scheduled without decoding a state
        assert len(coordinator._timers) == n, f"{len(coordinator._timers)} timers for {n} sagas"
    last = f"saga-restore-{n - 1:014d}"
    state = coordinator.state_of(last)
    assert state is not None and state.saga_id == last, f"{last} not restored readable"
    return Restore(n, seconds, n * len(packed) / 1e6)


# ------------------------------------------------------------------------------ report


def _kafka_version(bootstrap: str) -> str:
    try:
        from services import kafka_local

        status = kafka_local.status(timeout=2.0)
        if status.running and status.bootstrap == bootstrap:
            return f"Apache Kafka {status.version} (local KRaft broker, loopback)"
    except Exception:  # a description only; never fail the run over it
        pass
    return f"broker at {bootstrap} (version not known)"


def _versions() -> str:
    from importlib.metadata import version

    import confluent_kafka

    return (
        f"confluent-kafka {version('confluent-kafka')}, "
        f"librdkafka {confluent_kafka.libversion()[0]}"
    )


def _reading(through: Throughput, passthrough: Throughput, memory: Memory) -> str:
    """How to read the table: the mechanisms behind each number (stable across runs)."""
    heap = memory.heap_bytes["running"]
    return (
        "Reading it: the pass-through is the ceiling EOS itself sets (one transaction per "
        f"batch, about {passthrough.records / passthrough.batches:.0f} records each); the "
        f"coordinator runs at {through.per_second / passthrough.per_second:.0%} of it. "
        "Per record it verifies and decodes (Avro plus pydantic validation, see Codec), "
        "decides, and encodes its outputs; per batch it decodes each saga it touches once "
        "from the bytes memory keeps (the core then changes that object in place instead "
        "of copying the state per record) and writes one changelog record per changed "
        "saga. Its waits on the broker overlap its work: a batch's offsets go to its "
        "transaction (two round trips) while the batch is decided, and its commit runs "
        "in the background while the next batch is read and decoded; memory takes a "
        "batch's changes once its commit has returned. So under a backlog the "
        "coordinator is bound by its one Python thread's CPU, where the pass-through "
        "only waits on the broker. The loop blocks only until the first record arrives "
        "(or the next timer, kept in a heap, is due), then takes what has already "
        "arrived up to the batch size, so a lone `StepFailed` waits for at most the "
        "transaction in progress and its own; a batch that begins right after a commit "
        "is answered CONCURRENT_TRANSACTIONS until the broker has written the markers, "
        "and the coordinator retries it after 5 ms (librdkafka's default is 100 ms). In "
        "memory an in-flight saga is its changelog record plus its next timer, decoded "
        f"when a record or a timer of the saga needs it: about {heap:,.0f} B of heap "
        f"with its partition and timer entries, so 100,000 in-flight sagas hold about "
        f"{heap * 100_000 / 1e9:.2f} GB, and a restore only stores bytes (each changelog "
        "record carries its next timer in the `sagaline-next-due` header). Beside the "
        f"bytes it keeps the decoded states of the last {DECODED_STATES} sagas a "
        f"committed batch touched ({memory.cache_bytes / 2**20:.1f} MiB when full, "
        f"{memory.cache_bytes / 100_000:,.0f} B per saga at 100,000 in flight), so a "
        "saga's next batch does not decode it again."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run to check it works")
    parser.add_argument("--sagas", type=int, help="sagas in the input (default 6000; quick 300)")
    parser.add_argument(
        "--failing-share",
        type=float,
        default=0.15,
        help="share of sagas whose second step is rejected (compensated)",
    )
    parser.add_argument("--samples", type=int, help="latency samples (default 200; quick 30)")
    parser.add_argument("--batch-size", type=int, default=500, help="records per transaction")
    parser.add_argument(
        "--rounds",
        type=int,
        help="alternated pass-through and coordinator runs, each on its own copy of the "
        "input; medians reported (default 3; quick 1)",
    )
    parser.add_argument("--memory-sagas", type=int, help="sagas folded for tracemalloc")
    parser.add_argument(
        "--restore-sagas", type=int, help="in-flight sagas restored (default 100000; quick 5000)"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--no-docs",
        action="store_true",
        help="do not write docs/benchmarks.md (a --quick run never does)",
    )
    parser.add_argument("--keep-topics", action="store_true", help="leave the bench topics")
    args = parser.parse_args(argv)
    sagas = args.sagas or (300 if args.quick else 6000)
    samples = args.samples or (30 if args.quick else 200)
    memory_sagas = args.memory_sagas or (500 if args.quick else 2000)
    restore_sagas = args.restore_sagas or (5000 if args.quick else 100_000)
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    warmup = 5
    limit_s = 300.0

    from services.broker import resolve_bootstrap

    base = Settings.from_env()
    bootstrap = base.bootstrap or resolve_bootstrap()
    require_broker(bootstrap)
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    settings = dataclasses.replace(base, bootstrap=bootstrap, topic_prefix=prefix)
    command = "python bench/coordinator.py" + (" --quick" if args.quick else "")
    started_at = datetime.datetime.now(datetime.UTC)
    kafka = _kafka_version(bootstrap)
    print(f"{machine_description()}; {_versions()}")
    print(f"{kafka}; topics {prefix}*, {settings.partitions} partitions")

    # Round i reads its own copy of the input (topics under f"{prefix}r{i}."): a
    # coordinator's group and changelog start empty, as in the first round.
    per_round = [
        dataclasses.replace(settings, topic_prefix=f"{prefix}r{i}.") for i in range(rounds)
    ]
    for s in per_round:
        ensure_topics(bootstrap, s.topics, PARTICIPANTS, settings.partitions)
        _create_topic(bootstrap, f"{s.topic_prefix}bench.passthrough", settings.partitions)
    try:
        ledger = build_ledger(sagas, args.failing_share, samples + warmup, args.seed)
        for s in per_round:
            _produce_all(bootstrap, s.topics.events, ledger.records, settings.signer())
        ends = _end_offsets(bootstrap, per_round[0].topics.events, settings.partitions)
        # The ledger held here (tens of thousands of pydantic records) is the bench's,
        # not the coordinator's: keep it out of the full garbage collections that
        # would otherwise walk it during the timed phases (a coordinator process
        # holds its in-flight sagas as bytes, which the collector does not walk).
        gc.collect()
        gc.freeze()
        print(
            f"input: {sum(ends.values()):,} records of {ledger.sagas:,} sagas "
            f"({len(ledger.failing)} compensating, {len(ledger.open)} left in flight)"
        )

        passthroughs: list[Throughput] = []
        throughs: list[Throughput] = []
        for i, s in enumerate(per_round, 1):
            passthrough = run_passthrough(
                s, bootstrap, ends, args.batch_size, f"{s.topic_prefix}bench.passthrough", limit_s
            )
            passthroughs.append(passthrough)
            print(
                f"round {i}: pass-through: {passthrough.per_second:,.0f} events/s "
                f"({passthrough.records:,} in {passthrough.seconds:.2f} s, "
                f"{passthrough.batches} transactions)"
            )
            through, held = run_coordinator(s, bootstrap, ends, args.batch_size, ledger, limit_s)
            throughs.append(through)
            print(
                f"round {i}: coordinator: {through.per_second:,.0f} events/s "
                f"({through.records:,} in {through.seconds:.2f} s, {through.batches} "
                f"transactions; {len(held)} sagas in flight at the end; "
                f"{through.read - through.records} of its own records read back; "
                f"ratio {through.per_second / passthrough.per_second:.2f})"
            )
        passthrough = _median(passthroughs)
        through = _median(throughs)
        settings = per_round[-1]  # the latency phase takes over the last round's group

        with tempfile.TemporaryDirectory(prefix="sagaline-bench-") as tmp:
            latency = run_latency(
                settings, bootstrap, ledger, warmup, args.seed, Path(tmp) / "coordinator.log"
            )
        print(f"latency: {len(latency.samples_ms)} samples")
        memory = measure_memory(memory_sagas, held)
        restore_settings = dataclasses.replace(settings, topic_prefix=f"{prefix}restore.")
        ensure_topics(bootstrap, restore_settings.topics, PARTICIPANTS, settings.partitions)
        restore = measure_restore(restore_settings, bootstrap, restore_sagas)
        print(f"restore: {restore.sagas:,} sagas in {restore.seconds:.1f} s")
    finally:
        if not args.keep_topics:
            _delete_topics(bootstrap, prefix)

    of = f", median of {rounds}" if rounds > 1 else ""
    rows = [
        [
            f"events/s through the coordinator (EOS transactions{of})",
            f"{through.per_second:,.0f}",
        ],
        [f"events/s raw transactional pass-through{of}", f"{passthrough.per_second:,.0f}"],
        ["ratio coordinator / pass-through", f"{through.per_second / passthrough.per_second:.2f}"],
        ["StepFailed -> first CompensationRequested, p50", f"{latency.quantile(0.50):.1f} ms"],
        ["StepFailed -> first CompensationRequested, p99", f"{latency.quantile(0.99):.1f} ms"],
        [
            "memory per in-flight saga, Python heap (running)",
            f"{memory.heap_bytes['running']:,.0f} B",
        ],
        [
            "memory per in-flight saga, Python heap (compensating)",
            f"{memory.heap_bytes['compensating']:,.0f} B",
        ],
        [
            f"decoded-state cache, full ({DECODED_STATES} sagas; fixed, not per saga)",
            f"{memory.cache_bytes / 2**20:.1f} MiB",
        ],
        [
            "changelog record per in-flight saga (running)",
            f"{memory.changelog_bytes.get('running', 0):,.0f} B",
        ],
        [
            "changelog record per in-flight saga (compensating)",
            f"{memory.changelog_bytes.get('compensating', 0):,.0f} B",
        ],
        [
            f"restore of {restore.sagas:,} in-flight sagas from the changelog",
            f"{restore.seconds:.1f} s",
        ],
    ]
    table = markdown_table(["measure", "value"], rows)
    conditions = (
        f"{through.records:,} input events ({ledger.sagas:,} sagas of 2 steps, 6-8 records each, "
        f"{args.failing_share:.0%} compensating), {settings.partitions} partitions, "
        f"batch {args.batch_size}; latency over {len(latency.samples_ms)} samples "
        f"(after {warmup} warm-up, min {min(latency.samples_ms):.1f} ms, max "
        f"{max(latency.samples_ms):.1f} ms); heap over {memory.sagas:,} folded sagas"
    )
    print()
    print(table)
    print()
    print(conditions)

    if not (args.quick or args.no_docs):
        header = (
            f"`{command}` (or `.venv/bin/python -m bench.coordinator`; `--quick` for a short "
            "check). Method in the module docstring: a synthetic ledger on fresh topics of "
            "the real broker; the coordinator and a raw transactional pass-through "
            "(consume, copy the same bytes to the same partition, send offsets, commit; "
            "same batch size) consume it in the same run, alternated over rounds, each "
            "round on its own copy of the input (medians shown); then the real `sagaline "
            "coordinator run` process takes over and each `StepFailed` is timed to the "
            "first `CompensationRequested` seen by a read_committed consumer; heap per "
            "in-flight saga by tracemalloc over the folded states as the shell keeps them "
            "(their changelog bytes, next timer, partition and timer-heap entry), and "
            "of a full decoded-state cache apart; "
            "restore: a fresh coordinator reads a changelog of "
            "in-flight sagas to its end and schedules their timers.\n\n"
            f"Measured {started_at:%Y-%m-%d %H:%M} UTC on {machine_description()}; "
            f"{kafka}; {_versions()}.\n\n"
            f"{conditions}."
        )
        write_docs_section(
            "Coordinator", f"{header}\n\n{table}\n\n{_reading(through, passthrough, memory)}"
        )
        print("\nwrote the Coordinator section of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
