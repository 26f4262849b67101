"""``sagaline kafka up|down|status``: manage the local Kafka broker (or a local cluster).

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
from services._args import at_least


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        if args.brokers > 1:
            if args.fresh:
                raise kafka_local.KafkaLauncherError(
                    "--fresh is for the single broker; to empty a cluster, `sagaline kafka "
                    "down --brokers N` and remove its state dir"
                )
            if args.port is not None or args.controller_port is not None:
                raise kafka_local.KafkaLauncherError(
                    "--port/--controller-port name one node's ports; a cluster picks free "
                    "ones for every node and remembers them in its state dir"
                )
            result = kafka_local.ensure_cluster(
                args.state_dir,
                brokers=args.brokers,
                version=args.kafka_version,
                timeout=args.timeout,
            )
        else:
            result = kafka_local.ensure_running(
                args.state_dir,
                fresh=args.fresh,
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


def _state_dir(args: argparse.Namespace) -> str | None:
    """``--state-dir``, else the default dir of a ``--brokers N`` cluster (N > 1), else
    None (the single broker's)."""
    if args.state_dir:
        return str(args.state_dir)
    return str(kafka_local.default_cluster_dir(args.brokers)) if args.brokers > 1 else None


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        stopped = kafka_local.down(_state_dir(args), timeout=args.timeout)
    except kafka_local.KafkaLauncherError as exc:
        print(f"sagaline kafka down: {exc}", file=sys.stderr)
        return 1
    print("kafka: stopped" if stopped else "kafka: was not running")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        st = kafka_local.status(_state_dir(args))
    except kafka_local.KafkaLauncherError as exc:  # e.g. a cluster's damaged ports file
        print(f"sagaline kafka status: {exc}", file=sys.stderr)
        return 1
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
        help="run the local Kafka broker, or a local cluster (no Docker)",
        description="Run a real KRaft Kafka broker (or, with up --brokers N, an N-node "
        "cluster) on loopback, cached between runs. See docs/kafka-local.md.",
    )
    kafka.set_defaults(func=lambda _args: (kafka.print_help(), 2)[1])
    sub = kafka.add_subparsers(dest="kafka_command", metavar="{up,down,status}")

    def state_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--state-dir",
            default=None,
            help=f"broker state dir (default {kafka_local.default_state_dir()})",
        )
        if p is not p_up:
            p.add_argument(
                "--brokers",
                type=at_least(1),
                default=1,
                help="N>1: the N-node cluster's default dir",
            )

    p_up = sub.add_parser("up", help="start the broker (or reuse it); print its bootstrap")
    state_arg(p_up)
    p_up.add_argument("--port", type=int, default=None, help="client port (default: free)")
    p_up.add_argument("--controller-port", type=int, default=None)
    p_up.add_argument(
        "--kafka-version", default=None, help="Kafka version (default: first that resolves)"
    )
    p_up.add_argument("--timeout", type=float, default=None, help="start-up timeout, seconds")
    p_up.add_argument(
        "--fresh",
        action="store_true",
        help="stop the broker if it runs and start it on an empty data dir (every topic "
        "is deleted; ports are kept)",
    )
    p_up.add_argument(
        "--brokers",
        type=at_least(1),
        default=1,
        help="1: the single broker (default); N>1: an N-node KRaft cluster on loopback "
        "(state dir default <cache>/cluster-N; prints every node's address)",
    )
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
