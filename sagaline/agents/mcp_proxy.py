"""``sagaline mcp proxy``: an MCP server in front of upstream MCP servers, where every
write is a saga step and every undo is an upstream call.

The agent connects to the proxy (stdio) as to any MCP server. The proxy

* connects to the upstream servers of the declaration (stdio or streamable HTTP),
  lists their tools and refuses to start when the declaration cannot work
  (:mod:`sagaline.agents.declaration`);
* serves the declared tools as a participant (:class:`ParticipantRuntime`: intent on
  the ledger before the upstream call, a journal so no command runs twice,
  compensations and lookups by calling upstream tools);
* re-lists the tools to the agent with MCP annotations (``readOnlyHint``,
  ``destructiveHint``) and the reversibility in the description, plus
  ``saga_commit``, ``saga_abort`` and ``saga_check_plan``, and the receipt as the
  resource ``sagaline://saga/receipt``;
* runs one saga per MCP session: the first write starts it, a failed write aborts it
  (the coordinator has the committed steps compensated, in reverse order), and
  ``saga_commit`` / ``saga_abort`` end it. The open saga is remembered in the state
  directory, so a proxy restarted mid-saga continues it;
* asks for approval of IRREVERSIBLE calls through MCP elicitation when the client
  supports it; otherwise it answers "awaiting approval" and leaves the saga open.

Read-only tools are passed straight through: there is nothing to undo.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import inspect
import json
import keyword
import logging
import os
import re
import sqlite3
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import anyio
import pydantic

from participants.catalogue import Catalogue, wrap
from participants.client import (
    ApprovalPending,
    CallRefused,
    ClientStopped,
    InvalidSagaId,
    OutcomeUnknown,
    ResultTooLarge,
    Saga,
    SagaCallError,
    SagaClient,
    SagaHistoryUnreadable,
    SagaParked,
    SagaUnwinding,
    StepEscalated,
)
from participants.context import current_call
from participants.declarations import (
    BusinessRejection,
    CompensationContext,
    LookupResult,
    TransientError,
    compensable,
    tool,
)
from participants.errors import CatalogueError, InvalidArgumentsError
from participants.plan import check_plan
from participants.readiness import CoordinatorNotRunning
from participants.runtime import JournalUnusable, ParticipantRuntime
from sagaline.agents._core import SAGA_CALL_OPTIONS, STEP_LIMIT, missing_extra
from sagaline.agents.declaration import (
    Declaration,
    DeclarationError,
    ToolMapping,
    UpstreamSpec,
    UpstreamTool,
    build_args,
    check,
    load_declaration,
)
from sagaline.kafka import (
    DeliveryFailed,
    InstanceClaimed,
    KafkaError,
    KafkaException,
    TopicMissing,
    TopicSetupError,
)
from schemas.models import Reversibility, SagaOutcome
from schemas.settings import Settings

try:  # an optional extra: without it, say which one instead of "No module named 'mcp'"
    import mcp_types as types
    from mcp import ClientSession, StdioServerParameters, stdio_client
    from mcp.server.context import ServerRequestContext
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server
except ModuleNotFoundError as missing:
    raise missing_extra(__name__, "the MCP SDK", "mcp", missing) from missing

log = logging.getLogger("sagaline.mcp")

RECEIPT_URI = "sagaline://saga/receipt"
SAGA_TOOLS = ("saga_commit", "saga_abort", "saga_check_plan")
RECEIPT_PENDING = "RECEIPT_PENDING"  # the saga was ended; its receipt is not in yet
END_NOT_ACKNOWLEDGED = "END_NOT_ACKNOWLEDGED"  # the end may or may not be on the ledger
SAGA_NOT_STARTED = "saga-not-started"  # CallRefused.limit: the client does not know the saga

__all__ = ["RECEIPT_URI", "McpProxy", "UpstreamOutcomeUnknown", "UpstreamRejected", "main"]


class UpstreamRejected(BusinessRejection):
    """The upstream tool answered with ``isError``: it said no, retrying will not help."""


class UpstreamTransient(TransientError):
    """A forward call's error answer containing one of the tool's declared
    ``transient:`` texts: retried with the same idempotency key under the tool's retry
    policy, not a business rejection."""


class UpstreamUnavailable(RuntimeError):
    """An upstream server could not be started or reached at start-up."""


class UpstreamLookupFailed(RuntimeError):
    """A lookup's upstream call answered with an error that is not its declared "not
    found" (``not_found:``): it could not tell whether the operation happened (R11)."""


class UpstreamCompensationFailed(TransientError):
    """A compensation's upstream call answered with an error: retried by the
    coordinator under the compensation's retry policy, then handed to a person (R8)."""


class ProxyAlreadyRunning(RuntimeError):
    """Another proxy serves the same participant with the same state directory: the
    two would overwrite each other's open saga in ``mcp-session.json``."""


class ProxyStartFailed(RuntimeError):
    """The participant runtime or the saga client could not start on the broker (it
    did not answer, refused this client, or its topics are not as configured)."""


class UpstreamDown(ConnectionError):
    """The upstream's connection was lost and connecting again failed: the call was
    not sent (nothing was called), so its outcome is known; a plain failure, which the
    runtime retries (each retry tries to connect again) and then fails."""


class UpstreamOutcomeUnknown(TimeoutError):
    """A forward call whose transport failed (the upstream died or its connection
    dropped): it may have acted before it went, so the outcome is unknown (R11), as for
    a call past its deadline; the participant runtime takes a tool's TimeoutError for
    one and has it settled by the lookup (or a person), never as a plain failure."""


# ------------------------------------------------------------------- upstreams


class Upstreams:
    """Sessions with the upstream servers, owned by the proxy's event loop. The
    participant runtime's threads call through :meth:`call_sync`.

    Each connection lives in a task of its own (its transport's task group is entered
    and left there): an upstream that goes away ends that connection only, not the
    task serving the agent, and a connection found lost (a call answered "Connection
    closed", the transport failed, an HTTP server forgot the session) is replaced by a
    new one on the next call to that upstream."""

    def __init__(self, declaration: Declaration) -> None:
        self.declaration = declaration
        self.sessions: dict[str, ClientSession] = {}
        self.tools: list[UpstreamTool] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.opening: str | None = None  # the upstream being connected to at start-up
        # Forward calls still running upstream, by idempotency key: until one ends its
        # effect may still land, so a lookup of that key cannot say "not found" (R11).
        self._running: dict[str, int] = {}
        self._running_lock = threading.Lock()
        # Per upstream: its connection's task and what ends it; the lost ones.
        self._connections: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}
        self._lost: dict[str, str] = {}  # upstream -> why its connection is taken for lost
        self._reconnecting: dict[str, asyncio.Lock] = {}

    async def open(self, stack: AsyncExitStack) -> None:
        """Connect to every upstream and list its tools; :class:`UpstreamUnavailable`
        names the one that cannot be started or reached, and why."""
        self.loop = asyncio.get_running_loop()
        stack.push_async_callback(self.close)
        for name, spec in self.declaration.upstreams.items():
            self.opening = name
            try:
                # Bounded: a server that starts but never answers (stuck, or no MCP
                # server) would hold the proxy, and the client that started it, for good.
                async with asyncio.timeout(CONNECT_WAIT_S):
                    session = await self._connect(name, spec)
                    await self._list(name, session)
            except TimeoutError as exc:
                raise self.unavailable(
                    TimeoutError(
                        f"it did not answer initialize and list_tools within {CONNECT_WAIT_S:g} s"
                    )
                ) from exc
            except Exception as exc:
                raise self.unavailable(exc) from exc
        self.opening = None

    def unavailable(self, exc: BaseException) -> UpstreamUnavailable:
        """The upstream being opened cannot be reached, because of ``exc`` (its first
        error, when the SDK's task groups wrapped it in exception groups)."""
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        name = self.opening or "?"
        spec = self.declaration.upstreams.get(name)
        where = f" ({_shown(spec)})" if spec is not None else ""
        return UpstreamUnavailable(
            f"upstream {name!r}{where} cannot be reached: {type(exc).__name__}: {exc}"
        )

    async def close(self) -> None:
        """End every connection (at shutdown)."""
        connections = list(self._connections.values())
        self._connections.clear()
        for _task, done in connections:
            done.set()
        for task, _done in connections:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 30)

    async def _connect(self, name: str, spec: UpstreamSpec) -> ClientSession:
        """A new connection to ``name``, in a task of its own, made its session; the
        connection it replaces (if any) is ended."""
        opened: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
        done = asyncio.Event()
        task = asyncio.ensure_future(self._hold(name, spec, opened, done))
        try:
            session = await asyncio.shield(opened)
        except BaseException:
            done.set()
            if not opened.done():
                task.cancel()  # still opening (given up on): it must not linger
            raise
        old = self._connections.get(name)
        self._connections[name] = (task, done)
        self.sessions[name] = session
        self._lost.pop(name, None)
        if old is not None:
            old[1].set()
        return session

    async def _hold(
        self,
        name: str,
        spec: UpstreamSpec,
        opened: asyncio.Future[ClientSession],
        done: asyncio.Event,
    ) -> None:
        """One connection's task: open it, hand its session over, keep it until told
        to end it; if it ends on its own (its transport failed), it is lost."""
        try:
            async with AsyncExitStack() as stack:
                session = await self._open(stack, spec)
                opened.set_result(session)
                await done.wait()
        except BaseException as exc:  # this connection's end; nobody else's error
            if not opened.done():
                failure = exc if isinstance(exc, Exception) else ConnectionError(repr(exc))
                opened.set_exception(failure)
                return
            while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
                exc = exc.exceptions[0]
            if not done.is_set():
                why = f"its connection failed ({type(exc).__name__}: {exc})"
                self._mark_lost(name, opened.result(), why)

    async def _open(self, stack: AsyncExitStack, spec: UpstreamSpec) -> ClientSession:
        if spec.url:
            from mcp.client.streamable_http import streamable_http_client

            streams = await stack.enter_async_context(streamable_http_client(spec.url))
            read, write = streams[0], streams[1]
        else:
            assert spec.command is not None
            params = StdioServerParameters(
                command=spec.command,
                args=list(spec.args),
                env={**_upstream_environment(), **(spec.env or {})},
                cwd=spec.cwd,
            )
            read, write = await stack.enter_async_context(stdio_client(params))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        return session

    async def _list(self, name: str, session: ClientSession) -> None:
        listed = await session.list_tools()
        for t in listed.tools:
            hint = t.annotations.read_only_hint if t.annotations else None
            self.tools.append(
                UpstreamTool(
                    name=t.name,
                    upstream=name,
                    input_schema=t.input_schema,
                    output_schema=t.output_schema,
                    description=t.description or "",
                    read_only_hint=hint,
                )
            )

    def _mark_lost(self, name: str, session: ClientSession, why: str) -> None:
        if self.sessions.get(name) is session and name not in self._lost:
            self._lost[name] = why
            log.warning("upstream %r: %s; the next call connects again", name, why)

    async def _session(self, upstream: str) -> ClientSession:
        """The upstream's session; a lost one is replaced first. :class:`UpstreamDown`
        when that fails: the call is not sent."""
        if upstream not in self._lost:
            return self.sessions[upstream]
        lock = self._reconnecting.setdefault(upstream, asyncio.Lock())
        async with lock:
            why = self._lost.get(upstream)
            if why is None:  # replaced while this call waited
                return self.sessions[upstream]
            spec = self.declaration.upstreams[upstream]
            try:
                session = await asyncio.wait_for(self._connect(upstream, spec), RECONNECT_WAIT_S)
            except Exception as exc:
                while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
                    exc = exc.exceptions[0]  # type: ignore[assignment]
                raise UpstreamDown(
                    f"upstream {upstream!r} ({_shown(spec)}) is down: {why}, and connecting"
                    f" again failed ({type(exc).__name__}: {exc}); nothing was called"
                ) from exc
            log.info("upstream %r: connected again", upstream)
            return session

    def find(self, upstream: str, name: str) -> UpstreamTool:
        return next(t for t in self.tools if t.upstream == upstream and t.name == name)

    async def call(self, upstream: str, name: str, args: Mapping[str, Any]) -> Any:
        session = await self._session(upstream)
        try:
            result = await session.call_tool(name, dict(args))
        except Exception as exc:  # transport or protocol: the call may be retried
            if _connection_lost(exc):
                self._mark_lost(upstream, session, f"its connection was lost ({exc})")
            raise ConnectionError(f"upstream {upstream!r} call {name} failed: {exc}") from exc
        value = _result_value(result)
        if result.is_error:
            raise UpstreamRejected(f"{name}: {value}")
        return value

    def call_sync(
        self,
        upstream: str,
        name: str,
        args: Mapping[str, Any],
        timeout_s: float,
        *,
        key: str | None = None,
    ) -> Any:
        """The call on the proxy's loop, waited for up to ``timeout_s``. With ``key`` it
        counts as running for that idempotency key until the upstream call itself
        ends, which may be after this wait gave up (:meth:`running`)."""
        assert self.loop is not None
        if key is None:
            future = asyncio.run_coroutine_threadsafe(self.call(upstream, name, args), self.loop)
            return future.result(timeout_s)
        with self._running_lock:
            self._running[key] = self._running.get(key, 0) + 1
        try:
            future = asyncio.run_coroutine_threadsafe(self.call(upstream, name, args), self.loop)
        except BaseException:
            self._ended(key)
            raise
        future.add_done_callback(lambda _: self._ended(key))
        return future.result(timeout_s)

    def _ended(self, key: str) -> None:
        with self._running_lock:
            left = self._running.pop(key, 1) - 1
            if left:
                self._running[key] = left

    def running(self, key: str) -> bool:
        """Whether a call made with idempotency key ``key`` is still running upstream."""
        with self._running_lock:
            return key in self._running


