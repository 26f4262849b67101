"""The participant runtime's command loop, without a broker (a fast tier beside the
real-broker test in ``test_participant_concurrency``).

The loop does every command's waiting on one thread: it serves the delivery reports,
writes the journal marks of a turn in one transaction and runs only tools on other
threads. These check that nothing is lost or reordered by that: every command runs,
one saga's in offset order and never two at once, offsets become committable only
below the lowest unfinished command, an outcome the broker refused goes out again
before its saga's next command, an intent it refused un-marks the command so its
tool runs once when tried again, a tool past its deadline is answered for without
holding up its saga, and a close finishes what runs and leaves the queued for
redelivery. The journal's group commit (used by the rare paths that block) wakes
each caller once, so the same is checked of it: every mark is written, the marks that
queue behind a write go in one transaction, and a failed write fails exactly the
callers whose marks it held.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from participants import CompensationContext, compensable, tool, wrap
from participants.runtime import (
    CommandHandler,
    CommandJournal,
    ParticipantRuntime,
    _appended_by,
    _CommandLoop,
    _Watchdog,
)
from sagaline.kafka import DeliveryFailed, Message
from schemas import (
    ExecuteStep,
    Record,
    StepCommitted,
    StepFailed,
    StepIntentRecorded,
    StepOutcomeUnknown,
    envelope_for,
)
from schemas.codec import encode
from schemas.signing import Signer
from schemas.wire import to_message
from tests.system import wait_until

_SIGNER = Signer(None)


class _Msg:
    def __init__(self, record: Record, partition: int, offset: int) -> None:
        self._key, self._value, self._headers = to_message(record, _SIGNER)
        self._partition, self._offset = partition, offset

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, str | bytes | None]]:
        return list(self._headers)

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class _Broker:
    """The loop's producer and writer: records sent, their reports served by poll()
    (all acknowledged, unless ``refuse`` says which event ids the broker refuses
    once)."""

    def __init__(self) -> None:
        self.sent: list[Record] = []
        self.refuse: set[str] = set()
        self._reports: list[tuple[Record, Callable[[DeliveryFailed | None], None]]] = []
        self._lock = threading.Lock()

    def send_then(
        self,
        record: Record,
        on_delivered: Callable[[DeliveryFailed | None], None],
        encoded: bytes | None = None,
    ) -> None:
        # bytes handed over (a journalled outcome) are the record's own
        assert encoded is None or encoded == encode(record), record.TYPE
        with self._lock:
            self.sent.append(record)
            self._reports.append((record, on_delivered))

    def poll(self, timeout: float = 0) -> int:
        with self._lock:
            reports, self._reports = self._reports, []
        for record, on_delivered in reports:
            if record.event_id in self.refuse:
                self.refuse.discard(record.event_id)
                on_delivered(DeliveryFailed("the broker said no", topic="events", error=None))
            else:
                on_delivered(None)
        return len(reports)

    def of(self, cls: type[Record], saga: str | None = None) -> list[Record]:
        return [r for r in self.sent if isinstance(r, cls) and saga in (None, r.saga_id)]


class _Desk:
    """A tool that records which sagas' steps overlap and the order it ran them in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: set[str] = set()
        self.overlaps: list[str] = []
        self.ran: dict[str, list[int]] = defaultdict(list)
        self.gates: dict[str, threading.Event] = {}
        self.errors: dict[str, BaseException] = {}

    @tool(description="Book a desk")
    @compensable(by="release")
    def book(self, saga: str, n: int) -> dict[str, int]:
        with self.lock:
            if saga in self.running:
                self.overlaps.append(saga)
            self.running.add(saga)
            gate = self.gates.get(f"{saga}/{n}")
            error = self.errors.get(f"{saga}/{n}")
        if gate is not None:
            assert gate.wait(60)
        with self.lock:
            self.ran[saga].append(n)
            self.running.discard(saga)
        if error is not None:
            raise error
        return {"n": n}

    def release(self, ctx: CompensationContext) -> None:
        pass


def _execute(saga: str, n: int, *, deadline_ms: int = 60_000) -> ExecuteStep:
    env = envelope_for(
        ExecuteStep, saga_id=saga, tenant_id="t", producer="sagaline-coordinator", now=1
    )
    return ExecuteStep(
        envelope=env,
        step_id=f"{n:02d}-book",
        tool="book",
        args=f'{{"saga":"{saga}","n":{n}}}'.encode(),
        idempotency_key=f"{saga}-{n}",
        attempt=1,
        deadline_ms=deadline_ms,
        principal="p",
    )


