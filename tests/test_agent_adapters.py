"""The SDK adapters on the real broker, each driven by that SDK's own scripted/test
model (no network, no LLM): a run whose last tool fails ends with the earlier effects
compensated; a run that succeeds ends COMPLETED."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sagaline
from participants.client import BusinessRejected, SagaClient
from sagaline.agents import Interrupted as AnyInterrupted
from schemas import TerminalStatus
from schemas.models import Reversibility
from schemas.settings import Settings

# One worker of a parallel run takes the whole module: its module fixture runs a coordinator.
pytestmark = [pytest.mark.kafka, pytest.mark.xdist_group("agent-adapters")]


class Trip:
    """A seat and a card; the card declines anything over 500."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()

    @sagaline.tool(description="Reserve a seat on a flight")
    @sagaline.compensable(by="release_seat")
    def reserve_seat(self, flight: str) -> str:
        with self.lock:
            self.log.append(f"reserve:{flight}")
        return f"r-{flight}"

    def release_seat(self, ctx: sagaline.CompensationContext) -> None:
        with self.lock:
            self.log.append(f"release:{ctx.result}")

    @sagaline.tool(description="Charge the card")
    @sagaline.compensable(by="refund")
    def charge_card(self, amount: int) -> str:
        if amount > 500:
            raise sagaline.BusinessRejection(f"card declined for {amount}")
        with self.lock:
            self.log.append(f"charge:{amount}")
        return f"ch-{amount}"

    def refund(self, ctx: sagaline.CompensationContext) -> None:
        with self.lock:
            self.log.append(f"refund:{ctx.result}")


@pytest.fixture(scope="module")
def served(
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
    new_topic_prefix: Callable[[], str],
) -> Iterator[tuple[SagaClient, sagaline.Catalogue, Trip]]:
    trip = Trip()
    catalogue = sagaline.wrap(trip, name="trip")
    settings = Settings(
        bootstrap=kafka_bootstrap,
        topic_prefix=new_topic_prefix(),
        partitions=1,
        state_dir=Path(tmp_path_factory.mktemp("state")),
    )
    with sagaline.connect(catalogue, coordinator=True, settings=settings) as client:
        yield client, catalogue, trip


def _script(amount: int) -> list[tuple[str, dict[str, Any]]]:
    return [("reserve_seat", {"flight": "LX38"}), ("charge_card", {"amount": amount})]


def _assert_paused(stopped: Any, saga: Any, pending: list[Any]) -> None:
    """What every adapter's pause raises: an ``ApprovalPending`` of ``saga`` (so the
    saga's block leaves it open, R7) that is a ``sagaline.agents.Interrupted`` (what
    generic code catches), whose ``pending`` lists what the run waits on."""
    from participants.client import ApprovalPending

    assert isinstance(stopped, ApprovalPending) and stopped.saga_id == saga.saga_id
    assert isinstance(stopped, AnyInterrupted)
    assert stopped.pending == pending


def _assert_reservation_compensated(saga: Any, trip: Trip, flight: str) -> None:
    """The end of a paused run resumed into a declined charge: the saga compensated,
    the reservation made before the pause undone (once), the charge never made."""
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert [(s.tool, s.disposition.value) for s in receipt.steps] == [
        ("reserve_seat", "COMPENSATED"),
        ("charge_card", "NOT_COMMITTED"),
    ]
    assert [e for e in trip.log if flight in e] == [f"reserve:{flight}", f"release:r-{flight}"]


def _agent_graph(answer: Callable[[list[Any]], Any], tools: Any) -> Any:
    """A LangGraph agent loop, not compiled: the ``agent`` node (its message is
    ``answer`` of the messages so far), then the ``tools`` node (a ``ToolNode``) while
    that message calls a tool."""
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import tools_condition

    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [answer(state["messages"])]})
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    return graph


# ------------------------------------------------------------------ pydantic-ai


def _pydantic_ai_run(served: tuple[SagaClient, Any, Trip], amount: int, sagas: list[Any]) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, _trip = served
    script = iter(_script(amount))

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        schemas = {t.name: t.parameters_json_schema for t in info.function_tools}
        assert schemas == {n: catalogue[n].input_schema() for n in catalogue}
        step = next(script, None)
        if step is None:
            return ModelResponse(parts=[TextPart("booked")])
        return ModelResponse(parts=[ToolCallPart(step[0], step[1])])

    saga = client.saga("trip", principal="agent:pydantic-ai")
    sagas.append(saga)
    with saga:
        agent = Agent(FunctionModel(model), toolsets=[adapter.toolset(saga, catalogue)])
        agent.run_sync("book LX38")


def test_pydantic_ai_run_completes(served: Any) -> None:
    _completes(_pydantic_ai_run, served, 90)


def test_pydantic_ai_run_whose_last_tool_fails_is_compensated(served: Any) -> None:
    _compensates(_pydantic_ai_run, served, 900)


def test_pydantic_ai_run_ending_with_deferred_tool_requests_leaves_the_saga_open(
    served: Any,
) -> None:
    """A tool with ``requires_approval`` ends a pydantic-ai run with
    ``DeferredToolRequests`` as its output: ``run_sync`` returns, so leaving the saga's
    block completed the saga with the step made so far, and a failure in the approved
    run undid nothing. The adapter's ``run_sync`` raises ``Interrupted`` (an
    ``ApprovalPending``: the saga stays open, R7), and the approved run continues the
    saga in ``resumed``: its failure compensates the step made before the pause."""
    from pydantic_ai import DeferredToolResults

    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:pydantic-ai")
    agent = _deferring_pydantic_agent(saga, catalogue, "LX90", 990)

    with pytest.raises(adapter.Interrupted) as stopped, saga:
        adapter.run_sync(saga, agent, "book LX90")
    _assert_paused(stopped.value, saga, stopped.value.requests.approvals)
    assert [c.tool_name for c in stopped.value.requests.approvals] == ["confirm_payment"]

    approved = DeferredToolResults(approvals={"c-confirm_payment": True})
    with pytest.raises(BusinessRejected), adapter.resumed(saga):
        adapter.run_sync(
            saga,
            agent,
            message_history=stopped.value.result.all_messages(),
            deferred_tool_results=approved,
        )
    _assert_reservation_compensated(saga, trip, "LX90")


# ------------------------------------------- runs that pause for a person (R7)
# Each reserves a seat, pauses for a person, then (resumed) charges an amount the card
# declines: the resumed run's failure must compensate the reservation made before
# the pause.


def _approving_openai_agent(saga: Any, catalogue: Any, flight: str, amount: int) -> Any:
    """An OpenAI Agents agent that reserves ``flight``, calls ``confirm_payment`` (with
    ``needs_approval``: the run pauses), then charges ``amount``."""
    from agents import Agent, function_tool, set_tracing_disabled

    from sagaline.agents import openai_agents as adapter

    set_tracing_disabled(True)

    @function_tool(needs_approval=True)
    def confirm_payment(note: str) -> str:
        """Ask the traveller to confirm the payment."""
        return "confirmed"

    script = iter(
        [
            ("reserve_seat", {"flight": flight}),
            ("confirm_payment", {"note": "pay?"}),
            ("charge_card", {"amount": amount}),
        ]
    )
    return Agent(
        name="booker",
        model=_scripted_openai_model(script),
        tools=[*adapter.tools(saga, catalogue), confirm_payment],
    )


