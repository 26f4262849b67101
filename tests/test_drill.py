"""The fault drill (seed 004, "Test failures at every seam") on the real broker: our
refund example and the seed-004 fixture run through it, every seam for every step,
and a tool whose compensation does not undo anything is caught.

``SAGALINE_DRILL_STEPS`` (e.g. ``2,4``, 1-based) narrows the refund matrix to some
steps on a slow machine; by default every step runs.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest

from participants import CompensationContext, LookupResult, compensable, tool, wrap
from participants.context import current_call
from participants.plan import PlannedCall
from schemas import (
    IncidentRaised,
    IncidentResolved,
    Record,
    SagaTerminal,
    StepCommitted,
    StepScheduled,
    envelope_for,
    idempotency_key,
)
from schemas.models import Envelope, StepContract, TerminalStatus
from schemas.receipt import Disposition
from services.cli import main as sagaline
from services.drill import Seam, Verdict, instrument, run_drill
from services.drill import cli as drill_cli
from services.drill._inject import FaultBoard
from services.drill._run import CaseResult, _judge
from services.refund import drill_catalogues
from tests.test_demo_invariants import receipt, step
from tests.test_seed004_fixture import Steps

pytestmark = pytest.mark.kafka

REFUND_PLAN = Path(__file__).parent.parent / "services" / "refund" / "drill-plan.json"


@pytest.mark.timeout(900)  # 72 sagas on the real broker; minutes on a loaded machine
def test_refund_example_every_seam_every_step_converges_or_escalates_truthfully(
    kafka_bootstrap: str, tmp_path: Path, new_topic_prefix: Callable[..., str]
) -> None:
    steps_env = os.environ.get("SAGALINE_DRILL_STEPS", "")
    steps = [int(n) - 1 for n in steps_env.split(",") if n.strip()] or None
    calls = json.loads(REFUND_PLAN.read_text())["calls"]
    report = run_drill(
        drill_catalogues(tmp_path),
        calls,
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        steps=steps,
        prefix=new_topic_prefix("drill"),
    )
    print(report.matrix())
    assert report.ok, report.matrix()
    verdicts = {(r.seam, r.tool): r.verdict for r in report.results}
    if steps is None:
        assert len(report.results) == len(Seam) * len(calls)
        # What must hold whatever the machine: the fallible, undoable steps before the
        # pivot converge at every seam that exists for them.
        for seam in Seam:
            if seam is not Seam.EXPIRED_APPROVAL:
                assert verdicts[(seam, "place_hold")] is Verdict.CONVERGED, seam
        # The irreversible email's approval expiring after the pivot goes to a person.
        assert verdicts[(Seam.EXPIRED_APPROVAL, "send_reply")] is Verdict.ESCALATED


def test_seed004_fixture_every_seam_every_step(
    kafka_bootstrap: str, tmp_path: Path, new_topic_prefix: Callable[..., str]
) -> None:
    calls = [{"tool": "reserve"}, {"tool": "charge"}, {"tool": "email"}]
    report = run_drill(
        [wrap(Steps(), name="fixture")],
        calls,
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        prefix=new_topic_prefix("drill"),
    )
    print(report.matrix())
    assert report.ok, report.matrix()
    by = {(r.seam, r.tool): r for r in report.results}
    # email always fails: the saga is compensated however it is disturbed.
    for seam in (Seam.BEFORE_DISPATCH, Seam.DUPLICATES, Seam.PARTIAL_OUTAGE):
        assert by[(seam, "charge")].status == "COMPENSATED"
    # No lookup declared: a lost answer is an unknown outcome a person settles (R11).
    assert by[(Seam.BEFORE_RECEIPT, "reserve")].verdict is Verdict.ESCALATED
    assert "unknown-outcome" in by[(Seam.BEFORE_RECEIPT, "reserve")].detail


class ForgetfulVault:
    """A provider whose compensation answers "done" and changes nothing: the kind of
    bug the drill exists to catch through the tool's own ``verify``."""

    def __init__(self) -> None:
        self.items: dict[str, str] = {}
        self.lock = threading.Lock()

    @tool(description="Store an item", lookup="find", verify="is_gone")
    @compensable(by="remove")
    def store(self, item: str) -> str:
        key = current_call().idempotency_key
        with self.lock:
            self.items[key] = item
        return key

    def remove(self, ctx: CompensationContext) -> None:
        return None  # the bug: nothing is removed

    def find(self, key: str) -> LookupResult | None:
        with self.lock:
            return LookupResult.committed(key) if key in self.items else None

    def is_gone(self, ctx: CompensationContext) -> bool:
        with self.lock:
            return ctx.idempotency_key not in self.items


