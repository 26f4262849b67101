"""Secrets never reach a log in clear: a tool's exception that quotes a secret
argument is logged by the participant runtime with the secret replaced by its
redaction marker, in the message and in the traceback alike."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import orjson
import pytest

from participants import Accepted, CompensationContext, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal, ParticipantRuntime, _CommandLoop
from sagaline.kafka import Message
from schemas import CompensateStep, ExecuteStep, Record, derived_event_id, envelope_for
from schemas.redaction import Secret
from schemas.sealing import Sealer
from tests.system import wait_until
from tests.test_participant_work import _SIGNER, _Broker, _Msg

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


class _Abort(BaseException):
    """What some libraries raise (a cancellation, a timeout of their own): not an
    ``Exception``, so no step outcome is built from it and its command is
    dead-lettered."""


class _Terminal:
    @tool(description="Charge a card")
    @compensable(by="refund")
    def charge(self, token: Secret) -> dict[str, str]:
        raise _Abort(f"card {token} declined")

    def refund(self, ctx: CompensationContext) -> None:
        pass


def test_a_tool_escaping_with_a_secret_is_logged_and_dead_lettered_scrubbed_R16(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sealer = Sealer(b"shared secret")
    broker = _Broker()
    journal = CommandJournal(tmp_path / "journal.sqlite")
    handler = CommandHandler(
        wrap(_Terminal(), name="pay"), "pay", journal, broker.sent.append, sealer=sealer
    )
    dead: list[tuple[str, str]] = []  # (reason, detail) the DLQ got
    runtime = SimpleNamespace(
        participant="pay",
        handler=handler,
        signer=_SIGNER,
        metrics=SimpleNamespace(
            observe_record=lambda r: None, observe_output=lambda r: None, dlq=lambda r: None
        ),
        _writer=SimpleNamespace(producer=broker),
        _dead_letters=SimpleNamespace(
            write=lambda msg, reason, detail: dead.append((reason, detail))
        ),
        send=broker.send_then,
        _assigned_end={},
    )
    loop = _CommandLoop(cast(ParticipantRuntime, runtime), 2)
    env = envelope_for(
        ExecuteStep, saga_id="s-1", tenant_id="t", producer="sagaline-coordinator", now=1
    )
    command = ExecuteStep(
        envelope=env,
        step_id="01-charge",
        tool="charge",
        args=orjson.dumps(sealer.seal({"token": TOKEN}, ["token"], "s-1")),
        idempotency_key="k-1",
        attempt=1,
        deadline_ms=60_000,
        principal="p",
    )

    def turned() -> bool:
        loop.wait()
        loop.serve()
        return loop.pending == 0

    with caplog.at_level(logging.DEBUG):
        loop.submit(cast(Message, _Msg(command, 0, 0)))
        wait_until(turned, what="the command dead-lettered")
    loop.close()
    handler.close()
    [(reason, detail)] = dead
    assert reason == "handler-error"
    assert "_Abort" in detail and "declined" in detail
    assert TOKEN not in detail and sealer.marker(TOKEN) in detail
    logged = _logged(caplog)
    assert "declined" in logged
    assert TOKEN not in logged
    assert sealer.marker(TOKEN) in logged