def _interrupting_graph(saga: Any, catalogue: Any, flight: str, amount: int) -> Any:
    """A LangGraph agent that reserves ``flight`` while asking a person (``interrupt()``
    in the same tool node), then charges ``amount``: a function compiling it again
    (as a restarted process would) over one checkpointer and one scripted model."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.prebuilt import ToolNode
    from langgraph.types import interrupt

    from sagaline.agents import langchain as adapter

    @tool
    def ask_person(question: str) -> str:
        """Ask the traveller."""
        answer: str = interrupt(question)
        return answer

    replies = iter(
        [
            AIMessage(
                content="",
                tool_calls=[
                    {"name": "reserve_seat", "args": {"flight": flight}, "id": "call-r"},
                    {"name": "ask_person", "args": {"question": "pay?"}, "id": "call-a"},
                ],
            ),
            AIMessage(
                content="",
                tool_calls=[{"name": "charge_card", "args": {"amount": amount}, "id": "call-c"}],
            ),
            AIMessage(content="booked"),
        ]
    )
    model = GenericFakeChatModel(messages=replies)
    checkpointer = InMemorySaver()

    def graph() -> Any:
        built = _agent_graph(model.invoke, ToolNode([*adapter.tools(saga, catalogue), ask_person]))
        return built.compile(checkpointer=checkpointer)

    return graph


# -------------------------------------------------------------------- langchain


def _langgraph_run(served: tuple[SagaClient, Any, Trip], amount: int, sagas: list[Any]) -> None:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.prebuilt import ToolNode

    from sagaline.agents import langchain as adapter

    client, catalogue, _trip = served
    replies = [
        AIMessage(content="", tool_calls=[{"name": n, "args": a, "id": f"call-{i}"}])
        for i, (n, a) in enumerate(_script(amount))
    ] + [AIMessage(content="booked")]
    model = GenericFakeChatModel(messages=iter(replies))

    saga = client.saga("trip", principal="agent:langgraph")
    sagas.append(saga)
    with saga:
        tools = adapter.tools(saga, catalogue)
        assert {t.name for t in tools} == {"reserve_seat", "charge_card"}
        assert {t.name: t.args_schema for t in tools} == {
            n: catalogue[n].input_schema() for n in catalogue
        }
        graph = _agent_graph(model.invoke, ToolNode(tools))
        graph.compile().invoke({"messages": [HumanMessage("book LX38")]})


def test_langgraph_tool_node_run_completes(served: Any) -> None:
    _completes(_langgraph_run, served, 120)


def test_langgraph_run_whose_last_tool_fails_is_compensated(served: Any) -> None:
    _compensates(_langgraph_run, served, 901)


# ---------------------------------------------------------------- openai-agents


def _openai_agents_run(
    served: tuple[SagaClient, Any, Any],
    amount: int,
    sagas: list[Any],
    script_steps: list[tuple[str, dict[str, Any]]] | None = None,
) -> None:
    from agents import Agent, Runner, Usage, set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from sagaline.agents import openai_agents as adapter

    set_tracing_disabled(True)
    client, catalogue, _trip = served
    script = iter(_script(amount) if script_steps is None else script_steps)

    class Scripted(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            step = next(script, None)
            if step is None:
                text = ResponseOutputText(annotations=[], text="booked", type="output_text")
                out: Any = ResponseOutputMessage(
                    id="m-1",
                    content=[text],
                    role="assistant",
                    status="completed",
                    type="message",
                )
            else:
                out = ResponseFunctionToolCall(
                    arguments=__import__("json").dumps(step[1]),
                    call_id=f"c-{step[0]}",
                    name=step[0],
                    type="function_call",
                    id=f"f-{step[0]}",
                )
            return ModelResponse(output=[out], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    saga = client.saga("trip", principal="agent:openai")
    sagas.append(saga)
    with saga:
        tools = adapter.tools(saga, catalogue)
        assert {t.name: t.params_json_schema for t in tools} == {
            n: catalogue[n].input_schema() for n in catalogue
        }
        agent = Agent(name="booker", model=Scripted(), tools=list(tools))
        asyncio.run(Runner.run(agent, "book LX38"))


def test_openai_agents_run_completes(served: Any) -> None:
    _completes(_openai_agents_run, served, 130)


def test_openai_agents_run_whose_last_tool_fails_is_compensated(served: Any) -> None:
    _compensates(_openai_agents_run, served, 902)


def _completes(run: Any, served: Any, amount: int) -> None:
    sagas: list[Any] = []
    run(served, amount, sagas)
    assert sagas[0].wait(120).status is TerminalStatus.COMPLETED


def _compensates(run: Any, served: Any, amount: int) -> None:
    trip: Trip = served[2]
    sagas: list[Any] = []
    with pytest.raises(Exception) as err:  # some SDKs wrap it: see below
        run(served, amount, sagas)
    cause: BaseException | None = err.value  # the step's error, maybe as the SDK's cause
    while cause is not None and not isinstance(cause, BusinessRejected):
        cause = cause.__cause__
    assert cause is not None and f"card declined for {amount}" in str(cause)
    receipt = sagas[0].wait(120)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert [(s.tool, s.disposition.value) for s in receipt.steps] == [
        ("reserve_seat", "COMPENSATED"),
        ("charge_card", "NOT_COMMITTED"),
    ]
    assert trip.log[-2:] == ["reserve:LX38", "release:r-LX38"]


# ------------------------------------------------------- the model's arguments


def test_a_model_argument_named_like_a_saga_call_option_is_refused_not_obeyed(
    served: Any,
) -> None:
    """``step_id``, ``depends_on`` and ``timeout_s`` are options of ``saga.call``, never
    tool arguments (the catalogue refuses such parameters). A model that sends one
    must not steer the saga with it: here ``step_id`` naming the earlier step would
    hand back that step's result as if the charge had run."""
    from participants.client import CallRefused
    from sagaline.agents._core import saga_tools

    client, catalogue, trip = served
    with client.saga("trip", principal="agent:args") as saga:
        tools = {t.name: t for t in saga_tools(saga, catalogue)}
        assert tools["reserve_seat"]({"flight": "LX40"}) == "r-LX40"
        with pytest.raises(CallRefused):
            tools["charge_card"]({"amount": 140, "step_id": "01-reserve_seat"})
        with pytest.raises(CallRefused):
            asyncio.run(tools["charge_card"].acall({"amount": 141, "timeout_s": 5}))
    assert "charge:140" not in trip.log and "charge:141" not in trip.log


class Notice:
    @sagaline.tool(description="Announce to every customer")
    @sagaline.compensable(reversibility=Reversibility.IRREVERSIBLE)
    def announce(self, text: str) -> str:
        return text


def test_openai_agents_run_waiting_for_an_approval_leaves_the_saga_open_R7(served: Any) -> None:
    """An IRREVERSIBLE step without approval within the call timeout raises
    ApprovalPending: waiting for a person is not a failure, so the saga stays open
    (R7) and nothing is compensated. The SDK wraps whatever a tool raises in its own
    UserError unless it is one of its exceptions, and the saga's block then took it
    for a failure and aborted the saga."""
    from participants.client import ApprovalPending
    from sagaline.kafka import LedgerReader
    from schemas import SagaEndRequested

    client, _catalogue, _trip = served
    notice = sagaline.wrap(Notice(), name="notice")
    with sagaline.connect(notice, settings=client.settings, call_timeout_s=5) as short:
        sagas: list[Any] = []
        with pytest.raises(Exception) as err:
            _openai_agents_run((short, notice, None), 0, sagas, [("announce", {"text": "hi"})])
        saga = sagas[0]
        records = LedgerReader(short.bootstrap).saga_records(
            short.settings.topics.events, saga.saga_id, short.settings.signer()
        )
        assert [r.reason for r in records if isinstance(r, SagaEndRequested)] == []
        assert isinstance(err.value, ApprovalPending)  # as the agent's code catches it
        saga.end(sagaline.SagaOutcome.ABORT, "test over")


