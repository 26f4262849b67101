"""``sagaline demo`` and ``sagaline agent run``: the refund example, end to end.

``sagaline demo`` is the README's main command. On one machine it

1. starts (or reuses) the local Kafka broker and creates this run's topics under a
   prefix of its own (``demo-<run id>.``), so runs never see each other;
2. writes the seeded fault plan to a file and starts the coordinator and the five
   refund participants as separate processes, each logging under the state dir;
3. runs N refund sagas through the saga client from C agent threads, each agent
   choosing its tool sequence per ticket (and fixing the badly ordered plan the plan
   check flags, R17), while an operator thread approves the IRREVERSIBLE replies
   through ``sagaline.ops.actions`` -- the path a person uses (R7);
4. draws live progress, then prints a summary from ``sagaline.terminal``, one
   receipt for a person, and the invariant checked against each provider's own
   SQLite file (``services.demo_invariants``);
5. stops every process it started, also on Ctrl-C or an error.

It exits 0 only when every saga is terminal, the invariant holds, every fault it was
asked for fired mid-run and no service it started exited on its own.

``sagaline agent run`` is step 3 alone, against a system that is already running
(docker compose): no processes, no fault plan, no provider files to read.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from participants.catalogue import Catalogue
from participants.client import ApprovalPending, OutcomeUnknown, Saga, SagaCallError, SagaClient
from sagaline.kafka import (
    DeliveryFailed,
    KafkaException,
    LedgerReader,
    TopicMissing,
    TopicSetupError,
    ensure_topics,
    require_bootstrap,
)
from sagaline.ops.actions import OperatorChannel
from schemas.models import Record, SagaTerminal
from schemas.receipt import Receipt
from schemas.settings import Settings
from schemas.topics import DEFAULT_PARTITIONS, MAX_PARTITIONS
from services._args import at_least, between, port, seconds
from services.cli import PARENT_PID_VAR
from services.demo_invariants import (
    ProviderFileUnreadable,
    ProviderWorld,
    Violation,
    check_invariants,
    read_world,
)
from services.demo_processes import ProcessFailed, ServiceSpec, Supervisor, python_env, wait_until
from services.demo_progress import (
    COMPENSATING,
    DemoOperator,
    LedgerFollower,
    ProgressDisplay,
    SagaBoard,
)
from services.refund import PARTICIPANTS, build_catalogue
from services.refund.agent import (
    TOOL_PARTICIPANTS,
    CheckedPlan,
    Scenario,
    Ticket,
    assign_scenarios,
    checked_plan,
    fault_plan_for,
    generate_tickets,
    resolve_args,
)

__all__ = [
    "AgentOutcome",
    "DemoFault",
    "DemoOptions",
    "DemoRun",
    "FaultEvent",
    "RefundAgent",
    "register",
    "run_agent",
    "run_demo",
]

DEMO_HMAC_KEY = "sagaline-demo-signing-key"
"""Signs this run's records (every process of the run shares it); not a secret."""

OPERATOR = "demo-operator"
PRINCIPAL = "agent:atlas-refunds"
WORKFLOW = "refund"


# ------------------------------------------------------------------------ agent


@dataclass(frozen=True)
class AgentOutcome:
    """How the agent left one saga's ``with`` block."""

    ticket: Ticket
    saga_id: str
    ended: str  # "complete" | "abort"
    error: str | None = None


def declared_catalogues() -> list[Catalogue]:
    """The refund tools' declarations, for the agent's plan check (R17).

    The agent never runs a tool itself; it only needs what each tool declares, so the
    providers behind these catalogues live in a throw-away directory.
    """
    with tempfile.TemporaryDirectory(prefix="sagaline-plan-") as scratch:
        catalogues = [build_catalogue(name, Path(scratch)) for name in PARTICIPANTS]
        for catalogue in catalogues:
            for participant in catalogue.participants:
                provider = getattr(participant, "provider", None)
                if provider is not None:
                    provider.store.close()
        return catalogues


