"""The end-to-end invariant of the refund demo, checked against the providers' own state.

A receipt says what became of each effect; a provider's SQLite file says what really
happened. The demo only passes when the two agree (R1, R6, R8, R12, R14):

* every committed effect is retained in a completed saga (or, past a committed pivot,
  in an escalated one: R6 goes forward only), compensated exactly once, or named in
  an incident of an escalated saga;
* nothing is left on hold, restocked or closed for a saga the receipt calls
  compensated;
* no credit was ever voided (the pivot is never clawed back), and every credit that
  stands has either a reply that mentions it or an incident in its saga;
* a step the receipt calls not committed or read-only has no effect in the provider;
  one it calls escalated after the ledger saw it commit has its effect there;
* no step of a completed saga was compensated (a completed saga retains every
  committed effect);
* no provider effect is missing from the receipts (an effect nobody accounts for is
  exactly what Sagaline exists to prevent).

:func:`check_invariants` is pure: it takes the receipts and a :class:`ProviderWorld`
(the rows the providers hold), so it is unit-tested with hand-made worlds.
:func:`read_world` builds that world by opening each provider's SQLite file
read-only, never through the provider code under test.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from schemas.keys import key_hash
from schemas.models import TerminalStatus
from schemas.receipt import Disposition, Receipt, StepReceipt
from services.refund.providers import (
    InventoryProvider,
    MailerProvider,
    PaymentsProvider,
    PolicyProvider,
    TicketsProvider,
)

__all__ = [
    "FORWARD_EFFECTS",
    "ProviderEffect",
    "ProviderFileUnreadable",
    "ProviderWorld",
    "Violation",
    "check_invariants",
    "read_world",
]


@dataclass(frozen=True)
class ForwardEffect:
    """How one tool's effect, and the undoing of it, show in a provider's effect log."""

    provider: str
    done: str  # effect kind written when the tool commits
    undone: str  # effect kind written when its compensation changes the world


FORWARD_EFFECTS: Mapping[str, ForwardEffect] = {
    "place_hold": ForwardEffect("inventory", "hold.placed", "hold.released"),
    "return_to_inventory": ForwardEffect("inventory", "stock.returned", "stock.removed"),
    "issue_credit": ForwardEffect("payments", "credit.issued", "credit.voided"),
    "send_reply": ForwardEffect("mailer", "email.reply", "email.correction"),
    "close_ticket": ForwardEffect("tickets", "ticket.closed", "ticket.reopened"),
}
"""The refund tools that change the world (``validate_refund`` is read-only)."""

_UNDONE_KINDS = {f.undone: tool for tool, f in FORWARD_EFFECTS.items()}
_DONE_KINDS = {f.done: tool for tool, f in FORWARD_EFFECTS.items()}


@dataclass(frozen=True)
class ProviderEffect:
    """One row of a provider's effect log."""

    provider: str
    kind: str
    idempotency_key: str | None
    operation_id: str | None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderWorld:
    """What the providers hold: their effect logs and their current state tables."""

    effects: Sequence[ProviderEffect] = ()
    holds: Mapping[str, str] = field(default_factory=dict)  # hold_id -> active | released
    movements: Mapping[str, str] = field(default_factory=dict)  # id -> returned | removed
    credits: Mapping[str, str] = field(default_factory=dict)  # credit_id -> issued | voided
    reply_credits: Mapping[str, str | None] = field(default_factory=dict)  # msg -> credit_id
    corrections: Mapping[str, str] = field(default_factory=dict)  # msg -> corrected msg
    tickets: Mapping[str, str] = field(default_factory=dict)  # ticket_id -> status


@dataclass(frozen=True)
class Violation:
    """One way the world and the receipts disagree, in words a person can act on."""

    rule: str  # e.g. "R12" or "R6"
    saga_id: str | None
    message: str

    def __str__(self) -> str:
        where = f"saga {self.saga_id}: " if self.saga_id else ""
        return f"[{self.rule}] {where}{self.message}"


def _subject_of_done(effect: ProviderEffect) -> str | None:
    """What the undo of this effect refers to: the operation id, or the ticket id."""
    if effect.kind == "ticket.closed":
        ticket = effect.detail.get("ticket_id")
        return str(ticket) if ticket is not None else None
    return effect.operation_id


