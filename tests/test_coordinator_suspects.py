"""A saga whose records the client refused in a failed transaction is a *suspect*: the
retried batch parks it (``coordinator.shell._check_sizes``). That holds only while this
instance still owns the saga's partition: once it is revoked, the next owner decides
the saga afresh, and if the partition comes back here later, nothing failed for the
saga any more. Parking it then would need a person for nothing. Run on both
transports."""

from __future__ import annotations

from typing import Any

from coordinator.shell import Coordinator
from sagaline.kafka import KafkaError, KafkaException, Producer, TopicPartition
from tests.coordinator_turns import append, executes, one_saga, turn_until
from tests.test_coordinator_carry import _committed

SAGA = "saga-suspect"


class _RefusedOnce:
    """A producer that refuses the saga's first changelog record as too large (what
    librdkafka raises at once for a record over ``message.max.bytes``)."""

    def __init__(self, producer: Producer, topic: str) -> None:
        self._producer = producer
        self._topic = topic
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def produce(self, topic: str, **kwargs: Any) -> None:
        if self.refused == 0 and topic == self._topic and kwargs.get("key") == SAGA.encode():
            self.refused += 1
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large"))
        self._producer.produce(topic, **kwargs)


def test_a_suspect_of_a_revoked_partition_is_forgotten_and_not_parked_when_it_comes_back(
    transport: str, unique_prefix: str
) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, SAGA)
    append(settings, transport, ledger.started(), first)
    one = Coordinator(settings, transport, instance_id="suspect-1", carry_ms=0, linger_ms=0)
    one._join()
    refusing = _RefusedOnce(one._producer, settings.topics.state)
    one._producer = refusing  # type: ignore[assignment]
    turn_until(one, lambda: refusing.refused == 1)  # the batch failed, the saga a suspect
    one._settle()

    # The partition goes (another instance decides the saga afresh) and comes back.
    partition = [TopicPartition(settings.topics.events, 0)]
    one._on_revoke(one._consumer, partition)
    one._on_assign(one._consumer, partition)

    group = f"{unique_prefix}sagaline-coordinator"
    turn_until(one, lambda: _committed(settings, transport, group) == 2)
    one._settle()
    parked = one.marker_of(SAGA)  # before close(): its revocation drops the saga
    one._consumer.close()
    assert parked is None, f"parked although nothing failed for it any more: {parked}"
    assert executes(settings, transport, participant) == ["reserve"]
