"""One realistic record of every type, for smoke runs, benchmarks and tests.

The refund saga of seed 003 in miniature: a payment captured, then refunded.
"""

from __future__ import annotations

import orjson

from schemas.keys import args_fingerprint, compensation_key, fingerprint, idempotency_key
from schemas.models import (
    RECORD_TYPES,
    ApprovalDenied,
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    CompensateStep,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    CompensationRequested,
    Envelope,
    ExecuteStep,
    FailureKind,
    IncidentRaised,
    IncidentResolved,
    ReconcileResult,
    ReconcileStep,
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
    StepReconciled,
    StepRetryScheduled,
    StepScheduled,
    TerminalStatus,
)


def example_records(saga_id: str = "saga-example-1", now: int = 1_700_000_000_000) -> list[Record]:
    """One record of each of the 22 types, all of saga ``saga_id``, in ledger order."""
    args = orjson.dumps({"order": "o-42", "amount_cents": 1999, "currency": "EUR"})
    result = orjson.dumps({"charge_id": "ch_1", "status": "captured"})
    fp = args_fingerprint(args)
    key = idempotency_key(saga_id, "charge", "payments.charge", args)
    ckey = compensation_key(key)
    contract = StepContract(
        tool="payments.charge",
        participant="payments",
        reversibility=Reversibility.COMPENSATABLE,
        compensation="refund",
        has_lookup=True,
        resources=["order:o-42"],
        reversal_window_ms=86_400_000,
    )
    counter = iter(range(1, 1000))

    def env(record_type: type[Record]) -> Envelope:
        n = next(counter)
        return Envelope(
            event_id=f"{saga_id}-e{n}",
            saga_id=saga_id,
            tenant_id="acme",
            type=record_type.TYPE,
            occurred_at=now + n,
            producer="example",
            generation=1,
            causation_id=f"{saga_id}-e{n - 1}" if n > 1 else None,
        )

    common = {"step_id": "charge", "tool": "payments.charge", "idempotency_key": key}
    records: list[Record] = [
        SagaStarted(envelope=env(SagaStarted), workflow="refund", principal="alice"),
        StepScheduled(
            envelope=env(StepScheduled),
            step_id="charge",
            args=args,
            args_fingerprint=fp,
            depends_on=None,
            contract=contract,
        ),
        ApprovalRequested(
            envelope=env(ApprovalRequested),
            step_id="charge",
            approval_id="ap-1",
            purpose=ApprovalPurpose.FORWARD,
            principal="alice",
            args_fingerprint=fp,
            scope="payments",
            expires_at=now + 3_600_000,
        ),
        ApprovalGranted(
            envelope=env(ApprovalGranted),
            step_id="charge",
            approval_id="ap-1",
            purpose=ApprovalPurpose.FORWARD,
            principal="alice",
            args_fingerprint=fp,
            scope="payments",
            expires_at=now + 3_600_000,
            granted_by="bob",
        ),
        ApprovalDenied(
            envelope=env(ApprovalDenied),
            step_id="charge",
            approval_id="ap-2",
            purpose=ApprovalPurpose.COMPENSATION,
            denied_by="bob",
            reason="amount too high",
        ),
        ExecuteStep(
            envelope=env(ExecuteStep),
            args=args,
            attempt=1,
            deadline_ms=10_000,
            principal="alice",
            approval_id="ap-1",
            **common,
        ),
        StepIntentRecorded(
            envelope=env(StepIntentRecorded),
            args_fingerprint=fp,
            attempt=1,
            principal="alice",
            **common,
        ),
        StepFailed(
            envelope=env(StepFailed),
            attempt=1,
            kind=FailureKind.TRANSIENT,
            error_type="ConnectionError",
            message="payment gateway reset the connection",
            **common,
        ),
        StepRetryScheduled(
            envelope=env(StepRetryScheduled),
            step_id="charge",
            purpose=ApprovalPurpose.FORWARD,
            attempt=2,
            due_at=now + 400,
        ),
        StepOutcomeUnknown(
            envelope=env(StepOutcomeUnknown), attempt=2, reason="deadline 10000 ms", **common
        ),
        ReconcileStep(envelope=env(ReconcileStep), attempt=2, **common),
        StepReconciled(
            envelope=env(StepReconciled),
            attempt=2,
            outcome=ReconcileResult.COMMITTED,
            provider_operation_id="ch_1",
            result=result,
            response_fingerprint=fingerprint(result),
            **common,
        ),
        StepCommitted(
            envelope=env(StepCommitted),
            attempt=2,
            provider_operation_id="ch_1",
            result=result,
            response_fingerprint=fingerprint(result),
            **common,
        ),
        SagaEndRequested(
            envelope=env(SagaEndRequested), outcome=SagaOutcome.ABORT, reason="user cancelled"
        ),
        CompensationRequested(
            envelope=env(CompensationRequested),
            step_id="charge",
            tool="payments.charge",
            compensation="refund",
            compensation_key=ckey,
            attempt=1,
        ),
        CompensateStep(
            envelope=env(CompensateStep),
            compensation="refund",
            args=args,
            result=result,
            compensation_key=ckey,
            attempt=1,
            **common,
        ),
        CompensationFailed(
            envelope=env(CompensationFailed),
            step_id="charge",
            compensation_key=ckey,
            attempt=1,
            kind=FailureKind.TRANSIENT,
            error_type="TimeoutError",
            message="refund endpoint timed out",
        ),
        CompensationAccepted(
            envelope=env(CompensationAccepted),
            step_id="charge",
            compensation_key=ckey,
            attempt=2,
            provider_operation_id="re_1",
        ),
        CompensationCommitted(
            envelope=env(CompensationCommitted),
            step_id="charge",
            compensation_key=ckey,
            attempt=2,
            provider_operation_id="re_1",
            result=orjson.dumps({"refund_id": "re_1"}),
            verified=True,
        ),
        IncidentRaised(
            envelope=env(IncidentRaised),
            incident_id="inc-1",
            kind="compensation-verification",
            step_id="charge",
            tool="payments.charge",
            inconsistency="refund re_1 issued but ledger balance not restored",
            resources=["order:o-42"],
            effect="19.99 EUR charged",
            owner="payments-oncall",
        ),
        IncidentResolved(
            envelope=env(IncidentResolved),
            incident_id="inc-1",
            resolved_by="carol",
            resolution="balance corrected by hand",
            note="ticket PAY-7",
        ),
        SagaTerminal(
            envelope=env(SagaTerminal),
            status=TerminalStatus.COMPENSATED,
            receipt=orjson.dumps({"saga_id": saga_id, "status": "COMPENSATED"}),
            unresolved=[],
        ),
    ]
    assert {r.TYPE for r in records} == set(RECORD_TYPES), "one example per record type"
    return records


__all__ = ["example_records"]
