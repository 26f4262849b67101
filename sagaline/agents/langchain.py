"""LangChain adapter: a catalogue's tools as ``StructuredTool`` objects whose calls
are saga steps, usable in a LangGraph ``ToolNode`` (needs ``sagaline[langchain]``)::

    from langgraph.prebuilt import ToolNode
    from sagaline.agents import langchain as sagaline_langchain

    with client.saga("refund", principal="agent:atlas") as saga:
        tools = sagaline_langchain.tools(saga, catalogue)
        graph = build_graph(model.bind_tools(tools), ToolNode(tools))
        graph.invoke({"messages": [...]})
    # returned: the saga completes; raised: it aborts and is compensated

A step that does not commit raises out of the tool and out of the run, so the saga
aborts instead of the agent carrying on. A call the saga's client refuses before writing
anything (``CallRefused``: arguments that do not fit the tool's schema, arguments JSON
cannot hold, over the size limit, named like a ``saga.call`` option; the saga's step
limit) is no step at all: the model gets it as a tool error (a ``ToolMessage`` with
``status="error"``; nothing was called, it may call again) and the saga goes on. A saga
never started raises.

That holds with ``ToolNode``'s default ``handle_tool_errors``; set to ``True`` (or a
handler or types that catch ``Exception``), the ``ToolNode`` hands a failed step's
``SagaCallError`` (``OutcomeUnknown`` and ``ApprovalPending`` too) to the model as a
message, the run returns, and the block asks to complete a saga that is unwinding (or
has an unsettled step the model may call again: the effect twice). Keep the default,
or use a handler that re-raises ``sagaline.SagaCallError`` (docs/agents.md).

A graph that asks a person with LangGraph's ``interrupt()``, or reaches a static
breakpoint (``interrupt_before`` / ``interrupt_after``), stops, and ``graph.invoke``
*returns*: the block would complete the saga with the effects so far, and the
resumed run would meet an ended saga. Run the graph with :func:`invoke`: a run
stopped at an interrupt or a breakpoint raises :class:`Interrupted` (an
``ApprovalPending``: the saga stays open, R7); continue it in :func:`resumed`, which
ends the saga as the block would (completed, aborted, or left open at the next
interrupt)::

    try:
        with client.saga("refund", principal="agent:atlas") as saga:
            graph = build_graph(sagaline_langchain.tools(saga, catalogue), checkpointer)
            sagaline_langchain.invoke(saga, graph, {"messages": [...]}, config)
    except sagaline_langchain.Interrupted as stopped:
        answer = ask_the_person(stopped.interrupts)
    with sagaline_langchain.resumed(saga):  # or an attached saga, after a restart
        sagaline_langchain.invoke(saga, graph, Command(resume=answer), config)

A streamed run (``graph.stream``/``astream``/``astream_events``) stops the same way,
and the stream just ends: run it with :func:`stream` (or :func:`astream`,
:func:`astream_events`), which hands over the graph's chunks (events) and raises
:class:`Interrupted` after the last one when the run stopped at an interrupt or a
breakpoint (a stream left before its end is not checked)::

    for chunk in sagaline_langchain.stream(saga, graph, input, config, stream_mode="messages"):
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

from participants.catalogue import Catalogue, ToolSpec
from participants.client import AsyncSaga, CallRefused, Saga
from sagaline.agents import _core
from sagaline.agents._core import SagaTool, resumed, saga_tools

try:  # an optional extra: without it, say which one instead of "No module named ..."
    from langchain_core.tools import StructuredTool, ToolException
except ModuleNotFoundError as missing:
    raise _core.missing_extra(__name__, "LangChain", "langchain", missing) from missing

__all__ = [
    "Interrupted",
    "ainvoke",
    "astream",
    "astream_events",
    "invoke",
    "resumed",
    "stream",
    "tools",
]


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
        try:
            return bound(arguments, call_id)
        except CallRefused as exc:
            text = _core.refusal_for_model(bound.name, exc)
            if text is None:  # the saga cannot go on (never started)
                raise
            raise ToolException(text) from exc

    async def arun(arguments: dict[str, Any], call_id: str | None) -> Any:
        try:
            return await bound.acall(arguments, call_id)
        except CallRefused as exc:
            text = _core.refusal_for_model(bound.name, exc)
            if text is None:  # the saga cannot go on (never started)
                raise
            raise ToolException(text) from exc

    return _SagaStructuredTool(
        name=bound.name,
        description=bound.description,
        args_schema=bound.parameters,  # JSON Schema, as the model sees it
        func=run,
        coroutine=arun,
        # Only a call refused before anything was written (a ToolException) goes back to
        # the model, as a ToolMessage with status="error", and the saga goes on; a
        # failed step raises out of the run: the saga aborts.
        handle_tool_error=True,
        metadata={"irreversible": bound.irreversible, "read_only": bound.read_only},
    )


class Interrupted(_core.Interrupted):
    """The graph stopped at a LangGraph ``interrupt()`` or a static breakpoint
    (``interrupt_before`` / ``interrupt_after``): it waits for a person. Like any
    ``ApprovalPending`` it leaves the saga open (R7) when it leaves the saga's block;
    ``interrupts`` (and ``pending``) are the graph's ``Interrupt`` objects (value, id),
    none at a breakpoint; ``next`` the nodes the thread's state runs next (read when
    the graph has a checkpointer)."""

    def __init__(
        self,
        message: str,
        *,
        saga_id: str,
        interrupts: list[Any],
        next: tuple[str, ...] = (),
    ) -> None:
        ids = (str(getattr(i, "id", "") or "") for i in interrupts)
        super().__init__(message, saga_id=saga_id, pending=interrupts, ids=ids)
        self.interrupts = interrupts
        self.next = next


def invoke(
    saga: Saga | AsyncSaga, graph: Any, input: Any, config: Any = None, **kwargs: Any
) -> Any:
    """``graph.invoke(input, config, **kwargs)`` for a run that is ``saga``: its output,
    or :class:`Interrupted` when the run stopped at an ``interrupt()`` or a static
    breakpoint (``interrupt_before`` / ``interrupt_after``)."""
    output = graph.invoke(input, config, **kwargs)
    return _checked(saga, output, _output_interrupts(output), _state(graph, config))


async def ainvoke(
    saga: Saga | AsyncSaga, graph: Any, input: Any, config: Any = None, **kwargs: Any
) -> Any:
    """``await graph.ainvoke(...)``, as :func:`invoke`."""
    output = await graph.ainvoke(input, config, **kwargs)
    return _checked(saga, output, _output_interrupts(output), await _astate(graph, config))


def _output_interrupts(output: Any) -> list[Any]:
    interrupts = getattr(output, "interrupts", None)  # invoke(..., version="v2")
    if interrupts is None and isinstance(output, Mapping):
        interrupts = output.get("__interrupt__")
    if interrupts is None and isinstance(output, list):  # another stream_mode: its chunks
        found: dict[Any, Any] = {}
        for chunk in output:
            _note_interrupts(found, chunk)
        interrupts = list(found.values())
    return list(interrupts or ())


def _checked(saga: Saga | AsyncSaga, output: Any, interrupts: list[Any], state: Any) -> Any:
    stopped = _interrupted(saga, interrupts, state)
    if stopped is not None:
        raise stopped
    return output


def stream(
    saga: Saga | AsyncSaga, graph: Any, input: Any, config: Any = None, **kwargs: Any
) -> Iterator[Any]:
    """``graph.stream(input, config, **kwargs)`` for a run that is ``saga``: its chunks
    as they come, then, once the last one has been handed over, :class:`Interrupted`
    when the run stopped at an ``interrupt()`` (seen in the chunks, or, in a stream
    mode that does not carry interrupts, in the graph's state for the thread) or at a
    static breakpoint (the thread's state names a next node)."""
    found: dict[Any, Any] = {}

    def check() -> Interrupted | None:
        return _interrupted(saga, list(found.values()), _state(graph, config))

    chunks = graph.stream(input, config, **kwargs)
    return _core.checked_stream(chunks, check, lambda chunk: _note_interrupts(found, chunk))


def astream(
    saga: Saga | AsyncSaga, graph: Any, input: Any, config: Any = None, **kwargs: Any
) -> AsyncIterator[Any]:
    """``graph.astream(...)``, as :func:`stream` (``async for``)."""
    found: dict[Any, Any] = {}

    async def check() -> Interrupted | None:
        return _interrupted(saga, list(found.values()), await _astate(graph, config))

    chunks = graph.astream(input, config, **kwargs)
    return _core.achecked_stream(chunks, check, lambda chunk: _note_interrupts(found, chunk))


def astream_events(
    saga: Saga | AsyncSaga, graph: Any, input: Any, config: Any = None, **kwargs: Any
) -> AsyncIterator[Any]:
    """``graph.astream_events(input, config, **kwargs)`` (``version`` "v1" or "v2") for
    a run that is ``saga``, as :func:`astream`: its events as they come, then
    :class:`Interrupted` when the run stopped at an ``interrupt()`` or a breakpoint
    (read in the thread's state: needs the checkpointer, as resuming does). The
    experimental ``version="v3"`` (a run object, not events) is refused."""
    if kwargs.get("version") == "v3":
        raise ValueError(
            "sagaline.agents.langchain.astream_events takes version 'v1' or 'v2' (events);"
            " run a 'v3' stream through astream or ainvoke instead"
        )

    async def check() -> Interrupted | None:
        return _interrupted(saga, [], await _astate(graph, config))

    return _core.achecked_stream(graph.astream_events(input, config, **kwargs), check)


def _note_interrupts(found: dict[Any, Any], chunk: Any) -> None:
    """Adds the interrupts ``chunk`` carries, by id: a chunk of any stream mode
    (``(mode, data)``, ``(namespace, data)``, ``(namespace, mode, data)`` with several
    modes or subgraphs; ``version="v2"`` parts carry them as ``data`` or
    ``interrupts``)."""
    if isinstance(chunk, tuple) and chunk:
        chunk = chunk[-1]
    if not isinstance(chunk, Mapping):
        return
    interrupts = list(chunk.get("__interrupt__") or ())
    if isinstance(chunk.get("type"), str) and "data" in chunk:  # a v2 stream part
        interrupts += chunk.get("interrupts") or ()
        data = chunk["data"]
        if isinstance(data, Mapping):
            interrupts += data.get("__interrupt__") or ()
    for interrupt in interrupts:
        found.setdefault(getattr(interrupt, "id", None) or id(interrupt), interrupt)


def _thread(config: Any) -> Any:
    """The thread ``config`` runs (its latest checkpoint, not one it replays from)."""
    configurable = (config or {}).get("configurable") or {}
    if "thread_id" not in configurable:
        return None
    keys = ("thread_id", "checkpoint_ns")
    return {"configurable": {k: configurable[k] for k in keys if k in configurable}}


def _state(graph: Any, config: Any) -> Any:
    """The graph's state (a ``StateSnapshot``) for the thread ``config`` runs, or None
    without a thread or a checkpointer (then a run cannot be resumed either)."""
    thread = _thread(config)
    if thread is None or not getattr(graph, "checkpointer", None):
        return None
    return graph.get_state(thread)


async def _astate(graph: Any, config: Any) -> Any:
    thread = _thread(config)
    if thread is None or not getattr(graph, "checkpointer", None):
        return None
    return await graph.aget_state(thread)


def _interrupted(saga: Saga | AsyncSaga, interrupts: list[Any], state: Any) -> Interrupted | None:
    """The pause of a run that returned: the ``interrupt()``s its output or chunks
    showed, else those of the thread's ``state``; or, with none, a static breakpoint
    (the thread's state still names a node to run: a finished run names none)."""
    if state is not None and not interrupts:
        interrupts = list(state.interrupts)
    next_nodes = tuple(state.next) if state is not None else ()
    if not interrupts and not next_nodes:
        return None
    if interrupts:
        values = ", ".join(repr(getattr(i, "value", i)) for i in interrupts)
        what = f"{len(interrupts)} interrupt(s) ({values[:200]})"
        how = "Command(resume=...)"
    else:
        what = f"a breakpoint (next: {', '.join(next_nodes)[:200]})"
        how = "None as its input"
    message, ended = _core.paused(
        saga,
        f"the graph stopped at {what}",
        f"resume the graph with {how} in sagaline.agents.langchain.resumed(saga)",
    )
    stopped = Interrupted(message, saga_id=saga.saga_id, interrupts=interrupts, next=next_nodes)
    stopped.ended = ended
    return stopped
