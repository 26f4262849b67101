"""The ten assertions of seed 004's saga-ledger fixture, against the SDK and the
coordinator on the real broker.

The seed's fixture runs reserve, charge, email (email fails) and expects the charge
then the reservation undone; then a clean two-step saga; then an empty saga. Here
each step is a real tool of a participant service, the unwind is decided by the
coordinator from the ledger, and the outcome is read from the saga's receipt.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from participants import BusinessRejection, CompensationContext, compensable, tool, wrap
from participants.client import BusinessRejected
from schemas import Disposition, TerminalStatus
from tests.system import System

pytestmark = pytest.mark.kafka


class Steps:
    """The fixture's `step(name, fail)`: every do and undo is recorded, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def _log(self, entry: str) -> None:
        with self._lock:
            self.events.append(entry)

    def _do(self, name: str, fail: bool = False) -> str:
        self._log(f"do:{name}")
        if fail:
            raise BusinessRejection(name)
        return name

    @tool(description="reserve")
    @compensable(by="undo_reserve")
    def reserve(self) -> str:
        return self._do("reserve")

    def undo_reserve(self, ctx: CompensationContext) -> None:
        self._log(f"undo:{ctx.result}")

    @tool(description="charge")
    @compensable(by="undo_charge")
    def charge(self) -> str:
        return self._do("charge")

    def undo_charge(self, ctx: CompensationContext) -> None:
        self._log(f"undo:{ctx.result}")

    @tool(description="email (fails)")
    @compensable(by="undo_email")
    def email(self) -> str:
        return self._do("email", fail=True)

    def undo_email(self) -> None:
        self._log("undo:email")

    @tool(description="a")
    @compensable(by="undo_a")
    def a(self) -> str:
        return self._do("a")

    def undo_a(self) -> None:
        self._log("undo:a")

    @tool(description="b")
    @compensable(by="undo_b")
    def b(self) -> str:
        return self._do("b")

    def undo_b(self) -> None:
        self._log("undo:b")


@pytest.fixture
def system(transport: str, unique_prefix: str, tmp_path: Path) -> Iterator[System]:
    steps = Steps()
    with System(transport, unique_prefix, tmp_path, [wrap(steps, name="fixture")]) as s:
        s.steps = steps  # type: ignore[attr-defined]
        yield s


def test_seed004_fixture_ten_assertions(system: System) -> None:
    steps: Steps = system.steps  # type: ignore[attr-defined]
    client = system.client
    n = 0

    # reserve, charge, email (fails) -> compensated: undo charge, then undo reserve.
    failure: BusinessRejected | None = None
    try:
        with client.saga("fixture", "tester") as failed:
            failed.call("reserve")
            failed.call("charge")
            failed.call("email")
    except BusinessRejected as exc:
        failure = exc
    receipt = failed.wait(60)
    assert receipt.status is TerminalStatus.COMPENSATED
    n += 1
    assert steps.events == ["do:reserve", "do:charge", "do:email", "undo:charge", "undo:reserve"]
    n += 1
    committed = [s for s in receipt.steps if s.disposition is Disposition.COMPENSATED]
    assert [s.tool for s in committed] == ["reserve", "charge"]
    n += 1
    assert failure is not None and failure.tool == "email"
    n += 1

    # A clean two-step saga.
    steps.events.clear()
    error: Exception | None = None
    try:
        with client.saga("fixture", "tester") as done:
            done.call("a")
            done.call("b")
    except Exception as exc:  # pragma: no cover - the assertion below reports it
        error = exc
    receipt = done.wait(60)
    assert receipt.status is TerminalStatus.COMPLETED
    n += 1
    assert [s.disposition for s in receipt.steps] == [Disposition.RETAINED] * 2
    n += 1
    assert steps.events == ["do:a", "do:b"]
    n += 1
    assert error is None
    n += 1

    # An empty saga.
    with client.saga("fixture", "tester") as empty:
        pass
    receipt = empty.wait(60)
    assert receipt.steps == []
    n += 1
    assert receipt.status is TerminalStatus.COMPLETED
    n += 1

    assert n == 10
