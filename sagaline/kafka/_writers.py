"""Acknowledged writes: the ledger writer and the dead-letter writer.

"Acknowledged" means this record's own delivery report said the broker has it
(``acks=all``), not that the producer's whole queue was flushed: a writer shared by
threads waits for its record only, and a failure names the record that failed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from sagaline.kafka._clients import create_producer
from sagaline.kafka._config import ClientConfig
from sagaline.kafka._headers import readable_headers
from schemas.models import Record
from schemas.signing import Headers, Signer, header_value
from schemas.topics import TopicNames
from schemas.trust import SigningKeyError
from schemas.wire import DLQ_OMITTED, dlq_message, dlq_summary, message_size, to_message

log = logging.getLogger(__name__)


class DeliveryFailed(RuntimeError):
    """The broker did not acknowledge a record; it may or may not be in the log.

    Every Sagaline record carries a deterministic event id, so writing it again is
    safe (R15): retry, or let the command be redelivered.
    """

    def __init__(self, message: str, *, topic: str, error: KafkaError | None) -> None:
        super().__init__(message)
        self.topic = topic
        self.error = error

    @property
    def too_large(self) -> bool:
        """The broker refused the record for its size: the client took it (under its
        ``message.max.bytes``) but the topic's ``max.message.bytes`` is smaller. As
        permanent as :class:`RecordTooLarge`: sending it again is refused again, so
        a caller must give it up, not retry it for ever.

        From a :class:`LedgerWriter`, only a record refused *on its own*: a refusal
        of the record batch it went in (librdkafka does not split one the broker
        refuses, every record in it gets the size error) is no verdict on each
        record, so the writer sends each one again alone first (:class:`_Alone`)."""
        return self.error is not None and self.error.code() in _SIZE_CODES


# The broker's "too large" answers in a delivery report (MESSAGE_TOO_LARGE is also
# what librdkafka itself raises from produce(), see _refused).
_SIZE_CODES = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
# What a record still queued or in flight when LedgerWriter.close() purges it gets.
_PURGED_CODES = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})


def _rejected(err: KafkaError, topic: str, what: str) -> DeliveryFailed:
    """The :class:`DeliveryFailed` for a delivery report with ``err``; one refused for
    its size says so (and that retrying is useless)."""
    if err.code() in _PURGED_CODES:
        message = (
            f"{what} was not delivered to {topic}: its producer gave it up ({err.str()}; "
            "its writer was closed first, or the producer failed for good): it may or may "
            "not be in the log"
        )
    elif err.code() in _SIZE_CODES:
        message = (
            f"the broker refused {what} on {topic} for its size ({err.str()}): the topic's "
            "max.message.bytes is below it, so it can never be written"
        )
    else:
        message = f"the broker rejected {what} on {topic}: {err}"
    return DeliveryFailed(message, topic=topic, error=err)


class RecordTooLarge(ValueError):
    """The producer refused a record for its size (over ``message.max.bytes``): it was
    not sent, and sending it again is refused again. Not a :class:`DeliveryFailed`,
    which callers retry: whatever wrote the record must give it up (a participant
    dead-letters its command)."""

    def __init__(self, message: str, *, topic: str, size: int) -> None:
        super().__init__(message)
        self.topic = topic
        self.size = size


def _batch_refused(err: KafkaError | None) -> bool:
    """A delivery report's ``err`` is a refusal for size: of the record, or only of the
    batch it went in (the broker cannot tell which)."""
    return err is not None and err.code() in _SIZE_CODES


class _Alone:
    """Sends a record again in a record batch of its own, after the broker refused the
    batch it went in for its size.

    librdkafka batches records queued together (up to ``batch.size``, 1 MB unless set)
    and does not split a batch the broker refuses as over the topic's
    ``max.message.bytes``: every record in it gets the size error, also those that
    fit the topic alone. Here each is sent again through a producer that puts one
    record in each batch (``batch.num.messages=1``); only a refusal there means the
    record can never be written. The producer (and the thread that serves
    :meth:`deliver_then`) is made on the first such refusal: nothing on the normal
    path. Order is kept where it matters: a writer waits for a saga's record before
    its next (R10), and a refused batch wrote nothing."""

    def __init__(self, bootstrap: str | ClientConfig) -> None:
        self._bootstrap = bootstrap
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self._jobs: queue.SimpleQueue[_AloneJob | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False

    def _made(self) -> Producer:
        with self._lock:
            if self._producer is None:
                log.warning(
                    "the broker refused a record batch for its size (a topic's "
                    "max.message.bytes is below the producer's batch.size): its records "
                    "are sent again one by one; set SAGALINE_KAFKA_BATCH_SIZE to at most "
                    "the smallest max.message.bytes of the topics written to avoid it"
                )
                self._producer = create_producer(self._bootstrap, **{"batch.num.messages": 1})
            return self._producer

    def deliver(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        what: str,
        timeout_s: float,
    ) -> None:
        """:func:`deliver` of the record alone (a refusal for size is then final)."""
        deliver(
            self._made(),
            topic,
            key,
            value,
            headers,
            timeout_s=timeout_s,
            what=what,
            renew=self._renew,
        )

    def _renew(self, failed: Producer, error: KafkaError) -> Producer:
        """:meth:`LedgerWriter._renew` for this writer's own producer: one that failed
        for good is replaced, not kept for every later record to fail on."""
        with self._lock:
            if self._producer is not failed and self._producer is not None:
                return self._producer
            log.error(
                "the Kafka producer that sends records one by one failed for good (%s): a "
                "new one takes its place; the records it had not delivered are reported "
                "as not delivered",
                error,
            )
            self._producer = create_producer(self._bootstrap, **{"batch.num.messages": 1})
            fresh = self._producer
        _give_up(failed)
        return fresh

    def deliver_then(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        what: str,
        then: Callable[[DeliveryFailed | None], None],
    ) -> None:
        """:meth:`deliver` on this writer's own thread (the caller is a delivery
        callback, which must not wait); ``then`` gets its outcome there."""
        # Checked and queued under the lock: a close() in between would stop the
        # thread first, leaving this record queued behind the stop, never answered.
        with self._lock:
            if not self._closed:
                if self._worker is None:
                    self._worker = threading.Thread(
                        target=self._work, name="ledger-writer-alone", daemon=True
                    )
                    self._worker.start()
                self._jobs.put((topic, key, value, headers, what, then))
                return
        # Closed: nobody would send it; it may or may not be in the log.
        then(
            DeliveryFailed(
                f"{what} was not sent again to {topic} before its writer was closed",
                topic=topic,
                error=None,
            )
        )

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            topic, key, value, headers, what, then = job
            failure: DeliveryFailed | None = None
            try:
                self.deliver(topic, key, value, headers, what, 30.0)
            except DeliveryFailed as exc:
                failure = exc
            except Exception as exc:  # never left without an answer: it may be retried
                failure = DeliveryFailed(
                    f"{what} was not sent again to {topic}: {exc}", topic=topic, error=None
                )
            try:
                then(failure)
            except Exception:
                log.exception("a delivery callback of the ledger writer raised")

    def close(self, timeout_s: float) -> None:
        """Send what is waiting (for up to ``timeout_s``), then stop."""
        with self._lock:
            worker, producer = self._worker, self._producer
            self._closed = True
        if worker is not None:
            self._jobs.put(None)
            worker.join(timeout_s)
        if producer is not None:
            producer.flush(timeout_s)


_AloneJob = tuple[
    str, bytes | None, bytes | None, Headers | None, str, Callable[[DeliveryFailed | None], None]
]


def _refused(
    exc: BufferError | KafkaException,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None,
    what: str,
) -> Exception:
    """What a ``produce`` that raised at once raises instead (only on that path: a
    record that went out costs nothing more than the ``try``).

    A full local queue (``BufferError``: ``queue.buffering.max.messages`` or ``-kbytes``
    of records not yet acknowledged) is transient: a :class:`DeliveryFailed` to
    retry. A record over ``message.max.bytes`` is permanent: :class:`RecordTooLarge`.
    Any other error of the client is raised as it is."""
    if isinstance(exc, BufferError):
        return DeliveryFailed(
            f"{what} was not sent to {topic}: the producer's local queue is full "
            f"({exc}); try again once the queued records are acknowledged",
            topic=topic,
            error=None,
        )
    error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    if error is not None and error.code() == KafkaError.MSG_SIZE_TOO_LARGE:
        size = message_size(key, value, headers)
        return RecordTooLarge(
            f"{what} is {size} bytes (key, value and headers) on {topic}, more than the "
            f"producer's message.max.bytes allows: it can never be written ({error.str()})",
            topic=topic,
            size=size,
        )
    return exc


# Replaces a producer that failed for good (LedgerWriter._renew): the failed one and
# its error in, the one now in place out.
Renew = Callable[[Producer, KafkaError], Producer]
# How long LedgerWriter._renew waits for the reports of what the failed producer had
# in flight, before it gives those records up.
_RENEW_DRAIN_S = 10.0


def _fatal(exc: BaseException) -> KafkaError | None:
    """The error of a producer that failed for good, when ``exc`` is one: from then on
    its produce() raises _FATAL, and one poll raises the error that made it fail
    (``fatal()`` true). A flush that meets it raises a ``SystemError`` caused by it
    instead (librdkafka's flush goes on running callbacks with the error pending)."""
    if isinstance(exc, SystemError) and isinstance(exc.__cause__, KafkaException):
        exc = exc.__cause__
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(error, KafkaError) and (error.fatal() or error.code() == KafkaError._FATAL):
        return error
    return None


def _produce(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None,
    what: Callable[[], str],
    on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
    renew: Renew | None = None,
) -> Producer:
    """``producer.produce``, with a record it refuses at once raised as :func:`_refused`
    says; ``what`` names the record, built only then. A producer that failed for good
    is replaced through ``renew`` (when given) and the record produced there: returns
    the producer that took it."""
    try:
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=on_delivery)
    except (BufferError, KafkaException) as exc:
        error = _fatal(exc)
        if renew is None or error is None:
            raise _refused(exc, topic, key, value, headers, what()) from exc
        producer = renew(producer, error)
        try:
            producer.produce(topic, key=key, value=value, headers=headers, on_delivery=on_delivery)
        except (BufferError, KafkaException) as again:
            raise _refused(again, topic, key, value, headers, what()) from again
    return producer


