"""The pure coordinator core, rule by rule (no Kafka: decide/tick on plain records)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from coordinator_ledger import (
    Harness,
    Ledger,
    approval_requests,
    compensates,
    events,
    executes,
    fresh,
    incidents,
    receipt_of,
    reconciles,
    rejections,
    terminal,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import (
    COORDINATOR_PRODUCER,
    CorePolicy,
    CorrelationError,
    Destination,
    SagaState,
    compensation_order,
    decide,
    fold,
    retry_delay_ms,
    tick,
)
from coordinator.state import StepStatus
from participants import CompensationContext, compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal
from schemas import (
    ApprovalPurpose,
    ApprovalRequested,
    CompensationApproval,
    CompensationRequested,
    ExecuteStep,
    FailureKind,
    ReconcileResult,
    RetryPolicy,
    Reversibility,
    SagaOutcome,
    StepRetryScheduled,
    TerminalStatus,
    canonical_json,
    compensation_key,
    derived_event_id,
    fingerprint,
    key_hash,
)
from schemas.limits import MAX_OPERATOR_TEXT_BYTES
from schemas.models import CompensateStep, Record
from schemas.receipt import Disposition


def running(*steps: str, **kw: Any) -> tuple[Ledger, Harness]:
    """A saga whose steps (implicit chain) have all committed."""
    ledger, h = fresh()
    h.feed(ledger.started(**kw))
    for step in steps:
        h.feed(ledger.scheduled(step))
        h.feed(ledger.committed(step))
    return ledger, h


# ------------------------------------------------------------------ R15 dedup


def test_duplicate_event_changes_nothing_R15() -> None:
    ledger, h = running("reserve")
    scheduled = ledger.scheduled("charge")
    h.feed(scheduled)
    before = h.s.to_bytes()
    decision = decide(h.state, scheduled, h.now + 5)
    assert decision.outputs == []
    assert decision.changed is False
    assert decision.state is h.state
    assert decision.state is not None and decision.state.to_bytes() == before


def test_stale_generation_is_rejected_and_recorded_R15() -> None:
    ledger, h = fresh(generation=2)
    h.feed(ledger.started(), ledger.scheduled("reserve"))
    stale = ledger.committed("reserve", generation=1)
    out = h.feed(stale)
    [rejected] = rejections(out)
    assert rejected.reason == "stale-generation"
    assert rejected.record is stale
    assert h.status("reserve") == "DISPATCHED"
    assert h.s.rejected_count == 1
    assert h.s.recent_rejections[-1].reason == "stale-generation"
    # redelivery of the same stale record is a duplicate: not rejected twice
    assert h.feed(stale) == []
    assert h.s.rejected_count == 1


def test_coordinator_own_events_coming_back_are_no_ops_R15() -> None:
    ledger, h = running("reserve")
    out = h.feed(
        ledger.scheduled("charge"), ledger.failed("charge", kind=FailureKind.BUSINESS_REJECTION)
    )
    own = [o.record for o in out if o.appends_to_events]
    assert own, "compensating emits CompensationRequested"
    before = h.s.to_bytes()
    for record in own:
        decision = decide(h.state, record, h.now)
        assert decision.outputs == [] and decision.changed is False
    assert h.s.to_bytes() == before
    assert all(r.envelope.producer == COORDINATOR_PRODUCER for r in own)


def test_redeciding_the_same_input_gives_identical_outputs_R15() -> None:
    ledger, h = running("reserve", "charge")
    state = h.state
    failure = ledger.failed("charge", kind=FailureKind.BUSINESS_REJECTION)
    first = decide(state, failure, 5_000)
    second = decide(state, failure, 5_000)
    assert [o.record for o in first.outputs] == [o.record for o in second.outputs]
    assert first.state is not None and second.state is not None
    assert first.state.to_bytes() == second.state.to_bytes()


def test_derived_event_ids_are_the_uuid5_of_their_parts_R15() -> None:
    """Ids stay what every earlier version derived, so a replay by a newer coordinator
    is recognised as the same event downstream."""
    namespace = uuid.UUID("8f0b1d0e-5a6c-4c8e-9a57-5a9a11e0c0de")
    for parts in [
        ("saga-1", 1, "ExecuteStep", "s1", 1),
        ("saga-ü✓", "incident", "saga-parked"),
        ("", -3, 0, 10**15),
        ("a/b",),
    ]:
        expected = str(uuid.uuid5(namespace, "/".join(str(p) for p in parts)))
        assert derived_event_id(*parts) == expected


def test_dedup_memory_is_bounded_per_saga_R15() -> None:
    ledger, _h = fresh()
    policy = CorePolicy(dedup_memory=4)
    state = decide(None, ledger.started(), 1, policy).state
    for i in range(10):
        state = decide(state, ledger.scheduled(f"s{i}", depends_on=[]), 2 + i, policy).state
    assert state is not None and len(state.seen) == 4


def test_record_for_unknown_saga_is_rejected_R16() -> None:
    ledger = Ledger()
    ledger.scheduled("reserve")
    decision = decide(None, ledger.committed("reserve"), 1)
    assert decision.state is None
    [rejected] = decision.outputs
    assert rejected.destination is Destination.REJECTED and rejected.reason == "unknown-saga"


def test_record_for_terminal_saga_is_a_no_op_R14() -> None:
    ledger, h = fresh()
    out = h.feed(ledger.started(), ledger.end())
    assert terminal(out) is not None
    before = h.s.to_bytes()
    assert h.feed(ledger.scheduled("late")) == []
    assert h.s.to_bytes() == before


def test_record_of_another_saga_is_a_routing_error() -> None:
    _ledger, h = running("reserve")
    other = Ledger("saga-2")
    with pytest.raises(CorrelationError, match="route records by saga id"):
        decide(h.state, other.started(), 1)


def test_new_generation_reissues_in_flight_commands_under_it_R15() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("reserve"))
    out = h.feed(ledger.started(generation=2))
    [command] = [r for r in (o.record for o in out) if isinstance(r, ExecuteStep)]
    assert command.envelope.generation == 2
    assert command.idempotency_key == ledger.key("reserve")
    assert rejections(h.feed(ledger.committed("reserve", generation=1)))  # old run: stale


# ------------------------------------------------------------------ forward path


def test_scheduled_step_is_dispatched_with_its_idempotency_key() -> None:
    ledger, h = fresh()
    out = h.feed(ledger.started(), ledger.scheduled("reserve", participant="inventory"))
    [cmd] = [o for o in out if o.destination is Destination.COMMAND]
    assert cmd.participant == "inventory"
    assert isinstance(cmd.record, ExecuteStep)
    assert cmd.record.idempotency_key == ledger.key("reserve")
    assert cmd.record.attempt == 1 and cmd.record.principal == "alice"


def test_implicit_chain_waits_for_previous_step_to_commit_R2() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("a"))
    assert executes(h.feed(ledger.scheduled("b"))) == []
    assert executes(h.feed(ledger.committed("a"))) == ["b"]


def test_explicit_independent_steps_are_dispatched_together_R2() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    out = h.feed(ledger.scheduled("a", depends_on=[]), ledger.scheduled("b", depends_on=[]))
    assert executes(out) == ["a", "b"]


def test_dependency_on_unscheduled_step_is_rejected() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    [rejected] = rejections(h.feed(ledger.scheduled("b", depends_on=["nope"])))
    assert rejected.reason == "invalid-dependency"
    assert "b" not in h.s.steps


def test_step_id_reused_with_other_arguments_is_rejected() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("a", args={"n": 1}))
    [rejected] = rejections(h.feed(ledger.scheduled("a", args={"n": 2})))
    assert rejected.reason == "duplicate-step"


def test_step_id_reused_with_other_dependencies_is_rejected_R2() -> None:
    """A step scheduled again under its id with other ``depends_on`` was taken as the
    same step, silently: the first dependencies stayed in force, and the agent that
    asked for the new ones was never told. Refused like other arguments; the same
    dependencies (in any order) are still the same step."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("a"), ledger.scheduled("b", depends_on=[]))
    h.feed(ledger.scheduled("c", depends_on=["a"]))
    again = [
        ledger.scheduled("c", depends_on=["a", "b"]),
        ledger.scheduled("c", depends_on=["b"]),
        ledger.scheduled("c"),  # the implicit chain is another dependency
    ]
    for record in again:
        [rejected] = rejections(h.feed(record))
        assert rejected.reason == "duplicate-step"
        assert "depends on ['a']" in rejected.detail
    assert h.s.steps["c"].depends_on == ["a"]
    assert rejections(h.feed(ledger.scheduled("c", depends_on=["a", "a"]))) == []
    h.feed(ledger.scheduled("d"))
    assert rejections(h.feed(ledger.scheduled("d", depends_on=["c"]))) != []
    assert rejections(h.feed(ledger.scheduled("d"))) == []


