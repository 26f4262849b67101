"""Dashboard logins without a browser or broker (issue 12): who may view, who may act.

The browser and Kafka version is tests/test_dashboard_login_browser.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from sagaline.ops.metrics import SagalineMetrics
from services.dashboard import auth as auth_module
from services.dashboard.app import create_app
from services.dashboard.auth import (
    PROXY_SECRET_HEADER,
    PROXY_USER_HEADER,
    OperatorAuth,
    check_password,
    hash_password,
)
from services.dashboard.view import DashboardState

GRANT = "/approvals/s-1/a-1/grant"


def _client(auth: OperatorAuth) -> TestClient:
    return TestClient(create_app(DashboardState(SagalineMetrics("dashboard")), auth=auth))


def test_passwords_are_stored_as_scrypt_hashes_and_checked() -> None:
    stored = hash_password("a long password")
    assert stored.startswith("scrypt$") and "a long password" not in stored
    assert check_password("a long password", stored)
    assert not check_password("another one", stored) and not check_password("x", "garbage")


def test_viewing_needs_a_login_unless_opened_read_only() -> None:
    closed = _client(OperatorAuth(users={"alice": hash_password("pw-of-alice-123")}))
    response = closed.get("/", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"].startswith("/login")
    assert closed.get("/api/state").status_code == 401
    opened = _client(OperatorAuth(users={"a": hash_password("x" * 12)}, read_open=True))
    assert opened.get("/").status_code == 200


def test_wrong_password_is_refused_and_a_session_needs_its_csrf_token() -> None:
    client = _client(OperatorAuth(users={"alice": hash_password("pw-of-alice-123")}))
    assert client.post("/login", data={"name": "alice", "password": "nope"}).status_code == 401
    assert client.post(GRANT, data={"operator": "alice"}).status_code == 401
    ok = client.post(
        "/login", data={"name": "alice", "password": "pw-of-alice-123"}, follow_redirects=False
    )
    assert ok.status_code == 303 and "httponly" in ok.headers["set-cookie"].lower()
    assert "samesite=strict" in ok.headers["set-cookie"].lower()
    assert client.post(GRANT, data={"csrf": "wrong"}).status_code == 403
    page = client.get("/").text
    assert 'id="who">alice<' in page


def test_proxy_header_counts_only_with_the_shared_secret_and_still_needs_csrf() -> None:
    client = _client(OperatorAuth(proxy_secret="s3cret-of-the-proxy"))
    forged = {PROXY_USER_HEADER: "alice", PROXY_SECRET_HEADER: "guess"}
    assert client.get("/", headers=forged, follow_redirects=False).status_code == 303
    proxied = {PROXY_USER_HEADER: "alice", PROXY_SECRET_HEADER: "s3cret-of-the-proxy"}
    page = client.get("/", headers=proxied)
    assert page.status_code == 200 and 'id="who">alice<' in page.text
    # The proxy adds its headers to a cross-site POST too: the CSRF token stops it.
    assert client.post(GRANT, headers=proxied, data={}).status_code == 403
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None
    # With the token the request passes authentication (then: no such saga here).
    response = client.post(GRANT, headers=proxied, data={"csrf": token.group(1)})
    assert response.status_code == 400 and "no such saga" in response.text


def test_without_logins_configured_the_dashboard_says_it_is_in_development_mode() -> None:
    page = _client(OperatorAuth()).get("/").text
    assert "development mode: actions are not authenticated" in page


def test_expired_sessions_are_dropped_not_kept_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a proxy every request without the cookie (a script polling /api/state)
    opens a session; one that is never presented again used to stay in memory for good."""
    clock = [1_000_000.0]
    monkeypatch.setattr(auth_module, "time", SimpleNamespace(time=lambda: clock[0]))
    auth = OperatorAuth(proxy_secret="s3cret-of-the-proxy")
    proxied = {PROXY_USER_HEADER: "alice", PROXY_SECRET_HEADER: "s3cret-of-the-proxy"}
    for _ in range(100):
        auth.session(None, proxied)
    clock[0] += auth_module.SESSION_TTL_S + 1
    session, token = auth.session(None, proxied)
    assert session is not None and token is not None
    assert len(auth._sessions) == 1
