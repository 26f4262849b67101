"""The refund participants through their checked catalogues, as the runtime calls
them: tools read the idempotency key from ``current_call()``, compensations undo what
``ctx.result`` names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from participants.catalogue import Catalogue, ToolKind
from participants.context import CallContext, call_context
from participants.declarations import BusinessRejection, CompensationContext
from schemas.models import ReconcileResult
from services.refund import PARTICIPANTS, build_catalogue, build_participant
from services.refund.errors import PolicyRejection


def world(catalogue: Catalogue) -> Any:
    """The provider behind a catalogue's participant, to check the world."""
    participant: Any = catalogue.participants[0]
    return participant.provider


def run(catalogue: Catalogue, tool: str, key: str, **args: Any) -> Any:
    ctx = CallContext(saga_id="saga-1", step_id="s1", tool=tool, idempotency_key=key)
    with call_context(ctx):
        return catalogue[tool].invoke(args)


def compensate(catalogue: Catalogue, tool: str, key: str, args: dict[str, Any], result: Any) -> Any:
    ctx = CompensationContext("saga-1", tool, args, result, idempotency_key=key)
    with call_context(
        CallContext("saga-1", "s1", tool, key, compensation_key=ctx.compensation_key)
    ):
        return catalogue[tool].compensate(ctx)


@pytest.mark.parametrize("name", sorted(PARTICIPANTS))
def test_every_participant_catalogue_passes_wrap(name: str, tmp_path: Path) -> None:
    """R4: wrap() validates every declaration of every refund participant."""
    catalogue = build_catalogue(name, tmp_path)
    assert catalogue.name == name
    assert len(catalogue) >= 1


def test_the_catalogues_declare_seed_003s_refund_contract(tmp_path: Path) -> None:
    specs = {
        name: spec
        for participant in PARTICIPANTS
        for name, spec in build_catalogue(participant, tmp_path).items()
    }
    assert specs["validate_refund"].kind is ToolKind.READ_ONLY
    assert specs["place_hold"].compensation == "release_hold"
    assert specs["return_to_inventory"].compensation == "remove_from_inventory"
    assert specs["place_hold"].resources == specs["return_to_inventory"].resources
    assert [n for n, s in specs.items() if s.pivot] == ["issue_credit"]
    assert specs["issue_credit"].lookup_name == "find_credit"
    assert specs["send_reply"].kind is ToolKind.IRREVERSIBLE
    assert specs["send_reply"].compensation == "send_correction"
    assert specs["close_ticket"].kind is ToolKind.REVERSIBLE


def test_build_participant_names_the_choices_for_an_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="choose one of: policy, inventory"):
        build_participant("billing", tmp_path)


def test_a_tool_returns_its_identifier_and_a_retry_returns_the_same(tmp_path: Path) -> None:
    """Seed 000: return the identifier; R15: a redelivered call changes nothing."""
    catalogue = build_catalogue("inventory", tmp_path)
    first = run(catalogue, "place_hold", "k-1", order_id="o-1", sku="sku-1", quantity=1)
    again = run(catalogue, "place_hold", "k-1", order_id="o-1", sku="sku-1", quantity=1)
    assert first == again
    assert catalogue["place_hold"].provider_operation_id(first) == first["hold_id"]
    assert len(world(catalogue).holds()) == 1


def test_release_hold_releases_the_hold_named_in_ctx_result(tmp_path: Path) -> None:
    """Seed 000: the compensation targets what the tool returned."""
    catalogue = build_catalogue("inventory", tmp_path)
    provider = world(catalogue)
    args = {"order_id": "o-1", "sku": "sku-1", "quantity": 1}
    keep = run(catalogue, "place_hold", "k-keep", **{**args, "order_id": "o-2"})
    undo = run(catalogue, "place_hold", "k-undo", **args)
    compensate(catalogue, "place_hold", "k-undo", args, undo)
    compensate(catalogue, "place_hold", "k-undo", args, undo)
    assert {h.hold_id: h.status for h in provider.holds()} == {
        keep["hold_id"]: "active",
        undo["hold_id"]: "released",
    }
    assert len(provider.effects("hold.released")) == 1


def test_remove_from_inventory_undoes_the_restock_in_ctx_result(tmp_path: Path) -> None:
    catalogue = build_catalogue("inventory", tmp_path)
    provider = world(catalogue)
    args = {"order_id": "o-1", "sku": "sku-9", "quantity": 2}
    restock = run(catalogue, "return_to_inventory", "k-1", **args)
    assert provider.on_hand("sku-9") == 2
    compensate(catalogue, "return_to_inventory", "k-1", args, restock)
    assert provider.on_hand("sku-9") == 0
    assert [m.status for m in provider.movements()] == ["removed"]


