"""Per-saga coordinator state: what the core remembers between two records.

``SagaState`` is a fold of one saga's ledger (R5). It is serialised to the compacted
``sagaline.coordinator.state`` changelog by the shell (``to_bytes``/``from_bytes``),
so it holds only plain data: saga facts, steps with their life cycle, timers,
approvals, incidents, the bounded de-duplication memory and recorded rejections.
The rules that move it live in ``coordinator.core``; this module only describes it.
"""

from __future__ import annotations

import enum
import json
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.models import (
    ApprovalPurpose,
    LedgerRef,
    SagaOutcome,
    StepContract,
    TerminalStatus,
)
from schemas.receipt import ApprovalRecord, IncidentRecord

STATE_SCHEMA_VERSION = 1


class SagaStatus(enum.StrEnum):
    """Where a saga is: going forward, unwinding, or ended (R14)."""

    RUNNING = "RUNNING"
    COMPENSATING = "COMPENSATING"
    COMPLETED = "COMPLETED"
    COMPENSATED = "COMPENSATED"
    ESCALATED = "ESCALATED"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_SAGA

    def as_terminal(self) -> TerminalStatus:
        return TerminalStatus(self.value)


_TERMINAL_SAGA = frozenset({SagaStatus.COMPLETED, SagaStatus.COMPENSATED, SagaStatus.ESCALATED})


class StepStatus(enum.StrEnum):
    """One step's life cycle; see docs/coordinator.md for the transition diagram."""

    # forward path
    SCHEDULED = "SCHEDULED"  # recorded, waiting for its dependencies (or a pivot barrier)
    AWAITING_APPROVAL = "AWAITING_APPROVAL"  # IRREVERSIBLE: forward approval requested (R7)
    DISPATCHED = "DISPATCHED"  # ExecuteStep sent
    INTENT_RECORDED = "INTENT_RECORDED"  # the participant appended its intent (R10)
    RETRY_WAIT = "RETRY_WAIT"  # transient failure; forward retry timer pending
    RECONCILING = "RECONCILING"  # outcome unknown; ReconcileStep sent or re-reconcile timer
    UNKNOWN = "UNKNOWN"  # outcome unknown and no lookup: a person must settle it (R11)
    COMMITTED = "COMMITTED"  # the effect exists
    FAILED = "FAILED"  # failed finally, never committed
    CANCELLED = "CANCELLED"  # never ran (or its retry was dropped): the saga stopped going forward
    ESCALATED = "ESCALATED"  # handed to a person: failed after the pivot, or nothing can undo it
    # compensation path
    COMPENSATION_PENDING = "COMPENSATION_PENDING"  # must be undone; waiting for order/resources
    AWAITING_COMPENSATION_APPROVAL = "AWAITING_COMPENSATION_APPROVAL"  # REQUIRE mode (R13)
    COMPENSATING = "COMPENSATING"  # CompensateStep sent
    COMPENSATION_RETRY_WAIT = "COMPENSATION_RETRY_WAIT"  # transient failure; retry timer pending
    COMPENSATION_ACCEPTED = "COMPENSATION_ACCEPTED"  # accepted asynchronously: not done (R12)
    COMPENSATED = "COMPENSATED"  # committed (and verified where declared)
    COMPENSATION_FAILED = "COMPENSATION_FAILED"  # finally failed: incident raised (R3, R8)
    HELD = "HELD"  # upstream of an explicit edge whose compensation failed (R3)


FORWARD_IN_FLIGHT = frozenset(
    {
        StepStatus.DISPATCHED,
        StepStatus.INTENT_RECORDED,
        StepStatus.RECONCILING,
        StepStatus.UNKNOWN,
    }
)
"""The step may have taken effect and we do not know yet: nothing moves past it (R11)."""