def test_a_compensation_that_undoes_nothing_is_escalated_not_called_compensated_R12(
    kafka_bootstrap: str, tmp_path: Path, new_topic_prefix: Callable[..., str]
) -> None:
    report = run_drill(
        [wrap(ForgetfulVault(), name="vault")],
        [{"tool": "store", "args": {"item": "a"}}],
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        seams=[Seam.AFTER_COMMIT],
        prefix=new_topic_prefix("drill"),
    )
    [result] = report.results
    assert result.verdict is Verdict.ESCALATED
    assert result.status == "ESCALATED"
    assert result.detail == "compensation-not-verified"


class BlindVault(ForgetfulVault):
    """A provider whose lookup never finds anything: a lost answer looks like "not
    done", so the tool runs a second time for the same key."""

    def find(self, key: str) -> LookupResult | None:
        return None


def test_a_lookup_that_cannot_find_a_committed_operation_is_a_failed_case_R11(
    kafka_bootstrap: str, tmp_path: Path, new_topic_prefix: Callable[..., str]
) -> None:
    report = run_drill(
        [wrap(BlindVault(), name="vault")],
        [{"tool": "store", "args": {"item": "a"}}],
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        seams=[Seam.BEFORE_RECEIPT],
        prefix=new_topic_prefix("drill"),
    )
    [result] = report.results
    assert result.verdict is Verdict.FAILED
    assert "ran 2 times for one idempotency key" in result.detail
    assert not report.ok
    assert "FAILED after-dispatch-before-receipt @ 1:store" in report.matrix()


def test_instrumenting_a_catalogue_leaves_the_users_tools_untouched() -> None:
    vault = ForgetfulVault()
    original = wrap(vault, name="vault")
    wrapped = instrument(original, FaultBoard())
    assert original["store"].func == vault.store
    assert wrapped["store"].func is not original["store"].func
    assert wrapped["store"].lookup_func == original["store"].lookup_func
    assert wrapped.contracts() == original.contracts()


