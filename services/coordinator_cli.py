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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from sagaline.kafka import LedgerReader, TopicMissing, configured_broker, readable_headers
from schemas import (
    ApprovalRequested,
    IncidentRaised,
    IncidentResolved,
    Record,
    SagaTerminal,
)
from schemas.partitioning import partition_for
from schemas.receipt import Receipt
from schemas.settings import Settings
from schemas.signing import HeaderList, Signer
from services._args import (
    at_least,
    env_default,
    instance_id,
    port,
    seconds_or_zero,
    unusable_participant,
)

if TYPE_CHECKING:
    from coordinator.state import SagaState
    from sagaline.ops.actions import VerdictWatch


def _operator(args: argparse.Namespace, signed_as: str | None = None) -> str | None:
    """Who decides: --operator, else $SAGALINE_OPERATOR, else the operator whose key
    this process holds."""
    who: str | None = args.operator or os.environ.get("SAGALINE_OPERATOR") or signed_as
    if not who:
        print(
            "an operator identity is required: --operator NAME (or SAGALINE_OPERATOR)",
            file=sys.stderr,
        )
    return who


def _key_operator(signer: Signer) -> str | None:
    """The operator an identity key signs as (raises NoUsableKey for a key that is not
    a live operator key); None with a shared key or none."""
    from sagaline.ops.actions import operator_identity
    from schemas.trust import IdentitySigner

    return operator_identity(signer, True) if isinstance(signer, IdentitySigner) else None


def _one_line_errors(func: Callable[..., int]) -> Callable[..., int]:
    """Operator commands fail with one line that says what to do, never a traceback."""

    def run(args: argparse.Namespace, **options: Any) -> int:
        from sagaline.kafka import KafkaException
        from sagaline.ops.actions import OperatorActionError
        from schemas.settings import SettingsError
        from schemas.trust import TrustFileError

        for name in ("saga_id", "step_id", "incident_id"):
            value = getattr(args, name, None)
            if isinstance(value, str) and not _utf8(value):
                # A Kafka key and a record hold UTF-8 only: refuse it here, not as a
                # UnicodeEncodeError from deep in the reader.
                print(
                    f"{args.command}: the {name.replace('_', ' ')} {value!r} is not valid "
                    "UTF-8 text (a terminal in another encoding?): give it as UTF-8",
                    file=sys.stderr,
                )
                return 2
        try:
            return func(args, **options)
        except (OperatorActionError, TrustFileError, SettingsError, TopicMissing) as exc:
            print(f"{args.command}: {exc}", file=sys.stderr)
            return 2
        except KafkaException as exc:
            print(
                f"{args.command}: the broker did not answer ({exc.args[0]}); check "
                "KAFKA_BOOTSTRAP_SERVERS and that the broker runs, then retry",
                file=sys.stderr,
            )
            return 2

    return run