def _scripted_openai_model(script: Any, turn: Any = None) -> Any:
    """An OpenAI Agents ``Model`` that makes the calls of ``script`` in turn (one a
    turn; ids ``c-TOOL``), then answers "booked"; streamed as one completed response.
    ``turn``, when given, is awaited at the start of each turn."""
    from agents import Usage
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from openai.types.responses import (
        Response,
        ResponseCompletedEvent,
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    class Scripted(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            if turn is not None:
                await turn()
            step = next(script, None)
            if step is None:
                text = ResponseOutputText(annotations=[], text="booked", type="output_text")
                out: Any = ResponseOutputMessage(
                    id="m-1", content=[text], role="assistant", status="completed", type="message"
                )
            else:
                out = ResponseFunctionToolCall(
                    arguments=__import__("json").dumps(step[1]),
                    call_id=f"c-{step[0]}",
                    name=step[0],
                    type="function_call",
                    id=f"f-{step[0]}",
                )
            return ModelResponse(output=[out], usage=Usage(), response_id=None)

        async def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            response = await self.get_response()
            yield ResponseCompletedEvent(
                response=Response(
                    id="r-1",
                    created_at=0,
                    model="scripted",
                    object="response",
                    output=response.output,
                    parallel_tool_calls=False,
                    tool_choice="auto",
                    tools=[],
                ),
                sequence_number=0,
                type="response.completed",
            )

    return Scripted()


def test_openai_agents_run_paused_for_tool_approval_leaves_the_saga_open_for_the_resume(
    served: Any,
) -> None:
    """A tool with ``needs_approval`` pauses the run: ``Runner.run`` returns (it does
    not raise) with ``result.interruptions``, so leaving the saga's block completed the
    saga with the step made so far, and a failure after the approval undid nothing.
    The adapter's ``run``/``run_sync`` raise ``Interrupted`` (an ``ApprovalPending``:
    the saga stays open, R7), and the approved run continues the saga in ``resumed``:
    its failure compensates the step made before the pause."""
    from sagaline.agents import openai_agents as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:openai")
    agent = _approving_openai_agent(saga, catalogue, "LX80", 980)
    with pytest.raises(adapter.Interrupted) as stopped, saga:
        adapter.run_sync(saga, agent, "book LX80")
    _assert_paused(stopped.value, saga, stopped.value.interruptions)
    assert [i.tool_name for i in stopped.value.interruptions] == ["confirm_payment"]

    state = stopped.value.result.to_state()
    state.approve(stopped.value.interruptions[0])
    with pytest.raises(Exception) as err, adapter.resumed(saga):
        asyncio.run(adapter.run(saga, agent, state))
    assert isinstance(err.value.__cause__, BusinessRejected)
    _assert_reservation_compensated(saga, trip, "LX80")


class Ops:
    """Tool arguments named like the keywords LangChain passes to its own tools."""

    def __init__(self) -> None:
        self.deployed: list[tuple[str, str, str]] = []

    @sagaline.tool(description="Deploy a service")
    @sagaline.compensable(by="rollback")
    def deploy(self, service: str, config: str = "staging", run_manager: str = "ci") -> str:
        self.deployed.append((service, config, run_manager))
        return f"{service}@{config}"

    def rollback(self, ctx: sagaline.CompensationContext) -> None:
        pass


def test_langchain_tool_arguments_named_config_or_run_manager_reach_the_tool(
    served: Any,
) -> None:
    """LangChain's ``BaseTool.run`` passes ``config`` and ``run_manager`` keywords to
    the tool's ``_run``, overwriting model arguments of the same names: the step ran
    with the defaults (here: deployed to staging when the model asked for production)."""
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from sagaline.agents import langchain as adapter

    client, _catalogue, _trip = served
    ops = Ops()
    catalogue = sagaline.wrap(ops, name="ops")
    args = {"service": "web", "config": "production", "run_manager": "alice"}
    with sagaline.connect(catalogue, settings=client.settings) as ops_client:
        with ops_client.saga("ops", principal="agent:langgraph") as saga:
            graph = StateGraph(MessagesState)
            graph.add_node("tools", ToolNode(adapter.tools(saga, catalogue)))
            graph.add_edge(START, "tools")
            graph.add_edge("tools", END)
            call = {"name": "deploy", "args": args, "id": "call-deploy"}
            out = graph.compile().invoke({"messages": [AIMessage(content="", tool_calls=[call])]})
        assert saga.wait(120).status is TerminalStatus.COMPLETED
    assert out["messages"][-1].content == "web@production"
    assert ops.deployed == [("web", "production", "alice")]


class Desk:
    """A booking whose first run holds until the test lets it go."""

    def __init__(self) -> None:
        self.booked: list[str] = []
        self.release = threading.Event()

    @sagaline.tool(description="Book a room", deadline=300)
    @sagaline.compensable(by="cancel")
    def book(self, room: str) -> str:
        self.booked.append(room)
        self.release.wait(300)  # safety net only: the test sets it
        return f"b-{room}"

    def cancel(self, ctx: sagaline.CompensationContext) -> None:
        pass


def test_langgraph_retry_of_a_tool_call_is_the_same_step_not_a_second_effect_R11(
    served: Any,
) -> None:
    """A call whose outcome is not in within the call timeout raises OutcomeUnknown
    (R11: the effect may have happened). A LangGraph ``RetryPolicy`` on the tools node
    retries it (its default ``retry_on`` takes any SagaCallError for transient), with
    the same tool-call id: that must wait for the same step again, not schedule a new
    one that books the room a second time."""
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode
    from langgraph.types import RetryPolicy

    from participants.client import OutcomeUnknown
    from sagaline.agents import langchain as adapter

    client, _catalogue, _trip = served
    desk = Desk()
    catalogue = sagaline.wrap(desk, name="desk")
    retried: list[Exception] = []

    def retry_on(exc: Exception) -> bool:
        retried.append(exc)
        desk.release.set()  # the first run may finish now
        return isinstance(exc, OutcomeUnknown)

    with sagaline.connect(catalogue, settings=client.settings, call_timeout_s=3) as desk_client:
        with desk_client.saga("desk", principal="agent:langgraph") as saga:
            graph = StateGraph(MessagesState)
            graph.add_node(
                "tools",
                ToolNode(adapter.tools(saga, catalogue)),
                retry_policy=RetryPolicy(
                    max_attempts=100,
                    initial_interval=0.1,
                    max_interval=1.0,
                    jitter=False,
                    retry_on=retry_on,
                ),
            )
            graph.add_edge(START, "tools")
            graph.add_edge("tools", END)
            call = {"name": "book", "args": {"room": "R1"}, "id": "call-book-1"}
            try:
                out = graph.compile().invoke(
                    {"messages": [AIMessage(content="", tool_calls=[call])]}
                )
            finally:
                desk.release.set()
        receipt = saga.wait(120)
    assert retried and isinstance(retried[0], OutcomeUnknown)
    assert out["messages"][-1].content == "b-R1"
    assert desk.booked == ["R1"]
    assert [s.tool for s in receipt.steps] == ["book"]
    assert receipt.status is TerminalStatus.COMPLETED


def test_a_tool_call_id_names_one_step_and_distinct_calls_stay_distinct(served: Any) -> None:
    """The same tool-call id with the same arguments is one step (one effect); another
    id, or the same id with other arguments, is a call of its own."""
    from sagaline.agents._core import saga_tools

    client, catalogue, trip = served
    with client.saga("trip", principal="agent:ids") as saga:
        tools = {t.name: t for t in saga_tools(saga, catalogue)}
        first = tools["reserve_seat"]({"flight": "LX50"}, "c-1")
        again = asyncio.run(tools["reserve_seat"].acall({"flight": "LX50"}, "c-1"))
        other_id = tools["reserve_seat"]({"flight": "LX50"}, "c-2")
        other_args = tools["reserve_seat"]({"flight": "LX51"}, "c-1")
    receipt = saga.wait(120)
    assert (first, again, other_id, other_args) == ("r-LX50", "r-LX50", "r-LX50", "r-LX51")
    assert trip.log.count("reserve:LX50") == 2 and trip.log.count("reserve:LX51") == 1
    assert [s.tool for s in receipt.steps] == ["reserve_seat"] * 3


def test_any_tool_call_id_a_provider_sends_names_one_step(served: Any) -> None:
    """A tool-call id is the provider's: it may hold ``/`` (refused in step ids, which
    derived ids join with it), so every call carrying such an id was refused
    (``CallRefused``, ``step_id``) and the model told to call again, which it did
    with another id of the same shape. And an id holding ``#`` (``c#2``) was the very
    step another id's reuse goes on to (``c``, then ``c#2``): that call, made again
    with the same arguments, got the other call's outcome and its effect was never
    made. Every id names a step of its own, the same one when the call is repeated."""
    from sagaline.agents._core import saga_tools

    client, catalogue, trip = served
    with client.saga("trip", principal="agent:odd-ids") as saga:
        tools = {t.name: t for t in saga_tools(saga, catalogue)}
        reserve = tools["reserve_seat"]
        slashed = reserve({"flight": "LX60"}, "projects/p/calls/1")
        repeated = asyncio.run(reserve.acall({"flight": "LX60"}, "projects/p/calls/1"))
        hashed = reserve({"flight": "LX61"}, "c#2")
        reserve({"flight": "LX62"}, "c")
        reused = reserve({"flight": "LX61"}, "c")  # "c" again, other arguments
        escaped = reserve({"flight": "LX63"}, "c%2F")
    receipt = saga.wait(120)
    assert (slashed, repeated, hashed, reused) == ("r-LX60", "r-LX60", "r-LX61", "r-LX61")
    assert escaped == "r-LX63"
    assert [trip.log.count(f"reserve:LX{n}") for n in (60, 61, 62, 63)] == [1, 2, 1, 1]
    assert receipt.status is TerminalStatus.COMPLETED and len(receipt.steps) == 5


def test_langchain_sync_tool_call_in_an_async_saga_runs_the_step(served: Any) -> None:
    """``async with client.saga(...)`` gives an AsyncSaga, whose ``call`` is a
    coroutine: a LangChain tool invoked synchronously (``graph.invoke``, a sync
    ``ToolNode``) returned that coroutine, never awaited, as the tool's result, so
    the model was told the step ran while nothing was scheduled."""
    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served
    call = {"name": "reserve_seat", "args": {"flight": "LX60"}, "id": "c-60", "type": "tool_call"}

    async def run() -> tuple[Any, sagaline.Receipt]:
        async with client.saga("trip", principal="agent:async-langchain") as saga:
            tool = {t.name: t for t in adapter.tools(saga, catalogue)}["reserve_seat"]
            message = await asyncio.to_thread(tool.invoke, call)
        return message, await saga.wait(120)

    message, receipt = asyncio.run(run())
    assert message.content == "r-LX60"
    assert "reserve:LX60" in trip.log
    assert [s.tool for s in receipt.steps] == ["reserve_seat"]


def test_langgraph_run_stopped_at_an_interrupt_leaves_the_saga_open_for_the_resume(
    served: Any,
) -> None:
    """A tool of the graph asks a person with LangGraph's ``interrupt()``: the graph
    stops and ``graph.invoke`` returns (it does not raise), so leaving the saga's block
    completed the saga with the effects so far, and the resumed run's steps met an
    ended saga: a failure after the interrupt undid nothing. The adapter's ``invoke``
    raises ``Interrupted`` (an ``ApprovalPending``: a person is awaited, R7), the saga
    stays open, and the resumed run continues it: its failure compensates the step
    made before the interrupt, which the resume (re-running the node) did not repeat."""
    from langchain_core.messages import HumanMessage
    from langgraph.types import Command

    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served
    config: Any = {"configurable": {"thread_id": "trip-70"}}
    saga = client.saga("trip", principal="agent:langgraph")
    graph = _interrupting_graph(saga, catalogue, "LX70", 960)
    with pytest.raises(adapter.Interrupted) as stopped, saga:
        adapter.invoke(saga, graph(), {"messages": [HumanMessage("book LX70")]}, config)
    _assert_paused(stopped.value, saga, stopped.value.interrupts)
    assert [i.value for i in stopped.value.interrupts] == ["pay?"]

    with pytest.raises(BusinessRejected), adapter.resumed(saga):
        adapter.invoke(saga, graph(), Command(resume="yes"), config)
    _assert_reservation_compensated(saga, trip, "LX70")


# ---------------------------------------------------------------- streamed runs


def test_langgraph_streamed_run_stopped_at_an_interrupt_leaves_the_saga_open(
    served: Any,
) -> None:
    """``graph.stream`` of a graph that stops at ``interrupt()`` just ends: inside the
    saga's block that completed the saga with the effects so far. The adapter's
    ``stream`` hands over the chunks and raises ``Interrupted`` after the last one,
    also in a stream mode whose chunks carry no interrupts (here ``custom``: found in
    the thread's state); the resumed ``astream`` continues the saga, and its failure
    compensates the step made before the interrupt."""
    from langchain_core.messages import HumanMessage
    from langgraph.types import Command

    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served
    config: Any = {"configurable": {"thread_id": "trip-71"}}
    saga = client.saga("trip", principal="agent:langgraph")
    graph = _interrupting_graph(saga, catalogue, "LX71", 961)()

    chunks: list[Any] = []
    with pytest.raises(adapter.Interrupted) as stopped, saga:
        start = {"messages": [HumanMessage("book LX71")]}
        chunks.extend(adapter.stream(saga, graph, start, config, stream_mode="custom"))
    assert [i.value for i in stopped.value.interrupts] == ["pay?"]
    assert stopped.value.saga_id == saga.saga_id

    async def resume() -> list[Any]:
        return [c async for c in adapter.astream(saga, graph, Command(resume="yes"), config)]

    with pytest.raises(BusinessRejected), adapter.resumed(saga):
        asyncio.run(resume())
    _assert_reservation_compensated(saga, trip, "LX71")


def test_langgraph_stream_chunks_of_every_shape_show_the_interrupt() -> None:
    """The interrupt is found in the chunks of each stream shape: ``updates`` and
    ``values`` dicts, ``(mode, data)`` / ``(namespace, mode, data)`` tuples, and
    ``version="v2"`` parts (once, though both parts carry it)."""
    from langgraph.types import Interrupt

    from sagaline.agents.langchain import _note_interrupts

    stop = Interrupt(value="pay?", id="i-1")
    for chunks in (
        [{"agent": {}}, {"__interrupt__": (stop,)}],
        [("updates", {"__interrupt__": (stop,)}), ("values", {"messages": []})],
        [((), "updates", {"__interrupt__": (stop,)})],
        [
            {"type": "updates", "ns": (), "data": {"__interrupt__": (stop,)}},
            {"type": "values", "ns": (), "data": {}, "interrupts": (stop,)},
        ],
    ):
        found: dict[Any, Any] = {}
        for chunk in chunks:
            _note_interrupts(found, chunk)
        assert list(found.values()) == [stop], chunks


def test_openai_agents_streamed_run_paused_for_tool_approval_leaves_the_saga_open(
    served: Any,
) -> None:
    """``Runner.run_streamed`` of a run that pauses for tool approval: its
    ``stream_events()`` just ends, and the saga's block completed the saga. The
    adapter's ``run_streamed`` gives the result whose ``stream_events()`` raises
    ``Interrupted`` after the last event; the approved streamed run continues the
    saga in ``resumed``, and its failure compensates the step made before the pause."""
    from sagaline.agents import openai_agents as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:openai")
    agent = _approving_openai_agent(saga, catalogue, "LX81", 981)

    async def consume(input: Any) -> list[Any]:
        run = adapter.run_streamed(saga, agent, input)  # in the loop: it starts the run
        return [event async for event in run.stream_events()]

    with pytest.raises(adapter.Interrupted) as stopped, saga:
        asyncio.run(consume("book LX81"))
    assert [i.tool_name for i in stopped.value.interruptions] == ["confirm_payment"]
    assert stopped.value.pending == stopped.value.interruptions

    state = stopped.value.result.to_state()
    state.approve(stopped.value.interruptions[0])
    with pytest.raises(Exception) as err, adapter.resumed(saga):
        asyncio.run(consume(state))
    assert isinstance(err.value.__cause__, BusinessRejected)
    _assert_reservation_compensated(saga, trip, "LX81")


def _deferring_pydantic_agent(saga: Any, catalogue: Any, flight: str, amount: int) -> Any:
    """A pydantic-ai agent (streaming and not) that reserves ``flight``, asks for
    approval of ``confirm_payment``, then charges ``amount``."""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

    from sagaline.agents import pydantic_ai as adapter

    steps = [
        ("reserve_seat", {"flight": flight}),
        ("confirm_payment", {"note": "pay?"}),
        ("charge_card", {"amount": amount}),
    ]
    script = iter(steps)

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        step = next(script, None)
        if step is None:
            return ModelResponse(parts=[TextPart("booked")])
        return ModelResponse(parts=[ToolCallPart(step[0], step[1], tool_call_id=f"c-{step[0]}")])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> Any:
        step = next(script, None)
        if step is None:
            yield "booked"
            return
        name, args = step
        yield {0: DeltaToolCall(name=name, json_args=json.dumps(args), tool_call_id=f"c-{name}")}

    agent = Agent(
        FunctionModel(model, stream_function=stream),
        toolsets=[adapter.toolset(saga, catalogue)],
        output_type=[str, DeferredToolRequests],
    )

    @agent.tool_plain(requires_approval=True)
    def confirm_payment(note: str) -> str:
        return "confirmed"

    return agent


def test_pydantic_ai_streamed_run_ending_with_deferred_tool_requests_leaves_the_saga_open(
    served: Any,
) -> None:
    """``agent.run_stream`` (likewise ``iter``, ``run_stream_events``) of a run ending
    with ``DeferredToolRequests``: the ``async with`` block just ends, and the saga's
    block completed the saga. The adapter's ``run_stream`` raises ``Interrupted`` when
    that block ends; the approved run (``run_stream_events``) continues the saga in
    ``resumed``, and its failure compensates the step made before the pause."""
    from pydantic_ai import DeferredToolResults

    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:pydantic-ai")
    agent = _deferring_pydantic_agent(saga, catalogue, "LX91", 991)

    async def paused() -> None:
        async with saga, adapter.run_stream(saga, agent, "book LX91") as result:
            [_ async for _ in result.stream_output()]

    with pytest.raises(adapter.Interrupted) as stopped:
        asyncio.run(paused())
    assert [c.tool_name for c in stopped.value.pending] == ["confirm_payment"]
    assert stopped.value.requests.approvals == stopped.value.pending

    async def approved() -> None:
        async with adapter.run_stream_events(
            saga,
            agent,
            message_history=stopped.value.result.all_messages(),
            deferred_tool_results=DeferredToolResults(approvals={"c-confirm_payment": True}),
        ) as events:
            [_ async for _ in events]

    with pytest.raises(BusinessRejected), adapter.resumed(saga):
        asyncio.run(approved())
    _assert_reservation_compensated(saga, trip, "LX91")


def test_pydantic_ai_iter_run_ending_with_deferred_tool_requests_raises_interrupted(
    served: Any,
) -> None:
    """``agent.iter`` through the adapter: a run ending with ``DeferredToolRequests``
    raises ``Interrupted`` when its block ends, and the saga stays open."""
    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:pydantic-ai")
    agent = _deferring_pydantic_agent(saga, catalogue, "LX92", 92)

    async def paused() -> None:
        async with saga, adapter.iter(saga, agent, "book LX92") as run:
            [_ async for _ in run]

    with pytest.raises(adapter.Interrupted) as stopped:
        asyncio.run(paused())
    assert [c.tool_name for c in stopped.value.requests.approvals] == ["confirm_payment"]
    saga.end(sagaline.SagaOutcome.ABORT, "test over")  # it was left open: this ends it
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert [e for e in trip.log if "LX92" in e] == ["reserve:LX92", "release:r-LX92"]


def test_langgraph_invoke_in_another_stream_mode_stopped_at_an_interrupt_raises(
    served: Any,
) -> None:
    """``graph.invoke(..., stream_mode="updates")`` returns the list of chunks, with the
    interrupt in one of them: the adapter's ``invoke`` looked only at a dict output, so
    the run stopped at ``interrupt()`` returned and the block completed the saga."""
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode
    from langgraph.types import interrupt

    from sagaline.agents import langchain as adapter

    client, _catalogue, trip = served

    @tool
    def ask_person(question: str) -> str:
        """Ask the traveller."""
        answer: str = interrupt(question)
        return answer

    saga = client.saga("trip", principal="agent:langgraph")
    built = StateGraph(MessagesState)
    built.add_node("tools", ToolNode([ask_person]))
    built.add_edge(START, "tools")
    built.add_edge("tools", END)
    graph = built.compile(checkpointer=InMemorySaver())
    calls = [{"name": "ask_person", "args": {"question": "pay?"}, "id": "call-a"}]
    config: Any = {"configurable": {"thread_id": "trip-72"}}
    start = {"messages": [AIMessage(content="", tool_calls=calls)]}
    with pytest.raises(adapter.Interrupted) as stopped, saga:
        saga.call("reserve_seat", flight="LX72")
        adapter.invoke(saga, graph, start, config, stream_mode="updates")
    assert [i.value for i in stopped.value.interrupts] == ["pay?"]
    saga.end(sagaline.SagaOutcome.ABORT, "test over")  # it was left open: this ends it
    assert saga.wait(120).status is TerminalStatus.COMPENSATED
    assert [e for e in trip.log if "LX72" in e] == ["reserve:LX72", "release:r-LX72"]


def _breakpoint_graph(saga: Any, catalogue: Any, flight: str, amount: int, **compile: Any) -> Any:
    """A LangGraph agent (checkpointed) that reserves ``flight``, then charges ``amount``,
    compiled with ``compile`` (a static breakpoint: ``interrupt_before`` /
    ``interrupt_after``)."""
    from langchain_core.messages import AIMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.prebuilt import ToolNode

    from sagaline.agents import langchain as adapter

    replies = iter(
        [
            AIMessage(
                content="",
                tool_calls=[{"name": "reserve_seat", "args": {"flight": flight}, "id": "call-r"}],
            ),
            AIMessage(
                content="",
                tool_calls=[{"name": "charge_card", "args": {"amount": amount}, "id": "call-c"}],
            ),
            AIMessage(content="booked"),
        ]
    )
    # The replies as they are (a fake chat model's stream has none).
    built = _agent_graph(lambda _messages: next(replies), ToolNode(adapter.tools(saga, catalogue)))
    return built.compile(checkpointer=InMemorySaver(), **compile)


@pytest.mark.parametrize("mode", ["invoke", "stream", "astream", "astream_events"])
def test_langgraph_run_stopped_at_a_static_breakpoint_leaves_the_saga_open(
    served: Any, mode: str
) -> None:
    """A graph compiled with ``interrupt_after=["tools"]`` stops after the tool node and
    ``invoke`` returns with no ``__interrupt__`` in its output (a stream's last chunk
    carries an empty one, and the thread's state lists no interrupt, only its ``next``
    node): the adapter took the run for finished, the block completed the saga with
    the reservation, and the resumed run met an ended saga. It raises ``Interrupted``
    (with the ``next`` nodes), and the resumed run continues the saga: its failure
    compensates the reservation made before the breakpoint."""
    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served
    flight, amount = {
        "invoke": ("LX74", 974),
        "stream": ("LX75", 975),
        "astream": ("LX76", 976),
        "astream_events": ("LX77", 977),
    }[mode]
    saga = client.saga("trip", principal="agent:langgraph")
    graph = _breakpoint_graph(saga, catalogue, flight, amount, interrupt_after=["tools"])
    config: Any = {"configurable": {"thread_id": f"trip-{flight}"}}
    start = {"messages": [("user", f"book {flight}")]}

    async def astreamed(input: Any) -> list[Any]:
        if mode == "astream_events":
            return [e async for e in adapter.astream_events(saga, graph, input, config)]
        return [c async for c in adapter.astream(saga, graph, input, config)]

    def run(input: Any) -> Any:
        if mode == "invoke":
            return adapter.invoke(saga, graph, input, config)
        if mode == "stream":
            return list(adapter.stream(saga, graph, input, config, stream_mode="updates"))
        return asyncio.run(astreamed(input))

    with pytest.raises(adapter.Interrupted) as stopped, saga:
        run(start)
    assert stopped.value.saga_id == saga.saga_id
    assert stopped.value.interrupts == [] and stopped.value.next == ("agent",)

    with pytest.raises(BusinessRejected), adapter.resumed(saga):
        run(None)
    _assert_reservation_compensated(saga, trip, flight)


def test_langgraph_astream_events_refuses_the_v3_run_object() -> None:
    """``astream_events(version="v3")`` gives a run object, not events: refused with a
    clear error before the graph runs."""
    from sagaline.agents import langchain as adapter

    class Graph:
        def astream_events(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the graph ran")

    with pytest.raises(ValueError, match="'v1' or 'v2'"):
        adapter.astream_events(Any, Graph(), {}, None, version="v3")  # type: ignore[arg-type]


def test_pydantic_ai_run_stream_sync_ending_with_deferred_tool_requests_leaves_the_saga_open(
    served: Any,
) -> None:
    """``agent.run_stream_sync`` of a run ending with ``DeferredToolRequests``: its
    ``with`` block just ends, and the saga's block completed the saga with the
    reservation. The adapter's ``run_stream_sync`` raises ``Interrupted`` when that
    block ends; the approved run continues the saga in ``resumed``, and its failure
    compensates the step made before the pause."""
    from pydantic_ai import DeferredToolResults

    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:pydantic-ai")
    agent = _deferring_pydantic_agent(saga, catalogue, "LX93", 993)

    paused = adapter.run_stream_sync(saga, agent, "book LX93")
    with pytest.raises(adapter.Interrupted) as stopped, saga, paused as result:
        result.get_output()
    assert [c.tool_name for c in stopped.value.requests.approvals] == ["confirm_payment"]
    assert stopped.value.saga_id == saga.saga_id

    approvals = DeferredToolResults(approvals={"c-confirm_payment": True})
    approved = adapter.run_stream_sync(
        saga,
        agent,
        message_history=stopped.value.result.all_messages(),
        deferred_tool_results=approvals,
    )
    with pytest.raises(BusinessRejected), adapter.resumed(saga), approved as result:
        list(result.stream_output())
    _assert_reservation_compensated(saga, trip, "LX93")


# ------------------------------------------------ a stream left before its end
# Not checked (the run may still be going): leaving the saga's block completes the
# saga with the steps made so far, as docs/agents.md says; a call the run makes
# after that is refused, so no effect is made outside the saga or twice.


def test_langgraph_stream_left_at_its_interrupt_completes_the_saga_and_the_resume_makes_nothing(
    served: Any,
) -> None:
    """A caller breaks out of ``stream`` at the chunk that carries the interrupt: the
    saga completes with the reservation made so far (the stream was not read to its
    end, where ``Interrupted`` is raised); resuming the graph then meets an ended saga
    (``SagaUnwinding``): the reservation is not made again, the charge never."""
    from langchain_core.messages import HumanMessage
    from langgraph.types import Command

    from participants.client import SagaUnwinding
    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served
    config: Any = {"configurable": {"thread_id": "trip-78"}}
    saga = client.saga("trip", principal="agent:langgraph")
    graph = _interrupting_graph(saga, catalogue, "LX78", 178)()
    start = {"messages": [HumanMessage("book LX78")]}
    seen: list[Any] = []
    with saga:
        for chunk in adapter.stream(saga, graph, start, config, stream_mode="updates"):
            seen.append(chunk)
            if "__interrupt__" in chunk:
                break
    assert [i.value for i in seen[-1]["__interrupt__"]] == ["pay?"]
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [(s.tool, s.disposition.value) for s in receipt.steps] == [("reserve_seat", "RETAINED")]

    with pytest.raises(SagaUnwinding), adapter.resumed(saga):
        adapter.invoke(saga, graph, Command(resume="yes"), config)
    assert [e for e in trip.log if "LX78" in e or ":178" in e] == ["reserve:LX78"]


def test_openai_agents_stream_left_early_completes_the_saga_and_the_run_makes_no_more_steps(
    served: Any,
) -> None:
    """A caller stops reading ``stream_events()`` after the first tool's output: the
    saga's block completes the saga with that step, while the SDK's run goes on in the
    background; its next call meets the ended saga and is refused (the error is the
    run's, read from the same stream), so the charge is never made."""
    from agents import Agent

    from participants.client import SagaUnwinding
    from sagaline.agents import openai_agents as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:openai")
    script = iter([("reserve_seat", {"flight": "LX83"}), ("charge_card", {"amount": 183})])
    agent = Agent(
        name="booker", model=_scripted_openai_model(script), tools=adapter.tools(saga, catalogue)
    )

    async def left_early() -> BaseException | None:
        async with saga:
            run = adapter.run_streamed(saga, agent, "book LX83")
            events = run.stream_events()
            async for event in events:
                if getattr(getattr(event, "item", None), "type", "") == "tool_call_output_item":
                    break
        try:
            [_ async for _ in events]  # the rest of the run, after the saga ended
        except Exception as exc:
            return exc
        return None

    err = asyncio.run(left_early())
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [(s.tool, s.disposition.value) for s in receipt.steps] == [("reserve_seat", "RETAINED")]
    cause = err
    while cause is not None and not isinstance(cause, SagaUnwinding):
        cause = cause.__cause__
    assert isinstance(cause, SagaUnwinding), err
    assert [e for e in trip.log if "LX83" in e or ":183" in e] == ["reserve:LX83"]


def test_pydantic_ai_stream_left_before_its_output_completes_the_saga(served: Any) -> None:
    """A caller leaves ``run_stream``'s block without reading the output (here the
    ``DeferredToolRequests``): the run is not checked, and the saga completes with the
    reservation made so far; the run stops with the block (pydantic-ai runs no tool
    after the stream's result), so nothing is called after the saga ended."""
    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:pydantic-ai")
    agent = _deferring_pydantic_agent(saga, catalogue, "LX94", 194)

    async def left_early() -> None:
        async with saga, adapter.run_stream(saga, agent, "book LX94"):
            pass

    asyncio.run(left_early())
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [(s.tool, s.disposition.value) for s in receipt.steps] == [("reserve_seat", "RETAINED")]
    assert [e for e in trip.log if "LX94" in e or ":194" in e] == ["reserve:LX94"]


def test_a_tool_call_id_reused_after_a_restart_with_other_arguments_is_a_step_of_its_own(
    served: Any,
) -> None:
    """Some providers number tool calls afresh in every run (``call_0`` each time).
    The tool-call id -> step map was kept in memory only, so after the agent's
    process restarted (the saga attached) a reused id with other arguments was sent
    as the step ``TOOL@CALLID`` again and refused (``CallRefused``,
    ``duplicate-step``) instead of running. It runs as a step of its own, and a
    repeat of either call, in any process, is still the step it was (one effect)."""
    from sagaline.agents._core import resumed, saga_tools

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:restarted")
    saga.__enter__()  # started; the agent's process dies inside the block
    tools = {t.name: t for t in saga_tools(saga, catalogue)}
    assert tools["reserve_seat"]({"flight": "LX95"}, "call_0") == "r-LX95"
    assert tools["reserve_seat"]({"flight": "LX97"}, "call_0") == "r-LX97"
    assert tools["reserve_seat"]({"flight": "LX97"}, "call_0") == "r-LX97"  # a retry

    def attached(again: SagaClient) -> dict[str, Any]:
        view = again.saga("trip", principal="agent:restarted", saga_id=saga.saga_id).attach()
        return {t.name: t for t in saga_tools(view, catalogue)}

    with sagaline.connect(settings=client.settings) as again:
        tools = attached(again)
        assert tools["reserve_seat"]({"flight": "LX96"}, "call_0") == "r-LX96"
        assert tools["reserve_seat"]({"flight": "LX95"}, "call_0") == "r-LX95"
    with sagaline.connect(settings=client.settings) as third:
        tools = attached(third)
        with resumed(tools["reserve_seat"].saga):
            assert asyncio.run(tools["reserve_seat"].acall({"flight": "LX96"}, "call_0")) == (
                "r-LX96"
            )
            assert tools["reserve_seat"]({"flight": "LX95"}, "call_0") == "r-LX95"
            assert tools["reserve_seat"]({"flight": "LX97"}, "call_0") == "r-LX97"
        receipt = tools["reserve_seat"].saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    steps = sorted(s.step_id for s in receipt.steps)
    assert steps == ["reserve_seat@call_0", "reserve_seat@call_0#2", "reserve_seat@call_0#3"]
    assert [trip.log.count(f"reserve:LX{n}") for n in (95, 96, 97)] == [1, 1, 1]


def test_openai_agents_stream_read_on_after_the_saga_ended_does_not_say_the_saga_stays_open(
    served: Any,
) -> None:
    """A caller leaves ``stream_events()`` early (the saga's block completes the
    saga), then reads the rest of the run, which pauses for tool approval: the
    ``Interrupted`` said the saga "stays open" and told to resume it, while it had
    ended. It says the saga had already ended, and ``ended`` is its status."""
    from sagaline.agents import openai_agents as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:openai")
    agent = _approving_openai_agent(saga, catalogue, "LX84", 984)

    async def read_on() -> tuple[sagaline.Receipt, BaseException | None]:
        async with saga as view:
            events = adapter.run_streamed(saga, agent, "book LX84").stream_events()
            async for event in events:
                if getattr(getattr(event, "item", None), "type", "") == "tool_call_output_item":
                    break
        receipt = await view.wait(120)  # the saga's end is known to the client
        try:
            [_ async for _ in events]
        except adapter.Interrupted as exc:
            return receipt, exc
        return receipt, None

    receipt, stopped = asyncio.run(read_on())
    assert receipt.status is TerminalStatus.COMPLETED
    assert isinstance(stopped, adapter.Interrupted)
    assert [i.tool_name for i in stopped.interruptions] == ["confirm_payment"]
    assert "stays open" not in str(stopped), str(stopped)
    assert "had already ended (COMPLETED)" in str(stopped)
    assert stopped.ended is TerminalStatus.COMPLETED
    assert [e for e in trip.log if "LX84" in e or ":984" in e] == ["reserve:LX84"]


def test_openai_agents_stream_closed_early_cancels_the_run(served: Any) -> None:
    """A caller leaves ``stream_events()`` after the first tool's output and closes
    the stream (``aclose()``, as ``contextlib.aclosing`` does): the SDK's run went on
    in the background, asking the model again and running its next call, here the
    charge, still inside the saga's block. Closing the adapter's stream cancels the
    run (``result.cancel()``): the charge is never made, and the saga completes with
    the reservation only."""
    from agents import Agent

    from sagaline.agents import openai_agents as adapter

    client, catalogue, trip = served
    saga = client.saga("trip", principal="agent:openai")
    script = iter([("reserve_seat", {"flight": "LX85"}), ("charge_card", {"amount": 185})])
    turns: list[int] = []
    closed = asyncio.Event()  # bound to the loop of its first use

    async def turn() -> None:  # the model's second turn waits until the stream is closed
        turns.append(len(turns) + 1)
        if len(turns) == 2:
            await closed.wait()

    agent = Agent(
        name="booker",
        model=_scripted_openai_model(script, turn),
        tools=adapter.tools(saga, catalogue),
    )

    async def closed_early() -> asyncio.Task[Any]:
        async with saga:
            run = adapter.run_streamed(saga, agent, "book LX85")
            events = run.stream_events()
            async for event in events:
                if getattr(getattr(event, "item", None), "type", "") == "tool_call_output_item":
                    break
            await events.aclose()
            closed.set()
            task = run.result.run_loop_task
            assert task is not None
            await asyncio.wait([task])  # the run ends: cancelled, or having gone on
        return task

    task = asyncio.run(closed_early())
    receipt = saga.wait(120)
    assert task.cancelled()
    assert [e for e in trip.log if "LX85" in e or ":185" in e] == ["reserve:LX85"]
    assert receipt.status is TerminalStatus.COMPLETED
    assert [(s.tool, s.disposition.value) for s in receipt.steps] == [("reserve_seat", "RETAINED")]


def test_openai_agents_malformed_tool_arguments_go_back_to_the_model_and_the_saga_goes_on(
    served: Any,
) -> None:
    """A model that sends tool arguments that are no JSON object (cut off, or a list)
    made the tool raise ``json.JSONDecodeError``, which the SDK wraps in its
    ``UserError``: the run raised and the saga's block aborted the whole saga,
    undoing the steps before, though nothing of the bad call was written. Now the
    model gets a tool error saying so, and the run goes on (its next call runs)."""
    from agents import Agent, Runner, Usage, set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from sagaline.agents import openai_agents as adapter

    set_tracing_disabled(True)
    client, catalogue, trip = served
    script = iter(
        [
            ("c-1", "reserve_seat", '{"flight": "LX9'),
            ("c-2", "reserve_seat", '["LX91"]'),
            ("c-3", "reserve_seat", '{"flight": "LX92"}'),
        ]
    )
    inputs: list[str] = []

    class Scripted(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            inputs.append(repr(kwargs.get("input", args[1] if len(args) > 1 else None)))
            step = next(script, None)
            out: Any
            if step is None:
                text = ResponseOutputText(annotations=[], text="booked", type="output_text")
                out = ResponseOutputMessage(
                    id="m-1", content=[text], role="assistant", status="completed", type="message"
                )
            else:
                out = ResponseFunctionToolCall(
                    arguments=step[2],
                    call_id=step[0],
                    name=step[1],
                    type="function_call",
                    id=step[0],
                )
            return ModelResponse(output=[out], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    with client.saga("trip", principal="agent:openai") as saga:
        agent = Agent(name="booker", model=Scripted(), tools=adapter.tools(saga, catalogue))
        asyncio.run(Runner.run(agent, "book LX92"))
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.tool for s in receipt.steps] == ["reserve_seat"]
    assert "reserve:LX92" in trip.log and "reserve:LX9" not in trip.log
    assert "not a JSON object" in inputs[1] and "nothing was called" in inputs[1]
    assert "not a JSON object" in inputs[2]


def test_openai_agents_arguments_the_saga_refuses_go_back_to_the_model_not_abort_the_saga(
    served: Any,
) -> None:
    """A call the saga's client refuses before writing anything (an integer past 64
    bits in the model's JSON, an argument named like a ``saga.call`` option) raised
    ``CallRefused`` out of the tool: the SDK wrapped it in ``UserError``, the run
    raised, and the saga's block aborted the saga, undoing the steps before, for a
    call that never happened. The model now gets the refusal as a tool error (as
    from the MCP proxy) and the run goes on."""
    from agents import Agent, Runner, Usage, set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from sagaline.agents import openai_agents as adapter

    set_tracing_disabled(True)
    client, catalogue, trip = served
    script = iter(
        [
            ("c-1", "reserve_seat", '{"flight": "LX95"}'),
            ("c-2", "charge_card", '{"amount": 123456789012345678901234567890}'),
            ("c-3", "charge_card", '{"amount": 96, "step_id": "01-reserve_seat"}'),
            ("c-4", "charge_card", '{"amount": 97}'),
        ]
    )
    inputs: list[str] = []

    class Scripted(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            inputs.append(repr(kwargs.get("input", args[1] if len(args) > 1 else None)))
            step = next(script, None)
            out: Any
            if step is None:
                text = ResponseOutputText(annotations=[], text="booked", type="output_text")
                out = ResponseOutputMessage(
                    id="m-1", content=[text], role="assistant", status="completed", type="message"
                )
            else:
                out = ResponseFunctionToolCall(
                    arguments=step[2],
                    call_id=step[0],
                    name=step[1],
                    type="function_call",
                    id=step[0],
                )
            return ModelResponse(output=[out], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    with client.saga("trip", principal="agent:openai") as saga:
        agent = Agent(name="booker", model=Scripted(), tools=adapter.tools(saga, catalogue))
        asyncio.run(Runner.run(agent, "book LX95"))
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.tool for s in receipt.steps] == ["reserve_seat", "charge_card"]
    assert "charge:97" in trip.log and "charge:96" not in trip.log
    assert "args.amount" in inputs[2] and "nothing was called" in inputs[2]
    assert "step_id" in inputs[3]


def test_langgraph_arguments_the_saga_refuses_go_back_to_the_model_not_abort_the_saga(
    served: Any,
) -> None:
    """A call the saga's client refuses before writing anything (an integer past 64
    bits, an argument named like a ``saga.call`` option) raised ``CallRefused`` out
    of the LangChain tool, out of the graph: the saga's block aborted the saga,
    undoing the steps before, for a call that never happened. The model now gets the
    refusal as a ``ToolMessage`` with ``status="error"`` (as from the OpenAI Agents
    adapter and the MCP proxy) and the run goes on; so does a call made directly
    (``ainvoke`` of a tool call)."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langgraph.prebuilt import ToolNode

    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served
    calls = [
        ("reserve_seat", {"flight": "LX86"}),
        ("charge_card", {"amount": 123456789012345678901234567890}),
        ("charge_card", {"amount": 186, "step_id": "01-reserve_seat"}),
        ("charge_card", {"amount": 187}),
    ]
    replies = [
        AIMessage(content="", tool_calls=[{"name": n, "args": a, "id": f"call-86-{i}"}])
        for i, (n, a) in enumerate(calls)
    ] + [AIMessage(content="booked")]
    model = GenericFakeChatModel(messages=iter(replies))

    with client.saga("trip", principal="agent:langgraph") as saga:
        tools = adapter.tools(saga, catalogue)
        graph = _agent_graph(model.invoke, ToolNode(tools))
        out = graph.compile().invoke({"messages": [HumanMessage("book LX86")]})
        direct = asyncio.run(
            {t.name: t for t in tools}["charge_card"].ainvoke(
                {
                    "name": "charge_card",
                    "args": {"amount": 188, "timeout_s": 1},
                    "id": "call-86-9",
                    "type": "tool_call",
                }
            )
        )
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.tool for s in receipt.steps] == ["reserve_seat", "charge_card"]
    assert "charge:187" in trip.log
    assert "charge:186" not in trip.log and "charge:188" not in trip.log
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [m.status for m in results] == ["success", "error", "error", "success"]
    assert "args.amount" in str(results[1].content)
    assert "nothing was called" in str(results[1].content)
    assert "step_id" in str(results[2].content)
    assert direct.status == "error" and "timeout_s" in str(direct.content)


def test_langchain_tool_of_a_saga_never_started_still_raises(served: Any) -> None:
    """A refusal that is no fault of the call (the saga was never started: no call of
    it can run) is not handed to the model: it raises, as before."""
    from participants.client import CallRefused
    from sagaline.agents import langchain as adapter

    client, catalogue, _trip = served
    saga = client.saga("trip", principal="agent:langgraph")  # never entered
    tool = {t.name: t for t in adapter.tools(saga, catalogue)}["reserve_seat"]
    call = {"name": "reserve_seat", "args": {"flight": "LX87"}, "id": "c-87", "type": "tool_call"}
    with pytest.raises(CallRefused) as refused:
        tool.invoke(call)
    assert refused.value.limit == "saga-not-started"


def test_pydantic_ai_arguments_the_saga_refuses_go_back_to_the_model_not_abort_the_saga(
    served: Any,
) -> None:
    """A call the saga's client refuses before writing anything (an integer past 64
    bits, an argument named like a ``saga.call`` option) raised ``CallRefused`` out
    of the pydantic-ai tool, out of the run: the saga's block aborted the saga,
    undoing the steps before, for a call that never happened. The model now gets the
    refusal as the tool's result (as from the OpenAI Agents adapter and the MCP
    proxy; not a ``ModelRetry``, whose retry budget would still end the run) and the
    run goes on."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    script = iter(
        [
            ("reserve_seat", {"flight": "LX88"}),
            ("charge_card", {"amount": 123456789012345678901234567890}),
            ("charge_card", {"amount": 188, "step_id": "01-reserve_seat"}),
            ("charge_card", {"amount": 189, "timeout_s": 1}),
            ("charge_card", {"amount": 187}),
        ]
    )
    returned: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest):
            returned.extend(str(p.content) for p in last.parts if isinstance(p, ToolReturnPart))
        step = next(script, None)
        if step is None:
            return ModelResponse(parts=[TextPart("booked")])
        return ModelResponse(
            parts=[ToolCallPart(step[0], step[1], tool_call_id=f"p-{len(returned)}")]
        )

    with client.saga("trip", principal="agent:pydantic-ai") as saga:
        agent = Agent(FunctionModel(model), toolsets=[adapter.toolset(saga, catalogue)])
        adapter.run_sync(saga, agent, "book LX88")
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.tool for s in receipt.steps] == ["reserve_seat", "charge_card"]
    assert "charge:187" in trip.log
    assert "charge:188" not in trip.log and "charge:189" not in trip.log
    assert len(returned) == 5
    assert "args.amount" in returned[1] and "nothing was called" in returned[1]
    assert "step_id" in returned[2] and "timeout_s" in returned[3]


