"""Topic names, partition counts and configs: the one place that defines them.

Every topic keyed by saga id (events, state, terminal, incidents, commands) is
co-partitioned: the same partition count everywhere, and producers use
``murmur2_random``, so one saga's records share a partition number on each topic.
A ``prefix`` isolates a test run or a tenant deployment (``"t-1a2b."`` gives
``t-1a2b.sagaline.events``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEFAULT_PARTITIONS = 6
# The most partitions and replicas a topic can be created with: librdkafka, the
# client every Sagaline process uses, refuses more (1..100000 and 1..10000).
MAX_PARTITIONS = 100_000
MAX_REPLICATION_FACTOR = 10_000
# What Kafka takes as a topic name: ASCII letters, digits, '.', '_', '-'; 249 at most.
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_DAY_MS = 24 * 60 * 60 * 1000

# The ledger is the authoritative record (R5): keep it a long time. Operators who
# archive elsewhere may shorten it; the coordinator state survives in its own
# compacted changelog. Kafka deletes whole segments, once a segment's newest record
# is older than retention.ms, so a record stays readable for up to retention.ms +
# segment.ms: segment.ms is set (the broker's usual 7 days) so that bound does not
# depend on the broker's log.roll.ms. The coordinator remembers an ended saga at
# least that long (schemas.limits, terminal_memory_ms).
EVENTS_RETENTION_MS = 365 * _DAY_MS
EVENTS_SEGMENT_MS = 7 * _DAY_MS
EVENTS_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": str(EVENTS_RETENTION_MS),
    "segment.ms": str(EVENTS_SEGMENT_MS),
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
        """The command topic of one participant; ``ValueError`` for a name Kafka would
        refuse in a topic name (characters other than ASCII letters, digits, '.', '_'
        and '-', or too long). When the participant's name would do but the prefix does
        not (characters a topic name cannot hold, or too long with it), the error names
        the prefix."""
        name = f"{self.prefix}sagaline.commands.{participant}"
        if participant and _TOPIC_NAME.fullmatch(name) is not None:
            return name
        if not participant or _TOPIC_NAME.fullmatch(f"sagaline.commands.{participant}") is None:
            raise ValueError(f"participant name {participant!r} is not usable in a topic name")
        if _TOPIC_NAME.fullmatch(self.prefix) is None and len(self.prefix) < 250:
            raise ValueError(
                f"the topic prefix {self.prefix!r} (SAGALINE_TOPIC_PREFIX) is not usable in "
                "a topic name: use only ASCII letters, digits, '.', '_' or '-'"
            )
        room = 249 - len(name) + len(participant)
        raise ValueError(
            f"the command topic of participant {participant!r} would be {len(name)} "
            "characters, over the 249 Kafka allows: the topic prefix (SAGALINE_TOPIC_PREFIX, "
            f"{len(self.prefix)} characters) leaves room for a participant name of "
            f"{max(room, 0)} at most; shorten the prefix (or the name)"
        )


@dataclass(frozen=True)
class Replication:
    """How many copies of each topic a cluster keeps, and how many must acknowledge.

    ``None`` is the brokers' own setting (``default.replication.factor``,
    ``min.insync.replicas``), as for ``kafka-topics.sh`` without them: one replica on
    the single-node development broker, what the operator chose on a cluster. A
    production cluster uses ``factor=3, min_insync=2``: with producers on
    ``acks=all`` an acknowledged record then survives the loss of any one broker (R10).
    """

    factor: int | None = None
    min_insync: int | None = None

    def __post_init__(self) -> None:
        if self.factor is not None and not 1 <= self.factor <= MAX_REPLICATION_FACTOR:
            raise ValueError(
                f"replication factor {self.factor} must be between 1 and "
                f"{MAX_REPLICATION_FACTOR} (the most the Kafka client creates a topic with)"
            )
        # Unset factor: checked against the brokers' default when topics are made.
        most = MAX_REPLICATION_FACTOR if self.factor is None else self.factor
        if self.min_insync is not None and not 1 <= self.min_insync <= most:
            raise ValueError(
                f"min.insync.replicas {self.min_insync} must be between 1 and "
                + (f"{most}" if self.factor is None else f"the replication factor {most}")
            )

    def topic_config(self) -> dict[str, str]:
        """The per-topic settings (empty: the broker's default min.insync.replicas)."""
        if self.min_insync is None:
            return {}
        return {"min.insync.replicas": str(self.min_insync)}


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


__all__ = [
    "DEFAULT_PARTITIONS",
    "EVENTS_RETENTION_MS",
    "EVENTS_SEGMENT_MS",
    "MAX_PARTITIONS",
    "MAX_REPLICATION_FACTOR",
    "Replication",
    "TopicNames",
    "TopicSpec",
    "topic_specs",
]
