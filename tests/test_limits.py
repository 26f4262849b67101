"""Limits, payload references and changelog markers, without a broker (issue 11).

The real-broker behaviour is in tests/test_saga_isolation.py; these pin the pieces:
limits from the environment, the core keeping ledger positions instead of large
payloads (and commands carrying them), the markers' encoding, and that commands
written before the references existed still decode.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import orjson
import pytest
from coordinator_ledger import Ledger
from fastavro import schemaless_writer

from coordinator import Destination, decide
from coordinator.state import MarkerKind, SagaMarker, SagaState, load_changelog, terminal_marker
from participants import CompensationContext, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal
from schemas import (
    CompensateStep,
    CompensationFailed,
    ExecuteStep,
    FailureKind,
    LedgerRef,
    Record,
    SagaOutcome,
    StepCommitted,
    StepContract,
    StepFailed,
    StepScheduled,
    args_fingerprint,
    envelope_for,
    fingerprint,
)
from schemas.codec import MAGIC, Codec
from schemas.limits import (
    LIMIT_ENV_VARS,
    MAX_OPERATOR_TEXT_BYTES,
    Limits,
    is_omitted_result,
    omitted_result,
)
from schemas.registry import AVSC_DIR
from schemas.settings import ENV_VARS, Settings, SettingsError

BIG = {"blob": "b" * 5000}
R = TypeVar("R", bound=Record)


def test_limits_have_documented_defaults_and_are_read_from_the_environment() -> None:
    assert Limits().max_args_bytes == 256 * 1024
    assert Limits().max_record_bytes < 1_000_000  # under the producer's message limit
    assert set(LIMIT_ENV_VARS) <= set(ENV_VARS)
    settings = Settings.from_env({"SAGALINE_MAX_ARGS_BYTES": "1000", "SAGALINE_MAX_STEPS": "3"})
    assert settings.limits == Limits(max_args_bytes=1000, max_steps=3)
    assert Limits().max_participants == 1000
    assert Limits.from_env({"SAGALINE_MAX_PARTICIPANTS": "5"}).max_participants == 5
    with pytest.raises(SettingsError, match="SAGALINE_MAX_RESULT_BYTES='big'"):
        Settings.from_env({"SAGALINE_MAX_RESULT_BYTES": "big"})
    with pytest.raises(SettingsError, match="at least 1"):
        Settings.from_env({"SAGALINE_MAX_STEPS": "0"})


@pytest.mark.parametrize("raw", ["10", "0", "-5", "65535"])
def test_a_record_limit_below_its_minimum_is_refused_at_start_naming_it(raw: str) -> None:
    """SAGALINE_MAX_RECORD_BYTES=10 (a typo, KiB meant) was taken: every saga's state
    was over it, so the coordinator parked every saga (an incident each) and the
    operator channel refused every decision. It is refused at start now, naming the
    variable and the minimum: room for the largest operator decision (three texts of
    MAX_OPERATOR_TEXT_BYTES) copied into a saga's state."""
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"SAGALINE_MAX_RECORD_BYTES": raw})
    said = str(refused.value)
    from schemas.limits import MIN_RECORD_BYTES

    assert MIN_RECORD_BYTES > 3 * MAX_OPERATOR_TEXT_BYTES
    assert f"SAGALINE_MAX_RECORD_BYTES={int(raw)}" in said, said
    assert f"at least {MIN_RECORD_BYTES}" in said, said
    limits = Settings.from_env({"SAGALINE_MAX_RECORD_BYTES": str(MIN_RECORD_BYTES)}).limits
    assert limits.max_record_bytes == MIN_RECORD_BYTES


def test_a_blank_limit_variable_counts_as_unset_like_every_other_variable() -> None:
    """``SAGALINE_MAX_STEPS=" "`` (a compose ``${VAR:- }``, a stray space) stopped every
    process as "not an integer", where a blank SAGALINE_PARTITIONS is taken as unset
    (the README's rule: empty counts as unset, the default applies)."""
    blank = {var: " " for var in LIMIT_ENV_VARS} | {"SAGALINE_PARTITIONS": " "}
    assert Settings.from_env(blank).limits == Limits()
    assert Limits.from_env({"SAGALINE_MAX_STEPS": " 12 "}).max_steps == 12


def test_the_omitted_result_marker_is_recognised() -> None:
    marker = omitted_result(2_000_000, 262_144, "abc")
    assert is_omitted_result(orjson.loads(orjson.dumps(marker)))
    assert not is_omitted_result({"sagaline_result_omitted": 1, "other": 2})


