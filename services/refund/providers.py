"""The example providers of the refund domain (seed 003), each with its own SQLite
file under a state directory.

Each one plays someone else's system and keeps the state a test needs to check the
world afterwards: holds that are still active, stock that was returned and removed,
credits issued (and whether one was ever voided: it never should be), emails sent,
tickets closed and reopened. Every write takes an idempotency key; the same key gives
the same operation id and result and never a second effect. Compensating writes are
also idempotent by state: releasing a released hold is a no-op whatever its key.

Operation ids are derived from the idempotency key, so a seeded demo run produces the
same ids every time.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.refund._store import Effect, Operation, SqliteStore
from services.refund.errors import PolicyRejection, UnknownOperationError

__all__ = [
    "DEFAULT_REFUND_LIMIT_CENTS",
    "Credit",
    "Email",
    "Hold",
    "InventoryProvider",
    "MailerProvider",
    "Movement",
    "PaymentsProvider",
    "PolicyDecision",
    "PolicyProvider",
    "Provider",
    "Ticket",
    "TicketsProvider",
]

DEFAULT_REFUND_LIMIT_CENTS = 500_00


def _operation_id(prefix: str, key: str) -> str:
    return f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class Provider:
    """What every example provider shares: its store, lookup by key, the effect log."""

    file_name = "provider.sqlite3"
    schema = ""

    def __init__(self, state_dir: Path) -> None:
        self.store = SqliteStore(Path(state_dir) / self.file_name, self.schema)

    def lookup(self, idempotency_key: str) -> Operation | None:
        """The operation performed under ``idempotency_key``: None means not found."""
        return self.store.lookup(idempotency_key)

    def effects(self, kind: str | None = None) -> list[Effect]:
        """The ordered effect log (optionally of one kind)."""
        return self.store.effects(kind)

    def close(self) -> None:
        self.store.close()


# ------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class PolicyDecision:
    order_id: str
    amount_cents: int
    limit_cents: int


class PolicyProvider(Provider):
    """The refund policy: a limit per refund and orders that may not be refunded.

    Read-only: it answers, and keeps an audit log of what it was asked
    (``policy.approved`` / ``policy.refused`` effects), which is not a business
    effect and needs no undo.
    """

    file_name = "policy.sqlite3"

    def __init__(
        self,
        state_dir: Path,
        *,
        limit_cents: int = DEFAULT_REFUND_LIMIT_CENTS,
        refused_orders: Iterable[str] = (),
    ) -> None:
        super().__init__(state_dir)
        self.limit_cents = limit_cents
        self.refused_orders = frozenset(refused_orders)

    def evaluate(self, order_id: str, amount_cents: int, reason: str) -> PolicyDecision:
        """Approve the refund or raise ``PolicyRejection`` saying why."""
        refusal = None
        if amount_cents <= 0:
            refusal = f"refund amount must be positive, got {amount_cents} cents"
        elif amount_cents > self.limit_cents:
            refusal = (
                f"refund of {amount_cents} cents for order {order_id} exceeds the policy"
                f" limit of {self.limit_cents} cents; a supervisor must handle it"
            )
        elif order_id in self.refused_orders:
            refusal = f"order {order_id} is not refundable under the current policy"
        with self.store.transaction() as conn:
            SqliteStore.record_effect(
                conn,
                "policy.refused" if refusal else "policy.approved",
                order_id=order_id,
                amount_cents=amount_cents,
                reason=reason,
            )
        if refusal:
            raise PolicyRejection(refusal)
        return PolicyDecision(order_id, amount_cents, self.limit_cents)


# ---------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Hold:
    hold_id: str
    order_id: str
    sku: str
    quantity: int
    status: str  # active | released


@dataclass(frozen=True)
class Movement:
    movement_id: str
    order_id: str
    sku: str
    quantity: int
    status: str  # returned | removed


class InventoryProvider(Provider):
    """A warehouse: holds on an order's stock and returned items put back on the shelf."""

    file_name = "inventory.sqlite3"
    schema = """
    CREATE TABLE IF NOT EXISTS holds (
        hold_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, sku TEXT NOT NULL,
        quantity INTEGER NOT NULL, status TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS movements (
        movement_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, sku TEXT NOT NULL,
        quantity INTEGER NOT NULL, status TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, on_hand INTEGER NOT NULL);
    """

    def place_hold(self, key: str, order_id: str, sku: str, quantity: int) -> Operation:
        hold_id = _operation_id("hold", key)

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            conn.execute(
                "INSERT INTO holds VALUES (?, ?, ?, ?, 'active')",
                (hold_id, order_id, sku, quantity),
            )
            SqliteStore.record_effect(
                conn,
                "hold.placed",
                idempotency_key=key,
                operation_id=hold_id,
                order_id=order_id,
                sku=sku,
                quantity=quantity,
            )
            return hold_id, {"hold_id": hold_id}

        request = {"order_id": order_id, "sku": sku, "quantity": quantity}
        return self.store.perform(key, "place_hold", request, apply)

    def release_hold(self, key: str, hold_id: str) -> Operation:
        """Release a hold; releasing an already released hold changes nothing."""

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            row = conn.execute("SELECT status FROM holds WHERE hold_id = ?", (hold_id,)).fetchone()
            if row is None:
                raise UnknownOperationError(f"no hold {hold_id!r} exists; nothing to release")
            if row[0] == "active":
                conn.execute("UPDATE holds SET status = 'released' WHERE hold_id = ?", (hold_id,))
                SqliteStore.record_effect(
                    conn, "hold.released", idempotency_key=key, operation_id=hold_id
                )
            return hold_id, {"hold_id": hold_id, "status": "released"}

        return self.store.perform(key, "release_hold", {"hold_id": hold_id}, apply)

    def return_to_inventory(self, key: str, order_id: str, sku: str, quantity: int) -> Operation:
        movement_id = _operation_id("restock", key)

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            conn.execute(
                "INSERT INTO movements VALUES (?, ?, ?, ?, 'returned')",
                (movement_id, order_id, sku, quantity),
            )
            _adjust_stock(conn, sku, quantity)
            SqliteStore.record_effect(
                conn,
                "stock.returned",
                idempotency_key=key,
                operation_id=movement_id,
                order_id=order_id,
                sku=sku,
                quantity=quantity,
            )
            return movement_id, {"movement_id": movement_id}

        request = {"order_id": order_id, "sku": sku, "quantity": quantity}
        return self.store.perform(key, "return_to_inventory", request, apply)

    def remove_from_inventory(self, key: str, movement_id: str) -> Operation:
        """Take a returned item back off the shelf; a second removal changes nothing."""

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            row = conn.execute(
                "SELECT sku, quantity, status FROM movements WHERE movement_id = ?",
                (movement_id,),
            ).fetchone()
            if row is None:
                raise UnknownOperationError(
                    f"no stock movement {movement_id!r} exists; nothing to remove"
                )
            if row[2] == "returned":
                conn.execute(
                    "UPDATE movements SET status = 'removed' WHERE movement_id = ?", (movement_id,)
                )
                _adjust_stock(conn, row[0], -row[1])
                SqliteStore.record_effect(
                    conn, "stock.removed", idempotency_key=key, operation_id=movement_id
                )
            return movement_id, {"movement_id": movement_id, "status": "removed"}

        return self.store.perform(key, "remove_from_inventory", {"movement_id": movement_id}, apply)

    def holds(self, status: str | None = None, order_id: str | None = None) -> list[Hold]:
        rows = self.store.query("SELECT * FROM holds ORDER BY rowid")
        return [
            Hold(r["hold_id"], r["order_id"], r["sku"], r["quantity"], r["status"])
            for r in rows
            if (status is None or r["status"] == status)
            and (order_id is None or r["order_id"] == order_id)
        ]

    def movements(self, status: str | None = None, order_id: str | None = None) -> list[Movement]:
        rows = self.store.query("SELECT * FROM movements ORDER BY rowid")
        return [
            Movement(r["movement_id"], r["order_id"], r["sku"], r["quantity"], r["status"])
            for r in rows
            if (status is None or r["status"] == status)
            and (order_id is None or r["order_id"] == order_id)
        ]

    def on_hand(self, sku: str) -> int:
        rows = self.store.query("SELECT on_hand FROM stock WHERE sku = ?", (sku,))
        return int(rows[0]["on_hand"]) if rows else 0


