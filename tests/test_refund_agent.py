"""The scripted refund agent: per-ticket plans, the plan check and its fix (R17),
deterministic tickets and fault mixes."""

from __future__ import annotations

from collections import Counter

import pytest

from participants.catalogue import Catalogue
from participants.plan import FindingCode, PlannedCall, check_plan
from services.refund import PARTICIPANTS, FaultMode, build_catalogue
from services.refund.agent import (
    CREDIT_REF,
    TOOL_PARTICIPANTS,
    Scenario,
    Ticket,
    TicketKind,
    UnresolvedReference,
    assign_scenarios,
    checked_plan,
    fault_plan_for,
    fix_plan,
    generate_tickets,
    plan_for,
    resolve_args,
)


@pytest.fixture(scope="module")
def catalogues(tmp_path_factory: pytest.TempPathFactory) -> list[Catalogue]:
    state = tmp_path_factory.mktemp("refund-state")
    return [build_catalogue(name, state) for name in PARTICIPANTS]


RETURN = Ticket("T-1", "ord-1", TicketKind.RETURN, 25_00, "wrong size", "sku-lamp", 1)


def tools(plan: list[PlannedCall]) -> list[str]:
    return [call.tool for call in plan]


def test_a_return_is_planned_reversible_steps_then_the_credit_then_the_email() -> None:
    """Seed 003: fallible and undoable before the pivot, irreversible after it."""
    assert tools(plan_for(RETURN)) == [
        "validate_refund",
        "place_hold",
        "return_to_inventory",
        "issue_credit",
        "send_reply",
        "close_ticket",
    ]


def test_a_digital_refund_skips_the_hold_and_the_restock() -> None:
    ticket = Ticket("T-2", "ord-2", TicketKind.DIGITAL, 9_99, "arrived late")
    assert tools(plan_for(ticket)) == [
        "validate_refund",
        "issue_credit",
        "send_reply",
        "close_ticket",
    ]


def test_a_question_gets_a_reply_after_the_ticket_closes(catalogues: list[Catalogue]) -> None:
    """With no pivot, the irreversible email goes last, contingent on the rest."""
    ticket = Ticket("T-3", "ord-3", TicketKind.QUESTION, 0, "it ships soon")
    plan = plan_for(ticket)
    assert tools(plan) == ["close_ticket", "send_reply"]
    assert plan[1].args["credit_id"] is None
    assert check_plan(plan, catalogues).ok


def test_every_tool_the_agent_plans_is_served_by_the_named_participant(
    catalogues: list[Catalogue],
) -> None:
    served = {tool: catalogue.name for catalogue in catalogues for tool in catalogue}
    assert served == TOOL_PARTICIPANTS


def test_the_good_plan_passes_the_plan_check(catalogues: list[Catalogue]) -> None:
    """R17: only warnings and notes (work after the pivot, an approval to wait for)."""
    report = check_plan(plan_for(RETURN), catalogues)
    assert report.ok
    assert FindingCode.NEEDS_APPROVAL in report.codes()


def test_the_hasty_plan_is_flagged_for_emailing_before_the_credit(
    catalogues: list[Catalogue],
) -> None:
    """R17: an irreversible step before fallible ones is an error."""
    hasty = Ticket("T-4", "ord-4", TicketKind.RETURN, 25_00, "wrong size", "sku-lamp", 1, True)
    plan = plan_for(hasty)
    assert tools(plan).index("send_reply") < tools(plan).index("issue_credit")
    report = check_plan(plan, catalogues)
    assert not report.ok
    assert [(f.code, f.tool) for f in report.errors] == [
        (FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE, "send_reply")
    ]


def test_the_fixed_plan_moves_the_email_after_the_pivot_and_passes(
    catalogues: list[Catalogue],
) -> None:
    hasty = Ticket("T-4", "ord-4", TicketKind.RETURN, 25_00, "wrong size", "sku-lamp", 1, True)
    checked = checked_plan(hasty, catalogues)
    assert checked.was_fixed
    assert checked.report.ok
    good = plan_for(Ticket(**{**hasty.__dict__, "hasty": False}))
    assert checked.plan == good


def test_fix_plan_leaves_a_good_plan_alone(catalogues: list[Catalogue]) -> None:
    plan = plan_for(RETURN)
    assert fix_plan(plan, catalogues) == plan
    assert not checked_plan(RETURN, catalogues).was_fixed


def test_resolve_args_fills_the_credit_id_from_the_credit_step() -> None:
    args = {"order_id": "ord-1", "credit_id": CREDIT_REF, "text": "hi"}
    assert resolve_args(args, {"issue_credit": {"credit_id": "credit-9"}})["credit_id"] == (
        "credit-9"
    )
    with pytest.raises(UnresolvedReference, match="run issue_credit earlier"):
        resolve_args(args, {})


def test_generate_tickets_is_deterministic_per_seed() -> None:
    assert generate_tickets(200, seed=3) == generate_tickets(200, seed=3)
    assert generate_tickets(200, seed=3) != generate_tickets(200, seed=4)
    assert len({t.order_id for t in generate_tickets(200, seed=3)}) == 200


def test_generated_tickets_mix_kinds_and_include_a_hasty_refund() -> None:
    tickets = generate_tickets(300, seed=1)
    kinds = Counter(t.kind for t in tickets)
    assert set(kinds) == set(TicketKind)
    assert kinds[TicketKind.RETURN] > kinds[TicketKind.DIGITAL] > kinds[TicketKind.QUESTION]
    assert any(t.hasty for t in tickets)
    assert any(t.hasty for t in generate_tickets(3, seed=1) if t.kind is not TicketKind.QUESTION)


def test_the_scenario_mix_is_mostly_happy_and_covers_every_recovery_path() -> None:
    tickets = generate_tickets(400, seed=11)
    scenarios = Counter(assign_scenarios(tickets, seed=11).values())
    assert set(scenarios) == set(Scenario)
    assert scenarios[Scenario.HAPPY] > len(tickets) / 2
    assert assign_scenarios(tickets, seed=11) == assign_scenarios(tickets, seed=11)


def test_fault_plan_for_targets_each_scenario_by_order_and_is_deterministic() -> None:
    tickets = generate_tickets(300, seed=5)
    plan = fault_plan_for(tickets, seed=5)
    assert plan == fault_plan_for(tickets, seed=5)
    scenarios = assign_scenarios(tickets, seed=5)
    failing = {t.order_id for t in tickets if scenarios[t.ticket_id] is Scenario.COMPENSATION_FAILS}
    release = [r for r in plan.rules if r.method == "release_hold"]
    assert [r.times for r in release] == [None]
    assert set(release[0].where["order_id"]) == failing
    timeouts = [r for r in plan.rules if r.mode is FaultMode.COMMIT_THEN_TIMEOUT]
    assert {r.method for r in timeouts} == {"issue_credit"}


def test_expected_status_follows_the_pivot_rule() -> None:
    """R6/R9: rejected before the pivot unwinds; failed after it goes forward."""
    assert Scenario.CREDIT_REJECTED.expected_status == "COMPENSATED"
    assert Scenario.EMAIL_RETRY.expected_status == "COMPLETED"
    assert Scenario.COMPENSATION_FAILS.expected_status == "ESCALATED"


def test_the_fault_plan_round_trips_through_json() -> None:
    plan = fault_plan_for(generate_tickets(100, seed=2), seed=2)
    assert type(plan).parse(plan.to_json()) == plan
