"""R12 across a saga's generations (R15), end to end on the real broker: a compensation
the provider only accepted, when the agent restarts the saga as a new run before the
completion arrives.

The new run re-issues the compensation under its own generation (same compensation
key), so the participant holds two accepted commands for the one provider operation;
the old one's answers are stale from then on. The provider's receipt must still
complete the step in the new run, and the compensation must still be one refund.

Time is driven (:class:`~tests.system.DrivenClock`): the completion deadline never
passes unless a test says so.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator_ledger import commands, fresh, rejections, terminal

from participants import (
    Accepted,
    BusinessRejection,
    CompensationContext,
    compensable,
    tool,
    wrap,
)
from participants.runtime import ParticipantRuntime
from schemas import (
    CompensateStep,
    CompensationAccepted,
    CompensationCommitted,
    IncidentRaised,
    Record,
    SagaOutcome,
    SagaStarted,
    SagaTerminal,
    TerminalStatus,
    new_event_id,
)
from services.dashboard.view import DashboardState
from tests.system import DrivenClock, System, wait_until

WAIT_S = 30
WAIT_MS = WAIT_S * 1000


class Tables:
    """A provider whose releases finish asynchronously and are confirmed by its
    receipt (no ``verify``). It honours the compensation key: a release asked again
    under the same key is the same operation, so one refund however often it is asked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked: Counter[str] = Counter()

    @tool(description="Hold a table; its release is confirmed by the provider's receipt")
    @compensable(by="release", completion_within=WAIT_S)
    def hold(self, table: str) -> str:
        return f"hold-{table}"

    def release(self, ctx: CompensationContext) -> Accepted:
        with self.lock:
            self.asked[ctx.compensation_key] += 1
        return Accepted(operation_id=f"release-{ctx.result}")

    @tool(description="Always refused")
    @compensable(by="undo_refuse")
    def refuse(self) -> str:
        raise BusinessRejection("no")

    def undo_refuse(self) -> None:
        pass


@pytest.fixture
def clock() -> DrivenClock:
    return DrivenClock()


@pytest.fixture
def world(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, clock: DrivenClock
) -> Iterator[tuple[System, Tables]]:
    tables = Tables()
    with System(
        kafka_bootstrap, unique_prefix, tmp_path, [wrap(tables, name="tables")], clock=clock
    ) as system:
        yield system, tables


def _of(records: list[Record], kind: type[Record], generation: int | None = None) -> list[Record]:
    return [
        r
        for r in records
        if isinstance(r, kind) and (generation is None or r.envelope.generation == generation)
    ]


def _fail_after_hold(system: System) -> str:
    with pytest.raises(Exception), system.client.saga("dinner", "tester") as saga:  # noqa: B017
        saga.call("hold", table="t7")
        saga.call("refuse")
    return saga.saga_id


def _accepted(system: System, saga_id: str, generation: int) -> CompensationAccepted:
    found = wait_until(
        lambda: _of(system.records(saga_id), CompensationAccepted, generation),
        60,
        f"the acceptance under generation {generation}",
    )
    record = found[0]
    assert isinstance(record, CompensationAccepted)
    return record


def _folded_as_accepted(system: System, saga_id: str, step_id: str) -> None:
    coordinator = system.coordinator
    assert coordinator is not None

    def folded() -> bool:
        state = coordinator.state_of(saga_id)
        return state is not None and state.steps[step_id].status.value != "COMPENSATING"

    wait_until(folded, 60, "the coordinator to fold the acceptance")
    state = coordinator.state_of(saga_id)
    assert state is not None and state.steps[step_id].status.value == "COMPENSATION_ACCEPTED"


def _restart_as_generation(system: System, saga_id: str, generation: int, now: int) -> None:
    """The agent starts the saga again as a new run (a higher-generation SagaStarted)."""
    [first] = _of(system.records(saga_id), SagaStarted, 1)
    assert isinstance(first, SagaStarted)
    envelope = first.envelope.model_copy(
        update={"generation": generation, "event_id": new_event_id(), "occurred_at": now}
    )
    system.client.append(first.model_copy(update={"envelope": envelope}))


def _terminal(system: System, saga_id: str) -> tuple[SagaTerminal, list[Record]]:
    def ended() -> list[Record] | None:
        records = system.records(saga_id)
        return records if _of(records, SagaTerminal) else None

    records = wait_until(ended, 60, "the terminal record")
    [terminal] = _of(records, SagaTerminal)
    assert isinstance(terminal, SagaTerminal)
    return terminal, records


