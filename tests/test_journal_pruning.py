"""The command journal is pruned: old finished entries go, nothing else does.

A journal entry is what makes a redelivered command answered instead of run again.
One may go only once its command can no longer be delivered to this participant:
``done`` (its outcome journalled), not under way here, and older than the command
topic keeps a record (retention.ms + segment.ms + a margin, read from the broker).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

import participants.runtime as runtime_module
from participants.runtime import (
    JOURNAL_KEEP_MARGIN_MS,
    CommandJournal,
    JournalPruning,
    ParticipantRuntime,
    journal_keep_ms,
)
from sagaline.kafka import create_admin, ensure_topics
from schemas import StepCommitted
from schemas.topics import TopicNames
from tests.system import wait_until
from tests.test_participant_runtime import PARTICIPANT, Harness, _of

DAY_MS = 24 * 60 * 60 * 1000
NOW = 1_800_000_000_000


def _journal(tmp_path: Path, rows: list[tuple[str, str, int]]) -> CommandJournal:
    journal = CommandJournal(tmp_path / "commands.sqlite")
    journal.write([(cid, state, b"cmd", b"out", at) for cid, state, at in rows])
    return journal


def _ids(journal: CommandJournal, ids: list[str]) -> set[str]:
    return {cid for cid in ids if journal.get(cid) is not None}


def test_old_done_entries_are_pruned_and_unfinished_running_or_recent_ones_kept(
    tmp_path: Path,
) -> None:
    old = NOW - 20 * DAY_MS
    journal = _journal(
        tmp_path,
        [
            ("old-done", "done", old),
            ("old-started", "started", old),  # may have acted: a redelivery is unknown
            ("old-accepted", "accepted", old),  # its confirmation resumes from it
            ("old-running", "done", old),  # its outcome not acknowledged yet: under way
            ("recent-done", "done", NOW - DAY_MS),
            ("old-done-2", "done", old + 1),
        ],
    )
    pruning = JournalPruning(journal, 15 * DAY_MS, clock=lambda: NOW)
    pruning.turn({"old-running"})
    everything = [
        "old-done",
        "old-started",
        "old-accepted",
        "old-running",
        "recent-done",
        "old-done-2",
    ]
    kept = {"old-started", "old-accepted", "old-running", "recent-done"}
    assert _ids(journal, everything) == kept
    assert pruning.dropped == 2
    # Once no longer under way (its outcome acknowledged), it goes too.
    wait_turns = [pruning.turn(set()) for _ in range(3)]
    assert _ids(journal, everything) == {"old-started", "old-accepted", "recent-done"}
    assert all(t > 0 for t in wait_turns)


def test_nothing_is_pruned_while_a_command_waits_to_be_tried_again(tmp_path: Path) -> None:
    journal = _journal(tmp_path, [("old-done", "done", NOW - 20 * DAY_MS)])
    pruning = JournalPruning(journal, 15 * DAY_MS, clock=lambda: NOW)
    pruning.turn(None)  # a retry is queued: its command id is not known until it starts
    assert journal.get("old-done") is not None


def test_a_large_journal_is_pruned_in_batches_up_to_its_young_entries(tmp_path: Path) -> None:
    old = NOW - 20 * DAY_MS
    batch = runtime_module._PRUNE_BATCH
    rows = [(f"c{i}", "done", old + i) for i in range(2 * batch + 10)]
    rows.insert(5, ("accepted-then-done", "accepted", old))
    rows.append(("young", "done", NOW))
    journal = _journal(tmp_path, rows)
    pruning = JournalPruning(journal, 15 * DAY_MS, clock=lambda: NOW)
    first = pruning.turn(set())
    assert pruning.dropped <= batch  # one small batch a turn
    assert first == runtime_module._PRUNE_BEHIND_S  # behind: the next turn comes soon
    # Confirmed meanwhile (behind the batches' position): looked at again later.
    journal.write([("accepted-then-done", "done", b"cmd", b"out", old)])
    turns = 0
    while journal.get("accepted-then-done") is not None or pruning.dropped < 2 * batch + 10:
        pruning.turn(set())
        turns += 1
        assert turns < 20, f"pruning does not progress: {pruning.dropped} dropped"
    assert pruning.dropped == 2 * batch + 11
    assert journal.get("young") is not None
    assert pruning.turn(set()) == runtime_module._PRUNE_EVERY_S  # caught up


def test_the_journal_keep_setting_is_auto_minus_one_or_milliseconds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import build_parser

    def keep(*extra: str) -> Any:
        return build_parser().parse_args(["participant", "run", "seats", *extra]).journal_keep_ms

    assert keep() is None  # auto: from the broker
    assert keep("--journal-keep-ms", "-1") == -1
    assert keep("--journal-keep-ms", "86400000") == DAY_MS
    monkeypatch.setenv("SAGALINE_JOURNAL_KEEP_MS", "AUTO")
    assert keep() is None
    for bad in ("0", "-2", "1d"):
        with pytest.raises(SystemExit):
            keep("--journal-keep-ms", bad)
    assert "--journal-keep-ms: expected 'auto', -1 or a number" in capsys.readouterr().err


# ------------------------------------------------ the horizon, from the real broker


def _topic(bootstrap: str, prefix: str, config: dict[str, str]) -> str:
    from confluent_kafka.admin import NewTopic

    name = TopicNames(prefix).commands(PARTICIPANT)
    admin = create_admin(bootstrap)  # kept while its answer is awaited
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=1, replication_factor=1, config=config)]
    )
    futures[name].result(30)
    return name


@pytest.mark.kafka
def test_the_horizon_is_the_command_topics_retention_plus_a_segment_and_a_margin(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [PARTICIPANT], 1)
    topic = names.commands(PARTICIPANT)
    with caplog.at_level(logging.INFO, logger="sagaline.participant"):
        keep = journal_keep_ms(kafka_bootstrap, topic, None)
    # commands keep 7 days (schemas.topics); segment.ms is the broker's 7-day default
    assert keep == 7 * DAY_MS + 7 * DAY_MS + JOURNAL_KEEP_MARGIN_MS
    assert sum("are pruned" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.kafka
@pytest.mark.parametrize(
    "config",
    [{"retention.ms": "-1"}, {"cleanup.policy": "compact"}],
    ids=["retention-infinite", "compacted"],
)
def test_a_command_topic_that_keeps_records_for_ever_is_never_pruned_and_says_so_once(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    config: dict[str, str],
) -> None:
    _topic(kafka_bootstrap, unique_prefix, config)
    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)
    journal = CommandJournal(tmp_path / PARTICIPANT / "commands.sqlite")
    journal.write([("years-old", "done", b"cmd", b"out", NOW - 3650 * DAY_MS)])
    journal.close()
    with caplog.at_level(logging.INFO, logger="sagaline.participant"):
        harness.start()
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
        assert harness.runtime is not None
        assert harness.runtime.pruning is None
        assert harness.runtime.journal.get("years-old") is not None
        harness.stop()
    said = [r.getMessage() for r in caplog.records if "never pruned" in r.getMessage()]
    assert len(said) == 1 and "keeps its records for ever" in said[0]


@pytest.mark.kafka
def test_an_unreadable_retention_prunes_nothing_and_an_explicit_setting_overrides_it(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    missing = TopicNames(unique_prefix).commands("nobody")  # DescribeConfigs fails on it
    with caplog.at_level(logging.INFO, logger="sagaline.participant"):
        assert journal_keep_ms(kafka_bootstrap, missing, None) is None
        assert journal_keep_ms(kafka_bootstrap, missing, 5 * DAY_MS) == 5 * DAY_MS
        assert journal_keep_ms(kafka_bootstrap, missing, -1) is None
    said = [r.getMessage() for r in caplog.records]
    assert sum("could not be read" in m for m in said) == 1
    assert sum("never pruned (journal keep -1)" in m for m in said) == 1


@pytest.mark.kafka
def test_a_keep_shorter_than_the_topic_keeps_commands_is_used_with_a_warning(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    names = TopicNames(unique_prefix)
    ensure_topics(kafka_bootstrap, names, [PARTICIPANT], 1)
    with caplog.at_level(logging.INFO, logger="sagaline.participant"):
        assert journal_keep_ms(kafka_bootstrap, names.commands(PARTICIPANT), DAY_MS) == DAY_MS
    assert any(
        r.levelno == logging.WARNING and "ledger probe alone" in r.getMessage()
        for r in caplog.records
    )


# ------------------------------------------------------------------ end to end


@pytest.mark.kafka
def test_a_running_participant_prunes_entries_older_than_its_command_topic_keeps_commands(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)  # the default settings
    journal = CommandJournal(tmp_path / PARTICIPANT / "commands.sqlite")
    journal.write(
        [
            ("last-year", "done", b"cmd", b"out", NOW - 365 * DAY_MS),
            ("last-year-started", "started", b"cmd", None, NOW - 365 * DAY_MS),
        ]
    )
    journal.close()
    harness.start()
    command = harness.execute("s1", {"sku": "a", "quantity": 1})
    harness.send(command)
    harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
    runtime = harness.runtime
    assert runtime is not None
    wait_until(lambda: runtime.journal.get("last-year") is None, what="the old entry pruned")
    assert runtime.journal.get("last-year-started") is not None
    assert runtime.journal.get(command.event_id) is not None
    harness.stop()


class _PruningHarness(Harness):
    def __init__(self, *args: Any, keep_ms: int | None) -> None:
        super().__init__(*args)
        self.keep_ms = keep_ms

    def start(self, producer: Any = None) -> None:
        self.runtime = ParticipantRuntime(
            self.catalogue,
            self.settings,
            self.bootstrap,
            participant=PARTICIPANT,
            journal_keep_ms=self.keep_ms,
        )
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self.runtime.run, kwargs={"ready": ready}, daemon=True
        )
        self.thread.start()
        assert ready.wait(60), "participant runtime did not start"


@pytest.mark.kafka
def test_with_pruning_each_command_runs_once_across_a_restart_even_once_its_entry_is_gone(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Entries go as soon as their command is finished here (a keep of 1 ms, far below
    # what the topic keeps), so the restart finds none of them: the redeliveries read
    # at start are answered by the ledger probe, never run again.
    monkeypatch.setattr(runtime_module, "_PRUNE_EVERY_S", 0.2)
    harness = _PruningHarness(kafka_bootstrap, unique_prefix, tmp_path, keep_ms=1)
    harness.start()
    commands = [harness.execute(f"s{i}", {"sku": f"k{i}", "quantity": 1}) for i in range(3)]
    for command in commands:
        harness.send(command)
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 3)
    runtime = harness.runtime
    assert runtime is not None and runtime.pruning is not None
    wait_until(
        lambda: all(runtime.journal.get(c.event_id) is None for c in commands),
        what="the finished commands' journal entries pruned",
    )
    harness.stop()
    for command in commands:
        harness.send(command)  # delivered again while the participant is down
    harness.start()
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 6)
    harness.stop()
    records = harness.records()
    assert harness.shop.count("reserve") == 3
    assert len({r.event_id for r in _of(records, StepCommitted)}) == 3


@pytest.mark.kafka
def test_with_the_default_pruning_each_command_runs_once_across_a_restart(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    harness = _PruningHarness(kafka_bootstrap, unique_prefix, tmp_path, keep_ms=None)
    harness.start()
    command = harness.execute("s1", {"sku": "a", "quantity": 2})
    harness.send(command)
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 1)
    assert harness.runtime is not None and harness.runtime.pruning is not None
    assert harness.runtime.pruning.keep_ms > 7 * DAY_MS
    harness.stop()
    harness.send(command)
    harness.start()
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 2)
    harness.send(command)  # after the restart's assignment: the journal answers it
    harness.wait_for(lambda rs: len(_of(rs, StepCommitted)) >= 3)
    harness.stop()
    assert harness.shop.count("reserve") == 1


def test_the_documented_participant_acls_let_its_ledger_probe_read_the_ledger() -> None:
    """The journal's second line of defence, the ledger probe (and arguments passed by
    reference), reads ``sagaline.events``: a participant granted only what
    docs/security.md lists must be able to, or every command written while it was
    down (a journal miss, probed) is retried for ever."""
    text = (Path(__file__).parent.parent / "docs" / "security.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `User:<participant>`"))
    reads = row.split("|")[2]
    assert "`sagaline.events`" in reads, row
    example = text.split("For example, for the payments participant:", 1)[1].split("```")[1]
    grants = example.split("kafka-acls.sh")[1:]
    assert any("--operation Read" in g and "--topic sagaline.events" in g for g in grants), example
