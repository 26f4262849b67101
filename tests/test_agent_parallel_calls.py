"""Parallel tool calls of one model turn through the SDK adapters, on the real broker:
the frameworks run them concurrently (the OpenAI Agents SDK as asyncio tasks,
LangGraph's ToolNode in threads or tasks, pydantic-ai as tasks), and each is a step
of the one saga."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sagaline
from participants.client import ApprovalPending, AsyncSaga, SagaClient
from schemas import SagaEndRequested, TerminalStatus
from schemas.models import Reversibility
from schemas.settings import Settings
from tests.test_agent_adapters import Trip

pytestmark = [pytest.mark.kafka, pytest.mark.xdist_group("agent-parallel")]


class Desk(Trip):
    """The seat and card of the adapter tests' ``Trip``, a slow provisioning, and an
    announcement that cannot be undone (it waits for a person, R7)."""

    def __init__(self) -> None:
        super().__init__()
        self.provisioning = threading.Event()

    @sagaline.tool(description="Provision a server (slow: takes a few seconds)")
    @sagaline.compensable(by="decommission")
    def provision(self, host: str) -> str:
        self.provisioning.set()
        time.sleep(4)  # the work itself: longer than the sibling call's timeout
        with self.lock:
            self.log.append(f"provision:{host}")
        return f"p-{host}"

    def decommission(self, ctx: sagaline.CompensationContext) -> None:
        with self.lock:
            self.log.append(f"decommission:{ctx.result}")

    @sagaline.tool(description="Announce to every customer")
    @sagaline.compensable(reversibility=Reversibility.IRREVERSIBLE)
    def announce(self, text: str) -> str:
        with self.lock:
            self.log.append(f"announce:{text}")
        return text


@pytest.fixture(scope="module")
def served(
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
    new_topic_prefix: Callable[[], str],
) -> Iterator[tuple[SagaClient, sagaline.Catalogue, Desk]]:
    desk = Desk()
    catalogue = sagaline.wrap(desk, name="desk")
    settings = Settings(
        bootstrap=kafka_bootstrap,
        topic_prefix=new_topic_prefix(),
        partitions=1,
        state_dir=Path(tmp_path_factory.mktemp("state")),
    )
    with sagaline.connect(catalogue, coordinator=True, settings=settings) as client:
        yield client, catalogue, desk


def _short(client: SagaClient, catalogue: Any, timeout_s: float) -> SagaClient:
    """A client of the served tools with a short call timeout (the participant and the
    coordinator of ``served`` run them)."""
    return SagaClient(
        client.settings, client.bootstrap, catalogues=[catalogue], call_timeout_s=timeout_s
    ).start()


def _ledger(client: SagaClient, saga_id: str) -> list[Any]:
    from sagaline.kafka import LedgerReader

    return LedgerReader(client.bootstrap).saga_records(
        client.settings.topics.events, saga_id, client.settings.signer()
    )


def _tool_node_graph(tools: Any) -> Any:
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    return graph.compile()


def test_a_parallel_call_queued_behind_one_awaiting_approval_leaves_the_saga_open_R7(
    served: Any,
) -> None:
    """A model turn with two calls, an IRREVERSIBLE ``announce`` and a
    ``reserve_seat``, run at once by LangGraph's ToolNode (threads). ``announce``
    lands first and waits for a person (R7); ``reserve_seat`` is scheduled behind it
    (each step follows the one before) and cannot run until ``announce`` is decided.
    Its call must say so (``ApprovalPending``: the saga stays open for the person),
    not that its outcome is unknown: ``OutcomeUnknown`` raised out of the run (the
    ToolNode raises its calls' errors in their order) and the saga was aborted, the
    person's approval withdrawn, for a turn that only waited for a person."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import AIMessage

    from sagaline.agents import langchain as adapter

    served_client, catalogue, desk = served
    client = _short(served_client, catalogue, 3)

    class AnnounceFirst(BaseCallbackHandler):
        """Holds reserve_seat's call until announce's step waits for approval: the
        order the threads may take either way, made certain."""

        def on_tool_start(self, serialized: dict[str, Any], input_str: str, **kw: Any) -> None:
            if serialized.get("name") == "reserve_seat":
                assert saga.approval_request("announce@c-2", 120) is not None

    calls = [
        {"name": "reserve_seat", "args": {"flight": "Q1"}, "id": "c-1"},
        {"name": "announce", "args": {"text": "Q1 is full"}, "id": "c-2"},
    ]
    try:
        saga = client.saga("desk", principal="agent:langgraph")
        with pytest.raises(ApprovalPending) as err, saga:
            graph = _tool_node_graph(adapter.tools(saga, catalogue))
            adapter.invoke(
                saga,
                graph,
                {"messages": [AIMessage(content="", tool_calls=calls)]},
                {"callbacks": [AnnounceFirst()]},
            )
        assert err.value.step_id == "reserve_seat@c-1"
        assert "announce@c-2" in str(err.value)
        records = _ledger(client, saga.saga_id)
        assert [r.outcome for r in records if isinstance(r, SagaEndRequested)] == []
        assert "reserve:Q1" not in desk.log and "announce:Q1 is full" not in desk.log
        saga.end(sagaline.SagaOutcome.ABORT, "test over")
        assert saga.wait(120).status is TerminalStatus.COMPENSATED
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_a_parallel_call_waits_out_the_call_before_it_not_only_its_own_timeout(
    served: Any, mode: str
) -> None:
    """Two calls of one saga made at once (a framework running a turn's tool calls
    in threads or tasks): a ``provision`` that takes 4 s (its call waits up to 120 s)
    and a ``reserve_seat`` whose call waits 2 s. Each step follows the one scheduled
    before it, so ``reserve_seat`` runs only after ``provision`` committed: its wait
    holds ``provision``'s time too. It gave up after its own 2 s with
    ``OutcomeUnknown`` (the step had not even run), which the adapters raise out of
    the run: the saga was aborted and ``provision`` undone, though nothing failed.
    While a call of the saga scheduled before it is still awaited here, a call goes
    on waiting; both return their results and the saga completes."""
    served_client, catalogue, desk = served
    client = _short(served_client, catalogue, 120)
    host = f"h-{mode}"
    try:
        saga = client.saga("desk", principal="agent:parallel")
        with saga:
            if mode == "threads":
                desk.provisioning.clear()
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    first = pool.submit(saga.call, "provision", host=host)
                    # provision's step is on the ledger (it runs): reserve_seat's follows it
                    assert desk.provisioning.wait(120)
                    second = saga.call("reserve_seat", flight=host, timeout_s=2)
                    results = [first.result(), second]
            else:
                view = AsyncSaga(saga)

                async def both() -> list[Any]:
                    return list(
                        await asyncio.gather(
                            view.call("provision", host=host),
                            view.call("reserve_seat", flight=host, timeout_s=2),
                        )
                    )

                results = asyncio.run(both())
        assert results == [f"p-{host}", f"r-{host}"]
        assert saga.wait(120).status is TerminalStatus.COMPLETED
        assert [e for e in desk.log if host in e] == [f"provision:{host}", f"reserve:{host}"]
    finally:
        client.close()