def _utf8(text: str) -> bool:
    """Whether ``text`` is valid UTF-8 (an argument that is not reaches Python as lone
    surrogates, ``$'\\xff'`` as ``'\\udcff'``)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _saga_messages(
    bootstrap: str, topic: str, saga_id: str
) -> list[tuple[bytes, bytes, HeaderList | None, str]]:
    """Every message of one saga on ``topic``, undecoded (the headers say whether the
    ledger is signed), with its position (``topic[partition]@offset``), in log order."""
    reader = LedgerReader(bootstrap)
    key = saga_id.encode()
    partition = partition_for(key, reader.partition_count(topic))
    out: list[tuple[bytes, bytes, HeaderList | None, str]] = []
    for msg in reader.read(topic, [partition]):
        value = msg.value()
        if msg.key() == key and value is not None:
            where = f"{topic}[{msg.partition()}]@{msg.offset()}"
            out.append((key, value, readable_headers(msg), where))
    return out


def _decodable(
    messages: list[tuple[bytes, bytes, HeaderList | None, str]],
    signer: Signer,
    unreadable: list[str],
) -> list[Record]:
    """The messages that verify and decode; the rest the coordinator sent to the DLQ,
    except those under a schema this version does not know (a newer writer's), each
    noted in ``unreadable`` (position, schema)."""
    from schemas.errors import CodecError, SchemaMismatch, UnknownFingerprint
    from schemas.wire import from_message

    out: list[Record] = []
    for k, value, headers, where in messages:
        try:
            out.append(from_message(k, value, headers, signer))
        except (UnknownFingerprint, SchemaMismatch) as exc:
            unreadable.append(f"{where} (schema {bytes(value[2:10]).hex()}): {exc.reason}")
        except CodecError:
            continue
    return out


def _saga_records(
    bootstrap: str, settings: Settings, saga_id: str, unreadable: list[str]
) -> list[Record] | str:
    """The saga's records that verify and decode (``unreadable`` as for
    :func:`_decodable`), or why there are none although the saga has records: none
    verifies with this process's key, which would otherwise look like no saga at all."""
    topic = settings.topics.events
    messages = _saga_messages(bootstrap, topic, saga_id)
    records = _decodable(messages, settings.signer(), unreadable)
    if messages and not records and not unreadable:
        return (
            f"{len(messages)} record(s) of saga {saga_id!r} on {topic}, none verifies with "
            "this process's key: use the key the services use (SAGALINE_HMAC_KEY or the "
            "trust file)"
        )
    return records


def _signed(messages: list[tuple[bytes, bytes, HeaderList | None, str]]) -> bool:
    from schemas.signing import SIG_HEADER, header_value

    return any(header_value(h, SIG_HEADER) is not None for _k, _v, h, _w in messages)


# -------------------------------------------------------------------- run


def _cmd_run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings, bootstrap = configured_broker("sagaline coordinator run")
    import threading

    from coordinator.shell import Coordinator
    from sagaline.kafka import InstanceClaimed, KafkaException, TopicSetupError, ensure_topics
    from sagaline.ops.metrics import CoordinatorMetrics, MetricsServerError, start_metrics_server
    from schemas.trust import TrustFileError
    from services.refund import economic_effect

    participants = [p for p in args.participants.split(",") if p]
    problem = unusable_participant(settings, participants)
    if problem:
        print(f"coordinator run: {problem}", file=sys.stderr)
        return 2
    ready = threading.Event()  # set once the loop serves: a failure before is a start's
    try:
        ensure_topics(
            bootstrap,
            settings.topics,
            participants,
            settings.partitions,
            replication=settings.replication,
        )
        metrics = CoordinatorMetrics(effect=economic_effect)
        sizes = {} if args.decoded_states is None else {"decoded_states": args.decoded_states}
        coordinator = Coordinator(
            settings, bootstrap, instance_id=args.instance_id, metrics=metrics, **sizes
        )
        if args.metrics_port:
            start_metrics_server(
                args.metrics_port, metrics, settings.metrics_host, health=coordinator.health
            )
        coordinator.install_signal_handlers()
        coordinator.run(ready=ready)
    # one line, no traceback (a twin with this instance id: its pid, what to do)
    except (TopicSetupError, TrustFileError, MetricsServerError, InstanceClaimed) as exc:
        print(f"coordinator run: {exc}", file=sys.stderr)
        return 2
    except KafkaException as exc:
        if ready.is_set():
            raise  # the loop's own failure (fenced): its traceback is the report
        print(f"coordinator run: {start_failed(bootstrap, exc)}", file=sys.stderr)
        return 2
    return 0


def start_failed(bootstrap: str, exc: Exception) -> str:
    """What a service (the coordinator, a participant) that could not start on the
    broker prints, after its name: one line, no traceback."""
    from sagaline.kafka import KafkaError

    error = exc.args[0] if exc.args else None
    why = error.str() if isinstance(error, KafkaError) else str(exc)
    return (
        f"cannot start: Kafka at {bootstrap} did not answer or refused ({why}); check "
        "KAFKA_BOOTSTRAP_SERVERS, the client settings (SAGALINE_KAFKA_*) and that the broker "
        "runs, then start it again"
    )


