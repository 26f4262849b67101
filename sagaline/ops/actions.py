"""Operator decisions as records on the ledger: the one path for the CLI and the dashboard.

A person approving, denying or resolving never reaches into a service's state: the
decision becomes an ``ApprovalGranted``, ``ApprovalDenied`` or ``IncidentResolved``
record on ``sagaline.events`` (signed like every other record), and the coordinator
acts on it like on any other fact (R5, R7). Every action names the operator; an
empty identity is refused before anything is produced.

The record builders are pure (:func:`approval_granted`, :func:`approval_denied`,
:func:`incident_resolved`); the publishing functions wait for the broker's ack, so a
caller that returns without error knows the decision is in the log (and one that got
no ack does not know it is not: repeating the same decision is safe).

Example::

    channel = OperatorChannel.from_settings(Settings.from_env())
    unreadable: list[str] = []
    records = LedgerReader(bootstrap).saga_records(topic, saga_id, signer, unreadable=unreadable)
    request = find_approval_request(records, approval_id, unreadable=unreadable)
    grant_approval(channel, request, operator="alice@example.com", via="cli")
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson

from sagaline.kafka import (
    DeliveryFailed,
    KafkaError,
    KafkaException,
    LedgerReader,
    LedgerWriter,
    RecordTooLarge,
    TopicPartition,
    create_consumer,
    headers_of,
    producer_config,
    require_bootstrap,
    watermarks,
)
from schemas.codec import encode
from schemas.errors import CodecError
from schemas.keys import derived_event_id
from schemas.limits import DEFAULT_LIMITS, MAX_OPERATOR_TEXT_BYTES, Limits
from schemas.models import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    Envelope,
    IncidentRaised,
    IncidentResolved,
    Record,
)
from schemas.partitioning import partition_for
from schemas.settings import Settings
from schemas.signing import Signer
from schemas.topics import TopicNames
from schemas.trust import IdentitySigner, Role, authorize
from schemas.wire import read_dead_letter


class OperatorActionError(RuntimeError):
    """An operator action could not be recorded; the message says what to do."""


class MissingOperatorIdentity(OperatorActionError, ValueError):
    """Every decision must name the person who made it."""


class UnknownRequest(OperatorActionError, LookupError):
    """The approval request or incident named is not in the saga's ledger."""


class ApprovalExpired(OperatorActionError):
    """The request expired: the coordinator would reject a grant for it (R7)."""


class DecisionTooLarge(OperatorActionError, ValueError):
    """The decision is larger than a record may be (its note, result, resolution or
    reason too long): nothing was written, and sending it again is refused again."""


class NoUsableKey(OperatorActionError):
    """This process holds no key the system accepts for an operator decision, so the
    coordinator would drop the record: refuse instead of pretending it counted."""


def operator_identity(signer: Signer, ledger_signed: bool) -> str | None:
    """The operator a decision will be signed as (None with a shared key or none).

    Raises :class:`NoUsableKey` when the record would be refused: no operator key in
    the trust file, a retired one, or no key at all while the ledger is signed.
    """
    if isinstance(signer, IdentitySigner):
        if not signer.can_sign or signer.identity is None:
            raise NoUsableKey(
                "no operator key the trust file accepts: set SAGALINE_SIGNING_KEY to your "
                "operator key (`sagaline keys new NAME --role operator`, entry added to "
                "the trust file, not retired)"
            )
        if signer.identity.role is not Role.OPERATOR:
            raise NoUsableKey(
                f"the key in SAGALINE_SIGNING_KEY belongs to {signer.identity.name!r}, a "
                f"{signer.identity.role.value}: only an operator key may approve, deny or "
                "resolve; use your own operator key"
            )
        return signer.identity.name
    if not signer.enabled and ledger_signed:
        raise NoUsableKey(
            "the ledger is signed but this command holds no key, so the coordinator would "
            "drop the decision: set SAGALINE_HMAC_KEY (or SAGALINE_TRUST_FILE and "
            "SAGALINE_SIGNING_KEY) as the services have them"
        )
    return None


