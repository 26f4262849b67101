"""End to end: sagas/s through real processes on the real broker, and the raw floor.

Run: ``python bench/e2e.py`` (a few minutes on 2 cores), ``--quick`` for a short
check. It runs the checkout it lives in, so to compare two commits copy this file,
``bench/_common.py`` and ``bench/_requests.py`` into the other checkout and run it
there (it uses only APIs both have; ``bench/pair.py`` refuses checkouts whose copies
differ).

The scenario (issue 9): three tools in three participant processes
(``sagaline participant run``), the coordinator as its own process
(``sagaline coordinator run``), the agent (a :class:`participants.client.SagaClient`)
in this process, all on a fresh uniquely prefixed set of topics of the project's
broker, producers with ``acks=all``. A saga is three steps, ``e2e_reserve``,
``e2e_charge``, ``e2e_ship``. In the ``reject`` variant step 3 raises a business
rejection, so steps 2 then 1 are compensated; in the ``complete`` variant every saga
completes. Each variant runs one at a time and with N sagas in flight
(``--levels 1:30,100:300,1000:2000``: in-flight:count).

Measured per level:

* sagas/s from the first saga started to the last terminal record seen, and the
  start-to-terminal latency per saga;
* CPU seconds per process over the level, from ``/proc/<pid>/stat`` (the broker
  included: it is shared, so on a busy machine its figure includes other users);
* context switches per process over the level (all its threads, from
  ``/proc/<pid>/task/*/status``): on a VM where a switch is dear they are much of
  the CPU above;
* per-hop latency percentiles from record timestamps (each record against the record
  that caused it; the agent's records against the record that woke it); every
  percentile here is nearest-rank (:func:`pct`);
* every saga's trace checked against the tools' own state (one SQLite file per
  tool): the receipt's status, each effect made once, compensated exactly once and
  in reverse order (reject) or retained (complete);
* the raw floor: the same records (taken from a real saga's trace) through the same
  hops between plain confluent-kafka processes that only copy bytes, with the same
  durability (acks=all, a transactional read-process-write copier in the
  coordinator's place, each record of a chain produced after the previous one was
  acknowledged), the same number of sagas and the same in-flight level; and
  Sagaline's ratio to it;
* with ``--broker-requests``, the local broker's requests per saga, per process and
  API, for Sagaline and the raw floor (:mod:`bench._requests`: its request log is on
  during those runs, which slows the broker, so read their requests, not their
  speed). The broker's CPU per saga follows its requests per saga.

A benchmark, not a test: nothing asserts on time. Topics are deleted at the end unless
``--keep-topics``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import contextlib

from confluent_kafka import Consumer, KafkaError, Producer

from bench._common import REPO_ROOT, machine_description, markdown_table, require_broker
from bench._requests import RequestLog, per_saga
from participants import BusinessRejection, CompensationContext, compensable, tool, wrap
from participants.catalogue import Catalogue
from participants.context import current_call

PARTICIPANTS = ("e2ea", "e2eb", "e2ec")
TOOLS = ("e2e_reserve", "e2e_charge", "e2e_ship")
VARIANTS = ("reject", "complete")


# ------------------------------------------------------------------------ the tools


class _ToolStore:
    """What a tool actually did, in its own SQLite file: the truth a trace is checked
    against. Effects are idempotent by the idempotency key, like a real provider."""

    def __init__(self, name: str) -> None:
        base = Path(os.environ.get("E2E_TOOL_DIR") or os.environ.get("SAGALINE_STATE_DIR", "."))
        base.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            str(base / f"tool-{name}.sqlite"), check_same_thread=False, isolation_level=None
        )
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, saga_id TEXT, "
                "done_ns INTEGER, calls INTEGER, compensations INTEGER DEFAULT 0, "
                "compensated_ns INTEGER)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS rejections (saga_id TEXT, key TEXT, at_ns INTEGER)"
            )

    def effect(self) -> dict[str, str]:
        call = current_call()
        with self._lock:
            self._db.execute(
                "INSERT INTO effects (key, saga_id, done_ns, calls) VALUES (?, ?, ?, 1) "
                "ON CONFLICT(key) DO UPDATE SET calls = calls + 1",
                (call.idempotency_key, call.saga_id, time.time_ns()),
            )
        return {"ref": call.idempotency_key[:16]}

    def reject(self) -> None:
        call = current_call()
        with self._lock:
            self._db.execute(
                "INSERT INTO rejections VALUES (?, ?, ?)",
                (call.saga_id, call.idempotency_key, time.time_ns()),
            )
        raise BusinessRejection("the bench's step 3 says no")

    def undo(self, ctx: CompensationContext) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE effects SET compensations = compensations + 1, compensated_ns = ? "
                "WHERE key = ?",
                (time.time_ns(), ctx.idempotency_key),
            )


class Reserve:
    def __init__(self) -> None:
        self.store = _ToolStore("e2e_reserve")

    @tool(description="Step 1 of the bench saga")
    @compensable(by="undo")
    def e2e_reserve(self, n: int) -> dict[str, str]:
        return self.store.effect()

    def undo(self, ctx: CompensationContext) -> None:
        self.store.undo(ctx)


class Charge:
    def __init__(self) -> None:
        self.store = _ToolStore("e2e_charge")

    @tool(description="Step 2 of the bench saga")
    @compensable(by="undo")
    def e2e_charge(self, n: int) -> dict[str, str]:
        return self.store.effect()

    def undo(self, ctx: CompensationContext) -> None:
        self.store.undo(ctx)


class Ship:
    def __init__(self) -> None:
        self.store = _ToolStore("e2e_ship")

    @tool(description="Step 3 of the bench saga; rejects when asked to")
    @compensable(by="undo")
    def e2e_ship(self, n: int, reject: bool = False) -> dict[str, str]:
        if reject:
            self.store.reject()
        return self.store.effect()

    def undo(self, ctx: CompensationContext) -> None:
        self.store.undo(ctx)


def reserve_catalogue() -> Catalogue:
    return wrap(Reserve(), name=PARTICIPANTS[0])


def charge_catalogue() -> Catalogue:
    return wrap(Charge(), name=PARTICIPANTS[1])


def ship_catalogue() -> Catalogue:
    return wrap(Ship(), name=PARTICIPANTS[2])


CATALOGUES = (
    "bench.e2e:reserve_catalogue",
    "bench.e2e:charge_catalogue",
    "bench.e2e:ship_catalogue",
)


# ------------------------------------------------------------------------ processes


def _compat(name: str) -> Any:
    """``ensure_topics`` / ``read_to_end`` from the transport package, or from where
    they lived before it (so the bench runs on older checkouts too)."""
    import importlib

    for module in ("sagaline.kafka", "schemas.topics", "schemas.wire"):
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(name)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Voluntary plus involuntary context switches of all of ``pid``'s threads so far.

    Where a switch is dear (a VM), waking and sleeping threads, not Python, is much
    of a saga's CPU: this says how much of it each process causes."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return -1
    for task in tasks:
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split(":", 1)[1])
    return total


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"{self.name} exited ({self.popen.returncode}); {self.log}:\n{tail}")


def spawn(name: str, argv: Sequence[str], env: dict[str, str], logs: Path) -> Proc:
    log = logs / f"{name}.log"
    out = log.open("ab")
    popen = subprocess.Popen(
        list(argv),
        env=env,
        cwd=str(REPO_ROOT),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Proc(name, popen, log)


def wait_assigned(admin: Any, procs: Sequence[Proc], groups: dict[str, tuple[str, str]]) -> None:
    from services.demo_processes import group_assigned

    deadline = time.monotonic() + 120
    waiting = dict(groups)
    while waiting:
        for p in procs:
            p.check_alive()
        for name, (group, topic) in list(waiting.items()):
            if group_assigned(admin, group, topic):
                waiting.pop(name)
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready after 120 s: {sorted(waiting)}")
        time.sleep(0.2)


# ------------------------------------------------------------------------ the agent


@dataclass
class SagaRun:
    saga_id: str
    started: float
    ended: float
    status: str
    error: str = ""


def _has_native_async() -> bool:
    import participants.client as client_module

    return hasattr(client_module, "AsyncSaga")


def run_sync_saga(client: Any, variant: str, n: int, timeout_s: float) -> SagaRun:
    from participants.client import BusinessRejected

    started = time.perf_counter()
    saga = client.saga(workflow="e2e", principal="agent:bench")
    try:
        with saga:
            saga.call(TOOLS[0], n=n)
            saga.call(TOOLS[1], n=n)
            saga.call(TOOLS[2], n=n, reject=variant == "reject")
    except BusinessRejected:
        pass
    except Exception as exc:  # noted in the trace check, the bench goes on
        return SagaRun(saga.saga_id, started, time.perf_counter(), "ERROR", repr(exc))
    try:
        receipt = saga.wait(timeout_s)
    except Exception as exc:
        return SagaRun(saga.saga_id, started, time.perf_counter(), "ERROR", repr(exc))
    return SagaRun(saga.saga_id, started, time.perf_counter(), str(receipt.status))


async def run_async_saga(client: Any, variant: str, n: int, timeout_s: float) -> SagaRun:
    from participants.client import BusinessRejected

    started = time.perf_counter()
    saga_id = ""
    try:
        async with client.saga(workflow="e2e", principal="agent:bench") as saga:
            saga_id = saga.saga_id
            await saga.call(TOOLS[0], n=n)
            await saga.call(TOOLS[1], n=n)
            await saga.call(TOOLS[2], n=n, reject=variant == "reject")
    except BusinessRejected:
        pass
    except Exception as exc:
        return SagaRun(saga_id, started, time.perf_counter(), "ERROR", repr(exc))
    try:
        receipt = await saga.wait(timeout_s)
    except Exception as exc:
        return SagaRun(saga_id, started, time.perf_counter(), "ERROR", repr(exc))
    return SagaRun(saga_id, started, time.perf_counter(), str(receipt.status))


def drive(client: Any, variant: str, count: int, in_flight: int, api: str) -> list[SagaRun]:
    """Run ``count`` sagas keeping ``in_flight`` of them going at once."""
    timeout_s = 300.0
    if api == "async":

        async def main() -> list[SagaRun]:
            gate = asyncio.Semaphore(in_flight)

            async def one(n: int) -> SagaRun:
                async with gate:
                    return await run_async_saga(client, variant, n, timeout_s)

            return list(await asyncio.gather(*(one(n) for n in range(count))))

        return asyncio.run(main())
    if in_flight == 1:
        return [run_sync_saga(client, variant, n, timeout_s) for n in range(count)]
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        return list(pool.map(lambda n: run_sync_saga(client, variant, n, timeout_s), range(count)))


# ------------------------------------------------------------------ trace checking


def check_traces(runs: Sequence[SagaRun], variant: str, tool_dir: Path) -> list[str]:
    """Every saga against the tools' own state; returns the problems found."""
    problems: list[str] = []
    effects: dict[str, dict[str, tuple[int, int, int, int | None]]] = {}
    made: dict[str, collections.Counter[str]] = {}  # per tool, effects (keys) per saga
    rejections: dict[str, int] = collections.Counter()
    for name in TOOLS:
        db = sqlite3.connect(str(tool_dir / f"tool-{name}.sqlite"))
        effects[name] = {}
        made[name] = collections.Counter()
        for row in db.execute(
            "SELECT saga_id, calls, compensations, done_ns, compensated_ns FROM effects"
        ):
            effects[name][row[0]] = (row[1], row[2], row[3], row[4])
            made[name][row[0]] += 1
        if name == TOOLS[2]:
            for (saga_id,) in db.execute("SELECT saga_id FROM rejections"):
                rejections[saga_id] += 1
        db.close()
    want = "COMPENSATED" if variant == "reject" else "COMPLETED"
    for run in runs:
        sid = run.saga_id
        if run.status != want and not run.status.endswith(want):
            problems.append(f"{sid}: ended {run.status} {run.error}, expected {want}")
            continue
        got = {t: effects[t].get(sid) for t in TOOLS}
        for t in TOOLS:
            if made[t][sid] > 1:  # one row per idempotency key: the step ran under two
                problems.append(f"{sid}: {t} made {made[t][sid]} effects")
        for t in TOOLS[:2] + ((TOOLS[2],) if variant == "complete" else ()):
            e = got[t]
            if e is None:
                problems.append(f"{sid}: {t} has no effect")
            elif e[0] != 1:
                problems.append(f"{sid}: {t} ran {e[0]} times")
        if variant == "reject":
            if got[TOOLS[2]] is not None:
                problems.append(f"{sid}: rejected step 3 left an effect")
            if rejections.get(sid, 0) != 1:
                problems.append(f"{sid}: step 3 rejected {rejections.get(sid, 0)} times")
            one, two = got[TOOLS[0]], got[TOOLS[1]]
            if one and two:
                if one[1] != 1 or two[1] != 1:
                    problems.append(f"{sid}: compensations {two[1]} (step 2), {one[1]} (step 1)")
                elif not (two[3] or 0) <= (one[3] or 0):
                    problems.append(f"{sid}: step 1 compensated before step 2")
        else:
            for t in TOOLS:
                e = got[t]
                if e is not None and e[1] != 0:
                    problems.append(f"{sid}: {t} compensated in a completed saga")
    return problems


