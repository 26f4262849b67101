"""The transport layer (sagaline.kafka): client settings from the environment, topic
replication, the acknowledged ledger writer, the reader, the dead-letter writer."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from sagaline.kafka import (
    BrokerNotConfigured,
    ClientConfig,
    DeadLetterWriter,
    DeliveryFailed,
    KafkaConfigError,
    KafkaError,
    KafkaException,
    LedgerReader,
    LedgerWriter,
    Producer,
    RecordTooLarge,
    TopicSetupError,
    create_admin,
    create_consumer,
    create_producer,
    create_uncommitted_reader,
    ensure_topics,
    require_bootstrap,
    watermarks,
)
from schemas import SagaStarted
from schemas.examples import example_records
from schemas.settings import Settings
from schemas.signing import Signer
from schemas.topics import Replication, TopicNames
from schemas.wire import DLQ_REASON, read_dead_letter

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ settings


def test_every_librdkafka_setting_comes_from_a_prefixed_variable() -> None:
    config = ClientConfig.from_env(
        "b:9092",
        {
            "SAGALINE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "SAGALINE_KAFKA_SASL_MECHANISM": "PLAIN",
            "SAGALINE_KAFKA_SASL_USERNAME": "coordinator",
            "SAGALINE_KAFKA_LINGER_MS": "20",
            "SAGALINE_KAFKA_VERSION": "4.1.0",  # the dev launcher's, not a client setting
            "OTHER": "x",
        },
    )
    assert config.settings == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "coordinator",
        "linger.ms": "20",
    }
    producer = config.producer()
    assert producer["bootstrap.servers"] == "b:9092"
    assert producer["security.protocol"] == "SASL_PLAINTEXT"
    assert producer["linger.ms"] == "20"
    assert producer["partitioner"] == "murmur2_random"
    assert config.consumer("g")["sasl.username"] == "coordinator"
    assert config.admin()["security.protocol"] == "SASL_PLAINTEXT"


def test_the_log_level_variable_sets_librdkafkas_log_level_and_wins_over_the_admin_default() -> (
    None
):
    """librdkafka spells its log level ``log_level`` (an underscore, no dot), so the
    rule "replace the dots with underscores" mapped SAGALINE_KAFKA_LOG_LEVEL to
    ``log.level``, which librdkafka refuses: every command stopped with "No such
    configuration property". It is the one way to quieten or raise every client's
    log, and the admin clients' default (5) must yield to it."""
    config = ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_LOG_LEVEL": "7"})
    assert config.settings == {"log_level": "7"}
    assert config.admin()["log_level"] == "7"
    assert config.producer()["log_level"] == "7"
    AdminClient(config.admin())  # librdkafka takes it


def test_a_properties_file_is_read_and_variables_override_it(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_text(
        "# deployment settings\nsecurity.protocol=SASL_SSL\nssl.ca.location = /ca.pem\n"
        "sasl.mechanism=PLAIN\n"
    )
    config = ClientConfig.from_env(
        "b:1",
        {
            "SAGALINE_KAFKA_PROPERTIES_FILE": str(props),
            "SAGALINE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        },
    )
    assert config.settings == {
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": "/ca.pem",
        "sasl.mechanism": "SCRAM-SHA-512",
    }


def test_an_empty_client_variable_counts_as_unset(tmp_path: Path) -> None:
    """README ("Configuration"): a variable set to the empty string, as ``${VAR:-}``
    in a compose file gives, counts as unset. An empty SAGALINE_KAFKA_* variable was
    passed to librdkafka as "": `security.protocol` refused every command at start
    (exit 2), and an empty `sasl.username` silently replaced the properties file's."""
    props = tmp_path / "client.properties"
    props.write_text("sasl.username=coordinator\n")
    config = ClientConfig.from_env(
        "b:1",
        {
            "SAGALINE_KAFKA_PROPERTIES_FILE": str(props),
            "SAGALINE_KAFKA_SASL_USERNAME": "",
            "SAGALINE_KAFKA_SECURITY_PROTOCOL": "",
        },
    )
    assert config.settings == {"sasl.username": "coordinator"}


def test_an_unreadable_or_malformed_properties_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(KafkaConfigError, match="SAGALINE_KAFKA_PROPERTIES_FILE"):
        ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_PROPERTIES_FILE": str(tmp_path / "no")})
    bad = tmp_path / "bad.properties"
    bad.write_text("security.protocol\n")
    with pytest.raises(KafkaConfigError, match=r"bad.properties:1"):
        ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_PROPERTIES_FILE": str(bad)})


def test_a_malformed_properties_line_is_refused_without_its_value(tmp_path: Path) -> None:
    # Java properties also allow "name: value"; such a line is refused, and the error
    # (logged, printed at start-up) names the line, never what it holds.
    bad = tmp_path / "client.properties"
    bad.write_text("security.protocol=SASL_SSL\nsasl.password: hunter2-secret\n")
    with pytest.raises(KafkaConfigError, match=r"client.properties:2") as refused:
        ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_PROPERTIES_FILE": str(bad)})
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SAGALINE_KAFKA_PARTITIONER", "consistent_random"),
        ("SAGALINE_KAFKA_ENABLE_IDEMPOTENCE", "false"),
        ("SAGALINE_KAFKA_ACKS", "1"),
        ("SAGALINE_KAFKA_ISOLATION_LEVEL", "read_uncommitted"),
        ("SAGALINE_KAFKA_ENABLE_AUTO_COMMIT", "true"),
        # A group with no committed offset (new, or its offsets expired while it was
        # down) would skip every command and ledger record already written.
        ("SAGALINE_KAFKA_AUTO_OFFSET_RESET", "latest"),
        # librdkafka takes a topic-level property with a "topic." prefix too, and
        # "acks" is its alias of request.required.acks: the same settings, other names.
        ("SAGALINE_KAFKA_TOPIC_PARTITIONER", "consistent"),
        ("SAGALINE_KAFKA_REQUEST_REQUIRED_ACKS", "1"),
        ("SAGALINE_KAFKA_TOPIC_REQUEST_REQUIRED_ACKS", "1"),
    ],
)
def test_settings_the_design_depends_on_cannot_be_changed(var: str, value: str) -> None:
    with pytest.raises(KafkaConfigError, match="is not allowed"):
        ClientConfig.from_env("b:1", {var: value})


