"""Builders for coordinator-core tests: one saga's ledger records, written the way the
agent, the participants and an operator would write them, and a small harness that
feeds them to the pure core and keeps the clock.

Not a test module itself; imported by tests/test_coordinator_core*.py and
tests/test_coordinator_properties.py.
"""

from __future__ import annotations

from typing import Any

import orjson

from coordinator import Decision, Destination, Output, SagaState, decide, tick
from schemas import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    CompensateStep,
    CompensationAccepted,
    CompensationApproval,
    CompensationCommitted,
    CompensationFailed,
    CompensationRequested,
    Envelope,
    ExecuteStep,
    FailureKind,
    IncidentRaised,
    IncidentResolved,
    Receipt,
    ReconcileResult,
    ReconcileStep,
    Record,
    RetryPolicy,
    Reversibility,
    SagaEndRequested,
    SagaOutcome,
    SagaStarted,
    SagaTerminal,
    StepCommitted,
    StepContract,
    StepFailed,
    StepIntentRecorded,
    StepOutcomeUnknown,
    StepReconciled,
    StepScheduled,
    args_fingerprint,
    idempotency_key,
)


def contract(
    tool: str,
    *,
    participant: str = "svc",
    compensation: str | None = "__default__",
    reversibility: Reversibility = Reversibility.COMPENSATABLE,
    pivot: bool = False,
    read_only: bool = False,
    has_lookup: bool = False,
    has_verify: bool = False,
    resources: list[str] | None = None,
    reversal_window_ms: int | None = None,
    compensation_approval: CompensationApproval = CompensationApproval.INHERIT,
    retry: RetryPolicy | None = None,
    compensation_retry: RetryPolicy | None = None,
    owner: str = "operations",
    completion_within_ms: int | None = None,
) -> StepContract:
    """A tool contract; by default a compensatable tool undone by ``undo_<tool>``."""
    if compensation == "__default__":
        compensation = None if read_only or pivot else f"undo_{tool}"
    extra: dict[str, Any] = {}
    if retry is not None:
        extra["retry"] = retry
    if compensation_retry is not None:
        extra["compensation_retry"] = compensation_retry
    return StepContract(
        tool=tool,
        participant=participant,
        reversibility=reversibility,
        compensation=compensation,
        pivot=pivot,
        read_only=read_only,
        has_lookup=has_lookup,
        has_verify=has_verify,
        resources=resources or [],
        reversal_window_ms=reversal_window_ms,
        compensation_approval=compensation_approval,
        owner=owner,
        completion_within_ms=completion_within_ms,
        **extra,
    )