class _Rig:
    """A loop over a real handler and journal, its broker a :class:`_Broker`; the
    test's thread is the loop's thread."""

    def __init__(self, tmp_path: Path, workers: int = 4) -> None:
        self.desk = _Desk()
        self.broker = _Broker()
        self.journal = CommandJournal(tmp_path / "journal.sqlite")
        self.handler = CommandHandler(
            wrap(self.desk, name="desks"), "desks", self.journal, self._blocking_append
        )
        self.next_offset: dict[int, int] = defaultdict(int)
        self.dead_letters: list[tuple[int, str]] = []  # (offset, reason) the DLQ has
        self.dlq_refusals = 0  # how many DLQ writes the broker refuses next
        runtime = SimpleNamespace(
            participant="desks",
            handler=self.handler,
            signer=_SIGNER,
            metrics=SimpleNamespace(
                observe_record=lambda r: None, observe_output=lambda r: None, dlq=lambda r: None
            ),
            _writer=SimpleNamespace(producer=self.broker),
            _dead_letters=SimpleNamespace(write=self._dead_letter),
            send=self.broker.send_then,
            _assigned_end={},
        )
        self.loop = _CommandLoop(cast(ParticipantRuntime, runtime), workers)

    def _dead_letter(self, msg: Message, reason: str, detail: str) -> None:
        if self.dlq_refusals:
            self.dlq_refusals -= 1
            raise DeliveryFailed("the broker said no", topic="dlq", error=None)
        self.dead_letters.append((msg.offset() or 0, reason))

    def _blocking_append(self, record: Record) -> None:
        raise AssertionError(f"the loop's fast path appended {record.TYPE} blocking")

    def submit(self, record: Record, partition: int = 0) -> int:
        offset = self.next_offset[partition]
        self.next_offset[partition] += 1
        self.loop.submit(cast(Message, _Msg(record, partition, offset)))
        return offset

    def turn(self) -> None:
        self.loop.wait()
        self.loop.serve()

    def run_until(self, done: Callable[[], bool], what: str) -> None:
        def turned() -> bool:
            self.turn()
            return done()

        wait_until(turned, what=what)

    def probing(
        self,
        ledger: object | None = None,
        assigned_end: int = 1,
        appended: list[Record] | None = None,
    ) -> None:
        """From now on a command on partition 0 below ``assigned_end`` was there before
        the assignment: the ledger (``ledger``, else what the broker took) is probed for
        it and it is handled on the blocking path, which appends to ``appended`` (else
        the broker's ``sent``)."""
        sink = self.broker.sent if appended is None else appended
        self.handler._ledger = cast(Any, _Ledger(self.broker) if ledger is None else ledger)
        self.handler._append = self.handler._publish = sink.append
        self.handler._begin_append = _appended_by(sink.append)
        rt = cast(Any, self.loop._rt)
        rt._assigned_end = {0: assigned_end}
        rt._process = lambda *a: ParticipantRuntime._process(rt, *a)
        rt._dead_letter_blocking = lambda *a: ParticipantRuntime._dead_letter_blocking(rt, *a)
        rt._confirm_in_background = lambda *a: None

    def close(self) -> None:
        self.loop.close()
        self.handler.close()
        self.journal.close()


def test_each_saga_runs_in_offset_order_never_two_at_once_and_all_commit(
    tmp_path: Path,
) -> None:
    rig = _Rig(tmp_path, workers=4)
    submitted: dict[str, list[int]] = defaultdict(list)
    for i in range(120):
        saga = f"saga-{i % 13}"
        submitted[saga].append(i)
        rig.submit(_execute(saga, i), partition=(i % 13) % 2)  # a key on one partition
    rig.run_until(lambda: rig.loop.pending == 0, "every command done")
    assert rig.desk.overlaps == []
    assert dict(rig.desk.ran) == dict(submitted)
    assert rig.loop.committable() == {0: rig.next_offset[0], 1: rig.next_offset[1]}
    assert rig.loop.committable() == {}  # nothing moved since
    # each command's intent went out before its tool ran, its outcome after
    assert len(rig.broker.of(StepIntentRecorded)) == 120
    assert len(rig.broker.of(StepCommitted)) == 120
    rig.close()


def test_offsets_commit_only_below_the_lowest_unfinished(tmp_path: Path) -> None:
    rig = _Rig(tmp_path, workers=4)
    gate = rig.desk.gates["saga-3/3"] = threading.Event()
    for n in range(10):
        rig.submit(_execute(f"saga-{n}", n))
    rig.run_until(lambda: rig.loop.pending == 1, "all but the held command done")
    assert rig.loop.committable() == {0: 3}
    gate.set()
    rig.run_until(lambda: rig.loop.pending == 0, "the held command done")
    assert rig.loop.committable() == {0: 10}
    rig.close()


def test_a_refused_outcome_goes_again_before_its_sagas_next_command(tmp_path: Path) -> None:
    rig = _Rig(tmp_path)
    first, second = _execute("saga-a", 0), _execute("saga-a", 1)
    from schemas import derived_event_id

    rig.broker.refuse.add(derived_event_id(first.event_id, "outcome"))
    rig.submit(first)
    rig.submit(second)
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    outcomes = [r.event_id for r in rig.broker.of(StepCommitted)]
    assert outcomes == [
        derived_event_id(first.event_id, "outcome"),  # refused
        derived_event_id(first.event_id, "outcome"),  # the same outcome, again
        derived_event_id(second.event_id, "outcome"),
    ]
    assert rig.desk.ran["saga-a"] == [0, 1]  # the tool ran once per command
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_a_refused_intent_unmarks_the_command_and_its_tool_runs_once(tmp_path: Path) -> None:
    rig = _Rig(tmp_path)
    command = _execute("saga-a", 0)
    from schemas import derived_event_id

    rig.broker.refuse.add(derived_event_id(command.event_id, "intent"))
    rig.submit(command)
    rig.run_until(lambda: rig.loop.pending == 0, "the command done")
    assert len(rig.broker.of(StepIntentRecorded)) == 2  # refused, then sent again
    assert rig.desk.ran["saga-a"] == [0]  # not run before its intent was on the ledger
    assert [type(r) for r in rig.broker.of(StepCommitted)] == [StepCommitted]
    assert rig.journal.get(command.event_id) is not None
    rig.close()


