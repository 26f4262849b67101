"""The dashboard's in-memory view: a pure fold of ledger records into per-saga views.

No I/O here. The Kafka thread (:mod:`services.dashboard.consumer`) feeds every record
of ``sagaline.events``, ``sagaline.terminal`` and ``sagaline.incidents`` to
:meth:`DashboardState.apply`; pages read snapshots. Because the view is only a fold of
the log (R5), a restarted dashboard re-reads the topics from the beginning and ends up
with the same view.

Records of one saga reach us over three topics in no guaranteed interleaving, and the
same record (same ``event_id``) appears on two of them (the coordinator writes every
terminal record and incident to ``sagaline.events`` too), so the fold deduplicates by
the coordinator's key (:func:`coordinator.core.dedup_key`: the event id, within its
verified writer's name when writers are bound) and tolerates any order between topics.
"""

from __future__ import annotations

import enum
import heapq
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from coordinator.core import (
    AGENT_DRIVEN,
    COORDINATOR_PRODUCER,
    DEFAULT_POLICY,
    PARTICIPANT_OUTCOMES,
    SETTLES_UNKNOWN,
    CorePolicy,
    dedup_key,
    grant_mismatches,
    unknown_outcome_answer,
    unknown_outcome_refusal,
)
from sagaline.ops.metrics import SagalineMetrics
from schemas.models import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    CompensationRequested,
    IncidentRaised,
    IncidentResolved,
    ReconcileResult,
    Record,
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
from schemas.receipt import Receipt


class SagaStatus(enum.StrEnum):
    """What an operator needs to know first about a saga, in the order they act on it."""

    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting approval"
    UNKNOWN_OUTCOME = "unknown outcome"
    COMPENSATING = "compensating"
    COMPLETED = "completed"
    COMPENSATED = "compensated"
    ESCALATED = "escalated"

    @property
    def slug(self) -> str:
        return self.name.lower()


_TERMINAL = {
    TerminalStatus.COMPLETED: SagaStatus.COMPLETED,
    TerminalStatus.COMPENSATED: SagaStatus.COMPENSATED,
    TerminalStatus.ESCALATED: SagaStatus.ESCALATED,
}


class SpanKind(enum.StrEnum):
    APPROVAL = "approval"
    ATTEMPT = "attempt"
    RETRY_WAIT = "retry-wait"
    UNKNOWN = "unknown"
    COMPENSATION = "compensation"


@dataclass
class Span:
    """A stretch of time in one step's life, drawn as one bar of the timeline."""

    kind: SpanKind
    start: int
    end: int | None = None
    outcome: str = "pending"
    label: str = ""
    ref: str = ""  # approval id / attempt number, to find the span to close


@dataclass
class StepView:
    step_id: str
    tool: str = "?"
    participant: str = "?"
    reversibility: Reversibility = Reversibility.COMPENSATABLE
    pivot: bool = False
    read_only: bool = False
    compensation: str | None = None
    has_verify: bool = False  # a completion counts only with its verification (R12)
    # The coordinator gave the compensation up (its incident read): a completion read
    # later changes nothing for it (``_on_compensation_committed``), nor here.
    compensation_given_up: bool = False
    scheduled_at: int | None = None
    committed_at: int | None = None
    state: str = "scheduled"
    attempts: int = 0
    incident_id: str | None = None
    incidents: list[tuple[int, str]] = field(default_factory=list)  # (raised at, kind)
    spans: list[Span] = field(default_factory=list)

    def open_span(self, kind: SpanKind, ref: str | None = None) -> Span | None:
        for span in reversed(self.spans):
            if span.kind is kind and span.end is None and (ref is None or span.ref == ref):
                return span
        return None

    def close(self, kind: SpanKind, at: int, outcome: str, ref: str | None = None) -> None:
        span = self.open_span(kind, ref)
        if span is not None:
            span.end = max(at, span.start)
            span.outcome = outcome


@dataclass(frozen=True)
class UncountedDecision:
    """An approval decision on the ledger that the coordinator rejects (R7): shown with
    the reason, never as if it had released or stopped the step."""

    at: int
    kind: str  # "grant" or "denial"
    by: str
    step_id: str
    approval_id: str
    reason: str


@dataclass
class SagaView:
    saga_id: str
    tenant_id: str
    workflow: str = "?"
    principal: str = "?"
    generation: int = 1
    started_at: int | None = None
    last_at: int = 0
    steps: dict[str, StepView] = field(default_factory=dict)
    end_requested: SagaOutcome | None = None
    end_reason: str = ""
    failure_at: int | None = None
    compensating_since: int | None = None
    terminal_status: TerminalStatus | None = None
    terminal_at: int | None = None
    # The SagaTerminal read in the ledger itself (not an early copy from the terminal
    # topic): a decision after it in the ledger the coordinator leaves alone.
    ended_in_ledger: bool = False
    # Ended, known from the terminal topic alone when everything there was at start had
    # been read: its ledger expired (DashboardState.mark_caught_up).
    ledger_expired: bool = False
    # Dropped from memory once (ended, settled), brought back by an incident the
    # coordinator raised after that (DashboardState._revive): only what came since.
    history_dropped: bool = False
    # The incidents it had when dropped before: a copy of one brings nothing back.
    dropped_incidents: tuple[str, ...] = ()
    receipt: Receipt | None = None
    receipt_error: str | None = None
    pending_approvals: dict[str, ApprovalRequested] = field(default_factory=dict)
    # Requests past their expiry (DashboardState.expire_approvals): the coordinator no
    # longer waits for them, yet a grant made in time may still be read (and counts).
    expired_approvals: dict[str, ApprovalRequested] = field(default_factory=dict)
    open_incidents: dict[str, IncidentRaised] = field(default_factory=dict)
    resolved_incidents: dict[str, IncidentResolved] = field(default_factory=dict)
    # Unknown-outcome incidents the coordinator marks resolved without a record of their
    # own, because their step was settled (incident id -> how).
    settled_incidents: dict[str, str] = field(default_factory=dict)
    # The kind and step of every incident folded, open or not (incident id -> them): an
    # id names one incident, as ``coordinator.core._on_incident_raised`` holds.
    incident_labels: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    uncounted_decisions: list[UncountedDecision] = field(default_factory=list)
    started_by: str | None = None  # the SagaStarted's producer: the agent driving it
    refused: list[str] = field(default_factory=list)  # records the coordinator refuses
    record_count: int = 0
    # Its records' keys in the dedup memory (``coordinator.core.dedup_key``), dropped
    # with it (DashboardState._evict).
    event_ids: list[str] = field(default_factory=list, repr=False)

    @property
    def status(self) -> SagaStatus:
        if self.terminal_status is not None:
            return _TERMINAL[self.terminal_status]
        if any(s.state == "unknown" for s in self.steps.values()):
            return SagaStatus.UNKNOWN_OUTCOME
        if self.pending_approvals:
            return SagaStatus.AWAITING_APPROVAL
        if self.compensating_since is not None:
            return SagaStatus.COMPENSATING
        return SagaStatus.RUNNING

    @property
    def tools(self) -> set[str]:
        return {s.tool for s in self.steps.values()}

    @property
    def pivot_at(self) -> int | None:
        """When the pivot committed: from then on the saga only goes forward (R6)."""
        times = [s.committed_at for s in self.steps.values() if s.pivot and s.committed_at]
        return min(times) if times else None

    @property
    def ended_at(self) -> int | None:
        return self.terminal_at

    def step(self, step_id: str, tool: str | None = None) -> StepView:
        view = self.steps.get(step_id)
        if view is None:
            view = self.steps[step_id] = StepView(step_id=step_id)
        if tool and view.tool == "?":
            view.tool = tool
        return view