def _adjust_stock(conn: sqlite3.Connection, sku: str, delta: int) -> None:
    conn.execute(
        "INSERT INTO stock VALUES (?, ?) ON CONFLICT(sku) DO UPDATE SET on_hand = on_hand + ?",
        (sku, delta, delta),
    )


# ----------------------------------------------------------------------- payments


@dataclass(frozen=True)
class Credit:
    credit_id: str
    order_id: str
    amount_cents: int
    idempotency_key: str
    status: str  # issued | voided


class PaymentsProvider(Provider):
    """Store credit: issued once per idempotency key, found again by that key."""

    file_name = "payments.sqlite3"
    schema = """
    CREATE TABLE IF NOT EXISTS credits (
        credit_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL,
        idempotency_key TEXT NOT NULL, status TEXT NOT NULL
    );
    """

    def issue_credit(self, key: str, order_id: str, amount_cents: int) -> Operation:
        credit_id = _operation_id("credit", key)

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            conn.execute(
                "INSERT INTO credits VALUES (?, ?, ?, ?, 'issued')",
                (credit_id, order_id, amount_cents, key),
            )
            SqliteStore.record_effect(
                conn,
                "credit.issued",
                idempotency_key=key,
                operation_id=credit_id,
                order_id=order_id,
                amount_cents=amount_cents,
            )
            return credit_id, {
                "credit_id": credit_id,
                "order_id": order_id,
                "amount_cents": amount_cents,
            }

        request = {"order_id": order_id, "amount_cents": amount_cents}
        return self.store.perform(key, "issue_credit", request, apply)

    def void_credit(self, key: str, credit_id: str) -> Operation:
        """Claw a credit back. The refund saga never should (R6); tests check it didn't."""

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            row = conn.execute(
                "SELECT status FROM credits WHERE credit_id = ?", (credit_id,)
            ).fetchone()
            if row is None:
                raise UnknownOperationError(f"no credit {credit_id!r} exists; nothing to void")
            if row[0] == "issued":
                conn.execute(
                    "UPDATE credits SET status = 'voided' WHERE credit_id = ?", (credit_id,)
                )
                SqliteStore.record_effect(
                    conn, "credit.voided", idempotency_key=key, operation_id=credit_id
                )
            return credit_id, {"credit_id": credit_id, "status": "voided"}

        return self.store.perform(key, "void_credit", {"credit_id": credit_id}, apply)

    def credits(self, status: str | None = None, order_id: str | None = None) -> list[Credit]:
        rows = self.store.query("SELECT * FROM credits ORDER BY rowid")
        return [
            Credit(
                r["credit_id"],
                r["order_id"],
                r["amount_cents"],
                r["idempotency_key"],
                r["status"],
            )
            for r in rows
            if (status is None or r["status"] == status)
            and (order_id is None or r["order_id"] == order_id)
        ]


