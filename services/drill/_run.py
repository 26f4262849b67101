"""Running the drill: one saga per (seam, step) on the real broker, then a verdict.

Every case runs the whole plan as one saga with one fault armed (see ``_inject``),
against a coordinator, the participants' runtimes and an agent-side saga client in
this process, under a topic prefix of its own. The drill plays the operator too: it
grants approvals (except where the case lets one expire) and settles unknown
outcomes with the truth its wrappers observed, as a person checking the provider
would. After each case it reads the ledger (the receipt) and asks the provider,
through the tool's own ``lookup`` and ``verify``, whether the two agree.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from coordinator.core import DEFAULT_POLICY
from coordinator.shell import Coordinator
from participants.catalogue import Catalogue, ToolSpec
from participants.client import SagaCallError, SagaClient
from participants.context import CallContext, call_context
from participants.declarations import CompensationContext
from participants.plan import PlannedCall
from participants.runtime import ParticipantRuntime
from sagaline.kafka import (
    OFFSET_BEGINNING,
    LedgerReader,
    TopicPartition,
    create_consumer,
    create_producer,
    ensure_topics,
    headers_of,
)
from sagaline.ops.actions import OperatorChannel, approval_granted, incident_resolved
from schemas import (
    ApprovalRequested,
    IncidentRaised,
    IncidentResolved,
    ReconcileResult,
    Record,
    Reversibility,
    SagaEndRequested,
    SagaOutcome,
    SagaTerminal,
    StepCommitted,
    StepReconciled,
    StepScheduled,
    envelope_for,
    idempotency_key,
)
from schemas.errors import CodecError
from schemas.receipt import Disposition, Receipt
from schemas.settings import Settings
from schemas.wire import DLQ_REASON, from_message
from services.drill._inject import FaultBoard, Seam, instrument

__all__ = ["CaseResult", "DrillReport", "Verdict", "run_drill"]

OPERATOR = "drill-operator"

PER_STEP_FAULT = frozenset(
    {
        Seam.BEFORE_RECEIPT,
        Seam.LEDGER_APPEND,
        Seam.DURING_COMPENSATION,
        Seam.BEFORE_COMPENSATION_ACK,
        Seam.THROTTLING,
        Seam.CONCURRENT_CANCELLATION,
    }
)
"""Seams injected inside a tool call; the others are done by the drill's agent."""

ABORT_AFTER = frozenset(
    {
        Seam.AFTER_COMMIT,
        Seam.BEFORE_RECEIPT,
        Seam.LEDGER_APPEND,
        Seam.DURING_COMPENSATION,
        Seam.BEFORE_COMPENSATION_ACK,
    }
)
"""Seams whose case aborts right after the target step, so what it did is undone."""

SERIAL = (Seam.PARTIAL_OUTAGE, Seam.EXPIRED_APPROVAL)
"""Seams that stop a participant or move the coordinator's clock: one case at a time."""


class Verdict(enum.StrEnum):
    """What one case came to."""

    CONVERGED = "converged"  # ledger and provider agree on a clean terminal state
    ESCALATED = "escalated"  # truthfully handed to a person (incident), and they agree
    FAILED = "FAILED"  # stuck, or the ledger and the provider disagree
    NOT_APPLICABLE = "n/a"  # the seam does not exist for this step


@dataclass(frozen=True)
class CaseResult:
    seam: Seam
    step: int  # index into the plan
    tool: str
    saga_id: str
    verdict: Verdict
    status: str  # the saga's terminal status, or what it waits for
    detail: str = ""


