"""Two replicas of a participant that share no journal (issue 11, item 3).

A command partition moves from replica A to replica B (a join, a clean leave, a
kill -9): B may receive a command A already took. B's SQLite journal has never seen
it; the ledger has. These tests hand B exactly such a command on the real broker and
count the tool's invocations in the provider itself: the journal alone would run the
tool a second time, the ledger rule must not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from participants.ledger_probe import LedgerProbe
from participants.runtime import NoMetrics, ParticipantRuntime
from sagaline.kafka import create_producer
from schemas import (
    ExecuteStep,
    StepCommitted,
    StepIntentRecorded,
    StepOutcomeUnknown,
    derived_event_id,
)
from schemas.wire import to_message
from tests.newer_version import framed_by_a_newer_version
from tests.test_participant_runtime import PARTICIPANT, Harness, _of

pytestmark = pytest.mark.kafka


class CountingMetrics(NoMetrics):
    def __init__(self) -> None:
        self.duplicates = 0

    def duplicate_prevented(self, count: int = 1) -> None:
        self.duplicates += count


class Replicas(Harness):
    """The harness's provider and topics, served by replica ``a`` then replica ``b``,
    each with a journal of its own.

    Both use one static group member id, so b takes a's partition the moment it
    joins (as a replacement host with an empty disk would); with distinct ids the
    broker holds a stopped static member's partition for its session timeout, which
    the scale-out soak exercises.
    """

    def start_replica(self, name: str) -> None:
        self.runtime = ParticipantRuntime(
            self.catalogue,
            self.settings,
            self.bootstrap,
            participant=PARTICIPANT,
            instance_id=f"{PARTICIPANT}-replica",
            state_dir=self.settings.state_dir / f"replica-{name}",
            metrics=CountingMetrics(),
        )
        self._run_runtime()

    def _run_runtime(self) -> None:
        import threading

        assert self.runtime is not None
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self.runtime.run, kwargs={"ready": ready}, daemon=True
        )
        self.thread.start()
        assert ready.wait(60), "participant replica did not start"

    def duplicates_prevented(self) -> int:
        assert self.runtime is not None and isinstance(self.runtime.metrics, CountingMetrics)
        return self.runtime.metrics.duplicates


@pytest.fixture
def replicas(kafka_bootstrap: str, unique_prefix: str, tmp_path: Path) -> Iterator[Replicas]:
    r = Replicas(kafka_bootstrap, unique_prefix, tmp_path)
    yield r
    if r.thread is not None and r.thread.is_alive():
        r.stop()


def test_a_command_done_by_one_replica_is_not_run_again_by_the_other(
    replicas: Replicas,
) -> None:
    """A finished and appended its outcome, but its offset commit was lost with the
    partition: B re-sends A's outcome (same event id) and never calls the tool."""
    command = replicas.execute("s1", {"sku": "a", "quantity": 1})
    replicas.start_replica("a")
    replicas.send(command)
    replicas.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    replicas.stop()
    assert replicas.shop.count("reserve") == 1

    # The redelivery B sees after the partition moved: on the partition before B is
    # assigned it (a record that arrives after the assignment cannot have been taken
    # by another replica, and is not probed for).
    replicas.send(command)
    replicas.start_replica("b")
    records = replicas.wait_for(lambda rs: len(_of(rs, StepCommitted)) == 2)
    committed = _of(records, StepCommitted)
    assert committed[0].event_id == committed[1].event_id, "the same outcome, re-sent"
    assert replicas.shop.count("reserve") == 1, "replica b ran the tool again"
    assert len(_of(records, StepIntentRecorded)) == 1
    assert replicas.duplicates_prevented() == 1


def _intent_of(replicas: Replicas, command: ExecuteStep) -> StepIntentRecorded:
    """The intent replica a appends for ``command`` before its tool runs."""
    return StepIntentRecorded(
        envelope=replicas._envelope(StepIntentRecorded, "unused").model_copy(
            update={
                "event_id": derived_event_id(command.event_id, "intent"),
                "causation_id": command.event_id,
                "producer": PARTICIPANT,
            }
        ),
        step_id=command.step_id,
        tool=command.tool,
        idempotency_key=command.idempotency_key,
        args_fingerprint="f" * 64,
        attempt=command.attempt,
        principal=command.principal,
    )