def test_the_consumer_group_protocol_is_refused_naming_the_key_and_why() -> None:
    """``group.protocol=consumer`` (KIP-848) groups are invisible to the classic group
    listing Sagaline reads (sagaline.kafka.describe_group): a coordinator or
    participant with members reads as DEAD with none, so a client refuses to start
    for want of a coordinator and ``sagaline status`` says nothing consumes."""
    with pytest.raises(KafkaConfigError, match=r"group\.protocol='consumer' is not allowed") as e:
        ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_GROUP_PROTOCOL": "consumer"})
    assert "no members" in str(e.value)
    config = ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_GROUP_PROTOCOL": "CLASSIC"})
    assert config.consumer("g")["group.protocol"] == "classic"


@pytest.mark.parametrize(
    "var",
    [
        "SAGALINE_KAFKA_GROUP_ID",
        "SAGALINE_KAFKA_TRANSACTIONAL_ID",
        "SAGALINE_KAFKA_GROUP_INSTANCE_ID",
    ],
)
def test_a_per_client_identity_is_refused_not_silently_overridden(var: str) -> None:
    """Sagaline gives each consumer its group (and each coordinator producer its
    transactional id) itself: one from the environment was dropped for some clients
    and applied to all the others (every ledger writer made transactional, every
    consumer of a process the same static member)."""
    with pytest.raises(KafkaConfigError, match="set by Sagaline per client"):
        ClientConfig.from_env("b:1", {var: "mine"})


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SAGALINE_KAFKA_ACKS", "-1"),
        ("SAGALINE_KAFKA_AUTO_OFFSET_RESET", "smallest"),
        ("SAGALINE_KAFKA_ENABLE_IDEMPOTENCE", "TRUE"),
        # librdkafka's boolean spellings, any case: the same value as the pin.
        ("SAGALINE_KAFKA_ENABLE_IDEMPOTENCE", "1"),
        ("SAGALINE_KAFKA_ENABLE_AUTO_COMMIT", "0"),
        ("SAGALINE_KAFKA_ENABLE_AUTO_COMMIT", "False"),
    ],
)
def test_another_name_of_a_pinned_value_is_accepted(var: str, value: str) -> None:
    """librdkafka's synonyms of the pinned values (``acks=-1`` is ``all``)."""
    ClientConfig.from_env("b:1", {var: value})


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SAGALINE_KAFKA_ENABLE_IDEMPOTENCE", "0"),
        ("SAGALINE_KAFKA_ENABLE_AUTO_COMMIT", "1"),
        ("SAGALINE_KAFKA_ENABLE_AUTO_COMMIT", "TRUE"),
    ],
)
def test_a_boolean_spelling_of_another_value_than_the_pin_is_still_refused(
    var: str, value: str
) -> None:
    with pytest.raises(KafkaConfigError, match="is not allowed"):
        ClientConfig.from_env("b:1", {var: value})


def test_the_bootstrap_address_has_one_source() -> None:
    with pytest.raises(KafkaConfigError, match="KAFKA_BOOTSTRAP_SERVERS"):
        ClientConfig.from_env("b:1", {"SAGALINE_KAFKA_BOOTSTRAP_SERVERS": "other:1"})


def test_secrets_never_appear_in_the_repr_or_the_description() -> None:
    config = ClientConfig.from_env(
        "b:1",
        {
            "SAGALINE_KAFKA_SASL_USERNAME": "payments",
            "SAGALINE_KAFKA_SASL_PASSWORD": "hunter2-secret",
            "SAGALINE_KAFKA_SSL_KEY_PASSWORD": "k3y-pass",
            "SAGALINE_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET": "oauth-s3cret",
        },
    )
    shown = repr(config) + config.describe() + str(config)
    for secret in ("hunter2-secret", "k3y-pass", "oauth-s3cret"):
        assert secret not in shown
    assert "payments" in shown


def test_the_oauthbearer_config_is_masked() -> None:
    # librdkafka's sasl.oauthbearer.config carries the unsecured JWT settings or,
    # for many providers, a token or client secret itself ("token=...").
    config = ClientConfig.from_env(
        "b:1", {"SAGALINE_KAFKA_SASL_OAUTHBEARER_CONFIG": "principal=svc token=eyJ-s3cret"}
    )
    assert "eyJ-s3cret" not in repr(config) + config.describe()


def test_replication_must_be_achievable() -> None:
    assert Replication(3, 2).topic_config() == {"min.insync.replicas": "2"}
    assert Replication().topic_config() == {}
    with pytest.raises(ValueError, match=r"min\.insync\.replicas 3"):
        Replication(2, 3)
    settings = Settings.from_env(
        {"SAGALINE_REPLICATION_FACTOR": "3", "SAGALINE_MIN_INSYNC_REPLICAS": "2"}
    )
    assert settings.replication == Replication(3, 2)


# ------------------------------------------------------------- no broker set


def test_a_production_process_without_a_broker_is_told_what_to_set() -> None:
    with pytest.raises(BrokerNotConfigured) as caught:
        require_bootstrap(Settings.from_env({}), "sagaline coordinator run")
    message = str(caught.value)
    assert "sagaline coordinator run" in message
    assert "KAFKA_BOOTSTRAP_SERVERS" in message
    assert "sagaline kafka up" in message
    # A flag of the sagaline commands that have one (added by services.cli), not of
    # every process that calls this.
    assert "--dev-broker" not in message


