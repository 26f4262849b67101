"""R12, durably, end to end: a compensation the provider only accepted is done when its
completion is confirmed, and otherwise ends in exactly one incident at the declared
deadline after the acceptance, whatever happens to the participant meanwhile.

Time is driven, not waited for: the coordinator and the participants read one
:class:`~tests.system.DrivenClock` that moves only when the test says, so "late" and
"past the deadline" are facts of the test, not races with a busy machine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from participants import (
    Accepted,
    BusinessRejection,
    CatalogueError,
    CompensationContext,
    compensable,
    tool,
    wrap,
)
from participants.catalogue import Catalogue
from schemas import (
    CompensationAccepted,
    CompensationCommitted,
    IncidentRaised,
    Record,
    SagaTerminal,
    TerminalStatus,
)
from tests.system import DrivenClock, System, wait_until

WAIT_S = 30  # the declared completion wait; driven time, so its size costs nothing
WAIT_MS = WAIT_S * 1000


class Bookings:
    """A provider whose cancellations finish asynchronously: ``cancel`` answers
    Accepted and the booking is gone only when the test says the provider finished."""

    def __init__(self) -> None:
        self.finished: set[str] = set()
        self.lock = threading.Lock()

    @tool(description="Book a slot", verify="cancelled")
    @compensable(by="cancel", completion_within=WAIT_S)
    def book(self, slot: str) -> str:
        return f"bk-{slot}"

    def cancel(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"cancel-{ctx.result}")

    def cancelled(self, ctx: CompensationContext) -> bool:
        with self.lock:
            return f"cancel-{ctx.result}" in self.finished

    def finish(self, operation_id: str) -> None:
        with self.lock:
            self.finished.add(operation_id)

    @tool(description="Always refused")
    @compensable(by="undo_refuse")
    def refuse(self) -> str:
        raise BusinessRejection("no")

    def undo_refuse(self) -> None:
        pass

    @tool(description="Hold a table; its release is confirmed by the provider's receipt")
    @compensable(by="release", completion_within=WAIT_S)
    def hold(self, table: str) -> str:
        return f"hold-{table}"

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.result}")


@pytest.fixture
def clock() -> DrivenClock:
    return DrivenClock()


@pytest.fixture
def world(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, clock: DrivenClock
) -> Iterator[tuple[System, Bookings, Catalogue]]:
    bookings = Bookings()
    catalogue = wrap(bookings, name="bookings")
    with System(kafka_bootstrap, unique_prefix, tmp_path, [catalogue], clock=clock) as system:
        yield system, bookings, catalogue


def _fail_after(system: System, tool_name: str = "book", **args: str) -> str:
    """A saga that books a slot, then fails: the booking's cancel is accepted."""
    with pytest.raises(Exception), system.client.saga("trip", "tester") as saga:  # noqa: B017
        saga.call(tool_name, **(args or {"slot": "s1"}))
        saga.call("refuse")
    return saga.saga_id


def _of(records: list[Record], kind: type[Record]) -> list[Record]:
    return [r for r in records if isinstance(r, kind)]


def _accepted(system: System, saga_id: str) -> CompensationAccepted:
    found = wait_until(
        lambda: _of(system.records(saga_id), CompensationAccepted), 60, "the acceptance"
    )
    record = found[0]
    assert isinstance(record, CompensationAccepted)
    return record


def _terminal(system: System, saga_id: str) -> tuple[SagaTerminal, list[Record]]:
    def ended() -> list[Record] | None:
        records = system.records(saga_id)
        return records if _of(records, SagaTerminal) else None

    records = wait_until(ended, 60, "the terminal record")
    [terminal] = _of(records, SagaTerminal)
    assert isinstance(terminal, SagaTerminal)
    return terminal, records


def _still_waiting(system: System, accepted: CompensationAccepted) -> None:
    """The coordinator holds the step as accepted, not done, and the saga open."""
    coordinator = system.coordinator
    assert coordinator is not None
    saga_id, step_id = accepted.saga_id, accepted.step_id

    def folded() -> bool:
        state = coordinator.state_of(saga_id)
        return state is not None and state.steps[step_id].status.value in (
            "COMPENSATION_ACCEPTED",
            "COMPENSATED",
            "COMPENSATION_FAILED",
        )

    wait_until(folded, 60, "the coordinator to fold the acceptance")
    state = coordinator.state_of(saga_id)
    assert state is not None and not state.is_terminal
    assert state.steps[step_id].status.value == "COMPENSATION_ACCEPTED"


