"""The pure decision core of the coordinator: no Kafka, no clock, no randomness.

``decide(state, record, now)`` folds one ledger record into a saga's state and says
what to emit; ``tick(state, now)`` fires the timers that are due. Both return a
``Decision``: the new state and a list of ``Output`` records, each naming where it
goes. The Kafka shell only routes outputs and persists state; every rule (R1-R3,
R6-R9, R11-R15) is decided here, deterministically, so it can be tested without a
broker and replayed from the log (R5).

Example::

    d = decide(None, saga_started, now=1_000)
    d = decide(d.state, step_scheduled, now=1_010)
    for out in d.outputs:
        if out.destination is Destination.COMMAND:
            produce(f"sagaline.commands.{out.participant}", out.record)
    when = d.state.next_due_at()   # call tick(d.state, when) then
"""

from __future__ import annotations

import datetime
import enum
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson

from coordinator import graph
from coordinator.receipts import build_receipt, disposition
from coordinator.state import (
    COMPENSATION_ACTIVE,
    COMPENSATION_FINAL,
    FORWARD_IN_FLIGHT,
    NEVER_COMMITTED,
    PendingApproval,
    RejectionNote,
    SagaState,
    SagaStatus,
    StepState,
    StepStatus,
    TimerPurpose,
)
from schemas.keys import (
    args_fingerprint,
    canonical_json,
    compensation_key,
    derived_event_id,
    fingerprint,
    idempotency_key,
    key_hash,
    step_id_problem,
)
from schemas.limits import cut_operator_text
from schemas.models import (
    COMMAND_TYPES,
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
    LedgerRef,
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
    StepFailed,
    StepIntentRecorded,
    StepOutcomeUnknown,
    StepReconciled,
    StepRetryScheduled,
    StepScheduled,
    TerminalStatus,
)
from schemas.receipt import ApprovalRecord, Disposition, IncidentRecord

__all__ = [
    "COORDINATOR_PRODUCER",
    "DEFAULT_POLICY",
    "CorePolicy",
    "CorrelationError",
    "Decision",
    "Destination",
    "LedgerPosition",
    "Output",
    "RejectReason",
    "SagaState",
    "decide",
    "dedup_key",
    "fold",
    "record_time",
    "retry_delay_ms",
    "tenant_mismatch",
    "tick",
    "unknown_outcome_answer",
    "unknown_outcome_refusal",
]

LedgerPosition = tuple[int, int]
"""Where a record lies on ``sagaline.events``: (partition, offset)."""

COORDINATOR_PRODUCER = "sagaline-coordinator"
"""``envelope.producer`` of every record the core emits. Records carrying it that come
back on ``sagaline.events`` are the coordinator's own echo and change nothing."""


# ----------------------------------------------------------------------- outputs


class Destination(enum.StrEnum):
    """Where an output goes; the shell maps kinds to topics."""

    EVENT = "EVENT"  # sagaline.events
    COMMAND = "COMMAND"  # sagaline.commands.<participant>
    TERMINAL = "TERMINAL"  # sagaline.terminal, and appended to sagaline.events
    INCIDENT = "INCIDENT"  # sagaline.incidents, and appended to sagaline.events
    # sagaline.incidents only: an incident the coordinator settled itself (its step's
    # outcome read, a late completion), for the operators' feed (``_mark_resolved``).
    INCIDENT_FEED = "INCIDENT_FEED"
    REJECTED = "REJECTED"  # sagaline.dlq, with reason and detail


class RejectReason(enum.StrEnum):
    """Reason codes of rejected records (the DLQ ``reason``)."""

    STALE_GENERATION = "stale-generation"
    UNKNOWN_SAGA = "unknown-saga"
    UNKNOWN_STEP = "unknown-step"
    INVALID_TRANSITION = "invalid-transition"
    INVALID_DEPENDENCY = "invalid-dependency"
    INVALID_ARGUMENTS = "invalid-arguments"
    DUPLICATE_STEP = "duplicate-step"
    TOO_MANY_STEPS = "too-many-steps"
    INVALID_STEP_ID = "invalid-step-id"
    APPROVAL_MISMATCH = "approval-mismatch"
    NOT_AN_EVENT = "not-an-event"
    FORBIDDEN_WRITER = "forbidden-writer"
    TENANT_MISMATCH = "tenant-mismatch"


@dataclass(frozen=True, slots=True)
class Output:
    """One record to produce. ``participant`` is set for commands; ``reason`` and
    ``detail`` for rejections (``record`` is then the rejected input)."""

    destination: Destination
    record: Record
    participant: str | None = None
    reason: str | None = None
    detail: str = ""

    @property
    def appends_to_events(self) -> bool:
        """EVENT, TERMINAL and INCIDENT outputs all belong on the ledger."""
        return self.destination in (Destination.EVENT, Destination.TERMINAL, Destination.INCIDENT)


@dataclass(frozen=True, slots=True)
class Decision:
    """The result of one ``decide`` or ``tick``.

    ``changed`` is False when nothing changed (a duplicate, an echo, nothing due):
    ``state`` is then the very object passed in, untouched, and the shell need not
    write the changelog.
    """

    state: SagaState | None
    outputs: list[Output] = field(default_factory=list)
    changed: bool = False


@dataclass(frozen=True, slots=True)
class CorePolicy:
    """Knobs of the core that are not part of a tool's contract."""

    dedup_memory: int = 512  # event ids remembered per saga
    rejection_memory: int = 8  # recent rejections kept in state (the count is exact)
    approval_ttl_ms: int = 24 * 3600 * 1000  # how long an approval request stays open
    reconcile_rounds: int = 10  # PENDING lookups before a person is asked (R11)
    # With a trust file, envelope.producer is the verified signer (schemas.trust), and
    # the core also checks who answers a command and who drives a saga, and remembers
    # event ids per writer (``dedup_key``).
    bind_writers: bool = False
    # The most steps a saga may schedule (the shell sets ``Limits.max_steps``, i.e.
    # SAGALINE_MAX_STEPS); a step past it is rejected. None: no limit.
    max_steps: int | None = None
    # Arguments and results up to this size stay in state and commands; larger ones
    # are kept as a ledger reference (when the shell says where the record is).
    inline_payload_bytes: int = 1024
    reconcile_backoff: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(
            max_attempts=10, initial_backoff_ms=500, max_backoff_ms=60_000
        )
    )


DEFAULT_POLICY = CorePolicy()


class CorrelationError(ValueError):
    """The shell passed a record to the state of another saga (a routing bug)."""


# ---------------------------------------------------------------------- helpers


def retry_delay_ms(policy: RetryPolicy, failed_attempt: int, *salt: str | int) -> int:
    """Bounded exponential backoff with deterministic "equal jitter".

    The delay after attempt ``n`` is in ``[base/2, base]`` with
    ``base = min(max_backoff, initial * 2**(n-1))``; the point in that range is a hash
    of ``salt`` (saga, step, purpose, attempt), so replays compute the same timer.
    """
    exponent = min(max(failed_attempt - 1, 0), 40)
    base = max(1, min(policy.max_backoff_ms, policy.initial_backoff_ms << exponent))
    half = base // 2
    digest = hashlib.sha256("/".join(str(p) for p in salt).encode()).digest()
    return half + int.from_bytes(digest[:8], "big") % (base - half + 1)


def dedup_key(record: Record, policy: CorePolicy) -> str:
    """What ``SagaState.seen`` remembers of ``record`` to know a repeat of it (R15).

    Its event id; with bound writers, its event id within its writer's name (the
    verified ``envelope.producer``). Event ids of some records are derived from what
    every reader of the saga sees (an operator's decision, from the saga, the request
    and the operator's name), so another writer allowed on the saga (its agent, one of
    its participants) could otherwise write a record of its own under such an id first
    and have the real one dropped as its duplicate. A writer's own repeats (retries,
    redelivery, replay) still have one key. The name comes first, with its length, so
    no event id can make one writer's key another's."""
    if not policy.bind_writers:
        return record.event_id
    producer = record.envelope.producer
    return f"{len(producer)}:{producer}:{record.event_id}"


def _is_own(record: Record) -> bool:
    return record.envelope.producer == COORDINATOR_PRODUCER


_COORDINATOR_ONLY = (ApprovalRequested, StepRetryScheduled, CompensationRequested, SagaTerminal)
_UNKNOWN_OUTCOME = "unknown-outcome"
# What a participant's runtime raises when asked to look up a tool it declares no lookup
# for (the contract the step was scheduled under said it had one): a person must settle
# it exactly as an unknown-outcome incident (R11).
_UNKNOWN_OUTCOME_NO_LOOKUP = "unknown-outcome-no-lookup"
_SETTLES_UNKNOWN = frozenset({_UNKNOWN_OUTCOME, _UNKNOWN_OUTCOME_NO_LOOKUP})

SETTLES_UNKNOWN = _SETTLES_UNKNOWN
"""Incident kinds that ask a person to settle an unknown outcome (R11)."""


def unknown_outcome_answer(resolution: str) -> ReconcileResult | None:
    """A person's answer to an unknown-outcome incident as the core reads it (case-blind,
    spaces ignored): COMMITTED or NOT_FOUND; None for anything else, which the core
    refuses (:func:`unknown_outcome_refusal`) while the step is unsettled."""
    answer = resolution.strip().upper()
    if answer == ReconcileResult.COMMITTED.value:
        return ReconcileResult.COMMITTED
    if answer == ReconcileResult.NOT_FOUND.value:
        return ReconcileResult.NOT_FOUND
    return None


def unknown_outcome_refusal(incident_id: str, resolution: str) -> str:
    """Why the core refuses an answer that is not :func:`unknown_outcome_answer`."""
    return (
        f"incident {incident_id} is about an unknown outcome; resolve it with "
        f"COMMITTED or NOT_FOUND, not {cut_operator_text(resolution)!r}"
    )


def tenant_mismatch(record: Record, saga_id: str, tenant_id: str) -> str | None:
    """Why ``record`` is refused for a saga of ``tenant_id`` (None: same tenant)."""
    env = record.envelope
    if env.tenant_id == tenant_id:
        return None
    return (
        f"{env.type} {record.event_id} from {env.producer!r} is for tenant "
        f"{env.tenant_id!r} but saga {saga_id} belongs to tenant {tenant_id!r}"
    )


_FORWARD_FAILED_AFTER_PIVOT = "forward-failed-after-pivot"
_WINDOW_EXPIRED = "reversal-window-expired"


