"""The `sagaline` command line.

Each area of the project owns its sub-commands in its own module, which exposes
``register(subparsers)``; this file only wires them together, so adding a command
never means editing another area's code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from sagaline.kafka import BrokerNotConfigured, BrokerUnreachable, KafkaConfigError
from schemas.settings import SettingsError
from schemas.trust import TrustFileError

# Modules that contribute sub-commands. Each has `register(subparsers) -> None`,
# and every parser it adds sets `func=callable(args) -> int` as its default.
COMMAND_MODULES: tuple[str, ...] = (
    "services.kafka_cli",
    "services.serve",
    "participants.cli",
    "services.coordinator_cli",
    "services.demo",
    "services.dashboard",
    "services.keys_cli",
    "sagaline.cli",
    "services.drill.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sagaline",
        description="Recoverable side effects for AI-agent tool calls, over Kafka.",
    )
    parser.add_argument("--version", action="version", version=f"sagaline {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # that area is not built yet
        module.register(subparsers)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sagaline")
    except PackageNotFoundError:
        return "0+unknown (not installed)"


PARENT_PID_VAR = "SAGALINE_PARENT_PID"
"""Set by a supervisor that starts services as its children (the demo, the tests):
the service stops (SIGTERM to itself) once that process is gone, instead of running
on with nobody to stop it when its supervisor died without cleaning up."""


def watch_parent(interval_s: float = 1.0) -> None:
    """If ``SAGALINE_PARENT_PID`` names this process's parent, stop this process once
    it has another (the parent died and it was re-parented)."""
    wanted = os.environ.get(PARENT_PID_VAR, "")
    if not wanted.isdigit() or int(wanted) != os.getppid():
        return
    parent = int(wanted)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)  # a poll: the kernel tells a child nothing else
        print(f"parent process {parent} is gone: stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    watch_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        if getattr(args, "dev_broker", False) and not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            # Development only: the broker choice is imported on this path and no other.
            from services.broker import resolve_bootstrap

            os.environ["KAFKA_BOOTSTRAP_SERVERS"] = resolve_bootstrap()
        result: int = func(args)
    except (
        BrokerNotConfigured,
        BrokerUnreachable,
        KafkaConfigError,
        SettingsError,
        TrustFileError,
    ) as exc:
        text = str(exc)
        if isinstance(exc, BrokerNotConfigured) and hasattr(args, "dev_broker"):
            # Only the commands that take the flag are told about it.
            text = text.removesuffix(".") + ", or pass --dev-broker."
        print(f"error: {text}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not _launcher_error(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return result


def _launcher_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the local broker launcher's (``sagaline demo``, ``drill``,
    ``--dev-broker`` could not start the broker; its message says what to do).
    Checked without importing the launcher here: only a loaded launcher raises it."""
    launcher = sys.modules.get("services.kafka_local")
    return launcher is not None and isinstance(exc, launcher.KafkaLauncherError)


if __name__ == "__main__":
    sys.exit(main())