# ------------------------------------------------------------------- saga


@_one_line_errors
def _cmd_show(args: argparse.Namespace) -> int:
    from sagaline.ops.receipts import later_resolutions, render_receipt_text

    settings, bootstrap = configured_broker("sagaline", answering=True)
    unreadable: list[str] = []
    try:
        records = _saga_records(bootstrap, settings, args.saga_id, unreadable)
    except TopicMissing as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if isinstance(records, str):
        print(f"{args.command}: {records}", file=sys.stderr)
        return 2
    if not records:
        why = f" ({_unreadable_note(unreadable)})" if unreadable else ""
        print(
            f"no records for saga {args.saga_id!r} on {settings.topics.events}{why}",
            file=sys.stderr,
        )
        return 1
    terminal = [r for r in records if isinstance(r, SagaTerminal)]
    if terminal:
        receipt = Receipt.from_json(terminal[-1].receipt)
        if args.json:
            print(
                orjson.dumps(receipt.model_dump(mode="json"), option=orjson.OPT_INDENT_2).decode()
            )
        else:
            print(render_receipt_text(receipt, later_resolutions(receipt, records)))
        return 0
    # Not terminal yet: the ledger so far, which is what the coordinator folds.
    if args.json:
        print(orjson.dumps([_record_json(r) for r in records], option=orjson.OPT_INDENT_2).decode())
        if unreadable:
            print(_unreadable_note(unreadable), file=sys.stderr)
        return 0
    print(f"saga {args.saga_id}: running ({len(records)} records so far)")
    if unreadable:
        print(f"  [{_unreadable_note(unreadable)}]")
    state = _folded(records, args.saga_id, settings)
    refused = {n.event_id: n for n in state.recent_rejections} if state else {}
    for record in records:
        note = refused.get(record.event_id)
        mark = f"  [REFUSED {note.reason}: {note.detail}]" if note else ""
        print(f"  {record.envelope.occurred_at}  {record.TYPE:<22} {_summary(record)}{mark}")
    for approval in state.approvals if state else []:
        print(
            f"  approval of step {approval.step_id} ({approval.purpose.lower()}): "
            f"{approval.decision} by {approval.by}"
        )
    return 0


def _folded(records: list[Record], saga_id: str, settings: Settings) -> SagaState | None:
    """The saga as the coordinator sees it, folded by the coordinator's own core from
    the same records: which grants counted, which approvals are still open."""
    from coordinator.core import CorePolicy, fold
    from schemas.trust import IdentitySigner

    policy = CorePolicy(
        bind_writers=isinstance(settings.signer(), IdentitySigner),
        max_steps=settings.limits.max_steps,
    )
    return fold(records, policy=policy).get(saga_id)


@_one_line_errors
def _cmd_wait(args: argparse.Namespace) -> int:
    """Block until the saga is terminal, then print its receipt like ``saga show``:
    scripts need no Kafka calls of their own. Exit 0 when terminal, 124 on timeout."""
    import time

    settings, bootstrap = configured_broker("sagaline", answering=True)
    deadline = time.monotonic() + args.timeout
    while True:
        unreadable: list[str] = []
        try:
            records = _saga_records(bootstrap, settings, args.saga_id, unreadable)
        except TopicMissing as exc:
            print(str(exc), file=sys.stderr)
            return 2
        if isinstance(records, str):
            print(f"{args.command}: {records}", file=sys.stderr)
            return 2
        if any(isinstance(r, SagaTerminal) for r in records):
            return _cmd_show(args)
        if time.monotonic() >= deadline:
            state = f"{len(records)} records so far" if records else "no records at all"
            note = f"; {_unreadable_note(unreadable)}" if unreadable else ""
            print(
                f"saga {args.saga_id!r} is not terminal after {args.timeout:.0f} s ({state})"
                f"{note}; see `sagaline saga show {args.saga_id}` and `sagaline status`",
                file=sys.stderr,
            )
            return 124
        time.sleep(1.0)


