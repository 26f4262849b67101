"""What every SDK adapter shares: a catalogue's tools as (name, description, JSON
Schema) and one way to run a call as a step of a saga.

An adapter binds tools to a :class:`~participants.client.Saga`; the agent run goes
inside the saga's ``with`` block, so the saga ends with the run: completed when the
run returns, aborted (the committed steps compensated) when it raises. A step that
does not commit raises its :class:`~participants.client.SagaCallError` out of the
tool, through the framework, out of the run: the agent does not keep working on a
saga that is already unwinding.

A framework may run one tool call again (a LangGraph ``RetryPolicy`` retries a node
whose tool raised ``OutcomeUnknown``; a resumed interrupt re-runs the node): a call
that carries the framework's tool-call id is the step ``TOOL@CALLID`` (the id with
``%``, ``/`` and ``#`` percent-escaped; ``TOOL@CALLID#2``,
``#3``, ... when the saga has that id for other calls: a provider that numbers its
calls afresh in every run), so running it again with the same arguments, in this process
or one that attached the saga after a restart, waits for that step's outcome again
(the coordinator does not run a step twice) instead of making the effect a second
time.

A framework run that pauses for a person (a LangGraph ``interrupt()``, an OpenAI
Agents tool with ``needs_approval``, a pydantic-ai ``DeferredToolRequests`` output)
*returns*: the block would complete the saga with the effects so far. Each adapter
runs the agent through a helper that raises its ``Interrupted`` (an
``ApprovalPending``: the saga stays open, R7) instead, and :class:`resumed` ends the
rest of the saga once the run continues."""

from __future__ import annotations

import itertools
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from participants.catalogue import Catalogue, ToolKind, ToolSpec
from participants.client import ApprovalPending, AsyncSaga, CallRefused, Saga
from participants.errors import InvalidArgumentsError
from schemas import TerminalStatus

# Options of ``saga.call``, never tool arguments (the catalogue refuses such names).
SAGA_CALL_OPTIONS = frozenset({"step_id", "depends_on", "timeout_s"})

__all__ = ["Interrupted", "MissingExtra", "SagaTool", "resumed", "saga_tools"]

T = TypeVar("T")


class MissingExtra(ModuleNotFoundError):
    """An adapter's agent framework is not installed (``pip install sagaline`` brings
    none); the message names the extra that installs it. A ``ModuleNotFoundError``,
    so code that catches ``ImportError`` still does."""


def missing_extra(
    adapter: str, framework: str, extra: str, cause: ModuleNotFoundError
) -> MissingExtra:
    """The error ``adapter`` raises when importing ``framework`` failed with ``cause``."""
    return MissingExtra(
        f"{adapter} needs {framework}, which is not installed here ({cause}):"
        f" pip install 'sagaline[{extra}]'",
        name=cause.name,
    )


@dataclass(frozen=True)
class SagaTool:
    """One catalogue tool bound to a saga: each call is the saga's next step."""

    saga: Saga
    spec: ToolSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def description(self) -> str:
        return self.spec.model_description()

    @property
    def parameters(self) -> dict[str, Any]:
        return self.spec.input_schema()

    @property
    def irreversible(self) -> bool:
        return self.spec.kind is ToolKind.IRREVERSIBLE

    @property
    def read_only(self) -> bool:
        return self.spec.read_only

    def __call__(self, args: Mapping[str, Any], call_id: str | None = None) -> Any:
        kwargs = tool_args(self.saga, self.spec, args)
        if not call_id:
            return self.saga.call(self.spec.name, **kwargs)
        for step_id in self._step_ids(call_id):
            try:
                return self.saga.call(self.spec.name, step_id=step_id, **kwargs)
            except CallRefused as refused:
                if refused.limit != DUPLICATE_STEP:
                    raise
        raise AssertionError("unreachable: the step ids never run out")

    async def acall(self, args: Mapping[str, Any], call_id: str | None = None) -> Any:
        kwargs = tool_args(self.saga, self.spec, args)
        if not call_id:
            return await self.saga.acall(self.spec.name, **kwargs)
        for step_id in self._step_ids(call_id):
            try:
                return await self.saga.acall(self.spec.name, step_id=step_id, **kwargs)
            except CallRefused as refused:
                if refused.limit != DUPLICATE_STEP:
                    raise
        raise AssertionError("unreachable: the step ids never run out")

    def _step_ids(self, call_id: str) -> Iterator[str]:
        """The steps the framework's tool call ``call_id`` may be, in the order they
        are tried: ``TOOL@CALLID``, then ``TOOL@CALLID#2``, ``#3``, ... The call is
        the first the saga has not scheduled for another call: the saga's client
        refuses (``duplicate-step``, nothing written) an id it scheduled with other
        arguments, and answers one scheduled with the same with that step's outcome.
        Ids are taken in order and never given back, so the same call run again is
        the same step, and an id reused for other arguments (a provider numbering
        its calls afresh in every run) a new one; what the client knows is the
        saga's steps on the ledger (read by ``attach()`` in a process that
        restarted), so the same holds across restarts. Nothing of the arguments is
        in the id (a digest of a short secret could be reversed). The id is the
        provider's, any text: it goes in escaped (:func:`call_id_in_step`)."""
        # No tool name has "@": no step id is made twice.
        step = f"{self.spec.name}@{call_id_in_step(call_id)}"
        yield step
        for n in itertools.count(2):  # ends: each refused id is a step of the saga
            yield f"{step}#{n}"


