"""The demo's end-to-end invariant, on hand-made receipts and provider worlds.

Each test builds the world a bug would leave behind (a hold still active in a
compensated saga, a hold released twice, a voided credit, ...) and checks that
``check_invariants`` names it; the consistent worlds pass. ``read_world`` is checked
against real provider files.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from schemas.keys import key_hash
from schemas.models import Reversibility, TerminalStatus
from schemas.receipt import Disposition, IncidentRecord, Receipt, StepReceipt
from services.demo_invariants import (
    ProviderEffect,
    ProviderFileUnreadable,
    ProviderWorld,
    Violation,
    check_invariants,
    read_world,
)
from services.refund.providers import InventoryProvider, MailerProvider, PaymentsProvider

HOLD_KEY, RESTOCK_KEY, CREDIT_KEY, REPLY_KEY = "idem-hold", "idem-restock", "idem-credit", "idem-m"


def step(
    step_id: str,
    tool: str,
    disposition: Disposition,
    *,
    key: str | None,
    op: str | None,
    pivot: bool = False,
    incident_id: str | None = None,
) -> StepReceipt:
    return StepReceipt(
        step_id=step_id,
        tool=tool,
        participant="p",
        reversibility=Reversibility.REVERSIBLE,
        pivot=pivot,
        idempotency_key_hash=key_hash(key) if key else None,
        provider_operation_id=op,
        observation="COMMITTED" if op else "FAILED",
        forward_attempts=1,
        committed_at=1 if op else None,
        disposition=disposition,
        owner="ops",
        incident_id=incident_id,
    )


def receipt(
    status: TerminalStatus,
    steps: list[StepReceipt],
    incidents: list[IncidentRecord] | None = None,
    saga_id: str = "saga-1",
) -> Receipt:
    return Receipt(
        saga_id=saga_id,
        tenant_id="t",
        workflow="refund",
        workflow_version="1",
        policy_version="1",
        sdk_version="0",
        principal="agent",
        generation=1,
        status=status,
        started_at=0,
        ended_at=1,
        steps=steps,
        incidents=incidents or [],
    )


def hold_placed() -> ProviderEffect:
    return ProviderEffect("inventory", "hold.placed", HOLD_KEY, "hold-1", {"order_id": "o"})


def hold_released(key: str = "comp-hold") -> ProviderEffect:
    return ProviderEffect("inventory", "hold.released", key, "hold-1", {})


def credit_issued() -> ProviderEffect:
    return ProviderEffect("payments", "credit.issued", CREDIT_KEY, "credit-1", {"order_id": "o"})


def reply_sent() -> ProviderEffect:
    return ProviderEffect("mailer", "email.reply", REPLY_KEY, "msg-1", {"credit_id": "credit-1"})


def compensated_hold_saga() -> Receipt:
    """A return whose credit was rejected: the hold was undone (R9, R12)."""
    return receipt(
        TerminalStatus.COMPENSATED,
        [
            step("01", "place_hold", Disposition.COMPENSATED, key=HOLD_KEY, op="hold-1"),
            step(
                "02",
                "issue_credit",
                Disposition.NOT_COMMITTED,
                key=CREDIT_KEY,
                op=None,
                pivot=True,
            ),
        ],
    )


def completed_credit_saga() -> Receipt:
    return receipt(
        TerminalStatus.COMPLETED,
        [
            step("01", "issue_credit", Disposition.RETAINED, key=CREDIT_KEY, op="credit-1"),
            step("02", "send_reply", Disposition.RETAINED, key=REPLY_KEY, op="msg-1"),
        ],
    )


def rules(violations: list[Violation]) -> list[str]:
    return [v.rule for v in violations]


# ------------------------------------------------------------------ consistent


def test_a_compensated_hold_released_once_is_consistent() -> None:
    world = ProviderWorld(effects=[hold_placed(), hold_released()], holds={"hold-1": "released"})
    assert check_invariants([compensated_hold_saga()], world) == []


def test_a_completed_credit_with_its_reply_is_consistent() -> None:
    world = ProviderWorld(
        effects=[credit_issued(), reply_sent()],
        credits={"credit-1": "issued"},
        reply_credits={"msg-1": "credit-1"},
    )
    assert check_invariants([completed_credit_saga()], world) == []


def test_an_escalated_hold_named_in_an_incident_is_consistent() -> None:
    """R8: a compensation that finally fails is handed to a named person."""
    incident = IncidentRecord(
        incident_id="inc-1",
        kind="compensation_failed",
        step_id="01",
        inconsistency="hold still active",
        effect="hold-1",
        owner="warehouse",
    )
    escalated = receipt(
        TerminalStatus.ESCALATED,
        [
            step(
                "01",
                "place_hold",
                Disposition.ESCALATED,
                key=HOLD_KEY,
                op="hold-1",
                incident_id="inc-1",
            )
        ],
        [incident],
    )
    world = ProviderWorld(effects=[hold_placed()], holds={"hold-1": "active"})
    assert check_invariants([escalated], world) == []


# ------------------------------------------------------------------ violations


def test_a_hold_left_active_in_a_compensated_saga_is_a_violation() -> None:
    """R12: a saga is never called compensated because the loop ran."""
    world = ProviderWorld(effects=[hold_placed()], holds={"hold-1": "active"})
    violations = check_invariants([compensated_hold_saga()], world)
    assert any("still in place" in v.message and v.saga_id == "saga-1" for v in violations)
    assert "R8" in rules(violations)  # and it was compensated zero times, not once


def test_a_hold_released_twice_is_a_violation() -> None:
    """R8: a compensation takes effect exactly once."""
    world = ProviderWorld(
        effects=[hold_placed(), hold_released("comp-a"), hold_released("comp-b")],
        holds={"hold-1": "released"},
    )
    violations = check_invariants([compensated_hold_saga()], world)
    assert [v.rule for v in violations] == ["R8"]
    assert "2 times" in violations[0].message


def test_a_voided_credit_is_a_violation() -> None:
    """R6: the pivot is never clawed back."""
    world = ProviderWorld(
        effects=[
            credit_issued(),
            reply_sent(),
            ProviderEffect("payments", "credit.voided", "comp-c", "credit-1", {}),
        ],
        credits={"credit-1": "voided"},
        reply_credits={"msg-1": "credit-1"},
    )
    violations = check_invariants([completed_credit_saga()], world)
    assert any(v.rule == "R6" and "voided" in v.message for v in violations)


def test_a_credit_without_a_reply_or_an_incident_is_a_violation() -> None:
    only_credit = receipt(
        TerminalStatus.COMPLETED,
        [step("01", "issue_credit", Disposition.RETAINED, key=CREDIT_KEY, op="credit-1")],
    )
    world = ProviderWorld(effects=[credit_issued()], credits={"credit-1": "issued"})
    violations = check_invariants([only_credit], world)
    assert any("no reply mentions it" in v.message for v in violations)


def test_an_effect_the_receipt_calls_not_committed_is_a_violation() -> None:
    """R1: a step settled as not committed must really have no effect."""
    world = ProviderWorld(
        effects=[credit_issued(), reply_sent()],
        credits={"credit-1": "issued"},
        reply_credits={"msg-1": "credit-1"},
    )
    lying = receipt(
        TerminalStatus.COMPENSATED,
        [
            step("01", "issue_credit", Disposition.NOT_COMMITTED, key=CREDIT_KEY, op=None),
            step("02", "send_reply", Disposition.RETAINED, key=REPLY_KEY, op="msg-1"),
        ],
    )
    assert "R1" in rules(check_invariants([lying], world))


def test_an_effect_no_receipt_accounts_for_is_a_violation() -> None:
    world = ProviderWorld(effects=[hold_placed()], holds={"hold-1": "active"})
    violations = check_invariants([], world)
    assert len(violations) == 1
    assert "no saga receipt accounts for" in violations[0].message


def test_a_saga_without_a_receipt_is_a_violation() -> None:
    """R14: every saga ends in a terminal state."""
    violations = check_invariants([], ProviderWorld(), expected_sagas=["saga-9"])
    assert [(v.rule, v.saga_id) for v in violations] == [("R14", "saga-9")]


def test_an_escalated_step_with_no_incident_is_a_violation() -> None:
    escalated = receipt(
        TerminalStatus.ESCALATED,
        [step("01", "place_hold", Disposition.ESCALATED, key=HOLD_KEY, op="hold-1")],
    )
    world = ProviderWorld(effects=[hold_placed()], holds={"hold-1": "active"})
    assert "R8" in rules(check_invariants([escalated], world))


def _incident(step_id: str = "01") -> IncidentRecord:
    return IncidentRecord(
        incident_id="inc-1",
        kind="compensation_failed",
        step_id=step_id,
        inconsistency="hold still active",
        effect="hold-1",
        owner="warehouse",
    )


def test_a_compensated_step_in_a_completed_saga_is_a_violation() -> None:
    """COMPLETED means every committed effect was retained (docs/protocol.md,
    Terminal): a receipt that calls the saga completed while one of its steps was
    undone contradicts itself, and the demo said nothing."""
    contradicting = receipt(
        TerminalStatus.COMPLETED,
        [
            step("01", "place_hold", Disposition.COMPENSATED, key=HOLD_KEY, op="hold-1"),
            step("02", "issue_credit", Disposition.RETAINED, key=CREDIT_KEY, op="credit-1"),
            step("03", "send_reply", Disposition.RETAINED, key=REPLY_KEY, op="msg-1"),
        ],
    )
    world = ProviderWorld(
        effects=[hold_placed(), hold_released(), credit_issued(), reply_sent()],
        holds={"hold-1": "released"},
        credits={"credit-1": "issued"},
        reply_credits={"msg-1": "credit-1"},
    )
    violations = check_invariants([contradicting], world)
    assert any(
        v.rule == "R14" and "01 (place_hold)" in v.message and "COMPLETED" in v.message
        for v in violations
    ), violations


def test_an_escalated_step_the_ledger_saw_commit_but_the_provider_lacks_is_a_violation() -> None:
    """An ESCALATED step whose compensation failed hands a committed effect to a
    person: the provider must have it, or the incident sends them after nothing (and
    the ledger's commit was false)."""
    escalated = receipt(
        TerminalStatus.ESCALATED,
        [
            step(
                "01",
                "place_hold",
                Disposition.ESCALATED,
                key=HOLD_KEY,
                op="hold-1",
                incident_id="inc-1",
            )
        ],
        [_incident()],
    )
    violations = check_invariants([escalated], ProviderWorld())
    assert any(
        v.rule == "R14" and "the provider has no such effect" in v.message for v in violations
    ), violations


def test_an_escalated_step_of_unknown_outcome_without_an_effect_is_consistent() -> None:
    """Escalated before any commit was seen (an unknown outcome handed to a person):
    the effect may or may not exist; neither is a violation."""
    escalated = receipt(
        TerminalStatus.ESCALATED,
        [
            step(
                "01",
                "place_hold",
                Disposition.ESCALATED,
                key=HOLD_KEY,
                op=None,
                incident_id="inc-1",
            )
        ],
        [_incident()],
    )
    assert check_invariants([escalated], ProviderWorld()) == []


# ------------------------------------------------------------------ read_world


def test_read_world_reads_the_providers_own_files(tmp_path: Path) -> None:
    inventory = InventoryProvider(tmp_path / "inventory")
    payments = PaymentsProvider(tmp_path / "payments")
    mailer = MailerProvider(tmp_path / "mailer")
    hold = inventory.place_hold("k-hold", "o", "sku", 1)
    inventory.release_hold("k-release", hold.operation_id)
    credit = payments.issue_credit("k-credit", "o", 500)
    mailer.send_reply("k-reply", "o", credit.operation_id, "refunded")
    for provider in (inventory, payments, mailer):
        provider.store.close()

    world = read_world(tmp_path)

    assert world.holds == {hold.operation_id: "released"}
    assert world.credits == {credit.operation_id: "issued"}
    assert list(world.reply_credits.values()) == [credit.operation_id]
    assert [e.kind for e in world.effects] == [
        "hold.placed",
        "hold.released",
        "credit.issued",
        "email.reply",
    ]


def test_a_world_changing_step_the_receipt_calls_read_only_is_a_violation() -> None:
    """R14: a receipt that calls a hold "read-only" (so nothing is undone) while the
    provider holds it must not pass: the hold stands in a compensated saga."""
    lying = receipt(
        TerminalStatus.COMPENSATED,
        [step("01", "place_hold", Disposition.READ_ONLY, key=HOLD_KEY, op="hold-1")],
    )
    world = ProviderWorld(effects=[hold_placed()], holds={"hold-1": "active"})
    violations = check_invariants([lying], world)
    assert any(v.saga_id == "saga-1" and "read-only" in v.message for v in violations), violations


def test_a_provider_file_that_cannot_be_read_is_an_error_not_an_empty_world(
    tmp_path: Path,
) -> None:
    """Every sqlite3.OperationalError read as "the table was never created": an
    unreadable provider file counted as a provider that did nothing, so the invariant
    could pass on no data at all."""
    (tmp_path / "payments" / PaymentsProvider.file_name).mkdir(parents=True)
    with pytest.raises(ProviderFileUnreadable, match="payments"):
        read_world(tmp_path)


def test_a_provider_file_of_another_shape_is_an_error_not_an_empty_world(
    tmp_path: Path,
) -> None:
    """A table without the columns the check reads ("no such column") is not "never
    created" either."""
    (tmp_path / "inventory").mkdir()
    conn = sqlite3.connect(tmp_path / "inventory" / InventoryProvider.file_name)
    conn.execute("CREATE TABLE effects (seq INTEGER, kind TEXT)")
    conn.execute("INSERT INTO effects VALUES (1, 'hold.placed')")
    conn.commit()
    conn.close()
    with pytest.raises(ProviderFileUnreadable, match="no such column"):
        read_world(tmp_path)


def test_a_locked_provider_file_is_an_error_not_the_world_without_its_log(
    tmp_path: Path,
) -> None:
    """docs/running-the-demo.md: a provider file that is locked is "Invariant NOT
    checked". read_world fell back to an immutable read instead, which skips the
    write-ahead log: the hold the provider committed (still in its -wal file) was
    missing from the world, so an effect nobody accounts for, or one applied twice,
    would pass unseen."""
    inventory = InventoryProvider(tmp_path / "inventory")
    inventory.place_hold("k-hold", "o", "sku", 1)
    path = tmp_path / "inventory" / InventoryProvider.file_name
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("SELECT count(*) FROM holds").fetchall()
        inventory.store.close()  # not the last connection: the WAL is not checkpointed
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("CREATE TABLE IF NOT EXISTS scratch (a)")
        holder.execute("COMMIT")  # the exclusive lock stays held
        assert path.with_name(path.name + "-wal").stat().st_size > 0

        with pytest.raises(ProviderFileUnreadable, match="inventory"):
            world = read_world(tmp_path)
            assert [e.kind for e in world.effects] == ["hold.placed"], world  # never reached
    finally:
        holder.close()


def test_a_provider_that_never_created_a_table_contributes_nothing(tmp_path: Path) -> None:
    (tmp_path / "mailer").mkdir()
    sqlite3.connect(tmp_path / "mailer" / MailerProvider.file_name).close()
    world = read_world(tmp_path)
    assert world.effects == () and world.reply_credits == {}
