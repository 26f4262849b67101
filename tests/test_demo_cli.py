"""``sagaline demo`` as a person runs it, when something around it is wrong: it ends
with one clear line and exit 1, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.topics import MAX_PARTITIONS
from services.cli import build_parser
from tests.test_demo_fault_gate import _demo

ROOT = Path(__file__).resolve().parents[1]
DEMO = [sys.executable, "-m", "services.cli", "demo"]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_the_demo_against_a_broker_that_does_not_answer_says_so_without_a_traceback(
    tmp_path: Path,
) -> None:
    bootstrap, state = f"127.0.0.1:{_closed_port()}", tmp_path / "state"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*DEMO, "--sagas", "1", "--no-ui", "--dashboard-port", "0", "--state-dir", str(state)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    assert done.returncode == 1, output
    assert f"sagaline demo: Kafka at {bootstrap}" in done.stdout, output


def test_agent_run_before_the_topics_exist_says_so_without_a_traceback(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """``sagaline agent run`` against a system not started yet (compose's agent up
    before the coordinator created ``sagaline.events``): one line naming the topic."""
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SAGALINE_TOPIC_PREFIX": unique_prefix,
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "agent", "run", "--sagas", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    assert f"sagaline agent run: topic '{unique_prefix}sagaline.events'" in done.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--sagas", "0"],
        ["--sagas", "-3"],
        ["--concurrency", "0"],
        ["--kill-service", "inventory", "--kill-after", "0"],
        ["--kill-coordinator-after", "-1"],
    ],
)
def test_demo_flags_that_would_run_nothing_or_kill_nothing_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sagas 0`` ran the whole system and printed "demo OK" for no saga at all;
    ``--kill-after 0`` killed nothing although the run was asked for a kill."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["demo", *flags])
    assert exited.value.code == 2
    assert "expected a whole number >=" in capsys.readouterr().err


@pytest.mark.parametrize("partitions", ["0", "100001", "3000000000", "many"])
def test_demo_partitions_past_what_a_topic_can_have_are_a_usage_error(
    partitions: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--partitions 3000000000`` ran into the topic creation and ended the demo in a
    traceback (OverflowError, or librdkafka's ValueError over 100000), where
    SAGALINE_PARTITIONS is refused at start with the same bound."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["demo", "--partitions", partitions])
    assert exited.value.code == 2
    assert f"expected a whole number between 1 and {MAX_PARTITIONS}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["demo", "--call-timeout", "0"],
        ["demo", "--timeout", "-5"],
        ["demo", "--call-timeout", "nan"],
        ["agent", "run", "--call-timeout", "inf"],
        ["saga", "wait", "saga-1", "--timeout", "-1"],
    ],
)
def test_durations_that_are_no_positive_number_of_seconds_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--call-timeout 0`` reached the saga client, which refuses it with a
    ValueError: a traceback instead of a usage error."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(flags)
    assert exited.value.code == 2
    assert "expected seconds (a number >" in capsys.readouterr().err


def test_an_interrupted_demo_with_keep_does_not_claim_it_stopped_everything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --keep the services are left running on Ctrl-C (as asked); the last line
    said every process had been stopped."""
    import services.demo as demo

    def interrupted(_options: demo.DemoOptions) -> demo.DemoRun:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    args = build_parser().parse_args(["demo", "--keep", "--no-ui"])
    assert args.func(args) == 130
    err = capsys.readouterr().err
    assert "has been stopped" not in err, err
    assert "--keep" in err, err


def test_agent_run_without_a_configured_broker_exits_2_and_starts_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sagaline agent run`` runs against a system already running (compose's agent
    service). With KAFKA_BOOTSTRAP_SERVERS unset it started the local JVM broker (a
    2 GB heap, left running), where no coordinator could be, then failed on the missing
    topic; like every other service command it now says what to set, exit 2."""
    import services.broker
    from services.cli import main

    def no_broker_may_start() -> object:
        pytest.fail("sagaline agent run chose (and would start) the local broker")

    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setattr(services.broker, "choose_broker", no_broker_may_start)
    assert main(["agent", "run", "--sagas", "1"]) == 2
    err = capsys.readouterr().err
    assert "sagaline agent run: no Kafka broker configured" in err, err
    assert "--dev-broker" in err, err


@pytest.mark.parametrize(
    "shell",
    [
        {"SAGALINE_HMAC_KEY": "the-teams-own", "SAGALINE_HMAC_KEY_ID": "k2"},
        {"SAGALINE_TRUST_FILE": "/etc/sagaline/trust.json"},
        {"SAGALINE_TRUST_FILE": "/t.json", "SAGALINE_SIGNING_KEY": "/k.pem"},
        {"SAGALINE_SECRET_KEY": "s", "SAGALINE_SECRET_KEY_ID": "s2"},
    ],
)
def test_the_demos_services_sign_and_seal_as_its_own_agent_whatever_the_shell_exports(
    shell: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo set its own SAGALINE_HMAC_KEY for the processes it starts, but they
    inherited the rest of the shell's signing settings, while its agent, operator and
    progress reader (in the demo's process) sign with the demo key alone. With a key
    id of the team's own exported (or a trust file) every agent record was refused:
    "progress: 0/5 terminal" until --timeout, then "demo FAILED"."""
    from schemas.settings import Settings
    from services import demo

    for var, value in shell.items():
        monkeypatch.setenv(var, value)
    run = _demo(tmp_path)
    service = Settings.from_env(demo._service_env(run, tmp_path / "faults.json"))
    agent = Settings(hmac_key=demo.DEMO_HMAC_KEY.encode())
    assert (service.hmac_key, service.hmac_key_id) == (agent.hmac_key, agent.hmac_key_id)
    assert (service.trust_file, service.signing_key) == (None, None)
    assert (service.secret_key, service.secret_key_id) == (agent.secret_key, agent.secret_key_id)
    record = b'{"saga": 1}'
    service.signer().verify(b"s-1", record, agent.signer().headers(b"s-1", record))


def test_demo_and_agent_run_leave_the_signal_handlers_as_they_found_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands turn SIGINT/SIGTERM into KeyboardInterrupt while they run (so their
    ``finally`` blocks stop what they started). Called in-process (a test, an embedding
    program), they left those handlers installed for the rest of the process's life:
    a later SIGTERM raised KeyboardInterrupt wherever that process happened to be."""
    import signal

    import services.broker
    import services.demo as demo
    from services.cli import main

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(demo, "run_demo", lambda _options: type("R", (), {"exit_code": 0})())
    assert main(["demo", "--sagas", "1", "--no-ui", "--dashboard-port", "0"]) == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setattr(services.broker, "choose_broker", lambda: pytest.fail("no broker"))
    assert main(["agent", "run", "--sagas", "1"]) == 2
    capsys.readouterr()
    assert {sig: signal.getsignal(sig) for sig in before} == before
