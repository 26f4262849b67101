"""Fuzz (R16): generated and mutated records through every consumer, on the real broker.

``SAGALINE_FUZZ_RECORDS`` records per consumer (default 10,000; 2,000 with ``CI=true``,
about five minutes for the whole module at 10,000 on a busy two-core machine) from
``tests/fuzz_corpus.py`` (hypothesis: valid records, field rewrites, byte mutations,
bad signatures). For each consumer: it never crashes, every record its decoder
refuses ends in the DLQ with a reason (the coordinator and the participant runtime)
or is counted as rejected (the dashboard; the client skips it, leaving the DLQ to the
coordinator), and good records are still processed around the garbage. The pure
coordinator core decides every decodable record without raising.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from fuzz_corpus import Item, corpus

from coordinator.core import decide, tick
from coordinator.shell import Coordinator
from coordinator.state import SagaState
from participants import CompensationContext, LookupResult, compensable, tool, wrap
from participants.client import SagaClient
from participants.runtime import ParticipantRuntime
from sagaline.kafka import KafkaError, LedgerReader, Message, create_producer, ensure_topics
from schemas import (
    COMMAND_TYPES,
    CompensateStep,
    Envelope,
    ExecuteStep,
    ReconcileStep,
    Record,
    compensation_key,
    envelope_for,
    idempotency_key,
)
from schemas.examples import example_records
from schemas.settings import Settings
from schemas.signing import Signer
from schemas.wire import (
    DLQ_OFFSET,
    DLQ_PARTITION,
    DLQ_REASON,
    DLQ_TOPIC,
    from_message,
    to_message,
)
from services.dashboard.consumer import LedgerFollower
from services.dashboard.view import DashboardState
from tests.system import wait_until

pytestmark = pytest.mark.kafka

# 10,000 per consumer by default; CI (CI=true) runs a bounded 2,000 unless told.
N = int(
    os.environ.get("SAGALINE_FUZZ_RECORDS", "2000" if os.environ.get("CI") == "true" else "10000")
)
GOOD_SAGAS = 5
HMAC = b"fuzz-key"
WAIT_S = 240.0  # a generous bound for a busy two-core machine; never a timing claim


def _settings(bootstrap: str, prefix: str, state_dir: Path) -> Settings:
    return Settings(
        bootstrap=bootstrap, topic_prefix=prefix, partitions=2, hmac_key=HMAC, state_dir=state_dir
    )


def _produce(bootstrap: str, topic: str, items: list[Item]) -> list[tuple[int, int]]:
    """Produce every item; returns (partition, offset) per item, in order."""
    producer = create_producer(bootstrap, **{"linger.ms": 20})
    where: list[tuple[int, int]] = [(-1, -1)] * len(items)

    def delivered(index: int) -> object:
        def report(err: KafkaError | None, msg: Message) -> None:
            assert err is None, err
            partition, offset = msg.partition(), msg.offset()
            assert partition is not None and offset is not None
            where[index] = (partition, offset)

        return report

    for index, item in enumerate(items):
        producer.produce(
            topic,
            key=item.key,
            value=item.value,
            headers=item.headers,
            on_delivery=delivered(index),
        )
        if index % 1000 == 999:
            producer.flush(60)
    assert producer.flush(60) == 0
    return where


def _dead_letters(bootstrap: str, dlq: str, source: str) -> dict[tuple[int, int], str]:
    """(partition, offset) of each DLQ record that came from ``source`` -> its reason."""
    out: dict[tuple[int, int], str] = {}
    for _key, _value, headers in LedgerReader(bootstrap).records(dlq):
        h = {k: v for k, v in (headers or []) if isinstance(v, bytes)}
        if h.get(DLQ_TOPIC, b"").decode() != source:
            continue
        position = (int(h[DLQ_PARTITION]), int(h[DLQ_OFFSET]))
        out[position] = h.get(DLQ_REASON, b"").decode()
    return out


def _all_in_dlq(
    bootstrap: str, settings: Settings, source: str, items: list[Item], where: list[tuple[int, int]]
) -> dict[tuple[int, int], str]:
    bad = {where[i] for i, item in enumerate(items) if not item.decodable}

    def covered() -> dict[tuple[int, int], str] | None:
        letters = _dead_letters(bootstrap, settings.topics.dlq, source)
        return letters if bad <= letters.keys() else None

    letters = wait_until(
        covered, WAIT_S, f"all {len(bad)} undecodable records on {source} in the DLQ"
    )
    assert all(letters[p] for p in bad), "every dead letter says why"
    return letters


def _report(consumer: str, items: list[Item], dead: int) -> None:
    bad = sum(not i.decodable for i in items)
    print(
        f"\nfuzz {consumer}: {len(items)} records ({len(items) - bad} decodable, {bad} refused"
        f" by the decoder), {dead} in the DLQ"
    )


# ------------------------------------------------------------------ the events topic


@pytest.fixture
def events_corpus() -> list[Item]:
    return corpus(N, _signer())


def _signer() -> Signer:
    return Signer(HMAC)


def test_coordinator_core_decides_every_decodable_fuzzed_record(events_corpus: list[Item]) -> None:
    """The decision path: no record, however odd, makes ``decide`` or ``tick`` raise."""
    states: dict[str, SagaState] = {}
    decided = 0
    now = 1_700_000_000_000
    for item in events_corpus:
        if not item.decodable:
            continue
        record = from_message(item.key, item.value, item.headers, _signer())
        decision = decide(states.get(record.saga_id), record, now)
        if decision.state is not None:
            states[record.saga_id] = tick(decision.state, now + 10**9).state or decision.state
        decided += 1
        now += 1
    print(f"\nfuzz coordinator core: {decided} decodable records decided, {len(states)} sagas")
    assert decided > N // 10


@pytest.fixture
def events_system(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> Iterator[tuple[Settings, Coordinator, SagaClient, LedgerFollower, list[threading.Thread]]]:
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id=f"fuzz-{uuid.uuid4().hex[:6]}")
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    client = SagaClient(settings, kafka_bootstrap, call_timeout_s=120).start()
    follower = LedgerFollower(kafka_bootstrap, settings.topics, settings.signer(), DashboardState())
    follower.start()
    try:
        yield settings, coordinator, client, follower, [thread]
    finally:
        follower.stop()
        client.close()
        coordinator.stop()
        thread.join(30)


def _good_sagas(client: SagaClient) -> list[str]:
    done = []
    for _ in range(GOOD_SAGAS):
        with client.saga("fuzz", "tester") as saga:
            pass
        assert saga.wait(WAIT_S).status.value == "COMPLETED"
        done.append(saga.saga_id)
    return done


@pytest.mark.timeout(1200)
def test_coordinator_client_and_dashboard_survive_fuzzed_events_R16(
    kafka_bootstrap: str,
    events_corpus: list[Item],
    events_system: tuple[Settings, Coordinator, SagaClient, LedgerFollower, list[threading.Thread]],
) -> None:
    settings, _coordinator, client, follower, threads = events_system
    half = len(events_corpus) // 2
    where = _produce(kafka_bootstrap, settings.topics.events, events_corpus[:half])
    good = _good_sagas(client)  # good records go through while garbage is in the log
    where += _produce(kafka_bootstrap, settings.topics.events, events_corpus[half:])
    good += _good_sagas(client)  # and after it: the client's listener is alive too

    letters = _all_in_dlq(kafka_bootstrap, settings, settings.topics.events, events_corpus, where)
    assert all(t.is_alive() for t in threads), "the coordinator is still running"
    assert client._listener is not None and client._listener.is_alive()
    # The dashboard's equivalent rejection: counted and skipped (an empty value is a
    # tombstone to it, skipped without counting).
    refused = sum(not i.decodable and i.value is not None for i in events_corpus)
    wait_until(
        lambda: follower.rejected >= refused,
        WAIT_S,
        f"the dashboard to reject {refused} records (so far {follower.rejected})",
    )
    assert follower.rejected == refused
    assert follower._thread is not None and follower._thread.is_alive()

    def shown(saga_id: str) -> str | None:
        with follower.state.lock:
            view = follower.state.sagas.get(saga_id)
            return None if view is None else str(view.status.value)

    # The dashboard reads the terminal records on its own consumer: nothing orders it
    # after the client's wait, so wait for it to fold them before looking.
    wait_until(
        lambda: all(shown(s) in ("completed", "compensated", "escalated") for s in good),
        WAIT_S,
        "the dashboard to show every good saga ended",
    )
    for saga_id in good:
        assert shown(saga_id) == "completed"
    _report("coordinator (shell + core)", events_corpus, len(letters))
    _report("client listener", events_corpus, 0)
    _report("dashboard consumer", events_corpus, 0)
    print(f"dashboard rejected {follower.rejected}; {len(good)} good sagas completed meanwhile")


# --------------------------------------------------------------- a command topic


class Echo:
    """A participant with every kind of method a command can reach."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: dict[str, str] = {}

    @tool(description="Echo a text", lookup="find", verify="undone")
    @compensable(by="forget")
    def echo(self, text: str) -> str:
        return text

    def forget(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.done[ctx.idempotency_key] = "forgotten"

    def find(self, key: str) -> LookupResult | None:
        return None

    def undone(self, ctx: CompensationContext) -> bool:
        return True


def _echo_commands(saga_id: str) -> list[Record]:
    """Valid commands for the ``echo`` tool (the base the mutations start from)."""
    args = orjson.dumps({"text": "hello"})
    key = idempotency_key(saga_id, "s1", "echo", args)

    def env(cls: type[Record]) -> Envelope:
        return envelope_for(
            cls, saga_id=saga_id, tenant_id="default", producer="sagaline-coordinator", now=1
        )

    return [
        ExecuteStep(
            envelope=env(ExecuteStep),
            step_id="s1",
            tool="echo",
            args=args,
            idempotency_key=key,
            attempt=1,
            deadline_ms=5_000,
            principal="tester",
        ),
        CompensateStep(
            envelope=env(CompensateStep),
            step_id="s1",
            tool="echo",
            compensation="forget",
            args=args,
            result=b'"hello"',
            idempotency_key=key,
            compensation_key=compensation_key(key),
            attempt=1,
        ),
        ReconcileStep(
            envelope=env(ReconcileStep),
            step_id="s1",
            tool="echo",
            idempotency_key=key,
            attempt=1,
        ),
        *[r for r in example_records(saga_id) if not isinstance(r, COMMAND_TYPES)][:3],
    ]


@pytest.mark.timeout(1200)
def test_participant_runtime_survives_fuzzed_commands_R16(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    ensure_topics(kafka_bootstrap, settings.topics, ["echo"], settings.partitions)
    topic = settings.topics.commands("echo")
    items = corpus(N, _signer(), valid=_echo_commands)
    good = []
    for n in range(GOOD_SAGAS):
        key, value, headers = to_message(_echo_commands(f"good-{n}")[0], _signer())
        good.append(Item(key, value, list(headers), "good", True, f"good-{n}"))
    runtime = ParticipantRuntime(wrap(Echo(), name="echo"), settings, kafka_bootstrap)
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    assert ready.wait(60)
    try:
        started = time.monotonic()
        everything = items[: N // 2] + good + items[N // 2 :]
        where = _produce(kafka_bootstrap, topic, everything)
        letters = _all_in_dlq(kafka_bootstrap, settings, topic, everything, where)
        good_ids = {i.saga_id for i in good}

        def answered() -> bool:
            seen = set()
            for key, _value, _headers in LedgerReader(kafka_bootstrap).records(
                settings.topics.events
            ):
                if key is not None and key.decode() in good_ids:
                    seen.add(key.decode())
            return seen == good_ids

        wait_until(answered, WAIT_S, "an outcome for every good command")
        assert thread.is_alive(), "the runtime is still serving"
        _report("participant runtime", items, len(letters))
        print(f"participant runtime: {time.monotonic() - started:.0f} s for {len(everything)}")
    finally:
        runtime.stop()
        thread.join(30)