def _unreadable_note(unreadable: list[str]) -> str:
    return (
        f"{len(unreadable)} record(s) of this saga could not be read, written by a newer "
        f"version of Sagaline (upgrade this command): {'; '.join(unreadable[:5])}"
    )


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


def _pending_request(
    records: list[Record], state: SagaState | None, step_id: str, now: int
) -> ApprovalRequested | str:
    """The request the coordinator still waits on for the step, or why there is none.

    Decided by the coordinator's fold, not by "some grant exists": a grant the core
    rejected (wrong arguments, expired) leaves the approval pending.
    """
    step = state.steps.get(step_id) if state is not None else None
    if state is None or step is None:
        return f"saga {state.saga_id if state else '?'} has no step {step_id!r}"
    pending = step.approval
    if pending is None:
        return (
            f"step {step_id!r} is not awaiting approval (it is {step.status.value}); "
            "`sagaline saga show` lists what it waits for"
        )
    if pending.expires_at < now:
        return (
            f"the approval for step {step_id!r} expired at {pending.expires_at}; the "
            "coordinator will not accept a grant for it"
        )
    for record in reversed(records):
        if isinstance(record, ApprovalRequested) and record.approval_id == pending.approval_id:
            return record
    return f"approval {pending.approval_id} of step {step_id!r} is not in the ledger"


def _first_counts(saga_id: str) -> str:
    """What a printed decision means: on the ledger, counted unless another operator
    decided the same request a moment earlier (the coordinator counts the first)."""
    return (
        " (recorded on the ledger; if another operator decided it a moment earlier, theirs "
        f"counts and the coordinator refuses this one to the DLQ: see `sagaline saga show "
        f"{saga_id}`)"
    )


def _watch(
    args: argparse.Namespace, settings: Settings, bootstrap: str, saga_id: str
) -> VerdictWatch | None:
    """With ``--wait``: a :class:`sagaline.ops.actions.VerdictWatch` started before the
    decision is published; else None."""
    if args.wait is None:
        return None
    from coordinator.shell import coordinator_group
    from sagaline.ops.actions import VerdictWatch

    return VerdictWatch(
        bootstrap, settings.topics, saga_id, coordinator_group(settings.topic_prefix)
    )


def _outcome(
    args: argparse.Namespace, watch: VerdictWatch | None, record: Record, done: str
) -> int:
    """Print what was done; with ``--wait``, the coordinator's verdict on it: exit 0
    accepted, 1 refused (with the DLQ reason), 124 no verdict in time."""
    if watch is None:
        print(f"{done}{_first_counts(record.saga_id)}")
        return 0
    verdict = watch.wait(record, args.wait)
    if verdict.accepted:
        extra = f" ({verdict.reason}: {verdict.detail})" if verdict.reason else ""
        print(f"{done}: accepted by the coordinator{extra}")
        return 0
    if verdict.accepted is None:
        print(f"{done}; no verdict yet: {verdict.detail}", file=sys.stderr)
        return 124
    print(
        f"{done}, but the coordinator refused it ({verdict.reason}): {verdict.detail}",
        file=sys.stderr,
    )
    return 1


