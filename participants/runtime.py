"""The participant runtime: serves one catalogue over its Kafka command topic.

For every command on ``sagaline.commands.<participant>`` it

* ExecuteStep: appends ``StepIntentRecorded`` and waits for the broker's ack before
  the tool runs (R10); runs the tool under its deadline with the idempotency key in
  :func:`participants.context.current_call`; appends ``StepCommitted``,
  ``StepFailed`` (business rejection or transient, R9) or ``StepOutcomeUnknown`` when
  the deadline passed (R11);
* CompensateStep: runs the declared compensation with its ``CompensationContext``
  and the compensation key; appends ``CompensationCommitted`` (verified where a
  verification is declared), ``CompensationAccepted`` for asynchronous ones (then
  polls the verification until the completion is confirmed or the tool's declared
  ``completion_within`` has passed since the acceptance; without a verification the
  provider's receipt arrives through ``complete_accepted``, R12), or
  ``CompensationFailed``;
* ReconcileStep: looks the operation up by idempotency key and appends
  ``StepReconciled``; with no lookup declared it raises an incident, never guesses.

Redelivered commands never run a tool or a compensation twice: a SQLite journal of
handled command ids survives restarts. A step found *started but unfinished* after a
crash is reported as an unknown outcome and reconciled, because the tool may or may
not have acted (the mark is written while the intent travels to the broker; the tool
runs once both are durable). A compensation is not marked started: interrupted, it
runs again under the same compensation key, which it must honour. Replicas do not
share that journal, so on a journal miss the ledger decides
(:mod:`participants.ledger_probe`): an outcome already appended for the command is
re-sent, and an intent without an outcome (another replica took the command and
vanished, or still runs it) is an unknown outcome, reconciled through the tool's
lookup by idempotency key; the tool is never run a second time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import heapq
import logging
import os
import queue
import signal
import sqlite3
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

import orjson
from pydantic_core import to_jsonable_python

from participants.catalogue import Catalogue, ToolSpec
from participants.context import CallContext, call_context, deadline_at, serve_async_tools
from participants.declarations import Accepted, CompensationContext
from participants.errors import ContractChanged, InvalidArgumentsError, LedgerRefError
from participants.ledger_probe import LedgerProbe, LedgerProbeError
from participants.published import Published, entry_key, fold, stale_keys
from sagaline.kafka import (
    Consumer,
    DeliveryFailed,
    KafkaException,
    LedgerReader,
    LedgerWriter,
    Message,
    RecordTooLarge,
    TopicPartition,
    closing_tolerated,
    consumer_config,
    create_consumer,
    ensure_topics,
    headers_of,
    raise_if_fatal,
    watermarks,
)
from sagaline.kafka._claims import member_held
from sagaline.kafka._groups import PartitionMoves
from sagaline.kafka._topics import topic_retention
from schemas import (
    CompensateStep,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    ExecuteStep,
    FailureKind,
    IncidentRaised,
    LedgerRef,
    ReconcileResult,
    ReconcileStep,
    Record,
    Reversibility,
    StepCommitted,
    StepFailed,
    StepIntentRecorded,
    StepOutcomeUnknown,
    StepReconciled,
    StepScheduled,
    args_fingerprint,
    derived_event_id,
    envelope_for,
    fingerprint,
)
from schemas.errors import CodecError
from schemas.limits import (
    DEFAULT_LIMITS,
    RESULT_TOO_LARGE,
    RETENTION_MARGIN_MS,
    Limits,
    omitted_result,
)
from schemas.redaction import scrub
from schemas.sealing import Sealer, SealError
from schemas.settings import Settings
from schemas.trust import IdentitySigner, Role
from schemas.wire import from_message

log = logging.getLogger("sagaline.participant")


class RuntimeMetrics(Protocol):
    """What the runtime reports. The Prometheus implementation
    (``sagaline.ops.metrics.ParticipantMetrics``) sits in a layer above and is passed
    in by the process that serves the participant."""

    def observe_record(self, record: Record) -> None: ...

    def observe_output(self, output: Record) -> None: ...

    def duplicate_prevented(self, count: int = 1) -> None: ...

    def dlq(self, reason: str) -> None: ...


class NoMetrics:
    """The default: report nothing."""

    def observe_record(self, record: Record) -> None:
        pass

    def observe_output(self, output: Record) -> None:
        pass

    def duplicate_prevented(self, count: int = 1) -> None:
        pass

    def dlq(self, reason: str) -> None:
        pass


Clock = Callable[[], int]

# What a tool, compensation, lookup or verification raising is a failure of its step:
# every Exception, and SystemExit, which a library built on click or argparse raises
# for a bad input. The runtime's own BaseExceptions (_TakenOver, _GivenUp) pass.
_TOOL_ERRORS = (Exception, SystemExit)

# How often the runtime commits offsets (asynchronously). A crash redelivers at most
# this much finished work, which the journal recognises and answers without rerunning.
_COMMIT_INTERVAL_S = 0.1
# Why a step is an unknown outcome when its command was started before a crash, or
# before a revoke gave it up (_CommandLoop.drain) while its tool ran.
RESTARTED = (
    "the participant restarted (or gave the command up on a rebalance) while the tool was running"
)
# How long a partition revoke waits for the commands taken from it (running tools,
# their saga's queued commands) before it gives them up to the partition's next owner.
REVOKE_DRAIN_S = 30.0
R = TypeVar("R", bound=Record)


JournalRow = tuple[str, str, bytes | None, bytes | None, int]  # id, state, command, outcome, at
# The journal state of an execution given up (a rebalance) after its intent was sent
# and before its tool ran, with that intent in the outcome column: when the command
# comes back here it runs, unless the ledger holds an intent of it this replica did
# not send or an outcome. (Its "started" mark would make it an unknown outcome, which
# for a tool with no lookup waits for a person: a saga stuck by a broker outage.)
UNSTARTED = "unstarted"
# How the loop sends a record: (record, on_delivered, its bytes or None).
SendThen = Callable[[Record, Callable[[DeliveryFailed | None], None], bytes | None], None]


# SQLite's primary result codes of a journal failing for now, waited out: SQLITE_BUSY,
# SQLITE_LOCKED (a lock held too long), SQLITE_IOERR (an I/O error), SQLITE_FULL,
# SQLITE_PROTOCOL (a WAL lock race). Any other (SQLITE_READONLY: the file system
# remounted read-only; SQLITE_CANTOPEN: the file or its directory gone; SQLITE_ERROR:
# its table dropped) does not pass by waiting: the runtime stops (JournalUnusable).
# An SQLITE_IOERR on a file system mounted read-only counts as SQLITE_READONLY
# (CommandJournal._refused).
_TEMPORARY = (5, 6, 10, 13, 15)
# What to do about each while it is waited out, for the log line
_WAIT_HINTS = {
    5: "another process holds a lock on it",
    6: "another process holds a lock on it",
    10: "check the disk and its file system",
    13: "free disk space",
}
# SQLite's primary result codes for a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB
_DAMAGED = (11, 26)
# What to do about an error that stops the runtime, by primary result code
_STOP_HINTS = {
    1: "the file was changed from outside (its table dropped or altered): move it aside",
    3: "make the file, its -wal and -shm and its directory accessible to this user",
    8: "make the file, its -wal and -shm and its directory writable again (a file system "
    "remounted read-only, a changed owner)",
    14: "check that the file and its directory still exist and can be opened (removed, "
    "moved, unmounted)",
}


def _sqlite_error(exc: BaseException) -> sqlite3.OperationalError | None:
    """The SQLite OperationalError ``exc`` is, or was raised from (a failed mark)."""
    for e in (exc, exc.__cause__):
        if isinstance(e, sqlite3.OperationalError):
            return e
    return None


def _primary_code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _what_sqlite_said(exc: BaseException, hints: dict[int, str]) -> str:
    """``exc`` as SQLite named it, and what to do: ``SQLITE_FULL: database or disk is
    full; free disk space``."""
    name = getattr(exc, "sqlite_errorname", None)
    said = f"{name}: {exc}" if name else str(exc)
    code = _primary_code(exc)
    hint = hints.get(code) if code is not None else None
    return f"{said}; {hint}" if hint else said


def journal_unwritable(exc: BaseException) -> bool:
    """Whether ``exc`` is the journal failing for now (SQLite's OperationalError with
    a code in :data:`_TEMPORARY`: a full disk, an I/O error, a lock held too long), as
    :meth:`CommandJournal.mark` raises it: waited out. One without a code (not SQLite's
    own) counts as such too."""
    e = _sqlite_error(exc)
    if e is None:
        return False
    code = _primary_code(e)
    return code is None or code in _TEMPORARY


def _wait_reason(exc: BaseException) -> str:
    """What SQLite said of a journal failing for now, and what to do, for the log."""
    return _what_sqlite_said(_sqlite_error(exc) or exc, _WAIT_HINTS)


class JournalUnusable(RuntimeError):
    """The command journal cannot be used any more, and waiting will not change it
    (SQLite: ``attempt to write a readonly database``, ``unable to open database
    file``, ``no such table``; or the file damaged, :class:`JournalCorrupt`). Every
    command would fail the same way: the runtime stops with this instead of holding
    or dead-lettering them all; what it took stays uncommitted for the next run."""

    def __init__(self, path: Path, exc: BaseException, message: str | None = None) -> None:
        super().__init__(
            message
            or (
                f"the command journal {path} cannot be used "
                f"({_what_sqlite_said(_sqlite_error(exc) or exc, _STOP_HINTS)}): the "
                "participant stops instead of holding or dead-lettering every command; "
                "the commands it took are left uncommitted for the next run. Start it "
                'again once that is done (docs/operating.md, "The command journal")'
            )
        )
        self.path = path


class JournalCorrupt(JournalUnusable):
    """The command journal's file is damaged (SQLite: ``database disk image is
    malformed``). It can no longer tell a redelivered command from a new one, and
    every command would fail the same way: the runtime stops with this instead of
    dead-lettering them all; what it took stays uncommitted for the next run."""

    def __init__(self, path: Path, exc: BaseException) -> None:
        super().__init__(
            path,
            exc,
            f"the command journal {path} is damaged ({exc}): the participant stops "
            "instead of dead-lettering every command; the commands it took are left "
            "uncommitted for the next run. Move the file aside and start again, after "
            f"recovering what it holds: sqlite3 OLD .recover | sqlite3 {path} "
            '(docs/operating.md, "The command journal")',
        )


def journal_corrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is the journal's file being damaged (:class:`JournalCorrupt`,
    or SQLite's SQLITE_CORRUPT / SQLITE_NOTADB, also as the cause of a failed mark)."""
    if isinstance(exc, JournalCorrupt):
        return True
    return any(
        isinstance(e, sqlite3.DatabaseError)
        and getattr(e, "sqlite_errorcode", 0) & 0xFF in _DAMAGED
        for e in (exc, exc.__cause__)
    )


def journal_unusable(exc: BaseException) -> bool:
    """Whether ``exc`` stops the runtime: the journal's file damaged
    (:func:`journal_corrupt`), or an SQLite OperationalError waiting does not cure
    (not :func:`journal_unwritable`), or :class:`JournalUnusable` itself."""
    if isinstance(exc, JournalUnusable) or journal_corrupt(exc):
        return True
    return _sqlite_error(exc) is not None and not journal_unwritable(exc)


def journal_stop(path: Path, exc: BaseException) -> JournalUnusable:
    """The error the runtime stops with for ``exc`` (:func:`journal_unusable`)."""
    if isinstance(exc, JournalUnusable):
        return exc
    return JournalCorrupt(path, exc) if journal_corrupt(exc) else JournalUnusable(path, exc)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _json(value: Any) -> bytes:
    try:
        return orjson.dumps(value, default=_jsonable)
    except TypeError:  # refused outright: a key not a str, lone surrogates, a huge int
        return orjson.dumps(_plain(to_jsonable_python(value, fallback=str)))


