"""How the participant confirms an accepted (asynchronous) compensation (R12): the
polling of its declared verification while the wait runs.

A verification that keeps failing is reported, not logged at every poll (five a
second for the whole wait, hours of tracebacks); a redelivered command whose
compensation is still being confirmed does not start a second poller.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from participants import Accepted, CompensationContext, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal, ParticipantRuntime
from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas import (
    CompensateStep,
    CompensationAccepted,
    CompensationCommitted,
    ExecuteStep,
    Record,
    derived_event_id,
    envelope_for,
)
from schemas.limits import RESULT_OMITTED, Limits
from schemas.settings import Settings
from schemas.wire import to_message
from tests.system import wait_until

HOUR_S = 3600


def _compensate(
    n: int = 1,
    *,
    saga_id: str | None = None,
    tool_name: str = "book",
    compensation: str = "release",
) -> CompensateStep:
    saga = saga_id or f"s-{n}"
    env = envelope_for(
        CompensateStep,
        saga_id=saga,
        tenant_id="t",
        producer="sagaline-coordinator",
        now=1,
        event_id=derived_event_id(saga, f"compensate/{tool_name}/{n}"),
    )
    return CompensateStep(
        envelope=env,
        step_id=f"0{n}-{tool_name}",
        tool=tool_name,
        compensation=compensation,
        args=b'{"desk":"d7"}',
        result=b'{"desk":"d7"}',
        idempotency_key=f"k-{n}",
        compensation_key=f"c-{n}",
        attempt=1,
    )


class _Flaky:
    """A provider whose status endpoint fails ``failures`` times, then reports the
    release done; each failed call moves the driven clock by ``step_ms``."""

    def __init__(self, failures: int, clock: list[int], step_ms: int) -> None:
        self.failures = failures
        self.clock = clock
        self.step_ms = step_ms
        self.calls = 0

    @tool(description="Book a desk", verify="released")
    @compensable(by="release", completion_within=HOUR_S)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")

    def released(self, ctx: CompensationContext) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            self.clock[0] += self.step_ms
            raise ConnectionError(f"status endpoint down (call {self.calls})")
        return True


def test_a_verification_that_keeps_failing_logs_one_traceback_then_a_summary_a_minute_R12(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The provider's status endpoint is down for two minutes of polls (every 200 ms
    # in production: 600 failures). One traceback (the first), then one line a
    # minute at most with the count and the last error, then one line when it
    # answers again: not a traceback per poll.
    clock = [1_000_000]
    provider = _Flaky(failures=600, clock=clock, step_ms=200)
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(provider, name="desks"),
        "desks",
        journal,
        out.append,
        clock=lambda: clock[0],
        verify_poll_ms=0,
    )
    command = _compensate()
    assert handler.handle(command) == "accepted"
    [(command_id, command_bytes)] = journal.accepted()
    with caplog.at_level(logging.INFO, logger="sagaline.participant"):
        handler.confirm_accepted(command_id, command_bytes)
    handler.close()
    assert provider.calls == 601
    assert isinstance(out[-1], CompensationCommitted)  # confirmed once it answered
    lines = [r for r in caplog.records if r.name == "sagaline.participant"]
    tracebacks = [r.getMessage() for r in lines if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1, len(tracebacks)  # in the message, scrubbed of secrets
    assert "call 1)" in tracebacks[0]
    summaries = [r.getMessage() for r in lines if "still failing" in r.getMessage()]
    assert 1 <= len(summaries) <= 2, summaries  # 120 s of failures: a line a minute
    assert "ConnectionError" in summaries[-1] and "status endpoint down" in summaries[-1]
    recovered = [r.getMessage() for r in lines if "answers again" in r.getMessage()]
    assert len(recovered) == 1 and "600 failed" in recovered[0], recovered
    assert len(lines) <= 5, [r.getMessage() for r in lines]


class _AcceptingDesk:
    """``book``, whose release the provider accepts and finishes later; subclasses
    say how its verification ``released`` answers."""

    @tool(description="Book a desk", verify="released", deadline=300)
    @compensable(by="release", completion_within=HOUR_S)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")

    def released(self, ctx: CompensationContext) -> bool:
        raise NotImplementedError


class _Gated(_AcceptingDesk):
    """``book``'s release is accepted, and its verification waits for the test;
    ``note``'s release is done at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.checks = 0

    def released(self, ctx: CompensationContext) -> bool:
        with self.lock:
            self.checks += 1
        assert self.gate.wait(120)
        return False

    @tool(description="Note a desk")
    @compensable(by="erase")
    def note(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def erase(self, ctx: CompensationContext) -> None:
        pass


def _confirm_threads(participant: str) -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith((f"{participant}-confirm", f"{participant}-verify"))
    )