@_one_line_errors
def _decide(args: argparse.Namespace, *, grant: bool) -> int:
    import time

    from sagaline.ops.actions import (
        OperatorChannel,
        deny_approval,
        grant_approval,
        operator_identity,
    )

    settings, bootstrap = configured_broker("sagaline", answering=True)
    signer = settings.signer()
    operator = _operator(args, _key_operator(signer))
    if operator is None:
        return 2
    messages = _saga_messages(bootstrap, settings.topics.events, args.saga_id)
    if not messages:
        print(
            f"{args.command}: no saga {args.saga_id!r} on {settings.topics.events}", file=sys.stderr
        )
        return 1
    operator_identity(signer, ledger_signed=_signed(messages))  # refuses a grant that won't count
    unreadable: list[str] = []
    records = _decodable(messages, signer, unreadable)
    if not records and not unreadable:
        print(
            f"{args.command}: no record of saga {args.saga_id} verifies with this process's "
            "key: use the key the services use (SAGALINE_HMAC_KEY or the trust file)",
            file=sys.stderr,
        )
        return 2
    state = _folded(records, args.saga_id, settings)
    request = _pending_request(records, state, args.step_id, int(time.time() * 1000))
    if isinstance(request, str):
        # The request (or what decided it) may be among the records this version
        # cannot read: say so rather than only that there is none.
        why = f"; {_unreadable_note(unreadable)}" if unreadable else ""
        print(f"{args.command}: {request}{why}", file=sys.stderr)
        return 1
    watch = _watch(args, settings, bootstrap, args.saga_id)
    channel = OperatorChannel.from_settings(settings, bootstrap)
    record: Record
    try:
        if grant:
            record = grant_approval(channel, request, operator=operator, via="cli")
            done = f"approved {args.saga_id}/{args.step_id} ({request.scope}) as {operator}"
        else:
            record = deny_approval(
                channel, request, operator=operator, reason=args.reason, via="cli"
            )
            done = f"denied {args.saga_id}/{args.step_id} as {operator}: {args.reason}"
    finally:
        channel.close()
    return _outcome(args, watch, record, done)


# -------------------------------------------------------------- incidents


def incident_feed(
    settings: Settings, bootstrap: str, *, unreadable: list[str] | None = None
) -> tuple[dict[str, IncidentRaised], dict[str, IncidentResolved]]:
    """Every incident on the incidents topic, and the resolutions forwarded there.

    ``unreadable``, given, gets a line (position, schema) for each record written
    under a schema this version cannot read (a newer coordinator's).
    Raises :class:`sagaline.ops.actions.OperatorActionError` when the topic has records
    and none verifies with this process's key (another key than the coordinator's),
    which would otherwise look like no incident at all."""
    from sagaline.ops.actions import OperatorActionError
    from schemas.errors import CodecError, SchemaMismatch, UnknownFingerprint
    from schemas.wire import from_message

    raised: dict[str, IncidentRaised] = {}
    resolved: dict[str, IncidentResolved] = {}
    signer = settings.signer()
    topic = settings.topics.incidents
    refused = readable = 0
    for msg in LedgerReader(bootstrap).read(topic):
        value = msg.value()
        try:
            record = from_message(msg.key(), value, readable_headers(msg), signer)
        except (UnknownFingerprint, SchemaMismatch) as exc:
            readable += 1  # it verified: the key is right
            if unreadable is not None and value is not None:
                unreadable.append(
                    f"{topic}[{msg.partition()}]@{msg.offset()} (schema "
                    f"{bytes(value[2:10]).hex()}): {exc.reason}"
                )
            continue
        except CodecError:
            refused += 1
            continue
        readable += 1
        if isinstance(record, IncidentRaised):
            raised[record.incident_id] = record
        elif isinstance(record, IncidentResolved):
            # The first one is what the coordinator acted on: it ignores later ones.
            resolved.setdefault(record.incident_id, record)
    if refused and not readable:
        raise OperatorActionError(
            f"{refused} record(s) on {topic}, none verifies with this process's key: use "
            "the key the services use (SAGALINE_HMAC_KEY or the trust file)"
        )
    return raised, resolved


def _unreadable_incidents_note(unreadable: list[str]) -> str:
    return (
        f"{len(unreadable)} record(s) of the incidents topic could not be read, written by "
        "a newer version of Sagaline, and may be the incident (upgrade this command): "
        f"{'; '.join(unreadable[:5])}"
    )