RECONNECT_WAIT_S = 60.0
"""How long a call waits for a lost upstream to be connected again."""

_PROBE_S = 0.01
"""How long a write looks for the outcome of a step awaiting approval: the records the
client already has say it; no more is waited for."""

CONNECT_WAIT_S = 60.0
"""How long start-up waits for an upstream to answer initialize and list its tools."""


def _connection_lost(exc: BaseException) -> bool:
    """Whether a call's error says its connection is gone (not that the call was bad):
    the SDK's "Connection closed", an HTTP server that forgot the session (it was
    restarted), a stream or socket that broke."""
    from mcp.shared.exceptions import MCPError

    if isinstance(exc, MCPError):
        return exc.error.code == types.CONNECTION_CLOSED or "Session terminated" in str(exc)
    return isinstance(exc, (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError))


def _shown(spec: UpstreamSpec) -> str:
    """The upstream as said in an error: its command, or its URL without user, password
    or query (arguments and queries may carry tokens)."""
    if not spec.url:
        return spec.command or ""
    from urllib.parse import urlsplit

    url = urlsplit(spec.url)
    port = f":{url.port}" if url.port else ""
    return f"{url.scheme}://{url.hostname}{port}{url.path}"


def _upstream_environment() -> dict[str, str]:
    """The proxy's environment for a stdio upstream, minus Sagaline's own settings:
    they carry its keys (SAGALINE_HMAC_KEY signs ledger records, approvals included;
    SAGALINE_SECRET_KEY opens sealed arguments; SAGALINE_KAFKA_* holds broker
    passwords), which are no upstream's business. The declaration's env: adds any."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("SAGALINE_")}


def _result_value(result: types.CallToolResult) -> Any:
    if result.structured_content is not None:
        return result.structured_content
    texts = [c.text for c in result.content if isinstance(c, types.TextContent)]
    text = "\n".join(texts)
    try:
        return json.loads(text)
    except ValueError:
        return text


# -------------------------------------------------------------------- catalogue

_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list[Any],
    "object": dict[str, Any],
}


def build_catalogue(declaration: Declaration, upstreams: Upstreams) -> Catalogue:
    """One participant whose tools call upstream, checked by ``wrap()`` like any other."""
    members: dict[str, Any] = {}
    for name, mapping in declaration.tools.items():
        upstream = declaration.upstream_of(name)
        listed = upstreams.find(upstream, name)
        forward = _forward(upstreams, upstream, listed, mapping)
        lookup_name = None
        if mapping.lookup is not None:
            lookup_name = f"lookup_{name}"
            members[lookup_name] = staticmethod(_lookup(upstreams, upstream, mapping))
        forward = tool(
            description=listed.description or name,
            read_only=mapping.read_only,
            pivot=mapping.pivot,
            lookup=lookup_name,
            resources=mapping.resources,
            deadline=mapping.deadline,
            owner=mapping.owner,
            secret_fields=_secret_fields(listed, mapping),
        )(forward)
        if not mapping.read_only:
            undo = _compensation(upstreams, upstream, mapping) if mapping.compensation else None
            forward = compensable(by=undo, reversibility=mapping.reversibility)(forward)
        members[name] = staticmethod(forward)
    holder = type("McpUpstreamTools", (), members)()
    return wrap(holder, name=declaration.participant)


def _secret_fields(listed: UpstreamTool, mapping: ToolMapping) -> tuple[str, ...]:
    """The arguments the upstream lists as secrets (JSON Schema ``writeOnly`` or
    ``format: password``, what pydantic's ``SecretStr`` gives): sealed or redacted on
    the ledger like any secret argument, never written there in clear."""
    defs = listed.input_schema.get("$defs") or listed.input_schema.get("definitions") or {}
    paths: list[str] = []
    for arg, schema in listed.properties.items():
        if arg != mapping.idempotency_arg:
            _secret_paths(schema, defs, arg, paths, set())
    return tuple(dict.fromkeys(paths))


def _secret_paths(schema: Any, defs: Any, path: str, out: list[str], seen: set[str]) -> None:
    """The paths of the secrets in an argument's schema: itself, an optional one
    (``anyOf`` [password, null], what ``SecretStr | None`` gives), or a field of an
    object or an item of a list (through ``$defs``, as a pydantic model lists it)."""
    if not isinstance(schema, Mapping):
        return
    if schema.get("writeOnly") is True or schema.get("format") == "password":
        out.append(path)
        return
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen and isinstance(defs, Mapping):
        _secret_paths(defs.get(ref.rsplit("/", 1)[-1]), defs, path, out, seen | {ref})
    for key in ("anyOf", "oneOf", "allOf"):
        alternatives = schema.get(key)
        for alternative in alternatives if isinstance(alternatives, list) else ():
            _secret_paths(alternative, defs, path, out, seen)
    props = schema.get("properties")
    for name, sub in props.items() if isinstance(props, Mapping) else ():
        _secret_paths(sub, defs, f"{path}.{name}", out, seen)
    for key in ("items", "additionalProperties"):
        _secret_paths(schema.get(key), defs, f"{path}.*", out, seen)


def _forward(
    upstreams: Upstreams, upstream: str, listed: UpstreamTool, mapping: ToolMapping
) -> Callable[..., Any]:
    required = set(listed.required)
    params = []
    annotations: dict[str, Any] = {}
    upstream_name: dict[str, str] = {}  # Python parameter -> the upstream's argument
    taken = set(listed.properties)
    for arg, schema in listed.properties.items():
        if arg == mapping.idempotency_arg:
            continue  # filled by the proxy, never by the model
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        hint = _JSON_TYPES.get(kind, Any) if isinstance(kind, str) else Any
        param = _parameter_name(arg, taken)
        if param != arg:  # ``from``, ``reply-to``: served under the upstream's name
            taken.add(param)
            hint = Annotated[hint, pydantic.Field(alias=arg)]
        upstream_name[param] = arg
        annotations[param] = hint
        # Not given: left out (the upstream applies its own default); an explicit null
        # is the agent's (forwarded when the schema allows null, else refused).
        default = inspect.Parameter.empty if arg in required else _not_given()
        params.append(inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, default=default))

    def call_upstream(**kwargs: Any) -> Any:
        named = {upstream_name.get(k, k): v for k, v in kwargs.items()}
        args = {k: v for k, v in named.items() if v is not _OMITTED}
        key = current_call().idempotency_key
        if mapping.idempotency_arg:
            args[mapping.idempotency_arg] = key
        try:
            return upstreams.call_sync(upstream, listed.name, args, _wait_s(mapping), key=key)
        except UpstreamDown:
            raise  # not sent: it did not happen, a plain failure
        except UpstreamRejected as exc:
            if any(text in str(exc) for text in mapping.transient):
                raise UpstreamTransient(str(exc)) from exc
            raise  # the upstream said no: a business rejection (R9)
        except ConnectionError as exc:  # a transient failure would be retried, then
            # taken for a step that never ran: its effect neither undone nor named
            raise UpstreamOutcomeUnknown(f"{exc}; the outcome is unknown") from exc

    call_upstream.__name__ = listed.name
    call_upstream.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call_upstream.__annotations__ = annotations
    return call_upstream


class _Omitted:
    """An optional upstream argument the call did not give."""

    def __repr__(self) -> str:
        return "<not given>"


_OMITTED = _Omitted()


def _not_given() -> Any:
    """The default of an optional argument: a factory, so the catalogue's JSON schema
    has no default to show (the upstream's own applies) and pydantic does not check it."""
    return pydantic.Field(default_factory=lambda: _OMITTED)


def _parameter_name(arg: str, taken: set[str]) -> str:
    """``arg`` as a Python parameter name: itself when it is one, else a name made
    from it (``from`` -> ``from_``, ``reply-to`` -> ``reply_to``) that no other
    argument has; the argument keeps the upstream's name as its alias."""
    if arg.isidentifier() and not keyword.iskeyword(arg):
        return arg
    name = re.sub(r"\W", "_", arg)
    if not name.isidentifier():  # starts with a digit, or empty
        name = f"arg_{name}"
    name = f"{name}_" if keyword.iskeyword(name) else name
    while name in taken:
        name = f"{name}_"
    return name


def _wait_s(mapping: ToolMapping) -> float:
    """How long a thread of the runtime waits for an upstream call of ``mapping``'s
    tool: the runtime gives the call, its compensation and its lookup the tool's
    declared deadline (then settles the command itself), so wait a little past it."""
    return mapping.deadline + 5


def _compensation(
    upstreams: Upstreams, upstream: str, mapping: ToolMapping
) -> Callable[[CompensationContext], Any]:
    call = mapping.compensation
    assert call is not None

    def undo(ctx: CompensationContext) -> Any:
        args = build_args(call.args, ctx)
        try:
            return upstreams.call_sync(upstream, call.tool, args, _wait_s(mapping))
        except UpstreamRejected as exc:
            # An error answer cannot say whether it would pass later (a rate limit, a
            # failure of the upstream's own): retried with backoff, then a person (R8),
            # not given up at the first one.
            raise UpstreamCompensationFailed(str(exc)) from exc

    undo.__name__ = call.tool
    return undo


def _lookup(
    upstreams: Upstreams, upstream: str, mapping: ToolMapping
) -> Callable[[str], LookupResult | None]:
    call = mapping.lookup
    assert call is not None

    def find(idempotency_key: str) -> LookupResult | None:
        # The proxy's own call with this key still runs (it overran its deadline, so
        # the outcome is unknown): the upstream may not have acted yet and answer "not
        # found" while the effect still lands. Pending: reconciliation asks again.
        if upstreams.running(idempotency_key):
            return LookupResult.pending()
        ctx = CompensationContext("", mapping.name, {}, None, idempotency_key)
        args = build_args(call.args, ctx)
        try:
            found = upstreams.call_sync(upstream, call.tool, args, _wait_s(mapping))
        except UpstreamRejected as exc:
            # "Not found" only when the error says so (the declared not_found text): a
            # rate limit or a failure of the upstream's own cannot tell (R11). Raised,
            # the runtime reports PENDING: asked again, then a person.
            if call.not_found is None or call.not_found not in str(exc):
                raise UpstreamLookupFailed(
                    f"lookup {call.tool} of {idempotency_key} could not tell: {exc}"
                    + (
                        f" (not the declared not_found {call.not_found!r})"
                        if call.not_found
                        else " (no not_found: declared for its error answers)"
                    )
                ) from exc
            found = None  # the upstream says it has no such operation
        if isinstance(found, str) and call.not_found is not None and call.not_found in found:
            found = None  # said in a text answer, not an error: "not found" all the same
        if found not in (None, "", {}, []):
            return LookupResult.committed(found)
        return LookupResult.pending() if upstreams.running(idempotency_key) else None

    find.__annotations__ = {"idempotency_key": str, "return": LookupResult | None}
    return find


# ----------------------------------------------------------------------- sagas


@dataclass
class _Session:
    """The saga of the MCP session, remembered on disk so a restart continues it."""

    path: Path
    saga: Saga | None = None
    next_step: int = 1
    last_receipt: str | None = None
    # The end asked for the saga of last_receipt, when known: an ESCALATED receipt is
    # that of an abort (some effect not undone) or of a commit.
    last_requested: SagaOutcome | None = None
    # The end asked for but not acknowledged by the broker: it may be on the ledger, so
    # the saga is kept until an end is acknowledged, and a retry asks for this outcome.
    ending: SagaOutcome | None = None
    ending_reason: str = ""
    # IRREVERSIBLE steps answered "awaiting approval" and not known done since: each
    # step follows the one before, so a write now would wait behind them.
    awaiting: list[str] = field(default_factory=list)

    def remember_awaiting(self, step_id: str) -> None:
        """Remember ``step_id`` as waiting (for its approval, or for a coordinator), on
        disk too: the next write would wait behind it, so it is checked first."""
        self.awaiting.append(step_id)
        self.save()

    def save(self) -> None:
        if self.saga is None:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        saved: dict[str, Any] = {"saga_id": self.saga.saga_id, "next_step": self.next_step}
        if self.ending is not None:
            saved.update(ending=self.ending.value, ending_reason=self.ending_reason)
        if self.awaiting:
            saved["awaiting"] = self.awaiting
        # On disk before it replaces the last one, and the rename too: after a crash
        # of the machine an unsynced file may be empty or torn, its saga's id lost.
        with tmp.open("w") as out:
            out.write(json.dumps(saved))
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


@dataclass
class _Asking:
    """A write asking its person through the client for the approval of its
    IRREVERSIBLE step (holding the step lock, up to ``approval_wait_s``)."""

    saga: Saga
    step_id: str
    # Set by saga_abort, which goes ahead without waiting for the answer: the question
    # is withdrawn and any answer that comes is not recorded.
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class _AbortedWhileAsking:
    """What :meth:`McpProxy._approval` gives when saga_abort came while it asked."""


_ABORTED_WHILE_ASKING = _AbortedWhileAsking()


SESSION_LOCK = "mcp-session.lock"


def _claim_state(directory: Path, participant: str) -> int:
    """Hold the lock of ``directory``'s session file for this process's lifetime (the
    descriptor returned; closing it, or the process ending however it ends, lets go,
    so a restarted proxy is never held up by its dead predecessor).
    :class:`ProxyAlreadyRunning` when another live proxy holds it;
    :class:`ProxyStartFailed` when the directory cannot be made or written."""
    import fcntl

    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / SESSION_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by upstreams
    except OSError as exc:  # a file there, a read-only volume: one line, as `participant run`
        raise ProxyStartFailed(
            f"cannot use {directory} (SAGALINE_STATE_DIR): {exc.strerror or exc}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ProxyAlreadyRunning(
            f"a proxy for participant {participant!r} is already running (pid {holder})"
            f" with the state directory {directory}: the two would overwrite each other's"
            f" open saga in {directory / 'mcp-session.json'}. Stop it, or give this one"
            " its own participant: (another SAGALINE_STATE_DIR is no way out: its"
            " participant runtime would fence this one's, as the same static group member)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _read_saved(path: Path) -> dict[str, Any] | None:
    """The saga remembered in ``path``; None when the file is unreadable (torn, or not
    the proxy's): it is set aside for a person with a warning, not raised at every
    call and every start (a saga it named, if any, is not continued here)."""
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("saga_id"), str):
            raise ValueError("no saga_id")
        int(saved.get("next_step", 1))
        if saved.get("ending"):
            SagaOutcome(saved["ending"])
        awaiting = saved.get("awaiting", [])
        if not isinstance(awaiting, list) or not all(isinstance(a, str) for a in awaiting):
            raise ValueError("awaiting is not a list of step ids")
        return saved
    except (ValueError, TypeError) as exc:
        aside = path.with_name(path.name + ".unreadable")
        path.replace(aside)
        log.warning(
            "the saga remembered in %s cannot be read (%s): set aside as %s; a saga it"
            " named is not continued by this proxy (`sagaline dashboard` lists it)",
            path,
            exc,
            aside,
        )
        return None


class McpProxy:
    """The MCP server side: tools, saga tools, the receipt resource."""

    def __init__(
        self,
        declaration: Declaration,
        upstreams: Upstreams,
        catalogue: Catalogue,
        client: SagaClient,
        settings: Settings,
        *,
        approval_wait_s: float = 600.0,
        receipt_wait_s: float = 300.0,
    ) -> None:
        self.declaration = declaration
        self.upstreams = upstreams
        self.catalogue = catalogue
        self.client = client
        self.settings = settings
        self.approval_wait_s = approval_wait_s
        self.receipt_wait_s = receipt_wait_s
        state = settings.state_dir / declaration.participant / "mcp-session.json"
        self.session = _Session(state)
        # Held by writes and ends (one saga, one step at a time), for as long as a step
        # waits (its approval asked through the client, up to approval_wait_s). Reads
        # (read-only tools, the plan check, the receipt) change no saga: never behind it.
        self._lock = asyncio.Lock()
        # The one resume, begun by whoever asks first and awaited by every request
        # until it is done: not the asking request's, so that one cancelled meanwhile
        # (its thread still reading the ledger) does not let the next begin another.
        self._resuming: asyncio.Future[None] | None = None
        self._resumed = False
        self._remembered: str | None = None  # the id of the saga on disk, once read
        # The write asking its person through the client, if one is: saga_commit and
        # saga_abort do not wait behind it (see _call_tool).
        self._asking: _Asking | None = None
        # The saga a saga_abort ended beside such a write: the calls queued behind that
        # write for it were sent before the abort, so they do not run after it.
        self._aborted_ahead: Saga | None = None

    async def _ensure_resumed(self) -> None:
        """Continue the saga remembered on disk, once, before the first request: its
        ledger read is blocking, so it runs off the event loop the upstreams use. One
        that failed is begun again by the next request."""
        if self._resumed:
            return
        if self._resuming is None or self._resuming.cancelled():  # (its loop closed)
            self._resuming = asyncio.ensure_future(asyncio.to_thread(self._resume))
        resuming = self._resuming
        try:
            await asyncio.shield(resuming)
        except BaseException:
            if resuming.done() and self._resuming is resuming:  # failed: tried again
                self._resuming = None
            raise
        self._resumed = True

    def _resume(self) -> None:
        if not self.session.path.exists():
            return
        saved = _read_saved(self.session.path)
        if saved is None:
            return
        self._remembered = saved["saga_id"]
        # attach() reads the saga's records from the ledger (a scan of its partition):
        # the one read tells both what to continue and whether it already ended.
        try:
            saga = self._saga(saved["saga_id"]).attach()
        except InvalidSagaId as exc:  # not on this ledger: nothing to continue or end
            log.warning("forgetting the saga remembered on disk: %s", exc)
            self.session.path.unlink(missing_ok=True)
            return
        try:
            receipt = saga.wait(0)  # its terminal record, if that read found one
        except TimeoutError:
            receipt = None
        if receipt is not None:  # it ended while the proxy was down: nothing to continue
            self.session.last_receipt = receipt.model_dump_json(indent=2)
            if saved.get("ending"):
                self.session.last_requested = SagaOutcome(saved["ending"])
            self.session.path.unlink(missing_ok=True)
            log.info("saga %s ended while the proxy was down", saved["saga_id"])
            return
        self.session.saga = saga
        self.session.next_step = int(saved.get("next_step", 1))
        self.session.awaiting = list(saved.get("awaiting", []))
        if saved.get("ending"):
            self.session.ending = SagaOutcome(saved["ending"])
            self.session.ending_reason = str(saved.get("ending_reason", ""))
        log.info("continuing saga %s after a restart", saved["saga_id"])

    def _saga(self, saga_id: str | None = None) -> Saga:
        return self.client.saga(
            self.declaration.workflow, self.declaration.principal, saga_id=saga_id
        )

    def server(self) -> Server[Any]:
        return Server(
            "sagaline-mcp-proxy",
            instructions="Every write tool is a saga step: a failed call undoes the earlier"
            " ones. Call saga_commit when the task is done, saga_abort to undo it all.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_read_resource=self._read_resource,
        )

    # -------------------------------------------------------------- listing

    def tool_list(self) -> list[types.Tool]:
        internal = self.declaration.internal_tools()
        tools = []
        for name, mapping in self.declaration.tools.items():
            if name in internal:
                continue
            listed = self.upstreams.find(self.declaration.upstream_of(name), name)
            schema = dict(listed.input_schema)
            irreversible = (
                not mapping.read_only and mapping.reversibility is Reversibility.IRREVERSIBLE
            )
            if mapping.idempotency_arg:
                schema["properties"] = {
                    k: v for k, v in listed.properties.items() if k != mapping.idempotency_arg
                }
                schema["required"] = [r for r in listed.required if r != mapping.idempotency_arg]
            tools.append(
                types.Tool(
                    name=name,
                    description=f"{listed.description} {_recovery_note(self.catalogue, name)}",
                    input_schema=schema,
                    # An IRREVERSIBLE call may answer "awaiting approval" instead.
                    output_schema=None if irreversible else listed.output_schema,
                    annotations=types.ToolAnnotations(
                        read_only_hint=mapping.read_only,
                        destructive_hint=irreversible,
                    ),
                )
            )
        tools += _saga_tools()
        return tools

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tool_list())

    async def _list_resources(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(
            resources=[
                types.Resource(
                    uri=RECEIPT_URI,
                    name="saga receipt",
                    description="The receipt of this session's saga: every effect and what"
                    " became of it (the ledger so far while the saga is open)",
                    mime_type="application/json",
                )
            ]
        )

    async def _read_resource(
        self, ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        if params.uri != RECEIPT_URI:
            # The client's mistake, said as such (an error of another type would be
            # logged as the server's crash and answered with code 0).
            from mcp.shared.exceptions import MCPError

            raise MCPError(
                code=types.INVALID_PARAMS,
                message=f"unknown resource {params.uri!r}; this proxy serves {RECEIPT_URI}",
                data={"uri": params.uri},
            )
        try:  # not under the step lock: a read, served while a write waits
            await self._ensure_resumed()
        except (CoordinatorNotRunning, SagaHistoryUnreadable) as exc:
            # Said in the resource (no coordinator; records of a newer version:
            # upgrade), as the calls say it; retried at the next read.
            text = json.dumps(
                {
                    "saga_id": self._remembered,
                    "status": "CANNOT_CONTINUE",
                    "note": f"the saga this session had open cannot be continued yet: {exc}",
                }
            )
            return types.ReadResourceResult(
                contents=[
                    types.TextResourceContents(
                        uri=RECEIPT_URI, text=text, mime_type="application/json"
                    )
                ]
            )
        if self.session.last_receipt is not None and self.session.saga is None:
            text = self.session.last_receipt
        elif self.session.saga is not None:
            text = json.dumps(
                {
                    "saga_id": self.session.saga.saga_id,
                    "status": "OPEN",
                    "steps": sorted(self.session.saga.results),
                }
            )
        else:
            text = json.dumps({"status": "NO_SAGA", "note": "no write call yet"})
        return types.ReadResourceResult(
            contents=[
                types.TextResourceContents(uri=RECEIPT_URI, text=text, mime_type="application/json")
            ]
        )

    # -------------------------------------------------------------- calling

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        args = dict(params.arguments or {})
        if params.name == "saga_check_plan":
            return self._check_plan(args)
        mapping = self.declaration.tools.get(params.name)
        if params.name not in ("saga_commit", "saga_abort") and (
            mapping is None or params.name in self.declaration.internal_tools()
        ):
            return _text(_unknown_tool(self.declaration, params.name), error=True)
        if mapping is not None and mapping.read_only:
            # Not a step, so not under the step lock: served while a write waits (for
            # its approval, its outcome); the session's saga plays no part in it.
            return await self._read_only(params.name, mapping, args)
        asking = self._asking
        if (
            params.name in ("saga_commit", "saga_abort")
            and asking is not None
            and not asking.aborted.is_set()
            and asking.saga is self.session.saga
        ):
            # Not behind the step lock: the write holding it waits for a person, for
            # up to approval_wait_s.
            return await self._end_while_asking(asking, params.name, args)
        queued_in = self.session.saga
        async with self._lock:  # one saga, one step at a time (steps are ordered)
            # Refused also while the session still holds that saga: the abort's thread
            # may be done with the session not yet told (its callback comes later). Only
            # an end the broker did not acknowledge (ending) goes on, to be retried.
            if (
                queued_in is not None
                and queued_in is self._aborted_ahead
                and not (self.session.saga is queued_in and self.session.ending is not None)
            ):
                return _aborted_ahead(queued_in, params.name)
            try:
                await self._ensure_resumed()
            except (CoordinatorNotRunning, SagaHistoryUnreadable) as exc:
                # Said to the agent (no coordinator; records of a newer version: upgrade);
                # retried at the next call.
                return _text(
                    f"the saga this session had open cannot be continued yet: {exc};"
                    " nothing was called",
                    error=True,
                )
            if params.name == "saga_commit":
                return await self._end(SagaOutcome.COMPLETE, "committed by the agent")
            if params.name == "saga_abort":
                return await self._end(SagaOutcome.ABORT, str(args.get("reason") or "aborted"))
            assert mapping is not None
            return await self._step(ctx, params.name, mapping, args)

    async def _end_while_asking(
        self, asking: _Asking, name: str, args: dict[str, Any]
    ) -> types.CallToolResult:
        """saga_commit or saga_abort while a write asks its person for the approval of
        step ``asking.step_id``. A commit is refused, nothing ended: the saga could not
        complete before that step is decided, and it would wait unseen. An abort goes
        ahead: the asking write stops asking (an answer that still comes is not
        recorded) and answers that the saga was aborted; the coordinator cancels the
        step and withdraws its approval request, and compensates the earlier steps."""
        saga = asking.saga
        if name == "saga_commit":
            return _text(
                f"step {asking.step_id} of saga {saga.saga_id} is IRREVERSIBLE and waits for"
                " a person's approval, asked through this client: the saga cannot complete"
                f" before that step is decided. Commit once the call of {asking.step_id}"
                " has returned, or saga_abort to undo the saga; nothing was ended",
                error=True,
            )
        asking.aborted.set()
        self._aborted_ahead = saga
        return await self._end(SagaOutcome.ABORT, str(args.get("reason") or "aborted"))

    async def _aborted_while_asking(
        self, saga: Saga, name: str, step_id: str, call: asyncio.Future[Any]
    ) -> types.CallToolResult:
        """The answer to the write whose step ``step_id`` waited for its approval when
        saga_abort came (that abort goes on beside it): the step's outcome as the
        ledger gives it; normally the coordinator withdrew the request, so the step
        did not run."""
        try:
            value = await _outcome(saga, step_id, call, True)
        except SagaUnwinding as exc:  # the request withdrawn: the step never ran
            return _text(
                f"saga_abort was called while {name} (step {step_id}) waited for a"
                f" person's approval: the saga {saga.saga_id} was aborted, so {name} did"
                f" not run and will not ({exc}); the abort undoes the earlier effects (what"
                f" became of each: {RECEIPT_URI}).",
                error=True,
            )
        except ApprovalPending as exc:  # the coordinator has not acted on the abort
            if self.session.saga is not saga:  # the abort is acknowledged: it stands
                return _text(
                    f"saga_abort was called while {name} (step {step_id}) waited for a"
                    f" person's approval: the saga {saga.saga_id} was aborted, but the"
                    f" coordinator has not acted on the abort yet ({exc}); when it does it"
                    f" withdraws the request, so {name} does not run (unless a person"
                    f" approved it before the abort); read {RECEIPT_URI}.",
                    error=True,
                )
            self.session.remember_awaiting(step_id)
            return _awaiting(saga, step_id, f"saga_abort was called meanwhile: {exc}")
        except CoordinatorNotRunning as exc:  # nothing acts on the abort, nor on the step
            if self.session.saga is not saga:  # the abort is acknowledged: it stands
                return _text(
                    f"saga_abort was called while {name} (step {step_id}) waited for a"
                    f" person's approval: the saga {saga.saga_id} was aborted, but {exc}."
                    f" Once a coordinator consumes it acts on the abort and withdraws the"
                    f" request, so {name} does not run (unless a person approved it before"
                    f" the abort); do not call it again; read {RECEIPT_URI}.",
                    error=True,
                )
            self.session.remember_awaiting(step_id)
            return _no_coordinator(saga, name, step_id, exc)
        except ResultTooLarge as exc:  # approved before the abort: it ran and committed
            return _text(
                f"{name} (step {step_id}) ran and its effect committed: it was approved before"
                f" saga_abort reached the coordinator; do not call it again. Its result is not"
                f" returned: {exc}. It is IRREVERSIBLE, so the abort of saga {saga.saga_id}"
                f" does not undo it; read {RECEIPT_URI}.",
                error=True,
            )
        except SagaParked as exc:  # nothing more runs for the saga, the abort included
            return self._parked(
                saga,
                f"{name} (step {step_id})",
                exc,
                "saga_abort was called meanwhile, but the coordinator had parked the saga: ",
            )
        except OutcomeUnknown as exc:  # R11: approved before the abort, it may have run
            return _text(
                f"saga_abort was called while {name} (step {step_id}) waited for a person's"
                f" approval: the saga {saga.saga_id} was aborted, but the outcome of {name} is"
                f" unknown ({exc}): it may have run (if approved before the abort reached the"
                " coordinator). Do not call it again: the coordinator settles it (its lookup,"
                " else a person), and it is IRREVERSIBLE, so not undone if it ran; read"
                f" {RECEIPT_URI}.",
                error=True,
            )
        except StepEscalated as exc:  # handed to a person: it may have run
            return _text(
                f"{name} (step {step_id}) was handed to a person ({exc}): it may have run, and"
                " a person settles it; do not call it again. saga_abort was called meanwhile:"
                f" the saga {saga.saga_id} was aborted; read {RECEIPT_URI}.",
                error=True,
            )
        except SagaCallError as exc:  # decided before the abort (denied, rejected, failed)
            return _text(
                f"{name} (step {step_id}) did not run: {exc}. saga_abort was called"
                f" meanwhile: the saga {saga.saga_id} was aborted; read {RECEIPT_URI}.",
                error=True,
            )
        # Approved (by `sagaline approve`) before the abort reached the coordinator.
        return _text(
            f"{name} (step {step_id}) ran: it was approved before saga_abort reached the"
            f" coordinator. It is IRREVERSIBLE, so the abort of saga {saga.saga_id} does"
            f" not undo it; read {RECEIPT_URI}. Its result: {json.dumps(value)}",
            error=True,
        )

    def _check_plan(self, args: dict[str, Any]) -> types.CallToolResult:
        try:
            # Read-only calls are passed straight through, not saga steps: one failing
            # does not unwind the saga.
            report = check_plan(args.get("calls") or [], self.catalogue, reads_are_steps=False)
        except ValueError as exc:  # calls it cannot read: said to the agent
            return _text(f"saga_check_plan: {exc}; nothing was checked", error=True)
        return _text(report.render(), error=not report.ok)

    async def _read_only(
        self, name: str, mapping: ToolMapping, args: dict[str, Any]
    ) -> types.CallToolResult:
        """Passed straight through, within the tool's deadline like any upstream call:
        an upstream that never answers must not hold the session (and its lock)."""
        upstream = self.declaration.upstream_of(name)
        try:
            value = await asyncio.wait_for(
                self.upstreams.call(upstream, name, args), mapping.deadline
            )
        except TimeoutError:
            return _text(
                f"{name}: upstream {upstream!r} did not answer within its deadline of"
                f" {mapping.deadline:g} s; it is read-only, so nothing needs undoing",
                error=True,
            )
        except (UpstreamRejected, ConnectionError) as exc:
            return _text(str(exc), error=True)
        return _value(value)

    async def _step(
        self,
        ctx: ServerRequestContext[Any],
        name: str,
        mapping: ToolMapping,
        args: dict[str, Any],
    ) -> types.CallToolResult:
        clash = sorted(SAGA_CALL_OPTIONS.intersection(args))
        if clash:  # saga.call would take them for its own options: refuse, write nothing
            return _text(
                f"{name} takes no argument {', '.join(clash)}; nothing was called", error=True
            )
        try:
            # Checked before the step is written: the participant would refuse it, a
            # failed step, and the saga would be aborted for a call that never ran.
            self.catalogue[name].validate_args(args)
        except InvalidArgumentsError as exc:
            kept = self.session.saga
            return _text(
                f"{exc}; nothing was called"
                + (
                    f". The saga {kept.saga_id} stays open with its earlier effects" if kept else ""
                ),
                error=True,
            )
        if self.session.saga is not None and self.session.ending is not None:
            # A step scheduled after an end that lands is rejected by the coordinator.
            return _text(
                f"the saga {self.session.saga.saga_id} is being ended"
                f" ({self.session.ending.value} requested, not acknowledged yet): call"
                " saga_commit or saga_abort to retry its end before new writes; nothing was"
                " called",
                error=True,
            )
        if self.session.saga is not None and self.session.awaiting:
            waited = await self._awaited(self.session.saga, name)
            if waited is not None:
                return waited
        if self.session.saga is None:
            starting = self._saga()
            started = asyncio.ensure_future(asyncio.to_thread(starting.__enter__))
            # Runs when the start's thread ends, before this coroutine resumes, and also
            # when this request was cancelled while the thread still ran.
            started.add_done_callback(lambda f: self._started(starting, f))
            try:
                await asyncio.shield(started)
            except (CoordinatorNotRunning, DeliveryFailed) as exc:
                # Said to the agent, not left to the MCP server's bare "Internal server
                # error". A start not acknowledged has an abort queued behind it (R14).
                return _text(
                    f"could not start a saga for {name}: {exc}; nothing was called", error=True
                )
            except ClientStopped as exc:  # the client cannot go on (listener stopped)
                return _client_stopped(name, exc)
        saga = self.session.saga
        assert saga is not None  # this start, or one that landed meanwhile
        step_id = f"{self.session.next_step:02d}-{name}"
        self.session.next_step += 1
        self.session.save()
        # A future, not a thread: a step awaiting a person's approval goes on waiting
        # after the agent was answered, and a thread each would soon take all of the
        # default executor's, which every saga start and end needs.
        call = asyncio.ensure_future(saga.acall(name, step_id=step_id, **args))
        granted = False
        if mapping.reversibility is Reversibility.IRREVERSIBLE:
            outcome = await self._approval(ctx, saga, step_id, call)
            if isinstance(outcome, types.CallToolResult):  # "awaiting approval"
                self.session.remember_awaiting(step_id)
                return outcome
            if isinstance(outcome, _AbortedWhileAsking):
                return await self._aborted_while_asking(saga, name, step_id, call)
            granted = outcome
        try:
            value = await _outcome(saga, step_id, call, granted)
        except ApprovalPending as exc:
            self.session.remember_awaiting(step_id)
            return _awaiting(saga, step_id, str(exc))
        except CoordinatorNotRunning as exc:  # written: it runs once a coordinator consumes
            self.session.remember_awaiting(step_id)
            return _no_coordinator(saga, name, step_id, exc)
        except (OutcomeUnknown, DeliveryFailed) as exc:  # R11: not a failure: it may have
            # happened (DeliveryFailed: the step's record may still reach the ledger)
            receipt = await self._finish(SagaOutcome.ABORT, f"{name}: outcome unknown: {exc}")
            if receipt.get("status") == END_NOT_ACKNOWLEDGED:
                return _text(
                    f"the outcome of {name} is unknown ({exc}): it may have happened."
                    f" {receipt['note']}",
                    error=True,
                )
            if receipt.get("status") == "COMPLETED":  # past a pivot: went forward (R6)
                fate = "the coordinator has settled it (the receipt says how)"
            elif mapping.reversibility is Reversibility.IRREVERSIBLE or mapping.pivot:
                why = "IRREVERSIBLE" if not mapping.pivot else "a pivot"
                fate = f"if it did, it is not undone ({why}): it is handed to a person"
            else:
                fate = (
                    "the coordinator settles it (its lookup, else a person) and, if it did,"
                    " has it compensated with the earlier effects"
                )
            return _text(
                f"the outcome of {name} is unknown ({exc}): it may have happened; {fate}."
                f" {_abort_said(saga, receipt)}",
                error=True,
            )
        except CallRefused as exc:
            if exc.limit == SAGA_NOT_STARTED:  # the saga itself cannot go on
                return await self._failed(saga, name, exc)
            # Refused before anything was written (its arguments, the step limit):
            # nothing ran, nothing to undo, so the saga goes on and the agent may
            # correct the call; past the step limit no call can, only the end.
            if exc.limit == STEP_LIMIT:
                return _text(
                    f"{name} was refused: {exc}; nothing was called. The saga"
                    f" {saga.saga_id} can run no further tool call: end it (saga_commit"
                    " / saga_abort) with its earlier effects.",
                    error=True,
                )
            return _text(
                f"{name} was refused: {exc}; nothing was called. The saga {saga.saga_id}"
                f" stays open with its earlier effects: call {name} again with other"
                " arguments, or end the saga (saga_commit / saga_abort).",
                error=True,
            )
        except ResultTooLarge as exc:  # it ran and committed: not a failed write
            return _too_large(saga, name, step_id, exc)
        except SagaCallError as exc:
            return await self._failed(saga, name, exc)
        except ClientStopped as exc:  # refused before writing: the client cannot go on
            return _client_stopped(name, exc)
        return _value(value)

    async def _awaited(self, saga: Saga, name: str) -> types.CallToolResult | None:
        """None when no step this session left awaiting approval is still unfinished;
        else the answer to ``name``'s write, which would wait behind it (each step
        follows the one before): refused, nothing called. A step awaits its approval,
        or a coordinator (none consumed when its write waited), or its outcome (it
        runs now, or is reconciled). A step that ended meanwhile is forgotten; one that
        failed (a denied approval) aborts the saga, as a failed write does."""
        for step_id in list(self.session.awaiting):
            try:
                # Its outcome, if the ledger has it; else ApprovalPending at once.
                await saga.aresume(step_id, _PROBE_S)
            except ApprovalPending:
                return _text(
                    f"step {step_id} of saga {saga.saga_id} is IRREVERSIBLE and has not run"
                    f" yet: it waits for a person's approval (`sagaline approve"
                    f" {saga.saga_id} {step_id}`), or runs now. Each write follows the one"
                    f" before, so {name} would wait behind it: call it again once {step_id}"
                    f" is done (do not repeat {step_id}'s own call: it runs once approved;"
                    f" the steps done are listed in {RECEIPT_URI}), or saga_abort to undo"
                    " the saga; nothing was called",
                    error=True,
                )
            except CoordinatorNotRunning as exc:  # no outcome yet, nor any on its way
                return _text(
                    f"step {step_id} of saga {saga.saga_id} is written but has no outcome:"
                    f" {exc}. It runs once a coordinator consumes, and each write follows the"
                    f" one before, so {name} would wait behind it: call it again once"
                    f" {step_id} is done (do not repeat {step_id}'s own call; the steps done"
                    f" are listed in {RECEIPT_URI}), or saga_abort to undo the saga; nothing"
                    " was called",
                    error=True,
                )
            except OutcomeUnknown as exc:  # running, or being reconciled (R11): no outcome
                # in the records the client has yet, which is no failure: it gets one.
                return _text(
                    f"step {step_id} of saga {saga.saga_id} has no outcome yet ({exc}): it"
                    f" runs, or its outcome is being settled. Each write follows the one"
                    f" before, so {name} would wait behind it: call it again once {step_id}"
                    f" is done (do not repeat {step_id}'s own call; the steps done are listed"
                    f" in {RECEIPT_URI}), or saga_abort to undo the saga; nothing was called",
                    error=True,
                )
            except ResultTooLarge:
                pass  # it ran and committed (its result not kept): done, as any other
            except SagaCallError as exc:
                self.session.awaiting.remove(step_id)
                return await self._failed(saga, step_id, exc)
            self.session.awaiting.remove(step_id)
            self.session.save()
        return None

    async def _failed(self, saga: Saga, name: str, exc: SagaCallError) -> types.CallToolResult:
        """A write that did not commit: the saga is aborted, its earlier effects undone.
        A parked saga is not: the coordinator decides nothing more for it (an abort
        would go to the DLQ, its receipt never come); it is left to a person."""
        if isinstance(exc, SagaParked):
            return self._parked(saga, name, exc)
        if isinstance(exc, OutcomeUnknown):  # R11: not a failure
            what = f"the outcome of {name} is unknown ({exc}): it may have happened"
        elif isinstance(exc, StepEscalated):  # e.g. an unknown outcome with no lookup
            what = f"{name} was handed to a person ({exc}): it may have happened"
        else:
            what = f"{name} failed: {exc}"
        receipt = await self._finish(SagaOutcome.ABORT, what)
        if receipt.get("status") == END_NOT_ACKNOWLEDGED:
            return _text(f"{what}. {receipt['note']}", error=True)
        return _text(f"{what}. {_abort_said(saga, receipt)}", error=True)

    def _parked(
        self, saga: Saga, name: str, exc: SagaParked, before: str = ""
    ) -> types.CallToolResult:
        """The coordinator parked the saga: nothing more runs for it and nothing is
        undone automatically. The session lets go of it (the next write starts a new
        saga); the receipt resource says it is parked. ``before``: said first."""
        log.warning("saga %s is parked: %s", saga.saga_id, exc)
        note = (
            f"the saga {saga.saga_id} is parked by the coordinator ({exc}): nothing more"
            f" runs for it and nothing is undone automatically; a person settles its"
            f" effects (`sagaline saga show {saga.saga_id}`, its saga-parked incident in"
            f" `sagaline incidents list`), {name} included (it may or may not have run)."
            " The next write starts a new saga."
        )
        self.session.saga = None
        self.session.awaiting = []
        self.session.ending = None
        self.session.last_receipt = json.dumps(
            {"saga_id": saga.saga_id, "status": "PARKED", "note": note}, indent=2
        )
        self.session.last_requested = None
        self.session.save()
        return _text(f"{before}{name}: {note}", error=True)

    def _started(self, saga: Saga, start: asyncio.Future[Any]) -> None:
        """The session's part of starting ``saga`` (on the loop, once it started): it
        becomes the session's saga; if the request that started it was cancelled and
        another saga has become the session's since, nothing will ever use or end this
        one, so it is aborted (it has no steps), not left open for good (R14)."""
        if start.cancelled() or start.exception() is not None:
            return
        if self.session.saga is None:
            self.session.saga = saga
            self.session.next_step = 1
            self.session.awaiting = []
            self.session.save()
        elif self.session.saga is not saga:
            log.info("saga %s: started by a cancelled call, not used: aborting it", saga.saga_id)
            reason = "started by a call the MCP client cancelled; never used"
            _forget(asyncio.ensure_future(asyncio.to_thread(saga.end, SagaOutcome.ABORT, reason)))

    async def _approval(
        self,
        ctx: ServerRequestContext[Any],
        saga: Saga,
        step_id: str,
        call: asyncio.Future[Any],
    ) -> types.CallToolResult | bool | _AbortedWhileAsking:
        """An IRREVERSIBLE step: ask the person through elicitation if the client can,
        else answer "awaiting approval" (the saga stays open). A call that ends first
        (refused or never written, so no approval will be asked) is answered at once.
        Otherwise whether the person granted the approval through the client (the
        call's outcome is awaited next), or that saga_abort came while asking."""
        asking = asyncio.ensure_future(saga.aapproval_request(step_id, self.approval_wait_s))
        await asyncio.wait({call, asking}, return_when=asyncio.FIRST_COMPLETED)
        if not asking.done():
            asking.cancel()  # nothing more to ask for
            return False  # the call ended without asking: see its outcome
        request = asking.result()
        if request is None:
            return False  # the step ended without asking (e.g. rejected): see its outcome
        caps = ctx.session.client_capabilities
        if caps is None or caps.elicitation is None:
            _forget(call)
            return _awaiting(saga, step_id, f"approval {request.approval_id} requested")
        from sagaline.ops.actions import OperatorChannel

        who = "mcp-user"
        client_info = ctx.session.client_params.client_info if ctx.session.client_params else None
        if client_info is not None:
            who = f"mcp-user:{client_info.name}"
        channel = OperatorChannel.from_settings(self.settings, self.client.bootstrap)
        try:
            return await self._ask(ctx, saga, step_id, call, request, channel, who)
        except asyncio.CancelledError:
            # The request was cancelled (an MCP client's own request timeout is often
            # shorter than a person's answer) while the person was asked: the step
            # still waits for its approval on the ledger. Remembered as such, so the
            # next write is refused at once instead of waiting behind it unawares. Its
            # call goes on waiting; its ApprovalPending is nobody's, as when answered.
            _forget(call)
            if self.session.saga is saga and step_id not in self.session.awaiting:
                self.session.remember_awaiting(step_id)
            raise
        finally:
            channel.close()

    async def _ask(
        self,
        ctx: ServerRequestContext[Any],
        saga: Saga,
        step_id: str,
        call: asyncio.Future[Any],
        request: Any,
        channel: Any,
        who: str,
    ) -> types.CallToolResult | bool | _AbortedWhileAsking:
        """Ask the person through the client and record the answer as ``who``; not
        when saga_abort came meanwhile (the question is withdrawn)."""
        from sagaline.ops.actions import OperatorActionError, deny_approval, grant_approval

        try:
            # An answer this proxy's key cannot record (with per-identity keys only an
            # operator's may decide): not asked in vain.
            channel.producer_for(who, "mcp")
        except OperatorActionError as exc:
            _forget(call)
            return _awaiting(
                saga,
                step_id,
                f"approval {request.approval_id} requested; it cannot be decided through"
                f" the client: {exc}",
            )
        asking = _Asking(saga, step_id)
        self._asking = asking
        try:
            # Bounded: an answer that never comes (and a client that never cancels the
            # call) would hold the session's lock, and every later write, for good.
            answer = await _unless(
                asking.aborted,
                ctx.session.elicit_form(
                    f"Approve the IRREVERSIBLE call {request.step_id} of saga {saga.saga_id}?"
                    " It cannot be undone.",
                    {
                        "type": "object",
                        "properties": {"approve": {"type": "boolean", "title": "Approve"}},
                        "required": ["approve"],
                    },
                ),
                self.approval_wait_s,
            )
        except _Stopped:  # saga_abort: not asked any more, whatever the person answers
            return _ABORTED_WHILE_ASKING
        except TimeoutError:
            log.warning("saga %s: no answer to the approval asked through the client", saga.saga_id)
            _forget(call)
            return _awaiting(
                saga,
                step_id,
                f"approval {request.approval_id} requested; no answer through the client"
                f" within {self.approval_wait_s:g} s",
            )
        except Exception as exc:  # the client could not ask: as if it had no elicitation
            log.warning("saga %s: asking for approval failed: %s", saga.saga_id, exc)
            _forget(call)
            return _awaiting(
                saga,
                step_id,
                f"approval {request.approval_id} requested; asking through the client"
                f" failed: {exc}",
            )
        finally:
            if self._asking is asking:
                self._asking = None
        granted = answer.action == "accept" and (answer.content or {}).get("approve") is True
        try:
            if granted:
                await asyncio.to_thread(grant_approval, channel, request, operator=who, via="mcp")
                return True  # the step runs now: wait for its outcome
            await asyncio.to_thread(
                deny_approval,
                channel,
                request,
                operator=who,
                reason=f"elicitation {answer.action}",
                via="mcp",
            )
            return False  # the denial is a business rejection: the call fails
        except OperatorActionError as exc:  # not recorded (or not confirmed): said
            log.warning("saga %s: the answer given through the client: %s", saga.saga_id, exc)
            _forget(call)
            return _awaiting(
                saga,
                step_id,
                f"approval {request.approval_id} requested; the answer given through the"
                f" client ({'granted' if granted else 'denied'}) was not recorded: {exc}",
            )

    async def _end(self, outcome: SagaOutcome, reason: str) -> types.CallToolResult:
        if self.session.saga is None:
            return _no_saga_open(outcome, self.session.last_receipt, self.session.last_requested)
        receipt = await self._finish(outcome, reason)
        if receipt.get("status") in (RECEIPT_PENDING, END_NOT_ACKNOWLEDGED):
            return types.CallToolResult(
                content=[types.TextContent(text=str(receipt["note"]))],
                structured_content=receipt,
                is_error=receipt["status"] == END_NOT_ACKNOWLEDGED,
            )
        return _text(json.dumps(receipt, indent=2))

    async def _finish(self, outcome: SagaOutcome, reason: str) -> dict[str, Any]:
        """End the saga and wait for its receipt. Either way the session lets go of it
        (it was ended: the next write starts a new saga); a receipt not in within the
        wait is a note saying where to read it later, also served as the resource.

        The session lets go as soon as the end is acknowledged, even if this request is
        cancelled meanwhile (an MCP client's own request timeout is often shorter than
        the receipt wait): the end stands on the ledger, and a write continuing the
        ended saga would be rejected by the coordinator.

        An end the broker did not acknowledge (DeliveryFailed) may still land, or not:
        the session keeps the saga, remembers the outcome asked for (on disk too) and
        answers END_NOT_ACKNOWLEDGED; the next end retries that same outcome (the
        coordinator keeps the first end it reads and ignores a repeat), so an abort the
        proxy asked for after a failed step is never turned into a completion."""
        saga = self.session.saga
        assert saga is not None
        if self.session.ending is not None:
            outcome, reason = self.session.ending, self.session.ending_reason
        pending: dict[str, Any] = {
            "saga_id": saga.saga_id,
            "status": RECEIPT_PENDING,
            "requested": outcome.value,
            "note": f"the saga {saga.saga_id} was ended ({outcome.value} requested) but"
            f" its receipt is not in yet after {self.receipt_wait_s:g} s; the coordinator"
            f" settles it. Read it later with `sagaline saga show {saga.saga_id}`. The"
            " next write starts a new saga.",
        }
        ending = asyncio.ensure_future(asyncio.to_thread(saga.end, outcome, reason))
        # Runs when the end's thread ends, before this coroutine resumes, and also when
        # this request was cancelled while the thread still ran.
        ending.add_done_callback(lambda f: self._ended(saga, outcome, reason, f, pending))
        try:
            await asyncio.shield(ending)
        except DeliveryFailed as exc:
            log.warning("saga %s: its end was not acknowledged: %s", saga.saga_id, exc)
            return {
                "saga_id": saga.saga_id,
                "status": END_NOT_ACKNOWLEDGED,
                "requested": outcome.value,
                "note": f"The request to {outcome.value.lower()} the saga {saga.saga_id} was"
                f" not acknowledged by the broker ({exc}); it may still land, or not. The"
                " saga stays open in this session: call saga_commit or saga_abort to retry"
                f" (either asks again for {outcome.value.lower()}); no write is accepted"
                " until its end is acknowledged.",
            }
        try:
            receipt = await saga.await_terminal(self.receipt_wait_s)  # a future, no thread
        except TimeoutError as exc:
            log.warning("saga %s ended without its receipt in time: %s", saga.saga_id, exc)
            return pending
        text = receipt.model_dump_json(indent=2)
        # An abort that went ahead of an asking write waits outside the step lock: a
        # later saga of the session may have ended meanwhile, and stays the last one.
        last = self.session.last_receipt
        if last is None or json.loads(last).get("saga_id") == saga.saga_id:
            self.session.last_receipt = text
        result: dict[str, Any] = json.loads(text)
        return result

    def _ended(
        self,
        saga: Saga,
        outcome: SagaOutcome,
        reason: str,
        end: asyncio.Future[None],
        pending: dict[str, Any],
    ) -> None:
        """The session's part of ending ``saga`` (on the loop, once its end is answered):
        acknowledged, let go of it (its receipt pending until it is in); not
        acknowledged, keep it and remember the outcome to retry."""
        if self.session.saga is not saga or end.cancelled():
            return
        failure = end.exception()
        if isinstance(failure, DeliveryFailed):
            self.session.ending, self.session.ending_reason = outcome, reason
        elif failure is None:
            self.session.saga = None
            self.session.awaiting = []
            self.session.ending = None
            self.session.last_receipt = json.dumps(pending, indent=2)
            self.session.last_requested = outcome
        self.session.save()


def _no_saga_open(
    outcome: SagaOutcome, last_receipt: str | None, asked: SagaOutcome | None
) -> types.CallToolResult:
    """The answer to saga_commit (``outcome`` COMPLETE) or saga_abort (ABORT) when the
    session has no saga open: none was started, or the last one has already ended (the
    agent ended it, the proxy aborted it after a failed write, it was parked, it ended
    while the proxy was down). Nothing is asked of the ledger; the answer says how the
    last saga ended, an error where that is not what the agent asks for now.
    ``asked``: the end asked for that saga, when known (an ESCALATED abort is an
    abort all the same: a saga_abort after it asks for what was done)."""
    if last_receipt is None:
        return _text("no saga is open: nothing was written in this session")
    last: dict[str, Any] = json.loads(last_receipt)
    saga_id, status = last.get("saga_id"), str(last.get("status"))
    if status == RECEIPT_PENDING:  # ended as asked; how it settles is not in yet
        requested = str(last.get("requested"))
        ended_as = "COMPLETED" if requested == SagaOutcome.COMPLETE.value else "COMPENSATED"
        how = (
            "committed already (its receipt is not in yet)"
            if ended_as == "COMPLETED"
            else "aborted already (its effects are being undone; its receipt is not in yet)"
        )
    elif status == "ESCALATED" and asked is SagaOutcome.ABORT:
        ended_as = "COMPENSATED"
        how = (
            "aborted already, but not every effect could be undone: what is left is handed"
            " to a person (`sagaline incidents list`)"
        )
    else:
        ended_as = status
        how = {
            "COMPLETED": "committed already (its effects are kept)",
            "COMPENSATED": "aborted already (its effects undone)",
            "ESCALATED": "ended ESCALATED: an effect could not be settled automatically and"
            " is handed to a person (`sagaline incidents list`)",
            "PARKED": "parked by the coordinator: nothing more runs for it and nothing is"
            " undone automatically; a person settles its effects",
        }.get(status, "ended")
    met = ended_as == ("COMPLETED" if outcome is SagaOutcome.COMPLETE else "COMPENSATED")
    if met:
        what = "nothing more to do"
    elif outcome is SagaOutcome.COMPLETE:
        what = "nothing was committed now"
    else:
        what = "nothing was aborted now: an ended saga's effects cannot be undone by saga_abort"
    return _text(
        f"no saga is open: the last saga of this session, {saga_id}, was {how} (status"
        f" {status}); {what}. Read {RECEIPT_URI} (or `sagaline saga show {saga_id}`). The"
        " next write starts a new saga.",
        error=not met,
    )


_SERVED_NAMED = 20  # the most served tool names an unknown tool's answer lists


def _unknown_tool(declaration: Declaration, name: str) -> str:
    """What a call of a tool the proxy does not serve is answered with: the names it
    may have meant (as the saga client's UnknownTool says), and where served tools
    come from, so the fix is in the declaration, not in retrying."""
    internal = declaration.internal_tools()
    served = sorted(n for n in declaration.tools if n not in internal)
    served += [tool.name for tool in _saga_tools()]
    where = f" {declaration.file}" if declaration.file else ""
    if name in internal:  # declaring it under tools: too would not serve it
        return (
            f"tool {name!r} is not served to the agent: the proxy calls it itself (a"
            f" compensation, a lookup, or listed under internal: in its declaration{where})."
        )
    close = difflib.get_close_matches(name, served, n=3)
    if close:
        found = f"; did you mean {' or '.join(repr(n) for n in close)}?"
    else:
        listed = ", ".join(repr(n) for n in served[:_SERVED_NAMED])
        more = f" and {len(served) - _SERVED_NAMED} more" if len(served) > _SERVED_NAMED else ""
        found = f" (served: {listed}{more})."
    return (
        f"unknown tool {name!r}{found} The proxy serves the tools its declaration{where}"
        " lists under tools: (and the saga_* tools); to serve another tool of its"
        " upstream servers, add it there and restart the proxy."
    )


def _recovery_note(catalogue: Catalogue, name: str) -> str:
    spec = catalogue[name]
    if spec.read_only:
        return "[read-only]"
    if spec.reversibility is Reversibility.IRREVERSIBLE:
        return "[IRREVERSIBLE: cannot be undone; asks a person for approval before it runs]"
    return f"[{spec.reversibility.value}: undone by {spec.compensation} if the task fails]"


def _saga_tools() -> list[types.Tool]:
    empty: dict[str, Any] = {"type": "object", "properties": {}}
    return [
        types.Tool(
            name="saga_commit",
            description="Finish the task: keep every effect of this session. Returns the receipt.",
            input_schema=empty,
            annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False),
        ),
        types.Tool(
            name="saga_abort",
            description="Give up the task: undo every effect of this session (compensations"
            " run in reverse order). Returns the receipt.",
            input_schema={
                "type": "object",
                "properties": {"reason": {"type": "string", "description": "why"}},
            },
            annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=True),
        ),
        types.Tool(
            name="saga_check_plan",
            description="Before acting: classify a proposed list of calls (read-only,"
            " compensatable, irreversible) and flag risky ordering. Changes nothing.",
            input_schema={
                "type": "object",
                "properties": {
                    "calls": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"tool": {"type": "string"}, "args": {"type": "object"}},
                            "required": ["tool"],
                        },
                    }
                },
                "required": ["calls"],
            },
            annotations=types.ToolAnnotations(read_only_hint=True),
        ),
    ]


