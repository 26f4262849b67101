"""Prometheus metrics shared by the coordinator, the participant runtime and the dashboard.

One place defines every metric (names, labels, buckets), so the coordinator's
``/metrics``, a participant's ``/metrics`` and the dashboard's measures panel mean the
same thing by the same name. The seed-004 measures are *derived from the ledger*: each
process feeds the records it reads or writes to :meth:`SagalineMetrics.observe_record`
/ :meth:`SagalineMetrics.observe_output`, and the metrics object folds them (deduplicated
by ``event_id``, so a record seen twice - an echo of our own output, a redelivery, a
replay - is counted once).

Each metrics object owns its own :class:`prometheus_client.CollectorRegistry`, so a
test (or one process hosting several components) can make as many as it likes.

Example::

    metrics = CoordinatorMetrics()
    start_metrics_server(9464, metrics)
    metrics.observe_record(record)          # every record consumed
    metrics.observe_output(output)          # every record decided/emitted
    metrics.duplicate_prevented()           # a record dropped as a duplicate (R15)
    metrics.dlq("stale-generation")         # a record sent to the DLQ (R16)
    metrics.transaction_committed(0.012, 40)

Metric names are documented in ``docs/operations-dashboard.md``.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.exposition import ThreadingWSGIServer

from coordinator.core import COORDINATOR_PRODUCER
from schemas.models import (
    COMMAND_TYPES,
    ApprovalDenied,
    ApprovalGranted,
    IncidentRaised,
    IncidentResolved,
    ReconcileResult,
    Record,
    SagaEndRequested,
    SagaOutcome,
    SagaTerminal,
    StepCommitted,
    StepFailed,
    StepOutcomeUnknown,
    StepReconciled,
    StepScheduled,
    TerminalStatus,
)
from schemas.receipt import Disposition, Receipt

log = logging.getLogger("sagaline.metrics")

# Durations from a sub-second hiccup to a human settling something the next day.
_RECOVERY_BUCKETS = (
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    900,
    3600,
    4 * 3600,
    24 * 3600,
    float("inf"),
)
_COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, float("inf"))

# How many event ids / finished sagas a process remembers to deduplicate. Beyond this a
# very old redelivery could be counted twice, which a metric tolerates.
_MEMORY = 200_000

# Distinct tool names a process uses as label values; a tool first seen past this is
# counted under ``other`` (logged once): a writer naming thousands of tools (forged,
# or a bug) must not add a time series per name to every scrape.
_MAX_TOOL_LABELS = 1_000
OTHER_TOOL = "other"

# Incident kinds that mean "the reversal window expired before the compensation" (R13).
# Matched loosely ("window" in the kind) so the coordinator's exact spelling is free.
_WINDOW_MARKER = "window"

COMPENSATION_SUCCEEDED = "succeeded"
COMPENSATION_FAILED = "failed"
COMPENSATION_SKIPPED = "skipped"


EffectMeasure = Callable[[StepScheduled], "int | None"]
"""The economic effect of a scheduled step, in cents (None: none or unknown).

