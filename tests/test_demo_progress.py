"""The demo's live view: the ledger folded into one status per saga, and its rendering.

No Kafka: the board is fed records directly, as the ledger follower would.
"""

from __future__ import annotations

import io
from collections import Counter

import pytest
from confluent_kafka import KafkaError, KafkaException

from schemas import envelope_for
from schemas.models import (
    ApprovalGranted,
    ApprovalPurpose,
    ApprovalRequested,
    CompensationRequested,
    Envelope,
    Record,
    SagaStarted,
    SagaTerminal,
    TerminalStatus,
)
from schemas.signing import Signer
from services import demo_progress
from services.demo_progress import STATUSES, LedgerFollower, ProgressDisplay, SagaBoard


def env(cls: type[Record], saga: str) -> Envelope:
    return envelope_for(cls, saga_id=saga, tenant_id="t", producer="test", now=1)


def started(saga: str) -> SagaStarted:
    return SagaStarted(envelope=env(SagaStarted, saga), workflow="refund", principal="a")


def approval_requested(saga: str) -> ApprovalRequested:
    return ApprovalRequested(
        envelope=env(ApprovalRequested, saga),
        step_id="05-send_reply",
        approval_id="ap-1",
        purpose=ApprovalPurpose.FORWARD,
        principal="a",
        args_fingerprint="f",
        scope="send_reply",
        expires_at=10,
    )


def approval_granted(saga: str) -> ApprovalGranted:
    return ApprovalGranted(
        envelope=env(ApprovalGranted, saga),
        step_id="05-send_reply",
        approval_id="ap-1",
        purpose=ApprovalPurpose.FORWARD,
        principal="a",
        args_fingerprint="f",
        scope="send_reply",
        expires_at=10,
        granted_by="demo-operator",
    )


def compensation_requested(saga: str) -> CompensationRequested:
    return CompensationRequested(
        envelope=env(CompensationRequested, saga),
        step_id="02-place_hold",
        tool="place_hold",
        compensation="release_hold",
        compensation_key="comp-1",
        attempt=1,
    )


def terminal(saga: str, status: TerminalStatus) -> SagaTerminal:
    return SagaTerminal(envelope=env(SagaTerminal, saga), status=status, receipt=b"{}")


def test_a_saga_moves_through_approval_back_to_running_then_ends() -> None:
    board = SagaBoard()
    board.apply(started("s1"))
    assert board.status("s1") == "running"
    board.apply(approval_requested("s1"))
    assert board.status("s1") == "awaiting approval"
    board.apply(approval_granted("s1"))
    assert board.status("s1") == "running"
    board.apply(terminal("s1", TerminalStatus.COMPLETED))
    assert board.status("s1") == "completed"


def test_a_compensating_saga_shows_as_compensating_until_its_terminal_record() -> None:
    board = SagaBoard()
    board.apply(started("s1"))
    board.apply(compensation_requested("s1"))
    assert board.status("s1") == "compensating"
    board.apply(terminal("s1", TerminalStatus.COMPENSATED))
    assert board.counts() == Counter({"compensated": 1})


def test_a_record_after_the_terminal_one_changes_nothing() -> None:
    """R15: a late echo or duplicate does not resurrect a finished saga."""
    board = SagaBoard()
    board.apply(terminal("s1", TerminalStatus.ESCALATED))
    board.apply(compensation_requested("s1"))
    assert board.status("s1") == "escalated"
    assert board.terminal_count() == 1


def test_waiting_for_terminal_sagas_returns_when_all_are_terminal() -> None:
    board = SagaBoard()
    board.apply(terminal("s1", TerminalStatus.COMPLETED))
    assert board.wait_terminal({"s1"}, timeout_s=0.1)
    assert not board.wait_terminal({"s1", "s2"}, timeout_s=0.1)


def test_without_a_terminal_the_display_prints_one_plain_line_per_tick() -> None:
    board = SagaBoard()
    board.apply(started("s1"))
    board.apply(terminal("s2", TerminalStatus.COMPLETED))
    out = io.StringIO()
    ProgressDisplay(board, total=2, live=False, out=out).draw()
    line = out.getvalue()
    assert line.startswith("progress: 1/2 terminal")
    assert "\x1b[" not in line
    assert all(status in line for status in STATUSES)


def test_on_a_terminal_the_table_is_redrawn_in_place() -> None:
    board = SagaBoard()
    board.apply(started("s1"))
    out = io.StringIO()
    display = ProgressDisplay(board, total=1, live=True, out=out)
    display.draw()
    display.draw()
    text = out.getvalue()
    lines = len(display.render(board.counts(), 0.0))
    assert f"\x1b[{lines}F\x1b[J" in text  # cursor back up over the previous table
    assert "running" in text and "0/1 terminal" in text


# -------------------------------------------------------------- the ledger follower


class _UnreachableConsumer:
    """A consumer whose broker does not answer the metadata request."""

    def list_topics(self, *_args: object, **_kwargs: object) -> object:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))

    def close(self) -> None:
        pass


def _follow(bootstrap: str, topic: str) -> tuple[SagaBoard, LedgerFollower]:
    board = SagaBoard()
    follower = LedgerFollower(
        bootstrap, topic, Signer(b"k"), [board.apply], on_failure=board.abandon
    )
    follower.start()
    return board, follower


def test_a_follower_that_cannot_read_the_ledger_ends_the_wait_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """list_topics failing killed the follower's thread; the demo then waited its whole
    --timeout (300 s) and reported every saga "NOT terminal", never the cause."""
    monkeypatch.setattr(demo_progress, "create_consumer", lambda *_a: _UnreachableConsumer())
    board, follower = _follow("unused:0", "demo.sagaline.events")
    try:
        ended = board.wait_terminal({"s1"}, timeout_s=120)
        assert getattr(board, "failure", None), "the wait ran out its timeout, cause unsaid"
        assert not ended
        assert "all brokers down" in str(board.failure)
        assert "demo.sagaline.events" in str(board.failure)
    finally:
        follower.stop()


@pytest.mark.kafka
def test_a_follower_on_a_ledger_topic_that_does_not_exist_says_so(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A missing topic: the follower assigned no partition and read nothing, silently."""
    topic = f"{unique_prefix}sagaline.events"
    board, follower = _follow(kafka_bootstrap, topic)
    try:
        assert not board.wait_terminal({"s1"}, timeout_s=120)
        assert getattr(board, "failure", None), "the wait ran out its timeout, cause unsaid"
        assert topic in str(board.failure)
    finally:
        follower.stop()
