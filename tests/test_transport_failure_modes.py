"""The Kafka transport under failure: topics that exist with the wrong settings, a
producer that failed for good, and what a writer reports then."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Message
from confluent_kafka.admin import NewTopic

from sagaline.kafka import (
    DeliveryFailed,
    LedgerReader,
    LedgerWriter,
    TopicSetupError,
    create_admin,
    ensure_topics,
    read_to_end,
)
from schemas.examples import example_records
from schemas.signing import Signer
from schemas.topics import TopicNames
from tests.system import wait_until


def _create(bootstrap: str, name: str, partitions: int, config: dict[str, str]) -> None:
    admin = create_admin(bootstrap)
    futures = admin.create_topics([NewTopic(name, partitions, 1, config=config)])
    futures[name].result(timeout=60)


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("topic", "given", "expected"),
    [("catalogue", "delete", "compact"), ("events", "compact", "delete")],
)
def test_an_existing_topic_with_another_cleanup_policy_is_a_setup_error_naming_both(
    kafka_bootstrap: str, unique_prefix: str, topic: str, given: str, expected: str
) -> None:
    """A topic made before the coordinator ran (a broker's auto.create.topics.enable
    on a first write, or an admin's script) with another cleanup.policy is not left
    as it is: a catalogue on ``delete`` loses every tool's contract to retention, a
    ledger on ``compact`` keeps one record per saga. ensure_topics refuses it, naming
    the topic and both policies."""
    names = TopicNames(unique_prefix)
    name = getattr(names, topic)
    _create(kafka_bootstrap, name, 1, {"cleanup.policy": given})
    with pytest.raises(TopicSetupError) as caught:
        ensure_topics(kafka_bootstrap, names, [], 1)
    text = str(caught.value)
    assert repr(name) in text and "cleanup.policy" in text
    assert f"={given}" in text and expected in text


@pytest.mark.kafka
@pytest.mark.parametrize("topic", ["state", "terminal", "catalogue"])
def test_a_compacted_topic_that_also_deletes_by_age_is_a_setup_error(
    kafka_bootstrap: str, unique_prefix: str, topic: str
) -> None:
    """``cleanup.policy=compact,delete`` has ``compact`` but still deletes whole
    segments once older than ``retention.ms`` (the broker's 7 days here): the state
    changelog of a saga in flight longer than that (awaiting an approval) is gone, and
    the coordinator, restoring from the changelog only, never knows the saga again.
    Such a topic was accepted; it is refused naming the topic, its policy and its
    ``retention.ms``."""
    names = TopicNames(unique_prefix)
    name = getattr(names, topic)
    _create(kafka_bootstrap, name, 1, {"cleanup.policy": "compact,delete"})
    with pytest.raises(TopicSetupError) as caught:
        ensure_topics(kafka_bootstrap, names, [], 1)
    text = str(caught.value)
    assert repr(name) in text and "cleanup.policy=compact,delete" in text
    assert "retention.ms=" in text


@pytest.mark.kafka
def test_a_compacted_topic_that_deletes_nothing_by_age_or_size_passes(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """``compact,delete`` with ``retention.ms=-1`` (and no ``retention.bytes``) deletes
    nothing: it keeps what compaction keeps, and is accepted."""
    names = TopicNames(unique_prefix)
    _create(
        kafka_bootstrap, names.state, 1, {"cleanup.policy": "compact,delete", "retention.ms": "-1"}
    )
    assert names.state not in ensure_topics(kafka_bootstrap, names, [], 1)


@pytest.mark.kafka
def test_existing_topics_with_the_expected_cleanup_policies_pass(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, ["p"], 1)
    assert ensure_topics(kafka_bootstrap, names, ["p"], 1) == []


@pytest.mark.kafka
def test_a_compacted_command_topic_is_still_accepted(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """docs/operating.md: a compacted command topic only means the journal is never
    pruned; it is not refused."""
    names = TopicNames(unique_prefix)
    _create(kafka_bootstrap, names.commands("p"), 1, {"cleanup.policy": "compact"})
    assert names.commands("p") not in ensure_topics(kafka_bootstrap, names, ["p"], 1)


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka this process loaded (confluent-kafka's own copy)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "librdkafka" in line}
    if len(paths) != 1:
        pytest.skip(f"librdkafka not found once in this process's maps: {paths}")
    return ctypes.CDLL(paths.pop())


def _fail_for_good(producer: Any) -> None:
    """Raise a fatal error on a real producer, as librdkafka does for an idempotent
    producer it cannot go on with (``rd_kafka_test_fatal_error``, its test hook)."""
    lib = _librdkafka()
    lib.rd_kafka_name.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_name.restype = ctypes.c_char_p
    lib.rd_kafka_test_fatal_error.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
    # confluent-kafka's handle: the object's header, then the rd_kafka_t pointer
    handle = ctypes.c_void_p.from_address(id(producer) + object.__basicsize__).value
    if not (lib.rd_kafka_name(handle) or b"").startswith(b"rdkafka#producer"):
        pytest.skip("confluent-kafka's handle layout is not the one expected")
    out_of_order_sequence = 45
    assert lib.rd_kafka_test_fatal_error(handle, out_of_order_sequence, b"a test") == 0


@pytest.mark.kafka
@pytest.mark.parametrize("polled", [False, True], ids=["own-wait", "background-poll"])
def test_a_ledger_writer_whose_producer_failed_for_good_writes_with_a_new_one(
    kafka_bootstrap: str, unique_prefix: str, polled: bool
) -> None:
    """librdkafka's fatal error leaves a producer unusable for good (every produce()
    raises _FATAL): a writer that kept it failed every later record for the rest of
    the process, a service retrying it for ever. The writer puts a new producer in
    its place, so what is written next is acknowledged, its DLQ copies too."""
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1)
    signer = Signer(None)
    writer = LedgerWriter(kafka_bootstrap, names, signer, background_poll=polled)
    first, second, third = example_records(saga_id="saga-f")[:3]
    try:
        writer.append(first)
        _fail_for_good(writer.producer)
        writer.append(second)
        if polled:
            asyncio.run(writer.append_async(third))
        else:
            writer.begin_append(third)()
        writer.write(names.dlq, b"saga-f", b"copy")
    finally:
        writer.close()
    reader = LedgerReader(kafka_bootstrap)
    assert reader.saga_records(names.events, "saga-f", signer) == [first, second, third]
    assert [v for _k, v, _h in reader.records(names.dlq)] == [b"copy"]


@pytest.mark.kafka
def test_a_record_lost_with_a_producer_that_failed_for_good_is_reported_not_written(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A record still queued when the producer fails is given up by librdkafka
    (_PURGE_QUEUE): its callback gets a DeliveryFailed that says so (the caller
    writes it again; it was not blamed on a writer being closed, which nobody did),
    and the writer goes on through a new producer."""
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1)
    # Its ledger topic does not exist (auto-creation is off): a record to it waits.
    nowhere = TopicNames(f"{unique_prefix}nowhere.")
    writer = LedgerWriter(kafka_bootstrap, nowhere, Signer(None))
    reports: list[DeliveryFailed | None] = []
    try:
        writer.send_then(example_records(saga_id="saga-g")[0], reports.append)
        _fail_for_good(writer.producer)
        writer.write(names.events, b"saga-g", b"after")
    finally:
        writer.close()
    assert len(reports) == 1 and isinstance(reports[0], DeliveryFailed)
    text = str(reports[0])
    assert "failed for good" in text and "may or may not be in the log" in text
    assert [v for _k, v, _h in LedgerReader(kafka_bootstrap).records(names.events)] == [b"after"]


