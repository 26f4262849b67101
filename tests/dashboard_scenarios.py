"""Realistic ledgers for the dashboard tests: one saga per status, built from the
contract (schemas), the way the agent, coordinator and participants would write them.

Each scenario returns ``(records, expected status slug)``. Records are in log order;
``topics_for(record)`` says where the coordinator would also copy it (terminal records
to ``sagaline.terminal``, incidents to ``sagaline.incidents``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas import (
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    CompensationCommitted,
    CompensationFailed,
    CompensationRequested,
    FailureKind,
    IncidentRaised,
    Receipt,
    Record,
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
    StepRetryScheduled,
    StepScheduled,
    TerminalStatus,
    args_fingerprint,
    compensation_key,
    derived_event_id,
    envelope_for,
    idempotency_key,
    key_hash,
)
from schemas.receipt import ApprovalRecord, Disposition, IncidentRecord, StepReceipt

T0 = 1_760_000_000_000
# Long enough that a run years after T0 still finds the request live (a grant after
# expiry is refused before anything is written).
APPROVAL_TTL_MS = 50 * 365 * 86_400_000

TOOLS: dict[str, dict[str, Any]] = {
    "place_hold": dict(participant="payments", reversibility=Reversibility.REVERSIBLE,
                       compensation="release_hold", has_verify=True),
    "restock_inventory": dict(participant="inventory", compensation="unrestock",
                              resources=["sku"]),
    "issue_credit": dict(participant="payments", pivot=True, compensation=None),
    "send_email": dict(participant="mailer", reversibility=Reversibility.IRREVERSIBLE,
                       compensation=None),
}  # fmt: skip


@dataclass
class SagaScript:
    """Appends records for one saga with a clock that advances a little per record."""

    saga_id: str
    tenant: str = "acme"
    workflow: str = "refund"
    principal: str = "agent-7"
    now: int = T0
    records: list[Record] = field(default_factory=list)
    steps: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    receipt_steps: list[StepReceipt] = field(default_factory=list)
    approvals: list[ApprovalRecord] = field(default_factory=list)
    incidents: list[IncidentRecord] = field(default_factory=list)
    started_at: int = 0

    def add(self, cls: type[Any], advance_ms: int = 120, **body: Any) -> Any:
        self.now += advance_ms
        env = envelope_for(
            cls,
            saga_id=self.saga_id,
            tenant_id=self.tenant,
            producer="test",
            now=self.now,
            event_id=derived_event_id(self.saga_id, len(self.records), cls.TYPE),
        )
        record = cls(envelope=env, **body)
        self.records.append(record)
        return record

    # ------------------------------------------------------------------ forward

    def start(self) -> SagaScript:
        self.add(SagaStarted, workflow=self.workflow, principal=self.principal)
        self.started_at = self.now
        return self

    def schedule(self, step_id: str, tool: str, **args: Any) -> None:
        args_json = orjson.dumps(args or {"order": self.saga_id})
        self.steps[step_id] = (tool, args_json)
        self.add(
            StepScheduled,
            step_id=step_id,
            args=args_json,
            args_fingerprint=args_fingerprint(args_json),
            contract=StepContract(tool=tool, **TOOLS[tool]),
        )

    def key(self, step_id: str) -> str:
        tool, args = self.steps[step_id]
        return idempotency_key(self.saga_id, step_id, tool, args)

    def intent(self, step_id: str, attempt: int = 1) -> None:
        tool, args = self.steps[step_id]
        self.add(
            StepIntentRecorded, step_id=step_id, tool=tool, idempotency_key=self.key(step_id),
            args_fingerprint=args_fingerprint(args), attempt=attempt, principal=self.principal,
        )  # fmt: skip

    def commit(self, step_id: str, attempt: int = 1, ms: int = 300) -> None:
        tool, _ = self.steps[step_id]
        self.add(
            StepCommitted, advance_ms=ms, step_id=step_id, tool=tool,
            idempotency_key=self.key(step_id), attempt=attempt,
            provider_operation_id=f"op-{self.saga_id}-{step_id}", result=b'{"ok":true}',
            response_fingerprint="f" * 32,
        )  # fmt: skip

    def run(self, step_id: str, tool: str, **args: Any) -> None:
        self.schedule(step_id, tool, **args)
        self.intent(step_id)
        self.commit(step_id)

    def fail(self, step_id: str, kind: FailureKind, attempt: int = 1) -> None:
        tool, _ = self.steps[step_id]
        self.add(
            StepFailed, step_id=step_id, tool=tool, idempotency_key=self.key(step_id),
            attempt=attempt, kind=kind, error_type="CreditLimitExceeded"
            if kind is FailureKind.BUSINESS_REJECTION else "Timeout503",
            message="credit limit exceeded" if kind is FailureKind.BUSINESS_REJECTION
            else "provider answered 503",
        )  # fmt: skip

    def retry(self, step_id: str, attempt: int, wait_ms: int = 400) -> None:
        rec = self.add(
            StepRetryScheduled, step_id=step_id, purpose=ApprovalPurpose.FORWARD,
            attempt=attempt, due_at=self.now + 20 + wait_ms,
        )  # fmt: skip
        self.now = rec.due_at

    def request_approval(self, step_id: str) -> ApprovalRequested:
        tool, args = self.steps[step_id]
        rec: ApprovalRequested = self.add(
            ApprovalRequested, step_id=step_id, approval_id=f"apr-{self.saga_id}-{step_id}",
            purpose=ApprovalPurpose.FORWARD, principal=self.principal,
            args_fingerprint=args_fingerprint(args), scope=f"{self.workflow}:{tool}",
            expires_at=self.now + APPROVAL_TTL_MS,
        )  # fmt: skip
        return rec

    def grant(self, req: ApprovalRequested, by: str = "lead@ops", ms: int = 2_000) -> None:
        self.add(
            ApprovalGranted, advance_ms=ms, step_id=req.step_id, approval_id=req.approval_id,
            purpose=req.purpose, principal=req.principal, args_fingerprint=req.args_fingerprint,
            scope=req.scope, expires_at=req.expires_at, granted_by=by,
        )  # fmt: skip
        self.approvals.append(
            ApprovalRecord(step_id=req.step_id, purpose="FORWARD", decision="GRANTED", by=by,
                           principal=req.principal, args_fingerprint=req.args_fingerprint,
                           at=self.now)
        )  # fmt: skip

    # ------------------------------------------------------------- compensation

    def compensate(self, step_id: str, ok: bool = True, attempt: int = 1) -> None:
        tool, _ = self.steps[step_id]
        comp = TOOLS[tool]["compensation"]
        ckey = compensation_key(self.key(step_id))
        self.add(
            CompensationRequested, step_id=step_id, tool=tool, compensation=comp,
            compensation_key=ckey, attempt=attempt,
        )  # fmt: skip
        if ok:
            verified = True if TOOLS[tool].get("has_verify") else None
            self.add(
                CompensationCommitted, advance_ms=250, step_id=step_id, compensation_key=ckey,
                attempt=attempt, provider_operation_id=f"undo-{step_id}", verified=verified,
            )  # fmt: skip
        else:
            self.add(
                CompensationFailed, advance_ms=250, step_id=step_id, compensation_key=ckey,
                attempt=attempt, kind=FailureKind.TRANSIENT, error_type="Timeout503",
                message="warehouse API down",
            )  # fmt: skip

    def incident(self, step_id: str | None, kind: str, owner: str = "inventory-team") -> str:
        incident_id = f"inc-{self.saga_id}-{len(self.records)}"
        tool = self.steps[step_id][0] if step_id else None
        self.add(
            IncidentRaised, incident_id=incident_id, kind=kind, step_id=step_id, tool=tool,
            inconsistency=f"{tool} could not be undone", resources=["sku-42"],
            effect="3 units still in stock", owner=owner,
        )  # fmt: skip
        self.incidents.append(
            IncidentRecord(incident_id=incident_id, kind=kind, step_id=step_id,
                           inconsistency=f"{tool} could not be undone", resources=["sku-42"],
                           effect="3 units still in stock", owner=owner)
        )  # fmt: skip
        return incident_id

    # ----------------------------------------------------------------- terminal

    def step_receipt(self, step_id: str, disposition: Disposition, **extra: Any) -> None:
        tool, _ = self.steps[step_id]
        spec = TOOLS[tool]
        self.receipt_steps.append(
            StepReceipt(
                step_id=step_id, tool=tool, participant=spec["participant"],
                reversibility=spec.get("reversibility", Reversibility.COMPENSATABLE),
                pivot=spec.get("pivot", False), observation=extra.pop("observation", "COMMITTED"),
                forward_attempts=extra.pop("forward_attempts", 1),
                idempotency_key_hash=key_hash(self.key(step_id)),
                compensation=spec.get("compensation"), disposition=disposition,
                owner=extra.pop("owner", "operations"), **extra,
            )
        )  # fmt: skip

    def terminal(self, status: TerminalStatus, unresolved: list[str] | None = None) -> Receipt:
        receipt = Receipt(
            saga_id=self.saga_id, tenant_id=self.tenant, workflow=self.workflow,
            workflow_version="1", policy_version="1", sdk_version="0.1.0",
            principal=self.principal, generation=1, status=status, started_at=self.started_at,
            ended_at=self.now + 50,
            pivot_step=next(  # the pivot that committed, as the coordinator says
                (s.step_id for s in self.receipt_steps
                 if s.pivot and s.disposition is Disposition.RETAINED),
                None,
            ),
            approvals=self.approvals, steps=self.receipt_steps, incidents=self.incidents,
            unresolved=unresolved or [],
            owner="inventory-team" if status is TerminalStatus.ESCALATED else None,
        )  # fmt: skip
        self.add(
            SagaTerminal, advance_ms=50, status=status, receipt=receipt.to_json(),
            unresolved=unresolved or [],
        )  # fmt: skip
        return receipt


# ---------------------------------------------------------------------- scenarios


def completed(saga_id: str = "s-completed", start: int = T0) -> SagaScript:
    """hold -> restock -> credit (pivot) -> email (approved), all kept."""
    s = SagaScript(saga_id, now=start).start()
    s.run("1", "place_hold", amount_cents=4_000)
    s.run("2", "restock_inventory")
    s.run("3", "issue_credit", amount_cents=4_000)
    s.schedule("4", "send_email")
    s.grant(s.request_approval("4"))
    s.intent("4")
    s.commit("4")
    s.add(SagaEndRequested, outcome=SagaOutcome.COMPLETE)
    for step in "1234":
        s.step_receipt(step, Disposition.RETAINED)
    s.terminal(TerminalStatus.COMPLETED)
    return s


def compensated(saga_id: str = "s-compensated") -> SagaScript:
    """restock retried once; the credit is rejected; restock and hold are undone."""
    s = SagaScript(saga_id, tenant="globex", workflow="refund").start()
    s.run("1", "place_hold", amount_cents=2_500)
    s.schedule("2", "restock_inventory")
    s.intent("2")
    s.fail("2", FailureKind.TRANSIENT)
    s.retry("2", attempt=2)
    s.intent("2", attempt=2)
    s.commit("2", attempt=2)
    s.schedule("3", "issue_credit", amount_cents=2_500)
    s.intent("3")
    s.fail("3", FailureKind.BUSINESS_REJECTION)
    s.compensate("2")
    s.compensate("1")
    s.step_receipt("1", Disposition.COMPENSATED, verification="PASSED", compensation_attempts=1)
    s.step_receipt(
        "2", Disposition.COMPENSATED, verification="NOT_DECLARED", compensation_attempts=1,
        forward_attempts=2,
    )  # fmt: skip
    s.step_receipt("3", Disposition.NOT_COMMITTED, observation="FAILED")
    s.terminal(TerminalStatus.COMPENSATED)
    return s


def escalated(saga_id: str = "s-escalated", start: int = T0) -> SagaScript:
    """The credit fails; un-restocking fails twice and escalates; the hold is undone."""
    s = SagaScript(saga_id, now=start).start()
    s.run("1", "place_hold", amount_cents=1_000)
    s.run("2", "restock_inventory", amount_cents=2_500)
    s.schedule("3", "issue_credit", amount_cents=2_500)
    s.intent("3")
    s.fail("3", FailureKind.BUSINESS_REJECTION)
    s.compensate("2", ok=False)
    s.compensate("2", ok=False, attempt=2)
    incident = s.incident("2", "compensation-failed")
    s.compensate("1")
    s.step_receipt("1", Disposition.COMPENSATED, verification="PASSED", compensation_attempts=1)
    s.step_receipt("2", Disposition.ESCALATED, compensation_attempts=2, incident_id=incident,
                   owner="inventory-team")  # fmt: skip
    s.step_receipt("3", Disposition.NOT_COMMITTED, observation="FAILED")
    s.terminal(TerminalStatus.ESCALATED, unresolved=["restock_inventory (step 2)"])
    return s


def awaiting_approval(saga_id: str = "s-awaiting") -> SagaScript:
    """An IRREVERSIBLE email waits for a person (R7)."""
    s = SagaScript(saga_id, workflow="notify").start()
    s.run("1", "place_hold", amount_cents=700)
    s.schedule("2", "send_email")
    s.request_approval("2")
    return s


def unknown_outcome(saga_id: str = "s-unknown") -> SagaScript:
    """The restock timed out and has no lookup: a person must say if it happened (R11)."""
    s = SagaScript(saga_id, tenant="globex").start()
    s.run("1", "place_hold", amount_cents=900)
    s.schedule("2", "restock_inventory")
    s.intent("2")
    tool = s.steps["2"][0]
    s.add(StepOutcomeUnknown, step_id="2", tool=tool, idempotency_key=s.key("2"), attempt=1,
          reason="deadline 10000 ms passed")  # fmt: skip
    s.incident("2", "unknown-outcome", owner="warehouse-oncall")
    return s


def running(saga_id: str = "s-running") -> SagaScript:
    s = SagaScript(saga_id).start()
    s.run("1", "place_hold", amount_cents=300)
    s.schedule("2", "restock_inventory")
    s.intent("2")
    return s


def compensating(saga_id: str = "s-compensating") -> SagaScript:
    s = SagaScript(saga_id, workflow="notify").start()
    s.run("1", "place_hold", amount_cents=300)
    s.add(SagaEndRequested, outcome=SagaOutcome.ABORT, reason="agent raised ValueError")
    tool = s.steps["1"][0]
    s.add(CompensationRequested, step_id="1", tool=tool, compensation="release_hold",
          compensation_key=compensation_key(s.key("1")), attempt=1)  # fmt: skip
    return s


ALL = {
    "completed": completed,
    "compensated": compensated,
    "escalated": escalated,
    "awaiting_approval": awaiting_approval,
    "unknown_outcome": unknown_outcome,
    "running": running,
    "compensating": compensating,
}


def copies_to(record: Record) -> list[str]:
    """The extra topics (by TopicNames attribute) the coordinator copies a record to."""
    if isinstance(record, SagaTerminal):
        return ["terminal"]
    if isinstance(record, IncidentRaised):
        return ["incidents"]
    return []
