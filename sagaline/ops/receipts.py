"""Receipts in words a person can act on, as text (CLI) and HTML (dashboard).

Both renderings come from one description (:func:`describe_receipt`), so the CLI's
``sagaline saga show`` and the dashboard can never tell an operator two different
stories about the same saga. The description follows seed 004's user-facing split:
what was done, what was undone (and verified), what cannot be undone, what is still
pending, and who owns it.

Example::

    from sagaline.ops.receipts import render_receipt_text
    print(render_receipt_text(Receipt.from_json(terminal.receipt)))
"""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from schemas.models import IncidentResolved, Record, Reversibility, SagaTerminal, TerminalStatus
from schemas.receipt import ApprovalRecord, Disposition, Receipt, StepReceipt


@dataclass(frozen=True)
class Item:
    """One line an operator reads, plus the technical details that back it."""

    text: str
    details: tuple[str, ...] = ()


@dataclass(frozen=True)
class Section:
    key: str  # stable id: done | undone | irreversible | pending | not_committed | approvals
    title: str
    items: tuple[Item, ...]


@dataclass(frozen=True)
class ReceiptStory:
    headline: str
    status: TerminalStatus
    sections: tuple[Section, ...]
    facts: tuple[tuple[str, str], ...] = field(default_factory=tuple)


_HEADLINES = {
    TerminalStatus.COMPLETED: "completed: every effect it made was kept on purpose.",
    TerminalStatus.COMPENSATED: "was compensated: every effect it made was undone.",
    TerminalStatus.ESCALATED: "was escalated: some effects need a person (see 'Pending').",
}


# A grant the coordinator refused must not read like one that counted.
_DECISION = {
    "GRANTED": "granted",
    "DENIED": "denied",
    "EXPIRED": "EXPIRED grant (not counted)",
    "REJECTED_MISMATCH": "REJECTED grant, not matching the request (not counted)",
}
_UNANSWERED = "-"  # ``by`` of an approval request that expired with no decision


def format_ms(epoch_ms: int | None) -> str:
    """UTC wall time to the millisecond, or a dash; a time no calendar holds is
    shown as the number it is."""
    if epoch_ms is None:
        return "-"
    try:
        moment = _dt.datetime.fromtimestamp(epoch_ms / 1000, tz=_dt.UTC)
    except (OverflowError, OSError, ValueError):  # a producer's clock gone wrong
        return f"{epoch_ms} ms since the epoch (not a valid time)"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{epoch_ms % 1000:03d} UTC"


def format_duration(ms: int) -> str:
    """A duration the way a person says it: 850 ms, 2.4 s, 3 min 5 s, 2 h 10 min."""
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    if ms < 3_600_000:
        return f"{ms // 60_000} min {ms % 60_000 // 1000} s"
    return f"{ms // 3_600_000} h {ms % 3_600_000 // 60_000} min"


def _step_name(step: StepReceipt) -> str:
    return f"{step.tool} (step {step.step_id})"


def _handed_and_resolved(step: StepReceipt, name: str, ref: str, when: str, how: str) -> Item:
    """An escalated step whose incident a person resolved ``when`` ("before" or
    "after") the saga ended, and how."""
    return Item(
        f"{name} was handed to {step.owner}{ref}, resolved {when} the saga ended: {how}.",
        _forward_details(step) + (_compensation_details(step) if step.compensation else ()),
    )


def _forward_details(step: StepReceipt) -> tuple[str, ...]:
    out = [
        f"participant {step.participant}; {step.reversibility.value.lower()}"
        + ("; the pivot" if step.pivot else ""),
        f"forward attempts: {step.forward_attempts}; last observation: {step.observation}",
    ]
    if step.intent_at is not None:
        out.append(f"intent recorded at {format_ms(step.intent_at)}")
    if step.provider_operation_id:
        out.append(f"provider operation: {step.provider_operation_id}")
    if step.committed_at is not None:
        out.append(f"committed at {format_ms(step.committed_at)}")
    if step.idempotency_key_hash:
        out.append(f"idempotency key hash: {step.idempotency_key_hash}")
    if step.resources:
        out.append("resources: " + ", ".join(step.resources))
    if step.note:
        out.append(step.note)
    return tuple(out)


