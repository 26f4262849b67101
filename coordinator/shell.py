"""The coordinator's Kafka shell: exactly-once read-process-write around the pure core.

One loop, one transactional producer, one consumer in the ``sagaline-coordinator``
group on ``sagaline.events``. Per batch, a single Kafka transaction holds

* every output the core decided (commands, ledger events, terminal records,
  incidents, DLQ records),
* the changelog record of every saga whose state changed (``sagaline.coordinator.state``,
  compacted; a small terminal marker once the saga has ended, tombstoned after
  ``limits.terminal_memory_ms``),
* the consumed offsets.

So either the whole batch happened or none of it did: after a crash the new owner
restores state from the changelog and resumes from the committed offsets, and the
core's deterministic event ids make any re-decided output identical.

The loop does not wait on the broker when it has work: a batch's offsets go to its
transaction (two round trips) while the batch is decided, and its commit runs in
the background while the next batch is read and decoded. Memory takes a batch's
changes only once its commit has returned, and the next batch is decided only after
that; a commit that fails aborts the transaction and rewinds to the committed
offsets, so nothing of it (or of the batch read behind it) is applied. Each batch
decodes a saga's state once and the core changes that object in place.

One saga cannot stop the others: a saga whose decision raises, whose state or output
is over ``limits.max_record_bytes``, or whose records the broker refuses is *parked*
(a parked marker, one incident, its records to the DLQ as ``saga-parked``) and the
batch commits for everyone else; see docs/coordinator.md.

State for a partition is restored from the changelog when the partition is assigned,
before any of its records is processed; timers live in that state, so retries,
approval expiries and reversal windows fire after a restart too, once the consumer
has read the partition's backlog (which may hold the record that beats a deadline).

In memory an in-flight saga is its changelog bytes plus its next timer
(``_PackedStates``), decoded only when a record or a timer of the saga needs it: a few
KiB per saga instead of ~16 KiB of pydantic objects, and a restore stores bytes without
decoding them (each changelog record carries its next timer in the
``sagaline-next-due`` header). The decoded states of the last ``decoded_states`` sagas
a committed batch touched are kept as well, so a saga's next batch does not decode it
again; a batch takes them out and only its commit puts them back.
"""

from __future__ import annotations

import functools
import heapq
import logging
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from pydantic import ValidationError

from coordinator.core import (
    COORDINATOR_PRODUCER,
    CorePolicy,
    Decision,
    Destination,
    Output,
    RejectReason,
    decide,
    stale_resolution,
    tenant_mismatch,
    tick,
)
from coordinator.state import (
    UNKNOWN_TENANT,
    EndedResolution,
    MarkerKind,
    SagaMarker,
    SagaState,
    is_marker,
    load_changelog,
    open_incident_generations,
    state_head,
    terminal_marker,
    unreadable,
)
from coordinator.watchdog import deadline
from sagaline.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
    TopicSetupError,
    closing_tolerated,
    create_consumer,
    create_producer,
    create_uncommitted_reader,
    ensure_topics,
    headers_of,
    producer_config,
    raise_if_fatal,
    read_to_end,
    readable_headers,
    watermarks,
)
from sagaline.kafka._claims import member_held
from sagaline.kafka._groups import PartitionMoves
from sagaline.kafka._topics import (
    command_topic_participants,
    topic_retention,
    topics_max_message_bytes,
)
from schemas import IncidentRaised, IncidentResolved, Record, derived_event_id, envelope_for
from schemas.errors import CodecError
from schemas.limits import PARKED_INCIDENT, RETENTION_MARGIN_MS, cut_operator_text
from schemas.settings import Settings
from schemas.signing import HeaderList, Headers, header_value
from schemas.trust import IdentitySigner, Role, SigningKeyError
from schemas.wire import (
    DLQ_OMITTED,
    dlq_message,
    dlq_summary,
    from_message,
    message_size,
    to_message,
)

log = logging.getLogger("sagaline.coordinator")


class ShellMetrics(Protocol):
    """What the shell reports. The Prometheus implementation
    (``sagaline.ops.metrics.CoordinatorMetrics``) sits in a layer above and is passed in
    by the process that runs the coordinator."""

    def observe_record(self, record: Record) -> None: ...

    def observe_output(self, output: Output) -> None: ...

    def duplicate_prevented(self, count: int = 1) -> None: ...

    def dlq(self, reason: str) -> None: ...

    def transaction_committed(self, seconds: float, records: int) -> None: ...

    def in_flight(self, sagas: int) -> None: ...


class NoMetrics:
    """The default: report nothing."""

    def observe_record(self, record: Record) -> None:
        pass

    def observe_output(self, output: Output) -> None:
        pass

    def duplicate_prevented(self, count: int = 1) -> None:
        pass

    def dlq(self, reason: str) -> None:
        pass

    def transaction_committed(self, seconds: float, records: int) -> None:
        pass

    def in_flight(self, sagas: int) -> None:
        pass


# Consecutive failed transactions after which a batch is committed saga by saga, so
# that a failure only one saga causes (and that no size check foresaw) parks that
# saga instead of rewinding everybody's batch forever.
_ISOLATE_AFTER_FAILURES = 3

_BUSY = (KafkaError.CONCURRENT_TRANSACTIONS, KafkaError._TIMED_OUT)

# What librdkafka reports (all as ``_FENCED``) when the broker knows a newer epoch of
# the producer: a newer instance with the same transactional.id, or the broker
# aborted our transaction for its age (transaction.timeout.ms) and bumped the epoch.
_FENCINGS = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)

PARKED_REASON = PARKED_INCIDENT
"""DLQ reason of a record for a parked saga (kept, never lost, never decided)."""

DECODED_STATES = 512
"""How many committed sagas' decoded states the coordinator keeps (``decoded_states``)
beside their bytes, so that the next batch of a saga does not decode it again; about
16 KiB each (8 MiB in all when full), a few times the sagas a batch touches under load.
0 turns the cache off."""

# librdkafka's default batch.size and message.max.bytes: the largest record batch a
# producer sends unless the deployment sets them (SAGALINE_KAFKA_BATCH_SIZE, ...).
_LIBRDKAFKA_BATCH_BYTES = 1_000_000
# librdkafka's default queue.buffering.max.messages: how many records a producer holds
# (queued and in flight) before produce() raises BufferError.
_LIBRDKAFKA_QUEUE_MESSAGES = 100_000
# The most expired terminal markers one transaction tombstones (a quarter of the local
# queue at most, the rest is the batch's own records).
_EXPIRE_PER_BATCH = 1_000
# The records one saga's tick is allowed for in the local queue (its commands, events,
# incidents, terminal records and changelog record): bounds the due sagas a transaction
# fires to the queue's size over this.
_RECORDS_PER_TICK = 8
# What a record batch adds to a DLQ copy's key, value and headers (the batch header,
# the lengths of the record and of each header): room a topic it writes must leave.
_BATCH_FRAMING = 1024

# What a broker says of a record (or record batch) over a topic's max.message.bytes.
_SIZE_REFUSALS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
_NO_LIMIT = 1 << 62
_LOGGED_DETAIL = 2000  # as much of a DLQ detail as its copy carries (schemas.wire)

UNREADABLE_STATE_REASON = "unreadable-state"
"""DLQ reason of a saga's changelog value the coordinator cannot read (torn, or written
by a newer version), copied before the saga's parked marker replaces it."""

FEED_TOO_LARGE_REASON = "incident-feed-too-large"
"""DLQ reason of an accepted ``IncidentResolved`` whose copy the incident feed no longer
takes (its ``max.message.bytes`` lowered while the coordinator runs)."""


def coordinator_group(topic_prefix: str) -> str:
    """The coordinator's consumer group (unless one is given): its committed offsets
    on ``sagaline.events`` say up to where its decisions are durable."""
    return f"{topic_prefix}sagaline-coordinator"


_Msg = tuple[str, bytes | None, bytes | None, Headers, int | None]
"""A prepared record: topic, key, value, headers, partition (None: by key)."""

# The longest the loop blocks with nothing to do: how soon it notices stop() or ``until``.
_IDLE_WAIT_S = 0.2
# How long a batch that changed only state (no output, no timer) may wait to share the
# next batch's transaction. Nobody waits on a changelog record or an offset, and the
# wait is bounded, so this only saves transactions: one at a time, about half of a
# saga's records (intents, commits, echoes of the coordinator's own records) change
# nothing but state, and each transaction costs the broker six requests.
_CARRY_S = 0.1
# How long a batch with outputs may wait to share a transaction with the records that
# arrive after it, when it holds records of several sagas (load). Each transaction
# costs the broker a produce request and a KIP-890 verification per partition it
# touches, plus four transaction requests and a marker per partition; at 100 sagas in
# flight a transaction per commit round trip touches about 20 partitions for about
# five sagas. A lone saga is never held: its next record waits on this batch's outputs.
_LINGER_S = 0.02
# How long a restore waits for a transaction still open on the changelog partitions it
# reads (the previous owner's last one, completing): a transaction left open by a
# member that died is aborted by the broker after its transaction.timeout.ms (10 s for
# a coordinator), once its periodic check for them (every 10 s by default) comes by.
_STABLE_WAIT_S = 60.0
_STABLE_POLL_S = 0.02
# The longest a due timer waits (from when it was first held) for its partition's
# records not yet read, without a rebalance (a broker outage, a backlog under load):
# those may hold the record that beats its deadline, but an overloaded coordinator
# that is never caught up must still fire its deadlines (``_hold``).
LAG_HOLD_MS = 30_000
# How long a due timer's check asks the broker for its partition's end when the cached
# high watermark may be stale (``_unread_end``); unanswered, the timer is held and the
# broker asked again with the next batch.
_ASK_S = 1.0
# The end of a partition the broker did not say (held, asked again), and an end already
# read whatever the consumer's position (nothing was unread when it answered).
_UNKNOWN_END = sys.maxsize
_READ_END = -sys.maxsize


@dataclass
class _Pending:
    """What one batch changed, applied to memory only after its transaction commits.

    Outputs are kept per saga until the end of the batch, so that one saga that
    turns out to be unwritable can be parked without touching the others'."""

    states: dict[str, SagaState | SagaMarker] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[_Msg]] = field(default_factory=dict)
    sources: dict[str, list[Message]] = field(default_factory=dict)
    last_record: dict[str, Record] = field(default_factory=dict)
    parked: dict[str, str] = field(default_factory=dict)
    loose: list[_Msg] = field(default_factory=list)  # not one saga's: DLQ, parked incidents
    # Per saga, the incident feed's copies of the resolutions it accepted (or their DLQ
    # copies): written with the saga's changelog record, which holds the resolution
    # (a successor that restored it would take the record for a repeat and not copy
    # it again); dropped with the saga's outputs if it is parked.
    feed: dict[str, list[_Msg]] = field(default_factory=dict)
    expired: list[str] = field(default_factory=list)  # terminal markers to tombstone
    values: dict[str, bytes] = field(default_factory=dict)  # encoded once, when checked
    # States taken from memory for this batch: the core changes them in place (memory
    # keeps the bytes, and its decoded-state cache gets them back only once the batch
    # committed, so a batch that fails leaves nothing half-applied).
    loaded: dict[str, SagaState] = field(default_factory=dict)
    # What the metrics are told once the batch's transaction has committed (a batch
    # aborted, rewound or moved by a rebalance before that is counted by whoever
    # commits it, once): per saga, in the order decided, the records it took
    # (``observe_record``), its outputs (``observe_output``) and the reasons of its
    # DLQ copies among them (``dlq``); a parked saga's outputs are never written and
    # are not counted. Then the DLQ reasons of ``loose`` and the duplicates dropped.
    observed: dict[str, list[Record | Output | str]] = field(default_factory=dict)
    dlq: list[str] = field(default_factory=list)
    duplicates: int = 0


@dataclass
class _Committing:
    """A batch whose transaction commits in the background while the loop reads and
    decodes the next one; memory takes its changes once the commit has returned."""

    commit: Future[float]  # when it returned (perf_counter)
    pending: _Pending
    due: list[str]  # sagas whose timers it fired
    offsets: list[TopicPartition]  # where its transaction leaves the consumer
    started: float
    records: int


