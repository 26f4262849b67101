"""The reverse dependency graph the unwind reads (R2, R3): holds, order, resources,
in the pure core (``coordinator/graph.py`` and the unwind of ``coordinator/core.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from coordinator_ledger import (
    Harness,
    Ledger,
    compensates,
    executes,
    fresh,
    incidents,
    receipt_of,
)

import coordinator.graph as graph
from coordinator.state import StepStatus
from sagaline.ops.receipts import describe_receipt, render_receipt_text
from schemas import FailureKind, RetryPolicy, SagaOutcome, TerminalStatus

_DEPENDENTS = graph.dependents  # the real one, for the counting wrappers


def ladder(layers: int, *, bottom_fails: bool) -> tuple[Ledger, Harness]:
    """A write step ``a``, then ``layers`` layers of two read-only lookups, each
    depending explicitly on both of the layer before (a ladder of diamonds), and, with
    ``bottom_fails``, a write step ``w`` at the bottom whose compensation fails."""
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("a", depends_on=[]), ledger.committed("a"))
    previous = ["a"]
    for i in range(layers):
        layer = [f"x{i}", f"y{i}"]
        for step in layer:
            h.feed(ledger.scheduled(step, depends_on=previous, read_only=True))
            h.feed(ledger.committed(step))
        previous = layer
    if bottom_fails:
        h.feed(
            ledger.scheduled(
                "w", depends_on=previous, compensation_retry=RetryPolicy(max_attempts=1)
            ),
            ledger.committed("w"),
        )
    h.feed(ledger.scheduled("boom", depends_on=[]))
    return ledger, h


@pytest.mark.parametrize("bottom_fails", [False, True])
def test_holds_through_diamonds_of_read_only_steps_are_linear_not_exponential_R3(
    monkeypatch: Any, bottom_fails: bool
) -> None:
    """Whether ``a`` is held depends on what lies below the read-only lookups that
    depend on it (R3). Deciding it must visit each step once: walked path by path, a
    ladder of diamonds costs 2**layers walks, and at a few dozen layers (well inside
    the 256 steps a saga may have) one record of one saga stops the coordinator's
    whole partition."""
    ledger, h = ladder(12, bottom_fails=bottom_fails)
    calls = 0

    def counting(state: Any) -> Any:
        nonlocal calls
        calls += 1
        return _DEPENDENTS(state)

    monkeypatch.setattr(graph, "dependents", counting)
    out = h.feed(ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    if bottom_fails:
        assert compensates(out) == ["w"]
        out = h.feed(ledger.comp_failed("w"))
        assert h.s.steps["a"].status is StepStatus.HELD  # held through every lookup
    else:
        assert compensates(out) == ["a"]
    steps = len(h.s.steps)
    assert calls <= 8 * steps, f"{calls} walks of the graph for {steps} steps"


def test_a_compensation_waits_for_a_step_still_running_on_its_resource_R2() -> None:
    """``hold`` and ``restock`` both touch ``stock`` but do not depend on each other.
    When the saga turns around while ``restock`` is still running, undoing ``hold``
    must wait for it (R2: a compensation waits for a write on its resource), or
    ``release_hold`` runs on the stock while ``restock`` is changing it; once
    ``restock`` commits, it is undone first, then ``hold``."""
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("hold", depends_on=[], resources=["stock"]))
    h.feed(ledger.committed("hold"))
    h.feed(ledger.scheduled("restock", depends_on=[], resources=["stock"]))
    h.feed(ledger.scheduled("note", depends_on=[]), ledger.committed("note"))
    h.feed(ledger.scheduled("boom", depends_on=[]))
    out = h.feed(ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    assert h.status("restock") == "DISPATCHED"
    assert compensates(out) == ["note"]  # another resource: not held
    out = h.feed(ledger.intent("restock"))
    assert compensates(out) == []
    out = h.feed(ledger.committed("restock"))
    assert compensates(out) == ["restock"]
    assert compensates(h.feed(ledger.comp_committed("restock"))) == ["hold"]


def test_independent_forward_steps_on_one_resource_run_at_once_as_rule_R2_says() -> None:
    """Resources order compensations only: two forward steps on one declared resource
    with no dependency between them are dispatched together, and ``depends_on`` is
    what orders them. R2 in docs/rules.md said "Steps that touch the same declared
    resource are serialized", which the forward dispatch never did."""
    ledger, h = fresh()
    h.feed(ledger.started())
    out = h.feed(
        ledger.scheduled("hold", depends_on=[], resources=["stock"]),
        ledger.scheduled("restock", depends_on=[], resources=["stock"]),
    )
    assert executes(out) == ["hold", "restock"]
    r2 = (Path(__file__).resolve().parents[1] / "docs" / "rules.md").read_text()
    r2 = " ".join(r2.split("- R2 ", 1)[1].split("\n- R3 ", 1)[0].split())
    assert "Steps that touch the same declared resource are serialized" not in r2, r2
    assert "Forward steps are not serialized by resource" in r2, r2