@dataclass(frozen=True)
class SagaFilter:
    tenant: str | None = None
    workflow: str | None = None
    tool: str | None = None
    status: SagaStatus | None = None

    def matches(self, saga: SagaView) -> bool:
        return (
            (not self.tenant or saga.tenant_id == self.tenant)
            and (not self.workflow or saga.workflow == self.workflow)
            and (not self.tool or self.tool in saga.tools)
            and (self.status is None or saga.status is self.status)
        )


_BOUND_WRITERS = CorePolicy(bind_writers=True)

DEFAULT_ENDED_SAGAS = 10_000
"""Ended, settled sagas a dashboard keeps (``SAGALINE_DASHBOARD_ENDED_SAGAS``)."""

DEFAULT_DROPPED_SAGAS = 100_000
"""Dropped sagas a dashboard remembers (their ids, how they ended, their incidents'
ids: about 200 bytes each), so that their records read later change nothing; the
oldest dropped is forgotten first."""


class DashboardState:
    """The sagas the dashboard has seen, folded from the ledger; thread-safe.

    Every saga in flight (approvals pending included) or ended with an open incident
    is kept (an ended saga's requests wait for no one: a decision after its end does not
    count); of the ended, settled ones the ``ended_sagas`` that ended last.
    A saga is settled once its ledger's terminal record is read (every record before
    it is then folded) and nothing is open; one known only from the terminal topic
    (its ledger expired) once everything there was at start has been read
    (:meth:`mark_caught_up`); a terminal copy read after that, ahead of its ledger,
    waits for the ledger's. The ``dropped_sagas`` dropped last are remembered, so
    their records read later (the other topic's copy, a redelivery, a late decision the
    coordinator ignores) bring nothing back; a record of one forgotten since (dropped
    before those) is folded as a saga's first.

    ``lock`` guards the whole state: the Kafka thread holds it while applying a batch,
    page handlers while reading.
    """

    def __init__(
        self,
        metrics: SagalineMetrics | None = None,
        *,
        bind_writers: bool = False,
        ended_sagas: int = DEFAULT_ENDED_SAGAS,
        dropped_sagas: int = DEFAULT_DROPPED_SAGAS,
    ) -> None:
        if ended_sagas < 0:
            raise ValueError(f"ended_sagas must be 0 or more, not {ended_sagas}")
        if dropped_sagas < 0:
            raise ValueError(f"dropped_sagas must be 0 or more, not {dropped_sagas}")
        self.lock = threading.RLock()
        # With a trust file the coordinator takes a record only from the writer bound to
        # it (the saga's agent, the step's participant); so does the view.
        self.bind_writers = bind_writers
        self.refused_records = 0
        self.metrics = metrics or SagalineMetrics("dashboard")
        self.sagas: dict[str, SagaView] = {}
        self._seen: set[str] = set()
        self._seen_on_ledger: set[str] = set()
        self.ledger_duplicates = 0
        self.stale_records = 0
        self.records_applied = 0
        self.ended_sagas = ended_sagas
        self._settled: dict[str, int] = {}  # kept ended, settled sagas -> terminal_at
        self._settled_order: list[tuple[int, str]] = []  # heap; stale entries skipped
        # Dropped sagas, the ``dropped_sagas`` dropped last (oldest first): how each
        # ended, and the ids of the incidents it had (a dropped saga is brought back
        # only by a coordinator incident it did not have).
        self._evicted: OrderedDict[str, tuple[TerminalStatus | None, tuple[str, ...]]] = (
            OrderedDict()
        )
        self.dropped_sagas = dropped_sagas
        self.evicted_sagas = 0
        self.forgotten_sagas = 0  # dropped sagas no longer remembered
        self.evicted_records = 0  # records of a dropped saga read after it was dropped
        # Once caught up (:meth:`mark_caught_up`), ledger records of a saga not known
        # that a saga does not begin with: a forgotten saga's late ones, dropped
        # (:meth:`_late_record`).
        self.caught_up = False
        self.late_records_of_forgotten_sagas = 0
        # Sagas a ledger record of which the follower skipped unread (it failed
        # verification, or a newer version wrote it) before the view knew them: their
        # SagaStarted may be that record, and their later ones are no late ones
        # (:meth:`skipped_unread`). The ``dropped_sagas`` last, oldest first.
        self._skipped_unread: OrderedDict[str, None] = OrderedDict()
        # Sagas with a pending approval request: what the expiry scan and the pending
        # list look at, not every saga.
        self._awaiting: set[str] = set()

    # ---------------------------------------------------------------- applying

    def apply_all(self, records: Iterable[tuple[Record, bool]]) -> None:
        with self.lock:
            for record, from_ledger in records:
                self.apply(record, from_ledger=from_ledger)

    def apply(self, record: Record, *, from_ledger: bool = True) -> bool:
        """Fold one record; ``from_ledger`` is True for ``sagaline.events``. Returns False
        for a record already applied (a duplicate) or of a superseded generation."""
        with self.lock:
            # As the coordinator remembers it: with bound writers an event id within its
            # writer's name, so another writer allowed on the saga cannot write its own
            # record under an operator's (predictable) decision id first and have the
            # real decision dropped here as a duplicate.
            key = dedup_key(record, _BOUND_WRITERS if self.bind_writers else DEFAULT_POLICY)
            if record.saga_id in self._evicted and not self._revive(record):
                # Ended and settled before: nothing it still says counts (the
                # coordinator too ignores an ended saga's history), nor is measured.
                self.evicted_records += 1
                return False
            if not from_ledger and isinstance(record, IncidentResolved):
                # The incident feed's copy of a resolution is on the ledger too (which
                # outlives the feed). What it settles depends on the step's state when
                # the coordinator read it; read early (a restart reads the short feed
                # before the ledger's earlier records) it would settle nothing, so only
                # the ledger's record, in the saga's order, is folded. The coordinator's
                # own (an incident it settled itself: ``coordinator.core._mark_resolved``)
                # is on the feed only, and settles the incident whenever it is read.
                if record.envelope.producer == COORDINATOR_PRODUCER:
                    saga = self.sagas.get(record.saga_id)
                    if saga is not None and record.incident_id in saga.open_incidents:
                        _settle(saga, record.incident_id, record.resolution)
                        self._check_settled(saga)
                return False
            if self._late_record(record, from_ledger):
                self.late_records_of_forgotten_sagas += 1
                return False
            if from_ledger:
                if key in self._seen_on_ledger:
                    # The same fact twice in the ledger: consumers deduplicate it (R15).
                    self.ledger_duplicates += 1
                    self.metrics.duplicate_prevented()
                    return False
                self._seen_on_ledger.add(key)
                # Measures fold the ledger only: within a saga it is in order (one
                # partition), while the terminal/incident copies may come first. A
                # record the coordinator refuses is no fact: not folded there either.
                if self._measured(record):
                    self.metrics.observe_record(record)
            if key in self._seen:
                # Its saga: None when a writer reused another saga's event id.
                seen = self.sagas.get(record.saga_id)
                if from_ledger and seen is not None:
                    seen.event_ids.append(key)
                    self._ended_in_ledger(record)
                    self._given_up_in_ledger(record)
                    self._check_settled(seen)
                return False
            saga = self._saga_for(record, from_ledger)
            if saga is None:
                self._seen.add(key)
                self.sagas[record.saga_id].event_ids.append(key)
                self.stale_records += 1
                return False
            refused = _refusal(saga, record, self.bind_writers)
            if refused is not None:
                # Not remembered, as the coordinator does not: the rightful record with
                # this event id may follow.
                self._seen_on_ledger.discard(key)
                self.refused_records += 1
                saga.refused.append(f"{record.TYPE} {record.event_id}: {refused}")
                return False
            self._seen.add(key)
            saga.event_ids.append(key)
            _begin_generation(saga, record)
            self.records_applied += 1
            saga.record_count += 1
            saga.last_at = max(saga.last_at, record.envelope.occurred_at)
            _fold(saga, record)
            if from_ledger:
                self._ended_in_ledger(record)
            if saga.pending_approvals:
                self._awaiting.add(saga.saga_id)
            else:
                self._awaiting.discard(saga.saga_id)
            self._check_settled(saga)
            return True

    def dropped(self, saga_id: str) -> bool:
        """Whether ``saga_id`` ended, settled, and was dropped from memory (``ended_sagas``)."""
        with self.lock:
            return saga_id in self._evicted

    def awaiting_approval_ids(self) -> set[str]:
        """Sagas with a pending approval request (ended ones included)."""
        with self.lock:
            return set(self._awaiting)

    def mark_caught_up(self) -> None:
        """Everything that existed at start has been read: an ended saga known only
        from the terminal topic has no ledger left to read (it expired)."""
        with self.lock:
            self.caught_up = True
            for saga in list(self.sagas.values()):
                if self.sagas.get(saga.saga_id) is not saga:
                    continue  # dropped by an earlier one
                # Not a saga whose terminal copy is read later, ahead of its ledger.
                saga.ledger_expired = saga.terminal_at is not None and not saga.ended_in_ledger
                if saga.ledger_expired:
                    _settle_from_receipt(saga)
                self._check_settled(saga)

    def skipped_unread(self, saga_id: str) -> None:
        """The follower skipped a ledger record of ``saga_id`` unread: if the view does
        not know the saga, its later records still show it (shown without that one),
        not dropped as a forgotten saga's late ones."""
        with self.lock:
            if saga_id in self.sagas:
                return
            self._skipped_unread[saga_id] = None
            self._skipped_unread.move_to_end(saga_id)
            while len(self._skipped_unread) > self.dropped_sagas:
                self._skipped_unread.popitem(last=False)

    def _late_record(self, record: Record, from_ledger: bool) -> bool:
        """A ledger record of a saga the view does not know, read once caught up, that a
        saga does not begin with: live, a saga's records come after its SagaStarted in
        the ledger, so this is a late one of a saga dropped and forgotten since (100 000
        others dropped after it: a redelivery, a late decision), which would show as a
        saga *running* and be kept for good. Not an incident the coordinator raises (one
        for an ended saga it parked needs a person), nor a copy on the terminal or
        incident topic (read ahead of its saga's ledger, which follows). Before catch-up
        such a record may follow records the ledger's retention deleted, and is folded
        as the saga's first."""
        if not (from_ledger and self.caught_up) or record.saga_id in self.sagas:
            return False
        if isinstance(record, SagaStarted | SagaTerminal):
            return False
        if self._skipped_unread.pop(record.saga_id, False) is None:
            return False  # its first record was skipped unread: it now shows
        return not (
            isinstance(record, IncidentRaised) and record.envelope.producer == COORDINATOR_PRODUCER
        )

    def _check_settled(self, saga: SagaView) -> None:
        """Track whether ``saga`` is ended and settled; drop the oldest-ended such
        sagas past ``ended_sagas``."""
        if saga.history_dropped:
            if not saga.open_incidents:
                # Ended before every saga kept (it was dropped once): out again once
                # nothing of it is open.
                self._settled[saga.saga_id] = saga.last_at
                self._evict(saga.saga_id)
            return
        if (
            saga.terminal_at is None
            or saga.open_incidents
            or not (saga.ended_in_ledger or saga.ledger_expired)
        ):
            self._settled.pop(saga.saga_id, None)
            return
        if self._settled.get(saga.saga_id) == saga.terminal_at:
            return
        self._settled[saga.saga_id] = saga.terminal_at
        heapq.heappush(self._settled_order, (saga.terminal_at, saga.saga_id))
        while len(self._settled) > self.ended_sagas:
            at, saga_id = heapq.heappop(self._settled_order)
            if self._settled.get(saga_id) == at:
                self._evict(saga_id)
        if len(self._settled_order) > 2 * len(self._settled) + 64:  # stale entries
            self._settled_order = [(at, i) for i, at in self._settled.items()]
            heapq.heapify(self._settled_order)

    def _evict(self, saga_id: str) -> None:
        del self._settled[saga_id]
        self._awaiting.discard(saga_id)
        saga = self.sagas.pop(saga_id)
        for key in saga.event_ids:
            self._seen.discard(key)
            self._seen_on_ledger.discard(key)
        incidents = (*saga.dropped_incidents, *saga.resolved_incidents, *saga.settled_incidents)
        self._evicted[saga_id] = (saga.terminal_status, incidents)
        self.evicted_sagas += 1
        while len(self._evicted) > self.dropped_sagas:
            self._evicted.popitem(last=False)
            self.forgotten_sagas += 1

    def _revive(self, record: Record) -> bool:
        """Bring a dropped saga back for an incident the coordinator raised after it was
        dropped (it parks an ended saga whose changelog marker it cannot read, after its
        SagaTerminal): a person must see it. The view shows how the saga ended and
        what came since; its earlier history stays dropped (``sagaline saga show``).
        A copy of an incident it had when dropped brings nothing back."""
        status, incidents = self._evicted[record.saga_id]
        if (
            not isinstance(record, IncidentRaised)
            or record.envelope.producer != COORDINATOR_PRODUCER
            or record.incident_id in incidents
        ):
            return False
        env = record.envelope
        del self._evicted[record.saga_id]
        self.sagas[record.saga_id] = SagaView(
            saga_id=record.saga_id,
            tenant_id=env.tenant_id,
            generation=env.generation,
            terminal_status=status,
            ended_in_ledger=True,
            history_dropped=True,
            dropped_incidents=incidents,
        )
        return True

    def _ended_in_ledger(self, record: Record) -> None:
        """Ledger order decides what the coordinator still counts: decisions before its
        SagaTerminal, however early the terminal topic's copy was read."""
        if isinstance(record, SagaTerminal):
            saga = self.sagas.get(record.saga_id)
            if saga is not None and record.envelope.generation >= saga.generation:
                saga.ended_in_ledger = True
                _settle_from_receipt(saga)

    def _given_up_in_ledger(self, record: Record) -> None:
        """The ledger's copy of an incident the incident feed gave first (a restart):
        what came before it in the ledger (the compensation requested, accepted) is
        folded now, so the step is marked given up again, after it."""
        if isinstance(record, IncidentRaised):
            saga = self.sagas.get(record.saga_id)
            if saga is not None:
                _compensation_given_up(saga, record)

    def _measured(self, record: Record) -> bool:
        """Whether the coordinator takes ``record`` as a fact (and so measures it): not
        one it refuses, nor a grant or denial it does not count (APPROVAL_MISMATCH,
        not awaited), which the view lists as "not counted"."""
        known = self.sagas.get(record.saga_id)
        if known is None:
            return not isinstance(record, ApprovalGranted | ApprovalDenied)
        if (
            record.envelope.generation < known.generation
            and record.envelope.producer != COORDINATOR_PRODUCER
            and not _counts_from_earlier_run(known, record)
        ):
            return False  # a superseded run's: refused stale-generation (R15)
        if _refusal(known, record, self.bind_writers) is not None:
            return False
        if isinstance(record, ApprovalGranted):
            return not _grant_problems(known, record)
        if isinstance(record, ApprovalDenied):
            return not _denial_problems(known, record)
        return True

    def _saga_for(self, record: Record, from_ledger: bool = True) -> SagaView | None:
        env = record.envelope
        saga = self.sagas.get(env.saga_id)
        if saga is None:
            # A copy from the terminal or incident topic (read early on a restart) says
            # nothing of where the ledger's runs begin: it does not make the earlier
            # runs' records, still to be read from the ledger, stale.
            generation = env.generation if from_ledger else min(env.generation, 1)
            saga = self.sagas[env.saga_id] = SagaView(
                saga_id=env.saga_id, tenant_id=env.tenant_id, generation=generation
            )
            return saga
        if env.generation < saga.generation and not _counts_from_earlier_run(saga, record):
            return None  # a superseded run: history, not the current saga (R15)
        if (
            env.generation > saga.generation
            and isinstance(record, SagaStarted)
            and saga.ended_in_ledger
        ):
            # The coordinator ignores a late start of a saga that ended before it in the
            # ledger; the terminal topic's copy, read early on a restart, does not decide.
            return None
        return saga

    # ----------------------------------------------------------------- reading

    def select(self, flt: SagaFilter = SagaFilter()) -> list[SagaView]:
        """Matching sagas, most recent activity first."""
        with self.lock:
            found = [s for s in self.sagas.values() if flt.matches(s)]
        return sorted(found, key=lambda s: (-s.last_at, s.saga_id))

    def counts(self, flt: SagaFilter = SagaFilter()) -> dict[SagaStatus, int]:
        """Sagas per status (every status present, zero when none)."""
        unfiltered = SagaFilter(flt.tenant, flt.workflow, flt.tool, None)
        out = dict.fromkeys(SagaStatus, 0)
        with self.lock:
            for saga in self.sagas.values():
                if unfiltered.matches(saga):
                    out[saga.status] += 1
        return out

    def pending_approvals(self) -> list[tuple[SagaView, ApprovalRequested]]:
        with self.lock:
            return sorted(
                (
                    (s, a)
                    for s in (self.sagas[i] for i in self._awaiting)
                    if s.terminal_status is None
                    for a in s.pending_approvals.values()
                ),
                key=lambda pair: pair[1].envelope.occurred_at,
            )

    def expired_approvals(self) -> list[tuple[SagaView, ApprovalRequested]]:
        with self.lock:
            return sorted(
                (
                    (s, a)
                    for s in self.sagas.values()
                    if s.terminal_status is None
                    for a in s.expired_approvals.values()
                ),
                key=lambda pair: pair[1].envelope.occurred_at,
            )

    def expire_approvals(self, now: int) -> None:
        """Move requests whose ``expires_at`` is before ``now`` out of the pending ones,
        as the coordinator's expiry timer does (valid through ``expires_at``, R7): it no
        longer waits for a decision, so neither is the saga shown awaiting one. Pages
        call this with their clock before reading."""
        with self.lock:
            for saga_id in list(self._awaiting):
                saga = self.sagas[saga_id]
                if saga.terminal_status is not None:
                    continue  # nothing is waited for any more
                for request in [a for a in saga.pending_approvals.values() if a.expires_at < now]:
                    _expire(saga, request)
                if not saga.pending_approvals:
                    self._awaiting.discard(saga_id)

    def open_incidents(self) -> list[tuple[SagaView, IncidentRaised]]:
        with self.lock:
            return sorted(
                ((s, i) for s in self.sagas.values() for i in s.open_incidents.values()),
                key=lambda pair: pair[1].envelope.occurred_at,
            )

    def facets(self) -> dict[str, list[str]]:
        """The tenants, workflows and tools seen, for the filter drop-downs."""
        with self.lock:
            sagas = list(self.sagas.values())
            return {
                "tenant": sorted({s.tenant_id for s in sagas}),
                "workflow": sorted({s.workflow for s in sagas}),
                "tool": sorted({t for s in sagas for t in s.tools}),
            }