def _named(record: Record) -> str:
    return f"{record.TYPE} {record.event_id} of saga {record.saga_id}"


def deliver(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None = None,
    *,
    timeout_s: float = 30.0,
    what: str = "record",
    polled: bool = False,
    alone: _Alone | None = None,
    renew: Renew | None = None,
) -> None:
    """Produce one record and return once the broker acknowledged it.

    ``polled=True``: another thread polls ``producer`` all the time (see
    :class:`LedgerWriter` with ``background_poll``), so this one only waits for its
    own report, woken the moment it is served.

    Raises :class:`DeliveryFailed` with the broker's error, when no delivery report
    arrived within ``timeout_s``, or when the producer's local queue is full (not
    sent; retry); :class:`RecordTooLarge` for a record over ``message.max.bytes``
    (never retry it).

    ``alone``: a refusal for size is sent again there, in a batch of its own, and only
    a refusal of it alone is final (see :class:`_Alone`). ``renew``: how a producer
    that failed for good is replaced (see :meth:`LedgerWriter._renew`).
    """
    send(
        producer,
        topic,
        key,
        value,
        headers,
        timeout_s=timeout_s,
        what=what,
        polled=polled,
        alone=alone,
        renew=renew,
    )()


def send(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None = None,
    *,
    timeout_s: float = 30.0,
    what: str = "record",
    polled: bool = False,
    alone: _Alone | None = None,
    renew: Renew | None = None,
) -> Callable[[], None]:
    """Produce one record now; the returned call waits for its acknowledgement.

    :func:`deliver` in two halves, so a caller can do its own work (a local fsync)
    while the record is on its way. The wait raises as :func:`deliver` does; the
    timeout counts from the send.
    """
    # A held lock the delivery report releases: the cheapest hand-off between the
    # polling thread and this one (an Event costs a Condition round trip per record).
    done = threading.Lock()
    done.acquire()
    failure: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failure.append(err)
        done.release()

    listed = list(headers or ())
    producer = _produce(producer, topic, key, value, listed, lambda: what, on_delivery, renew)
    deadline = time.monotonic() + timeout_s

    def wait() -> None:
        acknowledged = (
            done.acquire(timeout=max(0.0, deadline - time.monotonic())) if polled else False
        )
        # poll() serves delivery reports (ours and other threads'); stop at ours.
        while not acknowledged:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeliveryFailed(
                    f"no acknowledgement for {what} on {topic} within {timeout_s:.0f} s: is "
                    "the broker reachable (KAFKA_BOOTSTRAP_SERVERS, SAGALINE_KAFKA_* "
                    "settings)?",
                    topic=topic,
                    error=None,
                )
            try:
                producer.poll(min(remaining, 0.1))
            except (KafkaException, SystemError) as exc:
                error = _fatal(exc)
                if renew is None or error is None:
                    raise
                # Failed for good: replaced; this record's report (given up) still
                # comes from the one it went to, served by the replacement's drain.
                renew(producer, error)
            acknowledged = done.acquire(blocking=False)
        if failure:
            if alone is not None and _batch_refused(failure[0]):
                alone.deliver(topic, key, value, listed, what, timeout_s)
                return
            raise _rejected(failure[0], topic, what)

    return wait


