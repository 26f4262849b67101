"""Produce one record of every type through the real broker and read it back.

``python -m services.smoke`` -- the interim main command until the demo exists. It
uses :meth:`Settings.from_env` (``KAFKA_BOOTSTRAP_SERVERS`` or the project's local
broker), creates topics under a fresh prefix so runs never see each other's records,
sends every event to the events topic and every command to a participant's command
topic (signed when ``SAGALINE_HMAC_KEY`` is set), consumes them, decodes them, and
compares each with what was sent, then deletes the run's topics. Exit status 0 when
all round-tripped, else 1.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from sagaline.kafka import create_admin, create_consumer, create_producer, ensure_topics
from schemas.errors import CodecError
from schemas.examples import example_records
from schemas.models import COMMAND_TYPES, Record
from schemas.settings import Settings
from schemas.topics import TopicNames
from schemas.wire import from_message, to_message
from services._args import seconds

PARTICIPANT = "smoke"


def _bootstrap(settings: Settings) -> str:
    if settings.bootstrap:
        return settings.bootstrap
    from services.broker import resolve_bootstrap

    return resolve_bootstrap()


def _delete_topics(bootstrap: str, names: TopicNames) -> None:
    """Remove this run's topics so repeated smoke runs do not pile up on the broker."""
    admin = create_admin(bootstrap)
    topics = [t for t in admin.list_topics(timeout=10).topics if t.startswith(names.prefix)]
    for future in admin.delete_topics(topics, operation_timeout=30).values():
        future.result(30)


def run(timeout_s: float = 60.0, keep_topics: bool = False) -> int:
    """Round-trip every record type; print one line per type and a summary."""
    settings = Settings.from_env()
    bootstrap = _bootstrap(settings)
    signer = settings.signer()
    run_id = uuid.uuid4().hex[:8]
    names = TopicNames(f"{settings.topic_prefix}smoke-{run_id}.")
    ensure_topics(bootstrap, names, [PARTICIPANT], partitions=settings.partitions)
    print(f"smoke: broker {bootstrap}, topics {names.prefix}*, signing {signer.enabled}")

    sent = example_records(saga_id=f"smoke-{run_id}")
    producer = create_producer(bootstrap)
    topics: dict[str, str] = {}
    for record in sent:
        topic = names.commands(PARTICIPANT) if isinstance(record, COMMAND_TYPES) else names.events
        topics[record.event_id] = topic
        key, value, headers = to_message(record, signer)
        producer.produce(topic, key=key, value=value, headers=headers)
    if producer.flush(timeout_s) != 0:
        print("smoke: FAILED, records still unacknowledged by the broker", file=sys.stderr)
        return 1

    received: dict[str, Record] = {}
    problems: list[str] = []
    consumer = create_consumer(bootstrap, f"{names.prefix}smoke")
    consumer.subscribe([names.events, names.commands(PARTICIPANT)])
    deadline = time.monotonic() + timeout_s
    try:
        while len(received) + len(problems) < len(sent) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                problems.append(f"consumer error: {msg.error()}")
                continue
            try:
                record = from_message(msg.key(), msg.value(), msg.headers(), signer)
            except CodecError as exc:
                problems.append(f"{exc.reason}: {exc}")
                continue
            received[record.event_id] = record
    finally:
        consumer.close()

    if not keep_topics:
        _delete_topics(bootstrap, names)

    ok = 0
    for record in sent:
        got = received.get(record.event_id)
        status = "ok" if got == record else ("MISSING" if got is None else "DIFFERENT")
        ok += status == "ok"
        print(f"  {record.TYPE:<22} {topics[record.event_id]:<45} {status}")
    for problem in problems:
        print(f"  problem: {problem}")
    print(f"smoke: {ok}/{len(sent)} records round-tripped")
    return 0 if ok == len(sent) and not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.smoke", description=__doc__)
    parser.add_argument("--timeout", type=seconds, default=60.0, help="seconds to wait")
    parser.add_argument("--keep-topics", action="store_true", help="leave the run's topics")
    args = parser.parse_args(argv)
    return run(args.timeout, keep_topics=args.keep_topics)


if __name__ == "__main__":
    raise SystemExit(main())
