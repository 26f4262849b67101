"""A full local queue (librdkafka's ``BufferError`` from ``produce``) is nobody's fault
and stops nothing: the batch's transaction is aborted, the consumer rewinds to the
committed offsets, and the batch is read and written again. That holds for every
record of the batch: a saga's outputs and changelog record, and also the records that
are no saga's (a DLQ record, R16) and the tombstones of expired terminal markers.
Run on both transports."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from coordinator.shell import Coordinator
from coordinator.state import MarkerKind, SagaMarker
from sagaline.kafka import LedgerReader, Producer, create_producer
from schemas.settings import Settings
from schemas.wire import read_dead_letter
from tests.coordinator_turns import append, executes, one_saga, turn_until
from tests.test_coordinator_carry import _committed

ENDED = "saga-ended"
JUNK = b"saga-junk"


class _QueueFullOnce:
    """A producer whose local queue is full for the first record ``refused`` matches."""

    def __init__(self, producer: Producer, refused: Any) -> None:
        self._producer = producer
        self._refused = refused
        self.full = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def produce(self, topic: str, **kwargs: Any) -> None:
        if self.full == 0 and self._refused(topic, kwargs):
            self.full += 1
            raise BufferError("Local: Queue full")
        self._producer.produce(topic, **kwargs)


@pytest.mark.parametrize("refused", ["dlq-record", "tombstone"])
def test_a_full_queue_for_a_record_of_no_saga_rewinds_the_batch_and_loses_nothing_R16(
    transport: str, unique_prefix: str, refused: str
) -> None:
    settings, _ledger, _first, _participant = one_saga(transport, unique_prefix, ENDED)
    # A saga that ended long ago (its marker is past terminal_memory_ms: the first
    # batch tombstones it) and a record that is no record (it goes to the DLQ).
    producer = create_producer(transport)
    marker = SagaMarker(marker=MarkerKind.TERMINAL, saga_id=ENDED, status="COMPLETED", at=1_000)
    producer.produce(settings.topics.state, key=ENDED.encode(), value=marker.to_bytes())
    producer.produce(settings.topics.events, key=JUNK, value=b"not a record")
    assert producer.flush(30) == 0

    one = Coordinator(settings, transport, instance_id="full-1", carry_ms=0, linger_ms=0)
    one._join()
    if refused == "dlq-record":
        full = _QueueFullOnce(one._producer, lambda topic, kw: topic == settings.topics.dlq)
    else:
        full = _QueueFullOnce(
            one._producer,
            lambda topic, kw: topic == settings.topics.state and kw["value"] is None,
        )
    one._producer = full  # type: ignore[assignment]

    def written() -> bool:
        if one.marker_of(ENDED) is not None or one.positions().get(0, -1) < 1:
            return False
        one._settle()
        return not one._rewind

    turn_until(one, written)
    one._consumer.close()
    assert full.full == 1, "the queue was never full"
    assert _dead_letters(settings, transport) == 1
    assert _changelog_values(settings, transport) == [marker.to_bytes(), None]
    assert _committed(settings, transport, f"{unique_prefix}sagaline-coordinator") == 1


def _dead_letters(settings: Settings, bootstrap: str) -> int:
    return sum(1 for k, _v, _h in LedgerReader(bootstrap).records(settings.topics.dlq) if k == JUNK)


def _changelog_values(settings: Settings, bootstrap: str) -> list[bytes | None]:
    return [
        v
        for k, v, _h in LedgerReader(bootstrap).records(settings.topics.state)
        if k == ENDED.encode()
    ]


@pytest.mark.kafka
def test_a_rejected_record_whose_dlq_copy_is_too_large_stops_nothing_and_is_not_lost_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    # A record on the ledger that fits under the producer's message.max.bytes but
    # whose DLQ copy (the original plus the sagaline-dlq-* headers) does not: the
    # copy the coordinator can write says what was lost, and the batch (another
    # saga's records with it) commits.
    settings, ledger, first, participant = one_saga(kafka_bootstrap, unique_prefix, "saga-next")
    junk = b"\x00" + b"j" * (999_850 - len(JUNK))  # as close to the limit as it takes
    producer = create_producer(kafka_bootstrap)
    producer.produce(settings.topics.events, key=JUNK, value=junk)
    assert producer.flush(30) == 0
    append(settings, kafka_bootstrap, ledger.started(), first)

    one = Coordinator(settings, kafka_bootstrap, instance_id="big-1", carry_ms=0, linger_ms=0)
    one._join()
    group = f"{unique_prefix}sagaline-coordinator"
    turn_until(one, lambda: _committed(settings, kafka_bootstrap, group) == 3)
    one._consumer.close()
    assert executes(settings, kafka_bootstrap, participant) == ["reserve"]
    [(_key, value, headers)] = [
        r for r in LedgerReader(kafka_bootstrap).records(settings.topics.dlq) if r[0] == JUNK
    ]
    letter = read_dead_letter(headers)
    assert (value, letter.source_topic, letter.offset) == (None, settings.topics.events, 0)
    assert letter.omitted is not None
    assert hashlib.sha256(junk).hexdigest() in letter.omitted
