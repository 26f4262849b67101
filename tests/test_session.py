"""``sagaline.connect()`` on its error paths, as a user meets them: what it started
fails, the block raises, it is used twice in one process. Real broker; every test
checks that no thread the session started is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import sagaline
import sagaline._session as session
from schemas.settings import Settings

pytestmark = pytest.mark.kafka

_SESSION_THREADS = ("sagaline-coordinator", "sagaline-participant-", "saga-client")


def _release(reservation_id: str) -> None:
    pass


@sagaline.compensable(by=_release, args=lambda c: {"reservation_id": c.result})
def reserve(flight: str) -> str:
    """Reserve a seat."""
    return f"r-{flight}"


def _settings(bootstrap: str, prefix: str, tmp_path: Path) -> Settings:
    return Settings(
        bootstrap=bootstrap, topic_prefix=prefix, partitions=1, state_dir=tmp_path / "state"
    )


def _session_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and t.name.startswith(_SESSION_THREADS)
    ]


class _Injected(RuntimeError):
    pass


def _fail(*args: object, **kwargs: object) -> None:
    raise _Injected("injected start failure")


@pytest.mark.parametrize("what", ["coordinator", "participant"])
def test_a_start_failure_is_raised_at_once_with_its_cause(
    what: str,
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A coordinator or runtime that raises while starting ends its thread: connect()
    waited out its whole start timeout (120 s) for it, then said "no coordinator is
    consuming ... use sagaline.connect(..., coordinator=True)" (which was used) or "see
    the log above", never why. Now it raises StartError from the failure at once.
    The start timeout is lowered so that the wait, if it came back, ends quickly in
    the wrong error rather than the test's."""
    import coordinator.shell
    import participants.runtime

    monkeypatch.setattr(session, "_START_TIMEOUT_S", 20.0)
    if what == "coordinator":
        monkeypatch.setattr(coordinator.shell.Coordinator, "_check_topic_sizes", _fail)
    else:
        monkeypatch.setattr(participants.runtime, "journal_keep_ms", _fail)
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with (
        pytest.raises(session.StartError, match=f"{what}.*injected start failure") as raised,
        sagaline.connect(reserve, name="seats", coordinator=True, settings=settings),
    ):
        pytest.fail("the session started")
    assert isinstance(raised.value.__cause__, _Injected)
    assert _session_threads() == []


def test_a_second_session_with_a_coordinator_does_not_fence_the_first(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Two ``connect(coordinator=True)`` in one process (a notebook cell run while
    another session is open, a helper that opens its own): both coordinators had the
    same static member and transactional id, so the second fenced the first (its
    thread died on _FENCED), and once the second session ended the first had no
    coordinator: its calls ended in OutcomeUnknown. Now the second session uses the
    coordinator already running for those topics, which stops with its last user."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with sagaline.connect(
        reserve, name="seats", coordinator=True, settings=settings, call_timeout_s=20
    ) as outer:
        with sagaline.connect(coordinator=True, settings=settings) as inner:
            with inner.saga("trip", principal="me") as saga:
                assert saga.call("reserve", flight="IN") == "r-IN"
            assert saga.wait(60).status == "COMPLETED"
        assert "sagaline-coordinator" in _session_threads()
        with outer.saga("trip", principal="me") as saga:
            assert saga.call(reserve, flight="OUT") == "r-OUT"
        assert saga.wait(60).status == "COMPLETED"
    assert _session_threads() == []


def test_a_bad_declaration_fails_before_a_broker_is_chosen_or_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no broker configured, connect() chose (and, if need be, started: a JVM,
    up to minutes) the local development broker before checking the tools, and only
    then raised the CatalogueError. The declarations are checked first now."""
    import services.broker

    def book(flight: str) -> str:  # a write tool with no undo declared
        """Book a flight."""
        return flight

    chosen: list[str] = []

    def resolve() -> str:
        chosen.append("broker")
        return "127.0.0.1:1"

    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setattr(services.broker, "resolve_bootstrap", resolve)
    with pytest.raises(sagaline.CatalogueError, match="book"), sagaline.connect(book, name="x"):
        pytest.fail("the session started")
    assert chosen == []


def test_a_broker_that_does_not_answer_is_one_clear_error_without_client_noise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A wrong KAFKA_BOOTSTRAP_SERVERS (nothing listening there): connect() printed a
    librdkafka FAIL line every 50 ms for 30 s, then raised the bare KafkaException
    "Failed to get metadata: Local: Broker transport failure", naming neither the
    address nor what to do. Now: a ConnectionError saying both, and why the
    connection failed; no client log lines. (The probe's wait is lowered here.)"""
    monkeypatch.setattr(session, "_PROBE_TIMEOUT_S", 3.0)
    settings = _settings("127.0.0.1:1", "unused.", tmp_path)
    with pytest.raises(ConnectionError) as raised, sagaline.connect(settings=settings):
        pytest.fail("the session started")
    text = str(raised.value)
    assert "127.0.0.1:1" in text and "KAFKA_BOOTSTRAP_SERVERS" in text, text
    assert "Connection refused" in text, text
    assert "rdkafka" not in capfd.readouterr().err
    assert _session_threads() == []


