"""SAGALINE_MAX_PARTICIPANTS bounds the command topics a coordinator creates: a buggy
or forged writer naming thousands of made-up participants made the coordinator
create a topic (and a ``sagaline_commands_emitted_total{participant}`` series) for
each. Past the limit, a saga whose step names a participant with no command topic
yet is parked with a reason naming the setting; participants whose topics exist
(listed at start, or made since by the participant itself) are always served, and
the other sagas go on."""

from __future__ import annotations

import dataclasses

import pytest
from confluent_kafka.admin import AdminClient

from coordinator.shell import Coordinator
from coordinator.state import MarkerKind
from sagaline.kafka import ensure_topics
from sagaline.ops.metrics import SagalineMetrics
from schemas.limits import Limits
from tests.coordinator_ledger import Ledger
from tests.coordinator_turns import append, executes, one_saga
from tests.test_coordinator_command_topic import _marker_once_written

pytestmark = pytest.mark.kafka


def test_past_max_participants_a_made_up_participant_parks_its_saga_not_a_new_topic_R16(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-ok")
    settings = dataclasses.replace(settings, limits=Limits(max_participants=2))
    # Two command topics exist at start: the limit is reached before any is made.
    ensure_topics(bootstrap, settings.topics, ["known"], settings.partitions)
    metrics = SagalineMetrics("coordinator")
    one = Coordinator(
        settings, bootstrap, instance_id="cap-1", carry_ms=0, linger_ms=0, metrics=metrics
    )
    one._join()
    # A participant started after the coordinator makes its own topic: still served.
    ensure_topics(bootstrap, settings.topics, ["late"], settings.partitions)
    forged = Ledger(saga_id="saga-forged", t0=ledger.clock)
    known = Ledger(saga_id="saga-known", t0=ledger.clock)
    late = Ledger(saga_id="saga-late", t0=ledger.clock)
    append(
        settings,
        bootstrap,
        forged.started(),
        forged.scheduled("ship", participant="made-up-1"),
        ledger.started(),
        first,
        known.started(),
        known.scheduled("pack", participant="known"),
        late.started(),
        late.scheduled("post", participant="late"),
    )
    marker = _marker_once_written(one, settings, bootstrap, 8, "saga-forged")
    made_up = settings.topics.commands("made-up-1")
    topics = set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics)
    assert made_up not in topics, f"{made_up} was created"
    assert marker is not None and marker.marker is MarkerKind.PARKED, marker
    assert "SAGALINE_MAX_PARTICIPANTS=2" in marker.reason, marker.reason
    assert executes(settings, bootstrap, participant) == ["reserve"]
    assert executes(settings, bootstrap, "known") == ["pack"]
    assert executes(settings, bootstrap, "late") == ["post"]
    labels = {
        s.labels["participant"]
        for m in metrics.registry.collect()
        if m.name == "sagaline_commands_emitted"
        for s in m.samples
    }
    assert labels == {participant, "known", "late"}, labels