# --------------------------------------------------------------- ledger and hops


@dataclass
class Traced:
    type: str
    event_id: str
    causation: str | None
    producer: str
    topic: str
    ts: int  # record timestamp, ms
    offset_key: tuple[int, int]


def read_traces(bootstrap: str, topics: Any, saga_ids: set[str]) -> dict[str, list[Traced]]:
    """Every record of the given sagas on the events, command and terminal topics."""
    from schemas.signing import Signer
    from schemas.wire import from_message

    read_to_end = _compat("read_to_end")

    out: dict[str, list[Traced]] = collections.defaultdict(list)
    names = [topics.events, topics.terminal] + [topics.commands(p) for p in PARTICIPANTS]
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for topic in names:
        meta = admin.list_topics(topic, timeout=30).topics[topic]
        group = f"e2e-trace-{uuid.uuid4().hex[:6]}"
        for msg in read_to_end(bootstrap, topic, sorted(meta.partitions), group):
            key = (msg.key() or b"").decode()
            if key not in saga_ids:
                continue
            try:
                record = from_message(msg.key(), msg.value(), msg.headers(), Signer(None))
            except Exception:
                continue
            env = record.envelope
            out[key].append(
                Traced(
                    record.TYPE,
                    env.event_id,
                    env.causation_id,
                    env.producer,
                    topic,
                    msg.timestamp()[1],
                    (msg.partition() or 0, msg.offset() or 0),
                )
            )
    for records in out.values():
        records.sort(key=lambda r: (r.ts, r.offset_key))
    return out