class Coordinator:
    """Runs the core over ``sagaline.events`` until :meth:`stop` (or SIGTERM)."""

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        *,
        instance_id: str = "coordinator-0",
        group_id: str | None = None,
        clock: Callable[[], int] | None = None,
        batch_size: int = 500,
        transaction_timeout_ms: int = 10_000,
        metrics: ShellMetrics | None = None,
        carry_ms: int = int(_CARRY_S * 1000),
        linger_ms: int = int(_LINGER_S * 1000),
        decoded_states: int = DECODED_STATES,
    ) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.topics = settings.topics
        self.signer = settings.signer()
        if isinstance(self.signer, IdentitySigner):
            # With another identity's key (or none) every participant would refuse its
            # commands, and it its own records: every saga stalled, nothing said.
            self.signer.require(COORDINATOR_PRODUCER, Role.COORDINATOR, "the coordinator")
        # Identity keys make envelope.producer the verified writer (schemas.trust).
        # SAGALINE_MAX_STEPS holds for every writer, not only for the saga client.
        self._policy = CorePolicy(
            bind_writers=isinstance(self.signer, IdentitySigner),
            max_steps=settings.limits.max_steps,
        )
        self.instance_id = instance_id
        self.group_id = group_id or coordinator_group(settings.topic_prefix)
        self._clock = clock or (lambda: int(time.time() * 1000))
        self._batch_size = batch_size
        self._running = True  # until stop(), which may come before run() reaches its loop
        # Taken by the first run() for good: its end closes the consumer and producer, and
        # a second run() (while it serves, or after) must neither use nor close them.
        self._run_once = threading.Lock()
        # health(): run() is in its loop, it has joined its group (its first
        # assignment is restored), and no restore is under way.
        self._serving = False
        self._joined = False
        self._restoring: list[int] | None = None  # the partitions a restore is reading
        self._ready: threading.Event | None = None  # run()'s ``ready``
        self._states = _PackedStates(decoded_states)
        self._partition_of: dict[str, int] = {}
        # Sagas the changelog keeps as a terminal marker, in the order they ended, so
        # the expired ones are at the front; parked markers (which never expire) apart,
        # or every batch's search for expired markers would walk past all of them.
        self._markers: dict[str, SagaMarker] = {}
        self._parked: dict[str, SagaMarker] = {}
        self._limits = settings.limits
        self._failures = 0  # consecutive failed transactions
        # The most bytes a record may have on each topic of ``_unparkable_topics`` whose
        # max.message.bytes was found lowered while running (``_read_topic_limits``).
        self._room: dict[str, int] = {}
        # Sagas whose records failed to produce (the retried batch parks them), with
        # their partition: forgotten when it is revoked (its next owner decides afresh).
        self._suspects: dict[str, int | None] = {}
        self._assigned: set[int] = set()
        # A record poll() returned before a rebalance that moved its partition is left
        # to the partition's owner (see _next_batch).
        self._moves = PartitionMoves()
        # The consumer's group metadata for the transactions' offsets, asked of
        # librdkafka once per assignment (each ask is a round trip to its main
        # thread); dropped on every rebalance and after a failed transaction.
        self._group_metadata: Any = None
        self._carry_s = carry_ms / 1000
        # A batch whose only effect is state, not yet committed (see _CARRY_S): memory
        # is untouched until the transaction that carries it commits, so an abort or a
        # rebalance rewinds to the committed offsets as for any batch.
        self._carry: _Pending | None = None
        self._carry_since = 0.0
        self._carry_until = 0.0
        self._linger_s = linger_ms / 1000
        self._lingering = False  # the carry holds outputs (see _LINGER_S)
        self._known_participants: set[str] = set()
        # Participants whose command topics exist (listed at start, made since): past
        # SAGALINE_MAX_PARTICIPANTS of them no other is made (``_may_make_command_topic``).
        self._command_topics: set[str] = set()
        # (due_at, saga_id) of every saga with a timer; an entry whose saga has since
        # moved (or ended) is skipped when it comes up, so updates only ever push.
        self._timers: list[tuple[int, str]] = []
        # Events partitions assigned with a backlog, and the end (last stable offset) each
        # had when assigned: their sagas' timers wait until the consumer has read that
        # far (``_catch_up``), since the backlog may hold the record that beats a
        # deadline (a completion recorded within its wait). Timers that came due
        # meanwhile are held per partition and go back to the heap once it caught up.
        self._catching_up: dict[int, int] = {}
        self._held_timers: dict[int, list[tuple[int, str]]] = {}
        # Without a rebalance, a due timer whose partition has records unread (librdkafka's
        # cached high watermark past the consumer's position) is held the same way, but
        # for at most LAG_HOLD_MS from when it was first held (``_hold``): the clock time
        # each saga's timer was first held, and for each partition held so (rather than
        # on assignment) the earliest time one of its held timers must fire regardless.
        self._lag_since: dict[str, int] = {}
        self._lag_release: dict[int, int] = {}
        # The partition's unread end when each such saga's timer was first held: what it
        # waits for (a timer that came due later, during the hold of another, waits for
        # what was unread then, not for the end noted at the other's hold).
        self._lag_until: dict[str, int] = {}
        # Events partitions whose cached high watermark may predate a broker outage: the
        # consumer reported a dropped connection since the broker last told their end.
        self._unconfirmed: set[int] = set()
        self.metrics: ShellMetrics = metrics or NoMetrics()

        self._producer_config: dict[str, Any] = {
            "transactional.id": f"{self.group_id}-{instance_id}",
            "transaction.timeout.ms": transaction_timeout_ms,
            # A batch that begins right after the last commit gets CONCURRENT_TRANSACTIONS
            # until the broker wrote the markers; retry in a few ms, not librdkafka's
            # default 100 ms.
            "retry.backoff.ms": 5,
        }
        self._producer: Producer = create_producer(bootstrap, **self._producer_config)
        self._transaction_timeout_s = transaction_timeout_ms / 1000
        self._began: float | None = None  # when the open transaction began (monotonic)
        # Tombstones of expired markers per transaction: all of them at once (many
        # expire together when SAGALINE_TERMINAL_MEMORY_MS is lowered) would overflow
        # the producer's local queue in every attempt and stop every saga.
        queue = producer_config(bootstrap, **self._producer_config).get(
            "queue.buffering.max.messages", _LIBRDKAFKA_QUEUE_MESSAGES
        )
        self._expire_max = max(1, min(_EXPIRE_PER_BATCH, int(queue) // 4))
        # Sagas whose timers one transaction fires: thousands overdue at once (after an
        # outage, on a restore) overflowed that queue too: three failed attempts, then
        # one transaction per saga, while no new record was decided.
        self._due_max = max(1, min(batch_size, int(queue) // _RECORDS_PER_TICK))
        # Waits on the broker for the loop: sends a batch's offsets to its transaction
        # while the batch is decided, and commits it while the next one is read.
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="sagaline-commit")
        self._committing: _Committing | None = None
        self._rewind = False  # a background commit failed: re-read from the committed offsets
        self._committed_to: dict[int, int] = {}  # partition -> offset, as of the last commit
        # Static membership: a restarted instance (same id) takes its partitions back
        # at once instead of waiting for the dead one's session to time out.
        self._consumer = create_consumer(
            bootstrap, self.group_id, **{"group.instance.id": f"{self.group_id}-{instance_id}"}
        )

    # ------------------------------------------------------------------ lifecycle

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT finish the current batch, then close cleanly."""

        def _stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: stopping after the current batch", signum)
            self.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def stop(self) -> None:
        self._running = False

    def health(self) -> str | None:
        """None while the loop serves (joined to its group, its partitions' sagas
        restored); else why not (``/healthz``)."""
        if not self._running:
            return "stopping"
        restoring = self._restoring
        if restoring is not None:
            return (
                f"restoring: reading the sagas of partitions {restoring} from {self.topics.state}"
            )
        if not self._serving or not self._joined:
            return "starting: checking its topics, fencing an older instance, joining its group"
        return None

    def run(
        self, *, until: Callable[[], bool] | None = None, ready: threading.Event | None = None
    ) -> None:
        """The loop. ``until`` lets tests and benchmarks stop it on a condition;
        ``ready`` is set once it serves (joined to its group, its first assignment
        restored): what it raises before that is a failure to start.

        First this machine's claim on the coordinator's static group member (its
        ``group.instance.id``, also its ``transactional.id``) is taken, and held until
        ``run`` returns (or the process ends): a second coordinator with the same
        instance id on the same broker, of this process or another, would fence this
        one, so it is refused at once with :class:`InstanceClaimed` naming the holder's
        pid. A coordinator runs once: ``run`` called again on it (while it serves, or
        after it returned) raises RuntimeError and touches nothing of it; make a new
        :class:`Coordinator` to run again."""
        if not self._run_once.acquire(blocking=False):
            raise RuntimeError(
                f"Coordinator.run() called again on coordinator {self.instance_id!r}: a"
                " coordinator runs once (its loop's end closes its consumer and producer);"
                " make a new Coordinator (same instance_id) to run it again"
            )
        member = f"{self.group_id}-{self.instance_id}"
        refusal = functools.partial(self._refusal, member)
        with member_held(self.bootstrap, member, refusal, self._close_unused):
            self._run(until, ready)

    def _close_unused(self) -> None:
        """What the constructor opened, when ``run`` is refused: nothing will use it."""
        self._sender.shutdown()
        self._consumer.close()

    def _refusal(self, member: str, holder: str, path: str) -> str:
        return (
            f"coordinator {self.instance_id!r} is already running on {self.bootstrap} in"
            f" {holder} (lock {path}): a second coordinator with the same static group"
            f" member and transactional id {member!r} would fence the first. Stop that one"
            " first, or give each coordinator its own instance id (`sagaline coordinator"
            " run --instance-id ID`, Coordinator(instance_id=...))"
        )

    def _run(self, until: Callable[[], bool] | None, ready: threading.Event | None) -> None:
        self._ready = ready
        # Inside the try: a start that fails before the loop (a topic too small, the
        # broker unreachable, fenced) closes the consumer and the sender like any other
        # way out; a process retrying the start must not leak them at each try.
        try:
            self._join()
            self._serving = True  # before the line saying so (health() also waits to join)
            log.info("coordinator %s consuming %s", self.instance_id, self.topics.events)
            while self._running and not (until is not None and self._carry is None and until()):
                self._process_batch(self._next_batch())
            if self._carry is not None:  # a clean stop leaves nothing to re-read
                self._process_batch([], flush=True)
            self._settle()
        finally:
            self._serving = self._joined = False
            self._sender.shutdown()
            self._consumer.close()
            try:
                self._producer.flush(10)
            except KafkaException as exc:
                # Everything the coordinator writes goes in transactions: what a failed
                # or fenced producer still holds was never committed, and the next owner
                # decides its batch again. A failure here must not hide why the loop
                # ended (this runs while its exception propagates).
                log.warning("coordinator %s: flush at close: %s", self.instance_id, exc)

    def _join(self) -> None:
        """What comes before the loop: check that the topics the coordinator writes
        records of no saga to take them, fence an older instance's open transaction
        (same transactional id), then join the group."""
        self._check_topic_sizes()
        self._check_terminal_memory()
        try:
            self._command_topics = command_topic_participants(
                self.bootstrap, self.topics, timeout_s=10
            )
        except KafkaException as exc:  # listed again when the limit is reached
            log.warning("could not list the command topics: %s", exc)
        self._producer.init_transactions(30)
        self._consumer.subscribe(
            [self.topics.events],
            on_assign=closing_tolerated(self._on_assign),
            on_revoke=closing_tolerated(self._on_revoke),
            on_lost=closing_tolerated(self._on_lost),
        )

    def _unparkable_topics(self) -> dict[str, tuple[str, str]]:
        """The topics the transaction ending each batch writes records of no saga to
        (``_Pending.loose``, tombstones, parked markers): what each is, what they are."""
        return {
            self.topics.dlq: ("DLQ", "DLQ copies of bad records"),
            self.topics.incidents: (
                "incident feed",
                "copies of accepted IncidentResolved records and participants' "
                "IncidentRaised records, and saga-parked incidents",
            ),
            self.topics.events: ("events", "saga-parked incidents"),
            self.topics.state: ("changelog", "parked markers and tombstones"),
        }

    def _check_topic_sizes(self) -> None:
        """Refuse to start (``TopicSetupError`` naming both sizes) when a topic's
        ``max.message.bytes`` is below what the coordinator writes to it outside any
        saga's records: records of up to ``limits.max_record_bytes``
        (``SAGALINE_MAX_RECORD_BYTES``) plus their batch's framing, batched up to the
        producer's ``batch.size``.

        A saga's own record the broker refuses parks that saga (saga by saga after
        repeated failures); ``sagaline.terminal`` and the command topics take nothing
        else. The records of ``_unparkable_topics`` (DLQ copies, saga-parked
        incidents, parked markers, tombstones) are no saga's, so no saga can be parked
        for them (the incident feed's copies of resolutions go with their saga's
        records, but the feed takes saga-parked incidents): the broker would refuse them in
        every transaction (the saga-by-saga commit too, whose last transaction carries
        them), and the coordinator would rewind the same batch for ever and decide no
        saga at all. One DescribeConfigs request for them all; a topic is not checked
        (a warning) when the broker does not say (no DESCRIBE_CONFIGS on it)."""
        carried = self._unparkable_topics()
        limits = topics_max_message_bytes(self.bootstrap, carried)
        batch = self._batch_bytes()
        record = self._limits.max_record_bytes
        needed = max(record + _BATCH_FRAMING, batch)
        for topic, (name, what) in carried.items():
            limit = limits[topic]
            if isinstance(limit, KafkaException):
                log.warning(
                    "could not read max.message.bytes of %s (%s): not checked against "
                    "SAGALINE_MAX_RECORD_BYTES=%d; grant DESCRIBE_CONFIGS on it to have it "
                    "checked",
                    topic,
                    limit.args[0] if limit.args else limit,
                    record,
                )
                continue
            if limit is None or limit >= needed:
                continue
            raise TopicSetupError(
                f"the {name} topic {topic!r} takes records of at most {limit} bytes (its "
                f"max.message.bytes), but the coordinator writes {what} there, no saga's "
                f"records, of up to SAGALINE_MAX_RECORD_BYTES={record} bytes (plus "
                f"{_BATCH_FRAMING} bytes of framing), in batches of up to {batch} bytes "
                "(the producer's batch.size): the broker would refuse them in every "
                "transaction and no saga would be decided. Raise the topic's "
                f"max.message.bytes to at least {needed}, or lower SAGALINE_MAX_RECORD_BYTES "
                f"to at most {limit - _BATCH_FRAMING} and SAGALINE_KAFKA_BATCH_SIZE to at "
                f"most {limit}"
            )

    def _check_terminal_memory(self) -> None:
        """Refuse to start (``TopicSetupError``) when ``limits.terminal_memory_ms`` is
        shorter than the events topic can deliver a record again: its ``retention.ms``
        plus its ``segment.ms`` (Kafka deletes whole segments) plus
        ``RETENTION_MARGIN_MS``, as the broker says. A marker tombstoned before the
        saga's ``SagaStarted`` is gone would let a replay (an offset reset, expired
        group offsets) run the ended saga again. An events topic that keeps its
        records for ever (``retention.ms=-1``) is only warned about: no memory covers
        it. Not checked (a warning) when the broker does not say (no
        DESCRIBE_CONFIGS on the topic)."""
        topic = self.topics.events
        memory = self._limits.terminal_memory_ms
        try:
            retention = topic_retention(self.bootstrap, topic, timeout_s=10)
        except KafkaException as exc:
            log.warning(
                "could not read retention.ms and segment.ms of %s (%s): "
                "SAGALINE_TERMINAL_MEMORY_MS=%d not checked against them; grant "
                "DESCRIBE_CONFIGS on it to have it checked",
                topic,
                exc.args[0] if exc.args else exc,
                memory,
            )
            return
        if retention is None:  # the in-process transport deletes nothing
            return
        kept, segment = retention
        if kept < 0:
            log.warning(
                "%s keeps its records for ever (retention.ms=-1, or no delete in its "
                "cleanup.policy), but the coordinator forgets an ended saga "
                "SAGALINE_TERMINAL_MEMORY_MS=%d ms after its end: its history read again "
                "after that (an offset reset, expired group offsets) runs it again. Set "
                "the topic's retention.ms, or a SAGALINE_TERMINAL_MEMORY_MS longer than "
                "history is ever replayed from (docs/operating.md, Limits)",
                topic,
                memory,
            )
            return
        needed = kept + segment + RETENTION_MARGIN_MS
        if memory < needed:
            raise TopicSetupError(
                f"SAGALINE_TERMINAL_MEMORY_MS={memory} is shorter than {topic!r} keeps "
                f"a record (retention.ms={kept} plus segment.ms={segment}: Kafka deletes "
                f"whole segments): an ended saga forgotten while its history can still be "
                "read again (an offset reset, expired group offsets) would run again. Set "
                f"SAGALINE_TERMINAL_MEMORY_MS to at least {needed} (that plus a "
                f"{RETENTION_MARGIN_MS} ms margin), or lower the topic's retention.ms or "
                "segment.ms (docs/operating.md, Limits)"
            )

    def _batch_bytes(self) -> int:
        """The largest record batch the producer sends (``batch.size``, at most its
        ``message.max.bytes``)."""
        producer = producer_config(self.bootstrap, **self._producer_config)
        return min(
            int(producer.get("batch.size", _LIBRDKAFKA_BATCH_BYTES)),
            int(producer.get("message.max.bytes", _LIBRDKAFKA_BATCH_BYTES)),
        )

    def _read_topic_limits(self) -> None:
        """After a transaction the broker refused for a record's size: read again the
        ``max.message.bytes`` of the topics that take records of no saga
        (``_unparkable_topics``). They were checked at start, but an operator may have
        lowered one since; a record of no saga over it would be refused in every
        transaction and stop every saga.

        For each topic now below what the start-up check asks for, the records it
        takes are held to its limit less the batch framing (``_room``): a DLQ copy over
        that is written as its summary (``_reject``), a copy of a resolution for the
        incident feed goes to the DLQ instead (``_to_incident_feed``), and a saga
        whose state or ledger output is over it is parked (``_check_sizes``). The
        producers that replace a failed one batch at most that many bytes
        (``batch.size``), so records that fit one by one are not refused together.
        This holds until the coordinator restarts (whose start-up check then names
        the topic).

        The topics that take only a saga's own records (``sagaline.terminal``, the
        command topics written so far) are read too: one whose limit is below the
        producer's ``batch.size`` refuses a whole batch of small records (librdkafka
        does not split it), and saga by saga a saga's several commands in one batch
        would park it though each fits. The producers that replace a failed one
        batch at most that limit less the framing too (a warning says so, and what
        to raise); a record over it on its own still parks its saga. Called only on
        such a failure: no per-record work otherwise."""
        carried = self._unparkable_topics()
        own = [self.topics.terminal]
        own += [self.topics.commands(p) for p in sorted(self._known_participants)]
        limits = topics_max_message_bytes(self.bootstrap, [*carried, *own], timeout_s=10)
        needed = max(self._limits.max_record_bytes + _BATCH_FRAMING, self._batch_bytes())
        batches: list[int] = []
        for topic in own:
            limit = limits[topic]
            if isinstance(limit, int) and limit - _BATCH_FRAMING < self._batch_bytes():
                log.warning(
                    "topic %r takes record batches of at most %d bytes (its "
                    "max.message.bytes), below the producer's batch.size of %d: the "
                    "coordinator now batches at most %d bytes until it restarts; set "
                    "SAGALINE_KAFKA_BATCH_SIZE to at most %d, or raise the topic's "
                    "max.message.bytes",
                    topic,
                    limit,
                    self._batch_bytes(),
                    max(1, limit - _BATCH_FRAMING),
                    max(1, limit - _BATCH_FRAMING),
                )
                batches.append(limit - _BATCH_FRAMING)
        for topic in carried:
            limit = limits[topic]
            if isinstance(limit, KafkaException):
                log.warning("could not read max.message.bytes of %s again: %s", topic, limit)
                continue
            if limit is None or limit >= needed:
                continue
            room = limit - _BATCH_FRAMING
            if self._room.get(topic) != room:
                log.error(
                    "the %s topic %r now takes records of at most %d bytes (its "
                    "max.message.bytes), below SAGALINE_MAX_RECORD_BYTES=%d plus %d bytes of "
                    "framing or the producer's batch.size: records over %d bytes for it are "
                    "dead-lettered (as summaries) or park their saga until the coordinator "
                    "restarts; raise the topic's max.message.bytes to at least %d",
                    carried[topic][0],
                    topic,
                    limit,
                    self._limits.max_record_bytes,
                    _BATCH_FRAMING,
                    room,
                    needed,
                )
            self._room[topic] = room
        batches += self._room.values()
        if batches:
            batch = max(1, min(batches))
            if batch < self._batch_bytes():
                self._producer_config["batch.size"] = batch

    def _room_on(self, topic: str) -> int:
        """The most bytes the coordinator writes in one record to ``topic``."""
        return min(self._limits.max_record_bytes, self._room.get(topic, _NO_LIMIT))

    def _next_batch(self) -> list[Message]:
        """Block until the first record arrives (or the next timer is due), then take
        whatever has already arrived, up to the batch size: no record waits for a
        batch to fill, and under load batches grow by themselves. While a batch is
        committing, only what has already arrived is taken; with nothing there, the
        commit is waited for instead (its outputs are then visible)."""
        if self._committing is not None:
            first = self._consumer.poll(0)
            if first is None:
                self._settle()
                return []
        else:
            wait_s = _IDLE_WAIT_S
            if self._timers:
                wait_s = min(wait_s, max(0.0, (self._timers[0][0] - self._clock()) / 1000))
            if self._carry is not None:
                wait_s = min(wait_s, max(0.0, self._carry_until - time.monotonic()))
                if self._lingering:  # under load: take what comes until the window ends
                    held = sum(len(s) for s in self._carry.sources.values())
                    return self._consumer.consume(max(1, self._batch_size - held), wait_s)
            first = self._consumer.poll(wait_s)
            if first is None:
                return []
        return self._moves.batch(first, self._consumer, self._batch_size - 1)

    def _due_sagas(self, now: int) -> list[str]:
        """Sagas with a timer due at ``now``, from the heap (no scan of every saga); at
        most ``_due_max`` of them, earliest first: the rest stay in the heap for the
        next batches' transactions (the loop does not wait while one is overdue)."""
        due: dict[str, None] = {}
        ends: dict[int, int | None] = {}  # each partition's unread end, asked once
        while self._timers and self._timers[0][0] <= now and len(due) < self._due_max:
            entry = heapq.heappop(self._timers)
            saga_id = entry[1]
            due_at = self._states.due_at(saga_id)  # no decoding: the entry keeps it
            if due_at is None or due_at > now:
                self._unhold(saga_id)  # moved or ended: no longer held
                continue
            partition = self._partition_of.get(saga_id)
            if partition is not None and self._hold(entry, partition, now, ends):
                continue
            due[saga_id] = None
        return list(due)

    def _hold(
        self, entry: tuple[int, str], partition: int, now: int, ends: dict[int, int | None]
    ) -> bool:
        """Hold the due timer ``entry`` (and say so) while its partition has records
        the consumer has not read: they may hold the record that beats its deadline
        (a completion recorded within its wait, a grant before its expiry).

        On assignment (and after a rewind) ``_behind`` noted the partition's backlog:
        held until it is read. Otherwise the consumer's lag is checked here, only when
        a timer is due and once per partition per batch (``_unread_end``: librdkafka's
        cached high watermark, or the broker when that may be stale): held until the
        consumer has read that far, but for at most LAG_HOLD_MS from when this saga's
        timer was first held, so that a coordinator always behind still fires it. A
        timer that comes due while the partition is held for another's waits for what
        is unread when it comes due (its own end, ``_lag_until``), not only for the
        end noted for the other: the record that beats it may be past that."""
        saga_id = entry[1]
        if partition in self._catching_up and partition not in self._lag_release:
            self._held_timers.setdefault(partition, []).append(entry)
            return True
        since = self._lag_since.get(saga_id)
        if since is not None and now - since >= LAG_HOLD_MS:
            self._unhold(saga_id)
            return False
        if since is None:
            if partition not in ends:
                ends[partition] = self._unread_end(partition)
            end = ends[partition]
            if end is None:
                return False
            since = self._lag_since[saga_id] = now
            self._lag_until[saga_id] = end
        until = self._lag_until.get(saga_id, 0)
        target = self._catching_up.get(partition)
        if target is None or until < target:
            self._catching_up[partition] = until  # the nearest end a held timer waits for
        release = self._lag_release.get(partition)
        if release is None or since + LAG_HOLD_MS < release:
            self._lag_release[partition] = since + LAG_HOLD_MS
        self._held_timers.setdefault(partition, []).append(entry)
        return True

    def _unread_end(self, partition: int) -> int | None:
        """The events partition's end when the consumer's position is behind it; None
        when it is not. Usually librdkafka's cached high watermark (a local call), but
        that is only as fresh as the last fetch response: unknown before the first one,
        and after a broker outage the fetch that shows the backlog may not have returned
        when a timer comes due. Then (and while nothing was read since assignment, the
        position unknown) the broker is asked; ``_UNKNOWN_END`` if it does not answer."""
        tp = TopicPartition(self.topics.events, partition)
        try:
            _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
        except KafkaException:
            return None
        (position,) = self._consumer.position([tp])
        offset = position.offset
        if high < 0 or offset < 0 or partition in self._unconfirmed:
            try:
                low, high = self._consumer.get_watermark_offsets(tp, timeout=_ASK_S)
                if offset < 0:  # nothing read since assigned: it starts where committed
                    (committed,) = self._consumer.committed([tp], _ASK_S)
                    offset = max(committed.offset, low)
            except KafkaException:
                return _UNKNOWN_END
            self._unconfirmed.discard(partition)
        if offset >= high:
            return None
        return int(high)

    def _ask_end(self, partition: int) -> None:
        """Ask again for the end of ``partition``, whose held timers wait for an end the
        broker did not say (``_unread_end``); once it answers they wait for that."""
        end = self._unread_end(partition)
        if end == _UNKNOWN_END:
            return
        held = self._held_timers.get(partition, [])
        for entry in held:
            if self._lag_until.get(entry[1]) == _UNKNOWN_END:
                self._lag_until[entry[1]] = _READ_END if end is None else end
        self._catching_up[partition] = min(self._lag_until.get(e[1], _READ_END) for e in held)

    def _catch_up(self, now: int) -> None:
        """Mark the partitions the consumer has read to the end they had when
        assigned (every record up to it is in this batch or an earlier one), and give
        their held timers back to the heap: this batch fires those that are due, after
        its records. A local call, made only while a partition is catching up.

        A timer held for its partition's lag (``_hold``) waits for the records unread
        when its hold began, not for those that came since: once the partition has
        read that far its timers fire, though it is still behind (under steady load a
        coordinator is never caught up, and a retry's backoff must not become
        LAG_HOLD_MS); those that have waited LAG_HOLD_MS go back (and fire) whether it
        read that far or not."""
        for n, target in list(self._catching_up.items()):
            if target == _UNKNOWN_END:
                self._ask_end(n)
        tps = [TopicPartition(self.topics.events, n) for n in self._catching_up]
        for tp in self._consumer.position(tps):
            n = tp.partition
            if tp.offset >= self._catching_up[n]:
                kept: list[tuple[int, str]] = []
                for entry in self._held_timers.pop(n, []):
                    until = self._lag_until.get(entry[1])
                    if until is not None and until > tp.offset:
                        kept.append(entry)  # came due later: what was unread then
                        continue
                    if entry[1] in self._lag_since:
                        # Waited for what was unread when held: not held again for
                        # what came since (a coordinator under steady load is never
                        # caught up; a retry's backoff must not grow to LAG_HOLD_MS).
                        self._unhold(entry[1])
                        self._lag_since[entry[1]] = now - LAG_HOLD_MS
                    heapq.heappush(self._timers, entry)
                if not kept:
                    del self._catching_up[n]
                    self._lag_release.pop(n, None)
                    continue
                self._held_timers[n] = kept
                self._catching_up[n] = min(self._lag_until[e[1]] for e in kept)
                self._lag_release[n] = min(self._lag_since[e[1]] for e in kept) + LAG_HOLD_MS
            release = self._lag_release.get(n)
            if release is not None and release <= now:
                self._release_overdue(n, now)

    def _release_overdue(self, partition: int, now: int) -> None:
        """Give the timers of ``partition`` held for its lag for LAG_HOLD_MS back to
        the heap (they fire in this batch); the others stay held."""
        kept: list[tuple[int, str]] = []
        release: int | None = None
        for entry in self._held_timers.pop(partition, []):
            until = self._lag_since.get(entry[1], now) + LAG_HOLD_MS
            if until <= now:
                heapq.heappush(self._timers, entry)
                continue
            kept.append(entry)
            release = until if release is None else min(release, until)
        if release is None:
            del self._catching_up[partition]
            del self._lag_release[partition]
            return
        self._held_timers[partition] = kept
        self._lag_release[partition] = release

    def _unhold(self, saga_id: str) -> None:
        """Forget that ``saga_id``'s timer is held for its partition's lag."""
        self._lag_since.pop(saga_id, None)
        self._lag_until.pop(saga_id, None)

    def _behind(self, partitions: list[TopicPartition], committed: list[TopicPartition]) -> None:
        """Note which of ``partitions`` have records to read up to their current end
        from ``committed`` (their committed offsets: where the consumer starts); those
        fire no timer of their sagas until the consumer has read that far."""
        start = {tp.partition: tp.offset for tp in committed}
        for tp in partitions:
            low, end = watermarks(self._consumer, TopicPartition(self.topics.events, tp.partition))
            offset = start.get(tp.partition, -1)
            if max(offset, low) < end:
                self._catching_up[tp.partition] = end
                self._lag_release.pop(tp.partition, None)  # held until that end is read

    def _schedule(self, saga_id: str, due_at: int | None) -> None:
        if due_at is not None:
            heapq.heappush(self._timers, (due_at, saga_id))

    # ----------------------------------------------------------------- the batch

    def _process_batch(self, messages: list[Message], *, flush: bool = False) -> None:
        """Decode the batch (while the previous one may still be committing), then
        decide it on memory as that commit left it (with the batch it carries, if
        any); then carry it too, or produce everything in one transaction and leave
        the commit to the background."""
        now = self._clock()
        started = time.perf_counter()
        records = [m for m in messages if m.error() is None]
        for m in messages:
            err = m.error()
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                raise_if_fatal(err)  # a fenced consumer: exit, a restart takes over
                log.warning("consumer error: %s", err)
                self._unconfirmed |= self._assigned  # the next fetch may show a backlog
        loose: list[_Msg] = []  # rejected at decoding, resolutions
        dlq: list[str] = []  # their reasons, counted once the batch commits
        decoded = [(m, r) for m in records if (r := self._decode(m, loose, dlq)) is not None]
        self._settle()
        if self._rewind:  # the previous batch failed: this one is read again after it
            self._rewind = False
            self._seek_committed()
            return
        if self._catching_up:
            self._catch_up(now)
        due = self._due_sagas(now)
        carried, self._carry = self._carry, None
        pending = carried or _Pending()
        pending.loose += loose
        pending.dlq += dlq
        pending.expired = self._expired_markers(now)
        flush = flush or (carried is not None and time.monotonic() >= self._carry_until)
        if not records and not due and not pending.expired and not flush:
            self._carry = carried
            return

        positions: list[TopicPartition] = []  # what this batch's transaction commits
        offsets: Future[None] | None = None
        try:
            if len(records) >= self._batch_size and self._failures < _ISOLATE_AFTER_FAILURES:
                # A full batch (a backlog; it is never carried): its offsets go to its
                # transaction (two round trips) while this thread decides it.
                positions = self._positions()
                offsets = self._begin(positions)
            self._decide_batch(decoded, due, now, pending)
            if offsets is None and not flush and not due and self._held(pending, carried):
                return
            # Sizes are checked (and states encoded) once per transaction, not per
            # carried batch: a saga several carried batches change is encoded once.
            self._check_sizes(now, pending)
            positions = positions or self._positions()
            if self._failures >= _ISOLATE_AFTER_FAILURES:
                self._commit_isolated(now, pending)
                commit: Future[float] = Future()
                commit.set_result(time.perf_counter())
            else:
                offsets = offsets or self._begin(positions)
                self._produce(pending.loose)
                for saga_id in self._sagas_in(pending):
                    self._produce_saga(saga_id, pending)
                self._produce_tombstones(pending)
                commit = self._sender.submit(_commit, self._producer, offsets)
        except KafkaException as exc:
            if offsets is not None:
                wait([offsets])  # nothing of this transaction may still be running
            self._failed(exc, due)
            self._seek_committed()
            return
        self._committing = _Committing(commit, pending, due, positions, started, len(records))

    def _begin(self, positions: list[TopicPartition]) -> Future[None]:
        """Begin the batch's transaction; its offsets are sent in the background."""
        self._begin_transaction()
        if self._group_metadata is None:
            self._group_metadata = self._consumer.consumer_group_metadata()
        return self._sender.submit(self._send_offsets, positions, self._group_metadata)

    def _held(self, pending: _Pending, carried: _Pending | None) -> bool:
        """Carry the batch (with what it already carries) into the next one's
        transaction, and say so; False: it is to be committed now.

        A batch that changed state at most has nothing to send anyone and waits up to
        ``carry_ms`` (``_CARRY_S``). A batch with outputs waits up to ``linger_ms``
        (``_LINGER_S``), and only while it holds records of at least two sagas: then
        more sagas are active, the next records come anyway, and one transaction
        takes them all. A lone saga's outputs are never held. The window counts from
        the first batch carried, so nothing waits longer than either bound."""
        held = sum(len(s) for s in pending.sources.values())
        if self._failures or pending.parked or held >= self._batch_size:
            return False
        outputs = bool(pending.loose or pending.expired or any(pending.outputs.values()))
        if outputs and (self._linger_s <= 0 or len(pending.sources) < 2):
            return False
        if carried is None:
            self._carry_since = time.monotonic()
        self._carry_until = self._carry_since + (self._linger_s if outputs else self._carry_s)
        if time.monotonic() >= self._carry_until:
            return False
        self._carry = pending
        self._lingering = outputs
        return True

    def _settle(self) -> None:
        """Wait for the batch committing in the background; then memory takes its
        changes, or, if its transaction failed, it is aborted and the consumer is
        rewound before the next batch (``_rewind``)."""
        committing, self._committing = self._committing, None
        if committing is None:
            return
        try:
            committed_at = committing.commit.result()
        except KafkaException as exc:
            self._failed(exc, committing.due)
            self._rewind = True
            return
        self._failures = 0
        self._began = None
        self.metrics.transaction_committed(committed_at - committing.started, committing.records)
        self._committed_to = {tp.partition: tp.offset for tp in committing.offsets}
        pending = committing.pending
        self._commit_pending(pending)
        for saga_id in committing.due:
            if saga_id in pending.states:
                continue  # scheduled by _commit_pending
            ticked = pending.loaded.get(saga_id)
            if ticked is None:  # not ticked (a marker): as memory says
                self._schedule(saga_id, self._states.due_at(saga_id))
                continue
            # The tick changed nothing, so no timer of the saga was due: the time its
            # entry said (its changelog record's sagaline-next-due header, corrupt or
            # written by hand) is no timer of its. Kept, it was due again at every
            # loop turn, each committing an empty transaction. Its real next timer
            # (from the state the tick decoded) takes the entry's place.
            due_at = ticked.next_due_at()
            self._states.retime(saga_id, due_at)
            self._schedule(saga_id, due_at)

    def _failed(self, exc: KafkaException, due: list[str]) -> None:
        """A batch's transaction failed: abort it (memory never saw it)."""
        self._failures += 1
        self._group_metadata = None  # a stale generation fails this way: ask again
        for saga_id in due:  # their timers fire again in the re-run of this batch
            self._schedule(saga_id, self._states.due_at(saga_id))
        error: KafkaError = exc.args[0]
        log.warning("transaction failed (%s); aborting the batch and rewinding", error)
        if error.fatal() and not self._replaceable(error):
            raise exc  # fenced by a newer instance with our transactional.id
        if error.code() in _SIZE_REFUSALS:
            self._read_topic_limits()  # before _abort: its new producer batches less
        self._abort()

    def _decode(self, msg: Message, loose: list[_Msg], dlq: list[str]) -> Record | None:
        """The record, or None when it went to the DLQ (R16)."""
        try:
            record = from_message(msg.key(), msg.value(), headers_of(msg), self.signer)
        except CodecError as exc:
            self._reject(msg, exc.reason, str(exc), loose, dlq.append)
            return None
        return record

    def _resolve_ended(
        self, msg: Message, record: IncidentResolved, marker: SagaMarker, pending: _Pending
    ) -> None:
        """A person settling what an ended (usually ESCALATED) or parked saga left:
        nothing to decide, but the same authorisation as for a saga in flight (its
        tenant, R15), it must name an incident the saga left open (when the marker
        says which), and the first resolution of an incident counts: a later one is
        refused ``invalid-transition`` naming it, as while the saga runs (a repeat of
        the same record changes nothing). Accepted, it is kept in the marker, the
        measures count it (the intervention, the recovery) and the incident feed shows
        it; a parked saga's record also goes to the DLQ."""
        saga_id = record.saga_id
        tenant = marker.tenant_id
        mismatch = None if tenant is None else tenant_mismatch(record, saga_id, tenant)
        if mismatch is not None:
            self._reject(
                msg, RejectReason.TENANT_MISMATCH, mismatch, pending.loose, pending.dlq.append
            )
            return
        counted = (marker.resolved or {}).get(record.incident_id)
        resolution = f"{record.resolution} (by {record.resolved_by})"[:200]
        if counted is not None:
            # A repeat is the same record: its id, and what it says (an operator's id is
            # derived from what anyone sees, so another writer could use it first).
            if counted.event_id == record.event_id and counted.resolution == resolution:
                pending.duplicates += 1  # a repeat: already on the feed
                return
            detail = (
                f"incident {record.incident_id} is already resolved ({counted.resolution}); "
                f"the resolution by {cut_operator_text(record.resolved_by)} "
                f"({cut_operator_text(record.resolution)}) does not count"
            )
            self._reject(
                msg, RejectReason.INVALID_TRANSITION, detail, pending.loose, pending.dlq.append
            )
            return
        if marker.incidents is not None and record.incident_id not in marker.incidents:
            detail = f"no open incident {record.incident_id} in ended saga {saga_id}"
            self._reject(
                msg, RejectReason.INVALID_TRANSITION, detail, pending.loose, pending.dlq.append
            )
            return
        raised = (marker.generations or {}).get(record.incident_id)
        if raised is not None and record.envelope.generation < raised:
            detail = stale_resolution(record, saga_id, raised)
            self._reject(
                msg, RejectReason.STALE_GENERATION, detail, pending.loose, pending.dlq.append
            )
            return
        if marker.marker is MarkerKind.PARKED:
            why = f"saga {saga_id} is parked: {marker.reason}"
            self._reject(msg, PARKED_REASON, why, pending.loose, pending.dlq.append)
        else:
            pending.observed.setdefault(saga_id, []).append(record)
        kept = EndedResolution(event_id=record.event_id, resolution=resolution)
        resolved = {**(marker.resolved or {}), record.incident_id: kept}
        pending.states[saga_id] = marker.model_copy(update={"resolved": resolved})
        pending.values.pop(saga_id, None)  # its changelog record is written anew
        self._to_incident_feed(msg, saga_id, pending)

    def _to_incident_feed(self, msg: Message, saga_id: str, pending: _Pending) -> None:
        """The operators' incident feed shows each resolution the coordinator accepted
        next to its incident, also for sagas that have already ended ESCALATED (the
        usual case). A refused one (another tenant, no such incident) stays off it:
        ``sagaline incidents list`` keeps the first resolution of an incident. It also
        shows each incident a participant raised that the coordinator took (its own
        go there as outputs), or ``sagaline incidents resolve`` would not find it.

        A copy the incident feed no longer takes (its ``max.message.bytes`` lowered
        while running, ``_read_topic_limits``) goes to the DLQ instead, with reason
        ``incident-feed-too-large``: it would be refused in every transaction.

        Either goes with the saga's records (``_Pending.feed``): in the saga-by-saga
        commit, in the transaction of its changelog record, not in the last one."""
        feed = pending.feed.setdefault(saga_id, [])
        key, value, headers = msg.key(), msg.value(), _headers(msg)
        room = self._room.get(self.topics.incidents)
        if room is not None:
            size = message_size(key, value, headers)
            if size > room:
                detail = (
                    f"accepted, but its copy for the incident feed {self.topics.incidents} is "
                    f"{size} bytes, over the {room} bytes the topic takes now (its "
                    f"max.message.bytes less framing); the resolution is on the ledger"
                )
                counted = pending.observed.setdefault(saga_id, [])
                self._reject(msg, FEED_TOO_LARGE_REASON, detail, feed, counted.append)
                return
        feed.append((self.topics.incidents, key, value, headers, None))

    def _decide_batch(
        self, records: list[tuple[Message, Record]], due: list[str], now: int, pending: _Pending
    ) -> None:
        for msg, record in records:
            self._handle_message(msg, record, now, pending)
        for saga_id in due:
            state = self._current(saga_id, pending, now)
            if not isinstance(state, SagaState) or saga_id in pending.parked:
                continue
            try:
                decision = tick(state, now, self._policy, in_place=True)
            except Exception as exc:  # a bug in one saga must not stop the others
                _log_raised(exc, "tick failed for %s", saga_id)
                self._park(saga_id, f"tick raised {_raised(exc)}", now, pending)
                continue
            self._apply_or_park(decision, saga_id, "a timer", now, pending)

    def _handle_message(self, msg: Message, record: Record, now: int, pending: _Pending) -> None:
        saga_id = record.saga_id
        pending.partitions.setdefault(saga_id, msg.partition() or 0)
        state = self._current(saga_id, pending, now, record)
        if isinstance(state, SagaMarker):
            if isinstance(record, IncidentResolved):
                self._resolve_ended(msg, record, state, pending)
            elif state.marker is MarkerKind.PARKED and not _is_own(record):
                self._reject(
                    msg,
                    PARKED_REASON,
                    f"saga {saga_id} is parked: {state.reason}",
                    pending.loose,
                    pending.dlq.append,
                )
            return  # history of a saga that ended here (late echo, duplicate, replay)
        # Whether a resolution names an open incident of this saga, before the core
        # (deciding in place) marks it resolved; a type check for every other record.
        resolves = False
        if isinstance(record, IncidentResolved) and state is not None:
            if state.is_terminal:
                # Ended in this batch: as for its marker (the core ignores it), which
                # an accepted one puts in place of the state at once. Whatever its
                # generation, as for the marker: no later run of an ended saga asks
                # again, so an earlier run's open incident is resolved as it is.
                self._resolve_ended(msg, record, terminal_marker(state), pending)
                return
            resolves = _names_open_incident(state, record)
        elif isinstance(record, IncidentRaised) and state is not None and not _is_own(record):
            # A participant's incident (no lookup, a result too large) the saga does not
            # hold yet: the feed is where `sagaline incidents` finds what to resolve.
            resolves = state.incident(record.incident_id) is None
        pending.sources.setdefault(saga_id, []).append(msg)
        pending.last_record[saga_id] = record
        try:
            decision = decide(
                state,
                record,
                now,
                self._policy,
                position=(msg.partition() or 0, msg.offset() or 0),
                in_place=True,
            )
        except Exception as exc:  # a bug must not stop the service or lose the record
            _log_raised(exc, "decide failed for %s", record.event_id)
            self._park(saga_id, f"deciding {record.TYPE} raised {_raised(exc)}", now, pending)
            return
        # A record the core refused (wrong tenant or writer, a mismatched grant, a stale
        # generation) goes to the DLQ, counted there: it is no fact of the saga, so the
        # measures (operator actions, failures, recoveries) must not fold it.
        refused = next(
            (
                o.reason
                for o in decision.outputs
                if o.destination is Destination.REJECTED and o.record is record
            ),
            None,
        )
        if refused is None:
            pending.observed.setdefault(saga_id, []).append(record)
        # A resolution of an open incident that the core did not refuse goes to the
        # incident feed (one of an earlier run's incident that no later run asked again
        # counts, whatever its generation: ``resolves_earlier_incident``). One refused
        # as stale does not: the step still waits on the incident asked again. So does a
        # participant's incident the core took (a saga that ended takes none).
        if resolves and refused is None and decision.changed:
            self._to_incident_feed(msg, saga_id, pending)
        if not decision.changed and record.envelope.producer != COORDINATOR_PRODUCER:
            pending.duplicates += 1
        self._apply_or_park(decision, saga_id, record.TYPE, now, pending, msg)

    def _apply_or_park(
        self,
        decision: Decision,
        saga_id: str,
        what: str,
        now: int,
        pending: _Pending,
        source: Message | None = None,
    ) -> None:
        """Apply the decision; park the saga if its outputs cannot even be prepared
        (e.g. a command for a participant whose name is no usable topic name): an
        exception here would stop the coordinator, and every restart would stop on
        the same record. The broker's errors still abort and rewind the batch.

        So does a command topic that could not be set up for want of an answer; one
        the broker refuses (no CREATE on it, a partition count other than the
        ledger's, a policy) parks the saga that addresses it: left to the loop, the
        error would end the process, and every restart would end on the same record."""
        try:
            self._apply(decision, saga_id, pending, source)
        except (KafkaException, SigningKeyError):
            raise  # not this saga's: SigningKeyError stops the coordinator, nothing committed
        except TopicSetupError as exc:
            cause = exc.__cause__
            if isinstance(cause, TimeoutError) or (
                isinstance(cause, KafkaException) and _retriable(cause)
            ):
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, str(exc))) from exc
            log.error("a command topic of saga %s cannot be set up: %s", saga_id, exc)
            self._park(saga_id, f"its command topic cannot be set up: {exc}", now, pending)
        except Exception as exc:
            _log_raised(exc, "the outputs of saga %s could not be prepared", saga_id)
            why = f"its outputs for {what} could not be prepared: {_raised(exc)}"
            self._park(saga_id, why, now, pending)

    def _apply(
        self,
        decision: Decision,
        saga_id: str,
        pending: _Pending,
        source: Message | None = None,
    ) -> None:
        out = pending.outputs.setdefault(saga_id, [])
        observed = pending.observed.setdefault(saga_id, [])
        for output in decision.outputs:
            out.extend(self._prepare(output, source, observed))
        if decision.changed and decision.state is not None:
            pending.states[saga_id] = decision.state
            pending.values.pop(saga_id, None)  # encoded again, once, by _check_sizes

    def _prepare(
        self, output: Output, source: Message | None, observed: list[Record | Output | str]
    ) -> list[_Msg]:
        if output.destination is Destination.REJECTED:
            if source is None:
                return []
            rejected: list[_Msg] = []
            self._reject(
                source, output.reason or "rejected", output.detail, rejected, observed.append
            )
            return rejected
        key, value, headers = to_message(output.record, self.signer)
        observed.append(output)
        return [(topic, key, value, headers, None) for topic in self._topics_for(output)]

    def _check_sizes(self, now: int, pending: _Pending) -> None:
        """Park, before anything is produced, every saga with a record the broker
        would refuse (its state or an output over ``limits.max_record_bytes``), and
        the sagas whose records failed to produce in an earlier attempt."""
        limit = self._limits.max_record_bytes
        # A topic whose max.message.bytes was lowered while running (``_room``) holds
        # the changelog record or the outputs it takes to less; only then are the
        # outputs' topics looked at.
        state_limit = self._room_on(self.topics.state)
        for saga_id in self._sagas_in(pending):
            if saga_id in self._suspects:
                self._park(saga_id, "its records could not be produced", now, pending)
                continue
            state = pending.states.get(saga_id)
            if state is not None and saga_id not in pending.values:
                # A carried saga that did not change since is not encoded again.
                pending.values[saga_id] = _changelog_value(state)
            size = len(pending.values.get(saga_id, b""))
            if size > state_limit:
                self._park(
                    saga_id,
                    f"its state is {size} bytes, over the limit of {state_limit} bytes "
                    + _limit_source(state_limit, limit, self.topics.state),
                    now,
                    pending,
                )
                continue
            outputs = pending.outputs.get(saga_id, [])
            biggest = max((len(m[2] or b"") for m in outputs), default=0)
            if biggest > limit:
                self._park(
                    saga_id,
                    f"an output record is {biggest} bytes, over the limit of {limit} bytes "
                    "(SAGALINE_MAX_RECORD_BYTES)",
                    now,
                    pending,
                )
            elif self._room:
                for topic, _key, value, _headers, _partition in outputs:
                    room = self._room.get(topic)
                    if room is not None and len(value or b"") > room:
                        self._park(
                            saga_id,
                            f"a record for {topic} is {len(value or b'')} bytes, over the limit "
                            f"of {room} bytes " + _limit_source(room, limit, topic),
                            now,
                            pending,
                        )
                        break

    def _park(self, saga_id: str, why: str, now: int, pending: _Pending) -> None:
        """Stop deciding one saga, durably, and tell a person; the rest go on.

        The saga's outputs of this batch are dropped, its records of this batch (and
        every later one) go to the DLQ with reason ``saga-parked``, its changelog
        record becomes a small parked marker, and one ``IncidentRaised`` says why."""
        log.error("parking saga %s: %s", saga_id, why)
        first = saga_id not in pending.parked
        pending.parked[saga_id] = why
        pending.outputs[saga_id] = []
        pending.feed.pop(saga_id, None)
        observed = pending.observed.get(saga_id)
        if observed:  # its outputs are not written: only the records it took count
            pending.observed[saga_id] = [r for r in observed if not isinstance(r, (Output, str))]
        for msg in pending.sources.pop(saga_id, []):
            self._reject(
                msg,
                PARKED_REASON,
                f"saga {saga_id} is parked: {why}",
                pending.loose,
                pending.dlq.append,
            )
        pending.values.pop(saga_id, None)
        state = self._live(saga_id)
        packed = self._states.packed(saga_id)
        if first and state is None and packed is not None:
            # Its changelog value is unreadable, and the parked marker replaces it on
            # the compacted changelog: the DLQ keeps it (R16), to be re-produced onto
            # the changelog by hand once a coordinator that reads it runs.
            self._dead_letter(
                (saga_id.encode(), packed, []),
                (self.topics.state, self._partition_of.get(saga_id), None),
                UNREADABLE_STATE_REASON,
                f"the changelog value of saga {saga_id} is unreadable, so the saga is "
                f"parked and its parked marker replaces this value: {why}",
                pending.loose,
                pending.dlq.append,
            )
        record = pending.last_record.get(saga_id)
        tenant, generation = self._tenant_of(saga_id, state, record, pending)
        incident_id = derived_event_id(saga_id, "incident", PARKED_INCIDENT)
        # What a resolution of the parked saga is checked against (None: not known).
        open_ids = [i.incident_id for i in state.open_incidents()] if state else []
        known = state is not None or record is not None
        pending.states[saga_id] = SagaMarker(
            marker=MarkerKind.PARKED,
            saga_id=saga_id,
            status="PARKED",
            at=now,
            reason=why[:2000],
            tenant_id=tenant,
            incidents=[*open_ids, incident_id] if known else None,
            generations=open_incident_generations(state) if state else None,
        )
        incident = IncidentRaised(
            envelope=envelope_for(
                IncidentRaised,
                saga_id=saga_id,
                tenant_id=tenant,
                producer=COORDINATOR_PRODUCER,
                now=now,
                generation=generation,
                event_id=derived_event_id(saga_id, "SagaParked"),
            ),
            incident_id=incident_id,
            kind=PARKED_INCIDENT,
            step_id=getattr(record, "step_id", None),
            inconsistency=(
                f"the coordinator parked saga {saga_id}: {why}. It decides nothing more for "
                "it; its further records are kept in the DLQ (reason saga-parked) and the "
                "ledger. Effects already committed stay as the ledger shows them"
            )[:4000],
            effect="saga not decided any further; see `sagaline saga show`",
            owner="operations",
        )
        key, value, headers = to_message(incident, self.signer)
        for topic in (self.topics.events, self.topics.incidents):
            pending.loose.append((topic, key, value, headers, None))

    def _tenant_of(
        self, saga_id: str, state: SagaState | None, record: Record | None, pending: _Pending
    ) -> tuple[str, int]:
        """The tenant and generation of a saga being parked, for its incident and its
        marker (a resolution must come from that tenant): from its committed state,
        else this batch's (a saga started in it), else the head of its changelog value
        when only the rest of it is unreadable (torn), else its record in this batch
        (parked from a timer, it has none). When nothing tells, ``UNKNOWN_TENANT``:
        never ``default``, a real tenant whose operators would see and resolve another
        tenant's saga while its own tenant's operators were refused."""
        if state is not None:
            return state.tenant_id, state.generation
        batch = pending.states.get(saga_id)
        if isinstance(batch, SagaState):
            return batch.tenant_id, batch.generation
        if isinstance(batch, SagaMarker) and batch.tenant_id is not None:
            return batch.tenant_id, record.envelope.generation if record else 1
        packed = self._states.packed(saga_id)
        head = None if packed is None else state_head(packed, saga_id)
        if head is not None:
            return head
        if record is not None:
            return record.envelope.tenant_id, record.envelope.generation
        return UNKNOWN_TENANT, 1

    def _sagas_in(self, pending: _Pending) -> list[str]:
        return list(dict.fromkeys([*pending.outputs, *pending.states]))

    def _produce_saga(self, saga_id: str, pending: _Pending) -> None:
        """One saga's outputs, then its changelog record. A record the client refuses
        at once for what it is (``_record_fault``) marks the saga a suspect: the
        retried batch parks it. A full local queue is nobody's fault: rewind."""
        try:
            self._produce(pending.outputs.get(saga_id, []))
            self._produce(pending.feed.get(saga_id, []))
            state = pending.states.get(saga_id)
            if state is not None:
                partition = pending.partitions.get(saga_id, self._partition_of.get(saga_id))
                value = pending.values.get(saga_id) if isinstance(state, SagaState) else None
                value = value or _changelog_value(state)
                headers: Headers = []
                if isinstance(state, SagaState) and not state.is_terminal:
                    headers = _due_headers(state.next_due_at())
                self._produce([(self.topics.state, saga_id.encode(), value, headers, partition)])
        except KafkaException as exc:
            if _record_fault(exc):
                self._suspects[saga_id] = pending.partitions.get(
                    saga_id, self._partition_of.get(saga_id)
                )
            raise

    def _produce(self, messages: list[_Msg]) -> None:
        """Queue ``messages`` in the open transaction. A full local queue
        (``BufferError``) is raised as a ``KafkaException``, as the broker's errors
        are: the batch is aborted and rewound, whichever of its records it hit."""
        try:
            for topic, key, value, headers, partition in messages:
                kwargs: dict[str, Any] = {"key": key, "value": value, "headers": headers}
                if partition is not None:
                    kwargs["partition"] = partition
                self._producer.produce(topic, **kwargs)
        except BufferError as exc:
            raise KafkaException(KafkaError(KafkaError._QUEUE_FULL, str(exc))) from exc

    def _produce_tombstones(self, pending: _Pending) -> None:
        self._produce(
            [
                (self.topics.state, saga_id.encode(), None, [], self._partition_of.get(saga_id))
                for saga_id in pending.expired
            ]
        )

    def _positions(self) -> list[TopicPartition]:
        """Where the consumer is: the offsets a batch commits once processed.

        Of the partitions the rebalance callbacks recorded: ``assignment()`` would be
        a round trip to librdkafka's main thread for every transaction."""
        topic = self.topics.events
        return self._consumer.position([TopicPartition(topic, p) for p in sorted(self._assigned)])

    def _send_offsets(self, positions: list[TopicPartition], metadata: Any) -> None:
        with deadline("send_offsets_to_transaction", 30):
            self._producer.send_offsets_to_transaction(positions, metadata, 30)

    def _commit_isolated(self, now: int, pending: _Pending) -> None:
        """After repeated failures: one transaction per saga, so a saga whose records
        cannot be written is found and parked; then the rest and the offsets.

        Outputs of a saga committed here may be produced again if the final
        transaction fails; their event ids are deterministic, so consumers (and the
        core's dedup memory, after a restore) treat them as duplicates."""
        log.warning("%d failed transactions in a row: committing saga by saga", self._failures)
        for saga_id in self._sagas_in(pending):
            if saga_id in pending.parked:
                continue
            self._begin_transaction()
            try:
                self._produce_saga(saga_id, pending)
                _commit_transaction(self._producer)
                self._began = None
            except KafkaException as exc:
                if not _record_fault(exc):
                    raise  # the broker is failing everyone: rewind, park nobody
                self._abort()
                self._park(saga_id, f"its records could not be written: {exc}", now, pending)
        self._begin_transaction()
        self._produce(pending.loose)
        for saga_id in pending.parked:
            self._produce_saga(saga_id, pending)
        self._produce_tombstones(pending)
        self._send_offsets(self._positions(), self._consumer.consumer_group_metadata())
        _commit_transaction(self._producer)
        self._began = None

    def _topics_for(self, output: Output) -> list[str]:
        if output.destination is Destination.COMMAND:
            assert output.participant is not None
            self._ensure_command_topic(output.participant)
            return [self.topics.commands(output.participant)]
        if output.destination is Destination.TERMINAL:
            return [self.topics.events, self.topics.terminal]
        if output.destination is Destination.INCIDENT:
            return [self.topics.events, self.topics.incidents]
        if output.destination is Destination.INCIDENT_FEED:
            return [self.topics.incidents]
        return [self.topics.events]

    def _ensure_command_topic(self, participant: str) -> None:
        """A command to a participant whose topic does not exist yet would abort every
        transaction; create it (idempotent, outside the transaction's concern)."""
        if participant not in self._known_participants:
            self._may_make_command_topic(participant)
            ensure_topics(
                self.bootstrap,
                self.topics,
                [participant],
                self.settings.partitions,
                replication=self.settings.replication,
                shared=False,  # checked at start; a refusal of one is not this topic's
            )
            self._known_participants.add(participant)
            self._command_topics.add(participant)

    def _may_make_command_topic(self, participant: str) -> None:
        """Raise ``TopicSetupError`` (the saga is parked) for a participant with no
        command topic once ``limits.max_participants`` participants have one: a writer
        naming made-up participants (a bug, a forgery) would otherwise have a topic,
        and a metrics series, made for each. A participant's own topic (made by
        ``participant run``) is always served: at the limit, the topics are listed
        again (one metadata request, only for a name not seen yet)."""
        limit = self._limits.max_participants
        if participant in self._command_topics or len(self._command_topics) < limit:
            return
        self._command_topics |= command_topic_participants(
            self.bootstrap, self.topics, timeout_s=10
        )
        if participant in self._command_topics:
            return
        raise TopicSetupError(
            f"participant {participant!r} has no command topic, and the coordinator makes "
            f"none past SAGALINE_MAX_PARTICIPANTS={limit} participants with one "
            f"({len(self._command_topics)} now): no service runs that participant (a step "
            "written by a buggy or forged writer?). `sagaline participant run` makes its "
            "participant's topic; or raise SAGALINE_MAX_PARTICIPANTS"
        )

    def _reject(
        self,
        msg: Message,
        reason: str,
        detail: str,
        into: list[_Msg],
        count: Callable[[str], None],
    ) -> None:
        """R16: bad input goes to the DLQ with its reason; the loop goes on. The
        reason goes to ``count``, for the metrics once the batch's transaction
        commits."""
        where = (msg.key(), msg.value(), readable_headers(msg))
        position = (msg.topic(), msg.partition(), msg.offset())
        self._dead_letter(where, position, reason, detail, into, count)

    def _dead_letter(
        self,
        where: tuple[bytes | None, bytes | None, HeaderList | None],
        position: tuple[str | None, int | None, int | None],
        reason: str,
        detail: str,
        into: list[_Msg],
        count: Callable[[str], None],
    ) -> None:
        """The DLQ copy of a record (key, value, headers) read at ``position`` (topic,
        partition, offset; None where unknown), into ``into``; see ``_reject``."""
        log.warning(  # the detail as the DLQ copy has it: a record cannot flood the log
            "dlq: %s at %s[%s]@%s: %s",
            reason,
            *position,
            detail[:_LOGGED_DETAIL],
        )
        copy: tuple[bytes | None, bytes | None, Headers] = dlq_message(
            *where, reason, detail, *position
        )
        size = message_size(*copy)
        limit = self._room_on(self.topics.dlq)
        if size > limit:
            # A record near the size limit whose copy (the headers added) is over it
            # would be refused in every transaction: the batch, and every saga in it,
            # would be rewound for ever. The copy that says what is missing instead.
            # So for a DLQ topic whose max.message.bytes was lowered while running.
            copy = dlq_summary(*where, reason, detail, *position)
            log.error(
                "the DLQ copy of %s[%s]@%s is %d bytes, over the limit of %d bytes %s: "
                "writing one without its value instead: %s",
                *position,
                size,
                limit,
                _limit_source(limit, self._limits.max_record_bytes, self.topics.dlq),
                (header_value(copy[2], DLQ_OMITTED) or b"").decode(),
            )
        into.append((self.topics.dlq, *copy, None))
        count(reason)

    def _expired_markers(self, now: int) -> list[str]:
        """Terminal markers past ``limits.terminal_memory_ms`` (oldest first), at most
        ``_expire_max`` of them: the rest go in the next batches' transactions."""
        horizon = now - self._limits.terminal_memory_ms
        expired: list[str] = []
        for saga_id, marker in self._markers.items():
            if marker.at > horizon or len(expired) >= self._expire_max:
                break
            expired.append(saga_id)
        return expired

    def _commit_pending(self, pending: _Pending) -> None:
        for saga_id in pending.expired:
            self._markers.pop(saga_id, None)
            self._partition_of.pop(saga_id, None)
        for saga_id, state in pending.states.items():
            if saga_id in pending.partitions:
                self._partition_of[saga_id] = pending.partitions[saga_id]
            if isinstance(state, SagaState) and not state.is_terminal:
                due_at = state.next_due_at()
                # The bytes written to the changelog are what memory keeps.
                value = pending.values.get(saga_id) or state.to_bytes()
                self._states.put(saga_id, value, due_at, state)
                self._schedule(saga_id, due_at)
                continue
            self._states.pop(saga_id)
            marker = terminal_marker(state) if isinstance(state, SagaState) else state
            self._keep_marker(saga_id, marker)
        for saga_id, state in pending.loaded.items():
            if saga_id not in pending.states:  # taken, not changed: still what memory says
                self._states.give_back(saga_id, state)
        for saga_id in pending.parked:
            self._suspects.pop(saga_id, None)
        self._count(pending)
        self.metrics.in_flight(len(self._states))

    def _count(self, pending: _Pending) -> None:
        """Tell the metrics what a committed batch did (as it decided it)."""
        metrics = self.metrics
        for observed in pending.observed.values():
            for item in observed:
                if isinstance(item, str):
                    metrics.dlq(item)
                elif isinstance(item, Output):
                    metrics.observe_output(item)
                else:
                    metrics.observe_record(item)
        for reason in pending.dlq:
            metrics.dlq(reason)
        if pending.duplicates:
            metrics.duplicate_prevented(pending.duplicates)

    def _current(
        self, saga_id: str, pending: _Pending, now: int, record: Record | None = None
    ) -> SagaState | SagaMarker | None:
        """The saga's state as this batch has left it so far: decoded from memory's
        bytes once per batch, then changed in place by each decision.

        A restore keeps changelog values undecoded (an unreadable one too), so an
        unreadable one is found here, the first time the saga is needed (for
        ``record``, or a timer): the saga is parked as any other (``_park``: a parked
        marker on the changelog, a saga-parked incident, its records to the DLQ)."""
        if saga_id in pending.states:
            return pending.states[saga_id]
        if saga_id in pending.loaded:
            return pending.loaded[saga_id]
        try:
            state = self._states.take(saga_id)
        except ValueError as exc:
            log.error("changelog value of saga %s is unreadable: %s", saga_id, exc)
            if record is not None:  # its tenant and generation for the incident
                pending.last_record.setdefault(saga_id, record)
            self._park(saga_id, f"its changelog value is unreadable: {exc}", now, pending)
            return pending.states[saga_id]
        if state is None:
            return self.marker_of(saga_id)
        pending.loaded[saga_id] = state
        return state

    def _keep_marker(self, saga_id: str, marker: SagaMarker) -> None:
        """Keep a saga's marker: a terminal one last (the newest ends last; one that
        only took a resolution stays where it was), a parked one apart (it never
        expires)."""
        self._parked.pop(saga_id, None)
        if marker.marker is MarkerKind.PARKED:
            self._markers.pop(saga_id, None)
            self._parked[saga_id] = marker
            return
        known = self._markers.get(saga_id)
        if known is None or known.at != marker.at:
            self._markers.pop(saga_id, None)
        # The same end (a resolution kept since): its place in the expiry order stays.
        self._markers[saga_id] = marker

    def _live(self, saga_id: str) -> SagaState | None:
        """The in-flight state of a saga (None: none, or unreadable)."""
        try:
            return self._states.take(saga_id)
        except ValueError:
            return None

    def _seek_committed(self, partitions: list[TopicPartition] | None = None) -> None:
        """Rewind ``partitions`` (default: all assigned) to the committed offsets:
        re-reading a batch re-decides it identically (memory never took the changes
        of a batch that did not commit)."""
        assignment = self._consumer.assignment() if partitions is None else partitions
        committed = self._consumer.committed(assignment, 30)
        self._behind(assignment, committed)  # what was read again is a backlog again
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    def _abort(self) -> None:
        """Abort the open transaction and start over with a fresh producer.

        After a record the broker refused, librdkafka may keep the partition's
        idempotence state stuck (the next attempt times out, the abort never
        finishes). A new producer with the same ``transactional.id`` fences the old
        one and the broker aborts whatever it left open: every retry starts clean."""
        try:
            self._producer.abort_transaction(10)
        except KafkaException as exc:
            if exc.args[0].fatal() and not self._replaceable(exc.args[0]):
                raise  # fenced by a newer instance with our transactional.id
            log.warning("abort did not finish (%s); replacing the producer", exc.args[0])
        self._began = None
        old = self._producer
        old.purge(in_queue=True, in_flight=True, blocking=False)
        self._producer = create_producer(self.bootstrap, **self._producer_config)
        for attempt in range(1, 4):
            try:
                self._producer.init_transactions(30)
                return
            except KafkaException as exc:  # the broker may still be finishing the abort
                error: KafkaError = exc.args[0]
                busy = error.retriable() or error.code() in _BUSY
                if error.fatal() or not busy or attempt == 3:
                    raise
                log.warning("init_transactions: %s; retrying", exc.args[0])

    def _begin_transaction(self) -> None:
        self._producer.begin_transaction()
        self._began = time.monotonic()

    def _replaceable(self, error: KafkaError) -> bool:
        """Whether a fatal error of the producer is its own, which a new producer
        (``_abort``: its ``init_transactions`` bumps the epoch) leaves behind, rather
        than a newer instance with our ``transactional.id``, which must end the process.

        librdkafka reports a transaction the broker aborted for its age (open longer
        than ``transaction.timeout.ms``: a slow batch, a long pause) exactly as a
        fencing (``_FENCED``); exiting for it stopped every saga until a restart. A
        transaction younger than the timeout cannot have been aborted for its age: a
        fencing then is a newer instance. Other fatal errors (INVALID_TXN_STATE, an
        idempotence failure) are the producer's alone; a new producer that cannot
        start either (e.g. no permission on the transactional id) raises from its
        ``init_transactions``. Should an older transaction have been fenced by a newer
        instance after all, the new producer fences it in turn, but it joined the
        group with the same static member id, so this instance's consumer is fenced
        (fatal on its next poll, which ends the process) and it commits nothing: its
        transactions' offsets carry the group generation it no longer holds."""
        if error.code() not in _FENCINGS:
            return True
        return self._began is not None and (
            time.monotonic() - self._began >= self._transaction_timeout_s
        )

    # -------------------------------------------------------------- rebalancing

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._moves.moved(partitions)
        self._settle()  # the changelog read below must hold our last batch
        self._group_metadata = None  # a new generation
        numbers = [p.partition for p in partitions]
        self._restoring = numbers or None
        try:
            restored = self._restore(numbers)
        finally:
            self._restoring = None
        self._assigned.update(numbers)
        self.metrics.in_flight(len(self._states))  # restored: in flight here from now
        if partitions:
            self._behind(partitions, consumer.committed(partitions, 30))
        self._joined = True  # an empty assignment too: a member with no partition serves
        if self._ready is not None:
            self._ready.set()
        log.info("assigned %s; restored %d sagas", numbers, restored)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._moves.moved(partitions)
        self._settle()  # our last batch commits (or aborts) before the partitions go
        self._group_metadata = None
        self._drop({p.partition for p in partitions})

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._moves.moved(partitions)
        self._settle()
        self._group_metadata = None
        self._drop({p.partition for p in partitions})

    def _drop(self, numbers: set[int]) -> None:
        if self._carry is not None:
            # Not committed: the next owner of these partitions re-reads its records
            # from the committed offsets, and so do we for the partitions we keep.
            self._carry = None
            kept = [tp for tp in self._consumer.assignment() if tp.partition not in numbers]
            if kept:
                self._seek_committed(kept)
        dropped = {s for s, p in self._partition_of.items() if p in numbers}
        for saga_id in dropped:
            self._states.pop(saga_id)
            self._markers.pop(saga_id, None)
            self._parked.pop(saga_id, None)
            self._partition_of.pop(saga_id, None)
            self._unhold(saga_id)
        if dropped:
            # Their timers go too: a restore schedules them again, and entries left
            # here (a day away, for an approval's expiry) piled up one per rebalance.
            self._timers = [entry for entry in self._timers if entry[1] not in dropped]
            heapq.heapify(self._timers)
        # A saga whose records failed here is decided afresh by the partition's next
        # owner: if the partition comes back, nothing failed for it any more.
        self._suspects = {s: p for s, p in self._suspects.items() if p not in numbers}
        for n in numbers:  # a restore schedules their timers again
            self._catching_up.pop(n, None)
            self._held_timers.pop(n, None)
            self._lag_release.pop(n, None)
        self._assigned -= numbers
        self._unconfirmed -= numbers
        self.metrics.in_flight(len(self._states))  # its sagas are the next owner's now

    def _restore(self, numbers: list[int]) -> int:
        """Read the compacted changelog partitions to their end (R5: state is a fold).

        A value that cannot be read parks its saga rather than failing the whole
        assignment: it is logged and kept as it is, and the saga is parked when it is
        first needed (``_current``)."""
        if not numbers:
            return 0
        group = f"{self.group_id}-restore"
        self._await_stable_changelog(numbers)
        markers: dict[str, SagaMarker] = {}
        for msg in read_to_end(self.bootstrap, self.topics.state, numbers, group):
            try:
                saga_id = (msg.key() or b"").decode()
            except UnicodeDecodeError:
                # Not this coordinator's (it keys by saga id): hand-written or
                # corrupted. No saga has that key, so none is stopped by it.
                log.error(
                    "skipped the changelog record at %s[%s]@%s: its key %r is not UTF-8, "
                    "so it is no saga's state (hand-written or corrupted); delete it "
                    "with a tombstone under that key",
                    msg.topic(),
                    msg.partition(),
                    msg.offset(),
                    msg.key(),
                )
                continue
            value = msg.value()
            self._states.pop(saga_id)
            markers.pop(saga_id, None)
            self._markers.pop(saga_id, None)
            self._parked.pop(saga_id, None)
            self._partition_of[saga_id] = msg.partition() or 0
            if value is None:
                self._partition_of.pop(saga_id, None)
                continue
            # Headers that cannot be read (a name not UTF-8) as none: the state is
            # decoded for its timer, as one written before the header existed.
            known, due_at = (
                (False, None) if is_marker(value) else _due_header(readable_headers(msg))
            )
            if known:  # a live state with its next timer: keep its bytes as they are
                self._states.put(saga_id, value, due_at)
                continue
            try:  # a marker, or a state written before the header existed
                restored = load_changelog(value)
            except ValueError as exc:
                # Kept as it is, and parked (_current) in the first batch: its timers
                # are unknown, so a saga waiting on its own timer (a retry, an
                # approval's expiry) would get no record to park it, ever.
                log.error("changelog value of saga %s is unreadable: %s", saga_id, exc)
                self._states.put(saga_id, value, _PARK_AT_ONCE)
                continue
            if isinstance(restored, SagaMarker) and restored.marker is MarkerKind.PARKED:
                self._parked[saga_id] = restored  # never expires: not in the expiry order
            elif isinstance(restored, SagaMarker):
                markers[saga_id] = restored
            else:
                self._states.put(saga_id, value, restored.next_due_at())
        # Oldest ended first, so expiry (``_expired_markers``) looks at the front only;
        # merged with the markers of partitions assigned before (a cooperative
        # rebalance adds partitions to those kept), or an old marker restored behind a
        # newer one would wait for it to expire first (up to terminal_memory_ms).
        if markers:
            merged = sorted([*self._markers.items(), *markers.items()], key=lambda kv: kv[1].at)
            self._markers = dict(merged)
        # Timers from the entries' next-due times, no state decoded; one heapify.
        for saga_id, partition in self._partition_of.items():
            due_at = self._states.due_at(saga_id)
            if partition in numbers and due_at is not None:
                self._timers.append((due_at, saga_id))
        heapq.heapify(self._timers)
        return sum(1 for p in self._partition_of.values() if p in numbers)

    def _await_stable_changelog(self, numbers: list[int]) -> None:
        """Wait until no transaction is open on the changelog partitions ``numbers``:
        their last stable offset has reached the high watermark they had when asked.

        The previous owner's last transaction holds its sagas' changelog records and
        the offsets past their records. Its commit returns once the broker prepared
        it, and the markers reach the partitions after that (a member dropped from the
        group mid-commit finishes later still). The consumer fetches committed offsets
        only once they are stable, so it resumes after those records; a restore that
        read only to the last stable offset as it was would miss their changelog
        records, and the sagas they changed would go back to an older state for good.
        Only a partition's owner writes its changelog, so the high watermark stays
        put; a transaction that is never completed is aborted by the broker. After
        ``_STABLE_WAIT_S`` the restore goes on with a warning."""
        topic = self.topics.state
        group = f"{self.group_id}-restore"
        stable = create_consumer(self.bootstrap, group)  # read_committed
        latest = create_uncommitted_reader(self.bootstrap, group)
        try:
            ends = {n: watermarks(latest, TopicPartition(topic, n))[1] for n in numbers}
            give_up = time.monotonic() + _STABLE_WAIT_S
            while True:
                ends = {
                    n: end
                    for n, end in ends.items()
                    if watermarks(stable, TopicPartition(topic, n))[1] < end
                }
                if not ends:
                    return
                if time.monotonic() >= give_up:
                    log.warning(
                        "a transaction is still open on %s partitions %s after %.0f s: "
                        "restoring what is committed so far",
                        topic,
                        sorted(ends),
                        _STABLE_WAIT_S,
                    )
                    return
                time.sleep(_STABLE_POLL_S)
        finally:
            stable.close()
            latest.close()

    # ----------------------------------------------------------------- inspection

    @property
    def in_flight(self) -> int:
        return len(self._states)

    def state_of(self, saga_id: str) -> SagaState | None:
        try:
            return self._states.get(saga_id)
        except ValueError:
            return None  # unreadable: parked when its saga is next needed

    def marker_of(self, saga_id: str) -> SagaMarker | None:
        """The terminal or parked marker of a saga, if the changelog keeps one."""
        return self._markers.get(saga_id) or self._parked.get(saga_id)

    def positions(self) -> dict[int, int]:
        """Next offset to read per assigned events partition (negative before the first
        fetch). When ``until`` is called every offset below it is processed and
        committed (``run`` asks it only when no batch is carried; while a batch commits
        in the background, this says where the last commit left the consumer), so an
        ``until`` callback can tell when a backlog is consumed. Call it from the
        thread running :meth:`run` (e.g. inside ``until``)."""
        assignment = self._consumer.assignment()
        if not assignment:
            return {}
        if self._committing is not None:  # read further than committed: say what is
            return {tp.partition: self._committed_to.get(tp.partition, -1) for tp in assignment}
        return {tp.partition: tp.offset for tp in self._consumer.position(assignment)}


