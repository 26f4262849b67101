"""``sagaline coordinator run`` and ``sagaline participant run`` against a broker that
does not answer (a stale KAFKA_BOOTSTRAP_SERVERS, the broker not up yet): one line
naming the address and what to check, exit code 2, as ``sagaline topics create``
says it. Both ended in a librdkafka traceback (cimpl.KafkaException from
ensure_topics' metadata request) with exit code 1.

Nothing listens on the port (bound, then released), so librdkafka's own metadata
timeout is waited out: the real failure, not a stand-in."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from coordinator.shell import Coordinator
from participants.runtime import ParticipantRuntime
from services.cli import main


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize("command", ["coordinator", "participant"])
def test_a_service_started_with_no_broker_answering_says_so_in_one_line_and_exits_2(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bootstrap = f"127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", "no-broker.")
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path))
    # The process's signal handlers are pytest's, not the service's.
    monkeypatch.setattr(Coordinator, "install_signal_handlers", lambda self: None)
    monkeypatch.setattr(ParticipantRuntime, "install_signal_handlers", lambda self: None)
    argv = (
        ["coordinator", "run"] if command == "coordinator" else ["participant", "run", "payments"]
    )
    prog = "coordinator run" if command == "coordinator" else "sagaline participant run payments"

    code = main(argv)

    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.startswith(f"{prog}: ") and err.count("\n") == 1, err
    assert bootstrap in err and "KAFKA_BOOTSTRAP_SERVERS" in err, err
    assert code == 2, err