def superseded_incidents(raised: dict[str, IncidentRaised]) -> dict[str, IncidentRaised]:
    """Each unknown-outcome incident that a later run (generation) of its saga raised
    again, mapped to the newest incident of the same saga, step and kind.

    A resolution copies its incident's generation, so the coordinator rejects one of
    a superseded incident as stale: the operator must resolve the newer one. Only an
    unknown outcome is asked again; any other incident of an earlier run stays open
    on its own and the coordinator takes its resolution whatever its generation.
    """
    from coordinator.core import SETTLES_UNKNOWN

    newest: dict[tuple[str, str | None, str], IncidentRaised] = {}
    for incident in raised.values():
        if incident.kind not in SETTLES_UNKNOWN:
            continue
        key = (incident.saga_id, incident.step_id, incident.kind)
        known = newest.get(key)
        if known is None or incident.envelope.generation > known.envelope.generation:
            newest[key] = incident
    superseded: dict[str, IncidentRaised] = {}
    for incident_id, incident in raised.items():
        newer = newest.get((incident.saga_id, incident.step_id, incident.kind))
        if newer is not None and newer.envelope.generation > incident.envelope.generation:
            superseded[incident_id] = newer
    return superseded


def _resolved_as(done: IncidentResolved) -> str:
    """How an incident was resolved: by a person, or settled by the coordinator itself
    (what the ledger said of its step: ``coordinator.core._mark_resolved``)."""
    from coordinator.core import COORDINATOR_PRODUCER

    if done.envelope.producer == COORDINATOR_PRODUCER:
        return f"settled by the coordinator: {done.resolution}"
    return f"resolved by {done.resolved_by}: {done.resolution}"


@_one_line_errors
def _cmd_incidents_list(args: argparse.Namespace) -> int:
    settings, bootstrap = configured_broker("sagaline", answering=True)
    unreadable: list[str] = []
    raised, resolved = incident_feed(settings, bootstrap, unreadable=unreadable)
    superseded = superseded_incidents(raised)
    shown = 0
    for incident_id, incident in raised.items():
        done = resolved.get(incident_id)
        newer = superseded.get(incident_id)
        if (done is not None or newer is not None) and not args.all:
            continue
        state = _resolved_as(done) if done else "OPEN"
        if newer is not None and done is None:
            state = f"superseded by {newer.incident_id} (generation {newer.envelope.generation})"
        print(
            f"{incident_id}  saga={incident.saga_id}  step={incident.step_id}  "
            f"owner={incident.owner}  [{state}]\n    {incident.kind}: "
            f"{incident.inconsistency}\n    effect: {incident.effect}"
        )
        shown += 1
    print(f"{shown} incident(s){'' if args.all else ' open'}")
    if unreadable:
        print(f"[{_unreadable_incidents_note(unreadable)}]")
    return 0


