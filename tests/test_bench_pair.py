"""``bench/pair.py`` alternates two checkouts' ``bench/e2e.py``: its ratio means
something only when both sides measure the same way, and a side whose raw floor
did not finish must show, not drop out of the range. Fake checkouts whose
``bench/e2e.py`` writes a result file stand in for the real runs (no broker)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench import pair

# A stand-in for bench/e2e.py: writes the JSON results pair.py reads. The "after"
# side's raw floor stalls (nan) when STALL_AFTER is in this file.
FAKE_E2E = """
import json, sys
args = sys.argv[1:]
label = args[args.index("--label") + 1]
out = args[args.index("--json-out") + 1]
levels = [1, 100] if "EXTRA_" + "LEVEL" in open(__file__).read() else [1]
stall = label == "after" and "STALL_" + "AFTER" in open(__file__).read()
json.dump([
    {"variant": "reject", "in_flight": n, "count": 5, "sagas_per_s": 10.0 * n,
     "raw_sagas_per_s": float("nan") if stall else 20.0 * n, "cpu": {}, "raw_cpu": {},
     "problems": 0}
    for n in levels
], open(out, "w"))
"""


@pytest.fixture(autouse=True)
def _work_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # pair.py's work directory


def _checkout(root: Path, name: str, e2e: str) -> Path:
    bench = root / name / "bench"
    bench.mkdir(parents=True)
    (bench / "e2e.py").write_text(e2e)
    (bench / "_common.py").write_text("# helpers\n")
    (bench / "_requests.py").write_text("# helpers\n")
    return root / name


def test_a_pair_of_different_bench_scripts_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _checkout(tmp_path, "before", FAKE_E2E)
    after = _checkout(tmp_path, "after", FAKE_E2E + "# EXTRA_LEVEL\n")

    with pytest.raises(SystemExit) as refused:
        pair.main(["--before", str(before), "--after", str(after), "--rounds", "1"])

    assert "bench/e2e.py" in str(refused.value.code)
    assert "x100" not in capsys.readouterr().out  # nothing was measured


def test_a_stalled_raw_floor_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    e2e = FAKE_E2E + "# STALL_AFTER\n"
    before = _checkout(tmp_path, "before", e2e)
    after = _checkout(tmp_path, "after", e2e)

    pair.main(["--before", str(before), "--after", str(after), "--rounds", "2"])

    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("raw floor reject x1"))
    assert "after 1" in line and "after 2" in line, line
