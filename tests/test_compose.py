"""docker-compose.yml is valid Compose and names commands the code really has.

No Docker engine exists here. The file is checked against the current Compose
Specification JSON schema (vendored from the compose-spec project in
``tests/fixtures/compose-spec/``), and Debian's ``docker-compose`` (1.29) checks it
too with ``config -q`` without talking to an engine (``scripts/test.sh`` installs it
when missing). Then each point of issue 10 item 4 is checked: two listeners, a volume
for Kafka's log, no default secrets, healthchecks and ``service_healthy``, distinct
instance ids under ``--scale``, a dependency layer in the Dockerfile.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def _compose_config(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: run scripts/test.sh (it installs it)")
    return subprocess.run(
        [exe, "-f", str(path), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
        # Secrets have no defaults in the file (Compose refuses to start without them).
        env={"PATH": "/usr/bin:/bin", "SAGALINE_HMAC_KEY": "test-only-key"},
    )


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def test_compose_file_is_valid_against_the_compose_schema() -> None:
    result = _compose_config(COMPOSE)
    assert result.returncode == 0, result.stderr


def test_validator_rejects_an_invalid_compose_file(tmp_path: Path) -> None:
    # Guards the test above: the validator really checks the schema.
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["coordinator"]["restart_policy_typo"] = "always"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    result = _compose_config(path)
    assert result.returncode != 0
    assert "restart_policy_typo" in result.stderr


def test_kafka_service_runs_kraft_with_the_apache_image() -> None:
    kafka = _services()["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_every_sagaline_service_command_parses_with_the_cli() -> None:
    parser = build_parser()
    checked = 0
    for name, service in _services().items():
        if service.get("image", "").startswith("apache/kafka"):
            continue
        args = parser.parse_args([str(a) for a in service["command"]])
        assert callable(getattr(args, "func", None)), f"{name}: {service['command']}"
        checked += 1
    assert checked >= 8


def test_every_environment_variable_is_one_the_code_reads() -> None:
    import inspect

    import services.dashboard.auth
    from schemas.settings import ENV_VARS

    dashboard = inspect.getsource(services.dashboard.auth)
    for name, service in _services().items():
        if service.get("image", "").startswith("apache/kafka"):
            continue
        read = set(ENV_VARS)
        if name == "dashboard":  # and the dashboard's own (services/dashboard/auth.py)
            read |= {v for v in service.get("environment", {}) if f'"{v}"' in dashboard}
        unknown = set(service.get("environment", {})) - read
        assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"


# ------------------------------------------------- the Compose specification (item 4)

SCHEMA = ROOT / "tests" / "fixtures" / "compose-spec" / "compose-spec.json"


def _schema_errors(document: Any) -> list[str]:
    import json

    import jsonschema

    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_compose_file_passes_the_current_compose_spec_schema() -> None:
    assert _schema_errors(yaml.safe_load(COMPOSE.read_text())) == []


def test_the_compose_spec_schema_rejects_what_compose_would() -> None:
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["coordinator"]["restart_policy_typo"] = "always"
    broken["services"]["kafka"]["healthcheck"]["interval"] = ["5s"]
    errors = _schema_errors(broken)
    assert any("restart_policy_typo" in e for e in errors), errors
    assert any(e.startswith("services/kafka/healthcheck/interval") for e in errors), errors


def _long_running() -> dict[str, Any]:
    return {
        name: s
        for name, s in _services().items()
        if str(s.get("restart")) != "no" and not s.get("image", "").startswith("apache/")
    }


def test_kafka_advertises_an_internal_and_a_host_listener() -> None:
    kafka = _services()["kafka"]
    env = kafka["environment"]
    advertised = dict(
        entry.split("://", 1) for entry in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    )
    assert advertised["INTERNAL"] == "kafka:9092"  # what containers use
    host, _, port = advertised["EXTERNAL"].rpartition(":")
    assert host in ("${KAFKA_HOST_ADDRESS:-localhost}", "localhost")  # resolvable on the host
    published = [str(p).rpartition("}:")[2] for p in kafka["ports"]]
    assert f"{port}:{port}" in published  # the host listener is the published one
    assert "9092:9092" not in published  # the internal one is not
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "INTERNAL"
    assert all(
        s["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
        for s in _services().values()
        if "KAFKA_BOOTSTRAP_SERVERS" in s.get("environment", {})
    )


def test_kafka_keeps_its_log_on_a_named_volume() -> None:
    document = yaml.safe_load(COMPOSE.read_text())
    kafka = document["services"]["kafka"]
    log_dir = kafka["environment"]["KAFKA_LOG_DIRS"]
    mounts = dict(v.split(":", 1) for v in kafka["volumes"])
    assert log_dir in mounts.values()
    volume = next(name for name, target in mounts.items() if target == log_dir)
    assert volume in document["volumes"]


def test_no_secret_has_a_default_and_compose_refuses_to_start_without_it(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    assert "change-me" not in text
    env = _services()["coordinator"]["environment"]
    assert env["SAGALINE_HMAC_KEY"].startswith("${SAGALINE_HMAC_KEY:?")
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: run scripts/test.sh (it installs it)")
    result = subprocess.run(
        [exe, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,  # no .env here
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "SAGALINE_HMAC_KEY" in result.stderr


def test_every_long_running_service_has_a_healthcheck_and_dependents_wait_for_it() -> None:
    services = _services()
    for name, service in _long_running().items():
        assert "healthcheck" in service, name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    assert "healthcheck" in services["kafka"]
    for name, service in services.items():
        for dependency, how in (service.get("depends_on") or {}).items():
            wanted = (
                "service_completed_successfully"
                if str(services[dependency].get("restart")) == "no"
                else "service_healthy"
            )
            assert how["condition"] == wanted, (name, dependency)
    assert set(services["agent"]["depends_on"]) >= {"coordinator", "payments", "policy"}


def test_the_healthchecks_probe_the_port_the_command_serves() -> None:
    for name, service in _long_running().items():
        command = [str(a) for a in service["command"]]
        flag = "--metrics-port" if "--metrics-port" in command else "--port"
        port = command[command.index(flag) + 1]
        probe = " ".join(map(str, service["healthcheck"]["test"]))
        assert port in probe, name
        # /metrics answers from the start; /healthz only while the process serves
        assert "/healthz" in probe, name


def test_no_service_pins_an_instance_id_so_scaled_replicas_differ() -> None:
    from services.cli import build_parser

    for name, service in _services().items():
        assert "--instance-id" not in [str(a) for a in service.get("command", [])], name
        assert "SAGALINE_INSTANCE_ID" not in service.get("environment", {}), name
    # Under Compose each replica has its own HOSTNAME: the id the CLI falls back to.
    import os

    old = os.environ.get("HOSTNAME")
    try:
        os.environ.pop("SAGALINE_INSTANCE_ID", None)
        ids = []
        for hostname in ("c0ffee000001", "c0ffee000002"):
            os.environ["HOSTNAME"] = hostname
            for argv in (["participant", "run", "payments"], ["coordinator", "run"]):
                ids.append(build_parser().parse_args(argv).instance_id)
        assert ids == ["c0ffee000001", "c0ffee000001", "c0ffee000002", "c0ffee000002"]
    finally:
        if old is None:
            os.environ.pop("HOSTNAME", None)
        else:
            os.environ["HOSTNAME"] = old


def test_the_dockerfile_installs_dependencies_in_a_layer_before_the_code() -> None:
    import tomllib

    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # join continuations
    lines = [
        " ".join(line.split())
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    steps = [line for line in lines if line.split()[0] in ("COPY", "RUN")]
    deps = next(
        i for i, line in enumerate(steps) if "requirements.txt" in line and "pip install" in line
    )
    assert steps[:deps] == ["COPY pyproject.toml ./"]  # only the dependency list before it
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    copied = {line.split()[1] for line in steps[deps:] if line.startswith("COPY")}
    for package in packages:
        assert package.rstrip("*") in copied, f"the image lacks {package}"
    assert any("--no-deps" in line for line in steps[deps + 1 :])


def test_every_published_port_is_on_loopback_unless_asked() -> None:
    """The example runs Kafka without authentication and the dashboard in development
    mode (no logins): published on every interface, anyone on the network could write
    to the ledger or approve. ``SAGALINE_PUBLISH_ADDRESS`` opens them on purpose."""
    published = [(name, p) for name, s in _services().items() for p in s.get("ports", [])]
    assert published  # Kafka's host listener and the dashboard
    for name, port in published:
        assert str(port).startswith("${SAGALINE_PUBLISH_ADDRESS:-127.0.0.1}:"), (name, port)


def test_the_dashboard_can_be_told_the_host_names_it_is_reached_by() -> None:
    """docs/deploying.md: SAGALINE_PUBLISH_ADDRESS=0.0.0.0 (with KAFKA_HOST_ADDRESS)
    reaches the dashboard from other hosts. Without logins it answers 403 to any Host
    but localhost, an IP address or a name in SAGALINE_DASHBOARD_HOSTS, which the
    compose file did not pass to the container: opened by the host's name, every page
    was refused, and the variable the 403 page names could not be set."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: run scripts/test.sh (it installs it)")
    result = subprocess.run(
        [exe, "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "SAGALINE_HMAC_KEY": "test-only-key",
            "SAGALINE_DASHBOARD_HOSTS": "ops.example.com",
        },
    )
    assert result.returncode == 0, result.stderr
    dashboard = yaml.safe_load(result.stdout)["services"]["dashboard"]
    assert dashboard["environment"].get("SAGALINE_DASHBOARD_HOSTS") == "ops.example.com"


def test_the_docs_say_scaled_replicas_share_the_journal_compose_gives_them() -> None:
    """Each participant mounts one named volume at /data (SAGALINE_STATE_DIR in the
    image), so ``--scale payments=2`` gives both replicas the same command journal
    (and the example provider's files, which they must share). The docs must say a
    journal may be shared so (and what that does), not that each has its own."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ENV SAGALINE_STATE_DIR=/data" in dockerfile
    for name, service in _services().items():
        command = [str(a) for a in service.get("command", [])]
        if command[:2] != ["participant", "run"]:
            continue
        assert "--journal-dir" not in command, name
        assert service["volumes"] == [f"{command[2]}-data:/data"], name
    operating = (ROOT / "docs" / "operating.md").read_text()
    scaling = " ".join(operating.split("## Scaling", 1)[1].split("\n## ", 1)[0].split())
    assert "a journal of its own" not in scaling
    assert "--scale" in scaling and "share" in scaling
    assert "network file system" in scaling
