"""A whole Sagaline system inside one test process, on the real broker.

The coordinator, each participant runtime and the agent's saga client run as they do
in production (own consumers, own producers, real transactions), in threads of the
test process, under a topic prefix of their own. Not a test module; imported by the
end-to-end tests.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.shell import Coordinator
from participants.catalogue import Catalogue
from participants.client import SagaClient
from participants.runtime import ParticipantRuntime
from sagaline.kafka import LedgerReader, Producer, create_producer, ensure_topics
from sagaline.ops.metrics import CoordinatorMetrics, ParticipantMetrics
from schemas import Record, StepRetryScheduled
from schemas.errors import CodecError
from schemas.limits import Limits
from schemas.settings import Settings
from schemas.wire import from_message


class DrivenClock:
    """Epoch ms that only move when the test moves them (:meth:`advance`, or a
    :class:`RetryDriver`): "late" and "past the deadline" are facts of the test, not
    races with a busy machine."""

    def __init__(self) -> None:
        self._now = int(time.time() * 1000)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms

    def advance_to(self, epoch_ms: int) -> None:
        with self._lock:
            self._now = max(self._now, epoch_ms)


class System:
    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        state_dir: Path,
        catalogues: list[Catalogue],
        *,
        hmac_key: bytes | None = b"test-key",
        partitions: int = 2,
        settings_for: Callable[[str], Settings] | None = None,
        limits: Limits | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        """``settings_for(component)`` gives a component its own settings (its own
        identity key): components are "coordinator", "agent" and each catalogue name."""
        self.bootstrap = bootstrap
        self.clock = clock  # drives the coordinator's and participants' time when set
        self.settings = Settings(
            bootstrap=bootstrap,
            topic_prefix=prefix,
            partitions=partitions,
            hmac_key=hmac_key,
            state_dir=state_dir,
            limits=limits or Limits(),
        )
        self.topics = self.settings.topics
        self._settings_for = settings_for or (lambda _component: self.settings)
        self.catalogues = catalogues
        ensure_topics(bootstrap, self.topics, [c.name for c in catalogues], partitions)
        self.coordinator: Coordinator | None = None
        self._threads: list[threading.Thread] = []
        self._runtimes: list[ParticipantRuntime] = []
        self._runtime_threads: dict[int, threading.Thread] = {}
        contracts = {}
        for catalogue in catalogues:
            contracts.update(catalogue.contracts())
        self.client = SagaClient(
            self._settings_for("agent"), bootstrap, contracts=contracts, call_timeout_s=60
        )

    def __enter__(self) -> System:
        self.start_coordinator()
        for catalogue in self.catalogues:
            self.start_participant(catalogue)
        self.client.start()
        return self

    def start_participant(self, catalogue: Catalogue) -> ParticipantRuntime:
        """Start (or restart: same state directory, same journal) one participant."""
        extra: dict[str, Any] = {} if self.clock is None else {"clock": self.clock}
        runtime = ParticipantRuntime(
            catalogue,
            self._settings_for(catalogue.name),
            self.bootstrap,
            metrics=ParticipantMetrics(catalogue.name),
            **extra,
        )
        ready = threading.Event()
        thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
        thread.start()
        assert ready.wait(60), f"participant {catalogue.name} did not start"
        self._runtimes.append(runtime)
        self._threads.append(thread)
        self._runtime_threads[id(runtime)] = thread
        return runtime

    def stop_participant(self, runtime: ParticipantRuntime) -> None:
        """Stop one participant and wait until its loop has closed its journal."""
        runtime.stop()
        self._runtime_threads[id(runtime)].join(30)

    def start_coordinator(self, instance_id: str | None = None) -> None:
        """Start a coordinator; pass the instance id of a stopped one to restart it
        (static membership: it takes the partitions back at once)."""
        self.coordinator = Coordinator(
            self._settings_for("coordinator"),
            self.bootstrap,
            instance_id=instance_id or f"test-{uuid.uuid4().hex[:6]}",
            metrics=CoordinatorMetrics(),
            clock=self.clock,
        )
        thread = threading.Thread(target=self.coordinator.run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Every loop is told to stop before any is waited for: they wind down together.
        for runtime in self._runtimes:
            runtime.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        self.client.close()
        for thread in self._threads:
            thread.join(30)

    # ------------------------------------------------------------------ reading

    def records(self, saga_id: str) -> list[Record]:
        return LedgerReader(self.bootstrap).saga_records(
            self.topics.events, saga_id, self.settings.signer()
        )

    def dlq(self) -> list[tuple[bytes | None, dict[str, bytes]]]:
        out = []
        for key, _value, headers in LedgerReader(self.bootstrap).records(self.topics.dlq):
            pairs = headers.items() if isinstance(headers, dict) else headers or []
            out.append((key, {k: v for k, v in pairs if isinstance(v, bytes)}))
        return out

    def raw_producer(self) -> Producer:
        return create_producer(self.bootstrap)


class RetryDriver:
    """Moves a system's :class:`DrivenClock` (``System(..., clock=...)``) to the due
    time of every retry the coordinator schedules (``StepRetryScheduled`` on the
    ledger) as soon as the schedule is on the ledger: each retry still happens, in the
    same order, after the same backoff on the coordinator's clock, but no test waits
    the backoff out in real time. A context manager around the part that retries."""

    def __init__(self, system: System) -> None:
        assert isinstance(system.clock, DrivenClock), "give the System a DrivenClock"
        self.system = system
        self.clock = system.clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retry-driver", daemon=True)

    def __enter__(self) -> RetryDriver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        signer = self.system.settings.signer()
        reader = LedgerReader(self.system.bootstrap)
        while not self._stop.wait(0.1):
            for key, value, headers in reader.records(self.system.topics.events):
                try:
                    record = from_message(key, value, headers, signer)
                except CodecError:
                    continue
                if isinstance(record, StepRetryScheduled):
                    self.clock.advance_to(record.due_at)


def wait_until(check: Callable[[], Any], timeout_s: float = 60.0, what: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (a condition with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or check}")
        time.sleep(0.2)
