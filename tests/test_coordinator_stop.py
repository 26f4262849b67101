"""What a clean stop of the coordinator does to its consumer group, as
docs/operating.md tells operators. The coordinator is a static member
(``group.instance.id``, so a restart takes its partitions back at once): librdkafka
sends no LeaveGroup for a static member when it closes, so a stopped coordinator keeps
its partitions until its session times out. The docs said it "leaves the group",
which an operator scaling down took to mean its sagas move on at once. Real broker:
the group is the broker's."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.shell import Coordinator
from sagaline.kafka import create_admin, describe_group
from tests.coordinator_turns import append, executes, one_saga

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[1]


def test_a_coordinator_stopped_cleanly_keeps_its_partitions_until_its_session_times_out(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-stop")
    append(settings, bootstrap, ledger.started(), first)
    one = Coordinator(settings, bootstrap, instance_id="stop-1", carry_ms=0, linger_ms=0)
    one.run(until=lambda: executes(settings, bootstrap, participant) == ["reserve"])

    admin = create_admin(bootstrap)
    info = describe_group(admin, f"{unique_prefix}sagaline-coordinator")
    assert info.members == 1, "the stopped coordinator left its group"

    text = (ROOT / "docs" / "operating.md").read_text()
    stop = text.split("All of them stop cleanly on SIGTERM", 1)[1].split("\n\n", 1)[0]
    assert "leaves the group" not in stop, stop
    assert "session.timeout.ms" in stop, stop