COMPENSATION_ACTIVE = frozenset(
    {
        StepStatus.AWAITING_COMPENSATION_APPROVAL,
        StepStatus.COMPENSATING,
        StepStatus.COMPENSATION_RETRY_WAIT,
        StepStatus.COMPENSATION_ACCEPTED,
    }
)
"""A compensation has started and not finished: it holds the step's resources (R2)."""

NEVER_COMMITTED = frozenset({StepStatus.FAILED, StepStatus.CANCELLED})

COMPENSATION_FINAL = frozenset(
    {
        StepStatus.COMPENSATED,
        StepStatus.COMPENSATION_FAILED,
        StepStatus.HELD,
        StepStatus.ESCALATED,
    }
)


class TimerPurpose(enum.StrEnum):
    """Why a step has a timer; each step holds at most one timer per purpose."""

    FORWARD_RETRY = "FORWARD_RETRY"
    COMPENSATION_RETRY = "COMPENSATION_RETRY"
    RECONCILE_RETRY = "RECONCILE_RETRY"
    APPROVAL_EXPIRY = "APPROVAL_EXPIRY"
    REVERSAL_WINDOW = "REVERSAL_WINDOW"
    COMPLETION_DEADLINE = "COMPLETION_DEADLINE"  # an Accepted compensation must complete (R12)


class _StateModel(BaseModel):
    """Mutable inside the core (it works on a private deep copy), bytes as base64."""

    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class PendingApproval(_StateModel):
    """The approval the coordinator asked for; a grant must match it exactly (R7)."""

    approval_id: str
    purpose: ApprovalPurpose
    scope: str
    args_fingerprint: str
    requested_at: int
    expires_at: int


class StepState(_StateModel):
    """Everything the core knows about one step."""

    step_id: str
    index: int  # position in scheduling order
    contract: StepContract
    args: bytes  # empty when ``args_ref`` is set (over the inline threshold)
    args_ref: LedgerRef | None = None  # where the StepScheduled with the args lies
    args_fingerprint: str
    depends_on: list[str]  # resolved: the implicit predecessor, or the explicit list
    explicit: bool  # True when depends_on came from the agent (DAG edges, R2/R3)
    status: StepStatus = StepStatus.SCHEDULED
    scheduled_at: int
    idempotency_key: str
    attempt: int = 0  # last forward attempt dispatched
    intent_at: int | None = None
    committed_at: int | None = None
    provider_operation_id: str | None = None
    result: bytes | None = None  # empty when ``result_ref`` is set
    result_ref: LedgerRef | None = None  # where the commit with the result lies
    response_fingerprint: str | None = None
    observation: str = "SCHEDULED"  # what the ledger said last about the forward path
    last_error: str = ""
    reconcile_round: int = 0
    approval: PendingApproval | None = None
    approval_id: str | None = None  # the grant that released the forward step
    compensation_attempt: int = 0
    compensation_provider_operation_id: str | None = None
    verification: str | None = None  # PASSED | FAILED | NOT_DECLARED
    reversal_deadline: int | None = None
    window_expired: bool = False
    timers: dict[TimerPurpose, int] = Field(default_factory=dict)
    incident_id: str | None = None
    note: str = ""


class RejectionNote(_StateModel):
    """A record the core refused (also sent to the DLQ by the shell, R15/R16)."""

    event_id: str
    type: str
    reason: str
    detail: str
    at: int


