"""Faults of the transport layer (sagaline.kafka) an operator or a user would hit:
settings librdkafka refuses, and the in-process transport's fidelity to the broker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sagaline.kafka import (
    ClientConfig,
    KafkaConfigError,
    create_admin,
    create_consumer,
    create_producer,
    create_uncommitted_reader,
)
from services import cli

_FACTORIES: dict[str, Callable[[ClientConfig], Any]] = {
    "producer": create_producer,
    "consumer": lambda config: create_consumer(config, "g"),
    "uncommitted_reader": lambda config: create_uncommitted_reader(config, "g"),
    "admin": create_admin,
}


@pytest.mark.parametrize("factory", sorted(_FACTORIES))
@pytest.mark.parametrize(
    ("var", "value", "named"),
    [
        ("SAGALINE_KAFKA_SSL_CA_LOCATON", "/etc/kafka/ca.pem", "ssl.ca.locaton"),
        ("SAGALINE_KAFKA_SECURITY_PROTOCOL", "SASL_TLS", "security.protocol"),
    ],
)
def test_a_client_setting_librdkafka_refuses_is_a_config_error_naming_it(
    factory: str, var: str, value: str, named: str
) -> None:
    """A misspelt property or a value librdkafka does not take is a setting to fix,
    not a broker fault: a :class:`KafkaConfigError` naming it (which every command
    prints as an error line), not librdkafka's bare ``KafkaException``."""
    config = ClientConfig.from_env("127.0.0.1:9", {var: value})
    with pytest.raises(KafkaConfigError, match=named) as caught:
        _FACTORIES[factory](config)
    assert "SAGALINE_KAFKA_" in str(caught.value)


@pytest.mark.parametrize("command", [["coordinator", "run"], ["topics", "create"]])
def test_a_service_with_a_misspelt_client_setting_exits_with_an_error_line(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No traceback, and not "the broker did not answer": what to fix."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", "never-created.")
    monkeypatch.setenv("SAGALINE_KAFKA_SSL_CA_LOCATON", "/etc/kafka/ca.pem")
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "ssl.ca.locaton" in err and "did not answer" not in err