@_one_line_errors
def _cmd_incidents_resolve(args: argparse.Namespace) -> int:
    from sagaline.ops.actions import OperatorChannel, operator_identity, resolve_incident

    settings, bootstrap = configured_broker("sagaline", answering=True)
    signer = settings.signer()
    operator = _operator(args, _key_operator(signer))
    if operator is None:
        return 2
    unreadable: list[str] = []
    raised, resolved = incident_feed(settings, bootstrap, unreadable=unreadable)
    incident = raised.get(args.incident_id)
    if incident is None:
        why = f"; {_unreadable_incidents_note(unreadable)}" if unreadable else ""
        print(
            f"{args.command}: no incident {args.incident_id!r} on "
            f"{settings.topics.incidents}; `sagaline incidents list` shows the open ones{why}",
            file=sys.stderr,
        )
        return 1
    done = resolved.get(args.incident_id)
    if done is not None:
        print(
            f"{args.command}: incident {args.incident_id} is already {_resolved_as(done)}; "
            "the coordinator acts on the first resolution only, so nothing was recorded",
            file=sys.stderr,
        )
        return 1
    newer = superseded_incidents(raised).get(args.incident_id)
    if newer is not None:
        print(
            f"{args.command}: incident {args.incident_id} was raised by an earlier run of saga "
            f"{incident.saga_id} (generation {incident.envelope.generation}); the coordinator "
            f"would reject its resolution as stale and asks {newer.incident_id} (generation "
            f"{newer.envelope.generation}) now: resolve that one. Nothing was recorded",
            file=sys.stderr,
        )
        return 1
    messages = _saga_messages(bootstrap, settings.topics.events, incident.saga_id)
    operator_identity(signer, ledger_signed=_signed(messages))  # refuses when it won't count
    watch = _watch(args, settings, bootstrap, incident.saga_id)
    channel = OperatorChannel.from_settings(settings, bootstrap)
    try:
        record = resolve_incident(
            channel,
            incident,
            operator=operator,
            resolution=args.resolution,
            note=args.note,
            via="cli",
            operation_id=args.operation_id,
            result_json=args.result,
        )
    finally:
        channel.close()
    return _outcome(
        args, watch, record, f"resolved {args.incident_id} ({args.resolution}) as {operator}"
    )


def _wait_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait",
        type=at_least(1),
        nargs="?",
        const=60,
        default=None,
        metavar="SECONDS",
        help="wait (default 60 s) for the coordinator's verdict on this decision: exit 0 "
        "accepted, 1 refused (the reason is printed), 124 no verdict in time",
    )


def register(subparsers: Any) -> None:
    coordinator = subparsers.add_parser("coordinator", help="the saga coordinator")
    coordinator_sub = coordinator.add_subparsers(dest="coordinator_command", required=True)
    run = coordinator_sub.add_parser("run", help="consume sagaline.events until SIGTERM")
    run.add_argument(
        "--instance-id",
        type=instance_id,
        default=env_default("HOSTNAME") or "coordinator-0",
        help="stable per instance: its transactional id fences a crashed twin (default: "
        "$HOSTNAME, else coordinator-0)",
    )
    run.add_argument(
        "--participants",
        default="",
        help="comma-separated participants whose command topics to create",
    )
    run.add_argument("--metrics-port", type=port, default=0, help="Prometheus port (0: off)")
    run.add_argument(
        "--decoded-states",
        type=at_least(0),
        default=env_default("SAGALINE_DECODED_STATES"),
        help="decoded saga states kept in memory beside their bytes, about 16 KiB each "
        "(default $SAGALINE_DECODED_STATES, else coordinator.shell.DECODED_STATES, 512; "
        "0: off). Raise it when more sagas than this are in flight",
    )
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
    wait = saga_sub.add_parser("wait", help="wait until the saga is terminal; print the receipt")
    wait.add_argument("saga_id")
    wait.add_argument(
        "--timeout", type=seconds_or_zero, default=300.0, help="seconds (default 300)"
    )
    wait.add_argument("--json", action="store_true", help="machine-readable output")
    wait.set_defaults(func=_cmd_wait)

    for name, grant in (("approve", True), ("deny", False)):
        p = subparsers.add_parser(name, help=f"{name} a pending approval (R7)")
        p.add_argument("saga_id")
        p.add_argument("step_id")
        p.add_argument("--operator", help="who decides (default: $SAGALINE_OPERATOR)")
        if not grant:
            p.add_argument("--reason", required=True, help="why: recorded on the ledger")
        _wait_option(p)
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
    resolve.add_argument(
        "--operation-id",
        help="with COMMITTED: the provider's id of the operation (the compensation gets it)",
    )
    resolve.add_argument(
        "--result",
        help="with COMMITTED: what the tool returned, as JSON (the compensation's ctx.result)",
    )
    resolve.add_argument("--operator", help="who resolves (default: $SAGALINE_OPERATOR)")
    _wait_option(resolve)
    resolve.set_defaults(func=_cmd_incidents_resolve)
