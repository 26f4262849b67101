"""The demo's fault schedule holds agents back so every fault lands mid-run."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any, cast

import pytest

from participants.client import SagaClient
from services.cli import build_parser
from services.demo import (
    AgentOutcome,
    DemoFault,
    DemoOptions,
    DemoRun,
    FaultGate,
    RefundAgent,
    _fault_injector,
    declared_catalogues_cached,
)
from services.demo_processes import ManagedProcess, ServiceSpec, Supervisor
from services.demo_progress import ProgressDisplay, SagaBoard
from services.refund.agent import CheckedPlan, checked_plan, generate_tickets


def _start(gate: FaultGate, index: int) -> threading.Thread:
    thread = threading.Thread(target=gate, args=(index,), daemon=True)
    thread.start()
    return thread


def test_sagas_up_to_after_plus_concurrency_start_without_waiting() -> None:
    gate = FaultGate([5], concurrency=2)
    for index in range(7):  # 0..6: fewer than 5 + 2 sagas before them
        gate(index)  # returns at once (a hang fails the test by its timeout)


def test_a_later_saga_waits_until_the_fault_has_fired() -> None:
    gate = FaultGate([5, 9], concurrency=2)
    held = _start(gate, 7)
    held.join(0.2)
    assert held.is_alive(), "saga 7 started before the fault due after 5 terminal sagas"
    gate.fired()
    held.join(30)
    assert not held.is_alive()
    later = _start(gate, 11)  # also needs the fault due after 9
    later.join(0.2)
    assert later.is_alive()
    gate.open()  # the injector ended (all applied, or it gave up): nobody waits
    later.join(30)
    assert not later.is_alive()


# ------------------------------------------------------------- the fault injector


class _FakeProcess(ManagedProcess):
    """A service that records what was done to it instead of running anything."""

    def __init__(self, name: str) -> None:
        super().__init__(ServiceSpec(name, [], {}, Path("/nonexistent") / f"{name}.log"))
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")
        self.starts += 1

    def kill9(self) -> None:
        self.calls.append("kill9")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        self.calls.append("stop")
        return 0


class _DoneBoard(SagaBoard):
    """Every saga the injector waits for is already terminal."""

    def wait_count(self, count: int, timeout_s: float) -> bool:
        return True


def _demo(tmp_path: Path, **options: object) -> DemoRun:
    fields: dict[str, object] = {"sagas": 10, "concurrency": 2, "ui": False, **options}
    return DemoRun(
        options=DemoOptions(**fields),  # type: ignore[arg-type]
        run_id="test",
        prefix="test.",
        state_dir=tmp_path,
        bootstrap="unused:0",
        tickets=[],
        scenarios={},
    )


def _inject(run: DemoRun, supervisor: Supervisor) -> list[threading.ExceptHookArgs]:
    """Run the run's fault schedule to its end; the exceptions its thread leaked."""
    leaked: list[threading.ExceptHookArgs] = []
    board = _DoneBoard()
    display = ProgressDisplay(board, 10, live=False, out=io.StringIO())
    previous = threading.excepthook
    threading.excepthook = leaked.append
    try:
        assert _fault_injector(run, supervisor, board, display) is not None
        for thread in threading.enumerate():
            if thread.name == "fault-injector":
                thread.join(60)
    finally:
        threading.excepthook = previous
    return leaked


def test_a_fault_that_raises_fails_the_run_instead_of_dying_in_its_thread(
    tmp_path: Path,
) -> None:
    """A DemoFault whose act raised killed the injector thread with a traceback and the
    run went on (and could end "demo OK") as if the fault had happened."""

    def broken(_supervisor: Supervisor) -> str:
        raise RuntimeError("the broker would not stop")

    run = _demo(tmp_path, faults=(DemoFault(3, "broker", broken),))
    leaked = _inject(run, Supervisor("unused:0"))
    assert not leaked, f"the injector thread died: {leaked[0].exc_value!r}"
    assert run.faults == []
    assert any("broker" in p and "the broker would not stop" in p for p in run.fault_problems)


def test_a_kill_due_after_the_demo_stopped_everything_restarts_nothing(tmp_path: Path) -> None:
    """The injector restarted a service after stop_all (the demo stopping): a
    participant left running after the demo said it had stopped everything."""
    supervisor = Supervisor("unused:0")
    inventory = _FakeProcess("inventory")
    supervisor.processes["inventory"] = inventory
    supervisor.stop_all()
    run = _demo(tmp_path, kill_service="inventory", kill_after=3)
    _inject(run, supervisor)
    assert inventory.calls == ["stop"], "a service was started again after stop_all"
    assert run.fault_problems, "the kill that did not happen is not reported"


class _NeverBoard(SagaBoard):
    """The sagas end without ever reaching the count a fault waits for."""

    def wait_count(self, count: int, timeout_s: float) -> bool:
        return False