def _text(text: str, *, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=error)


def _value(value: Any) -> types.CallToolResult:
    text = value if isinstance(value, str) else json.dumps(value)
    structured = value if isinstance(value, dict) else None
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=structured
    )


def _too_large(saga: Saga, name: str, step_id: str, exc: ResultTooLarge) -> types.CallToolResult:
    """A write that ran and committed whose result is over the limit (not on the ledger,
    so not returned): an error for the agent, which must not repeat the call; the saga
    stays open, the effect undone with the others only if it is aborted."""
    return _text(
        f"{name} was called and its effect committed (step {step_id} of saga"
        f" {saga.saga_id}): do not call it again. Its result is not returned: {exc}. The"
        f" saga stays open: the effect stands, and is undone with the others if the saga is"
        f" aborted; the steps done are listed in {RECEIPT_URI}.",
        error=True,
    )


def _abort_said(saga: Saga, receipt: Mapping[str, Any]) -> str:
    """What the proxy's abort of ``saga`` did, as its receipt (or its note that the
    receipt is not in yet) says: effects are said compensated only when they were."""
    status = receipt.get("status")
    if status == "COMPENSATED":
        did = "was aborted and its earlier effects compensated"
    elif status == "ESCALATED":
        did = (
            "was aborted, but not every effect could be undone: what is left is handed to a"
            " person (`sagaline incidents list`)"
        )
    elif status == "COMPLETED":  # R6: a pivot had committed, so the abort went forward
        pivot = receipt.get("pivot_step")
        did = (
            "was not undone: a pivot"
            + (f" ({pivot})" if pivot else "")
            + " had committed, so the saga went forward and completed; its effects stand"
        )
    elif status == RECEIPT_PENDING:
        did = (
            "was aborted; its earlier effects are being undone, its receipt not in yet"
            f" (read it later with `sagaline saga show {saga.saga_id}`)"
        )
    else:
        did = "was aborted"
    return f"The saga {saga.saga_id} {did} (status {status}); read {RECEIPT_URI}."


