"""Fault injection by configuration: each mode does what the demo relies on, and
the choice of which calls are hit is deterministic."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from participants.catalogue import Catalogue
from participants.context import CallContext, call_context
from participants.declarations import CompensationContext
from services.refund import FaultMode, FaultPlan, FaultRule, build_catalogue
from services.refund.errors import (
    FaultPlanError,
    InjectedRejection,
    InjectedTransientFailure,
    Throttled,
)
from services.refund.faults import FaultInjector


def world(catalogue: Catalogue) -> Any:
    """The provider behind a catalogue's participant, to check the world."""
    participant: Any = catalogue.participants[0]
    return participant.provider


def run(catalogue: Catalogue, tool: str, key: str, **args: Any) -> Any:
    with call_context(CallContext("saga-1", "s1", tool, key)):
        return catalogue[tool].invoke(args)


def compensate(catalogue: Catalogue, tool: str, key: str, args: dict[str, Any], result: Any) -> Any:
    ctx = CompensationContext("saga-1", tool, args, result, idempotency_key=key)
    with call_context(
        CallContext("saga-1", "s1", tool, key, compensation_key=ctx.compensation_key)
    ):
        return catalogue[tool].compensate(ctx)


def plan(*rules: FaultRule, seed: int = 7) -> FaultPlan:
    return FaultPlan(seed=seed, rules=list(rules))


HOLD = {"order_id": "o-1", "sku": "sku-1", "quantity": 1}
CREDIT = {"order_id": "o-1", "amount_cents": 100}


def test_reject_raises_a_business_rejection_and_makes_no_effect(tmp_path: Path) -> None:
    """R9: the runtime sees a non-retryable error; the provider is untouched."""
    faults = plan(FaultRule(method="place_hold", mode=FaultMode.REJECT, message="no stock"))
    catalogue = build_catalogue("inventory", tmp_path, faults)
    with pytest.raises(InjectedRejection, match="no stock") as raised:
        run(catalogue, "place_hold", "k-1", **HOLD)
    assert catalogue["place_hold"].is_business_rejection(raised.value)
    assert world(catalogue).holds() == []


def test_transient_fails_n_times_per_key_then_commits_once(tmp_path: Path) -> None:
    faults = plan(FaultRule(method="issue_credit", mode=FaultMode.TRANSIENT, times=2))
    catalogue = build_catalogue("payments", tmp_path, faults)
    for _ in range(2):
        with pytest.raises(InjectedTransientFailure):
            run(catalogue, "issue_credit", "k-1", order_id="o-1", amount_cents=100)
    credit = run(catalogue, "issue_credit", "k-1", order_id="o-1", amount_cents=100)
    assert world(catalogue).credits()[0].credit_id == credit["credit_id"]
    with pytest.raises(InjectedTransientFailure):  # a new key has its own count
        run(catalogue, "issue_credit", "k-2", order_id="o-2", amount_cents=100)


def test_transient_counts_survive_a_restarted_participant(tmp_path: Path) -> None:
    faults = plan(FaultRule(method="issue_credit", mode=FaultMode.TRANSIENT, times=1))
    with pytest.raises(InjectedTransientFailure):
        run(build_catalogue("payments", tmp_path, faults), "issue_credit", "k-1", **CREDIT)
    restarted = build_catalogue("payments", tmp_path, faults)
    assert run(restarted, "issue_credit", "k-1", **CREDIT)


def test_commit_then_timeout_commits_then_outlasts_the_deadline_and_lookup_finds_it(
    tmp_path: Path,
) -> None:
    """R11: the effect happened although the call did not return in time."""
    faults = plan(FaultRule(method="issue_credit", mode=FaultMode.COMMIT_THEN_TIMEOUT))
    catalogue = build_catalogue("payments", tmp_path, faults)
    deadline_s = catalogue["issue_credit"].deadline_ms / 1000
    started = time.monotonic()
    result = run(catalogue, "issue_credit", "k-1", order_id="o-1", amount_cents=100)
    assert time.monotonic() - started > deadline_s
    assert catalogue["issue_credit"].lookup("k-1").result == result
    started = time.monotonic()  # the retry (same key) returns at once
    assert run(catalogue, "issue_credit", "k-1", order_id="o-1", amount_cents=100) == result
    assert time.monotonic() - started < deadline_s
    assert len(world(catalogue).credits()) == 1