def test_a_kill_that_never_fired_before_the_run_ended_fails_the_run(tmp_path: Path) -> None:
    """--kill-after at or above what the run reaches: the kill never fired, nothing
    said so and the run could end "demo OK"."""
    run = _demo(tmp_path, kill_service="inventory", kill_after=9, timeout_s=1)
    supervisor = Supervisor("unused:0")
    inventory = _FakeProcess("inventory")
    supervisor.processes["inventory"] = inventory
    board = _NeverBoard()
    display = ProgressDisplay(board, 10, live=False, out=io.StringIO())
    assert _fault_injector(run, supervisor, board, display) is not None
    with supervisor.lock:  # the run is over: every saga ended
        run.faults_closed.set()
    for thread in threading.enumerate():
        if thread.name == "fault-injector":
            thread.join(60)
    assert inventory.calls == []
    assert any("inventory" in p and "never fired" in p for p in run.fault_problems), (
        run.fault_problems
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--sagas", "20", "--kill-service", "inventory", "--kill-after", "10"],
        ["--sagas", "20", "--concurrency", "4", "--kill-service", "payments", "--kill-after", "16"],
        ["--sagas", "5", "--kill-coordinator-after", "5"],
    ],
)
def test_a_kill_due_too_late_to_land_mid_run_is_a_usage_error(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No saga waits for a kill due after K terminal sagas when K >= sagas - concurrency:
    it may fire after the last saga, or never (K >= sagas), and the run said OK."""
    import services.demo as demo

    def must_not_run(_options: demo.DemoOptions) -> demo.DemoRun:
        raise AssertionError("the demo ran with a kill that cannot land mid-run")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    args = build_parser().parse_args(["demo", "--no-ui", *flags])
    assert args.func(args) == 2
    assert "--sagas minus --concurrency" in capsys.readouterr().err


class _StuckBoard(SagaBoard):
    """No saga ever ends (the coordinator died, say): every wait runs out."""

    def __init__(self) -> None:
        super().__init__()
        self._never = threading.Event()

    def wait_count(self, count: int, timeout_s: float) -> bool:
        self._never.wait(timeout_s)
        return False


def test_agents_held_for_a_fault_that_can_never_be_due_give_up_within_the_timeout(
    tmp_path: Path,
) -> None:
    """Fewer than K sagas ever ended: the agents held back for the kill due after K
    waited forever, and --timeout (applied only once every agent had returned)
    never came: the demo hung."""
    run = _demo(tmp_path, kill_service="inventory", kill_after=2, concurrency=1, timeout_s=1)
    supervisor = Supervisor("unused:0")
    inventory = _FakeProcess("inventory")
    supervisor.processes["inventory"] = inventory
    board = _StuckBoard()
    display = ProgressDisplay(board, 10, live=False, out=io.StringIO())
    gate = _fault_injector(run, supervisor, board, display)
    assert gate is not None
    answers: list[bool] = []
    held = threading.Thread(target=lambda: answers.append(gate(3)), daemon=True)
    held.start()
    held.join(120)  # far beyond the run's 1 s timeout: a busy machine still passes
    run.faults_closed.set()  # let a hung injector go (before the test fails)
    assert not held.is_alive(), "the held agent still waits for a fault that never fires"
    assert answers == [False], "a saga held back by a fault schedule that gave up was started"
    assert inventory.calls == []
    assert any("inventory" in p and "never fired" in p for p in run.fault_problems), (
        run.fault_problems
    )


def test_plans_the_gate_refuses_are_not_started() -> None:
    class _Agent(RefundAgent):
        def run_ticket(self, plan: CheckedPlan) -> AgentOutcome:
            raise AssertionError(f"started {plan.ticket.ticket_id} although the gate refused")

    tickets = generate_tickets(3, 7)
    plans = [checked_plan(t, declared_catalogues_cached()) for t in tickets]
    started: list[str] = []
    outcomes = _Agent(cast(SagaClient, None)).run_all(
        plans, 2, on_start=started.append, gate=lambda _index: False
    )
    assert outcomes == [] and started == []


class _OutageSaga:
    """A saga whose calls are not acknowledged in time (the broker away): the step's
    record stays queued in the client's producer and lands once the broker is back,
    when ``resume`` gets its result."""

    saga_id = "refund-T-out"

    def __init__(self, failure: Exception) -> None:
        self.failure = failure
        self.called: list[str] = []
        self.resumed: list[str] = []

    def call(self, tool: str, *, step_id: str, timeout_s: float, **args: Any) -> Any:
        self.called.append(step_id)
        raise self.failure

    def resume(self, step_id: str, timeout_s: float | None = None) -> Any:
        self.resumed.append(step_id)
        return {"sent": step_id}


def test_the_demo_agent_waits_again_for_a_step_the_broker_did_not_acknowledge_R6() -> None:
    """A broker outage longer than the call timeout: leaving the block aborted the saga,
    and past the pivot an abort completes it as it stands: the credit issued, no reply
    sent (CI: "credit ... stands but no reply mentions it"). The agent waits for the
    step once more, under the id its call scheduled."""
    from sagaline.kafka import DeliveryFailed

    saga = _OutageSaga(DeliveryFailed("no acknowledgement within 60 s", topic="t", error=None))
    agent = RefundAgent(cast(SagaClient, None), call_timeout_s=1)
    got = agent._call(cast(Any, saga), "05-send_reply", "send_reply", {"to": "x"})
    assert got == {"sent": "05-send_reply"}
    assert (saga.called, saga.resumed) == (["05-send_reply"], ["05-send_reply"])


def test_the_demo_agent_does_not_wait_for_a_step_refused_for_its_size() -> None:
    from confluent_kafka import KafkaError

    from sagaline.kafka import DeliveryFailed

    too_large = DeliveryFailed(
        "refused", topic="t", error=KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    )
    assert too_large.too_large
    saga = _OutageSaga(too_large)
    agent = RefundAgent(cast(SagaClient, None), call_timeout_s=1)
    with pytest.raises(DeliveryFailed):
        agent._call(cast(Any, saga), "05-send_reply", "send_reply", {"to": "x"})
    assert saga.resumed == []