def _run_to_compensation(position: bool) -> tuple[SagaState, list[object]]:
    """One big-argument step that commits a big result, then an abort."""
    ledger = Ledger()
    offsets = iter(range(100, 200))
    state = None
    commands: list[object] = []
    for record in (
        ledger.started(),
        ledger.scheduled("s1", args=BIG),
        ledger.intent("s1"),
    ):
        d = decide(state, record, record.envelope.occurred_at, position=_pos(position, offsets))
        state = d.state
        commands += [o.record for o in d.outputs if o.destination is Destination.COMMAND]
    commit = ledger.committed("s1")
    commit = commit.model_copy(update={"result": orjson.dumps({"echo": "r" * 3000})})
    for record in (commit, ledger.end(SagaOutcome.ABORT)):
        d = decide(state, record, record.envelope.occurred_at, position=_pos(position, offsets))
        state = d.state
        commands += [o.record for o in d.outputs if o.destination is Destination.COMMAND]
    assert state is not None
    return state, commands


def _pos(given: bool, offsets: object) -> tuple[int, int] | None:
    return (3, next(offsets)) if given else None  # type: ignore[call-overload]


def test_large_payloads_are_kept_as_ledger_positions_and_commands_carry_them() -> None:
    state, commands = _run_to_compensation(position=True)
    step = state.steps["s1"]
    assert step.args == b"" and step.result == b""
    assert step.args_ref is not None and step.result_ref is not None
    assert (step.args_ref.partition, step.args_ref.offset) == (3, 101)  # the StepScheduled
    assert (step.result_ref.partition, step.result_ref.offset) == (3, 103)  # the commit
    assert step.args_ref.fingerprint == fingerprint(orjson.dumps(BIG))
    execute = next(c for c in commands if isinstance(c, ExecuteStep))
    compensate = next(c for c in commands if isinstance(c, CompensateStep))
    assert execute.args == b"" and execute.args_ref == step.args_ref
    assert compensate.args_ref == step.args_ref and compensate.result_ref == step.result_ref
    # The state does not hold the 8 KB of payloads.
    assert len(state.to_bytes()) < 6000


def test_without_positions_and_for_small_payloads_everything_stays_inline() -> None:
    state, _commands = _run_to_compensation(position=False)
    step = state.steps["s1"]
    assert step.args == orjson.dumps(BIG) and step.args_ref is None and step.result_ref is None
    ledger = Ledger()
    d = decide(None, ledger.started(), 1, position=(0, 1))
    d = decide(d.state, ledger.scheduled("s1", args={"n": 1}), 2, position=(0, 2))
    assert d.state is not None
    assert d.state.steps["s1"].args == b'{"n":1}' and d.state.steps["s1"].args_ref is None


def test_changelog_values_are_states_or_markers() -> None:
    state, _ = _run_to_compensation(position=True)
    assert isinstance(load_changelog(state.to_bytes()), SagaState)
    marker = terminal_marker(state)
    assert load_changelog(marker.to_bytes()) == marker
    parked = SagaMarker(marker=MarkerKind.PARKED, saga_id="s", status="PARKED", at=1, reason="x")
    assert load_changelog(parked.to_bytes()) == parked
    assert len(parked.to_bytes()) < 200


@pytest.mark.parametrize("name", ["ExecuteStep", "CompensateStep"])
def test_commands_written_before_ledger_references_still_decode(name: str) -> None:
    """A coordinator not yet upgraded writes v1 commands; today's reader knows them."""
    codec = Codec()
    old = codec.registry.register_writer(
        json.loads((AVSC_DIR / "history" / f"{name}.v1.avsc").read_text())
    )
    assert old.fingerprint != codec.registry.reader(name).fingerprint
    ledger = Ledger()
    execute = ExecuteStep(
        envelope=ledger.env(ExecuteStep, "sagaline-coordinator"),
        step_id="s1",
        tool="t",
        args=b"{}",
        idempotency_key="k",
        attempt=1,
        deadline_ms=10,
        principal="p",
    )
    record = (
        execute
        if name == "ExecuteStep"
        else CompensateStep(
            envelope=ledger.env(CompensateStep, "sagaline-coordinator"),
            step_id="s1",
            tool="t",
            compensation="undo",
            args=b"{}",
            result=b"null",
            idempotency_key="k",
            compensation_key="c",
            attempt=1,
        )
    )
    datum = {k: v for k, v in record.model_dump().items() if not k.endswith("_ref")}
    buf = io.BytesIO()
    buf.write(MAGIC + old.fingerprint)
    schemaless_writer(buf, old.parsed, datum)
    decoded = codec.decode(buf.getvalue())
    assert decoded == record