def _compensation_details(step: StepReceipt) -> tuple[str, ...]:
    out = [f"compensation {step.compensation}: {step.compensation_attempts} attempt(s)"]
    if step.compensation_provider_operation_id:
        out.append(f"compensation operation: {step.compensation_provider_operation_id}")
    if step.compensation_key_hash:
        out.append(f"compensation key hash: {step.compensation_key_hash}")
    if step.verification is not None:
        out.append(f"compensation verification: {step.verification}")
    return tuple(out)


def _verification_words(step: StepReceipt) -> str:
    if step.verification == "PASSED":
        return "undone and verified"
    if step.verification == "FAILED":
        return "undo ran but its verification FAILED"
    return "undone (the tool declares no verification)"


def _approval_words(a: ApprovalRecord) -> str:
    if a.decision == "EXPIRED" and a.by == _UNANSWERED:
        # The coordinator's expiry timer: nobody decided, so there is no grant to name.
        return (
            f"request for step {a.step_id} ({a.purpose.lower()}) EXPIRED unanswered "
            f"at {format_ms(a.at)}"
        )
    if a.decision == "WITHDRAWN":
        # The coordinator stopped waiting (the step was cancelled, or its compensation
        # handed to a person): nobody decided.
        return (
            f"request for step {a.step_id} ({a.purpose.lower()}) WITHDRAWN by the "
            f"coordinator at {format_ms(a.at)}: the step no longer waited for it"
        )
    return (
        f"{_DECISION.get(a.decision, a.decision.lower())} by {a.by} for step {a.step_id} "
        f"({a.purpose.lower()}) at {format_ms(a.at)}"
    )


def later_resolutions(receipt: Receipt, records: Iterable[Record]) -> dict[str, str]:
    """How each incident the saga left open at its end was resolved since, from the
    saga's ledger records (in log order): the first resolution after the terminal
    record, of the saga's tenant, as the coordinator counts it
    (``coordinator.shell._resolve_ended``). Incident id -> "resolution (by whom)"."""
    left_open = {i.incident_id for i in receipt.incidents if not i.resolved}
    out: dict[str, str] = {}
    ended = False
    for record in records:
        if isinstance(record, SagaTerminal):
            ended = True
        elif (
            ended
            and isinstance(record, IncidentResolved)
            and record.incident_id in left_open
            and record.incident_id not in out
            and record.envelope.tenant_id == receipt.tenant_id
        ):
            out[record.incident_id] = f"{record.resolution} (by {record.resolved_by})"
    return out


