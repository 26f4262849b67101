"""A partition's new owner restores the changelog only once no transaction is open on
it. The previous owner's last transaction (its sagas' changelog records and the
offsets past their records) may still be completing when the new owner is assigned:
its commit has returned once the broker prepared it, and the commit markers reach the
partitions after that; a member that was dropped from the group mid-commit finishes
later still. A restore that read only to the last stable offset then missed those
changelog records, while the consumer (which fetches committed offsets only once they
are stable) resumed after their records: the sagas they changed went back to an older
state for good (a saga started in it was lost: its later records were refused
``unknown-saga``). Real broker: the open transaction and the stable offsets are the
broker's."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from coordinator_ledger import Harness, Ledger

from coordinator.shell import Coordinator, _due_headers
from sagaline.kafka import TopicPartition, create_consumer, create_producer, ensure_topics
from schemas.settings import Settings
from tests.coordinator_turns import append

pytestmark = pytest.mark.kafka

POLLS = 300  # a bound on polls (up to 0.2 s each), not a deadline


def test_a_restore_waits_for_the_previous_owners_last_transaction_R5(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = kafka_bootstrap
    settings = Settings(bootstrap=bootstrap, topic_prefix=unique_prefix, partitions=1)
    ledger = Ledger(saga_id="saga-handed-over", t0=int(time.time() * 1000))
    started = ledger.started()
    first = ledger.scheduled("reserve")
    records = [started, first]
    participant = first.contract.participant
    ensure_topics(bootstrap, settings.topics, [participant], settings.partitions)
    append(settings, bootstrap, *records)
    harness = Harness(ledger, now=ledger.clock)
    harness.feed(*records)
    decided = harness.s

    # The previous owner: a member of the coordinator group whose transaction holds the
    # saga's changelog record and the offsets past both records, not committed yet.
    group = f"{unique_prefix}sagaline-coordinator"
    previous = create_consumer(bootstrap, group)
    previous.subscribe([settings.topics.events])
    for _ in range(POLLS):
        previous.poll(0.2)
        if previous.assignment():
            break
    assert previous.assignment(), "the previous owner was never assigned"
    old = create_producer(bootstrap, **{"transactional.id": f"{group}-previous"})
    old.init_transactions(30)
    old.begin_transaction()
    old.produce(
        settings.topics.state,
        key=decided.saga_id.encode(),
        value=decided.to_bytes(),
        headers=_due_headers(decided.next_due_at()),
    )
    old.send_offsets_to_transaction(
        [TopicPartition(settings.topics.events, 0, len(records))],
        previous.consumer_group_metadata(),
        30,
    )
    previous.close()  # leaves the group: the partition goes to the new owner

    committed: list[threading.Thread] = []

    def commit_once() -> None:
        if not committed:
            committed.append(threading.Thread(target=old.commit_transaction, args=(30,)))
            committed[0].start()

    new = Coordinator(settings, bootstrap, instance_id="new-owner", carry_ms=0, linger_ms=0)
    restore = new._restore

    def restoring(numbers: list[int]) -> int:
        # The previous owner's commit completes once the restore has begun: after the
        # restore has read the changelog (before the fix), or while it waits for the
        # open transaction (the fix's wait, which this wraps).
        try:
            return restore(numbers)
        finally:
            commit_once()

    wait = getattr(new, "_await_stable_changelog", None)

    def waiting(*args: Any) -> Any:
        commit_once()
        assert wait is not None
        return wait(*args)

    monkeypatch.setattr(new, "_restore", restoring)
    if wait is not None:
        monkeypatch.setattr(new, "_await_stable_changelog", waiting)
    new._join()
    try:
        for _ in range(POLLS):
            new._process_batch(new._next_batch())
            if new._assigned:
                break
        assert new._assigned == {0}
        committed[0].join(60)
        state = new.state_of(decided.saga_id)
    finally:
        new._consumer.close()
    assert state == decided, "the restore missed the previous owner's last transaction"
