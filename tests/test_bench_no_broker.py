"""The benchmark scripts, pointed at an address where no broker answers, stop with a
message that names the address and what to do, not a librdkafka traceback."""

from __future__ import annotations

import socket

import pytest

from bench import coordinator as coordinator_bench
from bench import e2e


@pytest.fixture
def no_broker(monkeypatch: pytest.MonkeyPatch) -> str:
    with socket.socket() as s:  # a port nobody listens on once this is closed
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", address)
    return address


def test_e2e_says_no_broker_answers(no_broker: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        e2e.main(["--levels", "1:1", "--variants", "reject", "--no-raw"])

    message = str(stopped.value.code)
    assert f"no Kafka broker answers at {no_broker}" in message
    assert "KAFKA_BOOTSTRAP_SERVERS" in message


def test_coordinator_bench_says_no_broker_answers(no_broker: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        coordinator_bench.main(["--quick"])

    message = str(stopped.value.code)
    assert f"no Kafka broker answers at {no_broker}" in message
    assert "KAFKA_BOOTSTRAP_SERVERS" in message