# -------------------------------------------------------------------- the fold


def _first_failure(saga: SagaView, at: int) -> None:
    if saga.failure_at is None or at < saga.failure_at:
        saga.failure_at = at


def _fold(saga: SagaView, record: Record) -> None:
    at = record.envelope.occurred_at
    if isinstance(record, SagaStarted):
        if saga.started_by is None:
            saga.started_by = record.envelope.producer
        saga.workflow = record.workflow
        saga.principal = record.principal
        saga.tenant_id = record.envelope.tenant_id
        saga.started_at = at if saga.started_at is None else min(saga.started_at, at)
    elif isinstance(record, StepScheduled):
        step = saga.step(record.step_id)
        c = record.contract
        step.tool, step.participant = c.tool, c.participant
        step.reversibility, step.pivot, step.read_only = c.reversibility, c.pivot, c.read_only
        step.compensation = c.compensation
        step.has_verify = c.has_verify
        step.scheduled_at = at
    elif isinstance(record, ApprovalRequested):
        if record.purpose is ApprovalPurpose.COMPENSATION:
            _cancel_forward_approvals(saga, at)
        step = saga.step(record.step_id)
        saga.pending_approvals[record.approval_id] = record
        if record.purpose is ApprovalPurpose.FORWARD:
            step.state = "awaiting approval"
        step.spans.append(
            Span(
                SpanKind.APPROVAL,
                at,
                label=f"{record.purpose.value.lower()} approval requested",
                ref=record.approval_id,
            )
        )
    elif isinstance(record, ApprovalGranted):
        problems = _grant_problems(saga, record)
        if problems:
            _not_counted(saga, record, "grant", record.granted_by, problems)
            return
        step = saga.step(record.step_id)
        saga.pending_approvals.pop(record.approval_id, None)
        saga.expired_approvals.pop(record.approval_id, None)
        _close_approval(step, record.approval_id, at, f"granted by {record.granted_by}")
        if step.state in ("awaiting approval", "approval expired"):
            step.state = "approved"
    elif isinstance(record, ApprovalDenied) and record.envelope.producer == COORDINATOR_PRODUCER:
        # The coordinator withdrew its request (``core._withdraw_approval``): the step
        # was cancelled, or its compensation handed to a person; no one denied it, and
        # it is no decision to list as counted or not.
        saga.pending_approvals.pop(record.approval_id, None)
        saga.expired_approvals.pop(record.approval_id, None)
        step = saga.step(record.step_id)
        _close_approval(step, record.approval_id, at, "withdrawn by the coordinator")
        if step.state in ("awaiting approval", "approval expired"):
            step.state = "cancelled"
    elif isinstance(record, ApprovalDenied):
        problems = _denial_problems(saga, record)
        if problems:
            _not_counted(saga, record, "denial", record.denied_by, problems)
            return
        step = saga.step(record.step_id)
        saga.pending_approvals.pop(record.approval_id, None)
        saga.expired_approvals.pop(record.approval_id, None)
        _close_approval(step, record.approval_id, at, f"denied by {record.denied_by}")
        step.state = "denied"
        _first_failure(saga, at)
    elif isinstance(record, StepIntentRecorded):
        step = saga.step(record.step_id, record.tool)
        step.attempts = max(step.attempts, record.attempt)
        step.state = "running"
        step.close(SpanKind.RETRY_WAIT, at, "retried")
        step.spans.append(
            Span(SpanKind.ATTEMPT, at, label=f"attempt {record.attempt}", ref=str(record.attempt))
        )
    elif isinstance(record, StepCommitted):
        _settle_unknown_incidents(saga, record.step_id, "COMMITTED (observed in the ledger)")
        _settle_incidents(
            saga,
            record.step_id,
            {"forward-failed-after-pivot"},
            "COMMITTED (observed in the ledger)",
        )
        step = saga.step(record.step_id, record.tool)
        step.close(SpanKind.ATTEMPT, at, "committed")
        step.close(SpanKind.UNKNOWN, at, "committed")
        step.committed_at = step.committed_at or at
        step.state = "committed"
    elif isinstance(record, StepFailed):
        step = saga.step(record.step_id, record.tool)
        outcome = "rejected" if record.kind.value == "BUSINESS_REJECTION" else "failed"
        step.close(SpanKind.ATTEMPT, at, outcome)
        step.close(SpanKind.UNKNOWN, at, outcome)
        step.state = "failed"
        _first_failure(saga, at)
    elif isinstance(record, StepOutcomeUnknown):
        step = saga.step(record.step_id, record.tool)
        step.close(SpanKind.ATTEMPT, at, "timed out")
        if step.open_span(SpanKind.UNKNOWN) is None:
            step.spans.append(Span(SpanKind.UNKNOWN, at, label="outcome unknown"))
        step.state = "unknown"
        _first_failure(saga, at)
    elif isinstance(record, StepReconciled):
        step = saga.step(record.step_id, record.tool)
        if record.outcome is ReconcileResult.COMMITTED:
            _settle_unknown_incidents(saga, record.step_id, "COMMITTED (observed in the ledger)")
            step.close(SpanKind.UNKNOWN, at, "reconciled: committed")
            step.committed_at = step.committed_at or at
            step.state = "committed"
        elif record.outcome is ReconcileResult.NOT_FOUND:
            _settle_unknown_incidents(saga, record.step_id, "NOT_FOUND (reconciled by lookup)")
            step.close(SpanKind.UNKNOWN, at, "reconciled: not found")
            step.state = "failed"
    elif isinstance(record, StepRetryScheduled):
        step = saga.step(record.step_id)
        kind = "compensation retry" if record.purpose is ApprovalPurpose.COMPENSATION else "retry"
        step.spans.append(
            Span(
                SpanKind.RETRY_WAIT,
                at,
                end=max(record.due_at, at),
                outcome="scheduled",
                label=f"{kind} {record.attempt} due",
            )
        )
    elif isinstance(record, SagaEndRequested):
        saga.end_requested = record.outcome
        saga.end_reason = record.reason
        if record.outcome is SagaOutcome.ABORT:
            _first_failure(saga, at)
    elif isinstance(record, CompensationRequested):
        _cancel_forward_approvals(saga, at)
        step = saga.step(record.step_id, record.tool)
        step.compensation = step.compensation or record.compensation
        step.compensation_given_up = False
        if saga.compensating_since is None:
            saga.compensating_since = at
        step.state = "compensating"
        if step.open_span(SpanKind.COMPENSATION) is None:
            step.spans.append(
                Span(
                    SpanKind.COMPENSATION,
                    at,
                    label=f"{record.compensation} #{record.attempt}",
                )
            )
    elif isinstance(record, CompensationAccepted):
        step = saga.step(record.step_id)
        span = step.open_span(SpanKind.COMPENSATION)
        if span is not None:
            span.outcome = "accepted, awaiting completion"
    elif isinstance(record, CompensationCommitted):
        step = saga.step(record.step_id)
        if step.compensation_given_up:
            return  # the coordinator handed the effect to a person: its incident stays open
        # As the coordinator reads it (``_on_compensation_committed``): a declared
        # verification not reported is one that did not pass.
        if record.verified is False or (step.has_verify and record.verified is None):
            step.close(SpanKind.COMPENSATION, at, "verification failed")
            step.state = "compensation failed"
        else:
            step.close(SpanKind.COMPENSATION, at, "verified" if record.verified else "compensated")
            step.state = "compensated"
    elif isinstance(record, CompensationFailed):
        step = saga.step(record.step_id)
        step.close(SpanKind.COMPENSATION, at, "failed")
        step.state = "compensation failed"
    elif isinstance(record, IncidentRaised):
        _first_failure(saga, at)
        _supersede_incidents(saga, record)
        saga.incident_labels.setdefault(record.incident_id, (record.kind, record.step_id))
        if (
            record.incident_id not in saga.resolved_incidents
            and record.incident_id not in saga.settled_incidents
        ):
            saga.open_incidents[record.incident_id] = record
        if record.step_id is not None:
            step = saga.step(record.step_id, record.tool)
            step.incident_id = record.incident_id
            step.incidents.append((at, record.kind))
        _compensation_given_up(saga, record)
    elif isinstance(record, IncidentResolved):
        saga.resolved_incidents.setdefault(record.incident_id, record)  # the first counts
        incident = saga.open_incidents.pop(record.incident_id, None)
        if incident is not None and incident.step_id is not None:
            step = saga.step(incident.step_id)
            # Read as the coordinator reads it (``_on_incident_resolved``).
            answer = unknown_outcome_answer(record.resolution)
            if answer is not None and step.state == "unknown":
                how = f"{answer.value} (by {record.resolved_by})"
                _settle_unknown_incidents(saga, incident.step_id, how)
                step.close(SpanKind.UNKNOWN, at, f"resolved by {record.resolved_by}")
                committed = answer is ReconcileResult.COMMITTED
                step.state = "committed" if committed else "failed"
                if committed:
                    step.committed_at = step.committed_at or at
    elif isinstance(record, SagaTerminal):
        saga.terminal_status = record.status
        saga.terminal_at = at
        # Requests are kept (pages show none of an ended saga): this may be the terminal
        # topic's copy, read before a grant the ledger has ahead of it.
        try:
            saga.receipt = Receipt.from_json(record.receipt)
        except ValueError as exc:
            saga.receipt_error = f"the receipt could not be read: {exc}"
            return
        receipt = saga.receipt
        if saga.started_at is None:
            # Only the terminal topic survived (events expired): take what the receipt says.
            saga.started_at = receipt.started_at
            saga.workflow, saga.principal = receipt.workflow, receipt.principal
            for sr in receipt.steps:
                step = saga.step(sr.step_id, sr.tool)
                step.participant, step.reversibility = sr.participant, sr.reversibility
                step.pivot, step.read_only, step.compensation = (
                    sr.pivot,
                    sr.read_only,
                    sr.compensation,
                )
                step.committed_at = sr.committed_at
                step.state = sr.disposition.value.lower().replace("_", " ")