def _plain(value: Any) -> Any:
    """JSON-ready ``value`` (dicts, lists, scalars) as orjson writes it: keys and
    strings as UTF-8 (a lone surrogate, from a name read with surrogateescape, as
    "?"), an int past 64 bits as its digits."""
    if isinstance(value, str):
        return _utf8(value)
    if isinstance(value, dict):
        return {_utf8(str(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return str(value)
    return value


def _jsonable(value: Any) -> Any:
    """What orjson cannot write itself, as JSON: the tool has acted once it returned,
    so its result must be written whatever it holds (an outcome that could not be
    encoded would leave its saga waiting and the effect never compensated). A
    ``Decimal``, a ``set``, bytes, an enum, a UUID as pydantic writes them (a string, a
    list); an object nothing knows, as its ``str()``."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return to_jsonable_python(value, fallback=str)


class CommandJournal:
    """Durable record of handled commands (SQLite), so a redelivery is recognised.

    States: ``started`` (the tool may have run), ``done`` (outcome stored, re-sent on
    redelivery), ``accepted`` (an async compensation awaiting its completion),
    :data:`UNSTARTED` (given up, or its intent refused, before the tool ran).
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # It holds every command's arguments and every tool's result: a new journal is
        # its owner's alone (SQLite gives the -wal and -shm files the file's mode). One
        # that cannot be made is left to SQLite to report, below.
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        # group commit of mark(): marks waiting for the next transaction, and whether
        # a caller is writing one now (the others wait on their own _Mark)
        self._group = threading.Lock()
        self._queued: list[_Mark] = []
        self._writing = False
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS handled (command_id TEXT PRIMARY KEY, "
                "state TEXT NOT NULL, command BLOB, outcome BLOB, at INTEGER NOT NULL)"
            )
            self._refuse_read_only(path)

    def _refuse_read_only(self, path: Path) -> None:
        """A journal SQLite can read but not write (the file read-only, or another
        user's) opens fine, and every mark would then fail as a journal unwritable for
        now: every command would wait for good. Refused here instead, with its path.
        (A full disk or a lock held passes: the runtime waits those out.)"""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        try:
            self._db.execute(f"PRAGMA user_version = {version}")  # a write, same value
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != 8:  # not SQLITE_READONLY
                return
            self._db.close()
            raise sqlite3.OperationalError(
                f"the command journal {path} is read-only for this process ({exc}); make "
                "it (and its directory) writable by the participant's user"
            ) from exc

    def _refused(self, exc: BaseException) -> BaseException:
        """``exc``, a write's failure; or, for an I/O error (SQLITE_IOERR) on a file
        system mounted read-only, the same as SQLITE_READONLY. A file system remounted
        read-only under the open journal (ext4's errors=remount-ro after a disk error)
        fails each write() with EROFS, which SQLite reports as ``disk I/O error``:
        waited out as a disk hiccup, it would hold every command for ever."""
        if not isinstance(exc, sqlite3.OperationalError) or _primary_code(exc) != 10:
            return exc
        try:
            read_only = os.statvfs(self.path).f_flag & os.ST_RDONLY
        except OSError:
            return exc
        if not read_only:
            return exc
        refused = sqlite3.OperationalError(f"{exc}, on a file system mounted read-only")
        refused.sqlite_errorcode = 8  # SQLITE_READONLY: not waited out (JournalUnusable)
        refused.sqlite_errorname = getattr(exc, "sqlite_errorname", "SQLITE_IOERR")
        return refused

    def get(self, command_id: str) -> tuple[str, bytes | None] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT state, outcome FROM handled WHERE command_id = ?", (command_id,)
            ).fetchone()
        return None if row is None else (str(row[0]), row[1])

    def mark(
        self,
        command_id: str,
        state: str,
        *,
        command: bytes | None = None,
        outcome: bytes | None = None,
    ) -> None:
        """Record ``state`` durably; returns once it is on disk.

        Group commit: marks from concurrent commands are written in one transaction
        (one sync for the group); each caller still returns only after the
        transaction holding its mark committed, so a kill -9 loses no mark that was
        acknowledged. One caller writes at a time; the others wait each on its own
        lock, released once when its transaction committed (or to make it the next
        writer), so no caller is woken for a transaction that did not hold its mark.
        """
        me = _Mark((command_id, state, command, outcome, _now_ms()))
        with self._group:
            self._queued.append(me)
            lead = not self._writing
            self._writing = True
        if not lead:
            me.wake.acquire()  # released when written, or when it is this one's turn
            if me.outcome is not _LEAD:
                me.raise_failure()
                return
        with self._group:
            batch, self._queued = self._queued, []
        failure: BaseException | None = None
        try:
            self._write([m.row for m in batch])
        except BaseException as exc:
            failure = exc
        with self._group:
            if self._queued:  # arrived while this one wrote: the first of them writes next
                nxt = self._queued[0]
                nxt.outcome = _LEAD
                nxt.wake.release()
            else:
                self._writing = False
        for m in batch:
            if m is not me:
                m.outcome = failure
                m.wake.release()
        me.outcome = failure
        me.raise_failure()

    def write(self, rows: list[JournalRow]) -> None:
        """Write ``rows`` in one transaction (one sync), for a caller that groups the
        marks itself (the runtime's loop); returns once they are on disk."""
        self._write(rows)

    def _write(self, rows: list[JournalRow]) -> None:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(
                    "INSERT INTO handled (command_id, state, command, outcome, at) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(command_id) DO UPDATE SET "
                    "state = excluded.state, outcome = COALESCE(excluded.outcome, outcome), "
                    "command = COALESCE(excluded.command, command), at = excluded.at",
                    rows,
                )
                self._db.execute("COMMIT")
            except BaseException as exc:
                # A failed COMMIT (SQLITE_BUSY, a full disk) leaves the transaction
                # open: every later BEGIN would fail. These rows fail; later ones not.
                # (A failed BEGIN left none.)
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                refused = self._refused(exc)
                if refused is not exc:
                    raise refused from exc
                raise

    def forget(self, command_id: str) -> None:
        """Drop a command's row: it was marked started but its tool never ran (the
        intent was not acknowledged), so a redelivery must run it, not report it as
        an unknown outcome."""
        with self._lock:
            try:
                self._db.execute("DELETE FROM handled WHERE command_id = ?", (command_id,))
            except sqlite3.OperationalError as exc:
                refused = self._refused(exc)
                if refused is not exc:
                    raise refused from exc
                raise

    def mark_unstarted(self, command_id: str, intent: bytes) -> None:
        """A command marked "started" was given up before its tool ran (on a tool
        thread): :data:`UNSTARTED`, with the intent it sent. Only over "started": an
        answer written meanwhile (the command came back here) stays."""
        with self._lock:
            try:
                self._db.execute(
                    "UPDATE handled SET state = ?, outcome = ?, at = ? "
                    "WHERE command_id = ? AND state = 'started'",
                    (UNSTARTED, intent, _now_ms(), command_id),
                )
            except sqlite3.OperationalError as exc:
                refused = self._refused(exc)
                if refused is not exc:
                    raise refused from exc
                raise

    def prune(
        self, older_than: int, *, after: int = 0, limit: int = 1000, keep: Collection[str] = ()
    ) -> tuple[int, int]:
        """Drop ``done`` (and :data:`UNSTARTED`) rows last written before ``older_than``
        (epoch ms), except the commands in ``keep``; returns how many were dropped and
        where the next call starts (``after``).

        Looks at ``limit`` rows at most, in insertion (rowid) order after ``after``, in
        one short transaction, so a journal write waits for one small batch at most.
        ``started`` and ``accepted`` rows always stay (the first is what makes a
        redelivery an unknown outcome, the second resumes a confirmation). Rows are
        inserted in time order, so the next start moves past the old rows looked at,
        up to the first one too young; once a call finds nothing to drop and cannot
        move, the next starts again from the first row (rows kept then, an
        ``accepted`` one since ``done``, are looked at again)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT rowid, command_id, state, at FROM handled WHERE rowid > ? "
                "ORDER BY rowid LIMIT ?",
                (after, limit),
            ).fetchall()
            drop = [
                r[0]
                for r in rows
                if r[3] < older_than and r[2] in ("done", UNSTARTED) and r[1] not in keep
            ]
            nxt = after
            for rowid, _id, _state, at in rows:
                if at >= older_than:
                    break
                nxt = rowid
            if drop:
                marks = ",".join("?" * len(drop))
                try:
                    self._db.execute(
                        f"DELETE FROM handled WHERE rowid IN ({marks}) "
                        "AND state IN ('done', ?) AND at < ?",
                        (*drop, UNSTARTED, older_than),
                    )
                except sqlite3.OperationalError as exc:
                    refused = self._refused(exc)
                    if refused is not exc:
                        raise refused from exc
                    raise
        if not drop and nxt == after:
            nxt = 0
        return len(drop), nxt

    def command(self, command_id: str) -> bytes | None:
        """The command a row was written with (None: no row, or none recorded)."""
        with self._lock:
            row = self._db.execute(
                "SELECT command FROM handled WHERE command_id = ?", (command_id,)
            ).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    def accepted_outcomes(self) -> list[tuple[str, bytes]]:
        """The ``accepted`` rows' ids and outcomes (their ``CompensationAccepted``)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT command_id, outcome FROM handled "
                "WHERE state = 'accepted' AND outcome IS NOT NULL"
            ).fetchall()
        return [(str(r[0]), bytes(r[1])) for r in rows]

    def accepted(self) -> list[tuple[str, bytes]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT command_id, command FROM handled WHERE state = 'accepted'"
            ).fetchall()
        return [(str(r[0]), bytes(r[1])) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


_LEAD = object()  # a _Mark's outcome when its caller is to write the next transaction


class _Mark:
    """One caller's row in a journal group commit, and the lock it waits on."""

    __slots__ = ("outcome", "row", "wake")

    def __init__(self, row: tuple[str, str, bytes | None, bytes | None, int]) -> None:
        self.row = row
        self.wake = threading.Lock()
        self.wake.acquire()
        self.outcome: object = None  # None once written, the exception if the write failed

    def raise_failure(self) -> None:
        if isinstance(self.outcome, BaseException):
            raise RuntimeError(f"journal write failed: {self.outcome}") from self.outcome


def _traceback_text(exc: BaseException, clean: Callable[[str], str]) -> str:
    """``exc``'s traceback, as ``exc_info`` would log it, through ``clean``: the
    exception of a tool may quote a secret argument (in its message, or in the one it
    was raised from), and no log gets a secret in clear."""
    return clean("".join(traceback.format_exception(exc)).rstrip("\n"))


_CLEAN = "_sagaline_clean"  # on a tool's escaping exception: how to scrub its text


def _mark_clean(exc: BaseException, clean: Callable[[str], str]) -> None:
    """Remember on ``exc`` (raised by a tool past its step's outcome: not an
    ``Exception``) how to scrub its text of the call's clear secrets, for whoever logs
    or dead-letters it."""
    setattr(exc, _CLEAN, clean)  # every exception has a __dict__ (BaseException's)


def _cleaner(exc: BaseException) -> Callable[[str], str] | None:
    clean = getattr(exc, _CLEAN, None)
    return clean if callable(clean) else None


def _error_text(exc: BaseException) -> str:
    """``"<type>: <message>"``, scrubbed of the secrets of the tool call that raised it."""
    clean = _cleaner(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {clean(text) if clean is not None else text}"


def _log_failure(msg: str, *args: object, exc: BaseException) -> None:
    """``log.error(msg, *args, exc_info=exc)``, the traceback scrubbed when ``exc``
    came from a tool call with secrets (:func:`_mark_clean`)."""
    clean = _cleaner(exc)
    if clean is None:
        log.error(msg, *args, exc_info=exc)
    else:
        log.error(msg + "\n%s", *args, _traceback_text(exc, clean))


class _Failures:
    """The failures of a call made again and again (a verification polled every
    ``verify_poll_ms`` for as long as ``completion_within``), logged without a flood:
    the first with its traceback, then one line a minute at most (how many, the last
    error), and one line when the call answers again."""

    def __init__(self, what: str, clock: Clock) -> None:
        self._what = what
        self._clock = clock
        self._count = 0
        self._since = 0
        self._logged_at = 0

    def failed(self, exc: BaseException, clean: Callable[[str], str]) -> None:
        """``clean``: the text of ``exc`` (which may quote a secret argument) as it may
        be logged (the call's clear secrets replaced by their markers)."""
        now = self._clock()
        self._count += 1
        if self._count == 1:
            self._since = self._logged_at = now
            log.error(
                "%s failed; retrying (a summary a minute while it fails)\n%s",
                self._what,
                _traceback_text(exc, clean),
            )
        elif now - self._logged_at >= _FAILURES_SUMMARY_MS:
            self._logged_at = now
            log.error(
                "%s still failing: %d failures in %.0f s; the last %s: %s",
                self._what,
                self._count,
                (now - self._since) / 1000,
                type(exc).__name__,
                clean(str(exc))[:500],
            )

    def answered(self) -> None:
        if self._count:
            log.warning(
                "%s answers again after %d failed calls over %.0f s",
                self._what,
                self._count,
                (self._clock() - self._since) / 1000,
            )
            self._count = 0


@dataclass
class _Confirming:
    """One accepted compensation being confirmed: what each poll of it needs."""

    command_id: str
    cmd: CompensateStep
    spec: ToolSpec
    ctx: CompensationContext
    call: CallContext
    deadline: int  # epoch ms: the acceptance plus completion_within
    failures: _Failures
    recording: _Failures  # of writing its completion (or settlement): tried again


class _Confirmations:
    """Every accepted compensation being confirmed (R12), polled without a thread each.

    One entry per command id (a redelivery of a command already here adds nothing).
    A heap of next-poll times is served by one scheduler thread, which hands each
    due poll to a pool of ``_CONFIRM_THREADS``; a poll that does not end the
    confirmation is due again ``poll_s`` after it returned, so an entry is never
    polled twice at once and the pool's queue holds each entry at most once. A
    verification runs through :meth:`call`, on threads of its own
    (:class:`_CallThreads`), never on the handler's tool pool: it is timed from its
    own start, not from when it was due, and a call that hangs past its deadline
    keeps its own thread only; until it returns, its entry gets no second call.
    ``start(command_id, command)`` gives an entry's state at its first poll (None:
    nothing to poll), ``poll(state)`` runs one poll (True: ended). What raises ends
    the entry with one log line (its row stays accepted, resumed at the next
    start); a journal failing for now (:func:`journal_unwritable`) is tried again
    at the entry's next poll, and one unusable for good (:func:`journal_unusable`)
    goes to ``unusable`` instead, which stops the runtime."""

    def __init__(
        self,
        name: str,
        poll_s: float,
        start: Callable[[str, bytes], _Confirming | None],
        poll: Callable[[_Confirming], bool],
        unusable: Callable[[BaseException], None],
    ) -> None:
        self._name = name
        self._poll_s = poll_s
        self._start = start
        self._poll = poll
        self._unusable = unusable
        self._cv = threading.Condition()
        self._entries: dict[str, bytes | _Confirming] = {}  # command bytes until started
        self._due: list[tuple[float, int, str]] = []  # (monotonic time, seq, command id)
        self._seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=_CONFIRM_THREADS, thread_name_prefix=f"{name}-confirm"
        )
        self._calls = _CallThreads(f"{name}-verify", _CONFIRM_THREADS)
        self._running: dict[str, float] = {}  # command id -> monotonic start of its call
        self._journal_nagged_at = float("-inf")  # a journal failing for now: last logged

    def call(
        self, command_id: str, fn: Callable[[], Any], timeout_s: float, *, wait: bool = False
    ) -> Any:
        """``fn()`` (a verification of ``command_id``) on a call thread; past
        ``timeout_s`` a ``TimeoutError`` (the call runs on). While a call of the same
        command id has not returned (even past its deadline), no second one starts:
        :class:`_StillRunning` instead, at once (a poll), or once ``timeout_s`` has
        passed waiting for it (``wait``: a receipt, which runs its own call after)."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while (started := self._running.get(command_id)) is not None:
                left = end - time.monotonic()
                if not wait or left <= 0:
                    raise _StillRunning(
                        "its previous verification call, started "
                        f"{time.monotonic() - started:.0f} s ago, has not returned; not "
                        "called again until it does"
                    )
                self._cv.wait(left)
            self._running[command_id] = time.monotonic()

        def run() -> Any:
            try:
                return fn()
            finally:
                with self._cv:
                    self._running.pop(command_id, None)
                    self._cv.notify_all()

        try:
            future = self._calls.submit(run)
        except BaseException:
            with self._cv:
                self._running.pop(command_id, None)
            raise
        # Waited for in slices: once closed, this pool thread must not wait out a hung
        # call's deadline (an hour for a long one), which the interpreter would wait
        # for at exit (the call's own thread is a daemon; the row stays accepted).
        until = time.monotonic() + timeout_s
        while True:
            left = until - time.monotonic()
            try:
                return future.result(timeout=max(0.0, min(left, _CLOSED_CHECK_S)))
            except concurrent.futures.TimeoutError:
                if self._closed:
                    raise concurrent.futures.TimeoutError("closing") from None
                if left <= _CLOSED_CHECK_S:
                    raise

    def add(self, command_id: str, command: bytes) -> None:
        with self._cv:
            if self._closed or command_id in self._entries:
                return
            self._entries[command_id] = command
            self._due_locked(command_id, 0.0)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-confirm-schedule", daemon=True
                )
                self._thread.start()

    def _due_locked(self, command_id: str, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._due, (at, self._seq, command_id))
        self._cv.notify()

    def _serve(self) -> None:
        with self._cv:
            while not self._closed:
                if not self._due:
                    self._cv.wait()
                    continue
                wait_s = self._due[0][0] - time.monotonic()
                if wait_s > 0:
                    self._cv.wait(wait_s)
                    continue
                command_id = heapq.heappop(self._due)[2]
                try:
                    self._pool.submit(self._run, command_id)
                except RuntimeError:  # the interpreter is exiting: resumed at the next start
                    return

    def _run(self, command_id: str) -> None:
        ended = True
        try:
            with self._cv:
                entry = self._entries.get(command_id)
            if isinstance(entry, bytes):
                entry = self._start(command_id, entry)
                if entry is not None:
                    with self._cv:
                        self._entries[command_id] = entry
            if entry is not None:
                ended = self._poll(entry)
        except _TOOL_ERRORS as exc:
            if journal_unusable(exc):
                self._unusable(exc)
            elif journal_unwritable(exc) and not self._closed:
                ended = False  # the journal failing for now (a lock, a disk): polled again
                with self._cv:
                    now = time.monotonic()
                    nag = now - self._journal_nagged_at >= _JOURNAL_NAG_S
                    if nag:
                        self._journal_nagged_at = now
                if nag:
                    log.warning(
                        "confirming accepted compensation %s: the journal failed (%s); "
                        "tried again at its next poll (logged again in %.0f s at most "
                        "while it fails)",
                        command_id,
                        _wait_reason(exc),
                        _JOURNAL_NAG_S,
                    )
            elif not self._closed:
                log.error(
                    "confirming accepted compensation %s failed (%s: %s); resumed at the "
                    "next start",
                    command_id,
                    type(exc).__name__,
                    exc,
                )
        finally:
            with self._cv:
                if ended or self._closed:
                    self._entries.pop(command_id, None)
                else:
                    self._due_locked(command_id, time.monotonic() + self._poll_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._calls.close()


class _StillRunning(Exception):
    """A verification's previous call has not returned: no second one is started."""


class _CallThreads:
    """Threads for verification calls, none shared with commands. A call never
    waits for a thread: an idle one takes it, or a new one starts (so its deadline
    counts from its own start); a call that hangs keeps its thread only, and that
    thread leaves once the call returns when ``idle_max`` others are idle. How many
    hang at once is bounded by the confirmations: one call each at most
    (:meth:`_Confirmations.call`)."""

    def __init__(self, name: str, idle_max: int) -> None:
        self._name = name
        self._idle_max = idle_max
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_CallItem | None]] = []
        self._spawned = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the participant is stopping")
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._spawned += 1
                spawned = self._spawned
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(inbox,), name=f"{self._name}-{spawned}", daemon=True
            ).start()
        inbox.put((fn, future))
        return future

    def _serve(self, inbox: queue.SimpleQueue[_CallItem | None]) -> None:
        while (item := inbox.get()) is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, fn, future
            with self._lock:
                if self._closed or len(self._idle) >= self._idle_max:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


_CallItem = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


@dataclass(frozen=True)
class _Outcome:
    record: Record
    state: str = "done"


@dataclass(frozen=True)
class _Plan:
    """What the runtime's loop does for one command (:meth:`CommandHandler.plan`).

    ``resend``: a redelivery already answered; its stored outcome goes out again
    (``resend_bytes``: as the journal holds it, so it is not encoded again).
    ``outcome``: answered without running anything. ``intent``: appended and the
    ``started`` mark (the command's bytes) journalled, then ``run`` on a tool thread
    once both are durable (R10). ``run`` alone: a compensation or a lookup, on a tool
    thread. ``blocking``: none of these; :meth:`CommandHandler.handle` on a tool
    thread does it all.
    """

    resend: Record | None = None
    resend_bytes: bytes | None = None
    state: str = "done"
    outcome: _Outcome | None = None
    intent: Record | None = None
    started: bytes | None = None
    run: Callable[[], _Outcome] | None = None
    blocking: bool = False


