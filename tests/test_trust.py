"""Identities and permissions (issue 12): who signed a record, and may they write it.

No broker here: the verifier as ``from_message`` runs it, the core's writer checks,
sealing across key rotation. The same refusals on the real broker are in
tests/test_trust_kafka.py.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from coordinator.core import CorePolicy, decide
from schemas import (
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    ExecuteStep,
    IncidentResolved,
    Reversibility,
    SagaStarted,
    SagaTerminal,
    StepCommitted,
    StepContract,
    StepScheduled,
    TerminalStatus,
    args_fingerprint,
    envelope_for,
)
from schemas.errors import (
    BadSignature,
    ForbiddenWriter,
    MissingSignature,
    RetiredKey,
    TenantMismatch,
    UnknownKey,
)
from schemas.models import Record
from schemas.sealing import Sealer, SealError, _aad, derive_key
from schemas.settings import Settings
from schemas.signing import Signer
from schemas.trust import IdentitySigner, Role, TrustFileError, TrustStore
from schemas.wire import from_message, to_message
from tests.trust_kit import TrustKit

NOW = 1_700_000_000_000


@pytest.fixture
def kit(tmp_path: Path) -> TrustKit:
    kit = TrustKit(tmp_path)
    kit.add("sagaline-coordinator", Role.COORDINATOR)
    kit.add("payments", Role.PARTICIPANT, tenants=["acme"])
    kit.add("mailer", Role.PARTICIPANT)
    kit.add("agent", Role.AGENT, principals=["user:1"], tenants=["acme"])
    kit.add("alice", Role.OPERATOR)
    return kit


def _env(t: type[Record], producer: str, tenant: str = "acme", **kw: Any) -> Any:
    return envelope_for(t, saga_id="s-1", tenant_id=tenant, producer=producer, now=NOW, **kw)


def _execute(producer: str, tenant: str = "acme") -> ExecuteStep:
    return ExecuteStep(
        envelope=_env(ExecuteStep, producer, tenant),
        step_id="st-1",
        tool="charge",
        args=b"{}",
        idempotency_key="ik",
        attempt=1,
        deadline_ms=1000,
        principal="user:1",
    )


def _grant(producer: str, granted_by: str) -> ApprovalGranted:
    return ApprovalGranted(
        envelope=_env(ApprovalGranted, producer),
        step_id="st-1",
        approval_id="a-1",
        purpose=ApprovalPurpose.FORWARD,
        principal="user:1",
        args_fingerprint="fp",
        scope="payments/charge:execute",
        expires_at=NOW + 1000,
        granted_by=granted_by,
    )


def _terminal(producer: str) -> SagaTerminal:
    return SagaTerminal(
        envelope=_env(SagaTerminal, producer), status=TerminalStatus.COMPLETED, receipt=b"{}"
    )


def _roundtrip(kit: TrustKit, writer: str, record: Record, reader: str | None = None) -> Record:
    key, value, headers = to_message(record, kit.signer(writer))
    return from_message(key, value, headers, kit.signer(reader))


def test_coordinator_commands_and_terminal_pass(kit: TrustKit) -> None:
    for record in (_execute("sagaline-coordinator"), _terminal("sagaline-coordinator")):
        assert _roundtrip(kit, "sagaline-coordinator", record) == record


def test_participant_key_forging_a_command_or_terminal_is_a_forbidden_writer(kit: TrustKit) -> None:
    for record in (_execute("mailer"), _terminal("mailer")):
        with pytest.raises(ForbiddenWriter, match="mailer"):
            _roundtrip(kit, "mailer", record)


def test_participant_key_claiming_the_coordinators_name_is_a_forbidden_writer(
    kit: TrustKit,
) -> None:
    with pytest.raises(ForbiddenWriter, match="claims producer 'sagaline-coordinator'"):
        _roundtrip(kit, "mailer", _committed("sagaline-coordinator", None))


def test_only_an_operator_grants_and_only_in_its_own_name(kit: TrustKit) -> None:
    assert _roundtrip(kit, "alice", _grant("alice", "alice")).granted_by == "alice"
    with pytest.raises(ForbiddenWriter, match="may not write ApprovalGranted"):
        _roundtrip(kit, "agent", _grant("agent", "agent"))
    with pytest.raises(ForbiddenWriter, match="operators act only in their own name"):
        _roundtrip(kit, "alice", _grant("alice", "bob"))


def test_agent_starts_sagas_only_for_its_principals(kit: TrustKit) -> None:
    def started(principal: str) -> SagaStarted:
        return SagaStarted(envelope=_env(SagaStarted, "agent"), workflow="w", principal=principal)

    assert _roundtrip(kit, "agent", started("user:1"))
    with pytest.raises(ForbiddenWriter, match="user:2"):
        _roundtrip(kit, "agent", started("user:2"))


def test_writer_outside_its_tenants_is_a_tenant_mismatch(kit: TrustKit) -> None:
    resolved = IncidentResolved(
        envelope=_env(IncidentResolved, "alice", tenant="beta"),
        incident_id="i",
        resolved_by="alice",
        resolution="x",
    )
    assert _roundtrip(kit, "alice", resolved)  # operators without tenants: all tenants
    scheduled = StepScheduled(
        envelope=_env(StepScheduled, "agent", tenant="beta"),
        step_id="st",
        args=b"{}",
        args_fingerprint=args_fingerprint(b"{}"),
        contract=StepContract(tool="charge", participant="payments"),
    )
    with pytest.raises(TenantMismatch, match="beta"):
        _roundtrip(kit, "agent", scheduled)


def test_a_gateway_decides_for_an_operator_only_within_that_operators_tenants(
    kit: TrustKit,
) -> None:
    kit.add("bob", Role.OPERATOR, tenants=["acme"])
    kit.add("dashboard", Role.OPERATOR, acts_for=["alice", "bob"])

    def grant(granted_by: str, tenant: str) -> ApprovalGranted:
        return _grant("dashboard", granted_by).model_copy(
            update={"envelope": _env(ApprovalGranted, "dashboard", tenant=tenant)}
        )

    assert _roundtrip(kit, "dashboard", grant("bob", "acme"))
    assert _roundtrip(kit, "dashboard", grant("alice", "beta"))  # alice: every tenant
    # bob's own key cannot decide for tenant beta, so neither can the gateway as bob.
    with pytest.raises(TenantMismatch, match="beta"):
        _roundtrip(
            kit,
            "bob",
            grant("bob", "beta").model_copy(
                update={"envelope": _env(ApprovalGranted, "bob", tenant="beta")}
            ),
        )
    with pytest.raises(TenantMismatch, match="bob"):
        _roundtrip(kit, "dashboard", grant("bob", "beta"))


def test_participant_limited_to_tenants_refuses_commands_of_others(kit: TrustKit) -> None:
    assert _roundtrip(kit, "sagaline-coordinator", _execute("sagaline-coordinator"), "payments")
    with pytest.raises(TenantMismatch, match="payments"):
        _roundtrip(
            kit, "sagaline-coordinator", _execute("sagaline-coordinator", "beta"), "payments"
        )


def test_unknown_key_unsigned_hmac_and_tampered_records_are_refused(
    kit: TrustKit, tmp_path: Path
) -> None:
    stranger = TrustKit(tmp_path / "other")
    stranger.add("sagaline-coordinator", Role.COORDINATOR)
    record = _execute("sagaline-coordinator")
    key, value, headers = to_message(record, stranger.signer("sagaline-coordinator"))
    with pytest.raises(UnknownKey):
        from_message(key, value, headers, kit.signer())
    key, value, headers = to_message(record, Signer(b"shared"))
    with pytest.raises(BadSignature, match="HMAC"):
        from_message(key, value, headers, kit.signer())
    with pytest.raises(MissingSignature):
        from_message(key, value, [], kit.signer())
    key, value, headers = to_message(record, kit.signer("sagaline-coordinator"))
    with pytest.raises(BadSignature, match="Ed25519"):
        from_message(key, value[:-1] + bytes([value[-1] ^ 1]), headers, kit.signer())


def test_rotation_old_key_accepted_until_retired_then_refused(kit: TrustKit) -> None:
    reader = kit.signer()
    old = kit.current["alice"]
    old_message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    new = kit.add("alice", Role.OPERATOR)
    new_message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    assert from_message(*old_message, reader) and from_message(*new_message, reader)
    kit.retire(old)
    with pytest.raises(RetiredKey, match=old):
        from_message(*old_message, reader)
    assert from_message(*new_message, reader)
    assert kit.signer("alice", new).can_sign and not kit.signer("alice", old).can_sign


def test_settings_pick_the_identity_signer_only_with_a_trust_file(kit: TrustKit) -> None:
    base = Settings(hmac_key=b"dev")
    assert type(base.signer()) is Signer
    signer = kit.settings(base, "payments").signer()
    assert signer.enabled and "payments" in repr(signer) and "BEGIN" not in repr(signer)


def test_a_broken_trust_file_names_what_to_fix(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"identities": {"x": {"role": "wizard"}}}))
    with pytest.raises(TrustFileError, match="needs a role"):
        TrustStore.load(bad)
    with pytest.raises(TrustFileError, match="cannot read"):
        TrustStore.load(tmp_path / "missing.json")
    bad.write_bytes(b'{"identities": {"\xff": {}}}')  # not UTF-8
    with pytest.raises(TrustFileError, match="not UTF-8"):
        TrustStore.load(bad)
    bad.write_text("[" * 100_000)  # nested past the parser's recursion limit
    with pytest.raises(TrustFileError, match="does not parse"):
        TrustStore.load(bad)


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"identities": []}, "identities"),
        ({"identities": {"x": "participant"}}, "'x'"),
        ({"keys": {"k": "AAAA"}}, "'k'"),
        # One string where a list belongs: it would be its characters ("a", "c"...).
        ({"identities": {"x": {"role": "agent", "tenants": "acme"}}}, "tenants"),
        ({"identities": {"x": {"role": "agent", "principals": "user:42"}}}, "principals"),
        ({"identities": {"x": {"role": "operator", "acts_for": "alice"}}}, "acts_for"),
        ({"identities": {"x": {"role": "participant", "tenants": 5}}}, "tenants"),
        ({"keys": {"k": {"identity": ["x"], "public_key": "AAAA"}}}, "'k'"),
    ],
)
def test_a_trust_file_of_the_wrong_shape_names_what_to_fix(
    tmp_path: Path, data: dict[str, Any], names: str
) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(TrustFileError, match=names):
        TrustStore.load(bad)


def test_an_empty_principals_list_is_refused_naming_the_identity(tmp_path: Path) -> None:
    """``"principals": []`` silently became the identity's own name: an agent the file
    says may start sagas for nobody could start them for itself."""
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"identities": {"bot": {"role": "agent", "principals": []}}}))
    with pytest.raises(TrustFileError, match=r"identity 'bot'.*principals.*leave it out"):
        TrustStore.load(bad)


@pytest.mark.parametrize(
    "keys",
    [
        {"k": "AAAA"},
        # A key naming its identity as a list: unhashable, not a TrustFileError.
        {"k": {"identity": ["alice"], "public_key": "AAAA"}},
    ],
)
def test_a_broken_edit_of_the_trust_file_keeps_the_last_good_one(
    kit: TrustKit, keys: dict[str, Any]
) -> None:
    reader = kit.signer()
    message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    assert from_message(*message, reader)
    broken = {"identities": kit.data["identities"], "keys": keys}
    kit.trust_file.write_text(json.dumps(broken))
    assert from_message(*message, reader)  # not an AttributeError out of the reader


# ------------------------------------------------------------------ the core's checks

BOUND = CorePolicy(bind_writers=True)


def _started(producer: str = "agent") -> Any:
    record = SagaStarted(envelope=_env(SagaStarted, producer), workflow="w", principal="user:1")
    return decide(None, record, NOW, BOUND).state


def _dispatched() -> tuple[Any, ExecuteStep]:
    state = _started()
    scheduled = StepScheduled(
        envelope=_env(StepScheduled, "agent"),
        step_id="st-1",
        args=b"{}",
        args_fingerprint=args_fingerprint(b"{}"),
        contract=StepContract(tool="charge", participant="payments"),
    )
    decision = decide(state, scheduled, NOW, BOUND)
    [command] = [o.record for o in decision.outputs if isinstance(o.record, ExecuteStep)]
    assert isinstance(command, ExecuteStep)
    return decision.state, command


def _committed(producer: str, causation: str | None, tenant: str = "acme") -> StepCommitted:
    return StepCommitted(
        envelope=_env(StepCommitted, producer, tenant, causation_id=causation),
        step_id="st-1",
        tool="charge",
        idempotency_key="ik",
        attempt=1,
        result=b"{}",
        response_fingerprint="r",
    )


def _reasons(decision: Any) -> list[str]:
    return [o.reason for o in decision.outputs if o.reason]


def test_core_accepts_the_outcome_of_the_participant_the_command_went_to() -> None:
    state, command = _dispatched()
    decision = decide(state, _committed("payments", command.event_id), NOW, BOUND)
    assert _reasons(decision) == []
    assert decision.state is not None and decision.state.steps["st-1"].status.value == "COMMITTED"


def test_core_refuses_an_outcome_from_another_participant_or_for_no_command() -> None:
    state, command = _dispatched()
    forged = _committed("mailer", command.event_id)
    assert _reasons(decide(state, forged, NOW, BOUND)) == ["forbidden-writer"]
    uncaused = _committed("payments", "made-up")
    assert _reasons(decide(state, uncaused, NOW, BOUND)) == ["forbidden-writer"]
    # Refused records are not remembered: the real one with the same id still counts.
    after = decide(state, forged, NOW, BOUND).state
    real = _committed("payments", command.event_id).model_copy(
        update={"envelope": forged.envelope.model_copy(update={"producer": "payments"})}
    )
    assert _reasons(decide(after, real, NOW, BOUND)) == []


def test_core_refuses_another_agent_driving_the_saga() -> None:
    state = _started("agent")
    scheduled = StepScheduled(
        envelope=_env(StepScheduled, "other-agent"),
        step_id="st-1",
        args=b"{}",
        args_fingerprint=args_fingerprint(b"{}"),
        contract=StepContract(tool="charge", participant="payments"),
    )
    assert _reasons(decide(state, scheduled, NOW, BOUND)) == ["forbidden-writer"]


def test_core_refuses_a_record_of_another_tenant_and_raises_an_incident() -> None:
    state, command = _dispatched()
    decision = decide(state, _committed("payments", command.event_id, "beta"), NOW)
    assert _reasons(decision) == ["tenant-mismatch"]
    assert decision.state is not None
    [incident] = decision.state.incidents
    assert incident.kind == "tenant-mismatch" and "beta" in incident.inconsistency
    assert decision.state.steps["st-1"].status.value == "DISPATCHED"
    again = decide(decision.state, _committed("payments", command.event_id, "gamma"), NOW)
    assert _reasons(again) == ["tenant-mismatch"]  # refused again, but one incident is open
    assert again.state is not None and len(again.state.incidents) == 1


def _awaiting_approval() -> tuple[Any, StepScheduled, ApprovalRequested]:
    state = _started()
    scheduled = StepScheduled(
        envelope=_env(StepScheduled, "agent"),
        step_id="st-1",
        args=b"{}",
        args_fingerprint=args_fingerprint(b"{}"),
        contract=StepContract(
            tool="wire", participant="payments", reversibility=Reversibility.IRREVERSIBLE
        ),
    )
    decision = decide(state, scheduled, NOW, BOUND)
    [request] = [o.record for o in decision.outputs if isinstance(o.record, ApprovalRequested)]
    assert isinstance(request, ApprovalRequested)
    return decision.state, scheduled, request


def test_a_writer_cannot_shadow_an_operators_decision_by_writing_its_event_id_first_R7_R15() -> (
    None
):
    """An operator's decision has a deterministic event id (a retry counts once), derived
    from what every reader of the saga sees: saga, approval id, operator name. The saga's
    own agent may write records on the saga, so it can write one of its own (a harmless
    repeat of its step) under that id before the operator decides. With identities the
    core must not take the operator's real grant for a duplicate of the agent's record:
    that dropped the grant unseen (and `--wait` said it counted)."""
    from sagaline.ops.actions import approval_denied, approval_granted

    state, scheduled, request = _awaiting_approval()
    grant = approval_granted(request, operator="alice", now=NOW + 1, producer="alice")
    squat = scheduled.model_copy(
        update={"envelope": scheduled.envelope.model_copy(update={"event_id": grant.event_id})}
    )
    taken = decide(state, squat, NOW + 1, BOUND)
    assert _reasons(taken) == []  # the same step again: idempotent, and the agent's to write
    granted = decide(taken.state, grant, NOW + 2, BOUND)
    executed = [o.record for o in granted.outputs if isinstance(o.record, ExecuteStep)]
    assert [r.step_id for r in executed] == ["st-1"], "the operator's grant was dropped"
    again = decide(granted.state, grant, NOW + 3, BOUND)  # a retry of the same decision
    assert again.changed is False and again.outputs == []

    state, scheduled, request = _awaiting_approval()
    denial = approval_denied(request, operator="alice", reason="no", now=NOW + 1, producer="alice")
    squat = scheduled.model_copy(
        update={"envelope": scheduled.envelope.model_copy(update={"event_id": denial.event_id})}
    )
    denied = decide(decide(state, squat, NOW + 1, BOUND).state, denial, NOW + 2, BOUND)
    assert denied.state is not None
    assert denied.state.steps["st-1"].status.value == "FAILED", "the denial was dropped"


# ------------------------------------------------------------------ sealing rotation

ARGS = {"card": "4111 1111 1111 1111", "amount": 5}


def test_sealed_values_name_their_key_id_and_open_after_rotation() -> None:
    before = Sealer(b"old secret", "s1").seal(ARGS, ["card"], "saga-1")
    assert before["card"]["kid"] == "s1"
    rotated = Sealer(b"new secret", "s2", {"s1": b"old secret"})
    assert rotated.open(before, ["card"], "saga-1") == ARGS
    after = rotated.seal(ARGS, ["card"], "saga-1")
    assert after["card"]["kid"] == "s2"
    with pytest.raises(SealError, match="'s1'"):
        Sealer(b"new secret", "s2").open(before, ["card"], "saga-1")


def test_values_sealed_before_key_ids_still_open() -> None:
    """A value sealed by the earlier release (no kid, SHA-256 derived key) opens."""
    nonce = b"\x00" * 12
    box = AESGCM(derive_key(b"secret")).encrypt(
        nonce, orjson.dumps(ARGS["card"]), _aad("saga-1", "card")
    )
    old_style = {"card": {"$sealed": base64.b64encode(nonce + box).decode(), "fp": "x"}}
    assert Sealer(b"secret", "s1").open(old_style, ["card"], "saga-1") == {"card": ARGS["card"]}


def test_keys_new_writes_a_private_key_and_prints_a_usable_trust_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    pem = tmp_path / "alice.pem"
    assert main(["keys", "new", "alice", "--role", "operator", "--out", str(pem)]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert pem.stat().st_mode & 0o077 == 0 and "PRIVATE" not in json.dumps(entry)
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(entry))
    signer = Settings(trust_file=trust, signing_key=pem).signer()
    assert isinstance(signer, IdentitySigner) and signer.identity is not None
    assert signer.identity.name == "alice" and signer.can_sign
    assert main(["keys", "new", "alice", "--role", "operator", "--out", str(pem)]) == 2


def test_an_agent_with_an_identity_key_writes_under_its_identity(kit: TrustKit) -> None:
    from participants.client import SagaClient

    kit.add("refund-bot", Role.AGENT)
    client = SagaClient(kit.settings(Settings(), "refund-bot"), "127.0.0.1:9")
    assert client.producer_name == "refund-bot"
    assert SagaClient(Settings(), "127.0.0.1:9").producer_name == "agent"


def test_core_accepts_a_participant_incident_only_for_its_own_dispatched_step() -> None:
    from schemas import IncidentRaised

    state, command = _dispatched()

    def incident(producer: str, step_id: str | None) -> IncidentRaised:
        return IncidentRaised(
            envelope=_env(IncidentRaised, producer, causation_id=command.event_id),
            incident_id=f"inc-{producer}-{step_id}",
            kind="unknown-outcome-no-lookup",
            step_id=step_id,
            inconsistency="may have acted",
            effect="unknown",
            owner="billing",
        )

    assert _reasons(decide(state, incident("payments", "st-1"), NOW, BOUND)) == []
    assert _reasons(decide(state, incident("mailer", "st-1"), NOW, BOUND)) == ["forbidden-writer"]
    assert _reasons(decide(state, incident("payments", None), NOW, BOUND)) == ["forbidden-writer"]


def test_a_record_is_verified_and_authorized_against_one_reading_of_the_trust_file(
    kit: TrustKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit landing between the signature check and the permission check must not
    verify a record with one entry's key and authorize it as another entry's identity:
    here a command signed by the mailer, whose key id is reassigned to the coordinator
    (with the coordinator's public key) while the record is being read."""
    import schemas.wire

    reader = kit.signer()
    mailer_kid = kit.current["mailer"]
    forged = to_message(_execute("sagaline-coordinator"), kit.signer("mailer"))
    coordinator_key = kit.data["keys"][kit.current["sagaline-coordinator"]]["public_key"]
    real_decode = schemas.wire.decode

    def decode_then_edit(value: bytes, *expected: Any) -> Record:
        kit.data["keys"][mailer_kid] = {
            "identity": "sagaline-coordinator",
            "public_key": coordinator_key,
        }
        kit._write()
        return real_decode(value, *expected)

    monkeypatch.setattr(schemas.wire, "decode", decode_then_edit)
    with pytest.raises(ForbiddenWriter, match="'mailer'"):
        from_message(*forged, reader)