def test_a_receipt_after_a_new_generation_completes_the_step_in_the_new_run_R12_R15(
    world: tuple[System, Tables], clock: DrivenClock
) -> None:
    system, tables = world
    saga_id = _fail_after_hold(system)
    first = _accepted(system, saga_id, 1)
    _folded_as_accepted(system, saga_id, first.step_id)

    _restart_as_generation(system, saga_id, 2, clock())
    again = _accepted(system, saga_id, 2)  # the new run asked again; the provider said the same
    assert again.provider_operation_id == first.provider_operation_id

    handler = system._runtimes[0].handler
    assert handler.complete_accepted(str(first.provider_operation_id)) is True
    # complete_accepted appends before it returns: the new run's completion is there
    completions = _of(system.records(saga_id), CompensationCommitted)
    assert _of(completions, CompensationCommitted, 2), (
        "the provider's one receipt completed only the old run's command, whose "
        "completion the coordinator rejects as stale: generations "
        f"{[r.envelope.generation for r in completions]}"
    )

    terminal, records = _terminal(system, saga_id)  # the clock never moved: no deadline
    assert terminal.status is TerminalStatus.COMPENSATED
    assert _of(records, IncidentRaised) == []
    assert _of(records, CompensationCommitted, 1) == []  # the old run's: settled, not sent
    assert sum(tables.asked.values()) <= 2 and len(tables.asked) == 1  # one key: one refund


def test_a_receipt_the_old_run_took_before_the_new_run_asked_again_still_completes_R12_R15(
    world: tuple[System, Tables], clock: DrivenClock
) -> None:
    # The agent restarts the saga while the participant is down; the provider's one
    # receipt reaches the participant before it reads the new run's command, so it
    # completes the old run's. That completion answers the very compensation the
    # step still awaits (same attempt, same key): the effect is undone, and no later
    # receipt will come to say so again.
    system, _tables = world
    saga_id = _fail_after_hold(system)
    first = _accepted(system, saga_id, 1)
    _folded_as_accepted(system, saga_id, first.step_id)
    system.stop_participant(system._runtimes[0])

    _restart_as_generation(system, saga_id, 2, clock())
    coordinator = system.coordinator
    assert coordinator is not None
    wait_until(
        lambda: (s := coordinator.state_of(saga_id)) is not None and s.generation == 2,
        60,
        "the coordinator to take the new run",
    )

    # the participant's journal, before its loop reads the new run's command
    offline = ParticipantRuntime(
        system.catalogues[0], system.settings, system.bootstrap, clock=clock
    )
    try:
        assert offline.handler.complete_accepted(str(first.provider_operation_id)) is True
    finally:
        offline.handler.close()
        offline._writer.close()
        offline.journal.close()
    [completion] = _of(system.records(saga_id), CompensationCommitted)
    assert completion.envelope.generation == 1

    def decided() -> bool:
        state = coordinator.state_of(saga_id)
        return state is None or state.is_terminal or completion.event_id in state.seen

    wait_until(decided, 60, "the coordinator to decide the completion")
    state = coordinator.state_of(saga_id)
    status = None if state is None else state.steps[first.step_id].status.value
    assert status in (None, "COMPENSATED"), (
        f"the completion of the compensation the step awaits was refused as stale: {status}"
    )
    terminal, records = _terminal(system, saga_id)  # the clock never moved: no deadline
    assert terminal.status is TerminalStatus.COMPENSATED
    assert _of(records, IncidentRaised) == []


def _answering(record: Record, command: Record, generation: int) -> Record:
    """``record`` as the participant writes it: under its command's generation, caused
    by it."""
    envelope = record.envelope.model_copy(
        update={"generation": generation, "causation_id": command.event_id}
    )
    return record.model_copy(update={"envelope": envelope})


def test_the_old_runs_completion_of_the_awaited_compensation_counts_in_core_and_view_R12_R15() -> (
    None
):
    """The coordinator's core and the dashboard's fold read it alike: the completion of
    the attempt the step awaits counts whatever run's command it answers; any other
    record of the old run (an answer to another command) is still stale."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.intent("hold"))
    h.feed(ledger.committed("hold"))
    [command] = commands(h.feed(ledger.end(SagaOutcome.ABORT, "agent gave up")), CompensateStep)
    assert command.envelope.generation == 1
    h.feed(_answering(ledger.comp_accepted("hold"), command, 1))
    assert h.status("hold") == "COMPENSATION_ACCEPTED"
    ledger.generation = 2
    [again] = commands(h.feed(ledger.started()), CompensateStep)
    assert again.envelope.generation == 2

    forged = _answering(ledger.comp_committed("hold"), again, 1)  # names no gen-1 command
    assert [o.reason for o in rejections(h.feed(forged))] == ["stale-generation"]
    out = h.feed(_answering(ledger.comp_committed("hold"), command, 1))
    assert rejections(out) == []
    assert h.status("hold") == "COMPENSATED"
    ended = terminal(out)
    assert ended is not None and ended.status is TerminalStatus.COMPENSATED

    view = DashboardState()
    for record in h.log:
        view.apply(record)
    saga = view.sagas[ledger.saga_id]
    assert saga.steps["hold"].state == "compensated"
    assert view.stale_records == 1  # the forged one only
