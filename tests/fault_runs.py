"""Helpers for the failure-domain and scale-out runs (issue 11, items 3 and 4).

Not a test module. The runs are the refund demo with real processes
(``services.demo``), plus :class:`~services.demo.DemoFault` actions that kill or stop
brokers, start and stop coordinator instances and move a participant's partitions
between replicas. :func:`counts` reads what a run did back from the ledger and the
providers' own SQLite files, for the issue note.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from coordinator.watchdog import EXIT_WEDGED
from sagaline.kafka import LedgerReader
from schemas.errors import CodecError
from schemas.models import StepOutcomeUnknown
from schemas.settings import Settings
from schemas.wire import from_message
from services.demo import DEMO_HMAC_KEY, DemoRun
from services.demo_invariants import FORWARD_EFFECTS, read_world
from services.demo_processes import ManagedProcess, ServiceSpec, Supervisor

PARTICIPANT_OUTCOMES = {
    "StepCommitted",
    "StepFailed",
    "StepOutcomeUnknown",
    "StepReconciled",
    "CompensationCommitted",
    "CompensationAccepted",
    "CompensationFailed",
}


def env_int(name: str, default: int) -> int:
    """A positive integer knob from the environment (bounded defaults keep CI short)."""
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


@dataclass(frozen=True)
class RunCounts:
    sagas: int
    terminal: int
    statuses: dict[str, int]
    effects: int  # forward effects in the providers' own files
    duplicates_prevented: int  # outcomes re-sent for a redelivered command, not re-run
    replica_unknowns: int  # intents found on the ledger by another replica
    seconds: float

    def line(self, what: str) -> str:
        statuses = ", ".join(f"{k.lower()} {v}" for k, v in sorted(self.statuses.items()))
        return (
            f"{what}: sagas {self.sagas}, terminal {self.terminal} ({statuses}), provider "
            f"effects {self.effects} (each exactly once), duplicates prevented "
            f"{self.duplicates_prevented} (of which {self.replica_unknowns} intents of another "
            f"replica), time {self.seconds:.1f} s"
        )


def counts(result: DemoRun) -> RunCounts:
    """What a run did: terminal receipts, provider effects, and the redelivered
    commands whose outcome a participant re-sent instead of acting again (the same
    outcome event id on the ledger more than once)."""
    settings = Settings(topic_prefix=result.prefix, hmac_key=DEMO_HMAC_KEY.encode())
    signer = settings.signer()
    outcome_ids: Counter[str] = Counter()
    replica_unknowns = 0
    for key, value, headers in LedgerReader(result.bootstrap).records(settings.topics.events):
        try:
            record = from_message(key, value, headers, signer)
        except CodecError:
            continue
        if record.TYPE in PARTICIPANT_OUTCOMES:
            outcome_ids[record.event_id] += 1
            if isinstance(record, StepOutcomeUnknown) and "another replica" in record.reason:
                replica_unknowns += 1
    world = read_world(result.state_dir)
    forward = {f.done for f in FORWARD_EFFECTS.values()}
    return RunCounts(
        sagas=len(result.saga_of),
        terminal=len(result.receipts),
        statuses=dict(Counter(r.status.value for r in result.receipts.values())),
        effects=sum(1 for e in world.effects if e.kind in forward),
        duplicates_prevented=sum(n - 1 for n in outcome_ids.values() if n > 1),
        replica_unknowns=replica_unknowns,
        seconds=result.ended_at - result.started_at,
    )


# ------------------------------------------------------------------ process actions


def start_like(supervisor: Supervisor, template: str, name: str, *extra: str) -> ManagedProcess:
    """Start another instance of service ``template`` named ``name``: the same
    command and environment, with ``extra`` arguments appended and its own log."""
    spec = supervisor.processes[template].spec
    clone: ServiceSpec = dataclasses.replace(
        spec,
        name=name,
        cli_args=[*spec.cli_args, *extra],
        log_path=spec.log_path.with_name(f"{name}.log"),
    )
    return supervisor.start(clone)


def start_coordinator(supervisor: Supervisor, name: str) -> str:
    process = start_like(supervisor, "coordinator", name, "--instance-id", name)
    return f"started coordinator instance {name} (pid {process.pid})"


def start_replica(supervisor: Supervisor, participant: str, name: str, journal: Path) -> str:
    process = start_like(
        supervisor, participant, name, "--instance-id", name, "--journal-dir", str(journal)
    )
    return f"started replica {name} of {participant} (pid {process.pid}, journal {journal})"


def stop_cleanly(supervisor: Supervisor, name: str) -> str:
    process = supervisor.processes[name]
    pid = process.pid
    code = process.stop(timeout_s=60)
    return f"stopped {name} (pid {pid}) with SIGTERM, exit code {code}"


def kill9(supervisor: Supervisor, name: str) -> str:
    process = supervisor.processes[name]
    pid = process.pid
    process.kill9()
    return f"kill -9 {name} (pid {pid}), not restarted"


class RestartOnFailure:
    """What a deployment's restart policy does (compose ``restart: on-failure``,
    Kubernetes by default): start again any process of the run that exits with a
    failure status, e.g. a coordinator whose transactional producer hit a fatal
    error, or :data:`~coordinator.watchdog.EXIT_WEDGED`. A process stopped by the run
    exits 0, one it kills with SIGKILL exits -9: both are left alone; and nothing is
    started once the run is stopping its processes (``supervisor.lock``)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.restarts: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="restart-policy", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            for name, process in list(self.supervisor.processes.items()):
                popen = process.popen
                code = popen.poll() if popen is not None else None
                if code is None or code <= 0:
                    continue
                # The run's final stop (Supervisor.stop_all) takes this lock and then
                # refuses every start: never start a service again behind it.
                with self.supervisor.lock:
                    if self.supervisor.stopping:
                        continue
                    why = "wedged in librdkafka" if code == EXIT_WEDGED else "failed"
                    process.start()
                    self.restarts.append(
                        f"{name} exited {code} ({why}); restarted as {process.pid}"
                    )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
