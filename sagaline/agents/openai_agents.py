"""OpenAI Agents SDK adapter: a catalogue's tools as ``FunctionTool`` objects whose
calls are saga steps (needs ``sagaline[openai-agents]``)::

    from agents import Agent, Runner
    from sagaline.agents import openai_agents

    with client.saga("refund", principal="agent:atlas") as saga:
        agent = Agent(name="atlas", tools=openai_agents.tools(saga, catalogue))
        Runner.run_sync(agent, "refund order o-1")
    # returned: the saga completes; raised: it aborts and is compensated

A step that does not commit is not handed back to the model as text: it raises out
of the run, so the saga aborts instead of the agent carrying on. A call that is no
step at all is handed back as a tool error (nothing was written; the model may call
again): arguments that are no JSON object (cut off, garbled), and a call the client
refuses before writing it (``CallRefused``: arguments that do not fit the tool's
schema, arguments JSON cannot hold, over the
size limit, named like a ``saga.call`` option; the saga's step limit). A step waiting for
approval raises :class:`~participants.client.ApprovalPending` itself (the SDK wraps
other errors in its ``UserError``), so the saga stays open for the person (R7).

A tool with ``needs_approval`` pauses the run, and ``Runner.run`` *returns* (with
``result.interruptions``): the block would complete the saga with the effects so far,
and the approved run would meet an ended saga. Run the agent with :func:`run_sync`
(or :func:`run`): a run paused for approval raises :class:`Interrupted` (an
``ApprovalPending``: the saga stays open, R7); continue it in :func:`resumed`, which
ends the saga as the block would (completed, aborted, or left open at the next
pause)::

    try:
        with client.saga("refund", principal="agent:atlas") as saga:
            agent = Agent(name="atlas", tools=[*openai_agents.tools(saga, catalogue), ...])
            openai_agents.run_sync(saga, agent, "refund order o-1")
    except openai_agents.Interrupted as stopped:
        state = stopped.result.to_state()
        for item in stopped.interruptions:
            state.approve(item)  # or state.reject(item), as the person answers
    with openai_agents.resumed(saga):  # or an attached saga, after a restart
        openai_agents.run_sync(saga, agent, state)

A streamed run (``Runner.run_streamed``) pauses the same way, and its
``stream_events()`` just ends: run it with :func:`run_streamed`, whose
``stream_events()`` raises :class:`Interrupted` after the last event when the run
paused (a stream left before its end is not checked; closed before its end, e.g.
``await events.aclose()``, it cancels the run: ``result.cancel()``)::

    result = openai_agents.run_streamed(saga, agent, "refund order o-1")
    async for event in result.stream_events():
        ...
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from participants.catalogue import Catalogue, ToolSpec
from participants.client import ApprovalPending, AsyncSaga, CallRefused, Saga
from sagaline.agents import _core
from sagaline.agents._core import SagaTool, refusal_for_model, resumed, saga_tools

try:  # an optional extra: without it, say which one instead of "No module named 'agents'"
    from agents import Agent, FunctionTool, Runner, RunResult, RunResultStreaming
    from agents.exceptions import AgentsException
    from agents.stream_events import StreamEvent
    from agents.tool import set_function_tool_failure_error_function
    from agents.tool_context import ToolContext
except ModuleNotFoundError as missing:
    raise _core.missing_extra(
        __name__, "the OpenAI Agents SDK", "openai-agents", missing
    ) from missing

__all__ = ["Interrupted", "StreamedRun", "resumed", "run", "run_streamed", "run_sync", "tools"]


def tools(saga: Saga | AsyncSaga, catalogue: Catalogue | Iterable[ToolSpec]) -> list[FunctionTool]:
    """Every tool of ``catalogue`` as a ``FunctionTool`` running as a step of ``saga``."""
    return [_function_tool(t) for t in saga_tools(saga, catalogue)]


class _ApprovalPending(ApprovalPending, AgentsException):
    """ApprovalPending as the SDK lets it through: it re-raises its own exceptions and
    wraps any other in ``UserError``, which the saga's block would take for a failure
    and abort the saga that waits for a person."""


def _function_tool(bound: SagaTool) -> FunctionTool:
    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:  # JSONDecodeError: the model's text, cut off or garbled
            args, why = None, f"({exc})"
        else:
            why = f"(a JSON {type(args).__name__})"
        if not isinstance(args, dict):
            # Nothing was written: the model may correct its call, the saga goes on.
            return (
                f"error: the arguments of {bound.name} are not a JSON object {why}; "
                f"nothing was called. Call {bound.name} again with a JSON object of its "
                "parameters"
            )
        try:
            result = await bound.acall(args, ctx.tool_call_id)
        except CallRefused as exc:
            refusal = refusal_for_model(bound.name, exc)
            if refusal is None:  # the saga itself cannot go on (never started)
                raise
            return refusal
        except ApprovalPending as exc:
            raise _ApprovalPending(
                str(exc),
                saga_id=exc.saga_id,
                step_id=exc.step_id,
                tool=exc.tool,
                approval_id=exc.approval_id,
            ) from exc
        return result if isinstance(result, str) else json.dumps(result)

    tool = FunctionTool(
        name=bound.name,
        description=bound.description,
        params_json_schema=bound.parameters,
        on_invoke_tool=invoke,
        strict_json_schema=False,  # optional arguments keep their defaults
    )
    # Raise instead of returning the error to the model (the SDK's default).
    return set_function_tool_failure_error_function(tool, None)


class Interrupted(_core.Interrupted):
    """The run paused for tool approval (a tool with ``needs_approval``): it waits for
    a person. Like any ``ApprovalPending`` it leaves the saga open (R7) when it leaves
    the saga's block; ``result`` is the paused ``RunResult`` (a ``RunResultStreaming``
    for a streamed run; ``result.to_state()`` to approve or reject and run again),
    ``interruptions`` (and ``pending``) its ``ToolApprovalItem``s."""

    def __init__(
        self, message: str, *, saga_id: str, result: RunResult | RunResultStreaming
    ) -> None:
        self.result = result
        self.interruptions = list(result.interruptions)
        ids = (str(getattr(i.raw_item, "call_id", "") or "") for i in self.interruptions)
        super().__init__(message, saga_id=saga_id, pending=self.interruptions, ids=ids)


async def run(saga: Saga | AsyncSaga, agent: Agent[Any], input: Any, **kwargs: Any) -> RunResult:
    """``await Runner.run(agent, input, **kwargs)`` for a run that is ``saga``: its
    result, or :class:`Interrupted` when the run paused for tool approval."""
    return _checked(saga, await Runner.run(agent, input, **kwargs))


def run_sync(saga: Saga | AsyncSaga, agent: Agent[Any], input: Any, **kwargs: Any) -> RunResult:
    """``Runner.run_sync(agent, input, **kwargs)``, as :func:`run`."""
    return _checked(saga, Runner.run_sync(agent, input, **kwargs))


def run_streamed(
    saga: Saga | AsyncSaga, agent: Agent[Any], input: Any, **kwargs: Any
) -> StreamedRun:
    """``Runner.run_streamed(agent, input, **kwargs)`` for a run that is ``saga``: its
    result, whose ``stream_events()`` raises :class:`Interrupted` after the last event
    when the run paused for tool approval."""
    return StreamedRun(saga, Runner.run_streamed(agent, input, **kwargs))


class StreamedRun:
    """A ``RunResultStreaming`` (``result``; its other attributes read through) whose
    ``stream_events()`` hands over the run's events and then, once the last one has
    been handed over, raises :class:`Interrupted` when the run paused for tool
    approval (a stream left before its end is not checked). Closed before its end
    (``aclose()``, or finalized once left), the stream cancels the run
    (``result.cancel()``), which would otherwise go on in the background."""

    def __init__(self, saga: Saga | AsyncSaga, result: RunResultStreaming) -> None:
        self.saga = saga
        self.result = result

    def stream_events(self) -> AsyncIterator[StreamEvent]:
        async def check() -> Interrupted | None:
            return _interrupted(self.saga, self.result)

        # Closed before its end: the SDK's run would go on in the background (asking
        # the model, running tools outside the saga): cancel it.
        return _core.achecked_stream(self.result.stream_events(), check, closed=self.result.cancel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result, name)


def _checked(saga: Saga | AsyncSaga, result: RunResult) -> RunResult:
    stopped = _interrupted(saga, result)
    if stopped is not None:
        raise stopped
    return result


def _interrupted(
    saga: Saga | AsyncSaga, result: RunResult | RunResultStreaming
) -> Interrupted | None:
    if not result.interruptions:
        return None
    names = ", ".join(str(i.tool_name) for i in result.interruptions)
    message, ended = _core.paused(
        saga,
        f"the run paused for approval of {len(result.interruptions)} tool call(s) ({names[:200]})",
        "approve or reject them on result.to_state() and run it again in"
        " sagaline.agents.openai_agents.resumed(saga)",
    )
    stopped = Interrupted(message, saga_id=saga.saga_id, result=result)
    stopped.ended = ended
    return stopped