def test_a_redelivered_accepted_compensation_does_not_start_a_second_poller_R12(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    # R12/R15: the command of an accepted compensation comes again (a redelivery
    # after a rebalance or a lost commit) while its verification is still polled.
    # Its acceptance is re-sent, but the compensation keeps one poller: a second
    # would poll the provider twice as often, and each redelivery one more thread.
    gated = _Gated()
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, settings.topics, ["desks"], 1)
    runtime = ParticipantRuntime(wrap(gated, name="desks"), settings, kafka_bootstrap)
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    producer = create_producer(kafka_bootstrap)

    def send(command: Record) -> None:
        key, value, headers = to_message(command, settings.signer())
        producer.produce(settings.topics.commands("desks"), key=key, value=value, headers=headers)
        assert producer.flush(30) == 0

    def records(saga_id: str) -> Callable[[], list[Record]]:
        return lambda: LedgerReader(kafka_bootstrap).saga_records(
            settings.topics.events, saga_id, settings.signer()
        )

    try:
        assert ready.wait(60), "participant did not start"
        accepted = _compensate(1, saga_id="s-dup")
        send(accepted)
        wait_until(lambda: gated.checks >= 1, 60, "the first verification")
        before = _confirm_threads("desks")
        for _redelivery in range(3):
            send(accepted)
        # After the redeliveries, in the same saga (so handled after them): a
        # compensation whose outcome says they were all handled.
        send(_compensate(2, saga_id="s-dup", tool_name="note", compensation="erase"))
        found = wait_until(
            lambda: [r for r in records("s-dup")() if isinstance(r, CompensationCommitted)],
            60,
            "the later compensation",
        )
        assert found[0].step_id == "02-note"
        assert any(isinstance(r, CompensationAccepted) for r in records("s-dup")())
        assert _confirm_threads("desks") == before
        assert gated.checks == 1  # the one poller is still in its first verification
    finally:
        gated.gate.set()
        runtime.stop()
        thread.join(30)


class _Slow(_AcceptingDesk):
    """Bookings whose verification waits for the test, then reports done."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.checks = 0

    def released(self, ctx: CompensationContext) -> bool:
        with self.lock:
            self.checks += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        assert self.gate.wait(120)
        with self.lock:
            self.inside -= 1
        return True


def test_many_accepted_compensations_within_their_wait_do_not_take_a_thread_each_R12(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    # R12: forty compensations accepted a moment ago, each with an hour to
    # complete, resumed at a start. Their verifications are polled by a fixed set
    # of threads, a few at a time, not by a thread each for the whole hour (whose
    # calls then queued in the tool pool, the queueing eating their deadlines).
    slow = _Slow()
    catalogue = wrap(slow, name="slow")
    journal = CommandJournal(tmp_path / "slow" / "commands.sqlite")
    seeding = CommandHandler(catalogue, "slow", journal, lambda r: None)
    rows = 40
    for n in range(rows):
        assert seeding.handle(_compensate(n)) == "accepted"
    seeding.close()
    journal.close()
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, settings.topics, ["slow"], 1)
    idle = set(_confirm_threads("slow"))
    runtime = ParticipantRuntime(catalogue, settings, kafka_bootstrap)
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "participant did not start"
        wait_until(lambda: slow.inside >= 2, 60, "the first verifications")
        polling = [t for t in _confirm_threads("slow") if t not in idle]
        assert len(polling) <= 9, polling  # 4 pollers, their scheduler, 4 call threads
        slow.gate.set()
        wait_until(lambda: runtime.journal.accepted() == [], 60, "every compensation confirmed")
        assert slow.checks == rows  # each polled until confirmed, once here
        assert slow.most_inside <= 8
    finally:
        slow.gate.set()
        runtime.stop()
        thread.join(30)


class _Held:
    """A table hold whose release the provider confirms by a receipt (no verify)."""

    @tool(description="Hold a table")
    @compensable(by="release", completion_within=HOUR_S)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")


def test_a_receipt_whose_result_is_over_the_limit_completes_with_a_marker_R12(
    tmp_path: Path,
) -> None:
    # The provider's receipt carries a large body (a full statement). Like a
    # compensation's own result, it is informational: over max_result_bytes the
    # ledger gets a marker (size, fingerprint), so the completion can be written.
    # In full it made a record the coordinator parks the saga for, or (over the
    # broker's message.max.bytes) one refused at every try, the compensation never
    # completed.
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(_Held(), name="tables"),
        "tables",
        journal,
        out.append,
        limits=Limits(max_result_bytes=1024),
    )
    assert handler.handle(_compensate()) == "accepted"
    statement = {"lines": ["x" * 100] * 100}  # about 10 KB
    assert handler.complete_accepted("release-k-1", result=statement) is True
    handler.close()
    completion = out[-1]
    assert isinstance(completion, CompensationCommitted)
    assert len(completion.result) < 1024
    assert RESULT_OMITTED in orjson.loads(completion.result)
    assert journal.accepted() == []


class _Checked:
    """Releases confirmed by a verification the test sets, and by receipts."""

    def __init__(self) -> None:
        self.done = False
        self.checks = 0

    @tool(description="Book a desk", verify="released")
    @compensable(by="release", completion_within=HOUR_S)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")

    def released(self, ctx: CompensationContext) -> bool:
        self.checks += 1
        return self.done


def test_a_receipt_for_a_tool_with_a_verification_is_verified_before_it_counts_R12(
    tmp_path: Path,
) -> None:
    # R12: a declared verification must pass before the step counts as
    # compensated. A receipt reaching complete_accepted for such a tool is not
    # "verified" by itself: the verification runs, and while it does not pass the
    # receipt records nothing (the compensation stays accepted and polled).
    desks = _Checked()
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(wrap(desks, name="desks"), "desks", journal, out.append)
    assert handler.handle(_compensate()) == "accepted"
    assert handler.complete_accepted("release-k-1") is False
    assert desks.checks == 1
    assert not any(isinstance(r, CompensationCommitted) for r in out)
    assert [row_id for row_id, _c in journal.accepted()] == [_compensate().event_id]
    desks.done = True
    assert handler.complete_accepted("release-k-1") is True
    handler.close()
    completion = out[-1]
    assert isinstance(completion, CompensationCommitted) and completion.verified is True
    assert journal.accepted() == []


class _Stuck(_AcceptingDesk):
    """``book``'s releases are accepted; the verification of ``c-1`` blocks until the
    test releases it, the others pass at once. ``note`` is an ordinary tool."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.stuck_calls = 0
        self.noted = 0

    def released(self, ctx: CompensationContext) -> bool:
        if ctx.compensation_key != "c-1":
            return True
        with self.lock:
            self.stuck_calls += 1
        self.gate.wait()
        return False

    @tool(description="Look a desk up", read_only=True, deadline=60)
    def note(self, desk: str) -> dict[str, str]:
        with self.lock:
            self.noted += 1
        return {"desk": desk}