_COMPENSATION_GIVEN_UP = frozenset(
    {
        "compensation-failed",
        "compensation-not-verified",
        "compensation-not-completed",
        "compensation-approval-expired",
        "compensation-denied",
    }
)
"""Incident kinds of ``coordinator.core._compensation_failed_finally``: the step is
COMPENSATION_FAILED, and only a person settles its effect (R3, R8, R12)."""


def _compensation_given_up(saga: SagaView, record: IncidentRaised) -> None:
    """The coordinator gave the step's compensation up (an accepted one not completed in
    time, a verification failed, retries spent, its approval denied or expired): shown
    so, not as still compensating, and a completion read later does not undo it."""
    if (
        record.envelope.producer != COORDINATOR_PRODUCER
        or record.kind not in _COMPENSATION_GIVEN_UP
        or record.step_id is None
    ):
        return
    step = saga.step(record.step_id, record.tool)
    step.compensation_given_up = True
    step.state = "compensation failed"
    step.close(SpanKind.COMPENSATION, record.envelope.occurred_at, "failed")


def _awaited(saga: SagaView, step_id: str, purpose: ApprovalPurpose) -> ApprovalRequested | None:
    """The request the step is waiting on for ``purpose`` (the coordinator keeps one).
    One past its expiry by the dashboard's clock still qualifies: the coordinator judges
    a grant by the grant's own time, however late it is read."""
    for request in (*saga.pending_approvals.values(), *saga.expired_approvals.values()):
        if request.step_id == step_id and request.purpose is purpose:
            return request
    return None


