"""The dashboard's Kafka side: follow the three topics from their beginning, forever.

No consumer group state is kept: partitions are assigned manually from offset 0 on
every start, so a restarted dashboard rebuilds exactly the view it had (R5). New
topics and partitions (a fresh deployment, more partitions) are picked up by a
periodic metadata refresh.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from sagaline.kafka import (
    OFFSET_BEGINNING,
    ClientConfig,
    Consumer,
    KafkaException,
    TopicPartition,
    create_consumer,
    headers_of,
)
from schemas.errors import CodecError, SchemaMismatch, UnknownFingerprint
from schemas.signing import HeaderList, Signer
from schemas.topics import TopicNames
from schemas.wire import from_message
from services.dashboard.view import DashboardState

log = logging.getLogger("sagaline.dashboard")

_REFRESH_S = 1.0


class LedgerFollower:
    """Reads ``events``, ``terminal`` and ``incidents`` into a :class:`DashboardState`
    on a daemon thread. ``caught_up`` is set once everything that existed at start has
    been read (what a restart test or a readiness probe waits for)."""

    def __init__(
        self, bootstrap: str, topics: TopicNames, signer: Signer, state: DashboardState
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.signer = signer
        self.state = state
        self.caught_up = threading.Event()
        # Records skipped unread: they failed verification or decoding (the coordinator
        # DLQs them; every one of them here when the dashboard has another key than the
        # services), the unreadable ones below included. Logged once per reason.
        self.rejected = 0
        self._rejected_reasons: set[str] = set()
        # Of those, the ones written under a schema this version cannot read (a newer
        # writer, which reads them itself: nobody DLQs them), and their fingerprints.
        self.unreadable = 0
        self._unreadable_schemas: set[bytes] = set()
        # Records that verified but could not be folded into the view (a bug in the
        # fold): logged with their saga and skipped, never a reason to stop (R16).
        self.fold_errors = 0
        self.stopped_by: str | None = None  # why the thread ended, when it did by itself
        # Why the broker cannot be read right now (the last metadata refresh failed),
        # and since when (epoch ms): the pages say so rather than show the view as live.
        self.kafka_problem: str | None = None
        self.kafka_problem_since: int | None = None
        # The topics the last metadata refresh found missing (with the broker's error,
        # if any): logged on a change and named on the pages, as a wrong prefix or a
        # coordinator never started otherwise looks like an endless catch-up.
        self.missing_topics: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._assigned: set[tuple[str, int]] = set()
        self._targets: dict[tuple[str, int], int] = {}
        self._targets_fixed = False

    @property
    def topic_names(self) -> list[str]:
        return [self.topics.events, self.topics.terminal, self.topics.incidents]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dashboard-ledger", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The thread is running: the view still follows the topics."""
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> str | None:
        """None while the view follows the topics; else why it no longer does."""
        if self.alive:
            return None
        if self._thread is None:
            return "the ledger follower has not started"
        if self.stopped_by is not None:
            return f"the ledger follower stopped: {self.stopped_by}"
        return "the ledger follower stopped"

    def view_problem(self) -> tuple[str, bool] | None:
        """Why the view is not the topics' live state, for the pages (and whether it is
        an error rather than a wait): the follower stopped, the broker cannot be read,
        its topics are missing, or what existed at start is still being read. None: live."""
        stopped = self.health()
        if stopped is not None:
            return (
                f"{stopped}. This view no longer follows Kafka: it shows what was read "
                "until then. Restart the dashboard (it rebuilds the view from the topics).",
                True,
            )
        problem, since = self.kafka_problem, self.kafka_problem_since
        if problem is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime((since or 0) / 1000))
            return (
                f"{problem} (since {when}). What is shown is the view as last read, not "
                "live: anything decided since is not in it.",
                True,
            )
        missing = self.missing_topics
        if missing:
            return (
                f"Topics {', '.join(missing)} do not exist on {self.bootstrap} (or this "
                "dashboard may not read them): nothing of them is shown until they do. "
                f"Check SAGALINE_TOPIC_PREFIX ({self.topics.prefix!r}) and "
                "KAFKA_BOOTSTRAP_SERVERS, or start the coordinator, which creates them.",
                True,
            )
        if not self.caught_up.is_set():
            return (
                "The dashboard is still reading the topics from their beginning: counts and "
                "lists are incomplete until it has caught up.",
                False,
            )
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        group = f"{self.topics.prefix}sagaline-dashboard-{uuid.uuid4().hex[:12]}"
        config = ClientConfig.from_env(self.bootstrap)
        # While the broker is down librdkafka logs each reconnect (every ~50 ms, per
        # broker thread) at level 3; the follower says it once (_refresh) and the pages
        # say it. Critical lines still show; SAGALINE_KAFKA_LOG_LEVEL, when set, wins.
        quiet = {} if "log_level" in config.settings else {"log_level": 2}
        consumer = create_consumer(
            config,
            group,
            **{
                "topic.metadata.refresh.interval.ms": 5000,
                "allow.auto.create.topics": False,
                **quiet,
            },
        )
        next_refresh = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_refresh:
                    self._refresh(consumer)
                    next_refresh = time.monotonic() + _REFRESH_S
                if not self._assigned:
                    self._stop.wait(0.2)
                    continue
                messages = consumer.consume(500, 0.2)
                for msg in messages:
                    if msg.error() is not None:
                        continue
                    try:
                        headers = headers_of(msg)
                    except CodecError as exc:  # a header name not UTF-8: one record
                        self._reject(msg.topic() or "", exc)
                        continue
                    self._apply(msg.topic() or "", msg.key(), msg.value(), headers)
                self._check_caught_up(consumer)
        except Exception as exc:
            # The consumer itself broke (a record never gets here: _apply keeps those).
            # The page stays up with a view that no longer moves, so /healthz says so
            # (503, with this reason) and the orchestrator restarts the dashboard,
            # which rebuilds the view from the topics.
            self.stopped_by = f"{type(exc).__name__}: {exc}"
            log.exception("dashboard ledger follower stopped; /healthz now answers 503")
        finally:
            consumer.close()

    def _apply(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: HeaderList | None,
    ) -> None:
        if value is None:
            return  # a tombstone on a compacted topic
        try:
            record = from_message(key, value, headers, self.signer)
        except (UnknownFingerprint, SchemaMismatch) as exc:
            self._skipped_unread(topic, key)
            self.rejected += 1
            self.unreadable += 1
            schema = bytes(value[2:10])
            # Once per writer schema, for the first few (garbage names any schema).
            if schema not in self._unreadable_schemas and len(self._unreadable_schemas) < 64:
                self._unreadable_schemas.add(schema)
                log.warning(
                    "skipping records on %s written under schema %s, which this dashboard "
                    "cannot read (%s: %s): a newer version of Sagaline wrote them, and the "
                    "sagas they belong to are shown without them; upgrade the dashboard",
                    topic,
                    schema.hex(),
                    exc.reason,
                    exc,
                )
            return
        except CodecError as exc:
            self._skipped_unread(topic, key)
            self._reject(topic, exc)
            return
        except Exception as exc:  # R16: not a codec refusal, but still one record
            self._skipped_unread(topic, key)
            self.rejected += 1
            log.error(
                "skipping a record on %s (key %r) that could not be read (%s: %s)",
                topic,
                key,
                type(exc).__name__,
                exc,
                exc_info=True,
            )
            return
        try:
            self.state.apply(record, from_ledger=topic == self.topics.events)
        except Exception as exc:  # R16: one bad record never stops the dashboard
            self.fold_errors += 1
            log.error(
                "skipping %s %s of saga %s on %s: folding it failed (%s: %s); the saga's "
                "page may be incomplete (%d records skipped so far)",
                record.TYPE,
                record.event_id,
                record.saga_id,
                topic,
                type(exc).__name__,
                exc,
                self.fold_errors,
                exc_info=True,
            )

    def _skipped_unread(self, topic: str, key: bytes | None) -> None:
        """A ledger record skipped unread may be its saga's SagaStarted: the view is told
        (by the record's key, its saga id), so the saga's later records still show it
        rather than being dropped as a forgotten saga's late ones."""
        if key and topic == self.topics.events:
            self.state.skipped_unread(key.decode("utf-8", "replace"))

    def _reject(self, topic: str, exc: CodecError) -> None:
        """A record that fails verification or decoding: skipped and counted; the first
        of each reason logged at WARNING (a key other than the services' rejects them
        all, and the page would otherwise just stay empty), the others at DEBUG."""
        self.rejected += 1
        if exc.reason in self._rejected_reasons:
            log.debug("skipping a record on %s the codec rejects (%s): %s", topic, exc.reason, exc)
            return
        self._rejected_reasons.add(exc.reason)
        log.warning(
            "skipping records on %s that fail verification or decoding (%s: %s); their "
            "sagas are shown without them (counted in rejected_records in /healthz and "
            "/api/state). If every record fails, the dashboard does not have the "
            "services' key: check SAGALINE_HMAC_KEY or SAGALINE_TRUST_FILE",
            topic,
            exc.reason,
            exc,
        )

    def _refresh(self, consumer: Consumer) -> None:
        """Assign partitions we do not follow yet (from the beginning); update lag."""
        try:
            metadata = consumer.list_topics(timeout=5)
        except KafkaException as exc:
            # Once when the outage begins, not at each refresh (one a second): the
            # pages and /healthz keep saying it, with the latest error, meanwhile.
            if self.kafka_problem_since is None:
                self.kafka_problem_since = int(time.time() * 1000)
                log.warning(
                    "cannot reach Kafka at %s (%s): the pages show the view as last read "
                    "until it answers, which is logged too",
                    self.bootstrap,
                    exc,
                )
            self.kafka_problem = f"cannot read from Kafka at {self.bootstrap}: {exc}"
            return
        if self.kafka_problem_since is not None:
            lasted_s = time.time() - self.kafka_problem_since / 1000
            log.info(
                "Kafka at %s answers again after %.0f s: following the topics",
                self.bootstrap,
                lasted_s,
            )
            self.kafka_problem = self.kafka_problem_since = None
        new: list[TopicPartition] = []
        missing: list[str] = []
        for name in self.topic_names:
            topic = metadata.topics.get(name)
            if topic is None or topic.error is not None:
                missing.append(name if topic is None else f"{name} ({topic.error})")
                continue
            for number in topic.partitions:
                if (name, number) not in self._assigned:
                    new.append(TopicPartition(name, number, OFFSET_BEGINNING))
        self._say_missing(missing)
        ready: list[TopicPartition] = []
        for tp in new:
            try:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=5
                )
            except KafkaException as exc:
                # A partition whose leader is not known yet (a topic just created, a
                # broker restarting) is taken at the next refresh; the follower must
                # not stop for it (it did: the page then stayed empty for good).
                log.warning("%s[%d] not followed yet: %s", tp.topic, tp.partition, exc)
                continue
            if not self._targets_fixed:
                # Nothing left to read (retention deleted every record: low == high > 0)
                # counts as read: no position is ever reported for such a partition.
                self._targets[(tp.topic, tp.partition)] = high if high > low else 0
            ready.append(tp)
        if ready:
            consumer.incremental_assign(ready)
            self._assigned.update((tp.topic, tp.partition) for tp in ready)
        # "Caught up" waits for every partition of the start, and for every topic: one
        # created later (the dashboard started before the coordinator made them) is
        # read up to what it held when first followed before the view counts as whole.
        if not missing and len(ready) == len(new):
            self._targets_fixed = True
        self._report_lag(consumer)

    def _say_missing(self, missing: list[str]) -> None:
        """Name the topics not there (else nothing says why the view stays empty and
        /healthz 503), once per change, and when they have all appeared."""
        if missing == self.missing_topics:
            return
        if missing:
            log.warning(
                "topics %s do not exist on %s (or are not readable to this client): the "
                "dashboard shows nothing of them until they do; check SAGALINE_TOPIC_PREFIX "
                "(%r) and KAFKA_BOOTSTRAP_SERVERS, or start the coordinator, which creates them",
                ", ".join(missing),
                self.bootstrap,
                self.topics.prefix,
            )
        else:
            log.info("topics %s exist now: following them", ", ".join(self.topic_names))
        self.missing_topics = missing

    def _report_lag(self, consumer: Consumer) -> None:
        if not self._assigned:
            return
        positions = consumer.position([TopicPartition(t, p) for t, p in sorted(self._assigned)])
        for tp in positions:
            try:
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=2
                )
            except KafkaException:
                continue
            position = tp.offset if tp.offset >= 0 else 0
            self.state.metrics.set_consumer_lag(tp.topic, tp.partition, high - position)

    def _check_caught_up(self, consumer: Consumer) -> None:
        if self.caught_up.is_set() or not self._targets_fixed:
            return
        pending = {k: v for k, v in self._targets.items() if v > 0}
        if pending:
            positions = consumer.position([TopicPartition(t, p) for t, p in pending])
            for tp in positions:
                if tp.offset < pending[(tp.topic, tp.partition)]:
                    return
        self.state.mark_caught_up()  # what the terminal topic alone shows is settled
        self.caught_up.set()
        log.info("dashboard caught up: %d records applied", self.state.records_applied)
