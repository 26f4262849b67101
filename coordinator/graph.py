"""The dependency graph of a saga's steps, read for compensation (R2, R3).

Edges run from a step to the steps it depends on: the implicit chain (``depends_on``
None means "the step scheduled just before") plus explicit ``depends_on`` lists. A
step is only scheduled against steps that already exist, so the graph is a DAG in
scheduling order. Compensation runs the graph in reverse: a step is undone only once
everything that depends on it is finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.state import (
    COMPENSATION_ACTIVE,
    COMPENSATION_FINAL,
    NEVER_COMMITTED,
    SagaState,
    StepState,
    StepStatus,
)


def dependents(state: SagaState) -> dict[str, list[StepState]]:
    """For each step, the steps that depend on it directly (in scheduling order)."""
    result: dict[str, list[StepState]] = {step_id: [] for step_id in state.steps}
    for step in state.steps.values():
        for dep in step.depends_on:
            result[dep].append(step)
    return result


def transitive_dependents(state: SagaState, step_id: str) -> list[StepState]:
    """Every step that depends on ``step_id`` through any path."""
    direct = dependents(state)
    found: dict[str, StepState] = {}
    stack = [step_id]
    while stack:
        for child in direct[stack.pop()]:
            if child.step_id not in found:
                found[child.step_id] = child
                stack.append(child.step_id)
    return sorted(found.values(), key=lambda s: s.index)


def finished_for_unwind(step: StepState) -> bool:
    """True when the unwind no longer waits on this step's own effect.

    Never-committed and read-only steps leave nothing to undo; final compensation
    states are done one way or another. Anything in flight or still to undo is not.
    """
    if step.status in NEVER_COMMITTED or step.status in COMPENSATION_FINAL:
        return True
    return step.status is StepStatus.COMMITTED and step.contract.read_only


def blocks_upstream(state: SagaState, step: StepState) -> bool:
    """Whether this step's effect stays in the world after the unwind gave up on it,
    so the steps it explicitly depends on must be held (R3).

    A read-only step passes a block through from its own explicit dependents.
    """
    return UnwindView(state).blocks(step)


def holding_dependent(state: SagaState, step: StepState) -> StepState | None:
    """The dependent, over an explicit edge, whose unresolved effect holds ``step``.

    None when the unwind may proceed (implicit edges never hold, R3).
    """
    return UnwindView(state).holding_dependent(step)


def effect_left(state: SagaState, holder: StepState) -> StepState:
    """The step whose effect, left in the world, makes ``holder`` hold (R3): ``holder``
    itself, or for a read-only holder the step below it, over explicit edges, that was
    not undone (a lookup changed nothing, so naming it tells a person nothing)."""
    return UnwindView(state).effect_left(holder)


def ready_to_compensate(state: SagaState, step: StepState) -> bool:
    """Every step that depends on ``step`` (transitively) is finished (R2)."""
    return step.step_id not in UnwindView(state).waiting()


class UnwindView:
    """The graph as one decision of the unwind reads it: the edges are read once, and
    each step is looked at once, however many steps are pending. Asking the questions
    above step by step read every step and edge for every pending step, a second or so
    per decision for a saga of a few hundred densely connected steps.

    ``blocks`` answers are remembered for read-only steps only (the ones that recurse);
    that is sound while the caller changes steps latest first, as the unwind does:
    a step's answer depends only on steps scheduled after it.
    """

    def __init__(self, state: SagaState) -> None:
        self.state = state
        self.direct = dependents(state)
        self._passes_block: dict[str, bool] = {}

    def blocks(self, step: StepState) -> bool:
        """``blocks_upstream``; read-only steps may form diamonds, and walked path by
        path they cost 2**depth, so each is decided once."""
        if step.status in {StepStatus.COMPENSATION_FAILED, StepStatus.HELD, StepStatus.ESCALATED}:
            return True
        if step.status is not StepStatus.COMMITTED or not step.contract.read_only:
            return False
        known = self._passes_block.get(step.step_id)
        if known is None:
            known = self.holding_dependent(step) is not None
            self._passes_block[step.step_id] = known
        return known

    def holding_dependent(self, step: StepState) -> StepState | None:
        for child in self.direct[step.step_id]:
            if child.explicit and self.blocks(child):
                return child
        return None

    def effect_left(self, holder: StepState) -> StepState:
        step = holder
        while step.status is StepStatus.COMMITTED and step.contract.read_only:
            below = self.holding_dependent(step)
            if below is None:
                break
            step = below
        return step

    def waiting(self) -> set[str]:
        """The steps some step depending on them (transitively) is not finished for
        (R2): they may not be compensated yet. Dependents are scheduled after what
        they depend on, so one sweep, latest first, settles every step."""
        waiting: set[str] = set()
        for step in reversed(self.state.steps.values()):
            if any(
                not finished_for_unwind(child) or child.step_id in waiting
                for child in self.direct[step.step_id]
            ):
                waiting.add(step.step_id)
        return waiting


def shares_resource(a: StepState, b: StepState) -> bool:
    return bool(set(a.contract.resources) & set(b.contract.resources))


def resource_conflict(candidate: StepState, active: Iterable[StepState]) -> StepState | None:
    """The step in ``active`` (a started compensation, or a write still in flight)
    that shares a declared resource with ``candidate``."""
    for other in active:
        if other.step_id != candidate.step_id and shares_resource(candidate, other):
            return other
    return None


# Every compensation not finished: an accepted one is not done until it completes
# (R12), and one waiting for its retry still has its effect in the world.
_STILL_TO_UNDO = frozenset(
    {StepStatus.COMMITTED, StepStatus.COMPENSATION_PENDING} | COMPENSATION_ACTIVE
)


def compensation_order(state: SagaState) -> list[list[str]]:
    """The unwind plan as waves, if every committed step compensated successfully:
    each wave holds steps with no committed dependents left, latest first. Useful for
    explanation (``saga show``) and tests; the core decides incrementally.
    """
    remaining = {
        s.step_id
        for s in state.steps.values()
        if s.status in _STILL_TO_UNDO and not s.contract.read_only
    }
    direct = dependents(state)

    def waiting_on(step_id: str) -> bool:
        stack, seen = [step_id], set()
        while stack:
            for child in direct[stack.pop()]:
                if child.step_id in remaining:
                    return True
                if child.step_id not in seen:
                    seen.add(child.step_id)
                    stack.append(child.step_id)
        return False

    waves: list[list[str]] = []
    while remaining:
        wave = sorted(
            (sid for sid in remaining if not waiting_on(sid)),
            key=lambda sid: -state.steps[sid].index,
        )
        waves.append(wave)
        remaining -= set(wave)
    return waves