class _PackedStates:
    """The in-flight sagas' states, each kept as its changelog bytes plus its next
    timer, and decoded when the saga is needed (a record or a due timer): memory
    per in-flight saga stays near the size of its changelog record, and a restore
    only stores bytes. ``get`` and ``take`` raise ``ValueError`` for bytes that do
    not decode.

    Decoding is most of what a record costs when batches are small (many sagas in
    flight, a few records each), so the decoded objects of the ``decoded`` sagas
    most recently committed are kept too (least recently used dropped first). A
    batch ``take``s its sagas' objects out, and the core changes them in place; only
    a committed batch ``put``s them back, together with the bytes they encode to.
    So the cache never holds a change that did not commit: an aborted batch's
    objects are simply gone and the saga is decoded from its bytes again."""

    __slots__ = ("_capacity", "_decoded", "_packed")

    def __init__(self, decoded: int = 0) -> None:
        self._packed: dict[str, tuple[bytes, int | None]] = {}
        self._decoded: OrderedDict[str, SagaState] = OrderedDict()
        self._capacity = decoded

    def get(self, saga_id: str) -> SagaState | None:
        """A fresh decoding of the saga's bytes (the cache is left as it is)."""
        entry = self._packed.get(saga_id)
        return None if entry is None else SagaState.from_bytes(entry[0])

    def take(self, saga_id: str) -> SagaState | None:
        """The saga's state for a batch to change in place: the cached object (no
        longer cached) or, without one, a decoding of its bytes."""
        entry = self._packed.get(saga_id)
        if entry is None:
            return None
        state = self._decoded.pop(saga_id, None)
        return state if state is not None else SagaState.from_bytes(entry[0])

    def put(
        self, saga_id: str, packed: bytes, due_at: int | None, decoded: SagaState | None = None
    ) -> None:
        """Keep ``packed`` (a live state's ``to_bytes()``) and its ``next_due_at()``;
        and ``decoded``, the state ``packed`` encodes, if given and there is room."""
        self._packed[saga_id] = (packed, due_at)
        self._decoded.pop(saga_id, None)
        if decoded is not None:
            self.give_back(saga_id, decoded)

    def give_back(self, saga_id: str, decoded: SagaState) -> None:
        """Cache ``decoded``, which must be what the saga's bytes decode to (a taken
        state that a committed batch did not change)."""
        if self._capacity <= 0 or saga_id not in self._packed:
            return
        self._decoded[saga_id] = decoded
        self._decoded.move_to_end(saga_id)
        if len(self._decoded) > self._capacity:
            self._decoded.popitem(last=False)

    def due_at(self, saga_id: str) -> int | None:
        entry = self._packed.get(saga_id)
        return None if entry is None else entry[1]

    def retime(self, saga_id: str, due_at: int | None) -> None:
        """Correct the saga's next timer (its bytes, and its cached state, stay)."""
        entry = self._packed.get(saga_id)
        if entry is not None:
            self._packed[saga_id] = (entry[0], due_at)

    def packed(self, saga_id: str) -> bytes | None:
        """The saga's changelog bytes, as kept (not decoded)."""
        entry = self._packed.get(saga_id)
        return None if entry is None else entry[0]

    def pop(self, saga_id: str) -> None:
        self._packed.pop(saga_id, None)
        self._decoded.pop(saga_id, None)

    @property
    def cached(self) -> int:
        """How many decoded states are kept."""
        return len(self._decoded)

    def __contains__(self, saga_id: object) -> bool:
        return saga_id in self._packed

    def __len__(self) -> int:
        return len(self._packed)