def _utf8(label: str, value: str) -> str:
    """``value``, refused when it cannot be written: text that is not valid UTF-8 (an
    argument typed in a terminal of another encoding reaches Python as lone
    surrogates, ``$'\\xff'`` as ``'\\udcff'``) would fail deep in the encoder."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise OperatorActionError(
            f"the {label} {value!r} is not valid UTF-8 text (a terminal or variable in "
            "another encoding?): give it as UTF-8. Nothing was recorded"
        ) from None
    return value


def _operator(operator: str) -> str:
    who = _utf8("operator name", operator).strip()
    if not who:
        raise MissingOperatorIdentity(
            "an operator identity is required (who is approving, denying or resolving?): "
            "pass --operator NAME on the CLI or fill 'operator' in the dashboard form"
        )
    return who


def _now() -> int:
    return int(time.time() * 1000)


def _envelope(
    record_type: type[Record],
    cause: Record,
    action: str,
    ref: str,
    via: str,
    now: int,
    producer: str | None,
    decision: tuple[str | None, ...],
) -> Envelope:
    # A deterministic id per (action, request, what was decided and by whom): a double
    # click or a CLI retry produces the same event id, which the coordinator
    # deduplicates (R15). Another operator's decision, or a different one, on the same
    # request is a record of its own: the coordinator acts on the first and refuses the
    # later one visibly (DLQ, `sagaline saga show`, the dashboard), where one shared id
    # would have dropped it unseen while its operator was told it was recorded.
    content = hashlib.sha256(orjson.dumps(decision)).hexdigest()[:32]
    return Envelope(
        event_id=derived_event_id("operator", action, cause.saga_id, ref, content),
        saga_id=cause.saga_id,
        tenant_id=cause.envelope.tenant_id,
        type=record_type.TYPE,
        occurred_at=now,
        producer=producer or f"operator:{via}",  # with identities: the signer's name
        generation=cause.envelope.generation,
        causation_id=cause.event_id,
    )


# ---------------------------------------------------------------- pure builders


def approval_granted(
    request: ApprovalRequested,
    *,
    operator: str,
    now: int,
    via: str = "cli",
    producer: str | None = None,
) -> ApprovalGranted:
    """The grant bound to exactly what was requested (principal, step, fingerprint,
    scope, expiry): a grant for anything else would not count (R7). A request is valid
    through ``expires_at``; after it :class:`ApprovalExpired` is raised, as the
    coordinator would reject the grant."""
    who = _operator(operator)
    if now > request.expires_at:
        raise ApprovalExpired(
            f"approval {request.approval_id} of saga {request.saga_id} expired at "
            f"{request.expires_at} (now {now}): the coordinator would reject a grant, so "
            "nothing was recorded"
        )
    return ApprovalGranted(
        envelope=_envelope(
            ApprovalGranted, request, "grant", request.approval_id, via, now, producer, (who,)
        ),
        step_id=request.step_id,
        approval_id=request.approval_id,
        purpose=request.purpose,
        principal=request.principal,
        args_fingerprint=request.args_fingerprint,
        scope=request.scope,
        expires_at=request.expires_at,
        granted_by=who,
    )


def approval_denied(
    request: ApprovalRequested,
    *,
    operator: str,
    reason: str,
    now: int,
    via: str = "cli",
    producer: str | None = None,
) -> ApprovalDenied:
    """A denial is a business rejection: the saga compensates at once (R7, R9)."""
    who = _operator(operator)
    why = _utf8("reason", reason).strip() or f"denied by {who}"
    return ApprovalDenied(
        envelope=_envelope(
            ApprovalDenied, request, "deny", request.approval_id, via, now, producer, (who, why)
        ),
        step_id=request.step_id,
        approval_id=request.approval_id,
        purpose=request.purpose,
        denied_by=who,
        reason=why,
    )


def incident_resolved(
    incident: IncidentRaised,
    *,
    operator: str,
    resolution: str,
    note: str = "",
    now: int,
    via: str = "cli",
    producer: str | None = None,
    operation_id: str | None = None,
    result_json: str | None = None,
) -> IncidentResolved:
    """For an unknown-outcome incident ``resolution`` must be COMMITTED or NOT_FOUND
    (it settles the step, R11); otherwise it is free text. A COMMITTED resolution may
    name the provider's ``operation_id`` and the tool's result (``result_json``): the
    step's compensation receives both in its context."""
    who = _operator(operator)
    text = _utf8("resolution", resolution).strip()
    _utf8("note", note)
    _utf8("operation id", operation_id or "")
    _utf8("result", result_json or "")
    if not text:
        raise OperatorActionError(
            f"incident {incident.incident_id}: say how it was resolved (resolution is empty)"
        )
    if "unknown" in incident.kind.lower() and text.upper() not in ("COMMITTED", "NOT_FOUND"):
        raise OperatorActionError(
            f"incident {incident.incident_id} is an unknown outcome of step "
            f"{incident.step_id}: resolve it with COMMITTED (the effect happened) or "
            f"NOT_FOUND (it did not), not {text!r}"
        )
    if text.upper() in ("COMMITTED", "NOT_FOUND"):
        text = text.upper()
    if (operation_id or result_json is not None) and text != "COMMITTED":
        raise OperatorActionError(
            f"incident {incident.incident_id}: an operation id or result goes only with "
            "resolution COMMITTED (the effect happened)"
        )
    result: bytes | None = None
    if result_json is not None:
        try:
            result = orjson.dumps(orjson.loads(result_json))
        except orjson.JSONDecodeError:
            raise OperatorActionError(
                f"incident {incident.incident_id}: --result must be JSON (what the tool "
                f'returned, e.g. \'{{"refund_id": "r-1"}}\'), got {result_json[:60]!r}'
            ) from None
    decision = (who, text, note, operation_id or None, result.decode() if result else None)
    return IncidentResolved(
        envelope=_envelope(
            IncidentResolved,
            incident,
            "resolve",
            incident.incident_id,
            via,
            now,
            producer,
            decision,
        ),
        incident_id=incident.incident_id,
        resolved_by=who,
        resolution=text,
        note=note,
        provider_operation_id=operation_id or None,
        result=result,
    )


