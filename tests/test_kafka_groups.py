"""``sagaline.kafka.describe_group``: a group's state and its members' partitions, on
both transports, read without the admin call that can abort the process in
librdkafka 2.16 (see ``sagaline/kafka/_groups.py``)."""

from __future__ import annotations

import struct

import pytest

from sagaline.kafka import (
    KafkaException,
    create_admin,
    create_consumer,
    describe_group,
    ensure_topics,
)
from sagaline.kafka._groups import _assignment
from schemas.topics import TopicNames

pytestmark = pytest.mark.kafka


def test_a_joined_group_is_stable_with_each_partition_owned_and_an_unknown_one_is_dead(
    transport: str, unique_prefix: str
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(transport, names, [], 3)
    topic, group = names.events, f"{unique_prefix}groups-g"
    admin = create_admin(transport)
    consumer = create_consumer(transport, group)
    consumer.subscribe([topic])
    try:
        info = describe_group(admin, group)
        while info.state != "STABLE" or info.owned(topic) != {0, 1, 2}:
            consumer.poll(0.2)  # joins, then is assigned; the broker says when
            info = describe_group(admin, group)
        assert info.members == 1
        assert info.owned(f"{topic}.other") == set()
    finally:
        consumer.close()

    unknown = describe_group(admin, f"{unique_prefix}nobody")
    assert (unknown.state, unknown.members) == ("DEAD", 0)


def test_an_assignment_that_does_not_decode_is_a_clear_error() -> None:
    one_topic = struct.pack(">hih", 0, 1, 3) + b"abc" + struct.pack(">iii", 2, 0, 1)
    assert _assignment(one_topic) == {("abc", 0), ("abc", 1)}
    assert _assignment(b"") == frozenset()
    with pytest.raises(KafkaException, match="cannot decode a group assignment"):
        _assignment(one_topic[:-3])
