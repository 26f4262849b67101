"""The participant runtime's key-ordered work queue, without a broker (a fast tier
beside the real-broker test in ``test_participant_concurrency``).

Workers are woken only when idle and the loop only when it waits, so these check
that nothing is lost by waking less: every message runs, one key's in offset order
and never two at once, offsets become committable only below the lowest unfinished
message, and a waiting loop is woken once there is room; a message whose outcome
is still on its way to the broker finishes (and lets its key go on) only when the
delivery report comes, while its worker takes other keys meanwhile. The journal's group commit
wakes each caller once, so the same is checked of it: every mark is written, the
marks that queue behind a write go in one transaction, and a failed write fails
exactly the callers whose marks it held.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

import pytest

from participants.runtime import CommandJournal, _here, _KeyOrderedWork, _Watchdog
from sagaline.kafka import DeliveryFailed, Message
from tests.system import wait_until


class _Msg:
    def __init__(self, key: bytes, partition: int, offset: int) -> None:
        self._key, self._partition, self._offset = key, partition, offset

    def key(self) -> bytes:
        return self._key

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


def _msg(key: bytes, partition: int, offset: int) -> Message:
    return cast(Message, _Msg(key, partition, offset))


def test_each_key_runs_in_offset_order_never_two_at_once_and_all_commit() -> None:
    lock = threading.Lock()
    running: set[bytes] = set()
    overlaps: list[bytes] = []
    ran: dict[bytes, list[int]] = defaultdict(list)

    def process(msg: Any) -> bool:
        with lock:
            if msg.key() in running:
                overlaps.append(msg.key())
            running.add(msg.key())
        with lock:
            ran[msg.key()].append(msg.offset())
            running.discard(msg.key())
        return True

    work = _KeyOrderedWork(process, 4, "t")
    submitted: dict[bytes, list[int]] = defaultdict(list)
    next_offset = {0: 0, 1: 0}
    for i in range(400):
        key = f"saga-{i % 13}".encode()
        partition = (i % 13) % 2  # a key lives on one partition, as Kafka keys do
        offset = next_offset[partition]
        next_offset[partition] += 1
        submitted[key].append(offset)
        work.submit(_msg(key, partition, offset))
    work.wait_idle({0, 1})
    assert work.pending == 0
    assert overlaps == []
    assert dict(ran) == dict(submitted)
    assert work.committable() == {0: next_offset[0], 1: next_offset[1]}
    assert work.committable() == {}  # nothing moved since
    work.close()


def test_offsets_commit_only_below_the_lowest_unfinished_and_a_waiting_loop_wakes() -> None:
    gate = threading.Event()
    started = threading.Event()

    def process(msg: Any) -> bool:
        if msg.offset() == 3:
            started.set()
            gate.wait()
        return True

    work = _KeyOrderedWork(process, 4, "t")
    for offset in range(10):
        work.submit(_msg(f"saga-{offset}".encode(), 0, offset))
    assert started.wait(60)
    work.wait_below(2, 60)  # all but the held one finish and wake this waiter
    assert work.pending == 1
    assert work.committable() == {0: 3}
    gate.set()
    work.wait_below(1, 60)
    assert work.pending == 0
    assert work.committable() == {0: 10}
    work.close()


def test_close_lets_the_running_message_finish_and_drops_the_queued() -> None:
    gate = threading.Event()
    started = threading.Event()
    ran: list[int] = []

    def process(msg: Any) -> bool:
        started.set()
        gate.wait()
        ran.append(msg.offset())
        return True

    work = _KeyOrderedWork(process, 1, "t")
    for offset in range(3):
        work.submit(_msg(b"one-saga", 0, offset))
    assert started.wait(60)
    closer = threading.Thread(target=work.close)
    closer.start()
    assert work._closing.wait(60)
    gate.set()
    closer.join()
    assert ran == [0]  # the queued two are left for redelivery
    assert work.committable() == {0: 1}


def test_journal_marks_queued_behind_a_write_go_in_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = CommandJournal(tmp_path / "j.sqlite")
    write = journal._write
    writing = threading.Event()
    gate = threading.Event()
    transactions: list[list[str]] = []

    def held_write(rows: list[Any]) -> None:
        transactions.append([r[0] for r in rows])
        if len(transactions) == 1:
            writing.set()
            gate.wait()
        write(rows)

    monkeypatch.setattr(journal, "_write", held_write)
    first = threading.Thread(target=journal.mark, args=("c0", "started"))
    first.start()
    assert writing.wait(60)
    rest = [threading.Thread(target=journal.mark, args=(f"c{i}", "done")) for i in (1, 2, 3)]
    for thread in rest:
        thread.start()
    wait_until(lambda: len(journal._queued) == 3, what="three marks queued behind the write")
    gate.set()
    for thread in [first, *rest]:
        thread.join()
    assert [sorted(t) for t in transactions] == [["c0"], ["c1", "c2", "c3"]]
    assert [journal.get(f"c{i}") for i in range(4)] == [
        ("started", None),
        ("done", None),
        ("done", None),
        ("done", None),
    ]
    journal.close()


def test_a_failed_journal_write_fails_its_callers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = CommandJournal(tmp_path / "j.sqlite")
    write = journal._write

    def broken_write(rows: list[Any]) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(journal, "_write", broken_write)
    with pytest.raises(RuntimeError, match="journal write failed: disk full"):
        journal.mark("c0", "started")
    monkeypatch.setattr(journal, "_write", write)
    errors: list[BaseException] = []

    def mark(i: int) -> None:
        try:
            journal.mark(f"c{i}", "started")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=mark, args=(i,)) for i in range(1, 33)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert journal.get("c0") is None
    assert all(journal.get(f"c{i}") == ("started", None) for i in range(1, 33))
    journal.close()


def test_a_deferred_outcome_holds_its_key_until_delivered_while_the_worker_moves_on() -> None:
    got = threading.Condition()
    ran: list[tuple[bytes, int]] = []
    reports: list[Any] = []  # each run's delivery report callback, in run order

    def process(msg: Any) -> bool:
        lane = _here.lane
        with got:
            ran.append((msg.key(), msg.offset()))
            reports.append(lane.delivered)
            got.notify_all()
        lane.deferred = True  # as ParticipantRuntime._publish_outcome does
        return True

    def runs(n: int) -> list[tuple[bytes, int]]:
        with got:
            assert got.wait_for(lambda: len(ran) >= n, 60), ran
            return list(ran)

    work = _KeyOrderedWork(process, 1, "t")  # one worker: it must not wait for reports
    for key, offset in ((b"a", 0), (b"a", 1), (b"b", 2)):
        work.submit(_msg(key, 0, offset))
    assert runs(2) == [(b"a", 0), (b"b", 2)]  # a@1 waits for a@0's outcome
    assert work.committable() == {}
    reports[0](DeliveryFailed("broker said no", topic="t", error=None))
    assert runs(3)[2] == (b"a", 0)  # sent again before its saga's next command
    reports[2](None)
    assert runs(4)[3] == (b"a", 1)
    assert work.committable() == {0: 1}
    reports[3](None)
    reports[1](None)
    work.wait_idle({0})
    assert work.pending == 0
    assert work.committable() == {0: 3}
    work.close()


def test_the_watchdog_takes_over_only_calls_past_their_deadline_and_forgets_finished_ones() -> None:
    watchdog = _Watchdog("t-deadlines")
    overran = threading.Event()
    wrongly: list[str] = []
    in_time = watchdog.watch(3600, lambda: wrongly.append("in time"))
    late = watchdog.watch(0.01, overran.set)
    assert overran.wait(60)
    assert late.finish() is False  # the late call's answer does not count
    assert in_time.finish() is True
    # A call still running with the earliest deadline, and many finished behind it
    # with later ones: those are swept, not kept until they reach the top.
    running = watchdog.watch(3000, lambda: wrongly.append("running"))
    for _ in range(5000):
        watchdog.watch(3600, lambda: wrongly.append("finished")).finish()
    assert len(watchdog._heap) <= 600
    assert running.finish() is True
    watchdog.close()
    assert wrongly == []
