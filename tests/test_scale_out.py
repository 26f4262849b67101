"""Scale-out under load, shown (issue 11, item 3).

The refund demo on the real broker, with its coordinator and participants as real
processes, while the group membership changes under it:

* coordinator instances: a second and a third join, the second leaves cleanly
  (SIGTERM) and the first is killed with SIGKILL, so the coordinator partitions move
  three times during the run;
* two replicas of ``payments`` with journals of their own: ``payments-b`` joins
  (partitions move to it), then the original replica is killed with SIGKILL (the
  rest move once its session times out), so a command the first replica took but
  did not commit arrives at a replica whose journal never saw it; the ledger rule of
  the participant runtime keeps every effect single.

Every saga must end, and each provider's own SQLite file must agree with the
receipts (every effect exactly once). Marked ``soak``: ``SAGALINE_SCALE_SAGAS`` sagas
(default 60; the issue's run is ``SAGALINE_SCALE_SAGAS=1000``), counts printed with
``-s`` for the issue note.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.demo import DemoFault
from tests.fault_runs import (
    counts,
    env_int,
    kill9,
    start_coordinator,
    start_replica,
    stop_cleanly,
)
from tests.test_demo_e2e import assert_world_agrees_with_receipts, run

pytestmark = [pytest.mark.kafka, pytest.mark.soak]

SAGAS = env_int("SAGALINE_SCALE_SAGAS", 60)
TIMEOUT_S = max(400.0, SAGAS * 2.0)


@pytest.mark.timeout(int(TIMEOUT_S) * 2 + 300)
def test_coordinators_and_participant_replicas_come_and_go_under_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str
) -> None:
    journal_b = tmp_path / "state" / "payments-b-journal"

    def at(fraction: float) -> int:
        return max(1, int(SAGAS * fraction))

    def both(*actions: str) -> str:
        return "; ".join(actions)

    faults = (
        DemoFault(
            at(0.15),
            "scale-out",
            lambda s: both(
                start_coordinator(s, "coordinator-2"),
                start_replica(s, "payments", "payments-b", journal_b),
            ),
        ),
        DemoFault(at(0.3), "scale-out", lambda s: start_coordinator(s, "coordinator-3")),
        DemoFault(
            at(0.45),
            "scale-in",
            lambda s: both(stop_cleanly(s, "coordinator-2"), kill9(s, "payments")),
        ),
        DemoFault(at(0.6), "crash", lambda s: kill9(s, "coordinator")),
    )
    result = run(
        tmp_path,
        monkeypatch,
        kafka_bootstrap,
        sagas=SAGAS,
        seed=11,
        concurrency=8,
        partitions=6,
        faults=faults,
        timeout_s=TIMEOUT_S,
    )
    line = counts(result)
    print("\n" + line.line("scale-out"))
    for fault in result.faults:
        print(f"  fault: {fault}")
    assert len(result.faults) == 4, [str(f) for f in result.faults]
    assert all(f.terminal_before < SAGAS for f in result.faults), "every change was mid-run"
    assert result.exit_code == 0, result.violations
    assert_world_agrees_with_receipts(result)
    assert line.terminal == SAGAS
