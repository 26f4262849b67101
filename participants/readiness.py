"""Is anyone consuming? The coordinator's and each participant's consumer group, read
through the Kafka admin API, so scripts and the client need no admin calls of their own.

A call whose command nobody consumes would otherwise wait out its whole timeout and
end as an "unknown outcome" with no hint why; ``require_coordinator`` turns that into
an error that says what to start. ``sagaline status`` prints the same facts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sagaline.kafka import KafkaException, create_admin, describe_group
from schemas.settings import Settings

__all__ = [
    "CoordinatorNotRunning",
    "GroupStatus",
    "coordinator_group",
    "group_status",
    "participant_group",
    "require_coordinator",
]


class CoordinatorNotRunning(RuntimeError):
    """No coordinator consumes the ledger: no step would ever be dispatched."""


@dataclass(frozen=True)
class GroupStatus:
    """One consumer group as the broker reports it."""

    group: str
    state: str
    members: int

    @property
    def consuming(self) -> bool:
        """Some process is in the group (a rebalance in progress counts: it is joining)."""
        return self.members > 0 and self.state not in ("DEAD", "EMPTY")


def coordinator_group(settings: Settings) -> str:
    """The coordinator's consumer group (the default of ``coordinator.shell``)."""
    return f"{settings.topic_prefix}sagaline-coordinator"


def participant_group(settings: Settings, participant: str) -> str:
    """A participant's consumer group (as ``ParticipantRuntime.run`` names it)."""
    return f"{settings.topic_prefix}sagaline-participant-{participant}"


def group_status(
    bootstrap: str, group: str, *, timeout_s: float = 10.0, hidden_is_error: bool = False
) -> GroupStatus:
    """The state and member count of ``group``; an unknown group is ``DEAD`` with 0.
    ``hidden_is_error``: a group the broker hides from this principal (no Describe
    ACL on it) raises :class:`sagaline.kafka.GroupNotAuthorized` instead of reading
    as ``DEAD``.

    Read with :func:`sagaline.kafka.describe_group`, which a broker going away cannot
    turn into a crash of this process (the client calls this after a call times out,
    which is when a broker may be down)."""
    admin = create_admin(bootstrap)
    try:
        info = describe_group(admin, group, timeout_s=timeout_s, hidden_is_error=hidden_is_error)
    except KafkaException as exc:
        raise ConnectionError(
            f"cannot describe consumer group {group!r} on {bootstrap}: {exc}"
        ) from exc
    return GroupStatus(group, info.state, info.members)


def require_coordinator(settings: Settings, bootstrap: str, *, patience_s: float = 15.0) -> None:
    """Return once a coordinator consumes the ledger; raise ``CoordinatorNotRunning``
    (saying what to start) if none joins within ``patience_s`` (a coordinator that is
    starting or restarting gets that long to join its group)."""
    group = coordinator_group(settings)
    deadline = time.monotonic() + patience_s
    while True:
        status = group_status(bootstrap, group)
        if status.consuming:
            return
        if time.monotonic() >= deadline:
            raise CoordinatorNotRunning(no_coordinator_message(settings, status))
        time.sleep(0.5)


def no_coordinator_message(settings: Settings, status: GroupStatus) -> str:
    prefix = settings.topic_prefix
    env = f"SAGALINE_TOPIC_PREFIX={prefix} " if prefix else ""
    return (
        f"no coordinator is consuming `{settings.topics.events}` (consumer group"
        f" `{status.group}` is {status.state} with {status.members} member(s)): start one"
        f" with `{env}sagaline coordinator run` against the same broker, or for"
        " development use `sagaline.connect(..., coordinator=True)`"
    )
