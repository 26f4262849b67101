"""Who is acting on the dashboard: operator login, sessions, CSRF tokens.

Two ways to authenticate, configured by environment variables (docs/security.md):

* ``SAGALINE_DASHBOARD_USERS``: a JSON file ``{"alice": "scrypt$...", ...}`` of
  password hashes (``sagaline keys password alice`` prints one). Operators log in at
  ``/login``.
* ``SAGALINE_DASHBOARD_PROXY_SECRET``: a reverse proxy that has authenticated the
  operator sends ``X-Sagaline-Operator: alice`` and ``X-Sagaline-Proxy-Secret: <the
  secret>``; requests without the secret are anonymous.

Either way the dashboard keeps a server-side session (cookie ``sagaline_session``,
HttpOnly, SameSite=Strict) holding the operator and a CSRF token that every action
form carries: a POST without a session, or with another token, is refused. The
operator recorded as approver is the session's, never a form field. The cookie is
``Secure`` when the browser reached the dashboard over https: seen by the server itself,
or said by the proxy that holds the proxy secret (``X-Forwarded-Proto``), or always with
``SAGALINE_DASHBOARD_SECURE_COOKIE=1``.
``SAGALINE_DASHBOARD_READ_OPEN=1`` lets anyone view (never act) without logging in;
``SAGALINE_DASHBOARD_METRICS_OPEN=1`` lets anyone read ``/metrics`` alone (a
Prometheus scrape), which otherwise needs a login like every page.

With neither configured the dashboard behaves as before (a free-text operator name),
a development mode it states on every page. In both modes the app refuses a POST a
browser marks as coming from another web site (``services.dashboard.app.SameOriginOnly``);
in development mode it also answers only to a ``Host`` that is localhost, an IP address
or a name in ``SAGALINE_DASHBOARD_HOSTS`` (a page whose DNS name was re-pointed at the
dashboard is same-origin to the browser).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

SESSION_COOKIE = "sagaline_session"
PROXY_USER_HEADER = "x-sagaline-operator"
PROXY_SECRET_HEADER = "x-sagaline-proxy-secret"
SESSION_TTL_S = 8 * 3600

_SCRYPT = {"n": 2**14, "r": 8, "p": 1}


class AuthConfigError(ValueError):
    """The dashboard's login configuration cannot be used; the message says why."""


def hash_password(password: str, salt: bytes | None = None) -> str:
    """``scrypt$<salt b64>$<hash b64>``: what the users file stores, never the password."""
    salt = salt or os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, dklen=32, **_SCRYPT)
    return f"scrypt${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _parse_hash(stored: str) -> tuple[bytes, bytes] | None:
    """``(salt, digest)`` of a whole :func:`hash_password` entry, else None."""
    try:
        scheme, salt_b64, digest_b64 = stored.split("$")
        salt = base64.b64decode(salt_b64, validate=True)
        digest = base64.b64decode(digest_b64, validate=True)
    except ValueError:
        return None
    if scheme != "scrypt" or not salt or len(digest) != 32:
        return None
    return salt, digest


def check_password(password: str, stored: str) -> bool:
    parsed = _parse_hash(stored)
    if parsed is None:
        return False
    salt, digest = parsed
    given = hashlib.scrypt(password.encode(), salt=salt, dklen=32, **_SCRYPT)
    return hmac.compare_digest(given, digest)