class _Ctx:
    """One decision in progress: the private copy of the state and the outputs."""

    def __init__(
        self,
        state: SagaState,
        now: int,
        cause: str | None,
        policy: CorePolicy,
        position: LedgerPosition | None = None,
    ):
        self.s = state
        self.now = now
        self.cause = cause
        self.policy = policy
        self.position = position
        self.out: list[Output] = []

    def payload(self, data: bytes) -> tuple[bytes, LedgerRef | None]:
        """``(data, None)`` to keep a payload inline, or ``(b"", ref)`` to keep only
        where the record being decided lies on the ledger and its fingerprint."""
        if self.position is None or len(data) <= self.policy.inline_payload_bytes:
            return data, None
        partition, offset = self.position
        return b"", LedgerRef(partition=partition, offset=offset, fingerprint=fingerprint(data))

    # -- emitting

    def envelope(self, record_type: type[Record], event_id: str) -> Envelope:
        s = self.s
        return Envelope(
            event_id=event_id,
            saga_id=s.saga_id,
            tenant_id=s.tenant_id,
            type=record_type.TYPE,
            occurred_at=self.now,
            producer=COORDINATOR_PRODUCER,
            generation=s.generation,
            causation_id=self.cause,
        )

    def event_id(self, *parts: str | int) -> str:
        return derived_event_id(self.s.saga_id, *parts)

    def emit(self, record: Record, kind: Destination = Destination.EVENT) -> None:
        # Our own events come back on sagaline.events: remember them as seen.
        self.remember(dedup_key(record, self.policy))
        self.out.append(Output(kind, record))

    def command(self, record: Record, participant: str) -> None:
        self.out.append(Output(Destination.COMMAND, record, participant=participant))

    def remember(self, key: str) -> None:
        """Remember a record's ``dedup_key`` (the oldest are forgotten)."""
        seen = self.s.seen
        seen.append(key)
        excess = len(seen) - self.policy.dedup_memory
        if excess > 0:
            del seen[:excess]

    def reject(self, record: Record, reason: RejectReason, detail: str) -> None:
        s = self.s
        s.rejected_count += 1
        s.recent_rejections.append(
            RejectionNote(
                event_id=record.event_id,
                type=record.envelope.type,
                reason=reason.value,
                detail=detail,
                at=self.now,
            )
        )
        excess = len(s.recent_rejections) - self.policy.rejection_memory
        if excess > 0:
            del s.recent_rejections[:excess]
        self.out.append(Output(Destination.REJECTED, record, reason=reason.value, detail=detail))


def _private_copy(state: SagaState, in_place: bool) -> SagaState:
    """The state a decision works on: ``state`` itself when the caller gave it up
    (``in_place``), else a copy. Going through the changelog encoding is several times
    faster than a deep copy and proves on every decision that state round-trips."""
    return state if in_place else SagaState.from_bytes(state.to_bytes())


def _rejection(record: Record, reason: RejectReason, detail: str) -> Output:
    return Output(Destination.REJECTED, record, reason=reason.value, detail=detail)


# ------------------------------------------------------------------- public API


def decide(
    state: SagaState | None,
    record: Record,
    now: int,
    policy: CorePolicy = DEFAULT_POLICY,
    *,
    position: LedgerPosition | None = None,
    in_place: bool = False,
) -> Decision:
    """Fold one record of ``sagaline.events`` into its saga's state.

    ``state`` is None for a saga the coordinator has never seen; ``now`` is the
    processing time in epoch ms (used for timers and emitted envelopes only).
    ``position`` is where ``record`` lies on ``sagaline.events`` (partition, offset):
    given, arguments and results over ``policy.inline_payload_bytes`` are kept as a
    reference to it instead of a copy, and commands carry that reference. The rules
    do not depend on it.

    ``state`` is never changed unless ``in_place`` is set: then the caller gives it
    up, and a decision that changes the saga changes and returns that very object
    (half-changed if the call raises) instead of a private copy. The shell, which
    keeps states as bytes and decodes a fresh object per batch, saves a copy per record.
    """
    if state is None:
        return _decide_new(record, now, policy, position)
    if record.saga_id != state.saga_id:
        raise CorrelationError(
            f"record {record.event_id} belongs to saga {record.saga_id!r} but was decided "
            f"against the state of saga {state.saga_id!r}; route records by saga id"
        )
    key = dedup_key(record, policy)
    if key in state.seen:
        return Decision(state)  # a duplicate changes nothing (R15)
    own = _is_own(record)
    stale = (
        record.envelope.generation < state.generation
        and not resolves_earlier_incident(state, record)
        and not completes_awaited_compensation(state, record)
    )
    if own or (state.is_terminal and not stale):
        return Decision(state)  # our echo, or a late record for an ended saga
    ctx = _Ctx(_private_copy(state, in_place), now, record.event_id, policy, position)
    if _refused_writer(ctx, record):
        return Decision(ctx.s, ctx.out, True)  # not remembered: the rightful record may follow
    ctx.remember(key)
    if stale:
        detail = (
            f"{record.envelope.type} has generation {record.envelope.generation} but saga "
            f"{state.saga_id} is at generation {state.generation}"
        )
        if isinstance(record, IncidentResolved):
            raised = _older_than_its_incident(state, record)
            if raised is not None:
                detail = stale_resolution(record, state.saga_id, raised)
        ctx.reject(record, RejectReason.STALE_GENERATION, detail)
    else:
        _apply(ctx, record)
        _advance(ctx)
    return Decision(ctx.s, ctx.out, True)


def tick(
    state: SagaState, now: int, policy: CorePolicy = DEFAULT_POLICY, *, in_place: bool = False
) -> Decision:
    """Fire every timer of ``state`` that is due at ``now`` (retries, re-reconciles,
    approval expiry, reversal windows), then move the saga on. ``in_place`` as for
    :func:`decide`."""
    if state.is_terminal:
        return Decision(state)
    due = sorted(
        (at, step.index, purpose.value, step.step_id)
        for step in state.steps.values()
        for purpose, at in step.timers.items()
        if at <= now
    )
    if not due:
        return Decision(state)
    ctx = _Ctx(_private_copy(state, in_place), now, None, policy)
    for at, _index, purpose_value, step_id in due:
        step = ctx.s.steps[step_id]
        purpose = TimerPurpose(purpose_value)
        if step.timers.get(purpose) != at:
            continue  # an earlier timer in this tick already moved the step
        del step.timers[purpose]
        ctx.now = at  # a timer's effects happen when it was due, however late the tick
        _fire(ctx, step, purpose)
    ctx.now = now
    _advance(ctx)
    return Decision(ctx.s, ctx.out, True)


def record_time(record: Record) -> int:
    """The default clock for ``fold``: when the record says it happened."""
    return record.envelope.occurred_at


def fold(
    records: Iterable[Record],
    now_fn: Callable[[Record], int] = record_time,
    policy: CorePolicy = DEFAULT_POLICY,
) -> dict[str, SagaState]:
    """Rebuild coordinator state from a log (R5).

    Before each record its saga's due timers are fired at ``now_fn(record)``, as the
    live shell would have; the outputs are dropped (they are already in the log, and
    the coordinator's own records are no-ops when they come by).
    """
    states: dict[str, SagaState] = {}  # its own: decided in place
    for record in records:
        now = now_fn(record)
        state = states.get(record.saga_id)
        if state is not None:
            state = _state_of(tick(state, now, policy, in_place=True))
        decision = decide(state, record, now, policy, in_place=True)
        if decision.state is not None:
            states[record.saga_id] = decision.state
    return states


def _state_of(decision: Decision) -> SagaState:
    if decision.state is None:  # pragma: no cover - tick always returns a state
        raise RuntimeError("tick returned no state")
    return decision.state


# --------------------------------------------------------------- new sagas


# Who may write what in a saga once writers are bound (R15, R16); the dashboard
# mirrors the same decision, so it imports these.
AGENT_DRIVEN = (StepScheduled, SagaEndRequested, SagaStarted)
PARTICIPANT_OUTCOMES = (
    StepIntentRecorded,
    StepCommitted,
    StepFailed,
    StepOutcomeUnknown,
    StepReconciled,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    IncidentRaised,  # participants raise one for a lookup they cannot do
)


def resolves_earlier_incident(state: SagaState, record: Record) -> bool:
    """Whether ``record`` is a person's resolution of an incident an earlier run (an
    older generation) raised that ``state`` holds and no later run asked again: it is
    decided whatever generation it carries, as one of the current run (counted if the
    incident is open, else refused naming the first resolution). R15 still refuses
    every other record of a superseded run as stale.

    A resolution copies its incident's generation, so without this an incident that
    settles no step (no compensation, a failed compensation, a participant's own) and
    was open when the agent restarted the saga could never be resolved: no new run
    raises it again. An unknown outcome still unsettled is asked again under the new
    generation (``_ask_again_to_settle``): a resolution of the earlier incident stays
    stale, and the person answers the newer one (which settles both)."""
    if not isinstance(record, IncidentResolved):
        return False
    incident = state.incident(record.incident_id)
    if incident is None:
        return False
    if _older_than_its_incident(state, record) is not None:
        return False  # no copy of its incident's generation: a superseded run's record
    if incident.resolved:
        return True  # refused all the same, saying who resolved it first
    if incident.kind in _SETTLES_UNKNOWN and incident.step_id is not None:
        step = state.steps.get(incident.step_id)
        if step is not None and step.status in (StepStatus.UNKNOWN, StepStatus.RECONCILING):
            return False  # asked again under the current generation
    return True


def _older_than_its_incident(state: SagaState, record: IncidentResolved) -> int | None:
    """The generation ``record``'s incident was raised at when ``record`` carries an
    older one, else None. A resolution copies its incident's generation, so an older
    one answers no incident of that id this saga raised (R15)."""
    raised = state.incident_generation(record.incident_id)
    if raised is not None and record.envelope.generation < raised:
        return raised
    return None


def stale_resolution(record: IncidentResolved, saga_id: str, raised: int) -> str:
    """Why a resolution older than its incident (raised at generation ``raised``) is
    refused ``stale-generation``."""
    return (
        f"IncidentResolved has generation {record.envelope.generation} but incident "
        f"{record.incident_id} of saga {saga_id} was raised at generation {raised}: a "
        "resolution carries its incident's generation, so this one answers no incident "
        "of that id and does not count"
    )


def completes_awaited_compensation(state: SagaState, record: Record) -> bool:
    """Whether ``record`` is the completion (``CompensationCommitted``) of the very
    compensation a step of ``state`` still awaits, answering that compensation's
    command of an earlier run (an older generation): it is decided whatever
    generation it carries. R15 still refuses every other record of a superseded run.

    A new run asks again for a compensation in flight, under the same compensation
    key and attempt (``_on_saga_started``), so the provider's one operation may be
    completed under either run. When its completion reached the participant before
    the new run's command did (a receipt comes once), the old run's answer is the only
    one there will be: refused as stale, the step waited for a second completion
    that never comes and the saga escalated at the completion deadline, its effect
    undone. Only the command of the attempt the step awaits counts
    (``causation_id``), so an answer to an earlier attempt changes nothing."""
    if not isinstance(record, CompensationCommitted):
        return False
    step = state.steps.get(record.step_id)
    if step is None or step.status not in (
        StepStatus.COMPENSATING,
        StepStatus.COMPENSATION_ACCEPTED,
    ):
        return False
    attempt = step.compensation_attempt
    return record.attempt == attempt and record.envelope.causation_id == derived_event_id(
        state.saga_id, record.envelope.generation, "CompensateStep", step.step_id, attempt
    )


