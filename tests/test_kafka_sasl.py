"""Sagaline on a SASL listener, configured only through the environment.

A dedicated local broker (its own state dir, stopped at the end) is started with a
SASL_PLAINTEXT/PLAIN listener next to its plaintext one. The coordinator and a
participant run as separate processes whose only Kafka configuration is
``KAFKA_BOOTSTRAP_SERVERS`` and ``SAGALINE_KAFKA_*`` variables, each as its own
principal; an agent (also configured by environment only) runs a saga through them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from participants import SagaClient
from sagaline.kafka import ClientConfig, KafkaError, KafkaException, create_admin
from schemas import TerminalStatus
from schemas.settings import Settings
from services import kafka_local
from services.demo_processes import ManagedProcess, ServiceSpec, group_assigned, python_env
from tests.system import wait_until

# One worker of a parallel run takes the whole module: its fixture starts a broker.
pytestmark = [pytest.mark.kafka, pytest.mark.xdist_group("sasl-broker")]

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kafka_local.SaslListener]:
    state = tmp_path_factory.mktemp("sasl-broker")
    try:
        kafka_local.ensure_running(state, sasl=True)
    except kafka_local.ToolMissingError as missing:
        pytest.skip(f"no Java/Maven for a second local broker: {missing}")
    listener = kafka_local.sasl_listener(state)
    assert listener is not None
    try:
        yield listener
    finally:
        kafka_local.down(state)


def test_a_client_without_the_right_password_is_refused(
    sasl_broker: kafka_local.SaslListener,
) -> None:
    env = sasl_broker.client_env("agent") | {"SAGALINE_KAFKA_SASL_PASSWORD": "wrong"}
    config = ClientConfig.from_env(sasl_broker.bootstrap, env)
    errors: list[KafkaError] = []
    admin = create_admin(config, error_cb=errors.append)

    def refused() -> bool:
        admin.poll(0.2)  # serves the error callback
        return any(e.code() == KafkaError._AUTHENTICATION for e in errors)

    # The broker's refusal itself, reported as soon as it comes (not a timeout, which
    # a slow machine would also give).
    wait_until(refused, 120, "the broker to refuse the wrong password")
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=1)  # and nothing is served to this client


def test_coordinator_and_participant_run_on_sasl_from_environment_settings_only(
    sasl_broker: kafka_local.SaslListener,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    new_topic_prefix: Callable[..., str],
) -> None:
    prefix = new_topic_prefix("sasl")
    common = {
        "SAGALINE_TOPIC_PREFIX": prefix,
        "SAGALINE_PARTITIONS": "2",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
    }
    # Nothing from the test process's own Kafka settings may leak into the services.
    for var in [v for v in os.environ if v.startswith("SAGALINE_KAFKA_")]:
        monkeypatch.delenv(var)
    coordinator = ManagedProcess(
        ServiceSpec(
            "coordinator",
            ["coordinator", "run", "--instance-id", "sasl-0", "--participants", "desks"],
            python_env(common | sasl_broker.client_env("coordinator")),
            tmp_path / "coordinator.log",
        )
    )
    participant = ManagedProcess(
        ServiceSpec(
            "desks",
            ["participant", "run", "desks", "--catalogue", "sasl_tools:catalogue"],
            python_env(
                common
                | {"SAGALINE_STATE_DIR": str(tmp_path / "state")}
                | sasl_broker.client_env("participant")
            ),
            tmp_path / "desks.log",
        )
    )
    coordinator.start()
    participant.start()
    try:
        # The agent: this process, configured by the same kind of variables.
        for name, value in (common | sasl_broker.client_env("agent")).items():
            monkeypatch.setenv(name, value)
        settings = Settings.from_env()
        assert settings.bootstrap == sasl_broker.bootstrap
        admin = create_admin(settings.bootstrap)
        deadline = time.monotonic() + 120
        ready = {
            f"{prefix}sagaline-coordinator": f"{prefix}sagaline.events",
            f"{prefix}sagaline-participant-desks": f"{prefix}sagaline.commands.desks",
        }
        while ready:
            for process in (coordinator, participant):
                assert process.alive, process.log_tail(40)
            ready = {g: t for g, t in ready.items() if not group_assigned(admin, g, t)}
            assert time.monotonic() < deadline, f"not up on SASL: {ready}"
            time.sleep(0.3)
        client = SagaClient(settings, settings.bootstrap, call_timeout_s=60)
        with client:
            with client.saga("booking", principal="agent:sasl") as saga:
                assert saga.call("book", desk="d-7") == "booking-d-7"
            receipt = saga.wait(60)
        assert receipt.status is TerminalStatus.COMPLETED
    finally:
        participant.stop(timeout_s=20)
        coordinator.stop(timeout_s=20)
    for process, principal in ((coordinator, "coordinator"), (participant, "participant")):
        log = process.log_tail(500)
        # Each says what it connected with, and never the secret.
        assert f"sasl.username={principal}" in log
        assert "sasl.password=*****" in log
        assert sasl_broker.passwords[principal] not in log
