"""The agent-side saga client: start a saga, call tools, end it.

Example (``sagaline.connect()`` builds the client from the environment; by hand it is
``SagaClient(settings, bootstrap).start()``)::

    with sagaline.connect() as client, client.saga("refund", "agent:atlas") as saga:
        hold = saga.call("place_hold", order_id="o-1", sku="sku-9", quantity=1)
        saga.call("issue_credit", order_id="o-1", amount_cents=4000)
    # left normally: completion requested; left by an exception: abort requested,
    # which makes the coordinator compensate what committed.

A call is never run by the client itself: it appends ``StepScheduled`` (with the
tool's contract from the catalogue), the coordinator dispatches ``ExecuteStep`` to
the participant, and the client waits for the outcome on ``sagaline.events``. Local
tools (a catalogue passed as ``local=``) are served by an embedded participant
runtime, so they take exactly the same path and are compensated the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import difflib
import itertools
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import orjson

from participants.catalogue import Catalogue, ToolSpec
from participants.errors import ContractChanged
from participants.published import SEPARATOR, fold, named_participant
from participants.readiness import (
    CoordinatorNotRunning,
    GroupStatus,
    coordinator_group,
    group_status,
    no_coordinator_message,
    participant_group,
    require_coordinator,
)
from sagaline.kafka import (
    DeliveryFailed,
    KafkaError,
    KafkaException,
    LedgerReader,
    LedgerWriter,
    TopicPartition,
    create_consumer,
    headers_of,
)
from schemas import (
    ApprovalDenied,
    ApprovalPurpose,
    ApprovalRequested,
    CompensationRequested,
    IncidentRaised,
    ReconcileResult,
    Record,
    SagaEndRequested,
    SagaOutcome,
    SagaStarted,
    SagaTerminal,
    StepCommitted,
    StepContract,
    StepFailed,
    StepOutcomeUnknown,
    StepReconciled,
    StepScheduled,
    args_fingerprint,
    canonical_json,
    envelope_for,
)
from schemas.codec import record_type
from schemas.errors import CodecError, SchemaMismatch, UnknownFingerprint
from schemas.keys import step_id_problem
from schemas.limits import (
    PARKED_INCIDENT,
    RESULT_OMITTED,
    RESULT_TOO_LARGE,
    is_omitted_result,
)
from schemas.models import FailureKind
from schemas.receipt import Receipt
from schemas.redaction import scrub
from schemas.settings import Settings
from schemas.trust import IdentitySigner, Role, TrustFileError
from schemas.wire import from_message

log = logging.getLogger("sagaline.client")

R = TypeVar("R", bound=Record)
_COORDINATOR = "sagaline-coordinator"
"""``envelope.producer`` of the coordinator's records (``coordinator.COORDINATOR_PRODUCER``,
which this layer may not import): an ``ApprovalDenied`` it writes withdraws a request."""


# ---------------------------------------------------------------------- errors


class SagaCallError(Exception):
    """Base of what a tool call can end in, other than a result."""

    def __init__(self, message: str, *, saga_id: str, step_id: str, tool: str) -> None:
        super().__init__(message)
        self.saga_id = saga_id
        self.step_id = step_id
        self.tool = tool


class BusinessRejected(SagaCallError):
    """The provider said no for a business reason; not retried (R9)."""


class StepFailedError(SagaCallError):
    """Transient failures used up the tool's retry policy."""


class OutcomeUnknown(SagaCallError):
    """The call timed out and reconciliation has not settled it yet (R11)."""


class ApprovalPending(SagaCallError):
    """An IRREVERSIBLE step waits for a person's approval (R7)."""

    def __init__(
        self, message: str, *, saga_id: str, step_id: str, tool: str, approval_id: str
    ) -> None:
        super().__init__(message, saga_id=saga_id, step_id=step_id, tool=tool)
        self.approval_id = approval_id


class ApprovalDeniedError(SagaCallError):
    """A person denied the approval: a business rejection (R7)."""


class StepEscalated(SagaCallError):
    """The step was handed to a person by an incident."""


class SagaUnwinding(SagaCallError):
    """The saga is compensating or already terminal: no further steps run."""


class ResultTooLarge(StepEscalated):
    """The tool ran and committed, but its result was over the declared limit: the
    ledger holds a marker (size, fingerprint) instead, and an incident names it.
    The effect exists and is compensated like any other if the saga unwinds."""


class SagaParked(StepEscalated):
    """The coordinator parked the saga (its state or records could not be decided or
    written): nothing more runs for it; an incident says why and who looks."""


class CallRefused(SagaCallError, ValueError):
    """The call was refused before anything was written (nothing ran, nothing to
    undo). ``limit`` names the limit or rule, ``size`` what the call had."""

    def __init__(
        self, message: str, *, saga_id: str, step_id: str, tool: str, limit: str, size: int
    ) -> None:
        super().__init__(message, saga_id=saga_id, step_id=step_id, tool=tool)
        self.limit = limit
        self.size = size


class InvalidSagaId(ValueError):
    """A saga id that cannot key a saga (empty or blank, or the id of a saga this
    client already started or saw end), or, to attach(), names no saga on the ledger;
    refused, never replaced."""


class ClientStopped(RuntimeError):
    """The client was never started (no ``start()``), was closed, or its listener
    stopped following the ledger (a fatal error, Read refused): a start or call is
    refused before anything is written, since no outcome could reach it. Nothing was
    done; start the client, or use a new one."""


class SagaHistoryUnreadable(RuntimeError):
    """attach() found records of the saga on the ledger that this client cannot read
    (written under a schema it does not know, by a newer version of Sagaline): it
    cannot tell which steps the saga has, so it refuses, writing nothing; upgrade
    this client. ``unreadable`` lists the records (position and schema)."""

    def __init__(self, message: str, *, saga_id: str, unreadable: list[str]) -> None:
        super().__init__(message)
        self.saga_id = saga_id
        self.unreadable = unreadable


class UnknownTool(LookupError):
    """No local or published catalogue declares the tool."""


class AmbiguousTool(UnknownTool):
    """Two or more participants declare the tool name, so a call by name cannot say
    which one runs it (``participants`` lists them): nothing is scheduled."""

    def __init__(self, message: str, *, tool: str, participants: list[str]) -> None:
        super().__init__(message)
        self.tool = tool
        self.participants = participants


def _ambiguous(tool: str, participants: list[str], verb: str) -> AmbiguousTool:
    names = ", ".join(repr(p) for p in participants)
    return AmbiguousTool(
        f"tool {tool!r} is declared by {len(participants)} participants ({names}): a call "
        "by name would reach only one of them, so it is not scheduled. Rename one with "
        f"@tool(name=...), or withdraw it from the participant that should not "
        f"{verb} (restart that participant without the tool)",
        tool=tool,
        participants=participants,
    )


_KNOWN_NAMED = 20  # the most known tool names an UnknownTool lists


def _unknown(tool: str, known: Iterable[str], catalogue_topic: str) -> UnknownTool:
    """What an agent's call of a tool nobody declares is refused with: the names it
    may have meant, and the two ways to make a tool known (served here, or elsewhere)."""
    names = sorted(set(known))
    close = difflib.get_close_matches(tool, names, n=3)
    if close:
        found = f"; did you mean {' or '.join(repr(n) for n in close)}?"
    elif names:
        listed = ", ".join(repr(n) for n in names[:_KNOWN_NAMED])
        more = f" and {len(names) - _KNOWN_NAMED} more" if len(names) > _KNOWN_NAMED else ""
        found = f" (known tools: {listed}{more})."
    else:
        found = f" (none is known: no catalogue is published on {catalogue_topic!r})."
    return UnknownTool(
        f"no participant declares a tool named {tool!r}{found} Serve it from this process"
        f" with sagaline.connect({tool}, ...), or start the participant that declares it"
        " (sagaline participant run NAME --catalogue MODULE:FACTORY)."
    )


# -------------------------------------------------------------------- listener

# The record types some wait of this module looks at (approval_request, _step_check,
# wait). The listener skips the others (a saga's intents, its own scheduled steps,
# compensation progress: 10 of a 16-record saga) before verifying or decoding them;
# a new check on another type must add it here.
AWAITED: frozenset[type[Record]] = frozenset(
    {
        ApprovalDenied,
        ApprovalRequested,
        CompensationRequested,
        IncidentRaised,
        SagaTerminal,
        StepCommitted,
        StepFailed,
        StepOutcomeUnknown,
        StepReconciled,
    }
)


class _SagaFeed:
    """One followed saga: its records so far and who waits for the next one.

    ``held``: the agent left the saga open on ``ApprovalPending`` (R7) and may still
    ``resume()`` a step, so its records outlive its terminal record until it is ended
    or waited for; ``terminal``: that record, once it arrived."""

    __slots__ = ("cond", "futures", "held", "inserted", "records", "terminal", "unreadable")

    def __init__(self) -> None:
        self.records: list[Record] = []
        # How many times earlier records were put before these (attach()'s backfill):
        # a wait in progress, which counts what it read by position, reads again.
        self.inserted = 0
        self.cond = threading.Condition()
        self.futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.held = False
        self.terminal: SagaTerminal | None = None
        # The first record of the saga this client could not read for its schema (a
        # newer writer): it may be what a wait is waiting for, so a wait says so.
        self.unreadable: str | None = None


LISTENER_ERROR_LOG_INTERVAL_S = 60.0
"""How often the client's listener logs a consumer error it rides out (per error)."""

_LISTENER_REFUSED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED})
"""Consumer errors that do not pass: the ledger cannot be read by this client, so no
outcome will reach it (as a fatal error). The listener stops, naming it."""


CATALOGUE_MAX_AGE_S = 30.0
"""How old a client's copy of the published catalogue may be when it schedules a
step from it (``SagaClient.contract``): a redeclared tool reaches agents within it."""

ENDED_SAGAS_KEPT = 4096
"""How many recently ended sagas a client keeps the terminal record of, so that a
``wait()`` after the block still returns the receipt: far more than end between a
block and its wait(), and small (a 3-step saga's record is about 4 KB: 16 MB)."""


