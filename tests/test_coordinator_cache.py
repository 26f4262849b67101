"""The shell keeps the decoded states of recently committed sagas beside their bytes
(``coordinator.shell._PackedStates``, ``decoded_states``), so that a saga's next batch
does not decode it again. The core changes a batch's states in place, so the cache
must never hold a change that did not commit: a batch takes its sagas' objects out
and only its commit puts them back. A transaction that fails after its decisions
changed a cached saga is re-read and decided again from the committed state, and
its command is sent (once). Run on both transports."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from coordinator_ledger import Harness, Ledger

import coordinator.shell as shell
from coordinator.shell import Coordinator, _PackedStates
from coordinator.state import SagaState, StepStatus
from sagaline.kafka import (
    KafkaError,
    KafkaException,
    Producer,
)
from tests.coordinator_turns import append, executes, one_saga, turn_until


def _settled_at(coordinator: Coordinator, offset: int) -> Callable[[], bool]:
    """Every record below ``offset`` decided and committed, and memory up to date."""

    def done() -> bool:
        if coordinator._carry is not None or coordinator.positions().get(0, -1) < offset:
            return False
        coordinator._settle()
        return not coordinator._rewind

    return done


def test_a_failed_transaction_leaves_nothing_of_its_decisions_in_the_decoded_cache(
    transport: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, "saga-cached")

    one = Coordinator(settings, transport, instance_id="cache-1", carry_ms=0)
    one._join()
    append(settings, transport, ledger.started(), first)
    turn_until(one, _settled_at(one, 2))
    assert executes(settings, transport, participant) == ["reserve"]
    # Committed: memory keeps the decoded object beside the bytes, and they agree.
    cached = one._states._decoded.get("saga-cached")
    assert cached is not None and cached == one.state_of("saga-cached")

    # The next transaction fails once, after the core changed the cached object in
    # place (the reserve step committed, the charge step dispatched).
    failures: list[str] = []
    real_commit = shell._commit

    def commit_once_failing(producer: Producer, offsets: Future[None]) -> float:
        if not failures:
            offsets.result()
            failures.append("injected")
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected commit timeout"))
        return real_commit(producer, offsets)

    monkeypatch.setattr(shell, "_commit", commit_once_failing)
    append(
        settings,
        transport,
        ledger.intent("reserve"),
        ledger.committed("reserve"),
        ledger.scheduled("charge", tool="reserve"),
    )
    turn_until(one, _settled_at(one, 5))
    assert failures == ["injected"]

    # Re-read from the committed offsets and decided again from the committed state:
    # the charge command is sent (once), and memory's object is what its bytes say.
    assert executes(settings, transport, participant) == ["reserve", "charge"]
    held = one.state_of("saga-cached")
    assert held is not None
    assert held.steps["reserve"].status is StepStatus.COMMITTED
    assert held.steps["charge"].status is StepStatus.DISPATCHED
    assert one._states._decoded.get("saga-cached") == held
    one._consumer.close()


def _state(saga_id: str) -> SagaState:
    ledger = Ledger(saga_id=saga_id)
    h = Harness(ledger)
    h.feed(ledger.started(), ledger.scheduled("reserve"))
    assert h.state is not None
    return h.state


def test_the_decoded_cache_is_bounded_taken_once_and_replaced_with_the_bytes() -> None:
    states = _PackedStates(decoded=2)
    a, b, c = _state("saga-a"), _state("saga-b"), _state("saga-c")
    for state in (a, b, c):
        states.put(state.saga_id, state.to_bytes(), state.next_due_at(), state)
    assert states.cached == 2  # the least recently committed (saga-a) was dropped
    assert states.take("saga-c") is c  # taken out: a batch changes it in place
    taken_again = states.take("saga-c")
    assert taken_again is not c and taken_again == c  # decoded from the bytes now
    assert states.take("saga-a") == a  # dropped from the cache, still in memory

    # New bytes replace the cached object; a state given back after that is refused
    # only if its saga is gone.
    changed = b.model_copy(deep=True)
    changed.end_reason = "changed"
    states.put("saga-b", changed.to_bytes(), changed.next_due_at())
    taken: Any = states.take("saga-b")
    assert taken is not b and taken == changed
    states.pop("saga-b")
    states.give_back("saga-b", changed)
    assert states.cached == 0 and states.take("saga-b") is None

    off = _PackedStates(decoded=0)
    off.put("saga-a", a.to_bytes(), a.next_due_at(), a)
    assert off.cached == 0 and off.take("saga-a") == a
