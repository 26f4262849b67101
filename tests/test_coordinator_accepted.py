"""R12, durably: an Accepted compensation is done only when its completion arrives,
and the declared wait for it is a coordinator timer counted from the acceptance."""

from __future__ import annotations

import json
from pathlib import Path

from coordinator_ledger import Harness, Ledger, compensates, fresh, incidents, receipt_of, terminal
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordinator import decide, tick
from coordinator.state import TimerPurpose
from schemas import FailureKind, StepScheduled, TerminalStatus
from schemas.codec import Codec
from schemas.registry import AVSC_DIR, SchemaRegistry

WAIT_MS = 5_000


def accepted(within: int | None = WAIT_MS, **kw: object) -> tuple[Ledger, Harness, int]:
    """A saga unwinding ``refund`` whose compensation the provider only accepted;
    returns the acceptance time as the ledger records it."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("refund", completion_within_ms=within, **kw),
        ledger.committed("refund"),
    )
    out = h.feed(
        ledger.scheduled("boom"), ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION)
    )
    assert compensates(out) == ["refund"]
    acceptance = ledger.comp_accepted("refund")
    h.feed(acceptance)
    return ledger, h, acceptance.envelope.occurred_at


def test_acceptance_starts_the_declared_completion_timer_R12() -> None:
    _ledger, h, accepted_at = accepted()
    assert h.status("refund") == "COMPENSATION_ACCEPTED"
    assert h.s.steps["refund"].timers[TimerPurpose.COMPLETION_DEADLINE] == accepted_at + WAIT_MS
    assert h.s.next_due_at() == accepted_at + WAIT_MS


def test_completion_within_the_wait_compensates_and_clears_the_timer_R12() -> None:
    ledger, h, _at = accepted()
    h.advance(WAIT_MS - 10)
    out = h.feed(ledger.comp_committed("refund"))
    assert receipt_of(out).status is TerminalStatus.COMPENSATED
    assert incidents(h.outputs) == []


def test_no_completion_by_the_deadline_is_one_incident_naming_operation_and_time_R12() -> None:
    _ledger, h, accepted_at = accepted()
    assert h.advance(WAIT_MS - 1) == []  # one ms early: nothing yet
    out = h.run_timers()
    [incident] = incidents(out)
    assert incident.kind == "compensation-not-completed"
    assert incident.envelope.occurred_at == accepted_at + WAIT_MS
    assert "accepted as provider operation comp-refund at 1970-01-01T00:16:40" in (
        incident.inconsistency
    )
    assert f"no completion within the declared wait of {WAIT_MS} ms" in incident.inconsistency
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert h.status("refund") == "COMPENSATION_FAILED"


def test_a_late_completion_after_the_incident_changes_nothing_R12() -> None:
    ledger, h, _at = accepted()
    h.run_timers()
    assert terminal(h.outputs) is not None
    assert h.feed(ledger.comp_committed("refund")) == []
    assert len(incidents(h.outputs)) == 1


def test_a_tick_long_after_the_deadline_still_dates_the_incident_at_the_deadline_R12() -> None:
    """A coordinator that was down past the deadline fires the timer as of its due
    time: the wait counts from the acceptance, not from the restart."""
    _ledger, h, accepted_at = accepted()
    out = h.advance(10 * WAIT_MS)
    [incident] = incidents(out)
    assert incident.envelope.occurred_at == accepted_at + WAIT_MS


def test_repeated_acceptance_of_the_same_attempt_does_not_restart_the_wait_R12() -> None:
    """A participant restarted mid-wait re-sends its acceptance: the deadline stays."""
    ledger, h, accepted_at = accepted()
    h.advance(WAIT_MS // 2)
    h.feed(ledger.comp_accepted("refund"))  # a new event id, later occurred_at
    assert h.s.steps["refund"].timers[TimerPurpose.COMPLETION_DEADLINE] == accepted_at + WAIT_MS
    out = h.run_timers()
    assert len(incidents(out)) == 1


def test_an_acceptance_dated_ahead_of_the_coordinator_cannot_extend_the_wait_R12() -> None:
    """A participant whose clock runs ahead (a host eight hours off, a local time
    written as UTC) dates its acceptance in the future. The wait counts from when the
    coordinator decided the acceptance at the latest: it cannot have happened later,
    and the deadline must not move by the participant's clock."""
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("refund", completion_within_ms=WAIT_MS),
        ledger.committed("refund"),
    )
    h.feed(ledger.scheduled("boom"), ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    acceptance = ledger.comp_accepted("refund")
    ahead = acceptance.envelope.occurred_at + 8 * 3600 * 1000
    env = acceptance.envelope.model_copy(update={"occurred_at": ahead})
    now = h.now + 1
    decided = decide(h.s, acceptance.model_copy(update={"envelope": env}), now).state
    assert decided is not None and decided.next_due_at() == now + WAIT_MS
    [incident] = incidents(tick(decided, now + WAIT_MS).outputs)
    assert incident.kind == "compensation-not-completed"


def test_acceptance_from_a_tool_that_declared_no_wait_is_an_incident_at_once_R12() -> None:
    _ledger, h, accepted_at = accepted(within=None)
    out = h.run_timers()
    [incident] = incidents(out)
    assert incident.envelope.occurred_at == accepted_at
    assert "declares no completion wait" in incident.inconsistency


def test_a_step_recorded_before_completion_within_existed_still_decodes_R12(
    tmp_path: Path,
) -> None:
    """Schema evolution: ``completion_within_ms`` was added with a default, so a
    ``StepScheduled`` written by an older SDK reads as "no wait declared"."""
    for path in AVSC_DIR.glob("*.avsc"):
        (tmp_path / path.name).write_text(path.read_text())
    older = json.loads((AVSC_DIR / "StepContract.avsc").read_text())
    older["fields"] = [f for f in older["fields"] if f["name"] != "completion_within_ms"]
    (tmp_path / "StepContract.avsc").write_text(json.dumps(older))
    old_codec = Codec(SchemaRegistry(tmp_path))
    ledger, _h = fresh()
    scheduled = ledger.scheduled("refund")
    written = old_codec.encode(scheduled)

    current = Codec(SchemaRegistry())
    current.registry.register_writer(old_codec.registry.reader("StepScheduled").schema)
    decoded = current.decode(written, expected=StepScheduled)

    assert decoded == scheduled
    assert decoded.contract.completion_within_ms is None


_LONG = st.integers(-(2**63), 2**63 - 1)  # what an Avro long (occurred_at) may carry


@settings(max_examples=200, deadline=None)
@given(
    accepted_at=st.one_of(_LONG, st.integers(-(10**15), 10**15)),
    within=st.one_of(st.none(), st.integers(0, 2**62), st.integers(0, 10**13)),
)
def test_an_absurd_acceptance_time_or_wait_still_ends_in_an_incident_R12_R16(
    accepted_at: int, within: int | None
) -> None:
    """A participant's clock (or declaration) may be absurd: an acceptance dated before
    year 1 or after 9999, a wait of centuries. When the timer fires the saga must still
    end in the named incident; the incident text cannot turn the time into a calendar
    date, which raised ValueError out of ``tick`` and got the saga parked instead."""
    assume(-(2**63) <= accepted_at + (within or 0) < 2**63)
    ledger, h = fresh()
    h.feed(
        ledger.started(),
        ledger.scheduled("refund", completion_within_ms=within),
        ledger.committed("refund"),
    )
    h.feed(ledger.scheduled("boom"), ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    acceptance = ledger.comp_accepted("refund")
    env = acceptance.envelope.model_copy(update={"occurred_at": accepted_at})
    h.feed(acceptance.model_copy(update={"envelope": env}))
    due = h.s.next_due_at()
    assert due == accepted_at + (within or 0)
    h.now = max(h.now, due)
    out = h.advance(0)
    [incident] = incidents(out)
    assert incident.kind == "compensation-not-completed"
    assert incident.envelope.occurred_at == due
    assert receipt_of(out).status is TerminalStatus.ESCALATED
