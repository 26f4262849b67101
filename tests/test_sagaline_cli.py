"""The newcomer's commands: ``--version``/``--help`` on core dependencies only, one way
to name a catalogue (working directory, factories), ``status`` and ``saga wait``."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sagaline
from services.cli import main

# Makes every optional extra unimportable, as on a machine with `pip install sagaline`.
_CORE_ONLY = textwrap.dedent(
    """
    import sys
    class _NoExtras:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"mcp", "agents", "langchain_core", "langgraph",
                                      "pydantic_ai", "yaml", "openai"}:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoExtras())
    from services.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)

TOOLS_MODULE = textwrap.dedent(
    '''
    from sagaline import compensable, wrap

    def release(reservation_id: str) -> None:
        pass

    @compensable(by=release, args=lambda ctx: {"reservation_id": ctx.result})
    def reserve(flight: str) -> str:
        """Reserve a seat."""
        return "r-" + flight

    def make_catalogue():
        return wrap(reserve, name="seats")
    '''
)


def _core_only(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CORE_ONLY, *args], capture_output=True, text=True, timeout=120
    )


def test_version_and_help_work_with_only_the_core_dependencies() -> None:
    version = _core_only("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"sagaline {sagaline.__version__}"
    helped = _core_only("--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("status", "mcp", "saga", "participant", "catalogue"):
        assert command in helped.stdout
    proxy = _core_only("mcp", "proxy", "nothing.yaml")
    assert proxy.returncode == 2
    assert "pip install 'sagaline[mcp]'" in proxy.stderr


def test_catalogue_check_reads_a_factory_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "seat_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.chdir(tmp_path)
    assert main(["catalogue", "check", "seat_tools:make_catalogue"]) == 0
    out = capsys.readouterr().out
    assert "participant seats: 1 tool(s), all declarations valid" in out
    assert "release" in out


@pytest.mark.kafka
def test_participant_run_status_and_saga_wait(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "seat_tools.py").write_text(TOOLS_MODULE)
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SAGALINE_TOPIC_PREFIX": unique_prefix,
        "SAGALINE_PARTITIONS": "1",
        "SAGALINE_STATE_DIR": str(tmp_path / "state"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    # Nothing runs yet: status says so and exits 1.
    assert main(["status", "--participant", "seats"]) == 1
    assert re.search(r"coordinator +NOT consuming", capsys.readouterr().out)

    served = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "participant",
            "run",
            "seats",
            "--catalogue",
            "seat_tools:make_catalogue",
        ],
        cwd=tmp_path,
        env={**os.environ, **env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert served.stdout is not None
        for line in served.stdout:  # its log says when it serves
            if "participant seats serving" in line:
                break
        else:
            pytest.fail(f"participant run exited {served.wait()}")
        with sagaline.connect(coordinator=True) as client:
            with client.saga("trip", principal="me") as saga:
                assert saga.call("reserve", flight="LX1") == "r-LX1"
            assert main(["status"]) == 0
            status = capsys.readouterr().out
            assert re.search(r"coordinator +consuming", status)
            assert re.search(r"participant seats +consuming", status)
            assert main(["saga", "wait", saga.saga_id, "--timeout", "120"]) == 0
            assert "COMPLETED" in capsys.readouterr().out
    finally:
        served.send_signal(signal.SIGTERM)
        served.wait(60)
    assert main(["saga", "wait", "saga-that-never-was", "--timeout", "0"]) == 124
    assert "is not terminal after 0 s (no records at all)" in capsys.readouterr().err


def test_coordinator_run_takes_the_decoded_state_cache_size_from_a_flag_or_the_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import build_parser

    monkeypatch.delenv("SAGALINE_DECODED_STATES", raising=False)
    assert build_parser().parse_args(["coordinator", "run"]).decoded_states is None
    args = build_parser().parse_args(["coordinator", "run", "--decoded-states", "4096"])
    assert args.decoded_states == 4096
    monkeypatch.setenv("SAGALINE_DECODED_STATES", "0")
    assert build_parser().parse_args(["coordinator", "run"]).decoded_states == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator", "run", "--decoded-states", "-1"])
    assert "expected a whole number >= 0, got -1" in capsys.readouterr().err
    monkeypatch.setenv("SAGALINE_DECODED_STATES", "-5")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator", "run"])
    assert "got -5 from $SAGALINE_DECODED_STATES" in capsys.readouterr().err


def test_a_bad_journal_keep_ms_in_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import build_parser

    monkeypatch.setenv("SAGALINE_JOURNAL_KEEP_MS", "soon")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["participant", "run", "seats"])
    assert "got 'soon' from $SAGALINE_JOURNAL_KEEP_MS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["participant", "run", "seats", "--journal-keep-ms", "soon"])
    err = capsys.readouterr().err
    assert "got 'soon'" in err and "$SAGALINE_JOURNAL_KEEP_MS" not in err


def _broker_answers_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker answers the one-shot commands' first check (no broker at all is
    test_operator_cli's case) and fails after it: the command's own failure path."""
    from sagaline.kafka import _clients

    monkeypatch.setattr(_clients, "require_broker_answers", lambda *_a, **_kw: None)


def test_status_says_in_one_line_when_the_broker_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Documented: exit 2 when the broker does not answer (not a traceback, exit 1)."""
    from sagaline.kafka import KafkaError, KafkaException, LedgerReader

    def unreachable(self: LedgerReader, topic: str, partitions: object = None) -> object:
        raise KafkaException(
            KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: Broker transport failure")
        )

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    _broker_answers_the_check(monkeypatch)
    monkeypatch.setattr(LedgerReader, "records", unreachable)
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sagaline status: ") and err.count("\n") == 1
    assert "Broker transport failure" in err


def test_a_bad_max_in_flight_is_a_usage_error_of_participant_run_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong SAGALINE_MAX_IN_FLIGHT in the shared environment must not break every
    other command (status, approve, ...) with a traceback, and 0 is refused up front."""
    from services.cli import build_parser

    monkeypatch.setenv("SAGALINE_MAX_IN_FLIGHT", "abc")
    parser = build_parser()
    assert parser.parse_args(["status"]).command == "status"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["participant", "run", "seats"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    # The value came from the environment, not the flag: the message says where to fix it.
    assert (
        "--max-in-flight: expected a whole number between 1 and 1000000, "
        "got 'abc' from $SAGALINE_MAX_IN_FLIGHT" in err
    )
    monkeypatch.delenv("SAGALINE_MAX_IN_FLIGHT")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["participant", "run", "seats", "--max-in-flight", "0"])
    assert exited.value.code == 2
    assert build_parser().parse_args(["participant", "run", "seats"]).max_in_flight == 16


def test_topics_create_says_in_one_line_when_the_broker_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The topics job of a deployment: a broker that is not up yet is one line and
    exit 2 (retry later), not a librdkafka traceback."""
    import services.serve
    from sagaline.kafka import KafkaError, KafkaException

    def unreachable(*args: object, **kwargs: object) -> list[str]:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    _broker_answers_the_check(monkeypatch)
    monkeypatch.setattr(services.serve, "ensure_topics", unreachable)
    assert main(["topics", "create", "--participants", "a,b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sagaline topics create: ") and err.count("\n") == 1
    assert "Broker transport failure" in err


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_doc_the_help_names_exists() -> None:
    """`--help` sends a newcomer to docs/...: each file it names must be there."""
    from services.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    named: dict[str, str] = {}
    for parser in _parsers(build_parser()):
        texts = [parser.description or "", *(a.help or "" for a in parser._actions)]
        for text in texts:
            for doc in re.findall(r"docs/[\w.-]+\.md", text):
                named[doc] = parser.prog
    assert named, "no help text names a doc: the check reads the wrong thing"
    missing = {doc: prog for doc, prog in named.items() if not (root / doc).is_file()}
    assert not missing, missing
