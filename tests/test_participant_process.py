"""``sagaline participant run`` as a process: how it stops on signals.

The participant runs as a real subprocess against the broker, serving a catalogue
from the working directory whose tool hangs (as a provider that stopped answering
does). Each call leaves a file behind, so what the tool did is counted outside the
process.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sagaline.kafka import LedgerReader, create_producer, ensure_topics
from schemas import (
    ExecuteStep,
    Record,
    StepIntentRecorded,
    StepOutcomeUnknown,
    canonical_json,
    derived_event_id,
    envelope_for,
    idempotency_key,
)
from schemas.settings import Settings
from schemas.wire import to_message
from tests.system import wait_until

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[1]
PARTICIPANT = "hangs"

TOOLS = textwrap.dedent(
    """
    import os, threading, uuid
    from pathlib import Path
    from sagaline import compensable, tool, wrap

    CALLS = Path(os.environ["TEST_CALLS_DIR"])

    def release(reservation: str) -> None:
        pass

    @tool(description="never answers", deadline=3600.0)
    @compensable(by=release, args=lambda ctx: {"reservation": ctx.result})
    def reserve(sku: str) -> str:
        (CALLS / uuid.uuid4().hex).write_text(sku)
        threading.Event().wait()  # a provider that stopped answering
        return "never"

    def make_catalogue():
        return wrap(reserve, name="hangs")
    """
)


class Served:
    """One ``participant run`` subprocess, its output read line by line."""

    def __init__(self, cwd: Path, env: dict[str, str], *args: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "participant",
                "run",
                PARTICIPANT,
                "--catalogue",
                "tools_that_hang:make_catalogue",
                *args,
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line with {text!r} in {timeout_s} s:\n{''.join(self.seen)}")
            if line is None:
                pytest.fail(f"exited {self.process.wait()} before {text!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            if text in line:
                return line

    def output(self) -> str:
        """Everything it wrote, once it exited (killed if it had not)."""
        self.kill()
        while (line := self.lines.get(timeout=30)) is not None:
            self.seen.append(line)
        return "".join(self.seen)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


@pytest.fixture
def setup(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> Iterator[tuple[Settings, dict[str, str], Path, list[Served]]]:
    (tmp_path / "tools_that_hang.py").write_text(TOOLS)
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SAGALINE_TOPIC_PREFIX": unique_prefix,
        "SAGALINE_PARTITIONS": "1",
        "SAGALINE_STATE_DIR": str(tmp_path / "state"),
        "TEST_CALLS_DIR": str(calls),
        "PYTHONPATH": str(ROOT),
    }
    settings = Settings(
        bootstrap=kafka_bootstrap,
        topic_prefix=unique_prefix,
        partitions=1,
        state_dir=tmp_path / "state",
    )
    ensure_topics(kafka_bootstrap, settings.topics, [PARTICIPANT], 1)
    started: list[Served] = []
    yield settings, env, tmp_path, started
    for served in started:
        served.kill()


def _execute(settings: Settings, saga_id: str, step_id: str) -> ExecuteStep:
    body = canonical_json({"sku": step_id})
    return ExecuteStep(
        envelope=envelope_for(
            ExecuteStep,
            saga_id=saga_id,
            tenant_id="t",
            producer="coordinator",
            now=int(time.time() * 1000),
            event_id=derived_event_id(saga_id, f"exec/{step_id}"),
        ),
        step_id=step_id,
        tool="reserve",
        args=body,
        idempotency_key=idempotency_key(saga_id, step_id, "reserve", body),
        attempt=1,
        deadline_ms=3_600_000,
        principal="agent",
    )


def _send(settings: Settings, command: Record) -> None:
    producer = create_producer(settings.bootstrap)
    key, value, headers = to_message(command, settings.signer())
    producer.produce(settings.topics.commands(PARTICIPANT), key=key, value=value, headers=headers)
    assert producer.flush(30) == 0


def _records(settings: Settings, saga_id: str) -> list[Record]:
    return LedgerReader(settings.bootstrap).saga_records(
        settings.topics.events, saga_id, settings.signer()
    )


def test_a_second_sigterm_stops_at_once_and_the_restart_runs_nothing_twice(
    setup: tuple[Settings, dict[str, str], Path, list[Served]],
) -> None:
    """The first SIGTERM waits for the running tool (up to its deadline: an hour
    here); a second one stops now, exit 0, the command left uncommitted. The next run
    gets it again and answers it as an unknown outcome (its journal's "started" mark,
    R11), without calling the tool a second time."""
    settings, env, cwd, started = setup
    saga_id = f"saga-{settings.topic_prefix.strip('.')}"
    calls = cwd / "calls"
    served = Served(cwd, env)
    started.append(served)
    served.wait_for_line(f"participant {PARTICIPANT} serving")
    _send(settings, _execute(settings, saga_id, "s1"))
    wait_until(lambda: len(list(calls.iterdir())) == 1, what="the tool to be called")

    served.process.send_signal(signal.SIGTERM)
    served.wait_for_line("signal")  # the first one is taken: it waits for the tool
    served.process.send_signal(signal.SIGTERM)
    try:
        code = served.process.wait(90)  # the tool's deadline is an hour away
    except subprocess.TimeoutExpired:
        pytest.fail(f"a second SIGTERM did not stop the participant:\n{served.output()}")
    assert code == 0

    again = Served(cwd, env)
    started.append(again)
    again.wait_for_line(f"participant {PARTICIPANT} serving")
    records = wait_until(
        lambda: [r for r in _records(settings, saga_id) if isinstance(r, StepOutcomeUnknown)],
        what="the redelivered command answered as an unknown outcome",
    )
    assert [r.step_id for r in records] == ["s1"]
    assert len([r for r in _records(settings, saga_id) if isinstance(r, StepIntentRecorded)]) == 1
    assert len(list(calls.iterdir())) == 1, "the tool ran again after the restart"
    again.process.send_signal(signal.SIGTERM)
    assert again.process.wait(90) == 0


def test_topics_of_another_partition_count_stop_it_with_one_line_and_exit_2(
    setup: tuple[Settings, dict[str, str], Path, list[Served]],
) -> None:
    """A setting that does not match the topics (SAGALINE_PARTITIONS here) is a
    usage error, as for ``coordinator run``: one line naming it, exit 2."""
    _settings, env, cwd, _started = setup
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "participant",
            "run",
            PARTICIPANT,
            "--catalogue",
            "tools_that_hang:make_catalogue",
        ],
        cwd=cwd,
        env={**env, "SAGALINE_PARTITIONS": "2"},  # the topics have 1
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sagaline participant run {PARTICIPANT}: topic ")
    assert "set SAGALINE_PARTITIONS=1" in last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthz(port: int) -> tuple[int, str] | None:
    """(status, body) of /healthz; None while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError:
        return None


def test_healthz_says_ok_only_while_the_participant_serves(
    setup: tuple[Settings, dict[str, str], Path, list[Served]],
) -> None:
    """/healthz (the compose healthcheck's probe) answers 200 once the loop serves its
    command topic, and 503 once it is stopping (here waiting for a hung tool), where
    /metrics answers 200 all along."""
    settings, env, cwd, started = setup
    saga_id = f"saga-{settings.topic_prefix.strip('.')}"
    port = _free_port()
    served = Served(cwd, env, "--metrics-port", str(port))
    started.append(served)
    served.wait_for_line(f"participant {PARTICIPANT} serving")
    assert _healthz(port) == (200, "ok\n")
    _send(settings, _execute(settings, saga_id, "s1"))
    wait_until(lambda: len(list((cwd / "calls").iterdir())) == 1, what="the tool to be called")
    served.process.send_signal(signal.SIGTERM)
    served.wait_for_line("signal")  # stopping: it waits for the hung tool
    answer = _healthz(port)
    assert answer is not None and answer[0] == 503 and "stopping" in answer[1], answer
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as metrics:
        assert metrics.status == 200
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(90) == 0