class LedgerWriter:
    """Appends records to ``sagaline.events``, signed, each one acknowledged.

    Example::

        ledger = LedgerWriter(bootstrap, settings.topics, settings.signer())
        ledger.append(intent)        # returns once the broker has it (R10)
    """

    def __init__(
        self,
        bootstrap: str | ClientConfig,
        topics: TopicNames,
        signer: Signer,
        *,
        background_poll: bool = False,
    ) -> None:
        self.topics = topics
        self.signer = signer
        self._bootstrap = bootstrap
        self._renewing = threading.Lock()
        self.producer = create_producer(bootstrap)
        # Records of a batch the broker refused for its size go again one by one.
        self._alone = _Alone(bootstrap)
        # Many threads appending at once: one thread serves every delivery report,
        # so a writer never sits in poll() after another thread served its report.
        self._closed = threading.Event()
        # Per event loop, the delivery reports on their way to it (see _Inbox).
        self._inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = (
            weakref.WeakKeyDictionary()
        )
        self._poller: threading.Thread | None = None
        if background_poll:
            self._poller = threading.Thread(
                target=self._poll_forever, name="ledger-writer-poll", daemon=True
            )
            self._poller.start()

    def _poll_forever(self) -> None:
        while not self._closed.is_set():
            producer = self.producer
            try:
                producer.poll(0.1)
            except Exception as exc:  # a callback raised: the reports after it are still served
                error = _fatal(exc)
                if error is not None:
                    self._renew(producer, error)
                else:
                    log.exception("a delivery callback of the ledger writer raised")

    def _renew(self, failed: Producer, error: KafkaError) -> Producer:
        """Put a new producer in the place of ``failed``, which failed for good
        (librdkafka's fatal error: an idempotent producer that cannot go on, every
        produce() refused with _FATAL from then on); returns the one in place.

        Once per failed producer, whichever thread sees it first. The records it held
        are given up by librdkafka (_PURGE_QUEUE): their reports are served here, each
        a :class:`DeliveryFailed` (it may or may not be in the log), and the callers
        write them again, through the new producer. A record still in flight gets its
        broker's answer for up to :data:`_RENEW_DRAIN_S`; then it is given up too
        (_PURGE_INFLIGHT), not left without a report its caller would wait for."""
        with self._renewing:
            if self.producer is not failed:
                return self.producer
            log.error(
                "the Kafka producer of the ledger writer failed for good (%s): a new one "
                "takes its place; the records it had not delivered are reported as not "
                "delivered",
                error,
            )
            self.producer = create_producer(self._bootstrap)
            fresh = self.producer
        _give_up(failed)
        return fresh

    def _signed(self, record: Record, encoded: bytes | None = None) -> tuple[bytes, bytes, Headers]:
        """``record`` as a message. This process's key no longer signing (retired in
        the trust file with no replacement in its key file) is :class:`DeliveryFailed`:
        nothing was sent, and a retry signs with a key put in place meanwhile."""
        try:
            return to_message(record, self.signer, encoded)
        except SigningKeyError as exc:
            raise DeliveryFailed(
                f"{_named(record)} not sent: {exc}", topic=self.topics.events, error=None
            ) from None

    def append(self, record: Record, *, timeout_s: float = 30.0) -> None:
        """Write ``record`` to the ledger and wait for the broker's acknowledgement."""
        self.begin_append(record, timeout_s=timeout_s)()

    def begin_append(self, record: Record, *, timeout_s: float = 30.0) -> Callable[[], None]:
        """Write ``record`` to the ledger now; the returned call waits for the broker's
        acknowledgement (raising :class:`DeliveryFailed` as :meth:`append` does)."""
        key, value, headers = self._signed(record)
        return send(
            self.producer,
            self.topics.events,
            key,
            value,
            headers,
            timeout_s=timeout_s,
            what=_named(record),
            polled=self._poller is not None,
            alone=self._alone,
            renew=self._renew,
        )

    def append_then(
        self, record: Record, on_delivered: Callable[[DeliveryFailed | None], None]
    ) -> None:
        """Write ``record`` without waiting: ``on_delivered`` gets ``None`` once the broker
        acknowledged it, or the :class:`DeliveryFailed` that says why not.

        It runs on the background poller's thread (``background_poll=True`` is
        needed), so it must be quick and should not raise (one that does is logged and
        the poller goes on with the other reports): a caller that has nothing to do
        until the acknowledgement saves a thread switch by letting the poller carry
        on for it instead of being woken.

        A record the producer does not even take raises here, not through
        ``on_delivered``: :class:`DeliveryFailed` for a full local queue (retry),
        :class:`RecordTooLarge` for one over ``message.max.bytes`` (never retry).
        """
        if self._poller is None:
            raise RuntimeError("append_then needs LedgerWriter(..., background_poll=True)")
        self.send_then(record, on_delivered)

    def send_then(
        self,
        record: Record,
        on_delivered: Callable[[DeliveryFailed | None], None],
        encoded: bytes | None = None,
    ) -> None:
        """:meth:`append_then` for an owner that polls the producer itself (a loop
        that serves its own delivery reports): ``on_delivered`` runs on whichever
        thread polls, so it must be quick and must not raise. ``encoded``: the
        record's bytes when the caller has them already (a journalled outcome)."""
        topic = self.topics.events
        key, value, headers = self._signed(record, encoded)

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if _batch_refused(err):  # maybe only its batch: sent again alone
                self._alone.deliver_then(topic, key, value, headers, _named(record), on_delivered)
                return
            on_delivered(None if err is None else _rejected(err, topic, _named(record)))

        _produce(
            self.producer,
            topic,
            key,
            value,
            headers,
            lambda: _named(record),
            on_delivery,
            self._renew,
        )

    async def append_async(self, record: Record, *, timeout_s: float = 30.0) -> None:
        """:meth:`append` for asyncio: the caller awaits a future that this record's
        delivery report resolves (served by the background poller; no thread waits)."""
        if self._poller is None:
            raise RuntimeError("append_async needs LedgerWriter(..., background_poll=True)")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[KafkaError | None] = loop.create_future()
        inbox = self._inboxes.get(loop)
        if inbox is None:
            inbox = self._inboxes[loop] = _Inbox(loop)

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            inbox.put(future, err)

        key, value, headers = self._signed(record)
        what = _named(record)
        _produce(
            self.producer,
            self.topics.events,
            key,
            value,
            headers,
            lambda: what,
            on_delivery,
            self._renew,
        )
        try:
            err = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise DeliveryFailed(
                f"no acknowledgement for {what} on {self.topics.events} within "
                f"{timeout_s:.0f} s: is the broker reachable?",
                topic=self.topics.events,
                error=None,
            ) from None
        if _batch_refused(err):  # maybe only its batch: sent again alone
            await asyncio.to_thread(
                self._alone.deliver, self.topics.events, key, value, headers, what, timeout_s
            )
        elif err is not None:
            raise _rejected(err, self.topics.events, what)

    def write(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None = None,
        *,
        timeout_s: float = 30.0,
    ) -> None:
        """Write already-framed bytes to any topic, acknowledged (catalogue, DLQ)."""
        deliver(
            self.producer,
            topic,
            key,
            value,
            headers,
            timeout_s=timeout_s,
            polled=self._poller is not None,
            alone=self._alone,
            renew=self._renew,
        )

    def dead_letters(self, topic: str) -> DeadLetterWriter:
        """A :class:`DeadLetterWriter` to ``topic`` through this writer's producer, each
        copy acknowledged; a copy refused for its size with others in its batch is
        sent again alone, as this writer's records are, before it is summarised."""
        return DeadLetterWriter(
            self.producer,
            topic,
            acknowledged=True,
            polled=self._poller is not None,
            alone=self._alone,
            owner=self,
        )

    def close(self, timeout_s: float = 10.0) -> int:
        """Deliver whatever is still queued (nothing, after acknowledged writes), for up
        to ``timeout_s``; returns how many records were still undelivered then.

        Those are given up, not dropped in silence: before this returns, each one's
        delivery callback (:meth:`send_then`, :meth:`append_then`, a
        :meth:`begin_append` wait) gets a :class:`DeliveryFailed` saying its writer was
        closed first (it may or may not be in the log), and a warning says how many."""
        producer = self.producer
        try:
            # A fatal error met here, not inside flush(), which would run the
            # records' callbacks with it pending (they break, unreported).
            producer.poll(0)
            left = producer.flush(timeout_s)
        except (KafkaException, SystemError) as exc:
            error = _fatal(exc)
            if error is None:
                raise
            self._renew(producer, error)  # serves what the failed one held
            left = self.producer.flush(timeout_s)
        if left:
            log.warning(
                "ledger writer closed with %d record(s) not acknowledged within %.0f s: "
                "each is reported as not delivered",
                left,
                timeout_s,
            )
            self.producer.purge(in_queue=True, in_flight=True, blocking=True)
            self.producer.flush(timeout_s)  # serves the purged records' reports
        self._alone.close(timeout_s)
        self._closed.set()
        if self._poller is not None:
            self._poller.join(timeout_s)
        return left