class CommandHandler:
    """Decides and runs what one command asks; Kafka-free, so tests can drive it.

    ``append(record)`` must return only once the broker acknowledged the record.
    ``begin_append(record)`` (default: ``append``) may return before, with a call that
    waits for the acknowledgement. ``publish(outcome)`` (default: ``append``) may
    return before: the caller then owns finishing the command (its offset) when the
    acknowledgement comes.
    """

    def __init__(
        self,
        catalogue: Catalogue,
        participant: str,
        journal: CommandJournal,
        append: Callable[[Record], None],
        *,
        clock: Clock = _now_ms,
        workers: int = 8,
        verify_poll_ms: int = 200,
        metrics: RuntimeMetrics | None = None,
        sealer: Sealer | None = None,
        ledger: LedgerProbe | None = None,
        limits: Limits = DEFAULT_LIMITS,
        fetch: Callable[[LedgerRef], Record | None] | None = None,
        publish: Callable[[Record], None] | None = None,
        begin_append: Callable[[Record], Callable[[], None]] | None = None,
    ) -> None:
        self.catalogue = catalogue
        self._ledger = ledger
        self._sealer = sealer or Sealer(None)
        self._limits = limits
        self._fetch = fetch
        self.participant = participant
        self.journal = journal
        self._append = append
        # How a command's outcome goes out, once journalled: ``append`` unless the
        # runtime finishes the command when the broker acknowledges it.
        self._publish = publish or append
        self._begin_append = begin_append or _appended_by(append)
        self._clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"{participant}-tool"
        )
        self._verify_poll_ms = verify_poll_ms
        # Every accepted compensation being confirmed (R12): one entry per command
        # id, polled by one scheduler thread on a few threads (confirm_in_background).
        self._confirmations = _Confirmations(
            participant,
            verify_poll_ms / 1000,
            self._confirming,
            self._poll_once,
            self._confirmation_unusable,
        )
        # What a confirmation that finds the journal unusable for good tells (the
        # runtime: stop as a command's write would); None: it is logged alone.
        self.on_journal_unusable: Callable[[JournalUnusable], None] | None = None
        self._metrics = metrics
        self._stopping = threading.Event()
        # Commands waiting for a journal SQLite cannot write for now (_when_writable),
        # with what SQLite said: /healthz says not ready while there are any.
        self._journal_waits: dict[str, str] = {}
        self._journal_waits_lock = threading.Lock()
        self._watchdog = _Watchdog(f"{participant}-deadlines")
        # Which accepted compensation a provider operation id is (complete_accepted):
        # read from the journal's accepted rows once, when first needed, and kept up
        # to date as compensations are accepted and settled here.
        self._ops_lock = threading.Lock()
        self._ops_loaded = False
        self._ops: dict[str, list[str]] = {}  # operation id -> command ids
        self._op_of: dict[str, str] = {}  # command id -> operation id

    def close(self) -> None:
        self._stopping.set()
        self._watchdog.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._confirmations.close()
        if self._ledger is not None:
            self._ledger.close()

    # ------------------------------------------------------------------ dispatch

    def plan(
        self,
        command: Record,
        *,
        maybe_taken_elsewhere: bool = True,
        encoded: bytes | None = None,
        inline: bool = False,
        again: bool = False,
    ) -> _Plan:
        """What :meth:`handle` does for ``command``, split where it waits, so the
        runtime's loop can do the waiting for many commands at once (see
        :class:`_CommandLoop`). Paths that read the ledger before the tool runs (a
        probe after a rebalance, arguments by reference) block: the loop gets
        ``blocking`` for them and leaves them to ``handle`` on a tool thread, which
        asks with ``inline=True`` and reads the ledger here. ``again``: the caller's
        own retry of a command it already took (its outcome not acknowledged): a
        stored outcome is then its own, not a duplicate prevented."""
        seen = self.journal.get(command.event_id)
        if seen is not None and seen[0] in ("done", "accepted") and seen[1] is not None:
            # A redelivery: the work is done; re-send its outcome (same event id, so
            # the coordinator deduplicates) in case the first send was lost.
            if self._metrics is not None and not again:
                self._metrics.duplicate_prevented()
            from schemas.codec import decode

            return _Plan(resend=decode(seen[1]), resend_bytes=seen[1], state=seen[0])
        ours: StepIntentRecorded | None = None
        if seen is not None and seen[0] == UNSTARTED:
            # Given up here before its tool ran (a rebalance): not run here, so decided
            # as a journal miss, where its own intent on the ledger is no sign that
            # anyone acted; sent again as it was (one intent of this replica's there).
            from schemas.codec import decode

            sent = None if seen[1] is None else decode(seen[1])
            ours = sent if isinstance(sent, StepIntentRecorded) else None
            seen = None
        if seen is None and maybe_taken_elsewhere and self._probe_for(command) is not None:
            if not inline:
                return _Plan(blocking=True)
            earlier = self._on_ledger(command, ours)
            if earlier is not None:
                # Another replica (no shared journal) already took this command.
                if self._metrics is not None:
                    self._metrics.duplicate_prevented()
                log.info(
                    "%s %s: already on the ledger, not run again", command.TYPE, command.event_id
                )
                return _Plan(outcome=earlier)
        if isinstance(command, ExecuteStep) and seen is not None:
            # Started before a crash and never finished: it may have acted (R11), also
            # when this deploy no longer serves its tool (a rejection would say not).
            return _Plan(outcome=self._unknown_outcome(command, RESTARTED))
        if command.tool not in self.catalogue:  # type: ignore[attr-defined]
            return _Plan(outcome=_Outcome(self._unknown_tool(command)))
        if isinstance(command, ExecuteStep):
            refused = self._outdated_contract(command)
            if refused is not None:
                return _Plan(outcome=refused)
            if command.args_ref is not None and not inline:
                return _Plan(blocking=True)
            prepared = self._prepare_execute(command, ours)
            if isinstance(prepared, _Outcome):
                return _Plan(outcome=prepared)
            intent, run = prepared
            return _Plan(intent=intent, started=encoded or _command_bytes(command), run=run)
        if isinstance(command, CompensateStep):
            cmd = command
            return _Plan(run=lambda: self._compensate(cmd, encoded=encoded))
        if isinstance(command, ReconcileStep):
            rcmd = command
            return _Plan(run=lambda: self._reconcile(rcmd))
        raise TypeError(f"{command.TYPE} is not a participant command")

    def outcome_row(
        self, command: Record, outcome: _Outcome, encoded: bytes | None = None
    ) -> JournalRow:
        """The journal row that makes ``outcome`` the command's answer."""
        from schemas.codec import encode

        # An accepted compensation is confirmed from the journal after a restart
        # (``accepted()``), which needs the command itself.
        command_bytes = (encoded or encode(command)) if outcome.state == "accepted" else None
        return (command.event_id, outcome.state, command_bytes, encode(outcome.record), _now_ms())

    def handle(
        self,
        command: Record,
        *,
        maybe_taken_elsewhere: bool = True,
        encoded: bytes | None = None,
    ) -> str:
        """Run ``command`` once; returns its journal state after (``done``, or
        ``accepted`` for an asynchronous compensation awaiting its completion).

        ``maybe_taken_elsewhere=False``: the caller knows no other replica can have
        received it (it arrived after this one was assigned the partition), so a
        journal miss needs no ledger probe. ``encoded``: the command's bytes as read
        (``codec.encode`` of it), journalled as they are instead of encoded again."""
        _unless_given_up()
        plan = self.plan(
            command, maybe_taken_elsewhere=maybe_taken_elsewhere, encoded=encoded, inline=True
        )
        if plan.resend is not None:
            self._append(plan.resend)
            return plan.state
        outcome = plan.outcome
        if outcome is None:
            assert plan.run is not None
            if plan.intent is not None:
                _unless_given_up()  # given up during the probe: no intent from here
                intent_acknowledged = self._begin_append(plan.intent)
                # The journal's "started" (the tool may run from now on) is written
                # while the intent is on its way; the tool runs only once both are
                # durable (R10). A crash between them leaves a started command whose
                # intent may be missing: reported as an unknown outcome and
                # reconciled, true (the tool did not run) and safe. An intent the
                # broker refused marks it unstarted: the tool did not run.
                self._mark_when_writable(command.event_id, "started", command=plan.started)
                try:
                    intent_acknowledged()
                except BaseException:
                    self.unstarted_when_writable(command.event_id, plan.intent)
                    raise
            outcome = plan.run()
        return self._settle(command, outcome, encoded)

    def _settle(self, command: Record, outcome: _Outcome, encoded: bytes | None = None) -> str:
        """Journal ``outcome`` as the command's answer, then publish it."""
        command_id, state, command_bytes, outcome_bytes, _at = self.outcome_row(
            command, outcome, encoded
        )
        self._mark_when_writable(command_id, state, command=command_bytes, outcome=outcome_bytes)
        self._publish(outcome.record)
        if self._metrics is not None:
            self._metrics.observe_output(outcome.record)
        return outcome.state

    def _mark_when_writable(
        self,
        command_id: str,
        state: str,
        *,
        command: bytes | None = None,
        outcome: bytes | None = None,
    ) -> None:
        """``journal.mark``, waiting out a journal SQLite cannot write for now (a full
        disk, an I/O error: ``sqlite3.OperationalError``), tried again every second
        until it is written or the runtime stops (:meth:`stop_waiting`; then the
        failure is raised and the command left for redelivery). What needs the mark
        waits: the tool (its "started"), the outcome's send (its row)."""
        self._when_writable(
            command_id,
            lambda: self.journal.mark(command_id, state, command=command, outcome=outcome),
        )

    def unstarted_when_writable(self, command_id: str, intent: Record) -> None:
        """``journal.mark_unstarted`` with ``intent`` (a "started" mark whose intent
        the broker refused: the tool did not run), waiting out a journal SQLite cannot
        write for now as :meth:`_mark_when_writable` does. Left "started", the mark
        would make the command's retry an unknown outcome, reconciled (or an incident)
        for a tool that never ran; dropped, so would the refused intent where it
        reached the log after all (a report "may or may not be in the log": a
        timeout, a producer that failed for good), read by the ledger probe of a
        retry as another replica's. :data:`UNSTARTED`, the retry sends that intent
        again and runs the tool."""
        from schemas.codec import encode

        sent = encode(intent)
        self._when_writable(command_id, lambda: self.journal.mark_unstarted(command_id, sent))

    def _when_writable(self, command_id: str, write: Callable[[], None]) -> None:
        failing = False
        try:
            while True:
                try:
                    write()
                except (RuntimeError, sqlite3.OperationalError) as exc:
                    if not journal_unwritable(exc) or self._stopping.is_set():
                        raise
                    if not failing:
                        failing = True
                        with self._journal_waits_lock:
                            self._journal_waits[command_id] = _wait_reason(exc)
                        log.error(
                            "journal write failed (%s) on %s: command %s waits; trying "
                            "again every %.0f s",
                            _wait_reason(exc),
                            self.journal.path,
                            command_id,
                            _JOURNAL_AGAIN_S,
                        )
                    self._stopping.wait(_JOURNAL_AGAIN_S)
                    continue
                if failing:
                    log.warning("journal writable again: command %s goes on", command_id)
                return
        finally:
            if failing:
                with self._journal_waits_lock:
                    self._journal_waits.pop(command_id, None)

    def journal_waiting(self) -> str | None:
        """Why commands wait for the journal on tool threads (:meth:`_when_writable`),
        or None: what ``/healthz`` says while SQLite cannot write it."""
        with self._journal_waits_lock:
            if not self._journal_waits:
                return None
            waiting = len(self._journal_waits)
            reason = next(iter(self._journal_waits.values()))
        return (
            f"waiting for its command journal {self.journal.path} ({reason}): {waiting} "
            "commands wait, none runs or is answered until it is written"
        )

    def stop_waiting(self) -> None:
        """The runtime is stopping: background confirmations end, and a command
        waiting for the journal (:meth:`_mark_when_writable`) gives up."""
        self._stopping.set()

    def _probe_for(self, cmd: Record) -> LedgerProbe | None:
        """The ledger a journal miss for ``cmd`` reads first, if any: only executions
        and compensations leave records a replica could have written."""
        return self._ledger if isinstance(cmd, (ExecuteStep, CompensateStep)) else None

    def _on_ledger(self, cmd: Record, ours: Record | None = None) -> _Outcome | None:
        """What a journal miss must not ignore: this command's records on the ledger.

        Its outcome there is re-sent as is. An intent with no outcome means a replica
        may have acted (R11): an unknown outcome, which the coordinator reconciles
        through the tool's lookup by idempotency key. Compensations append no intent,
        so only their outcome can be found; one that ran without reporting is run
        again under the same compensation key, which the compensation must honour.
        ``ours``: the intent this replica sent for a command it gave up before the tool
        ran (journalled as such, :data:`UNSTARTED`); found as it is, it is no sign of a
        run, but any other intent of the command is.
        """
        ledger = self._probe_for(cmd)
        if ledger is None:
            return None
        found = ledger.caused_by(cmd)
        by_id = {r.event_id: r for r in found}
        outcome = by_id.get(derived_event_id(cmd.event_id, "outcome"))
        if outcome is not None:
            return _Outcome(
                outcome, "accepted" if isinstance(outcome, CompensationAccepted) else "done"
            )
        intent_id = derived_event_id(cmd.event_id, "intent")
        if isinstance(cmd, ExecuteStep) and any(
            r.event_id == intent_id and r != ours for r in found
        ):
            return self._unknown_outcome(
                cmd,
                "another replica recorded the intent for this idempotency key and "
                "reported no outcome (its partition moved); the tool may have acted",
            )
        return None

    def _unknown_outcome(self, cmd: ExecuteStep, reason: str) -> _Outcome:
        """The tool may or may not have acted: the coordinator reconciles it (R11)."""
        return _Outcome(
            self._record(
                StepOutcomeUnknown,
                cmd,
                "outcome",
                step_id=cmd.step_id,
                tool=cmd.tool,
                idempotency_key=cmd.idempotency_key,
                attempt=cmd.attempt,
                reason=reason,
            )
        )

    def _unknown_tool(self, cmd: Record) -> Record:
        """A command for a tool this participant does not serve: a business
        rejection (it would fail the same way forever), never a crash."""
        tool = getattr(cmd, "tool", "?")
        message = (
            f"participant {self.participant} serves no tool {tool!r} "
            f"(it serves {sorted(self.catalogue)})"
        )
        common: dict[str, Any] = {"step_id": getattr(cmd, "step_id", ""), "attempt": 1}
        if isinstance(cmd, CompensateStep):
            return self._record(
                CompensationFailed,
                cmd,
                "outcome",
                **common,
                compensation_key=cmd.compensation_key,
                kind=FailureKind.BUSINESS_REJECTION,
                error_type="UnknownTool",
                message=message,
            )
        if isinstance(cmd, ReconcileStep):
            return self._record(
                StepReconciled,
                cmd,
                "outcome",
                **common,
                tool=tool,
                idempotency_key=cmd.idempotency_key,
                outcome=ReconcileResult.PENDING,
            )
        assert isinstance(cmd, ExecuteStep)
        return self._record(
            StepFailed,
            cmd,
            "outcome",
            **common,
            tool=tool,
            idempotency_key=cmd.idempotency_key,
            kind=FailureKind.BUSINESS_REJECTION,
            error_type="UnknownTool",
            message=message,
        )

    def _outdated_contract(self, cmd: ExecuteStep) -> _Outcome | None:
        """A business rejection, before any intent, for a step of a tool this
        participant declares IRREVERSIBLE that arrives without an approval (R7).

        The coordinator decides from the contract the agent recorded in
        ``StepScheduled``, which the agent read from the published catalogue; a step
        scheduled between this participant's redeploy (the tool newly IRREVERSIBLE)
        and the agent's next read of the catalogue carries the old contract and was
        dispatched without asking anyone. The command does not carry the contract,
        but an approved forward step always carries its grant, so a missing one is
        exactly that case. Nothing ran: the saga unwinds what came before (R9)."""
        spec = self.catalogue[cmd.tool]
        if (
            spec.reversibility is not Reversibility.IRREVERSIBLE
            or spec.read_only
            or cmd.approval_id is not None
        ):
            return None
        common: dict[str, Any] = {
            "step_id": cmd.step_id,
            "tool": cmd.tool,
            "idempotency_key": cmd.idempotency_key,
            "attempt": cmd.attempt,
        }
        exc = ContractChanged(
            f"{cmd.tool} is declared IRREVERSIBLE by participant {self.participant}, but "
            "this step arrived without an approval: it was scheduled with an outdated "
            "contract (the agent's copy of the catalogue predates the declaration), so "
            "it did not run (R7). Schedule it again: the agent re-reads the catalogue "
            "and the step then waits for a person's approval"
        )
        log.warning("%s", exc)
        return _Outcome(self._failed(cmd, common, FailureKind.BUSINESS_REJECTION, exc))

    # --------------------------------------------------------------- execute step

    def _prepare_execute(
        self, cmd: ExecuteStep, ours: StepIntentRecorded | None = None
    ) -> _Outcome | tuple[StepIntentRecorded, Callable[[], _Outcome]]:
        """The step's intent (``ours``: the one sent before, for a command given up
        before its tool ran), and the call that runs its tool once the intent and the
        journal's "started" mark are durable; or its outcome when it cannot run."""
        spec = self.catalogue[cmd.tool]
        common: dict[str, Any] = {
            "step_id": cmd.step_id,
            "tool": cmd.tool,
            "idempotency_key": cmd.idempotency_key,
            "attempt": cmd.attempt,
        }
        try:
            raw_args = self._payload(cmd, cmd.args, cmd.args_ref, "arguments")
        except LedgerRefError as exc:  # the tool cannot run: nothing happened
            return _Outcome(self._failed(cmd, common, FailureKind.BUSINESS_REJECTION, exc))
        except Exception as exc:  # the ledger could not be read now: try again
            return _Outcome(self._failed(cmd, common, FailureKind.TRANSIENT, exc))
        intent = ours or self._record(
            StepIntentRecorded,
            cmd,
            "intent",
            step_id=cmd.step_id,
            tool=cmd.tool,
            idempotency_key=cmd.idempotency_key,
            args_fingerprint=args_fingerprint(raw_args),
            attempt=cmd.attempt,
            principal=cmd.principal,
        )

        def run() -> _Outcome:
            try:
                return self._call_tool(cmd, spec, raw_args, common)
            except _GivenUp:  # raised before the tool started: it did not run here
                sent = self.unstarted_row(cmd, intent)[3]
                assert sent is not None
                try:
                    self._when_writable(
                        cmd.event_id, lambda: self.journal.mark_unstarted(cmd.event_id, sent)
                    )
                except Exception as exc:  # "started" stays: an unknown outcome, as after a crash
                    log.warning("journalling %s as not run failed (%s)", cmd.event_id, exc)
                raise

        return intent, run

    def unstarted_row(self, cmd: ExecuteStep, intent: Record) -> JournalRow:
        """The journal row of a command given up before its tool ran, its intent sent
        (maybe on the ledger): :data:`UNSTARTED`, with that intent."""
        from schemas.codec import encode

        return (cmd.event_id, UNSTARTED, None, encode(intent), _now_ms())

    def _call_tool(
        self, cmd: ExecuteStep, spec: ToolSpec, raw_args: bytes, common: dict[str, Any]
    ) -> _Outcome:
        ctx = CallContext(
            cmd.saga_id, cmd.step_id, cmd.tool, cmd.idempotency_key, cmd.attempt, cmd.principal
        )

        def late() -> _Outcome:
            return _Outcome(
                self._record(
                    StepOutcomeUnknown,
                    cmd,
                    "outcome",
                    **common,
                    reason=f"no answer within the {cmd.deadline_ms} ms deadline",
                )
            )

        args: dict[str, Any] = {}  # opened: the clear secrets to keep out of a failure
        try:
            args = self._sealer.open(
                orjson.loads(raw_args), spec.secret_paths, cmd.saga_id, refuse_redacted=True
            )
            result = self._run(
                ctx, lambda: spec.invoke(args), cmd.deadline_ms, command=cmd, late=late
            )
        except concurrent.futures.TimeoutError:
            return late()
        except (InvalidArgumentsError, SealError) as exc:
            return _Outcome(
                self._failed(
                    cmd, common, FailureKind.BUSINESS_REJECTION, exc, args, spec.secret_paths
                )
            )
        except _TOOL_ERRORS as exc:
            kind = (
                FailureKind.BUSINESS_REJECTION
                if spec.is_business_rejection(exc)
                else FailureKind.TRANSIENT
            )
            return _Outcome(self._failed(cmd, common, kind, exc, args, spec.secret_paths))
        except BaseException as exc:  # not an Exception: the loop dead-letters its command
            _mark_clean(
                exc, lambda text: scrub(text, args, spec.secret_paths, self._sealer.marker_key)
            )
            raise
        body = self._bounded_result(cmd, spec, _json(result))
        return _Outcome(
            self._record(
                StepCommitted,
                cmd,
                "outcome",
                **common,
                provider_operation_id=_operation_id(_operation_id_of(spec, result)),
                result=body,
                response_fingerprint=fingerprint(body),
            )
        )

    def _bounded_result(
        self, cmd: ExecuteStep | ReconcileStep, spec: ToolSpec, body: bytes
    ) -> bytes:
        """``body``, or when it is over ``limits.max_result_bytes`` a marker with its
        size and fingerprint, after appending an incident that says so.

        The effect exists, so the commit must reach the ledger (a record over the
        broker's limit would never be written and the saga would hang); the result
        itself cannot. A compensation then gets the marker as ``ctx.result`` and
        must find the effect by its idempotency key (or the provider operation id).
        """
        limit = self._limits.max_result_bytes
        if len(body) <= limit:
            return body
        full_fingerprint = fingerprint(body)
        self._append(
            self._record(
                IncidentRaised,
                cmd,
                "result-too-large",
                incident_id=derived_event_id(cmd.event_id, "result-too-large"),
                kind=RESULT_TOO_LARGE,
                step_id=cmd.step_id,
                tool=cmd.tool,
                inconsistency=(
                    f"{cmd.tool} committed (key {cmd.idempotency_key}) but returned "
                    f"{len(body)} bytes, over the result limit of {limit} bytes "
                    "(SAGALINE_MAX_RESULT_BYTES): the ledger keeps only its size and "
                    f"fingerprint {full_fingerprint}; make the tool return a reference"
                ),
                resources=list(spec.resources),
                effect=f"committed; result of {len(body)} bytes not recorded",
                owner=spec.owner,
            )
        )
        return _json(omitted_result(len(body), limit, full_fingerprint))

    def _failed(
        self,
        cmd: ExecuteStep,
        common: dict[str, Any],
        kind: FailureKind,
        exc: BaseException,
        args: Mapping[str, Any] | None = None,
        secret_paths: tuple[str, ...] = (),
    ) -> StepFailed:
        """``args``: the opened arguments, whose clear secrets the message must not hold."""
        return self._record(
            StepFailed,
            cmd,
            "outcome",
            **common,
            kind=kind,
            error_type=type(exc).__name__,
            message=_utf8(
                scrub(str(exc), args or {}, secret_paths, self._sealer.marker_key)[:2000]
            ),
        )

    # ----------------------------------------------------------- compensate step

    def _compensate(self, cmd: CompensateStep, *, encoded: bytes | None = None) -> _Outcome:
        # No "started" mark: a compensation interrupted by a crash runs again under
        # the same compensation key (which it must honour) whether or not the journal
        # saw it start, so the mark would cost a synced write and decide nothing.
        spec = self.catalogue[cmd.tool]
        call = CallContext(
            cmd.saga_id,
            cmd.step_id,
            cmd.tool,
            cmd.idempotency_key,
            cmd.attempt,
            compensation_key=cmd.compensation_key,
        )
        common: dict[str, Any] = {
            "step_id": cmd.step_id,
            "compensation_key": cmd.compensation_key,
            "attempt": cmd.attempt,
        }

        def late() -> _Outcome:
            return _Outcome(
                self._record(
                    CompensationFailed,
                    cmd,
                    "outcome",
                    **common,
                    kind=FailureKind.TRANSIENT,
                    error_type="DeadlineExceeded",
                    message=f"compensation gave no answer within {spec.deadline_ms} ms",
                )
            )

        ctx: CompensationContext | None = None
        try:
            ctx = self._compensation_context(cmd, spec)
            result = self._run(
                call, lambda: spec.compensate(ctx), spec.deadline_ms, command=cmd, late=late
            )
            if isinstance(result, Accepted):
                accepted = self._record(
                    CompensationAccepted,
                    cmd,
                    "outcome",
                    **common,
                    provider_operation_id=_operation_id(result.operation_id),
                )
                self._index_operation(cmd.event_id, accepted.provider_operation_id)
                return _Outcome(accepted, state="accepted")
            verified = (
                self._run(call, lambda: spec.verify(ctx), spec.deadline_ms, command=cmd, late=late)
                if spec.verify_func is not None
                else None
            )
        except concurrent.futures.TimeoutError:
            return late()
        except _TOOL_ERRORS as exc:
            kind = (
                FailureKind.BUSINESS_REJECTION
                if spec.is_business_rejection(exc) or isinstance(exc, LedgerRefError)
                else FailureKind.TRANSIENT
            )
            return _Outcome(
                self._record(
                    CompensationFailed,
                    cmd,
                    "outcome",
                    **common,
                    kind=kind,
                    error_type=type(exc).__name__,
                    message=_utf8(
                        scrub(
                            str(exc),
                            ctx.input if ctx else {},
                            spec.secret_paths,
                            self._sealer.marker_key,
                        )[:2000]
                    ),
                )
            )
        except BaseException as exc:  # not an Exception: the loop dead-letters its command
            _mark_clean(
                exc,
                lambda text: scrub(
                    text, ctx.input if ctx else {}, spec.secret_paths, self._sealer.marker_key
                ),
            )
            raise
        return _Outcome(
            self._record(
                CompensationCommitted,
                cmd,
                "outcome",
                **common,
                provider_operation_id=_operation_id(_operation_id_of(spec, result)),
                result=self._bounded_compensation_result(_json(result)),
                verified=verified,
            )
        )

    def _bounded_compensation_result(self, body: bytes) -> bytes:
        """A compensation's own result is informational: over the limit, the ledger
        keeps a marker (size, fingerprint) so the outcome can still be written."""
        limit = self._limits.max_result_bytes
        if len(body) <= limit:
            return body
        return _json(omitted_result(len(body), limit, fingerprint(body)))

    def confirm_accepted(self, command_id: str, command: bytes) -> None:
        """Poll the declared verification of an accepted compensation until it passes,
        or until the declared wait (``completion_within``) after the acceptance (R12),
        on this thread (the runtime polls them all on a few threads instead:
        :meth:`confirm_in_background`).

        The wait counts from the acceptance as recorded, so a restart does not extend
        it. Past it this stops after one last check and settles the row (``done``,
        its answer still the acceptance): the coordinator's own timer for the same
        deadline raises the one incident, also when this participant is down. A tool
        with no ``verify`` is completed by :meth:`complete_accepted` (the provider's
        completion receipt) instead. A tool this participant no longer serves is
        reported failed (:meth:`_tool_gone`).
        """
        confirming = self._confirming(command_id, command)
        if confirming is None:
            return
        while not self._poll_once(confirming):
            self._stopping.wait(self._verify_poll_ms / 1000)

    def confirm_in_background(self, command_id: str, command: bytes) -> None:
        """:meth:`confirm_accepted` without a thread of its own: the compensation joins
        the ones being confirmed, polled every ``verify_poll_ms`` by one scheduler
        thread on a few threads. Nothing is added for one already there (a
        redelivery of its command), so the provider is polled at that pace only. A
        completion (or settlement) that cannot be written (the broker, the journal
        failing for now) is reported like a failing verification and the entry
        polled again, as is one whose journal row cannot be read for now (a lock
        held, an I/O error); a journal unusable for good stops the runtime
        (:attr:`on_journal_unusable`); another failure (the ledger reference of its
        arguments gone, say) is logged in one line and its row stays accepted,
        resumed at the next start."""
        self._confirmations.add(command_id, command)

    def resume_accepted(self) -> None:
        """At start: resume the ``accepted`` journal rows (R12): each joins the
        confirmations (:meth:`confirm_in_background`). A row whose wait is still
        running is polled until it ends; one whose wait has ended gets its last
        check, and one whose tool is no longer served its report, then each is
        settled. A row of a tool without a verification waits for
        :meth:`complete_accepted`: nothing to run."""
        from schemas.codec import decode

        for command_id, command in self.journal.accepted():
            try:
                spec = self.catalogue.get(decode(command, CompensateStep).tool)
            except Exception as exc:  # an unreadable row must not stop the start
                log.error("journal entry %s unreadable (%s); left as it is", command_id, exc)
                continue
            if spec is None or spec.verify_func is not None:
                self.confirm_in_background(command_id, command)

    def _confirming(self, command_id: str, command: bytes) -> _Confirming | None:
        """What polling this accepted compensation needs; None when there is nothing
        to poll: settled meanwhile, a tool without a verification (completed by
        :meth:`complete_accepted`), or one no longer served (reported here)."""
        from schemas.codec import decode

        seen = self.journal.get(command_id)
        if seen is None or seen[0] != "accepted":
            return None  # settled meanwhile (completed, or its wait over)
        cmd = decode(command, CompensateStep)
        spec = self.catalogue.get(cmd.tool)
        if spec is None:
            self._tool_gone(command_id, cmd)
            return None
        if spec.verify_func is None:
            return None  # completed by complete_accepted, or by the coordinator's deadline
        return _Confirming(
            command_id,
            cmd,
            spec,
            self._compensation_context(cmd, spec),
            _compensation_call(cmd),
            self._completion_deadline(command_id, spec),
            _Failures(f"verification of {cmd.compensation_key}", self._clock),
            _Failures(f"recording the confirmation of {cmd.compensation_key}", self._clock),
        )

    def _poll_once(self, c: _Confirming) -> bool:
        """One poll of an accepted compensation's verification; True when its
        confirmation has ended: confirmed (``CompensationCommitted`` appended), its
        wait over and the row settled, or the runtime stopping."""
        if self._stopping.is_set():
            return True  # resumed at the next start
        spec, ctx = c.spec, c.ctx
        try:
            confirmed = self._verify(c.command_id, c.call, lambda: spec.verify(ctx), spec)
        except _TOOL_ERRORS as exc:
            c.failures.failed(
                exc, lambda text: scrub(text, ctx.input, spec.secret_paths, self._sealer.marker_key)
            )
        else:
            c.failures.answered()
            if confirmed:
                # Not written (the broker or the journal failing for now): polled
                # again, not left until the next start (the coordinator would raise
                # an incident for a compensation that completed).
                return self._recorded(
                    c, lambda: self._completed(c.command_id, c.cmd, verified=True)
                )
        if self._clock() < c.deadline:
            return False
        if self._stopping.is_set():
            return True  # maybe not checked: resumed at the next start
        log.warning(
            "compensation %s was not confirmed within its declared wait; the "
            "coordinator raises the incident (not checked here again)",
            c.cmd.compensation_key,
        )
        # Settled: its answer stays the acceptance (re-sent on redelivery); it is not
        # resumed at later starts and is pruned like any done entry.
        return self._recorded(c, lambda: self._settle_unconfirmed(c.command_id))

    def _settle_unconfirmed(self, command_id: str) -> None:
        self.journal.mark(command_id, "done")
        self._forget_operation(command_id)

    def _recorded(self, c: _Confirming, write: Callable[[], None]) -> bool:
        """``write()`` (the end of ``c``'s confirmation); True once written. A failure
        is reported like a verification's (the first with its traceback, then a
        summary a minute) and the entry polled again; a journal unusable for good
        (:func:`journal_unusable`: read-only, damaged) raises :class:`JournalUnusable`,
        its row left accepted for the next start."""
        try:
            write()
        except _TOOL_ERRORS as exc:
            if self._stopping.is_set():
                return True  # resumed at the next start
            if journal_unusable(exc):  # polled again, it would fail (and append) for ever
                raise journal_stop(self.journal.path, exc) from exc
            c.recording.failed(exc, str)
            return False
        c.recording.answered()
        return True

    def _confirmation_unusable(self, exc: BaseException) -> None:
        """A background confirmation found the journal unusable for good: its entry
        ends (the row stays accepted, resumed at the next start) and the runtime is
        told (:attr:`on_journal_unusable`), which stops as a command's write would."""
        if self._stopping.is_set():
            return
        stop = journal_stop(self.journal.path, exc)
        log.error("confirming accepted compensations: %s", stop)
        if self.on_journal_unusable is not None:
            self.on_journal_unusable(stop)

    def complete_accepted(self, provider_operation_id: str, result: Any = None) -> bool:
        """Record the provider's completion receipt for an accepted compensation (R12).

        Call it from wherever the provider reports completion (a webhook, a poller).
        A receipt that comes before the acceptance is journalled (the provider
        answered the compensation a moment ago) waits for it, up to
        ``_RECEIPT_WAITS_S``. Returns False when no accepted compensation of this
        participant has that operation id (already completed, never accepted here,
        or, for a tool with a verification, settled after its declared wait ended: see
        :meth:`confirm_accepted`). For a tool with a verification the receipt counts
        only once the verification passes (R12): it is run here, and while it does
        not pass nothing is recorded and this returns False (the compensation stays
        accepted, its verification polled until it passes or its wait ends).

        A saga restarted as a new run (a higher generation, R15) asks again for a
        compensation it was waiting on, under the same compensation key: the
        provider answers with the same operation, so two commands of the step are
        accepted as it here. The receipt completes the newest run's command, the one
        whose answer the coordinator counts, and settles the older ones (their
        answers are stale).
        """
        # A receipt may come as soon as the provider answered the compensation, before
        # its acceptance is journalled: it waits for it (briefly), not dropped.
        until = time.monotonic() + _RECEIPT_WAITS_S
        while True:
            found, unjournalled = self._accepted_as(provider_operation_id)
            if found or not unjournalled or time.monotonic() >= until:
                break
            if self._stopping.wait(_RECEIPT_AGAIN_S):
                break
        completed = False
        for rows in found.values():
            command_id, cmd = max(rows, key=lambda row: row[1].envelope.generation)
            if not self._complete_receipt(command_id, cmd, provider_operation_id, result):
                continue
            completed = True
            for older_id, older in rows:
                if older.envelope.generation < cmd.envelope.generation:
                    self._settle_unconfirmed(older_id)  # superseded by the newer run
        return completed

    def _accepted_as(
        self, provider_operation_id: str
    ) -> tuple[dict[tuple[str, str], list[tuple[str, CompensateStep]]], bool]:
        """Per (saga, step), the commands journalled as accepted as
        ``provider_operation_id``, in the order accepted; and whether one accepted
        here as it is not journalled yet."""
        from schemas.codec import decode

        found: dict[tuple[str, str], list[tuple[str, CompensateStep]]] = {}
        unjournalled = False
        for command_id in self._operation_rows(provider_operation_id):
            seen = self.journal.get(command_id)
            if seen is None:
                unjournalled = True  # its acceptance is on its way to the journal
                continue
            if seen[0] == "done":
                self._forget_operation(command_id)  # settled
            if seen[0] != "accepted" or seen[1] is None:
                continue
            outcome = decode(seen[1])
            command = self.journal.command(command_id)
            if (
                command is not None
                and isinstance(outcome, CompensationAccepted)
                and outcome.provider_operation_id == provider_operation_id
            ):
                cmd = decode(command, CompensateStep)
                found.setdefault((cmd.saga_id, cmd.step_id), []).append((command_id, cmd))
        return found, unjournalled

    def _complete_receipt(
        self, command_id: str, cmd: CompensateStep, provider_operation_id: str, result: Any
    ) -> bool:
        """:meth:`complete_accepted` for one accepted command; True once completed."""
        spec = self.catalogue.get(cmd.tool)
        if spec is None:  # removed since: a receipt is a fact, nothing to verify
            log.warning(
                "completion of %s recorded unverified: participant %s no longer serves tool %r",
                cmd.compensation_key,
                self.participant,
                cmd.tool,
            )
        if spec is not None and not self._receipt_verified(command_id, cmd, spec):
            return False
        now = self.journal.get(command_id)
        if now is None or now[0] != "accepted":
            return False  # completed meanwhile (a poll confirmed it)
        self._completed(
            command_id,
            cmd,
            verified=None if spec is None or spec.verify_func is None else True,
            result=result,
            provider_operation_id=provider_operation_id,
        )
        return True

    def _index_operation(self, command_id: str, operation_id: str | None) -> None:
        if operation_id is None:
            return
        with self._ops_lock:
            self._index_locked(command_id, operation_id)

    def _index_locked(self, command_id: str, operation_id: str) -> None:
        if self._op_of.get(command_id) == operation_id:
            return
        self._op_of[command_id] = operation_id
        self._ops.setdefault(operation_id, []).append(command_id)

    def _forget_operation(self, command_id: str) -> None:
        """``command_id``'s accepted compensation is settled: no receipt finds it."""
        with self._ops_lock:
            operation_id = self._op_of.pop(command_id, None)
            ids = self._ops.get(operation_id, []) if operation_id is not None else []
            if command_id in ids:
                ids.remove(command_id)
            if operation_id is not None and not ids:
                self._ops.pop(operation_id, None)

    def _operation_rows(self, operation_id: str) -> list[str]:
        """The command ids of the compensations accepted as ``operation_id``: the
        journal's accepted rows are read once, at the first receipt."""
        from schemas.codec import decode

        with self._ops_lock:
            if not self._ops_loaded:
                for command_id, outcome in self.journal.accepted_outcomes():
                    try:
                        accepted = decode(outcome)
                    except Exception as exc:  # an unreadable row must not stop receipts
                        log.error(
                            "journal entry %s unreadable (%s); left as it is", command_id, exc
                        )
                        continue
                    found = getattr(accepted, "provider_operation_id", None)
                    if isinstance(accepted, CompensationAccepted) and found is not None:
                        self._index_locked(command_id, found)
                self._ops_loaded = True
            return list(self._ops.get(operation_id, ()))

    def _receipt_verified(self, command_id: str, cmd: CompensateStep, spec: ToolSpec) -> bool:
        """Whether a receipt for ``cmd`` may count: its tool declares no verification,
        or the verification passes now."""
        if spec.verify_func is None:
            return True
        ctx = self._compensation_context(cmd, spec)
        try:
            # A poll's call under way: the receipt waits for it (within the deadline),
            # then makes its own.
            call = _compensation_call(cmd)
            if self._verify(command_id, call, lambda: spec.verify(ctx), spec, wait=True):
                return True
            why = "it does not pass yet"
        except _StillRunning:
            why = "its previous call has not returned yet"
        except _TOOL_ERRORS as exc:
            why = f"it failed ({type(exc).__name__})"
        log.warning(
            "completion receipt for %s not recorded: its verification must pass first and %s; "
            "it is polled until it passes or its declared wait ends",
            cmd.compensation_key,
            why,
        )
        return False

    def _tool_gone(self, command_id: str, cmd: CompensateStep) -> None:
        """An accepted compensation of a tool this participant no longer serves (a
        deploy removed or renamed it): nothing here can confirm its completion. It is
        reported failed, naming the tool and the provider operation, so the
        coordinator hands it to a person at once (R3, R12); the row is settled with
        that answer, so it is not resumed at every start."""
        from schemas.codec import decode, encode

        seen = self.journal.get(command_id)
        accepted = decode(seen[1]) if seen is not None and seen[1] is not None else None
        operation = getattr(accepted, "provider_operation_id", None) or "(no operation id)"
        message = (
            f"participant {self.participant} no longer serves tool {cmd.tool!r}, so the "
            f"completion of compensation {cmd.compensation} accepted as provider operation "
            f"{operation} cannot be confirmed here: check with the provider whether it "
            f"completed (it serves {sorted(self.catalogue)})"
        )
        log.error("accepted compensation %s: %s", cmd.compensation_key, message)
        record = self._record(
            CompensationFailed,
            cmd,
            "completion",
            step_id=cmd.step_id,
            compensation_key=cmd.compensation_key,
            attempt=cmd.attempt,
            kind=FailureKind.BUSINESS_REJECTION,
            error_type="UnknownTool",
            message=_utf8(message[:2000]),
        )
        self._append(record)
        self.journal.mark(command_id, "done", outcome=encode(record))
        self._forget_operation(command_id)

    def _completion_deadline(self, command_id: str, spec: ToolSpec) -> int:
        """When the declared wait of an accepted compensation ends: its acceptance
        time (from the journalled ``CompensationAccepted``) plus ``completion_within``."""
        from schemas.codec import decode

        seen = self.journal.get(command_id)
        accepted_at = self._clock()
        if seen is not None and seen[1] is not None:
            accepted_at = decode(seen[1]).envelope.occurred_at
        return accepted_at + (spec.completion_within_ms or 0)

    def _completed(
        self,
        command_id: str,
        cmd: CompensateStep,
        *,
        verified: bool | None,
        result: Any = None,
        provider_operation_id: str | None = None,
    ) -> None:
        from schemas.codec import encode

        record = self._record(
            CompensationCommitted,
            cmd,
            "completion",
            step_id=cmd.step_id,
            compensation_key=cmd.compensation_key,
            attempt=cmd.attempt,
            provider_operation_id=provider_operation_id,
            result=self._bounded_compensation_result(_json(result)),
            verified=verified,
        )
        self._append(record)
        self.journal.mark(command_id, "done", outcome=encode(record))
        self._forget_operation(command_id)

    # ------------------------------------------------------------ reconcile step

    def _reconcile(self, cmd: ReconcileStep) -> _Outcome:
        spec = self.catalogue[cmd.tool]
        if spec.lookup_func is None:
            return _Outcome(
                self._record(
                    IncidentRaised,
                    cmd,
                    "outcome",
                    incident_id=derived_event_id(cmd.event_id, "incident"),
                    kind="unknown-outcome-no-lookup",
                    step_id=cmd.step_id,
                    tool=cmd.tool,
                    inconsistency=(
                        f"{cmd.tool} may or may not have acted (key "
                        f"{cmd.idempotency_key}) and declares no lookup"
                    ),
                    resources=list(spec.resources),
                    effect="unknown: check the provider by the idempotency key",
                    owner=spec.owner,
                )
            )
        call = CallContext(cmd.saga_id, cmd.step_id, cmd.tool, cmd.idempotency_key, cmd.attempt)
        common: dict[str, Any] = {
            "step_id": cmd.step_id,
            "tool": cmd.tool,
            "idempotency_key": cmd.idempotency_key,
            "attempt": cmd.attempt,
        }

        def pending(why: object) -> _Outcome:
            log.warning("lookup of %s failed (%s): reporting PENDING", cmd.idempotency_key, why)
            return _Outcome(
                self._record(
                    StepReconciled, cmd, "outcome", **common, outcome=ReconcileResult.PENDING
                )
            )

        try:
            found = self._run(
                call,
                lambda: spec.lookup(cmd.idempotency_key),
                spec.deadline_ms,
                command=cmd,
                late=lambda: pending(f"no answer within {spec.deadline_ms} ms"),
            )
        except _TOOL_ERRORS as exc:
            return pending(exc)
        if found.status is ReconcileResult.COMMITTED:
            body = self._bounded_result(cmd, spec, _json(found.result))
            return _Outcome(
                self._record(
                    StepReconciled,
                    cmd,
                    "outcome",
                    **common,
                    outcome=found.status,
                    provider_operation_id=_operation_id(
                        found.provider_operation_id or _operation_id_of(spec, found.result)
                    ),
                    result=body,
                    response_fingerprint=fingerprint(body),
                )
            )
        return _Outcome(
            self._record(StepReconciled, cmd, "outcome", **common, outcome=found.status)
        )

    # ------------------------------------------------------------------- helpers

    def _compensation_context(self, cmd: CompensateStep, spec: ToolSpec) -> CompensationContext:
        """Exactly the input the tool was called with (secrets opened) and its result.

        A result that was over the limit is the marker the runtime published instead
        (``{"sagaline_result_omitted": {...}}``, see ``schemas.limits``)."""
        args = self._payload(cmd, cmd.args, cmd.args_ref, "arguments")
        result = self._payload(cmd, cmd.result, cmd.result_ref, "result")
        return CompensationContext(
            saga_id=cmd.saga_id,
            tool_name=cmd.tool,
            input=self._sealer.open(orjson.loads(args), spec.secret_paths, cmd.saga_id),
            result=orjson.loads(result),
            idempotency_key=cmd.idempotency_key,
            compensation_key=cmd.compensation_key,
            provider_operation_id=cmd.provider_operation_id,
        )

    def _payload(
        self,
        cmd: ExecuteStep | CompensateStep,
        inline: bytes,
        ref: LedgerRef | None,
        what: str,
    ) -> bytes:
        """``inline``, or the payload ``ref`` points to on the ledger: the step's
        ``StepScheduled`` (arguments) or its commit (result), checked against the
        reference's fingerprint."""
        if ref is None:
            return inline
        where = f"sagaline.events[{ref.partition}]@{ref.offset}"
        if self._fetch is None:
            raise LedgerRefError(
                f"the {what} of step {cmd.step_id} are at {where} but this handler has no "
                "ledger reader (pass fetch=)"
            )
        record = self._fetch(ref)
        if record is None:
            raise LedgerRefError(
                f"the {what} of step {cmd.step_id} ({cmd.tool}) were at {where}, which is no "
                "longer on the ledger (past retention?); they cannot be recovered"
            )
        data: bytes | None = None
        if isinstance(record, StepScheduled):
            data = record.args
        elif isinstance(record, (StepCommitted, StepReconciled)):
            data = record.result
        same_step = record.saga_id == cmd.saga_id and getattr(record, "step_id", None) == (
            cmd.step_id
        )
        if data is None or not same_step or fingerprint(data) != ref.fingerprint:
            raise LedgerRefError(
                f"{where} holds {record.TYPE} {record.event_id}, not the {what} of step "
                f"{cmd.step_id} of saga {cmd.saga_id} with fingerprint {ref.fingerprint}"
            )
        return data

    def _verify(
        self,
        command_id: str,
        ctx: CallContext,
        fn: Callable[[], Any],
        spec: ToolSpec,
        *,
        wait: bool = False,
    ) -> Any:
        """The verification ``fn()`` of the accepted compensation ``command_id``, as the
        call ``ctx``, on the confirmations' own threads (never the tool pool, sized for
        commands): past the tool's deadline a ``TimeoutError``, and while a previous
        call of it has not returned, :class:`_StillRunning` (no second call), at once
        or (``wait``) once it has not returned within the deadline."""

        def call() -> Any:
            with call_context(ctx), deadline_at(time.monotonic() + spec.deadline_ms / 1000):
                return fn()

        return self._confirmations.call(command_id, call, spec.deadline_ms / 1000, wait=wait)

    def _run(
        self,
        ctx: CallContext,
        fn: Callable[[], Any],
        deadline_ms: int,
        *,
        command: Record | None = None,
        late: Callable[[], _Outcome] | None = None,
    ) -> Any:
        """``fn()`` as the call ``ctx``; past ``deadline_ms`` its answer no longer counts.

        On a tool thread of the runtime's loop (see :class:`_CommandLoop`) the tool
        runs right here: handing it to a pool thread and back would cost two thread
        switches a call. The watchdog then enforces the deadline: when it passes, the
        loop settles ``command`` with ``late()`` (the answer a timeout gives) and
        carries on with the saga's later commands, and this thread, once the tool
        returns, discards what it returned and leaves (:class:`_TakenOver`).
        Elsewhere (a handler driven directly) the tool runs on the pool and a timeout
        raises ``concurrent.futures.TimeoutError``. (Verifications of accepted
        compensations run on threads of their own: :meth:`_verify`.)
        """

        def call() -> Any:
            with call_context(ctx), deadline_at(time.monotonic() + deadline_ms / 1000):
                return fn()

        job: _Job | None = getattr(_here, "job", None)
        if job is None or command is None or late is None:
            return self._pool.submit(call).result(timeout=deadline_ms / 1000)
        if job.ended:  # given up on a revoke: the partition's next owner has it
            raise _GivenUp
        taken_by = job

        def take_over() -> None:
            taken_by.take_over(late)

        watch = self._watchdog.watch(deadline_ms / 1000, take_over)
        try:
            return call()
        finally:
            if not watch.finish():
                raise _TakenOver  # the watchdog answered for this command already

    def _record(self, cls: type[R], cmd: Record, purpose: str, **fields: Any) -> R:
        env = envelope_for(
            cls,
            saga_id=cmd.saga_id,
            tenant_id=cmd.envelope.tenant_id,
            producer=self.participant,
            now=self._clock(),
            generation=cmd.envelope.generation,
            causation_id=cmd.event_id,
            event_id=derived_event_id(cmd.event_id, purpose),
        )
        return cls(envelope=env, **fields)