def describe_receipt(
    receipt: Receipt, resolved_after: Mapping[str, str] | None = None
) -> ReceiptStory:
    """The one description both renderers print. ``resolved_after``: incidents the
    saga left open and a person resolved after its end (incident id -> how, e.g. from
    :func:`later_resolutions`); they are told as resolved, not as pending."""
    done: list[Item] = []
    undone: list[Item] = []
    irreversible: list[Item] = []
    pending: list[Item] = []
    not_committed: list[Item] = []
    settled: list[Item] = []  # handed to a person at the end, resolved since
    later = dict(resolved_after or {})

    open_incidents = {i.incident_id: i for i in receipt.incidents if not i.resolved}
    # Resolved while the saga still ran: the receipt itself says how.
    resolved_before = {i.incident_id: i for i in receipt.incidents if i.resolved}
    told: set[str] = set()  # the ``unresolved`` entries the pending items already name
    for step in receipt.steps:
        name = _step_name(step)
        if step.disposition is Disposition.READ_ONLY:
            continue  # changed nothing in the world: nothing to act on
        if step.disposition is Disposition.NOT_COMMITTED:
            not_committed.append(
                Item(f"{name} never took effect: nothing to undo.", _forward_details(step))
            )
            continue
        if step.disposition is Disposition.COMPENSATED:
            undone.append(
                Item(
                    f"{name}: {_verification_words(step)}.",
                    _forward_details(step) + _compensation_details(step),
                )
            )
            continue
        if step.disposition is Disposition.ESCALATED:
            ref = f" (incident {step.incident_id})" if step.incident_id else ""
            raised = open_incidents.pop(step.incident_id or "", None)
            told.add(step.step_id)
            before = resolved_before.get(step.incident_id or "")
            if raised is None and before is not None:
                told.add(f"incident:{before.incident_id}")  # told here, not again below
                settled.append(
                    _handed_and_resolved(step, name, ref, "before", before.resolution or "no note")
                )
                continue
            if raised is not None and raised.incident_id in later:
                told.add(f"incident:{raised.incident_id}")
                settled.append(
                    _handed_and_resolved(step, name, ref, "after", later[raised.incident_id])
                )
                continue
            # Forward work that failed after the pivot never took effect: it is owed,
            # not in effect (its incident says so too).
            owed = step.committed_at is None and step.compensation_attempts == 0
            what = ""
            if raised is not None:
                told.add(f"incident:{raised.incident_id}")
                where = f" on {', '.join(raised.resources)}" if raised.resources else ""
                label = "Now" if owed else "Still changed"
                what = f" {raised.inconsistency}{where}. {label}: {raised.effect}."
            state = (
                "did not take effect and is still owed; it needs"
                if owed
                else "is still in effect and needs"
            )
            pending.append(
                Item(
                    f"{name} {state} {step.owner}{ref}.{what}"
                    + (f" {step.note}" if step.note else ""),
                    _forward_details(step)
                    + (_compensation_details(step) if step.compensation else ()),
                )
            )
            continue
        # RETAINED: done and kept on purpose.
        why = "kept on purpose"
        if step.pivot:
            why = "kept: it is the pivot, past which the saga goes forward"
        elif receipt.pivot_step is not None and receipt.status is not TerminalStatus.COMPLETED:
            why = "kept: it ran past the pivot"
        item = Item(f"{name} was done and {why}.", _forward_details(step))
        if step.reversibility is Reversibility.IRREVERSIBLE:
            irreversible.append(
                Item(
                    f"{name} cannot be undone (it already reached someone); "
                    "only a follow-up, such as a correction, can change what they know.",
                    item.details,
                )
            )
        else:
            done.append(item)

    for incident in open_incidents.values():  # those not already told with their step
        told.add(f"incident:{incident.incident_id}")
        if incident.incident_id in later:
            settled.append(
                Item(
                    f"Incident {incident.incident_id} ({incident.kind}) was resolved after the "
                    f"saga ended: {later[incident.incident_id]}.",
                    (f"owner {incident.owner}; {incident.inconsistency}",),
                )
            )
            continue
        where = f" on {', '.join(incident.resources)}" if incident.resources else ""
        pending.append(
            Item(
                f"Incident {incident.incident_id} ({incident.kind}), owned by {incident.owner}: "
                f"{incident.inconsistency}{where}. Still changed: {incident.effect}.",
                ((f"step {incident.step_id}",) if incident.step_id else ()),
            )
        )
    for text in receipt.unresolved:
        if text not in told:
            pending.append(Item(f"Unresolved: {text}"))

    approvals = tuple(
        Item(
            _approval_words(a),
            (f"principal {a.principal}; arguments fingerprint {a.args_fingerprint}",),
        )
        for a in receipt.approvals
    )
    resolved = tuple(settled) + tuple(
        Item(
            f"Incident {i.incident_id} ({i.kind}) was resolved: {i.resolution or 'no note'}.",
            (f"owner {i.owner}; {i.inconsistency}",),
        )
        for i in receipt.incidents
        if i.resolved and f"incident:{i.incident_id}" not in told
    )

    sections = [
        Section("pending", "Pending: needs a person", tuple(pending)),
        Section("irreversible", "Cannot be undone", tuple(irreversible)),
        Section("undone", "Undone", tuple(undone)),
        Section("done", "Done and kept", tuple(done)),
        Section("not_committed", "Never took effect", tuple(not_committed)),
        Section("approvals", "Approvals", approvals),
        Section("resolved", "Resolved incidents", resolved),
    ]
    owner = receipt.owner or next(
        (s.owner for s in receipt.steps if s.disposition is Disposition.ESCALATED), None
    )
    headline = f"Saga {receipt.saga_id} ({receipt.workflow}) {_HEADLINES[receipt.status]}"
    if receipt.status is TerminalStatus.ESCALATED and settled and not pending:
        headline = (
            f"Saga {receipt.saga_id} ({receipt.workflow}) was escalated; what it left for a "
            "person has since been resolved (see 'Resolved incidents')."
        )
    elif owner and receipt.status is TerminalStatus.ESCALATED:
        headline += f" Owner: {owner}."
    facts = (
        ("saga", receipt.saga_id),
        ("tenant", receipt.tenant_id),
        ("workflow", f"{receipt.workflow} v{receipt.workflow_version}"),
        ("policy", f"v{receipt.policy_version}"),
        ("sdk", receipt.sdk_version),
        ("principal", receipt.principal),
        ("generation", str(receipt.generation)),
        ("status", receipt.status.value),
        ("started", format_ms(receipt.started_at)),
        (
            "ended",
            f"{format_ms(receipt.ended_at)} "
            f"(after {format_duration(max(receipt.ended_at - receipt.started_at, 0))})",
        ),
        ("end reason", receipt.end_reason or "-"),
        ("pivot", receipt.pivot_step or "none committed"),
        ("owner", owner or "-"),
    )
    return ReceiptStory(
        headline=headline,
        status=receipt.status,
        sections=tuple(s for s in sections if s.items),
        facts=facts,
    )


