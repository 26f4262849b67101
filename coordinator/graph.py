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
    return _blocks(step, dependents(state), {})


def _blocks(step: StepState, direct: dict[str, list[StepState]], memo: dict[str, bool]) -> bool:
    """``blocks_upstream`` with the graph read once and each step decided once: read-only
    steps may form diamonds, and walked path by path they cost 2**depth."""
    known = memo.get(step.step_id)
    if known is not None:
        return known
    if step.status in {StepStatus.COMPENSATION_FAILED, StepStatus.HELD, StepStatus.ESCALATED}:
        blocks = True
    elif step.status is StepStatus.COMMITTED and step.contract.read_only:
        blocks = any(
            child.explicit and _blocks(child, direct, memo) for child in direct[step.step_id]
        )
    else:
        blocks = False
    memo[step.step_id] = blocks
    return blocks


def holding_dependent(state: SagaState, step: StepState) -> StepState | None:
    """The dependent, over an explicit edge, whose unresolved effect holds ``step``.

    None when the unwind may proceed (implicit edges never hold, R3).
    """
    direct = dependents(state)
    memo: dict[str, bool] = {}
    for child in direct[step.step_id]:
        if child.explicit and _blocks(child, direct, memo):
            return child
    return None


def effect_left(state: SagaState, holder: StepState) -> StepState:
    """The step whose effect, left in the world, makes ``holder`` hold (R3): ``holder``
    itself, or for a read-only holder the step below it, over explicit edges, that was
    not undone (a lookup changed nothing, so naming it tells a person nothing)."""
    direct = dependents(state)
    memo: dict[str, bool] = {}
    step = holder
    while step.status is StepStatus.COMMITTED and step.contract.read_only:
        below = next(
            (c for c in direct[step.step_id] if c.explicit and _blocks(c, direct, memo)), None
        )
        if below is None:
            break
        step = below
    return step


def ready_to_compensate(state: SagaState, step: StepState) -> bool:
    """Every step that depends on ``step`` (transitively) is finished (R2)."""
    return all(finished_for_unwind(d) for d in transitive_dependents(state, step.step_id))


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