def test_a_tool_past_its_deadline_is_answered_for_and_its_saga_goes_on(tmp_path: Path) -> None:
    rig = _Rig(tmp_path, workers=1)  # the stuck tool's thread is replaced
    gate = rig.desk.gates["saga-a/0"] = threading.Event()
    rig.submit(_execute("saga-a", 0, deadline_ms=10))
    rig.submit(_execute("saga-a", 1))
    rig.submit(_execute("saga-b", 2))
    rig.run_until(lambda: rig.loop.pending == 0, "the later commands done")
    assert [
        type(r) for r in rig.broker.of(Record, "saga-a") if not isinstance(r, StepIntentRecorded)
    ] == [
        StepOutcomeUnknown,
        StepCommitted,
    ]
    assert rig.desk.ran["saga-a"] == [1] and rig.desk.ran["saga-b"] == [2]
    gate.set()  # the late tool returns: what it returned is not sent
    wait_until(lambda: rig.desk.ran["saga-a"] == [1, 0], what="the late tool returned")
    for _ in range(3):
        rig.turn()
    assert len(rig.broker.of(StepCommitted, "saga-a")) == 1
    assert rig.loop.committable() == {0: 3}
    rig.close()


def test_a_tool_error_whose_message_is_not_utf8_is_reported_and_its_saga_goes_on(
    tmp_path: Path,
) -> None:
    # R9/R16: a message read with surrogateescape (a file name, a provider's bytes)
    # cannot be written as UTF-8; the failure must still reach the ledger, and the
    # saga's next command (and the partition's offsets) must not wait behind it.
    rig = _Rig(tmp_path)
    rig.desk.errors["saga-a/0"] = ValueError(
        b"no such file: \xff".decode("utf-8", "surrogateescape")
    )
    rig.submit(_execute("saga-a", 0))
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    failed = rig.broker.of(StepFailed, "saga-a")
    assert len(failed) == 1 and failed[0].message.startswith("no such file: ")
    assert rig.desk.ran["saga-a"] == [0, 1]
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_a_dead_letter_the_broker_refused_is_written_again_before_its_offset_commits(
    tmp_path: Path,
) -> None:
    # R16: bad input never loses a record: its offset moves on only once the DLQ has it.
    rig = _Rig(tmp_path)
    rig.dlq_refusals = 1
    bad = _Msg(_execute("saga-a", 0), 0, 0)
    bad._value = b"not a record"
    rig.next_offset[0] = 1
    rig.loop.submit(cast(Message, bad))
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    assert rig.dead_letters == [(0, "malformed")]
    assert rig.desk.ran["saga-a"] == [1]
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_a_step_that_raises_after_the_tool_ran_dead_letters_its_command_and_its_saga_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R10/R16: the tool ran but its outcome cannot be journalled (here outcome_row
    # raises once): the command goes to the DLQ, as one whose outcome could not be
    # built does, and is not tried again (its tool must not run twice; its journal
    # mark stays "started", so a redelivery is reported as an unknown outcome). Its
    # saga's next command runs and the partition's offsets commit past it.
    rig = _Rig(tmp_path)
    outcome_row = rig.handler.outcome_row
    broken: list[str] = []

    def raising_once(command: Record, *args: Any) -> Any:
        if not broken:
            broken.append(command.event_id)
            raise TypeError("cannot encode the outcome")
        return outcome_row(command, *args)

    monkeypatch.setattr(rig.handler, "outcome_row", raising_once)
    first = _execute("saga-a", 0)
    rig.submit(first)
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    assert broken == [first.event_id]
    assert rig.dead_letters == [(0, "handler-error")]
    assert rig.desk.ran["saga-a"] == [0, 1]  # each tool ran once
    assert [r.step_id for r in rig.broker.of(StepCommitted, "saga-a")] == ["01-book"]
    assert rig.journal.get(first.event_id) == ("started", None)
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_a_refused_intent_whose_unmarking_raises_dead_letters_its_command_and_its_saga_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R10/R16: the broker refused the intent and un-marking the command raises: its
    # tool never runs, the command goes to the DLQ, the saga's next command runs
    # and the partition's offsets commit past it.
    from schemas import derived_event_id

    rig = _Rig(tmp_path)
    first = _execute("saga-a", 0)
    rig.broker.refuse.add(derived_event_id(first.event_id, "intent"))

    def raising(command_id: str, intent: bytes) -> None:
        raise OSError("disk I/O error")

    monkeypatch.setattr(rig.journal, "mark_unstarted", raising)
    rig.submit(first)
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    assert rig.dead_letters == [(0, "handler-error")]
    assert rig.desk.ran["saga-a"] == [1]  # its intent was never on the ledger
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_close_lets_the_running_command_finish_and_leaves_the_queued(tmp_path: Path) -> None:
    rig = _Rig(tmp_path, workers=1)
    gate = rig.desk.gates["saga-a/0"] = threading.Event()
    for n in range(3):
        rig.submit(_execute("saga-a", n))
    rig.run_until(lambda: "saga-a" in rig.desk.running, "the first tool running")

    def release_once_closing() -> None:
        wait_until(lambda: rig.loop._closing, what="the loop closing")
        gate.set()

    releaser = threading.Thread(target=release_once_closing)
    releaser.start()
    rig.loop.close()  # returns once the running command is done
    releaser.join()
    assert rig.desk.ran["saga-a"] == [0]  # the queued two are left for redelivery
    assert rig.loop.committable() == {0: 1}
    rig.handler.close()
    rig.journal.close()


def test_a_drain_past_its_bound_gives_up_its_partitions_commands_and_runs_none_of_them(
    tmp_path: Path,
) -> None:
    # R11/R15: a revoke's drain gives up what is unfinished on its partitions: the
    # running tool's late answer is dropped, a tool waiting for a thread never
    # starts, a saga's queued command never runs, no offset of theirs becomes
    # committable; the other partitions' commands go on with the full thread count.
    rig = _Rig(tmp_path, workers=1)
    gate = rig.desk.gates["saga-a/0"] = threading.Event()
    rig.submit(_execute("saga-a", 0))
    rig.submit(_execute("saga-a", 1))  # queued behind it
    rig.submit(_execute("saga-b", 2))  # waits for the one tool thread
    rig.run_until(
        lambda: "saga-a" in rig.desk.running and len(rig.broker.of(StepIntentRecorded)) == 2,
        "the first tool running, the other's intent sent",
    )
    for _ in range(3):
        rig.turn()
    rig.loop.drain({0}, 0.0)
    assert rig.loop.pending == 0
    gate.set()
    wait_until(lambda: rig.desk.ran["saga-a"] == [0], what="the given-up tool returned")
    rig.submit(_execute("saga-c", 3), partition=1)
    rig.run_until(lambda: rig.desk.ran["saga-c"] == [3], "the other partition's command ran")
    rig.run_until(lambda: rig.loop.committable() == {1: 1}, "its offset committable")
    assert dict(rig.desk.ran) == {"saga-a": [0], "saga-c": [3]}
    assert [r.saga_id for r in rig.broker.of(StepCommitted)] == ["saga-c"]
    assert rig.loop.pending == 0
    rig.close()


def test_journal_marks_queued_behind_a_write_go_in_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = CommandJournal(tmp_path / "j.sqlite")
    write = journal._write
    writing = threading.Event()
    gate = threading.Event()
    transactions: list[list[str]] = []

    def held_write(rows: list[Any]) -> None:
        transactions.append([r[0] for r in rows])
        if len(transactions) == 1:
            writing.set()
            gate.wait()
        write(rows)

    monkeypatch.setattr(journal, "_write", held_write)
    first = threading.Thread(target=journal.mark, args=("c0", "started"))
    first.start()
    assert writing.wait(60)
    rest = [threading.Thread(target=journal.mark, args=(f"c{i}", "done")) for i in (1, 2, 3)]
    for thread in rest:
        thread.start()
    wait_until(lambda: len(journal._queued) == 3, what="three marks queued behind the write")
    gate.set()
    for thread in [first, *rest]:
        thread.join()
    assert [sorted(t) for t in transactions] == [["c0"], ["c1", "c2", "c3"]]
    assert [journal.get(f"c{i}") for i in range(4)] == [
        ("started", None),
        ("done", None),
        ("done", None),
        ("done", None),
    ]
    journal.close()


def test_a_failed_journal_write_fails_its_callers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = CommandJournal(tmp_path / "j.sqlite")
    write = journal._write

    def broken_write(rows: list[Any]) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(journal, "_write", broken_write)
    with pytest.raises(RuntimeError, match="journal write failed: disk full"):
        journal.mark("c0", "started")
    monkeypatch.setattr(journal, "_write", write)
    errors: list[BaseException] = []

    def mark(i: int) -> None:
        try:
            journal.mark(f"c{i}", "started")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=mark, args=(i,)) for i in range(1, 33)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert journal.get("c0") is None
    assert all(journal.get(f"c{i}") == ("started", None) for i in range(1, 33))
    journal.close()