def _client_stopped(name: str, exc: ClientStopped) -> types.CallToolResult:
    """The saga client refused the start or the call before writing anything because
    it cannot go on (its listener stopped following the ledger, or it was closed):
    said to the agent, not left to the MCP server's bare "Internal server error"; no
    write can run until the proxy is restarted."""
    log.error("%s: the saga client cannot go on: %s", name, exc)
    return _text(
        f"{name} was not called: this proxy's saga client cannot go on ({exc}). No"
        " write can run until the proxy is restarted (the open saga, if any, is"
        " continued then); read-only calls still work.",
        error=True,
    )


def _aborted_ahead(saga: Saga, name: str) -> types.CallToolResult:
    """The answer to ``name``, sent for ``saga`` while a write asked its person and
    queued behind that write, when a saga_abort sent after it went ahead and ended the
    saga: not run in a new saga after the abort (its effect would not be undone by it,
    and that saga left open)."""
    if name == "saga_abort":
        return _text(f"the saga {saga.saga_id} was aborted already; read {RECEIPT_URI}.")
    what = (
        "nothing was ended"
        if name == "saga_commit"
        else "nothing was called (call it again to start a new saga)"
    )
    return _text(
        f"saga_abort was called while {name} waited behind the write before it: the saga"
        f" {saga.saga_id} was aborted, so {name} did not run in it; read {RECEIPT_URI};"
        f" {what}",
        error=True,
    )