# What a tool-call id cannot hold as it is in a step id: "/" (derived ids use it as
# their separator: refused in step ids), "#" (what follows it numbers a reused id's
# steps), and "%", the escape itself.
_CALL_ID_ESCAPES = str.maketrans({"%": "%25", "/": "%2F", "#": "%23"})


def call_id_in_step(call_id: str) -> str:
    """``call_id`` as it goes in a step id: the same text, with ``%``, ``/`` and ``#``
    percent-escaped (``projects/p/calls/1`` -> ``projects%2Fp%2Fcalls%2F1``). Any id a
    provider sends makes a valid step id, the same id always the same one, two ids
    never the same one; an id without those characters is itself."""
    return call_id.translate(_CALL_ID_ESCAPES)


# CallRefused.limit of a step id the saga scheduled with another tool or other arguments.
DUPLICATE_STEP = "duplicate-step"
# CallRefused.limit of arguments that do not fit the tool's schema.
INVALID_ARGS = "invalid-args"
# CallRefused.limit of a saga never started (or long ended): no call of it can run.
SAGA_NOT_STARTED = "saga-not-started"
# CallRefused.limit of a call past the saga's step limit (SAGALINE_MAX_STEPS).
STEP_LIMIT = "max_steps"


def refusal_for_model(tool: str, refused: CallRefused) -> str | None:
    """The tool error the model gets for a call of ``tool`` the saga's client refused
    before writing anything (its arguments: not fitting the tool's schema, JSON cannot
    hold them, over the size limit, named like a ``saga.call`` option; the saga's step
    limit): nothing ran, nothing to undo, so the saga goes on and the model may call
    again (as in the MCP proxy). None when the refusal is no fault of the call (the saga
    was never started): then it raises out of the run."""
    if refused.limit == SAGA_NOT_STARTED:
        return None
    if refused.limit == STEP_LIMIT:  # no other arguments get past it: retrying loops
        return (
            f"error: {tool} was refused: {refused}; nothing was called. This saga can"
            " run no further tool call: stop"
        )
    return (
        f"error: {tool} was refused: {refused}; nothing was called. Call {tool} again"
        " with other arguments, or stop"
    )


def tool_args(saga: Saga, spec: ToolSpec, args: Mapping[str, Any]) -> dict[str, Any]:
    """The model's arguments as ``saga.call`` keywords; :class:`CallRefused` when one
    is named like an option of ``saga.call`` (it would steer the saga, not reach the
    tool: ``step_id`` naming an earlier step hands back that step's result), or when
    they do not fit the tool's schema (a wrong type, a required one missing, one it
    does not take): the participant would refuse them, a failed step, and the saga
    would be aborted for a call that never ran (the MCP proxy checks them too)."""
    tool = spec.name
    clash = sorted(SAGA_CALL_OPTIONS.intersection(args))
    if clash:
        raise CallRefused(
            f"{tool} got argument(s) {', '.join(clash)}, which no tool takes"
            " (they are options of saga.call); nothing was written",
            saga_id=saga.saga_id,
            step_id="",
            tool=tool,
            limit="reserved-args",
            size=len(clash),
        )
    try:
        spec.validate_args(args)  # the values as given are written, not the coerced ones
    except InvalidArgumentsError as exc:
        raise CallRefused(
            f"{exc}; nothing was written",
            saga_id=saga.saga_id,
            step_id="",
            tool=tool,
            limit=INVALID_ARGS,
            size=len(args),
        ) from exc
    return dict(args)


def saga_tools(saga: Saga | AsyncSaga, catalogue: Catalogue | Iterable[ToolSpec]) -> list[SagaTool]:
    """``catalogue``'s tools bound to ``saga``. An :class:`AsyncSaga` (from ``async
    with``) is bound through its :class:`Saga`: its ``call`` is a coroutine, which a
    framework calling a tool synchronously would hand back, never awaited, as the
    tool's result (the model told the step ran while nothing was scheduled)."""
    if isinstance(saga, AsyncSaga):
        saga = saga._saga
    specs = catalogue.values() if isinstance(catalogue, Catalogue) else catalogue
    return [SagaTool(saga, spec) for spec in specs]


