"""Property tests of the pure coordinator core (hypothesis).

A simulator plays random sagas against ``decide``/``tick``: chains and DAGs with
explicit ``depends_on``, pivots, IRREVERSIBLE steps with grants, mismatched grants
and denials, shared resources, transient and business failures, unknown outcomes,
failing and asynchronously accepted compensations, reversal windows. It acts as the
agent, every participant (answering each command with an outcome drawn by hypothesis,
keeping the provider's own truth) and the operator, advances time only through
``tick``, and injects redeliveries, the coordinator's own echoes and stale-generation
copies. Each test checks one invariant over the recorded run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from coordinator_ledger import Ledger
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator import (
    CorePolicy,
    Decision,
    Destination,
    Output,
    SagaState,
    StepStatus,
    decide,
    fold,
    tick,
)
from schemas import (
    ApprovalPurpose,
    ApprovalRequested,
    CompensateStep,
    CompensationApproval,
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
    SagaOutcome,
    SagaTerminal,
    TerminalStatus,
)
from schemas.receipt import Disposition

POLICY = CorePolicy(approval_ttl_ms=5_000, reconcile_rounds=3)
PROPERTY_SETTINGS = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Strategies are built once: constructing them per draw costs more than the core does.
_BOOL = st.booleans()
_SIZES = st.sampled_from([0, 1, 2, 2, 3, 3, 4, 4, 5, 6])
_READ_ONLY = st.sampled_from([False, False, False, False, True])
_IRREVERSIBLE = st.sampled_from([False, False, False, True])
_NO_COMPENSATION = st.sampled_from([False] * 9 + [True])
_RESOURCES = st.sets(st.sampled_from(["acct", "sku"]), max_size=2)
_APPROVAL_MODES = st.sampled_from(list(CompensationApproval))
_FORWARD_ATTEMPTS = st.sampled_from([1, 2, 3, 3])
_COMPENSATION_ATTEMPTS = st.integers(min_value=1, max_value=4)
_WINDOWS = st.sampled_from([None, None, None, None, 150, 20_000])
_GENERATIONS = st.sampled_from([1, 2])
_EARLY_END = st.integers(0, 9)
_EXECUTE = st.sampled_from(["commit"] * 8 + ["transient"] * 2 + ["business", "unknown"])
_RECONCILE_PENDING = st.sampled_from([False, False, True])
_COMPENSATE = st.sampled_from(["commit"] * 4 + ["accept", "transient", "transient", "business"])
_VERIFIED = st.sampled_from([True, True, True, False])
_OPERATOR = st.sampled_from(["grant"] * 8 + ["mismatch", "deny", "ignore"])


@functools.cache
def _index(n: int) -> st.SearchStrategy[int]:
    return st.integers(0, n - 1)


@functools.cache
def _choice(options: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.sampled_from(options)


@functools.cache
def _subsets(i: int) -> st.SearchStrategy[set[str]]:
    return st.sets(st.sampled_from([f"s{j}" for j in range(i)]))


_FINISHED = {StepStatus.COMPENSATION_FAILED, StepStatus.HELD, StepStatus.ESCALATED}

# ------------------------------------------------------------------------ plans


@dataclass(frozen=True)
class StepPlan:
    step_id: str
    depends_on: list[str] | None
    pivot: bool
    irreversible: bool
    read_only: bool
    no_compensation: bool
    resources: list[str]
    has_lookup: bool
    has_verify: bool
    approval: CompensationApproval
    forward_attempts: int
    compensation_attempts: int
    window_ms: int | None

    def contract_kw(self) -> dict[str, Any]:
        compensation: str | None = None if self.no_compensation else f"undo_{self.step_id}"
        if self.read_only:
            compensation = None
        return {
            "participant": f"p{int(self.step_id[1:]) % 2}",
            "compensation": compensation,
            "reversibility": (
                Reversibility.IRREVERSIBLE if self.irreversible else Reversibility.COMPENSATABLE
            ),
            "pivot": self.pivot,
            "read_only": self.read_only,
            "has_lookup": self.has_lookup,
            "has_verify": self.has_verify,
            "resources": self.resources,
            "reversal_window_ms": self.window_ms,
            "compensation_approval": self.approval,
            "retry": RetryPolicy(
                max_attempts=self.forward_attempts, initial_backoff_ms=100, max_backoff_ms=400
            ),
            "compensation_retry": RetryPolicy(
                max_attempts=self.compensation_attempts, initial_backoff_ms=100, max_backoff_ms=800
            ),
            "completion_within_ms": 2_000,  # an Accepted may complete late, or never (R12)
            "owner": f"team-{self.step_id}",
        }


@dataclass(frozen=True)
class SagaPlan:
    steps: list[StepPlan]
    continue_on_compensation_failure: bool
    generation: int
    fails_at: str | None  # a step whose first attempt is rejected: forces an unwind

    def dependencies(self) -> dict[str, list[str]]:
        """The graph as the protocol defines it, computed independently of the core."""
        deps: dict[str, list[str]] = {}
        for i, step in enumerate(self.steps):
            if step.depends_on is not None:
                deps[step.step_id] = list(step.depends_on)
            else:
                deps[step.step_id] = [self.steps[i - 1].step_id] if i else []
        return deps

    def dependents_of(self, step_id: str) -> set[str]:
        deps = self.dependencies()
        found: set[str] = set()
        frontier = {step_id}
        while frontier:
            frontier = {s for s, ds in deps.items() if set(ds) & frontier} - found
            found |= frontier
        return found


@st.composite
def saga_plans(draw: st.DrawFn) -> SagaPlan:
    n = draw(_SIZES)
    pivot_at = draw(st.none() | _index(max(n, 1)))
    steps = []
    for i in range(n):
        earlier = [f"s{j}" for j in range(i)]
        explicit = bool(earlier) and draw(_BOOL)
        depends_on = sorted(draw(_subsets(i))) if explicit else None
        read_only = draw(_READ_ONLY)
        steps.append(
            StepPlan(
                step_id=f"s{i}",
                depends_on=depends_on,
                pivot=pivot_at == i and not read_only,
                irreversible=draw(_IRREVERSIBLE),
                read_only=read_only,
                no_compensation=draw(_NO_COMPENSATION),
                resources=sorted(draw(_RESOURCES)),
                has_lookup=draw(_BOOL),
                has_verify=draw(_BOOL),
                approval=draw(_APPROVAL_MODES),
                forward_attempts=draw(_FORWARD_ATTEMPTS),
                compensation_attempts=draw(_COMPENSATION_ATTEMPTS),
                window_ms=draw(_WINDOWS),
            )
        )
    return SagaPlan(
        steps=steps,
        continue_on_compensation_failure=draw(_BOOL),
        generation=draw(_GENERATIONS),
        fails_at=(f"s{draw(_index(n))}" if n and draw(_BOOL) else None),
    )


# -------------------------------------------------------------------- simulator


@dataclass
class Run:
    """What one simulated saga did, for the invariants to read."""

    plan: SagaPlan
    state: SagaState | None = None
    log: list[Record] = field(default_factory=list)  # everything on sagaline.events
    terminals: list[SagaTerminal] = field(default_factory=list)
    compensations: list[tuple[str, int]] = field(default_factory=list)
    truth_committed: set[str] = field(default_factory=set)  # the providers' own view
    compensated_ok: set[str] = field(default_factory=set)
    not_committed_compensated: list[str] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    resources: list[str] = field(default_factory=list)
    after_pivot: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


class Simulator:
    def __init__(self, plan: SagaPlan, data: st.DataObject) -> None:
        self.plan = plan
        self.data = data
        self.by_id = {s.step_id: s for s in plan.steps}
        self.ledger = Ledger("saga-p", generation=plan.generation)
        self.run = Run(plan)
        self.now = 1_000_000
        self.delivered: list[Record] = []  # foreign records, for redelivery
        self.own: list[Record] = []
        self.commands: list[Record] = []  # sent, not answered
        self.approvals: list[ApprovalRequested] = []
        self.accepted: list[tuple[str, int]] = []
        self.unknown_incidents: list[IncidentRaised] = []
        self.other_incidents: list[IncidentRaised] = []
        self.comp_outstanding: set[str] = set()
        self.scheduled = 0
        self.ended = False

    # -- plumbing

    @property
    def state(self) -> SagaState | None:
        return self.run.state

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        return self.data.draw(strategy)

    def make(self, build: Any) -> Record:
        self.ledger.clock = self.now
        record: Record = build()
        self.now = self.ledger.clock
        return record

    def deliver(self, record: Record) -> None:
        self.now = max(self.now, record.envelope.occurred_at)
        self._fire_due()
        self.delivered.append(record)
        self.run.log.append(record)
        self._take(decide(self.state, record, self.now, POLICY))

    def tick_now(self) -> None:
        state = self.state
        assert state is not None
        due = state.next_due_at()
        if due is not None:
            self.now = max(self.now, due)
            self._take(tick(state, self.now, POLICY))

    def _fire_due(self) -> None:
        # Like the shell: timers that are due fire before the next record is processed.
        state = self.state
        if state is not None and (due := state.next_due_at()) is not None and due <= self.now:
            self._take(tick(state, self.now, POLICY))

    def _take(self, decision: Decision) -> None:
        before = self.state
        self.run.state = decision.state
        for out in decision.outputs:
            self._observe(out, before)
        self._check_resources()

    def _observe(self, out: Output, before: SagaState | None) -> None:
        record = out.record
        if out.appends_to_events:
            self.run.log.append(record)
            self.own.append(record)
        if out.destination is Destination.COMMAND:
            self.commands.append(record)
            if isinstance(record, CompensateStep):
                self._check_compensation(record)
        elif isinstance(record, ApprovalRequested):
            self.approvals.append(record)
            if record.purpose is ApprovalPurpose.COMPENSATION:
                self._check_order(record.step_id)
        elif isinstance(record, SagaTerminal):
            self.run.terminals.append(record)
        elif isinstance(record, IncidentRaised):
            if record.kind == "compensation-not-completed" and record.step_id is not None:
                # R12: the declared wait passed; the coordinator stopped waiting and
                # handed the step to a person, so its compensation no longer holds
                # the resources and a completion will not come.
                self.comp_outstanding.discard(record.step_id)
                self.accepted = [a for a in self.accepted if a[0] != record.step_id]
            target = (
                self.unknown_incidents
                if record.kind == "unknown-outcome"
                else (self.other_incidents)
            )
            target.append(record)

    # -- invariants checked at the moment they apply

    def _check_compensation(self, cmd: CompensateStep) -> None:
        run, step = self.run, cmd.step_id
        run.compensations.append((step, cmd.attempt))
        if step not in run.truth_committed or self.by_id[step].read_only:
            run.not_committed_compensated.append(step)
        if step in run.compensated_ok or step in self.comp_outstanding:
            run.twice.append(f"{step} attempt {cmd.attempt}")
        if any(
            self.by_id[p.step_id].pivot
            for p in self.plan.steps
            if p.step_id in (run.truth_committed)
        ):
            run.after_pivot.append(step)
        for other in self.comp_outstanding:
            if set(self.by_id[other].resources) & set(self.by_id[step].resources):
                run.resources.append(f"{step} while {other} is compensating")
        if cmd.attempt == 1 and self.by_id[step].approval is not CompensationApproval.REQUIRE:
            self._check_order(step)
        self.comp_outstanding.add(step)

    def _check_order(self, step: str) -> None:
        state = self.state
        assert state is not None
        for dependent in self.plan.dependents_of(step):
            if dependent not in self.run.truth_committed or self.by_id[dependent].read_only:
                continue
            if dependent in state.steps and (
                dependent in self.run.compensated_ok or state.steps[dependent].status in _FINISHED
            ):
                continue
            self.run.order.append(f"{step} before its dependent {dependent}")

    def _check_resources(self) -> None:
        state = self.state
        if state is None:
            return
        active = [
            s
            for s in state.steps.values()
            if s.status
            in {
                StepStatus.COMPENSATING,
                StepStatus.COMPENSATION_ACCEPTED,
                StepStatus.COMPENSATION_RETRY_WAIT,
                StepStatus.AWAITING_COMPENSATION_APPROVAL,
            }
        ]
        for i, a in enumerate(active):
            for b in active[i + 1 :]:
                if set(a.contract.resources) & set(b.contract.resources):
                    self.run.resources.append(f"{a.step_id} and {b.step_id} at once")

    # -- actors

    def actions(self) -> list[str]:
        state = self.state
        assert state is not None
        acts = []
        all_scheduled = self.scheduled == len(self.plan.steps)
        if not self.ended and not all_scheduled:
            acts += ["schedule"] * 3
        if not self.ended and (all_scheduled or self.draw(_EARLY_END) == 0):
            acts.append("end")  # an early end is an abort: rarer
        if self.commands:
            acts += ["answer"] * 6
        if self.approvals:
            acts += ["approve"] * 4
        if self.accepted:
            acts.append("complete")
        if self.unknown_incidents or self.other_incidents:
            acts.append("resolve")
        if state.next_due_at() is not None:
            acts.append("tick")
        if self.delivered:
            acts += ["duplicate", "stale"]
        if self.own:
            acts.append("echo")
        return acts

    def act(self, action: str, *, drain: bool = False) -> None:
        getattr(self, f"_do_{action}")(drain)

    def _do_schedule(self, drain: bool) -> None:
        step = self.plan.steps[self.scheduled]
        self.scheduled += 1
        self.deliver(
            self.make(
                lambda: self.ledger.scheduled(
                    step.step_id, depends_on=step.depends_on, **step.contract_kw()
                )
            )
        )

    def _do_end(self, drain: bool) -> None:
        self.ended = True
        complete = self.scheduled == len(self.plan.steps) and (drain or self.draw(_BOOL))
        outcome = SagaOutcome.COMPLETE if complete else SagaOutcome.ABORT
        self.deliver(self.make(lambda: self.ledger.end(outcome)))

    def _do_answer(self, drain: bool) -> None:
        index = 0 if drain else self.draw(_index(len(self.commands)))
        cmd = self.commands.pop(index)
        if isinstance(cmd, ExecuteStep):
            self._answer_execute(cmd, drain)
        elif isinstance(cmd, ReconcileStep):
            self._answer_reconcile(cmd, drain)
        elif isinstance(cmd, CompensateStep):
            self._answer_compensate(cmd, drain)

    def _answer_execute(self, cmd: ExecuteStep, drain: bool) -> None:
        step, attempt, ledger = cmd.step_id, cmd.attempt, self.ledger
        if not drain and self.draw(_BOOL):
            self.deliver(self.make(lambda: ledger.intent(step, attempt)))
        if step in self.run.truth_committed or drain:
            outcome = "commit"  # the provider deduplicates by idempotency key
        elif step == self.plan.fails_at and attempt == 1:
            outcome = "business"
        else:
            outcome = self.draw(_EXECUTE)
        if outcome == "commit":
            self.run.truth_committed.add(step)
            self.deliver(self.make(lambda: ledger.committed(step, attempt)))
        elif outcome == "unknown":
            if self.draw(_BOOL):
                self.run.truth_committed.add(step)
            self.deliver(self.make(lambda: ledger.unknown(step, attempt)))
        else:
            kind = (
                FailureKind.TRANSIENT if outcome == "transient" else FailureKind.BUSINESS_REJECTION
            )
            self.deliver(self.make(lambda: ledger.failed(step, attempt, kind)))

    def _answer_reconcile(self, cmd: ReconcileStep, drain: bool) -> None:
        step = cmd.step_id
        if not drain and self.draw(_RECONCILE_PENDING):
            result = ReconcileResult.PENDING
        elif step in self.run.truth_committed:
            result = ReconcileResult.COMMITTED
        else:
            result = ReconcileResult.NOT_FOUND
        self.deliver(self.make(lambda: self.ledger.reconciled(step, result, cmd.attempt)))

    def _answer_compensate(self, cmd: CompensateStep, drain: bool) -> None:
        step, attempt, ledger = cmd.step_id, cmd.attempt, self.ledger
        plan = self.by_id[step]
        outcome = "commit" if drain else self.draw(_COMPENSATE)
        if outcome == "accept":
            self.accepted.append((step, attempt))
            self.deliver(self.make(lambda: ledger.comp_accepted(step, attempt)))
            return
        self.comp_outstanding.discard(step)
        if outcome == "commit":
            self._compensation_committed(step, attempt, drain)
        else:
            kind = (
                FailureKind.TRANSIENT if outcome == "transient" else FailureKind.BUSINESS_REJECTION
            )
            self.deliver(self.make(lambda: ledger.comp_failed(step, attempt, kind)))
        del plan

    def _compensation_committed(self, step: str, attempt: int, drain: bool) -> None:
        plan = self.by_id[step]
        verified: bool | None = None
        if plan.has_verify:
            verified = True if drain else self.draw(_VERIFIED)
        if verified is not False:
            self.run.compensated_ok.add(step)
        self.deliver(self.make(lambda: self.ledger.comp_committed(step, attempt, verified)))

    def _do_complete(self, drain: bool) -> None:
        index = 0 if drain else self.draw(_index(len(self.accepted)))
        step, attempt = self.accepted.pop(index)
        self.comp_outstanding.discard(step)
        self._compensation_committed(step, attempt, drain)

    def _do_approve(self, drain: bool) -> None:
        index = 0 if drain else self.draw(_index(len(self.approvals)))
        request = self.approvals.pop(index)
        choice = "grant" if drain else self.draw(_OPERATOR)
        if choice == "grant":
            self.deliver(self.make(lambda: self.ledger.grant(request)))
        elif choice == "mismatch":
            self.deliver(self.make(lambda: self.ledger.grant(request, args_fingerprint="other")))
            self.approvals.append(request)  # still pending
        elif choice == "deny":
            self.deliver(self.make(lambda: self.ledger.deny(request)))

    def _do_resolve(self, drain: bool) -> None:
        if self.unknown_incidents:
            incident = self.unknown_incidents.pop(0)
            assert incident.step_id is not None
            truth = "COMMITTED" if incident.step_id in self.run.truth_committed else "NOT_FOUND"
            self.deliver(self.make(lambda: self.ledger.resolve(incident.incident_id, truth)))
        else:
            incident = self.other_incidents.pop(0)
            self.deliver(self.make(lambda: self.ledger.resolve(incident.incident_id, "handled")))

    def _do_tick(self, drain: bool) -> None:
        self.tick_now()

    def _do_duplicate(self, drain: bool) -> None:
        record = self.delivered[self.draw(_index(len(self.delivered)))]
        self._expect_no_change(record, "redelivery")

    def _do_echo(self, drain: bool) -> None:
        record = self.own[self.draw(_index(len(self.own)))]
        self._expect_no_change(record, "own echo")

    def _expect_no_change(self, record: Record, what: str) -> None:
        state = self.state
        assert state is not None
        before = state.to_bytes()
        self.run.log.append(record)  # a producer retry: the copy is in the log too
        decision = decide(state, record, self.now, POLICY)
        if decision.outputs or decision.state is None or decision.state.to_bytes() != before:
            self.run.duplicates.append(f"{what} of {record.envelope.type} changed the saga")

    def _do_stale(self, drain: bool) -> None:
        original = self.delivered[self.draw(_index(len(self.delivered)))]
        state = self.state
        assert state is not None
        if state.generation < 2:
            return
        self.now += 1
        self._fire_due()  # at the stale record's time, as the shell and fold(...) do
        envelope = original.envelope.model_copy(
            update={"event_id": f"stale-{self.now}", "generation": 1, "occurred_at": self.now}
        )
        stale = original.model_copy(update={"envelope": envelope})
        before = self.state
        assert before is not None
        decision = decide(before, stale, self.now, POLICY)
        reasons = [o.reason for o in decision.outputs]
        after = decision.state
        assert after is not None
        keep = {"seen", "rejected_count", "recent_rejections"}
        # A person's resolution of an incident the saga holds is decided whatever its
        # generation (coordinator.core.resolves_earlier_incident): a copy of one this run
        # already counted is refused as a second resolution (naming the first) rather
        # than as stale. Either way it is refused, and it changes nothing.
        expected = (
            {"stale-generation", "invalid-transition"}
            if isinstance(stale, IncidentResolved)
            else {"stale-generation"}
        )
        if (
            len(reasons) != 1
            or reasons[0] not in expected
            or after.model_dump(exclude=keep) != before.model_dump(exclude=keep)
        ):
            self.run.duplicates.append(f"stale {original.envelope.type} was not just rejected")
        self.run.log.append(stale)
        self.run.state = after

    # -- the whole run

    def play(self) -> Run:
        self.deliver(
            self.make(
                lambda: self.ledger.started(
                    continue_on_compensation_failure=self.plan.continue_on_compensation_failure
                )
            )
        )
        for _ in range(80):
            state = self.state
            assert state is not None
            if state.is_terminal:
                break
            self.act(self.draw(_choice(tuple(self.actions()))))
        self._drain()
        return self.run

    def _drain(self) -> None:
        """Everyone cooperates from here on: the saga must then end."""
        for _ in range(400):
            state = self.state
            assert state is not None
            if state.is_terminal:
                return
            self.approvals = [
                a
                for a in self.approvals
                if state.steps[a.step_id].status
                in {StepStatus.AWAITING_APPROVAL, StepStatus.AWAITING_COMPENSATION_APPROVAL}
                and state.steps[a.step_id].approval is not None
                and state.steps[a.step_id].approval.approval_id == a.approval_id  # type: ignore[union-attr]
            ]
            if self.commands:
                self.act("answer", drain=True)
            elif self.accepted:
                self.act("complete", drain=True)
            elif self.approvals:
                self.act("approve", drain=True)
            elif self.unknown_incidents:
                self.act("resolve", drain=True)
            elif self.scheduled < len(self.plan.steps) and not self.ended:
                self.act("schedule", drain=True)
            elif not self.ended:
                self.act("end", drain=True)
            elif state.next_due_at() is not None:
                self.tick_now()
            else:
                return


def simulate(plan: SagaPlan, data: st.DataObject) -> Run:
    return Simulator(plan, data).play()


# ------------------------------------------------------------------- invariants


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_every_saga_reaches_a_terminal_status_R14(plan: SagaPlan, data: st.DataObject) -> None:
    run = simulate(plan, data)
    assert run.state is not None and run.state.is_terminal, run.state and run.state.status
    assert len(run.terminals) == 1
    assert run.terminals[0].status.value == run.state.status.value
    assert run.state.next_due_at() is None
    event(f"terminal {run.state.status.value}")
    for incident in run.state.incidents:
        event(f"incident {incident.kind}")
    if run.compensations:
        event("compensated something")
    committed = len(run.truth_committed)
    event(f"committed {committed if committed < 3 else '3+'}")


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_no_step_is_compensated_unless_it_committed_R1(plan: SagaPlan, data: st.DataObject) -> None:
    run = simulate(plan, data)
    assert run.not_committed_compensated == []


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_no_step_is_compensated_twice_R8_R12(plan: SagaPlan, data: st.DataObject) -> None:
    run = simulate(plan, data)
    assert run.twice == []
    for step in {s for s, _ in run.compensations}:
        attempts = [a for s, a in run.compensations if s == step]
        assert attempts == list(range(1, len(attempts) + 1)), (step, attempts)


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_compensations_respect_reverse_dependencies_and_resources_R2_R3(
    plan: SagaPlan, data: st.DataObject
) -> None:
    run = simulate(plan, data)
    assert run.order == []
    assert run.resources == []


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_nothing_is_compensated_after_the_pivot_committed_R6(
    plan: SagaPlan, data: st.DataObject
) -> None:
    run = simulate(plan, data)
    assert run.after_pivot == []
    pivots = {s.step_id for s in plan.steps if s.pivot}
    if pivots & run.truth_committed:
        assert run.compensations == []


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_duplicates_echoes_and_stale_generations_change_nothing_R15(
    plan: SagaPlan, data: st.DataObject
) -> None:
    run = simulate(plan, data)
    assert run.duplicates == []


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_folding_the_same_log_twice_gives_the_same_state_R5(
    plan: SagaPlan, data: st.DataObject
) -> None:
    run = simulate(plan, data)
    first = fold(run.log, policy=POLICY)
    second = fold(run.log, policy=POLICY)
    assert first.keys() == second.keys() == {"saga-p"}
    assert first["saga-p"].to_bytes() == second["saga-p"].to_bytes()
    assert run.state is not None
    assert first["saga-p"].model_dump() == run.state.model_dump()  # the log is the truth


@PROPERTY_SETTINGS
@given(plan=saga_plans(), data=st.data())
def test_receipt_accounts_for_every_committed_effect_R14(
    plan: SagaPlan, data: st.DataObject
) -> None:
    run = simulate(plan, data)
    [record] = run.terminals
    receipt = Receipt.from_json(record.receipt)
    by_step = {s.step_id: s for s in receipt.steps}
    for plan_step in plan.steps:
        entry = by_step.get(plan_step.step_id)
        if entry is None:
            continue  # never scheduled
        if plan_step.read_only:
            assert entry.disposition is Disposition.READ_ONLY
        elif plan_step.step_id in run.truth_committed:
            assert entry.disposition in {
                Disposition.RETAINED,
                Disposition.COMPENSATED,
                Disposition.ESCALATED,
            }, entry
        else:
            assert entry.disposition in {Disposition.NOT_COMMITTED, Disposition.ESCALATED}, entry
        if entry.disposition is Disposition.COMPENSATED:
            assert plan_step.step_id in run.compensated_ok
        if entry.disposition is Disposition.ESCALATED:
            assert entry.incident_id is not None and entry.owner == f"team-{plan_step.step_id}"
    dispositions = {s.disposition for s in receipt.steps}
    if receipt.status is TerminalStatus.COMPLETED:
        assert run.compensations == []
        assert dispositions <= {
            Disposition.RETAINED,
            Disposition.READ_ONLY,
            Disposition.NOT_COMMITTED,
        }
    if receipt.status is TerminalStatus.COMPENSATED:
        assert dispositions <= {
            Disposition.COMPENSATED,
            Disposition.NOT_COMMITTED,
            Disposition.READ_ONLY,
        }
    if receipt.status is TerminalStatus.ESCALATED:
        assert receipt.unresolved and receipt.owner
