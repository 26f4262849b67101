"""How the participant confirms an accepted (asynchronous) compensation (R12): the
polling of its declared verification while the wait runs.

A verification that keeps failing is reported, not logged at every poll (five a
second for the whole wait, hours of tracebacks); a redelivered command whose
compensation is still being confirmed does not start a second poller.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from participants import Accepted, CompensationContext, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal
from schemas import CompensateStep, CompensationCommitted, Record, envelope_for

HOUR_S = 3600


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


class _Flaky:
    """A provider whose status endpoint fails ``failures`` times, then reports the
    release done; each failed call moves the driven clock by ``step_ms``."""

    def __init__(self, failures: int, clock: list[int], step_ms: int) -> None:
        self.failures = failures
        self.clock = clock
        self.step_ms = step_ms
        self.calls = 0

    @tool(description="Book a desk", verify="released")
    @compensable(by="release", completion_within=HOUR_S)
    def book(self, desk: str) -> dict[str, str]:
        return {"desk": desk}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")

    def released(self, ctx: CompensationContext) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            self.clock[0] += self.step_ms
            raise ConnectionError(f"status endpoint down (call {self.calls})")
        return True


def test_a_verification_that_keeps_failing_logs_one_traceback_then_a_summary_a_minute_R12(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The provider's status endpoint is down for two minutes of polls (every 200 ms
    # in production: 600 failures). One traceback (the first), then one line a
    # minute at most with the count and the last error, then one line when it
    # answers again: not a traceback per poll.
    clock = [1_000_000]
    provider = _Flaky(failures=600, clock=clock, step_ms=200)
    out: list[Record] = []
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(provider, name="desks"),
        "desks",
        journal,
        out.append,
        clock=lambda: clock[0],
        verify_poll_ms=0,
    )
    command = _compensate()
    assert handler.handle(command) == "accepted"
    [(command_id, command_bytes)] = journal.accepted()
    with caplog.at_level(logging.INFO, logger="sagaline.participant"):
        handler.confirm_accepted(command_id, command_bytes)
    handler.close()
    assert provider.calls == 601
    assert isinstance(out[-1], CompensationCommitted)  # confirmed once it answered
    lines = [r for r in caplog.records if r.name == "sagaline.participant"]
    tracebacks = [r for r in lines if r.exc_info]
    assert len(tracebacks) == 1, len(tracebacks)
    assert "call 1)" in str(tracebacks[0].exc_info[1])  # type: ignore[index]
    summaries = [r.getMessage() for r in lines if "still failing" in r.getMessage()]
    assert 1 <= len(summaries) <= 2, summaries  # 120 s of failures: a line a minute
    assert "ConnectionError" in summaries[-1] and "status endpoint down" in summaries[-1]
    recovered = [r.getMessage() for r in lines if "answers again" in r.getMessage()]
    assert len(recovered) == 1 and "600 failed" in recovered[0], recovered
    assert len(lines) <= 5, [r.getMessage() for r in lines]
