"""Driving the coordinator shell by hand in transport tests: records appended the way
producers write them, and loop turns until a condition holds (``run`` would hide the
carried batch from its ``until``).

Not a test module itself; imported by tests/test_coordinator_carry.py and
tests/test_coordinator_cache.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from coordinator_ledger import Ledger

from coordinator.shell import Coordinator
from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas import ExecuteStep, Record, StepScheduled
from schemas.codec import decode
from schemas.settings import Settings
from schemas.wire import to_message


def one_saga(
    transport: str, prefix: str, saga_id: str
) -> tuple[Settings, Ledger, StepScheduled, str]:
    """Topics of one partition, a saga's ledger builder, its first step (``reserve``)
    and that step's participant."""
    settings = Settings(bootstrap=transport, topic_prefix=prefix, partitions=1)
    ledger = Ledger(saga_id=saga_id, t0=int(time.time() * 1000))
    first = ledger.scheduled("reserve")
    participant = first.contract.participant
    ensure_topics(transport, settings.topics, [participant], settings.partitions)
    return settings, ledger, first, participant


BATCHES = 2_000  # a bound on loop turns, not a deadline: each turn waits <= 0.2 s


def append(settings: Settings, bootstrap: str, *records: Record) -> None:
    """Append ``records`` to the ledger, signed, and wait until all are acknowledged."""
    producer = create_producer(bootstrap)
    signer = settings.signer()
    for record in records:
        key, value, headers = to_message(record, signer)
        producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0


def turn_until(coordinator: Coordinator, done: Callable[[], bool]) -> None:
    """Turn the loop by hand until ``done()``; at most :data:`BATCHES` turns."""
    for _ in range(BATCHES):
        coordinator._process_batch(coordinator._next_batch())
        if done():
            return
    raise AssertionError("the coordinator never got there")


def executes(settings: Settings, bootstrap: str, participant: str) -> list[str]:
    """The step ids of every ExecuteStep on ``participant``'s command topic, in order."""
    found = []
    for _k, value, _h in LedgerReader(bootstrap).records(settings.topics.commands(participant)):
        record = decode(value or b"")
        if isinstance(record, ExecuteStep):
            found.append(record.step_id)
    return found
