"""The Atlas refund example (seed 003) as Sagaline participants.

Five participants, each with its own SQLite provider under a state directory:
``policy``, ``inventory``, ``payments``, ``mailer``, ``tickets``. The registry below
is what the participant runtime loads (``sagaline participant run <name>``)::

    from services.refund import build_catalogue, FaultPlan
    catalogue = build_catalogue("payments", Path("/var/lib/sagaline"), FaultPlan.from_env())

``PARTICIPANTS[name](state_dir, faults)`` builds the bare participant object (its
provider at ``participant.provider``) for tests that want to look at the world.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from participants.catalogue import Catalogue, wrap
from schemas.models import StepScheduled
from services.refund.faults import FaultInjector, FaultMode, FaultPlan, FaultRule
from services.refund.participants import Inventory, Mailer, Payments, Policy, Tickets
from services.refund.providers import (
    InventoryProvider,
    MailerProvider,
    PaymentsProvider,
    PolicyProvider,
    TicketsProvider,
)

__all__ = [
    "PARTICIPANTS",
    "FaultMode",
    "FaultPlan",
    "FaultRule",
    "Inventory",
    "Mailer",
    "ParticipantFactory",
    "Payments",
    "Policy",
    "Tickets",
    "UnknownParticipantError",
    "build_catalogue",
    "build_participant",
    "drill_catalogues",
    "economic_effect",
]

ParticipantFactory = Callable[[Path, FaultPlan], Any]
"""``factory(state_dir, faults) -> participant object`` (with its provider)."""


def _policy(state_dir: Path, faults: FaultPlan) -> Policy:
    return Policy(PolicyProvider(state_dir), FaultInjector(faults, state_dir))


def _inventory(state_dir: Path, faults: FaultPlan) -> Inventory:
    return Inventory(InventoryProvider(state_dir), FaultInjector(faults, state_dir))


def _payments(state_dir: Path, faults: FaultPlan) -> Payments:
    return Payments(PaymentsProvider(state_dir), FaultInjector(faults, state_dir))


def _mailer(state_dir: Path, faults: FaultPlan) -> Mailer:
    return Mailer(MailerProvider(state_dir), FaultInjector(faults, state_dir))


def _tickets(state_dir: Path, faults: FaultPlan) -> Tickets:
    return Tickets(TicketsProvider(state_dir), FaultInjector(faults, state_dir))


PARTICIPANTS: dict[str, ParticipantFactory] = {
    "policy": _policy,
    "inventory": _inventory,
    "payments": _payments,
    "mailer": _mailer,
    "tickets": _tickets,
}
"""Participant name (its command topic is ``sagaline.commands.<name>``) -> factory."""


class UnknownParticipantError(KeyError):
    """A participant name the refund example does not have."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.text = (
            f"the refund example has no participant {name!r};"
            f" choose one of: {', '.join(PARTICIPANTS)}"
        )
        super().__init__(self.text)

    def __str__(self) -> str:
        return self.text


def build_participant(name: str, state_dir: Path, faults: FaultPlan | None = None) -> Any:
    """The participant object ``name`` with its provider under ``state_dir``."""
    try:
        factory = PARTICIPANTS[name]
    except KeyError:
        raise UnknownParticipantError(name) from None
    return factory(Path(state_dir), faults if faults is not None else FaultPlan.none())


def build_catalogue(name: str, state_dir: Path, faults: FaultPlan | None = None) -> Catalogue:
    """The checked catalogue of participant ``name`` (``wrap()`` raises on any bad
    declaration, R4); its participant object is ``catalogue.participants[0]``."""
    return wrap(build_participant(name, state_dir, faults), name=name)


def economic_effect(step: StepScheduled) -> int | None:
    """The refund tools' money effect: their ``amount_cents`` argument (the measure
    ``sagaline.ops.metrics`` is given; unreadable arguments count as none)."""
    try:
        args: Any = orjson.loads(step.args)
    except orjson.JSONDecodeError:
        return None
    value = args.get("amount_cents") if isinstance(args, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def drill_catalogues(state_dir: Path) -> list[Catalogue]:
    """Every refund participant's catalogue, without faults of its own: what
    ``sagaline drill --catalogue services.refund:drill_catalogues`` runs against
    (the drill injects its faults around the tools; ``drill-plan.json`` is the plan)."""
    return [build_catalogue(name, Path(state_dir) / name) for name in PARTICIPANTS]