def _refused_writer(ctx: _Ctx, record: Record) -> bool:
    """Reject (and report) a record from the wrong tenant or, with bound writers, from
    a writer with no say over this saga; True when it was refused."""
    s, env = ctx.s, record.envelope
    detail = tenant_mismatch(record, s.saga_id, s.tenant_id)
    if detail is not None:
        ctx.reject(record, RejectReason.TENANT_MISMATCH, detail)
        # One open incident per saga is enough for a person to look; more would be spam.
        if not any(i.kind == "tenant-mismatch" for i in s.open_incidents()):
            _raise_incident(
                ctx,
                "tenant-mismatch",
                None,
                detail,
                "none: the record was refused; find who wrote it",
            )
        return True
    if not ctx.policy.bind_writers:
        return False
    problem = None
    if isinstance(record, AGENT_DRIVEN) and s.started_by and env.producer != s.started_by:
        problem = f"saga {s.saga_id} was started by {s.started_by!r}; only it drives the saga"
    elif isinstance(record, PARTICIPANT_OUTCOMES):
        step = s.steps.get(record.step_id) if record.step_id is not None else None
        if step is None and isinstance(record, IncidentRaised):
            problem = "an incident from a participant must name a step of this saga"
        elif step is not None and env.producer != step.contract.participant:
            problem = (
                f"step {step.step_id} runs on participant {step.contract.participant!r}; "
                f"{env.producer!r} may not report its outcome"
            )
        elif step is not None and not _answers_command(
            s, step, env.generation, env.causation_id, ctx.policy.reconcile_rounds
        ):
            problem = (
                f"causation {env.causation_id!r} names no command sent to "
                f"{step.contract.participant!r} for step {step.step_id}"
            )
    if problem is None:
        return False
    ctx.reject(record, RejectReason.FORBIDDEN_WRITER, f"{env.type} {record.event_id}: {problem}")
    return True


def _answers_command(
    s: SagaState, step: StepState, generation: int, causation: str | None, rounds: int
) -> bool:
    """Whether ``causation`` is the event id of a command the core can have sent for
    ``step`` under ``generation`` (they are derived deterministically, so they are
    recomputed instead of stored).

    A participant answers under the generation of the command it answers (the runtime
    copies it), so only that one generation is looked at. Walking every generation up
    to the saga's made the cost grow with a number the agent chooses: a run numbered by
    a timestamp stopped the coordinator, and every saga it owns, on the first outcome.

    The commands of the current attempts come first (nearly every answer is to one of
    them). ``step.reconcile_round`` counts the lookups of the current attempt only: an
    earlier attempt may have had more (up to ``rounds``, when a person is asked), and a
    late answer to one of them is the right participant answering a command that was
    sent, not a forgery (R11: it is then ignored, or it is the effect).
    """
    if causation is None or generation > s.generation:
        return False  # no command of ours carries a generation the saga has not reached
    if causation in _commands_sent(s, step, generation):
        return True
    return any(
        causation
        == derived_event_id(s.saga_id, generation, "ReconcileStep", step.step_id, attempt, rnd)
        for attempt in range(1, step.attempt)
        for rnd in range(step.reconcile_round + 1, max(rounds, step.reconcile_round) + 1)
    )


def _commands_sent(s: SagaState, step: StepState, generation: int) -> set[str]:
    """Event ids of the commands :func:`_answers_command` looks at first: each
    attempt's ``ExecuteStep`` and ``CompensateStep``, and lookups up to the current
    round, under ``generation``."""
    sent: set[str] = set()
    if generation > s.generation:
        return sent  # no command of ours carries a generation the saga has not reached
    for attempt in range(1, step.attempt + 1):
        sent.add(derived_event_id(s.saga_id, generation, "ExecuteStep", step.step_id, attempt))
        for rnd in range(step.reconcile_round + 1):
            sent.add(
                derived_event_id(s.saga_id, generation, "ReconcileStep", step.step_id, attempt, rnd)
            )
    for attempt in range(1, step.compensation_attempt + 1):
        sent.add(derived_event_id(s.saga_id, generation, "CompensateStep", step.step_id, attempt))
    return sent


def _decide_new(
    record: Record, now: int, policy: CorePolicy, position: LedgerPosition | None
) -> Decision:
    if isinstance(record, SagaStarted):
        state = SagaState(
            started_by=record.envelope.producer if policy.bind_writers else "",
            saga_id=record.saga_id,
            tenant_id=record.envelope.tenant_id,
            generation=record.envelope.generation,
            workflow=record.workflow,
            workflow_version=record.workflow_version,
            policy_version=record.policy_version,
            sdk_version=record.sdk_version,
            principal=record.principal,
            continue_on_compensation_failure=record.continue_on_compensation_failure,
            started_at=record.envelope.occurred_at,
        )
        ctx = _Ctx(state, now, record.event_id, policy, position)
        ctx.remember(dedup_key(record, policy))
        _advance(ctx)
        return Decision(state, ctx.out, True)
    if _is_own(record):
        return Decision(None)  # e.g. the echo of a SagaTerminal after state was dropped
    if isinstance(record, COMMAND_TYPES):
        return Decision(None, [_not_an_event(record)])
    return Decision(
        None,
        [
            _rejection(
                record,
                RejectReason.UNKNOWN_SAGA,
                f"{record.envelope.type} for saga {record.saga_id}, which has no SagaStarted "
                "(or has ended and its state was dropped)",
            )
        ],
    )


def _not_an_event(record: Record) -> Output:
    return _rejection(
        record,
        RejectReason.NOT_AN_EVENT,
        f"{record.envelope.type} is a command; commands belong on sagaline.commands.*",
    )


# --------------------------------------------------------------- record handlers


def _apply(ctx: _Ctx, record: Record) -> None:
    match record:
        case SagaStarted():
            _on_saga_started(ctx, record)
        case StepScheduled():
            _on_step_scheduled(ctx, record)
        case ApprovalGranted():
            _on_approval_granted(ctx, record)
        case ApprovalDenied():
            _on_approval_denied(ctx, record)
        case StepIntentRecorded():
            _on_intent(ctx, record)
        case StepCommitted():
            _on_committed(ctx, record)
        case StepFailed():
            _on_failed(ctx, record)
        case StepOutcomeUnknown():
            _on_outcome_unknown(ctx, record)
        case StepReconciled():
            _on_reconciled(ctx, record)
        case SagaEndRequested():
            _on_end_requested(ctx, record)
        case CompensationAccepted():
            _on_compensation_accepted(ctx, record)
        case CompensationCommitted():
            _on_compensation_committed(ctx, record)
        case CompensationFailed():
            _on_compensation_failed(ctx, record)
        case IncidentRaised():
            _on_incident_raised(ctx, record)
        case IncidentResolved():
            _on_incident_resolved(ctx, record)
        case _ if isinstance(record, _COORDINATOR_ONLY):
            ctx.reject(
                record,
                RejectReason.INVALID_TRANSITION,
                f"only the coordinator writes {record.envelope.type}; this one came from "
                f"{record.envelope.producer!r}",
            )
        case _:
            ctx.reject(
                record,
                RejectReason.NOT_AN_EVENT,
                f"{record.envelope.type} is a command; commands belong on sagaline.commands.*",
            )


def _step(ctx: _Ctx, record: Record, step_id: str) -> StepState | None:
    step = ctx.s.steps.get(step_id)
    if step is None:
        ctx.reject(
            record,
            RejectReason.UNKNOWN_STEP,
            f"{record.envelope.type} names step {step_id!r}, which saga {ctx.s.saga_id} "
            "never scheduled",
        )
    return step


def _dispatched_step(ctx: _Ctx, record: Record, step_id: str) -> StepState | None:
    """The step a forward outcome names, or None (recorded as rejected) when the saga
    never scheduled it or never dispatched it."""
    step = _step(ctx, record, step_id)
    if step is not None and step.attempt == 0:
        ctx.reject(
            record,
            RejectReason.INVALID_TRANSITION,
            f"{record.envelope.type} for step {step.step_id}, which was never dispatched "
            f"(it is {step.status.value})",
        )
        return None
    return step


def _compensating_step(ctx: _Ctx, record: Record, step_id: str) -> StepState | None:
    """The step a compensation outcome names, or None (recorded as rejected) when its
    compensation was never requested."""
    step = _step(ctx, record, step_id)
    if step is not None and step.compensation_attempt == 0:
        ctx.reject(
            record,
            RejectReason.INVALID_TRANSITION,
            f"{record.envelope.type} for step {step.step_id}, whose compensation was never "
            f"requested (it is {step.status.value})",
        )
        return None
    return step


def _on_saga_started(ctx: _Ctx, r: SagaStarted) -> None:
    s = ctx.s
    if r.envelope.generation <= s.generation:
        ctx.reject(
            r,
            RejectReason.INVALID_TRANSITION,
            f"saga {s.saga_id} already started at generation {s.generation}",
        )
        return
    # A new run of the same saga supersedes the old one: its records are now stale,
    # so the in-flight commands are re-issued under the new generation (same keys).
    s.generation = r.envelope.generation
    for step in s.steps.values():
        if step.status in (StepStatus.DISPATCHED, StepStatus.INTENT_RECORDED):
            _execute_command(ctx, step)
        elif step.status is StepStatus.RECONCILING and TimerPurpose.RECONCILE_RETRY not in (
            step.timers
        ):
            _reconcile_command(ctx, step)
        elif step.status in (StepStatus.COMPENSATING, StepStatus.COMPENSATION_ACCEPTED):
            _compensate_command(ctx, step)
        elif step.approval is not None and _awaiting(step, step.approval.purpose):
            # The request of the old run is stale now, and so would be a grant of it:
            # ask again under this generation, with ids of its own (R7, R15).
            _request_approval(ctx, step, step.approval.purpose)
    _ask_again_to_settle(ctx)


def _ask_again_to_settle(ctx: _Ctx) -> None:
    """A new generation asks again each person who must still settle an unknown
    outcome (R11, R15).

    A resolution copies its incident's generation, so one of an incident raised by an
    earlier run is stale (and a retry of it a duplicate): the step would stay unknown
    for good. One new incident per unsettled step, under this generation and with an
    id of its own; the old one stays open and is resolved with it. Incidents of other
    kinds are not raised again: no step waits on their resolution, which only records
    what a person did.
    """
    s = ctx.s
    asked: dict[str, IncidentRecord] = {}
    for incident in s.open_incidents():
        step_id = incident.step_id
        if incident.kind not in _SETTLES_UNKNOWN or step_id is None or step_id in asked:
            continue
        step = s.steps.get(step_id)
        if step is not None and step.status in (StepStatus.UNKNOWN, StepStatus.RECONCILING):
            asked[step_id] = incident
    for step_id, incident in asked.items():
        _raise_incident(
            ctx,
            incident.kind,  # the same kind, so `incidents list` shows the old one superseded
            s.steps[step_id],
            f"{incident.inconsistency} (asked again for generation {s.generation}: "
            f"{incident.incident_id} belongs to an earlier run, whose records are stale)",
            incident.effect,
        )


