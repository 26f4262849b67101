"""docker-compose.yml is valid Compose and names commands the code really has.

No Docker engine exists here; Debian's ``docker-compose`` (1.29) validates a file
against its bundled Compose schema with ``config -q`` without talking to an engine.
``scripts/test.sh`` installs it when missing.
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
    from schemas.settings import ENV_VARS

    for name, service in _services().items():
        if service.get("image", "").startswith("apache/kafka"):
            continue
        unknown = set(service.get("environment", {})) - set(ENV_VARS)
        assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"