def _decision_problems(
    saga: SagaView, record: ApprovalGranted | ApprovalDenied
) -> tuple[ApprovalRequested | None, list[str]]:
    """What the coordinator checks of any decision first: the saga's tenant and a
    pending request of the step for that purpose."""
    if saga.ended_in_ledger:
        return None, ["the saga had already ended"]
    problems: list[str] = []
    if record.envelope.tenant_id != saga.tenant_id:
        problems.append(
            f"tenant {record.envelope.tenant_id!r} is not the saga's ({saga.tenant_id!r})"
        )
    pending = _awaited(saga, record.step_id, record.purpose)
    if pending is None:
        problems.append(f"step {record.step_id} is not awaiting a {record.purpose.value} approval")
    return pending, problems


def _grant_problems(saga: SagaView, r: ApprovalGranted) -> list[str]:
    """Why the coordinator would not count this grant (empty: it counts): its own
    checks (``coordinator.core.grant_mismatches``, R7) against the request."""
    pending, problems = _decision_problems(saga, r)
    if pending is None:
        return problems
    return problems + grant_mismatches(
        r,
        approval_id=pending.approval_id,
        principal=pending.principal,
        args_fingerprint=pending.args_fingerprint,
        scope=pending.scope,
        expires_at=pending.expires_at,
    )


