"""The command handler's journal around a tool call, without a broker.

The intent's trip to the broker and the journal's synced "started" overlap, and the
tool runs only once both are done (R10); an intent the broker refused leaves no
"started" behind, so the redelivered command runs its tool instead of being reported
as an unknown outcome. A compensation writes no "started"; an accepted one still
keeps its command in the journal, which confirms it after a restart (R12).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest

from participants import Accepted, CompensationContext, LookupResult, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal
from sagaline.kafka import DeliveryFailed
from schemas import (
    CompensateStep,
    CompensationAccepted,
    CompensationFailed,
    ExecuteStep,
    FailureKind,
    Record,
    StepCommitted,
    StepFailed,
    StepIntentRecorded,
    StepOutcomeUnknown,
    envelope_for,
)
from schemas.codec import decode
from schemas.redaction import Secret, redaction_marker
from schemas.sealing import Sealer
from tests.test_accepted_confirmations import _compensate

R = TypeVar("R", bound=Record)


class _Desk:
    def __init__(self) -> None:
        self.events: list[str] = []

    @tool(description="Book a desk")
    @compensable(by="release", completion_within=30)
    def book(self, desk: str) -> dict[str, str]:
        self.events.append(f"ran {desk}")
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        self.events.append("released")
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")


def _cmd(cls: type[R], **fields: object) -> R:
    env = envelope_for(cls, saga_id="s-1", tenant_id="t", producer="sagaline-coordinator", now=1)
    return cls(envelope=env, **fields)


def _execute() -> ExecuteStep:
    return _cmd(
        ExecuteStep,
        step_id="01-book",
        tool="book",
        args=b'{"desk":"d7"}',
        idempotency_key="k-1",
        attempt=1,
        deadline_ms=5000,
        principal="p",
    )


def _handler(
    tmp_path: Path,
    begin_append: Callable[[Record], Callable[[], None]] | None = None,
) -> tuple[CommandHandler, list[Record], _Desk]:
    desk = _Desk()
    out: list[Record] = []
    handler = CommandHandler(
        wrap(desk, name="desks"),
        "desks",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
        ledger=None,
        begin_append=begin_append,
    )
    return handler, out, desk


def test_the_tool_runs_once_the_intent_is_acknowledged_and_started_is_journalled(
    tmp_path: Path,
) -> None:
    command = _execute()
    events: list[str] = []
    journal_at_ack: list[object] = []
    handler: CommandHandler

    def begin_append(record: Record) -> Callable[[], None]:
        events.append(f"sent {record.TYPE}")

        def wait() -> None:
            journal_at_ack.append(handler.journal.get(command.event_id))
            events.append("acknowledged")

        return wait

    handler, out, desk = _handler(tmp_path, begin_append)
    assert handler.handle(command) == "done"
    assert events == ["sent StepIntentRecorded", "acknowledged"]
    assert journal_at_ack == [("started", None)]  # on disk before the wait ended
    assert desk.events == ["ran d7"]
    assert [type(r) for r in out] == [StepCommitted]  # the outcome goes out by append
    handler.close()


def test_an_intent_the_broker_refused_leaves_the_command_to_run_again(tmp_path: Path) -> None:
    command = _execute()
    refuse = [True]
    sent: list[Record] = []

    def begin_append(record: Record) -> Callable[[], None]:
        sent.append(record)

        def wait() -> None:
            if refuse.pop(0) if refuse else False:
                raise DeliveryFailed("the broker said no", topic="events", error=None)

        return wait

    handler, out, desk = _handler(tmp_path, begin_append)
    with pytest.raises(DeliveryFailed):
        handler.handle(command)
    assert desk.events == []  # the tool never ran ...
    seen = handler.journal.get(command.event_id)  # ... so nothing says it may have:
    assert seen is not None and seen[0] == "unstarted"  # its intent kept as its own
    assert handler.handle(command) == "done"  # the redelivery runs it, once
    assert desk.events == ["ran d7"]
    assert [type(r) for r in sent] == [StepIntentRecorded, StepIntentRecorded]
    assert [type(r) for r in out] == [StepCommitted]
    handler.close()


def test_a_command_started_before_a_crash_is_an_unknown_outcome_R11(tmp_path: Path) -> None:
    command = _execute()
    handler, out, desk = _handler(tmp_path)
    handler.journal.mark(command.event_id, "started")  # what a crash mid-tool leaves
    handler.handle(command)
    assert desk.events == []
    assert [type(r) for r in out] == [StepOutcomeUnknown]
    handler.close()


def test_a_command_started_before_a_crash_of_a_tool_since_removed_is_an_unknown_outcome_R11(
    tmp_path: Path,
) -> None:
    # A crash mid-tool, then a deploy that no longer serves the tool (renamed or
    # removed): the tool may have acted, so the redelivered command is an unknown
    # outcome to reconcile (R11), never a rejection saying nothing happened (a step
    # that never committed is never compensated).
    command = _execute()
    journal = CommandJournal(tmp_path / "journal.sqlite")
    journal.mark(command.event_id, "started")  # what a crash mid-tool leaves
    out: list[Record] = []

    class _Other:
        @tool(description="Something else", read_only=True)
        def other(self) -> str:
            return "other"

    handler = CommandHandler(wrap(_Other(), name="desks"), "desks", journal, out.append)
    handler.handle(command)
    assert [type(r) for r in out] == [StepOutcomeUnknown]
    handler.close()


def test_an_accepted_compensation_keeps_its_command_without_a_started_mark(
    tmp_path: Path,
) -> None:
    handler, out, desk = _handler(tmp_path)
    compensate = _compensate()
    assert handler.handle(compensate) == "accepted"
    assert desk.events == ["released"]
    assert [type(r) for r in out] == [CompensationAccepted]
    [(command_id, command)] = handler.journal.accepted()
    assert command_id == compensate.event_id
    assert decode(command, CompensateStep) == compensate
    handler.close()


class _Vault:
    def __init__(self) -> None:
        self.ran = 0

    @tool(description="Check a secret", read_only=True)
    def store(self, token: Secret) -> dict[str, str]:
        self.ran += 1
        return {"stored": "yes"}


def _store_with_the_key(tmp_path: Path, args: dict[str, Any]) -> tuple[StepFailed, _Vault]:
    """The vault's ``store`` called with ``args`` at a participant holding the key:
    the one StepFailed it answered (the command done), and the vault."""
    vault = _Vault()
    out: list[Record] = []
    handler = CommandHandler(
        wrap(vault, name="vault"),
        "vault",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
        ledger=None,
        sealer=Sealer(b"shared secret"),
    )
    command = _cmd(
        ExecuteStep,
        step_id="01-store",
        tool="store",
        args=orjson.dumps(args),
        idempotency_key="k-2",
        attempt=1,
        deadline_ms=5000,
        principal="p",
    )
    assert handler.handle(command) == "done"
    [failed] = [r for r in out if isinstance(r, StepFailed)]
    handler.close()
    return failed, vault


def test_a_malformed_sealed_argument_rejects_the_step_and_the_tool_never_runs(
    tmp_path: Path,
) -> None:
    # A SealError is a business rejection (sending it again cannot open it), whatever
    # is wrong with the sealed value: here its base64 does not even decode.
    args = {"token": {"$sealed": "not base64!", "fp": "x", "kid": "s1"}}
    failed, vault = _store_with_the_key(tmp_path, args)
    assert (failed.kind, failed.error_type) == (FailureKind.BUSINESS_REJECTION, "SealError")
    assert "malformed" in failed.message
    assert vault.ran == 0


@pytest.mark.parametrize("marker", ["[redacted]", "[redacted hmac:0123456789ab]"])
def test_a_secret_the_agent_redacted_is_refused_by_a_participant_holding_the_key(
    tmp_path: Path, marker: str
) -> None:
    """An agent without SAGALINE_SECRET_KEY redacts a secret argument; a participant
    that holds the key ran the tool with the marker as the secret (a charge of card
    "[redacted]", the saga COMPLETED), where a key mismatch the other way round is a
    SealError. Now a business rejection too, saying what to set; the tool never runs.
    (A participant without a key still gets the marker, as documented.)"""
    failed, vault = _store_with_the_key(tmp_path, {"token": marker})
    assert (failed.kind, failed.error_type) == (FailureKind.BUSINESS_REJECTION, "SealError")
    assert "'token'" in failed.message and "SAGALINE_SECRET_KEY" in failed.message, failed
    assert vault.ran == 0


class _Provider:
    @tool(description="Charge a saved card token")
    @compensable(by="refund")
    def charge(self, token: Secret, amount: int) -> dict[str, str]:
        # What provider SDKs do: the error quotes the request.
        raise ValueError(f"No such token: '{token}' (amount {amount})")

    def refund(self, ctx: CompensationContext) -> None:
        raise RuntimeError(f"refund refused for token {ctx.input['token']}")


def test_a_tool_error_quoting_a_secret_argument_reaches_the_ledger_redacted(
    tmp_path: Path,
) -> None:
    token = "tok_live_51HxQ9e2"
    sealer = Sealer(b"shared secret")
    out: list[Record] = []
    handler = CommandHandler(
        wrap(_Provider(), name="provider"),
        "provider",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
        ledger=None,
        sealer=sealer,
    )
    args = orjson.dumps(sealer.seal({"token": token, "amount": 5}, ["token"], "s-1"))
    execute = _cmd(
        ExecuteStep,
        step_id="01-charge",
        tool="charge",
        args=args,
        idempotency_key="k-3",
        attempt=1,
        deadline_ms=5000,
        principal="p",
    )
    compensate = _cmd(
        CompensateStep,
        step_id="01-charge",
        tool="charge",
        idempotency_key="k-3",
        compensation="refund",
        compensation_key="k-3:c",
        attempt=1,
        args=args,
        result=b"{}",
    )
    assert handler.handle(execute) == "done"
    assert handler.handle(compensate) == "done"
    [failed] = [r for r in out if isinstance(r, StepFailed)]
    [comp_failed] = [r for r in out if isinstance(r, CompensationFailed)]
    for record in (failed, comp_failed):
        assert token not in record.message
        assert sealer.marker(token) in record.message  # keyed, as the sealed fp
        assert redaction_marker(token, sealer.marker_key) in record.message
    assert "amount 5" in failed.message  # the rest of the message is kept
    handler.close()


class _Cli:
    """Tools over a click/argparse-style library: a bad input raises SystemExit."""

    @tool(description="Charge through a CLI", lookup="find")
    @compensable(by="refund")
    def charge(self, amount: int) -> dict[str, str]:
        raise SystemExit(2)

    def refund(self, ctx: CompensationContext) -> None:
        raise SystemExit("usage: refund ID")

    def find(self, idempotency_key: str) -> LookupResult | None:
        raise SystemExit(1)


def test_a_compensation_or_lookup_raising_system_exit_is_its_steps_failure(
    tmp_path: Path,
) -> None:
    # R8/R11/R16: SystemExit passes every ``except Exception``; it is the call's
    # failure like any error: a CompensationFailed (tried again), a lookup that
    # could not answer (PENDING), never a lost command.
    from schemas import ReconcileResult, ReconcileStep, StepReconciled

    out: list[Record] = []
    handler = CommandHandler(
        wrap(_Cli(), name="cli"), "cli", CommandJournal(tmp_path / "j.sqlite"), out.append
    )
    compensate = _cmd(
        CompensateStep,
        step_id="01-charge",
        tool="charge",
        idempotency_key="k-4",
        compensation="refund",
        compensation_key="k-4:c",
        attempt=1,
        args=b'{"amount":5}',
        result=b"{}",
    )
    reconcile = _cmd(
        ReconcileStep, step_id="01-charge", tool="charge", idempotency_key="k-4", attempt=1
    )
    assert handler.handle(compensate) == "done"
    assert handler.handle(reconcile) == "done"
    [failed, reconciled] = out
    assert isinstance(failed, CompensationFailed)
    assert (failed.kind, failed.error_type) == (FailureKind.TRANSIENT, "SystemExit")
    assert isinstance(reconciled, StepReconciled)
    assert reconciled.outcome is ReconcileResult.PENDING
    handler.close()


def test_a_journal_that_cannot_write_for_a_while_delays_the_command_not_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R10/R16, the path that handles a command whole on a tool thread (after a ledger
    # probe, arguments by reference): a full disk for the journal's first writes
    # (the "started" mark, then the outcome) is waited out, not a failure of the
    # command (which went to the DLQ with its tool's outcome unreported); the tool
    # and the compensation each run once and each outcome goes out once.
    import sqlite3

    handler, out, desk = _handler(tmp_path)
    write = handler.journal._write
    failures = {"left": 2}

    def full_disk(rows: list[object]) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        write(rows)  # type: ignore[arg-type]

    monkeypatch.setattr(handler.journal, "_write", full_disk)
    command = _execute()
    assert handler.handle(command) == "done"
    assert desk.events == ["ran d7"]
    assert [type(r) for r in out] == [StepIntentRecorded, StepCommitted]
    seen = handler.journal.get(command.event_id)
    assert seen is not None and seen[0] == "done"

    failures["left"] = 2  # now the compensation's outcome
    compensate = _compensate()
    assert handler.handle(compensate) == "accepted"
    assert desk.events == ["ran d7", "released"]
    assert [type(r) for r in out] == [StepIntentRecorded, StepCommitted, CompensationAccepted]
    assert failures["left"] == 0
    handler.close()


def test_a_command_waiting_for_the_journal_gives_up_when_the_runtime_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop while the disk stays full does not hang on the waiting command: it gives
    # up (the runtime leaves it for redelivery, see _process), its tool never ran.
    import sqlite3

    from participants.runtime import journal_unwritable

    handler, out, desk = _handler(tmp_path)

    def full_disk(rows: list[object]) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(handler.journal, "_write", full_disk)
    handler.stop_waiting()
    with pytest.raises(RuntimeError, match="disk is full") as raised:
        handler.handle(_execute())
    assert journal_unwritable(raised.value)
    assert desk.events == []
    assert [type(r) for r in out] == [StepIntentRecorded]  # no outcome: none was had
    handler.close()


def _sqlite_error(how: str, tmp_path: Path) -> Exception:
    """A real error from SQLite: ``read-only`` (SQLITE_READONLY, as a file system
    remounted read-only), ``locked`` (SQLITE_BUSY: another connection's lock)."""
    import sqlite3

    path = tmp_path / f"{how}.sqlite"
    db = sqlite3.connect(path, isolation_level=None, timeout=0)
    db.execute("CREATE TABLE t (x)")
    if how == "read-only":
        db.execute("PRAGMA query_only = 1")
    else:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(sqlite3.OperationalError) as raised:
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t VALUES (1)")
    return raised.value


def _first_write_fails(
    handler: CommandHandler, error: Exception, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """``handler``'s journal raises ``error`` at its first write, then writes; the
    number of rows of each write tried."""
    write = handler.journal._write
    calls: list[int] = []

    def once(rows: list[Any]) -> None:
        calls.append(len(rows))
        if len(calls) == 1:
            raise error
        write(rows)

    monkeypatch.setattr(handler.journal, "_write", once)
    return calls


def test_a_journal_sqlite_refuses_for_good_is_not_waited_for_and_runs_no_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLITE_READONLY (the file system remounted read-only) does not pass by waiting:
    # the mark fails at once (the runtime stops, the command left uncommitted), the
    # tool does not run. Before, it was waited out as a full disk, every second.
    import participants.runtime as runtime_module

    handler, out, desk = _handler(tmp_path)
    calls = _first_write_fails(handler, _sqlite_error("read-only", tmp_path), monkeypatch)
    with pytest.raises(RuntimeError, match="readonly") as raised:
        handler.handle(_execute())
    assert runtime_module.journal_unusable(raised.value)
    assert not runtime_module.journal_unwritable(raised.value)
    assert calls == [1]  # not tried again
    assert desk.events == []
    assert [type(r) for r in out] == [StepIntentRecorded]  # no outcome: none was had
    handler.close()


def test_a_journal_waited_for_says_what_sqlite_said_not_always_free_disk_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    handler, _out, desk = _handler(tmp_path)
    _first_write_fails(handler, _sqlite_error("locked", tmp_path), monkeypatch)
    with caplog.at_level(logging.WARNING, logger="sagaline.participant"):
        assert handler.handle(_execute()) == "done"
    [said] = [r.getMessage() for r in caplog.records if "journal write failed" in r.getMessage()]
    assert "SQLITE_BUSY" in said and "free disk space" not in said, said
    assert desk.events == ["ran d7"]
    handler.close()


_OPEN_READ_ONLY = """
import os, sqlite3, sys
from pathlib import Path
from participants.runtime import CommandJournal
if os.geteuid() == 0:
    os.setuid(65534)  # root writes a read-only file all the same: open it as nobody
try:
    journal = CommandJournal(Path(sys.argv[1]))
except sqlite3.Error as exc:
    print(f"refused: {exc}")
else:
    print(f"opened: {journal.get('a')}")
"""


def test_a_journal_file_that_cannot_be_written_is_refused_at_open_not_a_silent_stall() -> None:
    # A journal SQLite can read but not write (a file left read-only, owned by another
    # user): opened, every mark would fail as "unwritable for now" and every command
    # wait for good behind a hint to free disk space. It is refused when opened, so
    # the participant does not start (one line naming it) instead.
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        os.chmod(where, 0o777)
        path = Path(where) / "commands.sqlite"
        journal = CommandJournal(path)
        journal.mark("a", "done", outcome=b"x")
        journal.close()
        os.chmod(path, 0o444)
        child = subprocess.run(
            [sys.executable, "-c", _OPEN_READ_ONLY, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("refused: "), child.stdout
    assert "read-only" in child.stdout and str(path) in child.stdout, child.stdout


def test_an_operation_id_reader_that_raises_still_commits_the_step_the_tool_acted_on(
    tmp_path: Path,
) -> None:
    # @tool(operation_id=callable) reads the provider's id from the result; one that
    # raises on a result it did not expect must not turn a step whose tool acted into
    # a failure of the command (dead-lettered: its saga waits, the effect is never
    # compensated). The step commits, without the id.
    class _Payments:
        def __init__(self) -> None:
            self.charged = 0

        @tool(description="Charge", operation_id=lambda result: result["id"])
        @compensable(by="refund")
        def charge(self, desk: str) -> dict[str, str]:
            self.charged += 1
            return {"charge": "ch-1"}  # no "id"

        def refund(self) -> None:
            pass

    payments = _Payments()
    out: list[Record] = []
    handler = CommandHandler(
        wrap(payments, name="desks"),
        "desks",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
    )
    command = _execute().model_copy(update={"tool": "charge"})
    assert handler.handle(command) == "done"
    assert payments.charged == 1
    committed = [r for r in out if isinstance(r, StepCommitted)]
    assert len(committed) == 1 and committed[0].provider_operation_id is None
    assert orjson.loads(committed[0].result) == {"charge": "ch-1"}
    handler.close()


def test_a_result_orjson_refuses_outright_still_commits_the_step_the_tool_acted_on(
    tmp_path: Path,
) -> None:
    # orjson refuses some results without asking for help: a dict keyed by ints (a
    # status per order id), a file name read with surrogateescape, an int past 64
    # bits. The tool has acted, so the outcome is written all the same (keys as
    # strings, the lone surrogate as "?", the int as its digits), not dead-lettered.
    class _Orders:
        @tool(description="Ship", read_only=True)
        def ship(self, desk: str) -> dict[Any, Any]:
            return {7: "shipped", "file": "label-\udcff.pdf", "big": 2**70}

    out: list[Record] = []
    handler = CommandHandler(
        wrap(_Orders(), name="desks"),
        "desks",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
    )
    command = _execute().model_copy(update={"tool": "ship"})
    assert handler.handle(command) == "done"
    committed = [r for r in out if isinstance(r, StepCommitted)]
    assert len(committed) == 1
    assert orjson.loads(committed[0].result) == {
        "7": "shipped",
        "file": "label-?.pdf",
        "big": str(2**70),
    }
    handler.close()


def test_a_receipt_arriving_while_the_acceptance_is_being_journalled_completes_it_R12(
    tmp_path: Path,
) -> None:
    # A provider may send its completion receipt (a webhook) as soon as it answered
    # the compensation, before the runtime has journalled the acceptance. That
    # receipt must not be answered "no such accepted compensation" and dropped: with
    # no verify= nothing else would ever confirm it (the coordinator's incident at
    # the end of the wait). It waits for the acceptance, then completes it.
    import threading

    from schemas import CompensationCommitted

    handler, out, _desk = _handler(tmp_path)
    journal = handler.journal
    compensate = _compensate()
    marking, gate, looked = threading.Event(), threading.Event(), threading.Event()
    mark, get = journal.mark, journal.get

    def slow_mark(command_id: str, state: str, **kw: bytes | None) -> None:
        if state == "accepted":
            marking.set()
            assert gate.wait(60)
        mark(command_id, state, **kw)

    def watched_get(command_id: str) -> tuple[str, bytes | None] | None:
        found = get(command_id)
        if marking.is_set() and command_id == compensate.event_id and found is None:
            looked.set()  # the receipt found no acceptance journalled yet
        return found

    journal.mark = slow_mark  # type: ignore[method-assign]
    journal.get = watched_get  # type: ignore[method-assign]
    handled: list[str] = []
    answered: list[bool] = []
    compensating = threading.Thread(target=lambda: handled.append(handler.handle(compensate)))
    compensating.start()
    assert marking.wait(60), "the compensation was not journalled"
    receipt = threading.Thread(
        target=lambda: answered.append(handler.complete_accepted("release-k-1", {"ok": 1}))
    )
    receipt.start()
    assert looked.wait(60), "the receipt did not look for the acceptance"
    gate.set()
    compensating.join(60)
    receipt.join(60)
    assert handled == ["accepted"]
    assert answered == [True]
    assert [type(r) for r in out] == [CompensationAccepted, CompensationCommitted]
    seen = get(compensate.event_id)
    assert seen is not None and seen[0] == "done"
    handler.close()


def test_a_new_journal_and_its_wal_and_shm_are_readable_by_their_owner_only(
    tmp_path: Path,
) -> None:
    # The journal holds every command's arguments and every outcome (a tool's
    # result): a new one is made 0600 whatever the umask, and SQLite gives its -wal
    # and -shm files the mode of the database file. Before: 0644 under umask 022.
    import os
    import stat

    path = tmp_path / "state" / "commands.sqlite"
    umask = os.umask(0o022)
    try:
        journal = CommandJournal(path)
        journal.write([("c1", "done", b"cmd", b"out", 1)])
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.parent.iterdir()}
        journal.close()
    finally:
        os.umask(umask)
    assert set(modes) == {"commands.sqlite", "commands.sqlite-wal", "commands.sqlite-shm"}
    assert modes == dict.fromkeys(modes, 0o600), {k: oct(v) for k, v in modes.items()}
