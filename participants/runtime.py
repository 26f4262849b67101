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
import heapq
import logging
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

import orjson

from participants.catalogue import Catalogue, ToolSpec
from participants.context import CallContext, call_context, serve_async_tools
from participants.declarations import Accepted, CompensationContext
from participants.errors import InvalidArgumentsError, LedgerRefError
from participants.ledger_probe import LedgerProbe
from sagaline.kafka import (
    Consumer,
    DeadLetterWriter,
    DeliveryFailed,
    KafkaException,
    LedgerReader,
    LedgerWriter,
    Message,
    TopicPartition,
    create_consumer,
    ensure_topics,
    raise_if_fatal,
    watermarks,
)
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
from schemas.limits import DEFAULT_LIMITS, RESULT_TOO_LARGE, Limits, omitted_result
from schemas.sealing import Sealer, SealError
from schemas.settings import Settings
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

# How often the runtime commits offsets (asynchronously). A crash redelivers at most
# this much finished work, which the journal recognises and answers without rerunning.
_COMMIT_INTERVAL_S = 0.1
R = TypeVar("R", bound=Record)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _json(value: Any) -> bytes:
    return orjson.dumps(value, default=_jsonable)


def _jsonable(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    raise TypeError(f"tool result of type {type(value).__name__} is not JSON-serializable")


class CommandJournal:
    """Durable record of handled commands (SQLite), so a redelivery is recognised.

    States: ``started`` (the tool may have run), ``done`` (outcome stored, re-sent on
    redelivery), ``accepted`` (an async compensation awaiting its completion).
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
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

    def _write(self, rows: list[tuple[str, str, bytes | None, bytes | None, int]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT INTO handled (command_id, state, command, outcome, at) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(command_id) DO UPDATE SET "
                    "state = excluded.state, outcome = COALESCE(excluded.outcome, outcome), "
                    "command = COALESCE(excluded.command, command), at = excluded.at",
                    rows,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def forget(self, command_id: str) -> None:
        """Drop a command's row: it was marked started but its tool never ran (the
        intent was not acknowledged), so a redelivery must run it, not report it as
        an unknown outcome."""
        with self._lock:
            self._db.execute("DELETE FROM handled WHERE command_id = ?", (command_id,))

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


@dataclass(frozen=True)
class _Outcome:
    record: Record
    state: str = "done"


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
        self._metrics = metrics
        self._stopping = threading.Event()
        self._watchdog = _Watchdog(f"{participant}-deadlines")

    def close(self) -> None:
        self._stopping.set()
        self._watchdog.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._ledger is not None:
            self._ledger.close()

    # ------------------------------------------------------------------ dispatch

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
        seen = self.journal.get(command.event_id)
        if seen is not None and seen[0] in ("done", "accepted") and seen[1] is not None:
            # A redelivery: the work is done; re-send its outcome (same event id, so
            # the coordinator deduplicates) in case the first send was lost.
            if self._metrics is not None:
                self._metrics.duplicate_prevented()
            from schemas.codec import decode

            self._append(decode(seen[1]))
            return seen[0]
        probe = seen is None and maybe_taken_elsewhere
        earlier = self._on_ledger(command) if probe else None
        if earlier is not None:
            # Another replica (no shared journal) already took this command.
            if self._metrics is not None:
                self._metrics.duplicate_prevented()
            log.info("%s %s: already on the ledger, not run again", command.TYPE, command.event_id)
            outcome = earlier
        elif command.tool not in self.catalogue:  # type: ignore[attr-defined]
            outcome = _Outcome(self._unknown_tool(command))
        elif isinstance(command, ExecuteStep):
            outcome = self._execute(command, restarted=seen is not None, encoded=encoded)
        elif isinstance(command, CompensateStep):
            outcome = self._compensate(command, encoded=encoded)
        elif isinstance(command, ReconcileStep):
            outcome = self._reconcile(command)
        else:
            raise TypeError(f"{command.TYPE} is not a participant command")
        return self._settle(command, outcome, encoded)

    def _settle(self, command: Record, outcome: _Outcome, encoded: bytes | None = None) -> str:
        """Journal ``outcome`` as the command's answer, then publish it."""
        from schemas.codec import encode

        # An accepted compensation is confirmed from the journal after a restart
        # (``accepted()``), which needs the command itself.
        command_bytes = (encoded or encode(command)) if outcome.state == "accepted" else None
        self.journal.mark(
            command.event_id, outcome.state, command=command_bytes, outcome=encode(outcome.record)
        )
        self._publish(outcome.record)
        if self._metrics is not None:
            self._metrics.observe_output(outcome.record)
        return outcome.state

    def _on_ledger(self, cmd: Record) -> _Outcome | None:
        """What a journal miss must not ignore: this command's records on the ledger.

        Its outcome there is re-sent as is. An intent with no outcome means a replica
        may have acted (R11): an unknown outcome, which the coordinator reconciles
        through the tool's lookup by idempotency key. Compensations append no intent,
        so only their outcome can be found; one that ran without reporting is run
        again under the same compensation key, which the compensation must honour.
        """
        if self._ledger is None or not isinstance(cmd, (ExecuteStep, CompensateStep)):
            return None
        by_id = {r.event_id: r for r in self._ledger.caused_by(cmd)}
        outcome = by_id.get(derived_event_id(cmd.event_id, "outcome"))
        if outcome is not None:
            return _Outcome(
                outcome, "accepted" if isinstance(outcome, CompensationAccepted) else "done"
            )
        if isinstance(cmd, ExecuteStep) and derived_event_id(cmd.event_id, "intent") in by_id:
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

    # --------------------------------------------------------------- execute step

    def _execute(
        self, cmd: ExecuteStep, *, restarted: bool, encoded: bytes | None = None
    ) -> _Outcome:
        spec = self.catalogue[cmd.tool]
        if restarted:
            # Started before a crash and never finished: it may have acted (R11).
            return self._unknown_outcome(
                cmd, "the participant restarted while the tool was running"
            )
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
        intent_acknowledged = self._begin_append(
            self._record(
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
        )
        # The journal's "started" (the tool may run from now on) is written while the
        # intent is on its way; the tool runs only once both are durable (R10). A
        # crash between them leaves a started command whose intent may be missing:
        # reported as an unknown outcome and reconciled, true (the tool did not run)
        # and safe. An intent the broker refused un-marks it: the tool did not run.
        self.journal.mark(cmd.event_id, "started", command=encoded or _command_bytes(cmd))
        try:
            intent_acknowledged()
        except BaseException:
            self.journal.forget(cmd.event_id)
            raise
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

        try:
            args = self._sealer.open(orjson.loads(raw_args), spec.secret_paths, cmd.saga_id)
            result = self._run(
                ctx, lambda: spec.invoke(args), cmd.deadline_ms, command=cmd, late=late
            )
        except concurrent.futures.TimeoutError:
            return late()
        except (InvalidArgumentsError, SealError) as exc:
            return _Outcome(self._failed(cmd, common, FailureKind.BUSINESS_REJECTION, exc))
        except Exception as exc:
            kind = (
                FailureKind.BUSINESS_REJECTION
                if spec.is_business_rejection(exc)
                else FailureKind.TRANSIENT
            )
            return _Outcome(self._failed(cmd, common, kind, exc))
        body = self._bounded_result(cmd, spec, _json(result))
        return _Outcome(
            self._record(
                StepCommitted,
                cmd,
                "outcome",
                **common,
                provider_operation_id=_operation_id(spec.provider_operation_id(result)),
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
        self, cmd: ExecuteStep, common: dict[str, Any], kind: FailureKind, exc: BaseException
    ) -> StepFailed:
        return self._record(
            StepFailed,
            cmd,
            "outcome",
            **common,
            kind=kind,
            error_type=type(exc).__name__,
            message=str(exc)[:2000],
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

        try:
            ctx = self._compensation_context(cmd, spec)
            result = self._run(
                call, lambda: spec.compensate(ctx), spec.deadline_ms, command=cmd, late=late
            )
            if isinstance(result, Accepted):
                return _Outcome(
                    self._record(
                        CompensationAccepted,
                        cmd,
                        "outcome",
                        **common,
                        provider_operation_id=_operation_id(result.operation_id),
                    ),
                    state="accepted",
                )
            verified = (
                self._run(call, lambda: spec.verify(ctx), spec.deadline_ms, command=cmd, late=late)
                if spec.verify_func is not None
                else None
            )
        except concurrent.futures.TimeoutError:
            return late()
        except Exception as exc:
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
                    message=str(exc)[:2000],
                )
            )
        return _Outcome(
            self._record(
                CompensationCommitted,
                cmd,
                "outcome",
                **common,
                provider_operation_id=_operation_id(spec.provider_operation_id(result)),
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
        or until the declared wait (``completion_within``) after the acceptance (R12).

        Runs on a background thread; resumed for every ``accepted`` journal row when
        the runtime starts. The wait counts from the acceptance as recorded, so a
        restart does not extend it. Past it this stops quietly: the coordinator's own
        timer for the same deadline raises the one incident, also when this
        participant is down. A tool with no ``verify`` is completed by
        :meth:`complete_accepted` (the provider's completion receipt) instead.
        """
        from schemas.codec import decode

        cmd = decode(command, CompensateStep)
        spec = self.catalogue[cmd.tool]
        if spec.verify_func is None:
            return  # completed by complete_accepted, or by the coordinator's deadline
        deadline = self._completion_deadline(command_id, spec)
        ctx = self._compensation_context(cmd, spec)
        call = CallContext(
            cmd.saga_id,
            cmd.step_id,
            cmd.tool,
            cmd.idempotency_key,
            cmd.attempt,
            compensation_key=cmd.compensation_key,
        )
        while not self._stopping.is_set():
            try:
                if self._run(call, lambda: spec.verify(ctx), spec.deadline_ms):
                    self._completed(command_id, cmd, verified=True)
                    return
            except Exception:
                log.exception("verification of %s failed; retrying", cmd.compensation_key)
            if self._clock() >= deadline:
                log.warning(
                    "compensation %s was not confirmed within its declared wait; the "
                    "coordinator raises the incident",
                    cmd.compensation_key,
                )
                return
            self._stopping.wait(self._verify_poll_ms / 1000)

    def complete_accepted(self, provider_operation_id: str, result: Any = None) -> bool:
        """Record the provider's completion receipt for an accepted compensation (R12).

        Call it from wherever the provider reports completion (a webhook, a poller).
        Returns False when no accepted compensation of this participant has that
        operation id (already completed, or never accepted here).
        """
        from schemas.codec import decode

        for command_id, command in self.journal.accepted():
            seen = self.journal.get(command_id)
            if seen is None or seen[1] is None:
                continue
            outcome = decode(seen[1])
            if (
                isinstance(outcome, CompensationAccepted)
                and outcome.provider_operation_id == provider_operation_id
            ):
                cmd = decode(command, CompensateStep)
                spec = self.catalogue[cmd.tool]
                self._completed(
                    command_id,
                    cmd,
                    verified=None if spec.verify_func is None else True,
                    result=result,
                    provider_operation_id=provider_operation_id,
                )
                return True
        return False

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
            result=_json(result),
            verified=verified,
        )
        self._append(record)
        self.journal.mark(command_id, "done", outcome=encode(record))

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
        except Exception as exc:
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
                        found.provider_operation_id or spec.provider_operation_id(found.result)
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

        On a runtime's lane worker (see :class:`_KeyOrderedWork`) the tool runs right
        here: handing it to a pool thread and back costs two thread switches a call,
        the largest share of a command's CPU. The watchdog then enforces the
        deadline: when it passes, it settles ``command`` with ``late()`` (the answer
        a timeout gives) on a fresh worker that carries on with the saga's later
        commands, and this thread, once the tool returns, discards what it returned
        and leaves (:class:`_TakenOver`). Elsewhere (background verification, a
        handler driven directly) the tool runs on the pool and a timeout raises
        ``concurrent.futures.TimeoutError``.
        """

        def call() -> Any:
            with call_context(ctx):
                return fn()

        lane: _Lane | None = getattr(_here, "lane", None)
        if lane is None or command is None or late is None:
            return self._pool.submit(call).result(timeout=deadline_ms / 1000)

        def take_over() -> None:
            lane.take_over(lambda: self._settle(command, late()))

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


def _operation_id(found: str | None) -> str | None:
    """A provider operation id, bounded: by default a ``str`` result *is* the id, and a
    tool returning a 2 MB string must not make its outcome unwritable. A longer one
    is kept as its fingerprint."""
    if found is None or len(found) <= _MAX_OPERATION_ID:
        return found
    return f"sha256:{fingerprint(found.encode())} ({len(found)} chars)"


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
    crash redelivers only unfinished work, which the journal recognises.
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
        self.metrics: RuntimeMetrics = metrics or NoMetrics()
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (got {max_in_flight})")
        self.max_in_flight = max_in_flight
        state = state_dir or settings.state_dir / self.participant
        self.journal = CommandJournal(state / "commands.sqlite")
        self._writer = LedgerWriter(bootstrap, self.topics, self.signer, background_poll=True)
        self._reader = LedgerReader(bootstrap)
        self._dead_letters = DeadLetterWriter(
            self._writer.producer, self.topics.dlq, acknowledged=True, polled=True
        )
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
            publish=self._publish_outcome,
            begin_append=self._writer.begin_append,
        )
        # Set until stop(), which may come before run() reaches its loop (a SIGTERM
        # during start-up must not be lost).
        self._running = threading.Event()
        self._running.set()
        self._background: list[threading.Thread] = []
        self._work = _KeyOrderedWork(
            self._process, max_in_flight, self.participant, resume=self._process
        )
        # Per command partition, its end offset when it was assigned to this replica.
        self._assigned_end: dict[int, int] = {}
        for spec in catalogue.values():
            _check_served(spec, self.participant)
        if any(spec.is_async for spec in catalogue.values()):
            serve_async_tools()  # async tools share one long-lived loop, sync ones threads

    def publish_catalogue(self) -> None:
        """Publish every tool's contract and definition on the compacted catalogue
        topic, so agents can call the tools by name."""
        for spec in self.handler.catalogue.values():
            entry = {
                "participant": self.participant,
                "contract": spec.contract(self.participant).model_dump(mode="json"),
                "definition": spec.definition(),
                "secret_paths": list(spec.secret_paths),
            }
            self._writer.write(self.topics.catalogue, spec.name.encode(), orjson.dumps(entry))

    def _fetch(self, ref: LedgerRef) -> Record | None:
        """The ledger record a command's reference points to (signature checked)."""
        msg = self._reader.message_at(self.topics.events, ref.partition, ref.offset)
        if msg is None:
            return None
        return from_message(msg.key(), msg.value(), msg.headers(), self.signer)

    def _append(self, record: Record) -> None:
        # Wait for the broker's acknowledgement of this record (not a flush of every
        # thread's): the intent must be durable before the tool runs (R10), and an
        # outcome before the command's offset is committed.
        self._writer.append(record)

    def _publish_outcome(self, record: Record) -> None:
        """Send a command's journalled outcome; on a lane worker without waiting for it.

        The command is finished (its offset committable, its saga's next command
        started) by the delivery report, on the writer's poller thread (see
        :class:`_Lane`), so the worker takes other work instead of sleeping until the
        broker answers. An accepted compensation's outcome is awaited here: its
        background confirmation starts only once the acceptance is on the ledger.
        """
        lane: _Lane | None = getattr(_here, "lane", None)
        if lane is None or isinstance(record, CompensationAccepted):
            self._writer.append(record)
            return
        self._writer.append_then(record, lane.delivered)
        lane.deferred = True  # after: a produce that raised is not awaited

    def install_signal_handlers(self) -> None:
        def _stop(signum: int, frame: FrameType | None) -> None:
            self.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def stop(self) -> None:
        self._running.clear()

    def run(self, *, ready: threading.Event | None = None) -> None:
        ensure_topics(
            self.bootstrap,
            self.topics,
            [self.participant],
            self.settings.partitions,
            replication=self.settings.replication,
        )
        group = f"{self.topics.prefix}sagaline-participant-{self.participant}"
        consumer = create_consumer(
            self.bootstrap, group, **{"group.instance.id": f"{group}-{self.instance_id}"}
        )

        def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
            for tp in partitions:
                _low, high = watermarks(c, TopicPartition(tp.topic, tp.partition))
                self._assigned_end[tp.partition] = high

        def on_revoke(c: Consumer, partitions: list[TopicPartition]) -> None:
            # Finish what was taken from these partitions and commit it before another
            # member gets them: it must not run a command that is still running here.
            self._work.wait_idle({p.partition for p in partitions})
            try:
                self._commit(c, asynchronous=False)
            except KafkaException as exc:  # lost, not revoked: the next owner redelivers
                log.warning("offset commit on revoke failed (%s)", exc)
            self._work.forget({p.partition for p in partitions})

        consumer.subscribe(
            [self.topics.commands(self.participant)],
            on_assign=on_assign,
            on_revoke=on_revoke,
            on_lost=on_revoke,
        )
        self.publish_catalogue()
        for command_id, command in self.journal.accepted():
            self._confirm_in_background(command_id, command)
        log.info(
            "participant %s serving %s (%d commands in flight at most)",
            self.participant,
            self.topics.commands(self.participant),
            self.max_in_flight,
        )
        if ready is not None:
            ready.set()
        limit = 2 * self.max_in_flight
        next_commit = 0.0
        try:
            while self._running.is_set():
                if self._work.pending >= limit:
                    # Backpressure by not taking more (pause/resume would drop and
                    # refetch what librdkafka holds, a stall of hundreds of ms). Woken
                    # once the workers have room for a whole batch again, not by
                    # every command that finishes.
                    self._work.wait_below(self.max_in_flight + 1, 0.2)
                else:
                    msg = consumer.poll(0.05 if self._work.pending else 0.2)
                    batch = [] if msg is None else [msg, *consumer.consume(self.max_in_flight, 0)]
                    for m in batch:
                        error = m.error()
                        if error is not None:
                            raise_if_fatal(error)  # a fenced consumer: exit, restart
                            log.warning("consumer error: %s", error)
                            continue
                        self._work.submit(m)
                if time.monotonic() >= next_commit:  # one OffsetCommit per interval
                    self._commit(consumer, asynchronous=True)
                    next_commit = time.monotonic() + _COMMIT_INTERVAL_S
        finally:
            self._work.close()  # lets running commands finish; queued ones are redelivered
            # Outcomes still on their way finish their commands (delivery reports).
            self._writer.producer.flush(10)
            try:
                self._commit(consumer, asynchronous=False)
            except KafkaException as exc:
                log.warning("final offset commit failed (%s): commands will be redelivered", exc)
            self.handler.close()
            consumer.close()
            self._writer.close()
            self.journal.close()

    def _commit(self, consumer: Consumer, *, asynchronous: bool) -> None:
        """Commit, per partition, the offset below which every command is done."""
        topic = self._command_topic
        offsets = [TopicPartition(topic, p, o) for p, o in self._work.committable().items()]
        if offsets and asynchronous:
            consumer.commit(offsets=offsets, asynchronous=True)
        elif offsets:
            consumer.commit(offsets=offsets, asynchronous=False)

    def _process(self, msg: Message, resume: Callable[[], str] | None = None) -> bool:
        """Handle one command; False when its record could not be appended (retry).

        ``resume``: the watchdog took the command over when its tool overran the
        deadline; settle it with this instead of handling it (the journal has it
        started, the tool ran)."""
        try:
            command = from_message(msg.key(), msg.value(), msg.headers(), self.signer)
            if not isinstance(command, (ExecuteStep, CompensateStep, ReconcileStep)):
                raise _NotACommand(f"{command.TYPE} is not a participant command")
        except (CodecError, _NotACommand) as exc:
            reason = exc.reason if isinstance(exc, CodecError) else "not-a-command"
            self._dead_letters.write(msg, reason, str(exc))
            self.metrics.dlq(reason)
            return True
        if resume is None:
            self.metrics.observe_record(command)
        try:
            # Only commands already on the partition when it was assigned here can have
            # been taken by another replica; the ledger probe is for those alone.
            taken_before = self._assigned_end.get(msg.partition() or 0, 0)
            state = (
                resume()
                if resume is not None
                else self.handler.handle(
                    command,
                    maybe_taken_elsewhere=(msg.offset() or 0) < taken_before,
                    encoded=msg.value(),
                )
            )
        except DeliveryFailed:
            log.exception(
                "appending for %s %s failed; reading it again", command.TYPE, command.event_id
            )
            return False
        except Exception as exc:  # R16: never stop the service, never lose the record
            log.exception("handling %s %s failed", command.TYPE, command.event_id)
            self._dead_letters.write(msg, "handler-error", f"{type(exc).__name__}: {exc}")
            self.metrics.dlq("handler-error")
            return True
        if state == "accepted":
            self._confirm_in_background(command.event_id, msg.value() or _command_bytes(command))
        return True

    def _confirm_in_background(self, command_id: str, command: bytes) -> None:
        thread = threading.Thread(
            target=self.handler.confirm_accepted,
            args=(command_id, command),
            name=f"{self.participant}-confirm",
            daemon=True,
        )
        thread.start()
        self._background.append(thread)


class _NotACommand(Exception):
    pass


class _TakenOver(BaseException):
    """Raised on a lane worker whose tool returned after the watchdog had already
    answered for the command: unwinds the worker past every ``except Exception``
    (nothing of the late call may be journalled or published) and ends it."""


# The message a lane worker thread is running (a _Lane), read by CommandHandler._run.
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
    """Enforces the deadlines of tools run inline on lane workers, one thread for all.

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


_PENDING = object()  # a _Lane's delivery before its outcome's report came


class _Lane:
    """One attempt at a message on a lane worker: what the watchdog needs to take it
    over, and the hand-shake that lets a deferred outcome's delivery report finish it.

    ``deferred``: the outcome went out with :meth:`LedgerWriter.append_then`. The
    worker then looks under the work lock: the report already came (``delivery``),
    so it finishes the message itself; or not, so it marks the lane ``detached`` and
    takes other work, and :meth:`delivered` finishes the message on the poller's
    thread. Either way the key's next message starts only after the outcome is on
    the broker, so one saga's commands stay in order and never run two at once.
    """

    __slots__ = ("deferred", "delivery", "detached", "key", "msg", "thread", "work")

    def __init__(
        self, work: _KeyOrderedWork, key: bytes | None, msg: Message, thread: threading.Thread
    ) -> None:
        self.work = work
        self.key = key
        self.msg = msg
        self.thread = thread
        self.deferred = False
        self.delivery: object = _PENDING
        self.detached = False

    def take_over(self, resume: Callable[[], str]) -> None:
        """Settle this message with ``resume`` on a fresh worker, which then carries on
        with its key's later messages; the stuck thread leaves the pool."""
        self.work._take_over(self, resume)

    def delivered(self, failure: DeliveryFailed | None) -> None:
        """The deferred outcome's delivery report (on the writer's poller thread)."""
        with self.work._lock:
            if not self.detached:
                self.delivery = failure  # the worker is still here and finishes it
                return
        self.work._delivered(self, failure)


class _KeyOrderedWork:
    """Runs messages on worker threads: different keys at once, one key in order.

    A key's messages wait in its own queue while one of them runs; the thread that
    finishes one takes the key's next. Offsets are tracked per partition so the
    caller can commit up to the lowest message not yet done.

    Hand-offs between threads are what a command costs most under the GIL, so each
    is made only when someone waits for it: a submit wakes a worker only when one is
    idle (a busy worker takes the next ready key itself), a finished message wakes
    the caller only when it waits in :meth:`wait_below` (and the count is below its
    limit) or :meth:`wait_idle`, and a worker does not wait for the delivery report
    of a message's outcome (see :class:`_Lane`).
    """

    def __init__(
        self,
        process: Callable[[Message], bool],
        workers: int,
        name: str,
        *,
        resume: Callable[[Message, Callable[[], str]], bool] | None = None,
    ) -> None:
        self._process = process
        self._resume = resume
        self._spawned = 0
        self._workers = workers
        self._name = name
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)  # idle workers wait here
        self._finished = threading.Condition(self._lock)  # wait_below / wait_idle wait here
        # (key, message, sent before and failed: wait before sending again)
        self._ready: collections.deque[tuple[bytes | None, Message, bool]] = collections.deque()
        self._idle = 0  # workers waiting for a ready key and not yet claimed by a submit
        self._threads: list[threading.Thread] = []
        self._queues: dict[bytes | None, collections.deque[Message]] = {}
        self._taken: dict[int, collections.deque[int]] = {}  # partition -> offsets in order
        self._done: dict[int, set[int]] = {}
        self._committed: dict[int, int] = {}
        self._below: int | None = None  # the limit wait_below waits under, while it waits
        self._idle_waiters = 0
        self._closing = threading.Event()
        self.pending = 0

    def submit(self, msg: Message) -> None:
        key = msg.key()
        partition = msg.partition() or 0
        with self._lock:
            self._taken.setdefault(partition, collections.deque()).append(msg.offset() or 0)
            self.pending += 1
            queue = self._queues.get(key)
            if queue is not None:
                queue.append(msg)  # the key is busy: runs after the ones before it
                return
            self._queues[key] = collections.deque()
            self._ready.append((key, msg, False))
            self._wake()

    def _wake(self) -> None:
        """(Under the lock) get a worker to the ready queue: an idle one, or a new one."""
        if self._idle:
            self._idle -= 1  # claimed: a second submit wakes another worker
            self._work_ready.notify()
        elif len(self._threads) < self._workers:
            self._spawn()

    def _spawn(self, *first: Any) -> None:
        """Start a worker (under the lock); ``first``: a taken-over lane it starts with."""
        self._spawned += 1
        thread = threading.Thread(
            target=self._worker, args=first, name=f"{self._name}-cmd-{self._spawned}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _take_over(self, lane: _Lane, resume: Callable[[], str]) -> None:
        with self._lock:
            if lane.thread in self._threads:  # close() must not wait for a late tool
                self._threads.remove(lane.thread)
            self._spawn(lane.key, lane.msg, resume)

    def _delivered(self, lane: _Lane, failure: DeliveryFailed | None) -> None:
        """Finish a detached lane once its outcome's report came (poller thread)."""
        with self._lock:
            if failure is not None:
                if self._closing.is_set():  # not done: its offset stays uncommitted
                    self._queues.pop(lane.key, None)
                    return
                log.warning("%s; sending the outcome again", failure)
                self._ready.appendleft((lane.key, lane.msg, True))  # its saga waits for it
                self._wake()
                return
            following = self._finished_locked(lane.key, lane.msg)
            if following is not None:
                self._ready.append((lane.key, following, False))
                self._wake()

    def _worker(
        self,
        key: bytes | None = None,
        msg: Message | None = None,
        resume: Callable[[], str] | None = None,
    ) -> None:
        if msg is not None and not self._run_key(key, msg, resume=resume):
            return
        while True:
            with self._lock:
                while not self._ready:
                    if self._closing.is_set():
                        return
                    self._idle += 1
                    self._work_ready.wait()
                key, msg, again = self._ready.popleft()
            if not self._run_key(key, msg, again=again):
                return  # taken over: a fresh worker has this key now

    def _run_key(
        self,
        key: bytes | None,
        msg: Message,
        *,
        resume: Callable[[], str] | None = None,
        again: bool = False,
    ) -> bool:
        """Run ``msg`` and then its key's queued messages; False when the watchdog
        took one over from this thread (its tool overran the deadline).

        ``again``: its outcome was not delivered the last time; wait before retrying."""
        while True:
            try:
                while True:
                    if again:
                        # The ledger did not take its record: run it again (the journal
                        # re-sends a stored outcome, never reruns a tool); the saga's
                        # later commands wait behind it, so their order holds.
                        if self._closing.is_set():
                            return True  # not done: its offset stays uncommitted
                        time.sleep(0.5)
                    lane = _here.lane = _Lane(self, key, msg, threading.current_thread())
                    ok = (
                        self._process(msg)
                        if resume is None or self._resume is None
                        else self._resume(msg, resume)
                    )
                    resume = None
                    if ok and lane.deferred:
                        with self._lock:
                            if lane.delivery is _PENDING:
                                lane.detached = True  # its delivery report finishes it
                                return True
                        if lane.delivery is not None:
                            log.warning("%s; sending the outcome again", lane.delivery)
                            ok = False
                    if ok:
                        break
                    again = True
            except _TakenOver:
                return False
            except Exception:  # _process dead-letters what fails; this is a last resort
                log.exception("command at offset %s failed", msg.offset())
            finally:
                _here.lane = None
            with self._lock:
                following = self._finished_locked(key, msg)
            if following is None:
                return True
            msg, again = following, False

    def _finished_locked(self, key: bytes | None, msg: Message) -> Message | None:
        """(Under the lock) ``msg`` is done: count it, wake who waits for that, and
        return its key's next message (None: the key is free)."""
        partition = msg.partition() or 0
        self._done.setdefault(partition, set()).add(msg.offset() or 0)
        self.pending -= 1
        if self._idle_waiters or (self._below is not None and self.pending < self._below):
            self._finished.notify_all()
        queue = self._queues.get(key)
        if not queue or self._closing.is_set():
            self._queues.pop(key, None)
            return None
        return queue.popleft()

    def committable(self) -> dict[int, int]:
        """Per partition, the next offset to commit when it moved since last time."""
        out: dict[int, int] = {}
        with self._lock:
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

    def wait_below(self, limit: int, timeout_s: float) -> None:
        """Block until fewer than ``limit`` messages are queued or running."""
        with self._lock:
            self._below = limit
            try:
                self._finished.wait_for(lambda: self.pending < limit, timeout_s)
            finally:
                self._below = None

    def wait_idle(self, partitions: set[int]) -> None:
        """Block until no message of ``partitions`` is queued or running."""
        with self._lock:
            self._idle_waiters += 1
            try:
                while any(
                    len(self._taken.get(p, ())) > len(self._done.get(p, ())) for p in partitions
                ):
                    self._finished.wait(1.0)
            finally:
                self._idle_waiters -= 1

    def forget(self, partitions: set[int]) -> None:
        with self._lock:
            for p in partitions:
                self._taken.pop(p, None)
                self._done.pop(p, None)
                self._committed.pop(p, None)

    def close(self) -> None:
        """Finish the messages running now; drop the queued ones (redelivered later,
        since their offsets are never committed)."""
        self._closing.set()
        with self._lock:
            for queue in self._queues.values():
                self.pending -= len(queue)
                queue.clear()
            self.pending -= len(self._ready)
            self._ready.clear()
            self._idle = 0
            self._work_ready.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join()


def _check_served(spec: ToolSpec, participant: str) -> None:
    if spec.participant != participant:
        log.info(
            "tool %s (declared by %s) is served as participant %s",
            spec.name,
            spec.participant,
            participant,
        )
