"""No saga can stop another (issue 11 items 1 and 2), on the real broker.

* Limits are checked where data enters: the client refuses NaN, a blank saga id and an
  oversize argument before anything is written; a tool result over the limit becomes
  a truthful commit marker plus an incident.
* Coordinator state does not grow with payload size: large arguments and results are
  kept as ledger references, and compensations still get exactly what was passed.
* A poisoned saga (a decision that throws, a state too big to write, a record the
  broker refuses) is parked with one incident while the other sagas keep flowing.
* Terminal sagas stay terminal: the whole history re-delivered to a restarted
  coordinator produces no second SagaTerminal and no command.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

import coordinator.shell as shell
from coordinator.shell import Coordinator
from coordinator.state import MarkerKind
from participants import (
    BusinessRejection,
    CompensationContext,
    Reversibility,
    compensable,
    tool,
    wrap,
)
from participants.client import (
    BusinessRejected,
    CallRefused,
    InvalidSagaId,
    ResultTooLarge,
    SagaParked,
)
from sagaline.kafka import LedgerReader
from schemas import (
    Disposition,
    IncidentRaised,
    SagaTerminal,
    StepCommitted,
    StepScheduled,
    TerminalStatus,
)
from schemas.limits import RESULT_OMITTED, RESULT_TOO_LARGE, Limits
from schemas.partitioning import partition_for
from schemas.wire import read_dead_letter
from tests.system import System, wait_until

pytestmark = pytest.mark.kafka

KIB = 1024


class Store:
    """A provider that keeps blobs and hands out big reports; records what its
    compensations were given, so the test can check they got the exact payloads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blobs: dict[str, str] = {}
        self.undone_inputs: list[dict[str, Any]] = []
        self.undone_results: list[Any] = []
        self.reports: int = 0

    @tool(description="Keep a blob")
    @compensable(by="drop_blob", reversibility=Reversibility.REVERSIBLE)
    def keep_blob(self, name: str, blob: str) -> dict[str, str]:
        with self.lock:
            self.blobs[name] = blob
        return {"name": name, "echo": blob[:2000]}  # a result over the inline size too

    def drop_blob(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.blobs.pop(ctx.input["name"], None)
            self.undone_inputs.append(dict(ctx.input))
            self.undone_results.append(ctx.result)

    @tool(description="Build a large report")
    @compensable(by="discard_report", reversibility=Reversibility.REVERSIBLE)
    def build_report(self, size: int) -> str:
        with self.lock:
            self.reports += 1
        return "r" * size

    def discard_report(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.reports -= 1
            self.undone_results.append(ctx.result)

    @tool(description="A small note")
    @compensable(by="erase_note", reversibility=Reversibility.REVERSIBLE)
    def note(self, text: str) -> dict[str, str]:
        return {"text": text[:10]}

    def erase_note(self, ctx: CompensationContext) -> None:
        return None

    @tool(description="Always refuses")
    @compensable(by="nothing")
    def refuse(self) -> None:
        raise BusinessRejection("refused on purpose")

    def nothing(self) -> None:
        return None


class Sink:
    """A participant whose command topic accepts only tiny records
    (max.message.bytes=512, enough for transaction markers): a command to it with
    1 KB of arguments is refused by the broker inside the coordinator's transaction,
    a failure no size check foresees."""

    @tool(description="Never reached")
    @compensable(by="undo")
    def swallow(self, text: str) -> str:
        return text

    def undo(self) -> None:
        return None


def _ids_on_one_partition(count: int, partitions: int, tag: str) -> list[str]:
    """Saga ids that all land on the same partition (murmur2, as the producers)."""
    out: list[str] = []
    while len(out) < count:
        candidate = f"{tag}-{uuid.uuid4().hex[:10]}"
        if partition_for(candidate, partitions) == 0:
            out.append(candidate)
    return out


@pytest.fixture
def store_system(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> Iterator[tuple[System, Store]]:
    store = Store()
    with System(kafka_bootstrap, unique_prefix, tmp_path, [wrap(store, name="store")]) as system:
        yield system, store


# --------------------------------------------------------------- (d) refusals


def test_nan_blank_saga_id_and_5mb_argument_are_refused_before_anything_is_written(
    store_system: tuple[System, Store],
) -> None:
    system, store = store_system
    client = system.client

    with pytest.raises(InvalidSagaId, match="empty"):
        client.saga("w", "agent", saga_id="")
    with pytest.raises(InvalidSagaId):
        client.saga("w", "agent", saga_id="   ")

    with pytest.raises(CallRefused) as nan, client.saga("w", "agent") as saga_nan:
        saga_nan.call("note", text="x", step_id="nan", extra={"ratio": [1.0, float("nan")]})
    assert nan.value.limit == "finite-numbers"
    assert "args.extra.ratio[1]" in str(nan.value)

    big = "x" * (5 * 1024 * KIB)
    with pytest.raises(CallRefused) as too_big, client.saga("w", "agent") as saga_big:
        saga_big.call("keep_blob", name="huge", blob=big, step_id="big")
    assert too_big.value.limit == "max_args_bytes"
    assert too_big.value.size > 5 * 1024 * KIB
    assert "SAGALINE_MAX_ARGS_BYTES" in str(too_big.value)

    # Both sagas end (aborted, nothing to undo) and no step was ever scheduled.
    for saga in (saga_nan, saga_big):
        assert saga.wait(60).status is TerminalStatus.COMPENSATED
        records = system.records(saga.saga_id)
        assert not [r for r in records if isinstance(r, StepScheduled)]
    assert store.blobs == {}


# ------------------------------------------- (a) large payloads, neighbour flows


def test_large_arguments_and_a_2mb_result_get_truthful_outcomes_while_a_neighbour_completes(
    store_system: tuple[System, Store],
) -> None:
    system, store = store_system
    big_id, report_id, neighbour_id = _ids_on_one_partition(3, 2, "iso")
    blobs = {f"b{i}": (f"{i}" * 200 * KIB) for i in range(3)}  # 600 KB of arguments
    outcome: dict[str, Any] = {}

    def neighbour() -> None:
        with system.client.saga("w", "agent", saga_id=neighbour_id) as saga:
            for n in range(3):
                saga.call("note", text=f"n{n}")
        outcome["neighbour"] = saga.wait(120).status

    thread = threading.Thread(target=neighbour)
    thread.start()

    # 1. Large arguments: carried as ledger references, compensated with exactly them.
    sizes: list[int] = []
    with pytest.raises(BusinessRejected), system.client.saga("w", "agent", saga_id=big_id) as s1:
        for name, blob in blobs.items():
            assert s1.call("keep_blob", name=name, blob=blob)["name"] == name
            state = system.coordinator.state_of(big_id) if system.coordinator else None
            if state is not None:
                sizes.append(len(state.to_bytes()))
        s1.call("refuse")
    receipt = s1.wait(120)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert sorted(i["name"] for i in store.undone_inputs) == sorted(blobs)
    assert {i["name"]: i["blob"] for i in store.undone_inputs} == blobs  # exact input
    assert all(r["name"] in blobs for r in store.undone_results)  # exact (referenced) result
    assert store.blobs == {}
    # State never grew with the 600 KB of arguments (and 6 KB of results).
    assert sizes and max(sizes) < 40 * KIB, sizes

    # 2. A 2 MB result: the effect exists, the ledger says so truthfully.
    with (
        pytest.raises(ResultTooLarge) as err,
        system.client.saga("w", "agent", saga_id=report_id) as s2,
    ):
        s2.call("build_report", size=2_000_000)
    assert "2000002 bytes" in str(err.value) and "SAGALINE_MAX_RESULT_BYTES" in str(err.value)
    receipt2 = s2.wait(120)
    # Compensated (the agent aborted), but a person is told the result was not kept.
    assert receipt2.status is TerminalStatus.ESCALATED
    assert receipt2.steps[0].disposition is Disposition.COMPENSATED
    assert store.reports == 0
    marker = store.undone_results[-1]
    assert marker[RESULT_OMITTED]["bytes"] == 2_000_002  # ctx.result is the marker
    records = system.records(report_id)
    commit = next(r for r in records if isinstance(r, StepCommitted))
    assert orjson.loads(commit.result)[RESULT_OMITTED]["limit"] == Limits().max_result_bytes
    incidents = [r for r in records if isinstance(r, IncidentRaised)]
    assert [i.kind for i in incidents] == [RESULT_TOO_LARGE]
    assert incidents[0].step_id == "01-build_report" and incidents[0].owner

    thread.join(120)
    assert outcome["neighbour"] is TerminalStatus.COMPLETED
    # Nothing went to the DLQ as a handler error, nothing was parked.
    assert not [h for _k, h in system.dlq()]


# ----------------------------------------------------- (c) poisoned sagas parked


def test_poisoned_sagas_are_parked_with_an_incident_while_the_others_keep_flowing(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store()
    # One partition: every saga shares it, so a wedge would stop them all.
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    sink_topic = f"{unique_prefix}sagaline.commands.sink"
    admin.create_topics([NewTopic(sink_topic, 1, 1, config={"max.message.bytes": "512"})])[
        sink_topic
    ].result(30)
    limits = Limits(max_record_bytes=16 * KIB)
    catalogues = [wrap(store, name="store"), wrap(Sink(), name="sink")]
    throws = f"throws-{uuid.uuid4().hex[:6]}"
    real_decide = shell.decide

    def decide(state: Any, record: Any, now: int, *args: Any, **kw: Any) -> Any:
        if record.saga_id == throws and isinstance(record, StepScheduled):
            raise RuntimeError("a bug that only this saga's records hit")
        return real_decide(state, record, now, *args, **kw)

    monkeypatch.setattr(shell, "decide", decide)

    with System(
        kafka_bootstrap, unique_prefix, tmp_path, catalogues, partitions=1, limits=limits
    ) as system:
        client = system.client
        done: list[TerminalStatus] = []
        errors: list[BaseException] = []

        def healthy(n: int) -> None:
            try:
                with client.saga("w", "agent") as saga:
                    saga.call("note", text=f"a{n}")
                    saga.call("note", text=f"b{n}")
                done.append(saga.wait(300).status)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        def run_healthy(count: int) -> list[threading.Thread]:
            threads = [threading.Thread(target=healthy, args=(n,)) for n in range(count)]
            for t in threads:
                t.start()
            return threads

        flowing = run_healthy(4)

        # 1. A decision that throws.
        with (
            pytest.raises(SagaParked, match="RuntimeError"),
            client.saga("w", "agent", saga_id=throws) as s1,
        ):
            s1.call("note", text="boom")

        # 2. A state that cannot be written (grows past 16 KiB with inline args).
        with pytest.raises(SagaParked, match="state is"), client.saga("w", "agent") as s2:
            for n in range(40):
                s2.call("note", text=f"{n}" + "y" * 1000)

        # 3. A record the broker refuses (the sink's topic takes no record): the batch
        #    fails, is retried, and after repeated failures is committed saga by saga.
        with (
            pytest.raises(SagaParked, match="could not be written"),
            client.saga("w", "agent") as s3,
        ):
            # Each failed attempt waits for the broker's refusal or a timeout.
            s3.call("swallow", text=os.urandom(450).hex(), timeout_s=300)

        flowing += run_healthy(4)
        for t in flowing:
            t.join(300)
        assert not errors, errors
        assert done == [TerminalStatus.COMPLETED] * 8

        parked = {s1.saga_id, s2.saga_id, s3.saga_id}
        coordinator = system.coordinator
        assert coordinator is not None
        for saga_id in parked:
            marker = wait_until(lambda s=saga_id: coordinator.marker_of(s), 30, "parked marker")
            assert marker.marker is MarkerKind.PARKED

        # One incident per parked saga, on the incidents topic and the ledger.
        incidents: list[IncidentRaised] = []
        for saga_id in parked:
            incidents += [
                r
                for r in system.records(saga_id)
                if isinstance(r, IncidentRaised) and r.kind == "saga-parked"
            ]
        assert sorted(i.saga_id for i in incidents) == sorted(parked)
        # Records that arrived for them after parking (the agent's SagaEndRequested)
        # are in the DLQ with the reason, not lost.
        dead = wait_until(
            lambda: (
                {
                    k.decode()
                    for k, _v, h in LedgerReader(kafka_bootstrap).records(system.topics.dlq)
                    if k and read_dead_letter(h).reason == "saga-parked"
                }
                >= parked
            ),
            60,
            "saga-parked DLQ records",
        )
        assert dead
        # None of them ended, none got a SagaTerminal: a person decides.
        for saga_id in parked:
            assert not [r for r in system.records(saga_id) if isinstance(r, SagaTerminal)]

        # Parked is durable: a restarted coordinator restores the markers.
        coordinator.stop()
        system._threads[0].join(60)
        system.start_coordinator(coordinator.instance_id)
        restarted = system.coordinator
        assert restarted is not None and restarted is not coordinator
        for saga_id in parked:
            marker = wait_until(lambda s=saga_id: restarted.marker_of(s), 60, "restored marker")
            assert marker.marker is MarkerKind.PARKED


# ------------------------------------------- (b) re-delivered history changes nothing


def _end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    ends = LedgerReader(bootstrap).end_offsets(topic)
    assert len(ends) == partitions
    return ends


def _count(bootstrap: str, topic: str, keep: Callable[[bytes | None, bytes | None], bool]) -> int:
    return sum(1 for k, v, _h in LedgerReader(bootstrap).records(topic) if keep(k, v))


def test_history_redelivered_to_a_restarted_coordinator_changes_nothing_R15(
    store_system: tuple[System, Store], kafka_bootstrap: str
) -> None:
    system, _store = store_system
    finished: list[str] = []
    for n in range(4):
        if n % 2:
            with pytest.raises(BusinessRejected), system.client.saga("w", "agent") as saga:
                saga.call("keep_blob", name=f"k{n}", blob="z" * (4 * KIB))
                saga.call("refuse")
        else:
            with system.client.saga("w", "agent") as saga:
                saga.call("keep_blob", name=f"k{n}", blob="z" * (4 * KIB))
        saga.wait(60)
        finished.append(saga.saga_id)
    assert system.coordinator is not None
    system.coordinator.stop()
    system._threads[0].join(60)  # the coordinator's loop has finished its last batch

    topics = system.topics
    commands_topic = topics.commands("store")
    before_terminal = _count(kafka_bootstrap, topics.terminal, lambda k, v: True)
    before_commands = _count(kafka_bootstrap, commands_topic, lambda k, v: True)
    before_events = _end_offsets(kafka_bootstrap, topics.events, 2)
    assert before_terminal == 4

    # A coordinator in a fresh consumer group reads the events topic from its start:
    # every record of every finished saga, SagaStarted included, is delivered again.
    replay = Coordinator(
        system.settings,
        kafka_bootstrap,
        instance_id="replay",
        group_id=f"{topics.prefix}replay-{uuid.uuid4().hex[:6]}",
    )

    seen: dict[str, Any] = {}

    def caught_up() -> bool:
        positions = replay.positions()
        done = bool(positions) and all(
            positions.get(p, -1) >= end for p, end in before_events.items() if end > 0
        )
        if done:  # what it holds once the whole history went through it
            seen.update({s: (replay.marker_of(s), replay.state_of(s)) for s in finished})
        return done

    replay.run(until=caught_up)

    for saga_id in finished:
        marker, state = seen[saga_id]
        assert marker is not None and marker.marker is MarkerKind.TERMINAL
        assert state is None
    assert _count(kafka_bootstrap, topics.terminal, lambda k, v: True) == before_terminal
    assert _count(kafka_bootstrap, commands_topic, lambda k, v: True) == before_commands
    assert _end_offsets(kafka_bootstrap, topics.events, 2) == before_events  # nothing new
    for saga_id in finished:
        terminals = [r for r in system.records(saga_id) if isinstance(r, SagaTerminal)]
        assert len(terminals) == 1

    # The markers are tombstoned once SAGALINE_TERMINAL_MEMORY_MS has passed (here: a
    # coordinator whose clock is a year and a day ahead, in the original group).
    ahead = int(time.time() * 1000) + Limits().terminal_memory_ms + 86_400_000
    future = Coordinator(
        system.settings,
        kafka_bootstrap,
        instance_id=system.coordinator.instance_id,  # takes the partitions back at once
        clock=lambda: ahead,
    )
    future.run(
        until=lambda: (
            bool(future.positions()) and all(future.marker_of(s) is None for s in finished)
        )
    )
    latest: dict[bytes, bytes | None] = {}
    for k, v, _h in LedgerReader(kafka_bootstrap).records(topics.state):
        if k is not None:
            latest[k] = v
    assert all(latest[s.encode()] is None for s in finished)
