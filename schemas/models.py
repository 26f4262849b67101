"""The event contract as pydantic models.

Every record on a Sagaline topic is one of these models. Each mirrors an Avro
schema in ``schemas/avsc/`` (a test keeps the two from drifting): the Avro file is
the wire contract, the model is how Python code builds and reads it.

Shape: every record has an ``envelope`` (identity, correlation, provenance) and
its own body fields. Tool arguments and results travel as JSON bytes (orjson), so
the contract does not have to know every tool's types.

Times are integer epoch milliseconds (``*_at``) and durations integer
milliseconds (``*_ms``): exact to compare, exact to round-trip, and what the pure
coordinator core uses as its clock.
"""

from __future__ import annotations

import enum
from typing import ClassVar, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    """Frozen, strict-field base: records are facts and never change once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- enums


class Reversibility(enum.StrEnum):
    """How undoable a tool's effect is (seed 000)."""

    REVERSIBLE = "REVERSIBLE"  # a perfect undo exists
    COMPENSATABLE = "COMPENSATABLE"  # an imperfect undo: a correction, not an erasure
    IRREVERSIBLE = "IRREVERSIBLE"  # no undo; suspends for human approval before it runs


class CompensationApproval(enum.StrEnum):
    """Whether a compensation may run on the forward step's authority (R13)."""

    INHERIT = "INHERIT"  # the forward approval (if any) covers the compensation
    REQUIRE = "REQUIRE"  # a new approval is needed before compensating
    ALWAYS_ALLOWED = "ALWAYS_ALLOWED"  # risk reduction: always allowed


class ApprovalPurpose(enum.StrEnum):
    FORWARD = "FORWARD"
    COMPENSATION = "COMPENSATION"


class FailureKind(enum.StrEnum):
    """Why an attempt failed: only transient failures are retried (R9)."""

    TRANSIENT = "TRANSIENT"
    BUSINESS_REJECTION = "BUSINESS_REJECTION"


class SagaOutcome(enum.StrEnum):
    COMPLETE = "COMPLETE"
    ABORT = "ABORT"


class ReconcileResult(enum.StrEnum):
    COMMITTED = "COMMITTED"
    NOT_FOUND = "NOT_FOUND"
    PENDING = "PENDING"


class TerminalStatus(enum.StrEnum):
    """The only three ways a saga ends (R14)."""

    COMPLETED = "COMPLETED"
    COMPENSATED = "COMPENSATED"
    ESCALATED = "ESCALATED"


# ------------------------------------------------------------------ shared records


class Envelope(_Model):
    """Identity and provenance carried by every record.

    ``event_id`` is the deduplication key. ``generation`` lets the coordinator reject
    events of a superseded run of the same saga (R15). The schema fingerprint lives
    in the single-object-encoding frame and the HMAC signature in a Kafka header, so
    neither is part of the signed body.
    """

    event_id: str
    saga_id: str
    tenant_id: str
    type: str
    occurred_at: int
    producer: str
    generation: int = 1
    causation_id: str | None = None


class RetryPolicy(_Model):
    """Bounded exponential backoff; jitter is derived deterministically by the core."""

    max_attempts: int = 3
    initial_backoff_ms: int = 200
    max_backoff_ms: int = 5_000


class LedgerRef(_Model):
    """Where a payload lives on ``sagaline.events``: the record at ``(partition,
    offset)``, whose payload has ``fingerprint``. Commands carry it instead of
    arguments or results over the inline threshold (``schemas.limits``), so the
    coordinator's state never grows with payload size."""

    partition: int
    offset: int
    fingerprint: str


class StepContract(_Model):
    """What a tool declared about itself, snapshotted into the ledger per step.

    The coordinator decides only from the ledger, never from live code, so the
    contract that applied when the step ran is the one recorded here.
    """

    tool: str
    participant: str
    reversibility: Reversibility = Reversibility.COMPENSATABLE
    compensation: str | None = None
    read_only: bool = False
    pivot: bool = False
    has_lookup: bool = False
    has_verify: bool = False
    resources: list[str] = Field(default_factory=list)
    reversal_window_ms: int | None = None
    compensation_approval: CompensationApproval = CompensationApproval.INHERIT
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    compensation_retry: RetryPolicy = Field(
        default_factory=lambda: RetryPolicy(
            max_attempts=8, initial_backoff_ms=200, max_backoff_ms=10_000
        )
    )
    deadline_ms: int = 10_000
    owner: str = "operations"
    completion_within_ms: int | None = None  # the declared wait for an Accepted (R12)