def test_pydantic_ai_tool_of_a_saga_never_started_still_raises(served: Any) -> None:
    """A refusal that is no fault of the call (the saga was never started) is not
    handed to the model: it raises out of the run, as before."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from participants.client import CallRefused
    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart("reserve_seat", {"flight": "LX89"})])

    saga = client.saga("trip", principal="agent:pydantic-ai")  # never entered
    agent = Agent(FunctionModel(model), toolsets=[adapter.toolset(saga, catalogue)])
    with pytest.raises(CallRefused) as refused:
        agent.run_sync("book LX89")
    assert refused.value.limit == "saga-not-started"
    assert "reserve:LX89" not in trip.log


def test_pydantic_ai_tool_arguments_that_are_no_json_object_go_back_to_the_model(
    served: Any,
) -> None:
    """Tool arguments that are JSON but no object (a list, a string, null) passed
    pydantic-ai's validation of a schema tool (it takes any JSON) and the call of the
    tool raised ``TypeError`` (``argument after ** must be a mapping``), out of the
    run: the saga's block aborted the saga, undoing the steps before, though nothing
    of the bad call was written. The model now gets a retry saying the input should
    be an object (as for arguments that are not JSON), and the run goes on."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from sagaline.agents import pydantic_ai as adapter

    client, catalogue, trip = served
    script = iter(
        [
            ("reserve_seat", '{"flight": "LX73"}'),
            ("reserve_seat", '["LX82"]'),
            ("reserve_seat", '{"flight": "LX82"}'),
            ("reserve_seat", "null"),
            ("charge_card", '{"amount": 181}'),
        ]
    )
    returned: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest):
            returned.extend(str(p.content) for p in last.parts if isinstance(p, ToolReturnPart))
        step = next(script, None)
        if step is None:
            return ModelResponse(parts=[TextPart("booked")])
        call_id = f"q-{len(returned)}"
        return ModelResponse(parts=[ToolCallPart(step[0], step[1], tool_call_id=call_id)])

    with client.saga("trip", principal="agent:pydantic-ai") as saga:
        agent = Agent(FunctionModel(model), toolsets=[adapter.toolset(saga, catalogue)])
        adapter.run_sync(saga, agent, "book LX82")
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.tool for s in receipt.steps] == ["reserve_seat", "reserve_seat", "charge_card"]
    assert "reserve:LX82" in trip.log and "charge:181" in trip.log
    assert len(returned) == 5
    assert "object" in returned[1] and "object" in returned[3]