@dataclass
class DrillReport:
    """Every case's verdict; :meth:`matrix` prints seam x step."""

    calls: list[PlannedCall]
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if r.verdict == Verdict.FAILED]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.verdict.value] = out.get(r.verdict.value, 0) + 1
        return out

    def matrix(self) -> str:
        heads = [f"{i + 1}:{c.tool}" for i, c in enumerate(self.calls)]
        seams = list(dict.fromkeys(r.seam for r in self.results))
        cell = {(r.seam, r.step): r.verdict.value for r in self.results}
        first = max([len("seam")] + [len(s.value) for s in seams])
        widths = [max(len(h), len(Verdict.CONVERGED)) for h in heads]
        lines = [
            "  ".join(
                ["seam".ljust(first), *(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
            )
        ]
        for seam in seams:
            row = [cell.get((seam, i), "") for i in range(len(heads))]
            lines.append(
                "  ".join(
                    [
                        seam.value.ljust(first),
                        *(v.ljust(w) for v, w in zip(row, widths, strict=True)),
                    ]
                )
            )
        counts = ", ".join(f"{n} {v}" for v, n in sorted(self.counts().items()))
        lines.append(f"{len(self.results)} cases in {self.seconds:.0f} s: {counts}")
        for r in self.results:
            if r.verdict in (Verdict.FAILED, Verdict.ESCALATED):
                lines.append(f"  {r.verdict} {r.seam.value} @ {r.step + 1}:{r.tool}: {r.detail}")
        return "\n".join(lines)


class _Clock:
    """Wall-clock ms plus an offset the drill moves to let approvals expire."""

    def __init__(self) -> None:
        self.offset = 0

    def __call__(self) -> int:
        return int(time.time() * 1000) + self.offset


class _Watcher:
    """Follows ``sagaline.events`` for the drill's sagas; plays the operator."""

    def __init__(self, stage: _Stage) -> None:
        self.stage = stage
        self.records: dict[str, list[Record]] = {}
        self.failures: dict[str, list[str]] = {}  # saga id -> what the operator failed to do
        self.no_grant: set[str] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        settings = stage.settings
        self._consumer = create_consumer(
            stage.bootstrap, f"{settings.topic_prefix}drill-{uuid.uuid4().hex[:6]}"
        )
        # From the beginning: the drill's topics are its own (a fresh prefix), and
        # nothing a case writes may be missed.
        self._consumer.assign(
            [
                TopicPartition(settings.topics.events, p, OFFSET_BEGINNING)
                for p in range(settings.partitions)
            ]
        )
        self._thread = threading.Thread(target=self._run, name="drill-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()

    def of(self, saga_id: str) -> list[Record]:
        with self._cond:
            return list(self.records.get(saga_id, []))

    def wait(self, saga_id: str, check: Callable[[list[Record]], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = check(self.records.get(saga_id, []))
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found
                self._cond.wait(min(left, 0.5))

    def _run(self) -> None:
        signer = self.stage.settings.signer()
        while not self._stop.is_set():
            msg = self._consumer.poll(0.2)
            if msg is None or msg.error() is not None:
                continue
            try:
                record = from_message(msg.key(), msg.value(), headers_of(msg), signer)
            except CodecError:
                continue
            with self._cond:
                self.records.setdefault(record.saga_id, []).append(record)
                self._cond.notify_all()
            try:
                self._operate(record)
            except Exception as exc:  # it must not stop the watcher; that case fails
                with self._cond:
                    self.failures.setdefault(record.saga_id, []).append(
                        f"the drill's operator could not act on {record.TYPE}:"
                        f" {type(exc).__name__}: {exc}"
                    )

    def _operate(self, record: Record) -> None:
        stage = self.stage
        if isinstance(record, ApprovalRequested) and record.saga_id not in self.no_grant:
            stage.operator.publish(approval_granted(record, operator=OPERATOR, now=stage.clock()))
        elif isinstance(record, IncidentRaised) and record.kind == "unknown-outcome":
            # A person would ask the provider; the drill knows what its wrapper saw.
            key = _keys(self.of(record.saga_id)).get(record.step_id or "")
            truth = "COMMITTED" if key and stage.board.ran(key) else "NOT_FOUND"
            stage.operator.publish(
                incident_resolved(record, operator=OPERATOR, resolution=truth, now=stage.clock())
            )


class _Stage:
    """Coordinator, participants, client and operator for one drill run."""

    def __init__(
        self,
        catalogues: Sequence[Catalogue],
        bootstrap: str,
        state_dir: Path,
        *,
        prefix: str,
        case_timeout_s: float,
        hmac_key: bytes | None,
    ) -> None:
        self.bootstrap = bootstrap
        self.settings = Settings(
            bootstrap=bootstrap,
            topic_prefix=prefix,
            partitions=2,
            hmac_key=hmac_key,
            state_dir=state_dir,
        )
        self.board = FaultBoard()
        self.catalogues = [instrument(c, self.board) for c in catalogues]
        self.specs: dict[str, ToolSpec] = {n: s for c in catalogues for n, s in c.items()}
        self.participant_of = {n: c.name for c in catalogues for n in c}
        self.clock = _Clock()
        ensure_topics(
            bootstrap, self.settings.topics, [c.name for c in catalogues], self.settings.partitions
        )
        contracts = {n: s for c in catalogues for n, s in c.contracts().items()}
        self.client = SagaClient(
            self.settings, bootstrap, contracts=contracts, call_timeout_s=case_timeout_s
        )
        self.operator = OperatorChannel(bootstrap, self.settings.topics, self.settings.signer())
        self.coordinator = Coordinator(
            self.settings, bootstrap, instance_id=f"drill-{uuid.uuid4().hex[:6]}", clock=self.clock
        )
        self.watcher = _Watcher(self)
        self._threads: list[threading.Thread] = []
        self.runtimes: dict[str, tuple[ParticipantRuntime, threading.Thread]] = {}

    def __enter__(self) -> _Stage:
        self.watcher.start()
        thread = threading.Thread(
            target=self.coordinator.run, name="drill-coordinator", daemon=True
        )
        thread.start()
        self._threads.append(thread)
        for catalogue in self.catalogues:
            self.start_participant(catalogue.name)
        self.client.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        for runtime, thread in self.runtimes.values():
            runtime.stop()
            thread.join(30)
        self.coordinator.stop()
        for thread in self._threads:
            thread.join(30)
        self.watcher.stop()
        self.operator.close()

    def start_participant(self, name: str) -> None:
        catalogue = next(c for c in self.catalogues if c.name == name)
        runtime = ParticipantRuntime(catalogue, self.settings, self.bootstrap, clock=self.clock)
        # A command's outcome goes out through the runtime's loop (send), or, on the rare
        # paths a tool thread handles whole, through the handler's _publish.
        runtime.send = self.board.guard_send(runtime.send)
        runtime.handler._append = self.board.guard_append(runtime.handler._append)
        runtime.handler._publish = self.board.guard_append(runtime.handler._publish)
        ready = threading.Event()
        thread = threading.Thread(
            target=runtime.run, kwargs={"ready": ready}, name=f"drill-{name}", daemon=True
        )
        thread.start()
        if not ready.wait(60):
            raise RuntimeError(f"drill: participant {name} did not start within 60 s")
        self.runtimes[name] = (runtime, thread)

    def stop_participant(self, name: str) -> None:
        runtime, thread = self.runtimes.pop(name)
        runtime.stop()
        thread.join(30)

    def reproduce(self, saga_id: str, topics: Iterable[str]) -> int:
        """Produce every record of ``saga_id`` on ``topics`` once more (duplicates)."""
        producer = create_producer(self.bootstrap)
        count = 0
        for topic in topics:
            for key, value, headers in LedgerReader(self.bootstrap).records(topic):
                if key == saga_id.encode():
                    pairs = headers.items() if isinstance(headers, dict) else headers or []
                    producer.produce(topic, key=key, value=value, headers=list(pairs))
                    count += 1
        producer.flush(30)
        return count

    def dlq_reasons(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        reader = LedgerReader(self.bootstrap)
        for key, _value, headers in reader.records(self.settings.topics.dlq):
            pairs = headers.items() if isinstance(headers, dict) else headers or []
            reason = next((v for k, v in pairs if k == DLQ_REASON), None)
            if key is not None and isinstance(reason, bytes):
                out.setdefault(key.decode(), []).append(reason.decode())
        return out


def run_drill(
    catalogues: Sequence[Catalogue],
    calls: Sequence[PlannedCall | Mapping[str, Any]],
    *,
    bootstrap: str,
    state_dir: Path,
    seams: Sequence[Seam] | None = None,
    steps: Sequence[int] | None = None,
    prefix: str | None = None,
    case_timeout_s: float = 60.0,
    workers: int = 6,
    hmac_key: bytes | None = b"sagaline-drill",
    progress: Callable[[CaseResult], None] | None = None,
) -> DrillReport:
    """Run ``calls`` once per (seam, step) with that fault injected; judge each run.

    ``catalogues`` are the participants' own (wrapped here, never changed);
    ``calls`` the plan, each ``{"tool": ..., "args": {...}}``, where an argument
    ``"$tool.field"`` is the field of an earlier step's result. ``steps`` are
    0-based plan indexes (all by default).
    """
    plan = [
        c if isinstance(c, PlannedCall) else PlannedCall(c["tool"], c.get("args", {}))
        for c in calls
    ]
    chosen = list(seams or list(Seam))
    indexes = list(steps if steps is not None else range(len(plan)))
    outside = [i for i in indexes if not 0 <= i < len(plan)]
    if outside:
        raise ValueError(
            f"steps {outside} are not in the plan: 0-based indexes 0 to {len(plan) - 1}"
        )
    unknown = unknown_tools(catalogues, plan)
    if unknown:
        raise ValueError(unknown)
    report = DrillReport(plan)
    started = time.monotonic()
    prefix = prefix or f"drill{uuid.uuid4().hex[:8]}."
    with _Stage(
        catalogues,
        bootstrap,
        state_dir,
        prefix=prefix,
        case_timeout_s=case_timeout_s,
        hmac_key=hmac_key,
    ) as stage:
        cases = [(seam, i) for seam in chosen for i in indexes]
        parallel = [c for c in cases if c[0] not in SERIAL]
        serial = [c for c in cases if c[0] in SERIAL]
        raw: dict[tuple[Seam, int], tuple[str, str, str]] = {}

        def one(case: tuple[Seam, int]) -> None:
            raw[case] = _run_case(stage, plan, case[0], case[1], case_timeout_s)

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, parallel))
        for case in serial:
            one(case)
        dlq = stage.dlq_reasons()
        for seam, i in cases:
            saga_id, applicable, problem = raw[(seam, i)]
            result = _judge(
                stage, plan, seam, i, saga_id, applicable, dlq, case_timeout_s, problem=problem
            )
            report.results.append(result)
            if progress is not None:
                progress(result)
    report.seconds = time.monotonic() - started
    return report


def unknown_tools(
    catalogues: Sequence[Catalogue], calls: Sequence[PlannedCall | Mapping[str, Any]]
) -> str:
    """Why the plan cannot be drilled against ``catalogues`` ("" when every tool it
    calls is declared in one of them)."""
    known = sorted({name for c in catalogues for name in c})
    tools = [c.tool if isinstance(c, PlannedCall) else c.get("tool") for c in calls]
    missing = [f"{n}:{t}" for n, t in enumerate(tools, 1) if t not in known]
    if not missing:
        return ""
    return (
        f"the plan calls tools no catalogue declares ({', '.join(missing)});"
        f" known tools are {', '.join(known) or 'none'}"
    )


# ------------------------------------------------------------------------ one case


class _Abort(Exception):
    """The drill's agent gives up at this point of the plan (the seam)."""


def _run_case(
    stage: _Stage, plan: list[PlannedCall], seam: Seam, target: int, timeout_s: float
) -> tuple[str, str, str]:
    """Run the plan as one saga with ``seam`` at step ``target``; returns the saga id,
    "" when the fault applies or why it does not, and "" or why the case failed to
    run as meant (the fault could not be injected, or the case raised: that case's
    FAILED verdict, never the end of the drill)."""
    case = uuid.uuid4().hex[:8]
    saga_id = f"drill-{seam.value}-{target + 1}-{case}"
    spec = stage.specs.get(plan[target].tool)
    why_not = _not_applicable(seam, spec)
    if why_not:
        return saga_id, why_not, ""
    problems: list[str] = []
    try:
        _drive(stage, plan, seam, target, timeout_s, saga_id, case, problems)
    except Exception as exc:
        problems.append(f"the case raised {type(exc).__name__}: {exc}")
    return saga_id, "", "; ".join(problems)


def _drive(
    stage: _Stage,
    plan: list[PlannedCall],
    seam: Seam,
    target: int,
    timeout_s: float,
    saga_id: str,
    case: str,
    problems: list[str],
) -> None:
    """The drill's agent for one case; what kept the fault from being injected is
    appended to ``problems``."""
    target_step = _step_id(target, plan[target].tool)
    stage.board.arm(saga_id, target_step, seam)
    if seam is Seam.EXPIRED_APPROVAL:
        stage.watcher.no_grant.add(saga_id)
    results: dict[str, Any] = {}
    saga = stage.client.saga("drill", "drill-agent", saga_id=saga_id)
    try:
        with saga:
            for index, call in enumerate(plan):
                step_id = _step_id(index, call.tool)
                at_target = index == target
                if at_target and seam is Seam.BEFORE_DISPATCH:
                    stage.board.mark_fired(saga_id, step_id, seam)
                    raise _Abort(f"drill: the agent failed before dispatching {step_id}")
                helper = _helper(stage, saga, seam, step_id, problems) if at_target else None
                try:
                    results[call.tool] = saga.call(
                        call.tool, step_id=step_id, **_resolve(call.args, results, case)
                    )
                finally:
                    if helper is not None:
                        helper.join(timeout_s)
                if at_target and seam is Seam.DUPLICATES:
                    topics = [
                        stage.settings.topics.events,
                        stage.settings.topics.commands(stage.participant_of[call.tool]),
                    ]
                    if stage.reproduce(saga_id, topics) > 0:
                        stage.board.mark_fired(saga_id, step_id, seam)
                    else:
                        problems.append(
                            f"duplicates: no record of the saga was found to re-send after"
                            f" {step_id}: nothing was duplicated (not injected)"
                        )
                if at_target and seam is Seam.STALE_GENERATION:
                    _stale_abort(stage, saga_id)
                    stage.board.mark_fired(saga_id, step_id, seam)
                if at_target and seam is Seam.AFTER_COMMIT:
                    stage.board.mark_fired(saga_id, step_id, seam)
                if at_target and seam in ABORT_AFTER:
                    raise _Abort(f"drill: the saga fails right after {step_id}")
    except (_Abort, SagaCallError):
        pass  # leaving the block by an exception aborted the saga


def _not_applicable(seam: Seam, spec: ToolSpec | None) -> str:
    """Why ``seam`` does not exist for this tool ("" when it does)."""
    if spec is None:
        return ""
    if seam is Seam.EXPIRED_APPROVAL and (
        spec.reversibility is not Reversibility.IRREVERSIBLE or spec.read_only
    ):
        return f"{spec.name} runs without a forward approval"
    if seam in (Seam.DURING_COMPENSATION, Seam.BEFORE_COMPENSATION_ACK) and (
        spec.compensation_func is None
    ):
        return f"{spec.name} has no compensation"
    return ""


OUTAGE_WAIT_S = 60.0
"""How long a partial outage lasts at most, waiting for its step to be scheduled."""


def _helper(
    stage: _Stage, saga: Any, seam: Seam, step_id: str, problems: list[str]
) -> threading.Thread | None:
    """What happens beside the target call: a cancellation, an outage, an expiry.
    Why the fault could not be injected goes to ``problems``."""
    saga_id = saga.saga_id
    if seam is Seam.CONCURRENT_CANCELLATION:

        def cancel() -> None:
            if stage.board.tool_running(saga_id).wait(60):
                saga.end(SagaOutcome.ABORT, "drill: cancelled while the tool was running")
            stage.board.abort_written(saga_id).set()

        return _thread(cancel)
    if seam is Seam.PARTIAL_OUTAGE:
        participant = stage.participant_of[_tool_of(step_id)]
        stage.stop_participant(participant)

        def recover() -> None:
            try:
                scheduled = stage.watcher.wait(
                    saga_id,
                    lambda rs: any(
                        isinstance(r, StepScheduled) and r.step_id == step_id for r in rs
                    ),
                    OUTAGE_WAIT_S,
                )
                if scheduled:
                    stage.board.mark_fired(saga_id, step_id, seam)
                else:
                    problems.append(
                        f"partial-outage: {step_id} was not scheduled within"
                        f" {OUTAGE_WAIT_S:.0f} s of stopping {participant}; the outage"
                        " ended unobserved (not injected)"
                    )
            finally:
                try:
                    stage.start_participant(participant)
                except Exception as exc:  # that case fails; the drill goes on
                    problems.append(
                        f"partial-outage: {participant} could not be started again:"
                        f" {type(exc).__name__}: {exc}"
                    )

        return _thread(recover)
    if seam is Seam.EXPIRED_APPROVAL:

        def expire() -> None:
            found = stage.watcher.wait(
                saga_id,
                lambda rs: any(
                    isinstance(r, ApprovalRequested) and r.step_id == step_id for r in rs
                ),
                60,
            )
            if found:
                stage.board.mark_fired(saga_id, step_id, seam)
                stage.clock.offset += DEFAULT_POLICY.approval_ttl_ms + 1_000

        return _thread(expire)
    return None


def _thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _stale_abort(stage: _Stage, saga_id: str) -> None:
    """An authentic, signed abort from an older generation of this saga: it must be
    rejected and recorded, never obeyed (R15)."""
    record = SagaEndRequested(
        envelope=envelope_for(
            SagaEndRequested,
            saga_id=saga_id,
            tenant_id=stage.settings.tenant_id,
            producer="agent",
            now=stage.clock(),
            generation=0,
        ),
        outcome=SagaOutcome.ABORT,
        reason="drill: an abort from a stale generation",
    )
    stage.client.append(record)


def _step_id(index: int, tool: str) -> str:
    return f"s{index + 1:02d}-{tool}"


def _tool_of(step_id: str) -> str:
    return step_id.split("-", 1)[1]


def _resolve(args: Mapping[str, Any], results: Mapping[str, Any], case: str) -> dict[str, Any]:
    """``"$tool.field"`` -> that field of the earlier step's result; ``{case}`` in a
    string -> an id unique to the case, so concurrent cases touch separate objects
    (orders, tickets) of a shared provider."""
    out: dict[str, Any] = {}
    for name, value in args.items():
        if isinstance(value, str) and "{case}" in value:
            value = value.replace("{case}", case)
        if isinstance(value, str) and value.startswith("$") and "." in value:
            tool, _, key = value[1:].partition(".")
            found = results.get(tool)
            if not isinstance(found, Mapping) or key not in found:
                raise _Abort(f"drill: {value} names no result of an earlier step")
            value = found[key]
        out[name] = value
    return out


def _keys(records: Iterable[Record]) -> dict[str, str]:
    """Step id -> idempotency key, from the saga's ``StepScheduled`` records."""
    return {
        r.step_id: idempotency_key(r.saga_id, r.step_id, r.contract.tool, r.args)
        for r in records
        if isinstance(r, StepScheduled)
    }


# ------------------------------------------------------------------------- verdict


def _judge(
    stage: _Stage,
    plan: list[PlannedCall],
    seam: Seam,
    target: int,
    saga_id: str,
    why_not: str,
    dlq: Mapping[str, list[str]],
    timeout_s: float,
    *,
    problem: str = "",
) -> CaseResult:
    tool = plan[target].tool
    if why_not:
        return CaseResult(seam, target, tool, saga_id, Verdict.NOT_APPLICABLE, "-", why_not)

    def ended(rs: list[Record]) -> Record | None:
        return next((r for r in rs if isinstance(r, SagaTerminal)), None)

    if problem:  # the case did not run as meant: whatever its saga did, not a pass
        seen = ended(stage.watcher.of(saga_id))
        status = seen.status.value if isinstance(seen, SagaTerminal) else "not terminal"
        return CaseResult(seam, target, tool, saga_id, Verdict.FAILED, status, problem)

    terminal = stage.watcher.wait(saga_id, ended, timeout_s)
    records = stage.watcher.of(saga_id)
    incidents = [r for r in records if isinstance(r, IncidentRaised)]
    operator_failed = list(stage.watcher.failures.get(saga_id, []))
    if not isinstance(terminal, SagaTerminal):
        waiting = "not terminal"
        if operator_failed:  # the drill itself left something undone: not a person's
            return CaseResult(
                seam, target, tool, saga_id, Verdict.FAILED, waiting, "; ".join(operator_failed)
            )
        resolved = {r.incident_id for r in records if isinstance(r, IncidentResolved)}
        open_incidents = [i for i in incidents if i.incident_id not in resolved]
        if incidents and not open_incidents:
            return CaseResult(
                seam,
                target,
                tool,
                saga_id,
                Verdict.FAILED,
                waiting,
                f"no terminal record within {timeout_s:.0f} s although every incident was"
                " resolved: nobody is awaited, the saga is stuck",
            )
        if open_incidents:
            waiting = "awaiting a person"
            problems = _committed_disagreements(stage, records)
            if problems:
                return CaseResult(
                    seam, target, tool, saga_id, Verdict.FAILED, waiting, "; ".join(problems)
                )
            kinds = ", ".join(sorted({i.kind for i in open_incidents}))
            return CaseResult(seam, target, tool, saga_id, Verdict.ESCALATED, waiting, kinds)
        return CaseResult(
            seam,
            target,
            tool,
            saga_id,
            Verdict.FAILED,
            "not terminal",
            f"no terminal record and no incident within {timeout_s:.0f} s",
        )
    receipt = Receipt.from_json(terminal.receipt)
    problems = _disagreements(stage, records, receipt) + operator_failed
    fired = stage.board.fired(saga_id)
    if seam is Seam.STALE_GENERATION and fired and "stale-generation" not in dlq.get(saga_id, []):
        problems.append("the stale-generation abort was not rejected to the DLQ")
    if seam is Seam.EXPIRED_APPROVAL:
        # Nobody grants an approval in this case, so the step must never run: not
        # after its approval expired, and not without an approval ever asked for
        # (then the fault never fired, yet the saga went right past it, R7).
        target_id = _step_id(target, tool)
        key = _keys(records).get(target_id)
        ledger_ran = any(
            s.step_id == target_id and s.committed_at is not None for s in receipt.steps
        )
        if ledger_ran or (key is not None and stage.board.ran(key) > 0):
            problems.append(
                f"{target_id} ran although its approval expired (nobody granted it)"
                if fired
                else f"{target_id} ran without its approval ever being requested (R7)"
            )
    status = receipt.status.value
    if problems:
        return CaseResult(seam, target, tool, saga_id, Verdict.FAILED, status, "; ".join(problems))
    if status == "ESCALATED" or incidents:
        kinds = ", ".join(sorted({i.kind for i in incidents})) or "escalated"
        return CaseResult(seam, target, tool, saga_id, Verdict.ESCALATED, status, kinds)
    if not fired:
        passed = _passed_unfired(seam, receipt, _step_id(target, tool))
        if passed:
            return CaseResult(seam, target, tool, saga_id, Verdict.FAILED, status, passed)
    detail = "" if fired else "the fault was never reached (the saga did not get there)"
    verdict = Verdict.CONVERGED if fired else Verdict.NOT_APPLICABLE
    return CaseResult(seam, target, tool, saga_id, verdict, status, detail)


COMMIT_SEAMS = frozenset(
    {Seam.BEFORE_RECEIPT, Seam.LEDGER_APPEND, Seam.THROTTLING, Seam.CONCURRENT_CANCELLATION}
)
"""Seams injected in the tool call or its commit: a step that committed went past them."""

COMPENSATION_SEAMS = frozenset({Seam.DURING_COMPENSATION, Seam.BEFORE_COMPENSATION_ACK})
"""Seams injected in the compensation: a step compensated went past them."""


def _passed_unfired(seam: Seam, receipt: Receipt, step_id: str) -> str:
    """Why a fault that never fired should have ("" when the saga never got there).

    A fault armed in a tool call, its commit or its compensation that did not fire
    although the ledger shows the step committed (or compensated) is a broken
    injection point, not a step the plan never reaches."""
    step = next((s for s in receipt.steps if s.step_id == step_id), None)
    if step is None:
        return ""
    if seam in COMMIT_SEAMS and step.committed_at is not None:
        return f"{step_id} committed, but the {seam.value} fault armed on it never fired"
    if seam in COMPENSATION_SEAMS and step.disposition is Disposition.COMPENSATED:
        return f"{step_id} was compensated, but the {seam.value} fault armed on it never fired"
    return ""


def _disagreements(stage: _Stage, records: list[Record], receipt: Receipt) -> list[str]:
    """Where the ledger (receipt) and the provider's state disagree."""
    problems: list[str] = []
    scheduled = {r.step_id: r for r in records if isinstance(r, StepScheduled)}
    results: dict[str, bytes] = {}
    for r in records:
        if isinstance(r, StepCommitted):
            results[r.step_id] = r.result
        elif isinstance(r, StepReconciled) and r.outcome is ReconcileResult.COMMITTED:
            results.setdefault(r.step_id, r.result or b"null")
    keys = _keys(records)
    for step in receipt.steps:
        spec = stage.specs.get(step.tool)
        key = keys.get(step.step_id)
        if spec is None or step.disposition is Disposition.READ_ONLY:
            continue
        if key is None:  # its StepScheduled was dropped (undecodable): no key to ask with
            problems.append(
                f"{step.step_id}: the drill could not read its StepScheduled on the ledger,"
                " so the provider's state cannot be compared with the ledger"
            )
            continue
        runs = stage.board.ran(key)
        if runs > 1:
            problems.append(f"{step.step_id} ran {runs} times for one idempotency key")
        try:
            world = _world_has(spec, key, runs)
        except Exception as exc:  # the user's lookup: a failed case, not the drill's end
            problems.append(
                f"{step.step_id}: its lookup raised {type(exc).__name__}: {exc}; the"
                " provider's state cannot be compared with the ledger"
            )
            continue
        ledger = step.disposition in (Disposition.RETAINED, Disposition.COMPENSATED) or (
            step.disposition is Disposition.ESCALATED and step.committed_at is not None
        )
        if step.disposition is Disposition.NOT_COMMITTED and world:
            problems.append(f"{step.step_id}: the ledger says not committed, the provider has it")
        if ledger and not world:
            problems.append(f"{step.step_id}: the ledger says committed, the provider has nothing")
        if step.disposition is Disposition.COMPENSATED:
            scheduled_step = scheduled.get(step.step_id)
            if scheduled_step is None:
                continue
            ctx = CompensationContext(
                saga_id=receipt.saga_id,
                tool_name=step.tool,
                input=orjson.loads(scheduled_step.args),
                result=orjson.loads(results.get(step.step_id, b"null")),
                idempotency_key=key,
            )
            if spec.verify_func is not None:
                call = CallContext(receipt.saga_id, step.step_id, step.tool, key)
                try:
                    with call_context(call):
                        undone = spec.verify(ctx)
                except Exception as exc:  # the user's verify, as the lookup above
                    problems.append(
                        f"{step.step_id}: its verify raised {type(exc).__name__}: {exc}"
                    )
                    continue
                if not undone:
                    problems.append(f"{step.step_id}: compensated in the ledger, verify says no")
            elif not stage.board.compensated(ctx.compensation_key):
                problems.append(f"{step.step_id}: compensated in the ledger, never undone")
    return problems


def _committed_disagreements(stage: _Stage, records: list[Record]) -> list[str]:
    """For a saga with no receipt yet (awaiting a person): every step the ledger saw
    commit must be in the provider, and nothing ran twice for one key."""
    problems: list[str] = []
    keys = _keys(records)
    committed = {
        r.step_id
        for r in records
        if isinstance(r, StepCommitted)
        or (isinstance(r, StepReconciled) and r.outcome is ReconcileResult.COMMITTED)
    }
    contracts = {r.step_id: r.contract for r in records if isinstance(r, StepScheduled)}
    for step_id, key in keys.items():
        contract = contracts[step_id]
        spec = stage.specs.get(contract.tool)
        if spec is None or contract.read_only:
            continue
        runs = stage.board.ran(key)
        if runs > 1:
            problems.append(f"{step_id} ran {runs} times for one idempotency key")
        if step_id not in committed:
            continue  # its outcome is what the person is asked about
        try:
            world = _world_has(spec, key, runs)
        except Exception as exc:  # the user's lookup: a failed case, not the drill's end
            problems.append(f"{step_id}: its lookup raised {type(exc).__name__}: {exc}")
            continue
        if not world:
            problems.append(f"{step_id}: the ledger says committed, the provider has nothing")
    return problems


def _world_has(spec: ToolSpec, key: str, runs: int) -> bool:
    """Whether the provider holds the effect of ``key``: its own lookup when the tool
    declares one, else what the drill's wrapper saw."""
    if spec.lookup_func is None:
        return runs > 0
    found = spec.lookup(key)
    return found.status is ReconcileResult.COMMITTED