def test_the_watchdog_takes_over_only_calls_past_their_deadline_and_forgets_finished_ones() -> None:
    watchdog = _Watchdog("t-deadlines")
    overran = threading.Event()
    wrongly: list[str] = []
    in_time = watchdog.watch(3600, lambda: wrongly.append("in time"))
    late = watchdog.watch(0.01, overran.set)
    assert overran.wait(60)
    assert late.finish() is False  # the late call's answer does not count
    assert in_time.finish() is True
    # A call still running with the earliest deadline, and many finished behind it
    # with later ones: those are swept, not kept until they reach the top.
    running = watchdog.watch(3000, lambda: wrongly.append("running"))
    for _ in range(5000):
        watchdog.watch(3600, lambda: wrongly.append("finished")).finish()
    assert len(watchdog._heap) <= 600
    assert running.finish() is True
    watchdog.close()
    assert wrongly == []


class _Ledger:
    """A ledger probe over what the rig's broker took (``also``: records another
    replica wrote there)."""

    def __init__(self, broker: _Broker, also: list[Record] | None = None) -> None:
        self._broker = broker
        self._also = also or []

    def caused_by(self, command: Record) -> list[Record]:
        from schemas.codec import decode

        # as the probe reads them: decoded from the log, not the objects sent
        return [
            decode(encode(r))
            for r in [*self._broker.sent, *self._also]
            if r.envelope.causation_id == command.event_id
        ]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("where", ["intent", "thread"])
