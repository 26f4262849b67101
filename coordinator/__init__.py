"""The coordinator: a pure decision core (this package's public API) and, around it,
a thin Kafka shell.

The core folds each saga's ledger into ``SagaState`` and decides what to emit::

    from coordinator import decide, tick, Destination

    decision = decide(state, record, now=now_ms)     # state None for a new saga
    for out in decision.outputs:
        ...                                          # route by out.kind
    state = decision.state
    if state is not None and (due := state.next_due_at()) is not None:
        ...                                          # call tick(state, due) then

The shell runs it over Kafka (metrics are optional and come from a layer above)::

    from coordinator import Coordinator

    Coordinator(settings, bootstrap, instance_id="coordinator-0").run()

See docs/coordinator.md for the state machine and the scheduling rules.
"""

from __future__ import annotations

from coordinator.core import (
    COORDINATOR_PRODUCER,
    DEFAULT_POLICY,
    CorePolicy,
    CorrelationError,
    Decision,
    Destination,
    Output,
    RejectReason,
    decide,
    fold,
    record_time,
    retry_delay_ms,
    tick,
)
from coordinator.graph import compensation_order
from coordinator.receipts import build_receipt
from coordinator.shell import Coordinator, ShellMetrics
from coordinator.state import (
    SagaState,
    SagaStatus,
    StepState,
    StepStatus,
    TimerPurpose,
)

__all__ = [
    "COORDINATOR_PRODUCER",
    "DEFAULT_POLICY",
    "Coordinator",
    "CorePolicy",
    "CorrelationError",
    "Decision",
    "Destination",
    "Output",
    "RejectReason",
    "SagaState",
    "SagaStatus",
    "ShellMetrics",
    "StepState",
    "StepStatus",
    "TimerPurpose",
    "build_receipt",
    "compensation_order",
    "decide",
    "fold",
    "record_time",
    "retry_delay_ms",
    "tick",
]