def _fingerprint_problem(r: StepScheduled) -> str | None:
    """Why ``r.args_fingerprint`` is not the fingerprint of ``r.args``, or None. The
    agent writes it, and a grant binds to it (R7): the approver sees it, the receipt
    logs it. A fingerprint an older client wrote, which covered sealed values' bytes
    (nonce and all) instead of their markers, is still the arguments'."""
    try:
        computed = args_fingerprint(r.args)
        if computed == r.args_fingerprint:
            return None
        if fingerprint(canonical_json(orjson.loads(r.args))) == r.args_fingerprint:
            return None  # written before sealed values counted as their markers
    except orjson.JSONDecodeError as exc:
        return f"args of step {r.step_id} are not JSON: {exc}"
    return (
        f"step {r.step_id}: arguments fingerprint {r.args_fingerprint} is not that of its "
        f"arguments ({computed}); a grant binds to the fingerprint, so a step "
        "fingerprinted as other arguments is refused"
    )


def _on_step_scheduled(ctx: _Ctx, r: StepScheduled) -> None:
    s = ctx.s
    problem = step_id_problem(r.step_id)
    if problem is not None:
        ctx.reject(r, RejectReason.INVALID_STEP_ID, problem)
        return
    problem = _fingerprint_problem(r)
    if problem is not None:
        ctx.reject(r, RejectReason.INVALID_ARGUMENTS, problem)
        return
    existing = s.steps.get(r.step_id)
    if existing is not None:
        if (
            existing.args_fingerprint != r.args_fingerprint
            or existing.contract.tool != r.contract.tool
        ):
            ctx.reject(
                r,
                RejectReason.DUPLICATE_STEP,
                f"step {r.step_id} is already scheduled with tool {existing.contract.tool} and "
                f"arguments {existing.args_fingerprint}; a step id is used once per saga",
            )
        elif _dependencies(r.depends_on) != _dependencies(
            existing.depends_on if existing.explicit else None
        ):
            ctx.reject(
                r,
                RejectReason.DUPLICATE_STEP,
                f"step {r.step_id} is already scheduled and depends on "
                f"{_dependency_words(existing)}, not {_dependency_words(r.depends_on)}; "
                "a step id is used once per saga",
            )
        return  # the same step scheduled again: idempotent
    if s.end_requested is not None:
        ctx.reject(
            r,
            RejectReason.INVALID_TRANSITION,
            f"step {r.step_id} scheduled after the agent asked to {s.end_requested.value}",
        )
        return
    limit = ctx.policy.max_steps
    if limit is not None and len(s.steps) >= limit:
        ctx.reject(
            r,
            RejectReason.TOO_MANY_STEPS,
            f"step {r.step_id} would be step {len(s.steps) + 1} of saga {s.saga_id}, but at "
            f"most {limit} steps per saga are allowed (SAGALINE_MAX_STEPS of the "
            "coordinator); it is not scheduled. Split the work into several sagas",
        )
        return
    explicit = r.depends_on is not None
    if r.depends_on is not None:
        missing = [d for d in r.depends_on if d not in s.steps]
        if missing:
            ctx.reject(
                r,
                RejectReason.INVALID_DEPENDENCY,
                f"step {r.step_id} depends on {missing}, which are not scheduled in saga "
                f"{s.saga_id}; schedule dependencies first",
            )
            return
        depends_on = list(dict.fromkeys(r.depends_on))
    else:
        depends_on = [next(reversed(s.steps))] if s.steps else []
    try:
        key = idempotency_key(s.saga_id, r.step_id, r.contract.tool, r.args)
    except orjson.JSONDecodeError as exc:
        ctx.reject(
            r, RejectReason.INVALID_ARGUMENTS, f"args of step {r.step_id} are not JSON: {exc}"
        )
        return
    args, args_ref = ctx.payload(r.args)
    step = StepState(
        step_id=r.step_id,
        index=len(s.steps),
        contract=r.contract,
        args=args,
        args_ref=args_ref,
        args_fingerprint=r.args_fingerprint,
        depends_on=depends_on,
        explicit=explicit,
        scheduled_at=r.envelope.occurred_at,
        idempotency_key=key,
    )
    if s.status is SagaStatus.COMPENSATING:
        step.status = StepStatus.CANCELLED
        step.note = "scheduled after the saga began compensating; never dispatched"
    s.steps[r.step_id] = step


def _dependencies(depends_on: list[str] | None) -> frozenset[str] | None:
    """What a ``StepScheduled.depends_on`` asks for: None for the implicit chain, else
    the set of steps (order and repeats do not change it)."""
    return None if depends_on is None else frozenset(depends_on)


def _dependency_words(dependencies: StepState | list[str] | None) -> str:
    if isinstance(dependencies, StepState):
        if not dependencies.explicit:
            return f"{dependencies.depends_on} (the step scheduled before it)"
        dependencies = dependencies.depends_on
    return "the step scheduled before it" if dependencies is None else str(dependencies)


def _awaiting(step: StepState, purpose: ApprovalPurpose) -> PendingApproval | None:
    wanted = (
        StepStatus.AWAITING_APPROVAL
        if purpose is ApprovalPurpose.FORWARD
        else StepStatus.AWAITING_COMPENSATION_APPROVAL
    )
    if step.status is wanted and step.approval is not None:
        return step.approval
    return None


def _log_approval(
    ctx: _Ctx,
    step: StepState,
    purpose: ApprovalPurpose,
    decision: str,
    by: str,
    fp: str,
    principal: str | None = None,
) -> None:
    """One line of the receipt's approvals: a grant is logged with the principal and
    fingerprint it named (a refused one shows why it did not count)."""
    ctx.s.approvals.append(
        ApprovalRecord(
            step_id=step.step_id,
            purpose=purpose.value,
            decision=decision,
            by=by,
            principal=ctx.s.principal if principal is None else principal,
            args_fingerprint=fp,
            at=ctx.now,
        )
    )


def grant_mismatches(
    r: ApprovalGranted,
    *,
    approval_id: str,
    principal: str,
    args_fingerprint: str,
    scope: str,
    expires_at: int,
) -> list[str]:
    """Why ``r`` does not release the request it answers (empty: it does), R7: bound
    to the request's approval id, the saga's principal, the step's argument
    fingerprint and scope, and made by the earlier of the two expiries. The dashboard
    shows these same reasons for a grant it lists as not counted."""
    at = r.envelope.occurred_at
    problems = []
    if r.approval_id != approval_id:
        problems.append(f"approval id {r.approval_id} is not the one requested ({approval_id})")
    if r.principal != principal:
        problems.append(f"principal {r.principal!r} is not the saga's ({principal!r})")
    if r.args_fingerprint != args_fingerprint:
        problems.append(
            f"arguments {r.args_fingerprint} differ from the step's ({args_fingerprint})"
        )
    if r.scope != scope:
        problems.append(f"scope {r.scope!r} is not {scope!r}")
    if at > r.expires_at or at > expires_at:
        problems.append(f"granted at {at}, after expiry {min(r.expires_at, expires_at)}")
    return problems


def _on_approval_granted(ctx: _Ctx, r: ApprovalGranted) -> None:
    s = ctx.s
    step = _step(ctx, r, r.step_id)
    if step is None:
        return
    pending = _awaiting(step, r.purpose)
    if pending is None:
        ctx.reject(
            r,
            RejectReason.INVALID_TRANSITION,
            f"step {step.step_id} is not awaiting a {r.purpose.value} approval "
            f"(it is {step.status.value})",
        )
        return
    # R7: bound to principal, saga (by key), step, fingerprint, scope and expiry.
    at = r.envelope.occurred_at
    problems = grant_mismatches(
        r,
        approval_id=pending.approval_id,
        principal=s.principal,
        args_fingerprint=pending.args_fingerprint,
        scope=pending.scope,
        expires_at=pending.expires_at,
    )
    expired = at > r.expires_at or at > pending.expires_at
    if problems:
        decision = "EXPIRED" if expired and len(problems) == 1 else "REJECTED_MISMATCH"
        by = cut_operator_text(r.granted_by)
        _log_approval(ctx, step, r.purpose, decision, by, r.args_fingerprint, r.principal)
        ctx.reject(r, RejectReason.APPROVAL_MISMATCH, "; ".join(problems))
        return
    by = cut_operator_text(r.granted_by)
    _log_approval(ctx, step, r.purpose, "GRANTED", by, r.args_fingerprint)
    step.approval = None
    step.timers.pop(TimerPurpose.APPROVAL_EXPIRY, None)
    if r.purpose is ApprovalPurpose.FORWARD:
        step.approval_id = r.approval_id
        if _forward_allowed(s):
            _dispatch(ctx, step, 1)
        else:
            _cancel(ctx, step, "approved after the saga stopped going forward; never dispatched")
    else:
        _send_compensation(ctx, step, 1)


def _on_approval_denied(ctx: _Ctx, r: ApprovalDenied) -> None:
    step = _step(ctx, r, r.step_id)
    if step is None:
        return
    pending = _awaiting(step, r.purpose)
    if pending is None or pending.approval_id != r.approval_id:
        ctx.reject(
            r,
            RejectReason.APPROVAL_MISMATCH,
            f"denial {r.approval_id} does not match a pending {r.purpose.value} approval of "
            f"step {step.step_id} (it is {step.status.value})",
        )
        return
    # An operator's text is copied (several times) into the state: kept cut (R5).
    by = cut_operator_text(r.denied_by)
    _log_approval(ctx, step, r.purpose, "DENIED", by, pending.args_fingerprint)
    step.approval = None
    step.timers.pop(TimerPurpose.APPROVAL_EXPIRY, None)
    why = f"approval denied by {by}: {cut_operator_text(r.reason)}"
    if r.purpose is ApprovalPurpose.FORWARD:
        step.observation = "DENIED"
        step.last_error = why
        _forward_failed_finally(ctx, step, why)  # a denial is a business rejection (R7, R9)
    else:
        _compensation_failed_finally(ctx, step, "compensation-denied", why)


def _on_intent(ctx: _Ctx, r: StepIntentRecorded) -> None:
    step = _dispatched_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.intent_at is None:
        step.intent_at = r.envelope.occurred_at
    if step.status is StepStatus.DISPATCHED and r.attempt == step.attempt:
        step.status = StepStatus.INTENT_RECORDED
        step.observation = "INTENT_RECORDED"


