"""A damaged command journal stops the participant instead of dead-lettering every
command.

SQLite reports a damaged page as ``database disk image is malformed``
(SQLITE_CORRUPT). Before the fix the runtime took that for one command's failure:
each command whose journal lookup crossed the page went to the DLQ as
``handler-error`` and its offset was committed, so every saga that reached this
participant stalled, and nothing came back once the file was repaired. The journal
is the participant's own storage, not bad input (R16): the runtime now ends with an
error naming the file, leaving the command uncommitted for the next run.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from participants import CompensationContext, wrap
from participants.runtime import (
    CommandHandler,
    CommandJournal,
    JournalCorrupt,
    JournalPruning,
    ParticipantRuntime,
)
from schemas import StepCommitted, StepOutcomeUnknown
from schemas.settings import Settings
from tests.system import wait_until
from tests.test_accepted_confirmations import _AcceptingDesk, _compensate
from tests.test_participant_runtime import PARTICIPANT, Harness, _dead_letters, _of, serving


def _journal_with_a_damaged_index(path: Path) -> None:
    """A real journal of 300 done rows whose primary-key index root page is
    overwritten: a whole-table scan still reads, a lookup by command id does not."""
    journal = CommandJournal(path)
    journal.write([(f"old-{i}", "done", b"c" * 200, b"o" * 200, i) for i in range(300)])
    journal.close()
    db = sqlite3.connect(path)
    (root,) = db.execute(
        "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = 'handled'"
    ).fetchone()
    page = int(db.execute("PRAGMA page_size").fetchone()[0])
    db.close()
    with path.open("r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * page)
    with pytest.raises(sqlite3.DatabaseError, match="malformed"):
        CommandJournal(path).get("old-1")


def _stopped_by_a_command(
    harness: Harness, thread: threading.Thread, raised: list[BaseException]
) -> BaseException:
    """Send ``harness`` a command: the runtime serving on ``thread`` must stop,
    dead-lettering nothing; the one error it raised."""
    harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
    wait_until(
        lambda: not thread.is_alive() or _dead_letters(harness),
        60,
        "the runtime stopped or dead-lettered the command",
    )
    assert _dead_letters(harness) == []
    thread.join(30)
    assert not thread.is_alive()
    [error] = raised
    return error


def test_a_damaged_journal_stops_the_participant_and_dead_letters_nothing_R16(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    harness = Harness(transport, unique_prefix, tmp_path)
    path = tmp_path / PARTICIPANT / "commands.sqlite"
    path.parent.mkdir(parents=True)
    _journal_with_a_damaged_index(path)
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT
    )
    thread, raised = serving(runtime)
    error = _stopped_by_a_command(harness, thread, raised)
    assert isinstance(error, JournalCorrupt), repr(error)
    assert str(path) in str(error) and "malformed" in str(error), str(error)
    assert harness.shop.count("reserve") == 0

    # The command was left uncommitted: with the damaged file moved aside, the next
    # run gets it again and runs it, once.
    shutil.move(path, tmp_path / "damaged.sqlite")
    harness.start()
    try:
        records = harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
        assert [c.step_id for c in _of(records, StepCommitted)] == ["s1"]
        assert harness.shop.count("reserve") == 1
    finally:
        harness.stop()


# ------------------------------------------------- pruning a damaged journal


def test_pruning_a_damaged_journal_raises_journal_corrupt_naming_the_file(tmp_path: Path) -> None:
    # Before: pruning took the damage for a busy disk, logged "pruning failed ...;
    # tried again later" every 10 s, and the participant served on.
    path = tmp_path / "commands.sqlite"
    _journal_with_a_damaged_index(path)
    journal = CommandJournal(path)
    pruning = JournalPruning(journal, 1)
    with pytest.raises(JournalCorrupt) as raised:
        pruning.turn(set())
    assert str(path) in str(raised.value) and "malformed" in str(raised.value)
    journal.close()


def test_a_damaged_journal_found_by_pruning_stops_the_participant_as_a_command_would(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    # No command comes: only the loop's pruning turn meets the damaged page.
    harness = Harness(transport, unique_prefix, tmp_path)
    path = tmp_path / PARTICIPANT / "commands.sqlite"
    path.parent.mkdir(parents=True)
    _journal_with_a_damaged_index(path)
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT, journal_keep_ms=1
    )
    thread, raised = serving(runtime)
    wait_until(lambda: not thread.is_alive(), 60, "the runtime stopped on the damaged journal")
    [error] = raised
    assert isinstance(error, JournalCorrupt), repr(error)
    assert str(path) in str(error) and "malformed" in str(error), str(error)
    assert _dead_letters(harness) == []


# --------------------------------- SQLite errors that waiting does not cure


@pytest.mark.parametrize("how", ["read-only", "table-dropped"])
def test_a_journal_sqlite_refuses_for_good_stops_the_participant_naming_the_file(
    transport: str, unique_prefix: str, tmp_path: Path, how: str
) -> None:
    # SQLITE_READONLY (the file system remounted read-only mid-run: the journal's own
    # connection made query-only) or SQLITE_ERROR "no such table" (the file changed
    # from outside) does not pass by waiting. Before, both were taken for a full disk:
    # the command waited (or was looked up again) for ever, "free disk space" logged.
    # Now the participant stops as on a damaged file: one error naming the file,
    # nothing dead-lettered, the command left uncommitted for the next run.
    import participants.runtime as runtime_module

    harness = Harness(transport, unique_prefix, tmp_path)
    path = tmp_path / PARTICIPANT / "commands.sqlite"
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT
    )
    thread, raised = serving(runtime)
    if how == "read-only":
        with runtime.journal._lock:
            runtime.journal._db.execute("PRAGMA query_only = 1")
    else:
        outside = sqlite3.connect(path)
        outside.execute("DROP TABLE handled")
        outside.close()
    error = _stopped_by_a_command(harness, thread, raised)
    assert isinstance(error, runtime_module.JournalUnusable), repr(error)
    assert not isinstance(error, JournalCorrupt), repr(error)
    code = "SQLITE_READONLY" if how == "read-only" else "SQLITE_ERROR"
    assert str(path) in str(error) and code in str(error), str(error)
    assert "\n" not in str(error)
    assert harness.shop.count("reserve") == 0

    # Left uncommitted: the next run (the journal usable again) answers it, and the
    # tool runs once at most (an intent already on the ledger is an unknown outcome).
    harness.start()
    try:
        records = harness.wait_for(
            lambda rs: bool(_of(rs, StepCommitted) or _of(rs, StepOutcomeUnknown))
        )
        answered = _of(records, StepCommitted) + _of(records, StepOutcomeUnknown)
        assert [r.step_id for r in answered] == ["s1"]
        assert harness.shop.count("reserve") == len(_of(records, StepCommitted))
        if how == "table-dropped":  # failed at its lookup, before its intent: it runs
            assert harness.shop.count("reserve") == 1
    finally:
        harness.stop()


# ------------------------- a background confirmation meets a journal unusable


class _ReleasedDesk(_AcceptingDesk):
    """An asynchronous compensation whose verification passes at once."""

    def released(self, ctx: CompensationContext) -> bool:
        return True


def test_a_confirmation_the_journal_refuses_for_good_stops_the_participant_R12(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    # An accepted compensation resumed at start is confirmed (its verification
    # passes), but the journal refuses its "done" mark for good (SQLITE_READONLY).
    # Before, the confirmation took that for a broker hiccup: polled again every
    # 200 ms for ever, a CompensationCommitted appended at each poll, while the
    # participant served on. Now the participant stops as a command's write would
    # stop it, naming the file; the row stays accepted, resumed at the next start.
    import participants.runtime as runtime_module

    participant = "desks"
    catalogue = wrap(_ReleasedDesk(), name=participant)
    path = tmp_path / participant / "commands.sqlite"
    journal = CommandJournal(path)
    handler = CommandHandler(catalogue, participant, journal, lambda record: None)
    command = _compensate()
    assert handler.handle(command) == "accepted"
    handler.close()
    journal.close()

    settings = Settings(
        bootstrap=transport, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    runtime = ParticipantRuntime(catalogue, settings, transport, participant=participant)
    with runtime.journal._lock:
        runtime.journal._db.execute("PRAGMA query_only = 1")
    thread, raised = serving(runtime)
    wait_until(lambda: not thread.is_alive(), 60, "the runtime stopped on the unusable journal")
    [error] = raised
    assert isinstance(error, runtime_module.JournalUnusable), repr(error)
    assert str(path) in str(error) and "SQLITE_READONLY" in str(error), str(error)
    assert [c for c, _ in CommandJournal(path).accepted()] == [command.event_id]


# ------------------------ a file system remounted read-only under the journal


def _ioerr_write() -> sqlite3.OperationalError:
    """What SQLite raises when the write() of a page fails with EROFS (the file system
    remounted read-only under the open file, as ext4's errors=remount-ro does):
    SQLITE_IOERR_WRITE, not SQLITE_READONLY (the file was opened writable)."""
    exc = sqlite3.OperationalError("disk I/O error")
    exc.sqlite_errorcode = 778
    exc.sqlite_errorname = "SQLITE_IOERR_WRITE"
    return exc


class _WritesFail:
    """The journal's connection whose every transaction fails at COMMIT as above;
    reads, and everything else, go to the real one."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT":
            raise _ioerr_write()
        return self.db.execute(sql, *args)


@pytest.mark.parametrize("mounted", ["read-only", "read-write"])
def test_a_journal_io_error_on_a_read_only_file_system_stops_the_participant(
    transport: str,
    unique_prefix: str,
    tmp_path: Path,
    mounted: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # SQLite reports a write to a file system remounted read-only under the open
    # journal as "disk I/O error" (SQLITE_IOERR), which is waited out as a disk
    # hiccup. Before, it was waited out for ever, logged as "journal write failed
    # (SQLITE_IOERR_WRITE: disk I/O error; check the disk and its file system)",
    # naming no file. Now an I/O error on a file system mounted read-only stops the
    # participant as SQLITE_READONLY does (one error naming the file and the cause);
    # one on a writable file system is still waited out, its log naming the file.
    import participants.runtime as runtime_module

    harness = Harness(transport, unique_prefix, tmp_path)
    path = tmp_path / PARTICIPANT / "commands.sqlite"
    runtime = ParticipantRuntime(
        harness.catalogue, harness.settings, transport, participant=PARTICIPANT
    )
    real_statvfs = os.statvfs

    def statvfs(p: Any) -> Any:
        st = real_statvfs(p)
        if mounted == "read-only" and Path(p).parent == path.parent:
            return types.SimpleNamespace(f_flag=st.f_flag | os.ST_RDONLY)
        return st

    monkeypatch.setattr(os, "statvfs", statvfs)
    real_db = runtime.journal._db
    runtime.journal._db = _WritesFail(real_db)  # type: ignore[assignment]
    thread, raised = serving(runtime)
    with caplog.at_level(logging.WARNING, logger="sagaline.participant"):
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        if mounted == "read-only":
            wait_until(lambda: not thread.is_alive(), 60, "the runtime stopped")
            [error] = raised
            assert isinstance(error, runtime_module.JournalUnusable), repr(error)
            assert not isinstance(error, JournalCorrupt), repr(error)
            said = str(error)
            assert str(path) in said and "SQLITE_IOERR_WRITE" in said, said
            assert "read-only" in said and "\n" not in said, said
            assert _dead_letters(harness) == []
            assert harness.shop.count("reserve") == 0
            return
        said = wait_until(
            lambda: [r.getMessage() for r in caplog.records if "write failed" in r.getMessage()],
            60,
            "the journal's failing write logged",
        )[0]
    assert str(path) in said and "SQLITE_IOERR_WRITE" in said, said
    assert thread.is_alive() and harness.shop.count("reserve") == 0
    runtime.journal._db = real_db  # the disk answers again: the command goes on, once
    try:
        harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
        assert harness.shop.count("reserve") == 1
    finally:
        runtime.stop()
        thread.join(30)
    assert not thread.is_alive(), "the runtime did not stop once the write went through"
    assert raised == []