def test_a_step_past_the_coordinators_max_steps_is_rejected() -> None:
    """Only the saga client counted a saga's steps (SAGALINE_MAX_STEPS): a writer that
    skipped it (a forged record, another client) got every step scheduled and run,
    and the saga's state grew past what the limit promises. The coordinator refuses a
    new step past its own limit; a step it has already is still the same step."""
    ledger, h = fresh()
    policy = CorePolicy(max_steps=2)
    records = [ledger.started(), ledger.scheduled("a"), ledger.scheduled("b")]
    for record in records:
        h._take(decide(h.state, record, h.now, policy))
    third = ledger.scheduled("c")
    decision = decide(h.state, third, h.now, policy)
    [rejected] = rejections(decision.outputs)
    assert rejected.reason == "too-many-steps"
    assert "2 steps" in rejected.detail and "SAGALINE_MAX_STEPS" in rejected.detail
    assert decision.state is not None and "c" not in decision.state.steps
    h._take(decision)
    again = decide(h.state, ledger.scheduled("b"), h.now, policy)
    assert rejections(again.outputs) == []
    assert "c" in fold([*records, third])["saga-1"].steps  # the bare core: no limit set


def test_a_step_id_with_a_slash_is_rejected_not_decided() -> None:
    """Derived ids join their parts with "/": generation 1's step "2/x" and
    generation 2's step "x" would share an approval id and its event id."""
    ledger, h = fresh()
    h.feed(ledger.started())
    out = h.feed(ledger.scheduled("2/x"))
    [rejected] = rejections(out)
    assert rejected.reason == "invalid-step-id"
    assert "'2/x'" in rejected.detail and "/" in rejected.detail
    assert "2/x" not in h.s.steps and executes(out) == []


# ------------------------------------------------------------------ R7 approvals


def irreversible_pending() -> tuple[Ledger, Harness, ApprovalRequested]:
    ledger, h = running("hold")
    out = h.feed(ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE))
    [request] = approval_requests(out)
    return ledger, h, request


def test_irreversible_step_waits_for_approval_before_running_R7() -> None:
    ledger, h, request = irreversible_pending()
    assert h.status("wire") == "AWAITING_APPROVAL"
    assert "wire" not in executes(h.outputs)
    out = h.feed(ledger.grant(request))
    [cmd] = [r for r in (o.record for o in out) if isinstance(r, ExecuteStep)]
    assert cmd.step_id == "wire" and cmd.approval_id == request.approval_id


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ({"args_fingerprint": "other-args"}, "arguments"),
        ({"principal": "mallory"}, "principal"),
        ({"scope": "svc/other:execute"}, "scope"),
        ({"approval_id": "appr-forged"}, "approval id"),
    ],
)
def test_grant_that_does_not_match_the_request_does_not_count_R7(
    override: dict[str, str], why: str
) -> None:
    ledger, h, request = irreversible_pending()
    out = h.feed(ledger.grant(request, **override))
    [rejected] = rejections(out)
    assert rejected.reason == "approval-mismatch" and why in rejected.detail
    assert executes(out) == []
    assert h.status("wire") == "AWAITING_APPROVAL"
    assert h.s.approvals[-1].decision == "REJECTED_MISMATCH"


def test_a_step_whose_fingerprint_is_not_of_its_arguments_is_refused_R7() -> None:
    """The agent writes the fingerprint; an approver sees only it (the dashboard's
    "arguments <fp>", the receipt's approval log). One of other arguments than the
    step's would bind the grant to arguments the step does not run with."""
    ledger, h = running("hold")
    benign = ledger.scheduled("wire-small", "wire", args={"amount": 10})
    forged = ledger.scheduled("wire", args={"amount": 1_000_000}).model_copy(
        update={"args_fingerprint": benign.args_fingerprint}
    )
    out = h.feed(forged)
    [rejected] = rejections(out)
    assert rejected.reason == "invalid-arguments" and "fingerprint" in rejected.detail
    assert "wire" not in h.s.steps and approval_requests(out) == []


def test_a_step_fingerprinted_by_an_older_client_is_still_taken() -> None:
    """Before sealed values counted as their markers, a fingerprint covered the sealed
    bytes: such a record (a saga in flight across the upgrade) is no forgery."""
    ledger, h = running("hold")
    args = {"card": {"$sealed": "bm9uY2U=", "kid": "s1", "fp": "[redacted hmac:abc]"}}
    old = ledger.scheduled("pay", args=args)
    old = old.model_copy(update={"args_fingerprint": fingerprint(canonical_json(args))})
    out = h.feed(old)
    assert rejections(out) == [] and h.s.steps["pay"].args_fingerprint == old.args_fingerprint


def test_grant_after_its_expiry_does_not_count_R7() -> None:
    ledger, h, request = irreversible_pending()
    late = ledger.grant(request, occurred_at=request.expires_at + 1)
    out = h.feed(late)
    assert [r.reason for r in rejections(out)] == ["approval-mismatch"]
    assert h.s.approvals[-1].decision == "EXPIRED"
    assert executes(out) == []


def test_unanswered_approval_expires_and_the_saga_unwinds_R7() -> None:
    _ledger, h, _request = irreversible_pending()
    out = h.advance(CorePolicy().approval_ttl_ms + 10)
    assert h.status("wire") == "FAILED"
    assert compensates(out) == ["hold"]
    assert h.s.approvals[-1].decision == "EXPIRED"


def test_denial_is_a_business_rejection_not_retried_R7_R9() -> None:
    ledger, h, request = irreversible_pending()
    out = h.feed(ledger.deny(request))
    assert h.status("wire") == "FAILED"
    assert events(out, StepRetryScheduled) == []
    assert compensates(out) == ["hold"]