def _subject_of_undone(effect: ProviderEffect) -> str | None:
    if effect.kind == "email.correction":
        corrects = effect.detail.get("corrects")
        return str(corrects) if corrects is not None else None
    if effect.kind == "ticket.reopened":
        ticket = effect.detail.get("ticket_id")
        return str(ticket) if ticket is not None else None
    return effect.operation_id


def _state_undone(world: ProviderWorld, tool: str, subject: str) -> bool | None:
    """Whether the provider's state table shows the effect undone (None: no such row)."""
    if tool == "place_hold":
        status = world.holds.get(subject)
        return None if status is None else status != "active"
    if tool == "return_to_inventory":
        status = world.movements.get(subject)
        return None if status is None else status != "returned"
    if tool == "issue_credit":
        status = world.credits.get(subject)
        return None if status is None else status != "issued"
    if tool == "send_reply":
        return subject in world.corrections.values()
    if tool == "close_ticket":
        status = world.tickets.get(subject)
        return None if status is None else status != "closed"
    return None


def check_invariants(
    receipts: Iterable[Receipt],
    world: ProviderWorld,
    *,
    expected_sagas: Iterable[str] = (),
) -> list[Violation]:
    """Every disagreement between the receipts and the providers' state; empty when
    the run is consistent. ``expected_sagas`` are saga ids that must have a receipt
    (every saga the run started must be terminal)."""
    receipts = list(receipts)
    violations: list[Violation] = []
    by_saga = {r.saga_id: r for r in receipts}
    for saga_id in expected_sagas:
        if saga_id not in by_saga:
            violations.append(
                Violation("R14", saga_id, "not terminal: no SagaTerminal receipt was published")
            )

    # Index the effect logs: forward effects by key hash and operation id, undo
    # effects by the subject they undo.
    done_by_hash: dict[str, list[ProviderEffect]] = defaultdict(list)
    done_by_op: dict[str, list[ProviderEffect]] = defaultdict(list)
    undone_by_subject: dict[tuple[str, str], list[ProviderEffect]] = defaultdict(list)
    for effect in world.effects:
        if effect.kind in _DONE_KINDS:
            if effect.idempotency_key:
                done_by_hash[key_hash(effect.idempotency_key)].append(effect)
            if effect.operation_id:
                done_by_op[effect.operation_id].append(effect)
        elif effect.kind in _UNDONE_KINDS:
            subject = _subject_of_undone(effect)
            if subject is not None:
                undone_by_subject[(_UNDONE_KINDS[effect.kind], subject)].append(effect)

    claimed: set[int] = set()  # id() of forward effects some receipt step accounts for
    credit_sagas: dict[str, Receipt] = {}
    for receipt in receipts:
        pivot_committed = any(
            s.pivot and s.disposition is not Disposition.NOT_COMMITTED and s.committed_at
            for s in receipt.steps
        )
        for step in receipt.steps:
            if step.tool not in FORWARD_EFFECTS:
                continue
            found = _forward_effects_of(step, done_by_hash, done_by_op)
            claimed.update(id(e) for e in found)
            if step.tool == "issue_credit":
                for effect in found:
                    if effect.operation_id:
                        credit_sagas[effect.operation_id] = receipt
            violations += _check_step(
                receipt, step, found, undone_by_subject, world, pivot_committed
            )

    # Effects no receipt accounts for.
    for effect in world.effects:
        if effect.kind in _DONE_KINDS and id(effect) not in claimed:
            violations.append(
                Violation(
                    "R14",
                    None,
                    f"{effect.provider} has {effect.kind} {effect.operation_id}"
                    f" ({dict(effect.detail)}) that no saga receipt accounts for",
                )
            )

    # The pivot is never clawed back (R6).
    for effect in world.effects:
        if effect.kind == "credit.voided":
            saga = credit_sagas.get(effect.operation_id or "")
            violations.append(
                Violation(
                    "R6",
                    saga.saga_id if saga else None,
                    f"credit {effect.operation_id} was voided: the pivot must never be"
                    " compensated once it committed",
                )
            )

    # No credit without a reply that mentions it, or an incident in its saga.
    replied = {c for c in world.reply_credits.values() if c}
    for credit_id, status in world.credits.items():
        if status != "issued" or credit_id in replied:
            continue
        saga = credit_sagas.get(credit_id)
        if saga is not None and saga.incidents:
            continue
        violations.append(
            Violation(
                "R6",
                saga.saga_id if saga else None,
                f"credit {credit_id} stands but no reply mentions it and no incident"
                " hands it to a person",
            )
        )
    return violations


