"""A topic whose ``max.message.bytes`` an operator lowers while the coordinator runs.

The start-up check (``Coordinator._check_topic_sizes``) cannot see a change made
later. A record over the new limit is then refused by the broker inside the
coordinator's transaction: the batch must not be aborted and rewound for ever (which
stops every saga of the partition), and the record must not be lost. The coordinator
reads the topics' limits again after a transaction the broker refused for a size,
and writes what no longer fits the way the start-up limits make it: a DLQ copy too
large becomes its summary (R16), a saga whose own record is too large is parked."""

from __future__ import annotations

import os
import time

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)

from coordinator.shell import FEED_TOO_LARGE_REASON, Coordinator, _Pending
from coordinator.state import MarkerKind
from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas.settings import Settings
from schemas.wire import read_dead_letter
from tests.coordinator_ledger import Ledger
from tests.coordinator_turns import append, executes, one_saga
from tests.system import wait_until
from tests.test_coordinator_carry import _committed

pytestmark = pytest.mark.kafka

PROBE = b"size-probe"
# Loop turns a coordinator gets to write a batch the broker once refused: a failed
# transaction is retried, then committed saga by saga; far fewer turns than this.
TURNS = 40


def _lower_max_message_bytes(bootstrap: str, topic: str, limit: int) -> None:
    """Alter the topic's ``max.message.bytes`` and wait until the broker applies it
    (a probe record over it is refused; probes that got through are keyed PROBE)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry(
        "max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET
    )
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    admin.incremental_alter_configs([resource])[resource].result(30)
    producer = create_producer(bootstrap, **{"compression.type": "none"})

    def refused() -> bool:
        failed: list[KafkaError] = []
        producer.produce(
            topic,
            key=PROBE,
            value=os.urandom(limit + 1024),
            on_delivery=lambda err, _msg: failed.append(err) if err else None,
        )
        producer.flush(30)
        return bool(failed) and failed[0].code() == KafkaError.MSG_SIZE_TOO_LARGE

    wait_until(refused, 60, f"the broker to apply max.message.bytes={limit} to {topic}")


def _turn(coordinator: Coordinator, done: object) -> None:
    for _ in range(TURNS):
        try:
            coordinator._process_batch(coordinator._next_batch())
        except KafkaException as exc:  # pragma: no cover - reported below
            raise AssertionError(f"the loop raised {exc}") from exc
        if done():  # type: ignore[operator]
            return
    raise AssertionError(f"not written after {TURNS} loop turns")


def test_a_dlq_copy_over_a_limit_lowered_while_running_is_summarised_and_stops_nobody_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-ok")
    group = f"{unique_prefix}sagaline-coordinator"
    one = Coordinator(settings, bootstrap, instance_id="lowered-1", carry_ms=0, linger_ms=0)
    one._join()  # the start-up check passes: the DLQ topic takes 1 MB

    # The operator lowers the DLQ topic's limit; then a bad record of 40 kB arrives
    # (a DLQ copy of it no longer fits), then a healthy saga's records.
    _lower_max_message_bytes(bootstrap, settings.topics.dlq, 20_000)
    junk = os.urandom(40_000)  # incompressible
    producer = create_producer(bootstrap)
    producer.produce(settings.topics.events, key=b"saga-junk", value=junk)
    assert producer.flush(30) == 0
    append(settings, bootstrap, ledger.started(), first)

    def written() -> bool:
        one._settle()
        return not one._rewind and _committed(settings, bootstrap, group) == 3

    try:
        _turn(one, written)
    finally:
        one._consumer.close()
    assert executes(settings, bootstrap, participant) == ["reserve"]
    copies = [
        (k, v, read_dead_letter(h))
        for k, v, h in LedgerReader(bootstrap).records(settings.topics.dlq)
        if k != PROBE
    ]
    assert len(copies) == 1, copies
    key, value, letter = copies[0]
    assert key == b"saga-junk" and value is None
    assert letter.offset == 0 and letter.omitted is not None and "40000 bytes" in letter.omitted


def test_a_saga_whose_state_outgrows_a_changelog_limit_lowered_while_running_is_parked_alone(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The changelog's limit lowered under a saga's state: that saga is parked (its
    marker is small), its records go to the DLQ, and its neighbour's command is sent
    in the same batch; nothing is rewound for ever."""
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-ok")
    group = f"{unique_prefix}sagaline-coordinator"
    one = Coordinator(settings, bootstrap, instance_id="lowered-2", carry_ms=0, linger_ms=0)
    one._join()

    _lower_max_message_bytes(bootstrap, settings.topics.state, 20_000)
    big = Ledger(saga_id="saga-big", t0=ledger.clock)
    # 40 steps of 900 incompressible characters each, kept inline: ~50 kB of state.
    records = [big.started()] + [
        big.scheduled(f"s{n}", "reserve", args={"blob": os.urandom(450).hex()}) for n in range(40)
    ]
    append(settings, bootstrap, *records, ledger.started(), first)
    total = len(records) + 2

    def written() -> bool:
        one._settle()
        return not one._rewind and _committed(settings, bootstrap, group) == total

    try:
        _turn(one, written)
        marker = one.marker_of("saga-big")
        assert one.state_of("saga-ok") is not None
    finally:
        one._consumer.close()  # its revocation empties memory
    assert marker is not None and marker.marker is MarkerKind.PARKED, marker
    assert "max.message.bytes" in marker.reason and settings.topics.state in marker.reason
    assert "reserve" in executes(settings, bootstrap, participant)
    parked = [
        read_dead_letter(h).reason
        for k, _v, h in LedgerReader(bootstrap).records(settings.topics.dlq)
        if k == b"saga-big"
    ]
    assert parked and set(parked) == {"saga-parked"}, parked


