"""``sagaline topics create`` and ``sagaline participant run``: deployable processes.

``participant run NAME`` serves one catalogue over Kafka. NAME is a participant of
the refund example (``services.refund``), or ``--catalogue MODULE[:ATTR]`` names its
catalogue the way ``catalogue check`` reads it (from the working directory: a
``Catalogue``, participant objects, or a zero-argument factory; see
``participants.discovery``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

from participants.catalogue import Catalogue
from participants.runtime import MAX_IN_FLIGHT, JournalUnusable, ParticipantRuntime
from sagaline.kafka import (
    DeliveryFailed,
    InstanceClaimed,
    KafkaException,
    TopicSetupError,
    configured_broker,
    ensure_topics,
)
from sagaline.ops.metrics import MetricsServerError, ParticipantMetrics, start_metrics_server
from schemas.settings import Settings
from services._args import (
    between,
    env_default,
    got,
    instance_id,
    port,
    unusable_participant,
)

log = logging.getLogger("sagaline.serve")


def _cmd_topics_create(args: argparse.Namespace) -> int:
    settings, bootstrap = configured_broker("sagaline topics create", answering=True)
    participants = [p for p in args.participants.split(",") if p]
    problem = unusable_participant(settings, participants)
    if problem:
        print(f"sagaline topics create: {problem}", file=sys.stderr)
        return 2
    try:
        created = ensure_topics(
            bootstrap,
            settings.topics,
            participants,
            settings.partitions,
            replication=settings.replication,
        )
    except TopicSetupError as exc:
        print(f"sagaline topics create: {exc}", file=sys.stderr)
        return 1
    except KafkaException as exc:
        print(
            f"sagaline topics create: the broker at {bootstrap} did not answer ({exc}); "
            "run it again once the broker is up (it creates only what is missing)",
            file=sys.stderr,
        )
        return 2
    for name in created:
        print(f"created {name}")
    print(f"topics ready on {bootstrap} ({len(created)} created)")
    return 0


def load_catalogue(name: str, spec: str | None, settings: Settings) -> Catalogue:
    """The catalogue to serve: ``module:attr`` when given, else the refund example's."""
    if spec:
        # The rule every command shares: imports from the working directory, takes a
        # Catalogue, participant objects or a factory (participants.discovery).
        from participants.discovery import load_catalogue as discover

        return discover(spec, name=name)
    from services.refund import build_catalogue
    from services.refund.faults import FaultPlan

    return build_catalogue(name, settings.state_dir / name, FaultPlan.from_env())


def _cmd_participant_run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings, bootstrap = configured_broker("sagaline participant run")
    from participants.discovery import DiscoveryError
    from participants.errors import CatalogueError
    from services.refund.errors import FaultPlanError  # SAGALINE_FAULTS, the example's

    try:
        # NAME is the command topic's suffix, the state directory's name and the first
        # part of every catalogue key: checked before anything is made from it (a
        # Catalogue given by --catalogue is not wrapped with it, so wrap() cannot).
        settings.topics.commands(args.name)
    except ValueError as exc:
        print(
            f"sagaline participant run: {exc}; use letters, digits, '.', '_' or '-'",
            file=sys.stderr,
        )
        return 2
    prog = f"sagaline participant run {args.name}"
    if not args.catalogue:
        from services.refund import PARTICIPANTS, UnknownParticipantError

        if args.name not in PARTICIPANTS:  # checked before its directories are made
            print(
                f"{prog}: {UnknownParticipantError(args.name)}; to serve your own tools,"
                " name their catalogue with --catalogue MODULE[:ATTR]",
                file=sys.stderr,
            )
            return 2
    journal = args.journal_dir or settings.state_dir / args.name
    where = "--journal-dir" if args.journal_dir else "SAGALINE_STATE_DIR"
    # Every directory it will write, checked first: one line naming it and where it
    # came from, not a traceback from deep in the refund store or the journal.
    dirs = [(journal, where)]
    if not args.catalogue:  # the refund example keeps its provider's state there too
        dirs.append((settings.state_dir / args.name, "SAGALINE_STATE_DIR"))
    for path, source in dirs:
        problem = _unusable_dir(path)
        if problem:
            print(f"{prog}: cannot use {path} ({source}): {problem}", file=sys.stderr)
            return 2
    try:
        catalogue = load_catalogue(args.name, args.catalogue, settings)
    except (DiscoveryError, CatalogueError, FaultPlanError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error) as exc:
        if args.catalogue:
            raise  # the catalogue's own code: its traceback is the report
        print(
            f"{prog}: cannot open the example's state under {settings.state_dir / args.name}"
            f" (SAGALINE_STATE_DIR): {exc}",
            file=sys.stderr,
        )
        return 2
    from services.refund import economic_effect

    metrics = ParticipantMetrics(args.name, effect=economic_effect)
    served: list[ParticipantRuntime] = []  # /healthz: 503 until its loop serves

    def health() -> str | None:
        return served[0].health() if served else "starting: opening its command journal"

    if args.metrics_port:
        try:
            start_metrics_server(args.metrics_port, metrics, settings.metrics_host, health=health)
        except MetricsServerError as exc:
            print(f"sagaline participant run {args.name}: {exc}", file=sys.stderr)
            return 2
    try:
        runtime = ParticipantRuntime(
            catalogue,
            settings,
            bootstrap,
            participant=args.name,
            instance_id=args.instance_id or args.name,
            state_dir=args.journal_dir,
            metrics=metrics,
            max_in_flight=args.max_in_flight,
            journal_keep_ms=args.journal_keep_ms,
        )
    except sqlite3.Error as exc:  # only the command journal is opened here
        print(
            f"{prog}: cannot open the command journal {journal / 'commands.sqlite'} ({where}):"
            f" {exc}",
            file=sys.stderr,
        )
        return 2
    served.append(runtime)
    runtime.install_signal_handlers()
    ready = threading.Event()  # set once the loop serves: a failure before is a start's
    try:
        runtime.run(ready=ready)
    # the topics, the journal, a twin serving this instance id: one line
    except (TopicSetupError, JournalUnusable, InstanceClaimed) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (KafkaException, DeliveryFailed) as exc:
        if ready.is_set():
            raise  # the loop's own failure (fenced): its traceback is the report
        from services.coordinator_cli import start_failed

        print(f"{prog}: {start_failed(bootstrap, exc)}", file=sys.stderr)
        return 2
    return 0