def hop_latencies(traces: dict[str, list[Traced]]) -> dict[str, list[int]]:
    """Per hop "cause -> effect (who)", the milliseconds between their timestamps."""
    hops: dict[str, list[int]] = collections.defaultdict(list)
    for records in traces.values():
        by_id = {r.event_id: r for r in records if not r.topic.endswith("terminal")}
        last_other: Traced | None = None
        for r in records:
            if r.topic.endswith("terminal"):
                continue
            cause = by_id.get(r.causation) if r.causation else None
            if cause is None and r.producer.startswith("agent") and last_other is not None:
                cause = last_other
            if cause is not None and cause is not r:
                who = "agent" if r.producer.startswith("agent") else r.producer
                hops[f"{cause.type} -> {r.type} ({who})"].append(r.ts - cause.ts)
            if not r.producer.startswith("agent") and r.topic.endswith("events"):
                last_other = r
    return hops


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the ceil(q * n)-th smallest value (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    # ceil, minus a hair so that q * n a float ulp above an integer keeps its rank
    rank = math.ceil(q * len(ordered) - 1e-9)
    return ordered[max(0, min(len(ordered), rank) - 1)]


# ------------------------------------------------------------------- the raw floor

# A script is the list of one saga's records, in order: (role, topic kind, trigger),
# where trigger is the index of the record whose arrival makes ``role`` produce it
# (-1: the agent starts the saga). Topic kinds: "events", "terminal",
# "commands.<participant>".


def causal_order(records: Sequence[Traced]) -> list[Traced]:
    """One saga's records in an order where each comes after what caused it.

    Timestamps cannot give it: they are per millisecond and set by different
    processes, so one at a time a participant's intent often carries the same
    millisecond as the command that caused it, and a tie broken the wrong way made a
    raw script whose copier waits for a record that comes only after it (the floor
    then stalled and printed nan). A saga's ``sagaline.events`` records share one
    partition, so their offsets are their true order; every other record (a command,
    the terminal copy) follows the events record that caused it."""
    events = sorted((r for r in records if r.topic.endswith("events")), key=lambda r: r.offset_key)
    ids = {r.event_id for r in events}
    after: dict[str, list[Traced]] = collections.defaultdict(list)
    unplaced: list[Traced] = []
    for r in records:
        if r.topic.endswith("events"):
            continue
        if r.causation in ids:
            after[r.causation or ""].append(r)
        else:
            unplaced.append(r)
    ordered: list[Traced] = []
    for r in events:
        ordered.append(r)
        ordered.extend(after.get(r.event_id, ()))
    return ordered + unplaced


def script_from_trace(
    records: Sequence[Traced], topics: Any
) -> tuple[list[tuple[str, str, int]], int]:
    """The raw script of one real saga, and the index the raw agent treats as done."""
    records = causal_order(records)
    script: list[tuple[str, str, int]] = []
    index_of: dict[str, int] = {}
    last_other = -1
    done = -1
    for r in records:
        role = "agent" if r.producer.startswith("agent") else r.producer
        if "coordinator" in role:
            role = "coordinator"
        kind = r.topic[len(topics.prefix) :].removeprefix("sagaline.")
        trigger = last_other if role == "agent" else index_of.get(r.causation or "", last_other)
        script.append((role, kind, trigger))
        if kind != "terminal":
            index_of.setdefault(r.event_id, len(script) - 1)
        if kind == "events":
            if role != "agent":
                last_other = len(script) - 1
            if r.type == "SagaTerminal":
                done = len(script) - 1
    return script, done


def raw_node(args: argparse.Namespace) -> int:
    """One plain confluent-kafka process of the floor: consumes its topic, copies the
    incoming bytes to whatever its script says it produces next, decodes nothing."""
    script = [tuple(x) for x in json.loads(Path(args.script).read_text())["script"]]
    done_index = json.loads(Path(args.script).read_text())["done"]
    role = args.role
    prefix = args.prefix
    topic = {
        "events": f"{prefix}sagaline.events",
        "terminal": f"{prefix}sagaline.terminal",
        "state": f"{prefix}sagaline.coordinator.state",
    }

    def topic_of(kind: str) -> str:
        return topic.get(kind) or f"{prefix}sagaline.{kind}"

    # emit_on[i]: what this role produces when record i arrives (its own chains too)
    emit_on: dict[int, list[int]] = collections.defaultdict(list)
    for i, (r, _kind, trig) in enumerate(script):
        if r != role:
            continue
        t = trig
        while t >= 0 and script[t][0] == role:  # caused by our own record: same chain
            t = script[t][2]
        emit_on[t].append(i)
    base = {
        "bootstrap.servers": args.bootstrap,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 2,
        "partitioner": "murmur2_random",
        "compression.type": "lz4",
    }
    cconf = {
        "bootstrap.servers": args.bootstrap,
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
        "group.id": f"{prefix}raw-{role}",
    }
    in_topic = topic["events"] if role in ("agent", "coordinator") else topic_of(f"commands.{role}")
    running = True

    def _stop(*_: Any) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, _stop)
    consumer = Consumer(cconf)
    if role == "coordinator":
        producer = Producer(
            {**base, "transactional.id": f"{prefix}raw-coord", "retry.backoff.ms": 5}
        )
        producer.init_transactions(30)
        consumer.subscribe([in_topic])
        while running:
            first = consumer.poll(0.5)
            if first is None:
                continue
            batch = [first, *consumer.consume(499, 0)]
            producer.begin_transaction()
            touched: set[bytes] = set()
            for msg in batch:
                if msg.error() is not None:
                    continue
                i = int(dict(msg.headers() or [])["i"])
                for j in emit_on.get(i, ()):
                    producer.produce(
                        topic_of(script[j][1]),
                        key=msg.key(),
                        value=msg.value(),
                        headers=[("i", str(j).encode())],
                    )
                    touched.add(msg.key())
            for key in touched:
                producer.produce(topic["state"], key=key, value=b"x" * 200)
            producer.send_offsets_to_transaction(
                consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30
            )
            producer.commit_transaction(30)
        consumer.close()
        return 0

    producer = Producer(base)

    def emit_chain(
        key: bytes, value: bytes, chain: list[int], then: Callable[[], None] | None
    ) -> None:
        """Produce chain[0], and the rest each after the previous one was acked."""
        if not chain:
            if then is not None:
                then()
            return
        j = chain[0]

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                raise SystemExit(f"raw {role}: delivery failed: {err}")
            emit_chain(key, value, chain[1:], then)

        producer.produce(
            topic_of(script[j][1]),
            key=key,
            value=value,
            headers=[("i", str(j).encode())],
            on_delivery=delivered,
        )

    if role != "agent":
        consumer.subscribe([in_topic])
        pending_commit = False
        while running:
            producer.poll(0)
            first = consumer.poll(0.001 if len(producer) else 0.05)
            batch = [first, *consumer.consume(499, 0)] if first is not None else []
            for msg in batch:
                if msg.error() is not None:
                    continue
                i = int(dict(msg.headers() or [])["i"])
                chain = emit_on.get(i)
                if chain:
                    emit_chain(msg.key(), msg.value(), list(chain), None)
                pending_commit = True
            producer.poll(0)
            if pending_commit and batch:
                consumer.commit(asynchronous=True)
                pending_commit = False
        producer.flush(10)
        consumer.close()
        return 0

    # the raw agent drives the run: count sagas, in_flight at once
    from confluent_kafka import TopicPartition as TP

    meta = consumer.list_topics(in_topic, timeout=30).topics[in_topic]
    positions = []
    for n in meta.partitions:
        _low, high = consumer.get_watermark_offsets(TP(in_topic, n), timeout=30)
        positions.append(TP(in_topic, n, high))
    consumer.assign(positions)
    value = b"v" * args.value_size
    started = 0
    finished = 0
    t0 = time.perf_counter()
    cpu0 = os.times().user + os.times().system

    def start_one() -> None:
        nonlocal started
        key = f"raw-{uuid.uuid4().hex[:12]}".encode()
        started += 1
        emit_chain(key, value, list(emit_on.get(-1, ())), None)

    for _ in range(min(args.in_flight, args.sagas)):
        start_one()
    progress = time.monotonic()
    while finished < args.sagas:
        if time.monotonic() - progress > 60:
            print(
                json.dumps({"elapsed": float("nan"), "sagas": finished, "stuck": True}), flush=True
            )
            return 1
        producer.poll(0)
        first = consumer.poll(0.001 if len(producer) else 0.05)
        batch = [first, *consumer.consume(499, 0)] if first is not None else []
        for msg in batch:
            if msg.error() is not None:
                continue
            i = int(dict(msg.headers() or [])["i"])
            chain = emit_on.get(i)
            if chain:
                emit_chain(msg.key(), msg.value(), list(chain), None)
            if i == done_index:
                finished += 1
                progress = time.monotonic()
                if started < args.sagas:
                    start_one()
    elapsed = time.perf_counter() - t0
    cpu = os.times()
    producer.flush(10)
    consumer.close()
    print(
        json.dumps({"elapsed": elapsed, "sagas": finished, "cpu": cpu.user + cpu.system - cpu0}),
        flush=True,
    )
    return 0