def _long_text() -> str:
    return "pasted log line\n" * 25_000  # 400,000 bytes: far under a record's limit


def test_a_long_denial_reason_written_past_the_channel_is_kept_cut_R7() -> None:
    """The core copies a denial's reason into the step (error, note) and the saga's
    compensation reason: a 400 KB reason from an older client or written by hand
    made the state over 1 MB, and the shell parked the saga for it."""
    reason = _long_text()
    short_ledger, short, short_request = irreversible_pending()
    short.feed(short_ledger.deny(short_request))
    ledger, h, request = irreversible_pending()
    out = h.feed(ledger.deny(request, reason=reason))
    assert h.status("wire") == "FAILED" and compensates(out) == ["hold"]
    grown = len(h.s.to_bytes()) - len(short.s.to_bytes())
    assert grown < 4 * MAX_OPERATOR_TEXT_BYTES
    step = h.s.steps["wire"]
    assert step.last_error is not None
    assert f"[cut: {len(reason)} bytes in all]" in step.last_error
    assert step.last_error.startswith("approval denied by bob: pasted log line")


def test_a_long_abort_reason_from_the_agent_is_kept_cut() -> None:
    """The agent's abort reason (often an exception's text: a pasted response, a
    stack of causes) is copied into the saga's end and compensation reasons: one of
    400 KB made the state over the record limit, and the shell parked the saga."""
    reason = _long_text()
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge"))
    before = len(h.s.to_bytes())
    h.feed(ledger.end(SagaOutcome.ABORT, reason=reason))
    assert h.s.end_reason is not None and h.s.compensation_reason is not None
    assert f"[cut: {len(reason)} bytes in all]" in h.s.end_reason
    assert h.s.compensation_reason.startswith("aborted by the agent: pasted log line")
    assert len(h.s.to_bytes()) - before < 3 * MAX_OPERATOR_TEXT_BYTES


def test_a_long_resolution_written_past_the_channel_is_kept_cut_R11() -> None:
    """A free-text resolution is copied into the incident (state, receipt); one the
    core refuses is copied into the refusal's detail (state and DLQ)."""
    text = _long_text()
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge"))
    raised = ledger.participant_incident("charge", "inc-manual")
    h.feed(raised.model_copy(update={"kind": "manual-check"}))
    before = len(h.s.to_bytes())
    h.feed(ledger.resolve("inc-manual", text))
    [incident] = [i for i in h.s.incidents if i.incident_id == "inc-manual"]
    assert incident.resolved and incident.resolution is not None
    assert f"[cut: {len(text)} bytes in all]" in incident.resolution
    assert len(h.s.to_bytes()) - before < 2 * MAX_OPERATOR_TEXT_BYTES

    [unknown] = incidents(h.feed(ledger.unknown("charge")))
    before = len(h.s.to_bytes())
    [rejected] = rejections(h.feed(ledger.resolve(unknown.incident_id, text)))
    assert "COMMITTED or NOT_FOUND" in rejected.detail
    assert len(rejected.detail) < 2 * MAX_OPERATOR_TEXT_BYTES
    assert len(h.s.to_bytes()) - before < 2 * MAX_OPERATOR_TEXT_BYTES


# ------------------------------------------------------------------ R8/R9 retries


def test_transient_failure_is_retried_with_the_same_key_after_backoff_R8() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("charge"))
    out = h.feed(ledger.failed("charge"))
    [retry] = events(out, StepRetryScheduled)
    assert retry.attempt == 2 and retry.due_at > h.now
    assert executes(h.advance(retry.due_at - h.now - 1)) == []  # not yet due
    out = h.advance(1)
    [cmd] = [r for r in (o.record for o in out) if isinstance(r, ExecuteStep)]
    assert cmd.attempt == 2 and cmd.idempotency_key == ledger.key("charge")


def test_retry_delay_is_bounded_exponential_with_deterministic_jitter_R8() -> None:
    policy = RetryPolicy(max_attempts=10, initial_backoff_ms=100, max_backoff_ms=1_000)
    delays = [retry_delay_ms(policy, n, "s", "a", n) for n in range(1, 8)]
    assert delays == [retry_delay_ms(policy, n, "s", "a", n) for n in range(1, 8)]
    for n, delay in enumerate(delays, start=1):
        base = min(1_000, 100 * 2 ** (n - 1))
        assert base // 2 <= delay <= base
    assert len({retry_delay_ms(policy, 3, "s", step, 3) for step in "abcdefgh"}) > 1


def test_business_rejection_starts_compensation_at_once_R9() -> None:
    ledger, h = running("hold", "restock")
    h.feed(ledger.scheduled("charge"))
    out = h.feed(ledger.failed("charge", kind=FailureKind.BUSINESS_REJECTION))
    assert events(out, StepRetryScheduled) == []
    assert compensates(out) == ["restock"]
    assert h.s.status.value == "COMPENSATING"


def test_exhausted_forward_retries_start_compensation_R8() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("charge", retry=RetryPolicy(max_attempts=2)))
    h.feed(ledger.failed("charge", attempt=1))
    h.run_timers()
    out = h.feed(ledger.failed("charge", attempt=2))
    assert h.status("charge") == "FAILED"
    assert compensates(out) == ["hold"]


def test_compensations_are_retried_with_the_generous_policy_and_the_same_key_R8() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("charge"))
    h.feed(ledger.failed("charge", kind=FailureKind.BUSINESS_REJECTION))
    keys = []
    for attempt in range(1, 8):  # default compensation_retry allows 8 attempts
        h.feed(ledger.comp_failed("hold", attempt=attempt))
        out = h.run_timers()
        [req] = events(out, CompensationRequested)
        assert req.attempt == attempt + 1
        keys.append(req.compensation_key)
    assert set(keys) == {compensation_key(ledger.key("hold"))}
    assert h.status("hold") == "COMPENSATING"


# ------------------------------------------------------------------ R11 unknown outcome


def test_unknown_outcome_with_lookup_is_reconciled_R11() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge", has_lookup=True))
    out = h.feed(ledger.unknown("charge"))
    assert reconciles(out) == ["charge"]
    assert h.status("charge") == "RECONCILING"


def test_nothing_moves_past_an_unknown_step_R11() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge", has_lookup=True), ledger.scheduled("email"))
    h.feed(ledger.unknown("charge"), ledger.end())
    assert "email" not in executes(h.outputs)
    assert terminal(h.outputs) is None
    out = h.feed(ledger.reconciled("charge", ReconcileResult.COMMITTED))
    assert executes(out) == ["email"]
    assert h.s.steps["charge"].observation == "RECONCILED_COMMITTED"


def test_reconciled_not_found_is_retried_with_the_same_key_R11() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge", has_lookup=True), ledger.unknown("charge"))
    out = h.feed(ledger.reconciled("charge", ReconcileResult.NOT_FOUND))
    assert [r.attempt for r in events(out, StepRetryScheduled)] == [2]
    out = h.run_timers()
    [cmd] = [r for r in (o.record for o in out) if isinstance(r, ExecuteStep)]
    assert cmd.attempt == 2 and cmd.idempotency_key == ledger.key("charge")


