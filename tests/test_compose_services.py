"""Every service docker-compose.yml names starts with the command it gives (issue 5).

There is no Docker engine here, so each service's ``command`` is run as
``python -m services.cli <command...>`` against the local broker, with the service's
Compose environment (``${VAR:-default}`` resolved to its default, required secrets
given a test value) except for what
must differ on one host: ``KAFKA_BOOTSTRAP_SERVERS``, a unique
``SAGALINE_TOPIC_PREFIX``, a ``SAGALINE_STATE_DIR`` per service (Compose gives each
its own volume), and free ports in place of the fixed ``--port``/``--metrics-port``
(five participants share port 9101 in Compose, one per container).

One-shot services (``restart: "no"``: topic creation and the agent) must exit 0;
the others must come up (their consumer group owns its partitions, or their HTTP
port answers), and stop cleanly (exit 0) on SIGTERM, as ``docker compose stop`` does.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka.admin import AdminClient

from schemas.topics import TopicNames
from services.demo_processes import ManagedProcess, ServiceSpec, group_assigned, python_env
from tests.system import wait_until

# One worker of a parallel run takes the whole module: its module fixture starts every service.
pytestmark = [pytest.mark.kafka, pytest.mark.xdist_group("compose-services")]

ROOT = Path(__file__).resolve().parent.parent
SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
SAGALINE = {n: s for n, s in SERVICES.items() if not str(s.get("image", "")).startswith("apache/")}
ONE_SHOT = sorted(n for n, s in SAGALINE.items() if str(s.get("restart")) == "no")
LONG_RUNNING = sorted(n for n in SAGALINE if n not in ONE_SHOT)
_VARIABLE = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment with ``${VAR:-default}`` taken at its default and a
    required ``${VAR:?message}`` (a secret: Compose has no default) given a test value."""
    raw = service.get("environment") or {}

    def value(m: re.Match[str]) -> str:
        return f"test-{m.group(1).lower()}" if m.group(2) == "?" else m.group(3) or ""

    return {k: _VARIABLE.sub(value, str(v)) for k, v in raw.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def local_command(command: list[Any]) -> tuple[list[str], int | None]:
    """The command with free ports and a loopback bind; returns it and its HTTP port."""
    out, http_port = [str(a) for a in command], None
    for i, arg in enumerate(out[:-1]):
        if arg in ("--port", "--metrics-port"):
            http_port = free_port()
            out[i + 1] = str(http_port)
        elif arg == "--host":
            out[i + 1] = "127.0.0.1"
    return out, http_port


@dataclass
class Started:
    process: ManagedProcess
    http_port: int | None
    group: tuple[str, str] | None  # (consumer group, input topic) that means "ready"


@dataclass
class ComposeSystem:
    prefix: str
    bootstrap: str
    state: Path
    topics_init: subprocess.CompletedProcess[str]
    running: dict[str, Started]

    def spec(self, name: str, args: list[str]) -> ServiceSpec:
        env = compose_env(SAGALINE[name])
        env.update(
            KAFKA_BOOTSTRAP_SERVERS=self.bootstrap,
            SAGALINE_TOPIC_PREFIX=self.prefix,
            SAGALINE_STATE_DIR=str(self.state / name),
        )
        return ServiceSpec(name, args, python_env(env), self.state / "logs" / f"{name}.log")


def readiness_group(command: list[str], topics: TopicNames) -> tuple[str, str] | None:
    if command[:2] == ["coordinator", "run"]:
        return f"{topics.prefix}sagaline-coordinator", topics.events
    if command[:2] == ["participant", "run"]:
        name = command[2]
        return f"{topics.prefix}sagaline-participant-{name}", topics.commands(name)
    return None


@pytest.fixture(scope="module")
def system(
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
    new_topic_prefix: Callable[..., str],
) -> Iterator[ComposeSystem]:
    """topics-init run to completion, then every long-running service started."""
    prefix = new_topic_prefix("compose")  # its topics go when the session ends
    state = tmp_path_factory.mktemp("compose")
    shell = ComposeSystem(prefix, kafka_bootstrap, state, None, {})  # type: ignore[arg-type]
    init_args, _ = local_command(SAGALINE["topics-init"]["command"])
    init = shell.spec("topics-init", init_args)
    shell.topics_init = subprocess.run(
        init.argv, env=dict(init.env), capture_output=True, text=True, timeout=120
    )
    for name in LONG_RUNNING:
        args, port = local_command(SAGALINE[name]["command"])
        process = ManagedProcess(shell.spec(name, args))
        process.start()
        shell.running[name] = Started(process, port, readiness_group(args, TopicNames(prefix)))
    try:
        yield shell
    finally:
        for started in shell.running.values():
            started.process.stop(timeout_s=5)


def wait_up(system: ComposeSystem, name: str, timeout_s: float = 90) -> None:
    started = system.running[name]
    admin = AdminClient({"bootstrap.servers": system.bootstrap})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert started.process.alive, f"{name} exited:\n{started.process.log_tail(30)}"
        if started.group is not None:
            if group_assigned(admin, *started.group):
                return
        elif started.http_port is not None and _answers(started.http_port):
            return
        time.sleep(0.3)
    pytest.fail(f"{name} did not come up in {timeout_s} s:\n{started.process.log_tail(30)}")


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_compose_names_one_shot_and_long_running_services() -> None:
    assert ONE_SHOT == ["agent", "topics-init"]
    assert {"coordinator", "policy", "inventory", "payments", "mailer", "tickets"} <= set(
        LONG_RUNNING
    )


def test_topics_init_creates_the_topics_and_exits_zero(system: ComposeSystem) -> None:
    assert system.topics_init.returncode == 0, system.topics_init.stderr
    assert f"{system.prefix}sagaline.commands.payments" in system.topics_init.stdout


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_long_running_service_comes_up_with_its_compose_command(
    system: ComposeSystem, name: str
) -> None:
    wait_up(system, name)


def test_the_agent_runs_its_sagas_to_a_terminal_state_and_exits_zero(
    system: ComposeSystem,
) -> None:
    """The compose ``agent`` (``agent run --sagas 50 --seed 7``) against the services
    above: every saga terminal, approvals given through the operator path (R7)."""
    for name in LONG_RUNNING:
        wait_up(system, name)
    args, _ = local_command(SAGALINE["agent"]["command"])
    spec = system.spec("agent", args)
    result = subprocess.run(
        spec.argv, env=dict(spec.env), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "agent: 50 sagas" in result.stdout
    assert "NOT terminal" not in result.stdout


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_the_healthcheck_passes_once_the_service_is_up(system: ComposeSystem, name: str) -> None:
    """The service's compose healthcheck command itself (on this run's port), run once
    the service consumes or answers: it passes (the participants' and coordinator's
    probe /healthz, which answers 200 only while their loop serves; the dashboard's,
    once it has read the topics to their end). Tried again until it passes, as compose
    does (its ``retries``): the dashboard answers pages before it has caught up."""
    wait_up(system, name)
    test = [str(a) for a in SAGALINE[name]["healthcheck"]["test"]]
    assert test[:3] == ["CMD", "python", "-c"], test
    port = str(system.running[name].http_port)
    script = test[3].replace(":8088/", f":{port}/")
    args = [port if a in ("9100", "9101") else a for a in test[4:]]
    last: list[str] = []

    def passes() -> bool:
        started = system.running[name]
        assert started.process.alive, f"{name} exited:\n{started.process.log_tail(30)}"
        probe = subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60
        )
        last[:] = [probe.stderr[-2000:]]
        return probe.returncode == 0

    try:
        wait_until(passes, 120, f"the healthcheck of {name} to pass")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last probe said: {last}") from None


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_long_running_service_stops_cleanly_on_sigterm(system: ComposeSystem, name: str) -> None:
    """Exit 0 after SIGTERM, every long-running service, the dashboard included."""
    wait_up(system, name)
    process = system.running[name].process
    code = process.stop(timeout_s=20)
    assert code == 0, process.log_tail(30)


def test_the_image_entry_point_is_the_cli_these_tests_start() -> None:
    """Compose commands are arguments to the image's ENTRYPOINT; running them as
    ``python -m services.cli`` is only faithful if that entry point is this CLI."""
    import tomllib

    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["sagaline"]' in dockerfile
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sagaline"] == "services.cli:main"