def test_issue_credit_lookup_reports_committed_with_the_credit(tmp_path: Path) -> None:
    """R11: an unknown credit is settled by looking it up by its key."""
    catalogue = build_catalogue("payments", tmp_path)
    credit = run(catalogue, "issue_credit", "k-1", order_id="o-1", amount_cents=1500)
    found = catalogue["issue_credit"].lookup("k-1")
    assert found.status is ReconcileResult.COMMITTED
    assert found.result == credit
    assert found.provider_operation_id == credit["credit_id"]
    assert catalogue["issue_credit"].lookup("k-other").status is ReconcileResult.NOT_FOUND


def test_send_correction_follows_up_the_message_in_ctx_result(tmp_path: Path) -> None:
    catalogue = build_catalogue("mailer", tmp_path)
    provider = world(catalogue)
    args = {"order_id": "o-1", "credit_id": "credit-1", "text": "Refunded."}
    sent = run(catalogue, "send_reply", "k-1", **args)
    compensate(catalogue, "send_reply", "k-1", args, sent)
    correction = provider.emails(kind="correction")
    assert [e.corrects for e in correction] == [sent["message_id"]]
    assert "order o-1" in correction[0].text


def test_reopen_ticket_reopens_the_ticket_in_ctx_result(tmp_path: Path) -> None:
    catalogue = build_catalogue("tickets", tmp_path)
    closed = run(catalogue, "close_ticket", "k-1", ticket_id="T-1")
    compensate(catalogue, "close_ticket", "k-1", {"ticket_id": "T-1"}, closed)
    assert world(catalogue).status("T-1") == "reopened"


def test_validate_refund_over_the_limit_is_a_business_rejection(tmp_path: Path) -> None:
    """R9: the spec classifies the policy's refusal as not retryable."""
    catalogue = build_catalogue("policy", tmp_path)
    with pytest.raises(PolicyRejection) as raised:
        run(catalogue, "validate_refund", "k-1", order_id="o-1", amount_cents=600_00, reason="x")
    assert catalogue["validate_refund"].is_business_rejection(raised.value)
    assert isinstance(raised.value, BusinessRejection)
    ok = run(catalogue, "validate_refund", "k-2", order_id="o-1", amount_cents=100, reason="x")
    assert ok["approved"] is True


@pytest.mark.parametrize(
    ("participant", "tool", "args", "undone"),
    [
        (
            "inventory",
            "place_hold",
            {"order_id": "o-9", "sku": "sku-9", "quantity": 1},
            lambda p: [h.status for h in p.holds()] == ["released"],
        ),
        (
            "inventory",
            "return_to_inventory",
            {"order_id": "o-9", "sku": "sku-9", "quantity": 2},
            lambda p: [m.status for m in p.movements()] == ["removed"] and p.on_hand("sku-9") == 0,
        ),
        (
            "mailer",
            "send_reply",
            {"order_id": "o-9", "text": "refunded", "credit_id": None},
            lambda p: len(p.emails(kind="correction")) == 1,
        ),
        (
            "tickets",
            "close_ticket",
            {"ticket_id": "T-9"},
            lambda p: p.status("T-9") == "reopened",
        ),
    ],
)
def test_a_compensation_with_no_result_finds_what_to_undo_by_the_forward_key(
    participant: str, tool: str, args: dict[str, Any], undone: Any, tmp_path: Path
) -> None:
    """docs/operating.md: an unknown outcome an operator settles as COMMITTED without
    --result gives the compensation ctx.result = None ("write compensations that can
    find the operation by ctx.idempotency_key then"). The refund compensations read
    ctx.result["hold_id"] (...) only, and so failed with a TypeError on every attempt:
    the hold stayed placed although the provider could say which one it was."""
    catalogue = build_catalogue(participant, tmp_path)
    run(catalogue, tool, "k-fwd", **args)
    ctx = CompensationContext("saga-1", tool, args, None, idempotency_key="k-fwd")
    with call_context(
        CallContext("saga-1", "s1", tool, "k-fwd", compensation_key=ctx.compensation_key)
    ):
        catalogue[tool].compensate(ctx)
    assert undone(world(catalogue)), world(catalogue).effects()


def test_a_compensation_with_no_result_uses_the_operators_operation_id(tmp_path: Path) -> None:
    catalogue = build_catalogue("inventory", tmp_path)
    args = {"order_id": "o-9", "sku": "sku-9", "quantity": 1}
    hold = run(catalogue, "place_hold", "k-fwd", **args)
    ctx = CompensationContext(
        "saga-1",
        "place_hold",
        args,
        None,
        idempotency_key="k-other",  # the operator knows better than the key
        provider_operation_id=hold["hold_id"],
    )
    with call_context(
        CallContext("saga-1", "s1", "place_hold", "k-other", compensation_key=ctx.compensation_key)
    ):
        catalogue["place_hold"].compensate(ctx)
    assert [h.status for h in world(catalogue).holds()] == ["released"]