def _not_found(what: str, unreadable: Sequence[str]) -> str:
    """Why ``what`` is not among a saga's records: records this version cannot read
    (``saga_records(..., unreadable=...)``) may hold it."""
    if not unreadable:
        return ""
    return (
        f"{len(unreadable)} record(s) of this saga could not be read, written under a "
        "schema this version does not know by a newer version of Sagaline, and "
        f"{what} may be among them: upgrade this command line (or library) and retry; "
        f"{'; '.join(unreadable[:5])}"
    )


def find_approval_request(
    records: Iterable[Record], approval_id: str, *, unreadable: Sequence[str] = ()
) -> ApprovalRequested:
    """The ``ApprovalRequested`` with this id among a saga's records.

    ``unreadable``: the records of the saga that could not be read (as
    :meth:`sagaline.kafka.LedgerReader.saga_records` lists them); when the request is
    not found and there are some, :class:`UnknownRequest` says so instead of that
    there is no such request."""
    for record in records:
        if isinstance(record, ApprovalRequested) and record.approval_id == approval_id:
            return record
    why = _not_found(f"approval request {approval_id!r}", unreadable)
    if why:
        raise UnknownRequest(f"approval request {approval_id!r} not found: {why}")
    raise UnknownRequest(
        f"no approval request {approval_id!r} in this saga's ledger: check the saga id and "
        "the approval id (sagaline dashboard or `sagaline saga show` list pending ones)"
    )