class SagaState(_StateModel):
    """One saga, as folded from its ledger. Serialisable for the compacted changelog."""

    schema_version: int = STATE_SCHEMA_VERSION
    saga_id: str
    tenant_id: str
    generation: int
    workflow: str
    workflow_version: str
    policy_version: str
    sdk_version: str
    principal: str
    started_by: str = ""  # the agent that wrote SagaStarted, when writers are bound
    continue_on_compensation_failure: bool = False
    started_at: int
    status: SagaStatus = SagaStatus.RUNNING
    pivot_committed: str | None = None  # step id of the first pivot that committed (R6)
    end_requested: SagaOutcome | None = None
    end_reason: str = ""
    compensation_reason: str = ""
    ended_at: int | None = None
    steps: dict[str, StepState] = Field(default_factory=dict)  # in scheduling order
    approvals: list[ApprovalRecord] = Field(default_factory=list)
    incidents: list[IncidentRecord] = Field(default_factory=list)
    # The generation each incident was raised at (incident id -> generation): a
    # resolution copies it, so one older than its incident is stale (R15). None: no
    # incident raised since it was kept; then it is left out of the bytes, which stay
    # as an older coordinator writes and reads them.
    incident_generations: dict[str, int] | None = None
    # Recent records, oldest first: each one's event id, with bound writers within its
    # writer's name (``coordinator.core.dedup_key``).
    seen: list[str] = Field(default_factory=list)
    rejected_count: int = 0
    recent_rejections: list[RejectionNote] = Field(default_factory=list)

    # ------------------------------------------------------------------ serialisation

    def to_bytes(self) -> bytes:
        """Compact JSON for the changelog; equal states give equal bytes."""
        if self.incident_generations is None:
            return self.model_dump_json(exclude=_NO_INCIDENT_GENERATIONS).encode()
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SagaState:
        """The state ``data`` encodes; ``ValueError`` naming where it is invalid, and
        how, without any of its values (``unreadable``)."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise ValueError(unreadable(exc)) from None

    # ------------------------------------------------------------------------ queries

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    def next_due_at(self) -> int | None:
        """The earliest timer in this saga (epoch ms), or None: when the shell should
        call ``tick`` next. A terminal saga has no timers."""
        if self.is_terminal:
            return None
        due = [at for step in self.steps.values() for at in step.timers.values()]
        return min(due) if due else None

    def open_incidents(self) -> list[IncidentRecord]:
        return [i for i in self.incidents if not i.resolved]

    def incident(self, incident_id: str) -> IncidentRecord | None:
        for record in self.incidents:
            if record.incident_id == incident_id:
                return record
        return None

    def incident_generation(self, incident_id: str) -> int | None:
        """The generation ``incident_id`` was raised at, or None when not kept (an
        incident raised before it was)."""
        return (self.incident_generations or {}).get(incident_id)

    def keep_incident_generation(self, incident_id: str, generation: int) -> None:
        generations = self.incident_generations
        if generations is None:
            generations = self.incident_generations = {}
        generations[incident_id] = generation


_NO_INCIDENT_GENERATIONS = {"incident_generations"}


class MarkerKind(enum.StrEnum):
    """Why the changelog keeps a marker instead of a saga's full state."""

    TERMINAL = "TERMINAL"  # the saga ended: its history changes nothing any more
    PARKED = "PARKED"  # the saga could not be decided or written: a person looks


class EndedResolution(_StateModel):
    """The resolution that counted for an incident a saga left open when it ended."""

    event_id: str  # its record: a repeat of it (same id) changes nothing
    resolution: str  # "what (by whom)", as a running saga's incident keeps it


class SagaMarker(_StateModel):
    """The tiny changelog value of a saga that needs no full state any more.

    A terminal saga keeps one for ``Limits.terminal_memory_ms`` (then it is
    tombstoned), so that re-delivered history after a restart changes nothing and
    produces nothing. A parked saga keeps one until a person deals with it: its
    further records go to the DLQ (``saga-parked``) instead of stopping others.
    """

    marker: MarkerKind  # first field: ``is_marker`` recognises the bytes by it
    saga_id: str
    status: str  # the terminal status, or PARKED
    at: int  # ended_at, or when it was parked (epoch ms)
    reason: str = ""
    # What an ``IncidentResolved`` for the saga is checked against once only the marker
    # is left: the saga's tenant, and the ids of the incidents it left open. None: not
    # known (a marker written before they were kept); then nothing is checked.
    tenant_id: str | None = None
    incidents: list[str] | None = None
    # The incidents resolved since (incident id -> the resolution that counted), so a
    # later, conflicting one is refused as while the saga ran. None: none yet (and a
    # marker written before it was kept); then it is left out of the bytes, which
    # stay as an older coordinator writes and reads them.
    resolved: dict[str, EndedResolution] | None = None
    # The generation each open incident was raised at, where the saga kept it: a
    # resolution older than its incident is refused stale, as while the saga ran. None:
    # none kept; then it is left out of the bytes, as ``resolved``.
    generations: dict[str, int] | None = None

    def to_bytes(self) -> bytes:
        unset = {name for name in ("resolved", "generations") if getattr(self, name) is None}
        return self.model_dump_json(exclude=unset or None).encode()