def test_slow_delays_the_call(tmp_path: Path) -> None:
    faults = plan(FaultRule(method="close_ticket", mode=FaultMode.SLOW, delay_ms=300))
    catalogue = build_catalogue("tickets", tmp_path, faults)
    started = time.monotonic()
    run(catalogue, "close_ticket", "k-1", ticket_id="T-1")
    assert time.monotonic() - started >= 0.3


def test_throttle_refuses_calls_over_the_rate(tmp_path: Path) -> None:
    faults = plan(FaultRule(method="close_ticket", mode=FaultMode.THROTTLE, max_per_second=3))
    catalogue = build_catalogue("tickets", tmp_path, faults)
    for i in range(3):
        run(catalogue, "close_ticket", f"k-{i}", ticket_id=f"T-{i}")
    with pytest.raises(Throttled):
        run(catalogue, "close_ticket", "k-9", ticket_id="T-9")
    assert len(world(catalogue).tickets()) == 3


def test_a_compensation_can_fail_n_times_then_succeed(tmp_path: Path) -> None:
    """R8: compensations are retried; the fault counts per compensation key."""
    faults = plan(FaultRule(method="release_hold", mode=FaultMode.TRANSIENT, times=2))
    catalogue = build_catalogue("inventory", tmp_path, faults)
    hold = run(catalogue, "place_hold", "k-1", **HOLD)
    for _ in range(2):
        with pytest.raises(InjectedTransientFailure):
            compensate(catalogue, "place_hold", "k-1", HOLD, hold)
    compensate(catalogue, "place_hold", "k-1", HOLD, hold)
    assert [h.status for h in world(catalogue).holds()] == ["released"]


def test_a_compensation_can_always_fail(tmp_path: Path) -> None:
    """R8: this is what escalates to a person when retries run out."""
    faults = plan(FaultRule(method="release_hold", mode=FaultMode.TRANSIENT, times=None))
    catalogue = build_catalogue("inventory", tmp_path, faults)
    hold = run(catalogue, "place_hold", "k-1", **HOLD)
    for _ in range(10):
        with pytest.raises(InjectedTransientFailure):
            compensate(catalogue, "place_hold", "k-1", HOLD, hold)
    assert [h.status for h in world(catalogue).holds()] == ["active"]


def test_where_limits_a_rule_to_calls_with_matching_arguments(tmp_path: Path) -> None:
    faults = plan(
        FaultRule(method="place_hold", mode=FaultMode.REJECT, where={"order_id": ["o-bad"]})
    )
    catalogue = build_catalogue("inventory", tmp_path, faults)
    assert run(catalogue, "place_hold", "k-1", **HOLD)
    with pytest.raises(InjectedRejection):
        run(catalogue, "place_hold", "k-2", **{**HOLD, "order_id": "o-bad"})


def test_probability_picks_the_same_keys_for_the_same_seed() -> None:
    """Reproducible demo runs: the choice depends on seed, rule, method and key only."""
    rule = FaultRule(method="m", mode=FaultMode.REJECT, probability=0.3)

    def hit(seed: int) -> list[str]:
        injector = FaultInjector(plan(rule, seed=seed))
        keys = []
        for i in range(200):
            try:
                injector.call("m", f"k-{i}", {}, lambda: None, deadline_ms=1000)
            except InjectedRejection:
                keys.append(f"k-{i}")
        return keys

    first = hit(1)
    assert first == hit(1)
    assert first != hit(2)
    assert 30 < len(first) < 90  # about 30% of 200


def test_the_plan_loads_from_json_in_the_environment_and_from_a_file(tmp_path: Path) -> None:
    faults = plan(FaultRule(method="issue_credit", mode=FaultMode.TRANSIENT, times=3))
    env = {"SAGALINE_FAULTS": faults.to_json()}
    assert FaultPlan.from_env(env) == faults
    path = tmp_path / "faults.json"
    path.write_text(faults.to_json())
    assert FaultPlan.from_env({"SAGALINE_FAULTS": f"@{path}"}) == faults
    assert FaultPlan.from_env({}) == FaultPlan.none()


def test_a_bad_plan_is_refused_with_where_it_came_from() -> None:
    with pytest.raises(FaultPlanError, match=r"(?s)\$SAGALINE_FAULTS.*rules.0.mode"):
        FaultPlan.from_env({"SAGALINE_FAULTS": '{"rules": [{"method": "x", "mode": "explode"}]}'})