What a tool's arguments mean is the application's business, so shared code does not
guess: the deployable passes the measure of its own tools (the refund example's is
``services.refund.economic_effect``). With none, ``remaining_effect`` stays empty."""


class OutputLike(Protocol):
    """What :meth:`SagalineMetrics.observe_output` needs of a coordinator output."""

    @property
    def record(self) -> Record | None: ...

    @property
    def participant(self) -> str | None: ...


@dataclass
class _SagaTrack:
    """What the derived measures need to remember about one saga until it settles."""

    tenant_id: str = ""
    failure_at: int | None = None
    tools: dict[str, str] = field(default_factory=dict)  # step_id -> tool
    amounts: dict[str, int] = field(default_factory=dict)  # step_id -> cents (the effect measure)
    unknown_since: dict[str, int] = field(default_factory=dict)  # step_id -> ms
    incident_steps: dict[str, str] = field(default_factory=dict)  # incident_id -> step_id
    open_after_terminal: set[str] = field(default_factory=set)  # incident ids
    terminal: bool = False


class SagalineMetrics:
    """The metrics of one process (``component`` says which), in its own registry."""

    def __init__(
        self,
        component: str,
        registry: CollectorRegistry | None = None,
        *,
        effect: EffectMeasure | None = None,
    ) -> None:
        self.component = component
        self._effect = effect
        self._effect_failed = False  # logged at WARNING once
        self._tool_labels: set[str] = set()
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._lock = threading.Lock()
        # Label children of the per-record and per-batch metrics: ``labels()`` checks
        # and locks on every call, and a coordinator calls it for every record.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Records folded, by writer and event id: another writer's record under the same
        # id (an operator's decision id is predictable) is another fact, as the
        # coordinator with bound writers takes it (``coordinator.core.dedup_key``).
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._sagas: OrderedDict[str, _SagaTrack] = OrderedDict()
        self._receipts: OrderedDict[tuple[str, int], None] = OrderedDict()
        # incident id -> (tenant, cents) still changed in the world
        self._remaining: dict[str, tuple[str, int]] = {}

        # ---- seed 004 measures
        self.time_in_unknown = Histogram(
            "sagaline_time_in_unknown_state_seconds",
            "From StepOutcomeUnknown to the step being settled (reconciled, committed, "
            "failed or resolved by a person), by tool (R11).",
            ["tool"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.time_to_recovery = Histogram(
            "sagaline_time_to_acceptable_recovery_seconds",
            "From a saga's first failure signal to an acceptable state: COMPLETED or "
            "COMPENSATED, or the last incident of an ESCALATED saga resolved.",
            ["status"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.compensation_outcomes = Counter(
            "sagaline_compensation_outcomes",
            "Compensations by tool and result (succeeded | failed | skipped), from receipts "
            "(R8, R12).",
            ["tool", "result"],
            registry=r,
        )
        self.duplicates_prevented = Counter(
            "sagaline_duplicates_prevented",
            "Records recognised as duplicates and not acted on again (R15), by component.",
            ["component"],
            registry=r,
        )
        self.manual_interventions = Counter(
            "sagaline_manual_interventions",
            "Operator actions recorded in the ledger: approval_granted, approval_denied, "
            "incident_resolved.",
            ["action"],
            registry=r,
        )
        self.expired_windows = Counter(
            "sagaline_expired_reversal_windows",
            "Incidents raised because a reversal window expired before compensation (R13).",
            ["tool"],
            registry=r,
        )
        self.remaining_effect = Gauge(
            "sagaline_remaining_economic_effect_cents",
            "Economic effect (cents, by the deployment's effect measure) of escalated "
            "effects still changed in the world, by tenant, until their incident is resolved.",
            ["tenant"],
            registry=r,
        )
        self.disclosure_latency = Histogram(
            "sagaline_disclosure_latency_seconds",
            "From a saga's first failure signal to its terminal record (what the user is "
            "told), by terminal status.",
            ["status"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.sagas_terminal = Counter(
            "sagaline_sagas_terminal",
            "Sagas that reached a terminal status (R14).",
            ["status"],
            registry=r,
        )
        # ---- plumbing
        self.records_processed = Counter(
            "sagaline_records_processed",
            "Records consumed and processed, by record type.",
            ["component", "type"],
            registry=r,
        )
        self.records_emitted = Counter(
            "sagaline_records_emitted",
            "Ledger records produced, by record type.",
            ["component", "type"],
            registry=r,
        )
        self.commands_emitted = Counter(
            "sagaline_commands_emitted",
            "Commands sent to participants, by participant and command type.",
            ["participant", "type"],
            registry=r,
        )
        self.dlq_records = Counter(
            "sagaline_dlq_records",
            "Records sent to the dead-letter topic, by reason (R16).",
            ["component", "reason"],
            registry=r,
        )
        self.consumer_lag = Gauge(
            "sagaline_consumer_lag_records",
            "High watermark minus position, by topic and partition.",
            ["component", "topic", "partition"],
            registry=r,
        )
        self.commit_latency = Histogram(
            "sagaline_transaction_commit_seconds",
            "Wall time of one read-process-write transaction, begin to commit.",
            ["component"],
            buckets=_COMMIT_BUCKETS,
            registry=r,
        )
        self.transaction_records = Counter(
            "sagaline_transaction_records",
            "Input records committed inside transactions.",
            ["component"],
            registry=r,
        )
        self.sagas_in_flight = Gauge(
            "sagaline_sagas_in_flight",
            "Sagas held in memory, not yet terminal.",
            ["component"],
            registry=r,
        )

    # ------------------------------------------------------------- entry points

    def observe_record(self, record: Record) -> None:
        """A record was consumed and processed: count it and fold it into the measures."""
        self._child(self.records_processed, self.component, record.TYPE).inc()
        self._fold(record)

    def observe_output(self, output: OutputLike | Record) -> None:
        """A record was decided/produced. Commands count per participant; ledger records
        fold into the measures (a SagaTerminal's receipt included)."""
        if isinstance(output, Record):
            record: Record | None = output
            participant = None
        else:
            record, participant = output.record, output.participant
        if record is None:
            return
        if isinstance(record, COMMAND_TYPES):
            self._child(self.commands_emitted, participant or "unknown", record.TYPE).inc()
            return
        self._child(self.records_emitted, self.component, record.TYPE).inc()
        self._fold(record)

    def observe_receipt(self, receipt: Receipt) -> None:
        """Fold a terminal receipt (once per saga and generation)."""
        with self._lock:
            self._observe_receipt(receipt, failure_at=None)

    def duplicate_prevented(self, count: int = 1) -> None:
        self._child(self.duplicates_prevented, self.component).inc(count)

    def dlq(self, reason: str) -> None:
        self.dlq_records.labels(self.component, reason).inc()

    def set_consumer_lag(self, topic: str, partition: int, lag: int) -> None:
        self.consumer_lag.labels(self.component, topic, str(partition)).set(max(lag, 0))

    def transaction_committed(self, seconds: float, records: int) -> None:
        self._child(self.commit_latency, self.component).observe(seconds)
        self._child(self.transaction_records, self.component).inc(records)

    def in_flight(self, sagas: int) -> None:
        self._child(self.sagas_in_flight, self.component).set(sagas)

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once (children are never removed)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> MeasuresSnapshot:
        """The current values, for the dashboard's measures panel."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), s.value))

        def by(name: str, *labels: str) -> dict[tuple[str, ...], float]:
            out: dict[tuple[str, ...], float] = {}
            for lab, value in samples.get(name, []):
                key = tuple(lab.get(k, "") for k in labels)
                out[key] = out.get(key, 0.0) + value
            return out

        def hist(name: str, label: str) -> dict[str, HistogramSummary]:
            counts = by(name + "_count", label)
            sums = by(name + "_sum", label)
            return {k[0]: HistogramSummary(int(counts[k]), sums.get(k, 0.0)) for k in counts}

        return MeasuresSnapshot(
            time_in_unknown=hist("sagaline_time_in_unknown_state_seconds", "tool"),
            time_to_recovery=hist("sagaline_time_to_acceptable_recovery_seconds", "status"),
            compensation_outcomes={
                (k[0], k[1]): int(v)
                for k, v in by("sagaline_compensation_outcomes_total", "tool", "result").items()
            },
            duplicates_prevented={
                k[0]: int(v)
                for k, v in by("sagaline_duplicates_prevented_total", "component").items()
            },
            manual_interventions={
                k[0]: int(v) for k, v in by("sagaline_manual_interventions_total", "action").items()
            },
            expired_windows=int(
                sum(by("sagaline_expired_reversal_windows_total", "tool").values())
            ),
            remaining_effect_cents={
                k[0]: int(v)
                for k, v in by("sagaline_remaining_economic_effect_cents", "tenant").items()
            },
            disclosure_latency=hist("sagaline_disclosure_latency_seconds", "status"),
            sagas_terminal={
                k[0]: int(v) for k, v in by("sagaline_sagas_terminal_total", "status").items()
            },
            records_processed=int(sum(by("sagaline_records_processed_total", "type").values())),
            dlq_records={
                k[0]: int(v) for k, v in by("sagaline_dlq_records_total", "reason").items()
            },
        )

    # ----------------------------------------------------------------- the fold

    def _fold(self, record: Record) -> None:
        with self._lock:
            key = (record.envelope.producer, record.event_id)
            if key in self._seen:
                return
            self._seen[key] = None
            if len(self._seen) > _MEMORY:
                self._seen.popitem(last=False)
            self._fold_new(record)

    def _track(self, record: Record) -> _SagaTrack:
        track = self._sagas.get(record.saga_id)
        if track is None:
            track = self._sagas[record.saga_id] = _SagaTrack(tenant_id=record.envelope.tenant_id)
            if len(self._sagas) > _MEMORY:
                self._sagas.popitem(last=False)
        return track

    def _fold_new(self, record: Record) -> None:
        track = self._track(record)
        at = record.envelope.occurred_at

        if isinstance(record, StepScheduled):
            track.tools[record.step_id] = record.contract.tool
            amount = self._measure_effect(record)
            if amount is not None:
                track.amounts[record.step_id] = amount
        elif isinstance(record, StepOutcomeUnknown):
            track.tools.setdefault(record.step_id, record.tool)
            track.unknown_since.setdefault(record.step_id, at)
            _first_failure(track, at)
        elif isinstance(record, StepReconciled):
            if record.outcome is not ReconcileResult.PENDING:
                self._settle_unknown(track, record.step_id, at)
        elif isinstance(record, StepCommitted):
            self._settle_unknown(track, record.step_id, at)
        elif isinstance(record, StepFailed):
            self._settle_unknown(track, record.step_id, at)
            _first_failure(track, at)
        elif isinstance(record, ApprovalGranted):
            self.manual_interventions.labels("approval_granted").inc()
        elif isinstance(record, ApprovalDenied):
            if record.envelope.producer == COORDINATOR_PRODUCER:
                return  # a request the coordinator withdrew: no one intervened
            self.manual_interventions.labels("approval_denied").inc()
            _first_failure(track, at)
        elif isinstance(record, SagaEndRequested):
            if record.outcome is SagaOutcome.ABORT:
                _first_failure(track, at)
        elif isinstance(record, IncidentRaised):
            _first_failure(track, at)
            if record.step_id is not None:
                track.incident_steps[record.incident_id] = record.step_id
            if _WINDOW_MARKER in record.kind.lower():
                tool = record.tool or track.tools.get(record.step_id or "", "unknown")
                self.expired_windows.labels(self._tool(tool)).inc()
        elif isinstance(record, IncidentResolved):
            if record.envelope.tenant_id != track.tenant_id:
                return  # another tenant's: refused by the coordinator, no intervention
            self.manual_interventions.labels("incident_resolved").inc()
            self._resolve_incident(track, record.incident_id, at)
        elif isinstance(record, SagaTerminal):
            try:
                receipt = Receipt.from_json(record.receipt)
            except ValueError:
                return  # an unreadable receipt is the codec's problem, not a metric's
            self._observe_receipt(receipt, failure_at=track.failure_at)

    def _tool(self, tool: str) -> str:
        """``tool`` as a label value: the first :data:`_MAX_TOOL_LABELS` names seen are
        their own, later ones ``other`` (called under ``self._lock``)."""
        if tool in self._tool_labels:
            return tool
        if len(self._tool_labels) < _MAX_TOOL_LABELS:
            self._tool_labels.add(tool)
            return tool
        if OTHER_TOOL not in self._tool_labels:  # logged once
            self._tool_labels.add(OTHER_TOOL)
            log.warning(
                "more than %d tool names seen (the last: %.100r); further ones are "
                "counted under tool=%r (a writer naming tools no catalogue declares?)",
                _MAX_TOOL_LABELS,
                tool,
                OTHER_TOOL,
            )
        return OTHER_TOOL

    def _measure_effect(self, record: StepScheduled) -> int | None:
        """The deployment's effect measure of ``record``; one that raises (arguments
        it did not expect) measures nothing for that step, logged once: a metric must
        never stop the process that feeds it, nor the step's record (R16)."""
        if self._effect is None:
            return None
        try:
            amount = self._effect(record)
        except Exception as exc:
            level = logging.DEBUG if self._effect_failed else logging.WARNING
            self._effect_failed = True
            log.log(
                level,
                "the economic effect measure failed on step %s of saga %s (%s: %s); no "
                "amount is counted for it (further failures are logged at DEBUG)",
                record.step_id,
                record.saga_id,
                type(exc).__name__,
                exc,
            )
            return None
        return amount

    def _settle_unknown(self, track: _SagaTrack, step_id: str, at: int) -> None:
        since = track.unknown_since.pop(step_id, None)
        if since is not None:
            tool = self._tool(track.tools.get(step_id, "unknown"))
            self.time_in_unknown.labels(tool).observe(max(at - since, 0) / 1000)

    def _resolve_incident(self, track: _SagaTrack, incident_id: str, at: int) -> None:
        step_id = track.incident_steps.get(incident_id)
        if step_id is not None:
            self._settle_unknown(track, step_id, at)
        remaining = self._remaining.pop(incident_id, None)
        if remaining is not None:
            self.remaining_effect.labels(remaining[0]).dec(remaining[1])
        if incident_id in track.open_after_terminal:
            track.open_after_terminal.discard(incident_id)
            if not track.open_after_terminal and track.failure_at is not None:
                self.time_to_recovery.labels(TerminalStatus.ESCALATED.value).observe(
                    max(at - track.failure_at, 0) / 1000
                )

    def _observe_receipt(self, receipt: Receipt, *, failure_at: int | None) -> None:
        key = (receipt.saga_id, receipt.generation)
        if key in self._receipts:
            return
        self._receipts[key] = None
        if len(self._receipts) > _MEMORY:
            self._receipts.popitem(last=False)
        track = self._sagas.get(receipt.saga_id) or _SagaTrack(tenant_id=receipt.tenant_id)
        self._sagas[receipt.saga_id] = track
        track.terminal = True
        status = receipt.status.value
        self.sagas_terminal.labels(status).inc()

        for step in receipt.steps:
            if step.compensation is None:
                continue
            if step.disposition is Disposition.COMPENSATED:
                tool = self._tool(step.tool)
                self.compensation_outcomes.labels(tool, COMPENSATION_SUCCEEDED).inc()
            elif step.disposition is Disposition.ESCALATED:
                result = COMPENSATION_FAILED if step.compensation_attempts else COMPENSATION_SKIPPED
                self.compensation_outcomes.labels(self._tool(step.tool), result).inc()

        if receipt.status is TerminalStatus.ESCALATED:
            resolved = {i.incident_id for i in receipt.incidents if i.resolved}
            for step in receipt.steps:
                if step.disposition is not Disposition.ESCALATED:
                    continue
                cents = track.amounts.get(step.step_id)
                incident = step.incident_id or f"{receipt.saga_id}/{step.step_id}"
                if cents and incident not in resolved and incident not in self._remaining:
                    self._remaining[incident] = (receipt.tenant_id, cents)
                    self.remaining_effect.labels(receipt.tenant_id).inc(cents)
            track.open_after_terminal = {i.incident_id for i in receipt.incidents if not i.resolved}

        failure = failure_at if failure_at is not None else track.failure_at
        if failure is not None:
            elapsed = max(receipt.ended_at - failure, 0) / 1000
            self.disclosure_latency.labels(status).observe(elapsed)
            if receipt.status is not TerminalStatus.ESCALATED or not track.open_after_terminal:
                self.time_to_recovery.labels(status).observe(elapsed)


