"""The agent-side saga client on the real broker: local tools, async use, typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError

from participants import (
    BusinessRejection,
    CompensationContext,
    Reversibility,
    compensable,
    readiness,
    tool,
    wrap,
)
from participants import client as client_module
from participants.client import (
    ApprovalDeniedError,
    ApprovalPending,
    AsyncSaga,
    BusinessRejected,
    CallRefused,
    ClientStopped,
    InvalidSagaId,
    OutcomeUnknown,
    Saga,
    SagaCallError,
    SagaClient,
    SagaHistoryUnreadable,
    SagaUnwinding,
    UnknownTool,
)
from participants.plan import PlannedCall, PlanReport
from participants.readiness import CoordinatorNotRunning
from sagaline.kafka import DeliveryFailed, LedgerReader, TopicMissing, ensure_topics
from sagaline.ops.actions import OperatorChannel, deny_approval, grant_approval
from schemas import (
    ApprovalRequested,
    CompensationRequested,
    Disposition,
    Record,
    RetryPolicy,
    SagaEndRequested,
    SagaOutcome,
    SagaStarted,
    SagaTerminal,
    StepCommitted,
    StepFailed,
    StepScheduled,
    TerminalStatus,
)
from schemas.limits import Limits
from schemas.settings import Settings
from services import demo
from services.demo import RefundAgent
from services.demo_processes import wait_until
from services.refund.agent import CheckedPlan, Ticket, TicketKind
from tests.system import System

pytestmark = pytest.mark.kafka


class Desk:
    """Tools the agent runs in its own process (a local catalogue)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()

    @tool(description="Book a slot")
    @compensable(by="free_slot", reversibility=Reversibility.REVERSIBLE)
    def book_slot(self, day: str) -> dict[str, str]:
        with self.lock:
            self.log.append(f"book:{day}")
        return {"slot": f"slot-{day}"}

    def free_slot(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.log.append(f"free:{ctx.result['slot']}")

    @tool(description="Always refuses")
    @compensable(by="nothing")
    def refuse(self) -> None:
        raise BusinessRejection("no slots on Sundays")

    def nothing(self) -> None:
        return None

    @tool(description="Charge a card", secret_fields=("card",))
    @compensable(by="refund_card")
    def charge_card(self, amount: int, card: str) -> dict[str, str]:
        with self.lock:
            self.log.append(f"charge:{amount}:{card}")
        return {"charge": f"ch-{amount}"}

    def refund_card(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.log.append(f"refund:{ctx.input['card']}")

    @tool(description="Fails once, then books", retry=RetryPolicy(initial_backoff_ms=10))
    @compensable(by="nothing")
    def flaky(self, day: str) -> dict[str, str]:
        with self.lock:
            self.log.append(f"flaky:{day}")
            if self.log.count(f"flaky:{day}") == 1:
                raise ConnectionError("the provider hung up")
        return {"slot": f"slot-{day}"}

    @tool(description="Announce publicly")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def announce(self, text: str) -> str:
        return text


@pytest.fixture
def local(transport: str, unique_prefix: str, tmp_path: Path) -> Iterator[tuple[System, Desk]]:
    desk = Desk()
    # The system runs only the coordinator here; the desk is served by the client.
    with System(transport, unique_prefix, tmp_path, []) as system:
        client = SagaClient(
            system.settings, transport, local=wrap(desk, name="desk"), call_timeout_s=30
        )
        client.start()
        system.client.close()  # the default client is replaced by the local one
        system.client = client
        yield system, desk


def test_a_local_tool_is_called_and_compensated_through_the_ledger_R1(
    local: tuple[System, Desk],
) -> None:
    system, desk = local
    with pytest.raises(BusinessRejected), system.client.saga("desk", "agent") as saga:
        assert saga.call("book_slot", day="mon") == {"slot": "slot-mon"}
        saga.call("refuse")
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert desk.log == ["book:mon", "free:slot-mon"]
    assert [s.disposition for s in receipt.steps] == [
        Disposition.COMPENSATED,
        Disposition.NOT_COMMITTED,
    ]


def test_the_client_keeps_only_records_a_wait_reads_and_lets_a_saga_go_once_terminal(
    local: tuple[System, Desk],
) -> None:
    system, _desk = local
    ledger = system.client._ledger
    with pytest.raises(BusinessRejected), system.client.saga("desk", "agent") as saga:
        feed = ledger._feeds[saga.saga_id]  # let go once terminal: read it from here
        saga.call("book_slot", day="wed")
        saga.call("refuse")
    assert _terminal_arrived(system.client, saga.saga_id)
    kept = {type(r) for r in feed.records}
    # The listener skipped the saga's start, scheduled steps, intents and
    # compensation progress before decoding them; what a wait reads is there.
    assert kept <= client_module.AWAITED
    assert {StepCommitted, StepFailed, CompensationRequested, SagaTerminal} <= kept
    receipt = saga.wait(60)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert not ledger.follows(saga.saga_id)  # a long-lived agent keeps nothing of it
    assert saga.wait(0) == receipt  # asked again: the same receipt, no second wait


def test_sagas_nobody_waits_for_are_let_go_once_terminal_and_a_later_wait_still_answers(
    local: tuple[System, Desk],
) -> None:
    """The documented use ends a saga with its block and never calls wait(), sync or
    ``async with``: the client kept each such saga's records for as long as it lived,
    so a long-lived agent grew without bound. A saga is let go once its terminal
    record arrives; a wait() after the block still returns the receipt (R1)."""
    system, _desk = local
    ledger = system.client._ledger
    sagas: list[Saga | AsyncSaga] = []
    for n in range(8):
        with contextlib.suppress(SagaCallError), system.client.saga("desk", "agent") as saga:
            saga.call("book_slot", day=f"d{n}")
            if n % 2:
                saga.call("refuse")  # aborted and compensated: let go all the same
        sagas.append(saga)

    async def agent(n: int) -> AsyncSaga:
        async with system.client.saga("desk", "agent") as asaga:
            await asaga.call("book_slot", day=f"a{n}")
        return asaga

    async def agents() -> list[AsyncSaga]:
        return await asyncio.gather(*(agent(n) for n in range(8)))

    sagas.extend(asyncio.run(agents()))
    ids = [s.saga_id for s in sagas]
    assert all(_terminal_arrived(system.client, saga_id) for saga_id in ids)
    assert [i for i in ids if ledger.follows(i)] == []  # no feed, no records kept
    assert ledger._feeds == {}
    assert {type(r) for r in ledger._ended.values()} == {SagaTerminal}  # all it keeps
    statuses = [
        asyncio.run(s.wait(60)).status if isinstance(s, AsyncSaga) else s.wait(60).status
        for s in sagas
    ]
    assert (
        statuses
        == [TerminalStatus.COMPENSATED if n % 2 else TerminalStatus.COMPLETED for n in range(8)]
        + [TerminalStatus.COMPLETED] * 8
    )


def test_a_client_keeps_the_terminal_records_of_its_most_recently_ended_sagas_only(
    local: tuple[System, Desk],
) -> None:
    """What a wait() after the block needs is kept for ``ended_sagas_kept`` sagas,
    the newest; a wait on an older one says where its receipt is instead of timing
    out."""
    system, desk = local
    client = SagaClient(
        system.settings, system.bootstrap, catalogues=[wrap(desk, name="desk")], ended_sagas_kept=2
    )
    with client:
        sagas = []
        for n in range(3):
            with client.saga("desk", "agent") as saga:
                saga.call("book_slot", day=f"k{n}")
            assert _terminal_arrived(client, saga.saga_id)
            sagas.append(saga)
        assert list(client._ledger._ended) == [s.saga_id for s in sagas[1:]]
        oldest = sagas[0].saga_id
        with pytest.raises(TimeoutError, match=f"sagaline saga show {oldest}"):
            sagas[0].wait(60)
        assert [s.wait(60).status for s in sagas[1:]] == [TerminalStatus.COMPLETED] * 2


def test_a_saga_left_open_for_an_approval_keeps_its_records_for_resume_after_it_ended_R7(
    local: tuple[System, Desk],
) -> None:
    """A saga left open on ApprovalPending may end without the agent (the approval is
    denied, the saga compensated); resume() then still says why its step did not run,
    from the records, not only that the saga is over."""
    system, desk = local
    with pytest.raises(ApprovalPending) as err, system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="fri")
        saga.call("announce", text="hello", timeout_s=3)
    pending = err.value
    request = next(
        r
        for r in system.records(saga.saga_id)
        if isinstance(r, ApprovalRequested) and r.step_id == pending.step_id
    )
    channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
    deny_approval(channel, request, operator="ops:alice", reason="not today")
    channel.close()
    assert _terminal_arrived(system.client, saga.saga_id)
    assert system.client._ledger.follows(saga.saga_id)  # held for resume()
    with pytest.raises(ApprovalDeniedError, match="not today"):
        saga.resume(pending.step_id)
    assert saga.wait(60).status is TerminalStatus.COMPENSATED
    assert not system.client._ledger.follows(saga.saga_id)  # waited for: let go
    assert desk.log == ["book:fri", "free:slot-fri"]


def test_approval_pending_names_the_command_that_approves_its_step_R7(
    local: tuple[System, Desk],
) -> None:
    """The error an agent (or its log) shows says what to run: the approve command
    with this saga's id and step id, not the usage line `sagaline approve SAGA STEP`
    with the two left for the reader to dig out of the exception's attributes."""
    system, _desk = local
    with pytest.raises(ApprovalPending) as err, system.client.saga("desk", "agent") as saga:
        saga.call("announce", text="hello", timeout_s=3)
    pending = err.value
    assert f"(sagaline approve {saga.saga_id} {pending.step_id})" in str(pending)
    saga.end(SagaOutcome.ABORT, "test over")
    assert saga.wait(60).status is TerminalStatus.COMPENSATED


def test_held_sagas_that_ended_are_kept_for_the_most_recently_ended_only_R7(
    local: tuple[System, Desk],
) -> None:
    """A saga held for resume() (left open on ApprovalPending, or attach()ed) kept all
    its records until end() or wait(), also once it had ended: an agent that left
    sagas open for a person who never answered (the approval expired, an operator
    aborted them), or attached sagas to read their results, kept every one of them for
    as long as it lived. Once ended, held sagas are kept like the terminal records of
    ended ones: the ``ended_sagas_kept`` most recent."""
    system, desk = local
    ids = []
    for n in range(3):
        with system.client.saga("desk", "agent") as saga:
            saga.call("book_slot", day=f"h{n}")
        assert saga.wait(60).status is TerminalStatus.COMPLETED
        ids.append(saga.saga_id)
    with SagaClient(
        system.settings, system.bootstrap, catalogues=[wrap(desk, name="desk")], ended_sagas_kept=2
    ) as small:
        views = [small.saga("desk", "agent", saga_id=i).attach() for i in ids]
        assert [v.results for v in views] == [
            {"01-book_slot": {"slot": f"slot-h{n}"}} for n in range(3)
        ]
        assert sorted(small._ledger._feeds) == sorted(ids[1:])  # the oldest is let go
        # The newest still answer from their records; every one with its receipt
        # while it is among the most recently ended.
        assert views[2].resume("01-book_slot") == {"slot": "slot-h2"}
        assert [v.wait(0).status for v in views[1:]] == [TerminalStatus.COMPLETED] * 2
        assert small._ledger._feeds == {}


def test_async_with_completes_the_saga(local: tuple[System, Desk]) -> None:
    system, desk = local

    async def agent() -> TerminalStatus:
        async with system.client.saga("desk", "agent") as saga:
            await saga.acall("book_slot", day="tue")
        return (await saga.await_terminal(60)).status

    assert asyncio.run(agent()) is TerminalStatus.COMPLETED
    assert desk.log == ["book:tue"]


def test_a_wait_given_up_on_a_closed_event_loop_leaves_nothing_to_stop_the_listener(
    local: tuple[System, Desk],
) -> None:
    """An asyncio wait that gave up (timed out or cancelled) leaves no future behind:
    the next record of its saga would otherwise be handed to a loop that has closed
    since (``asyncio.run`` returned), and the one listener every saga of the client
    shares would die on it, leaving every later wait to time out."""
    system, _desk = local
    ledger = system.client._ledger
    with system.client.saga("desk", "agent") as saga:
        with pytest.raises(TimeoutError):
            asyncio.run(saga.await_terminal(0))  # gives up at once; its loop then closes

        async def cancelled() -> None:
            waiting = asyncio.create_task(saga.await_terminal(60))
            while not ledger._feeds[saga.saga_id].futures:  # until it waits
                await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

        asyncio.run(cancelled())
        assert ledger._feeds[saga.saga_id].futures == []
        assert saga.call("book_slot", day="sun") == {"slot": "slot-sun"}
    assert saga.wait(60).status is TerminalStatus.COMPLETED


def test_a_call_waits_for_its_steps_acknowledgement_as_long_as_for_its_outcome(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduling write that gave up would still sit in the producer's queue and
    could reach the ledger after the agent aborted (the step then runs behind its
    back): so the call's timeout, not the writer's 30 s default, bounds that wait."""
    system, _desk = local
    waits = _record_waits(system, monkeypatch)
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", timeout_s=75, day="thu")
        saga.call("book_slot", day="fri")  # the client's call_timeout_s (30)

    async def agent() -> None:
        async with system.client.saga("desk", "agent") as asaga:
            await asaga.acall("book_slot", timeout_s=80, day="sat")

    asyncio.run(agent())
    scheduled = [t for kind, t in waits if kind == "StepScheduled"]
    assert scheduled == [75, 30, 80]


def test_an_irreversible_call_without_approval_leaves_the_saga_open_R7(
    local: tuple[System, Desk],
) -> None:
    system, desk = local
    with pytest.raises(ApprovalPending) as err, system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="wed")
        saga.call("announce", text="hello", timeout_s=3)
    # ApprovalPending left the block, but waiting for a person is not a failure: the
    # saga was neither aborted nor compensated, the booking stands.
    pending = err.value
    assert pending.tool == "announce" and pending.approval_id
    assert desk.log == ["book:wed"]
    request = next(
        r
        for r in system.records(saga.saga_id)
        if isinstance(r, ApprovalRequested) and r.step_id == pending.step_id
    )
    channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
    grant_approval(channel, request, operator="ops:alice")
    channel.close()
    assert saga.resume(pending.step_id) == "hello"
    saga.end(SagaOutcome.COMPLETE)
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["book:wed"]


def test_the_demo_agent_waits_again_for_a_late_approval_and_ends_the_saga_R7(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The approval is granted only after the agent's call timeout (in CI: while the
    coordinator was restarted by its watchdog). Leaving the block on ApprovalPending
    left the saga open: its step then ran, but nothing ever ended it (R14)."""
    system, _desk = local
    agent = RefundAgent(system.client, call_timeout_s=8, run_tag="late")
    ticket = Ticket("T-late", "ord-late", TicketKind.QUESTION, 0, "when does it ship?")
    report = PlanReport(calls=(), findings=())
    plan = CheckedPlan(ticket, [PlannedCall("announce", {"text": "hi"})], report, report)
    saga_id = agent.saga_id(ticket)
    first_wait_over = threading.Event()
    monkeypatch.setattr(demo, "_say", lambda message="": first_wait_over.set())
    channel = OperatorChannel.from_settings(system.settings, system.bootstrap)

    def approve_late() -> None:
        if not first_wait_over.wait(120):
            return
        found: list[ApprovalRequested] = []

        def requested() -> bool:
            found.extend(r for r in system.records(saga_id) if isinstance(r, ApprovalRequested))
            return bool(found)

        wait_until(requested, 60, interval_s=0.2)
        grant_approval(channel, found[0], operator="ops:alice")

    approver = threading.Thread(target=approve_late, daemon=True)
    approver.start()
    outcome = agent.run_ticket(plan)
    first_wait_over.set()
    approver.join(60)
    channel.close()
    assert (outcome.ended, outcome.error) == ("complete", None)
    receipt = system.client.saga("desk", "agent", saga_id=saga_id).attach().wait(60)
    assert receipt.status is TerminalStatus.COMPLETED


def test_without_a_coordinator_a_saga_says_what_to_start(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No coordinator will come: the 15 s a starting one is given would only be waited out.
    monkeypatch.setattr(
        client_module,
        "require_coordinator",
        functools.partial(readiness.require_coordinator, patience_s=1.0),
    )
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, state_dir=tmp_path, partitions=1
    )
    ensure_topics(kafka_bootstrap, settings.topics, [], 1)
    client = SagaClient(settings, kafka_bootstrap, local=wrap(Desk(), name="desk"))
    with client, pytest.raises(CoordinatorNotRunning) as err, client.saga("desk", "agent"):
        pass
    message = str(err.value)
    assert f"no coordinator is consuming `{settings.topics.events}`" in message
    assert "sagaline coordinator run" in message and unique_prefix in message


def test_sagas_started_together_share_one_check_for_the_coordinator(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``async with client.saga(...)`` ran the first-saga check for a coordinator on the
    event loop's default executor (a handful of threads), once per saga started before
    one check had answered: a thousand sagas gathered at start-up (as in the quickstart)
    each waited out its own check, a few at a time, so without a coordinator the last
    one raised only after (sagas / threads) x 15 s. Sagas started together now wait for
    one check and all get its answer."""
    checks: list[int] = []

    def counted(settings: Settings, bootstrap: str) -> None:
        checks.append(1)
        readiness.require_coordinator(settings, bootstrap, patience_s=1.0)

    monkeypatch.setattr(client_module, "require_coordinator", counted)
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, state_dir=tmp_path, partitions=1
    )
    ensure_topics(kafka_bootstrap, settings.topics, [], 1)
    client = SagaClient(settings, kafka_bootstrap)

    async def agent() -> None:
        async with client.saga("desk", "agent"):
            pass

    async def main() -> list[BaseException | None]:
        return await asyncio.gather(*(agent() for _ in range(24)), return_exceptions=True)

    with client:
        outcomes = asyncio.run(main())
        assert all(isinstance(o, CoordinatorNotRunning) for o in outcomes), outcomes
        assert len(checks) == 1
        # A later saga checks again (a coordinator may have started since).
        with pytest.raises(CoordinatorNotRunning), client.saga("desk", "agent"):
            pass
        assert len(checks) == 2


def test_an_unknown_tool_is_a_clear_error(local: tuple[System, Desk]) -> None:
    system, _desk = local
    with pytest.raises(UnknownTool, match="no participant declares a tool named 'teleport'"):
        system.client.contract("teleport")


def test_a_secret_argument_reaches_the_tool_but_never_a_topic_in_clear(
    local: tuple[System, Desk],
) -> None:
    system, desk = local
    card = "4111111111111111"
    settings = dataclasses.replace(system.settings, secret_key=b"agent and desk share this")
    client = SagaClient(settings, system.bootstrap, local=wrap(desk, name="desk2"))
    with client:
        with pytest.raises(BusinessRejected), client.saga("desk", "agent") as saga:
            saga.call("charge_card", amount=500, card=card)
            saga.call("refuse")
        assert saga.wait(60).status is TerminalStatus.COMPENSATED
    assert desk.log == [f"charge:500:{card}", f"refund:{card}"]
    for topic in (system.topics.events, system.topics.commands("desk2")):
        values = [v for _k, v, _h in LedgerReader(system.bootstrap).records(topic) if v]
        assert values and not any(card.encode() in v for v in values), topic


def test_a_call_without_an_outcome_is_unknown_when_the_coordinator_check_cannot_reach_the_broker(
    transport: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a call times out the client asks the broker whether a coordinator runs, to
    say so; with a broker away that question fails too, and the call must still end as
    what it is, an unknown outcome (it raised the broker's ConnectionError instead)."""

    def broker_away(*_args: object, **_kwargs: object) -> None:
        raise ConnectionError("cannot describe consumer group: the broker is away")

    monkeypatch.setattr(client_module, "group_status", broker_away)
    settings = Settings(
        bootstrap=transport, topic_prefix=unique_prefix, state_dir=tmp_path, partitions=1
    )
    ensure_topics(transport, settings.topics, [], 1)
    client = SagaClient(settings, transport, local=wrap(Desk(), name="desk"))
    client.check_coordinator = False  # none runs: nothing will answer the call
    unknown = pytest.raises(OutcomeUnknown, match="no outcome for book_slot within 1")
    with client, unknown, client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="mon", timeout_s=1)


def test_a_saga_waits_for_its_start_and_end_acknowledgements_as_long_as_for_a_call(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI: the broker was killed just after an agent produced SagaStarted; the start
    waited the writer's 30 s, raised, and the block never ran, but the record reached
    the ledger when the broker came back, and the saga stayed open for good (R14). The
    start and the end now wait as long as a call (the client's call timeout)."""
    system, _desk = local
    monkeypatch.setattr(system.client, "call_timeout_s", 45.0)
    waits = _record_waits(system, monkeypatch)
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="thu")

    async def agent() -> None:
        async with system.client.saga("desk", "agent") as asaga:
            await asaga.acall("book_slot", day="sat")

    asyncio.run(agent())
    assert [w for w in waits if w[0] != "StepScheduled"] == [
        ("SagaStarted", 45.0),
        ("SagaEndRequested", 45.0),
    ] * 2


def test_a_start_that_was_not_acknowledged_queues_an_abort_behind_it(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the call timeout the start raises, and the block does not run; the start
    may still land later, so an abort goes out behind it and the saga ends (R14)."""
    system, _desk = local
    writer = system.client._writer
    sync_append = writer.append

    def start_unacknowledged(record: Record, *, timeout_s: float = 30.0) -> None:
        sync_append(record, timeout_s=timeout_s)  # it lands, the answer is lost
        if isinstance(record, SagaStarted):
            raise DeliveryFailed("no acknowledgement for SagaStarted", topic="t", error=None)

    monkeypatch.setattr(writer, "append", start_unacknowledged)
    saga = system.client.saga("desk", "agent")
    ran: list[str] = []
    with pytest.raises(DeliveryFailed), saga:
        ran.append("the block")
    assert ran == []
    receipt = saga.wait(timeout_s=120)
    assert receipt.status is TerminalStatus.COMPENSATED and not receipt.steps
    assert "gave up on starting the saga" in receipt.end_reason


def _terminal_arrived(client: SagaClient, saga_id: str) -> bool:
    """Whether the client's listener has handed on the saga's terminal record (within
    a generous bound), found the way a wait() finds it."""
    terminal = client._ledger.wait_for(
        saga_id, lambda r: r if isinstance(r, SagaTerminal) else None, 120
    )
    return terminal is not None


def _record_waits(system: System, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """(record type, how long its append waits for the broker) for every ledger write
    of the client from now on."""
    writer = system.client._writer
    waits: list[tuple[str, float]] = []
    sync_append, async_append = writer.append, writer.append_async

    def append(record: Record, *, timeout_s: float = 30.0) -> None:
        waits.append((record.TYPE, timeout_s))
        sync_append(record, timeout_s=timeout_s)

    async def append_async(record: Record, *, timeout_s: float = 30.0) -> None:
        waits.append((record.TYPE, timeout_s))
        await async_append(record, timeout_s=timeout_s)

    monkeypatch.setattr(writer, "append", append)
    monkeypatch.setattr(writer, "append_async", append_async)
    return waits


def test_connect_passes_ended_sagas_kept_to_its_client(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """``sagaline.connect()`` is how most agents get a client: the number of ended
    sagas whose receipts it keeps must be settable there too, not only on
    ``SagaClient``."""
    import sagaline

    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, state_dir=tmp_path, partitions=1
    )
    with sagaline.connect(settings=settings, ended_sagas_kept=2) as client:
        assert client._ledger.ended_kept == 2


def _restarted_agent(system: System, desk: Desk) -> SagaClient:
    """The agent's process after a restart: a new client, listening from the end of
    the ledger (the desk stays served by the first client's embedded runtime)."""
    return SagaClient(
        system.settings, system.bootstrap, catalogues=[wrap(desk, name="desk")], call_timeout_s=30
    )


def test_a_saga_attached_after_the_agent_restarted_continues_without_rerunning_a_step(
    local: tuple[System, Desk],
) -> None:
    """attach() continues a saga another process started: the results of its
    committed steps are there, a new call is a new step (not one that reuses the id
    of an earlier one, which the coordinator refuses), and a step re-issued under
    its own id answers with its outcome instead of running again."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()  # started; the agent's process dies inside the block
    first = saga.call("book_slot", day="fri")
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        assert resumed.results == {"01-book_slot": first}
        assert resumed.call("book_slot", day="sat") == {"slot": "slot-sat"}
        assert resumed.call("book_slot", step_id="01-book_slot", day="fri") == first
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED
    scheduled = [r.step_id for r in system.records(saga.saga_id) if isinstance(r, StepCommitted)]
    assert scheduled == ["01-book_slot", "02-book_slot"]
    assert desk.log == ["book:fri", "book:sat"]  # each step ran once


def test_a_step_waiting_for_approval_is_resumed_by_the_restarted_agent_R7(
    local: tuple[System, Desk],
) -> None:
    """An IRREVERSIBLE step scheduled before the agent restarted: once approved,
    resume() on the re-attached saga returns its result."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()
    # the call that the dying process was waiting in
    threading.Thread(
        target=lambda: saga.call("announce", text="hello", timeout_s=120), daemon=True
    ).start()
    found: list[ApprovalRequested] = []

    def requested() -> bool:
        found.extend(r for r in system.records(saga.saga_id) if isinstance(r, ApprovalRequested))
        return bool(found)

    wait_until(requested, 60, interval_s=0.2)
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
        grant_approval(channel, found[0], operator="ops:alice")
        channel.close()
        assert resumed.resume(found[0].step_id) == "hello"
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED


def test_a_client_started_before_the_ledger_exists_says_so_instead_of_hearing_nothing(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    """A client listens from the end of each partition of ``sagaline.events``; started
    before the topic exists (an agent up before its coordinator created the topics) it
    listened to no partition at all, so every later call waited out its timeout and
    ended as an unknown outcome while its steps ran: start() now refuses, naming it."""
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix, state_dir=tmp_path)
    client = SagaClient(settings, transport)
    with pytest.raises(TopicMissing, match=f"topic '{settings.topics.events}' does not exist"):
        client.start()
    client.close()


def test_an_async_call_without_an_outcome_checks_the_coordinator_off_the_event_loop(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a call's wait ends without an outcome the client asks the broker whether a
    coordinator consumes (an admin client, a request of up to 10 s): on the event loop
    that stalled every other saga of the process, and every delivery report, once per
    timed-out call."""
    system, _desk = local
    threads: list[threading.Thread] = []

    def status(bootstrap: str, group: str, **_: object) -> readiness.GroupStatus:
        threads.append(threading.current_thread())
        return readiness.GroupStatus(group, "STABLE", 1)

    async def no_outcome(*_: object) -> None:
        return None  # as a wait that timed out

    monkeypatch.setattr(client_module, "group_status", status)
    monkeypatch.setattr(system.client._ledger, "wait_for_async", no_outcome)

    async def agent() -> threading.Thread:
        with pytest.raises(OutcomeUnknown, match="no outcome for book_slot"):
            async with system.client.saga("desk", "agent") as saga:
                await saga.call("book_slot", day="wed")
        return threading.current_thread()

    loop_thread = asyncio.run(agent())
    assert threads and loop_thread not in threads


def test_a_start_cancelled_while_awaited_is_ended_not_left_open_R14(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task cancelled while ``async with client.saga(...)`` awaits the start's
    acknowledgement (a request timeout, a shutdown) never runs the block nor
    ``__aexit__``; the start is already on its way, so the saga landed and stayed
    open for good. Now an abort goes out behind it, as after a start that was not
    acknowledged."""
    system, _desk = local
    writer = system.client._writer
    async_append = writer.append_async

    async def main() -> Saga:
        started = asyncio.Event()

        async def append_async(record: Record, *, timeout_s: float = 30.0) -> None:
            await async_append(record, timeout_s=timeout_s)
            if isinstance(record, SagaStarted):
                started.set()
                await asyncio.get_running_loop().create_future()  # until cancelled

        monkeypatch.setattr(writer, "append_async", append_async)
        saga = system.client.saga("desk", "agent")
        ran: list[str] = []

        async def agent() -> None:
            async with saga:
                ran.append("the block")

        task = asyncio.create_task(agent())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ran == []
        return saga

    saga = asyncio.run(main())
    receipt = saga.wait(timeout_s=120)
    assert receipt.status is TerminalStatus.COMPENSATED and not receipt.steps
    assert "gave up on starting the saga" in receipt.end_reason


def test_a_start_interrupted_while_awaited_is_ended_not_left_open_R14(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for ``with client.saga(...)`` interrupted (Ctrl-C) while it waits for
    the start's acknowledgement."""
    system, _desk = local
    writer = system.client._writer
    sync_append = writer.append

    def interrupted(record: Record, *, timeout_s: float = 30.0) -> None:
        sync_append(record, timeout_s=timeout_s)
        if isinstance(record, SagaStarted):
            raise KeyboardInterrupt

    monkeypatch.setattr(writer, "append", interrupted)
    saga = system.client.saga("desk", "agent")
    with pytest.raises(KeyboardInterrupt), saga:
        pass
    monkeypatch.setattr(writer, "append", sync_append)
    receipt = saga.wait(timeout_s=120)
    assert receipt.status is TerminalStatus.COMPENSATED and not receipt.steps
    assert "gave up on starting the saga" in receipt.end_reason


def test_a_listener_that_died_fails_the_waits_saying_why_instead_of_timing_them_out(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every wait of a client is woken by its one listener thread. When that thread
    died, each pending call waited out its whole timeout and ended as "no outcome for
    <tool> within 30 s", and so did every later call, with the cause only in a
    thread's traceback on stderr: now the waits end at once, naming the cause."""
    system, _desk = local
    ledger = system.client._ledger

    def broken(_records: object) -> None:
        raise RuntimeError("handing records on broke")

    first = system.client.saga("desk", "agent")

    async def agent() -> None:
        async with first as saga:
            monkeypatch.setattr(ledger, "add", broken)
            await saga.call("book_slot", day="mon")

    with pytest.raises(OutcomeUnknown, match=r"listener stopped.*handing records on broke"):
        asyncio.run(agent())
    with pytest.raises(TimeoutError, match=r"listener stopped.*handing records on broke"):
        first.wait(timeout_s=120)
    # A saga that could never hear back is refused before anything is written.
    later = system.client.saga("desk", "agent")
    with pytest.raises(ClientStopped, match=r"listener stopped.*nothing was written"), later:
        pass


def test_a_saga_whose_block_outlives_its_closed_client_is_still_ended_at_once_R14(
    local: tuple[System, Desk],
) -> None:
    """A client closed while a saga's block was open (a shutdown closing it under
    requests in flight): the block's exit waited the whole call timeout for the
    acknowledgement of the saga's end, which the closed writer no longer served, and
    raised ``DeliveryFailed`` ("is the broker reachable?") over the block's own error,
    with no telling whether the end was written, so the saga could stay open for
    good. Now the end is written and acknowledged, and the block's error is raised."""
    system, _desk = local
    client = system.client
    ended: list[str] = []

    async def agent() -> None:
        async with client.saga("desk", "agent") as saga:
            ended.append(saga.saga_id)
            await saga.call("book_slot", day="mon")
            client.close()
            raise ValueError("the request was cancelled")

    with pytest.raises(ValueError, match="the request was cancelled"):
        asyncio.run(agent())
    sync = Saga(
        client,
        saga_id=ended[0],
        tenant_id=system.settings.tenant_id,
        workflow="desk",
        principal="agent",
        workflow_version="1",
        policy_version="1",
        continue_on_compensation_failure=False,
    )
    sync.end(SagaOutcome.ABORT, "again")  # ends after close() are written, sync as well
    reader = LedgerReader(system.bootstrap)

    def reasons() -> list[str]:
        records = reader.saga_records(system.settings.topics.events, ended[0], client.signer)
        return [r.reason for r in records if isinstance(r, SagaEndRequested)]

    # Both are acknowledged; a reader (read committed) sees the second once the
    # coordinator's transaction then open on that partition (the abort's unwind) ends.
    wait_until(lambda: len(reasons()) >= 2, 60)
    assert reasons() == ["ValueError: the request was cancelled", "again"]


def test_sagas_in_flight_when_their_client_closes_end_through_its_own_writer_R14(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() under many sagas in flight (a shutdown): each block's end then built a
    producer of its own, connected, waited for its acknowledgement and closed it, one
    after another on the event loop's few executor threads (300 sagas: 26 s on an
    idle machine), so a shutdown's grace period could run out with sagas left open
    (R14). The client's writer now stays open until the last block open at close()
    has ended, then closes."""
    system, desk = local
    client = _restarted_agent(system, desk).start()
    built: list[object] = []
    ledger_writer = client_module.LedgerWriter

    def counted(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return ledger_writer(*args, **kwargs)

    monkeypatch.setattr(client_module, "LedgerWriter", counted)
    n = 12

    async def agent(started: list[str]) -> str:
        try:
            async with client.saga("desk", "agent") as saga:
                started.append(saga.saga_id)
                await saga.call("announce", text="hello")  # waits for a person
        except (OutcomeUnknown, RuntimeError) as exc:
            return str(exc)
        return "no error"

    async def main() -> tuple[list[str], list[str]]:
        started: list[str] = []
        tasks = [asyncio.create_task(agent(started)) for _ in range(n)]
        while len(started) < n:
            await asyncio.sleep(0.01)
        client.close()
        return started, await asyncio.gather(*tasks)

    started, errors = asyncio.run(main())
    assert all("listener stopped" in e for e in errors), errors
    assert built == []  # every end went through the client's own writer
    assert client._writer._closed.is_set()  # closed once the last block ended
    reader = LedgerReader(system.bootstrap)

    def aborted(saga_id: str) -> bool:
        records = reader.saga_records(system.settings.topics.events, saga_id, client.signer)
        return any(
            isinstance(r, SagaEndRequested) and r.outcome is SagaOutcome.ABORT for r in records
        )

    wait_until(lambda: all(aborted(s) for s in started), 120)


def test_a_call_made_while_its_client_closes_is_refused_before_anything_is_written(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call (or a new saga) made after close() began but before the listener had
    stopped (it notices the stop within its poll, longer with the broker away) was
    written: its step ran, a pivot committed (the saga then goes forward, R6), while
    the call could only end without its outcome. It is refused now, nothing written;
    the saga's end is still written."""
    system, desk = local
    client = _restarted_agent(system, desk).start()
    ledger = client._ledger
    stopping = threading.Event()
    release = threading.Event()
    fail = ledger.fail

    def slow_fail(failure: BaseException) -> None:  # the listener, on its way out
        stopping.set()
        release.wait(120)
        fail(failure)

    monkeypatch.setattr(ledger, "fail", slow_fail)
    closer = threading.Thread(target=client.close)
    with pytest.raises(RuntimeError, match="closed"), client.saga("desk", "agent") as saga:
        assert saga.call("book_slot", day="mon") == {"slot": "slot-mon"}
        closer.start()
        assert stopping.wait(60)
        try:
            saga.call("book_slot", day="tue", timeout_s=5)
        finally:
            release.set()
    closer.join(60)
    assert "book:tue" not in desk.log
    records = system.records(saga.saga_id)
    assert [r.step_id for r in records if isinstance(r, StepScheduled)] == ["01-book_slot"]
    assert wait_until(
        lambda: [type(r) for r in system.records(saga.saga_id)].count(SagaEndRequested) == 1, 60
    )


def test_a_client_that_was_never_started_refuses_a_saga_before_anything_is_written(
    local: tuple[System, Desk],
) -> None:
    """A client built by hand without ``start()`` (or ``with client``) has no listener,
    so no outcome can reach it; yet its saga's start and step were written, the tool
    ran, and the call waited out its whole timeout to say ``OutcomeUnknown: no outcome
    for book_slot within ... s`` (leaving the block by it then aborted the saga). The
    start and the call are refused at once, sync and async, nothing written."""
    system, desk = local
    client = SagaClient(
        system.settings, system.bootstrap, catalogues=[wrap(desk, name="desk")], call_timeout_s=5
    )
    saga = client.saga("desk", "agent")
    with pytest.raises(ClientStopped, match=r"not started.*start\(\)"), saga:
        saga.call("book_slot", day="mon")

    async def agent() -> None:
        async with client.saga("desk", "agent") as asaga:
            await asaga.call("book_slot", day="tue")

    with pytest.raises(ClientStopped, match="not started"):
        asyncio.run(agent())
    # The same call through the fixture's started client runs: the desk is served.
    with system.client.saga("desk", "agent") as served:
        assert served.call("book_slot", day="wed") == {"slot": "slot-wed"}
    assert served.wait(60).status is TerminalStatus.COMPLETED
    assert system.records(saga.saga_id) == []
    assert desk.log == ["book:wed"]
    client.close()


def test_a_block_left_after_its_saga_was_ended_writes_no_second_end_R16(
    local: tuple[System, Desk],
) -> None:
    """``saga.end(ABORT)`` inside the block, then leaving it normally, wrote a second
    end (COMPLETE) that the coordinator refuses (the first end asked for counts): a
    dead-lettered ``invalid-transition`` record, counted as bad input (R16), for every
    such saga. Leaving the block after an acknowledged end writes nothing more, sync
    and async; the saga ends as the first end asked."""
    system, desk = local
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="mon")
        saga.end(SagaOutcome.ABORT, "the customer changed their mind")

    async def agent() -> str:
        async with system.client.saga("desk", "agent") as asaga:
            await asaga.call("book_slot", day="tue")
            await asaga.end(SagaOutcome.ABORT, "the customer changed their mind")
        assert (await asaga.wait(60)).status is TerminalStatus.COMPENSATED
        return asaga.saga_id

    assert saga.wait(60).status is TerminalStatus.COMPENSATED
    async_id = asyncio.run(agent())
    for saga_id in (saga.saga_id, async_id):
        assert [h for k, h in system.dlq() if k == saga_id.encode()] == []
        ends = [r for r in system.records(saga_id) if isinstance(r, SagaEndRequested)]
        assert [r.outcome for r in ends] == [SagaOutcome.ABORT]
    assert desk.log == ["book:mon", "free:slot-mon", "book:tue", "free:slot-tue"]


def test_an_end_interrupted_while_awaited_is_followed_by_no_second_end_R16(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``saga.end(COMPLETE)`` interrupted (Ctrl-C; a cancelled task) while it waited for
    the broker: the end is queued and lands, yet leaving the block by the interrupt
    wrote an ABORT after it (and waited for it), which the coordinator refuses to the
    DLQ (``invalid-transition``: the first end asked for counts). Now the block writes
    nothing more, sync and async; the saga completes as asked."""
    system, desk = local
    writer = system.client._writer
    sync_append, async_append = writer.append, writer.append_async

    def interrupted(record: Record, *, timeout_s: float = 30.0) -> None:
        sync_append(record, timeout_s=timeout_s)  # it lands; the wait is interrupted
        if isinstance(record, SagaEndRequested):
            raise KeyboardInterrupt

    async def cancelled(record: Record, *, timeout_s: float = 30.0) -> None:
        await async_append(record, timeout_s=timeout_s)
        if isinstance(record, SagaEndRequested):
            raise asyncio.CancelledError

    monkeypatch.setattr(writer, "append", interrupted)
    monkeypatch.setattr(writer, "append_async", cancelled)
    saga = system.client.saga("desk", "agent")
    with pytest.raises(KeyboardInterrupt), saga:
        saga.call("book_slot", day="mon")
        saga.end(SagaOutcome.COMPLETE)
    asaga = system.client.saga("desk", "agent")

    async def agent() -> None:
        async with asaga as running:
            await running.call("book_slot", day="tue")
            await running.end(SagaOutcome.COMPLETE)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(agent())
    for ended in (saga, asaga):
        ends = [r for r in system.records(ended.saga_id) if isinstance(r, SagaEndRequested)]
        assert [r.outcome for r in ends] == [SagaOutcome.COMPLETE]
        assert ended.wait(60).status is TerminalStatus.COMPLETED
        assert [h for k, h in system.dlq() if k == ended.saga_id.encode()] == []
    assert desk.log == ["book:mon", "book:tue"]


def test_a_call_cancelled_while_its_step_was_being_acknowledged_can_be_resumed(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call cancelled (a request timeout, ``asyncio.wait_for``) while it awaited the
    broker's acknowledgement of its step (long while the broker is away) leaves the
    step queued: it reaches the ledger and runs. ``resume(step_id)`` then refused it
    ("scheduled no step ... here ... attach() the saga first"), as if another process
    had scheduled it, so the agent could not learn the outcome of a step it wrote."""
    system, desk = local
    writer = system.client._writer
    async_append = writer.append_async

    async def agent() -> object:
        acknowledged = asyncio.Event()

        async def append_async(record: Record, *, timeout_s: float = 30.0) -> None:
            await async_append(record, timeout_s=timeout_s)
            if isinstance(record, StepScheduled):
                acknowledged.set()
                await asyncio.get_running_loop().create_future()  # until cancelled

        async with system.client.saga("desk", "agent") as saga:
            monkeypatch.setattr(writer, "append_async", append_async)
            call = asyncio.create_task(saga.call("book_slot", step_id="slot", day="wed"))
            await acknowledged.wait()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            monkeypatch.setattr(writer, "append_async", async_append)
            return await saga.resume("slot")

    assert asyncio.run(agent()) == {"slot": "slot-wed"}
    assert desk.log == ["book:wed"]


def test_an_async_saga_left_open_for_an_approval_is_resumed_with_await_R7(
    local: tuple[System, Desk],
) -> None:
    """``async with`` leaves a saga open on ApprovalPending like ``with`` does, and the
    docs say ``resume()`` then waits for the approved step; the async saga had no
    ``resume()`` (only the sync one, which blocks the event loop)."""
    system, desk = local

    async def agent() -> tuple[object, TerminalStatus]:
        with pytest.raises(ApprovalPending) as err:
            async with system.client.saga("desk", "agent") as saga:
                await saga.call("book_slot", day="mon")
                await saga.call("announce", text="hello", timeout_s=10)
        pending = err.value
        request = next(
            r
            for r in system.records(saga.saga_id)
            if isinstance(r, ApprovalRequested) and r.step_id == pending.step_id
        )
        channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
        grant_approval(channel, request, operator="ops:alice")
        channel.close()
        result = await saga.resume(pending.step_id)
        await saga.end(SagaOutcome.COMPLETE)
        return result, (await saga.wait(60)).status

    assert asyncio.run(agent()) == ("hello", TerminalStatus.COMPLETED)
    assert desk.log == ["book:mon"]


def test_an_approval_pending_out_of_a_task_group_leaves_the_saga_open_R7(
    local: tuple[System, Desk],
) -> None:
    """Calls run together in an ``asyncio.TaskGroup`` inside ``async with`` leave the
    block with an ``ExceptionGroup``: one holding only ``ApprovalPending`` (a step
    waiting for a person, R7) aborted the saga, as a failure would, where the same
    call awaited alone (or in ``gather``) left it open for ``resume()``."""
    system, desk = local

    async def agent() -> tuple[object, TerminalStatus]:
        with pytest.raises(ExceptionGroup) as err:
            async with system.client.saga("desk", "agent") as saga, asyncio.TaskGroup() as group:
                group.create_task(saga.call("book_slot", day="tue"))
                group.create_task(saga.call("announce", text="hi", timeout_s=10))
        (pending,) = err.value.exceptions
        assert isinstance(pending, ApprovalPending)
        request = next(
            r
            for r in system.records(saga.saga_id)
            if isinstance(r, ApprovalRequested) and r.step_id == pending.step_id
        )
        channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
        grant_approval(channel, request, operator="ops:alice")
        channel.close()
        result = await saga.resume(pending.step_id)
        await saga.end(SagaOutcome.COMPLETE)
        return result, (await saga.wait(60)).status

    assert asyncio.run(agent()) == ("hi", TerminalStatus.COMPLETED)
    assert desk.log == ["book:tue"]


def test_resuming_a_step_the_saga_does_not_know_says_what_to_do(
    local: tuple[System, Desk],
) -> None:
    """``resume()`` of a step this Saga object never scheduled (a restarted agent that
    did not ``attach()``, a typo) raised a bare ``KeyError: '02-announce'``."""
    system, _desk = local
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="sat")
    restarted = system.client.saga("desk", "agent", saga_id=saga.saga_id)
    with pytest.raises(ValueError, match=r"no step '02-announce'.*attach\(\)"):
        restarted.resume("02-announce")

    async def agent() -> None:
        with pytest.raises(ValueError, match=r"no step '02-announce'.*01-book_slot"):
            await AsyncSaga(saga).resume("02-announce")

    asyncio.run(agent())


def test_a_call_depending_on_a_step_the_saga_never_scheduled_is_refused_at_once(
    local: tuple[System, Desk],
) -> None:
    """The coordinator rejects a step whose ``depends_on`` names no scheduled step, and
    the rejection goes to the dead-letter topic, not to the saga: the call waited out
    its whole timeout and ended as "no outcome", as if the step might have run."""
    system, desk = local
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", step_id="first", day="mon")
        with pytest.raises(CallRefused, match=r"depends on \['frist'\].*not scheduled") as err:
            saga.call("book_slot", depends_on=["first", "frist"], timeout_s=10, day="tue")
        assert err.value.limit == "depends_on"
        assert saga.call("book_slot", depends_on=["first"], day="wed") == {"slot": "slot-wed"}
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["book:mon", "book:wed"]


def test_depends_on_given_as_one_string_is_refused_saying_to_pass_a_list(
    local: tuple[System, Desk],
) -> None:
    """``depends_on="first"`` (a list was meant) was read letter by letter: refused as
    depending on steps 'f', 'i', 'r', 's', 't', a message that names no mistake (and,
    were each letter a step, a ValidationError traceback from the record)."""
    system, desk = local
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", step_id="first", day="mon")
        with pytest.raises(CallRefused, match=r"depends_on=\['first'\]") as err:
            saga.call("book_slot", depends_on="first", timeout_s=10, day="tue")  # type: ignore[arg-type]
        assert err.value.limit == "depends_on"
        assert saga.call("book_slot", depends_on=["first"], day="wed") == {"slot": "slot-wed"}
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["book:mon", "book:wed"]


def test_a_step_id_with_a_slash_is_refused_before_anything_is_written(
    local: tuple[System, Desk],
) -> None:
    """Ids derived from a step id join their parts with "/": a step "2/x" would share
    its approval id with step "x" of the saga's next run. The coordinator rejects such
    a step to the DLQ, so the call would wait out its timeout as "no outcome"."""
    system, desk = local
    with system.client.saga("desk", "agent") as saga:
        with pytest.raises(CallRefused, match=r"step id '2/x'.*'/'") as err:
            saga.call("book_slot", step_id="2/x", timeout_s=10, day="mon")
        assert err.value.limit == "step_id"
        assert saga.call("book_slot", step_id="x", day="tue") == {"slot": "slot-tue"}
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["book:tue"]


def test_local_tools_that_cannot_start_fail_the_clients_start_saying_why(
    transport: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded runtime of ``local=`` tools that failed to start (its catalogue
    write refused, say by an ACL) let start() return after 60 s as if it ran: every
    call of a local tool then waited out its timeout as "no outcome"."""
    from participants.runtime import ParticipantRuntime

    settings = Settings(
        bootstrap=transport, topic_prefix=unique_prefix, state_dir=tmp_path, partitions=1
    )
    ensure_topics(transport, settings.topics, ["desk"], 1)

    def refused(_runtime: ParticipantRuntime) -> None:
        raise DeliveryFailed("TOPIC_AUTHORIZATION_FAILED", topic="catalogue", error=None)

    monkeypatch.setattr(ParticipantRuntime, "publish_catalogue", refused)
    client = SagaClient(settings, transport, local=wrap(Desk(), name="desk"))
    with pytest.raises(RuntimeError, match=r"local tools of 'desk'.*TOPIC_AUTHORIZATION_FAILED"):
        client.start()
    client.close()


def test_many_calls_without_an_outcome_share_one_check_of_the_coordinator(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call that ended without an outcome asked the broker about the coordinator
    with an admin client of its own (a connection, up to 10 s when the broker is away):
    a thousand async calls timing out together built a thousand admin clients, a few
    at a time in the worker threads, and the last call heard of its outcome minutes
    late. Calls ending together now share one check."""
    system, _desk = local
    system.client.coordinator_check_max_age_s = 600.0  # a busy machine: no expiry here
    asked: list[str] = []

    def status(bootstrap: str, group: str, **_: object) -> readiness.GroupStatus:
        asked.append(group)
        return readiness.GroupStatus(group, "STABLE", 1)

    async def no_outcome(*_: object) -> None:
        return None  # as a wait that timed out

    monkeypatch.setattr(client_module, "group_status", status)
    monkeypatch.setattr(system.client._ledger, "wait_for_async", no_outcome)

    async def agent(n: int) -> None:
        with pytest.raises(OutcomeUnknown, match="no outcome for book_slot"):
            async with system.client.saga("desk", "agent") as saga:
                await saga.call("book_slot", day=f"x{n}")

    async def agents() -> None:
        await asyncio.gather(*(agent(n) for n in range(20)))

    asyncio.run(agents())
    # One check of the coordinator's group and one of the step's participant's.
    assert sorted(asked) == sorted(
        {
            readiness.coordinator_group(system.settings),
            readiness.participant_group(system.settings, "desk"),
        }
    )


def test_a_call_to_a_participant_nobody_runs_says_so_and_its_step_still_runs_later_R11(
    local: tuple[System, Desk],
) -> None:
    """A call to a tool whose participant no service runs waited out its whole timeout
    and raised ``OutcomeUnknown: no outcome for book_slot within 2 s``, no hint of
    why. On that timeout the client asks the broker about the participant's consumer
    group (as it does about the coordinator's) and names it; the outcome stays
    unknown: once the participant starts, the step runs and resume() gets it."""
    system, _desk = local
    desk2 = wrap(Desk(), name="desk2")
    ensure_topics(system.bootstrap, system.topics, ["desk2"], 2)
    client = SagaClient(system.settings, system.bootstrap, catalogues=[desk2]).start()
    try:
        with client.saga("desk2", "agent") as saga:
            with pytest.raises(OutcomeUnknown) as raised:
                saga.call("book_slot", day="mon", timeout_s=2)
            message = str(raised.value)
            assert "no outcome for book_slot within 2 s" in message
            assert "no member of participant 'desk2'" in message
            assert readiness.participant_group(system.settings, "desk2") in message
            assert "may still run" in message
            system.start_participant(desk2)
            assert saga.resume("01-book_slot") == {"slot": "slot-mon"}
        assert saga.wait(60).status is TerminalStatus.COMPLETED
    finally:
        client.close()


def test_a_call_without_an_outcome_says_its_participant_is_running(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The participant's group has a member (the client's own local tools here): the
    unknown outcome says the participant is running, so the wait is not its absence."""
    system, _desk = local

    async def no_outcome(*_: object) -> None:
        return None  # as a wait that timed out

    monkeypatch.setattr(system.client._ledger, "wait_for_async", no_outcome)

    async def agent() -> None:
        async with system.client.saga("desk", "agent") as saga:
            await saga.call("book_slot", day="fri")

    with pytest.raises(OutcomeUnknown, match=r"participant 'desk' is running \(1 member"):
        asyncio.run(agent())


def test_a_new_saga_under_the_id_of_one_that_ended_is_refused_not_answered_by_the_old_one(
    local: tuple[System, Desk],
) -> None:
    """The coordinator ignores a SagaStarted (and every step) under the id of a saga
    that ended, so a new saga reusing the id never runs; the client answered it from
    the old saga's terminal record (its calls "unwinding", its wait() the old
    receipt). Starting it is now refused before anything is written, sync and async."""
    system, desk = local
    saga_id = f"reused-{id(desk)}"
    with system.client.saga("desk", "agent", saga_id=saga_id) as first:
        first.call("book_slot", day="mon")
    assert first.wait(60).status is TerminalStatus.COMPLETED
    again = system.client.saga("desk", "agent", saga_id=saga_id)
    with pytest.raises(InvalidSagaId, match="already started"), again:
        again.call("book_slot", day="tue")

    async def agent() -> None:
        async with system.client.saga("desk", "agent", saga_id=saga_id) as asaga:
            await asaga.call("book_slot", day="wed")

    with pytest.raises(InvalidSagaId, match="already started"):
        asyncio.run(agent())
    assert [type(r) for r in system.records(saga_id)].count(SagaStarted) == 1
    assert desk.log == ["book:mon"]
    # Reading the ended saga back is still fine.
    assert system.client.saga("desk", "agent", saga_id=saga_id).attach().wait(60) == (
        first.wait(60)
    )


@pytest.mark.parametrize("saga_id", [1042, b"order-1", "order-\udc80"])
def test_a_saga_id_that_is_no_text_is_refused_saying_so_before_anything_is_written(
    local: tuple[System, Desk], saga_id: Any
) -> None:
    """An order number passed as the saga id (``saga_id=order.id``, an int) crashed
    ``client.saga()`` with ``AttributeError: 'int' object has no attribute 'strip'``;
    bytes, or text that UTF-8 cannot hold (a lone surrogate from a bad decode), got
    as far as the start's write and failed there with an encoding traceback."""
    system, _desk = local
    with pytest.raises(InvalidSagaId, match="saga_id must be a string"):
        system.client.saga("desk", "agent", saga_id=saga_id)
    assert system.client._ledger._feeds == {}


def test_a_held_saga_whose_end_is_cancelled_while_awaited_is_still_let_go_R7(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saga left open on ApprovalPending is held (its records kept for resume())
    until it is ended or waited for. An ``end()`` whose task was cancelled while the
    end record's acknowledgement was awaited skipped the release: the end landed, the
    saga ended, and the client kept its records for as long as it lived."""
    system, _desk = local
    ledger = system.client._ledger
    writer = system.client._writer
    async_append = writer.append_async

    async def main() -> str:
        with pytest.raises(ApprovalPending):
            async with system.client.saga("desk", "agent") as saga:
                await saga.call("announce", text="hello", timeout_s=3)
        assert ledger.follows(saga.saga_id)  # held for resume()
        sent = asyncio.Event()

        async def append_async(record: Record, *, timeout_s: float = 30.0) -> None:
            await async_append(record, timeout_s=timeout_s)
            sent.set()
            await asyncio.get_running_loop().create_future()  # until cancelled

        monkeypatch.setattr(writer, "append_async", append_async)
        task = asyncio.create_task(saga.end(SagaOutcome.ABORT, "cancelled agent"))
        await sent.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return saga.saga_id

    saga_id = asyncio.run(main())
    assert _terminal_arrived(system.client, saga_id)
    assert not ledger.follows(saga_id)


def test_a_wait_in_progress_reads_the_records_attach_puts_before_the_ones_it_saw(
    local: tuple[System, Desk],
) -> None:
    """attach() puts the saga's earlier records, read from the ledger, before those the
    listener added; a wait in progress on the same saga counted the records it had
    read by position, so it skipped the ones put before them and waited out its
    timeout for a record the client held."""
    system, _desk = local
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="mon")
        saga.call("book_slot", day="tue")
    commits = [r for r in system.records(saga.saga_id) if isinstance(r, StepCommitted)]
    first, second = commits
    ledger = client_module._Ledger()
    ledger.follow(saga.saga_id)
    ledger.add([second])  # what the listener heard after the saga was followed
    scanned = threading.Event()
    found: list[object] = []

    def check(record: Record) -> object:
        if record is second:
            scanned.set()  # read while the wait holds the feed: it waits next
        return record if record is first else None

    waiter = threading.Thread(
        target=lambda: found.append(ledger.wait_for(saga.saga_id, check, 60)), daemon=True
    )
    waiter.start()
    assert scanned.wait(60)
    ledger.backfill(saga.saga_id, [first])  # attach(): the history, read from the ledger
    waiter.join(120)
    assert found == [first]


def test_a_sealed_call_repeated_under_its_step_id_after_attach_is_the_same_call(
    local: tuple[System, Desk],
) -> None:
    """A secret argument is sealed with a random nonce, and the arguments fingerprint
    covered the sealed bytes: the same call repeated under its step id by a restarted
    agent (attach(), then the call it is not sure was sent) got a new fingerprint,
    and the coordinator rejected it to the DLQ as ``duplicate-step``. The fingerprint
    now covers a sealed value's keyed marker, not its nonce and ciphertext."""
    system, desk = local
    card = "4111111111111111"
    settings = dataclasses.replace(system.settings, secret_key=b"agent and desk share this")
    with SagaClient(settings, system.bootstrap, local=wrap(desk, name="desk3")) as client:
        saga = client.saga("desk", "agent")
        saga.__enter__()  # started; the agent's process dies inside the block
        first = saga.call("charge_card", step_id="pay", amount=500, card=card)
        restarted = SagaClient(
            settings, system.bootstrap, catalogues=[wrap(desk, name="desk3")], call_timeout_s=30
        )
        with restarted:
            resumed = restarted.saga("desk", "agent", saga_id=saga.saga_id).attach()
            assert resumed.call("charge_card", step_id="pay", amount=500, card=card) == first
            resumed.end(SagaOutcome.COMPLETE)
            # The coordinator decided the repeat before the saga's terminal record.
            assert resumed.wait(60).status is TerminalStatus.COMPLETED
    scheduled = [r for r in system.records(saga.saga_id) if isinstance(r, StepScheduled)]
    assert len(scheduled) == 2
    assert scheduled[0].args != scheduled[1].args  # sealed twice, with two nonces
    assert scheduled[0].args_fingerprint == scheduled[1].args_fingerprint
    assert card.encode() not in scheduled[0].args
    assert [k for k, _h in system.dlq() if k == saga.saga_id.encode()] == []
    assert desk.log == [f"charge:500:{card}"]  # ran once


def test_a_step_id_repeated_with_other_arguments_is_refused_not_answered_by_the_first_call(
    local: tuple[System, Desk],
) -> None:
    """The coordinator rejects a step scheduled again under its id with other arguments
    or another tool (``duplicate-step``) and runs nothing; the client waited for the
    step id's outcome and returned the first call's result as this call's (here the
    Friday slot for a Sunday booking). Refused before anything is written, in the
    process that scheduled the step and in one that attach()ed the saga."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()
    first = saga.call("book_slot", step_id="slot", day="fri")
    with pytest.raises(CallRefused, match=r"already scheduled.*other arguments") as refused:
        saga.call("book_slot", step_id="slot", day="sun")
    assert refused.value.limit == "duplicate-step"
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        with pytest.raises(CallRefused, match=r"already scheduled.*other arguments"):
            resumed.call("book_slot", step_id="slot", day="sun")
        with pytest.raises(CallRefused, match="already scheduled with tool book_slot"):
            resumed.call("announce", step_id="slot", text="hi")
        assert resumed.call("book_slot", step_id="slot", day="fri") == first  # the same call
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED
    assert [k for k, _h in system.dlq() if k == saga.saga_id.encode()] == []
    assert desk.log == ["book:fri"]


def test_a_step_id_repeated_with_other_dependencies_is_refused_not_answered_by_the_first_call(
    local: tuple[System, Desk],
) -> None:
    """A call repeated under its step id with other ``depends_on`` was taken as the
    same call: the coordinator kept the first dependencies (now it rejects the record,
    ``duplicate-step``) and the call returned the first call's outcome, as if run
    after the steps it named. Refused before anything is written, in the process
    that scheduled the step and in one that attach()ed the saga."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()
    saga.call("book_slot", step_id="fri", day="fri")
    saga.call("book_slot", step_id="sat", day="sat", depends_on=[])
    first = saga.call("book_slot", step_id="sun", day="sun", depends_on=["fri"])
    with pytest.raises(CallRefused, match=r"already scheduled.*depend") as refused:
        saga.call("book_slot", step_id="sun", day="sun", depends_on=["fri", "sat"])
    assert refused.value.limit == "duplicate-step"
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        with pytest.raises(CallRefused, match=r"already scheduled.*depend"):
            resumed.call("book_slot", step_id="sun", day="sun")
        assert resumed.call("book_slot", step_id="sun", day="sun", depends_on=["fri"]) == first
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED
    assert [k for k, _h in system.dlq() if k == saga.saga_id.encode()] == []
    assert desk.log == ["book:fri", "book:sat", "book:sun"]


def test_a_saga_of_another_tenant_is_attached_under_its_own_tenant(
    local: tuple[System, Desk],
) -> None:
    """attach() wrote the calls and the end of a saga started with ``tenant_id=`` under
    the client's default tenant: the coordinator refused each (``tenant-mismatch``),
    so a restarted agent's calls waited out their timeout and its saga never ended.
    The saga's tenant is read from its start."""
    system, desk = local
    saga = system.client.saga("desk", "agent", tenant_id="tenant-b")
    saga.__enter__()
    saga.call("book_slot", day="fri")
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        assert resumed.call("book_slot", day="sat") == {"slot": "slot-sat"}
        assert resumed.tenant_id == "tenant-b"
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED
    assert [k for k, _h in system.dlq() if k == saga.saga_id.encode()] == []


def test_attaching_a_saga_that_was_never_started_says_so_before_anything_is_written(
    local: tuple[System, Desk],
) -> None:
    """attach() under an id with no start on the ledger (a typo, or a start that never
    reached the broker) went ahead: each call waited out its timeout and raised
    OutcomeUnknown ("may have run") while the coordinator rejected it as a step of an
    unknown saga, and wait() timed out. It is refused at once."""
    system, desk = local
    saga_id = f"never-started-{id(desk)}"
    with pytest.raises(InvalidSagaId, match=f"no saga {saga_id} on the ledger"):
        system.client.saga("desk", "agent", saga_id=saga_id).attach()
    assert system.records(saga_id) == []
    assert not system.client._ledger.knows(saga_id)  # not followed for nothing


def test_a_restarted_agent_resumes_a_step_of_a_saga_that_ended_meanwhile_from_its_records_R7(
    local: tuple[System, Desk],
) -> None:
    """attach() did not keep the saga's records once its terminal record was read, as
    a saga left open on ApprovalPending does: a restarted agent whose approval was
    denied (and the saga compensated) while it was down got SagaUnwinding from
    resume(), not the denial and its reason."""
    system, desk = local
    with pytest.raises(ApprovalPending) as err, system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="fri")
        saga.call("announce", text="hello", timeout_s=3)
    pending = err.value
    request = next(
        r
        for r in system.records(saga.saga_id)
        if isinstance(r, ApprovalRequested) and r.step_id == pending.step_id
    )
    channel = OperatorChannel.from_settings(system.settings, system.bootstrap)
    deny_approval(channel, request, operator="ops:alice", reason="not today")
    channel.close()
    assert saga.wait(60).status is TerminalStatus.COMPENSATED  # ended while "down"
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        with pytest.raises(ApprovalDeniedError, match="not today"):
            resumed.resume(pending.step_id)
        assert resumed.results == {"01-book_slot": {"slot": "slot-fri"}}
        assert resumed.resume("01-book_slot") == {"slot": "slot-fri"}
        assert resumed.wait(60).status is TerminalStatus.COMPENSATED
        assert not again._ledger.follows(saga.saga_id)  # waited for: let go


def test_a_restarted_agent_whose_step_ids_start_with_a_number_can_still_call(
    local: tuple[System, Desk],
) -> None:
    """attach() numbers new steps after the highest ``NN-`` prefix of the saga's step
    ids, and the client counted that number against ``max_steps``: a saga with a step
    named by a date (``20260101-book``) could make no further call once re-attached
    (CallRefused max_steps: "would get step 20260102"). The limit counts steps."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()
    first = saga.call("book_slot", step_id="20260101-book", day="fri")
    settings = dataclasses.replace(system.settings, limits=Limits(max_steps=2))
    with SagaClient(settings, system.bootstrap, catalogues=[wrap(desk, name="desk")]) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        assert resumed.call("book_slot", day="sat") == {"slot": "slot-sat"}
        with pytest.raises(CallRefused, match="would get step 3") as refused:
            resumed.call("book_slot", day="sun")
        assert refused.value.limit == "max_steps"
        # A step already scheduled is no new step.
        assert resumed.call("book_slot", step_id="20260101-book", day="fri") == first
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["book:fri", "book:sat"]


def test_attach_reads_step_ids_whose_prefix_is_no_plain_number(
    local: tuple[System, Desk],
) -> None:
    """attach() took a step id's prefix before ``-`` as a number when str.isdigit()
    said so, and int() refused what isdigit() accepts (``"²"``) or a prefix over
    Python's 4300 digits: the restarted agent's attach() crashed with a ValueError
    traceback. Such a prefix is not a number the client generated."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()
    saga.call("book_slot", step_id="²-book", day="fri")
    saga.call("book_slot", step_id="9" * 5000 + "-book", day="sat")
    with _restarted_agent(system, desk) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        assert resumed.call("book_slot", day="sun") == {"slot": "slot-sun"}
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED


def test_a_secret_argument_of_a_tool_pinned_by_contract_is_not_written_in_clear(
    local: tuple[System, Desk],
) -> None:
    """A client given a tool's contract (``contracts=``, as the drill and tests/system
    do) never read the published catalogue for it, and a contract does not carry the
    tool's secret fields: the secret argument reached ``sagaline.events`` in clear.
    The secret fields are read from the participant's published entry, also when
    another participant publishes the same tool name."""
    system, desk = local  # "desk" publishes charge_card too (the fixture's client)
    card = "4111111111111111"
    settings = dataclasses.replace(system.settings, secret_key=b"agent and desk share this")
    with SagaClient(settings, system.bootstrap, local=wrap(desk, name="desk5")) as served:
        pinned = wrap(desk, name="desk5").contracts()
        with SagaClient(settings, system.bootstrap, contracts=pinned) as client:
            with client.saga("desk", "agent") as saga:
                assert saga.call("charge_card", amount=500, card=card) == {"charge": "ch-500"}
            assert saga.wait(60).status is TerminalStatus.COMPLETED
        assert served.contract("charge_card").participant == "desk5"
    assert desk.log == [f"charge:500:{card}"]
    values = [v for _k, v, _h in LedgerReader(system.bootstrap).records(system.topics.events)]
    assert values and not any(v and card.encode() in v for v in values)


def test_a_call_repeated_after_its_tool_was_redeclared_is_waited_for_under_its_first_contract(
    local: tuple[System, Desk],
) -> None:
    """The coordinator keeps the contract a step was first scheduled with; the client
    waited for a repeated call under the contract the repeat carried (the tool's
    current one). Redeclared with fewer attempts, a transient failure the coordinator
    retried was taken for the last one: StepFailedError for a step that committed."""
    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()
    first = saga.call("flaky", step_id="slot", day="fri")  # failed once, then committed
    redeclared = wrap(desk, name="desk").contracts()
    redeclared["flaky"] = redeclared["flaky"].model_copy(
        update={"retry": RetryPolicy(max_attempts=1)}
    )
    with SagaClient(system.settings, system.bootstrap, contracts=redeclared) as again:
        resumed = again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        assert resumed.call("flaky", step_id="slot", day="fri") == first
        resumed.end(SagaOutcome.COMPLETE)
        assert resumed.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["flaky:fri", "flaky:fri"]


def test_an_abort_reason_quoting_a_secret_argument_reaches_no_topic_in_clear(
    local: tuple[System, Desk],
) -> None:
    """The agent's own exception, as the abort reason of ``SagaEndRequested``, was
    written as it was: an error quoting a secret the saga passed to a tool put the
    secret on ``sagaline.events`` in clear. The reason is scrubbed of the clear
    values of the saga's secret arguments, as a tool's error text is."""
    system, desk = local
    card, cvv = "4111111111111111", "737"
    settings = dataclasses.replace(system.settings, secret_key=b"agent and desk share this")
    with SagaClient(settings, system.bootstrap, local=wrap(desk, name="desk6")) as client:
        with pytest.raises(ValueError), client.saga("desk", "agent") as saga:
            saga.call("charge_card", amount=500, card=card)
            raise ValueError(f"card {card!r} declined by the bank")
        assert saga.wait(60).status is TerminalStatus.COMPENSATED

        async def agent() -> str:
            with contextlib.suppress(ValueError):
                async with client.saga("desk", "agent") as asaga:
                    await asaga.call("charge_card", amount=7, card=cvv)
                    raise ValueError(f"cvv {cvv} refused")
            return asaga.saga_id

        async_id = asyncio.run(agent())
    reader = LedgerReader(system.bootstrap)
    values = [v for _k, v, _h in reader.records(system.topics.events) if v]
    assert values and not any(card.encode() in v for v in values)
    ends = [
        r.reason
        for saga_id in (saga.saga_id, async_id)
        for r in reader.saga_records(system.topics.events, saga_id, settings.signer())
        if r.TYPE == "SagaEndRequested"
    ]
    marker = settings.sealer().marker
    assert ends == [
        f"ValueError: card '{marker(card)}' declined by the bank",
        f"ValueError: cvv {marker(cvv)} refused",
    ]


@pytest.mark.parametrize("timeout_s", [0, 0.0, -1.0, float("nan"), float("inf")])
def test_a_call_timeout_that_is_not_positive_is_refused_before_anything_is_written(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch, timeout_s: float
) -> None:
    """``timeout_s=0`` was read as "not given" (``timeout_s or call_timeout_s``): the
    call waited the client's whole call timeout, while a negative one or NaN wrote the
    step and gave up on its acknowledgement at once, the step running behind the
    agent's back. A timeout that is not a positive number is refused, nothing written."""
    system, _desk = local
    waits = _record_waits(system, monkeypatch)
    with system.client.saga("desk", "agent") as saga:
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            saga.call("book_slot", day="mon", timeout_s=timeout_s)
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            saga.resume("01-book_slot", timeout_s=timeout_s)

    async def agent() -> None:
        async with system.client.saga("desk", "agent") as asaga:
            with pytest.raises(ValueError, match="timeout_s must be a positive number"):
                await asaga.call("book_slot", day="tue", timeout_s=timeout_s)

    asyncio.run(agent())
    assert [w[0] for w in waits] == ["SagaStarted", "SagaEndRequested"] * 2
    with pytest.raises(ValueError, match="call_timeout_s must be a positive number"):
        SagaClient(system.settings, system.bootstrap, call_timeout_s=timeout_s)


def test_a_call_on_an_ended_saga_writes_nothing_and_names_how_the_saga_ended(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call after the saga ended still wrote a ``StepScheduled`` (which the
    coordinator does not run) and said the saga "is unwinding", also for a completed
    one. It is refused before anything is written, naming the saga's end: the one it
    asked for while the end is on its way, then the terminal status."""
    system, desk = local
    waits = _record_waits(system, monkeypatch)
    with system.client.saga("desk", "agent") as done:
        done.call("book_slot", day="mon")
    # The end is asked for (and may have been reached): the call comes after it.
    with pytest.raises(SagaUnwinding, match=r"ending \(complete requested|ended \(completed"):
        done.call("book_slot", day="tue")
    assert done.wait(60).status is TerminalStatus.COMPLETED
    with pytest.raises(SagaUnwinding, match=r"has ended \(completed\).*nothing was written"):
        done.call("book_slot", day="wed")

    undone = system.client.saga("desk", "agent")
    with contextlib.suppress(BusinessRejected), undone:
        undone.call("refuse")
    assert undone.wait(60).status is TerminalStatus.COMPENSATED

    async def agent() -> None:
        with pytest.raises(SagaUnwinding, match=r"has ended \(compensated\)"):
            await AsyncSaga(undone).call("book_slot", day="thu")

    asyncio.run(agent())
    # A repeated call of a step the saga ran is answered from its records, not written.
    with SagaClient(system.settings, system.bootstrap) as again:
        attached = again.saga("desk", "agent", saga_id=done.saga_id).attach()
        repeated = attached.call("book_slot", step_id="01-book_slot", day="mon")
        assert repeated == {"slot": "slot-mon"}
        with pytest.raises(SagaUnwinding, match=r"has ended \(completed\)"):
            attached.call("book_slot", day="fri")
        attached.wait(60)
    reader = LedgerReader(system.bootstrap)
    for saga, steps in ((done, ["01-book_slot"]), (undone, ["01-refuse"])):
        records = reader.saga_records(system.topics.events, saga.saga_id, system.settings.signer())
        assert [r.step_id for r in records if isinstance(r, StepScheduled)] == steps
    assert [w[0] for w in waits].count("StepScheduled") == 2
    assert desk.log == ["book:mon"]


def test_a_call_on_a_saga_that_was_not_started_writes_nothing_and_says_so(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool called before the saga's block (an adapter's toolset run before
    ``with client.saga(...)``) wrote a ``StepScheduled`` of a saga with no start,
    which the coordinator rejects, and at once said ``OutcomeUnknown: no outcome for
    book_slot within 30 s`` (no wait had run, and nothing could have run). It is
    refused before anything is written, saying to start or attach the saga first."""
    system, desk = local
    waits = _record_waits(system, monkeypatch)
    saga = system.client.saga("desk", "agent")
    with pytest.raises(CallRefused, match=r"not started.*nothing was written"):
        saga.call("book_slot", day="mon")

    async def agent() -> None:
        with pytest.raises(CallRefused, match="not started"):
            await AsyncSaga(saga).call("book_slot", day="tue")

    asyncio.run(agent())
    assert waits == []
    with saga:  # the same saga, started: its calls run
        assert saga.call("book_slot", day="wed") == {"slot": "slot-wed"}
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert desk.log == ["book:wed"]


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan"), float("inf")])
def test_a_wait_for_the_receipt_with_a_timeout_that_is_no_duration_is_refused(
    local: tuple[System, Desk], timeout_s: float
) -> None:
    """``saga.wait(float("nan"))`` spun a core until the saga ended (the time left was
    never <= 0, and each condition wait returned at once), ``wait(float("inf"))`` raised
    ``OverflowError: timestamp out of range``, and a negative one said the saga "is not
    terminal after -1.0 s". Each is a ValueError saying what a timeout must be; 0
    still answers from what has arrived."""
    system, _desk = local
    with system.client.saga("desk", "agent") as saga:
        saga.call("book_slot", day="mon")
    with pytest.raises(ValueError, match="timeout_s must be 0 or more seconds"):
        saga.wait(timeout_s)

    async def agent() -> None:
        with pytest.raises(ValueError, match="timeout_s must be 0 or more seconds"):
            await AsyncSaga(saga).wait(timeout_s)

    asyncio.run(agent())
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert saga.wait(0).status is TerminalStatus.COMPLETED


def test_a_wait_that_ends_without_a_record_this_client_cannot_read_says_so(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """A coordinator already on a later contract version wrote the saga's terminal
    record under a schema this client does not know. The listener skipped it without
    a word (nobody sends it to the DLQ: its writer reads it), so the wait ended as "not
    terminal after N s", as if the saga were still running. It must say that a record
    of the saga could not be read, why, and what to do."""
    from schemas import Envelope, FailureKind, envelope_for
    from schemas.wire import to_message
    from tests.newer_version import framed_by_a_newer_version

    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, state_dir=tmp_path, partitions=1
    )
    ensure_topics(kafka_bootstrap, settings.topics, [], 1)
    client = SagaClient(settings, kafka_bootstrap)
    client.check_coordinator = False  # none runs: the records below stand in for it
    client.start()
    try:
        saga = client.saga("desk", "agent").__enter__()

        def envelope(cls: type[Record]) -> Envelope:
            return envelope_for(
                cls,
                saga_id=saga.saga_id,
                tenant_id=saga.tenant_id,
                producer="coordinator",
                now=1_700_000_000_000,
            )

        terminal = SagaTerminal(
            envelope=envelope(SagaTerminal),
            status=TerminalStatus.COMPLETED,
            receipt=b"{}",
        )
        key = saga.saga_id.encode()
        value = framed_by_a_newer_version(terminal)
        client._writer.producer.produce(
            settings.topics.events, key=key, value=value, headers=client.signer.headers(key, value)
        )
        # Then a record it reads (behind it, on the same partition): once the listener
        # has it, it has been past the unreadable one.
        failed = StepFailed(
            envelope=envelope(StepFailed),
            step_id="01-x",
            tool="x",
            idempotency_key="k",
            attempt=1,
            kind=FailureKind.TRANSIENT,
            error_type="E",
            message="m",
        )
        k, v, h = to_message(failed, client.signer)
        client._writer.producer.produce(settings.topics.events, key=k, value=v, headers=h)
        assert client._writer.producer.flush(30) == 0
        seen = client._ledger.wait_for(
            saga.saga_id, lambda r: r if r.event_id == failed.event_id else None, 120
        )
        assert seen is not None

        with pytest.raises(TimeoutError) as raised:
            saga.wait(timeout_s=0.1)
        message = str(raised.value)
        assert "could not read" in message and "unknown-fingerprint" in message
        assert value[2:10].hex() in message
        assert "upgrade" in message
    finally:
        client.close()


def test_attach_refuses_a_saga_with_records_this_client_cannot_read(
    local: tuple[System, Desk],
) -> None:
    """attach() skipped the saga's records written under a schema this client does
    not know (a newer agent's, after a rollback of the agent): it numbered its next
    call as a step the newer agent had already scheduled, and its results and steps
    lacked those records. It refuses, naming the records and saying to upgrade, and
    writes nothing."""
    from sagaline.kafka import create_producer
    from schemas.wire import to_message
    from tests.newer_version import framed_by_a_newer_version

    system, desk = local
    saga = system.client.saga("desk", "agent")
    saga.__enter__()  # started; the agent's process dies inside the block
    saga.call("book_slot", day="fri")
    [first] = [r for r in system.records(saga.saga_id) if isinstance(r, StepScheduled)]
    newer_step = first.model_copy(update={"step_id": "02-book_slot"})
    signer = system.settings.signer()
    key, _value, _headers = to_message(newer_step, signer)
    newer = framed_by_a_newer_version(newer_step)
    producer = create_producer(system.bootstrap)
    producer.produce(system.topics.events, key=key, value=newer, headers=signer.headers(key, newer))
    assert producer.flush(30) == 0
    before = len(system.records(saga.saga_id))
    with _restarted_agent(system, desk) as again:
        with pytest.raises(SagaHistoryUnreadable) as err:
            again.saga("desk", "agent", saga_id=saga.saga_id).attach()
        assert newer[2:10].hex() in str(err.value) and "upgrade" in str(err.value)
        assert not again._ledger.knows(saga.saga_id)  # not followed for nothing
    assert len(system.records(saga.saga_id)) == before  # nothing written


def _refused_then_booked(
    system: System, bad: list[tuple[object, str]]
) -> tuple[Saga, list[CallRefused]]:
    """In one saga, ``book_slot(day=...)`` with each bad day, each refused with a
    ``CallRefused`` matching its pattern, then with a good day, which runs: the saga
    (ended) and the refusals."""
    refusals = []
    with system.client.saga("desk", "agent") as saga:
        for day, match in bad:
            with pytest.raises(CallRefused, match=match) as refused:
                saga.call("book_slot", day=day)
            refusals.append(refused.value)
        assert saga.call("book_slot", day="mon") == {"slot": "slot-mon"}
    return saga, refusals


def test_arguments_json_cannot_hold_are_refused_naming_them_and_use_no_step_number(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Decimal, a set, bytes or an integer past 64 bits (a model's JSON may hold
    one) in a call's arguments raised orjson's ``TypeError`` ("Type is not JSON
    serializable"), naming neither the tool nor the argument, and used up the step's
    number, so the next call was ``02-book_slot``. Now the call is refused
    (``CallRefused``, nothing written) naming the argument's path, and the next call
    gets the number the refused one would have had."""
    from decimal import Decimal

    system, desk = local
    waits = _record_waits(system, monkeypatch)
    bad: list[tuple[object, str]] = [
        (Decimal("1.5"), "args.day"),
        ({"mon", "tue"}, "args.day"),
        ({"when": [1, b"\x00"]}, r"args.day.when\[1\]"),
        ({"when": [2**70]}, r"args.day.when\[0\]"),
        ({1: "mon"}, "args.day"),
        ([1.0, float("nan")], r"args.day\[1\]"),
    ]
    saga, refusals = _refused_then_booked(
        system, [(day, rf"{path}.*nothing was written") for day, path in bad]
    )
    assert [r.tool for r in refusals] == ["book_slot"] * len(bad)
    assert list(saga.results) == ["01-book_slot"]
    assert [w[0] for w in waits] == ["SagaStarted", "StepScheduled", "SagaEndRequested"]
    assert desk.log == ["book:mon"]


class _Gate:
    """A tool that runs only once ``open`` is set (bounded wait)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    @tool(description="Pass the gate")
    @compensable(by="nothing")
    def pass_gate(self) -> str:
        assert self.open.wait(120), "the gate never opened"
        return "passed"

    def nothing(self) -> None:
        return None


class _ErrorMessage:
    """What a consumer's poll returns for an error (no record)."""

    def __init__(self, error: KafkaError) -> None:
        self._error = error

    def error(self) -> KafkaError:
        return self._error


def test_a_listener_refused_read_access_fails_pending_and_new_calls_naming_why(
    transport: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client's listener skipped every consumer error without a word: with read
    access to the ledger taken away (TOPIC_AUTHORIZATION_FAILED) every pending call
    waited out its timeout as "no outcome within 30 s", and so did every later one,
    nothing saying why. Now a passing error is logged once in a while, and one that
    lasts (refused access, a fatal error) stops the listener: the pending call ends at
    once naming it, and a new saga is refused before anything is written."""
    gate = _Gate()
    errors: list[KafkaError] = []
    # The tool returns once the listener was handed the refusal: its outcome could
    # only reach a listener that skipped it.
    handed = gate.open
    real = client_module.create_consumer

    class Refused:
        def __init__(self, consumer: Any) -> None:
            self._consumer = consumer

        def poll(self, timeout: float) -> Any:
            if errors:
                message = _ErrorMessage(errors.pop(0))
                if not errors:
                    handed.set()
                return message
            return self._consumer.poll(timeout)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._consumer, name)

    catalogue = wrap(gate, name="gate")
    with System(transport, unique_prefix, tmp_path, [catalogue]) as system:
        # Only this client's listener gets the errors, not the system's own client.
        monkeypatch.setattr(
            client_module, "create_consumer", lambda *a, **k: Refused(real(*a, **k))
        )
        client = SagaClient(system.settings, transport, catalogues=[catalogue], call_timeout_s=60)
        client.start()
        try:
            caplog.set_level("WARNING", logger="sagaline.client")
            saga = client.saga("gate", "agent")
            with pytest.raises(OutcomeUnknown, match="TOPIC_AUTHORIZATION_FAILED"), saga:
                errors.extend(
                    [
                        KafkaError(KafkaError._TRANSPORT),
                        KafkaError(KafkaError._TRANSPORT),
                        KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED),
                    ]
                )
                saga.call("pass_gate")
            later = client.saga("gate", "agent")
            with pytest.raises(RuntimeError, match="TOPIC_AUTHORIZATION_FAILED"), later:
                pass
        finally:
            client.close()
    passing = [r for r in caplog.records if "_TRANSPORT" in r.getMessage()]
    assert len(passing) == 1


def test_sagas_whose_start_never_reached_the_ledger_are_not_followed_for_good(
    local: tuple[System, Desk], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saga whose ``SagaStarted`` was not acknowledged stays followed in case the
    start lands later (an abort is queued behind it, and its terminal record lets it
    go). One whose start never lands gets no record at all, so the listener followed
    it for as long as the client lived: a long-lived agent behind a flapping broker
    grew with every failed start. Now only the most recent ``ended_sagas_kept`` such
    sagas are followed; older ones are let go."""
    system, desk = local
    client = SagaClient(
        system.settings,
        system.bootstrap,
        catalogues=[wrap(desk, name="desk")],
        call_timeout_s=30,
        ended_sagas_kept=2,
    )
    client.start()
    try:
        sync_append = client._writer.append

        def start_lost(record: Record, *, timeout_s: float = 30.0) -> None:
            if isinstance(record, SagaStarted):  # never sent: it never lands
                raise DeliveryFailed("no acknowledgement for SagaStarted", topic="t", error=None)
            sync_append(record, timeout_s=timeout_s)

        monkeypatch.setattr(client._writer, "append", start_lost)
        sagas = [client.saga("desk", "agent") for _ in range(3)]
        for saga in sagas:
            with pytest.raises(DeliveryFailed), saga:
                pass
        assert [client._ledger.follows(s.saga_id) for s in sagas] == [False, True, True]
        assert len(client._ledger._feeds) == 2
        # A start that is acknowledged again is followed as ever, and ends.
        monkeypatch.setattr(client._writer, "append", sync_append)
        with client.saga("desk", "agent") as saga:
            assert saga.call("book_slot", day="fri") == {"slot": "slot-fri"}
        assert saga.wait(60).status is TerminalStatus.COMPLETED
    finally:
        client.close()


@dataclasses.dataclass
class _Slot:
    day: str
    hours: float


@dataclasses.dataclass(slots=True)
class _Window:
    slots: list[_Slot]


def test_a_nan_inside_a_dataclass_argument_is_refused_not_written_as_null(
    local: tuple[System, Desk],
) -> None:
    """orjson writes a dataclass as an object and a NaN or infinity in it as ``null``,
    but the check for non-finite numbers walked dicts, lists and tuples only: a call
    with ``_Slot("mon", nan)`` was written (and run) with ``"hours": null``. It is
    refused like any other non-finite argument, naming the field's path, and
    nothing is written."""
    system, desk = local
    bad: list[tuple[object, str]] = [
        (_Slot("mon", float("nan")), "args.day.hours"),
        (_Window([_Slot("mon", 1.0), _Slot("tue", float("inf"))]), r"args.day.slots\[1\].hours"),
    ]
    saga, refusals = _refused_then_booked(
        system, [(day, rf"{path} .*NaN or infinite") for day, path in bad]
    )
    assert [r.limit for r in refusals] == ["finite-numbers"] * len(bad)
    assert list(saga.results) == ["01-book_slot"]
    assert desk.log == ["book:mon"]
    assert [r.step_id for r in system.records(saga.saga_id) if isinstance(r, StepScheduled)] == [
        "01-book_slot"
    ]


class _PlainSlot(_Slot):
    """A subclass not decorated itself: orjson writes only classes that are
    dataclasses themselves, so this one cannot be written as JSON."""


def test_a_subclass_of_a_dataclass_is_refused_naming_its_path_as_orjson_refuses_it(
    local: tuple[System, Desk],
) -> None:
    """orjson writes an instance as an object only when its own class is a dataclass
    (``__dataclass_fields__`` in the class itself); ``dataclasses.is_dataclass`` says
    yes for an undecorated subclass too. The walkers took it for an object orjson
    writes, so the refusal named ``args`` instead of ``args.day`` (and a NaN in it was
    reported as the problem, though no value of it can be written)."""
    system, desk = local
    match = r"argument args\.day of book_slot cannot be written as JSON \(.*_PlainSlot"
    _saga, refusals = _refused_then_booked(
        system, [(day, match) for day in (_PlainSlot("mon", 1.0), _PlainSlot("mon", float("nan")))]
    )
    assert [r.limit for r in refusals] == ["json-args"] * 2
    assert desk.log == ["book:mon"]


def test_arguments_that_hold_themselves_or_nest_too_deep_are_refused_saying_so(
    local: tuple[System, Desk],
) -> None:
    """A list that holds itself (or nesting deeper than the Python stack) made the
    argument checks recurse until ``RecursionError``, a traceback from the client's
    internals instead of a refusal. Now the call is refused (``CallRefused``,
    ``limit="json-args"``) naming where, and nothing is written; the next call gets
    the step number."""
    system, desk = local
    loop: list[Any] = ["mon"]
    loop.append(loop)
    deep: Any = "mon"
    for _ in range(5000):
        deep = [deep]
    saga, refusals = _refused_then_booked(
        system,
        [
            (day, rf"argument {path}.* cannot be written as JSON \(.*deeper.*nothing was")
            for day, path in [(loop, r"args.day\[1\]"), (deep, r"args.day(\[0\])+")]
        ],
    )
    assert [r.limit for r in refusals] == ["json-args"] * 2
    assert list(saga.results) == ["01-book_slot"]
    assert desk.log == ["book:mon"]