def find_incident(
    records: Iterable[Record], incident_id: str, *, unreadable: Sequence[str] = ()
) -> IncidentRaised:
    """The ``IncidentRaised`` with this id among a saga's records (``unreadable``: as
    for :func:`find_approval_request`)."""
    for record in records:
        if isinstance(record, IncidentRaised) and record.incident_id == incident_id:
            return record
    why = _not_found(f"incident {incident_id!r}", unreadable)
    if why:
        raise UnknownRequest(f"incident {incident_id!r} not found: {why}")
    raise UnknownRequest(
        f"no incident {incident_id!r} in this saga's ledger: check the saga id and the incident id"
    )


# ------------------------------------------------------------------ publishing


def _largest_part(record: Record) -> tuple[str, int]:
    """The decision's largest free-form field and its size in bytes (what to shorten)."""
    sizes = [("record", 0)]
    for name in ("note", "result", "resolution", "reason"):
        value = getattr(record, name, None)
        if isinstance(value, str):
            sizes.append((name, len(value.encode())))
        elif isinstance(value, bytes):
            sizes.append((name, len(value)))
    return max(sizes, key=lambda part: part[1])


# The operator's free text in a decision, as the error names it.
_OPERATOR_TEXT = {
    "reason": "reason",
    "resolution": "resolution",
    "note": "note",
    "granted_by": "operator name",
    "denied_by": "operator name",
    "resolved_by": "operator name",
}


def _too_large(record: Record, size: int, limit: int, source: str) -> DecisionTooLarge:
    name, part = _largest_part(record)
    alone = f"; its {name} alone is {part} bytes: shorten it" if part else ""
    over = f"{size - limit} over" if size > limit else "with its framing over"
    return DecisionTooLarge(
        f"{record.TYPE} for saga {record.saga_id} is {size} bytes, {over} the limit of "
        f"{limit} bytes ({source}){alone}. Nothing was recorded"
    )