# ------------------------------------------------------------------------- mailer


@dataclass(frozen=True)
class Email:
    message_id: str
    order_id: str
    kind: str  # reply | correction
    credit_id: str | None
    text: str
    corrects: str | None


class MailerProvider(Provider):
    """A mail gateway: what was sent stays sent; a correction is a second message."""

    file_name = "mailer.sqlite3"
    schema = """
    CREATE TABLE IF NOT EXISTS emails (
        message_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, kind TEXT NOT NULL,
        credit_id TEXT, text TEXT NOT NULL, corrects TEXT
    );
    """

    def send_reply(self, key: str, order_id: str, credit_id: str | None, text: str) -> Operation:
        message_id = _operation_id("msg", key)

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            conn.execute(
                "INSERT INTO emails VALUES (?, ?, 'reply', ?, ?, NULL)",
                (message_id, order_id, credit_id, text),
            )
            SqliteStore.record_effect(
                conn,
                "email.reply",
                idempotency_key=key,
                operation_id=message_id,
                order_id=order_id,
                credit_id=credit_id,
            )
            return message_id, {"message_id": message_id}

        request = {"order_id": order_id, "credit_id": credit_id, "text": text}
        return self.store.perform(key, "send_reply", request, apply)

    def send_correction(self, key: str, corrects: str, text: str) -> Operation:
        """Send a follow-up to ``corrects``; the original stays in the customer's inbox."""
        message_id = _operation_id("msg", key)

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            row = conn.execute(
                "SELECT order_id FROM emails WHERE message_id = ?", (corrects,)
            ).fetchone()
            if row is None:
                raise UnknownOperationError(
                    f"no message {corrects!r} was sent; there is nothing to correct"
                )
            conn.execute(
                "INSERT INTO emails VALUES (?, ?, 'correction', NULL, ?, ?)",
                (message_id, row[0], text, corrects),
            )
            SqliteStore.record_effect(
                conn,
                "email.correction",
                idempotency_key=key,
                operation_id=message_id,
                order_id=row[0],
                corrects=corrects,
            )
            return message_id, {"message_id": message_id, "corrects": corrects}

        return self.store.perform(
            key, "send_correction", {"corrects": corrects, "text": text}, apply
        )

    def emails(self, kind: str | None = None, order_id: str | None = None) -> list[Email]:
        rows = self.store.query("SELECT * FROM emails ORDER BY rowid")
        return [
            Email(
                r["message_id"],
                r["order_id"],
                r["kind"],
                r["credit_id"],
                r["text"],
                r["corrects"],
            )
            for r in rows
            if (kind is None or r["kind"] == kind)
            and (order_id is None or r["order_id"] == order_id)
        ]