def test_reconciled_pending_is_looked_up_again_on_a_timer_R11() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge", has_lookup=True), ledger.unknown("charge"))
    assert reconciles(h.feed(ledger.reconciled("charge", ReconcileResult.PENDING))) == []
    assert h.s.next_due_at() is not None
    assert reconciles(h.run_timers(limit=1)) == ["charge"]


def test_reconciliation_that_stays_pending_goes_to_a_person_R11() -> None:
    ledger, h = fresh()
    policy_rounds = CorePolicy().reconcile_rounds
    h.feed(ledger.started(), ledger.scheduled("charge", has_lookup=True), ledger.unknown("charge"))
    for _ in range(policy_rounds):
        h.feed(ledger.reconciled("charge", ReconcileResult.PENDING))
        h.run_timers(limit=1)
    assert h.status("charge") == "UNKNOWN"
    [incident] = incidents(h.outputs)
    assert incident.kind == "unknown-outcome"


def test_unknown_outcome_without_lookup_raises_an_incident_a_person_settles_R11() -> None:
    ledger, h = fresh()
    h.feed(
        ledger.started(), ledger.scheduled("charge", owner="payments"), ledger.scheduled("email")
    )
    out = h.feed(ledger.unknown("charge"))
    [incident] = incidents(out)
    assert incident.kind == "unknown-outcome" and incident.owner == "payments"
    assert reconciles(out) == []
    [rejected] = rejections(h.feed(ledger.resolve(incident.incident_id, "looked fine")))
    assert "COMMITTED or NOT_FOUND" in rejected.detail
    out = h.feed(ledger.resolve(incident.incident_id, "COMMITTED"))
    assert executes(out) == ["email"]
    assert h.s.incidents[0].resolved


