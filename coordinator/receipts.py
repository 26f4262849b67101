"""Build the saga receipt (R14) from coordinator state.

The receipt is the completion proof: every step with what the ledger observed, its
keys (hashed), attempts, compensation and verification, and a disposition that says
what became of its effect. Built at the terminal decision; built earlier (for a
``saga show`` of a running saga) it is provisional: effects still being undone show
as RETAINED because, right now, they are.
"""

from __future__ import annotations

from coordinator.state import SagaState, StepState, StepStatus
from schemas.keys import compensation_key, key_hash
from schemas.models import SagaOutcome, TerminalStatus
from schemas.receipt import Disposition, Receipt, StepReceipt

_ESCALATED_STEP = frozenset({StepStatus.COMPENSATION_FAILED, StepStatus.HELD, StepStatus.ESCALATED})


def disposition(step: StepState) -> Disposition:
    """What became of one step's effect."""
    if step.contract.read_only:
        return Disposition.READ_ONLY
    if step.status is StepStatus.COMPENSATED:
        return Disposition.COMPENSATED
    if step.status in _ESCALATED_STEP:
        return Disposition.ESCALATED
    if step.committed_at is None:
        return Disposition.NOT_COMMITTED
    return Disposition.RETAINED


def step_receipt(step: StepState) -> StepReceipt:
    contract = step.contract
    compensated = step.compensation_attempt > 0
    return StepReceipt(
        step_id=step.step_id,
        tool=contract.tool,
        participant=contract.participant,
        reversibility=contract.reversibility,
        pivot=contract.pivot,
        read_only=contract.read_only,
        depends_on=list(step.depends_on),
        resources=list(contract.resources),
        intent_at=step.intent_at,
        idempotency_key_hash=key_hash(step.idempotency_key) if step.attempt else None,
        provider_operation_id=step.provider_operation_id,
        observation=step.observation,
        forward_attempts=step.attempt,
        committed_at=step.committed_at,
        compensation=contract.compensation,
        compensation_key_hash=(
            key_hash(compensation_key(step.idempotency_key)) if compensated else None
        ),
        compensation_attempts=step.compensation_attempt,
        compensation_provider_operation_id=step.compensation_provider_operation_id,
        verification=step.verification,
        disposition=disposition(step),
        owner=contract.owner,
        incident_id=step.incident_id,
        note=step.note,
    )


def unresolved(state: SagaState) -> list[str]:
    """Step ids whose effect was handed to a person, then every other open incident
    (as ``incident:<id>``): one about no step or a step not escalated, and one about
    an escalated step other than the incident the step names (a participant's own,
    say), which a person must deal with as well."""
    escalated = [s for s in state.steps.values() if disposition(s) is Disposition.ESCALATED]
    named = {s.incident_id for s in escalated if s.incident_id is not None}
    extra = [
        f"incident:{i.incident_id}" for i in state.open_incidents() if i.incident_id not in named
    ]
    return [s.step_id for s in escalated] + extra


def end_reason(state: SagaState) -> str:
    """Why the saga ended as it did: the agent's words, except for a saga that unwound
    because a step failed finally; that one names the step, whatever the agent asked
    at the end (an agent that caught the tool's error and left its block normally asked
    to COMPLETE, which is not why the saga was compensated)."""
    if state.end_requested is SagaOutcome.COMPLETE and state.compensation_reason:
        return state.compensation_reason
    return state.end_reason or state.compensation_reason


def build_receipt(state: SagaState, status: TerminalStatus, ended_at: int) -> Receipt:
    """The receipt published with ``SagaTerminal``."""
    steps = [step_receipt(s) for s in state.steps.values()]
    owners = sorted(
        {s.owner for s in steps if s.disposition is Disposition.ESCALATED}
        | {i.owner for i in state.open_incidents()}
    )
    # The pivot the saga went past (R6); a declared one that never committed (or
    # committed only during the unwind) is not: each step's own flag says it is one.
    pivot = state.pivot_committed
    return Receipt(
        saga_id=state.saga_id,
        tenant_id=state.tenant_id,
        workflow=state.workflow,
        workflow_version=state.workflow_version,
        policy_version=state.policy_version,
        sdk_version=state.sdk_version,
        principal=state.principal,
        generation=state.generation,
        status=status,
        started_at=state.started_at,
        ended_at=ended_at,
        end_reason=end_reason(state),
        pivot_step=pivot,
        approvals=list(state.approvals),
        steps=steps,
        incidents=list(state.incidents),
        unresolved=unresolved(state),
        owner=", ".join(owners) if owners else None,
    )