def _denial_problems(saga: SagaView, r: ApprovalDenied) -> list[str]:
    """Why the coordinator would not count this denial (``_on_approval_denied``)."""
    pending, problems = _decision_problems(saga, r)
    if pending is not None and r.approval_id != pending.approval_id:
        problems.append(
            f"approval id {r.approval_id} is not the one requested ({pending.approval_id})"
        )
    return problems


def _not_counted(
    saga: SagaView, record: ApprovalGranted | ApprovalDenied, kind: str, by: str, why: list[str]
) -> None:
    saga.uncounted_decisions.append(
        UncountedDecision(
            record.envelope.occurred_at,
            kind,
            by,
            record.step_id,
            record.approval_id,
            "; ".join(why),
        )
    )


def _resolution_refused(saga: SagaView, r: IncidentResolved) -> str | None:
    """Why the coordinator rejects this resolution (``_on_incident_resolved``): an
    unknown outcome still unsettled is answered only with COMMITTED or NOT_FOUND;
    anything else leaves the incident open, waiting for a person. An ended saga's
    incident too counts its first resolution only (``coordinator.shell._resolve_ended``),
    and one naming no incident of the saga is refused whether it runs or not."""
    incident = saga.open_incidents.get(r.incident_id)
    if incident is None:
        # Settled before, by a person or the ledger: the coordinator acts on the first
        # resolution only and refuses this one (``_on_incident_resolved``).
        first = saga.resolved_incidents.get(r.incident_id)
        if (
            first is not None
            and first.event_id == r.event_id
            and first.envelope.producer == r.envelope.producer
        ):
            # This very resolution, folded already from the incident feed's copy (read
            # before the ledger's record): the same fact, which the measures still count.
            # (Another writer's record under its id is not: ``coordinator.core.dedup_key``.)
            return None
        how = (
            f"{first.resolution} (by {first.resolved_by})"
            if first is not None
            else saga.settled_incidents.get(r.incident_id)
        )
        if how is not None:
            return (
                f"incident {r.incident_id} is already resolved ({how}); the resolution by "
                f"{r.resolved_by} ({r.resolution}) does not count"
            )
        return f"no open incident {r.incident_id} in saga {saga.saga_id}"
    if incident.kind not in SETTLES_UNKNOWN or incident.step_id is None:
        return None
    step = saga.steps.get(incident.step_id)
    if step is None or step.state != "unknown":
        return None
    if unknown_outcome_answer(r.resolution) is not None:
        return None
    return unknown_outcome_refusal(r.incident_id, r.resolution)