def test_a_second_conflicting_resolution_is_refused_not_silently_ignored_R11() -> None:
    """The first resolution settles the step; a later one (another operator, another
    answer) was dropped without a trace, so nobody could see it did not count."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge"), ledger.scheduled("email"))
    [incident] = incidents(h.feed(ledger.unknown("charge")))
    assert executes(h.feed(ledger.resolve(incident.incident_id, "COMMITTED"))) == ["email"]
    [rejected] = rejections(h.feed(ledger.resolve(incident.incident_id, "NOT_FOUND")))
    assert "already resolved" in rejected.detail and "COMMITTED" in rejected.detail
    assert h.status("charge") == "COMMITTED"


def test_person_resolving_not_found_retries_the_step_R11() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge"))
    [incident] = incidents(h.feed(ledger.unknown("charge")))
    h.feed(ledger.resolve(incident.incident_id, "NOT_FOUND"))
    assert h.status("charge") == "RETRY_WAIT"


def test_participant_incident_for_unknown_outcome_is_not_duplicated_R11() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("charge"))
    h.feed(ledger.participant_incident("charge", "inc-p1"))
    assert incidents(h.feed(ledger.unknown("charge"))) == []
    h.feed(ledger.resolve("inc-p1", "committed"))
    assert h.status("charge") == "COMMITTED"


# ------------------------------------------------------------------ R1-R3 compensation


def test_only_committed_steps_are_compensated_R1() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("restock", depends_on=[]), ledger.scheduled("charge", depends_on=[]))
    h.feed(ledger.failed("restock", kind=FailureKind.BUSINESS_REJECTION))
    assert compensates(h.outputs) == ["hold"]  # independent of the failed step
    out = h.feed(ledger.committed("charge"))  # in flight when the unwind began
    assert compensates(out) == ["charge"]
    assert "restock" not in compensates(h.outputs)


def test_unwind_waits_for_in_flight_dependents_before_undoing_their_dependencies_R1_R2() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("restock", depends_on=["hold"]))
    h.feed(ledger.scheduled("email", depends_on=[]))
    out = h.feed(ledger.failed("email", kind=FailureKind.BUSINESS_REJECTION))
    assert compensates(out) == []  # restock may still commit: hold must wait
    out = h.feed(ledger.committed("restock"))
    assert compensates(out) == ["restock"]
    assert compensates(h.feed(ledger.comp_committed("restock"))) == ["hold"]


def test_plain_chain_unwinds_last_in_first_out_R2() -> None:
    ledger, h = running("a", "b", "c")
    h.feed(ledger.scheduled("d"))
    order = compensates(h.feed(ledger.failed("d", kind=FailureKind.BUSINESS_REJECTION)))
    for step in ("c", "b", "a"):
        order += compensates(h.feed(ledger.comp_committed(step)))
    assert order == ["c", "b", "a"]


def test_independent_branches_compensate_together_R2() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    for step in ("flight", "hotel"):
        h.feed(ledger.scheduled(step, depends_on=[]), ledger.committed(step))
    h.feed(ledger.scheduled("ship", depends_on=["flight", "hotel"]), ledger.committed("ship"))
    h.feed(ledger.scheduled("pay", depends_on=["ship"]))
    out = h.feed(ledger.failed("pay", kind=FailureKind.BUSINESS_REJECTION))
    assert compensates(out) == ["ship"]
    assert compensation_order(h.s) == [["ship"], ["hotel", "flight"]]
    assert sorted(compensates(h.feed(ledger.comp_committed("ship")))) == ["flight", "hotel"]


def test_the_plan_keeps_compensations_that_are_accepted_or_waiting_to_retry_R2_R12() -> None:
    """An accepted compensation is not done (R12), nor is one waiting for its retry:
    the plan must still show them, and what depends on them after them."""
    for answer in ("accepted", "transient"):
        ledger, h = running("a", "b")
        h.feed(ledger.end(SagaOutcome.ABORT))
        assert compensation_order(h.s) == [["b"], ["a"]]
        h.feed(ledger.comp_accepted("b") if answer == "accepted" else ledger.comp_failed("b"))
        assert h.status("b") in ("COMPENSATION_ACCEPTED", "COMPENSATION_RETRY_WAIT")
        assert compensation_order(h.s) == [["b"], ["a"]], answer
        attempt = 1
        if answer == "transient":
            assert compensates(h.run_timers()) == ["b"]
            attempt = 2
        assert compensates(h.feed(ledger.comp_committed("b", attempt=attempt))) == ["a"]
        assert compensation_order(h.s) == [["a"]]


def test_steps_sharing_a_resource_are_compensated_one_at_a_time_R2() -> None:
    ledger, h = fresh()
    h.feed(ledger.started())
    for step in ("x", "y", "z"):
        h.feed(ledger.scheduled(step, depends_on=[], resources=["acct:1"] if step != "z" else []))
        h.feed(ledger.committed(step))
    h.feed(ledger.scheduled("boom", depends_on=[]))
    out = h.feed(ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    assert compensates(out) == ["z", "y"]
    assert compensates(h.feed(ledger.comp_committed("z"))) == []
    assert compensates(h.feed(ledger.comp_committed("y"))) == ["x"]


def test_failed_compensation_raises_an_incident_and_the_unwind_continues_R3() -> None:
    ledger, h = running("hold")
    h.feed(
        ledger.scheduled(
            "restock",
            resources=["sku:42"],
            owner="warehouse-team",
            compensation_retry=RetryPolicy(max_attempts=1),
        )
    )
    h.feed(ledger.committed("restock"), ledger.scheduled("charge"))
    h.feed(ledger.failed("charge", kind=FailureKind.BUSINESS_REJECTION))
    out = h.feed(ledger.comp_failed("restock"))
    [incident] = incidents(out)
    assert incident.owner == "warehouse-team"
    assert incident.resources == ["sku:42"]
    assert incident.step_id == "restock" and "op-restock" in incident.effect
    assert "not undone" in incident.inconsistency
    assert compensates(out) == ["hold"]  # implicit edge: continue
    out = h.feed(ledger.comp_committed("hold"))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert receipt.unresolved == ["restock"]
    assert receipt.owner == "warehouse-team"


def explicit_pair(**started: Any) -> tuple[Ledger, Harness]:
    ledger, h = fresh()
    h.feed(ledger.started(**started))
    h.feed(ledger.scheduled("account", depends_on=[]), ledger.committed("account"))
    h.feed(
        ledger.scheduled(
            "card",
            depends_on=["account"],
            owner="cards",
            compensation_retry=RetryPolicy(max_attempts=1),
        )
    )
    h.feed(ledger.committed("card"))
    h.feed(ledger.scheduled("boom", depends_on=[]))
    h.feed(ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    return ledger, h


def test_explicit_upstream_is_held_when_its_dependent_cannot_be_undone_R3() -> None:
    ledger, h = explicit_pair()
    out = h.feed(ledger.comp_failed("card"))
    assert compensates(out) == []
    assert h.status("account") == "HELD"
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert set(receipt.unresolved) == {"card", "account"}
    held = next(s for s in receipt.steps if s.step_id == "account")
    assert held.disposition is Disposition.ESCALATED and held.incident_id is not None


def test_continue_on_compensation_failure_unwinds_past_explicit_edges_R3() -> None:
    ledger, h = explicit_pair(continue_on_compensation_failure=True)
    out = h.feed(ledger.comp_failed("card"))
    assert compensates(out) == ["account"]


# ------------------------------------------------------------------ R6 pivot


def pivoted() -> tuple[Ledger, Harness]:
    ledger, h = running("hold", "restock")
    h.feed(ledger.scheduled("credit", pivot=True), ledger.committed("credit"))
    return ledger, h


def test_failure_after_the_pivot_is_retried_forward_never_compensated_R6() -> None:
    ledger, h = pivoted()
    h.feed(ledger.scheduled("email", retry=RetryPolicy(max_attempts=3)))
    h.feed(ledger.failed("email"))
    out = h.run_timers()
    [cmd] = [r for r in (o.record for o in out) if isinstance(r, ExecuteStep)]
    assert cmd.attempt == 2 and cmd.idempotency_key == ledger.key("email")
    out = h.feed(ledger.committed("email", attempt=2), ledger.end())
    assert compensates(h.outputs) == []
    assert receipt_of(out).status is TerminalStatus.COMPLETED


def test_exhausted_forward_work_after_the_pivot_escalates_R6() -> None:
    ledger, h = pivoted()
    h.feed(ledger.scheduled("email", retry=RetryPolicy(max_attempts=2), owner="support"))
    h.feed(ledger.failed("email"))
    h.run_timers()
    out = h.feed(ledger.failed("email", attempt=2))
    [incident] = incidents(out)
    assert incident.kind == "forward-failed-after-pivot" and incident.owner == "support"
    out = h.feed(ledger.end(SagaOutcome.ABORT))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert compensates(h.outputs) == []
    assert {s.step_id: s.disposition for s in receipt.steps}["credit"] is Disposition.RETAINED


def test_a_commit_reported_after_the_escalation_after_the_pivot_settles_it_R6_R14() -> None:
    """The ledger is the truth: the step did take effect after all. Its incident said
    it did not and that it is still owed; left open, the saga ended ESCALATED with that
    claim in the receipt and its owner was handed work that was already done."""
    ledger, h = pivoted()
    h.feed(ledger.scheduled("email", retry=RetryPolicy(max_attempts=2), owner="support"))
    h.feed(ledger.failed("email"))
    h.run_timers()
    [incident] = incidents(h.feed(ledger.failed("email", attempt=2)))
    assert h.status("email") == "ESCALATED"
    h.feed(ledger.committed("email", attempt=2))
    assert h.status("email") == "COMMITTED"
    receipt = receipt_of(h.feed(ledger.end()))
    [record] = [i for i in receipt.incidents if i.incident_id == incident.incident_id]
    assert record.resolved, record
    assert receipt.unresolved == [] and receipt.owner is None
    assert receipt.status is TerminalStatus.COMPLETED
    assert {s.step_id: s.disposition for s in receipt.steps}["email"] is Disposition.RETAINED


def test_business_rejection_after_the_pivot_escalates_without_retry_R6_R9() -> None:
    ledger, h = pivoted()
    h.feed(ledger.scheduled("email"))
    out = h.feed(ledger.failed("email", kind=FailureKind.BUSINESS_REJECTION))
    assert events(out, StepRetryScheduled) == []
    assert h.status("email") == "ESCALATED"


def test_pivot_waits_until_every_earlier_step_committed_R6() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("a", depends_on=[]))
    out = h.feed(ledger.scheduled("credit", depends_on=[], pivot=True))
    assert executes(out) == []
    assert executes(h.feed(ledger.committed("a"))) == ["credit"]


def test_abort_while_the_pivot_is_in_flight_waits_for_its_outcome_R6() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("credit", pivot=True))
    assert compensates(h.feed(ledger.end(SagaOutcome.ABORT))) == []
    out = h.feed(ledger.committed("credit"))
    assert compensates(h.outputs) == []
    assert receipt_of(out).status is TerminalStatus.COMPLETED


def test_abort_before_the_pivot_compensates_R6() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("credit", pivot=True))
    h.feed(ledger.end(SagaOutcome.ABORT))
    out = h.feed(ledger.failed("credit", kind=FailureKind.BUSINESS_REJECTION))
    assert compensates(out) == ["hold"]


# ------------------------------------------------------------------ R12 async / verification


def failing_after(step: str, **kw: Any) -> tuple[Ledger, Harness]:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled(step, **kw), ledger.committed(step))
    h.feed(ledger.scheduled("boom"), ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    return ledger, h


def test_accepted_compensation_is_not_done_until_committed_R12() -> None:
    ledger, h = failing_after("refund")
    out = h.feed(ledger.comp_accepted("refund"))
    assert terminal(out) is None and h.status("refund") == "COMPENSATION_ACCEPTED"
    out = h.feed(ledger.comp_committed("refund"))
    assert receipt_of(out).status is TerminalStatus.COMPENSATED


def test_verified_false_is_a_failed_compensation_R12() -> None:
    ledger, h = failing_after("refund", has_verify=True)
    out = h.feed(ledger.comp_committed("refund", verified=False))
    assert [i.kind for i in incidents(out)] == ["compensation-not-verified"]
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert receipt.steps[0].verification == "FAILED"


def test_declared_verification_that_is_not_reported_does_not_count_R12() -> None:
    ledger, h = failing_after("refund", has_verify=True)
    out = h.feed(ledger.comp_committed("refund", verified=None))
    assert receipt_of(out).status is TerminalStatus.ESCALATED


def test_verified_compensation_is_recorded_in_the_receipt_R12() -> None:
    ledger, h = failing_after("refund", has_verify=True)
    out = h.feed(ledger.comp_committed("refund", verified=True))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert receipt.steps[0].verification == "PASSED"


# ------------------------------------------------------------------ R13


def test_expired_reversal_window_becomes_an_incident_R13() -> None:
    slow_retry = RetryPolicy(max_attempts=5, initial_backoff_ms=5_000, max_backoff_ms=10_000)
    ledger, h = failing_after("booking", reversal_window_ms=1_000, compensation_retry=slow_retry)
    assert h.status("booking") == "COMPENSATING"
    h.feed(ledger.comp_failed("booking"))  # transient: a retry is scheduled ...
    window = h.s.steps["booking"].reversal_deadline
    assert window is not None
    out = h.advance(window - h.now)  # ... but the window closes first
    kinds = [i.kind for i in incidents(out)]
    assert "reversal-window-expired" in kinds
    assert compensates(out) == []
    assert receipt_of(out).status is TerminalStatus.ESCALATED


def test_a_commit_dated_ahead_of_the_coordinator_cannot_extend_the_reversal_window_R13() -> None:
    """A participant whose clock runs ahead dates its commit in the future: the
    reversal window counts from when the coordinator decided the commit at the latest,
    so the compensation is not sent past the window the tool declared."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("booking", reversal_window_ms=1_000))
    commit = ledger.committed("booking", occurred_at=h.now + 8 * 3600 * 1000)
    now = h.now + 1
    decided = decide(h.s, commit, now).state
    assert decided is not None
    assert decided.steps["booking"].reversal_deadline == now + 1_000
    h.state = decided
    h.now = now
    h.feed(ledger.scheduled("boom"), ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION))
    assert h.status("booking") == "COMPENSATING"
    out = h.advance(now + 1_000 - h.now)
    [raised] = incidents(out)
    assert raised.kind == "reversal-window-expired"
    assert f"after the commit at {now})" in raised.inconsistency


