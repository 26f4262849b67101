"""tests/fault_runs.py's own helpers, without a broker."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from services.demo_processes import Supervisor
from tests.fault_runs import RestartOnFailure


@dataclass
class _ExitedPopen:
    """A process that exited with a failure status; counts the watcher's looks."""

    code: int | None = 1
    polls: int = 0
    looked_twice: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> int | None:
        self.polls += 1
        if self.polls >= 2:
            self.looked_twice.set()
        return self.code


class _FailedService:
    def __init__(self) -> None:
        self.popen = _ExitedPopen()
        self.starts = 0

    @property
    def pid(self) -> int:
        return 4242

    def start(self) -> None:
        self.starts += 1

    def stop(self, timeout_s: float = 15.0) -> int | None:
        return self.popen.code


def test_the_restart_policy_starts_nothing_once_the_run_has_stopped_its_processes() -> None:
    """The demo's final stop takes ``supervisor.lock`` and refuses every later start:
    a service that exited with a failure status must not be started again behind it
    (it would outlive the run and write to its topics after the checks)."""
    supervisor = Supervisor("127.0.0.1:1")
    service = _FailedService()
    supervisor.processes["coordinator"] = service  # type: ignore[assignment]
    assert supervisor.stop_all() == {"coordinator": 1}
    policy = RestartOnFailure(supervisor)
    try:
        # The second look begins after the whole first pass over the processes.
        assert service.popen.looked_twice.wait(60), "the restart policy never looked"
    finally:
        policy.stop()
    assert policy.restarts == []
    assert service.starts == 0


def test_the_restart_policy_still_restarts_a_failed_process_during_the_run() -> None:
    supervisor = Supervisor("127.0.0.1:1")
    service = _FailedService()
    supervisor.processes["coordinator"] = service  # type: ignore[assignment]
    policy = RestartOnFailure(supervisor)
    try:
        assert service.popen.looked_twice.wait(60), "the restart policy never looked"
    finally:
        policy.stop()
    assert service.starts >= 1
    assert policy.restarts[0] == "coordinator exited 1 (failed); restarted as 4242"