_MAX_OPERATION_ID = 1024


def _compensation_call(cmd: CompensateStep) -> CallContext:
    """The call context of ``cmd``'s compensation (and of its verification)."""
    return CallContext(
        cmd.saga_id,
        cmd.step_id,
        cmd.tool,
        cmd.idempotency_key,
        cmd.attempt,
        compensation_key=cmd.compensation_key,
    )


def _operation_id(found: str | None) -> str | None:
    """A provider operation id, bounded: by default a ``str`` result *is* the id, and a
    tool returning a 2 MB string must not make its outcome unwritable. A longer one
    is kept as its fingerprint."""
    if found is None:
        return None
    found = _utf8(found)
    if len(found) <= _MAX_OPERATION_ID:
        return found
    return f"sha256:{fingerprint(found.encode())} ({len(found)} chars)"


def _operation_id_of(spec: ToolSpec, result: Any) -> str | None:
    """``spec.provider_operation_id(result)``, or None when the declared reader raises
    (a result it did not expect): the tool has acted, so its outcome is written all
    the same, without the id (a failure here would dead-letter the command, its saga
    waiting and the effect never compensated)."""
    try:
        return spec.provider_operation_id(result)
    except Exception as exc:
        log.error(
            "tool %s: its operation_id could not read the provider operation id from the "
            "result (%s); the outcome is recorded without it",
            spec.name,
            _error_text(exc),
        )
        return None


