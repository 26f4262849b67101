"""The saga receipt: the completion proof published with every terminal status (R14).

It travels as JSON bytes inside ``SagaTerminal.receipt`` and is read by the CLI, the
dashboard and people. Every committed effect appears with its disposition: retained
on purpose, compensated (and verified where declared), or escalated to a named owner.
"""

from __future__ import annotations

import enum

import orjson
from pydantic import BaseModel, ConfigDict, Field

from schemas.models import Reversibility, TerminalStatus


class Disposition(enum.StrEnum):
    """What became of one step's effect."""

    RETAINED = "RETAINED"  # committed and kept on purpose (completed saga, or past the pivot)
    COMPENSATED = "COMPENSATED"  # undone (and verified, where a verification is declared)
    ESCALATED = "ESCALATED"  # handed to a named person: see the incident
    NOT_COMMITTED = "NOT_COMMITTED"  # never took effect: nothing to undo (R1)
    READ_ONLY = "READ_ONLY"  # changed nothing in the world


class ApprovalRecord(BaseModel):
    model_config = ConfigDict(frozen=True)
    step_id: str
    purpose: str
    decision: str  # GRANTED | DENIED | EXPIRED | REJECTED_MISMATCH
    by: str
    principal: str
    args_fingerprint: str
    at: int


class StepReceipt(BaseModel):
    model_config = ConfigDict(frozen=True)
    step_id: str
    tool: str
    participant: str
    reversibility: Reversibility
    pivot: bool = False
    read_only: bool = False
    depends_on: list[str] = Field(default_factory=list)
    resources: list[str] = Field(default_factory=list)
    intent_at: int | None = None
    idempotency_key_hash: str | None = None
    provider_operation_id: str | None = None
    observation: str  # what the ledger saw last: COMMITTED, FAILED, UNKNOWN, ...
    forward_attempts: int = 0
    committed_at: int | None = None
    compensation: str | None = None
    compensation_key_hash: str | None = None
    compensation_attempts: int = 0
    compensation_provider_operation_id: str | None = None
    verification: str | None = None  # PASSED | FAILED | NOT_DECLARED | None
    disposition: Disposition
    owner: str
    incident_id: str | None = None
    note: str = ""


class IncidentRecord(BaseModel):
    model_config = ConfigDict(frozen=True)
    incident_id: str
    kind: str
    step_id: str | None
    inconsistency: str
    resources: list[str] = Field(default_factory=list)
    effect: str
    owner: str
    resolved: bool = False
    resolution: str | None = None


class Receipt(BaseModel):
    """Everything a person or program needs to trust the terminal status."""

    model_config = ConfigDict(frozen=True)
    saga_id: str
    tenant_id: str
    workflow: str
    workflow_version: str
    policy_version: str
    sdk_version: str
    principal: str
    generation: int
    status: TerminalStatus
    started_at: int
    ended_at: int
    end_reason: str = ""
    # The pivot that committed, past which the saga went forward only (R6); None when
    # no pivot committed (a step's own ``pivot`` flag says it was declared one).
    pivot_step: str | None = None
    approvals: list[ApprovalRecord] = Field(default_factory=list)
    steps: list[StepReceipt] = Field(default_factory=list)
    incidents: list[IncidentRecord] = Field(default_factory=list)
    unresolved: list[str] = Field(default_factory=list)
    owner: str | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_json(cls, data: bytes) -> Receipt:
        return cls.model_validate(orjson.loads(data))