def test_a_command_given_up_before_its_tool_ran_runs_when_it_comes_back(
    tmp_path: Path, where: str
) -> None:
    # R11/R14: a broker down past the session timeout: the partition is lost while
    # a command's intent waits for its acknowledgement ("intent") or its tool for a
    # thread ("thread"), so it is given up and its tool never runs. Its intent
    # reaches the ledger later, and its "started" mark stayed in the journal. When
    # the command comes back here, it was reported as an unknown outcome ("the
    # participant restarted ... while the tool was running"): for a tool with no
    # lookup the coordinator asked a person, and the saga never ended (the broker
    # kill test's R14). The tool did not run: it runs now, once.
    from schemas import derived_event_id

    rig = _Rig(tmp_path, workers=1)
    command = _execute("saga-a", 0)
    intent_id = derived_event_id(command.event_id, "intent")
    held: list[Callable[[DeliveryFailed | None], None]] = []
    send_then = rig.broker.send_then

    def holding(record: Record, on_delivered: Any, encoded: bytes | None = None) -> None:
        if record.event_id == intent_id and where == "intent" and not held:
            rig.broker.sent.append(record)  # on its way: acknowledged after the give-up
            held.append(on_delivered)
            return
        send_then(record, on_delivered, encoded)

    cast(Any, rig.loop._rt).send = holding
    gate = rig.desk.gates["saga-b/1"] = threading.Event()
    if where == "thread":
        rig.submit(_execute("saga-b", 1), partition=1)  # holds the one tool thread
        rig.run_until(lambda: "saga-b" in rig.desk.running, "the other tool running")
    rig.submit(command)
    rig.run_until(
        lambda: (
            rig.journal.get(command.event_id) is not None
            and (bool(held) or rig.loop._tools._busy == 2)
        ),
        "the command marked started, its tool not running",
    )
    rig.loop.drain({0}, 0.0)  # lost: given up
    rig.loop.forget({0})
    for on_delivered in held:
        on_delivered(None)  # the broker is back: the intent is on the ledger
    gate.set()
    rig.run_until(lambda: rig.loop.pending == 0 and rig.loop._tools._busy == 0, "idle")
    assert rig.desk.ran["saga-a"] == []

    # the partition comes back to this replica, which reads the command again
    rig.probing()
    rig.loop.submit(cast(Message, _Msg(command, 0, 0)))
    rig.run_until(lambda: rig.loop.pending == 0, "the command done")
    assert rig.broker.of(StepOutcomeUnknown) == []
    assert [r.saga_id for r in rig.broker.of(StepCommitted, "saga-a")] == ["saga-a"]
    assert rig.desk.ran["saga-a"] == [0]
    # the same intent each time: the ledger holds none another replica could have sent
    intents = rig.broker.of(StepIntentRecorded, "saga-a")
    assert len(intents) == 2 and intents[0] == intents[1]
    assert rig.loop.committable()[0] == 1
    rig.close()


def test_a_command_given_up_here_whose_intent_another_replica_wrote_stays_unknown(
    tmp_path: Path,
) -> None:
    # R11: given up here before its tool ran, but the ledger also holds an intent
    # for it that this replica did not send (another replica owned the partition
    # meanwhile and may have run the tool): an unknown outcome, not a second run.
    from schemas import derived_event_id

    rig = _Rig(tmp_path)
    command = _execute("saga-a", 0)
    intent_id = derived_event_id(command.event_id, "intent")
    held: list[Record] = []
    send_then = rig.broker.send_then

    def holding(record: Record, on_delivered: Any, encoded: bytes | None = None) -> None:
        if record.event_id == intent_id and not held:
            held.append(record)  # never acknowledged here
            return
        send_then(record, on_delivered, encoded)

    cast(Any, rig.loop._rt).send = holding
    rig.submit(command)
    rig.run_until(
        lambda: bool(held) and rig.journal.get(command.event_id) is not None,
        "the intent sent, the command marked started",
    )
    rig.loop.drain({0}, 0.0)
    rig.loop.forget({0})
    rig.turn()
    theirs = held[0].model_copy(
        update={"envelope": held[0].envelope.model_copy(update={"occurred_at": 7})}
    )
    rig.probing(_Ledger(rig.broker, also=[held[0], theirs]))
    rig.loop.submit(cast(Message, _Msg(command, 0, 0)))
    rig.run_until(lambda: rig.loop.pending == 0, "the command done")
    assert rig.desk.ran["saga-a"] == []
    assert [r.saga_id for r in rig.broker.of(StepOutcomeUnknown)] == ["saga-a"]
    rig.close()


def test_the_journal_marks_a_given_up_command_unstarted_only_over_started(
    tmp_path: Path,
) -> None:
    # A tool thread journals its given-up command late: an answer written meanwhile
    # (the command came back here) stays. Unstarted rows are pruned like done ones.
    journal = CommandJournal(tmp_path / "j.sqlite")
    journal.write([("c", "started", b"command", None, 1), ("c", "done", None, b"outcome", 2)])
    journal.mark_unstarted("c", b"intent")
    assert journal.get("c") == ("done", b"outcome")
    journal.write([("d", "started", b"command", None, 3)])
    journal.mark_unstarted("d", b"intent")
    assert journal.get("d") == ("unstarted", b"intent")
    assert journal.prune(2**62)[0] == 2
    assert journal.get("c") is None and journal.get("d") is None
    journal.close()


