"""An ESCALATED saga's receipt is written when it ends; its incidents are usually
resolved after that. ``sagaline saga show`` and the dashboard's saga page must not go
on saying the effect is still in the world and needs its owner once a person has
resolved it (the coordinator counts that resolution: its measures, the incident feed).
"""

from __future__ import annotations

import re

import pytest
from dashboard_scenarios import SagaScript
from starlette.testclient import TestClient

from sagaline.kafka import create_producer, ensure_topics
from schemas import FailureKind, IncidentResolved, TerminalStatus
from schemas.receipt import Disposition
from schemas.settings import Settings
from schemas.wire import to_message
from services.cli import main
from services.dashboard.app import create_app
from services.dashboard.timeline import PLOT_X0, PLOT_X1, render_timeline_svg
from services.dashboard.view import DashboardState

DAY = 86_400_000


def _escalated_then_resolved(saga_id: str) -> SagaScript:
    """The credit is rejected; un-restocking fails and escalates; then alice resolves."""
    s = SagaScript(saga_id).start()
    s.run("1", "place_hold", amount_cents=1_000)
    s.run("2", "restock_inventory", amount_cents=2_500)
    s.schedule("3", "issue_credit", amount_cents=2_500)
    s.intent("3")
    s.fail("3", FailureKind.BUSINESS_REJECTION)
    s.compensate("2", ok=False)
    incident = s.incident("2", "compensation-failed")
    s.compensate("1")
    s.step_receipt("1", Disposition.COMPENSATED, verification="PASSED", compensation_attempts=1)
    s.step_receipt("2", Disposition.ESCALATED, compensation_attempts=1, incident_id=incident,
                   owner="inventory-team")  # fmt: skip
    s.step_receipt("3", Disposition.NOT_COMMITTED, observation="FAILED")
    s.terminal(TerminalStatus.ESCALATED, unresolved=["2"])
    s.add(IncidentResolved, advance_ms=60_000, incident_id=incident, resolved_by="alice",
          resolution="restocked by hand")  # fmt: skip
    return s


@pytest.mark.kafka
def test_saga_show_and_the_dashboard_tell_an_incident_resolved_after_the_end(
    kafka_bootstrap: str,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_HMAC_KEY", "receipt-test-key")
    monkeypatch.delenv("SAGALINE_TRUST_FILE", raising=False)
    settings = Settings.from_env()
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    saga = _escalated_then_resolved("s-settled-later")
    producer = create_producer(kafka_bootstrap)
    for record in saga.records:
        key, value, headers = to_message(record, settings.signer())
        producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0

    assert main(["saga", "show", saga.saga_id]) == 0
    text = capsys.readouterr().out
    assert "is still in effect" not in text, text
    assert "restocked by hand (by alice)" in text, text

    state = DashboardState()
    for record in saga.records:
        state.apply(record)
    page = TestClient(create_app(state)).get(f"/sagas/{saga.saga_id}").text
    assert "is still in effect" not in page
    assert "restocked by hand (by alice)" in page


def test_the_timeline_of_a_saga_resolved_days_later_still_shows_the_saga() -> None:
    """A resolution two days after the end is no bar or marker of the timeline, yet
    its time stretched the time axis: the whole saga (seconds long) was squeezed into
    a sliver at the left edge, its terminal line on top of its start."""
    saga = _escalated_then_resolved("s-resolved-later")
    last = saga.records[-1]
    later = last.envelope.model_copy(update={"occurred_at": last.envelope.occurred_at + 2 * DAY})
    saga.records[-1] = last.model_copy(update={"envelope": later})
    state = DashboardState()
    for record in saga.records:
        state.apply(record)
    view = state.sagas["s-resolved-later"]
    svg = render_timeline_svg(view, now=view.last_at)
    found = re.search(r'class="terminal-marker"><line x1="([0-9.]+)"', svg)
    assert found is not None
    # The terminal record is the saga's last drawn moment: at the right end of the plot.
    assert float(found.group(1)) > (PLOT_X0 + PLOT_X1) / 2, found.group(0)