class _Ledger:
    """Records of the sagas this client follows, fed by one background consumer.

    Each record wakes only the waiters of its own saga (a thread on the saga's
    condition, or an asyncio future), so a thousand sagas in flight cost a thousand
    wake-ups per thousand records, not a million.

    A saga is let go as soon as its ``SagaTerminal`` arrives, whether or not anyone
    waits for it (an agent need not call ``wait()``): its records go, and only that
    record stays, in a table of the ``ended_kept`` most recently ended sagas. A held
    saga (:meth:`hold`) keeps its records past its end, for the ``ended_kept`` most
    recently ended held sagas. Waiters
    in progress hold the feed itself, which already has the terminal record; every
    wait ends at it, so nothing after it is needed.
    """

    def __init__(self, ended_kept: int = ENDED_SAGAS_KEPT) -> None:
        self._feeds: dict[str, _SagaFeed] = {}
        self._ended: OrderedDict[str, SagaTerminal] = OrderedDict()
        self.ended_kept = ended_kept
        # Sagas whose start was not acknowledged, oldest first (see unconfirmed()).
        self._unconfirmed: OrderedDict[str, None] = OrderedDict()
        # Held sagas (see hold()) that ended, oldest end first: their feeds are kept
        # for resume() for the ``ended_kept`` most recent only.
        self._held_ended: OrderedDict[str, None] = OrderedDict()
        # Guards moving a saga from _feeds to _ended against follow() recreating it.
        self._lock = threading.Lock()
        # Why no record will come any more (the listener stopped): every wait ends.
        self.failure: BaseException | None = None

    def fail(self, failure: BaseException) -> None:
        """No record will be added any more: wake every waiter, now and later, so that
        it ends (its caller says why, from :attr:`failure`) instead of timing out."""
        self.failure = failure
        with self._lock:
            feeds = list(self._feeds.values())
        woken: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        for feed in feeds:
            with feed.cond:
                feed.cond.notify_all()
                woken += feed.futures
                feed.futures = []
        for loop, future in woken:
            with contextlib.suppress(RuntimeError):  # a loop closed since: nobody waits
                loop.call_soon_threadsafe(_wake, [future])

    def follow(self, saga_id: str) -> None:
        """Follow a saga; one that ended recently is not followed again (its terminal
        record answers every wait, and no record of it would come)."""
        with self._lock:
            if saga_id not in self._ended:
                self._feeds.setdefault(saga_id, _SagaFeed())

    def follow_new(self, saga_id: str) -> bool:
        """Follow a saga about to be started; False (nothing changed) when this client
        already follows it or saw it end recently: its id is taken."""
        with self._lock:
            if saga_id in self._ended or saga_id in self._feeds:
                return False
            self._feeds[saga_id] = _SagaFeed()
            return True

    def unconfirmed(self, saga_id: str) -> None:
        """The saga's start was not acknowledged. It may still land (an abort is queued
        behind it, and its terminal record lets the saga go as ever), or never: then no
        record of it ever comes, and it would be followed for as long as the client
        lives. Only the ``ended_kept`` most recent such sagas are followed; the oldest
        is let go (a wait on it says it is not followed)."""
        with self._lock:
            if saga_id not in self._feeds:
                return
            self._unconfirmed[saga_id] = None
            while len(self._unconfirmed) > self.ended_kept:
                oldest, _ = self._unconfirmed.popitem(last=False)
                self._feeds.pop(oldest, None)

    def unfollow_unused(self, saga_id: str) -> None:
        """Stop following a saga nothing was read or awaited for (attach() of an id
        with no saga): a feed in use stays."""
        with self._lock:
            feed = self._feeds.get(saga_id)
            if feed is not None and not feed.records and not feed.futures:
                del self._feeds[saga_id]

    def follows(self, saga_id: str) -> bool:
        return saga_id in self._feeds

    def end_of(self, saga_id: str) -> tuple[bool, SagaTerminal | None]:
        """Whether the saga is followed or recently ended, and its terminal record if
        it arrived (one dict look-up for a saga in flight)."""
        feed = self._feeds.get(saga_id)
        if feed is not None:
            return True, feed.terminal
        with self._lock:  # _let_go keeps the record before it drops the feed
            terminal = self._ended.get(saga_id)
        return terminal is not None, terminal

    def knows(self, saga_id: str) -> bool:
        """Whether the saga is followed or among the recently ended ones."""
        with self._lock:
            return saga_id in self._feeds or saga_id in self._ended

    def hold(self, saga_id: str) -> None:
        """Keep the saga's records past its terminal record, until :meth:`release`."""
        with self._lock:
            feed = self._feeds.get(saga_id)
            if feed is not None:
                feed.held = True

    def release(self, saga_id: str) -> None:
        """Undo :meth:`hold`; a saga already terminal is let go now."""
        with self._lock:
            feed = self._feeds.get(saga_id)
            if feed is None:
                return
            feed.held = False
            if feed.terminal is not None:
                self._let_go(saga_id, feed.terminal)

    def _terminal_arrived(self, saga_id: str, feed: _SagaFeed, terminal: SagaTerminal) -> None:
        with self._lock:
            if feed.terminal is None:
                feed.terminal = terminal
            if not feed.held:
                self._let_go(saga_id, feed.terminal)
            else:
                self._ended_held(saga_id, feed.terminal)

    def _ended_held(self, saga_id: str, terminal: SagaTerminal) -> None:
        """(Under the lock.) A held saga ended: its records stay for resume() until it
        is released, but only for the ``ended_kept`` most recently ended held sagas
        (an agent may never come back to one: its approval expired, an operator
        aborted it, it was attached to read its results); an older one is let go,
        its terminal record kept as for any saga that ended."""
        self._remember_end(saga_id, terminal)
        self._held_ended[saga_id] = None
        while len(self._held_ended) > self.ended_kept:
            oldest, _ = self._held_ended.popitem(last=False)
            self._feeds.pop(oldest, None)

    def _remember_end(self, saga_id: str, terminal: SagaTerminal) -> None:
        """(Under the lock.) Keep the terminal record among the most recent ones."""
        self._ended[saga_id] = terminal
        while len(self._ended) > self.ended_kept:
            self._ended.popitem(last=False)

    def _let_go(self, saga_id: str, terminal: SagaTerminal) -> None:
        """(Under the lock.) Keep the terminal record, drop the feed: in this order, so
        a wait that finds no feed finds the record."""
        self._remember_end(saga_id, terminal)
        self._feeds.pop(saga_id, None)
        self._unconfirmed.pop(saga_id, None)  # its start did land
        self._held_ended.pop(saga_id, None)

    def records(self, saga_id: str) -> list[Record]:
        """The records of ``saga_id`` this client holds (empty when it holds none)."""
        feed = self._feeds.get(saga_id)
        if feed is None:
            return []
        with feed.cond:
            return list(feed.records)

    def _after_end(self, saga_id: str, check: Callable[[Record], Any]) -> Any:
        """A wait on a saga with no feed: answered by its terminal record, if kept."""
        with self._lock:
            terminal = self._ended.get(saga_id)
        return None if terminal is None else check(terminal)

    def backfill(self, saga_id: str, history: list[Record]) -> None:
        """Put a followed saga's records read from the ledger (in log order) before
        the ones the listener added since it was followed, each once."""
        feed = self._feeds.get(saga_id)
        if feed is None:
            return
        with feed.cond:
            have = {r.event_id for r in feed.records}
            earlier = [r for r in history if type(r) in AWAITED and r.event_id not in have]
            if earlier:
                feed.records[:0] = earlier
                feed.inserted += 1
            feed.cond.notify_all()
            futures, feed.futures = feed.futures, []
        for record in earlier:
            if type(record) is SagaTerminal:
                self._terminal_arrived(saga_id, feed, record)
        for loop, future in futures:
            with contextlib.suppress(RuntimeError):  # a loop closed since: nobody waits
                loop.call_soon_threadsafe(_wake, [future])

    def unreadable(self, saga_id: str, where: str, error: CodecError) -> None:
        """A record of a followed saga at ``where`` was written under a schema this
        client cannot read (``error``): noted once per saga, for its waits to say."""
        feed = self._feeds.get(saga_id)
        if feed is None or feed.unreadable is not None:
            return
        feed.unreadable = (
            f"this client could not read a record of saga {saga_id} at {where} "
            f"({error.reason}: {error}); it may be the one waited for, written by a "
            "newer version of Sagaline: upgrade this client"
        )
        log.warning("%s", feed.unreadable)

    def unreadable_note(self, saga_id: str) -> str:
        """``"; <why>"`` when a record of the saga could not be read here, else ``""``."""
        feed = self._feeds.get(saga_id)
        return "" if feed is None or feed.unreadable is None else f"; {feed.unreadable}"

    def add(self, records: Iterable[Record]) -> None:
        """Hand each record to its saga's waiters; asyncio waiters are woken once per
        call and event loop (one wake-up of the loop for a whole batch)."""
        woken: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for record in records:
            feed = self._feeds.get(record.saga_id)
            if feed is None:
                continue
            with feed.cond:
                feed.records.append(record)
                feed.cond.notify_all()
                futures, feed.futures = feed.futures, []
            if type(record) is SagaTerminal:  # once per saga: the lock is no cost
                self._terminal_arrived(record.saga_id, feed, record)
            for loop, future in futures:
                woken.setdefault(loop, []).append(future)
        for loop, batch in woken.items():
            try:
                loop.call_soon_threadsafe(_wake, batch)
            except RuntimeError:  # the loop has closed since: nobody is left to wake
                continue

    def wait_for(self, saga_id: str, check: Callable[[Record], Any], timeout_s: float) -> Any:
        """Scan the saga's records (old and new) until ``check`` returns non-None."""
        feed = self._feeds.get(saga_id)
        if feed is None:
            return self._after_end(saga_id, check)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with feed.cond:
            inserted = feed.inserted
            while True:
                if feed.inserted != inserted:  # records were put before those read
                    seen, inserted = 0, feed.inserted
                for record in feed.records[seen:]:
                    found = check(record)
                    if found is not None:
                        return found
                seen = len(feed.records)
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None:
                    return None
                feed.cond.wait(left)

    async def wait_for_async(
        self, saga_id: str, check: Callable[[Record], Any], timeout_s: float
    ) -> Any:
        """:meth:`wait_for` for asyncio: the waiter is a future, not a thread."""
        feed = self._feeds.get(saga_id)
        if feed is None:
            return self._after_end(saga_id, check)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        seen = 0
        inserted = feed.inserted
        while True:
            with feed.cond:
                if feed.inserted != inserted:  # records were put before those read
                    seen, inserted = 0, feed.inserted
                records = feed.records[seen:]
                seen = len(feed.records)
                future: asyncio.Future[None] | None = None
                found = None
                for record in records:
                    found = check(record)
                    if found is not None:
                        break
                left = deadline - loop.time()
                if found is None and self.failure is None and left > 0:
                    future = loop.create_future()
                    feed.futures.append((loop, future))
            if found is not None or future is None:
                return found
            try:
                await asyncio.wait_for(future, left)
            except TimeoutError:
                # Read the feed once more, as a thread's wait does: the listener wakes a
                # batch's waiters only after adding all its records, so the one waited
                # for may be there with its wake-up still to come.
                pass
            finally:
                # A wait that gave up (timed out, cancelled) leaves no future behind for
                # the listener to wake on a loop that may have closed since.
                with feed.cond:
                    feed.futures = [w for w in feed.futures if w[1] is not future]