class Ledger:
    """Writes the records of one saga, with unique event ids and a moving clock."""

    def __init__(
        self,
        saga_id: str = "saga-1",
        *,
        tenant_id: str = "acme",
        principal: str = "alice",
        generation: int = 1,
        t0: int = 1_000_000,
    ) -> None:
        self.saga_id = saga_id
        self.tenant_id = tenant_id
        self.principal = principal
        self.generation = generation
        self.clock = t0
        self._n = 0
        self.steps: dict[str, StepScheduled] = {}

    def env(self, record_type: type[Record], producer: str, **kw: Any) -> Envelope:
        self._n += 1
        self.clock += 1
        return Envelope(
            event_id=f"{self.saga_id}-ev{self._n}",
            saga_id=self.saga_id,
            tenant_id=self.tenant_id,
            type=record_type.TYPE,
            occurred_at=kw.pop("occurred_at", self.clock),
            producer=producer,
            generation=kw.pop("generation", self.generation),
        )

    # -- agent

    def started(self, **kw: Any) -> SagaStarted:
        gen = kw.pop("generation", self.generation)
        return SagaStarted(
            envelope=self.env(SagaStarted, "agent", generation=gen),
            workflow=kw.pop("workflow", "refund"),
            principal=kw.pop("principal", self.principal),
            **kw,
        )

    def scheduled(
        self,
        step_id: str,
        tool: str | None = None,
        *,
        args: dict[str, Any] | None = None,
        depends_on: list[str] | None = None,
        **contract_kw: Any,
    ) -> StepScheduled:
        raw = orjson.dumps(args if args is not None else {"step": step_id})
        record = StepScheduled(
            envelope=self.env(StepScheduled, "agent"),
            step_id=step_id,
            args=raw,
            args_fingerprint=args_fingerprint(raw),
            depends_on=depends_on,
            contract=contract(tool or step_id, **contract_kw),
        )
        self.steps[step_id] = record
        return record

    def end(
        self, outcome: SagaOutcome = SagaOutcome.COMPLETE, reason: str = ""
    ) -> SagaEndRequested:
        return SagaEndRequested(
            envelope=self.env(SagaEndRequested, "agent"), outcome=outcome, reason=reason
        )

    # -- participants

    def key(self, step_id: str) -> str:
        s = self.steps[step_id]
        return idempotency_key(self.saga_id, step_id, s.contract.tool, s.args)

    def _p(self, step_id: str) -> str:
        return self.steps[step_id].contract.participant

    def intent(self, step_id: str, attempt: int = 1) -> StepIntentRecorded:
        s = self.steps[step_id]
        return StepIntentRecorded(
            envelope=self.env(StepIntentRecorded, self._p(step_id)),
            step_id=step_id,
            tool=s.contract.tool,
            idempotency_key=self.key(step_id),
            args_fingerprint=s.args_fingerprint,
            attempt=attempt,
            principal=self.principal,
        )

    def committed(self, step_id: str, attempt: int = 1, **kw: Any) -> StepCommitted:
        return StepCommitted(
            envelope=self.env(StepCommitted, self._p(step_id), **kw),
            step_id=step_id,
            tool=self.steps[step_id].contract.tool,
            idempotency_key=self.key(step_id),
            attempt=attempt,
            provider_operation_id=f"op-{step_id}",
            result=orjson.dumps({"id": f"op-{step_id}"}),
            response_fingerprint="fp",
        )

    def failed(
        self,
        step_id: str,
        attempt: int = 1,
        kind: FailureKind = FailureKind.TRANSIENT,
        message: str = "boom",
    ) -> StepFailed:
        return StepFailed(
            envelope=self.env(StepFailed, self._p(step_id)),
            step_id=step_id,
            tool=self.steps[step_id].contract.tool,
            idempotency_key=self.key(step_id),
            attempt=attempt,
            kind=kind,
            error_type="ToolError" if kind is FailureKind.TRANSIENT else "Rejected",
            message=message,
        )

    def unknown(self, step_id: str, attempt: int = 1) -> StepOutcomeUnknown:
        return StepOutcomeUnknown(
            envelope=self.env(StepOutcomeUnknown, self._p(step_id)),
            step_id=step_id,
            tool=self.steps[step_id].contract.tool,
            idempotency_key=self.key(step_id),
            attempt=attempt,
            reason="deadline passed",
        )

    def reconciled(
        self, step_id: str, outcome: ReconcileResult, attempt: int = 1
    ) -> StepReconciled:
        committed = outcome is ReconcileResult.COMMITTED
        return StepReconciled(
            envelope=self.env(StepReconciled, self._p(step_id)),
            step_id=step_id,
            tool=self.steps[step_id].contract.tool,
            idempotency_key=self.key(step_id),
            attempt=attempt,
            outcome=outcome,
            provider_operation_id=f"op-{step_id}" if committed else None,
            result=orjson.dumps({"id": f"op-{step_id}"}) if committed else None,
            response_fingerprint="fp" if committed else None,
        )

    def comp_key(self, step_id: str) -> str:
        from schemas import compensation_key

        return compensation_key(self.key(step_id))

    def comp_accepted(self, step_id: str, attempt: int = 1) -> CompensationAccepted:
        return CompensationAccepted(
            envelope=self.env(CompensationAccepted, self._p(step_id)),
            step_id=step_id,
            compensation_key=self.comp_key(step_id),
            attempt=attempt,
            provider_operation_id=f"comp-{step_id}",
        )

    def comp_committed(
        self, step_id: str, attempt: int = 1, verified: bool | None = None
    ) -> CompensationCommitted:
        return CompensationCommitted(
            envelope=self.env(CompensationCommitted, self._p(step_id)),
            step_id=step_id,
            compensation_key=self.comp_key(step_id),
            attempt=attempt,
            provider_operation_id=f"comp-{step_id}",
            verified=verified,
        )

    def comp_failed(
        self, step_id: str, attempt: int = 1, kind: FailureKind = FailureKind.TRANSIENT
    ) -> CompensationFailed:
        return CompensationFailed(
            envelope=self.env(CompensationFailed, self._p(step_id)),
            step_id=step_id,
            compensation_key=self.comp_key(step_id),
            attempt=attempt,
            kind=kind,
            error_type="CompensationError",
            message="provider said no",
        )

    def participant_incident(self, step_id: str, incident_id: str) -> IncidentRaised:
        return IncidentRaised(
            envelope=self.env(IncidentRaised, self._p(step_id)),
            incident_id=incident_id,
            kind="unknown-outcome",
            step_id=step_id,
            tool=self.steps[step_id].contract.tool,
            inconsistency="timed out, no lookup",
            effect="unknown",
            owner="payments",
        )

    # -- operator

    def grant(self, request: ApprovalRequested, **overrides: Any) -> ApprovalGranted:
        occurred_at = overrides.pop("occurred_at", None)
        env_kw = {} if occurred_at is None else {"occurred_at": occurred_at}
        fields: dict[str, Any] = {
            "step_id": request.step_id,
            "approval_id": request.approval_id,
            "purpose": request.purpose,
            "principal": request.principal,
            "args_fingerprint": request.args_fingerprint,
            "scope": request.scope,
            "expires_at": request.expires_at,
            "granted_by": "bob",
        }
        fields.update(overrides)
        return ApprovalGranted(envelope=self.env(ApprovalGranted, "operator", **env_kw), **fields)

    def deny(self, request: ApprovalRequested, reason: str = "no") -> ApprovalDenied:
        return ApprovalDenied(
            envelope=self.env(ApprovalDenied, "operator"),
            step_id=request.step_id,
            approval_id=request.approval_id,
            purpose=request.purpose,
            denied_by="bob",
            reason=reason,
        )

    def resolve(self, incident_id: str, resolution: str) -> IncidentResolved:
        return IncidentResolved(
            envelope=self.env(IncidentResolved, "operator"),
            incident_id=incident_id,
            resolved_by="carol",
            resolution=resolution,
        )