def test_an_intent_without_outcome_from_another_replica_is_an_unknown_outcome(
    replicas: Replicas,
) -> None:
    """A recorded the intent and was killed before it reported: the tool may have
    acted. B reports an unknown outcome (reconciled by lookup), never re-runs it."""
    command = replicas.execute("s1", {"sku": "a", "quantity": 1})
    intent = _intent_of(replicas, command)  # what replica a appended before it died
    key, value, headers = to_message(intent, replicas.settings.signer())
    replicas.producer.produce(
        replicas.settings.topics.events, key=key, value=value, headers=headers
    )
    assert replicas.producer.flush(30) == 0

    replicas.send(command)  # on the partition before B is assigned it, as above
    replicas.start_replica("b")
    records = replicas.wait_for(lambda rs: bool(_of(rs, StepOutcomeUnknown)))
    unknown = _of(records, StepOutcomeUnknown)[0]
    assert unknown.event_id == derived_event_id(command.event_id, "outcome")
    assert "another replica" in unknown.reason
    assert replicas.shop.count("reserve") == 0, "replica b ran the tool blind"
    assert not _of(records, StepCommitted)


def test_the_probe_finds_an_intent_behind_an_open_coordinator_transaction(
    replicas: Replicas,
) -> None:
    """The coordinator writes the ledger in transactions, so one is nearly always open
    on a busy partition. Replica a's intent, written after such a transaction began,
    sits past the partition's last stable offset until the coordinator commits: a
    probe that stopped there would miss it, and B would run the tool a second time."""
    topic = replicas.settings.topics.events
    coordinator = create_producer(
        replicas.bootstrap, **{"transactional.id": f"{topic}-coordinator"}
    )
    coordinator.init_transactions(30)
    coordinator.begin_transaction()
    other = replicas._envelope(StepIntentRecorded, "a coordinator output")
    key, value, headers = to_message(
        _intent_of(replicas, replicas.execute("s0", {"sku": "z", "quantity": 1})).model_copy(
            update={"envelope": other}
        ),
        replicas.settings.signer(),
    )
    coordinator.produce(topic, key=key, value=value, headers=headers)
    assert coordinator.flush(30) == 0  # on the partition, its transaction still open

    command = replicas.execute("s1", {"sku": "a", "quantity": 1})
    intent = _intent_of(replicas, command)
    key, value, headers = to_message(intent, replicas.settings.signer())
    replicas.producer.produce(topic, key=key, value=value, headers=headers)
    assert replicas.producer.flush(30) == 0

    probe = LedgerProbe(replicas.bootstrap, topic, replicas.settings.signer())
    try:
        found = probe.caused_by(command)
    finally:
        probe.close()
        coordinator.abort_transaction(30)
    assert [r.event_id for r in found] == [intent.event_id]


def test_a_command_nobody_took_runs_once_on_the_new_replica(replicas: Replicas) -> None:
    """The rule does not over-block: with nothing on the ledger, B runs the tool."""
    replicas.start_replica("b")
    replicas.send(replicas.execute("s2", {"sku": "b", "quantity": 2}))
    replicas.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    assert replicas.shop.count("reserve") == 1
    assert replicas.duplicates_prevented() == 0


def test_the_probe_retries_a_partition_error_of_its_time_lookup_instead_of_finding_nothing(
    replicas: Replicas,
) -> None:
    """offsets_for_times reports a partition's failure (a leader moving, as on the
    broker restart that also moves the group's partitions) in that partition's
    ``error``, with no offset, rather than raising. Read as "nothing written since the
    command was sent", the probe would let the new owner run a tool whose intent is
    on the ledger; it must ask again."""
    from types import SimpleNamespace

    from sagaline.kafka import KafkaError

    topic = replicas.settings.topics.events
    command = replicas.execute("s1", {"sku": "a", "quantity": 1})
    intent = _intent_of(replicas, command)
    key, value, headers = to_message(intent, replicas.settings.signer())
    replicas.producer.produce(topic, key=key, value=value, headers=headers)
    assert replicas.producer.flush(30) == 0

    probe = LedgerProbe(replicas.bootstrap, topic, replicas.settings.signer())
    consumer = probe._consumer
    failures = [KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)]

    class LeaderMoving:
        def __getattr__(self, name: str) -> Any:
            return getattr(consumer, name)

        def offsets_for_times(self, partitions: Any, timeout: float = -1) -> Any:
            found = consumer.offsets_for_times(partitions, timeout=timeout)
            if failures:
                return [
                    SimpleNamespace(
                        topic=tp.topic, partition=tp.partition, offset=-1, error=failures.pop()
                    )
                    for tp in found
                ]
            return found

    probe._consumer = cast(Any, LeaderMoving())
    try:
        found = probe.caused_by(command)
    finally:
        probe._consumer = consumer
        probe.close()
    assert failures == []
    assert [r.event_id for r in found] == [intent.event_id]


