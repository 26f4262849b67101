"""An operator in a real browser, while real sagas run on the real broker.

Headless Chromium (Debian's ``/usr/bin/chromium``, installed by this set-up when it
is missing; Playwright drives it and never downloads a browser of its own) loads the
dashboard served by uvicorn, watches a saga move to compensated, opens its timeline,
and approves a pending IRREVERSIBLE step with a click. Then the test checks Kafka: the
approval is a record naming the operator, and the approved step ran.

The timeline screenshot goes to the test's tmp dir; with
``SAGALINE_UPDATE_SCREENSHOTS=1`` it is also copied to ``docs/img/timeline.png``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "coordinator.shell",
    reason="the coordinator's Kafka shell is not built yet (issue: coordinator)",
)
pytest.importorskip(
    "participants.runtime", reason="the participant runtime is not built yet (issue: participants)"
)

import uvicorn
from playwright.sync_api import Page, sync_playwright

from participants import (
    BusinessRejection,
    CompensationContext,
    Reversibility,
    compensable,
    tool,
    wrap,
)
from participants.client import SagaCallError
from schemas import ApprovalGranted, StepCommitted, TerminalStatus
from services.dashboard import Dashboard
from tests.system import System, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "timeline.png"


class Shop:
    """A participant whose provider state the test can read back."""

    def __init__(self) -> None:
        self.holds: list[str] = []
        self.released: list[str] = []
        self.notified: list[str] = []

    @tool(description="Hold stock for an order.", resources=["stock"])
    @compensable(by="release", reversibility=Reversibility.REVERSIBLE)
    def reserve(self, sku: str) -> str:
        self.holds.append(sku)
        return f"hold-{sku}"

    def release(self, ctx: CompensationContext) -> None:
        self.released.append(str(ctx.result))

    @tool(description="Charge the customer.")
    @compensable(by="refund")
    def charge(self, amount_cents: int) -> str:
        return f"charge-{amount_cents}"

    def refund(self, ctx: CompensationContext) -> None:
        return None

    @tool(description="Check the credit limit (always over it here).")
    @compensable(by="nothing_to_undo")
    def check_credit(self, amount_cents: int) -> str:
        raise BusinessRejection(f"credit limit exceeded by {amount_cents} cents")

    def nothing_to_undo(self, ctx: CompensationContext) -> None:
        return None

    @tool(description="Email the customer; once read it cannot be taken back.")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def notify(self, message: str) -> str:
        self.notified.append(message)
        return "mail-1"


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium, installed here when missing (the machine runs us as root)."""
    if not CHROMIUM.exists():
        if os.geteuid() != 0:
            pytest.fail(f"{CHROMIUM} is missing and we are not root: apt-get install -y chromium")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        # Another apt (a second test worker, the machine's own) may hold dpkg's lock:
        # wait for it rather than fail.
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]
        subprocess.run([*apt, "update", "-qq"], check=True, env=env)
        subprocess.run([*apt, "install", "-y", "-qq", "chromium"], check=True, env=env)
    return CHROMIUM


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """The app on a real HTTP server (uvicorn in a thread) on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "the dashboard HTTP server to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextmanager
def browser_page(executable: Path) -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(executable), args=CHROMIUM_FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1200, "height": 900})
        finally:
            browser.close()


def _in_background(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = target()
        except SagaCallError as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_operator_watches_a_compensation_and_approves_an_irreversible_step(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, chromium: Path
) -> None:
    """R7, R9, R14: the browser shows the compensated saga and its timeline; a click on
    Approve becomes an ApprovalGranted naming the operator, and the email then runs."""
    shop = Shop()
    with System(kafka_bootstrap, unique_prefix, tmp_path, [wrap(shop, name="shop")]) as system:
        client = system.client
        dashboard = Dashboard(kafka_bootstrap, system.settings)
        with serving(dashboard.app) as base, browser_page(chromium) as page:
            # 1. A saga that fails on a business rejection and is compensated (R9).
            failing = client.saga("refund", "agent-7", saga_id=f"saga-comp-{uuid.uuid4().hex[:6]}")

            def refund_rejected() -> None:
                with failing as saga:
                    saga.call("reserve", sku="sku-42")
                    saga.call("charge", amount_cents=4_000)
                    saga.call("check_credit", amount_cents=4_000)

            worker, _ = _in_background(refund_rejected)
            page.goto(f"{base}/")
            row = f'tr[data-saga="{failing.saga_id}"][data-status="compensated"]'
            page.wait_for_selector(row, timeout=90_000)
            worker.join(30)

            page.click(f'{row} a[href="/sagas/{failing.saga_id}"]')
            page.wait_for_selector("svg.timeline")
            assert page.locator(".receipt .section-undone > ul > li").count() == 2
            shot = tmp_path / "timeline.png"
            page.locator("svg.timeline").screenshot(path=str(shot))
            if os.environ.get("SAGALINE_UPDATE_SCREENSHOTS") == "1":
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, SCREENSHOT)
            assert sorted(shop.released) == ["hold-sku-42"]

            # 2. A saga whose IRREVERSIBLE email waits for a person (R7).
            emailing = client.saga("notify", "agent-7", saga_id=f"saga-mail-{uuid.uuid4().hex[:6]}")

            def refund_with_email() -> None:
                with emailing as saga:
                    saga.call("reserve", sku="sku-7")
                    saga.call("notify", message="your refund is on its way", timeout_s=120)

            worker, box = _in_background(refund_with_email)
            page.goto(f"{base}/")
            item = page.locator(f'li.approval[data-saga="{emailing.saga_id}"]')
            item.wait_for(timeout=90_000)
            assert shop.notified == []  # nothing irreversible before the approval
            item.locator("input[name=operator]").fill("alice@ops")
            item.locator("button.grant").click()
            page.wait_for_selector('.notice:has-text("granted by alice@ops")')

            def grants() -> list[ApprovalGranted]:
                records = system.records(emailing.saga_id)
                return [r for r in records if isinstance(r, ApprovalGranted)]

            (grant,) = wait_until(grants, 60, "the ApprovalGranted on Kafka")
            assert grant.granted_by == "alice@ops"
            assert grant.envelope.producer == "operator:dashboard"
            wait_until(
                lambda: any(
                    isinstance(r, StepCommitted) and r.tool == "notify"
                    for r in system.records(emailing.saga_id)
                ),
                60,
                "the approved email step to commit",
            )
            assert shop.notified == ["your refund is on its way"]
            worker.join(60)
            assert "error" not in box, box.get("error")
            assert emailing.wait(60).status is TerminalStatus.COMPLETED
            page.goto(f"{base}/")
            page.wait_for_selector(
                f'tr[data-saga="{emailing.saga_id}"][data-status="completed"]', timeout=60_000
            )
