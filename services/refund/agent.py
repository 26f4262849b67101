"""The scripted refund agent: tickets, the tool sequence it chooses per ticket, the
plan check and its fix, and the seeded mix of faults a demo run injects.

No language model: the agent's choices are a pure function of the ticket, so a run
with a seed is reproducible. It still behaves like an agent in the ways that matter
to Sagaline: the sequence differs per ticket (no hold or restock when there is no
physical item; a reply alone for a question), and for a few "hasty" tickets it first
drafts a badly ordered plan (the email before the credit), which ``check_plan``
flags (R17) and ``fix_plan`` repairs before anything runs.

Executing the plan (the saga client) lives elsewhere; ``resolve_args`` turns a
``"$issue_credit.credit_id"`` reference into the value an earlier step returned.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from participants.catalogue import ToolSpec
from participants.plan import FindingCode, PlannedCall, PlanReport, check_plan
from services.refund.faults import FaultMode, FaultPlan, FaultRule
from services.refund.providers import DEFAULT_REFUND_LIMIT_CENTS

__all__ = [
    "TOOL_PARTICIPANTS",
    "CheckedPlan",
    "Scenario",
    "Ticket",
    "TicketKind",
    "UnresolvedReference",
    "assign_scenarios",
    "checked_plan",
    "fault_plan_for",
    "fix_plan",
    "generate_tickets",
    "plan_for",
    "resolve_args",
]

TOOL_PARTICIPANTS: dict[str, str] = {
    "validate_refund": "policy",
    "place_hold": "inventory",
    "return_to_inventory": "inventory",
    "issue_credit": "payments",
    "send_reply": "mailer",
    "close_ticket": "tickets",
}
"""Which participant serves each tool (its command topic ``sagaline.commands.<p>``)."""

CREDIT_REF = "$issue_credit.credit_id"


class TicketKind(StrEnum):
    RETURN = "return"  # a physical item comes back: hold, restock, credit, reply, close
    DIGITAL = "digital"  # nothing to put back on a shelf: credit, reply, close
    QUESTION = "question"  # no refund: close, then reply


@dataclass(frozen=True)
class Ticket:
    """A support ticket the agent answers."""

    ticket_id: str
    order_id: str
    kind: TicketKind
    amount_cents: int
    reason: str
    sku: str | None = None
    quantity: int = 0
    hasty: bool = False  # the agent drafts a badly ordered plan first


class UnresolvedReference(LookupError):
    """A ``$tool.field`` argument names a step that has not run or a missing field."""


# ------------------------------------------------------------------------ planning


def plan_for(ticket: Ticket) -> list[PlannedCall]:
    """The calls the agent proposes for ``ticket``, in its order.

    Everything fallible and undoable first, the credit as the pivot, the email
    after it (seed 003). A hasty ticket gets the email too early, which the plan
    check catches.
    """
    reply = PlannedCall(
        "send_reply",
        {
            "order_id": ticket.order_id,
            "credit_id": CREDIT_REF if ticket.kind is not TicketKind.QUESTION else None,
            "text": _reply_text(ticket),
        },
    )
    close = PlannedCall("close_ticket", {"ticket_id": ticket.ticket_id})
    if ticket.kind is TicketKind.QUESTION:
        # No pivot: the irreversible email goes last, contingent on the rest.
        return [close, reply]

    calls = [
        PlannedCall(
            "validate_refund",
            {
                "order_id": ticket.order_id,
                "amount_cents": ticket.amount_cents,
                "reason": ticket.reason,
            },
        )
    ]
    if ticket.kind is TicketKind.RETURN:
        item = {"order_id": ticket.order_id, "sku": ticket.sku, "quantity": ticket.quantity}
        calls += [PlannedCall("place_hold", item), PlannedCall("return_to_inventory", item)]
    credit = PlannedCall(
        "issue_credit", {"order_id": ticket.order_id, "amount_cents": ticket.amount_cents}
    )
    if ticket.hasty:
        return [calls[0], reply, *calls[1:], credit, close]
    return [*calls, credit, reply, close]


def fix_plan(
    plan: Sequence[PlannedCall],
    catalogues: Mapping[str, ToolSpec] | Iterable[Mapping[str, ToolSpec]],
) -> list[PlannedCall]:
    """Reorder ``plan`` until the plan check finds no irreversible step that a
    fallible one follows: each such step moves to just after the pivot (or to the
    end when there is none), keeping the order among the moved steps."""
    specs = _specs(catalogues)
    fixed = list(plan)
    for _ in range(len(fixed) + 1):
        report = check_plan(fixed, specs)
        flagged = [
            f.step for f in report.errors if f.code is FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE
        ]
        if not flagged:
            return fixed
        moving = [fixed[i] for i in flagged]
        rest = [c for i, c in enumerate(fixed) if i not in set(flagged)]
        pivots = [i for i, c in enumerate(rest) if c.tool in specs and specs[c.tool].pivot]
        at = pivots[0] + 1 if pivots else len(rest)
        fixed = rest[:at] + moving + rest[at:]
    return fixed


@dataclass(frozen=True)
class CheckedPlan:
    """What the agent will run, and how it got there."""

    ticket: Ticket
    plan: list[PlannedCall]
    first_report: PlanReport
    report: PlanReport

    @property
    def was_fixed(self) -> bool:
        return not self.first_report.ok and self.report.ok


def checked_plan(
    ticket: Ticket, catalogues: Mapping[str, ToolSpec] | Iterable[Mapping[str, ToolSpec]]
) -> CheckedPlan:
    """Plan, check (R17), and fix when the check finds an error."""
    specs = _specs(catalogues)
    plan = plan_for(ticket)
    first = check_plan(plan, specs)
    if first.ok:
        return CheckedPlan(ticket, plan, first, first)
    fixed = fix_plan(plan, specs)
    return CheckedPlan(ticket, fixed, first, check_plan(fixed, specs))


def resolve_args(
    args: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Replace ``"$tool.field"`` values with ``results[tool][field]`` (the result of
    the step that called ``tool`` earlier in the saga)."""
    resolved: dict[str, Any] = {}
    for name, value in args.items():
        if isinstance(value, str) and value.startswith("$"):
            tool, _, field = value[1:].partition(".")
            if tool not in results or field not in results[tool]:
                raise UnresolvedReference(
                    f"argument {name!r} refers to {value!r}, but {tool!r} has not returned"
                    f" a {field!r} yet; run {tool} earlier in the saga"
                )
            value = results[tool][field]
        resolved[name] = value
    return resolved


