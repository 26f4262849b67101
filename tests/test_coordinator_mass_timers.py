"""Many sagas whose timers are overdue at once (a coordinator restored after an outage,
or a broker hiccup that put thousands of steps in RETRY_WAIT) are ticked a bounded
number per transaction. All of them in one transaction overflowed the producer's local
queue (``queue.buffering.max.messages``, 100000 by default): the batch was aborted and
rewound three times, then committed one saga per transaction, while no new record was
decided; picking the due sagas was quadratic in their number besides. Real broker: the
local queue is librdkafka's; its limit is lowered here so that a few thousand sagas do
what some tens of thousands do by default."""

from __future__ import annotations

import pytest
from coordinator_ledger import Harness, Ledger

from coordinator.shell import Coordinator, _due_headers
from coordinator.state import SagaState, StepStatus
from sagaline.kafka import KafkaException, create_producer, ensure_topics
from schemas.settings import Settings
from tests.coordinator_turns import executes

pytestmark = pytest.mark.kafka

QUEUE = 1_000
SAGAS = 2 * QUEUE  # each tick writes an ExecuteStep and a changelog record
TURNS = 400  # loop turns, not a deadline


def _retrying() -> SagaState:
    """A saga whose step failed transiently long ago: its retry timer is overdue."""
    ledger = Ledger(saga_id="template")
    h = Harness(ledger)
    h.feed(ledger.started(), ledger.scheduled("reserve"))
    h.feed(ledger.intent("reserve"), ledger.failed("reserve"))
    assert h.status("reserve") == StepStatus.RETRY_WAIT.value
    return h.s


def _overdue(one: Coordinator) -> list[str]:
    now = one._clock()
    return [
        f"retry-{n}" for n in range(SAGAS) if (one._states.due_at(f"retry-{n}") or now + 1) <= now
    ]


def test_thousands_of_overdue_timers_are_ticked_in_bounded_transactions_none_failing(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = kafka_bootstrap
    settings = Settings(bootstrap=bootstrap, topic_prefix=unique_prefix, partitions=1)
    template = _retrying()
    participant = template.steps["reserve"].contract.participant
    ensure_topics(bootstrap, settings.topics, [participant], settings.partitions)
    due = template.next_due_at()
    producer = create_producer(bootstrap)
    for n in range(SAGAS):
        state = template.model_copy(update={"saga_id": f"retry-{n}"}, deep=True)
        producer.produce(
            settings.topics.state,
            key=state.saga_id.encode(),
            value=state.to_bytes(),
            headers=_due_headers(due),
        )
    assert producer.flush(60) == 0

    monkeypatch.setenv("SAGALINE_KAFKA_QUEUE_BUFFERING_MAX_MESSAGES", str(QUEUE))
    one = Coordinator(settings, bootstrap, instance_id="timers-1", carry_ms=0, linger_ms=0)
    failures: list[str] = []
    original = one._failed

    def failed(exc: KafkaException, due: list[str]) -> None:
        failures.append(f"{exc.args[0]} ({len(due)} due sagas)")
        original(exc, due)

    monkeypatch.setattr(one, "_failed", failed)
    one._join()
    try:
        for _ in range(TURNS):
            one._process_batch(one._next_batch())
            one._settle()
            if failures or (one.in_flight == SAGAS and not _overdue(one)):
                break
    finally:
        one._consumer.close()
    assert failures == [], f"transactions failed: {failures[:3]}"
    assert len(executes(settings, bootstrap, participant)) == SAGAS
