"""Operator commands tell the truth (issue 12), on the real broker: no "approved" for a
grant nobody will accept, an approval stays approvable after a rejected grant, and an
unknown outcome settled as COMMITTED hands its operation id to the compensation (R7,
R8, R11)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from participants import (
    BusinessRejection,
    CompensationContext,
    Reversibility,
    compensable,
    tool,
    wrap,
)
from participants.client import StepEscalated
from sagaline.kafka import LedgerReader
from sagaline.ops.actions import OperatorChannel, resolve_incident
from schemas import ApprovalGranted, ApprovalRequested, IncidentRaised, TerminalStatus
from schemas.codec import decode
from schemas.wire import DLQ_REASON, to_message
from services.cli import main
from tests.system import System, wait_until

pytestmark = pytest.mark.kafka


class Desk:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.charge_may_answer = threading.Event()
        self.refunds: list[tuple[str | None, Any]] = []

    @tool(description="Send a letter", owner="post-room")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def send_letter(self, to: str) -> str:
        self.sent.append(to)
        return f"letter-{to}"

    @tool(description="Charge a card; answers too late to count", deadline=1.0, owner="billing")
    @compensable(by="refund")
    def charge(self, cents: int) -> dict[str, Any]:
        self.charge_may_answer.wait(60)  # the provider hangs past the deadline
        return {"late": True}

    def refund(self, ctx: CompensationContext) -> None:
        self.refunds.append((ctx.provider_operation_id, ctx.result))

    @tool(description="Always says no")
    @compensable(by="nothing")
    def refuse(self) -> None:
        raise BusinessRejection("no")

    def nothing(self) -> None:
        return None


@pytest.fixture
def desk(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[System, Desk]]:
    desk = Desk()
    with System(kafka_bootstrap, unique_prefix, tmp_path, [wrap(desk, name="desk")]) as system:
        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
        monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
        monkeypatch.setenv("SAGALINE_HMAC_KEY", "test-key")
        yield system, desk
        desk.charge_may_answer.set()


def _letter_awaiting_approval(system: System) -> tuple[Any, ApprovalRequested, dict[str, Any]]:
    saga = system.client.saga("letters", "agent")
    out: dict[str, Any] = {}

    def agent() -> None:
        try:
            with saga:
                out["result"] = saga.call("send_letter", to="ada")
        except Exception as exc:
            out["error"] = exc

    threading.Thread(target=agent, daemon=True).start()
    request = wait_until(
        lambda: next(
            (r for r in system.records(saga.saga_id) if isinstance(r, ApprovalRequested)), None
        ),
        what="the approval request",
    )
    return saga, request, out


def test_approve_without_the_key_exits_non_zero_with_one_line_and_grants_nothing_R7(
    desk: tuple[System, Desk],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    system, office = desk
    saga, request, _out = _letter_awaiting_approval(system)
    monkeypatch.delenv("SAGALINE_HMAC_KEY")
    capsys.readouterr()
    assert main(["approve", saga.saga_id, request.step_id, "--operator", "alice"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SAGALINE_HMAC_KEY" in err and "approved" not in err
    grants = [r for r in system.records(saga.saga_id) if isinstance(r, ApprovalGranted)]
    assert grants == [] and office.sent == []

    monkeypatch.setenv("SAGALINE_HMAC_KEY", "test-key")
    assert main(["approve", saga.saga_id, request.step_id, "--operator", "alice"]) == 0
    assert saga.wait(60).status is TerminalStatus.COMPLETED and office.sent == ["ada"]


def test_a_rejected_grant_leaves_the_approval_pending_and_show_says_so_R7(
    desk: tuple[System, Desk], capsys: pytest.CaptureFixture[str]
) -> None:
    system, office = desk
    saga, request, out = _letter_awaiting_approval(system)
    wrong = ApprovalGranted(
        envelope=request.envelope.model_copy(
            update={"event_id": "forged-grant", "type": "ApprovalGranted", "producer": "x"}
        ),
        step_id=request.step_id,
        approval_id=request.approval_id,
        purpose=request.purpose,
        principal=request.principal,
        args_fingerprint="not-these-arguments",
        scope=request.scope,
        expires_at=request.expires_at,
        granted_by="mallory",
    )
    producer = system.raw_producer()
    key, value, headers = to_message(wrong, system.settings.signer())
    producer.produce(system.topics.events, key=key, value=value, headers=headers)
    producer.flush(30)
    wait_until(
        lambda: any(h.get(DLQ_REASON) == b"approval-mismatch" for _k, h in system.dlq()),
        what="the coordinator refusing the wrong grant",
    )

    capsys.readouterr()
    assert main(["saga", "show", saga.saga_id]) == 0
    shown = capsys.readouterr().out
    assert "REFUSED approval-mismatch" in shown and "REJECTED_MISMATCH by mallory" in shown
    assert office.sent == []

    assert main(["approve", saga.saga_id, request.step_id, "--operator", "alice"]) == 0
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert out == {"result": "letter-ada"} and office.sent == ["ada"]
    capsys.readouterr()
    assert main(["saga", "show", saga.saga_id]) == 0
    receipt = capsys.readouterr().out
    assert "REJECTED grant, not matching the request (not counted) by mallory" in receipt
    assert "granted by alice" in receipt


def test_unknown_outcome_resolved_committed_gives_the_compensation_its_operation_id_R11(
    desk: tuple[System, Desk], capsys: pytest.CaptureFixture[str]
) -> None:
    system, office = desk
    with pytest.raises(StepEscalated), system.client.saga("billing", "agent") as saga:
        saga.call("charge", cents=500)  # times out, no lookup: a person must settle it
    incident = wait_until(
        lambda: next(
            (r for r in system.records(saga.saga_id) if isinstance(r, IncidentRaised)), None
        ),
        what="the unknown-outcome incident",
    )
    office.charge_may_answer.set()

    capsys.readouterr()
    code = main(["incidents", "resolve", incident.incident_id, "--operator", "dave"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "COMMITTED" in err  # no traceback

    code = main(
        [
            "incidents",
            "resolve",
            incident.incident_id,
            "--operator",
            "dave",
            "--resolution",
            "committed",
            "--operation-id",
            "ch_77",
            "--result",
            '{"charge": "ch_77"}',
        ]
    )
    assert code == 0
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert office.refunds == [("ch_77", {"charge": "ch_77"})]


def test_two_operators_resolving_one_incident_differently_the_later_is_refused_visibly_R11(
    desk: tuple[System, Desk],
) -> None:
    """Alice and Bob both had the unknown outcome on screen and answered differently.
    Both records used to carry one event id, so the coordinator dropped Bob's as a
    duplicate, leaving no trace, while Bob was told it was recorded. Now Bob's is a
    record of its own that the coordinator refuses (DLQ, with the reason), and Alice's
    answer is the one acted on."""
    system, office = desk
    with pytest.raises(StepEscalated), system.client.saga("billing", "agent") as saga:
        saga.call("charge", cents=500)  # times out, no lookup: a person must settle it
    incident = wait_until(
        lambda: next(
            (r for r in system.records(saga.saga_id) if isinstance(r, IncidentRaised)), None
        ),
        what="the unknown-outcome incident",
    )
    office.charge_may_answer.set()
    channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
    try:
        first = resolve_incident(
            channel, incident, operator="alice", resolution="COMMITTED", operation_id="ch_1"
        )
        later = resolve_incident(channel, incident, operator="bob", resolution="NOT_FOUND")
    finally:
        channel.close()
    assert later.event_id != first.event_id

    def refused() -> dict[str, bytes] | None:
        for _key, value, headers in LedgerReader(system.bootstrap).records(system.topics.dlq):
            if decode(value or b"").event_id == later.event_id:
                pairs = headers.items() if isinstance(headers, dict) else headers or []
                return {k: v for k, v in pairs if isinstance(v, bytes)}
        return None

    found = wait_until(refused, what="the coordinator refusing Bob's resolution")
    assert found[DLQ_REASON] == b"invalid-transition"
    assert saga.wait(60).status is TerminalStatus.COMPENSATED
    assert office.refunds == [("ch_1", None)]  # Alice's answer: it happened