def _settle_unknown_incidents(saga: SagaView, step_id: str, how: str) -> None:
    """The step's outcome is known now (its commit read, a lookup's answer, a person's
    resolution): the coordinator marks every open unknown-outcome incident of the step
    resolved (``_resolve_unknown_incidents``) and writes no record for it, so nothing is
    left asking a person."""
    _settle_incidents(saga, step_id, SETTLES_UNKNOWN, how)


def _settle(saga: SagaView, incident_id: str, how: str) -> None:
    del saga.open_incidents[incident_id]
    saga.settled_incidents[incident_id] = how


def _settle_from_receipt(saga: SagaView) -> None:
    """The saga ended in the ledger (everything before it folded): an incident its
    receipt lists resolved, that no person's resolution read here settled, the
    coordinator settled itself (a compensation completed after its reversal window
    passed, and whatever else the ledger answered), so no one is asked for it."""
    if saga.receipt is None:
        return
    for incident in saga.receipt.incidents:
        if incident.resolved and incident.incident_id in saga.open_incidents:
            _settle(saga, incident.incident_id, incident.resolution or "resolved")


def _settle_incidents(saga: SagaView, step_id: str, kinds: Collection[str], how: str) -> None:
    """Open incidents of ``kinds`` about the step, settled by what the ledger says (a
    commit also settles a "forward-failed-after-pivot" escalation: the effect owed
    happened after all, ``coordinator.core._obligation_met``)."""
    for incident in list(saga.open_incidents.values()):
        if incident.step_id == step_id and incident.kind in kinds:
            del saga.open_incidents[incident.incident_id]
            saga.settled_incidents[incident.incident_id] = how


def _begin_generation(saga: SagaView, record: Record) -> None:
    """A new run continues the saga's steps, as the coordinator does (only a SagaStarted
    begins one: a later record read early from another topic must not make the current
    run's records stale). What the old run asked a person is asked again under the new
    generation."""
    env = record.envelope
    if env.generation > saga.generation and isinstance(record, SagaStarted):
        saga.generation = env.generation
        _new_generation(saga, env.occurred_at)


def _counts_from_earlier_run(saga: SagaView, record: Record) -> bool:
    """A record of an earlier run that the coordinator decides all the same: a person's
    resolution of an incident no later run asked again, or the completion of the
    compensation a step still awaits."""
    return _resolves_earlier_incident(saga, record) or _completes_awaited_compensation(saga, record)