@pytest.mark.parametrize(
    "command",
    [
        ["coordinator", "run"],
        ["participant", "run", "payments"],
        ["topics", "create"],
        ["dashboard"],
        ["saga", "show", "saga-1"],
    ],
)
def test_production_commands_fail_fast_without_a_broker(command: list[str]) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT), "SAGALINE_STATE_DIR": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # a hang (a broker being started) fails here, not a slow machine
    )
    assert done.returncode == 2, done.stderr
    assert "KAFKA_BOOTSTRAP_SERVERS" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["coordinator", "run"],
        ["participant", "run", "payments"],
        ["topics", "create"],
        ["dashboard"],
        ["saga", "show", "saga-1"],
        ["saga", "wait", "saga-1"],
        ["approve", "saga-1", "01-x", "--operator", "alice"],
        ["deny", "saga-1", "01-x", "--operator", "alice", "--reason", "no"],
        ["incidents", "list"],
        ["incidents", "resolve", "inc-1", "--operator", "alice"],
        ["status"],
        ["catalogue", "withdraw", "legacy"],
    ],
)
def test_the_no_broker_error_offers_dev_broker_only_where_the_command_takes_it(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user follows the error's advice: the flag it names must be accepted."""
    from services.cli import build_parser, main

    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("SAGALINE_OPERATOR", raising=False)
    assert main(command) == 2
    message = capsys.readouterr().err
    assert "KAFKA_BOOTSTRAP_SERVERS" in message
    takes_flag = hasattr(build_parser().parse_args(command), "dev_broker")
    assert ("--dev-broker" in message) == takes_flag, message


# ---------------------------------------- real broker (and, where marked, in-process)

# ``transport`` runs a test on the real broker and on the in-process transport
# (tests/conftest.py): the same contract for both.


@pytest.mark.kafka
def test_topics_get_the_configured_min_insync_replicas(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    from confluent_kafka.admin import ConfigResource, ResourceType

    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1, replication=Replication(1, 1))
    admin = create_admin(kafka_bootstrap)
    resource = ConfigResource(ResourceType.TOPIC, names.events)
    configs = admin.describe_configs([resource])[resource].result(30)
    assert configs["min.insync.replicas"].value == "1"
    assert configs["min.insync.replicas"].source != 5  # not the broker's default


@pytest.mark.kafka
def test_an_appended_record_is_acknowledged_and_read_back_per_saga(
    transport: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 3)
    signer = Signer(b"k" * 32)
    writer = LedgerWriter(transport, names, signer)
    records = [r for r in example_records(saga_id="saga-a") if r.envelope.saga_id == "saga-a"]
    other = example_records(saga_id="saga-b")[0]
    for record in [*records, other]:
        writer.append(record)
    writer.close()
    reader = LedgerReader(transport)
    assert reader.saga_records(names.events, "saga-a", signer) == records
    assert reader.saga_records(names.events, "saga-b", signer) == [other]
    assert sum(reader.end_offsets(names.events).values()) == len(records) + 1


@pytest.mark.kafka
def test_a_record_the_broker_does_not_take_raises_delivery_failed(
    transport: str, unique_prefix: str
) -> None:
    """No topic (auto-creation is off): the delivery report is an error, raised typed."""
    names = TopicNames(unique_prefix)  # topics never created
    config = ClientConfig(transport, {"message.timeout.ms": "1000"})
    writer = LedgerWriter(config, names, Signer(None))
    record = example_records(saga_id="saga-x")[0]
    with pytest.raises(DeliveryFailed, match=r"SagaStarted .* of saga saga-x") as caught:
        writer.append(record)
    assert caught.value.topic == names.events
    writer.close()


@pytest.mark.kafka
def test_a_delivery_callback_that_raises_does_not_stop_the_poller(
    transport: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One broken callback must not strand every later report of the process."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None), background_poll=True)
    record = example_records(saga_id="saga-p")[0]

    def broken(_failure: DeliveryFailed | None) -> None:
        raise RuntimeError("a broken callback")

    later: list[DeliveryFailed | None] = []
    writer.append_then(record, broken)
    writer.append_then(record, later.append)
    with caplog.at_level(logging.ERROR, logger="sagaline.kafka._writers"):
        writer.append(record)  # its report comes after both callbacks'
        asyncio.run(writer.append_async(record))
    assert later == [None]
    assert "a broken callback" in caplog.text
    writer.close()


class _Refusing:
    """A producer whose ``produce`` raises ``error`` for the next ``times`` records."""

    def __init__(self, producer: Producer, error: Exception, times: int = 1) -> None:
        self._producer = producer
        self._error = error
        self.times = times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
        if self.times:
            self.times -= 1
            raise self._error
        self._producer.produce(topic, *args, **kwargs)


def _writer_with_a_record(transport: str, prefix: str) -> tuple[TopicNames, LedgerWriter, Any]:
    """A polled ledger writer on fresh topics, and a record it wrote (to dead-letter)."""
    names = TopicNames(prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None), background_poll=True)
    writer.write(names.events, b"saga-z", b"junk")
    return names, writer, next(LedgerReader(transport).read(names.events))


def _produce_ways(writer: LedgerWriter, dlq_source: Any) -> dict[str, Callable[[], None]]:
    record = example_records(saga_id="saga-q")[0]
    events = writer.topics.events
    return {
        "append": lambda: writer.append(record),
        "begin_append": lambda: writer.begin_append(record)(),
        "append_then": lambda: writer.append_then(record, lambda f: None),
        "send_then": lambda: writer.send_then(record, lambda f: None),
        "append_async": lambda: asyncio.run(writer.append_async(record)),
        "write": lambda: writer.write(events, b"k", b"v"),
        "dead_letter": lambda: DeadLetterWriter(
            writer.producer, writer.topics.dlq, acknowledged=True, polled=True
        ).write(dlq_source, "malformed", "junk"),
        "dead_letter_unacknowledged": lambda: DeadLetterWriter(
            writer.producer, writer.topics.dlq, acknowledged=False
        ).write(dlq_source, "malformed", "junk"),
    }


@pytest.mark.kafka
@pytest.mark.parametrize(
    "way",
    [
        "append",
        "begin_append",
        "append_then",
        "send_then",
        "append_async",
        "write",
        "dead_letter",
        "dead_letter_unacknowledged",
    ],
)
def test_a_full_local_queue_is_a_delivery_failure_to_retry(
    transport: str, unique_prefix: str, way: str
) -> None:
    """librdkafka's ``BufferError``: nothing was sent, and a retry succeeds."""
    names, writer, source = _writer_with_a_record(transport, unique_prefix)
    full = _Refusing(writer.producer, BufferError("Local: Queue full"))
    writer.producer = full  # type: ignore[assignment]
    produce = _produce_ways(writer, source)[way]
    with pytest.raises(DeliveryFailed, match="local queue is full") as caught:
        produce()
    assert caught.value.topic in (names.events, names.dlq)
    assert full.times == 0
    produce()  # the same call again goes through
    writer.close()


@pytest.mark.kafka
@pytest.mark.parametrize("way", ["append", "send_then", "write"])
def test_a_record_too_large_for_the_producer_is_refused_for_good_naming_topic_and_size(
    transport: str, unique_prefix: str, way: str
) -> None:
    """Not a DeliveryFailed (which callers retry): writing it again never succeeds."""
    names, writer, source = _writer_with_a_record(transport, unique_prefix)
    too_large = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    writer.producer = _Refusing(writer.producer, too_large)  # type: ignore[assignment]
    with pytest.raises(RecordTooLarge, match=r"is \d+ bytes") as caught:
        _produce_ways(writer, source)[way]()
    assert caught.value.topic in str(caught.value)
    assert not isinstance(caught.value, DeliveryFailed)
    assert caught.value.topic in (names.events, names.dlq) and caught.value.size > 0
    writer.close()


@pytest.mark.kafka
@pytest.mark.parametrize("acknowledged", [True, False])
def test_a_dead_letter_refused_for_its_size_is_written_without_its_value_R16(
    transport: str, unique_prefix: str, acknowledged: bool
) -> None:
    """Unlike a ledger record, a DLQ copy is not given up: a copy without the value
    that says what is missing is written instead (the real producer's refusal:
    ``test_a_dead_letter_too_large_to_copy_whole_still_says_what_was_lost_R16``)."""
    names, writer, source = _writer_with_a_record(transport, unique_prefix)
    too_large = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    writer.producer = _Refusing(writer.producer, too_large)  # type: ignore[assignment]
    DeadLetterWriter(writer.producer, names.dlq, acknowledged=acknowledged).write(
        source, "malformed", "junk"
    )
    writer.close()
    [copy] = list(LedgerReader(transport).read(names.dlq))
    letter = read_dead_letter(copy.headers())
    assert (copy.key(), copy.value(), letter.reason) == (b"saga-z", None, "malformed")
    assert letter.omitted is not None and hashlib.sha256(b"junk").hexdigest() in letter.omitted


@pytest.mark.kafka
def test_a_record_over_the_brokers_size_is_refused_for_good_naming_topic_and_size(
    transport: str, unique_prefix: str
) -> None:
    """The real producer's refusal (``message.max.bytes``), not a stand-in's."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    with pytest.raises(RecordTooLarge, match=rf"is 2000001 bytes .* on {re.escape(names.events)}"):
        writer.write(names.events, b"k", b"x" * 2_000_000)
    writer.close()


@pytest.mark.kafka
def test_the_reader_seeks_by_offset_and_by_time(transport: str, unique_prefix: str) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    first = example_records(saga_id="saga-t")[0]
    assert isinstance(first, SagaStarted)
    writer.append(first)
    reader = LedgerReader(transport)
    # Every record after this point in time (the broker stamps CreateTime from the
    # producer's clock: the same host's clock).
    cut = int(time.time() * 1000) + 1
    while int(time.time() * 1000) <= cut:
        pass
    second = first.model_copy(update={"workflow": "later"})
    writer.append(second)
    writer.close()
    since = reader.offsets_for_time(names.events, cut)
    assert since == {0: 1}
    assert [m.value() for m in reader.read(names.events, start=since)] == [
        m.value() for m in reader.read(names.events) if m.offset() == 1
    ]
    assert [m.offset() for m in reader.read(names.events, start={0: 0})] == [0, 1]
    assert list(reader.read(names.events, start=reader.end_offsets(names.events))) == []


@pytest.mark.kafka
def test_the_reader_stops_at_the_end_the_topic_had_when_it_started(
    transport: str, unique_prefix: str
) -> None:
    """Records written while it reads are not its: a caller writing back to the topic
    it reads (the drill's duplicates) would otherwise chase its own writes forever."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    first = example_records(saga_id="saga-r")[0]
    for n in range(3):
        writer.append(first.model_copy(update={"workflow": f"before-{n}"}))
    read = []
    for msg in LedgerReader(transport).read(names.events):
        read.append(msg.offset())
        if len(read) > 5:
            break  # chasing its own writes: fail now, not at the suite's timeout
        writer.append(first.model_copy(update={"workflow": f"during-{msg.offset()}"}))
    writer.close()
    assert read == [0, 1, 2]
    assert list(LedgerReader(transport).end_offsets(names.events).values()) == [6]


@pytest.mark.kafka
def test_a_dead_letter_keeps_the_bytes_and_says_why(transport: str, unique_prefix: str) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    writer.write(names.events, b"saga-z", b"\x00not avro", [("h", b"1")])
    bad = next(LedgerReader(transport).read(names.events))
    DeadLetterWriter(writer.producer, names.dlq, acknowledged=True).write(
        bad, "malformed", "not an Avro record"
    )
    [copy] = list(LedgerReader(transport).read(names.dlq))
    assert (copy.key(), copy.value()) == (b"saga-z", b"\x00not avro")
    letter = read_dead_letter(copy.headers())
    assert (letter.reason, letter.source_topic, letter.offset) == ("malformed", names.events, 0)
    assert dict(copy.headers() or [])[DLQ_REASON] == b"malformed"


@pytest.mark.kafka
def test_a_transaction_is_read_only_once_committed_and_never_once_aborted(
    transport: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    producer = create_producer(transport, **{"transactional.id": f"{unique_prefix}tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(names.events, key=b"k", value=b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(names.events, key=b"k", value=b"committed")
    producer.flush(30)
    reader = LedgerReader(transport)
    assert [m.value() for m in reader.read(names.events)] == []  # still open
    producer.commit_transaction(30)
    assert [m.value() for m in reader.read(names.events)] == [b"committed"]


def _read_all(consumer: Consumer, topic: str) -> list[tuple[int, bytes | None]]:
    """(offset, value) of every record of partition 0 from the start to its end."""
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out: list[tuple[int, bytes | None]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        msg = consumer.poll(1.0)
        if msg is None:
            continue
        err = msg.error()
        if err is not None and err.code() == KafkaError._PARTITION_EOF:
            return out
        assert err is None, err
        out.append((msg.offset() or 0, msg.value()))
    raise AssertionError(f"no end of {topic}[0] reached; read {out}")


@pytest.mark.kafka
def test_an_uncommitted_reader_sees_open_and_aborted_transactions_records(
    transport: str, unique_prefix: str
) -> None:
    """``create_uncommitted_reader`` reads to the high watermark, as a real broker
    serves read_uncommitted: a record of a transaction still open, and one aborted,
    are read (the ledger probe must filter them itself); a committed reader sees
    neither."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    producer = create_producer(transport, **{"transactional.id": f"{unique_prefix}tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(names.events, key=b"k", value=b"open")
    producer.flush(30)
    uncommitted = create_uncommitted_reader(
        transport, f"{unique_prefix}u", **{"enable.partition.eof": True}
    )
    try:
        assert [v for _, v in _read_all(uncommitted, names.events)] == [b"open"]
        _low, high = watermarks(uncommitted, TopicPartition(names.events, 0))
        assert high == 1
        producer.abort_transaction(30)
        assert [v for _, v in _read_all(uncommitted, names.events)] == [b"open"]
    finally:
        uncommitted.close()
    assert [m.value() for m in LedgerReader(transport).read(names.events)] == []


@pytest.mark.kafka
def test_a_transactions_commit_or_abort_marker_takes_an_offset(
    transport: str, unique_prefix: str
) -> None:
    """A real broker writes a control record at the end of every transaction: the
    offsets of what is read skip it, and the high watermark counts it, so code that
    takes "the last record is at high - 1" must not rely on it."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    producer = create_producer(transport, **{"transactional.id": f"{unique_prefix}tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(names.events, key=b"k", value=b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(names.events, key=b"k", value=b"committed")
    producer.flush(30)
    producer.commit_transaction(30)
    writer = LedgerWriter(transport, names, Signer(None))
    writer.write(names.events, b"k", b"plain")
    writer.close()
    read = [(m.offset(), m.value()) for m in LedgerReader(transport).read(names.events)]
    assert read == [(2, b"committed"), (4, b"plain")]
    assert LedgerReader(transport).end_offsets(names.events) == {0: 5}


@pytest.mark.kafka
def test_every_rebalance_restarts_each_assigned_partition_at_its_committed_offset(
    transport: str, unique_prefix: str
) -> None:
    """The eager protocol (librdkafka's default assignors): a rebalance revokes every
    partition and assigns them again, and each starts at its committed offset: what
    was read past it is read again, on a partition that stayed with the member too.
    The coordinator and the participants rely on it: a batch they leave uncommitted
    across a rebalance, or a record they leave out after one, is redelivered (R15)."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 2)
    producer = create_producer(transport)
    for partition in (0, 1):
        for n in range(3):
            producer.produce(names.events, key=b"k", value=b"%d" % n, partition=partition)
    producer.flush(30)
    group = f"{unique_prefix}group"
    committed = {0: 1, 1: 2}
    # What the first member reads, each assignment opening a new list.
    reads: list[list[tuple[int, int]]] = []
    first = create_consumer(transport, group)
    first.subscribe([names.events], on_assign=lambda c, ps: reads.append([]))

    def poll_until(done: Callable[[], bool], *others: Consumer) -> None:
        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            for consumer in (first, *others):
                msg = consumer.poll(0.1)
                if consumer is first and msg is not None and not msg.error():
                    reads[-1].append((msg.partition() or 0, msg.offset() or 0))

    poll_until(lambda: bool(reads) and len(reads[-1]) == 6)
    first.commit(
        offsets=[TopicPartition(names.events, p, o) for p, o in committed.items()],
        asynchronous=False,
    )
    second = create_consumer(transport, group)
    second.subscribe([names.events])
    poll_until(lambda: len(first.assignment()) == len(second.assignment()) == 1, second)
    second.close()  # leaves the group: its partition comes back to the first member

    def by_partition() -> dict[int, list[int]]:
        return {p: [o for q, o in reads[-1] if q == p] for p in committed}

    # Each partition read again from its committed offset, the one that stayed with
    # the first member throughout as well as the one that came back.
    again = {0: [1, 2], 1: [2]}
    poll_until(lambda: len(first.assignment()) == 2 and by_partition() == again)
    first.close()
    assert by_partition() == again


@pytest.mark.kafka
def test_a_position_past_the_end_of_a_partition_starts_again_at_its_beginning(
    transport: str, unique_prefix: str
) -> None:
    """An offset past a partition's end (a committed offset from a topic deleted and
    made again, a seek to a stale position) is out of range to a broker: the consumer
    resets by ``auto.offset.reset`` (pinned ``earliest``) and reads the partition from
    its start. The in-process transport set an assigned offset to the end instead,
    and kept a committed one: it read nothing of what was there, then, for the
    committed one, nothing written after either until the log passed that offset."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    producer = create_producer(transport)
    for n in range(3):
        producer.produce(names.events, key=b"k", value=b"%d" % n)
    producer.flush(30)

    def offsets_read(consumer: Consumer, wanted: int) -> list[int]:
        read: list[int] = []
        deadline = time.monotonic() + 60
        while len(read) < wanted and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                read.append(msg.offset() or 0)
        consumer.close()
        return read

    assigned = create_consumer(transport, f"{unique_prefix}assigned")
    assigned.assign([TopicPartition(names.events, 0, 100)])
    assert offsets_read(assigned, 3) == [0, 1, 2]

    group = f"{unique_prefix}committed"
    committer = create_consumer(transport, group)
    committer.commit(offsets=[TopicPartition(names.events, 0, 100)], asynchronous=False)
    committer.close()
    member = create_consumer(transport, group)
    member.subscribe([names.events])
    assert offsets_read(member, 3) == [0, 1, 2]


@pytest.mark.kafka
def test_a_dead_letter_too_large_to_copy_whole_still_says_what_was_lost_R16(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record that fits under the producer's ``message.max.bytes`` (1,000,000 by
    default) whose DLQ copy does not (the copy adds the why and where-from headers):
    the copy that can be written names the record, its size, digest and key, and
    the operator is told."""
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None))
    value = b"\x00" + b"x" * 998_900  # fits alone, not with the DLQ headers
    writer.write(names.events, b"saga-big", value, [("h", b"1")])
    big = next(LedgerReader(kafka_bootstrap).read(names.events))
    with caplog.at_level(logging.ERROR, logger="sagaline.kafka"):
        DeadLetterWriter(writer.producer, names.dlq, acknowledged=True).write(
            big, "malformed", "not an Avro record " + "." * 1_990
        )
    writer.close()
    [copy] = list(LedgerReader(kafka_bootstrap).read(names.dlq))
    letter = read_dead_letter(copy.headers())
    assert (letter.reason, letter.source_topic, letter.partition, letter.offset) == (
        "malformed",
        names.events,
        0,
        0,
    )
    assert copy.key() == b"saga-big" and copy.value() is None
    assert letter.omitted is not None
    assert str(len(value)) in letter.omitted
    assert hashlib.sha256(value).hexdigest() in letter.omitted
    assert any(
        names.events in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


@pytest.mark.kafka
@pytest.mark.parametrize("way", ["append", "send_then"])
def test_a_record_the_topic_refuses_for_its_size_is_a_permanent_failure_not_a_retry(
    transport: str, unique_prefix: str, way: str
) -> None:
    """The client takes the record (under its ``message.max.bytes``) but the topic's
    ``max.message.bytes`` is smaller: the broker refuses it, and will every time."""
    names = TopicNames(unique_prefix)
    admin = create_admin(transport)
    [created] = admin.create_topics(
        [NewTopic(names.events, 1, 1, config={"max.message.bytes": "2000"})]
    ).values()
    created.result(30)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None), background_poll=True)
    record = example_records(saga_id="saga-" + os.urandom(4_000).hex())[0]
    reports: list[DeliveryFailed | None] = []
    reported = threading.Event()

    def on_delivered(failure: DeliveryFailed | None) -> None:
        reports.append(failure)
        reported.set()

    try:
        if way == "append":
            with pytest.raises(DeliveryFailed) as caught:
                writer.append(record)
            failure = caught.value
        else:
            writer.send_then(record, on_delivered)
            assert reported.wait(60)
            [report] = reports
            assert report is not None
            failure = report
    finally:
        writer.close()
    assert failure.too_large, failure
    assert "max.message.bytes" in str(failure) and names.events in str(failure)


def _small_topic(bootstrap: str, names: TopicNames, limit: int) -> None:
    """``names.events`` with ``max.message.bytes`` at ``limit`` (the rest as usual)."""
    admin = create_admin(bootstrap)  # kept until the topic exists
    topic = NewTopic(names.events, 1, 1, config={"max.message.bytes": str(limit)})
    [created] = admin.create_topics([topic]).values()
    created.result(30)
    ensure_topics(bootstrap, names, [], 1)


@pytest.mark.kafka
@pytest.mark.parametrize("way", ["send_then", "append", "append_async"])
def test_records_that_fit_alone_are_written_when_their_batch_is_refused_for_its_size(
    kafka_bootstrap: str, unique_prefix: str, way: str
) -> None:
    """librdkafka does not split a record batch the broker refuses as too large: every
    record in it gets MSG_SIZE_TOO_LARGE. Records of about 3 KB each, sent together on
    a topic taking 10 000 bytes, fit one by one: each is written, none is declared
    too large (a participant would dead-letter its command), and the writer goes on."""
    names = TopicNames(unique_prefix)
    _small_topic(kafka_bootstrap, names, 10_000)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None), background_poll=True)
    # Hex of random bytes: lz4 cannot shrink 20 of them under the topic's limit.
    records = [
        example_records(saga_id=f"saga-{n}-" + os.urandom(1_400).hex())[0] for n in range(20)
    ]
    failures: list[DeliveryFailed | None] = []
    try:
        if way == "send_then":
            reported = threading.Semaphore(0)

            def on_delivered(failure: DeliveryFailed | None) -> None:
                failures.append(failure)
                reported.release()

            for record in records:
                writer.send_then(record, on_delivered)
            for _ in records:
                assert reported.acquire(timeout=120)
        elif way == "append":
            waits = [writer.begin_append(record, timeout_s=120) for record in records]
            for wait in waits:
                try:
                    wait()
                    failures.append(None)
                except DeliveryFailed as exc:
                    failures.append(exc)
        else:

            async def all_of_them() -> list[BaseException | None]:
                return await asyncio.gather(
                    *(writer.append_async(r, timeout_s=120) for r in records),
                    return_exceptions=True,
                )

            for outcome in asyncio.run(all_of_them()):
                assert outcome is None or isinstance(outcome, DeliveryFailed), outcome
                failures.append(outcome)
        assert failures == [None] * len(records), [str(f) for f in failures if f][:2]
        writer.append(example_records(saga_id="saga-after")[0])
    finally:
        writer.close()
    written = {m.key() for m in LedgerReader(kafka_bootstrap).read(names.events)}
    assert {r.saga_id.encode() for r in records} <= written
    assert b"saga-after" in written


@pytest.mark.kafka
def test_a_record_over_the_topic_limit_on_its_own_is_still_too_large_after_a_batch_refusal(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """Sent again alone, a record the topic cannot take is refused again: then, and
    only then, it is too large (never retried), while its small neighbours are written."""
    names = TopicNames(unique_prefix)
    _small_topic(kafka_bootstrap, names, 10_000)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None), background_poll=True)
    big = example_records(saga_id="saga-big-" + os.urandom(6_000).hex())[0]
    small = [example_records(saga_id=f"saga-{n}-" + os.urandom(1_400).hex())[0] for n in range(5)]
    try:
        waits = [writer.begin_append(record, timeout_s=120) for record in [*small, big]]
        for wait in waits[:-1]:
            wait()
        with pytest.raises(DeliveryFailed) as caught:
            waits[-1]()
    finally:
        writer.close()
    assert caught.value.too_large, caught.value
    assert "max.message.bytes" in str(caught.value)


@pytest.mark.kafka
def test_a_dead_letter_the_dlq_topic_refuses_for_its_size_is_written_without_its_value_R16(
    transport: str, unique_prefix: str
) -> None:
    """The DLQ topic's ``max.message.bytes`` below the copy: refused by the broker,
    every time, so the copy that says what was lost is written instead (not retried)."""
    names = TopicNames(unique_prefix)
    admin = create_admin(transport)
    [created] = admin.create_topics(
        [NewTopic(names.dlq, 1, 1, config={"max.message.bytes": "3000"})]
    ).values()
    created.result(30)
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    value = os.urandom(4_000).hex().encode()  # lz4 cannot shrink it under the limit
    writer.write(names.events, b"saga-y", value)
    source = next(LedgerReader(transport).read(names.events))
    DeadLetterWriter(writer.producer, names.dlq, acknowledged=True).write(
        source, "malformed", "junk"
    )
    writer.close()
    [copy] = list(LedgerReader(transport).read(names.dlq))
    letter = read_dead_letter(copy.headers())
    assert (copy.key(), copy.value(), letter.offset) == (b"saga-y", None, 0)
    assert letter.omitted is not None and hashlib.sha256(value).hexdigest() in letter.omitted


@pytest.mark.kafka
def test_dead_letters_that_fit_alone_keep_their_value_when_their_batch_is_refused_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """DLQ copies of about 3 KB written at once (a participant's tool threads) on a DLQ
    topic taking 10 000 bytes go to the broker in one batch, refused whole: each copy
    fits alone, so each is written whole (its value kept), not as a summary."""
    names = TopicNames(unique_prefix)
    admin = create_admin(kafka_bootstrap)
    [created] = admin.create_topics(
        [NewTopic(names.dlq, 1, 1, config={"max.message.bytes": "10000"})]
    ).values()
    created.result(30)
    ensure_topics(kafka_bootstrap, names, [], 1)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None))
    values = {f"saga-{n}".encode(): os.urandom(1_400).hex().encode() for n in range(16)}
    for key, value in values.items():
        writer.write(names.events, key, value)
    sources = list(LedgerReader(kafka_bootstrap).read(names.events))
    dead_letters = writer.dead_letters(names.dlq)  # as a participant writes them
    errors: list[BaseException] = []

    def write(source: Any) -> None:
        try:
            dead_letters.write(source, "malformed", "junk")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(m,)) for m in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    writer.close()
    assert errors == []
    copies = {m.key(): m.value() for m in LedgerReader(kafka_bootstrap).read(names.dlq)}
    assert copies == values, [k for k, v in copies.items() if v is None]


@pytest.mark.kafka
def test_closing_a_subscribed_consumer_revokes_its_partitions_first(
    transport: str, unique_prefix: str
) -> None:
    """``close()`` serves ``on_revoke`` for what the member owns, as a rebalance does:
    a service's revoke handler (drain, commit) runs on shutdown too."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 2)
    revoked: list[list[int]] = []
    consumer = create_consumer(transport, f"{unique_prefix}group")
    consumer.subscribe(
        [names.events],
        on_revoke=lambda c, ps: revoked.append(sorted(tp.partition for tp in ps)),
    )
    deadline = time.monotonic() + 60
    while len(consumer.assignment()) < 2 and time.monotonic() < deadline:
        consumer.poll(0.1)
    assert len(consumer.assignment()) == 2
    consumer.close()
    assert revoked == [[0, 1]]


@pytest.mark.kafka
def test_a_new_producer_with_the_same_transactional_id_fences_the_old_one(
    transport: str, unique_prefix: str
) -> None:
    """A restarted coordinator (same instance, same transactional id) aborts what its
    predecessor left open, so the partition's committed readers go on, and the
    predecessor can commit nothing more (a zombie's batch must never count)."""
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 1)
    txid = f"{unique_prefix}tx"
    old = create_producer(transport, **{"transactional.id": txid})
    old.init_transactions(30)
    old.begin_transaction()
    old.produce(names.events, key=b"k", value=b"zombie")
    old.flush(30)
    new = create_producer(transport, **{"transactional.id": txid})
    new.init_transactions(60)
    new.begin_transaction()
    new.produce(names.events, key=b"k", value=b"new")
    new.commit_transaction(30)
    with pytest.raises(KafkaException):
        old.commit_transaction(30)
    assert [m.value() for m in LedgerReader(transport).read(names.events)] == [b"new"]


@pytest.mark.kafka
def test_closing_a_writer_fails_every_record_it_could_not_deliver(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A record still undelivered when ``close()`` gives up (here: its topic does not
    exist and auto-creation is off, so it waits for ever) is not dropped in silence:
    its callback gets a DeliveryFailed saying so, and close() reports the count."""
    names = TopicNames(unique_prefix)  # topics never created
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None), background_poll=True)
    got: list[DeliveryFailed | None] = []
    writer.append_then(example_records(saga_id="saga-c")[0], got.append)
    left = writer.close(timeout_s=1)
    assert len(got) == 1  # served before close() returns: nobody waits for ever
    assert isinstance(got[0], DeliveryFailed)
    assert got[0].topic == names.events
    assert "closed" in str(got[0]) and "saga-c" in str(got[0])
    assert left == 1


class _SlowAdmin:
    """An admin client whose topic creations are never answered (a broker that takes
    the request and does not reply within the timeout)."""

    def __init__(self, admin: Any) -> None:
        self._admin = admin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._admin, name)

    def create_topics(self, new_topics: list[NewTopic], **_: Any) -> dict[str, Any]:
        from concurrent.futures import Future

        return {t.topic: Future() for t in new_topics}


@pytest.mark.kafka
def test_a_topic_creation_that_times_out_is_a_setup_error_naming_the_topic(
    transport: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sagaline.kafka._topics as topics_module

    monkeypatch.setattr(
        topics_module, "create_admin", lambda config: _SlowAdmin(create_admin(config))
    )
    names = TopicNames(unique_prefix)
    with pytest.raises(TopicSetupError, match=re.escape(unique_prefix)) as caught:
        ensure_topics(transport, names, [], 1, timeout_s=1)
    assert "no answer" in str(caught.value)


class _UndescribedAdmin:
    """An admin client to whose principal the broker lists ``topic`` with an error
    (what a metadata request naming a topic without DESCRIBE on it returns)."""

    def __init__(self, admin: Any, topic: str, error: KafkaError) -> None:
        self._admin = admin
        self._topic = topic
        self._error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._admin, name)

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        metadata = self._admin.list_topics(*args, **kwargs)
        topics = dict(metadata.topics)
        topics[self._topic] = SimpleNamespace(topic=self._topic, partitions={}, error=self._error)
        return SimpleNamespace(topics=topics, brokers=metadata.brokers)


def test_a_topic_listed_with_a_broker_error_is_a_setup_error_naming_it_at_once(
    unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "not visible after creation" once the timeout has passed: the broker said
    why (here: no DESCRIBE on it), and no wait makes that go away. In memory: a broker
    lists a topic with such an error only to a request naming it, which the listing
    here stands in for."""
    import sagaline.kafka._topics as topics_module

    memory = f"memory://{unique_prefix.strip('.')}"
    names = TopicNames(unique_prefix)
    denied = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    monkeypatch.setattr(
        topics_module,
        "create_admin",
        lambda config: _UndescribedAdmin(create_admin(config), names.events, denied),
    )
    with pytest.raises(TopicSetupError, match=re.escape(repr(names.events))) as caught:
        ensure_topics(memory, names, [], 1, timeout_s=1)
    assert "TOPIC_AUTHORIZATION_FAILED" in str(caught.value)
    assert "not visible" not in str(caught.value)


class _HidingAdmin:
    """An admin client whose principal may not DESCRIBE ``topic``: a broker leaves it
    out of the topic listing, and refuses to create it as already existing."""

    def __init__(self, admin: Any, topic: str) -> None:
        self._admin = admin
        self._topic = topic

    def __getattr__(self, name: str) -> Any:
        return getattr(self._admin, name)

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        metadata = self._admin.list_topics(*args, **kwargs)
        topics = {k: v for k, v in metadata.topics.items() if k != self._topic}
        return SimpleNamespace(topics=topics, brokers=metadata.brokers)


def test_an_existing_topic_the_client_cannot_describe_is_named_as_such(
    unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is not "not visible after creation" with no word of why: the broker said
    it exists, so the likely cause (no DESCRIBE on it) is named with it."""
    import sagaline.kafka._topics as topics_module

    memory = f"memory://{unique_prefix.strip('.')}"
    names = TopicNames(unique_prefix)
    ensure_topics(memory, names, [], 1)
    monkeypatch.setattr(
        topics_module,
        "create_admin",
        lambda config: _HidingAdmin(create_admin(config), names.events),
    )
    with pytest.raises(TopicSetupError, match=re.escape(names.events)) as caught:
        ensure_topics(memory, names, [], 1, timeout_s=1)
    assert "exists but does not list it" in str(caught.value)
