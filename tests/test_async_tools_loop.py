"""Async tools run on one long-lived event loop of the participant process, with
their call context, instead of a fresh ``asyncio.run`` per call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest

from participants import (
    CompensationContext,
    LookupResult,
    compensable,
    current_call,
    tool,
    wrap,
)
from participants.catalogue import ToolSpec
from participants.context import CallContext, call_context, serve_async_tools
from participants.runtime import CommandHandler, CommandJournal
from schemas import ExecuteStep, Record, StepIntentRecorded, StepOutcomeUnknown, envelope_for


class AsyncShop:
    def __init__(self) -> None:
        self.loops: list[asyncio.AbstractEventLoop] = []
        self.keys: list[str] = []

    @tool(description="Reserve, asynchronously")
    @compensable(by="release")
    async def reserve(self, sku: str) -> dict[str, str]:
        self.loops.append(asyncio.get_running_loop())
        self.keys.append(current_call().idempotency_key)
        await asyncio.sleep(0)
        return {"sku": sku}

    async def release(self, ctx: CompensationContext) -> None:
        self.loops.append(asyncio.get_running_loop())


def test_async_tools_share_the_runtime_loop_and_see_their_call_context() -> None:
    shop = AsyncShop()
    spec = wrap(shop, name="shop")["reserve"]
    loop = serve_async_tools()
    for n in range(3):
        with call_context(CallContext("saga-1", f"s{n}", "reserve", f"key-{n}")):
            assert spec.invoke({"sku": "a"}) == {"sku": "a"}
    assert shop.loops == [loop, loop, loop]
    assert shop.keys == ["key-0", "key-1", "key-2"]
    assert serve_async_tools() is loop  # one per process


class ExitingShop:
    @tool(description="Reserve through a CLI-style library")
    @compensable(by="release")
    async def reserve(self, sku: str) -> dict[str, str]:
        await asyncio.sleep(0)
        raise SystemExit(f"usage: reserve SKU (got {sku!r})")  # what click/argparse raise

    async def release(self, ctx: CompensationContext) -> None:
        pass


def test_an_async_tool_raising_system_exit_fails_its_call_and_the_loop_serves_on() -> None:
    # R16: SystemExit raised in a task leaves asyncio's task machinery and stops the
    # loop running it. On the process's one loop for async tools that call would never
    # answer and every later async tool of the process would hang with it. The call
    # raises its SystemExit on the caller's thread (the runtime reports the step as
    # failed), and the loop serves the next call.
    loop = serve_async_tools()
    failing = wrap(ExitingShop(), name="exiting")["reserve"]
    working = wrap(AsyncShop(), name="shop")["reserve"]

    def call(spec: ToolSpec) -> object:
        with call_context(CallContext("saga-1", "s1", "reserve", "key-1")):
            return spec.invoke({"sku": "a"})

    def on_a_thread(spec: ToolSpec) -> concurrent.futures.Future[object]:
        # a daemon thread: a call that never answers must fail the test, not hang it
        answer: concurrent.futures.Future[object] = concurrent.futures.Future()

        def run() -> None:
            try:
                answer.set_result(call(spec))
            except BaseException as exc:
                answer.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return answer

    with pytest.raises(SystemExit, match="usage: reserve SKU"):
        on_a_thread(failing).result(timeout=60)  # a TimeoutError: never answered
    assert on_a_thread(working).result(timeout=60) == {"sku": "a"}
    assert serve_async_tools() is loop and loop.is_running()


class HangingShop:
    """An async tool whose provider never answers."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    @tool(description="Reserve at a provider that never answers")
    @compensable(by="release")
    async def reserve(self, sku: str) -> dict[str, str]:
        self.started.set()
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return {"sku": sku}

    async def release(self, ctx: CompensationContext) -> None:
        pass


def test_a_hung_async_tool_is_cancelled_at_its_deadline_and_its_outcome_is_unknown(
    tmp_path: Path,
) -> None:
    # R11: past its deadline the step is an unknown outcome (reconciled, never
    # guessed). The coroutine must not be left running for good on the shared
    # loop (its task, its connections) with a tool thread waiting on it: it is
    # cancelled at the deadline.
    serve_async_tools()
    shop = HangingShop()
    out: list[Record] = []
    handler = CommandHandler(
        wrap(shop, name="shop"), "shop", CommandJournal(tmp_path / "j.sqlite"), out.append
    )
    env = envelope_for(
        ExecuteStep, saga_id="s-1", tenant_id="t", producer="sagaline-coordinator", now=1
    )
    command = ExecuteStep(
        envelope=env,
        step_id="01-reserve",
        tool="reserve",
        args=b'{"sku":"a"}',
        idempotency_key="k-1",
        attempt=1,
        deadline_ms=50,
        principal="p",
    )
    assert handler.handle(command) == "done"
    assert [type(r) for r in out] == [StepIntentRecorded, StepOutcomeUnknown]  # R11
    assert shop.started.is_set()
    assert shop.cancelled.wait(60), "the hung coroutine was never cancelled"
    handler.close()
    handler.journal.close()


class SyncToolAsyncUndo:
    """A sync tool whose compensation, lookup and verification are async (an undo
    function of an async provider client)."""

    def __init__(self) -> None:
        self.loops: list[asyncio.AbstractEventLoop] = []

    @tool(description="Reserve", lookup="find", verify="released")
    @compensable(by="release")
    def reserve(self, sku: str) -> dict[str, str]:
        return {"sku": sku}

    async def release(self, ctx: CompensationContext) -> None:
        self.loops.append(asyncio.get_running_loop())

    async def find(self, key: str) -> LookupResult | None:
        self.loops.append(asyncio.get_running_loop())
        return None

    async def released(self, ctx: CompensationContext) -> bool:
        self.loops.append(asyncio.get_running_loop())
        return True


def test_async_compensations_of_a_sync_tool_also_run_on_the_runtime_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime started its shared loop only when a *tool* was async: an async
    compensation, lookup or verification of a sync tool got a fresh ``asyncio.run``
    loop per call, so a provider client bound to the loop of its first call (a
    connection pool) failed on every later one."""
    import uuid

    from participants import context
    from participants.runtime import ParticipantRuntime
    from schemas.settings import Settings

    monkeypatch.setattr(context, "_tool_loop", None)  # as in a fresh participant process
    bootstrap = f"memory://{uuid.uuid4().hex[:12]}"
    shop = SyncToolAsyncUndo()
    catalogue = wrap(shop, name="shop")
    settings = Settings(bootstrap=bootstrap, topic_prefix="t.", state_dir=tmp_path)
    runtime = ParticipantRuntime(catalogue, settings, bootstrap)
    loop = context.async_tool_loop()
    try:
        spec = catalogue["reserve"]
        ctx = CompensationContext("s-1", "reserve", {"sku": "a"}, {"sku": "a"}, "k-1")
        for _ in range(2):
            spec.compensate(ctx)
            spec.lookup("k-1")
            assert spec.verify(ctx) is True
        assert loop is not None
        assert shop.loops == [loop] * 6
    finally:
        runtime.handler.close()
        runtime.journal.close()
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