class resumed:  # used as a function: ``with resumed(saga):``
    """The rest of an open saga (one left open by an adapter's ``Interrupted``, or
    attached after a restart) as a block that ends it as its first block would have:
    completed when the block returns, aborted when it raises, left open on
    ``ApprovalPending`` (and so when the run pauses again); the saga is not started
    again. ``with`` or ``async with``."""

    def __init__(self, saga: Saga | AsyncSaga) -> None:
        self.saga = saga._saga if isinstance(saga, AsyncSaga) else saga

    def __enter__(self) -> Saga:
        return self.saga

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.saga.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> AsyncSaga:
        return AsyncSaga(self.saga)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.saga.__aexit__(exc_type, exc, tb)


class Interrupted(ApprovalPending):
    """A framework run paused for a person (the base of every adapter's
    ``Interrupted``). Like any ``ApprovalPending`` it leaves the saga open (R7) when it
    leaves the saga's block. ``pending`` lists what the run waits on, as the framework
    gives it (LangGraph ``Interrupt``s, OpenAI Agents ``ToolApprovalItem``s, pydantic-ai
    ``ToolCallPart``s), so code that handles any adapter's pause need not know which;
    ``approval_id`` joins their ids with commas."""

    # The saga's terminal status when it had already ended as the pause was found (a
    # stream read to its end after the saga's block ended it): nothing to resume.
    ended: TerminalStatus | None = None

    def __init__(
        self, message: str, *, saga_id: str, pending: list[Any], ids: Iterable[str]
    ) -> None:
        super().__init__(message, saga_id=saga_id, step_id="", tool="", approval_id=",".join(ids))
        self.pending = pending


def paused(saga: Saga | AsyncSaga, what: str, how: str) -> tuple[str, TerminalStatus | None]:
    """The message of an ``Interrupted`` for a run that ``what`` (it paused), and the
    saga's terminal status when it had already ended: then the message says so (its
    block ended it before the pause was read: a stream read on after the block), not
    that the saga stays open for ``how`` (the way to resume the run). The ending is
    known once this client has the saga's terminal record (no wait); before that the
    message says what the block does with the pause."""
    view = saga._saga if isinstance(saga, AsyncSaga) else saga
    try:
        status: TerminalStatus | None = view.wait(0).status
    except TimeoutError:  # not terminal (yet), or not followed by this client
        status = None
    if status is not None:
        return (
            f"{what}, but saga {view.saga_id} had already ended ({status.value}): its"
            " block ended before the pause was read (a stream read to its end after the"
            " block), so there is nothing to resume; run the paused calls in a new saga",
            status,
        )
    return (
        f"{what}: saga {view.saga_id} stays open when this leaves its block (R7; a"
        " block that ended before the pause was read, leaving a stream early, ended the"
        f" saga there), {how}",
        None,
    )


@asynccontextmanager
async def checked_context(
    opened: AbstractAsyncContextManager[T],
    check: Callable[[T], Awaitable[Interrupted | None]],
) -> AsyncIterator[T]:
    """``async with opened`` whose block, when it ends without an error, raises what
    ``check`` finds in the opened value (a run that paused), after ``opened`` closed:
    the framework closes a finished run, and the saga's block sees ``Interrupted``."""
    async with opened as value:
        yield value
        stopped = await check(value)
    if stopped is not None:
        raise stopped


def checked_stream(
    events: Iterable[T],
    check: Callable[[], Interrupted | None],
    seen: Callable[[T], object] | None = None,
) -> Iterator[T]:
    """``events`` as they come (each shown to ``seen`` first), then, once the last has
    been handed over, what ``check`` finds (a run that paused) raised."""
    for event in events:
        if seen is not None:
            seen(event)
        yield event
    stopped = check()
    if stopped is not None:
        raise stopped


async def achecked_stream(
    events: AsyncIterable[T],
    check: Callable[[], Awaitable[Interrupted | None]],
    seen: Callable[[T], object] | None = None,
    closed: Callable[[], object] | None = None,
) -> AsyncIterator[T]:
    """:func:`checked_stream` for an async stream; ``closed`` is called when the
    stream is closed before its end (``aclose()``, or finalized once left)."""
    try:
        async for event in events:
            if seen is not None:
                seen(event)
            yield event
    except GeneratorExit:
        if closed is not None:
            closed()
        raise
    stopped = await check()
    if stopped is not None:
        raise stopped