def _utf8(text: str) -> str:
    """``text`` as it can be written: a string read with surrogateescape (a file name,
    a provider's bytes) has no UTF-8 form, and an outcome holding one could not be
    encoded, so its command would never finish (its saga and offsets stuck behind it)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _appended_by(append: Callable[[Record], None]) -> Callable[[Record], Callable[[], None]]:
    """``begin_append`` from a blocking ``append``: the wait is already over."""

    def begin(record: Record) -> Callable[[], None]:
        append(record)
        return _acknowledged

    return begin


def _acknowledged() -> None:
    pass


def _command_bytes(cmd: Record) -> bytes:
    from schemas.codec import encode

    return encode(cmd)


class ParticipantRuntime:
    """The Kafka loop around :class:`CommandHandler` for one participant.

    Key-ordered concurrency (as Confluent's Parallel Consumer does for Java):
    commands of different sagas run at once, up to ``max_in_flight``; commands of one
    saga (the record key) run one at a time in their offset order. Each partition's
    offset is committed up to the lowest command not yet done, asynchronously, so a
    crash redelivers only unfinished work, which the journal recognises. One thread
    does the bookkeeping of every command (:class:`_CommandLoop`); tools run on
    their own threads.
    """

    def __init__(
        self,
        catalogue: Catalogue,
        settings: Settings,
        bootstrap: str,
        *,
        participant: str | None = None,
        instance_id: str | None = None,
        state_dir: Path | None = None,
        metrics: RuntimeMetrics | None = None,
        clock: Clock = _now_ms,
        max_in_flight: int = 16,
        revoke_drain_s: float = REVOKE_DRAIN_S,
        journal_keep_ms: int | None = None,
    ) -> None:
        self.participant = participant or catalogue.name
        # Static group membership: a restarted process with the same instance id gets
        # its partitions back at once. Give each replica of a participant its own id.
        self.instance_id = instance_id or self.participant
        self.settings = settings
        self.bootstrap = bootstrap
        self.topics = settings.topics
        self._command_topic = self.topics.commands(self.participant)
        self.signer = settings.signer()
        if isinstance(self.signer, IdentitySigner):
            # With another identity's key its tools would run while every reader
            # refused their intents and outcomes: effects the ledger never learns of.
            self.signer.require(
                self.participant, Role.PARTICIPANT, f"participant {self.participant!r}"
            )
        self.metrics: RuntimeMetrics = metrics or NoMetrics()
        if not 1 <= max_in_flight <= MAX_IN_FLIGHT:
            raise ValueError(
                f"max_in_flight must be at least 1 and at most {MAX_IN_FLIGHT} (the most "
                f"records the Kafka client fetches at once; got {max_in_flight})"
            )
        self.max_in_flight = max_in_flight
        # How long a revoke waits for the commands of its partitions; past it they
        # are given up to the partitions' next owner (_CommandLoop.drain).
        self.revoke_drain_s = revoke_drain_s
        # What a revoke waits at most: revoke_drain_s, below half the consumer's
        # max.poll.interval.ms (set by run, which reads it).
        self.revoke_drain_bound_s = revoke_drain_s
        state = state_dir or settings.state_dir / self.participant
        self.journal = CommandJournal(state / "commands.sqlite")
        # How long done journal entries are kept: None reads the command topic's
        # retention at start (journal_keep_ms), -1 keeps them for ever. Set by run.
        self.journal_keep_setting = journal_keep_ms
        self.pruning: JournalPruning | None = None
        # No poller thread: the loop serves the delivery reports (and a blocking
        # append on a tool thread polls for its own while it waits).
        self._writer = LedgerWriter(bootstrap, self.topics, self.signer)
        # How the loop sends an intent or an outcome (with its bytes when it has them):
        # ``on_delivered`` gets the broker's answer, on whichever thread polls the
        # producer (a seam for drills).
        self.send: SendThen = self._writer.send_then
        self._reader = LedgerReader(bootstrap)
        self._dead_letters = self._writer.dead_letters(self.topics.dlq)
        self.handler = CommandHandler(
            catalogue,
            self.participant,
            self.journal,
            self._append,
            metrics=self.metrics,
            sealer=settings.sealer(),
            ledger=LedgerProbe(bootstrap, self.topics.events, self.signer),
            limits=settings.limits,
            fetch=self._fetch,
            clock=clock,
            workers=max_in_flight,
            begin_append=self._writer.begin_append,
        )
        # Set until stop(), which may come before run() reaches its loop (a SIGTERM
        # during start-up must not be lost).
        self._running = threading.Event()
        self._running.set()
        # Taken by the first run() for good: its end closes the journal, the ledger
        # writer and the tool pool, and a second run() (while it serves, or after) must
        # neither use nor close them.
        self._run_once = threading.Lock()
        self._serving = False  # run() is in its loop (health())
        self._work = _CommandLoop(self, max_in_flight)
        # Set by a background confirmation that found the journal unusable for good:
        # the loop stops with it at its next turn, as on a command's journal write.
        self._journal_unusable: JournalUnusable | None = None
        self.handler.on_journal_unusable = self._stop_unusable
        # Per command partition assigned to this replica, its end offset when assigned.
        self._assigned_end: dict[int, int] = {}
        for spec in catalogue.values():
            _check_served(spec, self.participant)
        if any(spec.runs_async for spec in catalogue.values()):
            # Async tools, compensations, lookups and verifications share one
            # long-lived loop; sync ones run in threads.
            serve_async_tools()

    def publish_catalogue(self) -> None:
        """Publish every tool's contract and definition on the compacted catalogue
        topic, so agents can call the tools by name (``participants.published``).

        First, what this participant published before for tools it no longer serves
        is withdrawn (tombstoned), so a tool dropped or moved to another participant
        is not declared by it any more. A tool another participant also declares is
        published all the same, with an error in the log: agents refuse to call it
        by name until one of the two is renamed or withdrawn."""
        topic = self.topics.catalogue
        catalogue = self.handler.catalogue
        try:
            current = fold((k, v) for k, v, _h in self._reader.records(topic))
        except Exception as exc:  # e.g. no Read ACL on the topic: publish all the same
            log.warning(
                "catalogue: cannot read %s (%s): tools no longer served here are not "
                "withdrawn, and a name another participant declares is not reported; "
                "grant this participant Read on it (docs/security.md)",
                topic,
                exc,
            )
            current = Published()
        for key in stale_keys(current, self.participant, catalogue):
            log.info("catalogue: withdrawing %s (no longer served here)", key.decode())
            self._writer.write(topic, key, None)
        for spec in catalogue.values():
            entry = {
                "participant": self.participant,
                "contract": spec.contract(self.participant).model_dump(mode="json"),
                "definition": spec.definition(),
                "secret_paths": list(spec.secret_paths),
            }
            body = orjson.dumps(entry)
            # Signed (with identities, agents believe only entries their participant signed).
            for key in (spec.name.encode(), entry_key(self.participant, spec.name)):
                # The bare tool name is earlier versions' key.
                self._writer.write(topic, key, body, self.signer.headers(key, body))
            others = [p for p in current.owners(spec.name) if p != self.participant]
            if others:
                log.error(
                    "tool %s is also declared by participant(s) %s: agents refuse to call "
                    "it by name until one is renamed (@tool(name=...)) or withdrawn",
                    spec.name,
                    ", ".join(others),
                )

    def _fetch(self, ref: LedgerRef) -> Record | None:
        """The ledger record a command's reference points to (signature checked)."""
        msg = self._reader.message_at(self.topics.events, ref.partition, ref.offset)
        if msg is None:
            return None
        return from_message(msg.key(), msg.value(), headers_of(msg), self.signer)

    def _append(self, record: Record) -> None:
        # Wait for the broker's acknowledgement of this record (not a flush of every
        # thread's): the intent must be durable before the tool runs (R10), and an
        # outcome before the command's offset is committed.
        self._writer.append(record)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop once the commands running finish (their tools may
        run up to their deadlines); a second one stops now (:meth:`stop_now`)."""

        def _stop(signum: int, frame: FrameType | None) -> None:
            if self._running.is_set():
                self.stop()  # before the line: a signal sent on seeing it is the second
                log.info(
                    "signal %s: stopping once the commands running finish (up to their "
                    "tools' deadlines); signal again to stop now",
                    signum,
                )
            else:
                self.stop_now()
                log.warning(
                    "signal %s again: stopping now; the commands still running are left "
                    "uncommitted, for the next run (journal and ledger answer them, R11)",
                    signum,
                )

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def stop(self) -> None:
        """Stop taking commands; :meth:`run` returns once the running ones finish."""
        self._running.clear()

    def health(self) -> str | None:
        """None while the loop serves its command topic (subscribed, catalogue
        published) and its commands are not waiting for a journal SQLite cannot write
        for now (a full disk, an I/O error, a lock held); else why not (``/healthz``)."""
        if not self._running.is_set():
            return "stopping"
        if not self._serving:
            return "starting: checking its topics, joining its group, publishing its tools"
        if self._work._tools.exhausted:
            return (
                "every tool thread is stuck in a call past its deadline: no command "
                "starts until one returns (a restart drops them)"
            )
        return self._work.journal_waiting() or self.handler.journal_waiting()

    def stop_now(self) -> None:
        """Stop without waiting for running tools: their commands are given up as on a
        revoke (offsets uncommitted; what they return is dropped), so the next owner,
        or this replica restarted, answers each from its journal and the ledger: an
        execution whose tool may have run as an unknown outcome, reconciled (R11),
        never run twice; a compensation again under its key (R8)."""
        self._running.clear()
        self._work.hurry()

    def run(self, *, ready: threading.Event | None = None) -> None:
        """Serve the command topic until :meth:`stop`; ``ready`` is set once it serves.

        First this machine's claim on the runtime's static group member (its
        ``group.instance.id``) is taken, and held until ``run`` returns (or the
        process ends): a second runtime of the participant with the same instance id
        on the same broker, of this process or another, would fence this one (and be
        fenced back), so it is refused at once with :class:`InstanceClaimed` naming
        the holder's pid. A runtime runs once: ``run`` called again on it (while it
        serves, or after it returned) raises RuntimeError and touches nothing of it;
        make a new :class:`ParticipantRuntime` to serve again."""
        if not self._run_once.acquire(blocking=False):
            raise RuntimeError(
                f"ParticipantRuntime.run() called again on the runtime of"
                f" {self.participant!r}: a runtime runs once (its loop's end closes its"
                " journal and its Kafka clients); make a new ParticipantRuntime (same"
                " instance_id, same state directory) to serve again"
            )
        group = f"{self.topics.prefix}sagaline-participant-{self.participant}"
        member = f"{group}-{self.instance_id}"
        refusal = functools.partial(self._refusal, member)
        with member_held(self.bootstrap, member, refusal, self._close_unused):
            self._run(group, member, ready)

    def _close_unused(self) -> None:
        """What the constructor opened, as the loop's end closes it, when ``run`` ends
        before its loop (refused, or its start failed): nothing will use it, and a
        process that retries the start must not leak its threads, sockets and SQLite
        handle at each try."""
        self.handler.close()
        self._writer.close()
        self.journal.close()

    def _refusal(self, member: str, holder: str, path: str) -> str:
        return (
            f"participant {self.participant!r} (instance id {self.instance_id!r}) is already"
            f" served on {self.bootstrap} by {holder} (lock {path}): a second runtime with"
            f" the same static group member {member!r} would fence the first. Stop that one"
            " first, or give each replica its own instance id (`sagaline participant run"
            " NAME --instance-id ID`, ParticipantRuntime(instance_id=...))"
        )

    def _run(self, group: str, member: str, ready: threading.Event | None) -> None:
        try:  # a start that fails here (a topic missing, the broker down) closes them too
            ensure_topics(
                self.bootstrap,
                self.topics,
                [self.participant],
                self.settings.partitions,
                replication=self.settings.replication,
            )
            keep_ms = journal_keep_ms(
                self.bootstrap, self._command_topic, self.journal_keep_setting
            )
            self.pruning = None if keep_ms is None else JournalPruning(self.journal, keep_ms)
            poll_interval_s = _max_poll_interval_s(self.bootstrap, group)
            pause_after_s = poll_interval_s / 2
            self.revoke_drain_bound_s = _revoke_drain_bound_s(self.revoke_drain_s, poll_interval_s)
            consumer = create_consumer(self.bootstrap, group, **{"group.instance.id": member})
        except BaseException:
            self._close_unused()
            raise

        # A command poll() returned before a rebalance that moved its partition is left
        # to the partition's owner, which reads it from the committed offset.
        moves = PartitionMoves()
        backpressure = _Backpressure(consumer, pause_after_s)

        def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
            moves.moved(partitions)
            backpressure.assigned(partitions)
            for tp in partitions:
                _low, high = watermarks(c, TopicPartition(tp.topic, tp.partition))
                self._assigned_end[tp.partition] = high

        def on_revoke(c: Consumer, partitions: list[TopicPartition]) -> None:
            # Finish what was taken from these partitions and commit it before another
            # member gets them: it must not run a command that is still running here.
            # Bounded: a tool that does not return must not hold the rebalance (every
            # member waits for it); what is unfinished then is given up, uncommitted.
            # consumer.close() revokes too, after work.close() finished what was running
            # and dropped what was queued: nothing is left to wait for then (a dropped
            # command never finishes here, and waiting for it held the stop for
            # revoke_drain_s); only what is done is committed.
            moves.moved(partitions)
            backpressure.moved(partitions)
            within = 0.0 if self._work._closing else self.revoke_drain_bound_s
            self._work.drain({p.partition for p in partitions}, within)
            try:
                self._commit(c, asynchronous=False)
            except KafkaException as exc:  # lost, not revoked: the next owner redelivers
                log.warning("offset commit on revoke failed (%s)", exc)
            self._work.forget({p.partition for p in partitions})
            for tp in partitions:
                self._assigned_end.pop(tp.partition, None)

        def on_lost(c: Consumer, partitions: list[TopicPartition]) -> None:
            # Lost, not revoked (session timed out, poll interval exceeded): another
            # member may own them already and run their commands from the committed
            # offset. No drain: a saga's queued command started here would race the
            # owner's ledger probe and run twice. Everything of them is given up at
            # once (a running tool's intent is on the ledger: the owner reports an
            # unknown outcome), and no commit is attempted for partitions not ours.
            moves.moved(partitions)
            backpressure.moved(partitions)
            self._work.drain({p.partition for p in partitions}, 0.0)
            self._work.forget({p.partition for p in partitions})
            for tp in partitions:
                self._assigned_end.pop(tp.partition, None)

        limit = 2 * self.max_in_flight
        work = self._work
        next_commit = 0.0
        next_prune = 0.0
        # Inside the try: a start-up that fails (the catalogue not writable) closes
        # the consumer and the journal like any other way out.
        try:
            consumer.subscribe(
                [self.topics.commands(self.participant)],
                on_assign=closing_tolerated(on_assign),
                on_revoke=closing_tolerated(on_revoke),
                on_lost=closing_tolerated(on_lost),
            )
            self.publish_catalogue()
            self.handler.resume_accepted()
            self._serving = True  # before the line saying so: a probe may follow it at once
            log.info(
                "participant %s serving %s (%d commands in flight at most)",
                self.participant,
                self.topics.commands(self.participant),
                self.max_in_flight,
            )
            if ready is not None:
                ready.set()
            while self._running.is_set():
                if self._journal_unusable is not None:
                    raise self._journal_unusable
                if backpressure.paused and work.pending >= self.max_in_flight:
                    backpressure.poll(work.wait_s(0.2))  # stays in the group, takes nothing
                elif work.pending >= limit:
                    # Backpressure by not taking more (pause/resume would drop and
                    # refetch what librdkafka holds, a stall of hundreds of ms, at every
                    # burst); only when it lasts half of max.poll.interval.ms, past which
                    # the group would expel this replica, are the partitions paused.
                    if not backpressure.due(self.max_in_flight):
                        self._writer.producer.poll(work.wait_s(0.2))
                else:
                    backpressure.off()
                    if backpressure.held:  # polled while paused: before anything newer
                        batch = backpressure.take(self.max_in_flight)
                    else:
                        msg = consumer.poll(work.wait_s(0.2))
                        batch = (
                            [] if msg is None else moves.batch(msg, consumer, self.max_in_flight)
                        )
                    for m in batch:
                        error = m.error()
                        if error is not None:
                            raise_if_fatal(error)  # a fenced consumer: exit, restart
                            log.warning("consumer error: %s", error)
                            continue
                        work.submit(m)
                    if not batch:
                        work.wait()
                work.serve()
                if time.monotonic() >= next_commit:  # one OffsetCommit per interval
                    self._commit(consumer, asynchronous=True)
                    next_commit = time.monotonic() + _COMMIT_INTERVAL_S
                    if self.pruning is not None and next_commit >= next_prune:
                        # old done journal entries, a small batch off the commands' path
                        next_prune = time.monotonic() + self.pruning.turn(work.in_flight())
        except BaseException as exc:
            # The loop died (a fenced consumer, a damaged journal, a bug): the process
            # is to exit, not to wait for running tools up to their deadlines doing
            # nothing else. What runs is given up, uncommitted, to the next run
            # (journal, ledger: R11).
            work.hurry()
            if journal_unusable(exc) and not isinstance(exc, JournalUnusable):
                raise journal_stop(self.journal.path, exc) from exc  # at start: naming it
            raise
        finally:
            self._serving = False
            self.handler.stop_waiting()  # a command waiting for the journal gives up
            work.close()  # lets running commands finish; queued ones are redelivered
            self._writer.producer.flush(10)
            try:
                self._commit(consumer, asynchronous=False)
            except KafkaException as exc:
                log.warning("final offset commit failed (%s): commands will be redelivered", exc)
            self.handler.close()
            consumer.close()
            self._writer.close()
            self.journal.close()

    def _stop_unusable(self, exc: JournalUnusable) -> None:
        """(A confirmation thread) The loop stops with ``exc`` at its next turn."""
        self._journal_unusable = exc
        self._work._woken.set()

    def _commit(self, consumer: Consumer, *, asynchronous: bool) -> None:
        """Commit, per partition, the offset below which every command is done."""
        topic = self._command_topic
        offsets = [TopicPartition(topic, p, o) for p, o in self._work.committable().items()]
        if offsets and asynchronous:
            consumer.commit(offsets=offsets, asynchronous=True)
        elif offsets:
            consumer.commit(offsets=offsets, asynchronous=False)

    def _process(self, msg: Message, command: Record, maybe_taken_elsewhere: bool) -> bool:
        """Handle one decoded command on a tool thread, waiting where it must (the rare
        paths :meth:`CommandHandler.plan` leaves to ``handle``); False when its record
        could not be appended or the ledger probe could not read the ledger (the loop
        tries it again)."""
        try:
            state = self.handler.handle(
                command, maybe_taken_elsewhere=maybe_taken_elsewhere, encoded=msg.value()
            )
        except DeliveryFailed as exc:
            if not exc.too_large:
                log.exception(
                    "appending for %s %s failed; reading it again", command.TYPE, command.event_id
                )
                return False
            # refused for its size: every time, so dead-lettered as RecordTooLarge is
            return self._dead_letter_blocking(msg, command, exc)
        except LedgerProbeError as exc:  # the ledger is unreadable now, not the command bad
            log.warning("%s; trying %s %s again", exc, command.TYPE, command.event_id)
            return False
        except (_GivenUp, _TakenOver):
            raise  # the loop's own: nothing of this command is done here any more
        except BaseException as exc:  # R16: never stop the service, never lose the record
            if journal_unusable(exc):  # not the command's fault: the loop stops (_fail)
                raise
            if journal_unwritable(exc):  # still unwritable at stop: left for redelivery
                log.warning("journal unwritable: %s %s left undone", command.TYPE, command.event_id)
                return False
            return self._dead_letter_blocking(msg, command, exc)
        if state == "accepted":
            self._confirm_in_background(command.event_id, msg.value() or _command_bytes(command))
        return True

    def _dead_letter_blocking(self, msg: Message, command: Record, exc: BaseException) -> bool:
        """:meth:`_process`'s last resort; False when the DLQ copy was not written."""
        _log_failure("handling %s %s failed", command.TYPE, command.event_id, exc=exc)
        try:
            self._dead_letters.write(msg, "handler-error", _error_text(exc))
        except DeliveryFailed:  # tried again: its offset must not move past it
            log.exception("dead-lettering %s %s failed", command.TYPE, command.event_id)
            return False
        self.metrics.dlq("handler-error")
        return True

    def _confirm_in_background(self, command_id: str, command: bytes) -> None:
        self.handler.confirm_in_background(command_id, command)


