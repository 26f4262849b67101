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
from participants.client import AsyncSaga, Saga
from sagaline.agents._core import SagaTool, saga_tools

__all__ = ["tools"]


def tools(
    saga: Saga | AsyncSaga, catalogue: Catalogue | Iterable[ToolSpec]
) -> list[StructuredTool]:
    """Every tool of ``catalogue`` as a ``StructuredTool`` running as a step of ``saga``."""
    return [_structured_tool(t) for t in saga_tools(saga, catalogue)]


class _SagaStructuredTool(StructuredTool):
    """A ``StructuredTool`` that hands the model's arguments to the saga as one dict,
    with the tool-call id (a retried call is the same step, see ``_core``).

    ``BaseTool.run`` spreads the arguments as keywords of ``_run`` and then sets its
    own ``config`` and ``run_manager`` keywords over them, so a tool argument of
    either name never reached the tool (the step ran with its default)."""

    def _to_args_and_kwargs(
        self, tool_input: str | dict[str, Any], tool_call_id: str | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        _, arguments = super()._to_args_and_kwargs(tool_input, tool_call_id)
        return (arguments, tool_call_id), {}


def _structured_tool(bound: SagaTool) -> StructuredTool:
    def run(arguments: dict[str, Any], call_id: str | None) -> Any:
        return bound(arguments, call_id)

    async def arun(arguments: dict[str, Any], call_id: str | None) -> Any:
        return await bound.acall(arguments, call_id)

    return _SagaStructuredTool(
        name=bound.name,
        description=bound.description,
        args_schema=bound.parameters,  # JSON Schema, as the model sees it
        func=run,
        coroutine=arun,
        handle_tool_error=False,  # a failed step ends the run: the saga aborts
        metadata={"irreversible": bound.irreversible, "read_only": bound.read_only},
    )