def _first_failure(track: _SagaTrack, at: int) -> None:
    if track.failure_at is None or at < track.failure_at:
        track.failure_at = at


@dataclass(frozen=True)
class HistogramSummary:
    count: int
    sum_seconds: float

    @property
    def mean_seconds(self) -> float | None:
        return self.sum_seconds / self.count if self.count else None


@dataclass(frozen=True)
class MeasuresSnapshot:
    """Plain values of the seed-004 measures at one moment."""

    time_in_unknown: dict[str, HistogramSummary]
    time_to_recovery: dict[str, HistogramSummary]
    compensation_outcomes: dict[tuple[str, str], int]
    duplicates_prevented: dict[str, int]
    manual_interventions: dict[str, int]
    expired_windows: int
    remaining_effect_cents: dict[str, int]
    disclosure_latency: dict[str, HistogramSummary]
    sagas_terminal: dict[str, int]
    records_processed: int
    dlq_records: dict[str, int]

    def compensation_success_by_tool(self) -> dict[str, tuple[int, int]]:
        """tool -> (succeeded, attempted-or-owed)."""
        out: dict[str, tuple[int, int]] = {}
        for (tool, result), n in self.compensation_outcomes.items():
            ok, total = out.get(tool, (0, 0))
            out[tool] = (ok + (n if result == COMPENSATION_SUCCEEDED else 0), total + n)
        return out