class OperatorChannel:
    """A producer for operator decisions onto ``sagaline.events``; waits for acks.

    A decision larger than the coordinator takes (``limits.max_record_bytes``; a
    COMMITTED resolution's result over ``limits.max_result_bytes``, like a tool's) or
    than the producer sends (``message.max.bytes``), or with a reason, resolution, note
    or operator name over ``MAX_OPERATOR_TEXT_BYTES``, is refused with
    :class:`DecisionTooLarge`, nothing written."""

    def __init__(
        self,
        bootstrap: str,
        topics: TopicNames,
        signer: Signer,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.topics = topics
        self.signer = signer
        self.limits = limits
        self._bootstrap = bootstrap
        self._writer = LedgerWriter(bootstrap, topics, signer)

    @classmethod
    def from_settings(cls, settings: Settings, bootstrap: str | None = None) -> OperatorChannel:
        """``bootstrap`` overrides; else the settings' (never a broker started here)."""
        if bootstrap is None:
            bootstrap = require_bootstrap(settings, "operator action")
        return cls(bootstrap, settings.topics, settings.signer(), settings.limits)

    def producer_for(self, operator: str, via: str) -> str | None:
        """The producer name for ``operator``'s decision: with an identity key, the key's
        operator, who must be the one deciding; else None (``operator:<via>``)."""
        signer = self.signer
        if not isinstance(signer, IdentitySigner):
            return None
        name = operator_identity(signer, ledger_signed=True)
        assert signer.identity is not None  # operator_identity checked it
        who = operator.strip()
        acts_for = signer.identity.acts_for
        if who != name and who not in acts_for:
            known = signer.trust.identities.get(who)
            if known is None or known.role is not Role.OPERATOR:
                fix = (
                    f"{who!r} is not an operator identity in the trust file, and acts_for "
                    f"counts only those: add {who!r} under identities with role operator "
                    f"(`sagaline keys new {who} --role operator`) and to acts_for"
                )
            elif acts_for:
                fix = f"add {who!r} to the acts_for of {name!r} in the trust file"
            else:
                fix = "drop --operator or use their key"
            gateway = ", ".join(repr(n) for n in sorted(acts_for)) or "none"
            raise NoUsableKey(
                f"this key signs as {name!r}, not {who!r}: an operator decides only in "
                f"their own name, a gateway only for the operators its acts_for names "
                f"(here: {gateway}); {fix}"
            )
        return name

    def publish(self, record: Record, timeout_s: float = 30.0) -> None:
        """Produce ``record`` and wait until the broker acknowledges it.

        With an identity key, first the readers' own check (:func:`schemas.trust.authorize`):
        a decision they would refuse (a saga of a tenant outside the key's ``tenants``)
        raises :class:`NoUsableKey` instead of being reported as recorded."""
        signer = self.signer
        if isinstance(signer, IdentitySigner) and signer.identity is not None:
            try:
                authorize(signer.identity, record)
            except CodecError as exc:
                raise NoUsableKey(
                    f"{exc}; the coordinator would refuse this {record.TYPE}, so nothing "
                    "was recorded: decide with a key whose identity may act for it"
                ) from None
        self._check_size(record)
        try:
            self._writer.append(record, timeout_s=timeout_s)
        except RecordTooLarge as exc:  # the producer refused it at once: never sent
            limit = int(producer_config(self._bootstrap).get("message.max.bytes", 1_000_000))
            source = "the producer's message.max.bytes, SAGALINE_KAFKA_MESSAGE_MAX_BYTES"
            raise _too_large(record, exc.size, limit, source) from None
        except DeliveryFailed as exc:
            if exc.too_large:  # the broker refused it for its size: not in the log
                name, part = _largest_part(record)
                raise DecisionTooLarge(
                    f"{exc}; its {name} is {part} bytes: shorten it. Nothing was recorded"
                ) from None
            # No acknowledgement is no proof of absence: the record may be in the log
            # already, or be delivered later. Repeating the same decision is safe.
            raise OperatorActionError(
                f"the broker did not confirm {record.TYPE} for saga {record.saga_id}: "
                f"{exc}; the decision may or may not be recorded (it may still arrive): "
                "check the saga (`sagaline saga show` or the dashboard) before deciding "
                "anything else, or repeat the same decision, which is safe (same event id: "
                "it counts once)"
            ) from exc

    def _check_size(self, record: Record) -> None:
        """Refuse a decision the coordinator could not take: its record over
        ``max_record_bytes`` (it copies the record to the incident feed and the
        saga's state and receipt), a result over ``max_result_bytes``, a piece of
        operator text (reason, resolution, note, name) over ``MAX_OPERATOR_TEXT_BYTES``
        (copied into the saga's state and receipt, several of them could park it)."""
        for name in _OPERATOR_TEXT:
            value = getattr(record, name, None)
            size = len(value.encode()) if isinstance(value, str) else 0
            if size > MAX_OPERATOR_TEXT_BYTES:
                label = _OPERATOR_TEXT[name]
                raise DecisionTooLarge(
                    f"{record.TYPE} for saga {record.saga_id}: its {label} is {size} "
                    f"bytes, {size - MAX_OPERATOR_TEXT_BYTES} over the limit of "
                    f"{MAX_OPERATOR_TEXT_BYTES} bytes for an operator's text: shorten it "
                    "(put long logs elsewhere and say where). Nothing was recorded"
                )
        result = getattr(record, "result", None)
        if isinstance(result, bytes) and len(result) > self.limits.max_result_bytes:
            limit = self.limits.max_result_bytes
            raise DecisionTooLarge(
                f"the result of {record.TYPE} for saga {record.saga_id} is {len(result)} "
                f"bytes, {len(result) - limit} over the limit of {limit} bytes for a tool's "
                "result (SAGALINE_MAX_RESULT_BYTES): pass only what the compensation needs. "
                "Nothing was recorded"
            )
        size = len(encode(record))
        if size > self.limits.max_record_bytes:
            raise _too_large(
                record, size, self.limits.max_record_bytes, "SAGALINE_MAX_RECORD_BYTES"
            )

    def close(self) -> None:
        self._writer.close()


@dataclass(frozen=True)
class Verdict:
    """What the coordinator did with a decision's record (:class:`VerdictWatch`)."""

    accepted: bool | None  # None: no verdict within the time given
    reason: str = ""  # the DLQ reason of a refused one
    detail: str = ""  # why it was refused, or what else there is to know


class _NoVerdict(Exception):
    """The watch could not read what the verdict rests on; the message says what."""


class VerdictWatch:
    """Waits for the coordinator's verdict on one decision: start it before
    publishing, :meth:`wait` after.

    The coordinator commits its consumer offsets in the transaction that writes its
    outputs (a refused record's DLQ copy among them), so once its group's committed
    offset on the saga's ``sagaline.events`` partition is past the decision's record,
    the verdict is durable: refused if the DLQ holds a copy of that record, accepted
    otherwise (a repeat of a decision that counted already is accepted too). It needs
    Describe on the coordinator's group and Read on ``sagaline.events`` and
    ``sagaline.dlq``.

    Example::

        watch = VerdictWatch(bootstrap, settings.topics, saga_id, group)
        record = resolve_incident(channel, incident, operator="bob", resolution="done")
        verdict = watch.wait(record, timeout_s=60)
    """

    def __init__(self, bootstrap: str, topics: TopicNames, saga_id: str, group_id: str) -> None:
        self._bootstrap = bootstrap
        self._topics = topics
        self._group_id = group_id
        self._key = saga_id.encode()
        reader = LedgerReader(bootstrap)
        self._events = partition_for(self._key, reader.partition_count(topics.events))
        self._dlq = partition_for(self._key, reader.partition_count(topics.dlq))
        # Where the decision's record and its DLQ copy can be: after the ends as of now.
        self._events_from = reader.end_offsets(topics.events)[self._events]
        self._dlq_from = reader.end_offsets(topics.dlq)[self._dlq]

    def wait(self, record: Record, timeout_s: float) -> Verdict:
        from coordinator.shell import FEED_TOO_LARGE_REASON

        deadline = time.monotonic() + timeout_s
        offset = self._offset_of(record)
        if offset is None:
            return Verdict(None, detail=f"its record is not on {self._topics.events}")
        try:
            decided = self._decided(offset, deadline)
        except KafkaException as exc:  # the decision is written: say so, not "retry"
            return Verdict(
                None,
                detail=f"cannot read the committed offsets of the coordinator's group "
                f"{self._group_id} ({exc.args[0].str()}): --wait needs Describe on it (and a "
                "broker that answers); the decision is on the ledger, see `sagaline saga show`",
            )
        if not decided:
            return Verdict(
                None,
                detail=f"the coordinator has not decided on it within {timeout_s:.0f} s (is "
                "it running, and behind?); it is on the ledger and counts when it is read",
            )
        try:
            refusal = self._refusal(offset, deadline)
        except _NoVerdict as exc:
            return Verdict(None, detail=str(exc))
        if refusal is None:
            return Verdict(True)
        reason, detail = refusal
        if reason == FEED_TOO_LARGE_REASON:  # accepted; only its feed copy is missing
            return Verdict(True, reason, detail)
        return Verdict(False, reason, detail)

    def _offset_of(self, record: Record) -> int | None:
        """Where the decision's own bytes are: its event id is derived from what anyone
        can see (saga, request, operator), so another record under the same id, put
        there first by any writer of the topic, is not taken for it."""
        reader = LedgerReader(self._bootstrap)
        start = {self._events: self._events_from}
        written = encode(record)
        for msg in reader.read(self._topics.events, [self._events], start=start):
            if msg.key() == self._key and msg.value() == written:
                return msg.offset()
        return None

    def _decided(self, offset: int, deadline: float) -> bool:
        """Whether the coordinator's committed offset passed ``offset`` in time."""
        consumer = create_consumer(self._bootstrap, self._group_id)  # never joins: reads
        try:
            tp = TopicPartition(self._topics.events, self._events)
            while True:
                committed = consumer.committed([tp], timeout=10)[0].offset
                if committed > offset:
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)
        finally:
            consumer.close()

    def _refusal(self, offset: int, deadline: float) -> tuple[str, str] | None:
        """The DLQ reason and detail of the decision's record at ``offset``, if it was
        refused. Read up to the DLQ's end as of now, past the transactions still open
        there (the one that refused it is decided: its offsets are committed)."""
        consumer = create_consumer(self._bootstrap, f"sagaline-reader-{uuid.uuid4().hex[:8]}")
        try:
            tp = TopicPartition(self._topics.dlq, self._dlq, self._dlq_from)
            end = watermarks(consumer, tp)[1]
            consumer.assign([tp])
            position = self._dlq_from
            while position < end and time.monotonic() < deadline + 30:
                msg = consumer.poll(0.5)
                error = msg.error() if msg is not None else None
                if error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                    raise _NoVerdict(
                        f"cannot read {self._topics.dlq} ({error.str()}): --wait needs Read "
                        "on it to see a refusal; the decision is on the ledger, see "
                        "`sagaline saga show`"
                    )
                if msg is not None and error is None and msg.key() == self._key:
                    try:
                        dead = read_dead_letter(headers_of(msg))
                    except CodecError:
                        dead = None
                    if (
                        dead is not None
                        and dead.source_topic == self._topics.events
                        and (dead.partition, dead.offset) == (self._events, offset)
                    ):
                        return dead.reason, dead.detail
                position = consumer.position([tp])[0].offset
            if position < end:  # not read to the end: a refusal may be in the rest
                raise _NoVerdict(
                    f"{self._topics.dlq} could not be read to its end in time (at offset "
                    f"{position} of {end}), so a refusal may be unseen; the decision is on "
                    "the ledger, see `sagaline saga show`"
                )
            return None
        finally:
            consumer.close()