def _max_poll_interval_s(bootstrap: str, group: str) -> float:
    """The consumer's effective ``max.poll.interval.ms``, in seconds."""
    setting = consumer_config(bootstrap, group).get("max.poll.interval.ms", 300_000)
    return int(str(setting)) / 1000


def _revoke_drain_bound_s(revoke_drain_s: float, poll_interval_s: float) -> float:
    """How long a revoke drains at most: ``revoke_drain_s``, unless that is over half
    of ``max.poll.interval.ms`` (then half of it, with a warning). The drain runs
    inside the rebalance callback, between two polls, and the commit follows it: a
    drain that outlasted the interval would have the group expel this replica during
    the revoke (while a tool hangs), which then gives up everything it holds."""
    bound = poll_interval_s / 2
    if revoke_drain_s <= bound:
        return revoke_drain_s
    log.warning(
        "max.poll.interval.ms=%d is not above twice revoke_drain_s=%g s: a revoke that "
        "waited that long for a hanging tool would get this replica expelled from its "
        "group; a revoke drains for at most %g s (half the interval) instead. Raise "
        "max.poll.interval.ms (SAGALINE_KAFKA_MAX_POLL_INTERVAL_MS) or lower revoke_drain_s",
        round(poll_interval_s * 1000),
        revoke_drain_s,
        bound,
    )
    return bound


MAX_IN_FLIGHT = 1_000_000
"""The most ``max_in_flight`` may be (``--max-in-flight``, ``SAGALINE_MAX_IN_FLIGHT``):
the loop fetches up to that many records at once, and the Kafka client's
``consume()`` takes at most a million (past it, a ValueError at the first command)."""


# What a done journal entry outlives the command topic's retention by, besides its
# segment.ms: the broker's retention check (log.retention.check.interval.ms, 5 min by
# default) and a coordinator clock ahead of this one (its records' timestamps).
JOURNAL_KEEP_MARGIN_MS = RETENTION_MARGIN_MS
# Prune turns: one batch every _PRUNE_EVERY_S; again after _PRUNE_BEHIND_S while a
# turn still finds a full batch to drop (catching up on a large journal).
_PRUNE_EVERY_S = 10.0
_PRUNE_BEHIND_S = 0.2
_PRUNE_BATCH = 1000


def journal_keep_ms(bootstrap: str, topic: str, setting: int | None) -> int | None:
    """How long a ``done`` journal entry is kept (ms), or None: never pruned.

    ``setting`` (``--journal-keep-ms``): None reads the command topic's retention
    from the broker and keeps an entry ``retention.ms + segment.ms`` +
    :data:`JOURNAL_KEEP_MARGIN_MS` (a record can outlive retention.ms by up to a
    segment's span; past that it is gone from the topic, so no offset reset or
    expired group offset can deliver it again); -1 never prunes; a positive value is
    used as given (with a warning when the broker says it is too short). Every
    answer is logged once, here: a journal that is never pruned grows with every
    command."""
    if setting is not None and setting < 0:
        log.info(
            "journal: never pruned (journal keep -1); it grows with every command "
            "(docs/operating.md, 'The command journal')"
        )
        return None
    try:
        retention = topic_retention(bootstrap, topic)
    except KafkaException as exc:
        retention = None
        unreadable: KafkaException | None = exc
    else:
        unreadable = None
    needed = (
        None
        if retention is None or retention[0] < 0
        else retention[0] + retention[1] + JOURNAL_KEEP_MARGIN_MS
    )
    if setting is not None:
        if needed is not None and setting < needed:
            log.warning(
                "journal: done entries are kept %d ms (journal keep), less than %s keeps a "
                "command (retention.ms + segment.ms + margin = %d ms): a command read again "
                "after its entry was dropped (an offset reset, expired group offsets) is "
                "answered by the ledger probe alone",
                setting,
                topic,
                needed,
            )
        else:
            log.info("journal: done entries older than %d ms are pruned (journal keep)", setting)
        return setting
    if unreadable is not None:
        log.warning(
            "journal: never pruned: the retention of %s could not be read (%s); grant this "
            "participant DESCRIBE_CONFIGS on it, or set SAGALINE_JOURNAL_KEEP_MS "
            "(docs/operating.md, 'The command journal')",
            topic,
            unreadable,
        )
        return None
    if retention is None:
        return None  # the in-process transport: it deletes nothing, and runs for a test
    if needed is None:
        log.warning(
            "journal: never pruned: %s keeps its records for ever (retention.ms=-1, or a "
            "cleanup.policy without delete), so any command may be read again; the "
            "journal grows with every command (docs/operating.md, 'The command journal')",
            topic,
        )
        return None
    log.info(
        "journal: done entries older than %d ms are pruned (%s: retention.ms=%d, "
        "segment.ms=%d, margin %d ms)",
        needed,
        topic,
        retention[0],
        retention[1],
        JOURNAL_KEEP_MARGIN_MS,
    )
    return needed


class JournalPruning:
    """Drops the journal's old ``done`` (and :data:`UNSTARTED`) entries, a small
    batch per turn.

    Run from the runtime's loop at most every :data:`_PRUNE_EVERY_S` (sooner while
    catching up). An entry goes once it is ``done`` (its outcome journalled), its
    command is not under way here (``in_flight``: a retry re-reads it), and it was
    last written more than ``keep_ms`` ago."""

    def __init__(self, journal: CommandJournal, keep_ms: int, clock: Clock = _now_ms) -> None:
        self._journal = journal
        self.keep_ms = keep_ms
        self._clock = clock
        self._after = 0
        self.dropped = 0

    def turn(self, in_flight: Collection[str] | None) -> float:
        """One batch; returns the seconds until the next turn. ``in_flight`` None:
        some command under way here is not known by id (waiting to be tried again),
        so nothing is dropped this turn."""
        if in_flight is None:
            return _PRUNE_EVERY_S
        try:
            dropped, self._after = self._journal.prune(
                self._clock() - self.keep_ms,
                after=self._after,
                limit=_PRUNE_BATCH,
                keep=in_flight,
            )
        except sqlite3.Error as exc:
            if journal_unusable(exc):  # as a command's lookup would: the loop stops
                raise journal_stop(self._journal.path, exc) from exc
            # a busy or full disk: the entries stay, try later
            log.warning(
                "journal: pruning %s failed (%s); tried again later",
                self._journal.path,
                _wait_reason(exc),
            )
            return _PRUNE_EVERY_S
        self.dropped += dropped
        return _PRUNE_BEHIND_S if dropped >= _PRUNE_BATCH // 2 else _PRUNE_EVERY_S