class CoordinatorMetrics(SagalineMetrics):
    """The coordinator's metrics (component ``coordinator``)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, effect: EffectMeasure | None = None
    ) -> None:
        super().__init__("coordinator", registry, effect=effect)


class ParticipantMetrics(SagalineMetrics):
    """A participant runtime's metrics (component ``participant:<name>``)."""

    def __init__(
        self,
        participant: str,
        registry: CollectorRegistry | None = None,
        *,
        effect: EffectMeasure | None = None,
    ) -> None:
        super().__init__(f"participant:{participant}", registry, effect=effect)


def start_metrics_server(
    port: int,
    metrics: SagalineMetrics,
    addr: str = "127.0.0.1",
    *,
    health: Callable[[], str | None] | None = None,
) -> int:
    """Serve ``/metrics`` for ``metrics`` on a daemon thread; returns the bound port
    (pass 0 for a free one). Loopback unless told otherwise (``SAGALINE_METRICS_HOST``):
    the numbers name tools and tenants.

    With ``health``, ``/healthz`` answers 200 ``ok`` while it returns None and 503
    with the reason it returns otherwise (starting, stopping): what a healthcheck
    probes, since ``/metrics`` answers from the moment the server starts."""
    try:
        if health is None:
            server, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
        else:
            server = _serve_with_health(port, addr, metrics, health)
    except OSError as exc:  # in use, an address not of this host, a name that does not resolve
        raise MetricsServerError(
            f"cannot serve metrics on {addr}:{port} (--metrics-port {port}, "
            f"SAGALINE_METRICS_HOST={addr}): {exc.strerror or exc}"
        ) from None
    return int(server.server_address[1])


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Not every scrape and probe in the log."""


def _serve_with_health(
    port: int, addr: str, metrics: SagalineMetrics, health: Callable[[], str | None]
) -> WSGIServer:
    """prometheus_client's server (``start_http_server``) with ``/healthz`` beside."""
    scrape = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") != "/healthz":
            return scrape(environ, start_response)
        try:
            why = health()
        except Exception as exc:  # a probe must get an answer, not a dropped connection
            why = f"health check failed: {exc}"
        status = "200 OK" if why is None else "503 Service Unavailable"
        body = b"ok\n" if why is None else why.encode("utf-8", "replace") + b"\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class MetricsServerError(Exception):
    """The metrics server could not listen where it was told to."""
