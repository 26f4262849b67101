"""The dashboard against the real broker: it rebuilds its view from the topics, and an
operator's approval becomes a signed record on the ledger (never a side door).

Each test writes realistic ledgers (one saga per status, see ``dashboard_scenarios``)
into its own uniquely-prefixed topics, as the agent, participants and coordinator
would: every record on ``sagaline.events``, terminal records also on
``sagaline.terminal`` and incidents also on ``sagaline.incidents``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from dashboard_scenarios import ALL, copies_to
from starlette.testclient import TestClient

from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas import ApprovalGranted, ApprovalRequested, Record
from schemas.settings import Settings
from schemas.wire import to_message
from services.dashboard import Dashboard

pytestmark = pytest.mark.kafka

EXPECTED_STATUS = {
    "s-completed": "completed",
    "s-compensated": "compensated",
    "s-escalated": "escalated",
    "s-awaiting": "awaiting_approval",
    "s-unknown": "unknown_outcome",
    "s-running": "running",
    "s-compensating": "compensating",
}


def _until(condition: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def _publish(bootstrap: str, settings: Settings, records: list[Record]) -> None:
    producer = create_producer(bootstrap)
    signer, topics = settings.signer(), settings.topics
    for record in records:
        key, value, headers = to_message(record, signer)
        for attr in ["events", *copies_to(record)]:
            producer.produce(getattr(topics, attr), key=key, value=value, headers=headers)
    assert producer.flush(30) == 0


@pytest.fixture
def ledger(transport: str, unique_prefix: str) -> Settings:
    """Topics under a fresh prefix, holding one saga per status plus one duplicate."""
    settings = Settings(bootstrap=transport, topic_prefix=unique_prefix,
                        hmac_key=b"dashboard-test-key", partitions=3)  # fmt: skip
    ensure_topics(transport, settings.topics, partitions=3)
    records = [r for build in ALL.values() for r in build().records]
    _publish(transport, settings, [*records, records[3]])  # one redelivered record
    return settings


def _caught_up_state(client: TestClient, expected_sagas: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        body: dict[str, Any] = client.get("/api/state").json()
        return body if body["caught_up"] and len(body["sagas"]) == expected_sagas else None

    result: dict[str, Any] = _until(ready, f"the dashboard to show {expected_sagas} sagas")
    return result


def test_pages_show_each_saga_with_the_status_its_records_imply(
    transport: str, ledger: Settings
) -> None:
    """R14: terminal status from sagaline.terminal/events; live status from the ledger."""
    dashboard = Dashboard(transport, ledger)
    with TestClient(dashboard.app, base_url="http://localhost") as client:
        state = _caught_up_state(client, len(EXPECTED_STATUS))
        assert {s["saga_id"]: s["status"] for s in state["sagas"]} == EXPECTED_STATUS
        assert set(state["counts"].values()) == {1}
        assert state["ledger_duplicates"] == 1  # R15: the redelivered record, folded once
        page = client.get("/").text
        for saga_id, status in EXPECTED_STATUS.items():
            assert f'data-saga="{saga_id}" data-status="{status}"' in page
        saga_page = client.get("/sagas/s-escalated").text
        assert "restock_inventory (step 2) is still in effect and needs inventory-team" in saga_page


def test_a_restarted_dashboard_shows_the_same_sagas_and_counts(
    transport: str, ledger: Settings
) -> None:
    """R5: the view is a fold of the topics, so a restart rebuilds it exactly."""
    seen: list[dict[str, Any]] = []
    for _run in range(2):
        dashboard = Dashboard(transport, ledger)
        with TestClient(dashboard.app, base_url="http://localhost") as client:
            state = _caught_up_state(client, len(EXPECTED_STATUS))
            seen.append(
                {
                    "counts": state["counts"],
                    "sagas": sorted(
                        (s["saga_id"], s["status"], s["records"]) for s in state["sagas"]
                    ),
                    "approvals": state["pending_approvals"],
                    "incidents": sorted(i["incident_id"] for i in state["open_incidents"]),
                    "measures": client.get("/fragment/measures").text,
                }
            )
    assert seen[0] == seen[1]


def test_approving_in_the_dashboard_puts_a_grant_with_the_operator_on_kafka(
    transport: str, ledger: Settings
) -> None:
    """R7: the grant is a record on the ledger, bound to the request, naming the operator."""
    dashboard = Dashboard(transport, ledger)
    with TestClient(dashboard.app, base_url="http://localhost") as client:
        state = _caught_up_state(client, len(EXPECTED_STATUS))
        (pending,) = state["pending_approvals"]
        url = f"/approvals/{pending['saga_id']}/{pending['approval_id']}/grant"

        refused = client.post(url, data={"operator": ""}, follow_redirects=False)
        assert refused.status_code == 400
        response = client.post(url, data={"operator": "alice@ops", "next": "/"},
                               follow_redirects=False)  # fmt: skip
        assert response.status_code == 303

        def grants() -> list[ApprovalGranted]:
            records = LedgerReader(transport).saga_records(
                ledger.topics.events, pending["saga_id"], ledger.signer()
            )
            return [r for r in records if isinstance(r, ApprovalGranted)]

        (grant,) = _until(grants, "the ApprovalGranted on sagaline.events")
        request = next(
            r
            for r in LedgerReader(transport).saga_records(
                ledger.topics.events, pending["saga_id"], ledger.signer()
            )
            if isinstance(r, ApprovalRequested)
        )
        assert grant.granted_by == "alice@ops"
        assert grant.envelope.producer == "operator:dashboard"
        assert (grant.approval_id, grant.args_fingerprint, grant.principal, grant.scope) == (
            request.approval_id,
            request.args_fingerprint,
            request.principal,
            request.scope,
        )
        # The dashboard reads its own decision back from the ledger.
        _until(
            lambda: client.get("/api/state").json()["pending_approvals"] == [],
            "the approval to leave the pending list",
        )