def test_a_late_completion_compensates_only_once_it_arrives_R12(
    world: tuple[System, Bookings, Catalogue], clock: DrivenClock
) -> None:
    system, bookings, _catalogue = world
    saga_id = _fail_after(system)
    accepted = _accepted(system, saga_id)
    clock.advance(WAIT_MS // 2)  # half the wait, still no completion
    _still_waiting(system, accepted)
    assert not _of(system.records(saga_id), SagaTerminal)

    bookings.finish(str(accepted.provider_operation_id))
    terminal, records = _terminal(system, saga_id)
    assert terminal.status is TerminalStatus.COMPENSATED
    [completion] = _of(records, CompensationCommitted)
    assert completion.verified is True  # type: ignore[attr-defined]
    assert records.index(completion) < records.index(terminal)
    assert _of(records, IncidentRaised) == []


def test_no_completion_is_one_incident_at_the_declared_deadline_R12(
    world: tuple[System, Bookings, Catalogue], clock: DrivenClock
) -> None:
    system, _bookings, _catalogue = world
    saga_id = _fail_after(system)
    accepted = _accepted(system, saga_id)
    clock.advance(WAIT_MS - 1)
    _still_waiting(system, accepted)
    clock.advance(1)

    terminal, records = _terminal(system, saga_id)
    assert terminal.status is TerminalStatus.ESCALATED
    [incident] = _of(records, IncidentRaised)
    assert isinstance(incident, IncidentRaised)
    assert incident.kind == "compensation-not-completed"
    assert incident.envelope.occurred_at == accepted.envelope.occurred_at + WAIT_MS
    assert f"provider operation {accepted.provider_operation_id}" in incident.inconsistency
    assert _of(records, CompensationCommitted) == []


@pytest.mark.parametrize("completes_while_down", [True, False], ids=["completes", "never"])
def test_participant_restarted_repeatedly_does_not_move_the_deadline_R12(
    world: tuple[System, Bookings, Catalogue], clock: DrivenClock, completes_while_down: bool
) -> None:
    system, bookings, catalogue = world
    saga_id = _fail_after(system)
    accepted = _accepted(system, saga_id)
    runtime = system._runtimes[0]
    for _ in range(3):  # down, a quarter of the wait passes, up again: the wait goes on
        system.stop_participant(runtime)
        clock.advance(WAIT_MS // 4)
        runtime = system.start_participant(catalogue)
        _still_waiting(system, accepted)
    system.stop_participant(runtime)  # and now it stays down
    if completes_while_down:
        bookings.finish(str(accepted.provider_operation_id))
        _still_waiting(system, accepted)  # nobody has confirmed it yet
        system.start_participant(catalogue)
        terminal, records = _terminal(system, saga_id)
        assert terminal.status is TerminalStatus.COMPENSATED
        assert _of(records, IncidentRaised) == []
        return
    clock.advance(WAIT_MS)  # far past the deadline, the participant still down
    terminal, records = _terminal(system, saga_id)
    assert terminal.status is TerminalStatus.ESCALATED
    [incident] = _of(records, IncidentRaised)
    assert incident.envelope.occurred_at == accepted.envelope.occurred_at + WAIT_MS


def test_without_verify_the_providers_receipt_completes_it_R12(
    world: tuple[System, Bookings, Catalogue], clock: DrivenClock
) -> None:
    system, _bookings, _catalogue = world
    saga_id = _fail_after(system, "hold", table="t7")
    accepted = _accepted(system, saga_id)
    clock.advance(WAIT_MS // 2)
    _still_waiting(system, accepted)
    handler = system._runtimes[0].handler
    assert handler.complete_accepted("no-such-operation") is False
    assert handler.complete_accepted(str(accepted.provider_operation_id)) is True
    terminal, records = _terminal(system, saga_id)
    assert terminal.status is TerminalStatus.COMPENSATED
    [completion] = _of(records, CompensationCommitted)
    assert completion.verified is None  # type: ignore[attr-defined]
    assert completion.provider_operation_id == accepted.provider_operation_id  # type: ignore[attr-defined]


def test_a_compensation_that_can_answer_accepted_must_declare_its_wait_R12() -> None:
    class Undeclared:
        @tool(description="Book")
        @compensable(by="cancel")
        def book(self) -> str:
            return "b"

        def cancel(self, ctx: CompensationContext) -> Accepted | None:
            return None

    with pytest.raises(CatalogueError) as caught:
        wrap(Undeclared(), name="p")
    [problem] = caught.value.problems
    assert "can return Accepted but declares no completion wait" in problem.message
    assert "completion_within=" in problem.message


def test_a_declared_wait_on_a_compensation_that_never_answers_accepted_is_refused() -> None:
    class Misdeclared:
        @tool(description="Book")
        @compensable(by="cancel", completion_within=5)
        def book(self) -> str:
            return "b"

        def cancel(self, ctx: CompensationContext) -> None:
            return None

    with pytest.raises(CatalogueError) as caught:
        wrap(Misdeclared(), name="p")
    assert "never Accepted" in caught.value.problems[0].message


def test_the_declared_wait_is_in_the_step_contract_R12() -> None:
    contract = wrap(Bookings(), name="bookings").contracts()["book"]
    assert contract.completion_within_ms == WAIT_MS
    assert contract.has_verify is True


class BookingsRenamed:
    """The next deploy of ``bookings``: ``book`` is gone (renamed ``reserve``)."""

    @tool(description="Reserve a slot")
    @compensable(by="unreserve")
    def reserve(self, slot: str) -> str:
        return f"rs-{slot}"

    def unreserve(self, ctx: CompensationContext) -> None:
        pass


def test_an_accepted_compensation_whose_tool_a_redeploy_removed_goes_to_a_person_R12(
    world: tuple[System, Bookings, Catalogue], clock: DrivenClock
) -> None:
    # R12/R3: restarted without the tool, the participant cannot confirm the
    # completion. It says so at once (no traceback, no waiting out the deadline):
    # one incident names the missing tool and the provider operation to check.
    system, _bookings, _catalogue = world
    saga_id = _fail_after(system)
    accepted = _accepted(system, saga_id)
    _still_waiting(system, accepted)
    system.stop_participant(system._runtimes[0])
    system.start_participant(wrap(BookingsRenamed(), name="bookings"))

    terminal, records = _terminal(system, saga_id)  # the clock never moved: no deadline
    assert terminal.status is TerminalStatus.ESCALATED
    [incident] = _of(records, IncidentRaised)
    assert isinstance(incident, IncidentRaised)
    assert incident.kind == "compensation-failed"
    assert "no longer serves tool 'book'" in incident.inconsistency
    assert str(accepted.provider_operation_id) in incident.inconsistency
    assert _of(records, CompensationCommitted) == []
