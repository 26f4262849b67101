"""Which Kafka broker do the tests, the demo and ``--dev-broker`` use? One answer, in
one place. A development tool: production commands never come here (they stop with
``sagaline.kafka.BrokerNotConfigured`` when ``KAFKA_BOOTSTRAP_SERVERS`` is unset), and
an import contract (pyproject.toml, ``[tool.importlinter]``) keeps it off their path.

Order of choice (docs: ARCHITECTURE.md, "Kafka is real, everywhere"):

1. ``KAFKA_BOOTSTRAP_SERVERS`` if set: the caller already has a broker (CI scripts
   export it after ``sagaline kafka up``; a developer may point at their own).
2. Else the local single-node KRaft broker run on the JVM by
   :mod:`services.kafka_local` (started if needed, reused if running).
3. Else, only when Java/Maven are unavailable and cannot be installed, a
   testcontainers ``KafkaContainer`` if a Docker engine answers. It is imported
   lazily, so machines without Docker never touch the Docker SDK.

There is no in-memory fallback on purpose: integration tests must fail loudly
rather than pass against something that is not Kafka. (The in-process transport,
``memory://``, is a second test tier a suite asks for explicitly, never a fallback.)
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from schemas.settings import Settings
from services import kafka_local

__all__ = ["BrokerChoice", "choose_broker", "describe_configured", "resolve_bootstrap"]

ENV_VAR = "KAFKA_BOOTSTRAP_SERVERS"

# Keeps a testcontainers broker alive for the life of this process (its reaper
# removes it afterwards).
_container: Any = None


@dataclass(frozen=True)
class BrokerChoice:
    """The broker chosen, and a one-line human description of it."""

    bootstrap: str
    source: str  # "env" | "local-jvm" | "testcontainers"
    description: str


def _describe_env(bootstrap: str) -> str:
    st = kafka_local.status(timeout=2.0)
    if st.running and st.bootstrap == bootstrap:
        return (
            f"local JVM broker at {bootstrap} (Kafka {st.version}, pid {st.pid}, "
            f"via {ENV_VAR}; state {st.state_dir})"
        )
    return f"broker from {ENV_VAR}={bootstrap}"


def describe_configured() -> str:
    """Describe the broker choice without starting anything (for report headers)."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return _describe_env(env)
    st = kafka_local.status(timeout=2.0)
    if st.running:
        return f"local JVM broker at {st.bootstrap} (Kafka {st.version}, pid {st.pid}), reused"
    return "local JVM broker, started on first use (services/kafka_local.py)"


def _docker_answers() -> bool:
    try:
        docker = importlib.import_module("docker")  # optional: comes with testcontainers
        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


def _testcontainers_bootstrap() -> str:
    global _container
    if _container is None:
        try:  # testcontainers >= 4.15 (its testcontainers.kafka is a deprecated alias)
            from testcontainers.community.kafka import KafkaContainer
        except ImportError:  # 4.8 - 4.14, which pyproject.toml allows
            from testcontainers.kafka import KafkaContainer

        container = KafkaContainer().with_kraft()
        container.start()
        _container = container
    bootstrap: str = _container.get_bootstrap_server()
    return bootstrap


def choose_broker() -> BrokerChoice:
    """Apply the order of choice; start the local broker if that is the one chosen."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return BrokerChoice(env, "env", _describe_env(env))
    try:
        res = kafka_local.ensure_running()
    except kafka_local.ToolMissingError as missing:
        if not _docker_answers():
            raise kafka_local.KafkaLauncherError(
                "no Kafka broker available (and no Docker engine answers for the "
                f"testcontainers fallback): {missing}"
            ) from missing
        bootstrap = _testcontainers_bootstrap()
        return BrokerChoice(
            bootstrap, "testcontainers", f"testcontainers KafkaContainer at {bootstrap}"
        )
    how = "started by sagaline" if res.started else "reused (already running)"
    return BrokerChoice(
        res.bootstrap,
        "local-jvm",
        f"local JVM broker at {res.bootstrap} {how} (Kafka {res.version}, pid {res.pid}, "
        f"state {res.state_dir})",
    )


def resolve_bootstrap() -> str:
    """The bootstrap address of the broker to use (see the module docstring)."""
    return choose_broker().bootstrap


def settings_and_bootstrap() -> tuple[Settings, str]:
    """The process settings (from the environment) and the broker they point at:
    theirs when set, else the one chosen above. What every command starts with."""
    settings = Settings.from_env()
    return settings, settings.bootstrap or resolve_bootstrap()