class RefundAgent:
    """Runs each ticket's checked plan as one saga, from a pool of agent threads."""

    def __init__(self, client: SagaClient, *, call_timeout_s: float = 60.0, run_tag: str = ""):
        self.client = client
        self.call_timeout_s = call_timeout_s
        self.run_tag = run_tag or uuid.uuid4().hex[:6]

    def saga_id(self, ticket: Ticket) -> str:
        return f"refund-{ticket.ticket_id}-{self.run_tag}"

    def run_ticket(self, plan: CheckedPlan) -> AgentOutcome:
        """One saga: the calls in order; a typed call error leaves the block by
        exception, which requests the abort (and so the compensation)."""
        ticket = plan.ticket
        saga_id = self.saga_id(ticket)
        results: dict[str, Any] = {}
        try:
            with self.client.saga(WORKFLOW, PRINCIPAL, saga_id=saga_id) as saga:
                for number, call in enumerate(plan.plan, 1):
                    args = resolve_args(call.args, results)
                    step_id = f"{number:02d}-{call.tool}"  # the id the client would give
                    results[call.tool] = self._call(saga, step_id, call.tool, args)
        except SagaCallError as exc:
            return AgentOutcome(ticket, saga_id, "abort", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a broken agent still ends its saga (abort above)
            return AgentOutcome(ticket, saga_id, "abort", f"{type(exc).__name__}: {exc}")
        return AgentOutcome(ticket, saga_id, "complete")

    def _call(self, saga: Saga, step_id: str, tool: str, args: dict[str, Any]) -> Any:
        """One call. A step still waiting after the call timeout (its approval not acted
        on yet, its outcome not reconciled yet: e.g. while the coordinator restarts),
        or whose record the broker has not acknowledged yet (a broker outage: it stays
        queued and lands once the broker is back), gets one more wait: past the pivot
        an abort would end the saga with the credit issued and no reply sent (R6).
        Leaving the block on ``ApprovalPending`` would leave the saga open for good
        (R7: the client then ends nothing), so a second one aborts."""
        try:
            return saga.call(tool, step_id=step_id, timeout_s=self.call_timeout_s, **args)
        except (ApprovalPending, OutcomeUnknown, DeliveryFailed) as waiting:
            if isinstance(waiting, DeliveryFailed) and waiting.too_large:
                raise  # refused for its size: it never lands
            _say(f"  agent: {saga.saga_id}: {waiting}; waiting once more")
            try:
                return saga.resume(step_id, timeout_s=self.call_timeout_s)
            except ApprovalPending as still:
                raise SagaCallError(
                    f"{still}, still after {2 * self.call_timeout_s:.0f} s: giving up",
                    saga_id=still.saga_id,
                    step_id=still.step_id,
                    tool=still.tool,
                ) from still

    def run_all(
        self,
        plans: Sequence[CheckedPlan],
        concurrency: int,
        on_start: Callable[[str], None] | None = None,
        gate: Callable[[int], bool] | None = None,
    ) -> list[AgentOutcome]:
        """Run every plan from ``concurrency`` daemon threads (a Ctrl-C never waits
        for them); returns the outcomes of the plans run, in plan order. ``gate(index)``
        is called before plan ``index`` starts and may block (the fault schedule's start
        gate); when it returns False the plan is not started (the run gave up)."""
        work: queue.Queue[tuple[int, CheckedPlan]] = queue.Queue()
        for item in enumerate(plans):
            work.put(item)
        outcomes: list[AgentOutcome | None] = [None] * len(plans)

        def worker() -> None:
            while True:
                try:
                    index, plan = work.get_nowait()
                except queue.Empty:
                    return
                if gate is not None and not gate(index):
                    continue
                if on_start is not None:
                    on_start(self.saga_id(plan.ticket))
                outcomes[index] = self.run_ticket(plan)

        threads = [
            threading.Thread(target=worker, name=f"agent-{i}", daemon=True)
            for i in range(max(1, concurrency))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
        return [o for o in outcomes if o is not None]


def plan_fix_message(plans: Iterable[CheckedPlan]) -> str | None:
    """Words for the first plan the check flagged and the agent fixed (R17)."""
    for plan in plans:
        if not plan.was_fixed:
            continue
        first = [c.tool for c in plan.first_report.calls]
        errors = "; ".join(str(f) for f in plan.first_report.errors)
        return (
            f"plan check (R17) on ticket {plan.ticket.ticket_id}: the agent's first draft\n"
            f"    {' -> '.join(first)}\n"
            f"  was refused: {errors}\n"
            f"  the agent fixed it before running anything:\n"
            f"    {' -> '.join(c.tool for c in plan.plan)}"
        )
    return None


def wait_for_catalogue(client: SagaClient, timeout_s: float) -> set[str]:
    """Wait until the participants have published every refund tool; the missing ones."""
    missing: set[str] = set(TOOL_PARTICIPANTS)

    def known() -> bool:
        client.refresh_catalogue()
        missing.difference_update({t for t in list(missing) if _has_contract(client, t)})
        return not missing

    wait_until(known, timeout_s, interval_s=0.5)
    return missing


def _has_contract(client: SagaClient, tool: str) -> bool:
    try:
        client.contract(tool)
    except LookupError:
        return False
    return True


# ------------------------------------------------------------------------- demo


@dataclass(frozen=True)
class DemoOptions:
    sagas: int = 200
    seed: int = 7
    concurrency: int = 16
    partitions: int = DEFAULT_PARTITIONS
    state_dir: Path | None = None
    keep: bool = False
    ui: bool = True
    kill_service: str | None = None
    kill_after: int = 0
    kill_coordinator_after: int = 0
    call_timeout_s: float = 60.0
    timeout_s: float = 300.0
    dashboard_port: int = 0  # 0: no dashboard
    faults: tuple[DemoFault, ...] = ()  # injected by tests: broker kills, scale-out


@dataclass(frozen=True)
class DemoFault:
    """Something a test does to the running system after ``after`` terminal sagas
    (kill or stop a broker, start another coordinator, move a partition). ``act``
    gets the run's supervisor and returns what it did, for the run's fault log."""

    after: int
    name: str
    act: Callable[[Supervisor], str]


@dataclass
class DemoRun:
    """Everything one run knows, for the summary."""

    options: DemoOptions
    run_id: str
    prefix: str
    state_dir: Path
    bootstrap: str
    tickets: list[Ticket]
    scenarios: dict[str, Scenario]
    saga_of: dict[str, str] = field(default_factory=dict)  # ticket id -> saga id
    started_at: float = 0.0
    ended_at: float = 0.0
    faults: list[FaultEvent] = field(default_factory=list)
    receipts: dict[str, Receipt] = field(default_factory=dict)  # saga id -> receipt
    violations: list[Violation] = field(default_factory=list)
    stop_codes: dict[str, int | None] = field(default_factory=dict)
    exit_code: int = 1
    fault_problems: list[str] = field(default_factory=list)  # faults that failed
    crashed: list[tuple[str, int | None]] = field(default_factory=list)  # (service, exit code)
    not_started: int = 0  # sagas held back for a fault that could never be due
    faults_closed: threading.Event = field(default_factory=threading.Event, repr=False)
    fault_thread: threading.Thread | None = field(default=None, repr=False)


@dataclass(frozen=True)
class FaultEvent:
    """A process the run killed with SIGKILL and started again."""

    service: str
    old_pid: int | None
    new_pid: int | None
    terminal_before: int  # sagas terminal when it was killed
    compensating: int  # sagas compensating when it was killed
    detail: str = ""  # what a DemoFault did

    def __str__(self) -> str:
        if self.detail:
            return f"{self.service} after {self.terminal_before} terminal sagas: {self.detail}"
        return (
            f"kill -9 {self.service} (pid {self.old_pid}) after {self.terminal_before} terminal"
            f" sagas, {self.compensating} compensating; restarted as pid {self.new_pid}"
        )


def _say(message: str = "") -> None:
    print(message, flush=True)


def run_demo(options: DemoOptions) -> DemoRun:
    """Run the demo; ``.exit_code`` is 0 when every saga is terminal and consistent."""
    from services.broker import choose_broker

    if options.kill_service and options.kill_service not in PARTICIPANTS:
        raise ValueError(
            f"--kill-service: no participant {options.kill_service!r}; one of {list(PARTICIPANTS)}"
        )
    choice = choose_broker()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    state_dir = (options.state_dir or Path(".sagaline") / f"demo-{run_id}").resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    tickets = generate_tickets(options.sagas, options.seed)
    run = DemoRun(
        options=options,
        run_id=run_id,
        prefix=f"demo-{run_id}.",
        state_dir=state_dir,
        bootstrap=choice.bootstrap,
        tickets=tickets,
        scenarios=assign_scenarios(tickets, options.seed),
    )
    _say(
        f"sagaline demo: {options.sagas} refund sagas, seed {options.seed}, "
        f"{options.concurrency} agents"
    )
    _say(f"  kafka:  {choice.description}")
    _say(f"  topics: {run.prefix}sagaline.*   state and logs: {state_dir}")
    supervisor = Supervisor(choice.bootstrap)
    try:
        run.exit_code = _run(run, supervisor)
    except ProcessFailed as exc:
        _say(f"sagaline demo: {exc}")
        run.exit_code = 1
    except (KafkaException, TopicSetupError, DeliveryFailed) as exc:
        _say(
            f"sagaline demo: Kafka at {run.bootstrap} did not answer as needed: {_kafka_error(exc)}"
        )
        run.exit_code = 1
    finally:
        if options.keep:
            alive = {n: p.pid for n, p in supervisor.processes.items() if p.alive}
            _say(f"--keep: left running {alive}; topic prefix {run.prefix}")
        else:
            codes = run.stop_codes = supervisor.stop_all()
            unclean = {n: c for n, c in codes.items() if c not in (0, None)}
            _say(
                f"stopped {len(codes)} processes"
                + (f" (exit codes {unclean})" if unclean else " cleanly")
            )
    return run


def _kafka_error(exc: Exception) -> str:
    """The words of a Kafka error (librdkafka's own text, not its repr)."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    text = getattr(error, "str", None)
    return str(text()) if callable(text) else str(exc)


_NOT_INHERITED = (
    "SAGALINE_HMAC_KEY_ID",
    "SAGALINE_TRUST_FILE",
    "SAGALINE_SIGNING_KEY",
    "SAGALINE_SIGNING_KEY_ID",
    "SAGALINE_SECRET_KEY",
    "SAGALINE_SECRET_KEY_ID",
    "SAGALINE_OLD_SECRET_KEYS",
)


def _service_env(run: DemoRun, fault_file: Path) -> dict[str, str]:
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": run.bootstrap,
        "SAGALINE_TOPIC_PREFIX": run.prefix,
        "SAGALINE_PARTITIONS": str(run.options.partitions),
        "SAGALINE_STATE_DIR": str(run.state_dir),
        "SAGALINE_FAULTS": f"@{fault_file}",
        "SAGALINE_HMAC_KEY": DEMO_HMAC_KEY,
        # The run's agent, operator and progress reader sign with the demo key alone
        # and seal nothing: the shell's other signing and sealing settings (a team's
        # own key id, a trust file) would make every service refuse their records.
        # Empty counts as unset.
        **dict.fromkeys(_NOT_INHERITED, ""),
    }
    if not run.options.keep:  # a demo that dies without stopping them takes them along
        env[PARENT_PID_VAR] = str(os.getpid())
    return python_env(env)


def _start_services(run: DemoRun, supervisor: Supervisor, settings: Settings) -> None:
    fault_file = run.state_dir / "faults.json"
    plan = fault_plan_for(run.tickets, run.options.seed)
    fault_file.write_text(plan.to_json())
    env = _service_env(run, fault_file)
    topics = settings.topics
    names = list(PARTICIPANTS)
    ensure_topics(
        run.bootstrap,
        topics,
        names,
        run.options.partitions,
        replication=settings.replication,
    )
    logs = run.state_dir / "logs"
    supervisor.start(
        ServiceSpec(
            "coordinator",
            [
                "coordinator",
                "run",
                "--instance-id",
                "demo-coordinator",
                "--participants",
                ",".join(names),
            ],
            env,
            logs / "coordinator.log",
            group_id=f"{run.prefix}sagaline-coordinator",
            input_topic=topics.events,
        )
    )
    for name in names:
        supervisor.start(
            ServiceSpec(
                name,
                ["participant", "run", name],
                env,
                logs / f"{name}.log",
                group_id=f"{run.prefix}sagaline-participant-{name}",
                input_topic=topics.commands(name),
            )
        )
    _start_dashboard(run, supervisor, env, logs)
    _say(f"  faults: {len(plan.rules)} rules written to {fault_file}")
    _say(f"  starting coordinator + {', '.join(names)} ...")
    started = time.monotonic()
    supervisor.wait_ready(["coordinator", *names], timeout_s=120)
    pids = ", ".join(f"{n} {p.pid}" for n, p in supervisor.processes.items())
    _say(f"  ready in {time.monotonic() - started:.1f} s (pids: {pids})")


def _start_dashboard(
    run: DemoRun, supervisor: Supervisor, env: Mapping[str, str], logs: Path
) -> None:
    """The operators' dashboard over this run's topics, when a port is asked for and
    free; the demo does not depend on it, so a busy port only skips it."""
    port = run.options.dashboard_port
    if not port:
        return
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            _say(f"  dashboard: port {port} is busy; running without it (--dashboard-port)")
            return
    supervisor.start(
        ServiceSpec(
            "dashboard",
            ["dashboard", "--host", "127.0.0.1", "--port", str(port)],
            env,
            logs / "dashboard.log",
        )
    )
    _say(f"  dashboard: http://127.0.0.1:{port}/ (sagas, timelines, receipts, approvals)")


class FaultGate:
    """Holds back the start of saga ``i`` until every fault due after at most
    ``i - concurrency`` terminal sagas has been applied, so that each fault lands while
    sagas are still in flight however fast they run (at most ``after + concurrency``
    sagas have started when the fault due at ``after`` fires). Once the schedule is
    abandoned (a fault can never be due), no held saga starts."""

    def __init__(self, afters: Sequence[int], concurrency: int) -> None:
        self._afters = sorted(afters)
        self._concurrency = max(1, concurrency)
        self._fired = 0
        self._abandoned = False
        self._cond = threading.Condition()

    def fired(self) -> None:
        with self._cond:
            self._fired += 1
            self._cond.notify_all()

    def open(self) -> None:
        """No more faults will fire (all applied, or the injector gave up)."""
        with self._cond:
            self._fired = len(self._afters)
            self._cond.notify_all()

    def abandon(self) -> None:
        """A fault can never be due (the sagas stopped ending, or the run cannot see
        them end): no saga starts any more, held back or not."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def __call__(self, index: int) -> bool:
        """Whether saga ``index`` may start (False: the run gave up); may block."""
        needed = sum(1 for after in self._afters if after + self._concurrency <= index)
        with self._cond:
            self._cond.wait_for(lambda: self._abandoned or self._fired >= needed)
            return not self._abandoned


def _fault_injector(
    run: DemoRun,
    supervisor: Supervisor,
    board: SagaBoard,
    display: ProgressDisplay,
) -> FaultGate | None:
    """Starts a thread that applies each fault (or kill -9s and restarts a service)
    after K terminal sagas; returns the start gate the agents must pass."""
    opts = run.options
    jobs: list[tuple[str, int, DemoFault | None]] = [
        (fault.name, fault.after, fault) for fault in opts.faults
    ]
    if opts.kill_service and opts.kill_after > 0:
        jobs.append((opts.kill_service, opts.kill_after, None))
    if opts.kill_coordinator_after > 0:
        jobs.append(("coordinator", opts.kill_coordinator_after, None))
    if not jobs:
        return None
    gate = FaultGate([after for _name, after, _fault in jobs], opts.concurrency)

    def inject() -> None:
        try:
            apply_all()
        finally:
            gate.open()

    def apply_all() -> None:
        ordered = sorted(jobs, key=lambda j: j[1])
        for index, (name, after, fault) in enumerate(ordered):
            try:
                _wait_for_terminal(after)
                event = apply(name, fault)
            except (_RunOver, _Stalled) as over:
                gate.abandon()  # the run is over or stuck: start no held saga
                why = (
                    f"no saga ended in the last {opts.timeout_s:.0f} s (--timeout), with"
                    if isinstance(over, _Stalled)
                    else "the run ended with"
                )
                for late, late_after, _fault in ordered[index:]:
                    run.fault_problems.append(
                        f"{late} (due after {late_after} terminal sagas) never fired: {why}"
                        f" {board.terminal_count()} of {opts.sagas} sagas terminal"
                    )
                return
            except Exception as exc:  # the run fails naming it; the schedule goes on
                problem = (
                    f"{name} (due after {after} terminal sagas) failed: {type(exc).__name__}: {exc}"
                )
                run.fault_problems.append(problem)
                display.log(f"fault FAILED: {problem}")
            else:
                run.faults.append(event)
                display.log(f"fault: {event}")
                if event.terminal_before >= opts.sagas:
                    run.fault_problems.append(
                        f"{name} (due after {after} terminal sagas) fired only after all"
                        f" {opts.sagas} sagas had ended: it exercised nothing"
                    )
            gate.fired()

    def _wait_for_terminal(count: int) -> None:
        """Until ``count`` sagas are terminal; raises :class:`_Stalled` when none
        ends for ``--timeout`` seconds (the held agents would wait for ever)."""
        seen, since = board.terminal_count(), time.monotonic()
        while not board.wait_count(count, 1.0):
            if run.faults_closed.is_set() or board.failure is not None:
                raise _RunOver
            now_seen = board.terminal_count()
            if now_seen != seen:
                seen, since = now_seen, time.monotonic()
            elif time.monotonic() - since >= opts.timeout_s:
                raise _Stalled

    def apply(name: str, fault: DemoFault | None) -> FaultEvent:
        if fault is not None:
            with supervisor.lock:
                _refuse_after_the_run(run, supervisor)
                terminal, compensating = board.terminal_count(), board.counts()[COMPENSATING]
                return FaultEvent(
                    name, None, None, terminal, compensating, detail=fault.act(supervisor)
                )
        if name == "coordinator":
            # Aim for the middle of a compensation (issue 4's acceptance), but do
            # not wait for one forever, nor until the run is over: a compensation
            # lasts tens of ms and a fast run ends in seconds.
            wait_until(
                lambda: (
                    board.counts()[COMPENSATING] > 0 or board.terminal_count() >= opts.sagas - 2
                ),
                15.0,
                0.01,
            )
        with supervisor.lock:
            _refuse_after_the_run(run, supervisor)
            terminal, compensating = board.terminal_count(), board.counts()[COMPENSATING]
            old, new = supervisor.restart(name)
        return FaultEvent(name, old, new, terminal, compensating)

    run.fault_thread = threading.Thread(target=inject, name="fault-injector", daemon=True)
    run.fault_thread.start()
    return gate


class _RunOver(Exception):
    """The run ended (every saga terminal, or it gave up) before a fault was due."""


class _Stalled(Exception):
    """No saga ended for ``--timeout`` seconds while a fault was still due."""


def _refuse_after_the_run(run: DemoRun, supervisor: Supervisor) -> None:
    """Under ``supervisor.lock``: no fault once the run has ended or is stopping."""
    if run.faults_closed.is_set():
        raise _RunOver
    if supervisor.stopping:
        raise ProcessFailed("not applied: the run had already ended")


def _run(run: DemoRun, supervisor: Supervisor) -> int:
    opts = run.options
    shell = Settings.from_env()
    settings = Settings(
        bootstrap=run.bootstrap,
        topic_prefix=run.prefix,
        partitions=opts.partitions,
        hmac_key=DEMO_HMAC_KEY.encode(),
        state_dir=run.state_dir,
        replication=shell.replication,  # of the topics the run creates
        limits=shell.limits,  # as the services it starts read them (SAGALINE_MAX_*)
    )
    plans = [checked_plan(t, declared_catalogues_cached()) for t in run.tickets]
    fixed = plan_fix_message(plans)

    _start_services(run, supervisor, settings)

    board = SagaBoard()
    operator = DemoOperator(OperatorChannel.from_settings(settings, run.bootstrap), OPERATOR)
    follower = LedgerFollower(
        run.bootstrap,
        settings.topics.events,
        settings.signer(),
        [board.apply, operator.observe],
        on_failure=board.abandon,
    )
    live = opts.ui and sys.stdout.isatty()
    display = ProgressDisplay(board, len(plans), live=live)
    client = SagaClient(
        settings, run.bootstrap, producer_name="demo-agent", call_timeout_s=opts.call_timeout_s
    )
    follower.start()
    operator.start()
    client.start()
    try:
        missing = wait_for_catalogue(client, 60)
        if missing:
            raise ProcessFailed(f"the participants never published {sorted(missing)}")
        if fixed:
            _say(fixed)
        _say()
        agent = RefundAgent(client, call_timeout_s=opts.call_timeout_s, run_tag=run.run_id[-4:])
        run.saga_of = {t.ticket_id: agent.saga_id(t) for t in run.tickets}
        run.started_at = time.monotonic()
        display.start()
        gate = _fault_injector(run, supervisor, board, display)
        started: list[str] = []
        outcomes = agent.run_all(plans, opts.concurrency, on_start=started.append, gate=gate)
        # A saga never started (the fault schedule gave up) cannot end: not waited for.
        all_terminal = board.wait_terminal(set(started), opts.timeout_s)
        run.not_started = len(plans) - len(started)
        run.ended_at = time.monotonic()
        if board.failure is not None:
            raise ProcessFailed(f"{board.failure}; the sagas' endings are unknown")
        with supervisor.lock:  # a fault under way ends first; none starts after this
            run.faults_closed.set()
        if run.fault_thread is not None:  # it notes the faults that never fired
            run.fault_thread.join(60)
        display.stop()
        run.crashed = supervisor.crashed()
        if run.crashed:
            _say(
                f"services that exited on their own: {_exits(run.crashed)}"
                f" (logs in {run.state_dir}/logs)"
            )
        return _summarise(run, settings, outcomes, operator, all_terminal)
    finally:
        run.faults_closed.set()
        display._stop.set()
        follower.stop()
        operator.stop()
        client.close()


_CATALOGUES: list[Catalogue] = []


def declared_catalogues_cached() -> list[Catalogue]:
    if not _CATALOGUES:
        _CATALOGUES.extend(declared_catalogues())
    return _CATALOGUES


# ---------------------------------------------------------------------- summary


def terminal_receipts(bootstrap: str, settings: Settings) -> dict[str, Receipt]:
    """The receipt of every saga on ``sagaline.terminal`` (latest per saga)."""
    latest = LedgerReader(bootstrap).latest_by_key(settings.topics.terminal, settings.signer())
    return {
        saga: Receipt.from_json(record.receipt)
        for saga, record in latest.items()
        if isinstance(record, SagaTerminal)
    }


def _summarise(
    run: DemoRun,
    settings: Settings,
    outcomes: list[AgentOutcome],
    operator: DemoOperator,
    all_terminal: bool,
) -> int:
    from sagaline.ops.receipts import render_receipt_text

    receipts = terminal_receipts(run.bootstrap, settings)
    ours = {s: receipts[s] for s in run.saga_of.values() if s in receipts}
    statuses = Counter(r.status.value for r in ours.values())
    elapsed = max(run.ended_at - run.started_at, 1e-9)
    total = len(run.tickets)

    _say()
    _say("Summary")
    _say(f"  sagas        {total} run, {len(ours)} terminal on sagaline.terminal")
    if run.not_started:
        _say(
            f"  NOT STARTED  {run.not_started}: held back for a fault that could never be"
            " due (see fault FAILED)"
        )
    for status in ("COMPLETED", "COMPENSATED", "ESCALATED"):
        _say(f"  {status.lower():<12} {statuses[status]}")
    _say(f"  time         {elapsed:.1f} s ({len(ours) / elapsed:.1f} sagas/s)")
    _say(f"  approvals    {operator.granted} granted by {OPERATOR} (via operator_actions)")
    aborted = sum(1 for o in outcomes if o.ended == "abort")
    asked = len(outcomes) - aborted
    _say(f"  agents       {asked} asked to complete, {aborted} aborted on a call error")
    for event in run.faults:
        _say(f"  fault        {event}")
    for problem in run.fault_problems:
        _say(f"  fault FAILED {problem}")
    if run.crashed:
        _say(f"  crashed      {_exits(run.crashed)}: exited on their own during the run")

    _say()
    _say(_scenario_table(run, ours))

    sample = _pick_receipt(run, ours)
    if sample is not None:
        ticket_of = {s: t for t, s in run.saga_of.items()}
        ticket = ticket_of.get(sample.saga_id, "?")
        scenario = run.scenarios.get(ticket)
        _say()
        _say(
            f"One receipt, as a person reads it (ticket {ticket}, scenario "
            f"{scenario.value if scenario else '?'}):"
        )
        _say(_indent(render_receipt_text(sample), "  "))

    run.receipts = ours
    try:
        world = read_world(run.state_dir)
    except ProviderFileUnreadable as exc:
        _say()
        _say(f"Invariant NOT checked: {exc}")
        _say()
        _say("demo FAILED: see above")
        return 1
    violations = check_invariants(ours.values(), world, expected_sagas=run.saga_of.values())
    run.violations = violations
    _say()
    _say(_invariant_report(world, ours, violations, run.state_dir))
    ok = (
        all_terminal
        and not violations
        and len(ours) == total
        and not run.fault_problems
        and not run.crashed
    )
    _say()
    _say(
        "demo OK: every saga is terminal and each provider's own state agrees with the receipts"
        if ok
        else "demo FAILED: see above"
    )
    return 0 if ok else 1


def _exits(exits: Sequence[tuple[str, int | None]]) -> str:
    return ", ".join(f"{name} (exit code {code})" for name, code in exits)


def _scenario_table(run: DemoRun, receipts: dict[str, Receipt]) -> str:
    rows: dict[Scenario, Counter[str]] = {}
    for ticket in run.tickets:
        scenario = run.scenarios[ticket.ticket_id]
        receipt = receipts.get(run.saga_of[ticket.ticket_id])
        rows.setdefault(scenario, Counter())[
            receipt.status.value if receipt else "NOT TERMINAL"
        ] += 1
    header = (
        f"  {'scenario':<20} {'sagas':>5}  {'expected':<12} {'completed':>9} "
        f"{'compensated':>11} {'escalated':>9}  as expected"
    )
    lines = [header]
    for scenario in Scenario:
        counts = rows.get(scenario)
        if not counts:
            continue
        n = sum(counts.values())
        expected = scenario.expected_status
        mark = "yes" if counts[expected] == n else f"NO ({n - counts[expected]} differ)"
        lines.append(
            f"  {scenario.value:<20} {n:>5}  {expected:<12} {counts['COMPLETED']:>9} "
            f"{counts['COMPENSATED']:>11} {counts['ESCALATED']:>9}  {mark}"
        )
    return "\n".join(lines)


def _pick_receipt(run: DemoRun, receipts: dict[str, Receipt]) -> Receipt | None:
    """A compensated saga that undid something, else any compensated, else any."""
    compensated = [r for r in receipts.values() if r.status.value == "COMPENSATED"]
    undid = [r for r in compensated if any(s.disposition.value == "COMPENSATED" for s in r.steps)]
    for group in (undid, compensated, list(receipts.values())):
        if group:
            return sorted(group, key=lambda r: r.saga_id)[0]
    return None


def _invariant_report(
    world: ProviderWorld, receipts: dict[str, Receipt], violations: list[Violation], where: Path
) -> str:
    kinds = Counter(e.kind for e in world.effects)
    effects = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    lines = [
        "Invariant, checked against each provider's own SQLite file "
        f"({where}/<participant>/*.sqlite3):",
        f"  provider effects: {effects or 'none'}",
    ]
    if violations:
        lines.append(f"  {len(violations)} VIOLATION(S):")
        lines += [f"    {v}" for v in violations]
    else:
        lines.append(
            f"  holds: none active in a compensated saga; credits: none voided, each one"
            f" with a reply or an incident; {len(receipts)} receipts account for every effect"
        )
    return "\n".join(lines)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


# -------------------------------------------------------------------- agent run


def run_agent(
    sagas: int,
    seed: int,
    concurrency: int,
    *,
    approve: bool,
    operator_identity: str,
    call_timeout_s: float,
    timeout_s: float,
) -> int:
    """The scripted agent alone against a running system (``sagaline agent run``):
    the broker that system runs on, never a local one started for it (with
    ``KAFKA_BOOTSTRAP_SERVERS`` unset it stops with ``BrokerNotConfigured``, as every
    service command does; ``--dev-broker`` sets it to the local broker first)."""
    settings = Settings.from_env()
    bootstrap = require_bootstrap(settings, "sagaline agent run")
    tickets = generate_tickets(sagas, seed)
    plans = [checked_plan(t, declared_catalogues_cached()) for t in tickets]
    client = SagaClient(settings, bootstrap, producer_name="agent", call_timeout_s=call_timeout_s)
    agent = RefundAgent(client)
    ours = {agent.saga_id(t) for t in tickets}
    board = SagaBoard()
    handlers: list[Callable[[Record], None]] = [board.apply]
    operator: DemoOperator | None = None
    if approve:
        operator = DemoOperator(
            OperatorChannel.from_settings(settings, bootstrap), operator_identity
        )
        guard = operator

        def approve_ours(record: Record) -> None:
            if record.saga_id in ours:
                guard.observe(record)

        handlers.append(approve_ours)
        operator.start()
    follower = LedgerFollower(
        bootstrap, settings.topics.events, settings.signer(), handlers, on_failure=board.abandon
    )
    client.start()
    follower.start()
    started = time.monotonic()
    try:
        missing = wait_for_catalogue(client, 120)
        if missing:
            print(
                f"sagaline agent run: no participant publishes {sorted(missing)} on "
                f"{settings.topics.catalogue}; start the participants first",
                file=sys.stderr,
            )
            return 1
        fixed = plan_fix_message(plans)
        if fixed:
            print(fixed, flush=True)
        outcomes = agent.run_all(plans, concurrency)
        done = board.wait_terminal(ours, timeout_s)
        if board.failure is not None:
            print(f"sagaline agent run: {board.failure}", file=sys.stderr)
            return 1
        terminal = board.terminal()
        statuses = Counter(terminal[s].status.value for s in ours if s in terminal)
        elapsed = time.monotonic() - started
        aborted = sum(1 for o in outcomes if o.ended == "abort")
        print(
            f"agent: {len(tickets)} sagas in {elapsed:.1f} s; "
            + ", ".join(f"{k.lower()} {v}" for k, v in sorted(statuses.items()))
            + f"; {aborted} aborted by the agent"
            + (f"; {operator.granted} approvals granted by {operator_identity}" if operator else "")
            + ("" if done else f"; {len(ours) - len(statuses)} NOT terminal"),
            flush=True,
        )
        return 0 if done else 1
    finally:
        follower.stop()
        if operator is not None:
            operator.stop()
        client.close()


# ------------------------------------------------------------------------- CLI


def _cmd_demo(args: argparse.Namespace) -> int:
    if (args.kill_service is None) != (args.kill_after is None):
        print("--kill-service and --kill-after go together", file=sys.stderr)
        return 2
    # A kill lands mid-run only if some saga is held back until it has fired
    # (FaultGate): saga number K + concurrency must exist.
    latest = args.sagas - args.concurrency - 1
    for flag, after in (
        ("--kill-after", args.kill_after),
        ("--kill-coordinator-after", args.kill_coordinator_after),
    ):
        if after and after > latest:
            print(
                f"{flag} {after}: must be below --sagas minus --concurrency"
                f" ({args.sagas} - {args.concurrency} = {args.sagas - args.concurrency}),"
                " or the kill may come after the last saga ended, or never; raise --sagas"
                " or lower --concurrency",
                file=sys.stderr,
            )
            return 2
    if args.dashboard_port:
        # The dashboard child reads its SAGALINE_DASHBOARD_* switches from this
        # environment: one it cannot read stopped it at once, said only in its log,
        # while the demo announced it and ran on.
        from services.dashboard import DashboardConfigError, ended_sagas_from_env
        from services.dashboard.auth import AuthConfigError, OperatorAuth

        try:
            OperatorAuth.from_env()
            ended_sagas_from_env()
        except (AuthConfigError, DashboardConfigError) as exc:
            print(f"sagaline demo: the dashboard cannot start: {exc}", file=sys.stderr)
            return 2
    options = DemoOptions(
        sagas=args.sagas,
        seed=args.seed,
        concurrency=args.concurrency,
        partitions=args.partitions,
        state_dir=args.state_dir,
        keep=args.keep,
        ui=not args.no_ui,
        kill_service=args.kill_service,
        kill_after=args.kill_after or 0,
        kill_coordinator_after=args.kill_coordinator_after or 0,
        call_timeout_s=args.call_timeout,
        timeout_s=args.timeout,
        dashboard_port=args.dashboard_port,
    )
    try:
        with _interrupt_on(signal.SIGINT, signal.SIGTERM):
            return run_demo(options).exit_code
    except KeyboardInterrupt:
        print(
            "\ninterrupted: "
            + (
                "--keep: the services the demo started are left running (listed above)"
                if options.keep
                else "every process the demo started has been stopped"
            ),
            file=sys.stderr,
        )
        return 130


@contextmanager
def _interrupt_on(*signals: signal.Signals) -> Iterator[None]:
    """Turn these signals into KeyboardInterrupt while the block runs, so the
    ``finally`` blocks that stop the demo's processes run on Ctrl-C and on ``kill``
    alike (also when the shell started us with SIGINT ignored, as it does for
    background jobs); the handlers found are put back after it, for a caller that
    runs the command in its own process (a test, an embedding program)."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    found = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)


def _cmd_agent_run(args: argparse.Namespace) -> int:
    with suppress(KeyboardInterrupt), _interrupt_on(signal.SIGINT, signal.SIGTERM):
        try:
            return run_agent(
                args.sagas,
                args.seed,
                args.concurrency,
                approve=not args.no_approve,
                operator_identity=args.operator,
                call_timeout_s=args.call_timeout,
                timeout_s=args.timeout,
            )
        except (TopicMissing, KafkaException, DeliveryFailed) as exc:
            # The system is not there (yet): its topics, or the broker itself.
            print(f"sagaline agent run: {_kafka_error(exc)}", file=sys.stderr)
            return 1
    return 130


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run the refund example end to end on the local Kafka",
        description=(
            "Start the coordinator and the refund services as processes, run N refund "
            "sagas with a seeded mix of faults, show progress, and check each "
            "provider's own state against the receipts. Exit 0: every saga terminal "
            "and consistent."
        ),
    )
    demo.add_argument("--sagas", type=at_least(1), default=200, help="how many sagas (200)")
    demo.add_argument("--seed", type=int, default=7, help="tickets and faults (7)")
    demo.add_argument("--concurrency", type=at_least(1), default=16, help="agent threads (16)")
    demo.add_argument(
        "--partitions",
        type=between(1, MAX_PARTITIONS),
        default=DEFAULT_PARTITIONS,
        help=f"partitions per topic (1 to {MAX_PARTITIONS}, as SAGALINE_PARTITIONS)",
    )
    demo.add_argument(
        "--state-dir", type=Path, default=None, help="default: .sagaline/demo-<time>-<id>"
    )
    demo.add_argument("--keep", action="store_true", help="leave the processes running")
    demo.add_argument("--no-ui", action="store_true", help="plain log lines (CI, tests)")
    demo.add_argument("--kill-service", choices=list(PARTICIPANTS), help="participant to kill -9")
    demo.add_argument("--kill-after", type=at_least(1), help="... after this many terminal sagas")
    demo.add_argument(
        "--kill-coordinator-after",
        type=at_least(0),
        default=0,
        help="kill -9 the coordinator after this many terminal sagas (then restart it)",
    )
    demo.add_argument(
        "--dashboard-port",
        type=port,
        default=8088,
        help="serve the dashboard for this run on this port (8088; 0: none)",
    )
    demo.add_argument("--call-timeout", type=seconds, default=60.0, help="per tool call (s)")
    demo.add_argument(
        "--timeout",
        type=seconds,
        default=300.0,
        help="for every saga to end after the agents; with a kill due, the longest the run"
        " may go without a saga ending (s)",
    )
    demo.set_defaults(func=_cmd_demo)

    agent = subparsers.add_parser("agent", help="the scripted refund agent")
    agent_sub = agent.add_subparsers(dest="agent_command", required=True)
    run = agent_sub.add_parser("run", help="run refund sagas against a running system")
    run.add_argument("--sagas", type=at_least(1), default=50)
    run.add_argument("--seed", type=int, default=7)
    run.add_argument("--concurrency", type=at_least(1), default=8)
    run.add_argument("--operator", default=OPERATOR, help=f"who approves the replies ({OPERATOR})")
    run.add_argument(
        "--no-approve",
        action="store_true",
        help="leave approvals to a person (sagaline approve, or the dashboard)",
    )
    run.add_argument("--call-timeout", type=seconds, default=60.0)
    run.add_argument("--timeout", type=seconds, default=300.0)
    run.add_argument(
        "--dev-broker",
        action="store_true",
        help="development only: use (or start) the local broker when KAFKA_BOOTSTRAP_SERVERS "
        "is unset",
    )
    run.set_defaults(func=_cmd_agent_run)