def fresh(**ledger_kw: Any) -> tuple[Ledger, Harness]:
    """A ledger and a harness sharing one clock."""
    ledger = Ledger(**ledger_kw)
    return ledger, Harness(ledger)


class Harness:
    """Feeds records to the core, keeps the state and the clock, collects outputs."""

    def __init__(self, ledger: Ledger | None = None, now: int = 1_000_000) -> None:
        self.ledger = ledger
        self.state: SagaState | None = None
        self.now = now
        self.outputs: list[Output] = []
        self.log: list[Record] = []

    def feed(self, *records: Record) -> list[Output]:
        produced: list[Output] = []
        for record in records:
            self.now = max(self.now + 1, record.envelope.occurred_at)
            self.log.append(record)
            decision = decide(self.state, record, self.now)
            produced += self._take(decision)
        return produced

    def advance(self, ms: int) -> list[Output]:
        """Move the clock and fire what is due (the shell's timer loop)."""
        self.now += ms
        assert self.state is not None
        return self._take(tick(self.state, self.now))

    def run_timers(self, limit: int = 100) -> list[Output]:
        """Jump from timer to timer until none is left (or ``limit`` firings)."""
        produced: list[Output] = []
        for _ in range(limit):
            assert self.state is not None
            due = self.state.next_due_at()
            if due is None:
                break
            self.now = max(self.now, due)
            produced += self._take(tick(self.state, self.now))
        return produced

    def _take(self, decision: Decision) -> list[Output]:
        if self.ledger is not None:  # records written next happen after this decision
            self.ledger.clock = max(self.ledger.clock, self.now)
        self.state = decision.state
        self.outputs += decision.outputs
        for out in decision.outputs:
            if out.appends_to_events:
                self.log.append(out.record)
        return decision.outputs

    # -- views

    @property
    def s(self) -> SagaState:
        assert self.state is not None
        return self.state

    def status(self, step_id: str) -> str:
        return self.s.steps[step_id].status.value


def commands(outputs: list[Output], kind: type[Record] | None = None) -> list[Record]:
    return [
        o.record
        for o in outputs
        if o.destination is Destination.COMMAND and (kind is None or isinstance(o.record, kind))
    ]


def executes(outputs: list[Output]) -> list[str]:
    return [r.step_id for r in commands(outputs, ExecuteStep) if isinstance(r, ExecuteStep)]


def compensates(outputs: list[Output]) -> list[str]:
    return [r.step_id for r in commands(outputs, CompensateStep) if isinstance(r, CompensateStep)]


def reconciles(outputs: list[Output]) -> list[str]:
    return [r.step_id for r in commands(outputs, ReconcileStep) if isinstance(r, ReconcileStep)]


def events(outputs: list[Output], kind: type[Record]) -> list[Any]:
    return [o.record for o in outputs if o.appends_to_events and isinstance(o.record, kind)]


def approval_requests(outputs: list[Output]) -> list[ApprovalRequested]:
    return [r for r in events(outputs, ApprovalRequested) if isinstance(r, ApprovalRequested)]


def incidents(outputs: list[Output]) -> list[IncidentRaised]:
    return [
        o.record
        for o in outputs
        if o.destination is Destination.INCIDENT and isinstance(o.record, IncidentRaised)
    ]


def rejections(outputs: list[Output]) -> list[Output]:
    return [o for o in outputs if o.destination is Destination.REJECTED]


def terminal(outputs: list[Output]) -> SagaTerminal | None:
    found = [
        o.record
        for o in outputs
        if o.destination is Destination.TERMINAL and isinstance(o.record, SagaTerminal)
    ]
    assert len(found) <= 1, "at most one terminal record per saga"
    return found[0] if found else None


def receipt_of(outputs: list[Output]) -> Receipt:
    record = terminal(outputs)
    assert record is not None, "the saga has not ended"
    return Receipt.from_json(record.receipt)


__all__ = [
    "ApprovalPurpose",
    "CompensationRequested",
    "FailureKind",
    "Harness",
    "Ledger",
    "ReconcileResult",
    "SagaOutcome",
    "approval_requests",
    "compensates",
    "contract",
    "events",
    "executes",
    "fresh",
    "incidents",
    "receipt_of",
    "reconciles",
    "rejections",
    "terminal",
]
