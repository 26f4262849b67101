"""The contract against the real broker: every record type survives produce, consume
and decode, topics are created as designed, and bad input is dead-lettered instead of
stopping the consumer (R16)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Message, Producer
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from sagaline.kafka import consumer_config, ensure_topics, producer_config
from schemas.codec import MAGIC
from schemas.errors import CodecError
from schemas.examples import example_records
from schemas.models import COMMAND_TYPES, EVENT_TYPES, Record
from schemas.signing import Signer
from schemas.topics import TopicNames
from schemas.wire import dlq_message, from_message, read_dead_letter, to_message

pytestmark = pytest.mark.kafka

SIGNER = Signer(b"kafka-test-secret")


def _consume(
    bootstrap: str, topic: str, group: str, count: int, timeout_s: float = 30.0
) -> list[Message]:
    """Poll until ``count`` messages arrived from ``topic`` (or fail at the deadline)."""
    consumer = Consumer(consumer_config(bootstrap, group))
    consumer.subscribe([topic])
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(received) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            received.append(msg)
    finally:
        consumer.close()
    assert len(received) == count, f"got {len(received)} of {count} messages from {topic}"
    return received


def _produce(bootstrap: str, send: Callable[[Producer], None]) -> None:
    producer = Producer(producer_config(bootstrap))
    send(producer)
    assert producer.flush(30) == 0, "messages still in flight after 30 s"


def test_every_event_and_command_type_round_trips_through_the_broker(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, ["payments"], partitions=3)
    records = example_records(saga_id="saga-roundtrip")
    events = [r for r in records if isinstance(r, EVENT_TYPES)]
    commands = [r for r in records if isinstance(r, COMMAND_TYPES)]
    assert len(events) == len(EVENT_TYPES) and len(commands) == len(COMMAND_TYPES)

    def send(producer: Producer) -> None:
        for record in records:
            topic = names.commands("payments") if record in commands else names.events
            key, value, headers = to_message(record, SIGNER)
            producer.produce(topic, key=key, value=value, headers=headers)

    _produce(kafka_bootstrap, send)
    got_events = _consume(kafka_bootstrap, names.events, f"{unique_prefix}ev", len(events))
    got_commands = _consume(
        kafka_bootstrap, names.commands("payments"), f"{unique_prefix}cmd", len(commands)
    )

    decoded: list[Record] = [
        from_message(m.key(), m.value(), m.headers(), SIGNER) for m in got_events + got_commands
    ]
    # One saga id means one partition, so the broker keeps the produce order.
    assert decoded == events + commands


def test_ensure_topics_is_idempotent_and_compacts_state_and_terminal(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    created = ensure_topics(kafka_bootstrap, names, ["payments"], partitions=2)
    again = ensure_topics(kafka_bootstrap, names, ["payments"], partitions=2)

    assert names.events in created and names.state in created
    assert again == []
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    resources = [
        ConfigResource(ConfigResource.Type.TOPIC, t)
        for t in (names.events, names.state, names.terminal, names.commands("payments"))
    ]
    policies = {
        resource.name: future.result(30)["cleanup.policy"].value
        for resource, future in admin.describe_configs(resources).items()
    }
    assert policies == {
        names.events: "delete",
        names.state: "compact",
        names.terminal: "compact",
        names.commands("payments"): "delete",
    }
    topics = admin.list_topics(timeout=30).topics
    assert {len(topics[t].partitions) for t in (names.events, names.state, names.terminal)} == {2}


def test_bad_records_are_dead_lettered_and_the_consumer_keeps_going(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """Malformed bytes, an unknown fingerprint and a bad signature each produce a DLQ
    record with the original bytes and a reason; the good records around them decode."""
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], partitions=1)
    good_first, good_last = example_records(saga_id="saga-dlq")[:2]
    key, good_value, _ = to_message(good_first, SIGNER)
    unknown_fp = MAGIC + bytes.fromhex("00112233445566aa") + b"\x00"
    bad = [
        (b"not avro at all", SIGNER.headers(key, b"not avro at all")),
        (unknown_fp, SIGNER.headers(key, unknown_fp)),
        (good_value, Signer(b"some-other-secret").headers(key, good_value)),
    ]

    def send(producer: Producer) -> None:
        outgoing = [to_message(good_first, SIGNER), *[(key, v, h) for v, h in bad]]
        outgoing.append(to_message(good_last, SIGNER))
        for k, v, h in outgoing:
            producer.produce(names.events, key=k, value=v, headers=h)

    _produce(kafka_bootstrap, send)

    decoded: list[Record] = []
    dlq = Producer(producer_config(kafka_bootstrap))
    for msg in _consume(kafka_bootstrap, names.events, f"{unique_prefix}loop", 5):
        try:
            decoded.append(from_message(msg.key(), msg.value(), msg.headers(), SIGNER))
        except CodecError as exc:
            k, v, h = dlq_message(
                msg.key(),
                msg.value(),
                msg.headers(),
                exc.reason,
                str(exc),
                msg.topic(),
                msg.partition(),
                msg.offset(),
            )
            dlq.produce(names.dlq, key=k, value=v, headers=h)
    assert dlq.flush(30) == 0

    assert decoded == [good_first, good_last]
    letters = _consume(kafka_bootstrap, names.dlq, f"{unique_prefix}dlq", 3)
    assert [m.value() for m in letters] == [value for value, _ in bad]
    info = [read_dead_letter(m.headers()) for m in letters]
    assert [i.reason for i in info] == ["malformed", "unknown-fingerprint", "bad-signature"]
    assert "00112233445566aa" in info[1].detail
    assert [i.offset for i in info] == [1, 2, 3]
    assert {i.source_topic for i in info} == {names.events}


def test_a_dlq_copy_keeps_a_header_whose_value_is_null(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """``dlq_message`` dropped every header whose value is null, while the contract
    (docs/event-contract.md) says a DLQ copy keeps the headers byte-for-byte: a
    header present without a value (a flag, a tracing marker) was lost from the copy."""
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], partitions=1)
    headers = [("flag", None), ("trace", b"t-1"), ("empty", b"")]

    def send(producer: Producer) -> None:
        producer.produce(names.events, key=b"s-1", value=b"not avro", headers=headers)

    _produce(kafka_bootstrap, send)
    [msg] = _consume(kafka_bootstrap, names.events, f"{unique_prefix}loop", 1)
    copy = dlq_message(
        msg.key(), msg.value(), msg.headers(), "malformed", "x", msg.topic(), 0, msg.offset()
    )

    def send_copy(producer: Producer) -> None:
        producer.produce(names.dlq, key=copy[0], value=copy[1], headers=copy[2])

    _produce(kafka_bootstrap, send_copy)
    [letter] = _consume(kafka_bootstrap, names.dlq, f"{unique_prefix}dlq", 1)
    assert (letter.headers() or [])[:3] == headers
    assert read_dead_letter(letter.headers()).reason == "malformed"