_DUE_HEADER = "sagaline-next-due"
# The "next timer" of a restored value that could not be decoded: due at once, so the
# first batch parks its saga.
_PARK_AT_ONCE = 0


def _due_headers(due_at: int | None) -> Headers:
    """A live state's changelog record says when its next timer fires (empty: none),
    so a restore can schedule it without decoding the state."""
    return [(_DUE_HEADER, b"" if due_at is None else str(due_at).encode())]


def _due_header(headers: Any) -> tuple[bool, int | None]:
    """(whether the changelog record says, its next timer): a record written before
    the header existed, or with a garbled one, says nothing, and its state is decoded."""
    for name, value in headers or ():
        if name == _DUE_HEADER:
            try:
                return True, int(value) if value else None
            except ValueError:
                return False, None
    return False, None


def _limit_source(limit: int, record_limit: int, topic: str) -> str:
    """Where a size limit comes from, for a log line or a parked saga's reason."""
    if limit >= record_limit:
        return "(SAGALINE_MAX_RECORD_BYTES)"
    return f"({topic}'s max.message.bytes, lowered while the coordinator runs, less framing)"


def _changelog_value(state: SagaState | SagaMarker) -> bytes:
    """A live saga's full state; an ended one's terminal marker; a parked marker."""
    if isinstance(state, SagaMarker):
        return state.to_bytes()
    return terminal_marker(state).to_bytes() if state.is_terminal else state.to_bytes()


