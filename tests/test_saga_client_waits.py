"""The saga client's waits, without a broker: what ends a call's wait for its step,
fed records as the client's listener feeds them (``_Ledger``), sync and asyncio."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from participants.client import ApprovalPending, Saga, _Ledger
from schemas import (
    ApprovalPurpose,
    ApprovalRequested,
    Record,
    StepContract,
    args_fingerprint,
    envelope_for,
)
from schemas.models import Reversibility

SAGA = "s-waits"
NOW = 1_700_000_000_000


def _request(step_id: str) -> ApprovalRequested:
    """The coordinator's request for a person's approval of ``step_id`` (R7)."""
    return ApprovalRequested(
        envelope=envelope_for(
            ApprovalRequested,
            saga_id=SAGA,
            tenant_id="default",
            producer="sagaline-coordinator",
            now=NOW,
        ),
        step_id=step_id,
        approval_id=f"appr-{step_id}",
        purpose=ApprovalPurpose.FORWARD,
        principal="agent",
        args_fingerprint=args_fingerprint(b"{}"),
        scope="desk/announce:execute",
        expires_at=NOW + 60_000,
    )


def _saga(ledger: _Ledger) -> Saga:
    client: Any = SimpleNamespace(_ledger=ledger, signer=None, producer_name="agent")
    return Saga(
        client,
        saga_id=SAGA,
        tenant_id="default",
        workflow="desk",
        principal="agent",
        workflow_version="1",
        policy_version="1",
        continue_on_compensation_failure=False,
    )


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_a_parallel_call_whose_own_step_waits_for_approval_does_not_wait_once_more_R7(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model turn's two calls at once: a slow ``provision`` and an IRREVERSIBLE
    ``announce`` scheduled behind it. ``provision`` ends during ``announce``'s wait,
    and ``announce``'s step then asks a person (ApprovalRequested). A call queued
    behind an earlier one waits once more, a full timeout, after that call ended
    (2697135), "not while a step waits for a person": but only another step's
    request was looked at, so ``announce`` waited out another whole timeout (the
    client's 60 s by default) with its own request in hand before it raised
    ``ApprovalPending``, and the person was asked that much later."""
    ledger = _Ledger()
    ledger.follow(SAGA)
    saga = _saga(ledger)
    contract = StepContract(
        tool="announce", participant="desk", reversibility=Reversibility.IRREVERSIBLE
    )
    earlier = saga._awaiting("01-provision")
    own = saga._awaiting("02-announce")
    waits: list[float] = []

    def during_the_wait() -> None:
        if not waits:  # provision returns, then announce's step asks for approval
            saga._awaited_done(earlier)
            ledger.add([_request("02-announce")])

    if mode == "threads":
        wait_for = ledger.wait_for

        def counted(saga_id: str, check: Callable[[Record], Any], timeout_s: float) -> Any:
            during_the_wait()
            waits.append(timeout_s)
            return wait_for(saga_id, check, timeout_s)

        monkeypatch.setattr(ledger, "wait_for", counted)
        with pytest.raises(ApprovalPending) as err:
            saga._await_step("02-announce", contract, 0.2, own)
    else:
        wait_for_async = ledger.wait_for_async

        async def counted_async(
            saga_id: str, check: Callable[[Record], Any], timeout_s: float
        ) -> Any:
            during_the_wait()
            waits.append(timeout_s)
            return await wait_for_async(saga_id, check, timeout_s)

        monkeypatch.setattr(ledger, "wait_for_async", counted_async)
        with pytest.raises(ApprovalPending) as err:
            asyncio.run(saga._await_step_async("02-announce", contract, 0.2, own))
    assert err.value.approval_id == "appr-02-announce"
    assert waits == [0.2]


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_a_record_the_listener_added_as_the_wait_ran_out_ends_the_wait(mode: str) -> None:
    """The listener appends a batch's records to their sagas' feeds, then wakes the
    asyncio waiters of the whole batch (up to 500 records later). A wait whose
    timeout fell in between returned "no record" with its outcome in the feed (the
    call raised ``OutcomeUnknown`` for a step that committed, and the agent aborted
    the saga); a thread's wait reads the feed once more when its time is up, an
    asyncio wait now does too."""
    ledger = _Ledger()
    ledger.follow(SAGA)
    feed = ledger._feeds[SAGA]
    record = _request("01-announce")

    def appended_not_woken() -> None:
        with feed.cond:  # as _Ledger.add, before it wakes anyone
            feed.records.append(record)

    def check(r: Record) -> Any:
        return r if r is record else None

    if mode == "threads":
        # The wait reads the feed before or after the record comes: either way it ends.
        threading.Thread(target=appended_not_woken, daemon=True).start()
        assert ledger.wait_for(SAGA, check, 0.2) is record
        return

    async def wait() -> Any:
        # Runs once the wait read the feed and awaits its wake-up, which never comes.
        asyncio.get_running_loop().call_soon(appended_not_woken)
        return await ledger.wait_for_async(SAGA, check, 0.2)

    assert asyncio.run(wait()) is record


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -1.0])
@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_a_wait_for_an_approval_request_with_a_timeout_that_is_no_duration_is_refused(
    mode: str, timeout_s: float
) -> None:
    """``approval_request(step, timeout_s)`` took any number: NaN spun the wait for
    ever (the time left was never <= 0; a thread's wait used a CPU doing it),
    infinity failed deep in the wait with ``OverflowError``. It is refused as
    ``wait()`` refuses it, saying what it takes."""
    ledger = _Ledger()
    ledger.follow(SAGA)
    saga = _saga(ledger)
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            if mode == "threads":
                saga.approval_request("01-announce", timeout_s)
            else:
                asyncio.run(saga.aapproval_request("01-announce", timeout_s))
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(30)
    assert outcome, "approval_request() is still waiting"
    assert isinstance(outcome[0], ValueError)
    assert "timeout_s must be 0 or more seconds" in str(outcome[0])