def _no_coordinator(
    saga: Saga, name: str, step_id: str, exc: CoordinatorNotRunning
) -> types.CallToolResult:
    """The step was written, but the client found no coordinator consuming the ledger
    while it waited for the outcome: the step runs once one does. The session keeps
    it as awaiting (the next write checks the ledger first), so it is not called
    twice."""
    return _text(
        f"{name} (step {step_id}) was written to saga {saga.saga_id}, but {exc}. It runs"
        f" once a coordinator consumes the ledger: do not call it again (the next write"
        f" checks its outcome first; the steps done are listed in {RECEIPT_URI}). The"
        " saga stays open.",
        error=True,
    )


def _awaiting(saga: Saga, step_id: str, detail: str) -> types.CallToolResult:
    return types.CallToolResult(
        content=[
            types.TextContent(
                text=f"awaiting approval: step {step_id} of saga {saga.saga_id} is IRREVERSIBLE"
                f" and waits for a person ({detail}; `sagaline approve {saga.saga_id}"
                f" {step_id}`). The saga stays open; it runs once approved."
            )
        ],
        structured_content={
            "status": "awaiting_approval",
            "saga_id": saga.saga_id,
            "step_id": step_id,
        },
    )


async def _outcome(saga: Saga, step_id: str, call: asyncio.Future[Any], granted: bool) -> Any:
    """The step's outcome. One approved through the client after the call's own wait
    ran out (ApprovalPending: a person may take longer than the client's call timeout
    to answer) runs now: its outcome is waited for again, not said to be pending."""
    try:
        return await call
    except ApprovalPending:
        if not granted:
            raise
        return await saga.aresume(step_id)


