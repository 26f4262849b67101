"""Generic fault injection around a user's tools: no change to their code.

:func:`instrument` returns a copy of a catalogue whose tools and compensations run
inside a wrapper that asks a :class:`FaultBoard` whether this call (saga, step) has a
fault armed, and injects it at the seam named. The wrapped functions are the user's
own; lookups and verifications are left untouched, because the drill uses them to
read the provider's real state afterwards.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from participants.catalogue import Catalogue, ToolSpec
from participants.context import current_call
from participants.runtime import SendThen
from sagaline.kafka import DeliveryFailed
from schemas import Record, StepCommitted

__all__ = ["DrillFault", "FaultBoard", "ProviderThrottled", "Seam", "instrument"]


class Seam(enum.StrEnum):
    """Where a fault is injected (seed 004, "Test failures at every seam")."""

    BEFORE_DISPATCH = "before-dispatch"
    BEFORE_RECEIPT = "after-dispatch-before-receipt"
    AFTER_COMMIT = "after-commit"
    LEDGER_APPEND = "during-ledger-append"
    DURING_COMPENSATION = "during-compensation"
    BEFORE_COMPENSATION_ACK = "after-compensation-before-ack"
    DUPLICATES = "duplicates"
    STALE_GENERATION = "stale-generation"
    CONCURRENT_CANCELLATION = "concurrent-cancellation"
    EXPIRED_APPROVAL = "expired-approval"
    THROTTLING = "provider-throttling"
    PARTIAL_OUTAGE = "partial-outage"


class DrillFault(Exception):
    """A provider error the drill injected (transient: the runtime retries it)."""


class ProviderThrottled(DrillFault):
    """The provider said "slow down" (HTTP 429): transient, retried with backoff."""


class FaultBoard:
    """Which (saga, step) has which fault armed, and what the wrappers saw.

    Thread-safe: the participant runtimes call the wrappers from their worker
    threads while the drill arms cases from its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[tuple[str, str], Seam] = {}
        self._fired: set[tuple[str, str, Seam]] = set()
        self.forward_runs: Counter[str] = Counter()  # idempotency key -> real runs that returned
        self.compensation_runs: Counter[str] = Counter()  # compensation key -> real runs
        self._running: dict[str, threading.Event] = {}
        self._released: dict[str, threading.Event] = {}

    def arm(self, saga_id: str, step_id: str, seam: Seam) -> None:
        with self._lock:
            self._armed[(saga_id, step_id)] = seam
            self._running.setdefault(saga_id, threading.Event())
            self._released.setdefault(saga_id, threading.Event())

    def armed(self, saga_id: str, step_id: str) -> Seam | None:
        with self._lock:
            return self._armed.get((saga_id, step_id))

    def fire_once(self, saga_id: str, step_id: str, seam: Seam) -> bool:
        """True the first time ``seam`` is due for this step: inject it now."""
        with self._lock:
            if self._armed.get((saga_id, step_id)) is not seam:
                return False
            if (saga_id, step_id, seam) in self._fired:
                return False
            self._fired.add((saga_id, step_id, seam))
            return True

    def mark_fired(self, saga_id: str, step_id: str, seam: Seam) -> None:
        with self._lock:
            self._fired.add((saga_id, step_id, seam))

    def fired(self, saga_id: str) -> bool:
        with self._lock:
            return any(f[0] == saga_id for f in self._fired)

    # -- concurrent cancellation: the tool waits until the agent's abort is written

    def tool_running(self, saga_id: str) -> threading.Event:
        with self._lock:
            return self._running.setdefault(saga_id, threading.Event())

    def abort_written(self, saga_id: str) -> threading.Event:
        with self._lock:
            return self._released.setdefault(saga_id, threading.Event())

    def ran(self, key: str) -> int:
        with self._lock:
            return self.forward_runs[key]

    def compensated(self, key: str) -> int:
        with self._lock:
            return self.compensation_runs[key]

    def _count(self, counter: Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    # -- the wrappers

    def before_tool(self) -> None:
        call = current_call()
        seam = self.armed(call.saga_id, call.step_id)
        if seam is Seam.THROTTLING and self.fire_once(call.saga_id, call.step_id, seam):
            raise ProviderThrottled("drill: the provider answered 429 Too Many Requests")
        if seam is Seam.CONCURRENT_CANCELLATION and self.fire_once(
            call.saga_id, call.step_id, seam
        ):
            self.tool_running(call.saga_id).set()
            self.abort_written(call.saga_id).wait(30)  # the agent cancels meanwhile

    def after_tool(self) -> None:
        call = current_call()
        self._count(self.forward_runs, call.idempotency_key)
        if self.fire_once(call.saga_id, call.step_id, Seam.BEFORE_RECEIPT):
            # TimeoutError is what the runtime sees when a deadline passes: the
            # provider committed, the answer never came back (R11).
            raise TimeoutError("drill: the provider committed but its answer was lost")

    def before_compensation(self) -> None:
        call = current_call()
        if self.fire_once(call.saga_id, call.step_id, Seam.DURING_COMPENSATION):
            raise DrillFault("drill: the provider failed in the middle of the compensation")

    def after_compensation(self) -> None:
        call = current_call()
        self._count(self.compensation_runs, call.compensation_key or call.idempotency_key)
        if self.fire_once(call.saga_id, call.step_id, Seam.BEFORE_COMPENSATION_ACK):
            raise TimeoutError("drill: the compensation was done but its acknowledgement was lost")

    def guard_append(self, append: Callable[[Record], None]) -> Callable[[Record], None]:
        """Wrap a runtime's ledger append: the first ``StepCommitted`` of an armed
        step is not acknowledged by the broker."""

        def guarded(record: Record) -> None:
            refused = self._refused(record)
            if refused is not None:
                raise refused
            append(record)

        return guarded

    def guard_send(self, send: SendThen) -> SendThen:
        """Wrap a runtime's loop send (``ParticipantRuntime.send``) the same way: the
        refused record's delivery report says so."""

        def guarded(
            record: Record,
            on_delivered: Callable[[DeliveryFailed | None], None],
            encoded: bytes | None,
        ) -> None:
            refused = self._refused(record)
            if refused is not None:
                on_delivered(refused)
                return
            send(record, on_delivered, encoded)

        return guarded

    def _refused(self, record: Record) -> DeliveryFailed | None:
        """The broker's refusal of ``record``: the first ``StepCommitted`` of an armed
        step is not acknowledged."""
        if isinstance(record, StepCommitted) and self.fire_once(
            record.saga_id, record.step_id, Seam.LEDGER_APPEND
        ):
            return DeliveryFailed(
                f"drill: the broker did not acknowledge {record.TYPE} of step {record.step_id}",
                topic="sagaline.events",
                error=None,
            )
        return None


def instrument(catalogue: Catalogue, board: FaultBoard) -> Catalogue:
    """A copy of ``catalogue`` whose tools and compensations report to ``board``."""
    specs: dict[str, ToolSpec] = {}
    for name, spec in catalogue.items():
        comp = spec.compensation_func
        specs[name] = dataclasses.replace(
            spec,
            func=_around(spec.func, board.before_tool, board.after_tool),
            compensation_func=(
                None
                if comp is None
                else _around(comp, board.before_compensation, board.after_compensation)
            ),
        )
    return Catalogue(catalogue.name, specs, catalogue.participants)


def _around(
    func: Callable[..., Any], before: Callable[[], None], after: Callable[[], None]
) -> Callable[..., Any]:
    """``func`` with ``before``/``after`` hooks, sync or async like ``func``."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            before()
            result = await func(*args, **kwargs)
            after()
            return result

        return run_async

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        before()
        result = func(*args, **kwargs)
        after()
        return result

    return run
