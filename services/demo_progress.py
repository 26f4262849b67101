"""Following a demo run on the ledger: saga statuses, the operator, the live display.

One consumer reads the run's ``sagaline.events`` from the beginning (the topic prefix
is unique to the run, so it sees this run only) and hands each record to

* :class:`SagaBoard`, a fold of records into one status per saga (running, awaiting
  approval, compensating, then the terminal status), which the display draws;
* :class:`DemoOperator`, which answers each ``ApprovalRequested`` through
  ``sagaline.ops.actions.grant_approval`` -- the same records a person writes
  with ``sagaline approve`` or the dashboard -- under the identity ``demo-operator``.

The display redraws a progress bar and a status table in place with plain ANSI when
stdout is a terminal, and prints one line every few seconds otherwise.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from sagaline.kafka import (
    OFFSET_BEGINNING,
    KafkaException,
    TopicPartition,
    create_consumer,
    headers_of,
)
from sagaline.ops.actions import OperatorActionError, OperatorChannel, grant_approval
from schemas.errors import CodecError
from schemas.models import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    CompensationRequested,
    IncidentRaised,
    Record,
    SagaStarted,
    SagaTerminal,
)
from schemas.signing import Signer
from schemas.wire import from_message

__all__ = [
    "STATUSES",
    "DemoOperator",
    "LedgerFollower",
    "ProgressDisplay",
    "SagaBoard",
]

RUNNING = "running"
AWAITING = "awaiting approval"
COMPENSATING = "compensating"
COMPLETED = "completed"
COMPENSATED = "compensated"
ESCALATED = "escalated"
STATUSES: tuple[str, ...] = (RUNNING, AWAITING, COMPENSATING, COMPLETED, COMPENSATED, ESCALATED)
TERMINAL: frozenset[str] = frozenset({COMPLETED, COMPENSATED, ESCALATED})


class SagaBoard:
    """Status per saga, folded from the ledger; thread-safe, waitable."""

    def __init__(self) -> None:
        self._status: dict[str, str] = {}
        self._terminal: dict[str, SagaTerminal] = {}
        self.incidents: dict[str, list[IncidentRaised]] = {}
        self.failure: str | None = None  # why the board stopped hearing of the ledger
        self._cond = threading.Condition()

    def abandon(self, reason: str) -> None:
        """No more records will come (the ledger follower failed): every wait ends
        now, returning False, and :attr:`failure` says why."""
        with self._cond:
            self.failure = reason
            self._cond.notify_all()

    def apply(self, record: Record) -> None:
        with self._cond:
            saga = record.saga_id
            current = self._status.get(saga)
            if current in TERMINAL:
                return
            if isinstance(record, SagaTerminal):
                self._status[saga] = record.status.value.lower()
                self._terminal[saga] = record
                self._cond.notify_all()
            elif isinstance(record, SagaStarted):
                self._status.setdefault(saga, RUNNING)
            elif isinstance(record, CompensationRequested):
                self._status[saga] = COMPENSATING
            elif isinstance(record, ApprovalRequested) and current != COMPENSATING:
                self._status[saga] = AWAITING
            elif isinstance(record, (ApprovalGranted, ApprovalDenied)) and current == AWAITING:
                self._status[saga] = RUNNING
            elif isinstance(record, IncidentRaised):
                self.incidents.setdefault(saga, []).append(record)
            elif current is None:
                self._status[saga] = RUNNING

    def counts(self) -> Counter[str]:
        with self._cond:
            return Counter(self._status.values())

    def status(self, saga_id: str) -> str | None:
        with self._cond:
            return self._status.get(saga_id)

    def terminal(self) -> dict[str, SagaTerminal]:
        with self._cond:
            return dict(self._terminal)

    def terminal_count(self) -> int:
        with self._cond:
            return len(self._terminal)

    def wait_terminal(self, saga_ids: set[str], timeout_s: float) -> bool:
        """Block until every saga in ``saga_ids`` is terminal (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not saga_ids <= self._terminal.keys():
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None:
                    return False
                self._cond.wait(min(left, 1.0))
            return True

    def wait_count(self, count: int, timeout_s: float) -> bool:
        """Block until at least ``count`` sagas are terminal."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._terminal) < count:
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None:
                    return False
                self._cond.wait(min(left, 1.0))
            return True


class LedgerFollower:
    """One background consumer of the run's ledger, fanning records out to handlers.

    If it cannot follow the ledger (no metadata, no such topic, a handler raised) it
    stops, sets :attr:`failure` and calls ``on_failure`` with the reason, so nobody
    waits for records that will never come."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        signer: Signer,
        handlers: list[Callable[[Record], None]],
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.signer = signer
        self.handlers = handlers
        self.on_failure = on_failure
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-follower", daemon=True)
        self.records = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as exc:  # not a thread traceback: the waiters learn why
            error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
            text = getattr(error, "str", None)
            words = text() if callable(text) else exc
            self.failure = f"cannot follow the ledger {self.topic}: {words}"
            if self.on_failure is not None:
                self.on_failure(self.failure)

    def _follow(self) -> None:
        consumer = create_consumer(self.bootstrap, f"demo-follower-{uuid.uuid4().hex[:8]}")
        try:
            meta = consumer.list_topics(self.topic, timeout=30).topics[self.topic]
            if meta.error is not None or not meta.partitions:
                raise LookupError(f"no such topic on {self.bootstrap} ({meta.error})")
            consumer.assign(
                [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions]
            )
            while not self._stop.is_set():
                for msg in consumer.consume(500, 0.2):
                    if msg.error() is not None:
                        continue
                    try:
                        record = from_message(msg.key(), msg.value(), headers_of(msg), self.signer)
                    except CodecError:
                        continue  # the coordinator dead-letters it; not the demo's concern
                    self.records += 1
                    for handler in self.handlers:
                        handler(record)
        finally:
            consumer.close()


class DemoOperator:
    """Approves every pending approval request, as a person would, and says so."""

    def __init__(self, channel: OperatorChannel, identity: str = "demo-operator") -> None:
        self.channel = channel
        self.identity = identity
        self.granted = 0
        self.errors: list[str] = []
        self._answered: set[str] = set()
        self._queue: queue.Queue[ApprovalRequested | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="demo-operator", daemon=True)

    def observe(self, record: Record) -> None:
        if isinstance(record, (ApprovalGranted, ApprovalDenied)):
            self._answered.add(record.approval_id)
        elif isinstance(record, ApprovalRequested) and record.approval_id not in self._answered:
            self._answered.add(record.approval_id)
            self._queue.put(record)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(15)
        self.channel.close()

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                grant_approval(self.channel, request, operator=self.identity, via="demo")
                self.granted += 1
            except OperatorActionError as exc:
                self.errors.append(str(exc))


# --------------------------------------------------------------------- display


@dataclass
class ProgressDisplay:
    """A bar and a table that redraw in place on a terminal, or periodic log lines."""

    board: SagaBoard
    total: int
    live: bool
    out: TextIO = sys.stdout
    interval_s: float = 0.25
    line_interval_s: float = 5.0

    def __post_init__(self) -> None:
        self._lines_drawn = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="demo-display", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.draw(final=True)

    def log(self, message: str) -> None:
        """Print a line above the live table (or just print it)."""
        with self._lock:
            self._clear()
            print(message, file=self.out, flush=True)
        if self.live:
            self.draw()

    def _run(self) -> None:
        wait = self.interval_s if self.live else self.line_interval_s
        while not self._stop.wait(wait):
            self.draw()

    def draw(self, final: bool = False) -> None:
        with self._lock:
            counts = self.board.counts()
            done = sum(counts[s] for s in TERMINAL)
            elapsed = time.monotonic() - self._started
            if not self.live:
                table = "  ".join(f"{s} {counts[s]}" for s in STATUSES)
                print(
                    f"progress: {done}/{self.total} terminal after {elapsed:.0f} s | {table}",
                    file=self.out,
                    flush=True,
                )
                return
            self._clear()
            lines = self.render(counts, elapsed)
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
            self._lines_drawn = 0 if final else len(lines)

    def render(self, counts: Counter[str], elapsed: float) -> list[str]:
        done = sum(counts[s] for s in TERMINAL)
        width = 40
        filled = int(width * done / self.total) if self.total else width
        rate = done / elapsed if elapsed > 0 else 0.0
        bar = "\x1b[32m" + "█" * filled + "\x1b[2m" + "░" * (width - filled) + "\x1b[0m"
        lines = [
            f" {bar} {done}/{self.total} terminal  {elapsed:5.1f} s  {rate:5.1f} sagas/s",
            "",
        ]
        colours = {COMPLETED: "32", COMPENSATED: "33", ESCALATED: "31", COMPENSATING: "35"}
        for status in STATUSES:
            n = counts[status]
            colour = colours.get(status, "36")
            lines.append(f"   \x1b[{colour}m{status:<18}\x1b[0m {n:>6}")
        return lines

    def _clear(self) -> None:
        if self.live and self._lines_drawn:
            # Move up to the first line of the table and clear to the end of the screen.
            self.out.write(f"\x1b[{self._lines_drawn}F\x1b[J")
            self._lines_drawn = 0
