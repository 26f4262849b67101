"""The public surface of each package is its ``__init__``'s ``__all__``, on purpose.

A name added or removed here is an API decision: update this list in the same change
(and the docs). Everything else is private and free to change.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC: dict[str, list[str]] = {
    "sagaline": [
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
    ],
    "sagaline.kafka": [
        "AdminClient",
        "BrokerNotConfigured",
        "BrokerUnreachable",
        "ClientConfig",
        "Consumer",
        "DeadLetterWriter",
        "DeliveryFailed",
        "GroupInfo",
        "GroupNotAuthorized",
        "InstanceClaimed",
        "KafkaConfigError",
        "KafkaError",
        "KafkaException",
        "LedgerReader",
        "LedgerWriter",
        "Message",
        "OFFSET_BEGINNING",
        "Producer",
        "RecordTooLarge",
        "TopicMissing",
        "TopicNotAuthorized",
        "TopicPartition",
        "TopicSetupError",
        "closing_tolerated",
        "configured_broker",
        "consumer_config",
        "create_admin",
        "create_consumer",
        "create_producer",
        "create_uncommitted_reader",
        "deliver",
        "describe_group",
        "ensure_topics",
        "headers_of",
        "producer_config",
        "raise_if_fatal",
        "read_to_end",
        "readable_headers",
        "redacted",
        "require_bootstrap",
        "require_broker_answers",
        "watermarks",
    ],
    "sagaline.ops": [
        "CoordinatorMetrics",
        "EffectMeasure",
        "MeasuresSnapshot",
        "MissingOperatorIdentity",
        "OperatorActionError",
        "OperatorChannel",
        "ParticipantMetrics",
        "SagalineMetrics",
        "UnknownRequest",
        "approval_denied",
        "approval_granted",
        "deny_approval",
        "describe_receipt",
        "find_approval_request",
        "find_incident",
        "format_duration",
        "format_ms",
        "grant_approval",
        "incident_resolved",
        "later_resolutions",
        "render_receipt_html",
        "render_receipt_text",
        "resolve_incident",
        "start_metrics_server",
    ],
    "coordinator": [
        "COORDINATOR_PRODUCER",
        "Coordinator",
        "CorePolicy",
        "CorrelationError",
        "DEFAULT_POLICY",
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
    ],
    "participants": [
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
    ],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_public_surface_is_exactly_what_is_pinned(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == PUBLIC[package]
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def test_the_client_the_runtime_and_the_coordinator_are_public() -> None:
    import coordinator
    import participants
    from coordinator.shell import Coordinator
    from participants.client import SagaClient
    from participants.runtime import ParticipantRuntime

    assert participants.SagaClient is SagaClient
    assert participants.ParticipantRuntime is ParticipantRuntime
    assert coordinator.Coordinator is Coordinator


def test_the_error_an_agent_adapter_refuses_a_call_with_is_public() -> None:
    """The adapters (and every saga call over a limit) raise ``CallRefused``; a user
    catching it must not have to import it from a private module."""
    import sagaline
    from participants.client import CallRefused

    assert sagaline.CallRefused is CallRefused


def test_the_error_a_failed_start_raises_is_public() -> None:
    """``sagaline.connect`` raises ``StartError`` when a runtime or the coordinator it
    starts does not come up (or is served elsewhere); the docs tell users to catch it,
    so ``from sagaline import StartError`` must work, not only the private module."""
    import sagaline
    from sagaline import StartError
    from sagaline._session import StartError as private

    assert StartError is private
    assert sagaline.StartError is private
    assert issubclass(StartError, RuntimeError)
