"""The metrics tables in docs/operations-dashboard.md say what an operator scrapes and
who feeds it: every metric listed exists with that name, type and labels, every
metric defined is listed, and the calls each component is said to make are ones it
makes (a dashboard built on a call the component never makes shows nothing)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from coordinator.shell import ShellMetrics
from participants.runtime import RuntimeMetrics
from sagaline.ops.metrics import SagalineMetrics

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations-dashboard.md"
_ROW = re.compile(r"^\| `(sagaline_[a-z_]+)` \| (counter|gauge|histogram)((?:, `[a-z_]+`)*) \|")


def _documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), tuple(re.findall(r"`([a-z_]+)`", m.group(3))))
    return rows


def _defined() -> dict[str, tuple[str, tuple[str, ...]]]:
    metrics = SagalineMetrics("test")
    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
    out = {}
    for value in vars(metrics).values():
        kind = next((k for t, k in kinds.items() if isinstance(value, t)), None)
        if kind is None:
            continue
        name = value._name + ("_total" if kind == "counter" else "")
        out[name] = (kind, tuple(value._labelnames))
    return out


def test_every_metric_defined_is_documented_with_its_type_and_labels() -> None:
    assert _documented() == _defined()


def _calls(who: str) -> set[str]:
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| {who} |"):
            return set(re.findall(r"`([a-z_]+)\(", line))
    raise AssertionError(f"no row for {who} in {DOC.name}")


def _methods(protocol: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(protocol, inspect.isfunction) if not n.startswith("_")}


def test_the_calls_each_component_is_said_to_make_are_the_ones_it_reports() -> None:
    coordinator = _calls("coordinator shell") - {"CoordinatorMetrics"}
    assert coordinator == _methods(ShellMetrics)
    participant = _calls("participant runtime") - {"ParticipantMetrics"}
    assert participant == _methods(RuntimeMetrics)