_RECORD_FAULTS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.POLICY_VIOLATION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
    }
)
"""Errors that say "this record (or its topic) is refused", not "the broker is
unwell": only these make a saga the culprit. Timeouts, transport errors and
unavailable replicas abort and rewind the batch and park nobody."""


def _commit(producer: Producer, offsets: Future[None]) -> float:
    """Commit the open transaction once its offsets are in it (on the thread that
    sent them, after them); when it returned."""
    offsets.result()
    _commit_transaction(producer)
    return time.perf_counter()


def _commit_transaction(producer: Producer) -> None:
    """Commit the open transaction, asking again while librdkafka says it may.

    A retriable error (the call's timeout ran out) is no abort: the commit goes on in
    the background and may have committed the outputs, changelog and offsets, so
    rewinding would skip a batch memory never took. Only the call again says how it
    ended (an abortable error is raised and aborts the batch as usual)."""
    # The batch loop waits for this commit; a commit librdkafka never returns from
    # (as send_offsets_to_transaction can after a broker restart) must end the process
    # for its supervisor to restart, not stall every saga.
    with deadline("commit_transaction", 30):
        while True:
            try:
                producer.commit_transaction(30)
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.txn_requires_abort() or not error.retriable():
                    raise
                log.warning("commit_transaction: %s; asking again how it ended", error)


