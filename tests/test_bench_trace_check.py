"""``bench/e2e.py`` checks every saga's trace against the tools' own SQLite files:
a benchmark whose traces are wrong must say so. These feed the check tool state
written by hand (no broker, no processes), right and wrong, and see what it flags.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.e2e import TOOLS, SagaRun, _ToolStore, check_traces

Effect = tuple[str, str, int, int, int, int | None]  # key, saga, calls, comps, done, comp at


def _tool_state(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    rows: dict[str, list[Effect]],
    rejected: Sequence[str] = (),
) -> Path:
    monkeypatch.setenv("E2E_TOOL_DIR", str(tmp_path))
    for name in TOOLS:
        _ToolStore(name)  # the tables, as the tools create them
        db = sqlite3.connect(str(tmp_path / f"tool-{name}.sqlite"), isolation_level=None)
        db.executemany(
            "INSERT INTO effects (key, saga_id, calls, compensations, done_ns, compensated_ns) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            rows.get(name, []),
        )
        if name == TOOLS[2]:
            db.executemany(
                "INSERT INTO rejections VALUES (?, ?, ?)", [(s, f"k3-{s}", 1) for s in rejected]
            )
        db.close()
    return tmp_path


def _run(saga_id: str, status: str) -> SagaRun:
    return SagaRun(saga_id, 0.0, 1.0, status)


def _compensated(saga: str) -> dict[str, list[Effect]]:
    """A right reject trace: steps 1 and 2 made once, step 2 undone, then step 1."""
    return {
        TOOLS[0]: [(f"k1-{saga}", saga, 1, 1, 10, 40)],
        TOOLS[1]: [(f"k2-{saga}", saga, 1, 1, 20, 30)],
    }


def test_a_right_reject_trace_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool_dir = _tool_state(tmp_path, monkeypatch, _compensated("s1"), rejected=["s1"])

    assert check_traces([_run("s1", "COMPENSATED")], "reject", tool_dir) == []


@pytest.mark.parametrize(
    ("change", "flagged"),
    [
        ({TOOLS[0]: [("k1-s1", "s1", 2, 1, 10, 40)]}, "e2e_reserve ran 2 times"),
        ({TOOLS[1]: [("k2-s1", "s1", 1, 2, 20, 30)]}, "compensations 2 (step 2)"),
        ({TOOLS[1]: [("k2-s1", "s1", 1, 1, 20, 50)]}, "step 1 compensated before step 2"),
        ({TOOLS[1]: []}, "e2e_charge has no effect"),
        ({TOOLS[2]: [("k3-s1", "s1", 1, 0, 25, None)]}, "rejected step 3 left an effect"),
        # a second effect of step 1 under another key: the tool did it twice
        (
            {TOOLS[0]: [("k1-s1", "s1", 1, 1, 10, 40), ("k1b-s1", "s1", 1, 1, 11, 41)]},
            "e2e_reserve made 2 effects",
        ),
    ],
)
def test_a_wrong_reject_trace_is_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, list[Effect]], flagged: str
) -> None:
    tool_dir = _tool_state(tmp_path, monkeypatch, {**_compensated("s1"), **change}, rejected=["s1"])

    problems = check_traces([_run("s1", "COMPENSATED")], "reject", tool_dir)

    assert any(flagged in p for p in problems), problems


def test_a_wrong_status_or_a_second_rejection_is_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = {t: [*_compensated("s1")[t], *_compensated("s2")[t]] for t in TOOLS[:2]}
    tool_dir = _tool_state(tmp_path, monkeypatch, rows, rejected=["s1", "s2", "s2"])

    problems = check_traces(
        [_run("s1", "ESCALATED"), _run("s2", "COMPENSATED")], "reject", tool_dir
    )

    assert any(p.startswith("s1: ended ESCALATED") for p in problems), problems
    assert any(p == "s2: step 3 rejected 2 times" for p in problems), problems


def test_a_completed_saga_with_a_compensation_is_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: dict[str, list[Effect]] = {
        t: [(f"k{i}-s1", "s1", 1, 0, 10 + i, None)] for i, t in enumerate(TOOLS)
    }
    rows[TOOLS[1]] = [("k1-s1", "s1", 1, 1, 11, 30)]
    tool_dir = _tool_state(tmp_path, monkeypatch, rows)

    assert check_traces([_run("s1", "COMPLETED")], "complete", tool_dir) == [
        "s1: e2e_charge compensated in a completed saga"
    ]
