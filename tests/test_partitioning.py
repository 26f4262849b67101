"""The local murmur2 partitioner agrees with Kafka's (co-partitioning, saga lookup)."""

from __future__ import annotations

import ctypes

import pytest

from schemas.partitioning import murmur2, partition_for


@pytest.mark.parametrize(
    ("data", "java_value"),
    [
        # Vectors from Kafka's own UtilsTest.testMurmur2.
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
        (b"", 275646681),
    ],
)
def test_murmur2_matches_java(data: bytes, java_value: int) -> None:
    assert ctypes.c_int32(murmur2(data)).value == java_value


@pytest.mark.kafka
def test_partition_for_matches_the_murmur2_random_producer(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = unique_prefix + "partitioning"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=5, replication_factor=1)])[topic].result()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    keys = [f"saga-{i}" for i in range(40)]
    for key in keys:
        producer.produce(topic, key=key.encode(), value=b"x")
    assert producer.flush(30) == 0

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": unique_prefix + "g",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    seen: dict[str, int] = {}
    try:
        for _ in range(200):
            if len(seen) == len(keys):
                break
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            seen[msg.key().decode()] = msg.partition()
    finally:
        consumer.close()
    assert len(seen) == len(keys)
    assert {k: partition_for(k, 5) for k in keys} == seen