_COMMITTABLE = frozenset(
    {
        StepStatus.DISPATCHED,
        StepStatus.INTENT_RECORDED,
        StepStatus.RETRY_WAIT,
        StepStatus.RECONCILING,
        StepStatus.UNKNOWN,
        StepStatus.FAILED,
        StepStatus.CANCELLED,
    }
)


def _on_committed(ctx: _Ctx, r: StepCommitted) -> None:
    step = _dispatched_step(ctx, r, r.step_id)
    if step is None:
        return
    late_after_escalation = step.status is StepStatus.ESCALATED and step.committed_at is None
    if step.status in _COMMITTABLE or late_after_escalation:
        # The ledger is the truth: a commit we did not expect still happened.
        _commit(
            ctx,
            step,
            r.envelope.occurred_at,
            r.provider_operation_id,
            r.result,
            r.response_fingerprint,
            "COMMITTED",
        )
        if late_after_escalation:
            _obligation_met(ctx, step)


def _obligation_met(ctx: _Ctx, step: StepState) -> None:
    """A step escalated after the pivot committed after all (R6, R14): its incident
    said the effect is still owed, so it is settled by the ledger, as an unknown
    outcome's is; left open, the saga ended ESCALATED on a claim the ledger refutes."""
    step.note = f"committed after it was escalated ({step.note})"
    for incident in ctx.s.open_incidents():
        if incident.kind == _FORWARD_FAILED_AFTER_PIVOT and incident.step_id == step.step_id:
            _mark_resolved(ctx, incident.incident_id, "COMMITTED (observed in the ledger)")
    if not _forward_allowed(ctx.s):
        return
    # The work not run because a dependency had not completed was carried by that
    # dependency's incident, now settled: it is owed again and goes forward (R6).
    # ``_dispatch_ready`` cancels again what another escalated step still blocks.
    for other in ctx.s.steps.values():
        if other.status is StepStatus.CANCELLED and other.attempt == 0:
            other.status = StepStatus.SCHEDULED
            other.note = ""


def _on_failed(ctx: _Ctx, r: StepFailed) -> None:
    step = _dispatched_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.status in (StepStatus.DISPATCHED, StepStatus.INTENT_RECORDED) and (
        r.attempt == step.attempt
    ):
        step.observation = "FAILED"
        step.last_error = f"{r.kind.value}: {r.error_type}: {r.message}"
        _after_attempt_failed(ctx, step, r.kind, step.last_error)
    # otherwise a superseded attempt: the current one decides


def _on_outcome_unknown(ctx: _Ctx, r: StepOutcomeUnknown) -> None:
    step = _dispatched_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.status not in (StepStatus.DISPATCHED, StepStatus.INTENT_RECORDED) or (
        r.attempt != step.attempt
    ):
        return
    step.observation = "UNKNOWN"
    step.last_error = r.reason
    if step.contract.has_lookup:
        step.status = StepStatus.RECONCILING
        step.reconcile_round = 1
        _reconcile_command(ctx, step)
    else:
        _ask_person_to_settle(ctx, step, r.reason)


def _on_reconciled(ctx: _Ctx, r: StepReconciled) -> None:
    step = _dispatched_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.status not in (StepStatus.RECONCILING, StepStatus.UNKNOWN):
        return  # already settled
    if r.outcome is not ReconcileResult.COMMITTED and r.attempt != step.attempt:
        # A lookup made before the current attempt ran says nothing about it (R11);
        # a commit found for any attempt is the effect (one key runs them all).
        return
    if r.outcome is ReconcileResult.COMMITTED:
        _commit(
            ctx,
            step,
            r.envelope.occurred_at,
            r.provider_operation_id,
            r.result if r.result is not None else b"null",
            r.response_fingerprint or "",
            "RECONCILED_COMMITTED",
        )
    elif r.outcome is ReconcileResult.NOT_FOUND:
        step.timers.pop(TimerPurpose.RECONCILE_RETRY, None)
        step.observation = "RECONCILED_NOT_FOUND"
        _resolve_unknown_incidents(ctx, step, "NOT_FOUND (reconciled by lookup)")
        _after_attempt_failed(ctx, step, FailureKind.TRANSIENT, "not found by reconciliation")
    elif step.status is StepStatus.RECONCILING and TimerPurpose.RECONCILE_RETRY not in step.timers:
        if step.reconcile_round < ctx.policy.reconcile_rounds:
            delay = retry_delay_ms(
                ctx.policy.reconcile_backoff,
                step.reconcile_round,
                ctx.s.saga_id,
                step.step_id,
                "reconcile",
                step.attempt,
                step.reconcile_round,
            )
            step.timers[TimerPurpose.RECONCILE_RETRY] = ctx.now + delay
        else:
            _ask_person_to_settle(ctx, step, f"still PENDING after {step.reconcile_round} lookups")


def _on_end_requested(ctx: _Ctx, r: SagaEndRequested) -> None:
    s = ctx.s
    if s.end_requested is not None:
        if s.end_requested is not r.outcome:
            ctx.reject(
                r,
                RejectReason.INVALID_TRANSITION,
                f"the agent already asked to {s.end_requested.value}; {r.outcome.value} ignored",
            )
        return
    s.end_requested = r.outcome
    # Often an exception's text, copied twice into the state: kept cut, as an
    # operator's text is, so a long one cannot get the saga parked (R5: deterministic).
    reason = cut_operator_text(r.reason)
    s.end_reason = reason or r.outcome.value
    if r.outcome is SagaOutcome.ABORT and not s.compensation_reason:
        s.compensation_reason = f"aborted by the agent: {reason or 'no reason given'}"


def _on_compensation_accepted(ctx: _Ctx, r: CompensationAccepted) -> None:
    step = _compensating_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.status is StepStatus.COMPENSATING and r.attempt == step.compensation_attempt:
        step.status = StepStatus.COMPENSATION_ACCEPTED  # not done until committed (R12)
        step.compensation_provider_operation_id = r.provider_operation_id
        # The declared wait counts from the acceptance as the ledger records it, in
        # coordinator state: no participant restart resets it, and a participant that
        # stays down still ends in an incident when it fires. Never from later than
        # now: the acceptance happened by the time it is decided, so a participant's
        # clock running ahead cannot extend the wait.
        wait = step.contract.completion_within_ms or 0
        accepted_at = min(r.envelope.occurred_at, ctx.now)
        step.timers[TimerPurpose.COMPLETION_DEADLINE] = accepted_at + wait


def _on_compensation_committed(ctx: _Ctx, r: CompensationCommitted) -> None:
    step = _compensating_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.status not in (
        StepStatus.COMPENSATING,
        StepStatus.COMPENSATION_ACCEPTED,
        StepStatus.COMPENSATION_RETRY_WAIT,
    ):
        return
    if r.provider_operation_id is not None:
        step.compensation_provider_operation_id = r.provider_operation_id
    # R12: a declared verification must pass; verified=False is a failure.
    if r.verified is False or (step.contract.has_verify and r.verified is None):
        step.verification = "FAILED"
        _compensation_failed_finally(
            ctx,
            step,
            "compensation-not-verified",
            f"compensation {step.contract.compensation} ran but its verification "
            + ("failed" if r.verified is False else "was not reported"),
            raise_incident=not step.window_expired,
        )
        return
    step.verification = "PASSED" if r.verified else "NOT_DECLARED"
    step.status = StepStatus.COMPENSATED
    for purpose in (
        TimerPurpose.COMPENSATION_RETRY,
        TimerPurpose.REVERSAL_WINDOW,
        TimerPurpose.COMPLETION_DEADLINE,
    ):
        step.timers.pop(purpose, None)
    if step.window_expired:
        _undone_after_window(ctx, step)


def _undone_after_window(ctx: _Ctx, step: StepState) -> None:
    """R13, R14: the compensation in flight when the window passed committed after all
    (and verified, where declared: R12). Its incident said the effect may remain; the
    ledger says it is undone, so the ledger settles it, as ``_obligation_met`` does for
    a forward step. Left open, the saga ended ESCALATED on a claim the ledger refutes."""
    how = "and verified " if step.verification == "PASSED" else ""
    step.note = f"compensated {how}after its reversal window expired"
    for incident in ctx.s.open_incidents():
        if incident.kind == _WINDOW_EXPIRED and incident.step_id == step.step_id:
            _mark_resolved(ctx, incident.incident_id, f"COMPENSATED {how}(observed in the ledger)")


def _on_compensation_failed(ctx: _Ctx, r: CompensationFailed) -> None:
    step = _compensating_step(ctx, r, r.step_id)
    if step is None:
        return
    if step.status not in (StepStatus.COMPENSATING, StepStatus.COMPENSATION_ACCEPTED) or (
        r.attempt != step.compensation_attempt
    ):
        return
    step.last_error = f"{r.kind.value}: {r.error_type}: {r.message}"
    policy = step.contract.compensation_retry
    if (
        r.kind is FailureKind.TRANSIENT
        and step.compensation_attempt < policy.max_attempts
        and not step.window_expired
    ):
        due = ctx.now + retry_delay_ms(
            policy,
            step.compensation_attempt,
            ctx.s.saga_id,
            step.step_id,
            "compensation",
            step.compensation_attempt,
        )
        step.status = StepStatus.COMPENSATION_RETRY_WAIT
        step.timers[TimerPurpose.COMPENSATION_RETRY] = due
        _retry_scheduled(
            ctx, step, ApprovalPurpose.COMPENSATION, step.compensation_attempt + 1, due
        )
        return
    attempts = step.compensation_attempt
    _compensation_failed_finally(
        ctx,
        step,
        "compensation-failed",
        f"compensation {step.contract.compensation} failed after {attempts} "
        f"attempt{'s' if attempts != 1 else ''}: {step.last_error}",
        raise_incident=not step.window_expired,
    )


def _on_incident_raised(ctx: _Ctx, r: IncidentRaised) -> None:
    s = ctx.s
    held = s.incident(r.incident_id)
    if held is not None:
        if (held.kind, held.step_id) != (r.kind, r.step_id):
            # An id names one incident: a person resolves it by its id, and the first
            # resolution counts. Another incident under a taken id is refused where
            # people see it (DLQ, `saga show`), not dropped unseen (R8, R16).
            ctx.reject(
                r,
                RejectReason.INVALID_TRANSITION,
                f"incident id {r.incident_id} already names another incident of saga "
                f"{s.saga_id} ({_incident_label(held.kind, held.step_id)}); this "
                f"{_incident_label(r.kind, r.step_id)} from {r.envelope.producer!r} needs "
                "an id of its own",
            )
        return  # else a copy of the incident the saga holds
    s.keep_incident_generation(r.incident_id, r.envelope.generation)
    s.incidents.append(
        IncidentRecord(
            incident_id=r.incident_id,
            kind=r.kind,
            step_id=r.step_id,
            inconsistency=r.inconsistency,
            resources=list(r.resources),
            effect=r.effect,
            owner=r.owner,
        )
    )
    step = s.steps.get(r.step_id) if r.step_id is not None else None
    if step is None:
        return
    if r.kind == _UNKNOWN_OUTCOME_NO_LOOKUP and step.status is StepStatus.RECONCILING:
        # The participant cannot look the outcome up: a person is asked instead (R11),
        # and nothing else is: no lookup on a new generation, no second incident.
        step.status = StepStatus.UNKNOWN
        step.timers.pop(TimerPurpose.RECONCILE_RETRY, None)
        step.incident_id = r.incident_id
    elif step.incident_id is None and r.kind in _SETTLES_UNKNOWN:
        step.incident_id = r.incident_id