class _Backpressure:
    """Keeps the runtime's consumer in its group while the loop takes no command.

    The loop stops polling the consumer at its limit of commands taken. If that
    lasted ``max.poll.interval.ms``, the group would expel this replica, which would
    then give up everything it holds (``on_lost``). So once it has lasted
    ``pause_after_s``, the assigned partitions are paused and the consumer is polled
    again (which also serves rebalances: partitions assigned meanwhile are paused
    too), until fewer than ``max_in_flight`` commands are left; then they are
    resumed, once. A record poll() returns after the pause (librdkafka may hand out
    what it had fetched) is held, in order, and taken before anything newer.
    """

    def __init__(self, consumer: Consumer, pause_after_s: float) -> None:
        self._consumer = consumer
        self.pause_after_s = pause_after_s
        self.paused = False
        self.held: collections.deque[Message] = collections.deque()
        self._since: float | None = None  # when the loop reached its limit
        self._assigned: list[TopicPartition] = []  # while paused, not paused yet

    def due(self, max_in_flight: int) -> bool:
        """At the limit: pause if it has lasted ``pause_after_s`` (True then)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            return False
        if now - self._since < self.pause_after_s:
            return False
        partitions = self._consumer.assignment()
        if partitions:
            self._consumer.pause(partitions)
        self.paused = True
        self._assigned = []
        log.warning(
            "commands taken at the limit for %.0f s (tools slow to return, or outcomes "
            "not acknowledged): command partitions paused, the consumer still polled to "
            "stay in its group, until fewer than %d commands are left",
            now - self._since,
            max_in_flight,
        )
        return True

    def poll(self, timeout_s: float) -> None:
        """Poll the paused consumer: serves rebalances, holds what it returns."""
        msg = self._consumer.poll(timeout_s)
        if self._assigned:
            partitions, self._assigned = self._assigned, []
            self._consumer.pause(partitions)
        if msg is None:
            return
        error = msg.error()
        if error is not None:
            raise_if_fatal(error)
            log.warning("consumer error: %s", error)
            return
        self.held.append(msg)

    def off(self) -> None:
        """Below the limit (below ``max_in_flight`` once paused): resume, once."""
        self._since = None
        if not self.paused:
            return
        self.paused = False
        partitions = self._consumer.assignment()
        if partitions:
            self._consumer.resume(partitions)
        log.info("command partitions resumed")

    def take(self, count: int) -> list[Message]:
        return [self.held.popleft() for _ in range(min(count, len(self.held)))]

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """From ``on_assign``: these are paused after the poll that assigned them."""
        if self.paused:
            self._assigned.extend(partitions)

    def moved(self, partitions: list[TopicPartition]) -> None:
        """From ``on_revoke`` and ``on_lost``: what is held of these partitions is
        dropped, their next owner reads it from the committed offset."""
        gone = {tp.partition for tp in partitions}
        if self.held:
            kept = [m for m in self.held if m.partition() not in gone]
            self.held = collections.deque(kept)
        self._assigned = [tp for tp in self._assigned if tp.partition not in gone]


class _NotACommand(Exception):
    pass


class _GivenUp(BaseException):
    """Raised on a tool thread instead of starting a tool for a command that a
    partition revoke gave up (:meth:`_CommandLoop.drain`): its partition's next owner
    decides it, so it must not run here too."""


def _unless_given_up() -> None:
    """On a tool thread of the runtime's loop, :class:`_GivenUp` for a command a
    revoke gave up (before a thread took it, or while its ledger was probed): its
    partition's next owner decides it, so nothing of it (an intent, a mark) is
    written here; an intent sent after the give-up would read, to that owner's
    probe, as another replica's. Elsewhere (a handler driven directly) nothing."""
    job: _Job | None = getattr(_here, "job", None)
    if job is not None and job.ended:
        raise _GivenUp


class _TakenOver(BaseException):
    """Raised on a tool thread whose tool returned after the watchdog had already
    answered for the command: unwinds the thread past every ``except Exception``
    (nothing of the late call may be journalled or published) and ends it."""


# The command a tool thread is running (a _Job), read by CommandHandler._run.
_here = threading.local()

_RUNNING, _FINISHED, _OVERRUN = 0, 1, 2


class _Watch:
    """One tool call under a deadline; whichever of :meth:`finish` and the watchdog
    comes first decides whether its answer counts."""

    __slots__ = ("_lock", "deadline", "on_overrun", "state")

    def __init__(
        self, deadline: float, on_overrun: Callable[[], None], lock: threading.Lock
    ) -> None:
        self.deadline = deadline
        self.on_overrun = on_overrun
        self.state = _RUNNING
        self._lock = lock

    def finish(self) -> bool:
        """The tool returned: True when in time, False when the watchdog took over."""
        with self._lock:
            if self.state == _OVERRUN:
                return False
            self.state = _FINISHED
            return True


class _Watchdog:
    """Enforces the deadlines of tools run on tool threads, one thread for all.

    Its thread sleeps until the earliest deadline; a new call wakes it only when its
    deadline is earlier still (rare: most tools of a participant share a deadline),
    so watching a call costs a heap push, not a thread switch. Finished calls are
    dropped from the heap lazily: from its top as calls come, and all at once when
    the heap has doubled since the last sweep (finished calls held below a running
    one with an earlier deadline).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, _Watch]] = []
        self._seq = 0
        self._sweep_above = 256
        self._sleeping_until = float("-inf")  # -inf while awake: it looks again anyway
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, timeout_s: float, on_overrun: Callable[[], None]) -> _Watch:
        """Call ``on_overrun`` (on the watchdog's thread) if the returned watch is not
        finished within ``timeout_s``."""
        watch = _Watch(time.monotonic() + timeout_s, on_overrun, self._lock)
        with self._lock:
            heap = self._heap
            while heap and heap[0][2].state != _RUNNING:
                heapq.heappop(heap)
            if len(heap) > self._sweep_above:  # doubled since the last sweep
                heap[:] = [entry for entry in heap if entry[2].state == _RUNNING]
                heapq.heapify(heap)
                self._sweep_above = max(256, 2 * len(heap))
            self._seq += 1
            heapq.heappush(heap, (watch.deadline, self._seq, watch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            elif watch.deadline < self._sleeping_until:
                self._changed.notify()
        return watch

    def _serve(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                due: list[_Watch] = []
                heap = self._heap
                while heap and (heap[0][2].state != _RUNNING or heap[0][0] <= now):
                    watch = heapq.heappop(heap)[2]
                    if watch.state == _RUNNING:
                        watch.state = _OVERRUN
                        due.append(watch)
                if due:
                    self._lock.release()
                    try:
                        for watch in due:
                            try:
                                watch.on_overrun()
                            except Exception:
                                log.exception("taking over a command past its deadline failed")
                    finally:
                        self._lock.acquire()
                    continue
                self._sleeping_until = heap[0][0] if heap else float("inf")
                # bounded: a deadline of years must not overflow the wait's timeout
                self._changed.wait(None if not heap else min(heap[0][0] - now, 3600.0))
                self._sleeping_until = float("-inf")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify()


_RETRY_AFTER_S = 0.5  # before a command whose record the broker refused is tried again
_ONE_AT_A_TIME_WAIT_S = 0.05  # the longest wait() blocks before the consumer is polled
_JOURNAL_AGAIN_S = 1.0  # before journal marks SQLite could not write (a full disk) go again
# How long a completion receipt waits for its compensation's acceptance to be
# journalled (the provider answered it a moment ago), looking again every so often.
_RECEIPT_WAITS_S = 5.0
_RECEIPT_AGAIN_S = 0.02
# How many threads poll the verifications of accepted compensations, however many
# there are (_Confirmations).
_CONFIRM_THREADS = 4
_CLOSED_CHECK_S = 1.0  # how often a verification's wait looks whether it is closing
_FAILURES_SUMMARY_MS = 60_000  # how often a verification that keeps failing is logged
_JOURNAL_NAG_S = 60.0  # how often a journal that stays unwritable is logged again


class _Job:
    """One command message on its way through :class:`_CommandLoop`.

    ``waiting``: what the tool still waits for ("intent", "started"); ``refused``: the
    broker's refusal of the intent. ``settled``: an outcome was taken (from the tool
    or, past the deadline, from ``late()``), so a second one is dropped. ``ended``:
    finished or left to a retry, so a step of it that comes late ends nothing again.
    ``again``: this loop's own retry of the message (the metrics counted it already).
    """

    __slots__ = (
        "again",
        "command",
        "ended",
        "loop",
        "msg",
        "plan",
        "refused",
        "settled",
        "waiting",
    )

    def __init__(self, loop: _CommandLoop, msg: Message, command: Record | None) -> None:
        self.loop = loop
        self.msg = msg
        self.command = command
        self.plan: _Plan | None = None
        self.waiting: set[str] = set()
        self.refused: BaseException | None = None
        self.settled = False
        self.ended = False
        self.again = False

    def take_over(self, late: Callable[[], _Outcome]) -> None:
        """The tool overran its deadline (watchdog thread): the loop answers with
        ``late()`` and the tool's thread leaves once the tool returns."""
        self.loop.post(self, lambda: self.loop._overrun(self, late))


class _ToolThreads:
    """The threads that run tools, and the rare handling that blocks, for the loop.

    A sync tool blocks its thread, never the loop. Up to ``size`` threads, started
    as work needs them; a thread whose tool overran its deadline ("stuck") is
    replaced at once and leaves when the tool returns, so a few stuck tools do not
    eat the capacity. Up to ``size`` stuck threads are replaced, no more: a provider
    that hangs on every call would otherwise add a thread per command for good.
    Past that each stuck thread takes one off the capacity, and with ``2 x size``
    stuck no command starts (they wait, and backpressure pauses the partitions)
    until a stuck tool returns (:attr:`exhausted`).
    """

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._stuck = 0  # threads whose tool overran its deadline and has not returned
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[
            tuple[_Job, Callable[[], Any], Callable[[Any, BaseException | None], None]] | None
        ] = queue.SimpleQueue()
        self._alive = 0
        self._busy = 0
        self._spawned = 0
        self._closed = False

    def submit(
        self,
        job: _Job,
        fn: Callable[[], Any],
        done: Callable[[Any, BaseException | None], None],
    ) -> None:
        """Run ``fn()`` on a tool thread; ``done(result, error)`` is called there."""
        self._jobs.put((job, fn, done))
        with self._lock:
            self._busy += 1
            self._spawn_locked()

    def replace(self, what: str) -> None:
        """A thread's tool (``what``) overran: one more may run until that thread
        leaves, while no more than ``size`` are stuck."""
        with self._lock:
            self._stuck += 1
            stuck = self._stuck
            self._spawn_locked()
        if stuck > self._size:
            log.error(
                "%d tool calls of %s are stuck past their deadlines (the latest: %s), "
                "each holding a thread until it returns (their commands were answered "
                "for: unknown outcomes, reconciled); no more threads replace them, so %s. "
                "Check the provider; a restart drops the stuck threads",
                stuck,
                self._name,
                what,
                "no command starts until one returns (they wait; the partitions pause)"
                if stuck >= 2 * self._size
                else f"{2 * self._size - stuck} command(s) run at once instead of {self._size}",
            )

    @property
    def exhausted(self) -> bool:
        """Every thread there may be is stuck: a command waiting for one waits until a
        stuck tool returns."""
        with self._lock:
            return self._stuck >= 2 * self._size

    def _spawn_locked(self) -> None:
        """(Under the lock) start a thread when work waits and there is room."""
        limit = self._size + min(self._stuck, self._size)
        if self._busy > self._alive and self._alive < limit and not self._closed:
            self._alive += 1
            self._spawned += 1
            threading.Thread(
                target=self._serve, name=f"{self._name}-tool-{self._spawned}", daemon=True
            ).start()

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, fn, done = item
            _here.job = job
            try:
                result = fn()
            except _TakenOver:
                with self._lock:  # the loop answered for it: this thread leaves
                    self._busy -= 1
                    self._alive -= 1
                    self._stuck -= 1
                    self._spawn_locked()  # a command waiting for a thread gets one
                return
            except BaseException as exc:
                done(None, exc)
            else:
                done(result, None)
            finally:
                _here.job = None
            with self._lock:
                self._busy -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            alive = self._alive
        for _ in range(alive):
            self._jobs.put(None)


