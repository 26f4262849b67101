"""The processes a demo run starts, and how it knows they are ready.

Every service runs as its own OS process (``python -m services.cli ...``) with its
own log file, exactly as it would be deployed, so a ``kill -9`` in a fault test is a
real crash: no in-process shortcut survives it. Each process gets its own session,
so a Ctrl-C in the terminal reaches only the demo, which then stops them in order
(SIGTERM, then SIGKILL after a timeout).

Readiness is observed on the broker, not guessed from a sleep: a service is ready
when its consumer group is stable and every partition of its input topic is
assigned to a live member.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sagaline.kafka import AdminClient, KafkaException, create_admin, describe_group

__all__ = [
    "ManagedProcess",
    "ProcessFailed",
    "ServiceSpec",
    "Supervisor",
    "group_assigned",
    "wait_until",
]


class ProcessFailed(RuntimeError):
    """A service exited on its own or never became ready; the message names its log."""


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service: its CLI arguments, its environment and its log file."""

    name: str
    cli_args: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    group_id: str | None = None  # consumer group whose assignment means "ready"
    input_topic: str | None = None

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "services.cli", *self.cli_args]


@dataclass
class ManagedProcess:
    """One running service; restartable after a kill."""

    spec: ServiceSpec
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    stopped_on_purpose: bool = False  # by kill9 or stop (the run, or its fault plan)
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = self.spec.log_path.open("ab")
        self._log.write(f"--- start #{self.starts + 1}: {' '.join(self.spec.argv)}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(
            self.spec.argv,
            env=dict(self.spec.env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops us in order
        )
        self.starts += 1
        self.stopped_on_purpose = False

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        """A crash: SIGKILL, no chance to flush or commit anything."""
        if self.popen is not None and self.popen.poll() is None:
            self.stopped_on_purpose = True
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.stopped_on_purpose = True
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.send_signal(signal.SIGKILL)
                self.popen.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.popen.returncode

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """The processes of one run: started in order, stopped in reverse, always."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.processes: dict[str, ManagedProcess] = {}
        # Held by whatever starts or kills processes from another thread (a fault
        # test, the fault injector) and by stop_all: once the run is stopping,
        # nothing starts a service again behind its back.
        self.lock = threading.RLock()
        self.stopping = False
        # Exits nobody asked for that a restart then hid: (name, exit code).
        self.died: list[tuple[str, int | None]] = []

    def start(self, spec: ServiceSpec) -> ManagedProcess:
        with self.lock:
            self._refuse_if_stopping(spec.name)
            process = ManagedProcess(spec)
            self.processes[spec.name] = process
            process.start()
            return process

    def restart(self, name: str) -> tuple[int | None, int | None]:
        """``kill -9`` service ``name`` and start it again; (old pid, new pid).
        Raises :class:`ProcessFailed` once the run is stopping."""
        with self.lock:
            self._refuse_if_stopping(name)
            process = self.processes[name]
            old = process.pid
            if process.popen is not None and not process.alive and not process.stopped_on_purpose:
                self.died.append((name, process.popen.returncode))
            process.kill9()
            process.start()
            return old, process.pid

    def _refuse_if_stopping(self, name: str) -> None:
        if self.stopping:
            raise ProcessFailed(f"{name} not started: the run is stopping every process")

    def wait_ready(self, names: Sequence[str], timeout_s: float = 90.0) -> None:
        """Block until every named service's consumer group owns all its partitions.

        The admin client lives only for this wait, so a run's later broker faults
        find none of the run's own clients but those they are meant to hurt."""
        holder: list[AdminClient] = [create_admin(self.bootstrap)]
        try:
            self._wait_ready(holder[0], names, timeout_s)
        finally:
            release_in_background(holder)

    def _wait_ready(self, admin: AdminClient, names: Sequence[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(names)
        while waiting:
            for name in list(waiting):
                process = self.processes[name]
                if not process.alive:
                    raise ProcessFailed(
                        f"{name} exited with code {process.popen and process.popen.returncode}"
                        f" before it was ready; its log ({process.spec.log_path}) ends:\n"
                        f"{process.log_tail()}"
                    )
                spec = process.spec
                if (
                    spec.group_id is None
                    or spec.input_topic is None  # nothing to observe: alive is all we know
                    or group_assigned(admin, spec.group_id, spec.input_topic)
                ):
                    waiting.remove(name)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise ProcessFailed(
                    f"{', '.join(waiting)} not ready after {timeout_s:.0f} s (consumer group"
                    " not assigned); see the logs under "
                    f"{self.processes[waiting[0]].spec.log_path.parent}"
                )
            time.sleep(0.25)

    def crashed(self) -> list[tuple[str, int | None]]:
        """(name, exit code) of each service that exited although nobody stopped or
        killed it (neither the run nor its fault plan): also one a restart (a planned
        kill -9) found already dead."""
        now = [
            (n, p.popen.returncode)
            for n, p in self.processes.items()
            if p.popen is not None and not p.alive and not p.stopped_on_purpose
        ]
        return [*self.died, *now]

    def stop_all(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """Stop every process (reverse start order); returns their exit codes."""
        with self.lock:  # waits for a restart under way, then refuses any later one
            self.stopping = True
            codes: dict[str, int | None] = {}
            for name in reversed(list(self.processes)):
                codes[name] = self.processes[name].stop(timeout_s)
            return codes


def release_in_background(holder: list[Any]) -> None:
    """Destroy the Kafka clients in ``holder`` (their only references) on a daemon
    thread, never on the caller's.

    librdkafka's destroy joins the client's broker threads, and after a cluster node
    was killed one of them can wait forever (seen in CI: a worker hung in
    ``rd_kafka_destroy`` when a test's frame freed the supervisor's admin client, and
    pytest-timeout cannot interrupt a C join). If it hangs there, nothing waits for it.
    """
    threading.Thread(target=holder.clear, name="kafka-client-release", daemon=True).start()


def group_assigned(admin: AdminClient, group_id: str, topic: str) -> bool:
    """True when ``group_id`` is stable and its members own every partition of ``topic``."""
    try:
        meta = admin.list_topics(topic, timeout=5).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return False
        info = describe_group(admin, group_id, timeout_s=5)
    except KafkaException:  # the broker is busy or away: not ready
        return False
    return info.state == "STABLE" and info.owned(topic) >= set(meta.partitions)


def wait_until(check: Any, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``check()`` until it is true or ``timeout_s`` passes; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def python_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment plus ``extra``, with unbuffered Python output."""
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env
