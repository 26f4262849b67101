"""The agent-side saga client on the real broker: local tools, async use, typed errors."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from participants import (
    BusinessRejection,
    CompensationContext,
    Reversibility,
    compensable,
    tool,
    wrap,
)
from participants.client import (
    ApprovalPending,
    BusinessRejected,
    SagaClient,
    UnknownTool,
)
from sagaline.kafka import LedgerReader
from schemas import Disposition, TerminalStatus
from tests.system import System

pytestmark = pytest.mark.kafka


class Desk:
    """Tools the agent runs in its own process (a local catalogue)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()

    @tool(description="Book a slot")
    @compensable(by="free_slot", reversibility=Reversibility.REVERSIBLE)
    def book_slot(self, day: str) -> dict[str, str]:
        with self.lock:
            self.log.append(f"book:{day}")
        return {"slot": f"slot-{day}"}

    def free_slot(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.log.append(f"free:{ctx.result['slot']}")

    @tool(description="Always refuses")
    @compensable(by="nothing")
    def refuse(self) -> None:
        raise BusinessRejection("no slots on Sundays")

    def nothing(self) -> None:
        return None

    @tool(description="Charge a card", secret_fields=("card",))
    @compensable(by="refund_card")
    def charge_card(self, amount: int, card: str) -> dict[str, str]:
        with self.lock:
            self.log.append(f"charge:{amount}:{card}")
        return {"charge": f"ch-{amount}"}

    def refund_card(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.log.append(f"refund:{ctx.input['card']}")

    @tool(description="Announce publicly")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def announce(self, text: str) -> str:
        return text


@pytest.fixture
def local(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> Iterator[tuple[System, Desk]]:
    desk = Desk()
    # The system runs only the coordinator here; the desk is served by the client.
    with System(kafka_bootstrap, unique_prefix, tmp_path, []) as system:
        client = SagaClient(
            system.settings, kafka_bootstrap, local=wrap(desk, name="desk"), call_timeout_s=30
        )
        client.start()
        system.client.close()  # the default client is replaced by the local one
        system.client = client
        yield system, desk


def test_a_local_tool_is_called_and_compensated_through_the_ledger_R1(
    local: tuple[System, Desk],
) -> None:
    system, desk = local
    with pytest.raises(BusinessRejected), system.client.saga("desk", "agent") as saga:
        assert saga.call("book_slot", day="mon") == {"slot": "slot-mon"}
        saga.call("refuse")
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert desk.log == ["book:mon", "free:slot-mon"]
    assert [s.disposition for s in receipt.steps] == [
        Disposition.COMPENSATED,
        Disposition.NOT_COMMITTED,
    ]


def test_async_with_completes_the_saga(local: tuple[System, Desk]) -> None:
    system, desk = local

    async def agent() -> TerminalStatus:
        async with system.client.saga("desk", "agent") as saga:
            await saga.acall("book_slot", day="tue")
        return (await saga.await_terminal(60)).status

    assert asyncio.run(agent()) is TerminalStatus.COMPLETED
    assert desk.log == ["book:tue"]


def test_an_irreversible_call_without_approval_raises_approval_pending_R7(
    local: tuple[System, Desk],
) -> None:
    system, desk = local
    with pytest.raises(ApprovalPending) as err, system.client.saga("desk", "agent") as saga:
        saga.call("announce", text="hello", timeout_s=3)
    assert err.value.approval_id
    assert err.value.tool == "announce"
    # Leaving the block by the exception aborted the saga; nothing had committed.
    assert saga.wait(60).status is TerminalStatus.COMPENSATED
    assert desk.log == []  # the irreversible tool never ran


def test_an_unknown_tool_is_a_clear_error(local: tuple[System, Desk]) -> None:
    system, _desk = local
    with pytest.raises(UnknownTool, match="no participant declares a tool named 'teleport'"):
        system.client.contract("teleport")


def test_a_secret_argument_reaches_the_tool_but_never_a_topic_in_clear(
    local: tuple[System, Desk],
) -> None:
    system, desk = local
    card = "4111111111111111"
    settings = dataclasses.replace(system.settings, secret_key=b"agent and desk share this")
    client = SagaClient(settings, system.bootstrap, local=wrap(desk, name="desk2"))
    with client:
        with pytest.raises(BusinessRejected), client.saga("desk", "agent") as saga:
            saga.call("charge_card", amount=500, card=card)
            saga.call("refuse")
        assert saga.wait(60).status is TerminalStatus.COMPENSATED
    assert desk.log == [f"charge:500:{card}", f"refund:{card}"]
    for topic in (system.topics.events, system.topics.commands("desk2")):
        values = [v for _k, v, _h in LedgerReader(system.bootstrap).records(topic) if v]
        assert values and not any(card.encode() in v for v in values), topic
