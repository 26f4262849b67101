"""The call a tool is running for: saga, step and, above all, its idempotency key.

A tool's argument schema is what the agent (or a language model) sees, so the key is
not an argument. The participant runtime sets this context around every tool,
compensation, lookup and verification call; a tool passes ``current_call()
.idempotency_key`` to its provider so a retry or a redelivery lands on the same
operation instead of creating a second one.

Example::

    @tool(description="Issue a store credit", pivot=True, lookup="find_credit")
    @compensable(by="void_credit")
    def issue_credit(self, order_id: str, amount_cents: int) -> dict[str, str]:
        key = current_call().idempotency_key
        return {"credit_id": self.ledger.credit(order_id, amount_cents, key=key)}
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class CallContext:
    """Who is calling a tool, and under which key."""

    saga_id: str
    step_id: str
    tool: str
    idempotency_key: str
    attempt: int = 1
    principal: str = ""
    compensation_key: str | None = None  # set while a compensation runs


class NoCallContext(RuntimeError):
    """``current_call()`` was used outside a runtime call (e.g. a tool called by hand)."""


_current: ContextVar[CallContext | None] = ContextVar("sagaline_call", default=None)


def current_call() -> CallContext:
    """The context of the call in progress; raises NoCallContext outside one."""
    ctx = _current.get()
    if ctx is None:
        raise NoCallContext(
            "no Sagaline call is in progress: tools read current_call() only when the "
            "participant runtime (or call_context() in a test) runs them"
        )
    return ctx


@contextlib.contextmanager
def call_context(ctx: CallContext) -> Iterator[CallContext]:
    """Run a block as the call ``ctx`` (the runtime uses it; tests may too)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


_deadline: ContextVar[float | None] = ContextVar("sagaline_deadline", default=None)


def call_deadline() -> float | None:
    """When (``time.monotonic()``) the call in progress stops counting, if it has a
    deadline: an async tool still running then is cancelled (its outcome is what the
    deadline says, R11)."""
    return _deadline.get()


@contextlib.contextmanager
def deadline_at(when: float) -> Iterator[None]:
    """Run a block under the deadline ``when`` (``time.monotonic()``; the runtime)."""
    token = _deadline.set(when)
    try:
        yield
    finally:
        _deadline.reset(token)


# One long-lived event loop per process for async tools: a participant runtime runs
# its async tools, compensations, lookups and verifications there (with their call
# context) instead of in a fresh ``asyncio.run`` per call, so connections and other
# loop-bound resources of a tool live across calls.
_tool_loop: asyncio.AbstractEventLoop | None = None
_tool_loop_lock = threading.Lock()


def serve_async_tools() -> asyncio.AbstractEventLoop:
    """Start (once per process) the event loop async tools run on; returns it."""
    global _tool_loop
    with _tool_loop_lock:
        if _tool_loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=loop.run_forever, name="sagaline-async-tools", daemon=True
            ).start()
            _tool_loop = loop
        return _tool_loop


def async_tool_loop() -> asyncio.AbstractEventLoop | None:
    """The loop started by :func:`serve_async_tools`, if any."""
    return _tool_loop