class _Message:
    """A consumed record, as much of one as the shell reads."""

    def __init__(self, topic: str, key: bytes, value: bytes) -> None:
        self._topic, self._key, self._value = topic, key, value

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]]:
        return [("h", b"v")]

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 7


def test_a_resolution_the_lowered_incident_feed_no_longer_takes_goes_to_the_dlq() -> None:
    """The incident feed's copy of an accepted resolution over the feed's lowered limit
    would be refused in every transaction. It is dead-lettered (a summary if the DLQ's
    limit is lower still); one that fits is copied as before. Either goes with its
    saga's records."""
    transport = f"memory://{os.urandom(6).hex()}"
    settings = Settings(bootstrap=transport, topic_prefix="feed.", partitions=1)
    one = Coordinator(settings, transport, instance_id="feed-1")
    try:
        one._room[settings.topics.incidents] = 5_000
        pending = _Pending()
        events = settings.topics.events
        one._to_incident_feed(_Message(events, b"saga-a", b"r" * 4_000), "saga-a", pending)
        one._to_incident_feed(_Message(events, b"saga-b", b"r" * 6_000), "saga-b", pending)
    finally:
        one._consumer.close()
    assert pending.loose == []
    [(feed, key, _v, _h, _p)] = pending.feed["saga-a"]
    [(dlq, dead, value, headers, _p2)] = pending.feed["saga-b"]
    assert (feed, key) == (settings.topics.incidents, b"saga-a")
    assert (dlq, dead, value) == (settings.topics.dlq, b"saga-b", b"r" * 6_000)
    letter = read_dead_letter(headers)
    assert letter.reason == FEED_TOO_LARGE_REASON and "6008 bytes" in letter.detail
    assert letter.offset == 7


def test_commands_that_fit_alone_are_written_when_their_batch_is_refused_not_parked(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A participant's command topic takes 4 000 bytes per record batch, below the
    producer's batch.size (1 MB): a saga's parallel steps, about 1.3 kB of command
    each, go to the broker in one batch, which it refuses whole (librdkafka does not
    split it). Each command fits alone: all are sent, and the saga is not parked."""
    bootstrap = kafka_bootstrap
    settings = Settings(bootstrap=bootstrap, topic_prefix=unique_prefix, partitions=1)
    group = f"{unique_prefix}sagaline-coordinator"
    ledger = Ledger(saga_id="saga-fan", t0=int(time.time() * 1000))
    # Parallel steps (no dependencies) with inline args (under 1 KiB) of random hex:
    # lz4 cannot shrink them.
    steps = [
        ledger.scheduled(f"s{n}", "reserve", args={"blob": os.urandom(450).hex()}, depends_on=[])
        for n in range(8)
    ]
    participant = steps[0].contract.participant
    admin = AdminClient({"bootstrap.servers": bootstrap})
    small = NewTopic(
        settings.topics.commands(participant), 1, 1, config={"max.message.bytes": "4000"}
    )
    admin.create_topics([small])[small.topic].result(30)
    ensure_topics(bootstrap, settings.topics, [participant], 1)
    one = Coordinator(settings, bootstrap, instance_id="fan-1", carry_ms=0, linger_ms=0)
    one._join()
    append(settings, bootstrap, ledger.started(), *steps)
    total = len(steps) + 1

    def written() -> bool:
        one._settle()
        return not one._rewind and _committed(settings, bootstrap, group) == total

    try:
        _turn(one, written)
        marker = one.marker_of("saga-fan")
    finally:
        one._consumer.close()
    assert marker is None, marker
    assert sorted(executes(settings, bootstrap, participant)) == sorted(s.step_id for s in steps)