class _Stopped(Exception):
    """:func:`_unless`'s wait was stopped by its event."""


async def _unless(stop: asyncio.Event, awaitable: Any, timeout_s: float) -> Any:
    """``awaitable``'s result, within ``timeout_s`` (else TimeoutError); :class:`_Stopped`
    as soon as ``stop`` is set (checked first: a result that came at the same time is
    not taken). The awaitable is cancelled when it is not the answer."""
    work = asyncio.ensure_future(awaitable)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this wait is cancelled
        stopping.cancel()
        if stop.is_set() or not work.done():
            work.cancel()
    if stop.is_set():
        _forget(work)
        raise _Stopped
    if not work.done():
        raise TimeoutError
    return work.result()


def _forget(call: asyncio.Future[Any]) -> None:
    """The call (or wait) goes on; its eventual error is nobody's."""
    call.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)


# ------------------------------------------------------------------------ main


# How long the participant runtime may take to start serving before the proxy gives up.
RUNTIME_START_WAIT_S = 120.0

# A start refused by the broker or by the topics' settings: said in one line (no
# traceback), as `participant run` says it; anything else is a bug, its traceback kept.
_START_REFUSALS = (KafkaException, DeliveryFailed, TopicSetupError, TopicMissing, JournalUnusable)


# One process, two writers: the saga's agent (its start, steps and end) and the
# participant serving its tools (intents, outcomes). An identity key signs as one
# identity of one role, so readers would refuse one writer's records or the other's.
_IDENTITY_KEYS_REFUSED = (
    "SAGALINE_TRUST_FILE is set, but the proxy writes as an agent (each saga's start,"
    " steps and end) and as participant {participant!r} (the tools' intents and"
    " outcomes), and one identity key signs for one identity of one role: readers would"
    " refuse the records of one of them. Run the proxy on a ledger signed with the"
    " shared key (SAGALINE_HMAC_KEY) or unsigned, or run the agent and the participant"
    " as two processes (a SagaClient and `sagaline participant run`), each with its key"
)