# ------------------------------------------------------------------------- the run


@dataclass
class LevelResult:
    variant: str
    in_flight: int
    count: int
    elapsed: float
    runs: list[SagaRun]
    cpu: dict[str, float]
    problems: list[str]
    raw_elapsed: float = float("nan")
    raw_cpu: dict[str, float] = field(default_factory=dict)
    hops: dict[str, list[int]] = field(default_factory=dict)
    switches: dict[str, int] = field(default_factory=dict)  # per process, over the level
    # --broker-requests: per process, the broker's requests by API (bench/_requests.py)
    requests: dict[str, collections.Counter[str]] = field(default_factory=dict)
    raw_requests: dict[str, collections.Counter[str]] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.elapsed

    @property
    def raw_rate(self) -> float:
        return self.count / self.raw_elapsed


@contextlib.contextmanager
def _request_log(
    args: argparse.Namespace, broker_pid: int | None, bootstrap: str
) -> Iterator[RequestLog | None]:
    """The local broker's request log, on for the block when ``--broker-requests``
    asks (None otherwise); off after it however it ends (``stop`` inside the block
    counts and switches it off), so the broker does not go on logging every request."""
    if not args.broker_requests or not broker_pid:
        yield None
        return
    log = RequestLog(broker_pid, Path(args.broker_state_dir), bootstrap)
    log.start()
    try:
        yield log
    finally:
        log.off()


