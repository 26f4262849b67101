"""R10/R16: an intent the broker refuses un-marks its command (the journal's
"started" row becomes "unstarted", with that intent: the tool did not run) and the
command is tried again.
When the journal cannot write that row for a while (a full disk), the command must
neither go to the DLQ nor come back as an unknown outcome: it waits for the
journal like any other journal write, then runs once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from participants import compensable, tool, wrap
from participants.runtime import CommandHandler, CommandJournal, ParticipantRuntime
from sagaline.kafka import (
    DeliveryFailed,
    KafkaError,
    LedgerReader,
    create_producer,
    ensure_topics,
)
from schemas import (
    ExecuteStep,
    Record,
    StepCommitted,
    StepIntentRecorded,
    StepOutcomeUnknown,
    canonical_json,
    derived_event_id,
    envelope_for,
    idempotency_key,
)
from schemas.settings import Settings
from schemas.wire import read_dead_letter, to_message
from tests.system import wait_until


class _Shop:
    def __init__(self) -> None:
        self.runs = 0

    @tool(description="Reserve stock", deadline=60.0)
    @compensable(by="release")
    def reserve(self, sku: str) -> dict[str, str]:
        self.runs += 1
        return {"sku": sku}

    def release(self) -> None:
        pass


def _execute(saga_id: str, step_id: str = "s1") -> ExecuteStep:
    body = canonical_json({"sku": "a"})
    return ExecuteStep(
        envelope=envelope_for(
            ExecuteStep,
            saga_id=saga_id,
            tenant_id="t",
            producer="coordinator",
            now=1,
            event_id=derived_event_id(saga_id, f"exec/{step_id}"),
        ),
        step_id=step_id,
        tool="reserve",
        args=body,
        idempotency_key=idempotency_key(saga_id, step_id, "reserve", body),
        attempt=1,
        deadline_ms=60_000,
        principal="agent",
    )


class _FullDiskOnForget(CommandJournal):
    """A journal whose first ``failures`` un-markings fail as on a full disk."""

    def __init__(self, path: Path, failures: int) -> None:
        super().__init__(path)
        self.failures = failures

    def mark_unstarted(self, command_id: str, intent: bytes) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise sqlite3.OperationalError("database or disk is full")
        super().mark_unstarted(command_id, intent)


def _refused(error: KafkaError | None = None) -> DeliveryFailed:
    return DeliveryFailed(
        "StepIntentRecorded not acknowledged: Local: Message timed out",
        topic="sagaline.events",
        error=error or KafkaError(KafkaError._MSG_TIMED_OUT),
    )


def test_a_refused_intent_whose_mark_the_journal_cannot_drop_yet_runs_once_later_handled_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The way of a command handled whole on a tool thread (after a ledger probe, or
    # with arguments by reference): the broker refuses its intent, and the journal
    # fails to replace the "started" mark twice. The refusal is what the caller sees
    # (it tries the command again), and the retry runs the tool: not an unknown
    # outcome for a tool that never ran.
    monkeypatch.setattr("participants.runtime._JOURNAL_AGAIN_S", 0.01)
    shop = _Shop()
    out: list[Record] = []
    refusing = [True]

    def begin_append(record: Record) -> Callable[[], None]:
        def acknowledged() -> None:
            if refusing[0] and isinstance(record, StepIntentRecorded):
                raise _refused()
            out.append(record)

        return acknowledged

    journal = _FullDiskOnForget(tmp_path / "journal.sqlite", failures=2)
    handler = CommandHandler(
        wrap(shop, name="shop"), "shop", journal, out.append, begin_append=begin_append
    )
    command = _execute("saga-1")
    with pytest.raises(DeliveryFailed):
        handler.handle(command, maybe_taken_elsewhere=False)
    assert shop.runs == 0
    seen = journal.get(command.event_id)  # un-marked once the journal wrote
    assert seen is not None and seen[0] == "unstarted"
    refusing[0] = False
    assert handler.handle(command, maybe_taken_elsewhere=False) == "done"
    handler.close()
    assert [type(r) for r in out] == [StepIntentRecorded, StepCommitted]
    assert shop.runs == 1
    assert not any(isinstance(r, StepOutcomeUnknown) for r in out)


def test_a_refused_intent_whose_mark_the_journal_cannot_drop_yet_waits_not_dead_lettered_R16(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop's way: the broker's delivery report refuses the intent (a timeout),
    # and the journal fails to replace the "started" mark (a full disk) twice. The
    # command waits for the journal, then is tried again and runs once: not
    # dead-lettered (its saga would stall with no outcome), not an unknown outcome.
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, settings.topics, ["shop"], 1)
    shop = _Shop()
    runtime = ParticipantRuntime(wrap(shop, name="shop"), settings, kafka_bootstrap)
    journal = runtime.journal
    failures = [2]
    mark_unstarted = journal.mark_unstarted

    def full_disk_twice(command_id: str, intent: bytes) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        mark_unstarted(command_id, intent)

    monkeypatch.setattr(journal, "mark_unstarted", full_disk_twice)
    send = runtime.send
    refused = [0]

    def refuse_the_first_intent(
        record: Record, on_delivered: Callable[[DeliveryFailed | None], None], encoded: Any
    ) -> None:
        if isinstance(record, StepIntentRecorded) and refused[0] == 0:
            refused[0] += 1
            on_delivered(_refused())
            return
        send(record, on_delivered, encoded)

    runtime.send = refuse_the_first_intent
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    saga_id = f"saga-{unique_prefix.strip('.')}"

    def records() -> list[Record]:
        return LedgerReader(kafka_bootstrap).saga_records(
            settings.topics.events, saga_id, settings.signer()
        )

    def dead_letters() -> list[tuple[str, str]]:
        letters = []
        for msg in LedgerReader(kafka_bootstrap).read(settings.topics.dlq):
            letter = read_dead_letter(msg.headers())
            letters.append((letter.reason, letter.detail))
        return letters

    try:
        assert ready.wait(60), "participant did not start"
        # sent once the partition is assigned: the loop's way
        wait_until(lambda: runtime._assigned_end, 60, "the command partition assigned")
        key, value, headers = to_message(_execute(saga_id), settings.signer())
        producer = create_producer(kafka_bootstrap)
        producer.produce(settings.topics.commands("shop"), key=key, value=value, headers=headers)
        assert producer.flush(30) == 0
        wait_until(
            lambda: (
                any(isinstance(r, (StepCommitted, StepOutcomeUnknown)) for r in records())
                or dead_letters()
            ),
            60,
            "the command's outcome or its dead letter",
        )
        assert dead_letters() == []
        assert refused[0] == 1 and failures[0] == 0
        assert [type(r) for r in records()] == [StepIntentRecorded, StepCommitted]
        assert shop.runs == 1
    finally:
        runtime.stop()
        thread.join(30)