def _on_incident_resolved(ctx: _Ctx, r: IncidentResolved) -> None:
    s = ctx.s
    # The resolution and name go into the state and receipt: kept cut (R5).
    by, text = cut_operator_text(r.resolved_by), cut_operator_text(r.resolution)
    incident = s.incident(r.incident_id)
    if incident is None:
        ctx.reject(
            r,
            RejectReason.INVALID_TRANSITION,
            f"no incident {r.incident_id} in saga {s.saga_id}",
        )
        return
    if incident.resolved:
        # Another person (or the ledger) settled it first: refused where people see it,
        # not dropped unseen, so the later operator learns their answer did not count.
        ctx.reject(
            r,
            RejectReason.INVALID_TRANSITION,
            f"incident {r.incident_id} is already resolved ({incident.resolution}); the "
            f"resolution by {by} ({text}) does not count",
        )
        return
    step = s.steps.get(incident.step_id) if incident.step_id is not None else None
    unsettled = step is not None and step.status in (StepStatus.UNKNOWN, StepStatus.RECONCILING)
    if incident.kind not in _SETTLES_UNKNOWN or step is None or not unsettled:
        # The shell copies this resolution to the incident feed itself.
        _mark_resolved(ctx, incident.incident_id, f"{text} (by {by})", announce=False)
        return
    answer = unknown_outcome_answer(r.resolution)
    if answer is ReconcileResult.COMMITTED:
        # Every incident asking about this step is settled by this person (an earlier
        # run's too), before the commit would mark them "observed in the ledger".
        _resolve_unknown_incidents(ctx, step, f"COMMITTED (by {by})", answered=r.incident_id)
        # The operator may know what the provider did: the compensation then gets it.
        _commit(
            ctx,
            step,
            r.envelope.occurred_at,
            r.provider_operation_id,
            r.result if r.result is not None else b"null",
            "",
            "RESOLVED_COMMITTED",
            referable=False,
        )
    elif answer is ReconcileResult.NOT_FOUND:
        step.timers.pop(TimerPurpose.RECONCILE_RETRY, None)
        step.observation = "RESOLVED_NOT_FOUND"
        _resolve_unknown_incidents(ctx, step, f"NOT_FOUND (by {by})", answered=r.incident_id)
        _after_attempt_failed(ctx, step, FailureKind.TRANSIENT, f"not found (settled by {by})")
    else:
        ctx.reject(
            r,
            RejectReason.INVALID_TRANSITION,
            unknown_outcome_refusal(incident.incident_id, r.resolution),
        )


# --------------------------------------------------------------- transitions


def _forward_allowed(s: SagaState) -> bool:
    """New forward work may start: running, and not an abort waiting on a pivot."""
    if s.status is not SagaStatus.RUNNING:
        return False
    return not (s.end_requested is SagaOutcome.ABORT and s.pivot_committed is None)


def _cancel(ctx: _Ctx, step: StepState, note: str) -> None:
    step.status = StepStatus.CANCELLED
    _withdraw_approval(ctx, step, note)
    step.note = note
    for purpose in (TimerPurpose.FORWARD_RETRY, TimerPurpose.APPROVAL_EXPIRY):
        step.timers.pop(purpose, None)


def _withdraw_approval(ctx: _Ctx, step: StepState, why: str) -> None:
    """The step no longer waits for the approval it asked for (the saga turned around,
    the reversal window passed): say so on the ledger, or the request stays open there
    and every operator surface that reads it (the dashboard) offers a grant the core
    refuses. The record is an ``ApprovalDenied`` written by the coordinator itself
    (``denied_by`` is ``COORDINATOR_PRODUCER``); the core ignores its echo, like every
    record of its own, and the receipt lists the request as ``WITHDRAWN``."""
    pending = step.approval
    if pending is None:
        return
    step.approval = None
    step.timers.pop(TimerPurpose.APPROVAL_EXPIRY, None)
    _log_approval(ctx, step, pending.purpose, "WITHDRAWN", "-", pending.args_fingerprint)
    ctx.emit(
        ApprovalDenied(
            envelope=ctx.envelope(
                ApprovalDenied, ctx.event_id("ApprovalWithdrawn", pending.approval_id)
            ),
            step_id=step.step_id,
            approval_id=pending.approval_id,
            purpose=pending.purpose,
            denied_by=COORDINATOR_PRODUCER,
            reason=f"withdrawn by the coordinator: {why}",
        )
    )


def _commit(
    ctx: _Ctx,
    step: StepState,
    at: int,
    provider_operation_id: str | None,
    result: bytes,
    response_fingerprint: str,
    observation: str,
    *,
    referable: bool = True,
) -> None:
    """The step took effect. ``referable=False`` keeps the result inline whatever its
    size: a participant reads a result back only from a ``StepCommitted`` or
    ``StepReconciled``, so a reference to any other record (a person's
    ``IncidentResolved``) would make the step impossible to compensate."""
    s = ctx.s
    step.status = StepStatus.COMMITTED
    step.committed_at = at
    step.provider_operation_id = provider_operation_id
    step.result, step.result_ref = ctx.payload(result) if referable else (result, None)
    step.response_fingerprint = response_fingerprint
    step.observation = observation
    for purpose in (TimerPurpose.FORWARD_RETRY, TimerPurpose.RECONCILE_RETRY):
        step.timers.pop(purpose, None)
    if step.contract.reversal_window_ms is not None:
        # From the commit as the ledger records it, never from later than now: the
        # effect exists by the time it is decided, so a participant's clock running
        # ahead cannot extend the window past what the tool declared (R13).
        step.reversal_deadline = min(at, ctx.now) + step.contract.reversal_window_ms
    _resolve_unknown_incidents(ctx, step, "COMMITTED (observed in the ledger)")
    if step.contract.pivot and s.pivot_committed is None and s.status is SagaStatus.RUNNING:
        s.pivot_committed = step.step_id  # R6: from here on the saga only goes forward


def _after_attempt_failed(ctx: _Ctx, step: StepState, kind: FailureKind, why: str) -> None:
    """A forward attempt did not take effect: retry (same key) or give up (R8, R9)."""
    policy = step.contract.retry
    if (
        kind is FailureKind.TRANSIENT
        and step.attempt < policy.max_attempts
        and _forward_allowed(ctx.s)
    ):
        due = ctx.now + retry_delay_ms(
            policy, step.attempt, ctx.s.saga_id, step.step_id, "forward", step.attempt
        )
        step.status = StepStatus.RETRY_WAIT
        step.timers[TimerPurpose.FORWARD_RETRY] = due
        _retry_scheduled(ctx, step, ApprovalPurpose.FORWARD, step.attempt + 1, due)
        return
    if kind is FailureKind.TRANSIENT and step.attempt >= policy.max_attempts:
        why = f"{why} (after {step.attempt} attempts)"
    _forward_failed_finally(ctx, step, why)


def _forward_failed_finally(ctx: _Ctx, step: StepState, why: str) -> None:
    s = ctx.s
    for purpose in (TimerPurpose.FORWARD_RETRY, TimerPurpose.APPROVAL_EXPIRY):
        step.timers.pop(purpose, None)
    step.note = why
    if s.pivot_committed is not None and s.status is SagaStatus.RUNNING:
        # R6: past the pivot we never compensate; a failed obligation goes to a person.
        step.status = StepStatus.ESCALATED
        _raise_incident(
            ctx,
            _FORWARD_FAILED_AFTER_PIVOT,
            step,
            f"{step.contract.tool} (step {step.step_id}) could not complete after the pivot "
            f"{s.pivot_committed} committed: {why}",
            f"the pivot's effect stands and {step.contract.tool} is still owed; it did not "
            "take effect",
        )
        return
    step.status = StepStatus.FAILED
    if s.status is SagaStatus.RUNNING and not s.compensation_reason:
        s.compensation_reason = f"step {step.step_id} failed: {why}"


def _ask_person_to_settle(ctx: _Ctx, step: StepState, why: str) -> None:
    """R11 with no lookup (or lookups exhausted): a person says COMMITTED or NOT_FOUND."""
    step.status = StepStatus.UNKNOWN
    step.timers.pop(TimerPurpose.RECONCILE_RETRY, None)
    for incident in ctx.s.open_incidents():
        if incident.kind in _SETTLES_UNKNOWN and incident.step_id == step.step_id:
            step.incident_id = incident.incident_id  # the participant already asked
            return
    _raise_incident(
        ctx,
        _UNKNOWN_OUTCOME,
        step,
        f"{step.contract.tool} (step {step.step_id}, attempt {step.attempt}) may or may not "
        f"have taken effect: {why}. Resolve with COMMITTED or NOT_FOUND",
        f"unknown: look up the operation with idempotency key hash "
        f"{key_hash(step.idempotency_key)}",
    )


def _resolve_unknown_incidents(
    ctx: _Ctx, step: StepState, resolution: str, *, answered: str | None = None
) -> None:
    """Settle every open unknown-outcome incident of ``step``; ``answered`` is the one a
    person's resolution named (the shell copies that resolution to the feed)."""
    for incident in ctx.s.open_incidents():
        if incident.kind in _SETTLES_UNKNOWN and incident.step_id == step.step_id:
            announce = incident.incident_id != answered
            _mark_resolved(ctx, incident.incident_id, resolution, announce=announce)


def _incident_label(kind: str, step_id: str | None) -> str:
    return f"{kind} incident" + (f" of step {step_id}" if step_id is not None else "")


def _mark_resolved(ctx: _Ctx, incident_id: str, resolution: str, *, announce: bool = True) -> None:
    """Mark the incident resolved. Unless a person's resolution of it is what the shell
    copies to the incident feed (``announce=False``), say so there too: an
    ``IncidentResolved`` by the coordinator, on ``sagaline.incidents`` only (the ledger
    already holds what settled it), or `sagaline incidents list` and the dashboard
    would go on showing an incident that needs no one."""
    incidents = ctx.s.incidents
    for i, incident in enumerate(incidents):
        if incident.incident_id == incident_id:
            incidents[i] = incident.model_copy(update={"resolved": True, "resolution": resolution})
            if announce:
                settled = IncidentResolved(
                    envelope=ctx.envelope(
                        IncidentResolved, ctx.event_id("IncidentResolved", incident_id, "settled")
                    ),
                    incident_id=incident_id,
                    resolved_by=COORDINATOR_PRODUCER,
                    resolution=resolution,
                )
                ctx.out.append(Output(Destination.INCIDENT_FEED, settled))


