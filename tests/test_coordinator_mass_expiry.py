"""Many terminal markers expiring at once (an operator lowered
``SAGALINE_TERMINAL_MEMORY_MS``, or a coordinator restored a changelog full of old
markers) are tombstoned a bounded number per transaction: all of them in the next
batch's transaction overflowed the producer's local queue
(``queue.buffering.max.messages``, 100000 by default) in every attempt, so the batch
was aborted and rewound for ever and no saga was decided. Real broker: the local
queue is librdkafka's; its limit is lowered here so that a few thousand markers do
what 100000 do by default."""

from __future__ import annotations

import pytest

from coordinator.shell import Coordinator
from coordinator.state import MarkerKind, SagaMarker
from sagaline.kafka import LedgerReader, create_producer
from tests.coordinator_turns import append, executes, one_saga
from tests.test_coordinator_carry import _committed

pytestmark = pytest.mark.kafka

QUEUE = 1_000
MARKERS = 3 * QUEUE
TURNS = 200  # loop turns, not a deadline


def test_thousands_of_markers_expiring_at_once_are_tombstoned_and_stop_nobody(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-ok")
    producer = create_producer(bootstrap)
    for n in range(MARKERS):
        marker = SagaMarker(
            marker=MarkerKind.TERMINAL, saga_id=f"ended-{n}", status="COMPLETED", at=1_000 + n
        )
        producer.produce(
            settings.topics.state, key=marker.saga_id.encode(), value=marker.to_bytes()
        )
    assert producer.flush(60) == 0
    append(settings, bootstrap, ledger.started(), first)

    monkeypatch.setenv("SAGALINE_KAFKA_QUEUE_BUFFERING_MAX_MESSAGES", str(QUEUE))
    one = Coordinator(settings, bootstrap, instance_id="mass-1", carry_ms=0, linger_ms=0)
    one._join()
    group = f"{unique_prefix}sagaline-coordinator"
    try:
        for _ in range(TURNS):
            one._process_batch(one._next_batch())
            one._settle()
            if not one._markers and _committed(settings, bootstrap, group) == 2:
                break
        left = len(one._markers)
    finally:
        one._consumer.close()
    assert left == 0, f"{left} of {MARKERS} markers left after {TURNS} turns"
    assert executes(settings, bootstrap, participant) == ["reserve"]
    tombstones = sum(
        1 for _k, v, _h in LedgerReader(bootstrap).records(settings.topics.state) if v is None
    )
    assert tombstones == MARKERS