def test_keys_new_into_a_missing_directory_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    out = tmp_path / "no-such-dir" / "alice.pem"
    assert main(["keys", "new", "alice", "--role", "operator", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "Traceback" not in err and not out.exists()


def test_keys_new_refuses_names_no_process_could_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A blank identity, or --tenants/--principals naming nothing, would be an entry no
    record could pass ("tenants": [] allows no tenant); "acme, globex" means both."""
    from services.cli import main

    out = tmp_path / "k.pem"
    for argv in (
        ["keys", "new", " ", "--role", "operator"],
        ["keys", "new", "alice", "--role", "operator", "--tenants", ","],
        ["keys", "new", "bot", "--role", "agent", "--principals", " "],
    ):
        assert main([*argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("keys new: ") and err.count("\n") == 1, (argv, err)
        assert not out.exists()
    argv = ["keys", "new", "alice", "--role", "operator", "--tenants", "acme, globex"]
    assert main([*argv, "--out", str(out)]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["identities"]["alice"]["tenants"] == ["acme", "globex"]


def test_a_broken_edit_is_read_and_logged_once_not_at_every_record(
    kit: TrustKit, caplog: pytest.LogCaptureFixture
) -> None:
    reader = kit.signer()
    message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    assert from_message(*message, reader)
    kit.trust_file.write_text("{ not json")
    with caplog.at_level("ERROR", logger="sagaline.trust"):
        for _ in range(3):
            assert from_message(*message, reader)  # the last good contents
    assert len([r for r in caplog.records if "keeping the previous" in r.message]) == 1
    kit.retire(kit.current["alice"])  # the next edit is read again
    with pytest.raises(RetiredKey):
        from_message(*message, reader)


def _rewrite_in_place_same_size_and_mtime(path: Path, text: str) -> None:
    """Rewrite ``path`` in place (same inode) with ``text`` of the same size, then put
    its mtime back: what an editor or a config manager does within one mtime tick."""
    before = path.stat()
    assert len(text.encode()) == before.st_size
    with path.open("r+", encoding="utf-8") as f:
        f.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


def test_a_same_size_rewrite_within_one_mtime_tick_is_seen(kit: TrustKit) -> None:
    """Revoking a key by editing one character kept the old contents: the change
    detection looked only at inode, mtime and size, so the retired key stayed trusted."""
    alice = kit.current["alice"]
    kit.data["keys"][alice]["retired"] = False
    kit._write()
    reader = kit.signer()
    message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    assert from_message(*message, reader)
    text = kit.trust_file.read_text()
    revoked = text.replace('"retired": false', '"retired": true ')
    assert revoked != text
    _rewrite_in_place_same_size_and_mtime(kit.trust_file, revoked)
    with pytest.raises(RetiredKey, match=alice):
        from_message(*message, reader)


def test_a_change_stat_cannot_show_is_seen_at_the_next_content_check(
    kit: TrustKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system whose timestamps cannot tell two writes apart (a coarse clock, a
    network mount caching attributes): the contents are compared now and then, so the
    revocation is seen at the next check, not at the next unrelated edit."""
    import schemas.trust

    alice = kit.current["alice"]
    kit.data["keys"][alice]["retired"] = False
    kit._write()
    clock = [1000.0]
    monkeypatch.setattr(schemas.trust, "_monotonic", lambda: clock[0])
    stale = schemas.trust._stamp(kit.trust_file)
    monkeypatch.setattr(schemas.trust, "_stamp", lambda path: stale)  # stat shows nothing
    monkeypatch.setattr(schemas.trust, "_racy", lambda stamp: False)  # nor do the times
    reader = kit.signer()
    message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    assert from_message(*message, reader)
    text = kit.trust_file.read_text()
    kit.trust_file.write_text(text.replace('"retired": false', '"retired": true '))
    assert from_message(*message, reader)  # within one check interval: not read yet
    clock[0] += schemas.trust.TrustStore.CONTENT_CHECK_S
    with pytest.raises(RetiredKey, match=alice):
        from_message(*message, reader)


def _rotate_in_place(kit: TrustKit, identity: str, settings_key: Path) -> str:
    """A new key for ``identity`` written over the key file the process was given (a
    secret manager's rotation), its entry added to the trust file; its key id."""
    new = kit.add(identity, Role.PARTICIPANT)
    settings_key.write_bytes(kit.key_files[new].read_bytes())
    return new


def test_a_process_picks_up_its_rotated_key_from_its_key_file(kit: TrustKit) -> None:
    """The signing key was read once at start: after the operator put the new key in
    SAGALINE_SIGNING_KEY and retired the old one, the process went on signing with the
    old key and every reader refused its records (retired-key)."""
    old = kit.current["payments"]
    signer = kit.settings(Settings(), "payments").signer()
    reader = kit.signer()
    record = _committed("payments", "c-1")
    assert from_message(*to_message(record, signer), reader)
    new = _rotate_in_place(kit, "payments", kit.key_files[old])
    kit.retire(old)
    key, value, headers = to_message(record, signer)
    assert dict(headers)["sagaline-kid"] == new.encode()
    assert from_message(key, value, headers, reader)
    assert signer.can_sign and signer.key_id == new


def test_a_process_whose_key_is_retired_without_a_new_one_refuses_to_sign(
    kit: TrustKit,
) -> None:
    """Signing on with a retired key wrote records every reader refuses: the
    coordinator's commands dropped by participants, a participant's outcomes by the
    coordinator after its tool had run. Now the write fails with one error that says
    what to do."""
    from schemas.trust import SigningKeyError

    old = kit.current["payments"]
    signer = kit.settings(Settings(), "payments").signer()
    kit.retire(old)
    with pytest.raises(SigningKeyError, match=rf"{old}.*retired.*SAGALINE_SIGNING_KEY"):
        to_message(_committed("payments", "c-1"), signer)
    assert not signer.can_sign
    new = _rotate_in_place(kit, "payments", kit.key_files[old])  # the fix, no restart
    assert dict(to_message(_committed("payments", "c-1"), signer)[2])["sagaline-kid"] == (
        new.encode()
    )


def test_a_new_key_file_is_used_only_once_the_trust_file_lists_it_for_the_same_identity(
    kit: TrustKit, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The key file replaced before the trust file is edited (or with another
    identity's key): the process keeps signing with its live key, says why once,
    and switches when the trust file lists the new key."""
    import schemas.trust
    from schemas.trust import new_key_pair

    clock = [1000.0]
    monkeypatch.setattr(schemas.trust, "_monotonic", lambda: clock[0])
    old = kit.current["payments"]
    signer = kit.settings(Settings(), "payments").signer()
    reader = kit.signer()
    record = _committed("payments", "c-1")
    pem, new, entry = new_key_pair("payments", Role.PARTICIPANT)
    kit.key_files[old].write_bytes(pem)  # not in the trust file yet
    with caplog.at_level("ERROR", logger="sagaline.trust"):
        for _ in range(3):
            clock[0] += schemas.trust.KEY_CHECK_S
            message = to_message(record, signer)
            assert dict(message[2])["sagaline-kid"] == old.encode()
            assert from_message(*message, reader)
    assert [r.getMessage() for r in caplog.records if "cannot sign yet" in r.getMessage()] == [
        f"the new key in {kit.key_files[old]} cannot sign yet (its public key is not in the "
        f"trust file); still signing with {old!r}"
    ]
    kit.data["keys"][new] = {**entry["keys"][new], "identity": "mailer"}  # another's
    kit._write()
    clock[0] += schemas.trust.KEY_CHECK_S
    assert dict(to_message(record, signer)[2])["sagaline-kid"] == old.encode()
    kit.data["keys"][new] = entry["keys"][new]
    kit._write()
    assert dict(to_message(record, signer)[2])["sagaline-kid"] == old.encode()  # not yet due
    clock[0] += schemas.trust.KEY_CHECK_S
    message = to_message(record, signer)
    assert dict(message[2])["sagaline-kid"] == new.encode()
    assert from_message(*message, reader)


def test_a_process_serves_the_tenants_the_trust_file_gives_it_now(kit: TrustKit) -> None:
    """The reader's own tenants were those of start: after the operator took tenant
    globex from payments, payments still ran globex's commands (its tool's effect
    happened) and the coordinator refused the outcome (payments may not act for
    globex any more), so the ledger never learned of the charge."""
    kit.data["identities"]["payments"]["tenants"] = ["acme", "globex"]
    kit._write()
    payments = kit.signer("payments")
    command = to_message(
        _execute("sagaline-coordinator", "globex"), kit.signer("sagaline-coordinator")
    )
    assert from_message(*command, payments)
    kit.data["identities"]["payments"]["tenants"] = ["acme"]
    kit._write()
    with pytest.raises(TenantMismatch, match="globex"):
        from_message(*command, payments)
    assert payments.identity is not None and payments.identity.tenants == {"acme"}


def test_an_edit_read_by_another_thread_meanwhile_is_not_undone(
    kit: TrustKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads re-reading the trust file as it is edited twice: the slower one,
    holding the first edit, stored it after the quicker one had stored the second,
    while the hash remembered was the second's; the store kept the first edit's keys
    (here: alice's key live) and, the contents hash matching, never read the file
    again until some later edit, so the revocation was lost."""
    reader = kit.signer()
    message = to_message(_grant("alice", "alice"), kit.signer("alice"))
    store = reader.trust
    real_parse = TrustStore._parse
    calls: list[int] = []

    def parse_while_another_thread_reads(path: Path, raw: bytes) -> TrustStore:
        calls.append(1)
        if len(calls) == 1:  # the slow reader, holding edit 1: edit 2 lands and is read
            kit.retire(kit.current["alice"])
            store.refresh()
        return real_parse(path, raw)

    monkeypatch.setattr(TrustStore, "_parse", staticmethod(parse_while_another_thread_reads))
    kit.add("mailer", Role.PARTICIPANT)  # edit 1
    store.refresh()
    monkeypatch.setattr(TrustStore, "_parse", staticmethod(real_parse))
    with pytest.raises(RetiredKey):
        from_message(*message, reader)


@pytest.mark.parametrize("command", [["participant", "run", "payments"], ["dashboard"]])
def test_a_broken_trust_file_stops_a_service_with_one_line_not_a_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    """docs/security.md: a trust file of the wrong shape is refused at start-up with
    what to fix. `sagaline participant run` (and the dashboard) ended in a traceback."""
    from services.cli import main

    bad = tmp_path / "trust.json"
    bad.write_text(json.dumps({"identities": {"payments": {"role": "wizard"}}}))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    monkeypatch.setenv("SAGALINE_TRUST_FILE", str(bad))
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("SAGALINE_SIGNING_KEY", raising=False)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "needs a role" in err and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_an_approval_wait_is_not_ended_by_another_participants_report(kit: TrustKit) -> None:
    """approval_request() (the MCP proxy asks the person only once it returns the
    request) ended at any StepCommitted of the step: one the mailer forged before the
    coordinator asked, which the coordinator refuses, made it return None, so nobody
    was asked and the step waited out its approval. With identities only the step's
    participant reports on it, as for the call's own wait."""
    from types import SimpleNamespace

    from participants.client import Saga, _Ledger
    from schemas import ApprovalRequested

    ledger = _Ledger()
    ledger.follow("s-1")
    client: Any = SimpleNamespace(_ledger=ledger, signer=kit.signer("agent"), producer_name="agent")
    saga = Saga(
        client,
        saga_id="s-1",
        tenant_id="acme",
        workflow="w",
        principal="user:1",
        workflow_version="",
        policy_version="",
        continue_on_compensation_failure=False,
    )
    scheduled = StepScheduled(
        envelope=_env(StepScheduled, "agent"),
        step_id="st-1",
        args=b"{}",
        args_fingerprint=args_fingerprint(b"{}"),
        contract=StepContract(tool="charge", participant="payments"),
    )
    saga._contracts["st-1"] = scheduled.contract
    request = ApprovalRequested(
        envelope=_env(ApprovalRequested, "sagaline-coordinator"),
        step_id="st-1",
        approval_id="appr-1",
        purpose=ApprovalPurpose.FORWARD,
        principal="user:1",
        args_fingerprint=scheduled.args_fingerprint,
        scope="payments/charge:execute",
        expires_at=NOW + 60_000,
    )
    ledger.add([scheduled, _committed("mailer", "no-such-command"), request])
    assert saga.approval_request("st-1", 0) == request
    # The step's own participant still ends the wait (the step ran without asking).
    ledger2 = _Ledger()
    ledger2.follow("s-1")
    saga.client = SimpleNamespace(_ledger=ledger2, signer=client.signer, producer_name="agent")
    ledger2.add([scheduled, _committed("payments", "cmd-1"), request])
    assert saga.approval_request("st-1", 0) is None


@pytest.mark.parametrize("who", ["bob", "payments"])
def test_a_gateway_refusing_an_operator_says_which_acts_for_to_fix(kit: TrustKit, who: str) -> None:
    """A dashboard key whose acts_for does not cover the logged-in operator (left out,
    or named there without an operator identity of its own, which the trust file
    drops from acts_for) refused with CLI advice: "an operator decides only in their
    own name (drop --operator or use their key)", nothing about acts_for. Now the
    refusal names the gateway's acts_for and, when so, that the name is no operator
    identity in the trust file."""
    from sagaline.ops.actions import NoUsableKey, OperatorChannel
    from schemas.topics import TopicNames

    kit.add("dashboard", Role.OPERATOR, acts_for=["alice", "payments"])
    channel = OperatorChannel("127.0.0.1:9", TopicNames(), kit.signer("dashboard"))
    try:
        assert channel.producer_for("alice", "dashboard") == "dashboard"
        with pytest.raises(NoUsableKey) as refused:
            channel.producer_for(who, "dashboard")
    finally:
        channel.close()
    message = str(refused.value)
    assert "acts_for" in message and "'alice'" in message and f"{who!r}" in message
    if who == "payments":
        assert "not an operator identity" in message