def _give_up(failed: Producer) -> None:
    """Serve the reports of what a producer that failed for good held: its answers for
    up to :data:`_RENEW_DRAIN_S`, then what is still in flight is given up."""
    _drain(failed, _RENEW_DRAIN_S)
    if len(failed):  # in flight to a broker that does not answer: given up
        failed.purge(in_queue=True, in_flight=True, blocking=True)
        _drain(failed, 1.0)


def _drain(failed: Producer, timeout_s: float) -> None:
    """Serve the delivery reports of a producer that failed for good, for up to
    ``timeout_s`` or until it holds no record."""
    deadline = time.monotonic() + timeout_s
    while len(failed) and time.monotonic() < deadline:
        try:  # poll, not flush: librdkafka's flush runs callbacks after an error
            failed.poll(0.1)
        except Exception:  # the fatal error again, raised once: served
            continue


class _Inbox:
    """Delivery reports for one event loop, handed over with one wake-up per burst.

    ``call_soon_threadsafe`` per report writes to the loop's self-pipe and wakes its
    thread each time; under load the poller serves many reports at once, so the
    first one schedules a drain and the rest join it until the drain runs. It holds
    its loop weakly: the writer keeps inboxes in a ``WeakKeyDictionary`` by loop, and a
    strong reference from the value would keep every loop ever used alive."""

    __slots__ = ("_items", "_lock", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Future[KafkaError | None], KafkaError | None]] = []
        self._scheduled = False

    def put(self, future: asyncio.Future[KafkaError | None], err: KafkaError | None) -> None:
        with self._lock:
            self._items.append((future, err))
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed or gone: nobody awaits these any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for future, err in items:
            _settle(future, err)


