"""A commit whose outcome the client could not learn is asked again, never taken for an
abort. librdkafka's ``commit_transaction`` raises a *retriable* error when its timeout
runs out while the commit goes on in the background ("the application may call the
function again"): the transaction may well have committed its outputs, changelog and
offsets. Memory must then take the batch, as for any commit; treating it as aborted
rewinds to committed offsets that are already past the batch, so memory would never
see it (R5: memory is the fold of what was committed). Run on both transports."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.shell import Coordinator
from coordinator.state import StepStatus
from sagaline.kafka import KafkaError, KafkaException, Producer
from tests.coordinator_turns import append, executes, one_saga, turn_until


class _CommitOutlivesItsTimeout:
    """A producer whose first commit completes but reports librdkafka's retriable
    timeout; asked again, it reports what the commit did (it committed)."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self.timeouts = 0
        self.asked_again = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def commit_transaction(self, timeout: float) -> None:
        if self.timeouts == 0:
            self._producer.commit_transaction(timeout)
            self.timeouts += 1
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, "commit still in progress", retriable=True)
            )
        if self.asked_again == 0:
            self.asked_again += 1
            return  # the commit that continued in the background has completed
        self._producer.commit_transaction(timeout)


def test_a_commit_that_timed_out_but_went_through_is_not_taken_for_an_abort_R5(
    transport: str, unique_prefix: str
) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, "saga-slow")
    one = Coordinator(settings, transport, instance_id="slow-1", carry_ms=0)
    one._join()
    producer = _CommitOutlivesItsTimeout(one._producer)
    one._producer = producer  # type: ignore[assignment]

    def settled_at(offset: int) -> bool:
        if one._carry is not None or one.positions().get(0, -1) < offset:
            return False
        one._settle()
        return not one._rewind

    append(settings, transport, ledger.started(), first)
    # Until the commit that timed out has been dealt with (asked again, or aborted
    # and rewound) and nothing is in flight.
    turn_until(
        one,
        lambda: (
            producer.timeouts == 1
            and one._committing is None
            and one._carry is None
            and not one._rewind
        ),
    )
    assert producer.timeouts == 1
    assert executes(settings, transport, participant) == ["reserve"]
    # The batch committed (command, changelog, offsets): memory holds it too.
    state = one.state_of("saga-slow")
    assert state is not None and state.steps["reserve"].status is StepStatus.DISPATCHED

    # So the saga goes on: its step commits and the next one is dispatched, once.
    append(
        settings,
        transport,
        ledger.intent("reserve"),
        ledger.committed("reserve"),
        ledger.scheduled("charge", tool="reserve"),
    )
    turn_until(one, lambda: settled_at(5))
    assert executes(settings, transport, participant) == ["reserve", "charge"]
    one._consumer.close()


class _FlushRefused:
    """A producer whose close-time flush fails, as a fenced or failed transactional
    producer's can (seen in the drill: INVALID_TXN_STATE from ``flush`` at close)."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def flush(self, timeout: float) -> int:
        raise KafkaException(KafkaError(KafkaError._STATE, "INVALID_TXN_STATE at close"))


def test_a_flush_that_fails_at_close_neither_crashes_a_clean_stop_nor_hides_why_the_loop_ended(
    transport: str, unique_prefix: str
) -> None:
    """Everything the coordinator writes is transactional, so what a failed producer
    still holds at close was never committed: its flush failing must not turn a clean
    stop into a crash, nor replace the exception that ended the loop."""
    settings, _ledger, _first, _participant = one_saga(transport, unique_prefix, "saga-close")
    clean = Coordinator(settings, transport, instance_id="close-1", carry_ms=0)
    real_join = clean._join

    def join_then_refuse_flush(coordinator: Coordinator = clean) -> None:
        real_join()
        coordinator._producer = _FlushRefused(coordinator._producer)  # type: ignore[assignment]

    clean._join = join_then_refuse_flush  # type: ignore[method-assign]
    clean.run(until=lambda: True)  # returns: the stop was clean

    failing = Coordinator(settings, transport, instance_id="close-2", carry_ms=0)
    real_join_2 = failing._join

    def join_then_refuse_flush_2(coordinator: Coordinator = failing) -> None:
        real_join_2()
        coordinator._producer = _FlushRefused(coordinator._producer)  # type: ignore[assignment]

    def broken_batch(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("why the loop ended")

    failing._join = join_then_refuse_flush_2  # type: ignore[method-assign]
    failing._process_batch = broken_batch  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="why the loop ended"):
        failing.run()
