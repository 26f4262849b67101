"""What a consumer group is doing: its state, and what each member was assigned.

Read with the group-listing call (ListGroups, then DescribeGroups on the broker that
has the group), not with ``AdminClient.describe_consumer_groups``: in librdkafka 2.16
that one goes through the admin coordinator machinery, which aborts the whole process
(``rd_kafka_enq_once_del_source_return: Assertion eonce->refcnt > 0``) when the
request fails or times out on a connection that drops or is not up yet
(confluentinc/librdkafka#4605, #3663; seen in CI on a broker kill and on a fresh
three-node cluster). The listing call keeps its state on the caller's stack and drops
late replies once it has returned, so a timeout is only a timeout.

The listing has one blind spot: a broker enforcing ACLs leaves out the groups the
caller may not Describe, so a group with members reads exactly like one that does
not exist. ``describe_group(..., hidden_is_error=True)`` then asks once more with
``describe_consumer_groups``, which reports ``GROUP_AUTHORIZATION_FAILED``; only the
short-lived operator commands that act on "nothing consumes this" ask (``sagaline
status``, ``sagaline catalogue withdraw``), right after the listing answered, never
the client's checks or a long-running process.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

__all__ = ["GroupInfo", "GroupNotAuthorized", "PartitionMoves", "describe_group"]

# The listing API is deprecated in confluent-kafka in favour of the call above, the one
# this module exists to avoid.
warnings.filterwarnings(
    "ignore", message=r"list_groups\(\) is deprecated", category=DeprecationWarning
)

_STATES = {
    "Stable": "STABLE",
    "Empty": "EMPTY",
    "Dead": "DEAD",
    "PreparingRebalance": "PREPARING_REBALANCE",
    "CompletingRebalance": "COMPLETING_REBALANCE",
}


@dataclass(frozen=True)
class GroupInfo:
    """One consumer group as its coordinator reports it. An unknown group is ``DEAD``
    with no members."""

    group: str
    state: str  # STABLE, EMPTY, DEAD, PREPARING_REBALANCE, COMPLETING_REBALANCE
    assignments: tuple[frozenset[tuple[str, int]], ...]  # (topic, partition) per member

    @property
    def members(self) -> int:
        return len(self.assignments)

    def owned(self, topic: str) -> set[int]:
        """The partitions of ``topic`` some member owns."""
        return {p for member in self.assignments for t, p in member if t == topic}


class GroupNotAuthorized(PermissionError):
    """The broker will not describe ``group`` to this principal (no Describe ACL on
    it), so whether it has members cannot be known."""

    def __init__(self, group: str) -> None:
        super().__init__(f"not authorized to describe consumer group {group!r}")
        self.group = group


def describe_group(
    admin: Any, group: str, *, timeout_s: float = 10.0, hidden_is_error: bool = False
) -> GroupInfo:
    """The state and members' assignments of ``group``; raises ``KafkaException`` if the
    brokers do not answer within ``timeout_s``. ``hidden_is_error``: a group the
    listing does not show is checked once more, and :class:`GroupNotAuthorized` when
    the broker hides it from this principal (see the module's docstring)."""
    listed = admin.list_groups(group, timeout=timeout_s)
    for meta in listed:
        if meta.id != group:
            continue
        if meta.error is not None:
            raise KafkaException(meta.error)
        state = _STATES.get(meta.state, str(meta.state).upper())
        return GroupInfo(group, state, tuple(_assignment(m.assignment) for m in meta.members or ()))
    if hidden_is_error:
        _require_describable(admin, group, timeout_s)
    return GroupInfo(group, "DEAD", ())


def _require_describable(admin: Any, group: str, timeout_s: float) -> None:
    """Raise :class:`GroupNotAuthorized` when the broker refuses to describe ``group``."""
    describe = getattr(admin, "describe_consumer_groups", None)
    if describe is None:
        return  # the in-memory transport: no ACLs, nothing hidden
    (future,) = describe([group], request_timeout=timeout_s).values()
    try:
        future.result(timeout=timeout_s + 5)
    except KafkaException as exc:
        if exc.args and exc.args[0].code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
            raise GroupNotAuthorized(group) from None
        raise
    except TimeoutError as exc:
        raise KafkaException(
            KafkaError(KafkaError._TIMED_OUT, f"describing group {group!r} timed out")
        ) from exc


def _assignment(raw: bytes | None) -> frozenset[tuple[str, int]]:
    """Decode a consumer-protocol assignment (version, then topics and their partitions;
    later versions only append fields)."""
    if not raw:
        return frozenset()
    try:
        owned: set[tuple[str, int]] = set()
        at = 2  # int16 version
        (topics,) = struct.unpack_from(">i", raw, at)
        at += 4
        for _ in range(max(topics, 0)):
            (length,) = struct.unpack_from(">h", raw, at)
            at += 2
            topic = raw[at : at + length].decode()
            at += length
            count = max(struct.unpack_from(">i", raw, at)[0], 0)
            partitions = struct.unpack_from(f">{count}i", raw, at + 4)
            at += 4 + 4 * count
            owned.update((topic, p) for p in partitions)
        return frozenset(owned)
    except (struct.error, UnicodeDecodeError) as exc:
        raise KafkaException(
            KafkaError(KafkaError._BAD_MSG, f"cannot decode a group assignment: {exc}")
        ) from exc


class PartitionMoves:
    """The rebalances a consumer's callbacks served, and per partition the last one
    that assigned, revoked or lost it (call :meth:`moved` from each callback).

    A loop that takes one record with ``poll()`` and the rest with ``consume()`` must
    not keep the first when the ``consume()`` served a rebalance that moved its
    partition: the partition's owner (another member, or this one again) reads it
    from the committed offset, so keeping it would process it twice, or for a
    partition no longer ours. A partition the rebalance left alone (cooperative
    assignment) keeps fetching forward, so its record stays; so does an error.
    """

    __slots__ = ("_at", "_count")

    def __init__(self) -> None:
        self._count = 0
        self._at: dict[int, int] = {}

    def moved(self, partitions: list[TopicPartition]) -> None:
        self._count += 1
        for tp in partitions:
            self._at[tp.partition] = self._count

    def batch(self, first: Message, consumer: Any, more: int) -> list[Message]:
        """``first`` (from ``poll()``) and up to ``more`` records already fetched."""
        seen = self._count
        rest: list[Message] = consumer.consume(more, 0)
        if (
            self._count != seen
            and first.error() is None
            and self._at.get(first.partition() or 0, 0) > seen
        ):
            return rest
        return [first, *rest]