def _start_why(exc: BaseException, bootstrap: str) -> str:
    """One line on why a start failed, with what to check when the broker said no."""
    error = exc.args[0] if exc.args else None
    if isinstance(exc, KafkaException) and isinstance(error, KafkaError):
        return (
            f"Kafka at {bootstrap} did not answer or refused ({error.str()}); check"
            " KAFKA_BOOTSTRAP_SERVERS, the client settings (SAGALINE_KAFKA_*) and that the"
            " broker runs, then start it again"
        )
    return str(exc)


def main(path: Path, *, check_only: bool = False) -> int:
    """Run the proxy on stdio until the agent disconnects. 1: the declaration cannot
    work (every problem printed), 2: it cannot be read or a service is missing."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    # At INFO the HTTP client logs every request's URL, an upstream's password and
    # token (its query) in clear, and the MCP client its session id: warnings only.
    for noisy in ("httpx", "httpx2", "httpcore", "mcp.client.streamable_http"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        declaration = load_declaration(path)
    except DeclarationError as exc:
        print(f"sagaline mcp proxy: refusing to start: {exc}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_serve(declaration, check_only))
    except (DeclarationError, CatalogueError) as exc:
        print(f"sagaline mcp proxy: refusing to start: {exc}", file=sys.stderr)
        return 1
    except (UpstreamUnavailable, ProxyAlreadyRunning, InstanceClaimed, ProxyStartFailed) as exc:
        print(f"sagaline mcp proxy: cannot start: {exc}", file=sys.stderr)
        return 2


async def _serve(declaration: Declaration, check_only: bool) -> int:
    refused: Exception | None = None
    upstreams = Upstreams(declaration)
    try:
        async with AsyncExitStack() as stack:
            # Raised only after the upstream sessions are closed: raised inside them it
            # would arrive wrapped in the SDK's task-group exception group.
            try:
                await upstreams.open(stack)
                problems = check(declaration, upstreams.tools)
                if problems:
                    raise DeclarationError(declaration.source, problems)
                catalogue = build_catalogue(declaration, upstreams)
            except (DeclarationError, CatalogueError, UpstreamUnavailable) as exc:
                refused = exc
            else:
                if check_only:
                    print(
                        f"{declaration.source}: OK, {len(catalogue)} tool(s) over"
                        f" {len(declaration.upstreams)} upstream(s)",
                        file=sys.stderr,
                    )
                    return 0
                await _run(declaration, upstreams, catalogue, stack)
    except Exception as exc:
        # An upstream that cannot be reached fails in the SDK's task group (an HTTP
        # transport's connection error) and arrives in an exception group, or again
        # when its session is closed: said as the upstream that cannot be reached.
        if isinstance(refused, UpstreamUnavailable):
            pass
        elif upstreams.opening is not None:
            refused = upstreams.unavailable(exc)
        else:
            raise
    if refused is not None:
        raise refused
    return 0


async def _run(
    declaration: Declaration, upstreams: Upstreams, catalogue: Catalogue, stack: AsyncExitStack
) -> None:
    from sagaline.kafka import configured_broker

    # Started by an MCP client as a service: like `participant run`, it never starts a
    # broker; with none configured it fails and says what to set.
    settings, bootstrap = configured_broker("sagaline mcp proxy")
    if settings.trust_file is not None:
        raise ProxyStartFailed(_IDENTITY_KEYS_REFUSED.format(participant=declaration.participant))
    claim = _claim_state(settings.state_dir / declaration.participant, declaration.participant)
    stack.callback(os.close, claim)
    try:
        runtime = ParticipantRuntime(catalogue, settings, bootstrap)
    except sqlite3.Error as exc:  # only the command journal is opened here
        journal = settings.state_dir / declaration.participant / "commands.sqlite"
        raise ProxyStartFailed(
            f"cannot open the command journal {journal} (SAGALINE_STATE_DIR): {exc}"
        ) from None
    ready = threading.Event()
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            runtime.run(ready=ready)
        except BaseException as exc:
            if ready.is_set():
                raise  # the loop's own end, after it served: its traceback is the report
            failed.append(exc)  # a start that failed: said at once, not after the wait
        finally:
            ready.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    stack.callback(thread.join, 30)
    stack.callback(runtime.stop)
    if not await asyncio.to_thread(ready.wait, RUNTIME_START_WAIT_S):
        # Known, not a bug: its start waits on the broker (topics made, described,
        # the catalogue read and written), which can hang without refusing.
        raise ProxyStartFailed(
            f"the participant runtime of {declaration.participant} did not start within"
            f" {RUNTIME_START_WAIT_S:g} s: check that Kafka at {bootstrap} answers"
            " (KAFKA_BOOTSTRAP_SERVERS, SAGALINE_KAFKA_*), and that the command topic"
            f" {settings.topics.commands(declaration.participant)!r} and the catalogue"
            f" topic {settings.topics.catalogue!r} exist or can be made, and this"
            " principal may read and write them; then start it again"
        )
    if failed:
        if isinstance(failed[0], InstanceClaimed):
            raise failed[0]  # a twin serves this participant: its pid, what to do
        if isinstance(failed[0], _START_REFUSALS):  # what `participant run` says in one line
            raise ProxyStartFailed(
                f"the participant runtime of {declaration.participant} did not start:"
                f" {_start_why(failed[0], bootstrap)}"
            ) from failed[0]
        raise RuntimeError(
            f"the participant runtime of {declaration.participant} did not start:"
            f" {type(failed[0]).__name__}: {failed[0]}"
        ) from failed[0]
    client = SagaClient(settings, bootstrap, catalogues=[catalogue])
    try:
        await asyncio.to_thread(client.start)  # a start that fails closes the client
    except (*_START_REFUSALS, RuntimeError) as exc:  # RuntimeError: its listener's failure
        refusal = exc if isinstance(exc, _START_REFUSALS) else exc.__cause__
        if not isinstance(refusal, _START_REFUSALS):
            raise  # no refusal of the broker or the topics: a bug, its traceback kept
        raise ProxyStartFailed(
            f"the saga client did not start: {_start_why(exc, bootstrap)}"
            if refusal is exc
            else f"the saga client's listener did not start: {_start_why(refusal, bootstrap)}"
        ) from exc
    stack.callback(client.close)
    proxy = McpProxy(declaration, upstreams, catalogue, client, settings)
    server = proxy.server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())