def _why(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {failure}"


def _wake(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


# ---------------------------------------------------------------------- client


class SagaClient:
    """One per agent process: a producer, a listener and the known tool contracts.

    ``ended_sagas_kept`` (default 4096): for how many recently ended sagas the client
    keeps the terminal record once their other records are let go, so that
    ``saga.wait()`` after the block still returns the receipt. A saga's records go as
    soon as it is terminal, waited for or not, so a long-lived agent's memory does
    not grow with the sagas it ran.
    """

    check_coordinator = True
    """Before the first saga, wait (briefly) for a coordinator to consume the ledger
    and raise ``CoordinatorNotRunning`` if none does; set False to skip."""
    _coordinator_seen = False
    coordinator_check_max_age_s = 5.0
    """How long the answer of :meth:`coordinator_status` serves later calls."""

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        *,
        producer_name: str | None = None,
        local: Catalogue | None = None,
        contracts: Mapping[str, StepContract] | None = None,
        catalogues: Iterable[Catalogue] = (),
        call_timeout_s: float = 60.0,
        ended_sagas_kept: int = ENDED_SAGAS_KEPT,
        catalogue_max_age_s: float = CATALOGUE_MAX_AGE_S,
    ) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.topics = settings.topics
        self.signer = settings.signer()
        # With an identity key the producer is the key's identity (readers insist).
        signs_as = self.signer.signs_as
        if producer_name and signs_as is not None and producer_name != signs_as:
            # Every record it wrote would be refused (forbidden-writer), and its calls
            # would wait their whole timeout for outcomes that never come.
            raise TrustFileError(
                f"producer_name {producer_name!r} is not the identity of this process's "
                f"key {self.signer.key_id!r}, {signs_as!r}: every reader would refuse its "
                f"records (forbidden-writer); leave producer_name out (it is then "
                f"{signs_as!r}) or set SAGALINE_SIGNING_KEY to the key of {producer_name!r}"
            )
        self.producer_name = producer_name or signs_as or "agent"
        self.call_timeout_s = _positive(call_timeout_s, "call_timeout_s")
        self._writer = LedgerWriter(bootstrap, self.topics, self.signer, background_poll=True)
        self._ledger = _Ledger(ended_sagas_kept)
        # Contracts given to the client (contracts=, catalogues=, local=) win over the
        # published ones: the agent pinned them, or runs the tools itself.
        self._contracts: dict[str, StepContract] = dict(contracts or {})
        self._secret_paths: dict[str, tuple[str, ...]] = {}
        self._pinned_paths: dict[str, tuple[str, ...]] = {}
        # (participant, tool) -> secret fields, of every readable published entry: a
        # contract given as such (contracts=) does not carry them.
        self._owned_paths: dict[tuple[str, str], tuple[str, ...]] = {}
        # The published catalogue as last read (refresh_catalogue): each tool's latest
        # entry; the tools whose latest entry cannot be read, with why.
        self._published: dict[str, StepContract] = {}
        self._unreadable: dict[str, str] = {}
        self._skipped: list[str] = []
        self._ambiguous: dict[str, list[str]] = {}
        self._catalogue_read_at: float | None = None
        self._catalogue_lock = threading.Lock()
        self.catalogue_max_age_s = catalogue_max_age_s
        self._coordinator_lock = threading.Lock()
        self._coordinator_check_lock = threading.Lock()
        self._coordinator_checking: concurrent.futures.Future[None] | None = None
        self._coordinator_checked: tuple[float, GroupStatus | None] | None = None
        # Each participant's consumer group as last asked (after a call without an
        # outcome): participant -> (when, status); one check under way at a time.
        self._participant_lock = threading.Lock()
        self._participants_checked: dict[str, tuple[float, GroupStatus | None]] = {}
        self.sealer = settings.sealer()
        self._local = local
        self._stop = threading.Event()
        self._closed = False
        # The writer outlives close() while a saga block started here is still open
        # (its end is still to be written) or a write through it is in flight: then
        # the last of them closes it (see _writer_released).
        self._writer_lock = threading.Lock()
        self._writer_users = 0
        self._writer_closed = False
        self._open_blocks: set[str] = set()
        self._listener: threading.Thread | None = None
        self._errors_logged: dict[int, float] = {}  # error code -> when last logged
        self._local_runtime: Any = None
        self._local_thread: threading.Thread | None = None
        given = [*catalogues, *((local,) if local is not None else ())]
        for catalogue in given:
            self._contracts.update(catalogue.contracts())
            self._pinned_paths.update({n: s.secret_paths for n, s in catalogue.items()})
        self._secret_paths = dict(self._pinned_paths)
        # A tool name two of the given catalogues declare (as the plan check's
        # AMBIGUOUS_TOOL): the client would route every call to one of them.
        owners: dict[str, set[str]] = {}
        for catalogue in given:
            for name, contract in catalogue.contracts().items():
                owners.setdefault(name, set()).add(contract.participant)
        self._pinned_ambiguous = {n: sorted(p) for n, p in owners.items() if len(p) > 1}
        if any(self._secret_paths.values()) and not self.sealer.enabled:
            log.warning(
                "tools declare secret arguments but SAGALINE_SECRET_KEY is not set: they "
                "are redacted on the ledger and the tools receive the redaction marker"
            )

    # -------------------------------------------------------------- lifecycle

    def start(self) -> SagaClient:
        """Start listening (from the current end of the ledger) and, for a local
        catalogue, the embedded participant runtime. Raises
        :class:`~sagaline.kafka.TopicMissing` when the ledger topic does not exist yet
        (``sagaline.connect()`` creates the topics; by hand, start the coordinator
        first or run ``ensure_topics``).

        A start that fails closes what the client opened (its producer, the listener,
        the local runtime), as :meth:`close` would: that client is done, and a second
        start() raises :class:`ClientStopped`; build a new one to try again."""
        if self._closed:
            raise ClientStopped(
                "the saga client was closed (or its start() failed, which closes it): "
                "it cannot be started again; use a new client"
            )
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        """:meth:`start`'s work, which closes the client when this raises."""
        positions = self._end_positions()
        ready = threading.Event()
        self._listener = threading.Thread(
            target=self._listen, args=(positions, ready), name="saga-client", daemon=True
        )
        self._listener.start()
        ready.wait(30)
        if self._ledger.failure is not None:
            raise RuntimeError(
                f"the saga client's listener did not start: {_why(self._ledger.failure)}"
            ) from self._ledger.failure
        if self._local is not None:
            from participants.runtime import ParticipantRuntime

            runtime = ParticipantRuntime(self._local, self.settings, self.bootstrap)
            up = threading.Event()
            failed: list[BaseException] = []

            def serve() -> None:
                try:
                    runtime.run(ready=up)
                except BaseException as exc:
                    log.exception("the local tools of %r stopped", runtime.participant)
                    failed.append(exc)
                finally:
                    up.set()  # started, or never will: start() need not wait any more

            self._local_runtime = runtime
            self._local_thread = threading.Thread(target=serve, name="local-tools", daemon=True)
            self._local_thread.start()
            up.wait(60)
            if failed:
                raise RuntimeError(
                    f"the local tools of {self._local.name!r} did not start: "
                    f"{_why(failed[0])}; no call of them could run"
                ) from failed[0]

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._local_runtime is not None:
            self._local_runtime.stop()
        for thread in (self._listener, self._local_thread):
            if thread is not None:
                thread.join(10)
        with self._writer_lock:
            last = self._writer_unused()
        if last:
            self._writer.close()

    def _writer_unused(self) -> bool:
        """(Under ``_writer_lock``.) Whether the writer is to be closed now: the client
        is closed, and no saga block started here is open nor any write in flight (a
        thousand sagas in flight at close() end through it, instead of each building
        a producer of its own). True once: the caller closes it."""
        if not self._closed or self._writer_closed or self._writer_users or self._open_blocks:
            return False
        self._writer_closed = True
        return True

    def _block_opened(self, saga_id: str) -> None:
        """A saga block is about to start ``saga_id``: its end is written through the
        client's writer, also after :meth:`close`."""
        with self._writer_lock:
            self._open_blocks.add(saga_id)

    def _block_left(self, saga_id: str) -> bool:
        """``saga_id``'s end was asked for (or it was left open for a person): True
        when the caller is to close the writer now."""
        with self._writer_lock:
            self._open_blocks.discard(saga_id)
            return self._writer_unused()

    def _left(self, saga_id: str) -> None:
        """:meth:`_block_left`, closing the writer when it was the last user."""
        if self._block_left(saga_id):
            self._writer.close()

    def _close_writer_soon(self) -> None:
        """Close the writer off the event loop, not awaited: also from a ``finally``
        of a task cancelled again, which could not await it."""
        asyncio.get_running_loop().run_in_executor(None, self._writer.close)

    def _writer_taken(self) -> bool:
        """Whether the client's writer takes a record (counted until
        :meth:`_writer_released`); False once it was closed."""
        with self._writer_lock:
            if self._writer_closed:
                return False
            self._writer_users += 1
            return True

    def _writer_released(self) -> bool:
        """A write through the writer ended: True when the caller is to close it now."""
        with self._writer_lock:
            self._writer_users -= 1
            return self._writer_unused()

    def __enter__(self) -> SagaClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh_catalogue(self) -> int:
        """Read the contracts participants published on ``sagaline.catalogue`` and
        take each tool's latest one; returns how many tools are published.

        The topic has one partition and is compacted by key (the tool name), but until
        compaction runs it holds every version ever published: the last record of a
        key, in offset order, is the participant's current declaration, and a
        tombstone (a null value) removes the tool. Contracts given to the client
        (``contracts=``, ``catalogues=``, ``local=``) still take precedence.
        """
        with self._catalogue_lock:
            return self._read_catalogue()

    def _read_catalogue(self) -> int:
        """(Under ``_catalogue_lock``.) :meth:`refresh_catalogue`'s read."""
        records = list(LedgerReader(self.bootstrap).records(self.topics.catalogue))
        found = fold(((key, value) for key, value, _h in records), self._unsigned(records))
        published: dict[str, StepContract] = {}
        paths: dict[str, tuple[str, ...]] = {}
        ambiguous: dict[str, list[str]] = {}
        owned: dict[tuple[str, str], tuple[str, ...]] = {}
        for name, entries in found.tools.items():
            owned.update({(p, name): e.secret_paths for p, e in entries.items()})
            if name in found.unreadable:
                continue  # one declaration of it cannot be read: refused, not guessed
            if len(entries) > 1:
                ambiguous[name] = sorted(entries)
                continue
            (entry,) = entries.values()
            published[name] = entry.contract
            paths[name] = entry.secret_paths
        skipped = sorted(k for keys in found.skipped.values() for k in keys)
        if skipped and skipped != self._skipped:  # once per change, not per read
            owners = sorted({k.partition(SEPARATOR)[0] for k in skipped if SEPARATOR in k})
            log.warning(
                "published catalogue entries this client cannot read were skipped, as their "
                "tools were published readable after them: %s; if their participants are "
                "gone, tombstone them with %s",
                "; ".join(skipped),
                ", ".join(f"`sagaline catalogue withdraw {o}`" for o in owners) or "a tombstone",
            )
        self._skipped = skipped
        self._published, self._unreadable = published, found.unreadable
        self._ambiguous = ambiguous
        self._secret_paths = {**paths, **self._pinned_paths}
        self._owned_paths = owned
        self._catalogue_read_at = time.monotonic()
        return len(published)

    def _unsigned(self, records: list[tuple[bytes | None, bytes | None, Any]]) -> dict[str, str]:
        """With identities, the catalogue keys whose current entry its participant did
        not sign (a participant can write the topic, but only its own entries count:
        none may redirect another's tool to itself), with why."""
        if not isinstance(self.signer, IdentitySigner):
            return {}
        latest: dict[str, tuple[bytes, bytes | None, Any]] = {}
        for key, value, headers in records:
            if key is not None:
                latest[key.decode("utf-8", "replace")] = (key, value, headers)
        refused: dict[str, str] = {}
        for name, (key, value, headers) in latest.items():
            if value is None:
                continue  # a withdrawal: nothing to believe
            owner, sep, _tool = name.partition(SEPARATOR)
            try:
                writer = self.signer.writer(key, value, headers)
            except CodecError as exc:
                refused[name] = f"{exc.reason}: {exc}"
                continue
            named = owner if sep else named_participant(value)
            if writer.role is not Role.PARTICIPANT or writer.name != named:
                refused[name] = (
                    f"forbidden-writer: entry of {named!r} signed by {writer.name!r} "
                    f"({writer.role.value})"
                )
        return refused

    def ensure_coordinator(self) -> None:
        """Fail fast, saying what to start, when no coordinator consumes the ledger
        (instead of every call waiting out its timeout). Checked until a coordinator
        is seen once; sagas starting while a check is under way wait for its answer."""
        if self.check_coordinator and not self._coordinator_seen:
            try:
                self._coordinator_check().result()
            except CoordinatorNotRunning as exc:  # one exception shared by every waiter
                raise CoordinatorNotRunning(str(exc)) from None

    async def ensure_coordinator_async(self) -> None:
        """:meth:`ensure_coordinator` for asyncio: awaits the one check under way (run
        on a thread of its own, not the event loop's executor, which a thousand
        sagas starting at once would queue behind each other's checks)."""
        if self.check_coordinator and not self._coordinator_seen:
            try:
                await asyncio.wrap_future(self._coordinator_check())
            except CoordinatorNotRunning as exc:
                raise CoordinatorNotRunning(str(exc)) from None

    def _coordinator_check(self) -> concurrent.futures.Future[None]:
        """The check for a coordinator under way, started if none is. Its future is
        running from the start, so one waiter cancelled cannot cancel it for the rest;
        a failed check is forgotten, so the next saga checks again."""
        with self._coordinator_check_lock:
            check = self._coordinator_checking
            if check is not None:
                return check
            check = self._coordinator_checking = concurrent.futures.Future()
            check.set_running_or_notify_cancel()

        def run() -> None:
            try:
                require_coordinator(self.settings, self.bootstrap)
            except BaseException as exc:
                with self._coordinator_check_lock:
                    self._coordinator_checking = None
                check.set_exception(exc)
            else:
                self._coordinator_seen = True
                check.set_result(None)

        threading.Thread(target=run, name="coordinator-check", daemon=True).start()
        return check

    def coordinator_status(self) -> GroupStatus | None:
        """The coordinator's consumer group as the broker reports it, or None when the
        broker cannot say (it is away). Asked after a call ended without an outcome:
        calls ending together (a thousand async calls timing out at once) share one
        check, and its answer serves for ``coordinator_check_max_age_s``, instead of
        each building an admin client of its own and waiting up to 10 s for it."""
        with self._coordinator_lock:
            checked = self._coordinator_checked
            if checked is not None and time.monotonic() - checked[0] < (
                self.coordinator_check_max_age_s
            ):
                return checked[1]
            try:
                status: GroupStatus | None = group_status(
                    self.bootstrap, coordinator_group(self.settings)
                )
            except ConnectionError:  # a broker is away: the caller says what is known
                status = None
            self._coordinator_checked = (time.monotonic(), status)
            return status

    def participant_status(self, participant: str) -> GroupStatus | None:
        """The consumer group of ``participant``'s runtime (the one serving
        ``sagaline.commands.<participant>``) as the broker reports it, or None when
        the broker cannot say. Asked, as :meth:`coordinator_status`, only after a call
        ended without an outcome, and shared the same way: one check per participant,
        whose answer serves for ``coordinator_check_max_age_s``."""
        with self._participant_lock:
            checked = self._participants_checked.get(participant)
            if checked is not None and time.monotonic() - checked[0] < (
                self.coordinator_check_max_age_s
            ):
                return checked[1]
            try:
                status: GroupStatus | None = group_status(
                    self.bootstrap, participant_group(self.settings, participant)
                )
            except ConnectionError:  # a broker is away: the caller says what is known
                status = None
            self._participants_checked[participant] = (time.monotonic(), status)
            return status

    def contract(self, tool: str) -> StepContract:
        """The contract a step of ``tool`` is scheduled with (and the coordinator
        decides from): a contract given to the client, else the published one.

        When the published catalogue is re-read: on :meth:`refresh_catalogue`; for a
        tool it does not hold; and before a step whose entry was read more than
        ``catalogue_max_age_s`` ago (default 30 s), so a redeclared contract (a new
        pivot, resources, retry policy, reversibility) reaches a long-running agent
        within that bound, at the cost of one read of a small one-partition topic
        per bound, not per call. The bound is not what keeps R7: a step scheduled
        between a participant's redeploy and the next read still carries the old
        contract, so the participant itself refuses to run an IRREVERSIBLE tool that
        arrives without an approval (``ContractChanged``), and this client re-reads
        the catalogue after such a refusal."""
        if tool in self._pinned_ambiguous:
            raise _ambiguous(tool, self._pinned_ambiguous[tool], "declare it")
        found = self._cached_contract(tool)
        if found is not None:
            return found
        with self._catalogue_lock:
            # Another thread may have read it while this one waited for the lock.
            if self._cached_contract(tool) is None:
                self._read_catalogue()
        try:
            return self._contracts.get(tool) or self._published[tool]
        except KeyError:
            if tool in self._ambiguous:
                raise _ambiguous(tool, self._ambiguous[tool], "publish it") from None
            if tool in self._unreadable:
                raise UnknownTool(
                    f"the latest published entry of tool {tool!r} cannot be read "
                    f"({self._unreadable[tool]}); restart its participant to publish it "
                    "again"
                ) from None
            known = {*self._contracts, *self._published}
            raise _unknown(tool, known, self.topics.catalogue) from None

    def _cached_contract(self, tool: str) -> StepContract | None:
        """The contract of ``tool`` without I/O, or None when the published catalogue
        must be read for it (never read, not in it, or read too long ago)."""
        if tool in self._pinned_ambiguous:
            return None  # contract() raises
        pinned = self._contracts.get(tool)
        if pinned is not None and tool in self._pinned_paths:
            return pinned
        # A contract given without its tool (contracts=) does not say which arguments
        # are secret: its participant's published entry does, read as for a published
        # contract (the given contract is still the one used).
        read_at = self._catalogue_read_at
        if read_at is None or time.monotonic() - read_at >= self.catalogue_max_age_s:
            return None
        return pinned if pinned is not None else self._published.get(tool)

    def _secret_paths_of(self, contract: StepContract) -> tuple[str, ...]:
        """The secret fields of a call scheduled with ``contract``: its tool's given
        with its catalogue, else its participant's published ones."""
        tool = contract.tool
        if tool in self._pinned_paths:
            return self._pinned_paths[tool]
        owned = self._owned_paths.get((contract.participant, tool))
        return owned if owned is not None else self._secret_paths.get(tool, ())

    def forget_published(self) -> None:
        """Make the next call re-read the published catalogue (e.g. after a
        participant refused a step scheduled with an outdated contract)."""
        self._catalogue_read_at = None

    def saga(
        self,
        workflow: str,
        principal: str,
        *,
        saga_id: str | None = None,
        tenant_id: str | None = None,
        workflow_version: str = "1",
        policy_version: str = "1",
        continue_on_compensation_failure: bool = False,
    ) -> Saga:
        """A saga to use as ``with client.saga(...) as saga:`` (or ``async with``).

        ``saga_id`` left out gets a fresh one; an empty or blank one is refused
        (:class:`InvalidSagaId`), since replacing it would hide the caller's bug."""
        if saga_id is not None and not _is_text(saga_id):
            raise InvalidSagaId(
                f"saga_id must be a string (UTF-8 text), got {saga_id!r} "
                f"({type(saga_id).__name__}): pass str(...) of it, or leave it out to get "
                "a generated one; nothing was written"
            )
        if saga_id is not None and not saga_id.strip():
            raise InvalidSagaId(
                f"saga_id {saga_id!r} is empty: pass a non-blank id, or leave it out to "
                "get a generated one"
            )
        return Saga(
            self,
            saga_id=saga_id if saga_id is not None else f"saga-{uuid.uuid4().hex[:16]}",
            tenant_id=tenant_id or self.settings.tenant_id,
            workflow=workflow,
            principal=principal,
            workflow_version=workflow_version,
            policy_version=policy_version,
            continue_on_compensation_failure=continue_on_compensation_failure,
        )

    # ---------------------------------------------------------------- internals

    def append(self, record: Record, timeout_s: float = 30.0) -> None:
        """Produce to the ledger and wait for the broker's acknowledgement."""
        if not self._writer_taken():
            self._append_after_close(record, timeout_s)
            return
        try:
            self._writer.append(record, timeout_s=timeout_s)
        finally:
            if self._writer_released():
                self._writer.close()

    async def append_async(self, record: Record, timeout_s: float = 30.0) -> None:
        """:meth:`append` for asyncio: awaits this record's delivery report."""
        if not self._writer_taken():
            await asyncio.to_thread(self._append_after_close, record, timeout_s)
            return
        try:
            await self._writer.append_async(record, timeout_s=timeout_s)
        finally:
            if self._writer_released():
                self._close_writer_soon()

    def _append_after_close(self, record: Record, timeout_s: float) -> None:
        """After :meth:`close` closed the writer (only the end of a saga whose block
        was not open at close() gets this far: one attached, or left open for a
        person; a start or a call is refused, no outcome could reach it): the
        client's writer no longer serves its delivery reports, so the record goes
        through a writer of its own, and is acknowledged as ever, instead of waiting
        out ``timeout_s`` for a report that never comes while the saga's end is left
        in doubt."""
        writer = LedgerWriter(self.bootstrap, self.topics, self.signer)
        try:
            writer.append(record, timeout_s=timeout_s)
        finally:
            writer.close()

    def _end_positions(self) -> list[TopicPartition]:
        """Where the listener starts: the end of every partition of the ledger.
        :class:`~sagaline.kafka.TopicMissing` when the topic does not exist (a
        listener with no partition would hear no outcome, and every call would time
        out while its steps ran)."""
        topic = self.topics.events
        ends = LedgerReader(self.bootstrap).end_offsets(topic)
        return [TopicPartition(topic, n, high) for n, high in sorted(ends.items())]

    def _listen(self, positions: list[TopicPartition], ready: threading.Event) -> None:
        """The listener thread. However it ends (the client closed, or it failed), the
        waits still pending end too, rather than each waiting out its timeout."""
        try:
            self._follow_ledger(positions, ready)
        except BaseException as exc:
            log.exception("the saga client's listener stopped; no call can get its outcome")
            self._ledger.fail(exc)
        else:
            self._ledger.fail(RuntimeError("the saga client was closed"))
        finally:
            ready.set()

    def _follow_ledger(self, positions: list[TopicPartition], ready: threading.Event) -> None:
        consumer = create_consumer(
            self.bootstrap, f"{self.topics.prefix}agent-{uuid.uuid4().hex[:8]}"
        )
        consumer.assign(positions)
        ready.set()
        try:
            while not self._stop.is_set():
                # Block for the first record only, then take what has already arrived.
                first = consumer.poll(0.2)
                if first is None:
                    continue
                records: list[Record] = []
                for msg in (first, *consumer.consume(500, 0)):
                    error = msg.error()
                    if error is not None:
                        self._consumer_error(error)
                        continue
                    key = msg.key()
                    if key is None or not self._ledger.follows(key.decode("utf-8", "replace")):
                        continue  # another agent's saga: not even decoded
                    value = msg.value()
                    kind = None if value is None else record_type(value)
                    if kind is not None and kind not in AWAITED:
                        continue  # of a type no wait looks at: not verified nor decoded
                    try:
                        record = from_message(key, value, headers_of(msg), self.signer)
                    except (UnknownFingerprint, SchemaMismatch) as exc:
                        # Its writer may read it (a coordinator on a later version: then
                        # nobody DLQs it), and it may be what a wait waits for.
                        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
                        self._ledger.unreadable(key.decode("utf-8", "replace"), where, exc)
                        continue
                    except CodecError:
                        continue  # the coordinator routes it to the DLQ
                    records.append(record)
                self._ledger.add(records)
        finally:
            consumer.close()

    def _consumer_error(self, error: KafkaError) -> None:
        """(The listener, for a message that is an error.) One that lasts (read access
        to the ledger refused, a fatal error) stops the listener, which ends every
        wait at once naming it; one that passes (a broker away a moment) is logged,
        at most once a minute per error, as calls may get no outcome while it lasts."""
        code = error.code()
        if error.fatal() or code in _LISTENER_REFUSED:
            raise RuntimeError(
                f"the ledger {self.topics.events} cannot be read by this client "
                f"({error.name()}: {error.str()}); no outcome can reach it. Grant this "
                "agent's principal Read on the topic (docs/security.md), or check that it "
                "exists"
            ) from KafkaException(error)
        if code == KafkaError._PARTITION_EOF:
            return
        now = time.monotonic()
        if now - self._errors_logged.get(code, -math.inf) >= LISTENER_ERROR_LOG_INTERVAL_S:
            self._errors_logged[code] = now
            log.warning(
                "the saga client's listener: consumer error %s: %s (calls may get no "
                "outcome while it lasts)",
                error.name(),
                error.str(),
            )


class Saga:
    """One saga, as the agent sees it. Leaving the block ends it (complete or abort)."""

    def __init__(
        self,
        client: SagaClient,
        *,
        saga_id: str,
        tenant_id: str,
        workflow: str,
        principal: str,
        workflow_version: str,
        policy_version: str,
        continue_on_compensation_failure: bool,
    ) -> None:
        self.client = client
        self.saga_id = saga_id
        self.tenant_id = tenant_id
        self.workflow = workflow
        self.principal = principal
        self._start = SagaStarted(
            envelope=self._envelope(SagaStarted),
            workflow=workflow,
            workflow_version=workflow_version,
            policy_version=policy_version,
            principal=principal,
            continue_on_compensation_failure=continue_on_compensation_failure,
        )
        # The number of the next generated step id, taken only by a call that is
        # scheduled (a refused one leaves it to the next call); under the lock, as
        # calls from several threads share it.
        self._next_number = 1
        self._numbering = threading.Lock()
        # The calls awaiting their step here now (a framework runs a turn's tool calls
        # at once), by the order they were scheduled in (under ``_numbering``): a call
        # waits on while one scheduled before it is still awaited (see _queued).
        self._awaited: dict[int, str] = {}
        self._call_order = itertools.count()
        self.results: dict[str, Any] = {}
        self._contracts: dict[str, StepContract] = {}
        # Every step id this object scheduled (or read back in attach()), as soon as
        # its record is produced: what a later step may depend on.
        self._step_ids: set[str] = set()
        # The step ids scheduled with explicit ``depends_on`` (a DAG edge, not the
        # implicit chain of each step behind the one before it).
        self._explicit: set[str] = set()
        # The tool, arguments fingerprint and dependencies (None: the implicit chain)
        # each step id was first scheduled with: the only call the coordinator
        # answers under that id.
        self._calls: dict[str, tuple[str, str, frozenset[str] | None]] = {}
        # The arguments (and their secret fields) of every call with secret arguments:
        # an end reason quoting one of their clear values is scrubbed of it.
        self._secret_args: list[tuple[Mapping[str, Any], tuple[str, ...]]] = []
        # The end this object asked for (end(), or leaving the block): no step after it.
        self._end_requested: SagaOutcome | None = None
        # Whether the broker acknowledged that end, or it is queued and its wait was
        # interrupted (Ctrl-C, a cancelled task): leaving the block writes no other
        # (the coordinator keeps the first end asked for and dead-letters a second).
        self._end_written = False
        self._receipt: Receipt | None = None

    def _envelope(self, cls: type[Record]) -> Any:
        return envelope_for(
            cls,
            saga_id=self.saga_id,
            tenant_id=self.tenant_id,
            producer=self.client.producer_name,
            now=int(time.time() * 1000),
        )

    # ------------------------------------------------------------------ sync

    def __enter__(self) -> Saga:
        self._require_listener()
        self.client.ensure_coordinator()
        self._follow_new()
        self.client._block_opened(self.saga_id)
        try:
            self.client.append(self._start, timeout_s=self.client.call_timeout_s)
        except BaseException as exc:  # DeliveryFailed, or interrupted while waiting
            self._abort_behind_start(exc)
            raise
        return self

    def _follow_new(self) -> None:
        """Follow the saga about to be started, or :class:`InvalidSagaId` (nothing
        written) when this client already started it, or saw it end: the coordinator
        ignores a second ``SagaStarted`` under an id, and every step after it, so the
        new saga would never run and its waits would read the old one's records."""
        if not self.client._ledger.follow_new(self.saga_id):
            raise InvalidSagaId(
                f"saga {self.saga_id} was already started (it is in flight or ended "
                "recently, seen by this client): saga ids are unique on the ledger, and "
                "a second start under one is ignored, so nothing was written. Leave "
                "saga_id out to get a fresh one, or attach() to continue that saga"
            )

    def _require_listener(self) -> None:
        """Refuse, before anything is written, what could never learn its outcome."""
        if self.client._listener is None:  # start() never ran: nothing reads the ledger
            raise ClientStopped(
                f"the saga client was not started, so no outcome would reach saga "
                f"{self.saga_id}: nothing was written; call start() first (or use "
                "`with client:`, or sagaline.connect(), which starts it)"
            )
        if self.client._closed:  # its listener is stopping, if not stopped yet
            raise ClientStopped(
                f"the saga client was closed, so no outcome would reach saga "
                f"{self.saga_id}: nothing was written; use a new client"
            )
        failure = self.client._ledger.failure
        if failure is not None:
            raise ClientStopped(
                f"the saga client's listener stopped ({_why(failure)}), so no outcome "
                f"would reach saga {self.saga_id}: nothing was written; use a new client"
            ) from failure

    def _abort_behind_start(self, exc: BaseException, *, in_loop: bool = False) -> None:
        """``SagaStarted`` was not acknowledged (or the wait for it was cancelled or
        interrupted), so the block does not run and nothing will end this saga; but
        the record may still be in the producer's queue and reach the ledger once the
        broker is back (seen in CI: a saga open for good, R14). An abort queued behind
        it, on the same partition and in order, ends it then; if the start never
        lands, the coordinator rejects the lone abort."""
        why = str(exc) or type(exc).__name__
        self._end_requested = SagaOutcome.ABORT
        self.client._ledger.unconfirmed(self.saga_id)
        end = SagaEndRequested(
            envelope=self._envelope(SagaEndRequested),
            outcome=SagaOutcome.ABORT,
            reason=f"the agent gave up on starting the saga: {why}"[:2000],
        )

        def delivered(failure: DeliveryFailed | None) -> None:
            if failure is not None:
                log.warning("saga %s: the abort behind its start failed: %s", self.saga_id, failure)

        try:
            self.client._writer.append_then(end, delivered)
        except Exception as failure:  # the start's own error is the one to raise
            log.warning("saga %s: the abort behind its start failed: %s", self.saga_id, failure)
        finally:  # queued: a writer closed now still delivers it first
            if not in_loop:
                self.client._left(self.saga_id)
            elif self.client._block_left(self.saga_id):
                self.client._close_writer_soon()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._end_written:
            self._ended_before_leaving(exc)
        elif exc is None:
            self.end(SagaOutcome.COMPLETE)
        elif _waits_for_a_person(exc):
            # Waiting for a person is not a failure (R7): the saga stays open, the step
            # runs once approved. Finish with resume() then end(), or abort() it.
            # Scrubbed as an abort reason is: the message may quote a secret (an
            # adapter's Interrupted quotes the graph's question to its person).
            log.info("saga %s left open: %s", self.saga_id, self._scrubbed(str(exc)))
            self.client._ledger.hold(self.saga_id)  # resume() reads its records
            self.client._left(self.saga_id)
        else:
            self.end(SagaOutcome.ABORT, reason=f"{type(exc).__name__}: {exc}")

    def _ended_before_leaving(self, exc: BaseException | None) -> None:
        """The block is left after :meth:`end` was acknowledged (end() let the saga go
        already): another end would be refused, and dead-lettered, by the coordinator,
        which keeps the first one; say so when an exception would have aborted it."""
        if exc is not None and self._end_requested is SagaOutcome.COMPLETE:
            log.warning(
                "saga %s: its block was left by %s after its completion was requested: "
                "not aborted (the first end asked for counts)",
                self.saga_id,
                type(exc).__name__,
            )

    def _scrubbed(self, reason: str) -> str:
        """``reason`` (bound for the ledger) with every clear secret value of this
        saga's calls replaced by its marker: the agent's error, as the abort reason,
        may quote one (``ValueError(f"card {card} declined")``)."""
        key = self.client.sealer.marker_key
        for args, paths in self._secret_args:
            reason = scrub(reason, args, paths, key)
        return reason

    def end(self, outcome: SagaOutcome, reason: str = "") -> None:
        """Ask the coordinator to complete or abort the saga (waits, like a call, up to
        the client's call timeout for the broker's acknowledgement)."""
        self._end_requested = outcome
        try:
            self.client.append(
                SagaEndRequested(
                    envelope=self._envelope(SagaEndRequested),
                    outcome=outcome,
                    reason=self._scrubbed(reason)[:2000],
                ),
                timeout_s=self.client.call_timeout_s,
            )
            self._end_written = True
        except BaseException as exc:
            self._end_written = _interrupted(exc)  # queued: it lands, no second end
            raise
        finally:  # also when interrupted while waiting: the end is still queued
            self.client._ledger.release(self.saga_id)  # ended: nothing left to resume
            self.client._left(self.saga_id)

    def call(
        self,
        tool: str | ToolSpec | Callable[..., Any],
        /,
        *,
        step_id: str | None = None,
        depends_on: list[str] | None = None,
        timeout_s: float | None = None,
        **args: Any,
    ) -> Any:
        """Run one tool as the next step and return its result.

        ``depends_on`` lists explicit step ids (a DAG, R2); left out, the step depends
        on the step before it. Raises a :class:`SagaCallError` subclass when the
        step does not commit.
        """
        wait_s = self._wait_s(timeout_s)
        scheduled, write = self._scheduled(
            self.client.contract(_tool_name(tool)), step_id, depends_on, args
        )
        # The step's acknowledgement is awaited as long as its outcome: a record whose
        # wait gave up is still queued in the producer and may reach the ledger after
        # the agent has moved on (and aborted), so the step would run behind its back.
        # A repeated call is waited for under the contract its step was first
        # scheduled with, the one the coordinator keeps (not the tool's current one).
        # Kept before the write: a call whose wait for the acknowledgement gave up (or
        # was cancelled) leaves its step queued, and resume() waits for it.
        contract = self._contracts.setdefault(scheduled.step_id, scheduled.contract)
        order = self._awaiting(scheduled.step_id)
        try:
            if write:
                self.client.append(scheduled, timeout_s=wait_s)
            result = self._await_step(scheduled.step_id, contract, wait_s, order)
        finally:
            self._awaited_done(order)
        self.results[scheduled.step_id] = result
        return result

    def _awaiting(self, step: str) -> int:
        """Note a call awaiting ``step`` here; its order among this saga's calls."""
        with self._numbering:
            order = next(self._call_order)
            self._awaited[order] = step
        return order

    def _awaited_done(self, order: int) -> None:
        with self._numbering:
            self._awaited.pop(order, None)

    def _queued(self, step: str, order: int | None) -> bool:
        """Whether the call ``order`` awaiting ``step``, whose wait ended without an
        outcome, waits on: while a call of this saga scheduled before it is still
        awaited here (calls made at once: each step follows the one scheduled before
        it, so the wait for ``step`` holds that step's time too, and ``step`` may not
        have run at all), unless a step waits for a person (then ApprovalPending)."""
        if order is None or self.client._ledger.failure is not None:
            return False
        if not self.client._ledger.follows(self.saga_id):
            return False  # let go (ended): nothing more to wait for
        with self._numbering:
            earlier = any(o < order and s != step for o, s in self._awaited.items())
        return earlier and self._awaiting_approval_before(step) is None

    def _waits_again(
        self, step: str, order: int | None, was_queued: bool, seen: dict[str, Any]
    ) -> bool:
        """Whether the call ``order`` waits once more for ``step``: while a call
        scheduled before it is awaited (:meth:`_queued`), and once more after that
        call ended during the wait just over: ``step`` could run only then, so this
        call's own timeout counts from there, not from its first wait (else a step
        that ran right after the earlier one was reported ``OutcomeUnknown``). Not
        once ``step`` itself waits for a person (``seen``, what the wait saw): that is
        ``ApprovalPending`` now, not after another timeout (R7)."""
        if seen["approval"] is not None:
            return False
        if self._queued(step, order):
            return True
        return (
            was_queued
            and self.client._ledger.failure is None
            and self.client._ledger.follows(self.saga_id)
            and self._awaiting_approval_before(step) is None
        )

    def _wait_s(self, timeout_s: float | None) -> float:
        """How long a call waits: its ``timeout_s``, else the client's call timeout."""
        return self.client.call_timeout_s if timeout_s is None else _positive(timeout_s)

    def _scheduled(
        self,
        contract: StepContract,
        step_id: str | None,
        depends_on: list[str] | None,
        args: dict[str, Any],
    ) -> tuple[StepScheduled, bool]:
        """The ``StepScheduled`` record of the next call (sync and async alike), and
        whether to write it: not for a step the saga scheduled before it ended, whose
        outcome its records give (and the coordinator would not run it again)."""
        self._require_listener()
        name = contract.tool
        ended = self._ended(name, step_id)
        if ended is not None and (step_id is None or step_id not in self._step_ids):
            raise ended
        with self._numbering:
            number = self._next_number
            scheduled = self._numbered(contract, step_id, number, depends_on, args, ended)
            self._next_number = number + 1  # scheduled: the number is taken
        return scheduled, ended is None

    def _numbered(
        self,
        contract: StepContract,
        step_id: str | None,
        number: int,
        depends_on: list[str] | None,
        args: dict[str, Any],
        ended: SagaUnwinding | None,
    ) -> StepScheduled:
        """(Under ``_numbering``.) :meth:`_scheduled`'s record, the generated step id
        numbered ``number``, or :class:`CallRefused` (the number is not taken)."""
        name = contract.tool
        step = step_id or f"{number:02d}-{name}"
        problem = step_id_problem(step)
        if problem is not None:
            # The coordinator would reject the step to the dead-letter topic.
            raise CallRefused(
                f"saga {self.saga_id}: {problem}; nothing was written",
                limit="step_id",
                size=len(step),
                saga_id=self.saga_id,
                step_id=step,
                tool=name,
            )
        if isinstance(depends_on, str):
            raise CallRefused(
                f"step {step} ({name}): depends_on must be a list of step ids, not the "
                f"string {depends_on!r}; write depends_on=[{depends_on!r}]. Nothing was "
                "written",
                limit="depends_on",
                size=1,
                saga_id=self.saga_id,
                step_id=step,
                tool=name,
            )
        missing = [d for d in depends_on or () if d not in self._step_ids]
        if missing:
            # The coordinator would reject the step to the dead-letter topic, and the
            # call would wait out its timeout as if the step might have run.
            raise CallRefused(
                f"step {step} ({name}) depends on {missing}, which saga {self.saga_id} has "
                f"not scheduled (its steps: {sorted(self._step_ids)}); nothing was "
                "written. A process that restarted must attach() the saga first",
                limit="depends_on",
                size=len(missing),
                saga_id=self.saga_id,
                step_id=step,
                tool=name,
            )
        # The limit counts the saga's steps, not the number in generated ids, which
        # attach() takes after the highest "NN-" prefix (a step named by a date).
        count = len(self._step_ids) + (step not in self._step_ids)
        body = self._checked_body(contract, step, count, args)
        fingerprint = args_fingerprint(body)
        dependencies = None if depends_on is None else frozenset(depends_on)
        first = self._calls.setdefault(step, (name, fingerprint, dependencies))
        if first[:2] != (name, fingerprint):
            # The coordinator would reject the step to the dead-letter topic and run
            # nothing, and the wait for this step id would return the first call's
            # outcome as this one's.
            raise CallRefused(
                f"step {step} of saga {self.saga_id} is already scheduled with tool "
                f"{first[0]} and other arguments (fingerprint {first[1]}) than this call "
                f"of {name} ({fingerprint}); nothing was written. A step id names one "
                "call: repeat it with the same tool and arguments to get its outcome, or "
                "leave step_id out (or pick a new one) for a new step",
                limit="duplicate-step",
                size=1,
                saga_id=self.saga_id,
                step_id=step,
                tool=name,
            )
        if first[2] != dependencies:
            # The coordinator would reject the step (duplicate-step) and keep the
            # first dependencies; the wait would return the first call's outcome.
            raise CallRefused(
                f"step {step} of saga {self.saga_id} is already scheduled with other "
                f"dependencies ({_dependency_words(first[2])}) than this call of {name} "
                f"({_dependency_words(dependencies)}); nothing was written. A step id "
                "names one call: repeat it with the same depends_on to get its outcome, "
                "or leave step_id out (or pick a new one) for a new step",
                limit="duplicate-step",
                size=1,
                saga_id=self.saga_id,
                step_id=step,
                tool=name,
            )
        self._step_ids.add(step)
        if depends_on is not None:
            self._explicit.add(step)
        return StepScheduled(
            envelope=self._envelope(StepScheduled),
            step_id=step,
            args=body,
            args_fingerprint=fingerprint,
            depends_on=depends_on,
            contract=contract,
        )

    def _ended(self, tool: str, step_id: str | None) -> SagaUnwinding | None:
        """Why no new step of this saga can run (it ended, or its end was asked for),
        or None; :class:`CallRefused` when it was never started here: the coordinator
        would reject its steps, and no outcome would come."""
        where = {"saga_id": self.saga_id, "step_id": step_id or "", "tool": tool}
        known, terminal = self.client._ledger.end_of(self.saga_id)
        if terminal is not None:
            return SagaUnwinding(
                f"saga {self.saga_id} has ended ({terminal.status.value.lower()}): {tool} "
                "will not run, and nothing was written",
                **where,
            )
        if self._end_requested is not None:
            return SagaUnwinding(
                f"saga {self.saga_id} is ending ({self._end_requested.value.lower()} "
                f"requested by this client): {tool} will not run, and nothing was written",
                **where,
            )
        if not known:
            raise CallRefused(
                f"saga {self.saga_id} is not started (or it ended before the last "
                f"{self.client._ledger.ended_kept} sagas this client saw end): call its "
                "tools inside `with client.saga(...) as saga:` (or `async with`), or "
                f"attach() a saga started elsewhere; {tool} did not run and nothing was "
                "written",
                limit="saga-not-started",
                size=0,
                **where,
            )
        return None

    def attach(self) -> Saga:
        """Follow this saga (already started, e.g. by a process that restarted) without
        starting it again: new calls continue it.

        Its records so far are read from the ledger (its partition of
        ``sagaline.events``, once), so ``results`` holds what its steps committed,
        ``resume()`` waits for a step scheduled before, a call under the id of a step
        already scheduled, with the same tool and arguments, answers with that step's
        outcome (the coordinator does not run a step twice; other ones are refused,
        :class:`CallRefused`), and new steps are numbered after the ones scheduled.
        Its records are kept, even once it ended, until :meth:`end` or :meth:`wait`
        (as for a saga left open on ``ApprovalPending``; once ended, for the client's
        ``ended_sagas_kept`` most recently ended such sagas). New records carry the saga's
        own tenant (from its start), whatever
        ``tenant_id`` this view was made with. An id with no start on the ledger is
        :class:`InvalidSagaId`, nothing written. A saga with records this client
        cannot read (written by a newer version) is :class:`SagaHistoryUnreadable`,
        nothing written."""
        client = self.client
        client.ensure_coordinator()
        # Followed first: what the listener reads from now on is kept, and the read
        # below reaches at least as far, so no record falls between the two.
        followed = client._ledger.knows(self.saga_id)
        client._ledger.follow(self.saga_id)
        # Kept past its terminal record, as a saga left open on ApprovalPending, until
        # end() or wait(): it may have ended while the agent was away (an approval
        # denied, the saga compensated), and resume() still reads why a step ended.
        client._ledger.hold(self.saga_id)
        unreadable: list[str] = []
        history = LedgerReader(client.bootstrap).saga_records(
            client.topics.events, self.saga_id, client.signer, unreadable=unreadable
        )
        if unreadable:
            # A newer version wrote them (e.g. before this agent was rolled back): a
            # step it scheduled would be missing here, and a new call could get its id.
            if not followed:
                client._ledger.release(self.saga_id)
                client._ledger.unfollow_unused(self.saga_id)
            raise SagaHistoryUnreadable(
                f"cannot attach saga {self.saga_id}: {len(unreadable)} of its record(s) "
                "on the ledger were written under a schema this client cannot read, by "
                "a newer version of Sagaline, so the steps it has are not known here: "
                f"{'; '.join(unreadable[:5])}. Nothing was written; upgrade this client "
                "(the version that wrote them) and attach again",
                saga_id=self.saga_id,
                unreadable=unreadable,
            )
        if not followed and not any(isinstance(r, SagaStarted) for r in history):
            # Its steps would be rejected as steps of an unknown saga, each call
            # waiting out its timeout as if it might have run.
            client._ledger.release(self.saga_id)
            client._ledger.unfollow_unused(self.saga_id)
            raise InvalidSagaId(
                f"no saga {self.saga_id} on the ledger (no SagaStarted in "
                f"{client.topics.events}): never started, its start never reached the "
                "broker, or it is older than the topic's retention; nothing to attach "
                "and nothing was written. Check the id, or start a new saga"
            )
        client._ledger.backfill(self.saga_id, history)
        bound = isinstance(client.signer, IdentitySigner)  # producers are their signers
        numbered = 0
        started = False
        for record in history:
            if isinstance(record, SagaStarted) and not started:  # a second one is ignored
                started = True
                # The saga's own tenant (and names), whatever this view was made with:
                # the coordinator refuses a record under another tenant.
                if record.envelope.tenant_id != self.tenant_id:
                    log.info(
                        "saga %s belongs to tenant %r: attached under it, not %r",
                        self.saga_id,
                        record.envelope.tenant_id,
                        self.tenant_id,
                    )
                self.tenant_id = record.envelope.tenant_id
                self.workflow, self.principal = record.workflow, record.principal
            elif isinstance(record, StepScheduled):
                # Recomputed, not read: a fingerprint written by an older client may
                # count a sealed secret's random nonce (see args_fingerprint).
                with contextlib.suppress(orjson.JSONDecodeError):  # rejected: not JSON
                    self._calls.setdefault(
                        record.step_id,
                        (
                            record.contract.tool,
                            args_fingerprint(record.args),
                            None if record.depends_on is None else frozenset(record.depends_on),
                        ),
                    )
                if record.step_id not in self._step_ids and record.depends_on is not None:
                    self._explicit.add(record.step_id)
                self._contracts.setdefault(record.step_id, record.contract)  # the first
                self._step_ids.add(record.step_id)
                numbered = max(numbered + 1, _generated_number(record.step_id))
            elif isinstance(record, (StepCommitted, StepReconciled)):
                if isinstance(record, StepReconciled) and (
                    record.outcome is not ReconcileResult.COMMITTED
                ):
                    continue
                scheduled = self._contracts.get(record.step_id)
                if bound and (
                    scheduled is None
                    or not _may_report(record, record.step_id, scheduled.participant)
                ):
                    continue  # another participant's report: the coordinator refused it
                result = orjson.loads(record.result or b"null")
                if not is_omitted_result(result):
                    self.results[record.step_id] = result
        with self._numbering:
            self._next_number = numbered + 1
        return self

    def approval_request(self, step_id: str, timeout_s: float) -> ApprovalRequested | None:
        """The approval request of ``step_id`` as soon as the coordinator records it
        (an IRREVERSIBLE step, R7); None when the step ends first or within
        ``timeout_s`` nothing is requested (0: only if it has arrived)."""
        _duration(timeout_s)
        check = _approval_check(step_id, self._reporter(step_id))
        found = self.client._ledger.wait_for(self.saga_id, check, timeout_s)
        return found if isinstance(found, ApprovalRequested) else None

    async def aapproval_request(self, step_id: str, timeout_s: float) -> ApprovalRequested | None:
        """:meth:`approval_request` for asyncio (the waiter is a future, not a thread)."""
        _duration(timeout_s)
        found = await self.client._ledger.wait_for_async(
            self.saga_id, _approval_check(step_id, self._reporter(step_id)), timeout_s
        )
        return found if isinstance(found, ApprovalRequested) else None

    def _reporter(self, step_id: str) -> str | None:
        """With identities, the participant whose reports on ``step_id`` count (a
        step scheduled elsewhere: the coordinator's own records only); else None."""
        if not isinstance(self.client.signer, IdentitySigner):
            return None
        contract = self._contracts.get(step_id)
        return _COORDINATOR if contract is None else contract.participant

    def resume(self, step_id: str, timeout_s: float | None = None) -> Any:
        """Wait again for a step this saga scheduled, e.g. after ``ApprovalPending``:
        its result once approved and run, or the error it ended in."""
        wait_s = self._wait_s(timeout_s)
        result = self._await_step(step_id, self._scheduled_contract(step_id), wait_s)
        self.results[step_id] = result
        return result

    def _scheduled_contract(self, step_id: str) -> StepContract:
        """The contract ``step_id`` was scheduled with, or ValueError saying why not."""
        try:
            return self._contracts[step_id]
        except KeyError:
            raise ValueError(
                f"saga {self.saga_id} scheduled no step {step_id!r} here (its steps: "
                f"{sorted(self._contracts)}); a process that did not schedule it (one that "
                "restarted) must attach() the saga first, which reads its steps"
            ) from None

    def _checked_body(
        self, contract: StepContract, step: str, count: int, args: dict[str, Any]
    ) -> bytes:
        """The ledger bytes of a call's arguments, or :class:`CallRefused` before
        anything is written: non-finite numbers (JSON has none; orjson would write
        null), arguments over ``limits.max_args_bytes``, or a step past ``max_steps``."""
        name = contract.tool
        limits = self.client.settings.limits
        where = {"saga_id": self.saga_id, "step_id": step, "tool": name}
        if count > limits.max_steps:
            raise CallRefused(
                f"saga {self.saga_id} would get step {count} ({name}) but at most "
                f"{limits.max_steps} steps per saga are allowed (SAGALINE_MAX_STEPS); "
                "split the work into several sagas",
                limit="max_steps",
                size=count,
                **where,
            )
        bad = _non_finite_path(args, "args")
        if bad is not None:
            raise CallRefused(
                f"argument {bad} of {name} is NaN or infinite, which JSON cannot carry "
                "(it would be written as null); nothing was written. Pass a finite number, None "
                "or a string",
                limit="finite-numbers",
                size=0,
                **where,
            )
        # Secrets never reach the ledger in clear: sealed for the tool, or redacted.
        secrets = self.client._secret_paths_of(contract)
        try:
            body = canonical_json(self.client.sealer.seal(args, secrets, self.saga_id))
        except TypeError as exc:  # orjson: a Decimal, a set, bytes, an int over 64 bits
            bad, why = _unwritable_path(args, "args") or ("args", str(exc))
            raise CallRefused(
                f"argument {bad} of {name} cannot be written as JSON ({why}); nothing was "
                "written. Pass a string, a number (an integer within 64 bits), a "
                "boolean, None, or a list or an object (string keys) of them",
                limit="json-args",
                size=0,
                **where,
            ) from None
        if secrets:  # kept to scrub an end reason quoting them (a call with secrets only)
            self._secret_args.append((args, secrets))
        if len(body) > limits.max_args_bytes:
            raise CallRefused(
                f"arguments of {name} are {len(body)} bytes as JSON, over the limit of "
                f"{limits.max_args_bytes} bytes (SAGALINE_MAX_ARGS_BYTES); nothing was "
                "written. Pass a reference (a URL, a blob id) instead of the content",
                limit="max_args_bytes",
                size=len(body),
                **where,
            )
        return body

    def wait(self, timeout_s: float = 60.0) -> Receipt:
        """Wait for the terminal record and return its receipt (``timeout_s=0``: only
        if it has arrived)."""
        _duration(timeout_s)
        if self._receipt is not None:
            return self._receipt
        found = self.client._ledger.wait_for(
            self.saga_id, lambda r: r if isinstance(r, SagaTerminal) else None, timeout_s
        )
        return self._terminal(found, timeout_s)

    def _terminal(self, found: SagaTerminal | None, timeout_s: float) -> Receipt:
        """The receipt; a saga held open (R7) is let go now that it was waited for."""
        ledger = self.client._ledger
        if found is None and not ledger.knows(self.saga_id):
            raise TimeoutError(
                f"saga {self.saga_id} is not followed by this client: never started or "
                "attached here, or it ended before the last "
                f"{ledger.ended_kept} sagas that ended; read its receipt with "
                f"`sagaline saga show {self.saga_id}`"
            )
        if found is None and ledger.failure is not None:
            raise TimeoutError(
                f"saga {self.saga_id}: no terminal record can arrive, the client's listener "
                f"stopped ({_why(ledger.failure)}); see `sagaline saga show {self.saga_id}`"
            ) from ledger.failure
        if found is None:
            raise TimeoutError(
                f"saga {self.saga_id} is not terminal after {timeout_s} s"
                + ledger.unreadable_note(self.saga_id)
            )
        self._receipt = Receipt.from_json(found.receipt)
        ledger.release(self.saga_id)
        return self._receipt

    # ----------------------------------------------------------------- async

    async def __aenter__(self) -> AsyncSaga:
        """``async with client.saga(...) as saga``: the native asyncio view, whose
        pending calls are futures woken by the client's listener, not threads."""
        self._require_listener()
        await self.client.ensure_coordinator_async()
        self._follow_new()
        self.client._block_opened(self.saga_id)
        try:
            await self.client.append_async(self._start, timeout_s=self.client.call_timeout_s)
        except BaseException as exc:  # DeliveryFailed, or cancelled while awaiting it
            self._abort_behind_start(exc, in_loop=True)
            raise
        return AsyncSaga(self)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._end_written:
            self._ended_before_leaving(exc)
        elif exc is None:
            await self.end_async(SagaOutcome.COMPLETE)
        elif _waits_for_a_person(exc):
            # as in __exit__ (R7), scrubbed as there
            log.info("saga %s left open: %s", self.saga_id, self._scrubbed(str(exc)))
            self.client._ledger.hold(self.saga_id)
            if self.client._block_left(self.saga_id):
                self.client._close_writer_soon()
        else:
            await self.end_async(SagaOutcome.ABORT, reason=f"{type(exc).__name__}: {exc}")

    async def end_async(self, outcome: SagaOutcome, reason: str = "") -> None:
        self._end_requested = outcome
        try:
            await self.client.append_async(
                SagaEndRequested(
                    envelope=self._envelope(SagaEndRequested),
                    outcome=outcome,
                    reason=self._scrubbed(reason)[:2000],
                ),
                timeout_s=self.client.call_timeout_s,
            )
            self._end_written = True
        except BaseException as exc:
            self._end_written = _interrupted(exc)  # queued: it lands, no second end
            raise
        finally:  # cancelled while awaited, the end is still queued: let the saga go
            self.client._ledger.release(self.saga_id)
            if self.client._block_left(self.saga_id):
                self.client._close_writer_soon()

    async def acall(
        self,
        tool: str | ToolSpec | Callable[..., Any],
        /,
        *,
        step_id: str | None = None,
        depends_on: list[str] | None = None,
        timeout_s: float | None = None,
        **args: Any,
    ) -> Any:
        """:meth:`call` for asyncio (no thread per pending call)."""
        wait_s = self._wait_s(timeout_s)
        name = _tool_name(tool)
        contract = self.client._cached_contract(name)
        if contract is None:  # reading the published catalogue is blocking I/O
            contract = await asyncio.to_thread(self.client.contract, name)
        scheduled, write = self._scheduled(contract, step_id, depends_on, args)
        contract = self._contracts.setdefault(scheduled.step_id, contract)  # see call()
        order = self._awaiting(scheduled.step_id)
        try:
            if write:
                await self.client.append_async(scheduled, timeout_s=wait_s)  # see call()
            result = await self._await_step_async(scheduled.step_id, contract, wait_s, order)
        finally:
            self._awaited_done(order)
        self.results[scheduled.step_id] = result
        return result

    async def aresume(self, step_id: str, timeout_s: float | None = None) -> Any:
        """:meth:`resume` for asyncio."""
        wait_s = self._wait_s(timeout_s)
        result = await self._await_step_async(step_id, self._scheduled_contract(step_id), wait_s)
        self.results[step_id] = result
        return result

    async def _await_step_async(
        self, step: str, contract: StepContract, wait_s: float, order: int | None = None
    ) -> Any:
        check, seen = self._step_check(step, contract)
        while True:  # see _await_step
            was_queued = self._queued(step, order)
            found = await self.client._ledger.wait_for_async(self.saga_id, check, wait_s)
            if found is not None or not self._waits_again(step, order, was_queued, seen):
                break
        if found is None:  # the outcome asks the broker about the coordinator: not on the loop
            return await asyncio.to_thread(self._step_outcome, found, seen, step, contract, wait_s)
        return self._step_outcome(found, seen, step, contract, wait_s)

    async def await_terminal(self, timeout_s: float = 60.0) -> Receipt:
        """:meth:`wait` for asyncio."""
        _duration(timeout_s)
        if self._receipt is not None:
            return self._receipt
        found = await self.client._ledger.wait_for_async(
            self.saga_id, lambda r: r if isinstance(r, SagaTerminal) else None, timeout_s
        )
        return self._terminal(found, timeout_s)

    # -------------------------------------------------------------- outcomes

    def _await_step(
        self, step: str, contract: StepContract, timeout_s: float, order: int | None = None
    ) -> Any:
        check, seen = self._step_check(step, contract)
        while True:
            was_queued = self._queued(step, order)
            found = self.client._ledger.wait_for(self.saga_id, check, timeout_s)
            # No outcome within timeout_s: another such wait while a call scheduled
            # before this one (``order``) is still awaited here, or was when this wait
            # began. Ends: the first such call waits for no other, and each wait is
            # bounded.
            if found is not None or not self._waits_again(step, order, was_queued, seen):
                break
        return self._step_outcome(found, seen, step, contract, timeout_s)

    def _step_check(
        self, step: str, contract: StepContract
    ) -> tuple[Callable[[Record], Any], dict[str, Any]]:
        """What ends a wait for ``step``, and what the wait saw on the way."""
        where = {"saga_id": self.saga_id, "step_id": step, "tool": contract.tool}
        state: dict[str, Any] = {"unknown": False, "approval": None}
        # With identities a record's producer is its signer: as at the coordinator, only
        # the step's participant reports on it (another's report is refused there).
        bound = isinstance(self.client.signer, IdentitySigner)

        def check(record: Record) -> Any:
            if bound and not _may_report(record, step, contract.participant):
                return None
            if isinstance(record, StepCommitted) and record.step_id == step:
                result = orjson.loads(record.result)
                if is_omitted_result(result):
                    return ("err", _result_too_large(contract, result, **where))
                return ("ok", result)
            if (
                isinstance(record, StepReconciled)
                and record.step_id == step
                and record.outcome is ReconcileResult.COMMITTED
            ):
                return ("ok", orjson.loads(record.result or b"null"))
            if isinstance(record, StepFailed) and record.step_id == step:
                if record.error_type == ContractChanged.__name__:
                    # The participant's declaration changed since the catalogue was
                    # read: the next call reads it again.
                    self.client.forget_published()
                if record.kind is FailureKind.BUSINESS_REJECTION:
                    return (
                        "err",
                        BusinessRejected(f"{contract.tool} rejected: {record.message}", **where),
                    )
                if record.attempt >= contract.retry.max_attempts:
                    return (
                        "err",
                        StepFailedError(
                            f"{contract.tool} failed {record.attempt} times: {record.message}",
                            **where,
                        ),
                    )
            if isinstance(record, StepOutcomeUnknown) and record.step_id == step:
                state["unknown"] = True
            if isinstance(record, ApprovalRequested) and record.step_id == step:
                state["approval"] = record.approval_id
            if isinstance(record, ApprovalDenied) and record.step_id == step:
                if record.envelope.producer == _COORDINATOR:
                    # The coordinator withdrew the request: the saga turned around and
                    # cancelled the step; no one denied it.
                    return (
                        "err",
                        SagaUnwinding(
                            f"saga {self.saga_id} is unwinding; {contract.tool} will not "
                            f"run ({record.reason})",
                            **where,
                        ),
                    )
                asked = state["approval"]  # None: its request unread (a newer schema)
                if (
                    asked is not None and record.approval_id != asked
                ) or record.envelope.tenant_id != self.tenant_id:
                    # Not a denial of this step's request in the saga's tenant: the
                    # coordinator refuses it, and the step still waits for a decision.
                    return None
                return (
                    "err",
                    ApprovalDeniedError(
                        f"approval for {contract.tool} denied by {record.denied_by}: "
                        f"{record.reason}",
                        **where,
                    ),
                )
            if (
                isinstance(record, IncidentRaised)
                and record.step_id == step
                and record.kind == RESULT_TOO_LARGE
            ):
                return ("err", ResultTooLarge(record.inconsistency, **where))
            if isinstance(record, IncidentRaised) and record.kind == PARKED_INCIDENT:
                return ("err", SagaParked(record.inconsistency, **where))
            if isinstance(record, IncidentRaised) and record.step_id == step:
                return (
                    "err",
                    StepEscalated(
                        f"{contract.tool} escalated to {record.owner}: {record.inconsistency}",
                        **where,
                    ),
                )
            if isinstance(record, SagaTerminal):
                ended = record.status.value.lower()
                return (
                    "err",
                    SagaUnwinding(
                        f"saga {self.saga_id} has ended ({ended}); {contract.tool} will not run",
                        **where,
                    ),
                )
            if isinstance(record, CompensationRequested):
                return (
                    "err",
                    SagaUnwinding(
                        f"saga {self.saga_id} is unwinding; {contract.tool} will not run", **where
                    ),
                )
            return None

        return check, state

    def _awaiting_approval_before(self, step: str) -> tuple[str, str] | None:
        """Another step of this saga (and its approval id) that waits for a person,
        when ``step`` follows the step scheduled before it (no explicit
        ``depends_on`` in this saga: one chain); else None. Such a step holds
        ``step`` back: the coordinator asks for a step's approval only once the steps
        it follows committed, so a request that is not answered comes before ``step``
        in the chain, and ``step`` cannot run before it is decided. (With explicit
        edges the saga is a graph, and ``step`` may not follow it: not guessed.) Read
        from the records this client holds, once, when a wait for ``step`` ended
        without its outcome."""
        if self._explicit:
            return None
        bound = isinstance(self.client.signer, IdentitySigner)
        pending: dict[str, str] = {}
        for record in self.client._ledger.records(self.saga_id):
            other = getattr(record, "step_id", None)
            if other is None or other == step:
                continue
            if isinstance(record, ApprovalRequested):
                if record.purpose is ApprovalPurpose.FORWARD and (
                    not bound or record.envelope.producer == _COORDINATOR
                ):
                    pending[other] = record.approval_id
            elif isinstance(record, (ApprovalDenied, *_STEP_OUTCOMES, IncidentRaised)):
                pending.pop(other, None)  # answered, ran or ended: no longer waiting
        return next(iter(pending.items()), None)

    def _step_outcome(
        self,
        found: Any,
        state: dict[str, Any],
        step: str,
        contract: StepContract,
        timeout_s: float,
    ) -> Any:
        where = {"saga_id": self.saga_id, "step_id": step, "tool": contract.tool}
        failure = self.client._ledger.failure
        if found is None and failure is not None:
            raise OutcomeUnknown(
                f"no outcome for {contract.tool} can arrive: the client's listener "
                f"stopped ({_why(failure)}); the step may have run: see `sagaline saga "
                f"show {self.saga_id}`, and use a new client",
                **where,
            ) from failure
        if found is None:
            if state["approval"] is not None:
                raise ApprovalPending(
                    f"{contract.tool} waits for approval {state['approval']} "
                    f"(sagaline approve {self.saga_id} {step})",
                    approval_id=state["approval"],
                    **where,
                )
            blocker = self._awaiting_approval_before(step)
            if blocker is not None:
                # Not an unknown outcome: the step has not run, it waits behind a step
                # that waits for a person (R7), e.g. a call made in parallel with it.
                other, approval = blocker
                raise ApprovalPending(
                    f"{contract.tool} has not run: it follows step {other}, which waits "
                    f"for approval {approval} (sagaline approve {self.saga_id} {other}); "
                    f"it runs once {other} is done (resume({step!r}) waits for it)",
                    approval_id=approval,
                    **where,
                )
            status = self.client.coordinator_status()
            if status is not None and not status.consuming:
                raise CoordinatorNotRunning(no_coordinator_message(self.client.settings, status))
            note = self.client._ledger.unreadable_note(self.saga_id)
            note += self._participant_note(contract)
            if state["unknown"]:
                raise OutcomeUnknown(
                    f"{contract.tool} timed out and is not reconciled yet{note}", **where
                )
            raise OutcomeUnknown(
                f"no outcome for {contract.tool} within {timeout_s} s{note}", **where
            )
        kind, value = found
        if kind == "err":
            raise value
        return value

    def _participant_note(self, contract: StepContract) -> str:
        """For an outcome that did not come: whether a process of the step's
        participant runs (its consumer group has a member), as the broker says; ""
        when it cannot say. The outcome stays unknown either way: a step not run yet
        runs once its participant starts."""
        status = self.client.participant_status(contract.participant)
        if status is None:
            return ""
        who = f"participant {contract.participant!r}"
        if status.consuming:
            return (
                f"; {who} is running ({status.members} member(s) in consumer group "
                f"`{status.group}`), so the step may be slow or waiting its turn"
            )
        hidden = (
            " (or the broker hides the group from this agent: it lacks Describe on it)"
            if status.state == "DEAD"
            else ""
        )
        return (
            f"; no member of {who}'s consumer group `{status.group}` is running "
            f"({status.state}){hidden}: start the service that serves "
            f"`{self.client.topics.commands(contract.participant)}`; the step may still "
            f"run when it starts (resume() waits for it)"
        )


def _is_text(value: object) -> bool:
    """Whether ``value`` is a string that UTF-8 can hold (a key on every topic)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a bad decode upstream)
        return False
    return True


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc``, raised out of the wait for a record's acknowledgement, is an
    interruption of the wait (KeyboardInterrupt, a cancelled task, SystemExit), not a
    verdict on the record: it is queued and reaches the ledger as ever. An error
    (DeliveryFailed: not acknowledged, it may or may not be in the log) is not."""
    return not isinstance(exc, Exception)


def _waits_for_a_person(exc: BaseException) -> bool:
    """Whether ``exc`` leaving a saga's block leaves the saga open (R7): an
    ``ApprovalPending``, or a group of nothing else (calls run together in an
    ``asyncio.TaskGroup``, one of which waits for an approval)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_waits_for_a_person(e) for e in exc.exceptions)
    return isinstance(exc, ApprovalPending)


def _result_too_large(
    contract: StepContract, marker: dict[str, Any], *, saga_id: str, step_id: str, tool: str
) -> ResultTooLarge:
    info = marker[RESULT_OMITTED]
    return ResultTooLarge(
        f"{contract.tool} committed but its result ({info.get('bytes')} bytes) is over the "
        f"limit of {info.get('limit')} bytes, so it is not on the ledger (fingerprint "
        f"{info.get('fingerprint')}); an incident names it for {contract.owner}",
        saga_id=saga_id,
        step_id=step_id,
        tool=tool,
    )


def _positive(timeout_s: float, name: str = "timeout_s") -> float:
    """``timeout_s``, or ValueError when it is no positive, finite number of seconds (0
    used to mean "the default", and a negative one or NaN gave up on a written step)."""
    if not 0 < timeout_s < math.inf:  # NaN too
        raise ValueError(
            f"{name} must be a positive number of seconds, got {timeout_s!r}; nothing "
            "was written (leave it out for the client's call timeout)"
        )
    return timeout_s


def _duration(timeout_s: float) -> None:
    """ValueError when ``timeout_s`` of a wait for the receipt is no duration: NaN
    spun the wait (the time left was never <= 0), infinity overflowed it."""
    if not 0 <= timeout_s < math.inf:
        raise ValueError(
            f"timeout_s must be 0 or more seconds (a finite number), got {timeout_s!r}"
        )


def _dependency_words(dependencies: frozenset[str] | None) -> str:
    """A step's ``depends_on`` as a call's refusal names it."""
    if dependencies is None:
        return "depends_on left out: the step scheduled before it"
    return f"depends_on={sorted(dependencies)}"


def _generated_number(step_id: str) -> int:
    """The number of a step id of the form the client generates (``NN-tool``), or 0:
    a prefix of ASCII digits only (``int()`` refuses some that ``isdigit()`` accepts,
    such as ``"²"``), and short enough to be a count (``int()`` refuses a prefix over
    4300 digits, and a number that long could not be written in a step id again)."""
    prefix = step_id.split("-", 1)[0]
    if 0 < len(prefix) <= 18 and prefix.isascii() and prefix.isdigit():
        return int(prefix)
    return 0


_JSON_DEPTH = 254
"""How deep lists and objects may nest in arguments: orjson refuses deeper ones, and
the walkers below stop there (a list that holds itself never ends)."""


def _unwritable_path(value: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """Where in ``value`` something JSON cannot hold hides (``args.x[2]``), and what
    it is, or None (asked only once writing the arguments failed)."""
    nested = isinstance(value, (Mapping, list, tuple)) or _is_dataclass_instance(value)
    if nested and depth >= _JSON_DEPTH:
        return path if len(path) <= 80 else f"{path[:80]}...", (
            f"lists and objects nested deeper than {_JSON_DEPTH} levels (one that holds itself?)"
        )
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return path, f"key {k!r} is no string"
            found = _unwritable_path(v, f"{path}.{k}", depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _unwritable_path(v, f"{path}[{i}]", depth + 1)
            if found is not None:
                return found
        return None
    if _is_dataclass_instance(value):
        for k, v in _dataclass_fields(value):
            found = _unwritable_path(v, f"{path}.{k}", depth + 1)
            if found is not None:
                return found
        return None
    try:
        orjson.dumps(value)
    except TypeError as exc:
        return path, f"{type(value).__name__}: {exc}"
    return None


def _non_finite_path(value: Any, path: str, depth: int = 0) -> str | None:
    """Where in ``value`` a NaN or infinity hides (``args.x[2]``), or None (also past
    ``_JSON_DEPTH``: such arguments are refused as JSON cannot hold them)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if depth >= _JSON_DEPTH:
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _non_finite_path(v, f"{path}.{k}", depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _non_finite_path(v, f"{path}[{i}]", depth + 1)
            if found is not None:
                return found
    elif _is_dataclass_instance(value):  # orjson writes it as an object, NaN as null
        for k, v in _dataclass_fields(value):
            found = _non_finite_path(v, f"{path}.{k}", depth + 1)
            if found is not None:
                return found
    return None


def _is_dataclass_instance(value: Any) -> bool:
    """Whether orjson writes ``value`` as a dataclass: its own class is one (not a
    subclass left undecorated, which ``dataclasses.is_dataclass`` counts but orjson
    refuses; not a dataclass type passed as a value)."""
    return not isinstance(value, type) and "__dataclass_fields__" in vars(type(value))


def _dataclass_fields(value: Any) -> list[tuple[str, Any]]:
    """The attributes of a dataclass instance that orjson writes: those of its
    ``__dict__`` (or its fields, with ``slots=True``) not named with a leading ``_``."""
    attrs = getattr(value, "__dict__", None)
    if attrs is None:
        attrs = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return [(k, v) for k, v in attrs.items() if not k.startswith("_")]


class AsyncSaga:
    """A saga inside ``async with client.saga(...) as saga``: ``await saga.call(...)``.

    Every pending call is a future resolved by the client's one listener, so one
    process can hold thousands of sagas in flight on one event loop. Leaving the
    block ends the saga (complete, or abort on an exception) like the sync API.
    """

    def __init__(self, saga: Saga) -> None:
        self._saga = saga

    @property
    def saga_id(self) -> str:
        return self._saga.saga_id

    @property
    def results(self) -> dict[str, Any]:
        return self._saga.results

    async def call(
        self,
        tool: str | ToolSpec | Callable[..., Any],
        /,
        *,
        step_id: str | None = None,
        depends_on: list[str] | None = None,
        timeout_s: float | None = None,
        **args: Any,
    ) -> Any:
        """Run one tool as the next step and return its result (see :meth:`Saga.call`)."""
        return await self._saga.acall(
            tool, step_id=step_id, depends_on=depends_on, timeout_s=timeout_s, **args
        )

    acall = call

    async def resume(self, step_id: str, timeout_s: float | None = None) -> Any:
        """Wait again for a step this saga scheduled, e.g. after ``ApprovalPending``
        left the block with the saga open (see :meth:`Saga.resume`)."""
        return await self._saga.aresume(step_id, timeout_s)

    async def end(self, outcome: SagaOutcome, reason: str = "") -> None:
        await self._saga.end_async(outcome, reason)

    async def wait(self, timeout_s: float = 60.0) -> Receipt:
        """Wait for the terminal record and return its receipt."""
        return await self._saga.await_terminal(timeout_s)

    await_terminal = wait


_STEP_OUTCOMES = (StepCommitted, StepReconciled, StepFailed, StepOutcomeUnknown)


def _may_report(record: Record, step: str, participant: str) -> bool:
    """With identities, whether ``record`` can count for a wait on ``step`` of
    ``participant``: a step's outcome only from that participant (the coordinator
    refuses another's), an incident only from the coordinator or from that participant
    about that step (the coordinator refuses a participant's incident on no step)."""
    producer = record.envelope.producer
    if isinstance(record, _STEP_OUTCOMES):
        return producer == participant
    if isinstance(record, IncidentRaised):
        return producer == _COORDINATOR or (producer == participant and record.step_id == step)
    return True


def _approval_check(step_id: str, participant: str | None) -> Callable[[Record], Any]:
    """What ends a wait for ``step_id``'s approval request: the request, or ``False``
    once the step ended without asking. ``participant``: with identities, the step's
    participant, the only one whose report counts (:func:`_may_report`)."""

    def check(record: Record) -> Any:
        if getattr(record, "step_id", step_id) != step_id:
            return None  # another step's record
        if participant is not None and not _may_report(record, step_id, participant):
            return None  # another participant's report: the coordinator refuses it
        if isinstance(record, ApprovalRequested):
            return record
        if isinstance(record, (StepCommitted, StepFailed, IncidentRaised, SagaTerminal)):
            return False  # the step ended without asking
        return None

    return check


def _tool_name(tool: str | ToolSpec | Callable[..., Any]) -> str:
    if isinstance(tool, str):
        return tool
    if isinstance(tool, ToolSpec):
        return tool.name
    from participants.declarations import tool_declaration

    declared = tool_declaration(getattr(tool, "__func__", tool))
    if declared is not None and getattr(declared, "name", None):
        return str(declared.name)
    return str(getattr(tool, "__name__", tool))
