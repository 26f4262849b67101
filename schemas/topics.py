"""Topic names, partition counts and configs: the one place that defines them.

Every topic keyed by saga id (events, state, terminal, incidents, commands) is
co-partitioned: the same partition count everywhere, and producers use
``murmur2_random``, so one saga's records share a partition number on each topic.
A ``prefix`` isolates a test run or a tenant deployment (``"t-1a2b."`` gives
``t-1a2b.sagaline.events``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_PARTITIONS = 6
_DAY_MS = 24 * 60 * 60 * 1000

# The ledger is the authoritative record (R5): keep it a long time. Operators who
# archive elsewhere may shorten it; the coordinator state survives in its own
# compacted changelog.
EVENTS_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": str(365 * _DAY_MS),
}
COMPACTED_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "compact",
    "min.cleanable.dirty.ratio": "0.1",
    "segment.ms": str(_DAY_MS),
}
COMMANDS_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": str(7 * _DAY_MS),
}
INCIDENTS_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": str(90 * _DAY_MS),
}
DLQ_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": str(30 * _DAY_MS),
}


@dataclass(frozen=True)
class TopicNames:
    """The names of every Sagaline topic under one prefix."""

    prefix: str = ""

    @property
    def events(self) -> str:
        """The ledger: every fact about every saga."""
        return f"{self.prefix}sagaline.events"

    @property
    def state(self) -> str:
        """The coordinator's state changelog (compacted, tombstoned after terminal)."""
        return f"{self.prefix}sagaline.coordinator.state"

    @property
    def terminal(self) -> str:
        """Terminal status and receipt per saga, for dashboards (compacted)."""
        return f"{self.prefix}sagaline.terminal"

    @property
    def incidents(self) -> str:
        """Escalations to a person."""
        return f"{self.prefix}sagaline.incidents"

    @property
    def dlq(self) -> str:
        """Records that could not be decoded, verified or validated, with the reason."""
        return f"{self.prefix}sagaline.dlq"

    @property
    def catalogue(self) -> str:
        """Tool contracts published by participant runtimes (compacted, key = tool).

        Agents resolve a remote tool by name from here: its contract (what the
        coordinator needs) and its JSON Schema definition (what a model is shown).
        """
        return f"{self.prefix}sagaline.catalogue"

    def commands(self, participant: str) -> str:
        """The command topic of one participant."""
        if not participant or any(c in participant for c in " /\\"):
            raise ValueError(f"participant name {participant!r} is not usable in a topic name")
        return f"{self.prefix}sagaline.commands.{participant}"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: Mapping[str, str]
    co_partitioned: bool


def topic_specs(
    names: TopicNames, participants: Iterable[str], partitions: int = DEFAULT_PARTITIONS
) -> list[TopicSpec]:
    """Every topic a deployment with these participants needs, with its settings."""
    specs = [
        TopicSpec(names.events, partitions, EVENTS_CONFIG, True),
        TopicSpec(names.state, partitions, COMPACTED_CONFIG, True),
        TopicSpec(names.terminal, partitions, COMPACTED_CONFIG, True),
        TopicSpec(names.incidents, partitions, INCIDENTS_CONFIG, True),
        TopicSpec(names.dlq, partitions, DLQ_CONFIG, False),
        TopicSpec(names.catalogue, 1, COMPACTED_CONFIG, False),
    ]
    specs += [
        TopicSpec(names.commands(p), partitions, COMMANDS_CONFIG, True)
        for p in dict.fromkeys(participants)
    ]
    return specs


class TopicSetupError(RuntimeError):
    """A topic could not be created, or exists with settings that break the design."""


def ensure_topics(
    bootstrap: str,
    names: TopicNames,
    participants: Iterable[str] = (),
    partitions: int = DEFAULT_PARTITIONS,
    *,
    replication_factor: int = 1,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create every missing topic; existing ones are left alone (idempotent).

    Raises :class:`TopicSetupError` naming the topic when creation fails for any
    reason other than "already exists", or when a co-partitioned topic already exists
    with a different partition count (co-partitioning would silently break).
    Returns the names of the topics this call created.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    specs = topic_specs(names, participants, partitions)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=replication_factor,
                config=dict(s.config),
            )
            for s in specs
        ],
        operation_timeout=timeout_s,
        request_timeout=timeout_s,
    )
    created: list[str] = []
    for name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            created.append(name)
        except KafkaException as exc:
            err: Any = exc.args[0] if exc.args else None
            if getattr(err, "code", lambda: None)() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            raise TopicSetupError(f"cannot create topic {name!r} on {bootstrap}: {exc}") from exc
    # Metadata propagates asynchronously after CreateTopics: poll until every topic
    # is visible with all its partitions, then check the co-partitioning.
    deadline = time.monotonic() + timeout_s
    while True:
        metadata = admin.list_topics(timeout=timeout_s)
        missing = [
            s.name
            for s in specs
            if (t := metadata.topics.get(s.name)) is None or t.error is not None or not t.partitions
        ]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TopicSetupError(
                f"topics {missing} are not visible on {bootstrap} {timeout_s:.0f} s after creation"
            )
        time.sleep(0.1)
    for spec in specs:
        actual = len(metadata.topics[spec.name].partitions)
        if spec.co_partitioned and actual != spec.partitions:
            raise TopicSetupError(
                f"topic {spec.name!r} has {actual} partitions, expected "
                f"{spec.partitions}: co-partitioned topics must match; recreate it or set "
                f"SAGALINE_PARTITIONS={actual}"
            )
    return sorted(created)


__all__ = [
    "DEFAULT_PARTITIONS",
    "TopicNames",
    "TopicSetupError",
    "TopicSpec",
    "ensure_topics",
    "topic_specs",
]
