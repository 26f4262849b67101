"""pydantic-ai adapter: a catalogue's tools as a ``FunctionToolset`` whose calls are
saga steps (needs ``sagaline[pydantic-ai]``)::

    from pydantic_ai import Agent
    from sagaline.agents import pydantic_ai as sagaline_pydantic_ai

    with client.saga("refund", principal="agent:atlas") as saga:
        agent = Agent(model, toolsets=[sagaline_pydantic_ai.toolset(saga, catalogue)])
        agent.run_sync("refund order o-1")
    # returned: the saga completes; raised: it aborts and is compensated
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic_ai import RunContext, Tool
from pydantic_ai.toolsets import FunctionToolset

from participants.catalogue import Catalogue, ToolSpec
from participants.client import AsyncSaga, Saga
from sagaline.agents._core import SagaTool, saga_tools

__all__ = ["toolset"]


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
