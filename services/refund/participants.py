"""The refund domain's participants (seed 003): tools with their compensations
declared next to them, each backed by its own provider.

Ordering is the point of the example. Policy, hold and restock are reversible and
fallible: they run first. ``issue_credit`` is the pivot: once it commits the saga
only goes forward (R6). ``send_reply`` is IRREVERSIBLE: it waits for a person's
approval (R7), runs after the pivot, and names a correction message as its ``by=``.
``close_ticket`` is reversible yet sits after the pivot, because reversibility and
ordering are different axes.

Every tool passes ``current_call().idempotency_key`` to its provider, and every
compensation ``ctx.compensation_key`` (derived from the forward key, R8), so a retry
or a redelivery never produces a second effect. Tools return identifiers; the
compensations undo exactly what ``ctx.result`` names.
"""

from __future__ import annotations

from typing import Any

from participants.context import current_call
from participants.declarations import (
    CompensationContext,
    LookupResult,
    RetryPolicy,
    Reversibility,
    compensable,
    compensation,
    tool,
)
from services.refund.errors import UnknownOperationError
from services.refund.faults import FaultInjector
from services.refund.providers import (
    InventoryProvider,
    MailerProvider,
    PaymentsProvider,
    PolicyProvider,
    Provider,
    TicketsProvider,
)

__all__ = [
    "ORDER_STOCK",
    "Inventory",
    "Mailer",
    "Payments",
    "Policy",
    "Tickets",
]

ORDER_STOCK = "order-stock"
"""The resource hold and restock both touch. ``@tool(resources=...)`` takes static
names, so this is "the order's stock" within one saga rather than a per-order id."""

DEADLINE_S = 5.0
CREDIT_DEADLINE_S = 2.0  # short, so a commit-then-timeout demo run settles quickly
FORWARD_AFTER_PIVOT_RETRY = RetryPolicy(
    max_attempts=6, initial_backoff_ms=200, max_backoff_ms=5_000
)
"""Past the pivot a failure is retried forward, never compensated (R6): try harder."""


def _lookup(provider: Provider, key: str) -> LookupResult | None:
    found = provider.lookup(key)
    if found is None:
        return None
    return LookupResult.committed(found.result, found.operation_id)


def _key() -> str:
    return current_call().idempotency_key


def _undo_target(ctx: CompensationContext, field: str, provider: Provider) -> str:
    """What a compensation undoes: ``field`` of the tool's result; else (the outcome
    was unknown and a person settled it as COMMITTED without ``--result``, so
    ``ctx.result`` is None) the operation id the person gave, or the operation the
    provider performed under the forward call's idempotency key."""
    result = ctx.result
    if isinstance(result, dict) and result.get(field) is not None:
        return str(result[field])
    if ctx.provider_operation_id:
        return ctx.provider_operation_id
    found = provider.lookup(ctx.idempotency_key)
    if found is not None and found.result.get(field) is not None:
        return str(found.result[field])
    raise UnknownOperationError(
        f"{ctx.tool_name}: the result names no {field} and the provider performed"
        f" nothing under the forward call's idempotency key; there is nothing to undo"
    )


class _Participant:
    def __init__(self, faults: FaultInjector) -> None:
        self.faults = faults


class Policy(_Participant):
    """The refund policy check (read-only)."""

    def __init__(self, provider: PolicyProvider, faults: FaultInjector) -> None:
        super().__init__(faults)
        self.provider = provider

    @tool(read_only=True, deadline=DEADLINE_S)
    def validate_refund(self, order_id: str, amount_cents: int, reason: str) -> dict[str, Any]:
        """Check a refund against policy: the amount limit and orders that cannot be
        refunded. Rejects (never retried) when the refund is not allowed."""
        args = {"order_id": order_id, "amount_cents": amount_cents, "reason": reason}
        decision = self.faults.call(
            "validate_refund",
            current_call().idempotency_key,
            args,
            lambda: self.provider.evaluate(order_id, amount_cents, reason),
            deadline_ms=int(DEADLINE_S * 1000),
        )
        return {
            "approved": True,
            "order_id": decision.order_id,
            "amount_cents": decision.amount_cents,
            "limit_cents": decision.limit_cents,
        }


