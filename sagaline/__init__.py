"""Sagaline: recoverable side effects for AI-agent tool calls, over Kafka.

The one place to import from::

    import sagaline

    @sagaline.compensable(by=release_seat, args=lambda ctx: {"reservation_id": ctx.result})
    def reserve_seat(flight: str) -> str: ...

    with sagaline.connect(reserve_seat, name="trip", coordinator=True) as client:
        with client.saga("trip", principal="agent:me") as saga:
            saga.call(reserve_seat, flight="LX38")
        print(saga.wait().status)

Everything is imported on first use (a module ``__getattr__``), so ``import
sagaline`` is cheap and ``import sagaline.kafka`` pulls in no upper layer.
``docs/quickstart.md`` walks from ``pip install`` to a compensated saga.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from participants.catalogue import Catalogue, ToolSpec, wrap
    from participants.client import (
        AmbiguousTool,
        ApprovalDeniedError,
        ApprovalPending,
        BusinessRejected,
        CallRefused,
        ClientStopped,
        InvalidSagaId,
        OutcomeUnknown,
        ResultTooLarge,
        Saga,
        SagaCallError,
        SagaClient,
        SagaHistoryUnreadable,
        SagaParked,
        SagaUnwinding,
        StepEscalated,
        StepFailedError,
        UnknownTool,
    )
    from participants.declarations import (
        Accepted,
        BusinessRejection,
        CompensationApproval,
        CompensationContext,
        LookupResult,
        RetryPolicy,
        Reversibility,
        TransientError,
        compensable,
        compensation,
        tool,
    )
    from participants.errors import CatalogueError
    from participants.plan import check_plan
    from participants.readiness import CoordinatorNotRunning
    from sagaline._session import StartError, connect
    from schemas.models import SagaOutcome, TerminalStatus
    from schemas.receipt import Disposition, Receipt
    from schemas.settings import Settings

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "Accepted",
            "BusinessRejection",
            "CompensationApproval",
            "CompensationContext",
            "LookupResult",
            "RetryPolicy",
            "Reversibility",
            "TransientError",
            "compensable",
            "compensation",
            "tool",
        ),
        "participants.declarations",
    ),
    "Catalogue": "participants.catalogue",
    "ToolSpec": "participants.catalogue",
    "wrap": "participants.catalogue",
    "CatalogueError": "participants.errors",
    "check_plan": "participants.plan",
    **dict.fromkeys(
        (
            "AmbiguousTool",
            "ApprovalDeniedError",
            "ApprovalPending",
            "BusinessRejected",
            "CallRefused",
            "ClientStopped",
            "InvalidSagaId",
            "OutcomeUnknown",
            "ResultTooLarge",
            "Saga",
            "SagaCallError",
            "SagaClient",
            "SagaHistoryUnreadable",
            "SagaParked",
            "SagaUnwinding",
            "StepEscalated",
            "StepFailedError",
            "UnknownTool",
        ),
        "participants.client",
    ),
    "CoordinatorNotRunning": "participants.readiness",
    "StartError": "sagaline._session",
    "connect": "sagaline._session",
    "SagaOutcome": "schemas.models",
    "TerminalStatus": "schemas.models",
    "Disposition": "schemas.receipt",
    "Receipt": "schemas.receipt",
    "Settings": "schemas.settings",
}

__all__ = [
    "Accepted",
    "AmbiguousTool",
    "ApprovalDeniedError",
    "ApprovalPending",
    "BusinessRejected",
    "BusinessRejection",
    "CallRefused",
    "Catalogue",
    "CatalogueError",
    "ClientStopped",
    "CompensationApproval",
    "CompensationContext",
    "CoordinatorNotRunning",
    "Disposition",
    "InvalidSagaId",
    "LookupResult",
    "OutcomeUnknown",
    "Receipt",
    "ResultTooLarge",
    "RetryPolicy",
    "Reversibility",
    "Saga",
    "SagaCallError",
    "SagaClient",
    "SagaHistoryUnreadable",
    "SagaOutcome",
    "SagaParked",
    "SagaUnwinding",
    "Settings",
    "StartError",
    "StepEscalated",
    "StepFailedError",
    "TerminalStatus",
    "ToolSpec",
    "TransientError",
    "UnknownTool",
    "__version__",
    "check_plan",
    "compensable",
    "compensation",
    "connect",
    "tool",
    "wrap",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("sagaline")
        except PackageNotFoundError:  # a source checkout that was never installed
            return "0+unknown"
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sagaline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
