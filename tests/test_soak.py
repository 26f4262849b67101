"""Soak: many sagas with a participant and the coordinator both killed mid-run.

Marked ``soak``. CI runs it in a bounded form (``SAGALINE_SOAK_SAGAS``, default 40);
run it long locally, e.g. ``SAGALINE_SOAK_SAGAS=1000 scripts/test.sh -m soak``.
The check is the one of the end-to-end tests: every saga terminal, and the world in
each provider's own database agrees with the receipts (R14).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_demo_e2e import assert_world_agrees_with_receipts, run

pytestmark = [pytest.mark.kafka, pytest.mark.soak]


def test_sagas_survive_repeated_process_kills_with_the_world_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str
) -> None:
    sagas = int(os.environ.get("SAGALINE_SOAK_SAGAS", "40"))
    result = run(
        tmp_path,
        monkeypatch,
        kafka_bootstrap,
        sagas=sagas,
        seed=11,
        kill_service="payments",
        kill_after=max(1, sagas // 4),
        kill_coordinator_after=max(2, sagas // 2),
        timeout_s=max(150.0, sagas * 1.5),
    )
    assert sorted(f.service for f in result.faults) == ["coordinator", "payments"]
    assert all(f.terminal_before < sagas for f in result.faults), "both kills were mid-run"
    assert result.exit_code == 0, result.violations
    assert_world_agrees_with_receipts(result)
