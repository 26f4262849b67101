"""``curl /metrics`` on a running coordinator agrees with the run's receipt.

A scripted saga on the real broker (coordinator and participant in this process, see
``tests/system.py``): two committed steps, one redelivered record, then a business
rejection, so both steps are compensated. The coordinator's Prometheus endpoint must
count the duplicate it ignored and one successful compensation per tool, as the
receipt says.
"""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("coordinator.shell", reason="the coordinator's Kafka shell is not built yet")

from participants import BusinessRejection, CompensationContext, compensable, tool, wrap
from participants.client import BusinessRejected
from sagaline.kafka import create_producer
from sagaline.ops.metrics import start_metrics_server
from schemas import Disposition, StepCommitted, TerminalStatus
from schemas.wire import to_message
from tests.system import System, wait_until

pytestmark = pytest.mark.kafka


class Desk:
    @tool(description="Hold stock.")
    @compensable(by="release")
    def reserve(self, sku: str) -> str:
        return f"hold-{sku}"

    def release(self, ctx: CompensationContext) -> None:
        return None

    @tool(description="Charge.")
    @compensable(by="refund")
    def charge(self, amount_cents: int) -> str:
        return f"charge-{amount_cents}"

    def refund(self, ctx: CompensationContext) -> None:
        return None

    @tool(description="Always over the limit.")
    @compensable(by="nothing")
    def check_credit(self, amount_cents: int) -> str:
        raise BusinessRejection("credit limit exceeded")

    def nothing(self, ctx: CompensationContext) -> None:
        return None


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_coordinator_metrics_match_the_receipt(
    transport: str, unique_prefix: str, tmp_path: Path
) -> None:
    """R8/R12 compensation success by tool, R15 duplicates prevented, via /metrics."""
    with System(transport, unique_prefix, tmp_path, [wrap(Desk(), name="desk")]) as system:
        assert system.coordinator is not None
        port = start_metrics_server(0, system.coordinator.metrics, addr="127.0.0.1")
        duplicates = ("sagaline_duplicates_prevented_total", (("component", "coordinator"),))
        saga_id = f"saga-metrics-{uuid.uuid4().hex[:6]}"
        with (
            pytest.raises(BusinessRejected),
            system.client.saga("refund", "agent-7", saga_id=saga_id) as saga,
        ):
            saga.call("reserve", sku="sku-1")
            saga.call("charge", amount_cents=1_500)
            before = _scrape(port).get(duplicates, 0.0)
            # Redeliver the charge's commit, as a producer retry would (R15).
            commit = next(
                r for r in system.records(saga_id)
                if isinstance(r, StepCommitted) and r.tool == "charge"
            )  # fmt: skip
            key, value, headers = to_message(commit, system.settings.signer())
            producer = create_producer(transport)
            producer.produce(system.topics.events, key=key, value=value, headers=headers)
            assert producer.flush(30) == 0
            wait_until(
                lambda: _scrape(port).get(duplicates, 0.0) == before + 1,
                30,
                "the coordinator to count the redelivered commit as a duplicate",
            )
            saga.call("check_credit", amount_cents=1_500)
        receipt = saga.wait(60)
        assert receipt.status is TerminalStatus.COMPENSATED

        def outcomes() -> dict[str, float]:
            return {
                dict(labels)["tool"]: value
                for (name, labels), value in _scrape(port).items()
                if name == "sagaline_compensation_outcomes_total"
                and dict(labels)["result"] == "succeeded"
            }

        expected = {s.tool: 1.0 for s in receipt.steps if s.disposition is Disposition.COMPENSATED}
        assert expected == {"reserve": 1.0, "charge": 1.0}
        assert wait_until(lambda: outcomes() == expected, 30, "compensation outcomes") is True
        assert _scrape(port)[duplicates] == before + 1


def test_records_the_coordinator_refuses_are_not_counted_as_facts(
    transport: str, unique_prefix: str
) -> None:
    """A resolution from another tenant is refused (DLQ ``tenant-mismatch``): it is no
    operator action, and the metrics must not count it as one."""
    from coordinator_ledger import Ledger

    from coordinator.shell import Coordinator
    from sagaline.ops.metrics import CoordinatorMetrics
    from tests.coordinator_turns import append, one_saga, turn_until

    settings, ledger, first, _participant = one_saga(transport, unique_prefix, "saga-forged")
    metrics = CoordinatorMetrics()
    coordinator = Coordinator(
        settings, transport, instance_id="metrics-1", carry_ms=0, metrics=metrics
    )
    coordinator._join()
    forger = Ledger(saga_id="saga-forged", tenant_id="evil", t0=ledger.clock)
    forger._n = 100  # event ids of its own
    forged = forger.resolve("inc-1", "refunded by hand")
    append(settings, transport, ledger.started(), first, forged)

    def refused() -> bool:
        return metrics.snapshot().dlq_records.get("tenant-mismatch", 0) == 1

    turn_until(coordinator, refused)
    assert metrics.snapshot().manual_interventions == {}


def test_the_dashboards_measures_leave_out_what_its_view_refuses() -> None:
    """The dashboard mirrors the coordinator's refusal (another tenant's record) and
    must not count the refused record as an operator action either."""
    from coordinator_ledger import Ledger

    from services.dashboard.view import DashboardState

    ledger = Ledger(saga_id="saga-forged")
    first = ledger.scheduled("reserve")
    forger = Ledger(saga_id="saga-forged", tenant_id="evil", t0=ledger.clock)
    forger._n = 100
    state = DashboardState()
    for record in (ledger.started(), first, forger.resolve("inc-1", "refunded by hand")):
        state.apply(record)
    assert state.refused_records == 1
    assert state.metrics.snapshot().manual_interventions == {}