def grant_approval(
    channel: OperatorChannel,
    request: ApprovalRequested,
    *,
    operator: str,
    via: str = "cli",
    now: int | None = None,
) -> ApprovalGranted:
    """Record that ``operator`` approves ``request``; returns the record written."""
    producer = channel.producer_for(operator, via)
    record = approval_granted(
        request, operator=operator, now=now or _now(), via=via, producer=producer
    )
    channel.publish(record)
    return record


def deny_approval(
    channel: OperatorChannel,
    request: ApprovalRequested,
    *,
    operator: str,
    reason: str = "",
    via: str = "cli",
    now: int | None = None,
) -> ApprovalDenied:
    """Record that ``operator`` denies ``request``; returns the record written."""
    producer = channel.producer_for(operator, via)
    record = approval_denied(
        request, operator=operator, reason=reason, now=now or _now(), via=via, producer=producer
    )
    channel.publish(record)
    return record


def resolve_incident(
    channel: OperatorChannel,
    incident: IncidentRaised,
    *,
    operator: str,
    resolution: str,
    note: str = "",
    via: str = "cli",
    now: int | None = None,
    operation_id: str | None = None,
    result_json: str | None = None,
) -> IncidentResolved:
    """Record that ``operator`` resolved ``incident``; returns the record written."""
    record = incident_resolved(
        incident,
        operator=operator,
        resolution=resolution,
        note=note,
        now=now or _now(),
        via=via,
        producer=channel.producer_for(operator, via),
        operation_id=operation_id,
        result_json=result_json,
    )
    channel.publish(record)
    return record


__all__ = [
    "ApprovalExpired",
    "DecisionTooLarge",
    "MissingOperatorIdentity",
    "NoUsableKey",
    "OperatorActionError",
    "OperatorChannel",
    "UnknownRequest",
    "Verdict",
    "VerdictWatch",
    "approval_denied",
    "approval_granted",
    "deny_approval",
    "find_approval_request",
    "find_incident",
    "grant_approval",
    "incident_resolved",
    "operator_identity",
    "resolve_incident",
]
