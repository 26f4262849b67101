"""How a demo run ends when something around its sagas goes wrong: a service that
died on its own, a fault that can never be due. Each test runs the demo's own run
loop (``services.demo.run_demo``) on the real broker, with stand-in processes instead
of the refund services and no sagas (or agents that never reach the system), so it
is cheap; what it checks is the run's verdict: exit code and words."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

import services.demo as demo
from sagaline.kafka import ensure_topics
from schemas.settings import Settings
from services.demo_processes import ServiceSpec, Supervisor, python_env
from services.refund import PARTICIPANTS
from tests.topic_cleanup import record_prefix

pytestmark = pytest.mark.kafka


@dataclass(frozen=True)
class _Script(ServiceSpec):
    """A stand-in service: ``python -c CODE`` instead of ``services.cli``."""

    code: str = ""

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-c", self.code]


def _script(name: str, code: str, where: Path) -> _Script:
    return _Script(name, [], python_env({}), where / f"{name}.log", code=code)


SLEEPS = "import time; time.sleep(600)"
CRASHES = "raise SystemExit(3)"


def _run_demo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bootstrap: str,
    services: Sequence[tuple[str, str]],
    *,
    during: object = None,
    **options: object,
) -> demo.DemoRun:
    """``run_demo`` with ``services`` (name, python code) started instead of the refund
    services, and no tickets; ``during(supervisor)`` runs once they are up."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)

    def start_services(run: demo.DemoRun, supervisor: Supervisor, settings: Settings) -> None:
        record_prefix(run.prefix)
        ensure_topics(run.bootstrap, settings.topics, list(PARTICIPANTS), run.options.partitions)
        for name, code in services:
            supervisor.start(_script(name, code, tmp_path / "logs"))
        if callable(during):
            during(supervisor)

    monkeypatch.setattr(demo, "_start_services", start_services)
    monkeypatch.setattr(demo, "wait_for_catalogue", lambda _client, _timeout: set())
    monkeypatch.setattr(demo, "generate_tickets", lambda _n, _seed: [])
    fields: dict[str, object] = {
        "sagas": 1,
        "partitions": 1,
        "state_dir": tmp_path / "state",
        "ui": False,
        "timeout_s": 30,
        **options,
    }
    return demo.run_demo(demo.DemoOptions(**fields))  # type: ignore[arg-type]


def test_a_service_that_crashed_during_the_run_fails_the_demo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kafka_bootstrap: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A participant that exited on its own was listed, and the run still said
    "demo OK" and exited 0."""

    def crashed_before_the_end(supervisor: Supervisor) -> None:
        popen = supervisor.processes["payments"].popen
        assert popen is not None
        popen.wait(120)

    result = _run_demo(
        tmp_path,
        monkeypatch,
        kafka_bootstrap,
        [("coordinator", SLEEPS), ("payments", CRASHES)],
        during=crashed_before_the_end,
    )
    out = capsys.readouterr().out
    assert "demo OK" not in out, out
    assert result.exit_code == 1, out
    assert "payments (exit code 3)" in out, out


def test_a_service_the_fault_plan_killed_on_purpose_does_not_fail_the_demo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kafka_bootstrap: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A DemoFault that kill -9s or stops a service and does not restart it (a
    scale-in) is what the run meant to do: not a crash."""

    def scale_in(supervisor: Supervisor) -> None:
        supervisor.processes["payments-b"].kill9()
        supervisor.processes["coordinator-2"].stop()

    result = _run_demo(
        tmp_path,
        monkeypatch,
        kafka_bootstrap,
        [("coordinator", SLEEPS), ("coordinator-2", SLEEPS), ("payments-b", SLEEPS)],
        during=scale_in,
    )
    out = capsys.readouterr().out
    assert result.exit_code == 0, out
    assert "demo OK" in out, out
