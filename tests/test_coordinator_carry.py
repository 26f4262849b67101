"""A batch that changes only state rides in the next batch's transaction
(``coordinator.shell._CARRY_S``): until then nothing of it is committed, neither its
changelog record nor its offsets, so a coordinator that dies holding it loses
nothing: its successor re-reads those records from the committed offsets and
reaches the same state, and no command is sent twice. Run on both transports."""

from __future__ import annotations

from coordinator.shell import Coordinator
from coordinator.state import SagaState
from sagaline.kafka import (
    LedgerReader,
    TopicPartition,
    create_consumer,
)
from schemas.settings import Settings
from tests.coordinator_turns import append, executes, one_saga, turn_until


def _committed(settings: Settings, bootstrap: str, group: str) -> int:
    consumer = create_consumer(bootstrap, group)
    try:
        [tp] = consumer.committed([TopicPartition(settings.topics.events, 0)], 30)
        return max(tp.offset, 0)
    finally:
        consumer.close()


def _changelog(settings: Settings, bootstrap: str, saga_id: str) -> int:
    return sum(
        1
        for k, _v, _h in LedgerReader(bootstrap).records(settings.topics.state)
        if k == saga_id.encode()
    )


def test_a_state_only_batch_commits_with_the_next_and_a_crash_before_loses_nothing(
    transport: str, unique_prefix: str
) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, "saga-carry")
    group = f"{unique_prefix}sagaline-coordinator"

    # The carried batch waits for the next one however slow this test is (the window
    # is the only clock here): an hour, not the 100 ms default.
    one = Coordinator(settings, transport, instance_id="carry-1", carry_ms=3_600_000)
    one._join()
    append(settings, transport, ledger.started())
    turn_until(one, lambda: one._carry is not None and "saga-carry" in one._carry.states)
    # Decided, not committed: no changelog record, no offset, no state in memory.
    assert _changelog(settings, transport, "saga-carry") == 0
    assert _committed(settings, transport, group) == 0
    assert one.state_of("saga-carry") is None

    append(settings, transport, first)
    turn_until(one, lambda: one._carry is None and one.state_of("saga-carry") is not None)
    # One transaction: the command, one changelog record for both batches, the offsets.
    assert executes(settings, transport, participant) == ["reserve"]
    assert _changelog(settings, transport, "saga-carry") == 1
    assert _committed(settings, transport, group) == 2

    # The participant's intent and commit change state only: carried, then the
    # coordinator dies holding them (no transaction was begun for them).
    append(settings, transport, ledger.intent("reserve"), ledger.committed("reserve"))
    turn_until(
        one,
        lambda: one._carry is not None and sum(len(s) for s in one._carry.sources.values()) == 2,
    )
    assert one._carry is not None
    held = one._carry.states["saga-carry"]
    assert isinstance(held, SagaState)
    one._consumer.close()
    assert _committed(settings, transport, group) == 2

    # Its successor re-reads both from the committed offsets: the same state, and the
    # next step is sent once, the first one not again.
    two = Coordinator(settings, transport, instance_id="carry-1", carry_ms=0)
    two._join()
    turn_until(two, lambda: two._carry is None and two.positions().get(0, -1) >= 4)
    assert two.state_of("saga-carry") == held
    append(settings, transport, ledger.scheduled("charge", tool="reserve"))
    turn_until(two, lambda: _committed(settings, transport, group) == 5)
    assert executes(settings, transport, participant) == ["reserve", "charge"]
    two._consumer.close()