# ------------------------------------------------------------------------- events


class _Record(_Model):
    """Base of every event and command; ``TYPE`` is its Avro record name."""

    TYPE: ClassVar[str] = ""
    envelope: Envelope

    @model_validator(mode="after")
    def _type_matches_envelope(self) -> _Record:
        if self.envelope.type != self.TYPE:
            raise ValueError(
                f"envelope.type is {self.envelope.type!r} but the record is {self.TYPE!r}"
            )
        return self

    @property
    def saga_id(self) -> str:
        return self.envelope.saga_id

    @property
    def event_id(self) -> str:
        return self.envelope.event_id


class SagaStarted(_Record):
    """An agent opened a saga. Higher ``generation`` supersedes an earlier run."""

    TYPE: ClassVar[str] = "SagaStarted"
    workflow: str
    workflow_version: str = "1"
    policy_version: str = "1"
    principal: str
    continue_on_compensation_failure: bool = False
    sdk_version: str = "0.1.0"


class StepScheduled(_Record):
    """The agent asks for a step to run; the coordinator gates and dispatches it.

    ``depends_on`` is ``None`` for the implicit chain (the step depends on the one
    scheduled before it) or an explicit list of step ids (a DAG, R2).
    """

    TYPE: ClassVar[str] = "StepScheduled"
    step_id: str
    args: bytes
    args_fingerprint: str
    depends_on: list[str] | None = None
    contract: StepContract


class ApprovalRequested(_Record):
    TYPE: ClassVar[str] = "ApprovalRequested"
    step_id: str
    approval_id: str
    purpose: ApprovalPurpose
    principal: str
    args_fingerprint: str
    scope: str
    expires_at: int


class ApprovalGranted(_Record):
    """A grant counts only for the same principal, saga, step, fingerprint, scope and
    before ``expires_at`` (R7)."""

    TYPE: ClassVar[str] = "ApprovalGranted"
    step_id: str
    approval_id: str
    purpose: ApprovalPurpose
    principal: str
    args_fingerprint: str
    scope: str
    expires_at: int
    granted_by: str


class ApprovalDenied(_Record):
    TYPE: ClassVar[str] = "ApprovalDenied"
    step_id: str
    approval_id: str
    purpose: ApprovalPurpose
    denied_by: str
    reason: str


class StepIntentRecorded(_Record):
    """Appended, and acknowledged by the broker, before the tool runs (R10)."""

    TYPE: ClassVar[str] = "StepIntentRecorded"
    step_id: str
    tool: str
    idempotency_key: str
    args_fingerprint: str
    attempt: int
    principal: str


class StepCommitted(_Record):
    TYPE: ClassVar[str] = "StepCommitted"
    step_id: str
    tool: str
    idempotency_key: str
    attempt: int
    provider_operation_id: str | None = None
    result: bytes
    response_fingerprint: str


class StepFailed(_Record):
    TYPE: ClassVar[str] = "StepFailed"
    step_id: str
    tool: str
    idempotency_key: str
    attempt: int
    kind: FailureKind
    error_type: str
    message: str


class StepOutcomeUnknown(_Record):
    """A timeout: not a failure, the step may have committed (R11)."""

    TYPE: ClassVar[str] = "StepOutcomeUnknown"
    step_id: str
    tool: str
    idempotency_key: str
    attempt: int
    reason: str


class StepReconciled(_Record):
    TYPE: ClassVar[str] = "StepReconciled"
    step_id: str
    tool: str
    idempotency_key: str
    attempt: int
    outcome: ReconcileResult
    provider_operation_id: str | None = None
    result: bytes | None = None
    response_fingerprint: str | None = None


class StepRetryScheduled(_Record):
    """The coordinator will re-send a command at ``due_at`` (a timer in state)."""

    TYPE: ClassVar[str] = "StepRetryScheduled"
    step_id: str
    purpose: ApprovalPurpose
    attempt: int
    due_at: int


class SagaEndRequested(_Record):
    TYPE: ClassVar[str] = "SagaEndRequested"
    outcome: SagaOutcome
    reason: str = ""


class CompensationRequested(_Record):
    TYPE: ClassVar[str] = "CompensationRequested"
    step_id: str
    tool: str
    compensation: str
    compensation_key: str
    attempt: int


class CompensationAccepted(_Record):
    """Accepted asynchronously: not done until CompensationCommitted arrives (R12)."""

    TYPE: ClassVar[str] = "CompensationAccepted"
    step_id: str
    compensation_key: str
    attempt: int
    provider_operation_id: str | None = None


