"""Operator decisions as records on the ledger: the one path for the CLI and the dashboard.

A person approving, denying or resolving never reaches into a service's state: the
decision becomes an ``ApprovalGranted``, ``ApprovalDenied`` or ``IncidentResolved``
record on ``sagaline.events`` (signed like every other record), and the coordinator
acts on it like on any other fact (R5, R7). Every action names the operator; an
empty identity is refused before anything is produced.

The record builders are pure (:func:`approval_granted`, :func:`approval_denied`,
:func:`incident_resolved`); the publishing functions wait for the broker's ack, so a
caller that returns without error knows the decision is in the log.

Example::

    channel = OperatorChannel.from_settings(Settings.from_env())
    request = find_approval_request(saga_records(...), approval_id)
    grant_approval(channel, request, operator="alice@example.com", via="cli")
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sagaline.kafka import DeliveryFailed, LedgerWriter, require_bootstrap
from schemas.keys import derived_event_id
from schemas.models import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    Envelope,
    IncidentRaised,
    IncidentResolved,
    Record,
)
from schemas.settings import Settings
from schemas.signing import Signer
from schemas.topics import TopicNames


class OperatorActionError(RuntimeError):
    """An operator action could not be recorded; the message says what to do."""


class MissingOperatorIdentity(OperatorActionError, ValueError):
    """Every decision must name the person who made it."""


class UnknownRequest(OperatorActionError, LookupError):
    """The approval request or incident named is not in the saga's ledger."""


def _operator(operator: str) -> str:
    who = operator.strip()
    if not who:
        raise MissingOperatorIdentity(
            "an operator identity is required (who is approving, denying or resolving?): "
            "pass --operator NAME on the CLI or fill 'operator' in the dashboard form"
        )
    return who


def _now() -> int:
    return int(time.time() * 1000)


def _envelope(
    record_type: type[Record], cause: Record, action: str, ref: str, via: str, now: int
) -> Envelope:
    # A deterministic id per (action, request): a double click or a CLI retry produces
    # the same event id, which the coordinator deduplicates (R15).
    return Envelope(
        event_id=derived_event_id("operator", action, cause.saga_id, ref),
        saga_id=cause.saga_id,
        tenant_id=cause.envelope.tenant_id,
        type=record_type.TYPE,
        occurred_at=now,
        producer=f"operator:{via}",
        generation=cause.envelope.generation,
        causation_id=cause.event_id,
    )


# ---------------------------------------------------------------- pure builders


def approval_granted(
    request: ApprovalRequested, *, operator: str, now: int, via: str = "cli"
) -> ApprovalGranted:
    """The grant bound to exactly what was requested (principal, step, fingerprint,
    scope, expiry): a grant for anything else would not count (R7)."""
    who = _operator(operator)
    return ApprovalGranted(
        envelope=_envelope(ApprovalGranted, request, "grant", request.approval_id, via, now),
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
    request: ApprovalRequested, *, operator: str, reason: str, now: int, via: str = "cli"
) -> ApprovalDenied:
    """A denial is a business rejection: the saga compensates at once (R7, R9)."""
    who = _operator(operator)
    return ApprovalDenied(
        envelope=_envelope(ApprovalDenied, request, "deny", request.approval_id, via, now),
        step_id=request.step_id,
        approval_id=request.approval_id,
        purpose=request.purpose,
        denied_by=who,
        reason=reason.strip() or f"denied by {who}",
    )


def incident_resolved(
    incident: IncidentRaised,
    *,
    operator: str,
    resolution: str,
    note: str = "",
    now: int,
    via: str = "cli",
) -> IncidentResolved:
    """For an unknown-outcome incident ``resolution`` must be COMMITTED or NOT_FOUND
    (it settles the step, R11); otherwise it is free text."""
    who = _operator(operator)
    text = resolution.strip()
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
    return IncidentResolved(
        envelope=_envelope(IncidentResolved, incident, "resolve", incident.incident_id, via, now),
        incident_id=incident.incident_id,
        resolved_by=who,
        resolution=text,
        note=note,
    )


def find_approval_request(records: Iterable[Record], approval_id: str) -> ApprovalRequested:
    """The ``ApprovalRequested`` with this id among a saga's records."""
    for record in records:
        if isinstance(record, ApprovalRequested) and record.approval_id == approval_id:
            return record
    raise UnknownRequest(
        f"no approval request {approval_id!r} in this saga's ledger: check the saga id and "
        "the approval id (sagaline dashboard or `sagaline saga show` list pending ones)"
    )


def find_incident(records: Iterable[Record], incident_id: str) -> IncidentRaised:
    """The ``IncidentRaised`` with this id among a saga's records."""
    for record in records:
        if isinstance(record, IncidentRaised) and record.incident_id == incident_id:
            return record
    raise UnknownRequest(
        f"no incident {incident_id!r} in this saga's ledger: check the saga id and the incident id"
    )


# ------------------------------------------------------------------ publishing


class OperatorChannel:
    """A producer for operator decisions onto ``sagaline.events``; waits for acks."""

    def __init__(self, bootstrap: str, topics: TopicNames, signer: Signer) -> None:
        self.topics = topics
        self.signer = signer
        self._writer = LedgerWriter(bootstrap, topics, signer)

    @classmethod
    def from_settings(cls, settings: Settings, bootstrap: str | None = None) -> OperatorChannel:
        """``bootstrap`` overrides; else the settings' (never a broker started here)."""
        if bootstrap is None:
            bootstrap = require_bootstrap(settings, "operator action")
        return cls(bootstrap, settings.topics, settings.signer())

    def publish(self, record: Record, timeout_s: float = 30.0) -> None:
        """Produce ``record`` and wait until the broker acknowledges it."""
        try:
            self._writer.append(record, timeout_s=timeout_s)
        except DeliveryFailed as exc:
            raise OperatorActionError(
                f"could not record {record.TYPE} for saga {record.saga_id}: {exc}; "
                "nothing was decided, try again"
            ) from exc

    def close(self) -> None:
        self._writer.close()


def grant_approval(
    channel: OperatorChannel,
    request: ApprovalRequested,
    *,
    operator: str,
    via: str = "cli",
    now: int | None = None,
) -> ApprovalGranted:
    """Record that ``operator`` approves ``request``; returns the record written."""
    record = approval_granted(request, operator=operator, now=now or _now(), via=via)
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
    record = approval_denied(request, operator=operator, reason=reason, now=now or _now(), via=via)
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
) -> IncidentResolved:
    """Record that ``operator`` resolved ``incident``; returns the record written."""
    record = incident_resolved(
        incident, operator=operator, resolution=resolution, note=note, now=now or _now(), via=via
    )
    channel.publish(record)
    return record


__all__ = [
    "MissingOperatorIdentity",
    "OperatorActionError",
    "OperatorChannel",
    "UnknownRequest",
    "approval_denied",
    "approval_granted",
    "deny_approval",
    "find_approval_request",
    "find_incident",
    "grant_approval",
    "incident_resolved",
    "resolve_incident",
]
