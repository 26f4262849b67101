"""Faults of the transport layer (sagaline.kafka) an operator or a user would hit:
settings librdkafka refuses, and the in-process transport's fidelity to the broker."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest

from sagaline.kafka import (
    OFFSET_BEGINNING,
    ClientConfig,
    KafkaConfigError,
    LedgerReader,
    LedgerWriter,
    RecordTooLarge,
    TopicPartition,
    configured_broker,
    create_admin,
    create_consumer,
    create_producer,
    create_uncommitted_reader,
    ensure_topics,
)
from schemas.signing import Headers, Signer
from schemas.topics import TopicNames
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


@pytest.mark.kafka
@pytest.mark.parametrize("call", ["poll", "consume", "commit", "assignment", "watermarks"])
def test_a_closed_consumer_refuses_to_be_used_on_every_transport(
    transport: str, unique_prefix: str, call: str
) -> None:
    """librdkafka raises ``RuntimeError('Consumer closed')``: a service that polls or
    commits with a consumer it already closed crashes on Kafka, so the in-process
    transport must not let a fast-tier test pass on it (closing twice is harmless)."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    consumer = create_consumer(transport, f"{unique_prefix}group")
    consumer.assign([TopicPartition(names.events, 0, OFFSET_BEGINNING)])
    consumer.close()
    uses: dict[str, Callable[[], object]] = {
        "poll": lambda: consumer.poll(0.1),
        "consume": lambda: consumer.consume(5, 0.1),
        "commit": lambda: consumer.commit(
            offsets=[TopicPartition(names.events, 0, 0)], asynchronous=False
        ),
        "assignment": consumer.assignment,
        "watermarks": lambda: consumer.get_watermark_offsets(TopicPartition(names.events, 0), 5),
    }
    with pytest.raises(RuntimeError, match="Consumer closed"):
        uses[call]()
    consumer.close()


@pytest.mark.kafka
def test_the_producer_counts_a_records_framing_against_message_max_bytes_on_every_transport(
    transport: str, unique_prefix: str
) -> None:
    """librdkafka refuses a record whose key, value and headers fit under
    ``message.max.bytes`` but not with the 36 bytes of framing it reserves per record
    (and each header's two length varints): the in-process transport must refuse it
    too, or a fast-tier test passes on a record Kafka never takes."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(
        ClientConfig(transport, {"message.max.bytes": "10000"}), names, Signer(None)
    )
    headers: Headers = [("h", b"v" * 10)]
    # 36 bytes of framing, the key, and the header as written: a one-byte varint of
    # its name's length, the name, a one-byte varint of its value's length, the value.
    fits = 10_000 - 36 - len(b"k") - (1 + 1 + 1 + 10)
    writer.write(names.events, b"k", b"x" * fits, headers)  # exactly at the limit: taken
    with pytest.raises(RecordTooLarge, match=re.escape(names.events)):
        writer.write(names.events, b"k", b"x" * (fits + 1), headers)
    writer.close()
    assert [len(m.value() or b"") for m in LedgerReader(transport).read(names.events)] == [fits]


@pytest.mark.kafka
def test_a_header_with_a_null_value_is_kept_on_every_transport(
    transport: str, unique_prefix: str
) -> None:
    """Kafka keeps a header whose value is null, and a reader gets ``(name, None)``:
    code reading headers must cope with it (a hand-written or hostile record), so the
    in-process transport must deliver it too, not drop it."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    writer.write(names.events, b"k", b"v", [("a", None), ("b", b""), ("c", b"x")])
    writer.close()
    [msg] = list(LedgerReader(transport).read(names.events))
    assert msg.headers() == [("a", None), ("b", b""), ("c", b"x")]


def test_a_misspelt_secret_setting_is_refused_before_the_start_up_line_shows_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up line lists every client setting, masking the values of those
    named as secrets; a misspelt name (``sasl.pasword``) is no secret's name, so it
    must be refused before that line is written, not shown in clear and refused at
    the first client."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    monkeypatch.setenv("SAGALINE_KAFKA_SASL_PASWORD", "hunter2-in-clear")
    caplog.set_level(logging.DEBUG)
    try:
        configured_broker("sagaline coordinator run")
    except KafkaConfigError as exc:
        refused = str(exc)
    else:
        refused = ""
    assert "hunter2" not in caplog.text
    assert "sasl.pasword" in refused and "hunter2" not in refused


def test_a_deployment_setting_a_client_overrides_is_warned_about_not_dropped_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Some clients set a property themselves (the coordinator's producer its
    ``transaction.timeout.ms`` and ``retry.backoff.ms``): a deployment's own value for
    it is not used there, and the log says so, naming the variable, once."""
    config = ClientConfig.from_env(
        "b:9092",
        {"SAGALINE_KAFKA_RETRY_BACKOFF_MS": "500", "SAGALINE_KAFKA_LINGER_MS": "5"},
    )
    caplog.set_level(logging.WARNING, logger="sagaline.kafka")
    for _ in range(2):
        settings = config.producer(**{"retry.backoff.ms": 5, "linger.ms": "5"})
    assert settings["retry.backoff.ms"] == 5
    warned = [r.getMessage() for r in caplog.records if "retry.backoff.ms" in r.getMessage()]
    assert len(warned) == 1 and "500" in warned[0] and "not used" in warned[0]
    assert not [r for r in caplog.records if "linger.ms" in r.getMessage()]  # the same value