def _reply_text(ticket: Ticket) -> str:
    if ticket.kind is TicketKind.QUESTION:
        return f"Thanks for writing about order {ticket.order_id}. {ticket.reason.capitalize()}."
    dollars = f"${ticket.amount_cents // 100}.{ticket.amount_cents % 100:02d}"
    return (
        f"We have refunded {dollars} as store credit for order {ticket.order_id} ({ticket.reason})."
    )


def _specs(
    catalogues: Mapping[str, ToolSpec] | Iterable[Mapping[str, ToolSpec]],
) -> dict[str, ToolSpec]:
    if isinstance(catalogues, Mapping):
        return dict(catalogues)
    merged: dict[str, ToolSpec] = {}
    for catalogue in catalogues:
        merged.update(catalogue)
    return merged


# ------------------------------------------------------------------------- tickets

_REASONS = ("damaged in transit", "wrong size", "arrived late", "not as described")
_QUESTIONS = ("your parcel left our warehouse today", "the item ships in two weeks")
_SKUS = ("sku-lamp", "sku-kettle", "sku-chair", "sku-rug", "sku-clock")


def generate_tickets(n: int, seed: int) -> list[Ticket]:
    """``n`` tickets, the same for the same seed.

    About 60% returns, 25% digital refunds, 15% questions; about 5% of refunds ask
    for more than the policy limit (rejected before anything is done); about 3% of
    refunds are hasty (badly ordered first draft), and at least one is when there is
    a refund at all.
    """
    rng = random.Random(f"tickets/{seed}")
    tickets: list[Ticket] = []
    for i in range(n):
        roll = rng.random()
        kind = (
            TicketKind.RETURN
            if roll < 0.60
            else TicketKind.DIGITAL
            if roll < 0.85
            else TicketKind.QUESTION
        )
        ticket_id, order_id = f"T-{seed}-{i:04d}", f"ord-{seed}-{i:04d}"
        if kind is TicketKind.QUESTION:
            tickets.append(Ticket(ticket_id, order_id, kind, 0, rng.choice(_QUESTIONS)))
            continue
        over_limit = rng.random() < 0.05
        amount = (
            rng.randint(DEFAULT_REFUND_LIMIT_CENTS + 1, 2 * DEFAULT_REFUND_LIMIT_CENTS)
            if over_limit
            else rng.randint(5_00, 300_00)
        )
        physical = kind is TicketKind.RETURN
        tickets.append(
            Ticket(
                ticket_id,
                order_id,
                kind,
                amount,
                rng.choice(_REASONS),
                sku=rng.choice(_SKUS) if physical else None,
                quantity=rng.randint(1, 3) if physical else 0,
                hasty=rng.random() < 0.03,
            )
        )
    refunds = [i for i, t in enumerate(tickets) if t.kind is not TicketKind.QUESTION]
    if refunds and not any(tickets[i].hasty for i in refunds):
        first = refunds[0]
        t = tickets[first]
        tickets[first] = Ticket(
            t.ticket_id, t.order_id, t.kind, t.amount_cents, t.reason, t.sku, t.quantity, True
        )
    return tickets


# -------------------------------------------------------------------------- faults


