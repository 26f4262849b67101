"""OpenAI Agents SDK adapter: a catalogue's tools as ``FunctionTool`` objects whose
calls are saga steps (needs ``sagaline[openai-agents]``)::

    from agents import Agent, Runner
    from sagaline.agents import openai_agents

    with client.saga("refund", principal="agent:atlas") as saga:
        agent = Agent(name="atlas", tools=openai_agents.tools(saga, catalogue))
        Runner.run_sync(agent, "refund order o-1")
    # returned: the saga completes; raised: it aborts and is compensated

A step that does not commit is not handed back to the model as text: it raises out
of the run, so the saga aborts instead of the agent carrying on. A step waiting for
approval raises :class:`~participants.client.ApprovalPending` itself (the SDK wraps
other errors in its ``UserError``), so the saga stays open for the person (R7).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from agents import FunctionTool
from agents.exceptions import AgentsException
from agents.tool import set_function_tool_failure_error_function
from agents.tool_context import ToolContext

from participants.catalogue import Catalogue, ToolSpec
from participants.client import ApprovalPending, AsyncSaga, Saga
from sagaline.agents._core import SagaTool, saga_tools

__all__ = ["tools"]


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
            result = await bound.acall(json.loads(arguments or "{}"), ctx.tool_call_id)
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
