"""Label values that come from records (tool names) are bounded: a writer that names
thousands of tools (forged, or a bug) must not make thousands of time series, each
a histogram of 17 samples, in every scrape of the coordinator and the dashboard."""

from __future__ import annotations

from coordinator_ledger import Ledger

from sagaline.ops.metrics import _MAX_TOOL_LABELS, SagalineMetrics

_NAME = "sagaline_time_in_unknown_state_seconds_count"


def test_tool_labels_past_the_bound_are_counted_under_other_R16() -> None:
    metrics = SagalineMetrics("dashboard")
    tools = _MAX_TOOL_LABELS + 500
    for n in range(tools):
        ledger = Ledger(saga_id=f"saga-{n}")
        ledger.scheduled("s1", tool=f"tool-{n}")
        metrics.observe_record(ledger.unknown("s1"))
        metrics.observe_record(ledger.committed("s1"))
    series = {
        s.labels["tool"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == _NAME
    }
    assert len(series) == _MAX_TOOL_LABELS + 1
    assert series["other"] == 500
    assert series["tool-0"] == 1
    assert sum(series.values()) == tools  # every settlement counted, none lost