def _forward_effects_of(
    step: StepReceipt,
    done_by_hash: Mapping[str, list[ProviderEffect]],
    done_by_op: Mapping[str, list[ProviderEffect]],
) -> list[ProviderEffect]:
    kind = FORWARD_EFFECTS[step.tool].done
    found: dict[int, ProviderEffect] = {}
    if step.idempotency_key_hash:
        for effect in done_by_hash.get(step.idempotency_key_hash, []):
            if effect.kind == kind:
                found[id(effect)] = effect
    if step.provider_operation_id:
        for effect in done_by_op.get(step.provider_operation_id, []):
            if effect.kind == kind:
                found[id(effect)] = effect
    return list(found.values())


def _check_step(
    receipt: Receipt,
    step: StepReceipt,
    found: list[ProviderEffect],
    undone_by_subject: Mapping[tuple[str, str], list[ProviderEffect]],
    world: ProviderWorld,
    pivot_committed: bool,
) -> list[Violation]:
    saga, tool, where = receipt.saga_id, step.tool, f"step {step.step_id} ({step.tool})"
    status, disposition = receipt.status, step.disposition
    out: list[Violation] = []

    def bad(rule: str, message: str) -> None:
        out.append(Violation(rule, saga, f"{where}: {message}"))

    if len(found) > 1:
        bad("R15", f"the provider applied it {len(found)} times (idempotency key ignored)")
    if disposition is Disposition.NOT_COMMITTED:
        if found:
            bad(
                "R1",
                f"the receipt says it never committed, but {found[0].provider} has"
                f" {found[0].kind} {found[0].operation_id}: an effect nobody will undo",
            )
        return out
    if disposition is Disposition.READ_ONLY:
        if found:  # these tools change the world: "read-only" would hide the effect
            bad(
                "R14",
                f"the receipt says it was read-only (changed nothing), but"
                f" {found[0].provider} has {found[0].kind} {found[0].operation_id}:"
                " an effect nobody will undo",
            )
        return out

    subjects = {s for s in (_subject_of_done(e) for e in found) if s is not None}
    undos = [u for s in subjects for u in undone_by_subject.get((tool, s), [])]
    state_undone = [_state_undone(world, tool, s) for s in subjects]

    if disposition is Disposition.RETAINED:
        if not found:
            bad("R14", "the receipt says it was retained, but the provider has no such effect")
        if undos or any(state_undone):
            bad("R14", "the receipt says it was retained, but the provider shows it undone")
        if status is TerminalStatus.COMPENSATED:
            bad(
                "R12",
                f"left in place ({_describe(tool, subjects)}) although the saga is compensated",
            )
        elif status is TerminalStatus.ESCALATED and not pivot_committed:
            bad("R14", "retained in an escalated saga that has no committed pivot")
    elif disposition is Disposition.COMPENSATED:
        if status is TerminalStatus.COMPLETED:
            bad(
                "R14",
                "compensated in a saga that ended COMPLETED (a completed saga retains"
                " every committed effect)",
            )
        if tool == "issue_credit":
            bad("R6", "the pivot was compensated (credit voided)")
        if not found:
            bad("R1", "compensated, but the provider never committed the effect")
        elif len(undos) != 1:
            bad("R8", f"compensated {len(undos)} times in the provider (expected exactly once)")
        if found and not all(state_undone):
            bad(
                "R12",
                f"the receipt says compensated, but {_describe(tool, subjects)} is still in"
                " place in the provider",
            )
    elif disposition is Disposition.ESCALATED:
        incidents = {i.incident_id for i in receipt.incidents}
        if status is not TerminalStatus.ESCALATED:
            bad("R14", f"escalated step in a saga that ended {status.value}")
        if step.incident_id is None or step.incident_id not in incidents:
            bad("R8", "escalated, but no incident of the saga names it")
        if step.committed_at is not None and not found:
            # Its compensation failed or was held: the incident hands a committed
            # effect to a person. (Escalated before any commit, an unknown outcome,
            # the effect may or may not exist.)
            bad(
                "R14",
                "the ledger saw it commit and escalated it, but the provider has no such effect",
            )
        if len(undos) > 1:
            bad("R8", f"compensated {len(undos)} times in the provider (at most once)")
    return out