def test_sagaline_drill_prints_the_matrix(
    kafka_bootstrap: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    new_topic_prefix: Callable[..., str],
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    # The command picks a fresh prefix itself; give it one the session deletes.
    monkeypatch.setattr(
        drill_cli, "run_drill", functools.partial(run_drill, prefix=new_topic_prefix("drill"))
    )
    code = sagaline(
        [
            "drill",
            "--plan",
            str(REFUND_PLAN),
            "--seam",
            "after-commit",
            "--step",
            "2",
            "--state-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "after-commit" in out and "2:place_hold" in out
    assert "1 cases" in out and "1 converged" in out


@pytest.mark.parametrize("step", ["0", "7"])
def test_sagaline_drill_refuses_a_step_the_plan_does_not_have(
    step: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refund plan has 6 steps: --step 7 crashed with an IndexError after the
    whole stage had started, and --step 0 silently drilled nothing (exit 0)."""
    code = sagaline(["drill", "--plan", str(REFUND_PLAN), "--step", step])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--step {step}" in err and "1 to 6" in err, err


@pytest.mark.parametrize(
    "plan",
    [{"calls": 5}, {"calls": []}, {"calls": [{"args": {}}]}, {"calls": ["place_hold"]}],
)
def test_sagaline_drill_refuses_a_malformed_plan_without_a_traceback(
    plan: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan, "modules": ["services.refund:drill_catalogues"]}))
    code = sagaline(["drill", "--plan", str(path), "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot read the plan" in err, err


def test_run_drill_refuses_a_step_index_outside_the_plan(tmp_path: Path) -> None:
    calls = json.loads(REFUND_PLAN.read_text())["calls"]
    with pytest.raises(ValueError, match=r"steps \[6\] are not in the plan"):
        run_drill([], calls, bootstrap="127.0.0.1:1", state_dir=tmp_path, steps=[6])


class _RecordsOf:
    """What the watcher holds for the one saga of a hand-made case."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.failures: dict[str, list[str]] = {}

    def wait(self, _saga_id: str, check: Callable[[list[Record]], object], _t: float) -> object:
        return check(self.records)

    def of(self, _saga_id: str) -> list[Record]:
        return self.records


def test_an_irreversible_step_that_ran_after_its_approval_expired_is_a_failed_case() -> None:
    """docs/drill.md: expired-approval -> "the step never runs". A coordinator that ran
    the email anyway (its approval expired, nobody granted it) must not be judged
    converged because ledger and provider agree that it ran."""
    saga_id = "drill-expired-approval-1-abc"
    ran = receipt(
        TerminalStatus.COMPLETED,
        [step("s01-send_reply", "send_reply", Disposition.RETAINED, key="k", op="msg-1")],
        saga_id=saga_id,
    )
    terminal = SagaTerminal(
        envelope=envelope_for(
            SagaTerminal, saga_id=saga_id, tenant_id="t", producer="coordinator", now=1
        ),
        status=TerminalStatus.COMPLETED,
        receipt=ran.to_json(),
    )
    board = FaultBoard()
    board.arm(saga_id, "s01-send_reply", Seam.EXPIRED_APPROVAL)
    board.mark_fired(saga_id, "s01-send_reply", Seam.EXPIRED_APPROVAL)
    stage = SimpleNamespace(watcher=_RecordsOf([terminal]), board=board, specs={})
    plan = [PlannedCall("send_reply", {})]

    result = _judge(stage, plan, Seam.EXPIRED_APPROVAL, 0, saga_id, "", {}, 1.0)  # type: ignore[arg-type]

    assert result.verdict is Verdict.FAILED, result
    assert "approval expired" in result.detail


def test_an_irreversible_step_that_ran_with_no_approval_ever_requested_is_a_failed_case() -> None:
    """expired-approval arms nothing until the coordinator asks for the approval. A
    coordinator that ran the email without asking (R7 broken outright) left the fault
    unfired, and the case was judged n/a, "the saga did not get there", although the
    step committed right where it was armed and nobody granted anything."""
    saga_id = "drill-expired-approval-1-abd"
    ran = receipt(
        TerminalStatus.COMPLETED,
        [step("s01-send_reply", "send_reply", Disposition.RETAINED, key="k", op="msg-1")],
        saga_id=saga_id,
    )
    terminal = SagaTerminal(
        envelope=envelope_for(
            SagaTerminal, saga_id=saga_id, tenant_id="t", producer="coordinator", now=1
        ),
        status=TerminalStatus.COMPLETED,
        receipt=ran.to_json(),
    )
    board = FaultBoard()
    board.arm(saga_id, "s01-send_reply", Seam.EXPIRED_APPROVAL)  # armed, never fired
    stage = SimpleNamespace(watcher=_RecordsOf([terminal]), board=board, specs={})
    plan = [PlannedCall("send_reply", {})]

    result = _judge(stage, plan, Seam.EXPIRED_APPROVAL, 0, saga_id, "", {}, 1.0)  # type: ignore[arg-type]

    assert result.verdict is Verdict.FAILED, result
    assert "s01-send_reply ran" in result.detail and "approval" in result.detail, result


def _case(
    seam: Seam, disposition: Disposition, status: TerminalStatus, *, fired: bool
) -> tuple[object, str]:
    """A one-step case whose saga ended with step 1 ``disposition``; its fault fired or not."""
    saga_id = f"drill-{seam.value}-1-abc"
    ended = receipt(
        status,
        [
            step(
                "s01-place_hold",
                "place_hold",
                disposition,
                key="k",
                op=None if disposition is Disposition.NOT_COMMITTED else "hold-1",
            )
        ],
        saga_id=saga_id,
    )
    terminal = SagaTerminal(
        envelope=envelope_for(
            SagaTerminal, saga_id=saga_id, tenant_id="t", producer="coordinator", now=1
        ),
        status=status,
        receipt=ended.to_json(),
    )
    board = FaultBoard()
    board.arm(saga_id, "s01-place_hold", seam)
    if fired:
        board.mark_fired(saga_id, "s01-place_hold", seam)
    return SimpleNamespace(watcher=_RecordsOf([terminal]), board=board, specs={}), saga_id


@pytest.mark.parametrize(
    ("seam", "disposition", "status"),
    [
        (Seam.BEFORE_RECEIPT, Disposition.COMPENSATED, TerminalStatus.COMPENSATED),
        (Seam.LEDGER_APPEND, Disposition.COMPENSATED, TerminalStatus.COMPENSATED),
        (Seam.THROTTLING, Disposition.RETAINED, TerminalStatus.COMPLETED),
        (Seam.CONCURRENT_CANCELLATION, Disposition.COMPENSATED, TerminalStatus.COMPENSATED),
        (Seam.DURING_COMPENSATION, Disposition.COMPENSATED, TerminalStatus.COMPENSATED),
        (Seam.BEFORE_COMPENSATION_ACK, Disposition.COMPENSATED, TerminalStatus.COMPENSATED),
    ],
)
def test_a_fault_that_never_fired_where_the_saga_went_past_it_is_a_failed_case(
    seam: Seam, disposition: Disposition, status: TerminalStatus
) -> None:
    """A broken injection point (a wrapper the runtime no longer calls, an outcome
    published by a path the guard does not see) showed as n/a, "never reached",
    although the step committed (or was compensated) right where the fault was armed."""
    stage, saga_id = _case(seam, disposition, status, fired=False)
    plan = [PlannedCall("place_hold", {})]

    result = _judge(stage, plan, seam, 0, saga_id, "", {}, 1.0)  # type: ignore[arg-type]

    assert result.verdict is Verdict.FAILED, result
    assert "never fired" in result.detail


@pytest.mark.parametrize(
    ("seam", "disposition", "status"),
    [
        # the step failed before it committed: nothing to lose an answer of, no commit
        (Seam.BEFORE_RECEIPT, Disposition.NOT_COMMITTED, TerminalStatus.COMPENSATED),
        (Seam.LEDGER_APPEND, Disposition.NOT_COMMITTED, TerminalStatus.COMPENSATED),
        # a step kept by a completed saga is never compensated
        (Seam.DURING_COMPENSATION, Disposition.RETAINED, TerminalStatus.COMPLETED),
        (Seam.BEFORE_COMPENSATION_ACK, Disposition.RETAINED, TerminalStatus.COMPLETED),
    ],
)
def test_a_fault_at_a_point_the_saga_never_reached_is_not_applicable(
    seam: Seam, disposition: Disposition, status: TerminalStatus
) -> None:
    stage, saga_id = _case(seam, disposition, status, fired=False)
    plan = [PlannedCall("place_hold", {})]

    result = _judge(stage, plan, seam, 0, saga_id, "", {}, 1.0)  # type: ignore[arg-type]

    assert result.verdict is Verdict.NOT_APPLICABLE, result


def test_sagaline_drill_with_no_broker_answering_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stale KAFKA_BOOTSTRAP_SERVERS ended `sagaline drill` in a librdkafka
    traceback (cimpl.KafkaException from ensure_topics) instead of one line."""
    from sagaline.kafka import KafkaError, KafkaException
    from services.drill import _run

    def unreachable(*_args: object, **_kwargs: object) -> list[str]:
        raise KafkaException(
            KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: Broker transport failure")
        )

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setattr(_run, "ensure_topics", unreachable)
    code = sagaline(
        [
            "drill",
            "--plan",
            str(REFUND_PLAN),
            "--seam",
            "before-dispatch",
            "--step",
            "1",
            "--state-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("sagaline drill: ") and err.count("\n") == 1, err
    assert "127.0.0.1:1" in err and "Broker transport failure" in err, err


@pytest.mark.parametrize("step", ["1", "2"])
def test_sagaline_drill_refuses_a_plan_naming_a_tool_no_catalogue_has(
    step: str,
    kafka_bootstrap: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    new_topic_prefix: Callable[..., str],
) -> None:
    """A misspelt tool in the plan ("place_hld", step 2) ended `sagaline drill` in an
    UnknownTool traceback out of the case threads after the whole stage had started,
    and drilling only the steps before it reported every case fine (exit 0)."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setattr(
        drill_cli, "run_drill", functools.partial(run_drill, prefix=new_topic_prefix("drill"))
    )
    calls = json.loads(REFUND_PLAN.read_text())["calls"]
    calls[1] = {**calls[1], "tool": "place_hld"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"calls": calls, "modules": ["services.refund:drill_catalogues"]}))
    code = sagaline(
        [
            "drill",
            "--plan",
            str(path),
            "--seam",
            "after-commit",
            "--step",
            step,
            "--state-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "place_hld" in err and "place_hold" in err, err


class UnreachableVault(ForgetfulVault):
    """A provider whose compensation works but whose lookup API is down."""

    def remove(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.items.pop(ctx.idempotency_key, None)

    def find(self, key: str) -> LookupResult | None:
        raise ConnectionError("vault API unreachable")


def test_a_lookup_that_raises_is_a_failed_case_not_the_end_of_the_drill(
    kafka_bootstrap: str, tmp_path: Path, new_topic_prefix: Callable[..., str]
) -> None:
    """The drill asks the tool's own lookup after each case; one that raised escaped
    run_drill once every case had run, so the whole report was lost (a traceback
    from `sagaline drill`) instead of those cases being FAILED, saying why."""
    report = run_drill(
        [wrap(UnreachableVault(), name="vault")],
        [{"tool": "store", "args": {"item": "a"}}],
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        seams=[Seam.AFTER_COMMIT, Seam.DUPLICATES],
        prefix=new_topic_prefix("drill"),
    )
    assert [r.verdict for r in report.results] == [Verdict.FAILED, Verdict.FAILED], report.matrix()
    for result in report.results:
        assert "lookup" in result.detail and "vault API unreachable" in result.detail, result


class TidyVault(ForgetfulVault):
    """A provider whose compensation really takes the item out (its lookup still
    finds the store operation: it did commit)."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: set[str] = set()

    def remove(self, ctx: CompensationContext) -> None:
        with self.lock:
            self.removed.add(ctx.idempotency_key)

    def is_gone(self, ctx: CompensationContext) -> bool:
        with self.lock:
            return ctx.idempotency_key in self.removed


def _drill_vault(
    kafka_bootstrap: str, tmp_path: Path, prefix: str, seams: list[Seam], **kw: object
) -> dict[Seam, object]:
    report = run_drill(
        [wrap(TidyVault(), name="vault")],
        [{"tool": "store", "args": {"item": "a"}}],
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        seams=seams,
        prefix=prefix,
        **kw,  # type: ignore[arg-type]
    )
    print(report.matrix())
    return {r.seam: r for r in report.results}


def test_a_case_that_raises_is_that_cases_failed_verdict_not_the_end_of_the_drill(
    kafka_bootstrap: str,
    tmp_path: Path,
    new_topic_prefix: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One unexpected exception in a case (here re-sending the duplicates) escaped
    pool.map and ended run_drill: every other case's verdict was lost."""
    from services.drill import _run

    def broken(_stage: object, _saga_id: str, _topics: object) -> int:
        raise RuntimeError("the broker refused the duplicates")

    monkeypatch.setattr(_run._Stage, "reproduce", broken)
    by = _drill_vault(
        kafka_bootstrap,
        tmp_path,
        new_topic_prefix("drill"),
        [Seam.AFTER_COMMIT, Seam.DUPLICATES],
    )
    duplicates = by[Seam.DUPLICATES]
    assert duplicates.verdict is Verdict.FAILED, duplicates  # type: ignore[attr-defined]
    assert "the broker refused the duplicates" in duplicates.detail  # type: ignore[attr-defined]
    assert by[Seam.AFTER_COMMIT].verdict is Verdict.CONVERGED  # type: ignore[attr-defined]


def test_a_duplicates_case_that_re_sent_nothing_is_not_a_pass(
    kafka_bootstrap: str,
    tmp_path: Path,
    new_topic_prefix: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """reproduce() found no record to re-send (0 produced), yet the case counted as
    fired and converged: a duplicates drill that duplicated nothing passed."""
    from services.drill import _run

    monkeypatch.setattr(_run._Stage, "reproduce", lambda _stage, _saga_id, _topics: 0)
    by = _drill_vault(kafka_bootstrap, tmp_path, new_topic_prefix("drill"), [Seam.DUPLICATES])
    duplicates = by[Seam.DUPLICATES]
    assert duplicates.verdict is Verdict.FAILED, duplicates  # type: ignore[attr-defined]
    assert "not injected" in duplicates.detail  # type: ignore[attr-defined]


def test_a_partial_outage_whose_step_was_never_seen_scheduled_is_not_a_pass(
    kafka_bootstrap: str,
    tmp_path: Path,
    new_topic_prefix: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The outage lasts until the step is scheduled, 60 s at most; when that wait ran
    out the participant was started again and the case still counted as fired, so
    an outage nobody observed passed as converged."""
    from services.drill import _run

    real_wait = _run._Watcher.wait

    def wait(self: object, saga_id: str, check: Callable[..., object], timeout_s: float) -> object:
        if timeout_s == 60:  # the outage's wait for StepScheduled: it runs out at once
            return False
        return real_wait(self, saga_id, check, timeout_s)  # type: ignore[arg-type]

    monkeypatch.setattr(_run._Watcher, "wait", wait)
    by = _drill_vault(
        kafka_bootstrap,
        tmp_path,
        new_topic_prefix("drill"),
        [Seam.PARTIAL_OUTAGE],
        case_timeout_s=90.0,  # so that 60 s is the outage's wait alone
    )
    outage = by[Seam.PARTIAL_OUTAGE]
    assert outage.verdict is Verdict.FAILED, outage  # type: ignore[attr-defined]
    assert "not injected" in outage.detail  # type: ignore[attr-defined]


def test_a_step_whose_scheduling_record_the_drill_could_not_read_is_not_judged_agreeing() -> None:
    """The watcher drops records it cannot decode; a step whose StepScheduled was
    among them has no idempotency key, and the comparison of ledger and provider
    skipped it in silence, so the case converged with that step never checked."""
    saga_id = "drill-after-commit-1-abe"
    ended = receipt(
        TerminalStatus.COMPLETED,
        [step("s01-store", "store", Disposition.RETAINED, key="k", op="op-1")],
        saga_id=saga_id,
    )
    terminal = SagaTerminal(
        envelope=envelope_for(
            SagaTerminal, saga_id=saga_id, tenant_id="t", producer="coordinator", now=1
        ),
        status=TerminalStatus.COMPLETED,
        receipt=ended.to_json(),
    )
    board = FaultBoard()
    board.arm(saga_id, "s01-store", Seam.AFTER_COMMIT)
    board.mark_fired(saga_id, "s01-store", Seam.AFTER_COMMIT)
    specs = {"store": wrap(TidyVault(), name="vault")["store"]}
    stage = SimpleNamespace(watcher=_RecordsOf([terminal]), board=board, specs=specs)
    plan = [PlannedCall("store", {})]

    result = _judge(stage, plan, Seam.AFTER_COMMIT, 0, saga_id, "", {}, 1.0)  # type: ignore[arg-type]

    assert result.verdict is Verdict.FAILED, result
    assert "s01-store" in result.detail and "StepScheduled" in result.detail, result


def test_an_unknown_outcome_the_drills_operator_failed_to_settle_is_a_failed_case(
    kafka_bootstrap: str,
    tmp_path: Path,
    new_topic_prefix: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drill settles unknown outcomes as the operator; when that resolution
    failed the watcher swallowed the error, the saga waited for ever on an incident
    the drill itself should have settled, and the case was judged 'escalated,
    awaiting a person': a pass."""
    from sagaline.ops.actions import OperatorActionError
    from services.drill import _run

    def refused(*_args: object, **_kwargs: object) -> object:
        raise OperatorActionError("the operator channel refused the resolution")

    monkeypatch.setattr(_run, "incident_resolved", refused)
    report = run_drill(
        [wrap(Steps(), name="fixture")],
        [{"tool": "reserve"}],
        bootstrap=kafka_bootstrap,
        state_dir=tmp_path,
        seams=[Seam.BEFORE_RECEIPT],
        prefix=new_topic_prefix("drill"),
        case_timeout_s=30.0,
    )
    [result] = report.results
    assert result.verdict is Verdict.FAILED, result
    assert "the operator channel refused the resolution" in result.detail, result


def _open_case(records: list[Record], specs: Mapping[str, object]) -> CaseResult:
    saga_id = "drill-after-commit-1-abf"
    board = FaultBoard()
    board.arm(saga_id, "s01-store", Seam.AFTER_COMMIT)
    stage = SimpleNamespace(watcher=_RecordsOf(records), board=board, specs=specs)
    plan = [PlannedCall("store", {})]
    return _judge(stage, plan, Seam.AFTER_COMMIT, 0, saga_id, "", {}, 0.0)  # type: ignore[arg-type]


def _env(kind: type[Record], saga_id: str = "drill-after-commit-1-abf") -> Envelope:
    return envelope_for(kind, saga_id=saga_id, tenant_id="t", producer="coordinator", now=1)


def _incident_on(step_id: str) -> IncidentRaised:
    return IncidentRaised(
        envelope=_env(IncidentRaised),
        incident_id="inc-1",
        kind="unknown-outcome",
        step_id=step_id,
        tool="store",
        inconsistency="unknown",
        effect="?",
        owner="ops",
    )


def test_a_saga_stuck_after_every_incident_was_resolved_is_not_awaiting_a_person() -> None:
    """Not terminal, with an incident: judged 'escalated, awaiting a person' even when
    that incident had been resolved, i.e. nobody was awaited and the saga was stuck."""
    incident = _incident_on("s01-store")
    resolved = IncidentResolved(
        envelope=_env(IncidentResolved),
        incident_id="inc-1",
        resolved_by="drill-operator",
        resolution="COMMITTED",
    )
    result = _open_case([incident, resolved], {})
    assert result.verdict is Verdict.FAILED, result
    assert "resolved" in result.detail, result


def test_a_saga_awaiting_a_person_whose_committed_step_the_provider_lacks_is_a_failed_case() -> (
    None
):
    """Not terminal, with an open incident: judged escalated without asking the
    provider whether the steps the ledger saw commit are really there."""
    scheduled = StepScheduled(
        envelope=_env(StepScheduled),
        step_id="s01-store",
        args=b'{"item": "a"}',
        args_fingerprint="f",
        contract=StepContract(tool="store", participant="vault", has_lookup=True),
    )
    key = idempotency_key(scheduled.saga_id, "s01-store", "store", scheduled.args)
    committed = StepCommitted(
        envelope=_env(StepCommitted),
        step_id="s01-store",
        tool="store",
        idempotency_key=key,
        attempt=1,
        result=b'"k"',
        response_fingerprint="r",
    )
    specs = {"store": wrap(TidyVault(), name="vault")["store"]}  # empty: it has nothing
    result = _open_case([scheduled, committed, _incident_on("s02-other")], specs)
    assert result.verdict is Verdict.FAILED, result
    assert "s01-store" in result.detail and "provider" in result.detail, result