class _Blip:
    """A reader's consumer on the real broker whose first poll returns what librdkafka
    hands a consumer when a broker connection drops (a broker restarting, a leader
    moving): an error event, not fatal, after which it reconnects and goes on."""

    def __init__(self, consumer: Any, error: KafkaError) -> None:
        self._consumer = consumer
        self._error: KafkaError | None = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    def poll(self, timeout: float) -> Any:
        error, self._error = self._error, None
        if error is not None:
            return Message(error=error)
        return self._consumer.poll(timeout)


@pytest.mark.kafka
@pytest.mark.parametrize("code", [KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN])
def test_read_to_end_goes_on_after_a_broker_connection_error(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """A dropped connection while the coordinator restores its state (read_to_end of
    the changelog, in its assignment callback) ended the restore with a
    KafkaException, and the coordinator with it; librdkafka reconnects by itself."""
    import sagaline.kafka._reader as reader_module

    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None))
    writer.write(names.events, b"saga-r", b"one")
    writer.write(names.events, b"saga-r", b"two")
    writer.close()
    made = reader_module._reader
    monkeypatch.setattr(reader_module, "_reader", lambda *a: _Blip(made(*a), KafkaError(code)))
    values = [m.value() for m in read_to_end(kafka_bootstrap, names.events, [0], unique_prefix)]
    assert values == [b"one", b"two"]