class Inventory(_Participant):
    """Holds on the order's stock and returned items put back on the shelf."""

    def __init__(self, provider: InventoryProvider, faults: FaultInjector) -> None:
        super().__init__(faults)
        self.provider = provider

    @tool(
        resources=[ORDER_STOCK],
        lookup="find_operation",
        operation_id="hold_id",
        deadline=DEADLINE_S,
    )
    @compensable(by="release_hold", reversibility=Reversibility.REVERSIBLE)
    def place_hold(self, order_id: str, sku: str, quantity: int) -> dict[str, Any]:
        """Place a hold on the order's stock so it is not shipped or resold while the
        refund runs. Returns the hold id."""
        key = _key()
        args = {"order_id": order_id, "sku": sku, "quantity": quantity}
        return self.faults.call(
            "place_hold",
            key,
            args,
            lambda: self.provider.place_hold(key, order_id, sku, quantity).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    @compensation
    def release_hold(self, ctx: CompensationContext) -> dict[str, Any]:
        """Release the hold named in the tool's result."""
        hold_id = _undo_target(ctx, "hold_id", self.provider)
        return self.faults.call(
            "release_hold",
            ctx.compensation_key,
            ctx.input,
            lambda: self.provider.release_hold(ctx.compensation_key, hold_id).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    @tool(
        resources=[ORDER_STOCK],
        lookup="find_operation",
        operation_id="movement_id",
        deadline=DEADLINE_S,
    )
    @compensable(by="remove_from_inventory", reversibility=Reversibility.REVERSIBLE)
    def return_to_inventory(self, order_id: str, sku: str, quantity: int) -> dict[str, Any]:
        """Put the returned item back in stock. Returns the stock movement id."""
        key = _key()
        args = {"order_id": order_id, "sku": sku, "quantity": quantity}
        return self.faults.call(
            "return_to_inventory",
            key,
            args,
            lambda: self.provider.return_to_inventory(key, order_id, sku, quantity).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    @compensation
    def remove_from_inventory(self, ctx: CompensationContext) -> dict[str, Any]:
        """Take the restocked item back off the shelf (the movement in the result)."""
        movement_id = _undo_target(ctx, "movement_id", self.provider)
        return self.faults.call(
            "remove_from_inventory",
            ctx.compensation_key,
            ctx.input,
            lambda: self.provider.remove_from_inventory(ctx.compensation_key, movement_id).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    def find_operation(self, idempotency_key: str) -> LookupResult | None:
        """Reconcile an unknown hold or restock by its idempotency key (R11)."""
        return _lookup(self.provider, idempotency_key)


class Payments(_Participant):
    """Store credit: the pivot of the refund saga."""

    def __init__(self, provider: PaymentsProvider, faults: FaultInjector) -> None:
        super().__init__(faults)
        self.provider = provider

    @tool(
        pivot=True,
        lookup="find_credit",
        operation_id="credit_id",
        deadline=CREDIT_DEADLINE_S,
        owner="payments-oncall",
    )
    @compensable(by="void_credit", reversibility=Reversibility.COMPENSATABLE)
    def issue_credit(self, order_id: str, amount_cents: int) -> dict[str, Any]:
        """Issue store credit for the refund. This is the pivot: once it commits, the
        saga goes forward. Returns the credit id."""
        key = _key()
        args = {"order_id": order_id, "amount_cents": amount_cents}
        return self.faults.call(
            "issue_credit",
            key,
            args,
            lambda: self.provider.issue_credit(key, order_id, amount_cents).result,
            deadline_ms=int(CREDIT_DEADLINE_S * 1000),
        )

    @compensation
    def void_credit(self, ctx: CompensationContext) -> dict[str, Any]:
        """Claw the credit back. Declared so the catalogue says what undoing would
        mean; the coordinator never compensates a committed pivot (R6), so in a
        refund saga this does not run, and the tests check that it did not."""
        credit_id = _undo_target(ctx, "credit_id", self.provider)
        return self.faults.call(
            "void_credit",
            ctx.compensation_key,
            ctx.input,
            lambda: self.provider.void_credit(ctx.compensation_key, credit_id).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    def find_credit(self, idempotency_key: str) -> LookupResult | None:
        """Find a credit by the idempotency key it was issued under (R11)."""
        return _lookup(self.provider, idempotency_key)


class Mailer(_Participant):
    """Customer email: cannot be unsent, only followed by a correction."""

    def __init__(self, provider: MailerProvider, faults: FaultInjector) -> None:
        super().__init__(faults)
        self.provider = provider

    @tool(
        lookup="find_message",
        operation_id="message_id",
        deadline=DEADLINE_S,
        retry=FORWARD_AFTER_PIVOT_RETRY,
        owner="customer-support",
    )
    @compensable(by="send_correction", reversibility=Reversibility.IRREVERSIBLE)
    def send_reply(self, order_id: str, text: str, credit_id: str | None = None) -> dict[str, Any]:
        """Email the customer about their refund. Irreversible: a person approves it
        first, and it runs after the credit. Returns the message id."""
        key = _key()
        args = {"order_id": order_id, "credit_id": credit_id, "text": text}
        return self.faults.call(
            "send_reply",
            key,
            args,
            lambda: self.provider.send_reply(key, order_id, credit_id, text).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    @compensation
    def send_correction(self, ctx: CompensationContext) -> dict[str, Any]:
        """Not an undo: a follow-up that corrects the message in ``ctx.result``."""
        original = _undo_target(ctx, "message_id", self.provider)
        order_id = ctx.input.get("order_id", "?")
        text = (
            f"A correction to our earlier message about order {order_id}: please disregard"
            " it. We will write again once your refund is settled."
        )
        return self.faults.call(
            "send_correction",
            ctx.compensation_key,
            ctx.input,
            lambda: self.provider.send_correction(ctx.compensation_key, original, text).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    def find_message(self, idempotency_key: str) -> LookupResult | None:
        """Find a sent message by its idempotency key (R11)."""
        return _lookup(self.provider, idempotency_key)


class Tickets(_Participant):
    """The helpdesk ticket the refund answers."""

    def __init__(self, provider: TicketsProvider, faults: FaultInjector) -> None:
        super().__init__(faults)
        self.provider = provider

    @tool(
        lookup="find_closure",
        operation_id="closure_id",
        deadline=DEADLINE_S,
        retry=FORWARD_AFTER_PIVOT_RETRY,
    )
    @compensable(by="reopen_ticket", reversibility=Reversibility.REVERSIBLE)
    def close_ticket(self, ticket_id: str) -> dict[str, Any]:
        """Close the support ticket once the customer has been answered. Returns the
        closure id."""
        key = _key()
        return self.faults.call(
            "close_ticket",
            key,
            {"ticket_id": ticket_id},
            lambda: self.provider.close_ticket(key, ticket_id).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    @compensation
    def reopen_ticket(self, ctx: CompensationContext) -> dict[str, Any]:
        """Reopen the ticket named in ``ctx.result``."""
        ticket_id = str(
            ctx.result["ticket_id"]
            if isinstance(ctx.result, dict) and ctx.result.get("ticket_id")
            else ctx.input["ticket_id"]  # the ticket the forward call closed
        )
        return self.faults.call(
            "reopen_ticket",
            ctx.compensation_key,
            ctx.input,
            lambda: self.provider.reopen_ticket(ctx.compensation_key, ticket_id).result,
            deadline_ms=int(DEADLINE_S * 1000),
        )

    def find_closure(self, idempotency_key: str) -> LookupResult | None:
        """Find a ticket closure by its idempotency key (R11)."""
        return _lookup(self.provider, idempotency_key)