def _describe(tool: str, subjects: set[str]) -> str:
    noun = {
        "place_hold": "hold",
        "return_to_inventory": "restock",
        "issue_credit": "credit",
        "send_reply": "reply",
        "close_ticket": "ticket closure",
    }[tool]
    return f"{noun} {', '.join(sorted(subjects)) or '?'}"


# ---------------------------------------------------------------- reading the world

_FILES: Mapping[str, str] = {
    "policy": PolicyProvider.file_name,
    "inventory": InventoryProvider.file_name,
    "payments": PaymentsProvider.file_name,
    "mailer": MailerProvider.file_name,
    "tickets": TicketsProvider.file_name,
}


class ProviderFileUnreadable(RuntimeError):
    """A provider's SQLite file exists but cannot be read as one: the invariant
    cannot be checked (it is not an empty world)."""


def _connect_read_only(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.execute("SELECT 1 FROM sqlite_master").fetchall()
        return conn
    except sqlite3.OperationalError as exc:
        # A WAL database whose writers have all exited may lack its -shm file, which
        # a read-only connection cannot create; the file is quiescent, so read it as
        # is. Not when it is locked, nor when its -wal file holds commits: an
        # immutable read skips the WAL, and so would miss effects (raised instead,
        # as an unreadable file).
        if "locked" in str(exc) or _wal_may_hold_commits(path):
            raise
        return sqlite3.connect(f"file:{path}?immutable=1", uri=True)


def _wal_may_hold_commits(path: Path) -> bool:
    """Whether the -wal file beside ``path`` may hold commits not in ``path`` itself."""
    try:
        return path.with_name(path.name + "-wal").stat().st_size > 0
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: do not read around it


def _rows(conn: sqlite3.Connection, sql: str) -> list[tuple[Any, ...]]:
    try:
        return list(conn.execute(sql).fetchall())
    except sqlite3.OperationalError as exc:
        if str(exc).startswith("no such table"):
            return []  # the provider never created the table (it never ran)
        raise


def read_world(state_dir: Path) -> ProviderWorld:
    """Open each provider's SQLite file under ``state_dir/<participant>/`` read-only.

    A provider that never started has no file (or no tables): it contributes
    nothing. A file that exists but cannot be read raises
    :class:`ProviderFileUnreadable` naming it.
    """
    effects: list[ProviderEffect] = []
    tables: dict[str, list[tuple[Any, ...]]] = {}
    queries = {
        "inventory": {
            "holds": "SELECT hold_id, status FROM holds",
            "movements": "SELECT movement_id, status FROM movements",
        },
        "payments": {"credits": "SELECT credit_id, status FROM credits"},
        "mailer": {"emails": "SELECT message_id, kind, credit_id, corrects FROM emails"},
        "tickets": {"tickets": "SELECT ticket_id, status FROM tickets"},
    }
    for provider, file_name in _FILES.items():
        path = Path(state_dir) / provider / file_name
        if not path.exists():
            continue
        try:
            conn = _connect_read_only(path)
            try:
                for kind, key, op, detail in _rows(
                    conn,
                    "SELECT kind, idempotency_key, operation_id, detail FROM effects ORDER BY seq",
                ):
                    effects.append(ProviderEffect(provider, kind, key, op, orjson.loads(detail)))
                for table, sql in queries.get(provider, {}).items():
                    tables[table] = _rows(conn, sql)
            finally:
                conn.close()
        except sqlite3.DatabaseError as exc:  # OperationalError included
            raise ProviderFileUnreadable(f"cannot read {provider}'s file {path}: {exc}") from exc
    emails = tables.get("emails", [])
    return ProviderWorld(
        effects=tuple(effects),
        holds={r[0]: r[1] for r in tables.get("holds", [])},
        movements={r[0]: r[1] for r in tables.get("movements", [])},
        credits={r[0]: r[1] for r in tables.get("credits", [])},
        reply_credits={r[0]: r[2] for r in emails if r[1] == "reply"},
        corrections={r[0]: r[3] for r in emails if r[1] == "correction" and r[3]},
        tickets={r[0]: r[1] for r in tables.get("tickets", [])},
    )
