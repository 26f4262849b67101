"""A rebalance that ``close()`` runs must not kill the process: an assignment that
arrives just before a service stops is handed to its on_assign inside ``close()``,
where a consumer call (``committed``) fails with ``_DESTROY``, and confluent-kafka
2.16 hands that error out of ``close()`` as a bare ``KafkaError`` that no ``except``
catches (a CI worker died of it in the coordinator's ``_on_assign``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from coordinator.shell import Coordinator
from sagaline.kafka import KafkaError, KafkaException, TopicPartition, closing_tolerated
from schemas.settings import Settings

DESTROYED = KafkaException(
    KafkaError(
        KafkaError._DESTROY,
        "Failed to get committed offsets: Local: Broker handle destroyed for termination",
    )
)


def test_a_callback_cut_short_by_close_ends_quietly(caplog: pytest.LogCaptureFixture) -> None:
    def on_assign(_consumer: Any, _partitions: list[TopicPartition]) -> None:
        raise DESTROYED

    caplog.set_level(logging.INFO, "sagaline.kafka")
    closing_tolerated(on_assign)(None, [TopicPartition("events", 3)])  # type: ignore[arg-type]
    assert "rebalance of ['events[3]'] left undone: the consumer is closing" in caplog.text


def test_any_other_failure_of_a_callback_still_raises() -> None:
    fenced = KafkaException(KafkaError(KafkaError._FENCED, "fenced"))

    def on_revoke(_consumer: Any, _partitions: list[TopicPartition]) -> None:
        raise fenced

    with pytest.raises(KafkaException) as raised:
        closing_tolerated(on_revoke)(None, [])  # type: ignore[arg-type]
    assert raised.value is fenced


class _Closing:
    """The coordinator's consumer as ``close()`` leaves it inside the rebalance it
    runs: everything works but ``committed``, which fails with ``_DESTROY``."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.callbacks: dict[str, Any] = {}

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks
        self._consumer.subscribe(topics, **callbacks)

    def committed(self, *_args: Any) -> list[TopicPartition]:
        raise DESTROYED

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def test_the_coordinators_assignment_during_close_does_not_escape_it(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    from sagaline.kafka import ensure_topics

    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="closing")
    real = coordinator._consumer
    closing = _Closing(real)
    coordinator._consumer = closing  # type: ignore[assignment]
    try:
        coordinator._join()
        closing.callbacks["on_assign"](closing, [TopicPartition(settings.topics.events, 0)])
        assert not coordinator._joined  # it serves nothing: it is closing
    finally:
        real.close()
        coordinator._producer.flush(10)