class Scenario(StrEnum):
    """What a ticket's saga runs into, and so how it should end."""

    HAPPY = "happy"
    POLICY_REJECTED = "policy_rejected"  # over the limit: nothing done, nothing to undo
    CREDIT_REJECTED = "credit_rejected"  # rejection before the pivot: unwound (R9)
    TRANSIENT = "transient"  # a step fails once or twice, then succeeds (retried)
    CREDIT_TIMEOUT = "credit_timeout"  # credit commits, the call times out (R11)
    EMAIL_RETRY = "email_retry"  # the email fails after the pivot: retried forward (R6)
    SLOW = "slow"  # a slow provider, still within the deadline
    COMPENSATION_FAILS = "compensation_fails"  # the unwind cannot release a hold (R8)

    @property
    def expected_status(self) -> str:
        """The terminal status the saga should reach (``TerminalStatus`` value)."""
        if self in (Scenario.POLICY_REJECTED, Scenario.CREDIT_REJECTED):
            return "COMPENSATED"
        if self is Scenario.COMPENSATION_FAILS:
            return "ESCALATED"
        return "COMPLETED"


def assign_scenarios(tickets: Sequence[Ticket], seed: int) -> dict[str, Scenario]:
    """The scenario of each ticket (by ticket id), the same for the same seed.

    Most succeed. Among refunds within the limit: ~7% have the credit rejected,
    ~8% a transient failure, ~5% a credit that times out after committing, ~3% a
    slow step; ~6% of tickets with an email have it fail at first; ~3% of returns
    have the credit rejected and a hold that cannot be released.
    """
    rng = random.Random(f"scenarios/{seed}")
    scenarios: dict[str, Scenario] = {}
    for ticket in tickets:
        roll = rng.random()
        if ticket.kind is TicketKind.QUESTION:
            scenario = Scenario.EMAIL_RETRY if roll < 0.06 else Scenario.HAPPY
        elif ticket.amount_cents > DEFAULT_REFUND_LIMIT_CENTS:
            scenario = Scenario.POLICY_REJECTED
        elif ticket.kind is TicketKind.RETURN and roll < 0.03:
            scenario = Scenario.COMPENSATION_FAILS
        elif roll < 0.10:
            scenario = Scenario.CREDIT_REJECTED
        elif roll < 0.18:
            scenario = Scenario.TRANSIENT
        elif roll < 0.23:
            scenario = Scenario.CREDIT_TIMEOUT
        elif roll < 0.29:
            scenario = Scenario.EMAIL_RETRY
        elif roll < 0.32:
            scenario = Scenario.SLOW
        else:
            scenario = Scenario.HAPPY
        scenarios[ticket.ticket_id] = scenario
    return scenarios


def fault_plan_for(tickets: Sequence[Ticket], seed: int) -> FaultPlan:
    """The ``FaultPlan`` that makes each ticket's saga meet its scenario (see
    ``assign_scenarios``). Rules select tickets by ``order_id`` (``ticket_id`` for
    ``close_ticket``), so the plan is independent of saga ids and keys."""
    by_ticket = {t.ticket_id: t for t in tickets}
    groups: dict[tuple[str, FaultMode, int | None, int | None, str], list[str]] = {}
    transient_tools = {
        TicketKind.RETURN: ("place_hold", "return_to_inventory", "issue_credit"),
        TicketKind.DIGITAL: ("issue_credit",),
    }
    rng = random.Random(f"faults/{seed}")

    def add(
        method: str,
        mode: FaultMode,
        value: str,
        *,
        times: int | None = 1,
        delay_ms: int | None = None,
        field: str = "order_id",
    ) -> None:
        groups.setdefault((method, mode, times, delay_ms, field), []).append(value)

    for ticket_id, scenario in assign_scenarios(tickets, seed).items():
        ticket = by_ticket[ticket_id]
        order = ticket.order_id
        if scenario is Scenario.CREDIT_REJECTED:
            add("issue_credit", FaultMode.REJECT, order)
        elif scenario is Scenario.TRANSIENT:
            tool = rng.choice(transient_tools[ticket.kind])
            add(tool, FaultMode.TRANSIENT, order, times=rng.randint(1, 2))
        elif scenario is Scenario.CREDIT_TIMEOUT:
            add("issue_credit", FaultMode.COMMIT_THEN_TIMEOUT, order)
        elif scenario is Scenario.EMAIL_RETRY:
            add("send_reply", FaultMode.TRANSIENT, order, times=2)
        elif scenario is Scenario.SLOW:
            add("close_ticket", FaultMode.SLOW, ticket_id, delay_ms=300, field="ticket_id")
        elif scenario is Scenario.COMPENSATION_FAILS:
            add("issue_credit", FaultMode.REJECT, order)
            add("release_hold", FaultMode.TRANSIENT, order, times=None)

    rules = [
        FaultRule(
            method=method,
            mode=mode,
            where={field: list(values)},
            times=times,
            delay_ms=delay_ms,
            message=_FAULT_MESSAGES.get((method, mode)),
        )
        for (method, mode, times, delay_ms, field), values in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1].value, str(kv[0][2:]))
        )
    ]
    return FaultPlan(seed=seed, rules=rules)


_FAULT_MESSAGES: dict[tuple[str, FaultMode], str] = {
    ("issue_credit", FaultMode.REJECT): "the customer's store-credit account is frozen",
    ("release_hold", FaultMode.TRANSIENT): "warehouse system unavailable",
    ("send_reply", FaultMode.TRANSIENT): "mail gateway unavailable, try again",
}