def _raise_incident(
    ctx: _Ctx, kind: str, step: StepState | None, inconsistency: str, effect: str
) -> str:
    s = ctx.s
    step_id = step.step_id if step is not None else None
    incident_id = "inc-" + ctx.event_id("incident", kind, step_id or "-", len(s.incidents))
    taken = 0
    while s.incident(incident_id) is not None:
        # A participant chose its incident's id (anyone can derive ours): never share
        # it, or one resolution would settle two incidents (R8, R14).
        taken += 1
        incident_id = "inc-" + ctx.event_id(
            "incident", kind, step_id or "-", len(s.incidents), "taken", taken
        )
    resources = list(step.contract.resources) if step is not None else []
    owner = step.contract.owner if step is not None else "operations"
    s.keep_incident_generation(incident_id, s.generation)
    s.incidents.append(
        IncidentRecord(
            incident_id=incident_id,
            kind=kind,
            step_id=step_id,
            inconsistency=inconsistency,
            resources=resources,
            effect=effect,
            owner=owner,
        )
    )
    if step is not None:
        step.incident_id = incident_id
    ctx.emit(
        IncidentRaised(
            envelope=ctx.envelope(IncidentRaised, ctx.event_id("IncidentRaised", incident_id)),
            incident_id=incident_id,
            kind=kind,
            step_id=step_id,
            tool=step.contract.tool if step is not None else None,
            inconsistency=inconsistency,
            resources=resources,
            effect=effect,
            owner=owner,
        ),
        Destination.INCIDENT,
    )
    return incident_id


def _effect(step: StepState) -> str:
    op = step.provider_operation_id or "unknown"
    return f"{step.contract.tool} effect remains in the world (provider operation {op})"


def _compensation_failed_finally(
    ctx: _Ctx, step: StepState, kind: str, why: str, *, raise_incident: bool = True
) -> None:
    """R3/R8: the compensation gave up; a person owns the remaining effect."""
    step.status = StepStatus.COMPENSATION_FAILED
    _withdraw_approval(ctx, step, why)
    step.note = why
    for purpose in (
        TimerPurpose.COMPENSATION_RETRY,
        TimerPurpose.REVERSAL_WINDOW,
        TimerPurpose.APPROVAL_EXPIRY,
        TimerPurpose.COMPLETION_DEADLINE,
    ):
        step.timers.pop(purpose, None)
    if raise_incident:
        _raise_incident(
            ctx,
            kind,
            step,
            f"{step.contract.tool} (step {step.step_id}) was not undone: {why}",
            _effect(step),
        )


def _retry_scheduled(
    ctx: _Ctx, step: StepState, purpose: ApprovalPurpose, attempt: int, due: int
) -> None:
    event_id = ctx.event_id(
        ctx.s.generation, "StepRetryScheduled", step.step_id, purpose.value, attempt
    )
    ctx.emit(
        StepRetryScheduled(
            envelope=ctx.envelope(StepRetryScheduled, event_id),
            step_id=step.step_id,
            purpose=purpose,
            attempt=attempt,
            due_at=due,
        )
    )


# ----------------------------------------------------------------- commands


def _execute_command(ctx: _Ctx, step: StepState) -> None:
    s = ctx.s
    event_id = ctx.event_id(s.generation, "ExecuteStep", step.step_id, step.attempt)
    ctx.command(
        ExecuteStep(
            envelope=ctx.envelope(ExecuteStep, event_id),
            step_id=step.step_id,
            tool=step.contract.tool,
            args=step.args,
            idempotency_key=step.idempotency_key,
            attempt=step.attempt,
            deadline_ms=step.contract.deadline_ms,
            principal=s.principal,
            approval_id=step.approval_id,
            args_ref=step.args_ref,
        ),
        step.contract.participant,
    )


def _dispatch(ctx: _Ctx, step: StepState, attempt: int) -> None:
    step.attempt = attempt
    step.status = StepStatus.DISPATCHED
    step.observation = "DISPATCHED"
    step.timers.pop(TimerPurpose.FORWARD_RETRY, None)
    _execute_command(ctx, step)


def _reconcile_command(ctx: _Ctx, step: StepState) -> None:
    event_id = ctx.event_id(
        ctx.s.generation, "ReconcileStep", step.step_id, step.attempt, step.reconcile_round
    )
    ctx.command(
        ReconcileStep(
            envelope=ctx.envelope(ReconcileStep, event_id),
            step_id=step.step_id,
            tool=step.contract.tool,
            idempotency_key=step.idempotency_key,
            attempt=step.attempt,
        ),
        step.contract.participant,
    )


def _compensate_command(ctx: _Ctx, step: StepState) -> None:
    attempt = step.compensation_attempt
    event_id = ctx.event_id(ctx.s.generation, "CompensateStep", step.step_id, attempt)
    ctx.command(
        CompensateStep(
            envelope=ctx.envelope(CompensateStep, event_id),
            step_id=step.step_id,
            tool=step.contract.tool,
            compensation=step.contract.compensation or "",
            args=step.args,
            result=step.result if step.result is not None else b"null",
            idempotency_key=step.idempotency_key,
            compensation_key=compensation_key(step.idempotency_key),
            attempt=attempt,
            provider_operation_id=step.provider_operation_id,
            args_ref=step.args_ref,
            result_ref=step.result_ref,
        ),
        step.contract.participant,
    )


def _send_compensation(ctx: _Ctx, step: StepState, attempt: int) -> None:
    step.compensation_attempt = attempt
    step.status = StepStatus.COMPENSATING
    step.timers.pop(TimerPurpose.COMPENSATION_RETRY, None)
    event_id = ctx.event_id(ctx.s.generation, "CompensationRequested", step.step_id, attempt)
    ctx.emit(
        CompensationRequested(
            envelope=ctx.envelope(CompensationRequested, event_id),
            step_id=step.step_id,
            tool=step.contract.tool,
            compensation=step.contract.compensation or "",
            compensation_key=compensation_key(step.idempotency_key),
            attempt=attempt,
        )
    )
    _compensate_command(ctx, step)


def _request_approval(ctx: _Ctx, step: StepState, purpose: ApprovalPurpose) -> None:
    s = ctx.s
    contract = step.contract
    action = "execute" if purpose is ApprovalPurpose.FORWARD else (contract.compensation or "")
    scope = f"{contract.participant}/{contract.tool}:{action}"
    # One id per generation: a request asked again by a new run (and its grant) never
    # shares ids with the old run's, which are stale. Generation 1 keeps the id earlier
    # versions derived, so a replayed ledger folds to the same request.
    if s.generation == 1:
        approval_id = "appr-" + ctx.event_id("approval", step.step_id, purpose.value)
    else:
        approval_id = "appr-" + ctx.event_id("approval", s.generation, step.step_id, purpose.value)
    expires_at = ctx.now + ctx.policy.approval_ttl_ms
    step.approval = PendingApproval(
        approval_id=approval_id,
        purpose=purpose,
        scope=scope,
        args_fingerprint=step.args_fingerprint,
        requested_at=ctx.now,
        expires_at=expires_at,
    )
    step.status = (
        StepStatus.AWAITING_APPROVAL
        if purpose is ApprovalPurpose.FORWARD
        else StepStatus.AWAITING_COMPENSATION_APPROVAL
    )
    step.timers[TimerPurpose.APPROVAL_EXPIRY] = expires_at + 1  # valid through expires_at
    ctx.emit(
        ApprovalRequested(
            envelope=ctx.envelope(
                ApprovalRequested, ctx.event_id("ApprovalRequested", approval_id)
            ),
            step_id=step.step_id,
            approval_id=approval_id,
            purpose=purpose,
            principal=s.principal,
            args_fingerprint=step.args_fingerprint,
            scope=scope,
            expires_at=expires_at,
        )
    )


# ------------------------------------------------------------------- timers


def _fire(ctx: _Ctx, step: StepState, purpose: TimerPurpose) -> None:
    s = ctx.s
    if purpose is TimerPurpose.FORWARD_RETRY:
        if step.status is StepStatus.RETRY_WAIT:
            if _forward_allowed(s):
                _dispatch(ctx, step, step.attempt + 1)  # same idempotency key (R6, R8)
            else:
                _cancel(
                    ctx, step, f"retry dropped: the saga stopped going forward ({step.last_error})"
                )
    elif purpose is TimerPurpose.COMPENSATION_RETRY:
        if step.status is StepStatus.COMPENSATION_RETRY_WAIT:
            _send_compensation(ctx, step, step.compensation_attempt + 1)
    elif purpose is TimerPurpose.RECONCILE_RETRY:
        if step.status is StepStatus.RECONCILING:
            step.reconcile_round += 1
            _reconcile_command(ctx, step)
    elif purpose is TimerPurpose.APPROVAL_EXPIRY:
        pending = step.approval
        if pending is None:
            return
        _log_approval(ctx, step, pending.purpose, "EXPIRED", "-", pending.args_fingerprint)
        step.approval = None
        if step.status is StepStatus.AWAITING_APPROVAL:
            step.observation = "APPROVAL_EXPIRED"
            _forward_failed_finally(ctx, step, f"forward approval expired at {pending.expires_at}")
        elif step.status is StepStatus.AWAITING_COMPENSATION_APPROVAL:
            _compensation_failed_finally(
                ctx,
                step,
                "compensation-approval-expired",
                f"compensation approval expired at {pending.expires_at}",
            )
    elif purpose is TimerPurpose.REVERSAL_WINDOW:
        _expire_window(ctx, step)
    elif (
        purpose is TimerPurpose.COMPLETION_DEADLINE
        and step.status is StepStatus.COMPENSATION_ACCEPTED
    ):
        _completion_overdue(ctx, step)


def _completion_overdue(ctx: _Ctx, step: StepState) -> None:
    """R12: accepted is not done; the declared wait passed with no completion."""
    within = step.contract.completion_within_ms
    accepted_at = ctx.now - (within or 0)  # the timer was set at acceptance + wait
    operation = step.compensation_provider_operation_id or "(no operation id given)"
    waited = (
        f"no completion within the declared wait of {within} ms"
        if within is not None
        else "the tool declares no completion wait (@compensable(completion_within=...))"
    )
    _compensation_failed_finally(
        ctx,
        step,
        "compensation-not-completed",
        f"compensation {step.contract.compensation} was accepted as provider operation "
        f"{operation} at {_iso(accepted_at)}; {waited} (deadline {_iso(ctx.now)})",
        raise_incident=not step.window_expired,
    )