class _CommandLoop:
    """Every command's bookkeeping on the runtime's one loop thread.

    Commands of different sagas (record keys) are in flight at once, a key's in
    offset order, never two at once (as Confluent's Parallel Consumer does for
    Java). The waits of a command are the loop's, not a thread's: the intents and
    outcomes it produces are acknowledged by delivery reports the loop serves, the
    journal marks of every command that reached one are written in one transaction
    per turn, and only the tools (and rare paths that block) run on
    :class:`_ToolThreads`. So a command's waits cost no thread switches: about ten
    a command instead of about twenty-four with a thread per command
    (``docs/benchmarks-log.md``).

    Offsets are tracked per partition so the runtime commits up to the lowest
    command not yet done; a crash redelivers only unfinished work, which the
    journal recognises. Everything but :meth:`post` runs on the loop thread.
    """

    def __init__(self, runtime: ParticipantRuntime, workers: int) -> None:
        self._rt = runtime
        self._handler = runtime.handler
        # The writer's producer, looked up at each poll: the writer replaces one that
        # failed for good, and a cached one would leave the new one's reports unserved.
        self._writer = runtime._writer
        self._tools = _ToolThreads(runtime.participant, workers)
        # posted by delivery reports and tool threads, run on the loop thread; each
        # with the job it is a step of, which ends if the step raises
        self._inbox: collections.deque[tuple[_Job, Callable[[], None]]] = collections.deque()
        self._rows: list[tuple[JournalRow, _Job, Callable[[], None]]] = []
        # marks the journal could not write (sqlite3.OperationalError: a full disk, an
        # I/O error), written again from _unwritten_at on; their commands wait
        self._unwritten: list[tuple[JournalRow, _Job, Callable[[], None]]] = []
        self._unwritten_at = 0.0
        self._journal_down = False  # since the last failed write, none succeeded
        self._unwritable_since = 0.0
        self._unwritable_reason = ""  # what SQLite said at the last failed write
        self._nagged_at = 0.0
        self._unread_nagged_at = float("-inf")  # a journal lookup failing: last logged
        self._unread_reason: str | None = None  # the last lookup failed so (None: it did not)
        self._retries: list[tuple[float, int, Message]] = []
        self._seq = 0
        self._queues: dict[bytes | None, collections.deque[Message]] = {}  # busy keys
        self._running: dict[bytes | None, _Job] = {}  # per busy key, its command under way
        self._taken: dict[int, collections.deque[int]] = {}  # partition -> offsets in order
        self._done: dict[int, set[int]] = {}
        self._committed: dict[int, int] = {}
        self._closing = False
        self._hurry = False  # stop_now(): give up what runs instead of waiting for it
        self._woken = threading.Event()  # set by post(): wait() returns
        self._sending = 0  # records sent whose report the loop has not taken yet
        self.pending = 0  # taken and not done

    # ------------------------------------------------------------- the loop's turn

    def post(self, job: _Job, work: Callable[[], None]) -> None:
        """Run ``work``, a step of ``job``, on the loop thread at its next turn (any
        thread)."""
        self._inbox.append((job, work))
        self._woken.set()

    def wait_s(self, idle_s: float) -> float:
        """How long the loop may block in the consumer's poll: not at all with work
        waiting or with one command in flight (:meth:`wait` blocks on what it
        waits for instead), a millisecond with more (their reports and tools finish
        without waking a poll, and one of them finishes about every millisecond),
        ``idle_s`` with nothing to do."""
        if self._inbox or self._rows or self._single:
            return 0.0
        return 0.001 if self._queues or self._retries else idle_s

    @property
    def _single(self) -> bool:
        return len(self._queues) == 1 and not self._retries

    def wait(self) -> None:
        """With one command in flight (sagas one at a time), block until what it
        waits for comes: its record's delivery report, or its tool's end. Polling
        the consumer a millisecond at a time instead would add about a millisecond
        to each of a command's three waits."""
        if not self._single or self._rows:
            return
        self._woken.clear()
        if self._inbox:
            return
        if self._sending:
            self._writer.producer.poll(_ONE_AT_A_TIME_WAIT_S)
        else:
            self._woken.wait(_ONE_AT_A_TIME_WAIT_S)

    def serve(self) -> None:
        """One turn: delivery reports, finished tools, retries due, journal marks."""
        self._writer.producer.poll(0)
        while True:
            while self._inbox:
                job, work = self._inbox.popleft()
                try:
                    work()
                except Exception as exc:  # one command's step must not strand it
                    self._broken(job, exc)
            if self._retries and self._retries[0][0] <= time.monotonic():
                self._start(heapq.heappop(self._retries)[2], again=True)
                continue
            if not self._rows and not self._unwritten:
                return
            if self._unwritten:
                if time.monotonic() < self._unwritten_at:  # everything waits its turn
                    self._unwritten += self._rows
                    self._rows = []
                    return
                self._rows = self._unwritten + self._rows
                self._unwritten = []
                retried = True
            else:
                retried = False
            rows, self._rows = self._rows, []
            try:
                self._handler.journal.write([row for row, _job, _then in rows])
            except Exception as exc:
                if journal_unwritable(exc):  # the disk for now, not the commands
                    self._unwritable(rows, exc)
                    return
                # R16: each command's record is dead-lettered; a journal unusable for
                # good (damaged, read-only) stops the loop instead (_fail)
                self._journal_down = False  # no command waits for it any more
                for _row, job, _then in rows:
                    self._fail(job, exc)
                continue
            if retried:
                self._journal_down = False
                log.warning(
                    "journal writable again after %.0f s: %d commands go on",
                    time.monotonic() - self._unwritable_since,
                    len(rows),
                )
            for _row, job, then in rows:
                try:
                    then()
                except Exception as exc:
                    self._broken(job, exc)

    def _unwritable(
        self, rows: list[tuple[JournalRow, _Job, Callable[[], None]]], exc: Exception
    ) -> None:
        """SQLite could not write the journal (a full disk, an I/O error, a lock held
        too long): the marks wait and are written again in a second, so nothing that
        needs them happens before (no tool runs before its "started" mark, no outcome
        goes out before it is journalled) and nothing runs twice. Their commands and
        their sagas' later ones wait; the loop keeps polling, so backpressure holds
        the rest and the group keeps this replica. Closing, they are left undone."""
        now = time.monotonic()
        if self._closing:
            self._abandon(rows, exc)
            return
        first = not self._journal_down
        self._unwritable_reason = _wait_reason(exc)
        if first:
            self._journal_down = True
            self._unwritable_since = now
        self._unwritten = rows + self._unwritten
        self._unwritten_at = now + _JOURNAL_AGAIN_S
        if first or now - self._nagged_at >= _JOURNAL_NAG_S:
            self._nagged_at = now
            log.error(
                "journal write failed (%s) on %s: %d commands wait, nothing of them is sent "
                "or run until it is written; trying again every %.0f s",
                _wait_reason(exc),
                self._handler.journal.path,
                len(self._unwritten),
                _JOURNAL_AGAIN_S,
            )

    def journal_waiting(self) -> str | None:
        """Why the loop's commands wait for the journal (:meth:`_unwritable`, or a
        lookup failing for now in :meth:`_begin`), or None:
        what ``/healthz`` says while SQLite cannot write it (read off the loop thread;
        a flag and a string, each read whole)."""
        if not self._journal_down:
            unread = self._unread_reason
            if unread is None or not self._retries:  # a command tried again: one waits
                return None
            return (
                f"waiting for its command journal {self._handler.journal.path}: lookups "
                f"fail ({unread}); no command starts until one succeeds"
            )
        return (
            f"waiting for its command journal {self._handler.journal.path} "
            f"({self._unwritable_reason}) for {time.monotonic() - self._unwritable_since:.0f}"
            " s: no command runs or is answered until it is written"
        )

    def _abandon(
        self, rows: list[tuple[JournalRow, _Job, Callable[[], None]]], exc: Exception
    ) -> None:
        """Stopping with marks the journal still cannot write: their commands are left
        undone (offsets uncommitted), redelivered at the next start, where the journal
        and the ledger decide them (a tool that ran is reported as an unknown outcome
        or, a compensation, runs again under its key)."""
        log.error(
            "journal still not writable at stop (%s): %d commands left for redelivery",
            exc,
            len(rows),
        )
        for _row, job, _then in rows:
            self._leave(job)

    def _leave(self, job: _Job) -> None:
        """End ``job`` undone, with its saga's queued commands: their offsets stay
        uncommitted, for the next run (or the partition's next owner)."""
        if job.ended:
            return
        job.ended = job.settled = True
        key = job.msg.key()
        self._running.pop(key, None)
        self.pending -= 1 + len(self._queues.pop(key, ()))

    # ------------------------------------------------------------------ commands

    def submit(self, msg: Message) -> None:
        key = msg.key()
        self._taken.setdefault(msg.partition() or 0, collections.deque()).append(msg.offset() or 0)
        self.pending += 1
        queue_ = self._queues.get(key)
        if queue_ is not None:
            queue_.append(msg)  # the key is busy: runs after the ones before it
            return
        self._queues[key] = collections.deque()
        self._start(msg)

    def _start(self, msg: Message, *, again: bool = False) -> None:
        job = self._running[msg.key()] = _Job(self, msg, None)
        job.again = again
        try:
            self._begin(job)
        except Exception as exc:  # not the caller's (another command's step, the run loop)
            self._broken(job, exc)

    def _begin(self, job: _Job) -> None:
        rt = self._rt
        msg = job.msg
        try:
            command = from_message(msg.key(), msg.value(), headers_of(msg), rt.signer)
            if not isinstance(command, (ExecuteStep, CompensateStep, ReconcileStep)):
                raise _NotACommand(f"{command.TYPE} is not a participant command")
        except (CodecError, _NotACommand) as exc:
            reason = exc.reason if isinstance(exc, CodecError) else "not-a-command"
            self._dead_letter(job, reason, str(exc))
            return
        if not job.again:  # consumed once, however often it is tried
            rt.metrics.observe_record(command)
        job.command = command
        # Only commands already on the partition when it was assigned here can have
        # been taken by another replica; the ledger probe is for those alone.
        maybe = (msg.offset() or 0) < rt._assigned_end.get(msg.partition() or 0, 0)
        try:
            plan = job.plan = self._handler.plan(
                command, maybe_taken_elsewhere=maybe, encoded=msg.value(), again=job.again
            )
        except sqlite3.OperationalError as exc:  # the journal's lookup, for now (as a write)
            if not journal_unwritable(exc):  # for good (no such table): the loop stops
                self._fail(job, exc)
                return
            self._unread_reason = _wait_reason(exc)
            now = time.monotonic()
            if now - self._unread_nagged_at >= _JOURNAL_NAG_S:  # not at every retry
                self._unread_nagged_at = now
                log.warning(
                    "reading the journal %s for %s %s failed (%s); trying the command again "
                    "every %.1f s, its saga's later commands behind it (logged again in "
                    "%.0f s at most while lookups fail)",
                    self._handler.journal.path,
                    command.TYPE,
                    command.event_id,
                    _wait_reason(exc),
                    _RETRY_AFTER_S,
                    _JOURNAL_NAG_S,
                )
            self._retry(job)
            return
        except Exception as exc:
            self._fail(job, exc)
            return
        if self._unread_reason is not None:
            self._unread_reason = None  # the journal reads again
        if plan.resend is not None:
            self._send(job, plan.resend, plan.state, plan.resend_bytes)
        elif plan.outcome is not None:
            self._settle(job, plan.outcome)
        elif plan.blocking:
            self._tools.submit(
                job, lambda: rt._process(msg, command, maybe), self._blocking_done(job)
            )
        elif plan.intent is not None:
            assert plan.started is not None
            job.waiting = {"intent", "started"}
            try:
                rt.send(
                    plan.intent,
                    self._reported(job, lambda failure: self._intent_step(job, "intent", failure)),
                    None,
                )
            except DeliveryFailed as exc:  # not sent (a full local queue): nothing happened
                self._sending -= 1
                log.warning("%s; trying the command again", exc)
                self._retry(job)
                return
            except Exception as exc:  # never sendable (RecordTooLarge), or a bug
                self._sending -= 1
                self._fail(job, exc)
                return
            row: JournalRow = (command.event_id, "started", plan.started, None, _now_ms())
            self._rows.append((row, job, lambda: self._intent_step(job, "started")))
        else:
            self._run_tool(job)

    def _intent_step(self, job: _Job, what: str, failure: BaseException | None = None) -> None:
        """The intent was acknowledged, or the ``started`` mark written: once both
        are, the tool runs (R10); an intent the broker refused marks the command
        :data:`UNSTARTED` with that intent (the tool did not run; the intent may be on
        the ledger all the same) and it is tried again."""
        if job.ended:  # given up on a revoke (or dead-lettered): its tool does not run
            return
        job.waiting.discard(what)
        if failure is not None:
            job.refused = failure
        if job.waiting:
            return
        if job.refused is not None:
            assert job.command is not None and job.plan is not None
            assert isinstance(job.command, ExecuteStep) and job.plan.intent is not None
            sent = self._handler.unstarted_row(job.command, job.plan.intent)[3]
            assert sent is not None
            try:  # its intent may be on the ledger all the same: kept as this replica's
                self._handler.journal.mark_unstarted(job.command.event_id, sent)
            except sqlite3.OperationalError:
                self._unmark_waiting(job, job.command.event_id, job.plan.intent)
                return
            self._after_refusal(job)
            return
        self._run_tool(job)

    def _after_refusal(self, job: _Job) -> None:
        """The refused intent's command, marked unstarted: tried again (or, refused
        for its size, dead-lettered)."""
        if isinstance(job.refused, DeliveryFailed) and job.refused.too_large:
            self._fail(job, job.refused)  # refused every time: as RecordTooLarge
            return
        log.warning("%s; trying the command again", job.refused)
        self._retry(job)

    def _unmark_waiting(self, job: _Job, command_id: str, intent: Record) -> None:
        """The journal could not replace the "started" mark of a command whose intent
        was refused (a full disk): on a tool thread it is replaced once the journal
        writes again (tried every second, :meth:`CommandHandler.unstarted_when_writable`),
        then the command goes on as refused; its saga's later commands wait behind
        it. Stopping first, it is left undone (its mark stays: at the next start an
        unknown outcome, reconciled, as after a crash)."""

        def done(_ok: Any, error: BaseException | None) -> None:
            then = self._retry if error is not None else self._after_refusal
            self.post(job, lambda: then(job))

        self._tools.submit(
            job, lambda: self._handler.unstarted_when_writable(command_id, intent), done
        )

    def _run_tool(self, job: _Job) -> None:
        assert job.plan is not None and job.plan.run is not None
        run = job.plan.run

        def done(outcome: Any, error: BaseException | None) -> None:
            self.post(job, lambda: self._tool_done(job, outcome, error))

        self._tools.submit(job, run, done)

    def _tool_done(self, job: _Job, outcome: Any, error: BaseException | None) -> None:
        if job.settled:
            return
        if error is None:
            self._settle(job, outcome)
        elif isinstance(error, DeliveryFailed) and not error.too_large:  # its own (an incident)
            log.warning("%s; trying the command again", error)
            self._retry(job)
        else:
            self._fail(job, error)

    def _overrun(self, job: _Job, late: Callable[[], _Outcome]) -> None:
        command = job.command
        what = "?" if command is None else f"{command.TYPE} {getattr(command, 'tool', '?')}"
        self._tools.replace(what)  # its thread leaves when the tool returns, settled or not
        if job.settled:
            return
        self._settle(job, late())

    def _settle(self, job: _Job, outcome: _Outcome) -> None:
        """Journal ``outcome`` as the command's answer, then send it."""
        assert job.command is not None
        job.settled = True
        row = self._handler.outcome_row(job.command, outcome, job.msg.value())
        self._rows.append(
            (row, job, lambda: self._send(job, outcome.record, outcome.state, row[3]))
        )

    def _send(self, job: _Job, record: Record, state: str, encoded: bytes | None) -> None:
        """Send a journalled outcome (``encoded``: its bytes, as journalled); the
        command is done once the broker has it."""

        def delivered(failure: BaseException | None) -> None:
            if isinstance(failure, DeliveryFailed) and failure.too_large:
                self._fail(job, failure)  # the broker refuses it every time: RecordTooLarge's way
                return
            if failure is not None:
                log.warning("%s; sending the outcome again", failure)
                self._retry(job)  # the journal has it: the same outcome goes again
                return
            self._rt.metrics.observe_output(record)  # acknowledged: emitted, once
            if state == "accepted":
                self._rt._confirm_in_background(
                    record.event_id if job.command is None else job.command.event_id,
                    job.msg.value() or b"",
                )
            self._finished(job)

        try:
            self._rt.send(record, self._reported(job, delivered), encoded)
        except RecordTooLarge as exc:  # refused again each time: not retried for ever
            self._sending -= 1
            self._fail(job, exc)
            return
        except Exception as exc:  # not sent (a full local queue): the journal has it
            self._sending -= 1
            log.warning("sending %s failed (%s); sending it again", record.TYPE, exc)
            self._retry(job)
            return

    def _reported(
        self, job: _Job, then: Callable[[BaseException | None], None]
    ) -> Callable[[DeliveryFailed | None], None]:
        """A delivery report's callback (served by whichever thread polls the
        producer) that runs ``then``, a step of ``job``, on the loop thread."""

        self._sending += 1

        def taken(failure: BaseException | None) -> None:
            self._sending -= 1
            then(failure)

        def on_delivered(failure: DeliveryFailed | None) -> None:
            self.post(job, lambda: taken(failure))

        return on_delivered

    def _blocking_done(self, job: _Job) -> Callable[[Any, BaseException | None], None]:
        def done(ok: Any, error: BaseException | None) -> None:
            def finish() -> None:
                if job.ended:  # given up on a revoke: nothing of it counts here
                    return
                if error is not None and journal_unusable(error):
                    self._fail(job, error)  # stops the loop; the command stays uncommitted
                    return
                if error is not None:  # _process dead-letters what fails: a last resort
                    _log_failure("command at offset %s failed", job.msg.offset(), exc=error)
                    self._finished(job)
                elif ok:
                    self._finished(job)
                else:
                    self._retry(job)

            self.post(job, finish)

        return done

    def _fail(self, job: _Job, exc: BaseException) -> None:
        """R16: never stop the service, never lose the record: dead-letter it.

        Not a command already ended: one a revoke gave up is its partition's next
        owner's to decide (a copy in the DLQ from here would be a second answer). Nor
        one the journal failed for being damaged or unusable for good: every command
        would fail the same way, so the loop stops (:class:`JournalUnusable`) and
        leaves it uncommitted."""
        if journal_unusable(exc):
            self._leave(job)
            if self._closing:
                return
            if isinstance(exc, JournalUnusable):
                raise exc
            raise journal_stop(self._handler.journal.path, exc) from exc
        if job.ended:
            log.warning(
                "the command at offset %s failed after it was given up (%s): left to "
                "the partition's owner",
                job.msg.offset(),
                _error_text(exc),
            )
            return
        command = job.command
        if command is not None:
            _log_failure("handling %s %s failed", command.TYPE, command.event_id, exc=exc)
        job.settled = True
        self._dead_letter(job, "handler-error", _error_text(exc))

    def _broken(self, job: _Job, exc: Exception) -> None:
        """A step of ``job`` raised (a bug; the journal, an encoding or a metrics
        hook failing): end the job as one the loop cannot complete, in the DLQ (R16),
        so its saga's later commands and its partition's offsets move on. Not tried
        again: its tool may have run (its "started" mark, if any, stays, so a
        redelivery is an unknown outcome), and what failed may fail every time."""
        if job.ended and not journal_unusable(exc):
            log.error(
                "a step of the command at offset %s failed after it ended",
                job.msg.offset(),
                exc_info=exc,
            )
            return
        if job.command is None:  # else _fail names it
            log.error("a step of the command at offset %s failed", job.msg.offset(), exc_info=exc)
        self._fail(job, exc)

    def _dead_letter(self, job: _Job, reason: str, detail: str) -> None:
        rt = self._rt

        def write() -> bool:
            try:
                rt._dead_letters.write(job.msg, reason, detail)
            except DeliveryFailed:  # tried again: no offset moves past a record not kept
                log.exception("dead-lettering offset %s failed", job.msg.offset())
                return False
            rt.metrics.dlq(reason)
            return True

        self._tools.submit(job, write, self._blocking_done(job))

    def _retry(self, job: _Job) -> None:
        """Try ``job``'s command again after a pause; its saga's later commands wait
        behind it, so their order holds (the journal re-sends a stored outcome, never
        reruns a tool). Closing, it is left undone: its offset stays uncommitted."""
        if job.ended:
            return
        job.ended = True
        msg = job.msg
        self._running.pop(msg.key(), None)
        if self._closing:
            self._queues.pop(msg.key(), None)
            return
        self._seq += 1
        heapq.heappush(self._retries, (time.monotonic() + _RETRY_AFTER_S, self._seq, msg))

    def _finished(self, job: _Job) -> None:
        """``job`` is done: its offset may be committed; its key's next one starts."""
        if job.ended:
            return
        job.ended = True
        msg = job.msg
        partition = msg.partition() or 0
        self._done.setdefault(partition, set()).add(msg.offset() or 0)
        self.pending -= 1
        key = msg.key()
        self._running.pop(key, None)
        queue_ = self._queues.get(key)
        if not queue_ or self._closing:
            self._queues.pop(key, None)
            return
        self._start(queue_.popleft())

    # --------------------------------------------------------- offsets, rebalance

    def in_flight(self) -> set[str] | None:
        """Event ids of the commands under way here, whose journal entries must stay
        (one sent again after a failed send re-reads its entry); None while any waits
        to be tried again (not known by id until it starts again)."""
        if self._retries:
            return None
        return {j.command.event_id for j in self._running.values() if j.command is not None}

    def committable(self) -> dict[int, int]:
        """Per partition, the next offset to commit when it moved since last time."""
        out: dict[int, int] = {}
        for partition, done in self._done.items():
            if not done:
                continue
            taken = self._taken[partition]
            last = None
            while taken and taken[0] in done:
                last = taken.popleft()
                done.discard(last)
            if last is not None and self._committed.get(partition) != last + 1:
                out[partition] = self._committed[partition] = last + 1
        return out

    def drain(self, partitions: set[int], within_s: float) -> None:
        """Serve until no command of ``partitions`` is queued or running, for at most
        ``within_s``; then give up the ones that are (:meth:`_give_up`)."""
        until = time.monotonic() + within_s
        while any(len(self._taken.get(p, ())) > len(self._done.get(p, ())) for p in partitions):
            if self._hurry or time.monotonic() >= until:
                self._give_up(partitions)
                return
            self._pause()

    def _give_up(self, partitions: set[int], why: str = "revoked") -> None:
        """Leave the unfinished commands of ``partitions`` to their next owner.

        Their offsets stay uncommitted, so the owner reads them again, and nothing of
        them is done here any more: a tool not started yet never starts, one running
        is answered for by nobody here (what it returns is dropped), a retry is
        dropped, a saga's queued commands too. The journal and the ledger hold what
        the owner needs to decide each without running a tool twice: an execution
        whose tool may have run has its intent on the ledger and its "started" mark
        here, so it is reported as an unknown outcome and reconciled (R11); one whose
        intent never reached the ledger never ran; one given up before its tool
        started is journalled :data:`UNSTARTED` with the intent it sent (here, or by
        its tool thread's :class:`_GivenUp`), so it runs when it comes back here; an
        outcome already journalled (or on the ledger) is re-sent. A compensation runs
        again under its key (R8)."""
        for key, job in list(self._running.items()):
            if (job.msg.partition() or 0) in partitions:
                plan, command = job.plan, job.command
                if job.waiting and plan is not None and plan.intent is not None:
                    # its intent (maybe on the ledger) or "started" mark not taken
                    # yet: its tool never ran here, as the journal says from now on
                    assert isinstance(command, ExecuteStep)
                    row = self._handler.unstarted_row(command, plan.intent)
                    self._rows.append((row, job, _acknowledged))
                job.ended = job.settled = True
                del self._running[key]
                self.pending -= 1 + len(self._queues.pop(key, ()))
                log.warning(
                    "partition %s %s with the command at offset %s unfinished: left "
                    "to the partition's next owner",
                    job.msg.partition(),
                    why,
                    job.msg.offset(),
                )
        kept = []
        for entry in self._retries:
            msg = entry[2]
            if (msg.partition() or 0) in partitions:
                self.pending -= 1 + len(self._queues.pop(msg.key(), ()))
            else:
                kept.append(entry)
        heapq.heapify(kept)
        self._retries = kept

    def _pause(self) -> None:
        """Serve a turn, then block as the run loop would (without consuming)."""
        self.serve()
        self.wait()
        self._writer.producer.poll(self.wait_s(0.001))

    def forget(self, partitions: set[int]) -> None:
        for p in partitions:
            self._taken.pop(p, None)
            self._done.pop(p, None)
            self._committed.pop(p, None)

    def close(self) -> None:
        """Finish the commands running now; drop the queued ones (redelivered later,
        since their offsets are never committed)."""
        self._closing = True
        self._unwritten_at = 0.0  # marks the journal could not write: once more, now
        for queue_ in self._queues.values():
            self.pending -= len(queue_)
            queue_.clear()
        self.pending -= len(self._retries)
        for _due, _seq, msg in self._retries:
            self._queues.pop(msg.key(), None)
        self._retries.clear()
        while self._queues or self._inbox or self._rows:
            if self._running and (self._hurry or self._tools.exhausted):
                # Stopping now, or every tool thread is stuck: what waits for one
                # would wait as long as the provider hangs.
                running = {j.msg.partition() or 0 for j in self._running.values()}
                why = "stopping now" if self._hurry else "stopping with every tool thread stuck"
                self._give_up(running, why)
            self._pause()
        self._tools.close()

    def hurry(self) -> None:
        """(Any thread) Closing, give up the commands running instead of waiting for
        them (:meth:`ParticipantRuntime.stop_now`)."""
        self._hurry = True
        self._woken.set()


def _check_served(spec: ToolSpec, participant: str) -> None:
    if spec.participant != participant:
        log.info(
            "tool %s (declared by %s) is served as participant %s",
            spec.name,
            spec.participant,
            participant,
        )
