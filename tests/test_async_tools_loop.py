"""Async tools run on one long-lived event loop of the participant process, with
their call context, instead of a fresh ``asyncio.run`` per call."""

from __future__ import annotations

import asyncio

from participants import CompensationContext, compensable, current_call, tool, wrap
from participants.context import CallContext, call_context, serve_async_tools


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
