"""The refund flow of seed 003 through the coordinator, on the real broker.

Each test runs the five refund participants (with their SQLite providers), the
coordinator and an agent in one process, injects one fault, and checks the outcome
against the providers' own state and the saga's receipt. The coordinator's and the
participants' clock is driven (:class:`~tests.system.DrivenClock`): a retry's backoff
passes when the test's :class:`~tests.system.RetryDriver` moves the clock to it, not
in real time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from participants.client import BusinessRejected, Saga
from sagaline.ops.actions import OperatorChannel, approval_granted, grant_approval
from schemas import (
    ApprovalGranted,
    ApprovalRequested,
    Disposition,
    IncidentRaised,
    StepFailed,
    TerminalStatus,
)
from schemas.wire import DLQ_REASON, to_message
from services.refund import PARTICIPANTS, FaultMode, FaultPlan, FaultRule, build_catalogue
from tests.system import DrivenClock, RetryDriver, System, wait_until

pytestmark = pytest.mark.kafka

NAMES = ["policy", "inventory", "payments", "mailer", "tickets"]
ORDER = {"order_id": "ord-1", "sku": "sku-9", "quantity": 1}


class Refunds:
    """The system plus each participant's provider, to check the world directly."""

    def __init__(self, bootstrap: str, prefix: str, tmp: Path, faults: FaultPlan) -> None:
        self.participants = {n: PARTICIPANTS[n](tmp / n, faults) for n in NAMES}
        catalogues = [build_catalogue(n, tmp / n, faults) for n in NAMES]
        # The providers the catalogues serve are separate objects on the same SQLite
        # files: the test reads the same world the participants change.
        self.clock = DrivenClock()
        self.system = System(bootstrap, prefix, tmp, catalogues, clock=self.clock)
        self.channel = OperatorChannel(bootstrap, self.system.topics, self.system.settings.signer())

    def provider(self, name: str) -> Any:
        return self.participants[name].provider

    def retries(self) -> RetryDriver:
        """Each retry the coordinator schedules is due at once (driven clock)."""
        return RetryDriver(self.system)

    def kinds(self, name: str) -> list[str]:
        return [e.kind for e in self.provider(name).effects()]

    def approve_when_asked(self, saga: Saga, stop: threading.Event) -> threading.Thread:
        """An operator who approves every request of the saga, the way a person would."""

        def run() -> None:
            done: set[str] = set()
            while not stop.is_set():
                for r in self.system.records(saga.saga_id):
                    if isinstance(r, ApprovalRequested) and r.approval_id not in done:
                        grant_approval(self.channel, r, operator="test-operator")
                        done.add(r.approval_id)
                stop.wait(0.2)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


@pytest.fixture
def refunds(
    request: pytest.FixtureRequest, transport: str, unique_prefix: str, tmp_path: Path
) -> Iterator[Refunds]:
    faults = FaultPlan(seed=1, rules=list(getattr(request, "param", [])))
    r = Refunds(transport, unique_prefix, tmp_path, faults)
    with r.system:
        yield r


def _refund_until_credit(saga: Saga) -> dict[str, Any]:
    saga.call("validate_refund", order_id="ord-1", amount_cents=4000, reason="damaged")
    saga.call("place_hold", **ORDER)
    saga.call("return_to_inventory", **ORDER)
    credit: dict[str, Any] = saga.call("issue_credit", order_id="ord-1", amount_cents=4000)
    return credit


@pytest.mark.parametrize(
    "refunds", [[FaultRule(method="issue_credit", mode=FaultMode.REJECT)]], indirect=True
)
def test_failure_before_the_pivot_unwinds_restock_then_hold_R2_R9(refunds: Refunds) -> None:
    with pytest.raises(BusinessRejected), refunds.system.client.saga("refund", "agent") as saga:
        _refund_until_credit(saga)
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert refunds.kinds("inventory") == [
        "hold.placed",
        "stock.returned",
        "stock.removed",
        "hold.released",
    ]
    assert refunds.provider("payments").credits() == []
    by_tool = {s.tool: s.disposition for s in receipt.steps}
    assert by_tool["validate_refund"] is Disposition.READ_ONLY
    assert by_tool["issue_credit"] is Disposition.NOT_COMMITTED


@pytest.mark.parametrize(
    "refunds",
    [[FaultRule(method="send_reply", mode=FaultMode.TRANSIENT, times=2)]],
    indirect=True,
)
def test_email_failure_after_the_pivot_is_retried_forward_never_clawed_back_R6(
    refunds: Refunds,
) -> None:
    stop = threading.Event()
    with refunds.retries():
        with refunds.system.client.saga("refund", "agent") as saga:
            operator = refunds.approve_when_asked(saga, stop)
            credit = _refund_until_credit(saga)
            saga.call(
                "send_reply", order_id="ord-1", text="refunded", credit_id=credit["credit_id"]
            )
        receipt = saga.wait(60)
    stop.set()
    operator.join(10)
    assert receipt.status is TerminalStatus.COMPLETED
    failures = [r for r in refunds.system.records(saga.saga_id) if isinstance(r, StepFailed)]
    assert [f.attempt for f in failures] == [1, 2]
    assert len({f.idempotency_key for f in failures}) == 1  # retried with the same key
    assert [c.status for c in refunds.provider("payments").credits()] == ["issued"]
    assert "credit.voided" not in refunds.kinds("payments")
    assert refunds.kinds("mailer") == ["email.reply"]