def _window_passes_in_flight(*, accepted: bool = False) -> tuple[Ledger, Harness, str]:
    """booking's compensation (with a declared verification) is in flight when its
    reversal window passes: the incident is raised at once, the step stays in flight."""
    ledger, h = failing_after(
        "booking", reversal_window_ms=1_000, has_verify=True, completion_within_ms=60_000
    )
    assert compensates(h.outputs) == ["booking"]
    if accepted:
        h.feed(ledger.comp_accepted("booking"))
    window = h.s.steps["booking"].reversal_deadline
    assert window is not None
    [raised] = incidents(h.advance(window - h.now))
    assert raised.kind == "reversal-window-expired"
    assert terminal(h.outputs) is None
    return ledger, h, raised.incident_id


@pytest.mark.parametrize("accepted", [False, True])
def test_compensation_verified_after_the_window_passed_settles_its_incident_R13_R14(
    accepted: bool,
) -> None:
    """The compensation that was in flight when the window passed committed and its
    verification passed: the ledger says the effect is undone, so the window's incident
    is settled by it, as a late forward commit settles its obligation. Left open, the
    saga ended ESCALATED and the receipt listed the step both as undone and verified
    and as "Still changed: effect remains in the world"."""
    ledger, h, incident_id = _window_passes_in_flight(accepted=accepted)
    out = h.feed(ledger.comp_committed("booking", verified=True))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.COMPENSATED
    [step] = [s for s in receipt.steps if s.step_id == "booking"]
    assert step.disposition is Disposition.COMPENSATED and step.verification == "PASSED"
    [incident] = [i for i in receipt.incidents if i.incident_id == incident_id]
    assert incident.resolved
    assert incident.resolution is not None and "COMPENSATED" in incident.resolution
    assert receipt.unresolved == []


def test_compensation_failing_verification_after_the_window_leaves_its_incident_R12_R13() -> None:
    ledger, h, incident_id = _window_passes_in_flight()
    out = h.feed(ledger.comp_committed("booking", verified=False))
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert [i.incident_id for i in receipt.incidents if not i.resolved] == [incident_id]


def test_compensation_failing_after_the_window_leaves_its_incident_R13() -> None:
    ledger, h, incident_id = _window_passes_in_flight()
    out = h.feed(ledger.comp_failed("booking"))
    assert compensates(out) == []  # no further attempt past the window
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert [i.incident_id for i in receipt.incidents if not i.resolved] == [incident_id]


def test_compensation_only_accepted_after_the_window_leaves_its_incident_R12_R13() -> None:
    ledger, h, incident_id = _window_passes_in_flight(accepted=True)
    out = h.run_timers()  # the completion wait passes with no completion
    receipt = receipt_of(out)
    assert receipt.status is TerminalStatus.ESCALATED
    assert [i.incident_id for i in receipt.incidents if not i.resolved] == [incident_id]
    # a completion arriving after that changes nothing: a person owns it
    assert terminal(h.feed(ledger.comp_committed("booking", verified=True))) is None
    still = h.s.incident(incident_id)
    assert still is not None and not still.resolved


def test_compensation_requiring_approval_asks_before_compensating_R13() -> None:
    ledger, h = failing_after("refund", compensation_approval=CompensationApproval.REQUIRE)
    [request] = approval_requests(h.outputs)
    assert request.purpose is ApprovalPurpose.COMPENSATION
    assert compensates(h.outputs) == []
    out = h.feed(ledger.grant(request))
    assert compensates(out) == ["refund"]


def test_denied_compensation_approval_escalates_R13() -> None:
    ledger, h = failing_after("refund", compensation_approval=CompensationApproval.REQUIRE)
    [request] = approval_requests(h.outputs)
    out = h.feed(ledger.deny(request))
    assert [i.kind for i in incidents(out)] == ["compensation-denied"]
    assert receipt_of(out).status is TerminalStatus.ESCALATED


@pytest.mark.parametrize(
    "mode", [CompensationApproval.INHERIT, CompensationApproval.ALWAYS_ALLOWED]
)
def test_inherited_or_always_allowed_compensation_runs_at_once_R13(
    mode: CompensationApproval,
) -> None:
    _ledger, h = failing_after("refund", compensation_approval=mode)
    assert compensates(h.outputs) == ["refund"]
    assert approval_requests(h.outputs) == []


def test_committed_step_without_compensation_escalates_by_name_R3_R14() -> None:
    _ledger, h = failing_after("notify", compensation=None, owner="comms")
    [incident] = incidents(h.outputs)
    assert incident.kind == "no-compensation" and incident.owner == "comms"
    receipt = receipt_of(h.outputs)
    assert receipt.status is TerminalStatus.ESCALATED and receipt.unresolved == ["notify"]


# ------------------------------------------------------------------ R14 receipt


