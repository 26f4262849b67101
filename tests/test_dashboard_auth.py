"""Dashboard logins without a browser or broker (issue 12): who may view, who may act.

The browser and Kafka version is tests/test_dashboard_login_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dashboard_scenarios import T0, awaiting_approval, unknown_outcome
from starlette.testclient import TestClient

from sagaline.ops.metrics import SagalineMetrics
from services.cli import main as cli_main
from services.dashboard import Dashboard
from services.dashboard import auth as auth_module
from services.dashboard.app import create_app
from services.dashboard.auth import (
    PROXY_SECRET_HEADER,
    PROXY_USER_HEADER,
    AuthConfigError,
    OperatorAuth,
    check_password,
    hash_password,
)
from services.dashboard.view import DashboardState
from tests.test_dashboard_view import RecordingChannel

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


def test_a_refused_decision_does_not_tell_a_logged_in_operator_actions_are_unauthenticated() -> (
    None
):
    """The pages answering a decision that was not recorded (no such saga, approval
    not pending, ...) were drawn as in development mode: a logged-in operator read
    "actions are not authenticated" and no longer saw who they were signed in as."""
    client, channel, actions = _pending(
        OperatorAuth(users={"alice": hash_password("pw-of-alice-123")})
    )
    client.post("/login", data={"name": "alice", "password": "pw-of-alice-123"})
    token = re.search(r'name="csrf" value="([^"]+)"', client.get("/").text)
    assert token is not None
    path, _form = actions["grant"]
    unknown_approval = path.replace("/grant", "-not-asked/grant")
    for target in ("/approvals/no-such-saga/a-1/grant", unknown_approval):
        response = client.post(target, data={"csrf": token.group(1)}, follow_redirects=False)
        assert "development mode" not in response.text, target
        assert 'id="who">alice<' in response.text, target
        assert response.status_code == 400 and "nothing was recorded" in response.text
    assert channel.published == []


# --------------------------------------------------- requests from another web site


def _pending(
    auth: OperatorAuth,
) -> tuple[TestClient, RecordingChannel, dict[str, tuple[str, dict[str, str]]]]:
    """A dashboard with a pending approval and an open unknown-outcome incident, and
    for each action its path and a form that records it."""
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in [*awaiting_approval().records, *unknown_outcome().records]:
        state.apply(record)
    ((saga, req),) = state.pending_approvals()
    ((other, incident),) = state.open_incidents()
    channel = RecordingChannel()
    client = TestClient(create_app(state, channel, auth=auth, clock=lambda: T0))  # type: ignore[arg-type]
    approval = f"/approvals/{saga.saga_id}/{req.approval_id}"
    actions = {
        "grant": (f"{approval}/grant", {"operator": "mallory"}),
        "deny": (f"{approval}/deny", {"operator": "mallory", "reason": "x"}),
        "resolve": (
            f"/incidents/{other.saga_id}/{incident.incident_id}/resolve",
            {"operator": "mallory", "resolution": "NOT_FOUND"},
        ),
    }
    return client, channel, actions


CROSS_SITE = [
    {"origin": "https://evil.example"},
    {"origin": "http://testserver.evil.example"},
    {"origin": "http://testserver:8089"},  # another port is another origin (same site)
    {"origin": "null"},  # a sandboxed frame, a data: URL
    {"sec-fetch-site": "cross-site"},  # a browser that sent no Origin
    {"sec-fetch-site": "same-site"},
    {"origin": "http://testserver", "sec-fetch-site": "cross-site"},
]


@pytest.mark.parametrize("action", ["grant", "deny", "resolve"])
def test_a_decision_posted_from_another_web_site_is_refused_in_development_mode(
    action: str,
) -> None:
    """Without logins any page the operator's browser opens could post a decision to
    the local dashboard (CSRF): it was recorded, under whatever name the page chose."""
    client, channel, actions = _pending(OperatorAuth())
    path, form = actions[action]
    for headers in CROSS_SITE:
        response = client.post(path, data=form, headers=headers, follow_redirects=False)
        assert (response.status_code, channel.published) == (403, []), headers
        assert "another web site" in response.text and "nothing was recorded" in response.text
    # The dashboard's own pages, and clients that are not browsers, still act.
    for headers in (
        {"origin": "http://testserver", "sec-fetch-site": "same-origin"},
        {"origin": "http://testserver"},  # a browser that sends no Sec-Fetch-Site
        {"sec-fetch-site": "same-origin"},
        {},  # curl, scripts
        # Behind a reverse proxy that rewrites Host: the browser's own word counts...
        {"origin": "https://dash.example.com", "sec-fetch-site": "same-origin"},
        # ... and, from an older browser, the host the proxy says it was asked for.
        {"origin": "https://dash.example.com", "x-forwarded-host": "dash.example.com"},
    ):
        published = len(channel.published)
        response = client.post(path, data=form, headers=headers, follow_redirects=False)
        assert response.status_code == 303, (headers, response.text)
        assert len(channel.published) == published + 1


def test_with_logins_a_cross_site_post_is_refused_too_even_with_the_token() -> None:
    """Logged in, the session cookie is SameSite=Strict (a browser does not send it
    cross-site) and every action needs the session's CSRF token; a request that says it
    comes from another web site is refused before either is looked at."""
    client, channel, actions = _pending(
        OperatorAuth(users={"alice": hash_password("pw-of-alice-123")})
    )
    login = {"name": "alice", "password": "pw-of-alice-123"}
    refused = client.post(
        "/login", data=login, headers={"origin": "https://evil.example"}, follow_redirects=False
    )
    assert refused.status_code == 403 and "set-cookie" not in refused.headers  # login CSRF
    ok = client.post("/login", data=login, follow_redirects=False)
    cookie = ok.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
    token = re.search(r'name="csrf" value="([^"]+)"', client.get("/").text)
    assert token is not None
    path, _form = actions["grant"]
    for headers in CROSS_SITE:
        response = client.post(
            path, data={"csrf": token.group(1)}, headers=headers, follow_redirects=False
        )
        assert (response.status_code, channel.published) == (403, []), headers
    same = {"origin": "http://testserver", "sec-fetch-site": "same-origin"}
    response = client.post(
        path, data={"csrf": token.group(1)}, headers=same, follow_redirects=False
    )
    assert response.status_code == 303 and len(channel.published) == 1
    out = client.post(
        "/logout", data={"csrf": token.group(1)}, headers={"origin": "https://evil.example"}
    )
    assert out.status_code == 403 and 'id="who">alice<' in client.get("/").text


@pytest.mark.parametrize("action", ["grant", "deny", "resolve"])
def test_in_development_mode_a_page_whose_name_was_rebound_to_the_dashboard_is_refused(
    action: str,
) -> None:
    """DNS rebinding: a page at rebound.evil.example that has its name re-pointed to
    127.0.0.1 reads and posts to the local dashboard as its *own* origin (the browser
    says same-origin), so the cross-site check let it approve, deny or resolve under
    any name. Without logins the dashboard answers only to the names a person uses for
    it: localhost, an IP address, or those listed in SAGALINE_DASHBOARD_HOSTS."""
    client, channel, actions = _pending(OperatorAuth.from_env({}))
    path, form = actions[action]
    rebound = {
        "host": "rebound.evil.example:8088",
        "origin": "http://rebound.evil.example:8088",
        "sec-fetch-site": "same-origin",
    }
    response = client.post(path, data=form, headers=rebound, follow_redirects=False)
    assert (response.status_code, channel.published) == (403, []), response.text[:300]
    assert "SAGALINE_DASHBOARD_HOSTS" in response.text
    read = client.get("/api/state", headers={"host": "rebound.evil.example:8088"})
    assert read.status_code == 403
    assert client.get("/healthz", headers={"host": "dashboard:8088"}).status_code == 200
    for host in ("127.0.0.1:8088", "localhost:8088", "[::1]:8088", "10.1.2.3", "LOCALHOST"):
        same = {"host": host, "origin": f"http://{host}", "sec-fetch-site": "same-origin"}
        assert client.get("/api/state", headers={"host": host}).status_code == 200, host
        published = len(channel.published)
        response = client.post(path, data=form, headers=same, follow_redirects=False)
        assert response.status_code == 303 and len(channel.published) == published + 1, host
    named, named_channel, _ = _pending(
        OperatorAuth.from_env({"SAGALINE_DASHBOARD_HOSTS": "dash.internal, ops.example"})
    )
    named_host = {"host": "dash.internal:8088", "sec-fetch-site": "same-origin"}
    response = named.post(path, data=form, headers=named_host, follow_redirects=False)
    assert response.status_code == 303
    assert len(named_channel.published) == 1


def test_no_page_of_the_dashboard_can_be_framed_by_another_web_site() -> None:
    """Clickjacking: a page elsewhere that shows the dashboard in an invisible frame
    and gets the operator to click where Approve is posts a same-origin form, which the
    cross-site check cannot see (behind an SSO proxy whose cookie goes to frames, or in
    development mode, the click alone decided). Every answer forbids framing."""
    client, _channel, actions = _pending(OperatorAuth())
    path, form = actions["grant"]
    saga_id = path.split("/")[2]
    answers = [
        client.get("/"),
        client.get(f"/sagas/{saga_id}"),
        client.get("/fragment/actions"),
        client.get("/login"),
        client.post(path, data={"operator": " "}),  # an error page
        client.post(path, data=form, headers={"origin": "https://evil.example"}),  # refused
    ]
    for response in answers:
        headers = response.headers
        assert headers.get("x-frame-options") == "DENY", response.url
        assert "frame-ancestors 'none'" in headers.get("content-security-policy", "")
        assert headers.get("x-content-type-options") == "nosniff"


# ------------------------------------------------------------------------ /metrics


def test_metrics_need_a_login_when_viewing_does_unless_opened_for_a_scrape() -> None:
    """/metrics shows tenant names and money amounts (the remaining economic effect by
    tenant): it answered anyone while every page asked for a login."""
    users = {"alice": hash_password("pw-of-alice-123")}
    closed = _client(OperatorAuth(users=users))
    refused = closed.get("/metrics", follow_redirects=False)
    assert refused.status_code == 401, refused.text[:200]
    closed.post("/login", data={"name": "alice", "password": "pw-of-alice-123"})
    assert "sagaline_" in closed.get("/metrics").text  # logged in: the registry
    proxied = {PROXY_USER_HEADER: "prometheus", PROXY_SECRET_HEADER: "s3cret-of-the-proxy"}
    behind_proxy = _client(OperatorAuth(proxy_secret="s3cret-of-the-proxy"))
    assert behind_proxy.get("/metrics").status_code == 401
    assert behind_proxy.get("/metrics", headers=proxied).status_code == 200
    # Opened for a Prometheus scrape (or with viewing open): /metrics alone, not the pages.
    scrape = OperatorAuth.from_env(
        {"SAGALINE_DASHBOARD_USERS": "", "SAGALINE_DASHBOARD_METRICS_OPEN": "1"}
    )
    assert scrape.metrics_open and not OperatorAuth.from_env({}).metrics_open
    opened = _client(OperatorAuth(users=users, metrics_open=True))
    assert opened.get("/metrics").status_code == 200
    assert opened.get("/", follow_redirects=False).status_code == 303
    assert opened.get("/api/state").status_code == 401
    assert _client(OperatorAuth(users=users, read_open=True)).get("/metrics").status_code == 200
    assert _client(OperatorAuth()).get("/metrics").status_code == 200  # development mode


# ------------------------------------------------------------ the login configuration


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{}", "no operator"),
        ('["alice"]', "JSON object"),
        ('{"alice": {"hash": "scrypt$x$y"}}', "alice"),
        ('{"alice": "hunter2-in-clear"}', "alice"),
    ],
    ids=["empty", "a-list", "not-a-string", "not-a-hash"],
)
def test_a_users_file_without_usable_logins_is_refused_not_development_mode(
    tmp_path: Path, content: str, why: str
) -> None:
    """SAGALINE_DASHBOARD_USERS set to a file with no usable entry must not leave the
    dashboard open: an empty one turned logins off (development mode: anyone acts under
    any name) and a malformed one failed at the first login, or with a bare TypeError."""
    users = tmp_path / "users.json"
    users.write_text(content, encoding="utf-8")
    with pytest.raises(AuthConfigError, match=why):
        OperatorAuth.from_env({"SAGALINE_DASHBOARD_USERS": str(users)})


@pytest.mark.parametrize(
    "cut",
    [
        lambda h: h[: h.rindex("$")],  # the digest lost
        lambda h: h[:-8],  # the digest cut short
        lambda h: "scrypt$x$y",
        lambda h: h + "$more",
    ],
    ids=["no-digest", "short-digest", "not-base64", "extra-part"],
)
def test_a_users_file_entry_cut_short_is_refused_at_start_not_at_every_login(
    tmp_path: Path, cut: Callable[[str], str]
) -> None:
    """An entry that begins like a hash but is not a whole one (cut when pasted) passed
    the start-up check: the dashboard ran with logins on and that operator's every login
    failed as a wrong password, with no word of why. Refused at start, naming it."""
    users = tmp_path / "users.json"
    entry = cut(hash_password("pw-of-alice-123"))
    users.write_text(json.dumps({"alice": entry, "bob": hash_password("pw")}), encoding="utf-8")
    with pytest.raises(AuthConfigError, match="alice"):
        OperatorAuth.from_env({"SAGALINE_DASHBOARD_USERS": str(users)})


@pytest.mark.parametrize("pad", [(" ", ""), ("", " "), ("", "\n"), ("\t", "\r\n")])
def test_a_users_file_hash_with_whitespace_around_it_still_logs_its_operator_in(
    tmp_path: Path, pad: tuple[str, str]
) -> None:
    """Whitespace around a whole hash (pasted with the line's end, or a space): the
    base64 reading ignored it, so the operator logged in, until the strict start-up
    check read such an entry as "not a whole password hash" and stopped the dashboard
    on upgrade. A hash holds no whitespace: what surrounds it is not part of it."""
    users = tmp_path / "users.json"
    before, after = pad
    entry = before + hash_password("pw-of-alice-123") + after
    users.write_text(json.dumps({"alice": entry}), encoding="utf-8")
    auth = OperatorAuth.from_env({"SAGALINE_DASHBOARD_USERS": str(users)})
    assert auth.login("alice", "pw-of-alice-123") is not None
    assert auth.login("alice", "pw-of-alice-124") is None


@pytest.mark.parametrize("name", ["alice ", " alice", "alice\n"])
def test_a_users_file_name_with_surrounding_whitespace_is_refused_at_start(
    tmp_path: Path, name: str
) -> None:
    """The login form's name is stripped, so an entry "alice " could never log in:
    the dashboard started with logins on and that operator locked out, with no word
    of why. Refused at start, naming the entry."""
    users = tmp_path / "users.json"
    users.write_text(json.dumps({name: hash_password("pw-of-alice-123")}), encoding="utf-8")
    with pytest.raises(AuthConfigError, match="whitespace"):
        OperatorAuth.from_env({"SAGALINE_DASHBOARD_USERS": str(users)})


def test_keys_password_refuses_a_name_that_could_never_log_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import main

    assert main(["keys", "password", "alice "]) == 2
    assert "whitespace" in capsys.readouterr().err


def test_a_valid_users_file_enables_logins(tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"alice": hash_password("pw-of-alice-123")}), encoding="utf-8")
    auth = OperatorAuth.from_env({"SAGALINE_DASHBOARD_USERS": str(users)})
    assert auth.enabled and auth.login("alice", "pw-of-alice-123") is not None


def test_sagaline_dashboard_stops_with_the_reason_when_the_users_file_is_unusable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    users = tmp_path / "users.json"
    users.write_text("{}", encoding="utf-8")
    monkeypatch.setenv("SAGALINE_DASHBOARD_USERS", str(users))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "memory://dashboard-users-check")
    served: list[int] = []  # a dashboard that starts anyway is caught here, not left serving
    monkeypatch.setattr(Dashboard, "serve", lambda self, host, port: served.append(port))
    assert cli_main(["dashboard", "--port", "0"]) == 2
    assert served == []
    assert "SAGALINE_DASHBOARD_USERS" in capsys.readouterr().err


def _raw_post(
    app: Any, path: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> tuple[int, int]:
    """POST ``body`` straight to the ASGI app: (status, bytes of the body it read)."""
    read = 0
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)] or [b""]

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not chunks:
            return {"type": "http.disconnect"}
        chunk = chunks.pop(0)
        read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8088"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8088),
    }
    asyncio.run(app(scope, receive, send))
    return status[0], read


def test_an_oversized_form_is_refused_with_413_before_it_is_buffered() -> None:
    """Forms were parsed whole, with no overall limit: one POST could make the dashboard
    buffer about a gigabyte. A body over the limit is refused 413 and nothing is written,
    whether it says its length up front or not (chunked)."""
    state = DashboardState(SagalineMetrics("dashboard"))
    for record in awaiting_approval().records:
        state.apply(record)
    _, req = state.pending_approvals()[0]
    channel = RecordingChannel()
    app = create_app(state, channel)  # type: ignore[arg-type]
    path = f"/approvals/{req.saga_id}/{req.approval_id}/grant"
    body = b"operator=alice&reason=" + b"x" * (4 << 20)
    form = (b"content-type", b"application/x-www-form-urlencoded")
    length = (b"content-length", str(len(body)).encode())
    status, read = _raw_post(app, path, [form, length], body)
    assert status == 413 and read == 0  # refused on its stated length, unread
    status, read = _raw_post(app, path, [form], body)  # chunked: no length up front
    assert status == 413 and read < 1 << 20
    assert channel.published == []


def test_an_anonymous_post_is_refused_before_its_form_is_read() -> None:
    """With logins, a POST without a session is refused 401 without parsing its body."""
    app = create_app(
        DashboardState(SagalineMetrics("dashboard")),
        auth=OperatorAuth(users={"alice": hash_password("pw-of-alice-123")}),
    )
    form = (b"content-type", b"application/x-www-form-urlencoded")
    status, read = _raw_post(app, GRANT, [form], b"operator=alice&csrf=x")
    assert status == 401 and read == 0
    status, read = _raw_post(app, "/incidents/s-1/i-1/resolve", [form], b"resolution=done")
    assert status == 401 and read == 0


def test_the_session_cookie_is_secure_behind_a_trusted_tls_proxy(tmp_path: Path) -> None:
    """The cookie was Secure only when the app itself saw https; behind a proxy that
    ends TLS it went without, though docs/security.md says "Secure over https". The
    proxy's X-Forwarded-Proto counts when the proxy proves itself (the proxy secret),
    and SAGALINE_DASHBOARD_SECURE_COOKIE=1 makes it Secure always."""
    client = _client(OperatorAuth(proxy_secret="s3cret-of-the-proxy"))
    proxied = {PROXY_USER_HEADER: "alice", PROXY_SECRET_HEADER: "s3cret-of-the-proxy"}
    tls = {"x-forwarded-proto": "https"}
    page = client.get("/", headers={**proxied, **tls})
    assert page.status_code == 200 and "secure" in page.headers["set-cookie"].lower()
    plain = _client(OperatorAuth(proxy_secret="s3cret-of-the-proxy")).get("/", headers=proxied)
    assert "secure" not in plain.headers["set-cookie"].lower()  # http end to end

    users = tmp_path / "users.json"
    users.write_text(json.dumps({"alice": hash_password("pw-of-alice-123")}))
    login = {"name": "alice", "password": "pw-of-alice-123"}
    untrusted = _client(OperatorAuth.from_env({"SAGALINE_DASHBOARD_USERS": str(users)}))
    # Anyone can send the header: from a proxy not proven, it changes nothing.
    answer = untrusted.post("/login", data=login, headers=tls, follow_redirects=False)
    assert answer.status_code == 303 and "secure" not in answer.headers["set-cookie"].lower()
    env = {"SAGALINE_DASHBOARD_USERS": str(users), "SAGALINE_DASHBOARD_SECURE_COOKIE": "1"}
    always = _client(OperatorAuth.from_env(env))
    answer = always.post("/login", data=login, follow_redirects=False)
    assert answer.status_code == 303 and "secure" in answer.headers["set-cookie"].lower()


def test_without_logins_a_gateway_key_does_not_decide_in_another_operators_name(
    tmp_path: Path,
) -> None:
    """A dashboard holding a gateway key (``acts_for``) but run without logins
    (development mode) signed whatever name the form was given: anyone who reached the
    port approved "as alice", a record the coordinator accepts as the dashboard
    vouching for alice, who never logged in. It now decides only in its key's own name
    there (as every page says, unauthenticated) and refuses the rest, nothing recorded."""
    from sagaline.ops.actions import OperatorChannel
    from schemas.models import ApprovalGranted
    from schemas.topics import TopicNames
    from schemas.trust import Role
    from tests.trust_kit import TrustKit

    kit = TrustKit(tmp_path)
    kit.add("alice", Role.OPERATOR)
    kit.add("dashboard", Role.OPERATOR, acts_for=["alice"])
    channel = OperatorChannel(
        os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
        TopicNames("unused-"),
        kit.signer("dashboard"),
    )
    real_writer = channel._writer
    written: list[object] = []
    channel._writer = SimpleNamespace(  # type: ignore[assignment]
        append=lambda record, timeout_s=30.0: written.append(record), close=lambda: None
    )
    try:
        state = DashboardState(SagalineMetrics("dashboard"))
        for record in awaiting_approval().records:
            state.apply(record)
        ((saga, req),) = state.pending_approvals()
        client = TestClient(create_app(state, channel, auth=OperatorAuth(), clock=lambda: T0))
        path = f"/approvals/{saga.saga_id}/{req.approval_id}/grant"
        response = client.post(path, data={"operator": "alice"}, follow_redirects=False)
        assert (response.status_code, written) == (403, []), response.text
        assert "nothing was recorded" in response.text
        # In its own name it still decides (development mode: unauthenticated, as said).
        response = client.post(path, data={"operator": "dashboard"}, follow_redirects=False)
        assert response.status_code == 303, response.text
        assert [(r.granted_by, r.envelope.producer) for r in written] == [  # type: ignore[attr-defined]
            ("dashboard", "dashboard")
        ]
        assert isinstance(written[0], ApprovalGranted)
    finally:
        real_writer.close()