def _settle(future: asyncio.Future[KafkaError | None], err: KafkaError | None) -> None:
    if not future.done():
        future.set_result(err)


class DeadLetterWriter:
    """Copies a rejected message to the DLQ with why and where from (R16).

    ``acknowledged=True`` waits for the broker per record (a participant commits the
    command's offset right after); ``False`` only produces, for a transactional
    producer whose commit is the acknowledgement (the coordinator's batch).
    ``polled=True``: another thread polls ``producer`` (a :class:`LedgerWriter` with
    ``background_poll``), so a write waits for its own report instead of sitting in
    ``poll()`` after that thread served it. ``alone`` (from
    :meth:`LedgerWriter.dead_letters`): a copy the broker refused with its batch for
    the batch's size is sent again alone before it counts as too large.
    """

    def __init__(
        self,
        producer: Producer,
        topic: str,
        *,
        acknowledged: bool,
        polled: bool = False,
        alone: _Alone | None = None,
        owner: LedgerWriter | None = None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.acknowledged = acknowledged
        self.polled = polled
        self._alone = alone
        # From LedgerWriter.dead_letters: its producer, the one in place now.
        self._owner = owner

    def write(self, msg: Message, reason: str, detail: str) -> None:
        """Dead-letter ``msg`` byte-for-byte, with ``reason`` and ``detail`` headers.

        A copy too large to write (the headers it adds take a record near the size
        limit over it, or the DLQ topic's ``max.message.bytes`` is smaller) is
        written as :func:`~schemas.wire.dlq_summary` instead (no value; its size,
        digest, key and where from), and the operator is told in an error log line:
        the command's offset then moves on, but not past a record nobody can find.
        Raises :class:`DeliveryFailed` (retry) when even that copy was not
        acknowledged."""
        where = (msg.key(), msg.value(), readable_headers(msg))
        position = (msg.topic(), msg.partition(), msg.offset())
        try:
            self._write(*dlq_message(*where, reason, detail, *position), reason)
        except (RecordTooLarge, DeliveryFailed) as exc:
            if isinstance(exc, DeliveryFailed) and not exc.too_large:
                raise  # not acknowledged: the caller writes it again
            key, value, headers = dlq_summary(*where, reason, detail, *position)
            log.error(
                "the DLQ copy of %s[%s]@%s (%s) is too large to write whole (%s); writing "
                "one without its value instead: %s",
                *position,
                reason,
                exc,
                (header_value(headers, DLQ_OMITTED) or b"").decode(),
            )
            self._write(key, value, headers, reason)

    def _write(self, key: bytes | None, value: bytes | None, headers: Headers, reason: str) -> None:
        if self.acknowledged:
            owner = self._owner
            deliver(
                self.producer if owner is None else owner.producer,
                self.topic,
                key,
                value,
                headers,
                what=f"DLQ copy ({reason})",
                polled=self.polled,
                alone=self._alone,
                renew=None if owner is None else owner._renew,
            )
        else:
            _produce(self.producer, self.topic, key, value, headers, lambda: f"DLQ copy ({reason})")
