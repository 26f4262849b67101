"""Identities on the real broker (issue 12): forged records are refused where they are
read, go to the DLQ with their reason, are counted, and change no provider's state,
while legitimate sagas finish; a key rotation during a run.

Every component signs with its own Ed25519 key from a trust file (tests/trust_kit.py):
the coordinator, the participants ``payments`` and ``mailer``, the agent, the operator
``alice``, and ``beta-agent`` of another tenant.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from participants import CompensationContext, Reversibility, compensable, tool, wrap
from sagaline.kafka import LedgerReader
from schemas import (
    ApprovalGranted,
    ApprovalRequested,
    ExecuteStep,
    SagaEndRequested,
    SagaOutcome,
    SagaTerminal,
    StepCommitted,
    TerminalStatus,
    envelope_for,
)
from schemas.models import Record
from schemas.settings import Settings
from schemas.trust import Role
from schemas.wire import DLQ_REASON, to_message
from services.cli import main
from tests.system import System, wait_until
from tests.trust_kit import TrustKit

pytestmark = pytest.mark.kafka

TENANT = "acme"
_REQUEST_FIELDS = (
    "step_id",
    "approval_id",
    "purpose",
    "principal",
    "args_fingerprint",
    "scope",
    "expires_at",
)  # what a grant repeats from its request


class Payments:
    """A provider with state: every charge and wire that really happened."""

    def __init__(self) -> None:
        self.charges: list[int] = []
        self.wires: list[str] = []

    @tool(description="Charge a card", owner="billing")
    @compensable(by="refund")
    def charge(self, cents: int) -> str:
        self.charges.append(cents)
        return f"ch-{len(self.charges)}"

    def refund(self, ctx: CompensationContext) -> None:
        self.charges.remove(ctx.input["cents"])

    @tool(description="Wire money out", owner="treasury")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def wire(self, to: str) -> str:
        self.wires.append(to)
        return f"wire-{to}"


class Mailer:
    def __init__(self) -> None:
        self.sent: list[str] = []

    @tool(description="Send mail", owner="comms")
    @compensable(by="recall")
    def send(self, to: str) -> str:
        self.sent.append(to)
        return f"mail-{to}"

    def recall(self, ctx: CompensationContext) -> None:
        self.sent.remove(ctx.input["to"])


@dataclasses.dataclass
class World:
    system: System
    kit: TrustKit
    payments: Payments
    mailer: Mailer

    def reader(self) -> Any:
        return self.kit.signer()

    def records(self, saga_id: str) -> list[Record]:
        return LedgerReader(self.system.bootstrap).saga_records(
            self.system.topics.events, saga_id, self.reader()
        )

    def forge(self, topic: str, record: Record, identity: str, key_id: str | None = None) -> None:
        key, value, headers = self.kit.forged(record, key_id or self.kit.current[identity])
        producer = self.system.raw_producer()
        producer.produce(topic, key=key, value=value, headers=headers)
        producer.flush(30)

    def dlq_reasons(self) -> list[str]:
        return [h.get(DLQ_REASON, b"").decode() for _k, h in self.system.dlq()]

    def wait_dlq(self, reason: str, count: int) -> None:
        wait_until(
            lambda: self.dlq_reasons().count(reason) >= count,
            what=f"{count} DLQ record(s) with reason {reason}",
        )

    def awaiting_approval(self, to: str) -> tuple[Any, ApprovalRequested, dict[str, Any]]:
        saga = self.system.client.saga("treasury", "agent")
        out: dict[str, Any] = {}

        def agent() -> None:
            try:
                with saga:
                    out["result"] = saga.call("wire", to=to)
            except Exception as exc:
                out["error"] = exc

        threading.Thread(target=agent, daemon=True).start()
        request = wait_until(
            lambda: next(
                (r for r in self.records(saga.saga_id) if isinstance(r, ApprovalRequested)),
                None,
            ),
            what="the approval request",
        )
        return saga, request, out


@pytest.fixture
def world(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[World]:
    kit = TrustKit(tmp_path / "keys")
    kit.add("sagaline-coordinator", Role.COORDINATOR)
    kit.add("payments", Role.PARTICIPANT, tenants=[TENANT])
    kit.add("mailer", Role.PARTICIPANT)
    kit.add("agent", Role.AGENT, tenants=[TENANT])
    kit.add("alice", Role.OPERATOR)
    kit.add("beta-agent", Role.AGENT, tenants=["beta"])
    base = Settings(
        bootstrap=kafka_bootstrap,
        topic_prefix=unique_prefix,
        partitions=2,
        state_dir=tmp_path,
        tenant_id=TENANT,
    )

    def settings_for(component: str) -> Settings:
        identity = "sagaline-coordinator" if component == "coordinator" else component
        return kit.settings(base, identity)

    payments, mailer = Payments(), Mailer()
    catalogues = [wrap(payments, name="payments"), wrap(mailer, name="mailer")]
    with System(
        kafka_bootstrap,
        unique_prefix,
        tmp_path,
        catalogues,
        hmac_key=None,
        settings_for=settings_for,
    ) as system:
        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
        monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
        monkeypatch.setenv("SAGALINE_TRUST_FILE", str(kit.trust_file))
        monkeypatch.setenv("SAGALINE_SIGNING_KEY", str(kit.key_files[kit.current["alice"]]))
        monkeypatch.delenv("SAGALINE_HMAC_KEY", raising=False)
        monkeypatch.delenv("SAGALINE_OPERATOR", raising=False)
        yield World(system, kit, payments, mailer)


def _dlq_count(metrics: Any, reason: str) -> int:
    return int(metrics.snapshot().dlq_records.get(reason, 0))


def test_forgeries_are_refused_counted_and_change_nothing_while_legit_sagas_finish(
    world: World,
) -> None:
    system = world.system
    assert system.coordinator is not None
    saga, request, out = world.awaiting_approval("acct-9")
    env: dict[str, Any] = {"saga_id": saga.saga_id, "tenant_id": TENANT, "now": 1}

    # 1. The mailer's key forges an ExecuteStep for payments (on payments' command topic).
    forged_command = ExecuteStep(
        envelope=envelope_for(ExecuteStep, producer="mailer", **env),
        step_id=request.step_id,
        tool="wire",
        args=b'{"to": "mallory"}',
        idempotency_key="forged",
        attempt=1,
        deadline_ms=5000,
        principal="agent",
    )
    world.forge(system.topics.commands("payments"), forged_command, "mailer")
    # 2. ... an ApprovalGranted for the irreversible wire.
    grant = ApprovalGranted(
        envelope=envelope_for(ApprovalGranted, producer="mailer", **env),
        **{k: getattr(request, k) for k in _REQUEST_FIELDS},
        granted_by="mailer",
    )
    world.forge(system.topics.events, grant, "mailer")
    # 3. ... a SagaTerminal, on the ledger and on the terminal topic.
    terminal = SagaTerminal(
        envelope=envelope_for(SagaTerminal, producer="mailer", **env),
        status=TerminalStatus.COMPLETED,
        receipt=b"{}",
    )
    world.forge(system.topics.events, terminal, "mailer")
    world.forge(system.topics.terminal, terminal, "mailer")
    # 4. The agent's own key grants its own approval.
    self_grant = grant.model_copy(
        update={
            "envelope": envelope_for(ApprovalGranted, producer="agent", **env),
            "granted_by": "agent",
        }
    )
    world.forge(system.topics.events, self_grant, "agent")
    # 5. A record of tenant beta targets this acme saga.
    beta = SagaEndRequested(
        envelope=envelope_for(
            SagaEndRequested, producer="beta-agent", saga_id=saga.saga_id, tenant_id="beta", now=1
        ),
        outcome=SagaOutcome.ABORT,
    )
    world.forge(system.topics.events, beta, "beta-agent")
    # 6. Even the coordinator's key cannot make payments (limited to acme) act for beta.
    other_tenant = forged_command.model_copy(
        update={
            "envelope": envelope_for(
                ExecuteStep,
                producer="sagaline-coordinator",
                saga_id=saga.saga_id,
                tenant_id="beta",
                now=1,
            )
        }
    )
    world.forge(system.topics.commands("payments"), other_tenant, "sagaline-coordinator")

    world.wait_dlq("forbidden-writer", 4)  # the command, two grants, the terminal
    world.wait_dlq("tenant-mismatch", 2)
    payments_runtime = next(r for r in system._runtimes if r.participant == "payments")
    assert _dlq_count(payments_runtime.metrics, "forbidden-writer") == 1
    assert _dlq_count(payments_runtime.metrics, "tenant-mismatch") == 1
    assert _dlq_count(system.coordinator.metrics, "forbidden-writer") == 3
    assert _dlq_count(system.coordinator.metrics, "tenant-mismatch") == 1

    # Nothing moved: no wire, the approval still pends, no terminal for the saga.
    assert world.payments.wires == [] and world.mailer.sent == []
    assert not any(isinstance(r, SagaTerminal) for r in world.records(saga.saga_id))
    assert "result" not in out

    # A legitimate saga finishes meanwhile, and the operator's grant counts.
    with system.client.saga("shop", "agent") as other:
        assert other.call("charge", cents=250) == "ch-1"
        assert other.call("send", to="ada") == "mail-ada"
    assert other.wait(60).status is TerminalStatus.COMPLETED
    assert main(["approve", saga.saga_id, request.step_id]) == 0
    receipt = saga.wait(60)
    # The tenant-mismatch incident stays open for a person: the saga ends ESCALATED,
    # with the wire done once, approved by alice (the key's owner, not a typed name).
    assert receipt.status is TerminalStatus.ESCALATED
    assert world.payments.wires == ["acct-9"] and world.payments.charges == [250]
    assert [(a.decision, a.by) for a in receipt.approvals] == [("GRANTED", "alice")]
    assert any("tenant" in i.inconsistency for i in receipt.incidents)


def test_a_participant_reports_only_on_commands_sent_to_it(world: World) -> None:
    system = world.system
    assert system.coordinator is not None
    saga, request, _out = world.awaiting_approval("acct-1")
    forged = StepCommitted(
        envelope=envelope_for(
            StepCommitted,
            producer="mailer",
            saga_id=saga.saga_id,
            tenant_id=TENANT,
            now=1,
            causation_id="no-such-command",
        ),
        step_id=request.step_id,
        tool="wire",
        idempotency_key="x",
        attempt=1,
        result=b'"wire-fake"',
        response_fingerprint="x",
    )
    world.forge(system.topics.events, forged, "mailer")
    world.wait_dlq("forbidden-writer", 1)
    assert main(["approve", saga.saga_id, request.step_id]) == 0
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert world.payments.wires == ["acct-1"]


def test_key_rotation_during_a_run_old_key_accepted_until_retired(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    kit, system = world.kit, world.system
    old = kit.current["alice"]

    def approve_with(key_id: str, to: str) -> Any:
        saga, request, _out = world.awaiting_approval(to)
        monkeypatch.setenv("SAGALINE_SIGNING_KEY", str(kit.key_files[key_id]))
        assert main(["approve", saga.saga_id, request.step_id]) == 0
        return saga.wait(60)

    assert approve_with(old, "a1").status is TerminalStatus.COMPLETED
    new = kit.add("alice", Role.OPERATOR)  # rotation: a second key, both live
    assert approve_with(new, "a2").status is TerminalStatus.COMPLETED
    assert approve_with(old, "a3").status is TerminalStatus.COMPLETED

    kit.retire(old)
    saga, request, _out = world.awaiting_approval("a4")
    monkeypatch.setenv("SAGALINE_SIGNING_KEY", str(kit.key_files[old]))
    capsys.readouterr()
    assert main(["approve", saga.saga_id, request.step_id]) == 2  # the CLI knows first
    assert "no operator key the trust file accepts" in capsys.readouterr().err
    grant = ApprovalGranted(
        envelope=envelope_for(
            ApprovalGranted, producer="alice", saga_id=saga.saga_id, tenant_id=TENANT, now=1
        ),
        **{k: getattr(request, k) for k in _REQUEST_FIELDS},
        granted_by="alice",
    )
    world.forge(system.topics.events, grant, "alice", old)  # ...and the coordinator too
    world.wait_dlq("retired-key", 1)
    assert world.payments.wires == ["a1", "a2", "a3"]
    monkeypatch.setenv("SAGALINE_SIGNING_KEY", str(kit.key_files[new]))
    assert main(["approve", saga.saga_id, request.step_id]) == 0
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert world.payments.wires == ["a1", "a2", "a3", "a4"]


def test_an_operator_decision_for_a_tenant_outside_the_key_is_refused_not_published(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The coordinator refuses a grant signed by an operator outside the saga's tenant
    (tenant-mismatch, DLQ); the CLI and the dashboard must say so instead of reporting
    the decision as recorded (docs/security.md, Operators)."""
    from sagaline.kafka import ensure_topics
    from sagaline.ops.actions import NoUsableKey, OperatorChannel, grant_approval
    from schemas import ApprovalPurpose
    from schemas.errors import TenantMismatch
    from schemas.wire import from_message

    kit = TrustKit(tmp_path / "keys")
    kit.add("bob", Role.OPERATOR, tenants=[TENANT])
    settings = kit.settings(Settings(topic_prefix=unique_prefix, partitions=1), "bob")
    ensure_topics(kafka_bootstrap, settings.topics, partitions=1)
    request = ApprovalRequested(
        envelope=envelope_for(
            ApprovalRequested,
            producer="sagaline-coordinator",
            saga_id="s-beta",
            tenant_id="beta",
            now=1,
        ),
        step_id="st-1",
        approval_id="a-1",
        purpose=ApprovalPurpose.FORWARD,
        principal="user:1",
        args_fingerprint="fp",
        scope="payments/wire:execute",
        expires_at=2**62,
    )
    channel = OperatorChannel.from_settings(settings, kafka_bootstrap)
    try:
        with pytest.raises(NoUsableKey, match="beta"):
            grant_approval(channel, request, operator="bob")
    finally:
        channel.close()
    # What every reader would have done with it:
    grant = ApprovalGranted(
        envelope=envelope_for(
            ApprovalGranted, producer="bob", saga_id="s-beta", tenant_id="beta", now=1
        ),
        **{k: getattr(request, k) for k in _REQUEST_FIELDS},
        granted_by="bob",
    )
    with pytest.raises(TenantMismatch):
        from_message(*to_message(grant, kit.signer("bob")), kit.signer())