def test_a_compensation_on_a_resource_goes_ahead_when_the_step_running_there_fails_R2() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(ledger.scheduled("hold", depends_on=[], resources=["stock"]))
    h.feed(ledger.committed("hold"))
    h.feed(ledger.scheduled("restock", depends_on=[], resources=["stock"]))
    h.feed(ledger.end(SagaOutcome.ABORT))
    assert compensates(h.outputs) == []
    out = h.feed(ledger.failed("restock", kind=FailureKind.BUSINESS_REJECTION))
    assert compensates(out) == ["hold"]


def test_a_hold_through_a_lookup_names_the_effect_left_in_the_world_R3() -> None:
    """``a`` is held because ``w``, below the read-only lookups that depend on it, was
    not undone. The hold's incident and note must name ``w``: the lookup that depends
    on ``a`` directly changed nothing, and a receipt reader (the receipt's story skips
    read-only steps) could not find what keeps ``a`` in place."""
    ledger, h = ladder(2, bottom_fails=True)
    h.feed(ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    out = h.feed(ledger.comp_failed("w"))
    held = [i for i in incidents(out) if i.kind == "compensation-held"]
    assert [i.step_id for i in held] == ["a"]
    assert "w (w)" in held[0].inconsistency, held[0].inconsistency
    assert "w" in h.s.steps["a"].note.split(), h.s.steps["a"].note


def graph_reads_for_an_unwind(monkeypatch: Any, steps: int) -> int:
    """The most times one decision of the core reads the dependency graph while
    unwinding a saga of ``steps`` steps, each depending explicitly on every step before
    it."""
    ledger, h = fresh()
    h.feed(ledger.started())
    ids: list[str] = []
    for i in range(steps):
        h.feed(ledger.scheduled(f"s{i}", depends_on=list(ids)), ledger.committed(f"s{i}"))
        ids.append(f"s{i}")
    calls = 0

    def counting(state: Any) -> Any:
        nonlocal calls
        calls += 1
        return _DEPENDENTS(state)

    monkeypatch.setattr(graph, "dependents", counting)
    order = compensates(h.feed(ledger.end(SagaOutcome.ABORT)))
    most = calls
    for step in reversed(ids):
        before = calls
        order += compensates(h.feed(ledger.comp_committed(step)))
        most = max(most, calls - before)
    assert order == list(reversed(ids))  # R2: each after everything that depends on it
    assert h.s.status.value == "COMPENSATED"
    return most


def test_each_decision_of_an_unwind_reads_the_graph_a_fixed_number_of_times_R2(
    monkeypatch: Any,
) -> None:
    """Each pending step used to read the whole graph (every step and edge) for its
    hold and again for its readiness, on every decision: a saga of 255 steps, each
    depending on those before it, took about a second of the coordinator's one
    decision loop per record of its unwind (about 4 minutes in all), every other saga
    of the partition waiting behind it. A decision reads the graph a fixed number of
    times, however many steps are pending."""
    small = graph_reads_for_an_unwind(monkeypatch, 5)
    large = graph_reads_for_an_unwind(monkeypatch, 40)
    assert large <= small, f"{large} graph reads in a decision at 40 steps, {small} at 5"


def test_an_effect_a_person_resolved_before_the_end_is_not_left_pending_R3_R14() -> None:
    """``a``'s compensation failed finally (R3); while the other branch was still being
    undone, a person resolved its incident. The saga ends ESCALATED (an effect was
    handed to a person, and the receipt names it), but its story must not tell the
    reader ``a`` still needs them: the receipt's incident says they dealt with it, as a
    resolution given after the end does (``later_resolutions``)."""
    ledger, h = fresh()
    h.feed(ledger.started())
    h.feed(
        ledger.scheduled("a", depends_on=[], compensation_retry=RetryPolicy(max_attempts=1)),
        ledger.committed("a"),
    )
    h.feed(ledger.scheduled("c", depends_on=[]), ledger.committed("c"))
    h.feed(ledger.scheduled("e", depends_on=[]))
    h.feed(ledger.failed("e", kind=FailureKind.BUSINESS_REJECTION))
    [raised] = incidents(h.feed(ledger.comp_failed("a")))
    h.feed(ledger.resolve(raised.incident_id, "voided by hand in the provider console"))
    receipt = receipt_of(h.feed(ledger.comp_committed("c")))
    assert receipt.status is TerminalStatus.ESCALATED
    assert receipt.unresolved == ["a"]  # handed to a person: see its (resolved) incident
    story = describe_receipt(receipt)
    pending = [s for s in story.sections if s.key == "pending"]
    assert pending == [], pending
    text = render_receipt_text(receipt)
    assert text.count("voided by hand in the provider console") == 1, text
    assert "needs operations" not in text, text
