"""``sagaline kafka up|down|status``: manage the local single-node Kafka broker.

The broker itself lives in :mod:`services.kafka_local`; this module is only the
command-line face of it, so scripts (``scripts/test.sh``, ``scripts/demo.sh``) and
people use one entry point. ``up`` prints the bootstrap address as the *last line*
of stdout so scripts can capture it with ``tail -n1``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services import kafka_local


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        result = kafka_local.ensure_running(
            args.state_dir,
            port=args.port,
            controller_port=args.controller_port,
            version=args.kafka_version,
            timeout=args.timeout,
        )
    except kafka_local.KafkaLauncherError as exc:
        print(f"sagaline kafka up: {exc}", file=sys.stderr)
        return 1
    how = "started" if result.started else "already running"
    print(
        f"kafka: {how}: Kafka {result.version}, pid {result.pid}, state {result.state_dir}",
        file=sys.stderr,
    )
    print(result.bootstrap, flush=True)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        stopped = kafka_local.down(args.state_dir, timeout=args.timeout)
    except kafka_local.KafkaLauncherError as exc:
        print(f"sagaline kafka down: {exc}", file=sys.stderr)
        return 1
    print("kafka: stopped" if stopped else "kafka: was not running")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    st = kafka_local.status(args.state_dir)
    print(f"kafka: {st.detail}")
    print(f"state dir: {st.state_dir}")
    print(f"log: {st.log_file}")
    if st.running and st.bootstrap:
        print(st.bootstrap)
    return 0 if st.running else 1


def register(subparsers: Any) -> None:
    """Add ``kafka`` and its sub-commands to the ``sagaline`` parser."""
    kafka = subparsers.add_parser(
        "kafka",
        help="run the local single-node Kafka broker (no Docker)",
        description="Run a real single-node KRaft Kafka broker on loopback, cached between "
        "runs. See docs/kafka-local.md.",
    )
    kafka.set_defaults(func=lambda _args: (kafka.print_help(), 2)[1])
    sub = kafka.add_subparsers(dest="kafka_command", metavar="{up,down,status}")

    def state_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--state-dir",
            default=None,
            help=f"broker state dir (default {kafka_local.default_state_dir()})",
        )

    p_up = sub.add_parser("up", help="start the broker (or reuse it); print its bootstrap")
    state_arg(p_up)
    p_up.add_argument("--port", type=int, default=None, help="client port (default: free)")
    p_up.add_argument("--controller-port", type=int, default=None)
    p_up.add_argument(
        "--kafka-version", default=None, help="Kafka version (default: first that resolves)"
    )
    p_up.add_argument("--timeout", type=float, default=None, help="start-up timeout, seconds")
    p_up.set_defaults(func=_cmd_up)

    p_down = sub.add_parser("down", help="stop the broker (SIGTERM, then SIGKILL)")
    state_arg(p_down)
    p_down.add_argument("--timeout", type=float, default=kafka_local.DEFAULT_STOP_TIMEOUT)
    p_down.set_defaults(func=_cmd_down)

    p_status = sub.add_parser("status", help="exit 0 if the broker runs and answers, else 1")
    state_arg(p_status)
    p_status.set_defaults(func=_cmd_status)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.kafka_cli up|down|status``: the same commands without the
    rest of the ``sagaline`` CLI, so scripts that only need the broker do not depend
    on every other area's commands importing cleanly."""
    parser = argparse.ArgumentParser(prog="sagaline")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["kafka", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
