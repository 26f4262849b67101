"""The refund example's providers keep real state and honour idempotency keys, so
the end-to-end tests can check the world against the providers' own records."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from services.refund.errors import IdempotencyKeyReused, PolicyRejection, UnknownOperationError
from services.refund.providers import (
    InventoryProvider,
    MailerProvider,
    PaymentsProvider,
    PolicyProvider,
    TicketsProvider,
)


def test_same_key_twice_issues_one_credit_with_one_id(tmp_path: Path) -> None:
    """R8/R15: a retried call with the same key is the same operation, not a second."""
    payments = PaymentsProvider(tmp_path)
    first = payments.issue_credit("k-1", "ord-1", 1250)
    again = payments.issue_credit("k-1", "ord-1", 1250)
    assert again.operation_id == first.operation_id
    assert again.result == first.result
    assert again.replayed and not first.replayed
    assert len(payments.credits()) == 1
    assert len(payments.effects("credit.issued")) == 1


def test_a_key_reused_for_other_arguments_is_refused(tmp_path: Path) -> None:
    payments = PaymentsProvider(tmp_path)
    payments.issue_credit("k-1", "ord-1", 1250)
    with pytest.raises(IdempotencyKeyReused, match="k-1"):
        payments.issue_credit("k-1", "ord-1", 9999)
    assert [c.amount_cents for c in payments.credits()] == [1250]


def test_lookup_finds_a_committed_operation_and_nothing_for_an_unused_key(
    tmp_path: Path,
) -> None:
    """R11: reconciliation asks the provider by idempotency key."""
    payments = PaymentsProvider(tmp_path)
    issued = payments.issue_credit("k-1", "ord-1", 1250)
    found = payments.lookup("k-1")
    assert found is not None
    assert found.operation_id == issued.operation_id
    assert found.result["credit_id"] == issued.result["credit_id"]
    assert payments.lookup("k-never-used") is None


def test_state_survives_a_new_provider_on_the_same_directory(tmp_path: Path) -> None:
    """A restarted service sees what the killed one did, and still deduplicates."""
    first = InventoryProvider(tmp_path)
    hold = first.place_hold("k-1", "ord-1", "sku-1", 2)
    first.close()
    restarted = InventoryProvider(tmp_path)
    assert restarted.place_hold("k-1", "ord-1", "sku-1", 2).operation_id == hold.operation_id
    assert [h.status for h in restarted.holds()] == ["active"]


def test_releasing_a_hold_twice_releases_it_once(tmp_path: Path) -> None:
    """R8: compensations are idempotent, by key and by state."""
    inventory = InventoryProvider(tmp_path)
    hold_id = inventory.place_hold("k-1", "ord-1", "sku-1", 1).result["hold_id"]
    inventory.release_hold("c-1", hold_id)
    inventory.release_hold("c-1", hold_id)
    inventory.release_hold("c-other", hold_id)
    assert [h.status for h in inventory.holds()] == ["released"]
    assert len(inventory.effects("hold.released")) == 1


def test_restock_and_removal_move_stock_and_are_logged_in_order(tmp_path: Path) -> None:
    inventory = InventoryProvider(tmp_path)
    movement = inventory.return_to_inventory("k-1", "ord-1", "sku-1", 3).result["movement_id"]
    assert inventory.on_hand("sku-1") == 3
    inventory.remove_from_inventory("c-1", movement)
    inventory.remove_from_inventory("c-2", movement)
    assert inventory.on_hand("sku-1") == 0
    assert [m.status for m in inventory.movements()] == ["removed"]
    assert [e.kind for e in inventory.effects()] == ["stock.returned", "stock.removed"]


def test_undoing_an_operation_that_never_happened_is_an_error(tmp_path: Path) -> None:
    """R1: there is nothing to compensate for an effect that never committed."""
    with pytest.raises(UnknownOperationError, match="hold-missing"):
        InventoryProvider(tmp_path).release_hold("c-1", "hold-missing")


def test_a_correction_is_a_second_message_linked_to_the_first(tmp_path: Path) -> None:
    """Seed 003: an email cannot be unsent; the compensation is a correction."""
    mailer = MailerProvider(tmp_path)
    sent = mailer.send_reply("k-1", "ord-1", "credit-1", "Your refund is on its way")
    mailer.send_correction("c-1", sent.operation_id, "Please disregard")
    mailer.send_correction("c-1", sent.operation_id, "Please disregard")
    assert [e.kind for e in mailer.emails()] == ["reply", "correction"]
    assert mailer.emails(kind="correction")[0].corrects == sent.operation_id


def test_a_closed_ticket_reopens_once(tmp_path: Path) -> None:
    tickets = TicketsProvider(tmp_path)
    assert tickets.status("T-1") == "open"
    tickets.close_ticket("k-1", "T-1")
    assert tickets.status("T-1") == "closed"
    tickets.reopen_ticket("c-1", "T-1")
    tickets.reopen_ticket("c-2", "T-1")
    assert tickets.status("T-1") == "reopened"
    assert len(tickets.effects("ticket.reopened")) == 1


def test_policy_rejects_a_refund_over_the_limit_and_a_refused_order(tmp_path: Path) -> None:
    """R9: these are business rejections, never retried."""
    policy = PolicyProvider(tmp_path, limit_cents=500_00, refused_orders=["ord-fraud"])
    assert policy.evaluate("ord-1", 500_00, "damaged").limit_cents == 500_00
    with pytest.raises(PolicyRejection, match="exceeds the policy limit"):
        policy.evaluate("ord-1", 500_01, "damaged")
    with pytest.raises(PolicyRejection, match="not refundable"):
        policy.evaluate("ord-fraud", 10, "damaged")
    assert [e.kind for e in policy.effects()] == [
        "policy.approved",
        "policy.refused",
        "policy.refused",
    ]


def test_concurrent_calls_with_one_key_from_two_threads_make_one_effect(tmp_path: Path) -> None:
    """Two runtime threads racing on a redelivered command still make one credit."""
    payments = PaymentsProvider(tmp_path)
    ids: list[str] = []
    barrier = threading.Barrier(4)

    def issue() -> None:
        barrier.wait()
        for _ in range(10):
            ids.append(payments.issue_credit("k-race", "ord-1", 100).operation_id)

    threads = [threading.Thread(target=issue) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 40
    assert len(set(ids)) == 1
    assert len(payments.effects("credit.issued")) == 1


def test_two_providers_on_one_file_serialise_their_writes(tmp_path: Path) -> None:
    """Like a killed process and its restart overlapping on the same database."""
    a, b = PaymentsProvider(tmp_path), PaymentsProvider(tmp_path)
    a.issue_credit("k-1", "ord-1", 100)
    assert b.issue_credit("k-1", "ord-1", 100).replayed
    b.issue_credit("k-2", "ord-2", 200)
    assert [c.order_id for c in a.credits()] == ["ord-1", "ord-2"]