def _retriable(exc: KafkaException) -> bool:
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and error.retriable()


def _record_fault(exc: KafkaException) -> bool:
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and not error.fatal() and error.code() in _RECORD_FAULTS


def _headers(msg: Message) -> Headers:
    headers = msg.headers()
    return list(headers) if isinstance(headers, list) else []


def _is_own(record: Record) -> bool:
    return record.envelope.producer == COORDINATOR_PRODUCER


def _names_open_incident(state: SagaState | None, record: IncidentResolved) -> bool:
    """Whether ``record`` resolves an incident ``state`` holds open (a resolution of
    another saga's incident, an unknown one or one already resolved does not)."""
    incident = state.incident(record.incident_id) if state is not None else None
    return incident is not None and not incident.resolved


def _raised(exc: Exception) -> str:
    """What an exception from deciding or preparing a saga says in its parked reason
    (the marker, the saga-parked incident on the ledger and the incident feed).
    pydantic's own message quotes each bad field's input, a step's arguments or
    result in clear: a validation error names the fields and error types only."""
    if isinstance(exc, ValidationError):
        return f"ValidationError: {unreadable(exc)}"
    return f"{type(exc).__name__}: {exc}"


def _log_raised(exc: Exception, message: str, *args: object) -> None:
    """Log a saga's failure with its traceback, except for a validation error, whose
    message quotes the values it refused: its fields and error types only."""
    if isinstance(exc, ValidationError):
        log.error(message + ": %s", *args, _raised(exc))
    else:
        log.exception(message, *args)
