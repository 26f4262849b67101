"""An in-process transport: the fast test tier, selected by a ``memory://NAME`` bootstrap.

It implements the part of the Kafka client API that Sagaline uses (the factories in
:mod:`sagaline.kafka` hand it out instead of librdkafka clients), with the semantics
the code relies on: partitions with offsets, murmur2 partitioning, delivery reports
served by ``poll``/``flush``, transactions whose records ``read_committed``
consumers see only after commit (and never after abort) while ``read_uncommitted``
ones read them at once, a control record taking an offset at each commit or abort,
fencing by ``transactional.id`` within the process,
the size limits (``message.max.bytes`` in ``produce``, a topic's ``max.message.bytes``
in the delivery report), offsets committed with a
transaction, consumer groups that split partitions among members and call
``on_assign``/``on_revoke``, a closed consumer refusing every
further call, committed offsets, an offset past a partition's end reset by
``auto.offset.reset``, watermarks, ``PARTITION_EOF``, seek by
time. Everything lives in this process, so one behaviour suite can run against it
in seconds and against the real broker as well; the real-broker tier stays the
authority (replication, networking, anything across processes are not modelled).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    OFFSET_INVALID,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from schemas.partitioning import partition_for
from schemas.wire import message_size

SCHEME = "memory://"

_brokers: dict[str, MemoryBroker] = {}
_registry_lock = threading.Lock()


def is_memory(bootstrap: str) -> bool:
    """True for a bootstrap address that names an in-process broker."""
    return bootstrap.startswith(SCHEME)


def broker_for(bootstrap: str) -> MemoryBroker:
    """The in-process broker named by ``memory://NAME`` (created on first use)."""
    with _registry_lock:
        return _brokers.setdefault(bootstrap, MemoryBroker(bootstrap))


@dataclass
class _Record:
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]
    timestamp: int
    txn: _Transaction | None = None  # None: committed at once (no transaction)
    # A transaction's commit or abort marker: takes an offset, is never delivered.
    control: bool = False


@dataclass
class _Transaction:
    state: str = "open"  # open | committed | aborted
    offsets: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)
    partitions: set[tuple[str, int]] = field(default_factory=set)  # written to


@dataclass
class _Group:
    members: list[MemoryConsumer] = field(default_factory=list)
    committed: dict[tuple[str, int], int] = field(default_factory=dict)