def render_receipt_text(receipt: Receipt, resolved_after: Mapping[str, str] | None = None) -> str:
    """The receipt as plain text for a terminal (``sagaline saga show``)."""
    story = describe_receipt(receipt, resolved_after)
    lines = [story.headline, ""]
    for section in story.sections:
        lines.append(f"{section.title}:")
        for item in section.items:
            lines.append(f"  - {item.text}")
            lines.extend(f"      {d}" for d in item.details)
        lines.append("")
    width = max(len(k) for k, _ in story.facts)
    lines.append("Details:")
    lines.extend(f"  {k.ljust(width)}  {v}" for k, v in story.facts)
    return "\n".join(lines) + "\n"


def render_receipt_html(receipt: Receipt, resolved_after: Mapping[str, str] | None = None) -> str:
    """The receipt as an HTML fragment (no <html> wrapper) for the dashboard."""
    story = describe_receipt(receipt, resolved_after)
    e = html.escape
    status = story.status.value.lower()
    parts = [
        f'<section class="receipt receipt-{status}">',
        f'<p class="headline">{e(story.headline)}</p>',
    ]
    for section in story.sections:
        parts.append(f'<div class="receipt-section section-{section.key}">')
        parts.append(f"<h3>{e(section.title)}</h3><ul>")
        for item in section.items:
            parts.append(f"<li>{e(item.text)}")
            if item.details:
                parts.append('<details><summary>details</summary><ul class="details">')
                parts.extend(f"<li>{e(d)}</li>" for d in item.details)
                parts.append("</ul></details>")
            parts.append("</li>")
        parts.append("</ul></div>")
    parts.append('<table class="facts">')
    parts.extend(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in story.facts)
    parts.append("</table></section>")
    return "\n".join(parts)