def test_keys_rotated_in_their_key_files_are_picked_up_without_a_restart(world: World) -> None:
    """A secret manager writes each process's new key over its SAGALINE_SIGNING_KEY
    file and the trust file gets the new entries: the running coordinator, participant
    and agent sign with the new keys, so the old ones can be retired. Before, they kept
    the keys read at start until restarted, and once the old keys were retired every
    reader refused their records as retired-key and no saga moved."""
    kit, system = world.kit, world.system
    assert system.coordinator is not None
    payments = next(r for r in system._runtimes if r.participant == "payments")
    signers = {
        "sagaline-coordinator": (Role.COORDINATOR, system.coordinator.signer),
        "payments": (Role.PARTICIPANT, payments.signer),
        "agent": (Role.AGENT, system.client.signer),
    }
    with system.client.saga("shop", "agent") as first:
        assert first.call("charge", cents=100) == "ch-1"
    assert first.wait(60).status is TerminalStatus.COMPLETED
    olds = {identity: kit.current[identity] for identity in signers}
    for identity, (role, _signer) in signers.items():
        new = kit.add(identity, role)  # listed, the old key still live
        kit.key_files[olds[identity]].write_bytes(kit.key_files[new].read_bytes())
    for identity, (_role, signer) in signers.items():
        wait_until(
            lambda s=signer, i=identity: s.can_sign and s.key_id == kit.current[i],
            what=f"{identity} to sign with its new key",
        )
    for old in olds.values():  # the old keys' records are read: retire them
        kit.retire(old)
    with system.client.saga("shop", "agent") as second:
        assert second.call("charge", cents=200) == "ch-2"
    assert second.wait(60).status is TerminalStatus.COMPLETED
    assert world.payments.charges == [100, 200]
    assert "retired-key" not in world.dlq_reasons()