def _iso(epoch_ms: int) -> str:
    """A readable UTC time for incident texts (epoch ms in, ISO 8601 out). A time no
    calendar date names (a participant's absurd clock, a wait of centuries) is given
    as the number it is: the incident it belongs to must still be raised."""
    try:
        at = datetime.datetime.fromtimestamp(epoch_ms / 1000, tz=datetime.UTC)
    except (ValueError, OverflowError, OSError):
        return f"{epoch_ms} ms since the epoch"
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _expire_window(ctx: _Ctx, step: StepState) -> None:
    """R13: past the reversal window, compensation becomes an incident."""
    step.timers.pop(TimerPurpose.REVERSAL_WINDOW, None)
    window = step.contract.reversal_window_ms
    counted_from = (
        step.committed_at
        if step.reversal_deadline is None or window is None
        else step.reversal_deadline - window
    )
    why = (
        f"its reversal window ({window} ms after the commit at "
        f"{counted_from}) expired before the compensation committed"
    )
    if step.status in (
        StepStatus.COMPENSATION_PENDING,
        StepStatus.AWAITING_COMPENSATION_APPROVAL,
        StepStatus.COMPENSATION_RETRY_WAIT,
    ):
        step.window_expired = True
        _compensation_failed_finally(ctx, step, _WINDOW_EXPIRED, why)
    elif step.status in (StepStatus.COMPENSATING, StepStatus.COMPENSATION_ACCEPTED):
        # Already sent: its outcome is still recorded truthfully, but a person is told now
        # and no further attempt is made.
        step.window_expired = True
        _raise_incident(
            ctx,
            _WINDOW_EXPIRED,
            step,
            f"{step.contract.tool} (step {step.step_id}) may not be undone: {why}",
            _effect(step),
        )


# ------------------------------------------------------------------ advance


def _advance(ctx: _Ctx) -> None:
    """Move the saga as far as the facts allow: dispatch, unwind, end.

    Every pass either changes a step or the saga for good, so the loop ends; the bound
    only turns a bug into an error instead of a hang.
    """
    s = ctx.s
    for _ in range(4 * len(s.steps) + 8):
        if s.status.is_terminal:
            return
        changed = False
        if s.status is SagaStatus.RUNNING:
            changed |= _maybe_start_compensating(ctx)
        if s.status is SagaStatus.RUNNING:
            changed |= _dispatch_ready(ctx)
        else:
            changed |= _progress_unwind(ctx)
        changed |= _maybe_end(ctx)
        if not changed:
            return
    raise RuntimeError(f"coordinator core did not settle saga {s.saga_id}; this is a bug")


def _pivot_in_flight(s: SagaState) -> bool:
    return any(st.contract.pivot and st.status in FORWARD_IN_FLIGHT for st in s.steps.values())


def _maybe_start_compensating(ctx: _Ctx) -> bool:
    """Before the pivot, a final failure (R9) or an abort turns the saga around."""
    s = ctx.s
    if s.pivot_committed is not None:
        return False
    failed = any(st.status is StepStatus.FAILED for st in s.steps.values())
    if not failed and s.end_requested is not SagaOutcome.ABORT:
        return False
    if _pivot_in_flight(s):
        return False  # the pivot's outcome decides the direction (R6)
    s.status = SagaStatus.COMPENSATING
    for step in s.steps.values():
        if step.status in (StepStatus.SCHEDULED, StepStatus.AWAITING_APPROVAL):
            _cancel(ctx, step, "never dispatched: the saga began compensating")
        elif step.status is StepStatus.RETRY_WAIT:
            _cancel(ctx, step, f"retry dropped: the saga began compensating ({step.last_error})")
    return True


def _forward_prerequisites(s: SagaState, step: StepState) -> list[StepState]:
    """Dependencies, plus the pivot barrier: a pivot waits for every earlier step and
    every later step waits for the pivots before it (R6)."""
    prereqs = [s.steps[d] for d in step.depends_on]
    for other in s.steps.values():
        if other.index == step.index:
            continue
        if (step.contract.pivot and other.index < step.index) or (
            other.contract.pivot and other.index < step.index
        ):
            prereqs.append(other)
    return prereqs


def _dispatch_ready(ctx: _Ctx) -> bool:
    s = ctx.s
    if not _forward_allowed(s):
        return False
    changed = False
    for step in s.steps.values():
        if step.status is not StepStatus.SCHEDULED:
            continue
        prereqs = _forward_prerequisites(s, step)
        blocker = next(
            (p for p in prereqs if p.status in NEVER_COMMITTED | {StepStatus.ESCALATED}), None
        )
        if blocker is not None:
            _cancel(ctx, step, f"not run: {blocker.step_id} did not complete")
            changed = True
        elif all(p.status is StepStatus.COMMITTED for p in prereqs):
            irreversible = step.contract.reversibility is Reversibility.IRREVERSIBLE
            if irreversible and not step.contract.read_only and step.approval_id is None:
                _request_approval(ctx, step, ApprovalPurpose.FORWARD)  # R7
            else:
                _dispatch(ctx, step, 1)
            changed = True
    return changed


def _needs_compensation(ctx: _Ctx, step: StepState) -> None:
    if step.contract.pivot:
        step.status = StepStatus.ESCALATED
        _raise_incident(
            ctx,
            "pivot-committed-during-unwind",
            step,
            f"pivot {step.step_id} ({step.contract.tool}) committed after the saga began "
            "unwinding; a pivot is never compensated automatically",
            _effect(step),
        )
    elif step.contract.compensation is None:
        step.status = StepStatus.ESCALATED
        _raise_incident(
            ctx,
            "no-compensation",
            step,
            f"{step.contract.tool} (step {step.step_id}, {step.contract.reversibility.value}) "
            "committed and declares no compensation",
            _effect(step),
        )
    else:
        step.status = StepStatus.COMPENSATION_PENDING
        if step.reversal_deadline is not None:
            step.timers[TimerPurpose.REVERSAL_WINDOW] = step.reversal_deadline


def _progress_unwind(ctx: _Ctx) -> bool:
    """R1-R3, R13: compensate committed steps in reverse dependency order."""
    s = ctx.s
    changed = False
    for step in s.steps.values():
        if step.status is StepStatus.COMMITTED and not step.contract.read_only:
            _needs_compensation(ctx, step)  # R1: only what committed
            changed = True
        elif step.status in (StepStatus.SCHEDULED, StepStatus.AWAITING_APPROVAL):
            _cancel(ctx, step, "never dispatched: the saga is compensating")
            changed = True
    for step in s.steps.values():
        window = step.timers.get(TimerPurpose.REVERSAL_WINDOW)
        if window is not None and window <= ctx.now:
            _expire_window(ctx, step)
            changed = True
    view = graph.UnwindView(s)  # the graph read once for this pass (steps change below)
    if not s.continue_on_compensation_failure:
        for step in reversed(s.steps.values()):  # latest first, as the view needs
            if step.status is not StepStatus.COMPENSATION_PENDING:
                continue
            holder = view.holding_dependent(step)
            if holder is not None:
                step.status = StepStatus.HELD
                step.timers.pop(TimerPurpose.REVERSAL_WINDOW, None)
                left = view.effect_left(holder)
                if left is holder:
                    note = f"{holder.step_id} depends on it explicitly and was not undone"
                    why = f"{holder.step_id} depends on it explicitly and its effect was not undone"
                else:  # a read-only holder passes on the block of a step below it
                    note = why = (
                        f"{holder.step_id} depends on it explicitly, and the effect of "
                        f"{left.contract.tool} ({left.step_id}), which depends on "
                        f"{holder.step_id}, was not undone"
                    )
                step.note = f"held: {note}"
                _raise_incident(
                    ctx,
                    "compensation-held",
                    step,
                    f"{step.contract.tool} (step {step.step_id}) was not compensated because {why}",
                    _effect(step),
                )
                changed = True
    if _pivot_in_flight(s):
        return changed
    # R2: a compensation waits for every started compensation on its resources, and
    # for a write still running there (its effect may be landing; once it settles it
    # is undone first, or was never there).
    active = [
        st
        for st in s.steps.values()
        if st.status in COMPENSATION_ACTIVE
        or (st.status in FORWARD_IN_FLIGHT and not st.contract.read_only)
    ]
    # A pending step counts as not finished whether or not it starts below, so what
    # waits on it is the same before and after: one sweep serves the whole loop.
    waiting = view.waiting()
    for step in reversed(s.steps.values()):
        if step.status is not StepStatus.COMPENSATION_PENDING:
            continue
        if step.step_id in waiting:
            continue
        if graph.resource_conflict(step, active) is not None:
            continue  # R2: one compensation per resource at a time
        if step.contract.compensation_approval is CompensationApproval.REQUIRE:
            _request_approval(ctx, step, ApprovalPurpose.COMPENSATION)  # R13
        else:
            _send_compensation(ctx, step, 1)
        active.append(step)
        changed = True
    return changed


_SETTLED_FORWARD = frozenset(
    {StepStatus.COMMITTED, StepStatus.ESCALATED, StepStatus.CANCELLED, StepStatus.FAILED}
)


def _settled_for_unwind(step: StepState) -> bool:
    if step.status in NEVER_COMMITTED or step.status in COMPENSATION_FINAL:
        return True
    return step.status is StepStatus.COMMITTED and step.contract.read_only


def _maybe_end(ctx: _Ctx) -> bool:
    s = ctx.s
    steps = s.steps.values()
    if s.status is SagaStatus.COMPENSATING:
        if not all(_settled_for_unwind(st) for st in steps):
            return False
    elif s.end_requested is SagaOutcome.COMPLETE or (
        s.end_requested is SagaOutcome.ABORT and s.pivot_committed is not None
    ):
        if not all(st.status in _SETTLED_FORWARD for st in steps):
            return False
    else:
        return False
    _finish(ctx)
    return True


def _finish(ctx: _Ctx) -> None:
    """R14: the one terminal record, with the full receipt."""
    s = ctx.s
    escalated = any(disposition(st) is Disposition.ESCALATED for st in s.steps.values())
    if escalated or s.open_incidents():
        status = TerminalStatus.ESCALATED
    elif s.status is SagaStatus.COMPENSATING:
        status = TerminalStatus.COMPENSATED
    else:
        status = TerminalStatus.COMPLETED
    s.status = SagaStatus(status.value)
    s.ended_at = ctx.now
    for step in s.steps.values():
        step.timers.clear()
    receipt = build_receipt(s, status, ctx.now)
    ctx.emit(
        SagaTerminal(
            envelope=ctx.envelope(SagaTerminal, ctx.event_id(s.generation, "SagaTerminal")),
            status=status,
            receipt=receipt.to_json(),
            unresolved=list(receipt.unresolved),
        ),
        Destination.TERMINAL,
    )