def _completes_awaited_compensation(saga: SagaView, record: Record) -> bool:
    """The completion of the compensation attempt a step still awaits, answering the
    earlier run's command for it: ``coordinator.core.completes_awaited_compensation``
    decides it whatever its generation (a new run asks again under the same key, and
    the provider's one receipt may complete either)."""
    if not isinstance(record, CompensationCommitted):
        return False
    step = saga.steps.get(record.step_id)
    if step is None or step.state != "compensating":
        return False
    span = step.open_span(SpanKind.COMPENSATION)
    return span is not None and span.label.endswith(f" #{record.attempt}")


def _resolves_earlier_incident(saga: SagaView, record: Record) -> bool:
    """A person's resolution of an incident an earlier run raised, which no later run
    asked again: the coordinator decides it whatever its generation (a resolution
    copies its incident's), as ``coordinator.core.resolves_earlier_incident`` says. An
    unknown outcome still unsettled was asked again (superseded): that one is stale."""
    if not isinstance(record, IncidentResolved):
        return False
    incident_id = record.incident_id
    incident = saga.open_incidents.get(incident_id)
    if incident is None:
        if incident_id in saga.resolved_incidents:
            return True
        how = saga.settled_incidents.get(incident_id)
        return how is not None and not how.startswith("superseded by")
    if record.envelope.generation < incident.envelope.generation:
        return False  # a resolution copies its incident's generation: not this one's
    if incident.kind in SETTLES_UNKNOWN and incident.step_id is not None:
        step = saga.steps.get(incident.step_id)
        return step is None or step.state != "unknown"
    return True


def _refusal(saga: SagaView, record: Record, bind_writers: bool) -> str | None:
    """Why the coordinator refuses ``record`` before acting on it (TENANT_MISMATCH, and
    with a trust file FORBIDDEN_WRITER: ``coordinator.core._refused_writer``), else
    None. Its own records it never re-applies; they are the view's facts. (Its check
    that an outcome answers a command it sent is not mirrored: commands are not read.)"""
    env = record.envelope
    if env.producer == COORDINATOR_PRODUCER or saga.started_by is None:
        return None  # the saga's tenant and starter are known from its SagaStarted
    if env.tenant_id != saga.tenant_id:
        return f"tenant {env.tenant_id!r}, but the saga belongs to tenant {saga.tenant_id!r}"
    if isinstance(record, IncidentResolved):
        refused = _resolution_refused(saga, record)
        if refused is not None:
            return refused
    if isinstance(record, IncidentRaised):
        held = saga.incident_labels.get(record.incident_id)
        if held is not None and held != (record.kind, record.step_id):
            # As coordinator.core._on_incident_raised: an id names one incident, also
            # once it is resolved.
            return f"incident id {record.incident_id} already names another incident"
    if not bind_writers:
        return None
    if isinstance(record, AGENT_DRIVEN) and env.producer != saga.started_by:
        return f"the saga was started by {saga.started_by!r}; only it drives the saga"
    if isinstance(record, PARTICIPANT_OUTCOMES):
        if record.step_id is None:
            return "an incident from a participant must name a step of this saga"
        step = saga.steps.get(record.step_id)
        if step is not None and step.participant != "?" and env.producer != step.participant:
            return (
                f"step {record.step_id} runs on participant {step.participant!r}; "
                f"{env.producer!r} may not report its outcome"
            )
    return None


def _new_generation(saga: SagaView, at: int) -> None:
    """The old run's approval requests are stale (a grant of them is rejected): the
    coordinator asks again, with ids of its own, so none is shown pending."""
    for requests in (saga.pending_approvals, saga.expired_approvals):
        for request in list(requests.values()):
            del requests[request.approval_id]
            step = saga.steps.get(request.step_id)
            if step is not None:
                superseded = f"superseded by generation {saga.generation}"
                _close_approval(step, request.approval_id, at, superseded)


def _supersede_incidents(saga: SagaView, record: IncidentRaised) -> None:
    """An unknown outcome a later run asked again (same step and kind) replaces the
    earlier run's incident: a resolution copies its incident's generation, so one of
    the old incident would be stale. As ``sagaline incidents list`` shows it. No other
    incident is asked again: an earlier run's stays open on its own."""
    if record.kind not in SETTLES_UNKNOWN:
        return
    generation = record.envelope.generation
    for old in list(saga.open_incidents.values()):
        if (
            old.step_id == record.step_id
            and old.kind == record.kind
            and old.envelope.generation < generation
        ):
            del saga.open_incidents[old.incident_id]
            saga.settled_incidents[old.incident_id] = (
                f"superseded by {record.incident_id} (generation {generation})"
            )


def _cancel_forward_approvals(saga: SagaView, at: int) -> None:
    """A compensation is asked for only once the saga turned around, and then the
    coordinator has cancelled every step still awaiting a forward approval (never
    dispatched; ``_maybe_start_compensating``), writing no record of it: no one is
    waited for any more, so none is shown pending."""
    for requests in (saga.pending_approvals, saga.expired_approvals):
        for request in [a for a in requests.values() if a.purpose is ApprovalPurpose.FORWARD]:
            del requests[request.approval_id]
            step = saga.steps.get(request.step_id)
            if step is None:
                continue
            _close_approval(step, request.approval_id, at, "cancelled: the saga is compensating")
            if step.state in ("awaiting approval", "approval expired"):
                step.state = "cancelled"


def _expire(saga: SagaView, request: ApprovalRequested) -> None:
    saga.pending_approvals.pop(request.approval_id, None)
    saga.expired_approvals[request.approval_id] = request
    step = saga.steps.get(request.step_id)
    if step is None:
        return
    span = step.open_span(SpanKind.APPROVAL, request.approval_id)
    if span is not None:
        span.end = max(request.expires_at, span.start)
        span.outcome = "expired"
        span.label = f"{request.purpose.value.lower()} approval expired"
    if step.state == "awaiting approval":
        step.state = "approval expired"


def _close_approval(step: StepView, approval_id: str, at: int, outcome: str) -> None:
    span = step.open_span(SpanKind.APPROVAL, approval_id)
    if span is None:  # expired by our clock, but decided in time after all
        span = next(
            (
                s
                for s in reversed(step.spans)
                if s.kind is SpanKind.APPROVAL and s.ref == approval_id and s.outcome == "expired"
            ),
            None,
        )
    if span is not None:
        span.end = max(at, span.start)
        span.outcome = outcome
        span.label = outcome
