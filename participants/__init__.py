"""The participant SDK: tools declare how their effects are undone, next to their
schema, and ``wrap()`` checks every declaration before anything runs (R4).

The Python twin of seed 000's ``reserveInventory`` / ``releaseInventory``::

    from participants import (
        CompensationContext, LookupResult, Reversibility,
        compensable, compensation, tool, wrap,
    )

    class Inventory:
        @tool(description="Reserve inventory", lookup="find_reservation",
              resources=("inventory",))
        @compensable(by="release_inventory")
        def reserve_inventory(self, sku: str) -> str:
            return self.store.reserve(sku)          # "res-8891": return the handle

        @compensation
        def release_inventory(self, ctx: CompensationContext) -> None:
            self.store.release(ctx.result)          # ctx.input == {"sku": ...}

        def find_reservation(self, idempotency_key: str) -> LookupResult | None:
            found = self.store.by_key(idempotency_key)
            return LookupResult.committed(found) if found else None

        @tool(description="Send a wire transfer")
        @compensable(reversibility=Reversibility.IRREVERSIBLE)
        def send_wire_transfer(self, amount: str, to: str) -> str: ...

    catalogue = wrap(Inventory(), name="inventory")   # raises CatalogueError on a typo
    catalogue.tool_definitions()                      # JSON Schema for the model
    catalogue["reserve_inventory"].contract()         # StepContract for the ledger

Serve a catalogue over Kafka with ``ParticipantRuntime(catalogue, settings,
bootstrap).run()``; call tools from an agent with ``SagaClient`` (``participants.client``).

Check a catalogue from the shell with ``sagaline catalogue check MODULE`` and a
proposed plan with ``sagaline plan check FILE`` (``docs/writing-a-participant.md``).
"""

from __future__ import annotations

from participants.catalogue import Catalogue, ToolKind, ToolSpec, wrap
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
from participants.context import CallContext, NoCallContext, call_context, current_call
from participants.declarations import (
    Accepted,
    BusinessRejection,
    CompensationApproval,
    CompensationContext,
    LookupResult,
    ReconcileResult,
    RetryPolicy,
    Reversibility,
    TransientError,
    compensable,
    compensation,
    tool,
)
from participants.errors import (
    CatalogueError,
    CatalogueProblem,
    ContractChanged,
    ContractViolation,
    InvalidArgumentsError,
    LedgerRefError,
    NotDeclaredError,
    SagalineParticipantError,
    UnknownToolError,
)
from participants.plan import (
    CallClass,
    Finding,
    FindingCode,
    PlannedCall,
    PlanReport,
    Severity,
    check_plan,
)
from participants.readiness import CoordinatorNotRunning
from participants.runtime import ParticipantRuntime, RuntimeMetrics

__all__ = [
    "Accepted",
    "AmbiguousTool",
    "ApprovalDeniedError",
    "ApprovalPending",
    "BusinessRejected",
    "BusinessRejection",
    "CallClass",
    "CallContext",
    "CallRefused",
    "Catalogue",
    "CatalogueError",
    "CatalogueProblem",
    "ClientStopped",
    "CompensationApproval",
    "CompensationContext",
    "ContractChanged",
    "ContractViolation",
    "CoordinatorNotRunning",
    "Finding",
    "FindingCode",
    "InvalidArgumentsError",
    "InvalidSagaId",
    "LedgerRefError",
    "LookupResult",
    "NoCallContext",
    "NotDeclaredError",
    "OutcomeUnknown",
    "ParticipantRuntime",
    "PlanReport",
    "PlannedCall",
    "ReconcileResult",
    "ResultTooLarge",
    "RetryPolicy",
    "Reversibility",
    "RuntimeMetrics",
    "Saga",
    "SagaCallError",
    "SagaClient",
    "SagaHistoryUnreadable",
    "SagaParked",
    "SagaUnwinding",
    "SagalineParticipantError",
    "Severity",
    "StepEscalated",
    "StepFailedError",
    "ToolKind",
    "ToolSpec",
    "TransientError",
    "UnknownTool",
    "UnknownToolError",
    "call_context",
    "check_plan",
    "compensable",
    "compensation",
    "current_call",
    "tool",
    "wrap",
]
