"""pydantic-ai adapter: a catalogue's tools as a ``FunctionToolset`` whose calls are
saga steps (needs ``sagaline[pydantic-ai]``)::

    from pydantic_ai import Agent
    from sagaline.agents import pydantic_ai as sagaline_pydantic_ai

    with client.saga("refund", principal="agent:atlas") as saga:
        agent = Agent(model, toolsets=[sagaline_pydantic_ai.toolset(saga, catalogue)])
        agent.run_sync("refund order o-1")
    # returned: the saga completes; raised: it aborts and is compensated

A run that calls a deferred tool (one with ``requires_approval``, or one that raises
``ApprovalRequired`` / ``CallDeferred``) ends with ``DeferredToolRequests`` as its
output, and ``agent.run_sync`` *returns*: the block would complete the saga with the
effects so far, and the continued run would meet an ended saga. Run the agent with
:func:`run_sync` (or :func:`run`): a run ending with ``DeferredToolRequests`` raises
:class:`Interrupted` (an ``ApprovalPending``: the saga stays open, R7); continue it
in :func:`resumed`, which ends the saga as the block would (completed, aborted, or
left open at the next pause)::

    try:
        with client.saga("refund", principal="agent:atlas") as saga:
            agent = Agent(model, toolsets=[...], output_type=[str, DeferredToolRequests])
            sagaline_pydantic_ai.run_sync(saga, agent, "refund order o-1")
    except sagaline_pydantic_ai.Interrupted as stopped:
        answers = ask_the_person(stopped.requests)  # a DeferredToolResults
    with sagaline_pydantic_ai.resumed(saga):  # or an attached saga, after a restart
        sagaline_pydantic_ai.run_sync(
            saga, agent, message_history=stopped.result.all_messages(),
            deferred_tool_results=answers,
        )
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic_ai import Agent, AgentRunResult, DeferredToolRequests, RunContext, Tool
from pydantic_ai.toolsets import FunctionToolset

from participants.catalogue import Catalogue, ToolSpec
from participants.client import AsyncSaga, Saga
from sagaline.agents import _core
from sagaline.agents._core import SagaTool, resumed, saga_tools

__all__ = ["Interrupted", "resumed", "run", "run_sync", "toolset"]


def toolset(
    saga: Saga | AsyncSaga, catalogue: Catalogue | Iterable[ToolSpec]
) -> FunctionToolset[Any]:
    """Every tool of ``catalogue`` in one toolset, each call a step of ``saga``."""
    return FunctionToolset([_tool(t) for t in saga_tools(saga, catalogue)])


def _tool(bound: SagaTool) -> Tool[Any]:
    async def call(ctx: RunContext[Any], /, **kwargs: Any) -> Any:
        return await bound.acall(kwargs, ctx.tool_call_id)  # see _core: retried calls

    function: Callable[..., Any] = call
    return Tool.from_schema(
        function,
        name=bound.name,
        description=bound.description,
        json_schema=bound.parameters,
        takes_ctx=True,
    )


class Interrupted(_core.Interrupted):
    """The run ended waiting for deferred tool calls (approvals, or calls run outside
    the agent): it waits for a person. Like any ``ApprovalPending`` it leaves the saga
    open (R7) when it leaves the saga's block; ``result`` is the run's
    ``AgentRunResult`` (``result.all_messages()`` to continue it), ``requests`` its
    ``DeferredToolRequests``, ``pending`` their ``ToolCallPart``s (approvals first)."""

    def __init__(self, message: str, *, saga_id: str, result: AgentRunResult[Any]) -> None:
        self.result = result
        self.requests: DeferredToolRequests = result.output
        calls = [*self.requests.approvals, *self.requests.calls]
        ids = (c.tool_call_id for c in calls)
        super().__init__(message, saga_id=saga_id, pending=calls, ids=ids)


async def run(
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], *args: Any, **kwargs: Any
) -> AgentRunResult[Any]:
    """``await agent.run(*args, **kwargs)`` for a run that is ``saga``: its result, or
    :class:`Interrupted` when the run ended waiting for deferred tool calls."""
    return _checked(saga, await agent.run(*args, **kwargs))


def run_sync(
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], *args: Any, **kwargs: Any
) -> AgentRunResult[Any]:
    """``agent.run_sync(*args, **kwargs)``, as :func:`run`."""
    return _checked(saga, agent.run_sync(*args, **kwargs))


def _checked(saga: Saga | AsyncSaga, result: AgentRunResult[Any]) -> AgentRunResult[Any]:
    if isinstance(result.output, DeferredToolRequests):
        requests = result.output
        calls = [*requests.approvals, *requests.calls]
        names = ", ".join(c.tool_name for c in calls)
        raise Interrupted(
            f"the run ended waiting for {len(calls)} deferred tool call(s) ({names[:200]}):"
            f" saga {saga.saga_id} stays open; continue it with message_history="
            "result.all_messages() and deferred_tool_results=... in"
            " sagaline.agents.pydantic_ai.resumed(saga)",
            saga_id=saga.saga_id,
            result=result,
        )
    return result
