"""The operators' dashboard: sagas by status, timelines, receipts, actions, measures.

It follows ``sagaline.events``, ``sagaline.terminal`` and ``sagaline.incidents`` from
the beginning into an in-memory view (so a restart loses nothing), serves pages from
that view, and turns an operator's approve / deny / resolve into records on the
ledger through :mod:`sagaline.ops.actions` (the CLI's path too).

Example::

    dashboard = Dashboard.from_settings(Settings.from_env())
    dashboard.serve(port=8088)           # blocks; or build dashboard.app for tests

    $ sagaline dashboard --port 8088
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Mapping

from sagaline.kafka import require_bootstrap
from sagaline.ops.actions import OperatorChannel
from sagaline.ops.metrics import SagalineMetrics
from schemas.settings import Settings
from schemas.trust import IdentitySigner
from services._args import port
from services.dashboard.app import create_app
from services.dashboard.auth import AuthConfigError, OperatorAuth
from services.dashboard.consumer import LedgerFollower
from services.dashboard.view import (
    DEFAULT_ENDED_SAGAS,
    DashboardState,
    SagaFilter,
    SagaStatus,
    SagaView,
)

DEFAULT_PORT = 8088


class DashboardConfigError(ValueError):
    """A dashboard setting cannot be used; the message says why."""


def ended_sagas_from_env(env: Mapping[str, str] | None = None) -> int:
    """``SAGALINE_DASHBOARD_ENDED_SAGAS``: ended, settled sagas kept in memory (unset or
    empty: :data:`DEFAULT_ENDED_SAGAS`)."""
    env = os.environ if env is None else env
    raw = env.get("SAGALINE_DASHBOARD_ENDED_SAGAS", "").strip()
    if not raw:
        return DEFAULT_ENDED_SAGAS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise DashboardConfigError(
            f"SAGALINE_DASHBOARD_ENDED_SAGAS={raw!r}: expected a whole number of ended "
            f"sagas to keep in memory, 0 or more (unset: {DEFAULT_ENDED_SAGAS})"
        )
    return value


class Dashboard:
    """One dashboard process: state, Kafka follower, operator channel and the ASGI app."""

    def __init__(
        self,
        bootstrap: str,
        settings: Settings,
        auth: OperatorAuth | None = None,
        ended_sagas: int | None = None,
    ) -> None:
        """``ended_sagas`` None: from ``SAGALINE_DASHBOARD_ENDED_SAGAS``."""
        self.settings = settings
        from services.refund import economic_effect

        signer = settings.signer()
        self.state = DashboardState(
            SagalineMetrics("dashboard", effect=economic_effect),
            # The coordinator binds writers with a trust file (identities): so does the view.
            bind_writers=isinstance(signer, IdentitySigner),
            ended_sagas=ended_sagas_from_env() if ended_sagas is None else ended_sagas,
        )
        self.follower = LedgerFollower(bootstrap, settings.topics, signer, self.state)
        self.channel = OperatorChannel(bootstrap, settings.topics, signer, settings.limits)
        self.auth = auth or OperatorAuth.from_env()
        self.app = create_app(self.state, self.channel, self.follower, auth=self.auth)

    @classmethod
    def from_settings(cls, settings: Settings, bootstrap: str | None = None) -> Dashboard:
        """``bootstrap`` overrides; else the settings' (never a broker started here)."""
        return cls(bootstrap or require_bootstrap(settings, "sagaline dashboard"), settings)

    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        sockets: list[socket.socket] | None = None,
    ) -> None:
        """Run the HTTP server until interrupted (the follower runs with the app), on
        ``sockets`` when given (from :func:`listen`), else on ``host:port``; raises
        :class:`DashboardBindError` when it cannot listen there."""
        import signal

        import uvicorn

        if sockets is None:
            sockets = listen(host, port)
        # uvicorn re-raises the signal that stopped it once it has shut down; with a
        # handler of ours in place that ends the process with 0, a clean stop.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _exit_cleanly)
        server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="info"))
        server.run(sockets=sockets)
        if not server.started:  # as uvicorn.run: the app's start-up failed
            raise SystemExit(3)


