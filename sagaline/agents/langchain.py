"""LangChain adapter: a catalogue's tools as ``StructuredTool`` objects whose calls
are saga steps, usable in a LangGraph ``ToolNode`` (needs ``sagaline[langchain]``)::

    from langgraph.prebuilt import ToolNode
    from sagaline.agents import langchain as sagaline_langchain

    with client.saga("refund", principal="agent:atlas") as saga:
        tools = sagaline_langchain.tools(saga, catalogue)
        graph = build_graph(model.bind_tools(tools), ToolNode(tools))
        graph.invoke({"messages": [...]})
    # returned: the saga completes; raised: it aborts and is compensated
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from langchain_core.tools import StructuredTool

from participants.catalogue import Catalogue, ToolSpec
from participants.client import Saga
from sagaline.agents._core import SagaTool, saga_tools

__all__ = ["tools"]


def tools(saga: Saga, catalogue: Catalogue | Iterable[ToolSpec]) -> list[StructuredTool]:
    """Every tool of ``catalogue`` as a ``StructuredTool`` running as a step of ``saga``."""
    return [_structured_tool(t) for t in saga_tools(saga, catalogue)]


def _structured_tool(bound: SagaTool) -> StructuredTool:
    def run(**kwargs: Any) -> Any:
        return bound(kwargs)

    async def arun(**kwargs: Any) -> Any:
        return await bound.acall(kwargs)

    return StructuredTool(
        name=bound.name,
        description=bound.description,
        args_schema=bound.parameters,  # JSON Schema, as the model sees it
        func=run,
        coroutine=arun,
        handle_tool_error=False,  # a failed step ends the run: the saga aborts
        metadata={"irreversible": bound.irreversible, "read_only": bound.read_only},
    )