def _flag(env: Mapping[str, str], name: str) -> bool:
    """``1``/``true``/``yes`` on, unset or ``0``/``false``/``no`` off; anything else is
    refused, not read as off (``SAGALINE_DASHBOARD_SECURE_COOKIE=on`` was)."""
    value = env.get(name, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("", "0", "false", "no"):
        return False
    raise AuthConfigError(
        f"{name}={env[name]!r}: expected 1 (or true, yes) to turn it on, 0 (or false, no,"
        " or unset) for off"
    )


def _read_users(path: str) -> dict[str, str]:
    """The users file, refused unless it holds at least one name -> scrypt hash.

    Logins are on exactly when some user exists, so an empty (or unreadable as such)
    file must stop the dashboard: it silently ran in development mode, where anyone
    acts under any name, and a malformed entry failed only at that operator's login."""
    fix = "it must be a JSON object of name -> hash (`sagaline keys password NAME` prints one)"
    try:
        users = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AuthConfigError(f"SAGALINE_DASHBOARD_USERS={path}: {exc}; {fix}") from None
    if not isinstance(users, dict):
        raise AuthConfigError(
            f"SAGALINE_DASHBOARD_USERS={path}: a {type(users).__name__}, not a JSON object; {fix}"
        )
    if not users:
        raise AuthConfigError(
            f"SAGALINE_DASHBOARD_USERS={path} names no operator, so no one could log in "
            f"and logins would be off; {fix}, or unset the variable for development mode"
        )
    for name, stored in users.items():
        if isinstance(stored, str):
            # A hash holds no whitespace: around it (pasted with a line's end) it is not
            # part of it, as the base64 reading always ignored it.
            stored = users[name] = stored.strip()
        if not name.strip() or not isinstance(stored, str) or not stored.startswith("scrypt$"):
            raise AuthConfigError(
                f"SAGALINE_DASHBOARD_USERS={path}: the entry of {name!r} is not a password "
                f"hash; {fix}"
            )
        if _parse_hash(stored) is None:
            # Begins like one but is not whole (cut when pasted): every login of this
            # operator would fail as a wrong password.
            raise AuthConfigError(
                f"SAGALINE_DASHBOARD_USERS={path}: the entry of {name!r} is not a whole "
                f"password hash (scrypt$<salt>$<32-byte digest>, in base64); {fix}"
            )
        if name != name.strip():
            # The login form's name is stripped (as the proxy's header is): this entry
            # could never log in.
            raise AuthConfigError(
                f"SAGALINE_DASHBOARD_USERS={path}: the name {name!r} begins or ends with "
                f"whitespace, so its operator could never log in (a typed name is "
                f"stripped); write it as {name.strip()!r}"
            )
    return users


@dataclass(frozen=True)
class Session:
    operator: str
    csrf: str
    expires: float
    via: str  # "password" or "proxy"


class OperatorAuth:
    """Logins, sessions and CSRF checks for the dashboard (``enabled`` is False in the
    development mode, where nothing is checked)."""

    def __init__(
        self,
        users: Mapping[str, str] | None = None,
        proxy_secret: str | None = None,
        read_open: bool = False,
        metrics_open: bool = False,
        dev_hosts: Collection[str] | None = None,
        secure_cookie: bool = False,
    ) -> None:
        self._users = dict(users or {})
        # The session cookie is always Secure (SAGALINE_DASHBOARD_SECURE_COOKIE): for a
        # TLS-ending proxy that does not send the proxy secret.
        self.secure_cookie = secure_cookie
        self._proxy_secret = proxy_secret or None
        self.read_open = read_open
        # /metrics without a login (a Prometheus scrape), the pages still behind one.
        self.metrics_open = metrics_open
        # Development mode only: the Host names a browser may reach the dashboard by,
        # besides localhost and IP addresses (DNS rebinding; None: not checked).
        self.dev_hosts = (
            None if dev_hosts is None else frozenset(h.strip().lower() for h in dev_hosts)
        )
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorAuth:
        env = os.environ if env is None else env
        users: dict[str, str] = {}
        path = env.get("SAGALINE_DASHBOARD_USERS")
        if path:
            users = _read_users(path)
        return cls(
            users,
            env.get("SAGALINE_DASHBOARD_PROXY_SECRET"),
            _flag(env, "SAGALINE_DASHBOARD_READ_OPEN"),
            _flag(env, "SAGALINE_DASHBOARD_METRICS_OPEN"),
            [h for h in env.get("SAGALINE_DASHBOARD_HOSTS", "").split(",") if h.strip()],
            _flag(env, "SAGALINE_DASHBOARD_SECURE_COOKIE"),
        )

    @property
    def enabled(self) -> bool:
        return bool(self._users) or self._proxy_secret is not None

    @property
    def uses_passwords(self) -> bool:
        return bool(self._users)

    # ---------------------------------------------------------------- sessions

    def login(self, name: str, password: str) -> str | None:
        """A new session token for valid credentials, else None."""
        stored = self._users.get(name)
        # Hash anyway for an unknown name, so timing does not tell names apart.
        ok = check_password(password, stored or hash_password("", b"\0" * 16))
        if stored is None or not ok:
            return None
        return self._open(name, "password")

    def _open(self, operator: str, via: str) -> str:
        token = secrets.token_urlsafe(32)
        now = time.time()
        session = Session(operator, secrets.token_urlsafe(32), now + SESSION_TTL_S, via)
        with self._lock:
            # Sessions never presented again (a client that keeps no cookie opens one
            # per request behind a proxy) go when they expire, not never.
            for stale in [t for t, s in self._sessions.items() if s.expires < now]:
                del self._sessions[stale]
            self._sessions[token] = session
        return token

    def logout(self, token: str | None) -> None:
        with self._lock:
            self._sessions.pop(token or "", None)

    def session(
        self, token: str | None, headers: Mapping[str, str]
    ) -> tuple[Session | None, str | None]:
        """The caller's session and, when one was opened for a proxy-authenticated
        operator just now, its new token (to set as the cookie)."""
        proxied = self._proxy_operator(headers)
        with self._lock:
            found = self._sessions.get(token or "")
            if found is not None and found.expires < time.time():
                del self._sessions[token or ""]
                found = None
        if proxied is None:
            # Without the proxy's headers only a password session counts.
            return (found if found is not None and found.via == "password" else None), None
        if found is not None and found.operator == proxied and found.via == "proxy":
            return found, None
        fresh = self._open(proxied, "proxy")
        with self._lock:
            return self._sessions[fresh], fresh

    def _proxy_operator(self, headers: Mapping[str, str]) -> str | None:
        if not self._from_proxy(headers):
            return None
        return headers.get(PROXY_USER_HEADER, "").strip() or None

    def _from_proxy(self, headers: Mapping[str, str]) -> bool:
        """The request came through the configured proxy (it holds the proxy secret)."""
        if self._proxy_secret is None:
            return False
        given = headers.get(PROXY_SECRET_HEADER, "")
        return hmac.compare_digest(given.encode(), self._proxy_secret.encode())

    def cookie_secure(self, scheme: str, headers: Mapping[str, str]) -> bool:
        """Whether the session cookie gets ``Secure``: always with ``secure_cookie``;
        when this server saw https (uvicorn applies ``X-Forwarded-Proto`` itself from
        the addresses in ``FORWARDED_ALLOW_IPS``); or when the proxy that proved itself
        with the proxy secret says the browser used https (``X-Forwarded-Proto``, its
        first value). The header from anyone else counts for nothing."""
        if self.secure_cookie or scheme == "https":
            return True
        proto = headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
        return proto == "https" and self._from_proxy(headers)

    @staticmethod
    def csrf_ok(expected: str | None, given: str | None) -> bool:
        """The form's token is the session's (both present, compared in constant time)."""
        return bool(expected and given) and hmac.compare_digest(
            str(expected).encode(), str(given).encode()
        )


__all__ = [
    "AuthConfigError",
    "OperatorAuth",
    "Session",
    "check_password",
    "hash_password",
]