class MemoryBroker:
    """Topics, groups and transactions of one in-process cluster."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.topics: dict[str, list[list[_Record]]] = {}
        self.groups: dict[str, _Group] = {}
        # A topic's max.message.bytes when it was created with one: a record over it
        # is refused in its delivery report, as a broker does (MSG_SIZE_TOO_LARGE).
        self.max_bytes: dict[str, int] = {}
        # Per transactional id: the epoch of its newest producer, and its open
        # transaction (a new producer's init_transactions aborts it and fences the old).
        self.epochs: dict[str, int] = {}
        self.open_txns: dict[str, _Transaction] = {}
        self.changed = threading.Condition()

    # ----------------------------------------------------------------- topics

    def create_topic(self, name: str, partitions: int, max_bytes: int | None = None) -> bool:
        with self.changed:
            if name in self.topics:
                return False
            self.topics[name] = [[] for _ in range(partitions)]
            if max_bytes is not None:
                self.max_bytes[name] = max_bytes
            self._rebalance_all()
            return True

    def append(self, topic: str, partition: int | None, record: _Record) -> tuple[int, int]:
        with self.changed:
            parts = self.topics.get(topic)
            if parts is None:
                raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
            limit = self.max_bytes.get(topic)
            if limit is not None and _size(record.key, record.value, record.headers) > limit:
                raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            if partition is None or partition < 0:
                partition = partition_for(record.key, len(parts)) if record.key else 0
            parts[partition].append(record)
            self.changed.notify_all()
            return partition, len(parts[partition]) - 1

    def end_transaction(self, txn: _Transaction, state: str) -> None:
        """Commit or abort ``txn``: as a broker does, a control record ends it on every
        partition it wrote to, taking an offset no consumer is served (lock held)."""
        txn.state = state
        for topic, n in sorted(txn.partitions):
            self.topics[topic][n].append(_Record(None, None, [], _now_ms(), txn, True))
        self.changed.notify_all()

    def stable_end(self, topic: str, partition: int) -> int:
        """The last stable offset: nothing at or after it is visible to read_committed."""
        log = self.topics[topic][partition]
        for offset, record in enumerate(log):
            if record.txn is not None and record.txn.state == "open":
                return offset
        return len(log)

    # ----------------------------------------------------------------- groups

    def join(self, group: str, member: MemoryConsumer) -> None:
        with self.changed:
            g = self.groups.setdefault(group, _Group())
            if member not in g.members:
                g.members.append(member)
            self._rebalance(g, rejoin=True)

    def leave(self, group: str, member: MemoryConsumer) -> None:
        with self.changed:
            g = self.groups.setdefault(group, _Group())
            if member in g.members:
                g.members.remove(member)
                self._rebalance(g, rejoin=True)

    def _rebalance_all(self) -> None:
        for g in self.groups.values():
            self._rebalance(g, rejoin=False)

    def _rebalance(self, g: _Group, *, rejoin: bool) -> None:
        """Round-robin every subscribed partition over the members.

        The eager protocol of librdkafka's default assignors (``range,roundrobin``;
        Sagaline sets no other): a member joining or leaving (``rejoin``), or a new
        topic changing anyone's share, makes every member revoke everything and be
        assigned again in its next poll, even the partitions it keeps."""
        members = [m for m in g.members if m.subscription]
        wanted: dict[MemoryConsumer, list[tuple[str, int]]] = {m: [] for m in members}
        topics = sorted({t for m in members for t in m.subscription if t in self.topics})
        i = 0
        for topic in topics:
            for n in range(len(self.topics[topic])):
                subscribers = [m for m in members if topic in m.subscription]
                if subscribers:
                    wanted[subscribers[i % len(subscribers)]].append((topic, n))
                    i += 1

        def current(m: MemoryConsumer) -> list[tuple[str, int]]:
            return m.owned if m.pending_assignment is None else m.pending_assignment

        if rejoin or any(sorted(wanted[m]) != sorted(current(m)) for m in members):
            for m in members:
                m.pending_assignment = wanted[m]
        self.changed.notify_all()

    def commit_offsets(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        with self.changed:
            self.groups.setdefault(group, _Group()).committed.update(offsets)

    def committed(self, group: str, tp: tuple[str, int]) -> int | None:
        with self.changed:
            return self.groups.setdefault(group, _Group()).committed.get(tp)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _size(key: bytes | None, value: bytes | None, headers: Any) -> int:
    """A record's bytes as the size limits count them (key, value, headers)."""
    return message_size(key, value, headers)


# What librdkafka reserves per record on top of its key, value and headers when it
# checks message.max.bytes in produce() (RD_KAFKA_MESSAGE_V2_MAX_OVERHEAD: the varints
# of the record's length, timestamp and offset deltas, key and value lengths, header
# count, and its attributes byte).
_RECORD_FRAMING = 36


def _varint_size(n: int) -> int:
    """Bytes of ``n`` as a zigzag varint (Kafka's record format)."""
    zigzag, size = (n << 1) ^ (n >> 63), 1
    while zigzag >= 0x80:
        zigzag >>= 7
        size += 1
    return size


def _wire_size(key: bytes | None, value: bytes | None, headers: Iterable[Any]) -> int:
    """A record's size as librdkafka counts it against ``message.max.bytes`` in
    ``produce()``: the framing, key, value, and each header with the varints of its
    name's and value's lengths (a record that fits without them is still refused)."""
    size = _RECORD_FRAMING + len(key or b"") + len(value or b"")
    for name, v in headers:
        raw = name.encode() if isinstance(name, str) else name
        data = v.encode() if isinstance(v, str) else v
        size += _varint_size(len(raw)) + len(raw)
        size += _varint_size(-1 if data is None else len(data)) + len(data or b"")
    return size


def _headers(raw: Any) -> list[tuple[str, str | bytes | None]]:
    """Headers as a consumer reads them back: ``str`` values as bytes, and a null
    value kept as ``None`` (Kafka keeps such a header; readers must cope with it)."""
    items = raw.items() if isinstance(raw, dict) else (raw or [])
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in items]


