"""R12 after a restart, without a broker: what the participant does with the
``accepted`` rows of its journal (asynchronous compensations awaiting completion)
when it starts again, and when a provider's receipt arrives.

A new deploy may no longer serve the tool of such a row (removed, renamed): nothing
can confirm it here any more, so it is reported, naming the tool, and the
coordinator hands it to a person; the receipt of such an operation is still
recorded, never a crash.
"""

from __future__ import annotations

import threading
from pathlib import Path

from participants import CompensationContext, compensable, tool, wrap
from participants.catalogue import Catalogue
from participants.runtime import _CONFIRM_THREADS, CommandHandler, CommandJournal, _now_ms
from schemas import (
    CompensateStep,
    CompensationAccepted,
    CompensationCommitted,
    CompensationFailed,
    FailureKind,
    Record,
)
from schemas.codec import decode
from tests.system import System, wait_until
from tests.test_accepted_confirmations import _AcceptingDesk, _compensate

DAY_MS = 86_400_000


class _Desk(_AcceptingDesk):
    """The first deploy: its verification never passes."""

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


def _accept(tmp_path: Path, n: int = 1, *, at: int | None = None) -> tuple[str, bytes]:
    """A compensation of ``book`` accepted by the first deploy (``at``: when, epoch
    ms): its journal row."""
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(_Desk(), name="desks"),
        "desks",
        journal,
        out.append,
        **({} if at is None else {"clock": lambda: at}),
    )
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


class _Counting(_Desk):
    def __init__(self) -> None:
        self.checks = 0

    def released(self, ctx: CompensationContext) -> bool:
        self.checks += 1
        return False


def test_an_accepted_compensation_past_its_wait_is_checked_once_then_settled_R12(
    tmp_path: Path,
) -> None:
    # R12: past the declared wait the coordinator has handed the step to a person.
    # The participant checks it one last time, then settles its row (the answer kept
    # is still the acceptance): no verification at every later start, and the row is
    # pruned with the other done ones.
    command_id, command = _accept(tmp_path, at=_now_ms() - DAY_MS)
    desk = _Counting()
    for _start in range(2):
        handler, out = _redeployed(tmp_path, wrap(desk, name="desks"))
        for row_id, row in handler.journal.accepted():
            handler.confirm_accepted(row_id, row)
        handler.close()
    assert desk.checks == 1
    assert out == []  # nothing new to report: the coordinator's incident stands
    journal = CommandJournal(tmp_path / "journal.sqlite")
    assert journal.accepted() == []
    seen = journal.get(command_id)
    assert seen is not None and seen[0] == "done" and seen[1] is not None
    assert isinstance(decode(seen[1]), CompensationAccepted)
    assert decode(command, CompensateStep).event_id == command_id


class _Gated(_AcceptingDesk):
    """Bookings whose verification waits for the test, then does not pass."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.inside = 0
        self.checks = 0

    def released(self, ctx: CompensationContext) -> bool:
        with self.lock:
            self.inside += 1
            self.checks += 1
        assert self.gate.wait(120)
        with self.lock:
            self.inside -= 1
        return False


def test_start_up_resumes_overdue_accepted_rows_on_a_small_pool_and_settles_them_R12(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    # A journal holding many accepted rows whose wait ended long ago (a day): the
    # start must not take a thread (and a provider call) per row at every start;
    # they are checked once each, a few at a time, and settled.
    gated = _Gated()
    catalogue = wrap(gated, name="gated")
    journal = CommandJournal(tmp_path / "gated" / "commands.sqlite")
    seeding = CommandHandler(
        catalogue, "gated", journal, lambda r: None, clock=lambda: _now_ms() - DAY_MS
    )
    rows = 20
    for n in range(rows):
        assert seeding.handle(_compensate(n)) == "accepted"
    seeding.close()
    journal.close()
    with System(kafka_bootstrap, unique_prefix, tmp_path, [catalogue]) as system:
        wait_until(lambda: gated.inside >= 2, 60, "the first checks")
        confirming = [
            t for t in threading.enumerate() if t.name.startswith(("gated-confirm", "gated-verify"))
        ]
        # the pool that polls every confirmation, its scheduler, and the threads its
        # verification calls run on (one per poller while none hangs)
        assert len(confirming) <= 2 * _CONFIRM_THREADS + 1, [t.name for t in confirming]
        gated.gate.set()
        runtime = system._runtimes[0]
        wait_until(lambda: runtime.journal.accepted() == [], 60, "every row settled")
        assert gated.checks == rows
        system.stop_participant(runtime)
        runtime = system.start_participant(catalogue)
        assert runtime.journal.accepted() == []  # nothing left to check at this start