@pytest.mark.parametrize("refunds", [[]], indirect=True)
def test_irreversible_step_runs_only_after_a_valid_grant_R7(refunds: Refunds) -> None:
    system = refunds.system
    outcome: dict[str, Any] = {}
    saga = system.client.saga("refund", "agent")

    def agent() -> None:
        with saga:
            outcome["reply"] = saga.call("send_reply", order_id="ord-1", text="hello")

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    request = wait_until(
        lambda: next(
            (r for r in system.records(saga.saga_id) if isinstance(r, ApprovalRequested)), None
        ),
        what="an approval request",
    )
    # A grant for other arguments (a different fingerprint) does not count.
    forged = approval_granted(request, operator="mallory", now=request.envelope.occurred_at)
    forged = forged.model_copy(
        update={
            "args_fingerprint": "0" * 32,
            "envelope": forged.envelope.model_copy(update={"event_id": "forged-grant"}),
        }
    )
    key, value, headers = to_message(forged, system.settings.signer())
    producer = system.raw_producer()
    producer.produce(system.topics.events, key=key, value=value, headers=headers)
    producer.flush(30)
    wait_until(
        lambda: any(h.get(DLQ_REASON) == b"approval-mismatch" for _k, h in system.dlq()),
        what="the mismatched grant to be rejected",
    )
    assert refunds.provider("mailer").emails() == []
    assert "reply" not in outcome

    grant_approval(refunds.channel, request, operator="alice")
    thread.join(60)
    assert outcome["reply"]["message_id"]
    assert refunds.kinds("mailer") == ["email.reply"]
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [(a.decision, a.by) for a in receipt.approvals if a.decision == "GRANTED"] == [
        ("GRANTED", "alice")
    ]
    grants = [r for r in system.records(saga.saga_id) if isinstance(r, ApprovalGranted)]
    assert {g.granted_by for g in grants} == {"mallory", "alice"}


@pytest.mark.parametrize(
    "refunds",
    [
        [
            FaultRule(method="issue_credit", mode=FaultMode.REJECT),
            FaultRule(method="remove_from_inventory", mode=FaultMode.TRANSIENT, times=None),
        ]
    ],
    indirect=True,
)
def test_a_compensation_that_keeps_failing_escalates_to_its_owner_while_others_run_R3_R8(
    refunds: Refunds,
) -> None:
    with refunds.retries():
        with pytest.raises(BusinessRejected), refunds.system.client.saga("refund", "agent") as saga:
            _refund_until_credit(saga)
        receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.ESCALATED
    # The failing undo of the restock did not stop the hold from being released.
    assert "hold.released" in refunds.kinds("inventory")
    assert "stock.removed" not in refunds.kinds("inventory")
    incidents = [r for r in refunds.system.records(saga.saga_id) if isinstance(r, IncidentRaised)]
    assert len(incidents) == 1
    contract = refunds.system.client.contract("return_to_inventory")
    assert incidents[0].owner == contract.owner
    assert incidents[0].tool == "return_to_inventory"
    by_tool = {s.tool: s for s in receipt.steps}
    assert by_tool["return_to_inventory"].disposition is Disposition.ESCALATED
    assert by_tool["place_hold"].disposition is Disposition.COMPENSATED


@pytest.mark.parametrize("refunds", [[]], indirect=True)
def test_garbage_and_bad_signatures_go_to_the_dlq_while_sagas_finish_R16(
    refunds: Refunds,
) -> None:
    system = refunds.system
    producer = system.raw_producer()
    # Garbage, correctly signed (so it gets past verification to the decoder).
    garbage = b"\x00not avro at all"
    signed = system.settings.signer().headers(b"garbage", garbage)
    producer.produce(system.topics.events, key=b"garbage", value=garbage, headers=signed)
    with system.client.saga("refund", "agent") as saga:
        saga.call("place_hold", **ORDER)
        # A record signed with another key, in the middle of a live saga.
        from schemas.signing import Signer

        start = next(r for r in system.records(saga.saga_id))
        key, value, headers = to_message(start, Signer(b"another key"))
        producer.produce(system.topics.events, key=key, value=value, headers=headers)
        producer.flush(30)
        saga.call("return_to_inventory", **ORDER)
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPLETED
    reasons = wait_until(
        lambda: (lambda rs: rs if {b"malformed", b"bad-signature"} <= rs else None)(
            {h.get(DLQ_REASON) for _k, h in system.dlq()}
        ),
        what="both bad records in the DLQ",
    )
    assert {b"malformed", b"bad-signature"} <= reasons