@pytest.mark.kafka
def test_read_to_end_still_raises_a_fatal_consumer_error(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sagaline.kafka._reader as reader_module

    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None))
    writer.write(names.events, b"saga-r", b"one")
    writer.close()
    made = reader_module._reader
    fatal = KafkaError(KafkaError.FENCED_INSTANCE_ID, "fenced", fatal=True)
    monkeypatch.setattr(reader_module, "_reader", lambda *a: _Blip(made(*a), fatal))
    with pytest.raises(KafkaException):
        list(read_to_end(kafka_bootstrap, names.events, [0], unique_prefix))


@pytest.mark.kafka
def test_closing_a_writer_whose_producer_failed_for_good_reports_what_it_held(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The fatal error met first by close(): librdkafka's flush then runs the given-up
    records' callbacks with the error pending, so they broke (SystemError) and close()
    raised it; each record must be reported as not delivered, and close() return."""
    nowhere = TopicNames(f"{unique_prefix}nowhere.")
    writer = LedgerWriter(kafka_bootstrap, nowhere, Signer(None))
    reports: list[DeliveryFailed | None] = []
    writer.send_then(example_records(saga_id="saga-c")[0], reports.append)
    _fail_for_good(writer.producer)
    writer.close()
    assert len(reports) == 1 and isinstance(reports[0], DeliveryFailed)


@pytest.mark.kafka
def test_a_partition_count_mismatch_is_refused_before_any_topic_is_created(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A process started with the wrong SAGALINE_PARTITIONS against a deployment whose
    ledger has another count was refused only after it had created the missing
    topics (a new participant's command topic) with its wrong count: once the
    operator set the count the error named, those topics were refused in turn, and
    only deleting them by hand got the process going."""
    names = TopicNames(unique_prefix)
    _create(kafka_bootstrap, names.events, 2, {"cleanup.policy": "delete"})
    # The broker lists a topic a moment after it answers its creation: not yet
    # listed, it is found only once the missing ones are made (with the wrong count).
    admin = create_admin(kafka_bootstrap)
    wait_until(lambda: names.events in admin.list_topics(timeout=30).topics, what="listed")
    with pytest.raises(TopicSetupError, match="SAGALINE_PARTITIONS=2"):
        ensure_topics(kafka_bootstrap, names, ["p"], 1)
    created = ensure_topics(kafka_bootstrap, names, ["p"], 2)
    assert names.commands("p") in created and names.events not in created


@pytest.mark.kafka
def test_co_partitioned_topics_that_disagree_with_each_other_are_named_together(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A ledger of 2 partitions and a changelog of 3: the refusal named the first
    topic found off SAGALINE_PARTITIONS and told the operator to set it to that
    topic's count, which the other topic then refused in turn, with the opposite
    advice. No setting fixes it: the error names every count and says so."""
    names = TopicNames(unique_prefix)
    _create(kafka_bootstrap, names.events, 2, {"cleanup.policy": "delete"})
    _create(kafka_bootstrap, names.state, 3, {"cleanup.policy": "compact"})
    admin = create_admin(kafka_bootstrap)
    wait_until(
        lambda: {names.events, names.state} <= set(admin.list_topics(timeout=30).topics),
        what="both topics listed",
    )
    for partitions in (1, 2, 3):
        with pytest.raises(TopicSetupError) as caught:
            ensure_topics(kafka_bootstrap, names, [], partitions)
        text = str(caught.value)
        assert f"{names.events!r} has 2" in text and f"{names.state!r} has 3" in text
        assert "SAGALINE_PARTITIONS=" not in text


class _HungThenFailed:
    """A producer whose first record went out to a broker that never answers, and
    which then failed for good (librdkafka's fatal error: every later produce()
    refused). librdkafka purges only what was still queued on a fatal error; a record
    in flight waits for its broker's answer, here for ever, until it is purged."""

    def __init__(self) -> None:
        self.in_flight: list[Any] = []
        self.given_up: list[Any] = []

    def produce(self, topic: str, key: Any = None, value: Any = None, **kw: Any) -> None:
        if self.in_flight or self.given_up:
            raise KafkaException(KafkaError(KafkaError._FATAL, "failed for good", fatal=True))
        self.in_flight.append(kw["on_delivery"])

    def __len__(self) -> int:
        return len(self.in_flight) + len(self.given_up)

    def poll(self, timeout: float = 0) -> int:
        served, self.given_up = self.given_up, []
        for callback in served:
            callback(KafkaError(KafkaError._PURGE_INFLIGHT), None)
        return len(served)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        if in_flight:
            self.given_up += self.in_flight
            self.in_flight = []


def test_a_record_in_flight_on_a_producer_that_failed_for_good_is_reported_not_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer waits a while for the failed producer's records still in flight,
    then went on with the new one: a record whose broker had not answered by then got
    no report at all, and its caller (a participant's send_then) waited for ever. It
    is given up and reported as not delivered (it may or may not be in the log)."""
    import sagaline.kafka._writers as writers

    monkeypatch.setattr(writers, "_RENEW_DRAIN_S", 0.2)
    names = TopicNames("t.")
    transport = f"memory://{uuid.uuid4().hex[:12]}"
    ensure_topics(transport, names, [], 1)
    writer = LedgerWriter(transport, names, Signer(None))
    failed = _HungThenFailed()
    writer.producer = failed  # type: ignore[assignment]
    first, second = example_records(saga_id="saga-h")[:2]
    reports: list[DeliveryFailed | None] = []
    writer.send_then(first, reports.append)
    writer.send_then(second, reports.append)  # the failure met: a new producer takes it
    writer.producer.poll(0)
    writer.close()
    replaced: Any = writer.producer
    assert replaced is not failed and len(failed) == 0
    assert len(reports) == 2 and None in reports
    [lost] = [r for r in reports if r is not None]
    assert "may or may not be in the log" in str(lost)


def test_a_record_sent_again_alone_as_its_writer_closes_gets_its_report() -> None:
    """A record whose batch was refused for its size is sent again alone on the
    writer's own thread (_Alone.deliver_then). A close() that came between its check
    of "closed" and its queueing of the record stopped that thread first: the record
    was queued behind the stop, never sent, and its callback never called (a
    participant's send_then waiting for ever). Here close() runs as soon as it can
    once deliver_then decided to queue: the callback still gets an answer."""
    from sagaline.kafka._writers import _Alone, _AloneJob

    names = TopicNames("t.")
    transport = f"memory://{uuid.uuid4().hex[:12]}"
    ensure_topics(transport, names, [], 1)
    alone = _Alone(transport)
    closing: list[threading.Thread] = []
    jobs = alone._jobs

    class _CloseOnQueue:
        """The writer's queue, calling close() the moment a record is queued."""

        def put(self, item: _AloneJob | None) -> None:
            if item is not None and not closing:
                closer = threading.Thread(target=alone.close, args=(30.0,))
                closing.append(closer)
                if alone._lock.acquire(blocking=False):  # close() can run now: it does
                    alone._lock.release()
                    closer.run()
                else:  # it waits for deliver_then to be done queueing
                    closer.start()
            jobs.put(item)

        def get(self) -> _AloneJob | None:
            return jobs.get()

    alone._jobs = _CloseOnQueue()  # type: ignore[assignment]
    reports: list[DeliveryFailed | None] = []
    reported = threading.Event()

    def then(failure: DeliveryFailed | None) -> None:
        reports.append(failure)
        reported.set()

    alone.deliver_then(names.events, b"saga-c", b"value", None, "a record", then)
    for closer in closing:
        if closer.ident is not None:
            closer.join(60)
    assert reported.wait(10), "the record's callback was never called"
    assert len(reports) == 1


@pytest.mark.kafka
def test_the_one_by_one_producer_that_failed_for_good_is_replaced_too(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The producer a ledger writer sends records of a batch refused for its size
    with, one by one (_Alone), failed for good like any other: it was kept, so every
    later resend raised librdkafka's raw KafkaException(_FATAL) out of append(), not
    a DeliveryFailed, for the rest of the process. It is replaced as the writer's own
    producer is, and the record is written through the new one."""
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [], 1)
    writer = LedgerWriter(kafka_bootstrap, names, Signer(None))
    alone = writer._alone
    try:
        failed = alone._made()
        _fail_for_good(failed)
        alone.deliver(names.events, b"saga-a", b"alone", None, "a record", 30.0)
        assert alone._producer is not failed
    finally:
        writer.close()
    assert [v for _k, v, _h in LedgerReader(kafka_bootstrap).records(names.events)] == [b"alone"]