def test_a_failing_client_close_neither_masks_the_blocks_error_nor_leaves_threads(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's end closed the client, then stopped the runtimes and the
    coordinator, in one ``finally``: a close() that raised left them running and
    replaced the error the block raised with its own."""
    from participants.client import SagaClient

    closing = SagaClient.close

    def close(self: SagaClient) -> None:
        closing(self)
        raise RuntimeError("close failed")

    monkeypatch.setattr(SagaClient, "close", close)
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with (
        pytest.raises(ValueError, match="the block's own"),
        sagaline.connect(reserve, name="seats", coordinator=True, settings=settings),
    ):
        raise ValueError("the block's own")
    assert _session_threads() == []


def test_sessions_on_one_broker_list_spelled_otherwise_share_one_coordinator(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The instance claim keys a broker list as a set of addresses (6ee6916), but
    the sessions' shared coordinators were kept by the bootstrap string as given: a
    second ``connect(coordinator=True)`` of the process with the same brokers spelled
    otherwise (" host:port, ") found none running, started its own, and that one
    was refused by the first one's claim ("this process runs the development
    coordinator"): StartError, where the docs say the sessions share one."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with sagaline.connect(
        reserve, name="seats", coordinator=True, settings=settings, call_timeout_s=20
    ):
        spelled = f" {kafka_bootstrap}, "
        with sagaline.connect(coordinator=True, settings=settings, bootstrap=spelled) as inner:
            with inner.saga("trip", principal="me") as saga:
                assert saga.call("reserve", flight="IN") == "r-IN"
            assert saga.wait(60).status == "COMPLETED"
        assert "sagaline-coordinator" in _session_threads()
    assert _session_threads() == []


def test_a_coordinator_replaced_after_it_died_serves_until_the_last_session_ends(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The shared coordinator died under an open session (fenced, crashed); the next
    session replaces it. That one counted only its own session: when it ended it
    stopped the replacement, and the first session, still open, was left with no
    coordinator (its calls ended in OutcomeUnknown). Now the replacement serves
    every session of the dead one too, and stops with the last."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with sagaline.connect(
        reserve, name="seats", coordinator=True, settings=settings, call_timeout_s=20
    ) as outer:
        dead = session._coordinators[(kafka_bootstrap, settings.topics.events)]
        dead.core.stop()
        dead.thread.join(30)
        assert "sagaline-coordinator" not in _session_threads()
        with sagaline.connect(coordinator=True, settings=settings):
            assert "sagaline-coordinator" in _session_threads()
        assert "sagaline-coordinator" in _session_threads()
        with outer.saga("trip", principal="me") as saga:
            assert saga.call(reserve, flight="OUT") == "r-OUT"
        assert saga.wait(60).status == "COMPLETED"
    assert _session_threads() == []


_OTHER_PROCESS = """
import sys
from pathlib import Path

import sagaline
from schemas.settings import Settings

bootstrap, prefix, state = sys.argv[1:]
settings = Settings(
    bootstrap=bootstrap, topic_prefix=prefix, partitions=1, state_dir=Path(state)
)
with sagaline.connect(coordinator=True, settings=settings):
    print("serving", flush=True)
    sys.stdin.readline()
"""


def _other_process(kafka_bootstrap: str, prefix: str, state: Path) -> subprocess.Popen[str]:
    """A process serving ``connect(coordinator=True)`` on ``prefix``'s topics, until
    its stdin closes; returned once it serves."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_PROCESS, kafka_bootstrap, prefix, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert other.stdout is not None
    if other.stdout.readline().strip() != "serving":
        other.kill()
        _, err = other.communicate(timeout=30)
        pytest.fail(f"the other process did not start serving: {err}")
    return other


def test_a_second_process_with_a_coordinator_is_refused_and_fences_nothing(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Two processes with ``connect(coordinator=True)`` on one broker and topics (two
    scripts, a notebook and a script): both coordinators had the instance id
    "dev-coordinator", so the same static member and transactional id, and the
    second silently fenced the first (its thread died on _FENCED; its process was left
    with no coordinator once the second ended). Now the second is refused with a clear
    StartError saying what to do, and the first keeps serving: a session of the
    second process without a coordinator runs its sagas through it."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    other = _other_process(kafka_bootstrap, unique_prefix, tmp_path / "other")
    try:
        assert other.stdin is not None
        with (
            pytest.raises(session.StartError, match=r"another process \(pid \d+\)") as raised,
            sagaline.connect(reserve, name="seats", coordinator=True, settings=settings),
        ):
            pytest.fail("a second coordinator started")
        assert "coordinator=False" in str(raised.value), raised.value
        assert _session_threads() == []
        with sagaline.connect(reserve, name="seats", settings=settings, call_timeout_s=20) as c:
            with c.saga("trip", principal="me") as saga:
                assert saga.call(reserve, flight="IN") == "r-IN"
            assert saga.wait(60).status == "COMPLETED"
        other.stdin.close()
        assert other.wait(60) == 0
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(30)
    assert other.stderr is not None
    err = other.stderr.read()
    assert "_FENCED" not in err and "no longer served" not in err, err
    assert _session_threads() == []


def test_a_process_with_a_coordinator_restarted_after_a_kill_takes_it_over(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The claim that refuses a second process's coordinator dies with its holder: a
    process killed (SIGKILL) mid-session does not block the next one, which takes the
    same instance id (fencing the dead one's transaction) and runs sagas."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    other = _other_process(kafka_bootstrap, unique_prefix, tmp_path / "other")
    other.kill()
    other.communicate(timeout=30)
    with sagaline.connect(
        reserve, name="seats", coordinator=True, settings=settings, call_timeout_s=20
    ) as client:
        with client.saga("trip", principal="me") as saga:
            assert saga.call(reserve, flight="IN") == "r-IN"
        assert saga.wait(60).status == "COMPLETED"
    assert _session_threads() == []


def test_a_second_session_serving_the_same_participant_is_refused(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Two sessions serving one participant name (a helper that opens its own session
    with the tools while another serves them; two scripts): both runtimes had the
    participant's name as instance id, so the same static group member, and fenced
    each other back and forth, the fenced one serving nothing from then on. Now the
    second is refused with a StartError saying what to do, and the first serves on."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with sagaline.connect(
        reserve, name="seats", coordinator=True, settings=settings, call_timeout_s=20
    ) as outer:
        with (
            pytest.raises(session.StartError, match="'seats' is already served") as raised,
            sagaline.connect(reserve, name="seats", settings=settings),
        ):
            pytest.fail("a second runtime of 'seats' started")
        assert "this process" in str(raised.value), raised.value
        with sagaline.connect(settings=settings, call_timeout_s=20) as inner:
            with inner.saga("trip", principal="me") as saga:
                assert saga.call("reserve", flight="IN") == "r-IN"
            assert saga.wait(60).status == "COMPLETED"
        with outer.saga("trip", principal="me") as saga:
            assert saga.call(reserve, flight="OUT") == "r-OUT"
        assert saga.wait(60).status == "COMPLETED"
    assert _session_threads() == []
    # Released with the session: the next one serves the participant again.
    with sagaline.connect(reserve, name="seats", settings=settings):
        assert any(t.startswith("sagaline-participant-seats") for t in _session_threads())
    assert _session_threads() == []


def test_a_coordinator_that_cannot_be_built_leaves_no_claim_behind(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim on the coordinator's instance id is taken before it is built: a
    construction that raised (a bad client setting) kept it, so every later
    ``connect(coordinator=True)`` of the process was refused as "this process runs
    the development coordinator", with none running."""
    import coordinator.shell

    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(coordinator.shell.Coordinator, "__init__", _fail)
        with (
            pytest.raises(_Injected),
            sagaline.connect(coordinator=True, settings=settings),
        ):
            pytest.fail("the session started")
    with sagaline.connect(coordinator=True, settings=settings):
        assert "sagaline-coordinator" in _session_threads()
    assert _session_threads() == []


def test_a_forked_child_does_not_keep_the_claim_of_a_session_that_ended(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """A child forked while a session serves (a multiprocessing pool with the fork
    start method) inherited the claim's descriptor, and with it the flock: once the
    session ended, the next session of the process serving the same participant was
    refused as "already served by this process" while the child lived, with none
    served."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path)
    read_end, write_end = os.pipe()
    with sagaline.connect(reserve, name="seats", settings=settings):
        child = os.fork()
        if child == 0:  # waits for the parent's word, touching nothing else
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
    os.close(read_end)
    try:
        with sagaline.connect(reserve, name="seats", settings=settings):
            assert any(t.startswith("sagaline-participant-seats") for t in _session_threads())
    finally:
        os.close(write_end)
        os.waitpid(child, 0)
    assert _session_threads() == []