@pytest.mark.parametrize("path", ["blocking", "loop"])
def test_an_intent_refused_yet_on_the_ledger_does_not_make_its_retry_an_unknown_outcome(
    tmp_path: Path, path: str
) -> None:
    # R10/R11/R14: a DeliveryFailed for the intent says it "may or may not be in the
    # log" (a message timeout; a record in flight on a producer that failed for good,
    # purged after a wait). The tool did not run, so its "started" mark was dropped.
    # When the command was tried again with the ledger probed (it was read again after
    # a rebalance, or it is on the probing path), the intent that did reach the log,
    # its own, read as another replica's: an unknown outcome, for a tool with no
    # lookup a person asked about a call that never ran. The tool runs once instead.
    from schemas import derived_event_id

    rig = _Rig(tmp_path)
    command = _execute("saga-a", 0)
    intent_id = derived_event_id(command.event_id, "intent")
    sent = rig.broker.sent

    if path == "blocking":
        rig.probing()
        refused: list[Record] = []

        def refusing(record: Record) -> Callable[[], None]:
            sent.append(record)  # it reached the log; its report said it may not have

            def acknowledged() -> None:
                if record.event_id == intent_id and not refused:
                    refused.append(record)
                    raise DeliveryFailed("not acknowledged", topic="events", error=None)

            return acknowledged

        rig.handler._begin_append = refusing
        rig.submit(command)
    else:
        rig.broker.refuse.add(intent_id)  # sent (on the log), reported refused
        rig.submit(command)
        rig.run_until(lambda: len(rig.loop._retries) == 1, "the command left to try again")
        assert rig.desk.ran["saga-a"] == []
        rig.loop.drain({0}, 0.0)  # a rebalance before the retry: read again, probed
        rig.loop.forget({0})
        rig.probing()
        rig.loop.submit(cast(Message, _Msg(command, 0, 0)))
    rig.run_until(lambda: rig.loop.pending == 0, "the command done")
    assert rig.broker.of(StepOutcomeUnknown) == []
    assert rig.desk.ran["saga-a"] == [0]
    assert [r.saga_id for r in rig.broker.of(StepCommitted)] == ["saga-a"]
    rig.close()


def test_a_probed_command_given_up_before_a_tool_thread_took_it_sends_nothing(
    tmp_path: Path,
) -> None:
    # R10/R11: a command read again after a rebalance is probed for on a tool thread.
    # Given up (its partition lost or revoked) while it waited for one, it is its
    # next owner's: nothing of it may happen here. It used to be handled all the same
    # once a thread was free: its intent appended after the give-up, where the new
    # owner's probe reads it as another replica's (an unknown outcome for a tool
    # that never ran, and for a tool with no lookup a person asked).

    rig = _Rig(tmp_path, workers=1)
    sent = rig.broker.sent
    gate = rig.desk.gates["saga-b/1"] = threading.Event()
    rig.submit(_execute("saga-b", 1), partition=1)  # holds the one tool thread
    rig.run_until(lambda: "saga-b" in rig.desk.running, "the other tool running")
    rig.probing()  # the command below was on the partition before it was assigned
    command = _execute("saga-a", 0)
    rig.submit(command)
    rig.run_until(lambda: rig.loop._tools._busy == 2, "the command waiting for a thread")
    rig.loop.drain({0}, 0.0)  # lost: given up
    rig.loop.forget({0})
    gate.set()
    rig.run_until(lambda: rig.loop.pending == 0 and rig.loop._tools._busy == 0, "idle")
    assert rig.desk.ran["saga-a"] == []
    assert [r.TYPE for r in sent if r.saga_id == "saga-a"] == []
    assert rig.journal.get(command.event_id) is None
    rig.close()