def _unusable_dir(path: Path) -> str | None:
    """Why this process cannot keep its files in ``path`` (made if missing), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return "not readable and writable by this user"
    return None


def register(subparsers: Any) -> None:
    topics = subparsers.add_parser("topics", help="create the Sagaline topics")
    topics_sub = topics.add_subparsers(dest="topics_command", required=True)
    create = topics_sub.add_parser("create", help="create every missing topic (idempotent)")
    create.add_argument(
        "--participants", default="", help="comma-separated participants (command topics)"
    )
    create.add_argument(
        "--dev-broker",
        action="store_true",
        help="development only: use (or start) the local broker when KAFKA_BOOTSTRAP_SERVERS "
        "is unset",
    )
    create.set_defaults(func=_cmd_topics_create)

    participant = subparsers.add_parser("participant", help="run a participant service")
    participant_sub = participant.add_subparsers(dest="participant_command", required=True)
    run = participant_sub.add_parser("run", help="serve a catalogue on its command topic")
    run.add_argument("name", help="participant name (its command topic)")
    run.add_argument("--catalogue", help="module:attr of a Catalogue (default: refund example)")
    run.add_argument("--metrics-port", type=port, default=0, help="Prometheus port (0: off)")
    run.add_argument(
        "--max-in-flight",
        type=between(1, MAX_IN_FLIGHT),
        # A string: argparse converts it only when this command runs, so a bad value in
        # the environment is this command's usage error, not every command's traceback.
        default=env_default("SAGALINE_MAX_IN_FLIGHT") or "16",
        help="commands of different sagas run at once (one saga's stay in order; default "
        f"$SAGALINE_MAX_IN_FLIGHT, else 16; 1 to {MAX_IN_FLIGHT})",
    )
    run.add_argument(
        "--instance-id",
        type=instance_id,
        default=env_default("SAGALINE_INSTANCE_ID", "HOSTNAME"),
        help="distinct per replica, stable across restarts (default: $SAGALINE_INSTANCE_ID, "
        "else $HOSTNAME, which is per container under docker compose --scale; else the "
        "participant name)",
    )
    run.add_argument(
        "--dev-broker",
        action="store_true",
        help="development only: use (or start) the local broker when KAFKA_BOOTSTRAP_SERVERS "
        "is unset",
    )
    run.add_argument(
        "--journal-dir",
        type=Path,
        default=None,
        help="this replica's command journal (default: <state dir>/<name>); replicas may "
        "share one on a local disk, never on a network file system (docs/operating.md)",
    )
    run.add_argument(
        "--journal-keep-ms",
        type=_journal_keep,
        default=env_default("SAGALINE_JOURNAL_KEEP_MS") or "auto",
        help="how long finished commands stay in the journal: 'auto' (from the command "
        "topic's retention.ms and segment.ms, plus a day), -1 (never pruned) or "
        "milliseconds (default $SAGALINE_JOURNAL_KEEP_MS, else auto; docs/operating.md)",
    )
    run.set_defaults(func=_cmd_participant_run)


def _journal_keep(text: str) -> int | None:
    """``--journal-keep-ms``: None for ``auto``, -1 for never, else milliseconds."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto', -1 or a number of milliseconds >= 1, {got(text)}"
        ) from None
    if value == 0 or value < -1:
        raise argparse.ArgumentTypeError(
            f"expected 'auto', -1 or a number of milliseconds >= 1, {got(text, value)}"
        )
    return value