def _clients(who: dict[str, int]) -> dict[str, int]:
    return {role: pid for role, pid in who.items() if role != "broker"}


def parse_levels(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        if part.strip():
            flight, _, count = part.partition(":")
            out.append((int(flight), int(count or max(20, 3 * int(flight)))))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reject variant, 1:10,100:200")
    parser.add_argument(
        "--levels", default="1:30,100:300,1000:2000", help="in-flight:count pairs, comma-separated"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--api",
        choices=("auto", "sync", "async"),
        default="auto",
        help="agent API (auto: native async when the client has it)",
    )
    parser.add_argument("--no-raw", action="store_true", help="skip the raw floor")
    parser.add_argument("--keep-topics", action="store_true")
    parser.add_argument("--keep-work", action="store_true", help="keep logs and tool state")
    parser.add_argument(
        "--broker-state-dir",
        help="state dir of the local broker in use, to read its CPU (default: the shared one)",
    )
    parser.add_argument("--label", default="", help="a name for this checkout in the output")
    parser.add_argument(
        "--broker-requests",
        action="store_true",
        help="count the local broker's requests per saga, process and API (its request "
        "log is on during each run, which slows the broker: read requests, not speed)",
    )
    parser.add_argument("--json-out", help="write the results as JSON here")
    sub = parser.add_subparsers(dest="cmd")
    raw = sub.add_parser("_raw-node")
    raw.add_argument("--role", required=True)
    raw.add_argument("--script", required=True)
    raw.add_argument("--bootstrap", required=True)
    raw.add_argument("--prefix", required=True)
    raw.add_argument("--sagas", type=int, default=0)
    raw.add_argument("--in-flight", type=int, default=1)
    raw.add_argument("--value-size", type=int, default=300)
    args = parser.parse_args(argv)
    if args.cmd == "_raw-node":
        return raw_node(args)
    if args.quick:
        args.variants = "reject"
        args.levels = "1:10,100:200"
    return run_bench(args)


def run_bench(args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from participants.client import SagaClient
    from schemas.settings import Settings
    from services import kafka_local
    from services.broker import resolve_bootstrap

    bootstrap = resolve_bootstrap()
    require_broker(bootstrap)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    label = args.label or commit
    api = args.api
    if api == "auto":
        api = "async" if _has_native_async() else "sync"
    levels = parse_levels(args.levels)
    variants = [v for v in args.variants.split(",") if v]
    prefix = f"e2e{uuid.uuid4().hex[:6]}."
    work = Path(tempfile.mkdtemp(prefix="sagaline-e2e-"))
    logs = work / "logs"
    logs.mkdir()
    print(f"machine: {machine_description()}")
    print(f"checkout: {REPO_ROOT} at {commit}; agent API: {api}; broker {bootstrap}")
    print(f"topics: {prefix}*; logs and tool state: {work}")
    status = kafka_local.status(args.broker_state_dir, timeout=2.0)
    broker_pid = status.pid if status.running and status.bootstrap == bootstrap else None
    if args.broker_requests and not broker_pid:
        raise SystemExit("--broker-requests needs the local broker (--broker-state-dir)")
    env = dict(os.environ)
    env.update(
        {
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "SAGALINE_TOPIC_PREFIX": prefix,
            "PYTHONUNBUFFERED": "1",
        }
    )
    settings = Settings.from_env(env)
    topics = settings.topics
    _compat("ensure_topics")(bootstrap, topics, list(PARTICIPANTS), settings.partitions)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    results: list[LevelResult] = []
    procs: list[Proc] = []
    client: Any = None
    try:
        for variant in variants:
            venv = dict(env, SAGALINE_STATE_DIR=str(work / variant))
            cli = [sys.executable, "-m", "services.cli"]
            coord = spawn(
                f"{variant}-coordinator",
                [
                    *cli,
                    "coordinator",
                    "run",
                    "--instance-id",
                    f"e2e-{variant}",
                    "--participants",
                    ",".join(PARTICIPANTS),
                ],
                venv,
                logs,
            )
            procs.append(coord)
            parts = [
                spawn(
                    f"{variant}-{p}", [*cli, "participant", "run", p, "--catalogue", c], venv, logs
                )
                for p, c in zip(PARTICIPANTS, CATALOGUES, strict=True)
            ]
            procs.extend(parts)
            groups = {"coordinator": (f"{prefix}sagaline-coordinator", topics.events)}
            for p in PARTICIPANTS:
                groups[p] = (f"{prefix}sagaline-participant-{p}", topics.commands(p))
            wait_assigned(admin, [coord, *parts], groups)
            client = SagaClient(settings, bootstrap, producer_name="agent").start()
            client.refresh_catalogue()
            drive(client, variant, 3, 1, api)  # warm-up: connections, metadata, caches
            who = {
                "coordinator": coord.pid,
                **{p.name.split("-", 1)[1]: p.pid for p in parts},
                "agent": os.getpid(),
            }
            if broker_pid:
                who["broker"] = broker_pid
            for in_flight, count in levels:
                before = {k: cpu_seconds(pid) for k, pid in who.items()}
                switched = {k: context_switches(pid) for k, pid in who.items()}
                with _request_log(args, broker_pid, bootstrap) as request_log:
                    t0 = time.perf_counter()
                    runs = drive(client, variant, count, in_flight, api)
                    elapsed = time.perf_counter() - t0
                    cpu = {k: cpu_seconds(pid) - before[k] for k, pid in who.items()}
                    switches = {k: context_switches(pid) - switched[k] for k, pid in who.items()}
                    requests = {} if request_log is None else request_log.stop(_clients(who))
                problems = check_traces(runs, variant, work / variant)
                res = LevelResult(variant, in_flight, count, elapsed, runs, cpu, problems)
                res.switches = switches
                res.requests = requests
                results.append(res)
                lat = [r.ended - r.started for r in runs]
                print(
                    f"\n[{variant} x{in_flight}] {count} sagas in {elapsed:.1f} s: "
                    f"{res.rate:.1f} sagas/s; saga latency p50 {pct(lat, 0.5) * 1000:.0f} ms, "
                    f"p99 {pct(lat, 0.99) * 1000:.0f} ms; traces: "
                    f"{'all correct' if not problems else f'{len(problems)} WRONG'}",
                    flush=True,
                )
                for p in problems[:10]:
                    print(f"   ! {p}")
                print(
                    "   CPU ms/saga: "
                    + ", ".join(f"{k} {v * 1000 / count:.1f}" for k, v in cpu.items()),
                    flush=True,
                )
                print(
                    "   context switches/saga: "
                    + ", ".join(f"{k} {v / count:.0f}" for k, v in switches.items()),
                    flush=True,
                )
                if requests:
                    print(per_saga(requests, count))
            client.close()
            client = None
            for p in [*parts, coord]:
                p.stop()
                procs.remove(p)
        # per-hop latencies and the raw scripts, from the ledger after the runs
        for variant in variants:
            mine = [r for r in results if r.variant == variant]
            ids = {run.saga_id for r in mine for run in r.runs}
            traces = read_traces(bootstrap, topics, ids)
            for r in mine:
                r.hops = hop_latencies({s.saga_id: traces.get(s.saga_id, []) for s in r.runs})
            example = next(
                (
                    traces[s.saga_id]
                    for r in mine
                    for s in r.runs
                    if s.saga_id in traces and not r.problems
                ),
                None,
            )
            if example is None or args.no_raw:
                continue
            script, done = script_from_trace(example, topics)
            print(
                f"\n[{variant}] records per saga: {len(script)} "
                f"({collections.Counter(k for _r, k, _t in script)})"
            )
            script_path = work / f"script-{variant}.json"
            script_path.write_text(json.dumps({"script": script, "done": done}))
            run_raw(args, bootstrap, variant, mine, script_path, work, logs, admin, broker_pid)
    finally:
        if client is not None:
            client.close()
        for p in procs:
            p.stop()
        if not args.keep_topics:
            delete_topics(admin, prefix)
    report(results, label, api)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                [
                    {
                        "variant": r.variant,
                        "in_flight": r.in_flight,
                        "count": r.count,
                        "sagas_per_s": r.rate,
                        "raw_sagas_per_s": r.raw_rate,
                        "cpu": r.cpu,
                        "raw_cpu": r.raw_cpu,
                        "problems": len(r.problems),
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    if not args.keep_work and not any(r.problems for r in results):
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r.problems for r in results) else 0


def run_raw(
    args: argparse.Namespace,
    bootstrap: str,
    variant: str,
    mine: list[LevelResult],
    script_path: Path,
    work: Path,
    logs: Path,
    admin: Any,
    broker_pid: int | None,
) -> None:
    """The floor for each level of ``variant``: plain copier processes, same hops."""
    from schemas.topics import TopicNames

    ensure_topics = _compat("ensure_topics")

    prefix = f"e2eraw{uuid.uuid4().hex[:6]}."
    topics = TopicNames(prefix)
    ensure_topics(bootstrap, topics, list(PARTICIPANTS), 6)
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_raw-node",
        "--script",
        str(script_path),
        "--bootstrap",
        bootstrap,
        "--prefix",
        prefix,
    ]
    nodes = [
        spawn(f"raw-{variant}-{role}", [*me, "--role", role], dict(os.environ), logs)
        for role in ("coordinator", *PARTICIPANTS)
    ]
    try:
        groups = {"coordinator": (f"{prefix}raw-coordinator", topics.events)}
        for p in PARTICIPANTS:
            groups[p] = (f"{prefix}raw-{p}", topics.commands(p))
        wait_assigned(admin, nodes, groups)
        for res in mine:
            who = {
                "coordinator": nodes[0].pid,
                **{PARTICIPANTS[i]: nodes[i + 1].pid for i in range(3)},
            }
            if broker_pid:
                who["broker"] = broker_pid
            before = {k: cpu_seconds(pid) for k, pid in who.items()}
            with _request_log(args, broker_pid, bootstrap) as request_log:
                agent = subprocess.Popen(
                    [
                        *me,
                        "--role",
                        "agent",
                        "--sagas",
                        str(res.count),
                        "--in-flight",
                        str(res.in_flight),
                    ],
                    cwd=str(REPO_ROOT),
                    stdout=subprocess.PIPE,
                    text=True,
                )
                out, _ = agent.communicate()
                cpu = {k: cpu_seconds(pid) - before[k] for k, pid in who.items()}
                if request_log is not None:
                    # the raw agent has exited: its requests are the ones no process claims
                    res.raw_requests = request_log.stop(_clients(who))
                    res.raw_requests["agent"] = res.raw_requests.pop("other", collections.Counter())
            outcome = json.loads(out.strip().splitlines()[-1])
            if outcome.get("stuck"):
                # Say so (nan alone reads like a result); keep the nodes' logs.
                args.keep_work = True
                print(
                    f"[raw {variant} x{res.in_flight}] the floor stalled: "
                    f"{outcome['sagas']} of {res.count} sagas, then no progress for 60 s; "
                    f"its processes' logs are kept in {logs}",
                    flush=True,
                )
            cpu["agent"] = outcome.get("cpu", float("nan"))
            res.raw_cpu = cpu
            res.raw_elapsed = outcome["elapsed"]
            print(
                f"[raw {variant} x{res.in_flight}] {res.count} sagas in {res.raw_elapsed:.2f} s: "
                f"{res.raw_rate:.1f} sagas/s; Sagaline/raw = {res.rate / res.raw_rate:.3f}",
                flush=True,
            )
            if res.raw_requests:
                print(per_saga(res.raw_requests, res.count))
    finally:
        for n in nodes:
            n.stop()
        delete_topics(admin, prefix)


def delete_topics(admin: Any, prefix: str) -> None:
    try:
        names = [t for t in admin.list_topics(timeout=30).topics if t.startswith(prefix)]
        if names:
            for f in admin.delete_topics(names, operation_timeout=30).values():
                with contextlib.suppress(Exception):
                    f.result()
    except Exception as exc:
        print(f"(could not delete topics {prefix}*: {exc})")


def report(results: Sequence[LevelResult], label: str, api: str) -> None:
    if not results:
        return
    print(f"\n== e2e results ({label}, agent API {api}) on {machine_description()}")
    rows = []
    for r in results:
        cpu_total = sum(v for v in r.cpu.values() if v == v)
        rows.append(
            [
                f"{r.variant}, {r.in_flight} in flight",
                str(r.count),
                f"{r.rate:.1f}",
                f"{pct([x.ended - x.started for x in r.runs], 0.5) * 1000:.0f}",
                f"{pct([x.ended - x.started for x in r.runs], 0.99) * 1000:.0f}",
                f"{cpu_total * 1000 / r.count:.1f}",
                f"{r.raw_rate:.1f}",
                f"{r.rate / r.raw_rate:.3f}" if r.raw_elapsed == r.raw_elapsed else "-",
                "yes" if not r.problems else f"NO ({len(r.problems)})",
            ]
        )
    print(
        markdown_table(
            [
                "scenario",
                "sagas",
                "sagas/s",
                "p50 ms",
                "p99 ms",
                "CPU ms/saga",
                "raw floor sagas/s",
                "ratio to raw",
                "traces correct",
            ],
            rows,
        )
    )
    print("\nCPU ms per saga, per process (Sagaline | raw floor):")
    for r in results:
        parts = [f"{k} {v * 1000 / r.count:.1f}" for k, v in r.cpu.items()]
        raw = [f"{k} {v * 1000 / r.count:.1f}" for k, v in r.raw_cpu.items()]
        print(f"  {r.variant} x{r.in_flight}: {', '.join(parts)} | {', '.join(raw) or '-'}")
    print("\ncontext switches per saga, per process (Sagaline):")
    for r in results:
        parts = [f"{k} {v / r.count:.0f}" for k, v in r.switches.items()]
        total = sum(v for v in r.switches.values() if v >= 0) / r.count
        print(f"  {r.variant} x{r.in_flight}: {', '.join(parts)}; all {total:.0f}")
    print("\nper-hop latency from record timestamps, ms (p50 / p90 / p99, n):")
    for r in results:
        print(f"  {r.variant} x{r.in_flight}:")
        for hop, values in sorted(r.hops.items(), key=lambda kv: -pct(kv[1], 0.5)):
            print(
                f"    {hop:<58} {pct(values, 0.5):6.0f} {pct(values, 0.9):6.0f} "
                f"{pct(values, 0.99):6.0f}  n={len(values)}"
            )


if __name__ == "__main__":
    sys.exit(main())
