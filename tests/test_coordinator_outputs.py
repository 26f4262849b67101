"""A saga whose decided outputs cannot even be prepared (a command for a participant
whose name is no usable Kafka topic name, written into a ``StepScheduled`` by a buggy
or foreign client) is parked like any other poisoned saga: the coordinator does not
crash on it, which would stop every saga and crash again on the same record after each
restart. The other sagas of the batch go on. Run on both transports."""

from __future__ import annotations

import pytest
from coordinator_ledger import Ledger

from coordinator.shell import Coordinator
from coordinator.state import MarkerKind
from sagaline.kafka import LedgerReader
from schemas.settings import Settings
from schemas.wire import read_dead_letter
from tests.coordinator_turns import append, executes, one_saga, turn_until


@pytest.mark.parametrize("participant", ["bad name", "caf\u00e9", "a:b", "x" * 240])
def test_a_command_for_an_unusable_participant_name_parks_its_saga_not_the_coordinator_R16(
    transport: str, unique_prefix: str, participant: str
) -> None:
    settings, good, first, good_participant = one_saga(transport, unique_prefix, "saga-good")
    bad = Ledger(saga_id="saga-bad", t0=good.clock)
    poisoned = bad.scheduled("reserve", participant=participant)
    append(settings, transport, bad.started(), poisoned, good.started(), first)

    one = Coordinator(settings, transport, instance_id="poison-1", carry_ms=0, linger_ms=0)
    one._join()
    turn_until(
        one,
        lambda: one.marker_of("saga-bad") is not None and one.state_of("saga-good") is not None,
    )
    marker = one.marker_of("saga-bad")
    assert marker is not None and marker.marker is MarkerKind.PARKED
    assert "topic name" in marker.reason, marker.reason
    assert executes(settings, transport, good_participant) == ["reserve"]
    # Its later records are kept in the DLQ with the reason, never decided.
    # (Offsets 0-3 are the four above, then the parking's own IncidentRaised.)
    append(settings, transport, bad.end())
    turn_until(one, lambda: max(_parked_offsets(settings, transport), default=0) > 4)
    one._consumer.close()


def _parked_offsets(settings: Settings, bootstrap: str) -> set[int]:
    """Source offsets of the DLQ records of saga-bad with reason saga-parked."""
    found = set()
    for k, _v, h in LedgerReader(bootstrap).records(settings.topics.dlq):
        letter = read_dead_letter(h)
        if k == b"saga-bad" and letter.reason == "saga-parked":
            found.add(letter.offset)
    return found