class _Hung(_Stuck):
    """As :class:`_Stuck`, the verification's deadline 300 ms: the blocked call
    overruns it."""

    @tool(description="Book a desk", verify="released", deadline=0.3)
    @compensable(by="release", completion_within=HOUR_S)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}


def _execute(saga_id: str) -> ExecuteStep:
    body = b'{"desk":"d9"}'
    return ExecuteStep(
        envelope=envelope_for(
            ExecuteStep,
            saga_id=saga_id,
            tenant_id="t",
            producer="sagaline-coordinator",
            now=1,
            event_id=derived_event_id(saga_id, "exec/note"),
        ),
        step_id="01-note",
        tool="note",
        args=body,
        idempotency_key=f"k-{saga_id}",
        attempt=1,
        deadline_ms=60_000,
        principal="agent",
    )


def _accept(handler: CommandHandler, journal: CommandJournal, n: int) -> str:
    command = _compensate(n)
    assert handler.handle(command) == "accepted"
    return command.event_id


def test_verifications_do_not_queue_in_a_tool_pool_of_one_R12(tmp_path: Path) -> None:
    # --max-in-flight 1: the handler's tool pool has one thread. A verification that
    # takes long (the provider's status endpoint is slow) must not hold up the
    # verification of another accepted compensation (queued behind it, the wait
    # counted against its deadline), nor a command.
    stuck = _Stuck()
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(wrap(stuck, name="desks"), "desks", journal, out.append, workers=1)
    try:
        first = _accept(handler, journal, 1)
        second = _accept(handler, journal, 2)
        by_id = dict(journal.accepted())
        handler.confirm_in_background(first, by_id[first])
        wait_until(lambda: stuck.stuck_calls >= 1, 60, "the slow verification")
        handler.confirm_in_background(second, by_id[second])
        wait_until(
            lambda: [r for r in out if isinstance(r, CompensationCommitted)],
            60,
            "the other compensation confirmed while the slow verification runs",
        )
        assert handler.handle(_execute("s-note")) == "done"
        assert stuck.noted == 1
        assert stuck.stuck_calls == 1
    finally:
        stuck.gate.set()
        handler.close()


