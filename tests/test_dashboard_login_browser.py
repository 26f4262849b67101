"""Operators must log in to act on the dashboard (issue 12), in headless Chromium on the
real broker, with identity keys on.

Without a login the Approve button is disabled and a forged POST (no session, or a
session with a wrong CSRF token) is refused and records nothing; after logging in, a
click on Approve records an ``ApprovalGranted`` naming the logged-in operator, signed
by the dashboard's gateway key, and the irreversible step runs.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from participants import Reversibility, compensable, tool, wrap
from sagaline.kafka import LedgerReader
from schemas import ApprovalGranted, TerminalStatus
from schemas.settings import Settings
from schemas.trust import Role
from services.dashboard import Dashboard
from services.dashboard.auth import SESSION_COOKIE, OperatorAuth, hash_password
from tests.system import System, wait_until
from tests.test_dashboard_browser import browser_page, chromium, serving
from tests.trust_kit import TrustKit

pytestmark = [pytest.mark.kafka, pytest.mark.browser]

__all__ = ["chromium"]  # the fixture, imported for pytest

PASSWORD = "alice-has-a-long-password"


class Mail:
    def __init__(self) -> None:
        self.sent: list[str] = []

    @tool(description="Email the customer; once read it cannot be taken back.")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def notify(self, message: str) -> str:
        self.sent.append(message)
        return "mail-1"


def _post(url: str, form: dict[str, str], cookie: str | None = None) -> int:
    """A POST as a forger would send it (no browser, no page): its HTTP status."""
    request = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(), method="POST")
    if cookie:
        request.add_header("Cookie", f"{SESSION_COOKIE}={cookie}")
    opener = urllib.request.build_opener(_NoRedirect())
    try:
        with opener.open(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_approve_needs_a_login_and_a_csrf_token_and_records_the_logged_in_operator(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, chromium: Path
) -> None:
    kit = TrustKit(tmp_path / "keys")
    kit.add("sagaline-coordinator", Role.COORDINATOR)
    kit.add("mail", Role.PARTICIPANT)
    kit.add("agent", Role.AGENT)
    kit.add("alice", Role.OPERATOR)
    kit.add("dashboard", Role.OPERATOR, acts_for=["alice"])  # the gateway for alice
    base = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=2)

    def settings_for(component: str) -> Settings:
        return kit.settings(
            base, "sagaline-coordinator" if component == "coordinator" else component
        )

    mail = Mail()
    with System(
        kafka_bootstrap,
        unique_prefix,
        tmp_path,
        [wrap(mail, name="mail")],
        hmac_key=None,
        settings_for=settings_for,
    ) as system:
        auth = OperatorAuth(users={"alice": hash_password(PASSWORD)}, read_open=True)
        dashboard = Dashboard(kafka_bootstrap, kit.settings(base, "dashboard"), auth=auth)
        saga = system.client.saga("notify", "agent")
        box: dict[str, Any] = {}

        def agent() -> None:
            with saga:
                box["result"] = saga.call("notify", message="refund sent", timeout_s=120)

        threading.Thread(target=agent, daemon=True).start()

        def grants() -> list[ApprovalGranted]:
            records = LedgerReader(system.bootstrap).saga_records(
                system.topics.events, saga.saga_id, kit.signer()
            )
            return [r for r in records if isinstance(r, ApprovalGranted)]

        with serving(dashboard.app) as url, browser_page(chromium) as page:
            # Viewing is open (read_open): the request shows, its button does not work.
            page.goto(f"{url}/")
            item = page.locator(f'li.approval[data-saga="{saga.saga_id}"]')
            item.wait_for(timeout=90_000)
            approve = item.locator("button.grant")
            assert approve.is_disabled()
            assert item.locator("input[name=operator]").count() == 0  # no typed names
            action = item.locator("form").get_attribute("action")
            assert action is not None

            # Forged POSTs: no session; then a real session with a wrong token.
            forged = {"operator": "mallory", "next": "/"}
            assert _post(f"{url}{action}", forged) == 401

            page.click('a[href="/login"]')
            page.fill("input[name=name]", "alice")
            page.fill("input[name=password]", PASSWORD)
            page.click("#login")
            page.wait_for_selector('#who:has-text("alice")')
            cookie = next(c["value"] for c in page.context.cookies() if c["name"] == SESSION_COOKIE)
            assert _post(f"{url}{action}", forged | {"csrf": "wrong"}, cookie) == 403
            assert grants() == [] and mail.sent == []

            # Logged in: the click records alice, whatever a form might claim.
            item = page.locator(f'li.approval[data-saga="{saga.saga_id}"]')
            assert item.locator(".as").inner_text() == "as alice"
            item.locator("button.grant").click()
            page.wait_for_selector('.notice:has-text("granted by alice")')

        (grant,) = wait_until(grants, 60, "the ApprovalGranted on Kafka")
        assert grant.granted_by == "alice" and grant.envelope.producer == "dashboard"
        assert saga.wait(60).status is TerminalStatus.COMPLETED
        assert mail.sent == ["refund sent"] and box == {"result": "mail-1"}
