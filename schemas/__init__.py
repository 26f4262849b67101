"""The Sagaline event contract: records, keys, receipts (and, in submodules, the
Avro codec, topic names and signing).

Example::

    from schemas import SagaStarted, envelope_for
    event = SagaStarted(
        envelope=envelope_for(SagaStarted, saga_id="s-1", tenant_id="acme",
                              producer="agent", now=1_700_000_000_000),
        workflow="refund", principal="alice",
    )
"""

from __future__ import annotations

from schemas.keys import (
    args_fingerprint,
    canonical_json,
    compensation_key,
    derived_event_id,
    fingerprint,
    idempotency_key,
    key_hash,
    new_event_id,
)
from schemas.models import (
    COMMAND_TYPES,
    EVENT_TYPES,
    RECORD_TYPES,
    ApprovalDenied,
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    Command,
    CompensateStep,
    CompensationAccepted,
    CompensationApproval,
    CompensationCommitted,
    CompensationFailed,
    CompensationRequested,
    Envelope,
    Event,
    ExecuteStep,
    FailureKind,
    IncidentRaised,
    IncidentResolved,
    LedgerRef,
    ReconcileResult,
    ReconcileStep,
    Record,
    RetryPolicy,
    Reversibility,
    SagaEndRequested,
    SagaOutcome,
    SagaStarted,
    SagaTerminal,
    StepCommitted,
    StepContract,
    StepFailed,
    StepIntentRecorded,
    StepOutcomeUnknown,
    StepReconciled,
    StepRetryScheduled,
    StepScheduled,
    TerminalStatus,
)
from schemas.receipt import Disposition, Receipt, StepReceipt


def envelope_for(
    record_type: type[Record],
    *,
    saga_id: str,
    tenant_id: str,
    producer: str,
    now: int,
    generation: int = 1,
    causation_id: str | None = None,
    event_id: str | None = None,
) -> Envelope:
    """Build the envelope for a new record of ``record_type``."""
    return Envelope(
        event_id=event_id or new_event_id(),
        saga_id=saga_id,
        tenant_id=tenant_id,
        type=record_type.TYPE,
        occurred_at=now,
        producer=producer,
        generation=generation,
        causation_id=causation_id,
    )


__all__ = [
    "COMMAND_TYPES",
    "EVENT_TYPES",
    "RECORD_TYPES",
    "ApprovalDenied",
    "ApprovalGranted",
    "ApprovalPurpose",
    "ApprovalRequested",
    "Command",
    "CompensateStep",
    "CompensationAccepted",
    "CompensationApproval",
    "CompensationCommitted",
    "CompensationFailed",
    "CompensationRequested",
    "Disposition",
    "Envelope",
    "Event",
    "ExecuteStep",
    "FailureKind",
    "IncidentRaised",
    "IncidentResolved",
    "LedgerRef",
    "Receipt",
    "ReconcileResult",
    "ReconcileStep",
    "Record",
    "RetryPolicy",
    "Reversibility",
    "SagaEndRequested",
    "SagaOutcome",
    "SagaStarted",
    "SagaTerminal",
    "StepCommitted",
    "StepContract",
    "StepFailed",
    "StepIntentRecorded",
    "StepOutcomeUnknown",
    "StepReceipt",
    "StepReconciled",
    "StepRetryScheduled",
    "StepScheduled",
    "TerminalStatus",
    "args_fingerprint",
    "canonical_json",
    "compensation_key",
    "derived_event_id",
    "envelope_for",
    "fingerprint",
    "idempotency_key",
    "key_hash",
    "new_event_id",
]

# The wire side of the contract: codec, errors, signing, redaction, topics, settings.
# (Imported after the records above; these modules depend on them.)
from schemas.codec import Codec, decode, encode  # noqa: E402
from schemas.errors import (  # noqa: E402
    BadSignature,
    CodecError,
    InvalidRecord,
    MalformedRecord,
    MissingSignature,
    SchemaMismatch,
    SignatureError,
    UnknownFingerprint,
)
from schemas.redaction import SECRET, Secret, redact, redacted_json, secret_paths  # noqa: E402
from schemas.registry import SchemaRegistry, default_registry  # noqa: E402
from schemas.settings import Settings, SettingsError  # noqa: E402
from schemas.signing import Signer  # noqa: E402
from schemas.topics import Replication, TopicNames  # noqa: E402
from schemas.wire import dlq_message, from_message, to_message  # noqa: E402

__all__ += [
    "SECRET",
    "BadSignature",
    "Codec",
    "CodecError",
    "InvalidRecord",
    "MalformedRecord",
    "MissingSignature",
    "Replication",
    "SchemaMismatch",
    "SchemaRegistry",
    "Secret",
    "Settings",
    "SettingsError",
    "SignatureError",
    "Signer",
    "TopicNames",
    "UnknownFingerprint",
    "decode",
    "default_registry",
    "dlq_message",
    "encode",
    "from_message",
    "redact",
    "redacted_json",
    "secret_paths",
    "to_message",
]
