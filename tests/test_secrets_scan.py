"""No secret a test used ever reaches a topic in clear (issue 12).

Run it after the suite and the demo (``pytest -m secretscan``, last): it reads every
partition of every topic on the broker from the beginning, committed or not (an
aborted transaction still put its bytes on disk), and searches keys, values and
headers for the secret values the tests and the demo use, plus anything that looks
like a PEM private key. A hit names the topic, partition and offset.
"""

from __future__ import annotations

import os
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from sagaline.kafka import readable_headers

pytestmark = [pytest.mark.kafka, pytest.mark.secretscan]

SECRET_VALUES: tuple[bytes, ...] = (
    # card numbers the tests seal or redact (tests/test_saga_client.py, test_sealing.py, ...)
    b"4111111111111111",
    b"4111 1111 1111 1111",
    # the sealing keys tests and the demo share between agent and participants
    b"agent and desk share this",
    b"shared secret",
    # signing keys (HMAC): never on a topic, not even in a header
    b"sagaline-demo-signing-key",
    b"dashboard-test-key",
    # dashboard passwords (tests/test_dashboard_*.py)
    b"alice-has-a-long-password",
    b"pw-of-alice-123",
    # any Ed25519 (or other) private key in PEM form
    b"PRIVATE KEY-----",
)


def _every_partition(bootstrap: str) -> list[TopicPartition]:
    """Every partition, or only the topics under ``SAGALINE_SECRET_SCAN_PREFIX`` (one
    demo run's topics on a long-lived broker, say)."""
    prefix = os.environ.get("SAGALINE_SECRET_SCAN_PREFIX", "")
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=60)
    return [
        TopicPartition(name, number, OFFSET_BEGINNING)
        for name, topic in metadata.topics.items()
        if not name.startswith("__")  # the broker's own offsets and transaction logs
        and name.startswith(prefix)
        for number in topic.partitions
    ]


@pytest.mark.timeout(1800)  # a long-lived broker can hold thousands of topics
def test_no_topic_holds_a_secret_value_in_clear(kafka_bootstrap: str) -> None:
    partitions = _every_partition(kafka_bootstrap)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"secret-scan-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_uncommitted",
        }
    )
    hits: list[str] = []
    scanned = 0
    try:
        consumer.assign(partitions)
        remaining = {(tp.topic, tp.partition) for tp in partitions}
        while remaining:
            for msg in consumer.consume(1000, 5.0):
                err = msg.error()
                if err is not None:
                    if err.code() in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                        remaining.discard((msg.topic() or "", msg.partition() or 0))
                        continue
                    raise AssertionError(f"scan failed: {err}")
                scanned += 1
                # Never msg.headers(): a header name that is not UTF-8 (tests write some)
                # crashes the interpreter (sagaline.kafka.headers_of says why).
                blob = b"\x00".join(
                    [msg.key() or b"", msg.value() or b""]
                    + [
                        v.encode() if isinstance(v, str) else v or b""
                        for _n, v in (readable_headers(msg) or [])
                    ]
                )
                for secret in SECRET_VALUES:
                    if secret in blob:
                        hits.append(
                            f"{secret.decode()!r} in {msg.topic()}[{msg.partition()}]"
                            f"@{msg.offset()}"
                        )
    finally:
        consumer.close()
    assert scanned > 0, "nothing on the broker to scan: run the suite and the demo first"
    print(f"secret scan: {scanned} records on {len(partitions)} partitions, {len(hits)} hits")
    assert hits == [], f"{len(hits)} secret value(s) on topics in clear: {hits[:20]}"