class DashboardBindError(Exception):
    """The dashboard could not listen where it was told to."""


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``host:port`` (every address the name resolves to, as uvicorn
    binds them; with port 0, all on the free port the first one took, the one port
    printed at start), or :class:`DashboardBindError` saying why not: bound here,
    before uvicorn runs, so a port in use is one line and exit 2 like
    ``--metrics-port``, not uvicorn's log line and its exit code 3."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _name, address in dict.fromkeys(
            (i[0], i[1], i[2], "", i[4]) for i in infos
        ):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: each address family on its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the free port the first one took, on all
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
    except OSError as exc:  # in use, an address not of this host, a name that does not resolve
        for sock in sockets:
            sock.close()
        raise DashboardBindError(
            f"cannot serve the dashboard on {host}:{port} (--host {host} --port {port}): "
            f"{exc.strerror or exc}"
        ) from None
    return sockets


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        sockets = listen(args.host, args.port)
    except DashboardBindError as exc:
        print(f"sagaline dashboard: {exc}", file=sys.stderr)
        return 2
    try:
        dashboard = Dashboard.from_settings(Settings.from_env(), args.bootstrap)
    except BaseException as exc:
        for sock in sockets:
            sock.close()
        if not isinstance(exc, AuthConfigError | DashboardConfigError):
            raise
        print(f"error: {exc}", file=sys.stderr)  # what to fix, not a traceback
        return 2
    # The port bound, not the one asked for: --port 0 takes a free one, which this
    # line is the only place to learn.
    bound = sockets[0].getsockname()[1] if sockets else args.port
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"sagaline dashboard on http://{host}:{bound}/", flush=True)
    dashboard.serve(args.host, bound, sockets)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``sagaline dashboard``."""
    parser = subparsers.add_parser(
        "dashboard",
        help="serve the operators' dashboard (sagas, timelines, receipts, approvals)",
        description="Serve the operators' dashboard. Reads the topics from the beginning "
        "on start; configuration from the environment (KAFKA_BOOTSTRAP_SERVERS, "
        "SAGALINE_TOPIC_PREFIX, SAGALINE_HMAC_KEY or SAGALINE_TRUST_FILE; operator logins: "
        "SAGALINE_DASHBOARD_USERS or SAGALINE_DASHBOARD_PROXY_SECRET; "
        "SAGALINE_DASHBOARD_READ_OPEN, SAGALINE_DASHBOARD_METRICS_OPEN open viewing, or "
        "/metrics alone, without a login; without logins SAGALINE_DASHBOARD_HOSTS names "
        "the hosts it may be reached by besides localhost and IP addresses; "
        "SAGALINE_DASHBOARD_SECURE_COOKIE=1 makes the session cookie always Secure; see "
        "docs/security.md; SAGALINE_DASHBOARD_ENDED_SAGAS bounds the ended sagas kept in "
        f"memory, {DEFAULT_ENDED_SAGAS} by default).",
    )
    parser.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help="HTTP port (8088; 0: a free one, printed at start)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1)")
    parser.add_argument(
        "--bootstrap", default=None, help="Kafka bootstrap servers (overrides the environment)"
    )
    parser.add_argument(
        "--dev-broker",
        action="store_true",
        help="development only: use (or start) the local broker when KAFKA_BOOTSTRAP_SERVERS "
        "is unset",
    )
    parser.set_defaults(func=_run)


__all__ = [
    "DEFAULT_ENDED_SAGAS",
    "DEFAULT_PORT",
    "Dashboard",
    "DashboardConfigError",
    "DashboardState",
    "LedgerFollower",
    "OperatorAuth",
    "SagaFilter",
    "SagaStatus",
    "SagaView",
    "create_app",
    "ended_sagas_from_env",
    "register",
]
