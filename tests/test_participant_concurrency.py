"""Key-ordered concurrency in the participant runtime, on the real broker.

One participant process (``sagaline participant run``, 8 commands in flight) gets
the commands of many sagas at once. Commands of different sagas run concurrently;
the commands of one saga run in their offset order and never two at once. The
process is killed with SIGKILL mid-run and restarted: no command runs twice, none is
lost (every command gets its outcome on the ledger), R10/R11/R15.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas import (
    ExecuteStep,
    Record,
    StepCommitted,
    StepOutcomeUnknown,
    canonical_json,
    derived_event_id,
    envelope_for,
    idempotency_key,
)
from schemas.settings import Settings
from schemas.wire import from_message, to_message
from services.demo_processes import wait_until
from tests.concurrency_tools import DB_VAR, PARTICIPANT, open_calls

pytestmark = pytest.mark.kafka

SAGAS = 30
STEPS = 4
REPO = Path(__file__).resolve().parent.parent


def _command(saga_id: str, seq: int) -> ExecuteStep:
    body = canonical_json({"saga": saga_id, "seq": seq})
    step = f"s{seq}"
    return ExecuteStep(
        envelope=envelope_for(
            ExecuteStep,
            saga_id=saga_id,
            tenant_id="t",
            producer="coordinator",
            now=int(time.time() * 1000),
            event_id=derived_event_id(saga_id, f"exec/{step}"),
        ),
        step_id=step,
        tool="work",
        args=body,
        idempotency_key=idempotency_key(saga_id, step, "work", body),
        attempt=1,
        deadline_ms=30_000,
        principal="agent",
    )


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "participant",
            "run",
            PARTICIPANT,
            "--catalogue",
            "tests.concurrency_tools:catalogue",
            "--max-in-flight",
            "8",
        ],
        cwd=str(REPO),
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _outcomes(bootstrap: str, settings: Settings) -> dict[str, Record]:
    """Outcome records on the ledger, by the event id of the command they answer."""
    out: dict[str, Record] = {}
    for key, value, headers in LedgerReader(bootstrap).records(settings.topics.events):
        record = from_message(key, value, headers, settings.signer())
        if isinstance(record, (StepCommitted, StepOutcomeUnknown)):
            out[record.envelope.causation_id or ""] = record
    return out


def test_sagas_run_concurrently_each_in_order_and_exactly_once_across_kill9(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=3, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, settings.topics, [PARTICIPANT], settings.partitions)
    calls_path = tmp_path / "calls.sqlite"
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        SAGALINE_TOPIC_PREFIX=unique_prefix,
        SAGALINE_PARTITIONS="3",
        SAGALINE_STATE_DIR=str(tmp_path / "state"),
        PYTHONUNBUFFERED="1",
        **{DB_VAR: str(calls_path)},
    )
    calls = open_calls(calls_path)

    # Every command is on the topic before the participant starts: it takes many at once.
    commands = [_command(f"saga-{n:03d}", seq) for seq in range(1, STEPS + 1) for n in range(SAGAS)]
    producer = create_producer(kafka_bootstrap)
    for cmd in commands:
        key, value, headers = to_message(cmd, settings.signer())
        producer.produce(
            settings.topics.commands(PARTICIPANT), key=key, value=value, headers=headers
        )
    assert producer.flush(30) == 0

    log = tmp_path / "participant.log"
    process = _start(env, log)
    third = len(commands) // 3
    reached = wait_until(
        lambda: calls.execute("SELECT COUNT(*) FROM calls").fetchone()[0] >= third, 120, 0.01
    )
    assert reached, f"the participant ran fewer than {third} commands; log: {log.read_text()}"
    process.send_signal(signal.SIGKILL)  # a crash: nothing flushed, nothing committed
    process.wait()
    killed_pid = process.pid

    process = _start(env, log)
    try:
        wanted = {cmd.event_id for cmd in commands}
        assert wait_until(lambda: wanted <= set(_outcomes(kafka_bootstrap, settings)), 180, 0.5), (
            f"commands without an outcome after the restart; log: {log.read_text()}"
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)

    outcomes = _outcomes(kafka_bootstrap, settings)
    rows = calls.execute("SELECT key, saga_id, seq, pid, start_ns, end_ns FROM calls").fetchall()
    runs: dict[str, int] = defaultdict(int)
    for key, *_ in rows:
        runs[key] += 1
    # Never run twice (R15), across the crash too.
    assert max(runs.values()) == 1, [k for k, n in runs.items() if n > 1]
    # Never lost: every command has its outcome; a committed one ran exactly once, and
    # one the crash interrupted is reported unknown (R11), never silently re-run.
    for cmd in commands:
        outcome = outcomes[cmd.event_id]
        if isinstance(outcome, StepCommitted):
            assert runs[cmd.idempotency_key] == 1, cmd.event_id
        else:
            assert runs[cmd.idempotency_key] <= 1, cmd.event_id
    assert any(pid == killed_pid for *_, pid, _s, _e in rows), "the kill came after all the work"
    assert any(pid != killed_pid for *_, pid, _s, _e in rows), "the kill came after all the work"

    # Per saga: in offset (= seq) order, never two at once.
    by_saga: dict[str, list[tuple[int, int, int | None]]] = defaultdict(list)
    for _key, saga_id, seq, _pid, start, end in rows:
        by_saga[saga_id].append((start, seq, end))
    for saga_id, saga_calls in by_saga.items():
        saga_calls.sort()
        assert [seq for _s, seq, _e in saga_calls] == sorted(seq for _s, seq, _e in saga_calls), (
            saga_id
        )
        for (_s1, _q1, end1), (start2, _q2, _e2) in itertools.pairwise(saga_calls):
            if end1 is not None:  # None: killed mid-call, the next ran after the restart
                assert end1 <= start2, f"{saga_id}: two commands at once"

    # And different sagas did run at the same time (concurrency > 1 was used).
    finished = sorted((s, e) for *_, s, e in rows if e is not None)
    overlapping = any(b[0] < a[1] for a, b in itertools.pairwise(finished))
    assert overlapping, "no two commands ever ran at once: the runtime is serial"
