"""A command topic the coordinator cannot set up for one saga's participant (no CREATE
on it in a least-privilege deployment, or, as here, one made by hand with another
partition count than the ledger's, which would break co-partitioning) parks the
sagas that address that participant, with an incident naming the topic; it does
not stop the coordinator. Before, the ``TopicSetupError`` left the loop, the process
exited, and every restart re-read the same record and exited again: no saga was
decided any more."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from coordinator.shell import Coordinator
from coordinator.state import MarkerKind, SagaMarker
from sagaline.kafka import LedgerReader
from schemas import IncidentRaised
from schemas.settings import Settings
from tests.coordinator_ledger import Ledger
from tests.coordinator_turns import append, executes, one_saga, turn_until
from tests.test_coordinator_carry import _committed

pytestmark = pytest.mark.kafka


def _marker_once_written(
    one: Coordinator, settings: Settings, bootstrap: str, records: int, saga_id: str
) -> SagaMarker | None:
    """Turn the coordinator's loop until the first ``records`` ledger records are
    committed (all they led to written), close it: ``saga_id``'s marker then."""
    group = f"{settings.topic_prefix}sagaline-coordinator"

    def written() -> bool:
        one._settle()
        return not one._rewind and _committed(settings, bootstrap, group) == records

    try:
        turn_until(one, written)
        return one.marker_of(saga_id)
    finally:
        one._consumer.close()


def test_a_participant_whose_command_topic_cannot_be_set_up_parks_only_its_sagas_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-ok")
    broken = settings.topics.commands("broken")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(broken, 2, 1)])[broken].result(30)  # ledger: 1 partition
    other = Ledger(saga_id="saga-broken", t0=ledger.clock)
    append(
        settings,
        bootstrap,
        other.started(),
        other.scheduled("ship", participant="broken"),
        ledger.started(),
        first,
    )
    one = Coordinator(settings, bootstrap, instance_id="topic-1", carry_ms=0, linger_ms=0)
    one._join()
    marker = _marker_once_written(one, settings, bootstrap, 4, "saga-broken")
    assert executes(settings, bootstrap, participant) == ["reserve"]
    assert marker is not None and marker.marker is MarkerKind.PARKED, marker
    assert broken in marker.reason, marker.reason
    incidents = [
        r
        for r in LedgerReader(bootstrap).saga_records(
            settings.topics.events, "saga-broken", settings.signer()
        )
        if isinstance(r, IncidentRaised)
    ]
    assert [i.kind for i in incidents] == ["saga-parked"], incidents


def test_a_shared_topic_changed_after_start_does_not_park_sagas_for_a_new_participant_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The coordinator sets up a participant's command topic the first time a saga
    addresses it. That set-up checked every topic of the deployment again, and took a
    refusal of any of them for the command topic's: a shared topic whose settings
    changed after the start (here the DLQ's ``min.insync.replicas`` raised above its one
    replica; an operator lowering the ledger's during a broker outage is the same) parked
    every saga that addressed a participant this process had not addressed yet, though
    its command topic was fine. The shared topics are checked at start; here only the
    command topic is set up, and the saga's command goes out."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    from tests.system import wait_until

    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-ok")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    dlq = settings.topics.dlq
    entry = ConfigEntry("min.insync.replicas", "2", incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ConfigResource.Type.TOPIC, dlq, incremental_configs=[entry])
    admin.incremental_alter_configs([resource])[resource].result(30)

    def applied() -> bool:
        described = ConfigResource(ConfigResource.Type.TOPIC, dlq)
        entries = admin.describe_configs([described])[described].result(30)
        return bool(entries["min.insync.replicas"].value == "2")

    wait_until(applied, 30, "the DLQ's min.insync.replicas altered")
    append(settings, bootstrap, ledger.started(), first)
    one = Coordinator(settings, bootstrap, instance_id="shared-1", carry_ms=0, linger_ms=0)
    one._join()
    marker = _marker_once_written(one, settings, bootstrap, 2, "saga-ok")
    assert marker is None or marker.marker is not MarkerKind.PARKED, marker
    assert executes(settings, bootstrap, participant) == ["reserve"]
