"""Secrets never reach a log in clear: a tool's exception that quotes a secret
argument is logged by the participant runtime with the secret replaced by its
redaction marker, in the message and in the traceback alike."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import orjson
import pytest

from participants import Accepted, CompensationContext, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal
from schemas import CompensateStep, Record, derived_event_id, envelope_for
from schemas.redaction import Secret
from schemas.sealing import Sealer

TOKEN = "tok_live_51HxQ9e2"


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    """Everything the log records hold: each message and each traceback."""
    texts = []
    for r in caplog.records:
        texts.append(r.getMessage())
        if r.exc_info and r.exc_info[1] is not None:
            texts.append("".join(traceback.format_exception(r.exc_info[1])))
    return "\n".join(texts)


class _Cards:
    def __init__(self, clock: list[int]) -> None:
        self.clock = clock
        self.calls = 0

    @tool(description="Hold a card", verify="released")
    @compensable(by="release", completion_within=3600)
    def hold(self, token: Secret) -> dict[str, str]:
        return {"held": "yes"}

    def release(self, ctx: CompensationContext) -> Accepted:
        return Accepted(operation_id=f"release-{ctx.idempotency_key}")

    def released(self, ctx: CompensationContext) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.clock[0] += 1000
            raise ValueError(f"card {ctx.input['token']} unknown to the status endpoint")
        return True


def test_a_failing_verification_quoting_a_secret_logs_its_traceback_scrubbed_R12(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sealer = Sealer(b"shared secret")
    clock = [1_000_000]
    cards = _Cards(clock)
    journal = CommandJournal(tmp_path / "journal.sqlite")
    out: list[Record] = []
    handler = CommandHandler(
        wrap(cards, name="cards"),
        "cards",
        journal,
        out.append,
        ledger=None,
        sealer=sealer,
        clock=lambda: clock[0],
        verify_poll_ms=0,
    )
    args = orjson.dumps(sealer.seal({"token": TOKEN}, ["token"], "s-1"))
    env = envelope_for(
        CompensateStep,
        saga_id="s-1",
        tenant_id="t",
        producer="sagaline-coordinator",
        now=1,
        event_id=derived_event_id("s-1", "compensate/hold/1"),
    )
    command = CompensateStep(
        envelope=env,
        step_id="01-hold",
        tool="hold",
        compensation="release",
        args=args,
        result=b'{"held":"yes"}',
        idempotency_key="k-1",
        compensation_key="c-1",
        attempt=1,
    )
    assert handler.handle(command) == "accepted"
    [(command_id, command_bytes)] = journal.accepted()
    with caplog.at_level(logging.DEBUG):
        handler.confirm_accepted(command_id, command_bytes)
    handler.close()
    assert cards.calls == 2
    logged = _logged(caplog)
    assert "unknown to the status endpoint" in logged  # the failure is logged...
    assert "Traceback" in logged  # ...with where it came from
    assert TOKEN not in logged  # ...and the secret is not
    assert sealer.marker(TOKEN) in logged
