"""The shell keeps in-flight states as their changelog bytes plus their next timer
(``coordinator.shell._PackedStates``): a restore from the real broker stores bytes,
schedules timers from the ``sagaline-next-due`` header without decoding, still reads
records written before the header existed, honours markers, and parks a saga whose
bytes turn out unreadable when it is first needed."""

from __future__ import annotations

from coordinator_ledger import Harness, Ledger

from coordinator.shell import Coordinator, _due_headers, _Pending
from coordinator.state import MarkerKind, SagaState, terminal_marker
from sagaline.kafka import Producer, ensure_topics, producer_config
from schemas import FailureKind
from schemas.settings import Settings


def _waiting(saga_id: str) -> SagaState:
    """A saga unwinding an accepted compensation: it has a completion timer."""
    ledger = Ledger(saga_id=saga_id)
    h = Harness(ledger)
    h.feed(
        ledger.started(),
        ledger.scheduled("refund", completion_within_ms=5_000),
        ledger.committed("refund"),
        ledger.scheduled("boom"),
        ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION),
        ledger.comp_accepted("refund"),
    )
    assert h.s.next_due_at() is not None
    return h.s


def test_restore_keeps_bytes_schedules_timers_and_parks_unreadable_states_on_use(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=2)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    headed, old, ended = _waiting("saga-headed"), _waiting("saga-old"), _waiting("saga-ended")
    due = headed.next_due_at()
    assert due is not None
    producer = Producer(producer_config(kafka_bootstrap))
    records = [
        ("saga-headed", headed.to_bytes(), _due_headers(due)),
        ("saga-old", old.to_bytes(), []),  # written before the header existed
        ("saga-garbled", b'{"saga_id": 3', _due_headers(due + 1)),
        ("saga-ended", ended.to_bytes(), _due_headers(due)),
        ("saga-ended", terminal_marker(ended).to_bytes(), []),  # it ended later
    ]
    for key, value, headers in records:
        producer.produce(settings.topics.state, key=key.encode(), value=value, headers=headers)
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="packed-test")
    assert coordinator._restore(list(range(settings.partitions))) == 4

    assert coordinator.in_flight == 3  # the garbled one too: it was not decoded
    assert sorted(coordinator._timers) == sorted(
        [(due, "saga-headed"), (old.next_due_at() or 0, "saga-old"), (due + 1, "saga-garbled")]
    )
    assert coordinator.state_of("saga-headed") == headed
    assert coordinator.state_of("saga-old") == old
    marker = coordinator.marker_of("saga-ended")
    assert marker is not None and marker.marker is MarkerKind.TERMINAL
    assert coordinator.state_of("saga-ended") is None
    assert set(coordinator._due_sagas(due + 1)) == {"saga-headed", "saga-old", "saga-garbled"}

    # The garbled saga is found when it is first needed: parked, not decided, not lost.
    current = coordinator._current("saga-garbled", _Pending())
    parked = coordinator.marker_of("saga-garbled")
    assert current is parked and parked is not None and parked.marker is MarkerKind.PARKED
    assert "unreadable" in (parked.reason or "")
    assert coordinator.in_flight == 2