def test_a_hung_verification_is_not_called_again_and_takes_no_tool_thread_R12(
    tmp_path: Path,
) -> None:
    # A verification hangs past its deadline (300 ms). Each later poll of that
    # compensation used to start another call on the tool pool while the first
    # still ran: a few polls filled the pool, and every command then timed out
    # waiting for a thread. Now a compensation has at most one call outstanding (a
    # poll while it runs counts as a failure), and commands keep their threads.
    stuck = _Hung()
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(stuck, name="desks"), "desks", journal, out.append, workers=2, verify_poll_ms=50
    )
    try:
        first = _accept(handler, journal, 1)
        handler.confirm_in_background(first, dict(journal.accepted())[first])

        def failures() -> int:
            entry = handler._confirmations._entries.get(first)
            return getattr(getattr(entry, "failures", None), "_count", 0)

        wait_until(lambda: failures() >= 4, 60, "polls after the hung call's deadline")
        assert stuck.stuck_calls == 1
        assert handler.handle(_execute("s-note")) == "done"
        assert stuck.noted == 1
    finally:
        stuck.gate.set()
        handler.close()


class _CountingJournal(CommandJournal):
    """A journal that counts its reads of rows."""

    reads = 0

    def get(self, command_id: str) -> tuple[str, bytes | None] | None:
        self.reads += 1
        return super().get(command_id)

    def accepted(self) -> list[tuple[str, bytes]]:
        rows = super().accepted()
        self.reads += len(rows)
        return rows

    def command(self, command_id: str) -> bytes | None:
        self.reads += 1
        return super().command(command_id)

    def accepted_outcomes(self) -> list[tuple[str, bytes]]:
        rows = super().accepted_outcomes()
        self.reads += len(rows)
        return rows


def test_a_receipt_reads_its_own_journal_row_not_every_accepted_one_R12(tmp_path: Path) -> None:
    # A provider's webhook calls complete_accepted once per completed operation.
    # It read and decoded every accepted row to find the one with that operation
    # id: with thousands of accepted compensations, each receipt (and each retried
    # receipt of one already completed) cost as many reads. Now it reads the row
    # of its operation (an index kept in memory, built from the journal once).
    out: list[Record] = []
    path = tmp_path / "journal.sqlite"
    seeding = CommandHandler(
        wrap(_Held(), name="tables"), "tables", CommandJournal(path), out.append
    )
    rows = 30
    for n in range(rows):
        assert seeding.handle(_compensate(n)) == "accepted"
    seeding.close()
    journal = _CountingJournal(path)  # an existing journal, as at a restart
    handler = CommandHandler(wrap(_Held(), name="tables"), "tables", journal, out.append)
    try:
        assert handler.complete_accepted("release-k-0") is True
        journal.reads = 0
        assert handler.complete_accepted(f"release-k-{rows - 1}") is True
        assert handler.complete_accepted(f"release-k-{rows - 1}") is False  # a retried receipt
        assert handler.complete_accepted("release-unknown") is False
        assert journal.reads <= 3, journal.reads
        # one accepted later, found too
        assert handler.handle(_compensate(rows)) == "accepted"
        assert handler.complete_accepted(f"release-k-{rows}") is True
        assert len(journal.accepted()) == rows - 2
    finally:
        handler.close()


def test_a_confirmation_whose_completion_could_not_be_written_is_tried_again_R12(
    tmp_path: Path,
) -> None:
    # The verification passes, but the CompensationCommitted cannot be written
    # this once (the broker unreachable past the producer's delivery timeout, or
    # a full disk). The confirmation used to end there, the row left accepted
    # until the next start: the compensation had completed, but the coordinator
    # raised an incident when its wait ended. It is polled again instead.
    desks = _Checked()
    desks.done = True
    out: list[Record] = []
    refused: list[Record] = []

    def append(record: Record) -> None:
        if isinstance(record, CompensationCommitted) and not refused:
            refused.append(record)
            raise RuntimeError("delivery failed: broker unreachable")
        out.append(record)

    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(wrap(desks, name="desks"), "desks", journal, append, verify_poll_ms=0)
    try:
        command_id = _accept(handler, journal, 1)
        handler.confirm_in_background(command_id, dict(journal.accepted())[command_id])
        wait_until(lambda: journal.accepted() == [], 60, "the completion written at last")
        assert refused
        assert [r for r in out if isinstance(r, CompensationCommitted)]
    finally:
        handler.close()