def test_receipt_lists_every_step_and_its_evidence_R14() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(workflow_version="7", policy_version="3"))
    h.feed(ledger.scheduled("lookup", read_only=True), ledger.committed("lookup"))
    h.feed(ledger.scheduled("hold"), ledger.intent("hold"), ledger.committed("hold"))
    h.feed(ledger.scheduled("wire", reversibility=Reversibility.IRREVERSIBLE))
    [request] = approval_requests(h.outputs)
    h.feed(ledger.grant(request), ledger.failed("wire", kind=FailureKind.BUSINESS_REJECTION))
    out = h.feed(ledger.comp_committed("hold"))
    receipt = receipt_of(out)
    assert (receipt.workflow_version, receipt.policy_version) == ("7", "3")
    assert receipt.principal == "alice" and receipt.status is TerminalStatus.COMPENSATED
    by_step = {s.step_id: s for s in receipt.steps}
    assert by_step["lookup"].disposition is Disposition.READ_ONLY
    hold = by_step["hold"]
    assert hold.disposition is Disposition.COMPENSATED
    assert hold.idempotency_key_hash == key_hash(ledger.key("hold"))
    assert hold.provider_operation_id == "op-hold" and hold.intent_at is not None
    assert hold.compensation_attempts == 1 and hold.verification == "NOT_DECLARED"
    assert by_step["wire"].disposition is Disposition.NOT_COMMITTED
    assert [a.decision for a in receipt.approvals] == ["GRANTED"]
    assert receipt.unresolved == []


@settings(max_examples=60, deadline=None)
@given(
    committed=st.integers(0, 3),
    how=st.sampled_from(["business", "transient", "denied"]),
    end=st.sampled_from(["none", "complete-before", "complete-after"]),
)
def test_the_receipt_of_an_unwound_saga_says_which_step_failed_R9_R14(
    committed: int, how: str, end: str
) -> None:
    """A saga that unwound because a step failed finally says so in its receipt's end
    reason, whatever the agent asked at the end: an agent that caught the tool's error
    and left its block normally asked to COMPLETE, and the receipt of the COMPENSATED
    saga said only "COMPLETE", losing which step failed and why."""
    ledger, h = fresh()
    h.feed(ledger.started())
    for i in range(committed):
        h.feed(ledger.scheduled(f"s{i}"), ledger.committed(f"s{i}"))
    irreversible = Reversibility.IRREVERSIBLE if how == "denied" else Reversibility.COMPENSATABLE
    h.feed(
        ledger.scheduled("credit", reversibility=irreversible, retry=RetryPolicy(max_attempts=1))
    )
    if end == "complete-before":
        h.feed(ledger.end())
    if how == "denied":
        [request] = approval_requests(h.outputs)
        h.feed(ledger.deny(request, reason="over limit"))
    else:
        kind = FailureKind.BUSINESS_REJECTION if how == "business" else FailureKind.TRANSIENT
        h.feed(ledger.failed("credit", kind=kind, message="over limit"))
    if end == "complete-after":
        h.feed(ledger.end())
    for i in reversed(range(committed)):
        h.feed(ledger.comp_committed(f"s{i}"))
    receipt = receipt_of(h.outputs)
    assert receipt.status is TerminalStatus.COMPENSATED
    assert receipt.end_reason.startswith("step credit failed: "), receipt.end_reason
    assert "over limit" in receipt.end_reason


def test_the_receipt_of_an_aborted_saga_keeps_the_agents_reason_R14() -> None:
    ledger, h = running("hold")
    h.feed(ledger.end(SagaOutcome.ABORT, reason="ValueError: customer changed their mind"))
    receipt = receipt_of(h.feed(ledger.comp_committed("hold")))
    assert receipt.end_reason == "ValueError: customer changed their mind"


def test_terminal_record_goes_to_the_terminal_topic_and_the_ledger_R14() -> None:
    ledger, h = fresh()
    out = h.feed(ledger.started(), ledger.end())
    [term] = [o for o in out if o.destination is Destination.TERMINAL]
    assert term.appends_to_events
    assert h.s.is_terminal and h.s.next_due_at() is None


# ------------------------------------------------------------------ state & fold (R5)


def test_state_round_trips_through_bytes() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("charge"), ledger.failed("charge"))
    data = h.s.to_bytes()
    assert SagaState.from_bytes(data).to_bytes() == data
    assert SagaState.from_bytes(data).steps["hold"].result == orjson.dumps({"id": "op-hold"})


def test_next_due_at_reports_the_earliest_timer() -> None:
    ledger, h = running("hold")
    h.feed(ledger.scheduled("charge"))
    out = h.feed(ledger.failed("charge"))
    [retry] = events(out, StepRetryScheduled)
    assert h.s.next_due_at() == retry.due_at
    nothing = tick(h.s, retry.due_at - 1)
    assert nothing.outputs == [] and nothing.state is h.state


def test_fold_of_the_log_rebuilds_the_live_state_R5() -> None:
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("hold"), ledger.committed("hold"))
    h.feed(ledger.scheduled("charge"), ledger.failed("charge"))
    h.run_timers()  # the retry fires from a timer, not from a record
    h.feed(ledger.failed("charge", attempt=2, kind=FailureKind.BUSINESS_REJECTION))
    h.feed(ledger.comp_committed("hold"))
    rebuilt = fold(h.log)["saga-1"]
    assert rebuilt.to_bytes() == fold(h.log)["saga-1"].to_bytes()
    assert rebuilt.status == h.s.status
    assert {k: (v.status, v.attempt) for k, v in rebuilt.steps.items()} == {
        k: (v.status, v.attempt) for k, v in h.s.steps.items()
    }


def test_deciding_in_place_gives_the_same_decisions_and_copying_leaves_the_input_alone() -> None:
    """The shell hands its per-batch state to the core (``in_place``): every decision,
    timers included, must be the one the copying core makes, and the copying core
    must never change the state it was given."""
    ledger = Ledger()
    records = [
        ledger.started(),
        ledger.scheduled("hold"),
        ledger.intent("hold"),
        ledger.committed("hold"),
        ledger.scheduled("charge"),
        ledger.failed("charge"),  # transient: a retry timer
        None,  # the timer fires
        ledger.failed("charge", attempt=2, kind=FailureKind.BUSINESS_REJECTION),
        ledger.comp_accepted("hold"),  # no completion wait declared: an incident
        ledger.comp_committed("hold"),
    ]
    copied: SagaState | None = None
    owned: SagaState | None = None
    now = 1_000_000
    for record in records:
        now += 10
        if record is None:
            assert copied is not None and owned is not None
            now = copied.next_due_at() or now
            before = copied.to_bytes()
            a, b = tick(copied, now), tick(owned, now, in_place=True)
        else:
            before = copied.to_bytes() if copied is not None else b""
            a = decide(copied, record, now, position=(0, now))
            b = decide(owned, record, now, position=(0, now), in_place=True)
        if copied is not None:
            assert copied.to_bytes() == before  # the copying core left its input alone
        assert a.outputs == b.outputs and a.changed == b.changed
        assert a.state is not None and b.state is not None
        assert a.state.to_bytes() == b.state.to_bytes()
        assert owned is None or b.state is owned  # changed where it was
        copied, owned = a.state, b.state
    assert owned is not None and owned.is_terminal


def test_commands_on_the_events_topic_are_rejected_R16() -> None:
    ledger, h = fresh()
    out = h.feed(ledger.started(), ledger.scheduled("hold"))
    [cmd] = [o.record for o in out if o.destination is Destination.COMMAND]
    forged = cmd.model_copy(
        update={
            "envelope": cmd.envelope.model_copy(update={"producer": "someone", "event_id": "x"})
        }
    )
    [rejected] = rejections(h.feed(forged))
    assert rejected.reason == "not-an-event"


# ------------------------------------------------------------------ bound writers


