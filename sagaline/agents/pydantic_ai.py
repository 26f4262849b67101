"""pydantic-ai adapter: a catalogue's tools as a ``FunctionToolset`` whose calls are
saga steps (needs ``sagaline[pydantic-ai]``)::

    from pydantic_ai import Agent
    from sagaline.agents import pydantic_ai as sagaline_pydantic_ai

    with client.saga("refund", principal="agent:atlas") as saga:
        agent = Agent(model, toolsets=[sagaline_pydantic_ai.toolset(saga, catalogue)])
        agent.run_sync("refund order o-1")
    # returned: the saga completes; raised: it aborts and is compensated

A step that does not commit raises out of the tool and out of the run, so the saga
aborts instead of the agent carrying on. A call the saga's client refuses before writing
anything (``CallRefused``: arguments that do not fit the tool's schema, arguments JSON
cannot hold, over the size limit, named like a ``saga.call`` option; the saga's step
limit) is no step at all: the model gets the refusal as the tool's result ("error: TOOL
was refused: ...; nothing was called"; nothing to undo, it may call again) and the saga
goes on. A saga never started raises.

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
        history = stopped.result.all_messages()     # `stopped` is unbound after `except`
    with sagaline_pydantic_ai.resumed(saga):  # or an attached saga, after a restart
        sagaline_pydantic_ai.run_sync(
            saga, agent, message_history=history, deferred_tool_results=answers,
        )

A streamed run (``agent.run_stream``, ``agent.run_stream_sync``, ``agent.iter``,
``agent.run_stream_events``) ends the same way once consumed, and its ``async with``
(``with``) block just ends: use :func:`run_stream`, :func:`run_stream_sync`,
:func:`iter` or :func:`run_stream_events` (same arguments), which
raise :class:`Interrupted` when that block ends and the run finished waiting for
deferred tool calls (a stream left before its end is not checked)::

    async with sagaline_pydantic_ai.run_stream(saga, agent, "refund order o-1") as result:
        async for text in result.stream_output():
            ...
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager
from typing import Any

from pydantic_core import SchemaValidator, core_schema

from participants.catalogue import Catalogue, ToolSpec
from participants.client import AsyncSaga, CallRefused, Saga
from sagaline.agents import _core
from sagaline.agents._core import SagaTool, resumed, saga_tools

try:  # an optional extra: without it, say which one instead of "No module named ..."
    from pydantic_ai import (
        Agent,
        AgentRun,
        AgentRunResult,
        DeferredToolRequests,
        RunContext,
        Tool,
    )
    from pydantic_ai.agent.abstract import AgentRunEvents
    from pydantic_ai.result import StreamedRunResult, StreamedRunResultSync
    from pydantic_ai.toolsets import FunctionToolset
except ModuleNotFoundError as missing:
    raise _core.missing_extra(__name__, "pydantic-ai", "pydantic-ai", missing) from missing

__all__ = [
    "Interrupted",
    "iter",
    "resumed",
    "run",
    "run_stream",
    "run_stream_events",
    "run_stream_sync",
    "run_sync",
    "toolset",
]


def toolset(
    saga: Saga | AsyncSaga, catalogue: Catalogue | Iterable[ToolSpec]
) -> FunctionToolset[Any]:
    """Every tool of ``catalogue`` in one toolset, each call a step of ``saga``."""
    return FunctionToolset([_tool(t) for t in saga_tools(saga, catalogue)])


def _tool(bound: SagaTool) -> Tool[Any]:
    async def call(ctx: RunContext[Any], /, **kwargs: Any) -> Any:
        try:
            return await bound.acall(kwargs, ctx.tool_call_id)  # see _core: retried calls
        except CallRefused as exc:
            text = _core.refusal_for_model(bound.name, exc)
            if text is None:  # the saga cannot go on (never started)
                raise
            # Nothing was written: the tool's result, not a ModelRetry (whose retry
            # budget, spent, would end the run and abort the saga for it).
            return text

    function: Callable[..., Any] = call
    tool = Tool.from_schema(
        function,
        name=bound.name,
        description=bound.description,
        json_schema=bound.parameters,
        takes_ctx=True,
    )
    # from_schema takes any JSON as the arguments: a list, a string or null reached
    # ``call(**args)`` as a TypeError out of the run (the saga aborted for a call that
    # wrote nothing). An object only: anything else goes back to the model as a retry,
    # as arguments that are no JSON do.
    tool.function_schema.validator = _ARGUMENTS
    return tool


_ARGUMENTS = SchemaValidator(core_schema.dict_schema(keys_schema=core_schema.str_schema()))


class Interrupted(_core.Interrupted):
    """The run ended waiting for deferred tool calls (approvals, or calls run outside
    the agent): it waits for a person. Like any ``ApprovalPending`` it leaves the saga
    open (R7) when it leaves the saga's block; ``result`` is the run's
    ``AgentRunResult`` (a ``StreamedRunResult`` from :func:`run_stream`, a
    ``StreamedRunResultSync`` from :func:`run_stream_sync`; ``result.all_messages()``
    to continue it), ``requests`` its ``DeferredToolRequests``, ``pending`` their
    ``ToolCallPart``s (approvals first)."""

    def __init__(
        self,
        message: str,
        *,
        saga_id: str,
        result: AgentRunResult[Any] | StreamedRunResult[Any, Any] | StreamedRunResultSync[Any, Any],
        requests: DeferredToolRequests | None = None,
    ) -> None:
        self.result = result
        if requests is None:
            assert isinstance(result, AgentRunResult)
            requests = result.output
        self.requests: DeferredToolRequests = requests
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


def run_stream(
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], *args: Any, **kwargs: Any
) -> AbstractAsyncContextManager[StreamedRunResult[Any, Any]]:
    """``async with agent.run_stream(*args, **kwargs)`` for a run that is ``saga``: its
    ``StreamedRunResult``; when the block ends with the stream consumed and the run
    ended waiting for deferred tool calls, :class:`Interrupted` (a stream left before
    its end is not checked)."""

    async def check(result: StreamedRunResult[Any, Any]) -> Interrupted | None:
        if not result.is_complete:
            return None
        return _interrupted(saga, result, await result.get_output())

    return _core.checked_context(agent.run_stream(*args, **kwargs), check)


def run_stream_sync(
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], *args: Any, **kwargs: Any
) -> AbstractContextManager[StreamedRunResultSync[Any, Any]]:
    """``with agent.run_stream_sync(*args, **kwargs)`` for a run that is ``saga``, as
    :func:`run_stream` (a ``with`` block: the run's ``StreamedRunResultSync``). The run
    starts when the block is entered (``agent.run_stream_sync`` starts it at once)."""
    return _checked_sync_stream(saga, agent, args, kwargs)


@contextmanager
def _checked_sync_stream(
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], args: Any, kwargs: Any
) -> Iterator[StreamedRunResultSync[Any, Any]]:
    with agent.run_stream_sync(*args, **kwargs) as result:
        yield result
        stopped = _interrupted(saga, result, result.get_output()) if result.is_complete else None
    if stopped is not None:
        raise stopped


def iter(  # the name of agent.iter
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], *args: Any, **kwargs: Any
) -> AbstractAsyncContextManager[AgentRun[Any, Any]]:
    """``async with agent.iter(*args, **kwargs)`` for a run that is ``saga``: its
    ``AgentRun``; when the block ends with the run finished waiting for deferred tool
    calls, :class:`Interrupted`."""
    return _core.checked_context(agent.iter(*args, **kwargs), _finished_check(saga))


def run_stream_events(
    saga: Saga | AsyncSaga, agent: Agent[Any, Any], *args: Any, **kwargs: Any
) -> AbstractAsyncContextManager[AgentRunEvents[Any]]:
    """``async with agent.run_stream_events(*args, **kwargs)`` for a run that is
    ``saga``: its events; when the block ends with the run finished waiting for
    deferred tool calls, :class:`Interrupted`."""
    return _core.checked_context(agent.run_stream_events(*args, **kwargs), _finished_check(saga))


def _finished_check(
    saga: Saga | AsyncSaga,
) -> Callable[[AgentRun[Any, Any] | AgentRunEvents[Any]], Awaitable[Interrupted | None]]:
    async def check(run: AgentRun[Any, Any] | AgentRunEvents[Any]) -> Interrupted | None:
        result = run.result  # None until the run finished
        return None if result is None else _interrupted(saga, result, result.output)

    return check


def _checked(saga: Saga | AsyncSaga, result: AgentRunResult[Any]) -> AgentRunResult[Any]:
    stopped = _interrupted(saga, result, result.output)
    if stopped is not None:
        raise stopped
    return result


def _interrupted(
    saga: Saga | AsyncSaga,
    result: AgentRunResult[Any] | StreamedRunResult[Any, Any] | StreamedRunResultSync[Any, Any],
    output: Any,
) -> Interrupted | None:
    if not isinstance(output, DeferredToolRequests):
        return None
    calls = [*output.approvals, *output.calls]
    names = ", ".join(c.tool_name for c in calls)
    message, ended = _core.paused(
        saga,
        f"the run ended waiting for {len(calls)} deferred tool call(s) ({names[:200]})",
        "continue it with message_history=result.all_messages() and"
        " deferred_tool_results=... in sagaline.agents.pydantic_ai.resumed(saga)",
    )
    stopped = Interrupted(message, saga_id=saga.saga_id, result=result, requests=output)
    stopped.ended = ended
    return stopped