class _GroupMetadata:
    def __init__(self, group: str) -> None:
        self.group = group


# ------------------------------------------------------------------ producer


class MemoryProducer:
    """``confluent_kafka.Producer`` over a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, config: dict[str, Any]) -> None:
        self.broker = broker
        self.transactional = "transactional.id" in config
        self.txid = str(config.get("transactional.id"))
        self._epoch: int | None = None  # set by init_transactions
        # librdkafka refuses a record over message.max.bytes in produce() itself,
        # counting its framing too (_wire_size).
        self.max_bytes = int(config.get("message.max.bytes", 1_000_000))
        self._reports: list[tuple[Callable[..., Any], KafkaError | None, Message]] = []
        self._txn: _Transaction | None = None
        # poll(timeout) waits on it for a delivery report, as librdkafka's does: a
        # background poller must not spin.
        self._lock = threading.Condition()

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int = -1,
        on_delivery: Callable[..., Any] | None = None,
        headers: Any = None,
        **_: Any,
    ) -> None:
        if self.transactional:
            if self._txn is None:
                raise KafkaException(KafkaError(KafkaError._STATE, "produce outside a transaction"))
            self._check_fenced()
        record = _Record(key, value, _headers(headers), _now_ms(), self._txn)
        if _wire_size(key, value, record.headers) > self.max_bytes:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        error: KafkaError | None = None
        n, offset = partition, -1
        try:
            n, offset = self.broker.append(topic, partition, record)
            if self._txn is not None:
                self._txn.partitions.add((topic, n))
        except KafkaException as exc:
            error = exc.args[0]
        if on_delivery is not None:
            msg = Message(
                topic=topic, partition=max(n, 0), offset=offset, key=key, value=value,
                headers=record.headers, error=error, timestamp=(1, record.timestamp),
            )  # fmt: skip
            with self._lock:
                self._reports.append((on_delivery, error, msg))
                self._lock.notify_all()

    def poll(self, timeout: float = 0) -> int:
        with self._lock:
            if not self._reports and timeout > 0:
                self._lock.wait(timeout)
            reports, self._reports = self._reports, []
        for served, (callback, error, msg) in enumerate(reports):
            try:
                callback(error, msg)
            except BaseException:
                # As librdkafka: poll() raises the callback's error and the reports
                # after it stay queued for the next poll.
                with self._lock:
                    self._reports[:0] = reports[served + 1 :]
                raise
        return len(reports)

    def flush(self, timeout: float = 0) -> int:
        self.poll(0)
        return 0

    def __len__(self) -> int:
        return len(self._reports)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """Nothing to drop: every produce is appended at once (the coordinator purges
        the producer it replaces after an abort)."""

    # transactions

    def init_transactions(self, timeout: float = 0) -> None:
        with self.broker.changed:
            self._epoch = self.broker.epochs.get(self.txid, -1) + 1
            self.broker.epochs[self.txid] = self._epoch
            left_open = self.broker.open_txns.pop(self.txid, None)
            if left_open is not None:  # the previous producer's: aborted, as a broker does
                self.broker.end_transaction(left_open, "aborted")

    def _check_fenced(self) -> None:
        """Raise librdkafka's fatal error once a newer producer with the same
        transactional id initialised (or without init_transactions, its state error)."""
        if self._epoch is None:
            raise KafkaException(KafkaError(KafkaError._STATE, "init_transactions not called"))
        if self.broker.epochs.get(self.txid) != self._epoch:
            raise KafkaException(
                KafkaError(
                    KafkaError._FENCED,
                    "fenced by a newer producer with the same transactional.id",
                    fatal=True,
                )
            )

    def begin_transaction(self) -> None:
        with self.broker.changed:
            self._check_fenced()
            self._txn = _Transaction()
            self.broker.open_txns[self.txid] = self._txn

    def send_offsets_to_transaction(
        self, positions: list[TopicPartition], metadata: _GroupMetadata, timeout: float = 0
    ) -> None:
        assert self._txn is not None
        offsets = {(tp.topic, tp.partition): tp.offset for tp in positions if tp.offset >= 0}
        self._txn.offsets.setdefault(metadata.group, {}).update(offsets)

    def commit_transaction(self, timeout: float = 0) -> None:
        txn, self._txn = self._txn, None
        if txn is None:
            return
        with self.broker.changed:
            self._check_fenced()
            self.broker.open_txns.pop(self.txid, None)
            self.broker.end_transaction(txn, "committed")
            for group, offsets in txn.offsets.items():
                self.broker.groups.setdefault(group, _Group()).committed.update(offsets)
        self.poll(0)

    def abort_transaction(self, timeout: float = 0) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            with self.broker.changed:
                self._check_fenced()
                self.broker.open_txns.pop(self.txid, None)
                self.broker.end_transaction(txn, "aborted")
        self.poll(0)


# ------------------------------------------------------------------ consumer


class MemoryConsumer:
    """``confluent_kafka.Consumer`` over a :class:`MemoryBroker` (read_committed unless
    ``isolation.level`` says read_uncommitted)."""

    def __init__(self, broker: MemoryBroker, config: dict[str, Any]) -> None:
        self.broker = broker
        self.group = str(config["group.id"])
        self.eof = bool(config.get("enable.partition.eof", False))
        self.earliest = str(config.get("auto.offset.reset", "earliest")) != "latest"
        # read_uncommitted (create_uncommitted_reader) reads to the high watermark, as
        # a real broker serves it: records of open and of aborted transactions too.
        self.committed_only = config.get("isolation.level") != "read_uncommitted"
        self.subscription: list[str] = []
        self.owned: list[tuple[str, int]] = []
        self.pending_assignment: list[tuple[str, int]] | None = None
        self._positions: dict[tuple[str, int], int] = {}
        self._eof_sent: set[tuple[str, int]] = set()
        self._paused: set[tuple[str, int]] = set()
        self._callbacks: dict[str, Callable[..., Any] | None] = {}
        self._closed = False

    def _open(self) -> None:
        """As librdkafka: every call on a closed consumer but ``close()`` raises."""
        if self._closed:
            raise RuntimeError("Consumer closed")

    # assignment

    def subscribe(
        self,
        topics: list[str],
        on_assign: Callable[..., Any] | None = None,
        on_revoke: Callable[..., Any] | None = None,
        on_lost: Callable[..., Any] | None = None,
    ) -> None:
        self._open()
        self.subscription = list(topics)
        self._callbacks = {"assign": on_assign, "revoke": on_revoke}
        self.broker.join(self.group, self)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self._open()
        self.subscription = []
        self.owned = [(tp.topic, tp.partition) for tp in partitions]
        for tp in partitions:
            self._set_position(tp)

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self._open()
        self.owned += [(tp.topic, tp.partition) for tp in partitions]
        for tp in partitions:
            self._set_position(tp)

    def unassign(self) -> None:
        self._open()
        self.owned = []

    def assignment(self) -> list[TopicPartition]:
        self._open()
        return [TopicPartition(t, n) for t, n in self.owned]

    def _set_position(self, tp: TopicPartition) -> None:
        key = (tp.topic, tp.partition)
        with self.broker.changed:
            end = len(self.broker.topics[tp.topic][tp.partition])
        reset = 0 if self.earliest else end  # auto.offset.reset
        if tp.offset == OFFSET_BEGINNING:
            self._positions[key] = 0
        elif tp.offset == OFFSET_END:
            self._positions[key] = end
        else:
            offset = tp.offset if tp.offset >= 0 else self.broker.committed(self.group, key)
            # As a broker: an offset past the high watermark is out of range, and the
            # consumer starts again where auto.offset.reset says.
            self._positions[key] = reset if offset is None or offset > end else offset
        self._eof_sent.discard(key)

    def _apply_rebalance(self) -> None:
        with self.broker.changed:
            new = self.pending_assignment
            self.pending_assignment = None
        if new is None:
            return
        revoked = [TopicPartition(t, n) for t, n in self.owned]
        if revoked and self._callbacks.get("revoke"):
            self._callbacks["revoke"](self, revoked)  # type: ignore[misc]
        # As librdkafka does on an eager rebalance: what was fetched and not consumed
        # is dropped, and every assigned partition, a kept one too, starts again at
        # its committed offset (auto.offset.reset without one); a record polled and
        # then left out, or a batch left uncommitted on revoke, is read again.
        self.owned = []
        self._positions.clear()
        self._eof_sent.clear()
        self._paused.clear()
        assigned = [TopicPartition(t, n) for t, n in new]
        if self._callbacks.get("assign"):
            self._callbacks["assign"](self, assigned)  # type: ignore[misc]
        self.owned = list(new)
        for tp in assigned:
            if (tp.topic, tp.partition) not in self._positions:  # not assigned by on_assign
                self._set_position(TopicPartition(tp.topic, tp.partition, OFFSET_INVALID))

    # reading

    def _fetch(self, limit: int) -> list[Message]:
        out: list[Message] = []
        with self.broker.changed:
            for topic, n in self.owned:
                key = (topic, n)
                if key in self._paused:
                    continue
                log = self.broker.topics[topic][n]
                stable = self._end(topic, n)
                position = self._positions.get(key, 0)
                while position < stable and len(out) < limit:
                    record = log[position]
                    position += 1
                    if record.txn is not None and (
                        record.control or (record.txn.state == "aborted" and self.committed_only)
                    ):
                        continue
                    out.append(
                        Message(
                            topic=topic,
                            partition=n,
                            offset=position - 1,
                            key=record.key,
                            value=record.value,
                            headers=list(record.headers) or None,
                            error=None,
                            timestamp=(1, record.timestamp),
                        )
                    )
                self._positions[key] = position
                if out and out[-1].topic() == topic and out[-1].partition() == n:
                    self._eof_sent.discard(key)
                at_end = position >= stable and key not in self._eof_sent
                if self.eof and at_end and len(out) < limit:
                    self._eof_sent.add(key)
                    out.append(
                        Message(
                            topic=topic,
                            partition=n,
                            offset=position,
                            error=KafkaError(KafkaError._PARTITION_EOF),
                        )
                    )
                if len(out) >= limit:
                    break
        return out

    def _end(self, topic: str, partition: int) -> int:
        """What this consumer may read up to: the last stable offset (read_committed)
        or the high watermark (read_uncommitted)."""
        if self.committed_only:
            return self.broker.stable_end(topic, partition)
        return len(self.broker.topics[topic][partition])

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        self._open()
        deadline = time.monotonic() + max(timeout, 0)
        while True:
            self._apply_rebalance()
            out = self._fetch(num_messages)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0 or self._closed:
                return out
            with self.broker.changed:
                self.broker.changed.wait(min(remaining, 0.05))

    def poll(self, timeout: float = -1) -> Message | None:
        out = self.consume(1, timeout)
        return out[0] if out else None

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        self._open()
        positions = self._positions
        return [
            TopicPartition(tp.topic, tp.partition, positions.get((tp.topic, tp.partition), -1001))
            for tp in partitions
        ]

    def seek(self, tp: TopicPartition) -> None:
        self._open()
        self._set_position(tp)

    def committed(
        self, partitions: list[TopicPartition], timeout: float = 0
    ) -> list[TopicPartition]:
        self._open()
        out = []
        for tp in partitions:
            offset = self.broker.committed(self.group, (tp.topic, tp.partition))
            out.append(TopicPartition(tp.topic, tp.partition, -1001 if offset is None else offset))
        return out

    def commit(
        self,
        message: Message | None = None,
        offsets: list[TopicPartition] | None = None,
        asynchronous: bool = True,
    ) -> None:
        self._open()
        if message is not None:
            done = {(message.topic() or "", message.partition() or 0): (message.offset() or 0) + 1}
        elif offsets is not None:
            done = {(tp.topic, tp.partition): tp.offset for tp in offsets}
        else:
            done = dict(self._positions)
        self.broker.commit_offsets(self.group, done)

    def consumer_group_metadata(self) -> _GroupMetadata:
        self._open()
        return _GroupMetadata(self.group)

    def get_watermark_offsets(
        self, tp: TopicPartition, timeout: float = 0, cached: bool = False
    ) -> tuple[int, int]:
        self._open()
        with self.broker.changed:
            parts = self.broker.topics.get(tp.topic)
            if parts is None or tp.partition >= len(parts):
                raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
            return 0, self._end(tp.topic, tp.partition)

    def offsets_for_times(
        self, partitions: list[TopicPartition], timeout: float = 0
    ) -> list[TopicPartition]:
        self._open()
        out = []
        with self.broker.changed:
            for tp in partitions:
                log = self.broker.topics[tp.topic][tp.partition]
                found = next(
                    (i for i, r in enumerate(log) if r.timestamp >= tp.offset and not r.control),
                    -1,
                )
                out.append(TopicPartition(tp.topic, tp.partition, found))
        return out

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _Metadata:
        self._open()
        return _metadata(self.broker)

    def pause(self, partitions: list[TopicPartition]) -> None:
        # Nothing is prefetched here: a paused partition's next record is simply not
        # returned until it is resumed (an assignment starts unpaused).
        self._open()
        self._paused.update((tp.topic, tp.partition) for tp in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._open()
        self._paused.difference_update((tp.topic, tp.partition) for tp in partitions)

    def close(self) -> None:
        # As librdkafka's close(): a subscribed member's partitions are revoked through
        # its on_revoke (a service's drain-and-commit runs on shutdown), then it leaves.
        revoke = self._callbacks.get("revoke")
        if self.subscription and self.owned and revoke is not None and not self._closed:
            revoke(self, [TopicPartition(t, n) for t, n in self.owned])
        self._closed = True
        if self.subscription:
            self.broker.leave(self.group, self)
        self.subscription = []
        self.owned = []


# --------------------------------------------------------------------- admin


@dataclass
class _GroupMember:
    id: str
    assignment: bytes  # the consumer protocol's encoding, as a broker returns it


@dataclass
class _GroupListing:
    id: str
    state: str
    members: list[_GroupMember]
    error: KafkaError | None = None


def _encode_assignment(owned: Iterable[tuple[str, int]]) -> bytes:
    by_topic: dict[str, list[int]] = {}
    for topic, partition in owned:
        by_topic.setdefault(topic, []).append(partition)
    out = bytearray(struct.pack(">hi", 0, len(by_topic)))
    for topic, partitions in sorted(by_topic.items()):
        name = topic.encode()
        out += struct.pack(">h", len(name)) + name
        out += struct.pack(f">i{len(partitions)}i", len(partitions), *sorted(partitions))
    return bytes(out + struct.pack(">i", -1))  # null user data


@dataclass
class _TopicMetadata:
    topic: str
    partitions: dict[int, Any]
    error: KafkaError | None = None


@dataclass
class _Metadata:
    topics: dict[str, _TopicMetadata]
    brokers: dict[int, Any]


def _metadata(broker: MemoryBroker) -> _Metadata:
    with broker.changed:
        topics = {
            name: _TopicMetadata(name, {n: object() for n in range(len(parts))})
            for name, parts in broker.topics.items()
        }
    return _Metadata(topics, {1: broker.name})


class MemoryAdmin:
    """``confluent_kafka.admin.AdminClient`` over a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, config: dict[str, Any]) -> None:
        self.broker = broker

    def create_topics(self, new_topics: Iterable[Any], **_: Any) -> dict[str, Future[None]]:
        futures: dict[str, Future[None]] = {}
        for spec in new_topics:
            future: Future[None] = Future()
            limit = (getattr(spec, "config", None) or {}).get("max.message.bytes")
            created = self.broker.create_topic(
                spec.topic, spec.num_partitions, None if limit is None else int(limit)
            )
            if created:
                future.set_result(None)
            else:
                future.set_exception(KafkaException(KafkaError(KafkaError.TOPIC_ALREADY_EXISTS)))
            futures[spec.topic] = future
        return futures

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _Metadata:
        return _metadata(self.broker)

    def list_groups(self, group: str | None = None, timeout: float = -1) -> list[_GroupListing]:
        """Like the broker's: ``Stable`` with its members' assignments, else ``Empty``;
        a group nobody ever joined is not listed."""
        with self.broker.changed:
            out: list[_GroupListing] = []
            for name, g in sorted(self.broker.groups.items()):
                if group is not None and name != group:
                    continue
                members = [
                    _GroupMember(f"member-{i}", _encode_assignment(m.owned))
                    for i, m in enumerate(g.members)
                ]
                out.append(_GroupListing(name, "Stable" if members else "Empty", members))
            return out