def _ids_derived_to_accept_a_commit(generation: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """With bound writers: how many event ids the core derives to accept one commit."""
    import coordinator.core as core

    bound = CorePolicy(bind_writers=True)
    ledger = Ledger(generation=generation)
    d = decide(None, ledger.started(), ledger.clock, bound)
    d = decide(d.state, ledger.scheduled("charge"), ledger.clock, bound)
    [command] = [o.record for o in d.outputs if isinstance(o.record, ExecuteStep)]
    commit = ledger.committed("charge")
    commit = commit.model_copy(
        update={"envelope": commit.envelope.model_copy(update={"causation_id": command.event_id})}
    )
    calls: list[tuple[Any, ...]] = []
    real = core.derived_event_id

    def counting(*parts: Any) -> str:
        calls.append(parts)
        return real(*parts)

    with monkeypatch.context() as patched:
        patched.setattr(core, "derived_event_id", counting)
        out = decide(d.state, commit, ledger.clock, bound)
    assert [o.reason for o in out.outputs if o.reason] == []
    assert out.state is not None and out.state.steps["charge"].status.value == "COMMITTED"
    return len(calls)


def test_checking_who_answered_does_not_grow_with_the_generation_R15_R16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent may number its runs as it likes (a long; a timestamp is a natural
    choice). Checking that an outcome answers a command sent for its step must not
    walk every generation below the saga's: at generation 10**12 that loop never ends
    and the coordinator instance stops deciding every saga it owns."""
    assert _ids_derived_to_accept_a_commit(5_000, monkeypatch) == _ids_derived_to_accept_a_commit(
        1, monkeypatch
    )


def _answering(record: Record, command: Record) -> Record:
    """``record`` as a participant writes it in answer to ``command`` (its causation)."""
    env = record.envelope.model_copy(update={"causation_id": command.event_id})
    return record.model_copy(update={"envelope": env})


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.integers(2, 4),
    late=st.data(),
    outcome=st.sampled_from(list(ReconcileResult)),
)
def test_a_late_answer_to_an_earlier_attempts_lookup_is_no_forged_writer_R11_R15_R16(
    rounds: int, late: st.DataObject, outcome: ReconcileResult
) -> None:
    """Attempt 1 timed out and took ``rounds`` lookups to be found NOT_FOUND; attempt 2
    timed out too and is at its first lookup. The participant's answer to one of
    attempt 1's lookups arrives again (a redelivered command, a second replica): it is
    the right participant answering a command the coordinator did send, so it is absorbed
    quietly (a COMMITTED one is the effect, R11). Before, it was refused as
    ``forbidden-writer``, a false security alarm in the DLQ, because only lookup rounds up
    to attempt 2's current round were counted as sent. A forged causation is refused."""
    bound = CorePolicy(bind_writers=True, reconcile_rounds=5)
    ledger = Ledger()
    state: SagaState | None = None
    sent: list[Record] = []

    def feed(record: Record) -> list[str]:
        nonlocal state
        d = decide(state, record, ledger.clock, bound)
        state = d.state
        sent.extend(o.record for o in d.outputs if o.destination is Destination.COMMAND)
        return [o.reason for o in d.outputs if o.reason]

    def run_timers() -> None:
        nonlocal state
        assert state is not None
        due = state.next_due_at()
        assert due is not None
        ledger.clock = max(ledger.clock, due)
        d = tick(state, ledger.clock, bound)
        state = d.state
        sent.extend(o.record for o in d.outputs if o.destination is Destination.COMMAND)

    assert feed(ledger.started()) == []
    assert feed(ledger.scheduled("pay", has_lookup=True)) == []
    assert feed(_answering(ledger.unknown("pay", 1), sent[-1])) == []
    lookups: list[Record] = []
    for n in range(rounds):
        lookups.append(sent[-1])
        answer = ReconcileResult.PENDING if n < rounds - 1 else ReconcileResult.NOT_FOUND
        assert feed(_answering(ledger.reconciled("pay", answer, 1), sent[-1])) == []
        run_timers()  # the next lookup, or the retry of the step
    assert state is not None and state.steps["pay"].attempt == 2
    assert feed(_answering(ledger.unknown("pay", 2), sent[-1])) == []
    assert state.steps["pay"].reconcile_round == 1
    earlier = late.draw(st.sampled_from(lookups), label="earlier lookup")
    again = _answering(ledger.reconciled("pay", outcome, 1), earlier)
    assert feed(again) == []
    status = state.steps["pay"].status
    assert status is (
        StepStatus.COMMITTED if outcome is ReconcileResult.COMMITTED else StepStatus.RECONCILING
    )
    forged = ledger.reconciled("pay", outcome, 1)
    forged = forged.model_copy(
        update={"envelope": forged.envelope.model_copy(update={"causation_id": "made-up"})}
    )
    assert feed(forged) == ["forbidden-writer"]


# ------------------------------------------------------------------ payload references


class _Payments:
    def __init__(self) -> None:
        self.refunded: list[object] = []

    @tool(description="Take a payment")
    @compensable(by="refund")
    def pay(self, cents: int) -> dict[str, str]:
        return {"payment": "p-1"}

    def refund(self, ctx: CompensationContext) -> None:
        self.refunded.append(ctx.result)


def test_a_large_result_a_person_settles_with_reaches_the_compensation_R11_R12(
    tmp_path: Path,
) -> None:
    """A person settles an unknown outcome as COMMITTED and gives the tool's result.
    Over the inline size the core kept it as a reference to the IncidentResolved, which
    the participant cannot read a result from: the compensation failed for good and the
    saga ended ESCALATED with the effect left in the world."""
    payments = _Payments()
    ledger = Ledger()
    on_ledger: dict[tuple[int, int], Record] = {}
    state: SagaState | None = None
    sent: list[Record] = []

    def feed(record: Record) -> None:
        nonlocal state
        position = (0, len(on_ledger))
        on_ledger[position] = record
        d = decide(state, record, record.envelope.occurred_at, position=position)
        state = d.state
        sent.extend(o.record for o in d.outputs if o.destination is Destination.COMMAND)

    feed(ledger.started())
    feed(
        ledger.scheduled("pay", args={"cents": 500}, participant="payments", compensation="refund")
    )
    feed(ledger.unknown("pay"))
    assert state is not None and state.incidents
    big = {"payment": "p-7", "lines": ["x" * 40] * 50}  # about 2 KiB
    resolution = ledger.resolve(state.incidents[0].incident_id, "COMMITTED").model_copy(
        update={"provider_operation_id": "pay-op-7", "result": orjson.dumps(big)}
    )
    feed(resolution)
    assert state.steps["pay"].status.value == "COMMITTED"
    feed(ledger.end(SagaOutcome.ABORT))
    [compensate] = [r for r in sent if isinstance(r, CompensateStep)]

    out: list[Record] = []
    handler = CommandHandler(
        wrap(payments, name="payments"),
        "payments",
        CommandJournal(tmp_path / "journal.sqlite"),
        out.append,
        fetch=lambda ref: on_ledger.get((ref.partition, ref.offset)),
    )
    try:
        handler.handle(compensate)
    finally:
        handler.close()
    assert [type(r).__name__ for r in out] == ["CompensationCommitted"], out
    assert payments.refunded == [big]
