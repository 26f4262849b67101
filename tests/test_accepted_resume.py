"""R12 after a restart, without a broker: what the participant does with the
``accepted`` rows of its journal (asynchronous compensations awaiting completion)
when it starts again, and when a provider's receipt arrives.

A new deploy may no longer serve the tool of such a row (removed, renamed): nothing
can confirm it here any more, so it is reported, naming the tool, and the
coordinator hands it to a person; the receipt of such an operation is still
recorded, never a crash.
"""

from __future__ import annotations

from pathlib import Path

from participants import Accepted, CompensationContext, compensable, tool, wrap
from participants.catalogue import Catalogue
from participants.runtime import CommandHandler, CommandJournal
from schemas import (
    CompensateStep,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    FailureKind,
    Record,
    envelope_for,
)
from schemas.codec import decode


class _Desk:
    @tool(description="Book a desk", verify="released")
    @compensable(by="release", completion_within=30)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")

    def released(self, ctx: CompensationContext) -> bool:
        return False


class _DeskRenamed:
    """The next deploy: ``book`` is now ``reserve``."""

    @tool(description="Reserve a desk")
    @compensable(by="free")
    def reserve(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def free(self, ctx: CompensationContext) -> None:
        pass


def _compensate(n: int = 1) -> CompensateStep:
    env = envelope_for(
        CompensateStep, saga_id=f"s-{n}", tenant_id="t", producer="sagaline-coordinator", now=1
    )
    return CompensateStep(
        envelope=env,
        step_id="01-book",
        tool="book",
        compensation="release",
        args=b'{"desk":"d7"}',
        result=b'{"desk":"d7"}',
        idempotency_key=f"k-{n}",
        compensation_key=f"c-{n}",
        attempt=1,
    )


def _accept(tmp_path: Path, n: int = 1) -> tuple[str, bytes]:
    """A compensation of ``book`` accepted by the first deploy: its journal row."""
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(wrap(_Desk(), name="desks"), "desks", journal, out.append)
    command = _compensate(n)
    assert handler.handle(command) == "accepted"
    assert isinstance(out[-1], CompensationAccepted)
    [row] = [r for r in journal.accepted() if r[0] == command.event_id]
    handler.close()
    journal.close()
    return row


def _redeployed(tmp_path: Path, catalogue: Catalogue) -> tuple[CommandHandler, list[Record]]:
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    return CommandHandler(catalogue, "desks", journal, out.append), out


def test_an_accepted_compensation_of_a_tool_no_longer_served_is_reported_not_a_crash_R12(
    tmp_path: Path,
) -> None:
    # R12/R16: the row's tool is gone from the catalogue. Resuming it must not raise
    # (a traceback on every start, the row kept for ever): the compensation is
    # reported failed, naming the tool and the provider operation, so the
    # coordinator raises the incident at once; the row is settled with that outcome.
    command_id, command = _accept(tmp_path)
    handler, out = _redeployed(tmp_path, wrap(_DeskRenamed(), name="desks"))
    handler.confirm_accepted(command_id, command)
    [failed] = out
    assert isinstance(failed, CompensationFailed)
    assert (failed.kind, failed.error_type) == (FailureKind.BUSINESS_REJECTION, "UnknownTool")
    assert "no longer serves tool 'book'" in failed.message
    assert "release-k-1" in failed.message  # the operation a person must check
    assert failed.attempt == 1 and failed.step_id == "01-book"
    assert handler.journal.accepted() == []
    seen = handler.journal.get(command_id)
    assert seen is not None and seen[0] == "done" and seen[1] is not None
    assert decode(seen[1]) == failed  # a redelivery re-sends this answer
    handler.close()


def test_a_receipt_for_a_tool_no_longer_served_is_still_recorded_R12(tmp_path: Path) -> None:
    # The provider's receipt is a fact: recorded (nothing to verify it with here, so
    # verified stays unreported and the coordinator decides by the step's contract),
    # never an exception to the webhook that delivers it.
    command_id, _command = _accept(tmp_path)
    handler, out = _redeployed(tmp_path, wrap(_DeskRenamed(), name="desks"))
    assert handler.complete_accepted("release-k-1", result={"ok": True}) is True
    [completion] = out
    assert isinstance(completion, CompensationCommitted)
    assert completion.verified is None
    assert completion.provider_operation_id == "release-k-1"
    assert handler.journal.accepted() == []
    seen = handler.journal.get(command_id)
    assert seen is not None and seen[0] == "done"
    assert handler.complete_accepted("release-k-1") is False  # completed already
    handler.close()