_MARKER_PREFIX = b'{"marker":'

UNKNOWN_TENANT = "(unknown)"
"""The tenant of a parked saga whose tenant nothing tells (its state unreadable from
the first byte, no record of it in the batch): its incident and parked marker carry
this name, so only an operator of every tenant (or one given this name) may resolve
it and no tenant's operators see another tenant's saga as theirs."""

# The head of a state's JSON (``SagaState.to_bytes``: fields in declaration order).
_STATE_HEAD = re.compile(
    rb'\{"schema_version":\d+,"saga_id":("(?:[^"\\]|\\.)*"),'
    rb'"tenant_id":("(?:[^"\\]|\\.)*"),"generation":(\d+)[,}]'
)


def is_marker(value: bytes) -> bool:
    """Whether a changelog value is a marker (without decoding it)."""
    return value.startswith(_MARKER_PREFIX)


def state_head(value: bytes, saga_id: str) -> tuple[str, int] | None:
    """The tenant and generation a live state's changelog value starts with, for a
    value that does not decode as a whole (torn, or a newer version's): None when its
    head is not intact or names another saga."""
    head = _STATE_HEAD.match(value)
    if head is None:
        return None
    try:
        named, tenant = json.loads(head[1]), json.loads(head[2])
    except ValueError:
        return None
    if named != saga_id or not isinstance(tenant, str):
        return None
    return tenant, int(head[3])


def load_changelog(value: bytes) -> SagaState | SagaMarker:
    """Decode one changelog value: a full state or a marker."""
    if value.startswith(_MARKER_PREFIX):
        try:
            return SagaMarker.model_validate_json(value)
        except ValidationError as exc:
            raise ValueError(unreadable(exc)) from None
    return SagaState.from_bytes(value)


def unreadable(exc: ValidationError) -> str:
    """Why a changelog value does not decode, for a log line and a parked saga's
    reason (its marker, its incident on the ledger and the incident feed): each bad
    field's location and error type, and where the JSON breaks off. Never pydantic's
    own message, which quotes each bad field's input: a step's arguments or result,
    or the end of a torn value, in clear."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "(value)"
        problem = f"{where} ({error['type']})"
        if error["type"] == "json_invalid":  # the parser's position, no input quoted
            problem += f": {(error.get('ctx') or {}).get('error', '')}"
        problems.append(problem)
    shown = "; ".join(problems[:10])
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    return f"{exc.title} is invalid: {shown}{more}"


def terminal_marker(state: SagaState) -> SagaMarker:
    return SagaMarker(
        marker=MarkerKind.TERMINAL,
        saga_id=state.saga_id,
        status=state.status.value,
        at=state.ended_at or 0,
        tenant_id=state.tenant_id,
        incidents=[i.incident_id for i in state.open_incidents()],
        generations=open_incident_generations(state),
    )


def open_incident_generations(state: SagaState) -> dict[str, int] | None:
    """The generations ``state`` kept of its open incidents (None: none kept)."""
    generations = {
        i.incident_id: g
        for i in state.open_incidents()
        if (g := state.incident_generation(i.incident_id)) is not None
    }
    return generations or None