# ------------------------------------------------------------------------ tickets


@dataclass(frozen=True)
class Ticket:
    ticket_id: str
    status: str  # open | closed | reopened


class TicketsProvider(Provider):
    """A helpdesk: tickets closed when handled, reopened if that is undone.

    A ticket the helpdesk has not seen is taken to be open (the demo does not
    pre-create its tickets).
    """

    file_name = "tickets.sqlite3"
    schema = """
    CREATE TABLE IF NOT EXISTS tickets (ticket_id TEXT PRIMARY KEY, status TEXT NOT NULL);
    """

    def close_ticket(self, key: str, ticket_id: str) -> Operation:
        closure_id = _operation_id("closure", key)

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            conn.execute(
                "INSERT INTO tickets VALUES (?, 'closed')"
                " ON CONFLICT(ticket_id) DO UPDATE SET status = 'closed'",
                (ticket_id,),
            )
            SqliteStore.record_effect(
                conn,
                "ticket.closed",
                idempotency_key=key,
                operation_id=closure_id,
                ticket_id=ticket_id,
            )
            return closure_id, {"ticket_id": ticket_id, "closure_id": closure_id}

        return self.store.perform(key, "close_ticket", {"ticket_id": ticket_id}, apply)

    def reopen_ticket(self, key: str, ticket_id: str) -> Operation:
        """Reopen a closed ticket; reopening an open one changes nothing."""

        def apply(conn: sqlite3.Connection) -> tuple[str, dict[str, Any]]:
            row = conn.execute(
                "SELECT status FROM tickets WHERE ticket_id = ?", (ticket_id,)
            ).fetchone()
            if row is None:
                raise UnknownOperationError(f"ticket {ticket_id!r} was never closed here")
            if row[0] == "closed":
                conn.execute(
                    "UPDATE tickets SET status = 'reopened' WHERE ticket_id = ?", (ticket_id,)
                )
                SqliteStore.record_effect(
                    conn, "ticket.reopened", idempotency_key=key, ticket_id=ticket_id
                )
            return ticket_id, {"ticket_id": ticket_id, "status": "reopened"}

        return self.store.perform(key, "reopen_ticket", {"ticket_id": ticket_id}, apply)

    def tickets(self, status: str | None = None) -> list[Ticket]:
        rows = self.store.query("SELECT * FROM tickets ORDER BY rowid")
        return [
            Ticket(r["ticket_id"], r["status"])
            for r in rows
            if status is None or r["status"] == status
        ]

    def status(self, ticket_id: str) -> str:
        rows = self.store.query("SELECT status FROM tickets WHERE ticket_id = ?", (ticket_id,))
        return str(rows[0]["status"]) if rows else "open"