# ------------------------------------------- participants resolve references


class _Vault:
    def __init__(self) -> None:
        self.ran: list[str] = []
        self.undone: list[tuple[object, object]] = []

    @tool(description="Put a blob")
    @compensable(by="take")
    def put(self, blob: str) -> dict[str, str]:
        self.ran.append(blob)
        return {"blob": blob}

    def take(self, ctx: CompensationContext) -> None:
        self.undone.append((ctx.input, ctx.result))


def _cmd(cls: type[R], saga: str = "s-1", **fields: object) -> R:
    env = envelope_for(cls, saga_id=saga, tenant_id="t", producer="sagaline-coordinator", now=1)
    return cls(envelope=env, **fields)


def _scheduled(step: str, args: bytes) -> StepScheduled:
    return _cmd(
        StepScheduled,
        step_id=step,
        args=args,
        args_fingerprint=args_fingerprint(args),
        contract=StepContract(tool="put", participant="vault", compensation="take"),
    )


def _handler(
    tmp_path: Path, fetch: Callable[[LedgerRef], Record | None]
) -> tuple[CommandHandler, list[Record], _Vault]:
    vault = _Vault()
    out: list[Record] = []
    handler = CommandHandler(
        wrap(vault, name="vault"),
        "vault",
        CommandJournal(tmp_path / f"j-{len(list(tmp_path.iterdir()))}.sqlite"),
        out.append,
        fetch=fetch,
    )
    return handler, out, vault


def _execute(ref: LedgerRef) -> ExecuteStep:
    return _cmd(
        ExecuteStep,
        step_id="01-put",
        tool="put",
        args=b"",
        args_ref=ref,
        idempotency_key="k",
        attempt=1,
        deadline_ms=5000,
        principal="p",
    )


def test_a_referenced_payload_is_read_back_and_checked(tmp_path: Path) -> None:
    args = orjson.dumps({"blob": "x" * 3000})
    ref = LedgerRef(partition=0, offset=7, fingerprint=fingerprint(args))
    asked: list[LedgerRef] = []

    def fetch(r: LedgerRef) -> Record | None:
        asked.append(r)
        return _scheduled("01-put", args)

    handler, out, vault = _handler(tmp_path, fetch)
    handler.handle(_execute(ref))
    assert asked == [ref] and vault.ran == ["x" * 3000]
    assert isinstance(out[-1], StepCommitted)
    handler.close()


@pytest.mark.parametrize(
    ("found", "says"),
    [
        (None, "no longer on the ledger"),
        (_scheduled("02-other", b'{"blob":"y"}'), "not the arguments of step 01-put"),
    ],
)
def test_a_reference_that_cannot_be_used_fails_the_step_clearly(
    tmp_path: Path, found: Record | None, says: str
) -> None:
    handler, out, vault = _handler(tmp_path, lambda r: found)
    handler.handle(_execute(LedgerRef(partition=0, offset=7, fingerprint="f" * 32)))
    failed = out[-1]
    assert isinstance(failed, StepFailed)
    assert failed.kind is FailureKind.BUSINESS_REJECTION  # the tool never ran: unwind
    assert failed.error_type == "LedgerRefError" and says in failed.message
    assert vault.ran == []
    handler.close()


def test_a_compensation_whose_result_is_gone_fails_finally(tmp_path: Path) -> None:
    handler, out, vault = _handler(tmp_path, lambda r: None)
    handler.handle(
        _cmd(
            CompensateStep,
            step_id="01-put",
            tool="put",
            compensation="take",
            args=b'{"blob":"x"}',
            result=b"",
            result_ref=LedgerRef(partition=1, offset=9, fingerprint="f" * 32),
            idempotency_key="k",
            compensation_key="c",
            attempt=1,
        )
    )
    failed = out[-1]
    assert isinstance(failed, CompensationFailed)
    assert failed.kind is FailureKind.BUSINESS_REJECTION  # an incident, not retried
    assert "sagaline.events[1]@9" in failed.message
    assert vault.undone == []
    handler.close()