class _FirstGated(_AcceptingDesk):
    """A verification whose first call (a poll) waits for the test and does not
    pass; the later ones pass."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.calls = 0

    def released(self, ctx: CompensationContext) -> bool:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.gate.wait()
        return not first


def test_a_receipt_during_a_poll_of_its_compensation_waits_for_it_then_counts_R12(
    tmp_path: Path,
) -> None:
    # The provider's webhook comes while a poll's verification of the same
    # compensation is under way. The receipt waits for that call (a compensation
    # has one verification call at a time), then runs its own, and is recorded:
    # it is not refused because a poll happened to be running.
    desks = _FirstGated()
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(desks, name="desks"), "desks", journal, out.append, verify_poll_ms=HOUR_S * 1000
    )
    answers: list[bool] = []
    try:
        command_id = _accept(handler, journal, 1)
        handler.confirm_in_background(command_id, dict(journal.accepted())[command_id])
        wait_until(lambda: desks.calls >= 1, 60, "the poll's verification")
        receipt = threading.Thread(
            target=lambda: answers.append(handler.complete_accepted("release-k-1"))
        )
        receipt.start()
        receipt.join(5)  # not a synchronisation: gives a receipt refused at once time to show
        desks.gate.set()
        receipt.join(60)
        assert answers == [True]
        assert len([r for r in out if isinstance(r, CompensationCommitted)]) == 1
        assert journal.accepted() == []
    finally:
        desks.gate.set()
        handler.close()


_CLOSE_WITH_A_HUNG_VERIFICATION = """
import sys
from pathlib import Path

from participants import wrap
from participants.runtime import CommandHandler, CommandJournal
from tests.system import wait_until
from tests.test_accepted_confirmations import _accept, _Stuck

stuck = _Stuck()  # c-1's verification blocks; its deadline is 300 s
journal = CommandJournal(Path(sys.argv[1]) / "journal.sqlite")
handler = CommandHandler(wrap(stuck, name="desks"), "desks", journal, [].append, workers=1)
first = _accept(handler, journal, 1)
handler.confirm_in_background(first, dict(journal.accepted())[first])
wait_until(lambda: stuck.stuck_calls >= 1, 60, "the verification hanging")
handler.close()
journal.close()
print("closed", flush=True)
"""


def test_a_hung_verification_does_not_hold_the_process_exit_after_close_R12(
    tmp_path: Path,
) -> None:
    # A participant stopping (even on a second SIGTERM) closes its handler and
    # returns; the interpreter then waits for the confirmations' pool threads, one
    # of which waited for a hung verification up to its deadline (an hour for a
    # long one). What is unconfirmed is resumed from the journal at the next start.
    root = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CLOSE_WITH_A_HUNG_VERIFICATION, str(tmp_path)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            timeout=120,  # the verification's deadline is 300 s
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: it waited for the hung verification")
    assert done.returncode == 0, done.stderr
    assert "closed" in done.stdout


def _locked_error(tmp_path: Path) -> sqlite3.OperationalError:
    """A real SQLITE_BUSY (``database is locked``): a read while another connection
    holds the file's exclusive lock."""
    path = tmp_path / "locked.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    reader = sqlite3.connect(path, isolation_level=None, timeout=0)
    with pytest.raises(sqlite3.OperationalError) as raised:
        reader.execute("SELECT * FROM t").fetchall()
    holder.close()
    reader.close()
    assert raised.value.sqlite_errorcode & 0xFF == 5, raised.value.sqlite_errorname
    return raised.value


def test_a_confirmation_whose_journal_read_fails_for_now_is_tried_again_R12(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first poll of an accepted compensation reads its journal row, and SQLite
    # answers "database is locked" this once (another process's lock held past the
    # timeout). The confirmation used to end there ("resumed at the next start"),
    # the row left accepted while the participant ran on: the compensation completed
    # but went unconfirmed, and the coordinator raised an incident when its wait
    # ended. Like a failing write, it is tried again at the next poll instead.
    desks = _Checked()
    desks.done = True
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(desks, name="desks"), "desks", journal, out.append, verify_poll_ms=0
    )
    error = _locked_error(tmp_path)
    get = journal.get
    failed: list[str] = []

    def locked_once(command_id: str) -> tuple[str, bytes | None] | None:
        if not failed:
            failed.append(command_id)
            raise error
        return get(command_id)

    try:
        command_id = _accept(handler, journal, 1)
        monkeypatch.setattr(journal, "get", locked_once)
        handler.confirm_in_background(command_id, dict(journal.accepted())[command_id])
        wait_until(lambda: journal.accepted() == [], 30, "the compensation confirmed")
        assert failed == [command_id]
        assert [r.compensation_key for r in out if isinstance(r, CompensationCommitted)] == ["c-1"]
    finally:
        handler.close()
