"""Typed errors of the refund example's providers and fault injection.

Two families matter to the runtime: ``BusinessRejection`` subclasses are never
retried (R9); everything else raised by a tool is a transient failure and is retried
with the same idempotency key.
"""

from __future__ import annotations

from participants.declarations import BusinessRejection


class RefundExampleError(Exception):
    """Base of the refund example's own errors."""


class IdempotencyKeyReused(RefundExampleError):
    """One idempotency key was used for two different requests.

    A key names one operation; the caller derived the same key for other arguments,
    which is a bug in the caller, not something to retry.
    """

    def __init__(self, key: str, *, first: str, now: str) -> None:
        self.key = key
        super().__init__(
            f"idempotency key {key!r} was first used for {first} and is now used for {now};"
            " derive a new key for a different request"
        )


class UnknownOperationError(RefundExampleError):
    """A compensation named an operation the provider never performed (a hold, a
    credit, a message that does not exist). Retrying will not make it exist."""


class ProviderUnavailable(RefundExampleError):
    """A transient provider failure: try again with the same idempotency key."""


class Throttled(ProviderUnavailable):
    """The provider refused the call for exceeding its rate; try again later."""


class PolicyRejection(BusinessRejection):
    """The refund policy said no (amount over the limit, order not refundable)."""


class InjectedRejection(BusinessRejection):
    """A business rejection injected by the fault plan."""


class InjectedTransientFailure(ProviderUnavailable):
    """A transient failure injected by the fault plan."""


class FaultPlanError(RefundExampleError, ValueError):
    """The fault plan (``SAGALINE_FAULTS`` or a file) could not be read."""