class _UnreadableLedger:
    """A ledger probe that cannot read the ledger ``failures`` times (a broker outage
    longer than its timeout), then finds nothing there."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.asked = 0

    def caused_by(self, command: Record) -> list[Record]:
        from participants.ledger_probe import LedgerProbeError

        self.asked += 1
        if self.asked <= self.failures:
            raise LedgerProbeError(f"could not read the ledger for {command.event_id}")
        return []

    def close(self) -> None:
        pass


def test_a_command_whose_ledger_probe_fails_is_tried_again_not_dead_lettered(
    tmp_path: Path,
) -> None:
    # R16/R15: a command on the partition before it was assigned here is looked up
    # on the ledger first. The ledger being unreadable for a while (a broker outage)
    # says nothing about the command: it is tried again once the ledger answers, its
    # tool runs once, nothing goes to the DLQ (where its saga would wait for good).

    rig = _Rig(tmp_path)
    appended: list[Record] = []
    # the commands were there before the assignment
    rig.probing(_UnreadableLedger(failures=1), assigned_end=100, appended=appended)
    rig.submit(_execute("saga-a", 0))
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    assert rig.dead_letters == []
    assert rig.desk.ran["saga-a"] == [0, 1]  # in order, each once
    assert [r.step_id for r in appended if isinstance(r, StepCommitted)] == ["00-book", "01-book"]
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_a_journal_commit_that_fails_does_not_wedge_the_journal(tmp_path: Path) -> None:
    # R16: a transaction whose COMMIT fails (SQLITE_BUSY while another process reads
    # the file in rollback-journal mode, where WAL is unavailable; a disk full) stays
    # open in SQLite. Left open, every later write failed ("cannot start a
    # transaction within a transaction") and every later command went to the DLQ
    # until a restart; the failed one must fail alone.
    import sqlite3

    path = tmp_path / "j.sqlite"
    journal = CommandJournal(path)
    journal._db.execute("PRAGMA journal_mode=DELETE")  # as on a filesystem without WAL
    journal._db.execute("PRAGMA busy_timeout=0")
    reader = sqlite3.connect(str(path), isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM handled").fetchone()  # holds a shared lock
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        journal.write([("c0", "started", None, None, 1)])
    reader.execute("COMMIT")
    reader.close()
    journal.write([("c1", "started", None, None, 2)])
    assert journal.get("c1") == ("started", None)
    assert journal.get("c0") is None  # the failed transaction left nothing
    journal.close()


class _EmptyLedger:
    """A ledger probe that finds nothing of the command (never taken elsewhere)."""

    def caused_by(self, command: Record) -> list[Record]:
        return []

    def close(self) -> None:
        pass


@pytest.mark.parametrize("blocking", [False, True], ids=["loop", "blocking"])
def test_a_tool_raising_system_exit_fails_its_step_and_its_saga_goes_on(
    tmp_path: Path, blocking: bool
) -> None:
    # R9/R16: a tool built on a click/argparse-style library raises SystemExit, which
    # passes every ``except Exception``. It is that step's failure like any tool
    # error: its outcome reaches the ledger, nothing is dead-lettered or dropped,
    # the saga's next command runs and the offsets move past it. Both the loop's
    # path and the blocking one (a command from before the assignment: the ledger
    # probe first) are checked.

    rig = _Rig(tmp_path)
    rig.desk.errors["saga-a/0"] = SystemExit(2)
    if blocking:  # the commands were there before the assignment
        rig.probing(_EmptyLedger(), assigned_end=100)
    rig.submit(_execute("saga-a", 0))
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: rig.loop.pending == 0, "both commands done")
    assert rig.dead_letters == []
    [failed] = rig.broker.of(StepFailed, "saga-a")
    assert (failed.step_id, failed.error_type) == ("00-book", "SystemExit")
    assert [r.step_id for r in rig.broker.of(StepCommitted, "saga-a")] == ["01-book"]
    assert rig.desk.ran["saga-a"] == [0, 1]
    assert rig.loop.committable() == {0: 2}
    rig.close()


def test_an_outcome_refused_for_its_size_after_a_give_up_is_not_dead_lettered_here(
    tmp_path: Path,
) -> None:
    # R15/R16: a revoke gave the command up (its partition's next owner decides it
    # from the journal and ledger); the broker's late refusal of its outcome must not
    # make this replica write a dead-letter copy of a command it no longer owns.
    from confluent_kafka import KafkaError

    from schemas import derived_event_id

    rig = _Rig(tmp_path)
    command = _execute("saga-a", 0)
    rig.submit(command)
    rig.run_until(lambda: bool(rig.broker.of(StepCommitted)), "the outcome sent")
    refused = DeliveryFailed(
        "too large", topic="events", error=KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    )
    assert refused.too_large
    outcome_id = derived_event_id(command.event_id, "outcome")
    poll = rig.broker.poll

    def refusing(timeout: float = 0) -> int:  # its report comes back: too large
        with rig.broker._lock:
            reports, rig.broker._reports = rig.broker._reports, []
        for record, on_delivered in reports:
            on_delivered(refused if record.event_id == outcome_id else None)
        return len(reports) + poll(timeout)

    rig.broker.poll = refusing  # type: ignore[method-assign]
    rig.loop.drain({0}, 0.0)  # revoked before the report came: given up
    assert rig.loop.pending == 0
    rig.run_until(lambda: not rig.loop._sending, "the outcome's report taken")
    wait_until(lambda: rig.loop._tools._busy == 0, what="no tool thread busy")
    assert rig.dead_letters == []
    assert rig.loop.committable() == {}
    rig.close()


class _FullDisk:
    """The journal's ``write`` raising as SQLite does on a full disk, ``failures``
    times (for ever with None), then writing."""

    def __init__(self, journal: CommandJournal, failures: int | None) -> None:
        self._write = journal.write
        self.failures = failures
        self.failed = 0

    def __call__(self, rows: list[Any]) -> None:
        import sqlite3

        if self.failures is None or self.failed < self.failures:
            self.failed += 1
            raise sqlite3.OperationalError("database or disk is full")
        self._write(rows)


def test_a_journal_that_cannot_write_for_a_while_holds_its_commands_not_dead_letters_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R10/R16: a full disk is not a bad command. The marks of that turn (here an
    # intent's "started", then the outcomes) wait and are written again once the
    # journal takes them: nothing is dead-lettered, no tool runs before its
    # "started" is on disk or twice, every outcome goes out after it is journalled.
    from schemas import derived_event_id

    rig = _Rig(tmp_path)
    full = _FullDisk(rig.journal, failures=3)
    monkeypatch.setattr(rig.journal, "write", full)
    commands = [_execute("saga-a", 0), _execute("saga-a", 1), _execute("saga-b", 2)]
    for command in commands:
        rig.submit(command)
    rig.run_until(lambda: rig.loop.pending == 0, "every command done")
    assert rig.dead_letters == []
    assert full.failed == 3
    assert dict(rig.desk.ran) == {"saga-a": [0, 1], "saga-b": [2]}  # each once
    committed = rig.broker.of(StepCommitted)
    assert sorted(r.event_id for r in committed) == sorted(
        derived_event_id(c.event_id, "outcome") for c in commands
    )
    for command in commands:
        seen = rig.journal.get(command.event_id)
        assert seen is not None and seen[0] == "done"
    assert rig.loop.committable() == {0: 3}
    rig.close()


def test_a_journal_that_stays_unwritable_leaves_its_commands_undone_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop while the disk is still full does not hang and dead-letters nothing:
    # the waiting command is left undone (its offset uncommitted, redelivered at the
    # next start, where the journal and the ledger decide it); its tool never ran.
    rig = _Rig(tmp_path)
    full = _FullDisk(rig.journal, failures=None)
    monkeypatch.setattr(rig.journal, "write", full)
    rig.submit(_execute("saga-a", 0))
    rig.submit(_execute("saga-a", 1))
    rig.run_until(lambda: full.failed >= 2, "the journal failing again")
    rig.loop.close()
    assert rig.dead_letters == []
    assert dict(rig.desk.ran) == {}
    assert rig.loop.committable() == {}
    assert rig.loop.pending == 0
    rig.handler.close()
    rig.journal.close()


def _tool_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("desks-tool-"))


def test_tools_hanging_past_their_deadlines_do_not_grow_the_threads_without_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A provider that hangs on every call: each call past its deadline is answered
    # for (an unknown outcome) and its thread stays until the tool returns. Stuck
    # threads are replaced up to the worker count only, then no more commands start
    # (they wait, nothing lost), with an error in the log; once the tools return,
    # the waiting commands run.
    before = _tool_threads()
    rig = _Rig(tmp_path, workers=2)
    gates = [rig.desk.gates.setdefault(f"saga-{n}/{n}", threading.Event()) for n in range(10)]
    for n in range(10):
        rig.submit(_execute(f"saga-{n}", n, deadline_ms=10))
    rig.run_until(
        lambda: (
            len(rig.broker.of(StepOutcomeUnknown)) == 10
            or (getattr(rig.loop._tools, "exhausted", False) and rig.loop.pending == 6)
        ),
        "every call answered for, or every tool thread stuck",
    )
    assert _tool_threads() - before <= 4, "a tool thread for every stuck call"
    assert len(rig.broker.of(StepOutcomeUnknown)) == 4
    assert rig.loop.pending == 6  # waiting for a thread, not lost
    assert "stuck past their deadlines" in caplog.text
    for gate in gates:
        gate.set()
    rig.run_until(lambda: rig.loop.pending == 0, "the waiting commands done")
    assert len(rig.broker.of(StepOutcomeUnknown)) + len(rig.broker.of(StepCommitted)) == 10
    assert rig.loop.committable() == {0: 10}
    rig.close()


def test_a_close_with_every_tool_thread_stuck_leaves_the_waiting_commands_undone(
    tmp_path: Path,
) -> None:
    # The commands waiting for a thread would wait as long as the provider hangs:
    # a stop leaves them uncommitted for the next run instead.
    rig = _Rig(tmp_path, workers=1)
    gates = [rig.desk.gates.setdefault(f"saga-{n}/{n}", threading.Event()) for n in range(4)]
    for n in range(4):
        rig.submit(_execute(f"saga-{n}", n, deadline_ms=10))
    rig.run_until(
        lambda: getattr(rig.loop._tools, "exhausted", False) and rig.loop.pending == 2,
        "every thread stuck, their commands answered for",
    )
    closer = threading.Thread(target=rig.loop.close, daemon=True)
    closer.start()
    closer.join(60)
    stuck = closer.is_alive()
    for gate in gates:
        gate.set()
    assert not stuck, "the close waited for commands no thread will run"
    assert rig.loop.committable() == {0: 2}  # the two answered for; the rest redelivered
    wait_until(lambda: len(rig.desk.ran) == 2, what="the stuck tools returned")
    assert sorted(rig.desk.ran) == ["saga-0", "saga-1"]  # the waiting ones never ran
    rig.handler.close()
    rig.journal.close()


def test_health_says_so_when_every_tool_thread_is_stuck(tmp_path: Path) -> None:
    # /healthz (ParticipantRuntime.health) must not say ok while no command can start.
    from schemas.settings import Settings

    desk = _Desk()
    runtime = ParticipantRuntime(
        wrap(desk, name="desks"),
        Settings(bootstrap="memory://stuck-health", partitions=1, state_dir=tmp_path),
        "memory://stuck-health",
        participant="desks",
        max_in_flight=1,
    )
    try:
        runtime._serving = True  # as run() sets it once its loop serves
        assert runtime.health() is None
        tools = runtime._work._tools
        tools.replace("ExecuteStep book")
        assert runtime.health() is None  # one stuck thread, replaced: it still serves
        tools.replace("ExecuteStep book")  # two: the one thread and its replacement
        why = runtime.health()
        assert why is not None and "stuck" in why
    finally:
        runtime.handler.close()
        runtime.journal.close()


def test_health_is_ok_by_the_time_the_serving_line_is_logged(tmp_path: Path) -> None:
    # Deployments and tests wait for "participant X serving" in the log, then probe
    # /healthz: the line came before run() set its serving flag, so a probe right
    # after it could still get 503 "starting" (seen on a busy CI machine).
    import logging
    import threading

    from schemas.settings import Settings

    runtime = ParticipantRuntime(
        wrap(_Desk(), name="desks"),
        Settings(bootstrap="memory://serving-line", partitions=1, state_dir=tmp_path),
        "memory://serving-line",
        participant="desks",
    )
    said: list[str | None] = []

    class AtTheLine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("participant desks serving"):
                said.append(runtime.health())

    handler = AtTheLine()
    logger = logging.getLogger("sagaline.participant")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the runtime never served"
    finally:
        runtime.stop()
        thread.join(60)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert said == [None]