# Arguments that are a JSON object but do not fit the tool's schema: a wrong type,
# a required one missing, one the tool does not take.
_MISFIT: list[dict[str, Any]] = [{"amount": "lots"}, {}, {"amount": 5, "currency": "EUR"}]


def _assert_misfits_refused(saga: Any, trip: Trip, told: list[str], amount: int) -> None:
    receipt = saga.wait(120)
    assert receipt.status is TerminalStatus.COMPLETED
    assert [s.tool for s in receipt.steps] == ["reserve_seat", "charge_card"]
    assert f"charge:{amount}" in trip.log
    assert len(told) == len(_MISFIT)
    for text, where in zip(told, ["amount", "amount", "currency"], strict=True):
        assert "nothing was called" in text and where in text, text


def test_arguments_that_do_not_fit_the_tools_schema_go_back_to_the_model_not_abort_the_saga(
    served: Any,
) -> None:
    """A model's call whose arguments do not fit the tool's schema (a wrong type, a
    required one missing, one the tool does not take) was written as a step: the
    participant refused it (``InvalidArgumentsError``, a business rejection), the
    step failed, ``BusinessRejected`` raised out of the run and the saga was aborted,
    its earlier steps undone, for a call that never ran (the MCP proxy checks them
    first). Each adapter now refuses it before anything is written, hands the model
    a tool error saying why, and the run goes on (OpenAI Agents, LangGraph,
    pydantic-ai in turn)."""
    from agents import Agent, Usage, set_tracing_disabled
    from agents.items import ModelResponse as AgentsResponse
    from agents.models.interface import Model
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langgraph.prebuilt import ToolNode
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )
    from pydantic_ai import Agent as PydanticAgent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from sagaline.agents import langchain as lc_adapter
    from sagaline.agents import openai_agents as oa_adapter
    from sagaline.agents import pydantic_ai as pa_adapter

    client, catalogue, trip = served

    def calls(flight: str, amount: int) -> list[tuple[str, dict[str, Any]]]:
        misfits = [("charge_card", a) for a in _MISFIT]
        return [("reserve_seat", {"flight": flight}), *misfits, ("charge_card", {"amount": amount})]

    # OpenAI Agents SDK
    set_tracing_disabled(True)
    script = iter(calls("LX61", 161))
    inputs: list[Any] = []

    class Scripted(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> AgentsResponse:
            inputs.append(kwargs.get("input", args[1] if len(args) > 1 else None))
            step = next(script, None)
            out: Any
            if step is None:
                text = ResponseOutputText(annotations=[], text="booked", type="output_text")
                out = ResponseOutputMessage(
                    id="m-1", content=[text], role="assistant", status="completed", type="message"
                )
            else:
                n = len(inputs)
                out = ResponseFunctionToolCall(
                    arguments=json.dumps(step[1]),
                    call_id=f"m-{n}",
                    name=step[0],
                    type="function_call",
                    id=f"m-{n}",
                )
            return AgentsResponse(output=[out], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    with client.saga("trip", principal="agent:openai") as saga:
        agent = Agent(name="booker", model=Scripted(), tools=[*oa_adapter.tools(saga, catalogue)])
        oa_adapter.run_sync(saga, agent, "book LX61")
    outputs = [str(i["output"]) for i in inputs[-1] if i.get("type") == "function_call_output"]
    _assert_misfits_refused(saga, trip, outputs[1:-1], 161)

    # LangGraph ToolNode
    replies = [
        AIMessage(content="", tool_calls=[{"name": n, "args": a, "id": f"call-62-{i}"}])
        for i, (n, a) in enumerate(calls("LX62", 162))
    ] + [AIMessage(content="booked")]
    model = GenericFakeChatModel(messages=iter(replies))
    with client.saga("trip", principal="agent:langgraph") as saga:
        graph = _agent_graph(model.invoke, ToolNode(lc_adapter.tools(saga, catalogue)))
        out = lc_adapter.invoke(saga, graph.compile(), {"messages": [HumanMessage("book")]})
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [m.status for m in results] == ["success", "error", "error", "error", "success"]
    _assert_misfits_refused(saga, trip, [str(m.content) for m in results[1:-1]], 162)

    # pydantic-ai
    pa_script = iter(calls("LX63", 163))
    returned: list[str] = []

    def pa_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest):
            returned.extend(str(p.content) for p in last.parts if isinstance(p, ToolReturnPart))
        step = next(pa_script, None)
        if step is None:
            return ModelResponse(parts=[TextPart("booked")])
        return ModelResponse(
            parts=[ToolCallPart(step[0], step[1], tool_call_id=f"p63-{len(returned)}")]
        )

    with client.saga("trip", principal="agent:pydantic-ai") as saga:
        pa_agent = PydanticAgent(
            FunctionModel(pa_model), toolsets=[pa_adapter.toolset(saga, catalogue)]
        )
        pa_adapter.run_sync(saga, pa_agent, "book LX63")
    _assert_misfits_refused(saga, trip, returned[1:-1], 163)


def test_langgraph_tool_node_handle_tool_errors_must_let_saga_errors_raise(
    served: Any,
) -> None:
    """What docs/agents.md says of LangGraph's ``ToolNode(handle_tool_errors=...)``:
    its default lets a failed step's ``SagaCallError`` raise out of the run (the
    saga aborts); ``handle_tool_errors=True`` turns it into a ``ToolMessage``, so the
    run returns as if it went well while the coordinator compensates the saga (the
    agent's later calls meet ``SagaUnwinding``, as messages too); a handler that
    re-raises ``sagaline.SagaCallError`` keeps the adapters' guarantee."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langgraph.prebuilt import ToolNode

    from sagaline.agents import langchain as adapter

    client, catalogue, trip = served

    sagas: list[Any] = []

    def run(flight: str, handle: Any) -> Any:
        calls = [
            ("reserve_seat", {"flight": flight}),
            ("charge_card", {"amount": 966}),
            ("reserve_seat", {"flight": f"{flight}-2"}),
        ]
        replies = [
            AIMessage(content="", tool_calls=[{"name": n, "args": a, "id": f"{flight}-{i}"}])
            for i, (n, a) in enumerate(calls)
        ] + [AIMessage(content="booked")]
        model = GenericFakeChatModel(messages=iter(replies))
        saga = client.saga("trip", principal="agent:langgraph")
        sagas.append(saga)
        with saga:
            tools = adapter.tools(saga, catalogue)
            node = ToolNode(tools) if handle is None else ToolNode(tools, handle_tool_errors=handle)
            graph = _agent_graph(model.invoke, node)
            out = adapter.invoke(saga, graph.compile(), {"messages": [HumanMessage("book")]})
        return out

    def keep_saga_errors(error: Exception) -> str:
        if isinstance(error, sagaline.SagaCallError):
            raise error
        return f"error: {error}"

    for flight, handle in [("LX64", None), ("LX65", keep_saga_errors)]:
        with pytest.raises(BusinessRejected):
            run(flight, handle)
    out = run("LX66", True)  # the step's error swallowed: the run returns
    told = [str(m.content) for m in out["messages"] if isinstance(m, ToolMessage)]
    assert "BusinessRejected" in told[1] and "SagaUnwinding" in told[2]
    assert out["messages"][-1].content == "booked"
    # COMPENSATED, all three; the last not what its run's "booked" says
    assert [s.wait(120).status for s in sagas] == [TerminalStatus.COMPENSATED] * 3
    for flight in ("LX64", "LX65", "LX66"):
        assert f"release:r-{flight}" in trip.log and f"reserve:{flight}-2" not in trip.log


class Vault:
    """A card check whose card number is a secret argument."""

    @sagaline.tool(description="Check a card", secret_fields=("card",))
    @sagaline.compensable(by="forget")
    def check_card(self, card: str) -> str:
        return "ok"

    def forget(self, ctx: sagaline.CompensationContext) -> None:
        pass


def test_a_paused_run_left_open_logs_no_secret_the_saga_passed_to_a_tool(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A graph asks its person about a card the saga passed to a tool as a secret
    (``interrupt(f"charge card {card}?")``): the adapter's ``Interrupted`` quotes the
    interrupt, and the saga's block, leaving the saga open for the person, logged
    that message with the card in clear, where the abort reason the same block would
    write is scrubbed of it (docs/security.md)."""
    import logging

    from langchain_core.messages import AIMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode
    from langgraph.types import interrupt

    from sagaline.agents import langchain as adapter

    client, _catalogue, _trip = served
    catalogue = sagaline.wrap(Vault(), name="vault")
    card = "4111111111111111"
    config: Any = {"configurable": {"thread_id": "vault-1"}}
    caplog.set_level(logging.INFO, logger="sagaline.client")
    with sagaline.connect(catalogue, settings=client.settings) as vault_client:
        saga = vault_client.saga("vault", principal="agent:langgraph")
        with pytest.raises(adapter.Interrupted), saga:
            graph = StateGraph(MessagesState)
            graph.add_node("tools", ToolNode(adapter.tools(saga, catalogue)))
            graph.add_node("ask", lambda state: {"messages": [interrupt(f"charge card {card}?")]})
            graph.add_edge(START, "tools")
            graph.add_edge("tools", "ask")
            graph.add_edge("ask", END)
            call = {"name": "check_card", "args": {"card": card}, "id": "call-card"}
            start = {"messages": [AIMessage(content="", tool_calls=[call])]}
            adapter.invoke(saga, graph.compile(checkpointer=InMemorySaver()), start, config)
        saga.end(sagaline.SagaOutcome.ABORT, "test over")  # it was left open: this ends it
    left_open = [r.getMessage() for r in caplog.records if "left open" in r.getMessage()]
    assert len(left_open) == 1 and "charge card" in left_open[0], left_open
    assert card not in left_open[0], left_open


def test_a_call_past_the_step_limit_tells_the_model_to_stop_not_to_retry() -> None:
    """Past SAGALINE_MAX_STEPS no arguments get a call through: a model told to "call
    it again with other arguments" retried until its framework's own turn limit
    (OpenAI Agents' MaxTurnsExceeded), which aborted the saga and undid every step.
    An argument refusal still invites the corrected call."""
    from participants.client import CallRefused
    from sagaline.agents._core import refusal_for_model

    def refused(limit: str) -> CallRefused:
        return CallRefused(
            "refused", limit=limit, size=1, saga_id="s-1", step_id="65-charge", tool="charge"
        )

    past = refusal_for_model("charge", refused("max_steps"))
    assert past is not None and "no further tool call" in past and "again" not in past, past
    bad_args = refusal_for_model("charge", refused("max_args_bytes"))
    assert bad_args is not None and "Call charge again with other arguments" in bad_args