class CompensationCommitted(_Record):
    """``verified`` is None when the tool declares no verification."""

    TYPE: ClassVar[str] = "CompensationCommitted"
    step_id: str
    compensation_key: str
    attempt: int
    provider_operation_id: str | None = None
    result: bytes = b"null"
    verified: bool | None = None


class CompensationFailed(_Record):
    TYPE: ClassVar[str] = "CompensationFailed"
    step_id: str
    compensation_key: str
    attempt: int
    kind: FailureKind
    error_type: str
    message: str


class IncidentRaised(_Record):
    """A hand-over to a person, naming what is inconsistent and whose it is (R8)."""

    TYPE: ClassVar[str] = "IncidentRaised"
    incident_id: str
    kind: str
    step_id: str | None = None
    tool: str | None = None
    inconsistency: str
    resources: list[str] = Field(default_factory=list)
    effect: str
    owner: str


class IncidentResolved(_Record):
    """``resolution`` is free text, except for unknown-outcome incidents, where
    ``COMMITTED`` or ``NOT_FOUND`` settles the step. A ``COMMITTED`` resolution may
    carry the provider's operation id and the tool's result (JSON), which the step's
    compensation then receives."""

    TYPE: ClassVar[str] = "IncidentResolved"
    incident_id: str
    resolved_by: str
    resolution: str
    note: str = ""
    provider_operation_id: str | None = None
    result: bytes | None = None


class SagaTerminal(_Record):
    """The last word on a saga; ``receipt`` is a JSON ``schemas.receipt.Receipt``."""

    TYPE: ClassVar[str] = "SagaTerminal"
    status: TerminalStatus
    receipt: bytes
    unresolved: list[str] = Field(default_factory=list)


# ----------------------------------------------------------------------- commands


class ExecuteStep(_Record):
    """Coordinator -> participant: run a tool. Retries reuse ``idempotency_key``."""

    TYPE: ClassVar[str] = "ExecuteStep"
    step_id: str
    tool: str
    args: bytes
    idempotency_key: str
    attempt: int
    deadline_ms: int
    principal: str
    approval_id: str | None = None
    args_ref: LedgerRef | None = None  # set: ``args`` is empty, read the StepScheduled


class CompensateStep(_Record):
    """Coordinator -> participant: run the declared compensation (exact input/result)."""

    TYPE: ClassVar[str] = "CompensateStep"
    step_id: str
    tool: str
    compensation: str
    args: bytes
    result: bytes
    idempotency_key: str
    compensation_key: str
    attempt: int
    provider_operation_id: str | None = None
    args_ref: LedgerRef | None = None  # set: ``args`` is empty, read the StepScheduled
    result_ref: LedgerRef | None = None  # set: ``result`` is empty, read the commit


class ReconcileStep(_Record):
    """Coordinator -> participant: look an operation up by its idempotency key."""

    TYPE: ClassVar[str] = "ReconcileStep"
    step_id: str
    tool: str
    idempotency_key: str
    attempt: int


Event: TypeAlias = (
    SagaStarted
    | StepScheduled
    | ApprovalRequested
    | ApprovalGranted
    | ApprovalDenied
    | StepIntentRecorded
    | StepCommitted
    | StepFailed
    | StepOutcomeUnknown
    | StepReconciled
    | StepRetryScheduled
    | SagaEndRequested
    | CompensationRequested
    | CompensationAccepted
    | CompensationCommitted
    | CompensationFailed
    | IncidentRaised
    | IncidentResolved
    | SagaTerminal
)
"""Any record of ``sagaline.events``."""

Command: TypeAlias = ExecuteStep | CompensateStep | ReconcileStep
"""Any record of a ``sagaline.commands.<participant>`` topic."""

EVENT_TYPES: tuple[type[_Record], ...] = (
    SagaStarted,
    StepScheduled,
    ApprovalRequested,
    ApprovalGranted,
    ApprovalDenied,
    StepIntentRecorded,
    StepCommitted,
    StepFailed,
    StepOutcomeUnknown,
    StepReconciled,
    StepRetryScheduled,
    SagaEndRequested,
    CompensationRequested,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    IncidentRaised,
    IncidentResolved,
    SagaTerminal,
)
COMMAND_TYPES: tuple[type[_Record], ...] = (ExecuteStep, CompensateStep, ReconcileStep)
RECORD_TYPES: dict[str, type[_Record]] = {t.TYPE: t for t in EVENT_TYPES + COMMAND_TYPES}

Record: TypeAlias = _Record
"""Base class of every event and command, for annotations."""