def test_a_coordinator_whose_key_is_retired_stops_with_one_error_parking_nothing(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its key retired with no replacement, the coordinator signed on: participants
    refused its commands, it refused its own records, every saga stalled with nothing
    said. Now it stops at its first record to write, with an error saying what to do,
    commits nothing and parks no saga; a new key in its key file and a restart finish
    the saga."""
    kit, system = world.kit, world.system
    stopped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: stopped.append(args.exc_value))
    old = kit.current["sagaline-coordinator"]
    kit.retire(old)
    saga = system.client.saga("shop", "agent")
    out: dict[str, Any] = {}

    def agent() -> None:
        try:
            with saga:
                out["charge"] = saga.call("charge", cents=300)
        except Exception as exc:  # kept apart from the coordinator's thread's error
            out["error"] = exc

    threading.Thread(target=agent, daemon=True).start()
    wait_until(lambda: stopped, what="the coordinator to stop")
    from schemas.trust import SigningKeyError

    [error] = stopped
    assert isinstance(error, SigningKeyError)
    assert old in str(error) and "retired" in str(error) and "SAGALINE_SIGNING_KEY" in str(error)
    assert world.payments.charges == []
    assert "saga-parked" not in world.dlq_reasons()

    new = kit.add("sagaline-coordinator", Role.COORDINATOR)
    kit.key_files[old].write_bytes(kit.key_files[new].read_bytes())
    assert system.coordinator is not None
    system.start_coordinator(system.coordinator.instance_id)  # the restart
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert world.payments.charges == [300] and out["charge"] == "ch-1"


def test_a_participant_whose_key_is_retired_runs_no_tool_until_it_has_a_new_key(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Its key retired with no replacement, the participant ran the tool (the charge
    happened) and wrote outcomes the coordinator refused as retired-key: an effect the
    ledger never learned of. Now nothing is signed, so the intent is not written and
    the tool does not run; the command waits and is tried again, and a new key in its
    key file lets it finish, charging once."""
    kit, system = world.kit, world.system
    old = kit.current["payments"]
    kit.retire(old)
    saga = system.client.saga("shop", "agent")
    out: dict[str, Any] = {}

    def agent() -> None:
        try:
            with saga:
                out["charge"] = saga.call("charge", cents=300)
        except Exception as exc:
            out["error"] = exc

    with caplog.at_level("WARNING"):
        threading.Thread(target=agent, daemon=True).start()
        wait_until(
            lambda: any(f"signing key {old!r}" in r.getMessage() for r in caplog.records),
            what="the participant to say its key is retired",
        )
    assert world.payments.charges == []
    new = kit.add("payments", Role.PARTICIPANT)
    kit.key_files[old].write_bytes(kit.key_files[new].read_bytes())
    assert saga.wait(60).status is TerminalStatus.COMPLETED
    assert world.payments.charges == [300] and out == {"charge": "ch-1"}
    assert "retired-key" not in world.dlq_reasons()
    assert "handler-error" not in world.dlq_reasons()


@pytest.mark.parametrize("signed_by", ["mailer", None])
def test_a_participant_cannot_take_another_participants_tool_through_the_catalogue(
    world: World, signed_by: str | None
) -> None:
    """The published catalogue was read without looking at who wrote it: the mailer
    (whose Kafka principal may write sagaline.catalogue) republished payments' charge
    as its own, agents sent every charge to the mailer, and the coordinator took the
    mailer's StepCommitted as the outcome of a step it now ran on. With identities,
    an entry counts only when signed by the participant whose key it is under and
    who it names; a forged one makes the tool unreadable (refused), never redirected."""
    from participants.client import SagaClient, UnknownTool

    kit, system = world.kit, world.system
    topic = system.topics.catalogue
    key = b"payments/charge"
    # An agent that takes its contracts from the published catalogue (the default).
    client = SagaClient(system._settings_for("agent"), system.bootstrap)
    assert client.contract("charge").participant == "payments"
    [(_k, value, _h)] = [r for r in LedgerReader(system.bootstrap).records(topic) if r[0] == key][
        -1:
    ]
    assert value is not None
    entry = orjson.loads(value)
    entry["participant"] = entry["contract"]["participant"] = "mailer"
    forged = orjson.dumps(entry)
    headers = kit.signed_headers(key, forged, kit.current[signed_by]) if signed_by else []
    producer = system.raw_producer()
    producer.produce(topic, key=key, value=forged, headers=headers)
    producer.flush(30)
    try:
        client.refresh_catalogue()
        with pytest.raises(UnknownTool, match="charge"):
            client.contract("charge")
        assert client.contract("send").participant == "mailer"  # its own: still good
    finally:
        client.close()


def test_an_agent_takes_a_steps_outcome_only_from_the_participant_it_runs_on(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Any participant may write StepCommitted and StepFailed (for its own steps: the
    coordinator refuses the rest). The agent's client took the first verified outcome
    naming the step, whoever wrote it: the mailer could hand the agent a made-up result
    of a payments charge (or a rejection), which the agent acted on though the
    coordinator refused it. Only the step's own participant answers for it now."""
    from participants.client import SagaClient
    from sagaline.kafka import ensure_topics
    from schemas import StepContract

    kit = TrustKit(tmp_path / "keys")
    kit.add("agent", Role.AGENT)
    kit.add("payments", Role.PARTICIPANT)
    kit.add("mailer", Role.PARTICIPANT)
    base = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, base.topics, [], 1)
    contract = StepContract(tool="charge", participant="payments")
    client = SagaClient(
        kit.settings(base, "agent"), kafka_bootstrap, contracts={"charge": contract}
    )
    client.check_coordinator = False  # none runs: the records below stand in for it
    client.start()
    try:
        saga = client.saga("billing", "agent").__enter__()
        producer = client._writer.producer

        def committed(by: str, result: str) -> StepCommitted:
            return StepCommitted(
                envelope=envelope_for(
                    StepCommitted,
                    saga_id=saga.saga_id,
                    tenant_id=saga.tenant_id,
                    producer=by,
                    now=1_700_000_000_000,
                ),
                step_id="01-charge",  # the id the call below gets
                tool="charge",
                idempotency_key="k",
                attempt=1,
                result=orjson.dumps(result),
                response_fingerprint="0" * 32,
            )

        forged, real = committed("mailer", "forged by the mailer"), committed("payments", "ch-1")
        for record, identity in ((forged, "mailer"), (real, "payments")):
            key, value, headers = kit.forged(record, kit.current[identity])
            producer.produce(base.topics.events, key=key, value=value, headers=headers)
        assert producer.flush(30) == 0
        assert client._ledger.wait_for(
            saga.saga_id, lambda r: r if r.event_id == real.event_id else None, 120
        ), "the listener did not get the records"
        assert saga.call("charge", cents=5, timeout_s=120) == "ch-1"
    finally:
        client.close()


def test_an_agent_takes_a_denial_only_of_its_steps_request_in_its_sagas_tenant(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The agent's client ended a call with ApprovalDeniedError on any operator's
    ApprovalDenied naming the step: one for another tenant (an operator of globex on an
    acme saga) or of another approval id, both of which the coordinator refuses while
    the step still waits for its decision. The agent gave up (and its saga unwound)
    on a denial that never counted."""
    from participants.client import SagaClient
    from sagaline.kafka import ensure_topics
    from schemas import ApprovalDenied, ApprovalPurpose, StepContract

    kit = TrustKit(tmp_path / "keys")
    kit.add("sagaline-coordinator", Role.COORDINATOR)
    kit.add("agent", Role.AGENT)
    kit.add("payments", Role.PARTICIPANT)
    kit.add("gina", Role.OPERATOR, tenants=["globex"])
    kit.add("bob", Role.OPERATOR)
    base = Settings(
        bootstrap=kafka_bootstrap,
        topic_prefix=unique_prefix,
        partitions=1,
        state_dir=tmp_path,
        tenant_id=TENANT,
    )
    ensure_topics(kafka_bootstrap, base.topics, [], 1)
    contract = StepContract(tool="charge", participant="payments")
    client = SagaClient(
        kit.settings(base, "agent"), kafka_bootstrap, contracts={"charge": contract}
    )
    client.check_coordinator = False  # none runs: the records below stand in for it
    client.start()
    try:
        saga = client.saga("billing", "agent").__enter__()
        step = "01-charge"  # the id the call below gets

        def envelope(cls: type[Record], by: str, tenant: str = TENANT) -> Any:
            return envelope_for(
                cls, saga_id=saga.saga_id, tenant_id=tenant, producer=by, now=1_700_000_000_000
            )

        def denial(by: str, approval_id: str, tenant: str = TENANT) -> ApprovalDenied:
            return ApprovalDenied(
                envelope=envelope(ApprovalDenied, by, tenant),
                step_id=step,
                approval_id=approval_id,
                purpose=ApprovalPurpose.FORWARD,
                denied_by=by,
                reason="no",
            )

        request = ApprovalRequested(
            envelope=envelope(ApprovalRequested, "sagaline-coordinator"),
            step_id=step,
            approval_id="appr-1",
            purpose=ApprovalPurpose.FORWARD,
            principal="agent",
            args_fingerprint="f" * 32,
            scope="payments/charge:execute",
            expires_at=1_800_000_000_000,
        )
        committed = StepCommitted(
            envelope=envelope(StepCommitted, "payments"),
            step_id=step,
            tool="charge",
            idempotency_key="k",
            attempt=1,
            result=orjson.dumps("ch-1"),
            response_fingerprint="0" * 32,
        )
        records = [
            (request, "sagaline-coordinator"),
            (denial("gina", "appr-1", tenant="globex"), "gina"),  # another tenant's operator
            (denial("bob", "appr-0"), "bob"),  # not the approval requested
            (committed, "payments"),  # what the coordinator's run really led to
        ]
        producer = client._writer.producer
        for record, identity in records:
            key, value, headers = kit.forged(record, kit.current[identity])
            producer.produce(base.topics.events, key=key, value=value, headers=headers)
        assert producer.flush(30) == 0
        assert client._ledger.wait_for(
            saga.saga_id, lambda r: r if r.event_id == committed.event_id else None, 120
        ), "the listener did not get the records"
        assert saga.call("charge", cents=5, timeout_s=120) == "ch-1"
    finally:
        client.close()


@pytest.mark.parametrize("key_of", ["mailer", "agent", None])
def test_a_participant_started_without_its_own_key_refuses_to_start(
    world: World, tmp_path: Path, key_of: str | None
) -> None:
    """Given another identity's key (a copy-paste of the mailer's key file), the
    payments runtime ran its tools: the charge happened, while the coordinator refused
    its intent and outcome as forbidden-writer (signed by 'mailer', producer
    'payments'), so the ledger never learned of the effect. Without a key it started
    and failed at its catalogue with a traceback. Now it refuses at once, naming the
    key's owner and the identity it needs, and nothing runs."""
    from participants.runtime import ParticipantRuntime
    from schemas.trust import TrustFileError

    settings = world.kit.settings(world.system.settings, key_of)
    with pytest.raises(TrustFileError) as refused:
        ParticipantRuntime(
            wrap(Payments(), name="payments"),
            settings,
            world.system.bootstrap,
            instance_id="payments-wrong-key",
            state_dir=tmp_path / "wrong-key",
        )
    message = str(refused.value)
    assert "'payments'" in message and "SAGALINE_SIGNING_KEY" in message
    if key_of is not None:
        assert f"{key_of!r}" in message
    assert not (tmp_path / "wrong-key").exists()  # refused before its journal was opened


@pytest.mark.parametrize("key_of", ["coordinator", "payments", None])
def test_a_coordinator_started_without_the_coordinators_key_refuses_to_start(
    world: World, key_of: str | None
) -> None:
    """A coordinator given a key of an identity named 'coordinator' (not
    'sagaline-coordinator', the producer it writes as) or a participant's key ran:
    every participant dead-lettered its commands as forbidden-writer and every saga
    stalled, with nothing said where the operator looks. Without a key it started and
    then stopped at its first record with a ValueError traceback. Now it refuses at
    once, with a line saying which key it needs."""
    from coordinator.shell import Coordinator
    from schemas.trust import TrustFileError

    if key_of == "coordinator":
        world.kit.add("coordinator", Role.COORDINATOR)
    settings = world.kit.settings(world.system.settings, key_of)
    with pytest.raises(TrustFileError) as refused:
        Coordinator(settings, world.system.bootstrap, instance_id="coordinator-wrong-key")
    message = str(refused.value)
    assert "'sagaline-coordinator'" in message and "SAGALINE_SIGNING_KEY" in message
    if key_of is not None:
        assert f"{key_of!r}" in message


def test_an_agent_named_otherwise_than_its_key_is_refused_at_once(world: World) -> None:
    """A client given ``producer_name="refund-bot"`` and the key of 'agent' wrote its
    SagaStarted as 'refund-bot': the coordinator refused it (forbidden-writer) and
    the call waited its whole timeout, then said OutcomeUnknown ("the step may be
    slow or waiting its turn"). Now the client refuses at construction, naming
    both; the key's own name is still taken, as is no name (the key's)."""
    from participants import SagaClient
    from schemas.trust import TrustFileError

    settings = world.kit.settings(world.system.settings, "agent")
    with pytest.raises(TrustFileError) as refused:
        SagaClient(settings, world.system.bootstrap, producer_name="refund-bot")
    message = str(refused.value)
    assert "'refund-bot'" in message and "'agent'" in message
    for name in ("agent", None):
        client = SagaClient(settings, world.system.bootstrap, producer_name=name)
        assert client.producer_name == "agent"
        client.close()
