"""Operator commands: run the coordinator, read a saga, approve, deny, resolve.

A deployable (it wires the coordinator to the operator layer, ``sagaline.ops``, and to
the refund example's effect measure), so it lives in ``services/``.

Every decision goes onto the ledger through ``sagaline.ops.actions`` (the same
path the dashboard uses); nothing here touches a service's state directly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import orjson

from sagaline.kafka import LedgerReader, TopicMissing, configured_broker
from schemas import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    IncidentRaised,
    IncidentResolved,
    Record,
    SagaTerminal,
)
from schemas.receipt import Receipt
from schemas.settings import Settings


def _operator(args: argparse.Namespace) -> str | None:
    who: str | None = args.operator or os.environ.get("SAGALINE_OPERATOR")
    if not who:
        print(
            "an operator identity is required: --operator NAME (or SAGALINE_OPERATOR)",
            file=sys.stderr,
        )
    return who


# -------------------------------------------------------------------- run


def _cmd_run(args: argparse.Namespace) -> int:
    settings, bootstrap = configured_broker("sagaline coordinator run")
    from coordinator.shell import Coordinator
    from sagaline.kafka import ensure_topics
    from sagaline.ops.metrics import CoordinatorMetrics, start_metrics_server
    from services.refund import economic_effect

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    participants = [p for p in args.participants.split(",") if p]
    ensure_topics(
        bootstrap,
        settings.topics,
        participants,
        settings.partitions,
        replication=settings.replication,
    )
    metrics = CoordinatorMetrics(effect=economic_effect)
    coordinator = Coordinator(settings, bootstrap, instance_id=args.instance_id, metrics=metrics)
    if args.metrics_port:
        start_metrics_server(args.metrics_port, metrics)
    coordinator.install_signal_handlers()
    coordinator.run()
    return 0


# ------------------------------------------------------------------- saga


def _cmd_show(args: argparse.Namespace) -> int:
    from sagaline.ops.receipts import render_receipt_text

    settings, bootstrap = configured_broker("sagaline")
    try:
        records = LedgerReader(bootstrap).saga_records(
            settings.topics.events, args.saga_id, settings.signer()
        )
    except TopicMissing as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if not records:
        print(f"no records for saga {args.saga_id!r} on {settings.topics.events}", file=sys.stderr)
        return 1
    terminal = [r for r in records if isinstance(r, SagaTerminal)]
    if terminal:
        receipt = Receipt.from_json(terminal[-1].receipt)
        if args.json:
            print(
                orjson.dumps(receipt.model_dump(mode="json"), option=orjson.OPT_INDENT_2).decode()
            )
        else:
            print(render_receipt_text(receipt))
        return 0
    # Not terminal yet: the ledger so far, which is what the coordinator folds.
    if args.json:
        print(orjson.dumps([_record_json(r) for r in records], option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"saga {args.saga_id}: running ({len(records)} records so far)")
    for record in records:
        print(f"  {record.envelope.occurred_at}  {record.TYPE:<22} {_summary(record)}")
    return 0


def _record_json(record: Record) -> dict[str, Any]:
    out: dict[str, Any] = record.model_dump(mode="json")
    out["type"] = record.TYPE
    return out


def _summary(record: Record) -> str:
    step = getattr(record, "step_id", None)
    parts = [f"step={step}"] if step else []
    for name in ("tool", "kind", "outcome", "status", "attempt", "message", "owner"):
        value = getattr(record, name, None)
        if value is not None and not isinstance(value, bytes):
            parts.append(f"{name}={getattr(value, 'value', value)}")
    return " ".join(parts)


# -------------------------------------------------------------- approvals


def _pending_request(records: list[Record], step_id: str) -> ApprovalRequested | None:
    """The newest approval request for the step that nobody has answered yet."""
    answered = {r.approval_id for r in records if isinstance(r, (ApprovalGranted, ApprovalDenied))}
    requests = [
        r
        for r in records
        if isinstance(r, ApprovalRequested)
        and r.step_id == step_id
        and r.approval_id not in answered
    ]
    return requests[-1] if requests else None


def _decide(args: argparse.Namespace, *, grant: bool) -> int:
    from sagaline.ops.actions import OperatorChannel, deny_approval, grant_approval

    operator = _operator(args)
    if operator is None:
        return 2
    settings, bootstrap = configured_broker("sagaline")
    records = LedgerReader(bootstrap).saga_records(
        settings.topics.events, args.saga_id, settings.signer()
    )
    request = _pending_request(records, args.step_id)
    if request is None:
        print(
            f"saga {args.saga_id} has no pending approval for step {args.step_id!r}",
            file=sys.stderr,
        )
        return 1
    channel = OperatorChannel.from_settings(settings, bootstrap)
    try:
        if grant:
            grant_approval(channel, request, operator=operator, via="cli")
            print(f"approved {args.saga_id}/{args.step_id} ({request.scope}) as {operator}")
        else:
            deny_approval(channel, request, operator=operator, reason=args.reason, via="cli")
            print(f"denied {args.saga_id}/{args.step_id} as {operator}: {args.reason}")
    finally:
        channel.close()
    return 0


# -------------------------------------------------------------- incidents


def incident_feed(
    settings: Settings, bootstrap: str
) -> tuple[dict[str, IncidentRaised], dict[str, IncidentResolved]]:
    """Every incident on the incidents topic, and the resolutions forwarded there."""
    from schemas.errors import CodecError
    from schemas.wire import from_message

    raised: dict[str, IncidentRaised] = {}
    resolved: dict[str, IncidentResolved] = {}
    signer = settings.signer()
    for key, value, headers in LedgerReader(bootstrap).records(settings.topics.incidents):
        try:
            record = from_message(key, value, headers, signer)
        except CodecError:
            continue
        if isinstance(record, IncidentRaised):
            raised[record.incident_id] = record
        elif isinstance(record, IncidentResolved):
            resolved[record.incident_id] = record
    return raised, resolved


def _cmd_incidents_list(args: argparse.Namespace) -> int:
    settings, bootstrap = configured_broker("sagaline")
    raised, resolved = incident_feed(settings, bootstrap)
    shown = 0
    for incident_id, incident in raised.items():
        done = resolved.get(incident_id)
        if done is not None and not args.all:
            continue
        state = f"resolved by {done.resolved_by}: {done.resolution}" if done else "OPEN"
        print(
            f"{incident_id}  saga={incident.saga_id}  step={incident.step_id}  "
            f"owner={incident.owner}  [{state}]\n    {incident.kind}: "
            f"{incident.inconsistency}\n    effect: {incident.effect}"
        )
        shown += 1
    print(f"{shown} incident(s){'' if args.all else ' open'}")
    return 0


def _cmd_incidents_resolve(args: argparse.Namespace) -> int:
    from sagaline.ops.actions import OperatorChannel, resolve_incident

    operator = _operator(args)
    if operator is None:
        return 2
    settings, bootstrap = configured_broker("sagaline")
    raised, _resolved = incident_feed(settings, bootstrap)
    incident = raised.get(args.incident_id)
    if incident is None:
        print(f"no incident {args.incident_id!r} on {settings.topics.incidents}", file=sys.stderr)
        return 1
    channel = OperatorChannel.from_settings(settings, bootstrap)
    try:
        resolve_incident(
            channel,
            incident,
            operator=operator,
            resolution=args.resolution,
            note=args.note,
            via="cli",
        )
    finally:
        channel.close()
    print(f"resolved {args.incident_id} ({args.resolution}) as {operator}")
    return 0


def register(subparsers: Any) -> None:
    coordinator = subparsers.add_parser("coordinator", help="the saga coordinator")
    coordinator_sub = coordinator.add_subparsers(dest="coordinator_command", required=True)
    run = coordinator_sub.add_parser("run", help="consume sagaline.events until SIGTERM")
    run.add_argument(
        "--instance-id",
        default=os.environ.get("HOSTNAME", "coordinator-0"),
        help="stable per instance: its transactional id fences a crashed twin",
    )
    run.add_argument(
        "--participants",
        default="",
        help="comma-separated participants whose command topics to create",
    )
    run.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    run.add_argument(
        "--dev-broker",
        action="store_true",
        help="development only: use (or start) the local broker when KAFKA_BOOTSTRAP_SERVERS "
        "is unset",
    )
    run.set_defaults(func=_cmd_run)

    saga = subparsers.add_parser("saga", help="read a saga")
    saga_sub = saga.add_subparsers(dest="saga_command", required=True)
    show = saga_sub.add_parser("show", help="the receipt (or the ledger so far)")
    show.add_argument("saga_id")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=_cmd_show)

    for name, grant in (("approve", True), ("deny", False)):
        p = subparsers.add_parser(name, help=f"{name} a pending approval (R7)")
        p.add_argument("saga_id")
        p.add_argument("step_id")
        p.add_argument("--operator", help="who decides (default: $SAGALINE_OPERATOR)")
        if not grant:
            p.add_argument("--reason", required=True, help="why: recorded on the ledger")
        p.set_defaults(func=lambda a, g=grant: _decide(a, grant=g))

    incidents = subparsers.add_parser("incidents", help="escalations to a person")
    incidents_sub = incidents.add_subparsers(dest="incidents_command", required=True)
    listing = incidents_sub.add_parser("list", help="open incidents")
    listing.add_argument("--all", action="store_true", help="include resolved ones")
    listing.set_defaults(func=_cmd_incidents_list)
    resolve = incidents_sub.add_parser("resolve", help="record a resolution")
    resolve.add_argument("incident_id")
    resolve.add_argument(
        "--resolution",
        default="resolved",
        help="COMMITTED / NOT_FOUND settle an unknown outcome; else free text",
    )
    resolve.add_argument("--note", default="")
    resolve.add_argument("--operator", help="who resolves (default: $SAGALINE_OPERATOR)")
    resolve.set_defaults(func=_cmd_incidents_resolve)