def test_the_probe_does_not_read_a_newer_replicas_intent_as_nothing(
    replicas: Replicas,
) -> None:
    """A rolling upgrade: replica a (already on a later contract version) recorded the
    intent under a schema replica b does not know, and died. The probe cannot read
    that record, so it cannot say nobody took the command: finding nothing, b would
    run the tool a second time. It must not answer (the command is tried again, never
    run blind) and say why."""
    from participants.ledger_probe import LedgerProbeError

    topic = replicas.settings.topics.events
    command = replicas.execute("s1", {"sku": "a", "quantity": 1})
    intent = _intent_of(replicas, command)
    key = intent.saga_id.encode()
    value = framed_by_a_newer_version(intent)
    signer = replicas.settings.signer()
    replicas.producer.produce(topic, key=key, value=value, headers=signer.headers(key, value))
    assert replicas.producer.flush(30) == 0

    probe = LedgerProbe(replicas.bootstrap, topic, signer)
    try:
        with pytest.raises(LedgerProbeError, match="unknown-fingerprint") as raised:
            probe.caused_by(command)
    finally:
        probe.close()
    assert value[2:10].hex() in str(raised.value)


def test_the_probe_waits_only_for_unreadable_records_its_own_participant_signed(
    replicas: Replicas, tmp_path: Path
) -> None:
    """With identities, only this participant's own key can have written a command's
    intent or outcome. A record of the saga it cannot read, signed by someone else
    (an agent on a later version, or any agent writing bytes under the saga's key),
    must not hold the command back: it would wait for ever for an upgrade that reads
    a record that is not its business. One its own identity signed still does."""
    from participants.ledger_probe import LedgerProbeError
    from schemas.trust import Role
    from tests.trust_kit import TrustKit

    kit = TrustKit(tmp_path / "trust")
    shop_kid = kit.add(PARTICIPANT, Role.PARTICIPANT)
    agent_kid = kit.add("agent-1", Role.AGENT, principals=["agent"])
    topic = replicas.settings.topics.events
    command = replicas.execute("s1", {"sku": "a", "quantity": 1})
    key = command.saga_id.encode()
    value = framed_by_a_newer_version(_intent_of(replicas, command))
    headers = kit.signed_headers(key, value, agent_kid)
    replicas.producer.produce(topic, key=key, value=value, headers=headers)
    assert replicas.producer.flush(30) == 0

    probe = LedgerProbe(replicas.bootstrap, topic, kit.signer(PARTICIPANT))
    try:
        assert probe.caused_by(command) == []
        headers = kit.signed_headers(key, value, shop_kid)
        replicas.producer.produce(topic, key=key, value=value, headers=headers)
        assert replicas.producer.flush(30) == 0
        with pytest.raises(LedgerProbeError, match="unknown-fingerprint"):
            probe.caused_by(command)
    finally:
        probe.close()


def test_the_probe_takes_no_intent_or_outcome_another_participant_signed(
    replicas: Replicas, tmp_path: Path
) -> None:
    """With identities, a participant may write intents and outcomes, but only for its
    own steps (the coordinator refuses the rest). The probe took any verified record
    with the command's causation: another participant (the mailer) that wrote an
    outcome under the event id this participant's answer gets (derived from the
    command's id, which anyone reading the ledger can compute) made a replica re-send
    it "as is" instead of running the tool, an answer the coordinator refuses, so the
    step never got one. Only this participant's own records count."""
    from schemas.trust import Role
    from tests.trust_kit import TrustKit

    kit = TrustKit(tmp_path / "trust")
    shop_kid = kit.add(PARTICIPANT, Role.PARTICIPANT)
    mailer_kid = kit.add("mailer", Role.PARTICIPANT)
    topic = replicas.settings.topics.events
    command = replicas.execute("s1", {"sku": "a", "quantity": 1})

    def as_written_by(producer: str) -> list[StepIntentRecorded | StepCommitted]:
        intent = _intent_of(replicas, command)
        intent = intent.model_copy(
            update={"envelope": intent.envelope.model_copy(update={"producer": producer})}
        )
        outcome = StepCommitted(
            envelope=intent.envelope.model_copy(
                update={
                    "event_id": derived_event_id(command.event_id, "outcome"),
                    "type": StepCommitted.TYPE,
                }
            ),
            step_id=command.step_id,
            tool=command.tool,
            idempotency_key=command.idempotency_key,
            attempt=command.attempt,
            result=b"{}",
            response_fingerprint="0" * 32,
        )
        return [intent, outcome]

    for record in as_written_by("mailer"):
        key, value, headers = kit.forged(record, mailer_kid)  # the mailer's own key
        replicas.producer.produce(topic, key=key, value=value, headers=headers)
    assert replicas.producer.flush(30) == 0

    probe = LedgerProbe(replicas.bootstrap, topic, kit.signer(PARTICIPANT))
    try:
        assert probe.caused_by(command) == []
        own = as_written_by(PARTICIPANT)
        for record in own:
            key, value, headers = kit.forged(record, shop_kid)
            replicas.producer.produce(topic, key=key, value=value, headers=headers)
        assert replicas.producer.flush(30) == 0
        assert [r.envelope.producer for r in probe.caused_by(command)] == [PARTICIPANT] * 2
    finally:
        probe.close()
