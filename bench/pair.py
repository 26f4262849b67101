"""A same-hour pair: ``bench/e2e.py`` of two checkouts, alternated on one broker.

Issue 9's acceptance compares the code before a change with the code after it on the
same machine in the same hour. On a 2-core VM one run of the same code moves by up to
a quarter from the next (the machine, not the code), so this runs the two checkouts in
turn (before, after, before, after, ...) and prints every run and the means:

    python bench/pair.py --before ../base --after . --rounds 2 -- \\
        --levels 1:100,100:1000 --variants reject --broker-state-dir ...

Each checkout runs its own ``bench/e2e.py`` (copy this one's, with ``bench/_common.py``
and ``bench/_requests.py``, into the other checkout first: it only uses APIs both have;
a pair whose two checkouts' copies differ is refused) with the interpreter running
this script; the arguments after ``--`` go to every run. Every run's output is kept in the work
directory it prints; a run that fails or finds a wrong trace fails the pair.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

from bench._common import machine_description, markdown_table


@dataclass(frozen=True)
class Run:
    side: str
    round: int
    started: str  # UTC, HH:MM:SS
    rates: dict[str, float]  # "reject x100" -> sagas/s
    raw_rates: dict[str, float]
    problems: int


# What bench/e2e.py runs with: both sides must run the same, or their figures differ by
# more than the code under test (another default level, another measure).
BENCH_FILES = ("bench/e2e.py", "bench/_common.py", "bench/_requests.py")


def require_same_bench(before: Path, after: Path) -> None:
    """Refuse a pair whose two checkouts would measure with different bench files."""
    differ = [
        rel
        for rel in BENCH_FILES
        if not (before / rel).exists()
        or not (after / rel).exists()
        or (before / rel).read_bytes() != (after / rel).read_bytes()
    ]
    if differ:
        raise SystemExit(
            f"{before} and {after} do not run the same benchmark ({', '.join(differ)} "
            f"differ or are missing): copy them into both, e.g. "
            f"cp {' '.join(str(after / rel) for rel in BENCH_FILES)} {before / 'bench'}/"
        )


def commit_of(checkout: Path) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def run_once(side: str, n: int, checkout: Path, e2e_args: Sequence[str], work: Path) -> Run:
    script = checkout / "bench" / "e2e.py"
    if not script.exists():
        raise SystemExit(
            f"{script} does not exist: copy {', '.join(BENCH_FILES)} into that checkout"
        )
    log = work / f"{side}-{n}.log"
    result = work / f"{side}-{n}.json"
    started = time.strftime("%H:%M:%S", time.gmtime())
    with log.open("w") as out:
        code = subprocess.run(
            [sys.executable, str(script), *e2e_args, "--label", side, "--json-out", str(result)],
            cwd=checkout,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    if code != 0 or not result.exists():
        raise SystemExit(f"{side} run {n} failed (exit {code}); its output: {log}")
    levels = json.loads(result.read_text())
    rates: dict[str, float] = {}
    raw: dict[str, float] = {}
    problems = 0
    for level in levels:
        name = f"{level['variant']} x{level['in_flight']}"
        rates[name] = float(level["sagas_per_s"])
        raw[name] = float(level["raw_sagas_per_s"])
        problems += int(level["problems"])
    return Run(side, n, started, rates, raw, problems)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def report(runs: Sequence[Run], before: Path, after: Path, raw: bool = True) -> str:
    """The table of every run, the means and the ratio; ``raw``: the runs measured the
    raw floor (no ``--no-raw``), so a run without one is named (its floor stalled)."""
    names = list(dict.fromkeys(name for run in runs for name in run.rates))
    rows: list[list[str]] = []
    for run in runs:
        rows.append(
            [f"{run.side} {run.round} ({run.started})"]
            + [f"{run.rates.get(name, float('nan')):.1f}" for name in names]
        )
    means: dict[str, dict[str, float]] = {}
    for side in ("before", "after"):
        mine = [run for run in runs if run.side == side]
        means[side] = {
            name: _mean([r.rates[name] for r in mine if name in r.rates]) for name in names
        }
        rows.append([f"{side}, mean"] + [f"{means[side][name]:.1f}" for name in names])
    rows.append(
        ["after / before (means)"]
        + [f"{means['after'][name] / means['before'][name]:.1f}x" for name in names]
    )
    lines = [
        f"== pair on {machine_description()}",
        f"before: {before} at {commit_of(before)}; after: {after} at {commit_of(after)}; "
        f"{len(runs) // 2} rounds, alternated",
        "",
        markdown_table(["sagas/s", *names], rows),
    ]
    for name in names:
        floor = [r.raw_rates[name] for r in runs if not math.isnan(r.raw_rates.get(name, math.nan))]
        line = f"raw floor {name}: {min(floor):.1f}-{max(floor):.1f} sagas/s" if floor else ""
        missing = [
            f"{r.side} {r.round}" for r in runs if math.isnan(r.raw_rates.get(name, math.nan))
        ]
        if raw and missing:
            line = (line + "; " if line else f"raw floor {name}: ") + (
                f"none in {', '.join(missing)} (it stalled: see that run's output)"
            )
        if line:
            lines.append(line)
    wrong = sum(run.problems for run in runs)
    lines.append("traces: all correct" if not wrong else f"traces: {wrong} WRONG")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    e2e_args: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, e2e_args = args_in[:cut], args_in[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old code")
    parser.add_argument("--after", type=Path, required=True, help="checkout of the new code")
    parser.add_argument("--rounds", type=int, default=2, help="before+after runs (default 2)")
    args = parser.parse_args(args_in)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    require_same_bench(args.before.resolve(), args.after.resolve())
    work = Path(tempfile.mkdtemp(prefix="sagaline-pair-"))
    print(f"runs' output: {work}", flush=True)
    runs: list[Run] = []
    for n in range(1, args.rounds + 1):
        for side, checkout in (("before", args.before), ("after", args.after)):
            run = run_once(side, n, checkout.resolve(), e2e_args, work)
            shown = ", ".join(f"{k} {v:.1f}" for k, v in run.rates.items())
            print(f"{side} {n} ({run.started}): {shown} sagas/s", flush=True)
            runs.append(run)
    print()
    print(report(runs, args.before.resolve(), args.after.resolve(), "--no-raw" not in e2e_args))
    return 1 if any(run.problems for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
