"""One live client per static group member on this machine, whoever starts it.

A participant runtime (its ``group.instance.id``) and the coordinator (the same string
is its ``transactional.id``) claim their member as they start: a second one with the
same id on the same broker, of this process or another (`sagaline participant run`
twice, `sagaline coordinator run` twice, a runtime beside a ``connect()`` session),
would fence the first, which dies or flaps with no word of its twin. Only
``sagaline.connect()`` took that claim; every other way of starting one is refused now
too, at once, naming the holder's pid and what to do. Real broker."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import sagaline
from coordinator.shell import Coordinator
from participants import ParticipantRuntime, wrap
from sagaline.kafka import ensure_topics
from schemas.settings import Settings
from tests.system import wait_until

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[1]


def _release(reservation_id: str) -> None:
    pass


@sagaline.compensable(by=_release, args=lambda c: {"reservation_id": c.result})
def reserve(flight: str) -> str:
    """Reserve a seat."""
    return f"r-{flight}"


SEATS = wrap(reserve, name="seats")  # `participant run seats --catalogue` loads it


def _settings(bootstrap: str, prefix: str, state: Path) -> Settings:
    return Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=1, state_dir=state)


class _Serving:
    """``run(ready=...)`` in a thread; what it raised, if it ended."""

    def __init__(self, run: object) -> None:
        self.ready = threading.Event()
        self.failed: list[BaseException] = []

        def serve() -> None:
            try:
                run(ready=self.ready)  # type: ignore[operator]
            except BaseException as exc:
                self.failed.append(exc)
            finally:
                self.ready.set()

        self.thread = threading.Thread(target=serve, name="claims-test", daemon=True)
        self.thread.start()

    def started(self) -> bool:
        """Whether it serves (False: it ended before, ``failed`` says why)."""
        assert self.ready.wait(120), "neither served nor failed"
        return not self.failed


def _raised(run: object) -> RuntimeError:
    """What ``run()`` raised (it must raise a RuntimeError at once)."""
    try:
        run()  # type: ignore[operator]
    except RuntimeError as exc:
        return exc
    raise AssertionError(f"{run} returned")


def _refused_naming_this_process(done: subprocess.CompletedProcess[str]) -> None:
    """A CLI start refused as documented: exit 2, one line, no traceback, naming the
    holder (this test process) and what to do (``--instance-id``)."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"another process (pid {os.getpid()})" in done.stderr, done.stderr
    assert "--instance-id" in done.stderr, done.stderr


def _cli(bootstrap: str, prefix: str, state: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "SAGALINE_TOPIC_PREFIX": prefix,
        "SAGALINE_STATE_DIR": str(state),
        "SAGALINE_PARTITIONS": "1",
        "PYTHONPATH": str(ROOT),
    }
    # The timeout only ends a process that was not refused (it serves for ever).
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_second_runtime_of_a_participant_is_refused_until_the_first_stops(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Two ``ParticipantRuntime`` of one participant with the same instance id (two
    threads of a service, a SagaClient's local tools beside a runtime): the second
    joined as the same static member and they fenced each other. Now the second is
    refused at once, naming this process and the instance id to change; the first
    serves on, and once it stopped the next one starts."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path / "state")
    first = ParticipantRuntime(SEATS, settings, kafka_bootstrap)
    one = _Serving(first.run)
    assert one.started(), one.failed
    try:
        second = _Serving(ParticipantRuntime(SEATS, settings, kafka_bootstrap).run)
        try:
            assert not second.started(), "a second runtime of 'seats' started beside the first"
        finally:
            second.thread.join(30)
        refused = second.failed[0]
        assert isinstance(refused, sagaline.kafka.InstanceClaimed), repr(refused)
        assert "'seats'" in str(refused) and "by this process" in str(refused), refused
        assert "--instance-id" in str(refused), refused
        assert first.health() is None and one.thread.is_alive()
    finally:
        first.stop()
        one.thread.join(60)
    assert not one.thread.is_alive()
    third = ParticipantRuntime(SEATS, settings, kafka_bootstrap)
    again = _Serving(third.run)
    try:
        assert again.started(), again.failed
    finally:
        third.stop()
        again.thread.join(60)


def test_participant_run_beside_a_runtime_of_the_participant_exits_naming_its_pid(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """`sagaline participant run seats` on a machine where a runtime of ``seats``
    already serves (a second terminal, a restart script that did not stop the old
    one) fenced it: the two flapped, each serving nothing for long. Now it exits 2
    with one line naming the holder's pid; the first serves on."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path / "state")
    runtime = ParticipantRuntime(SEATS, settings, kafka_bootstrap)
    serving = _Serving(runtime.run)
    assert serving.started(), serving.failed
    try:
        done = _cli(
            kafka_bootstrap,
            unique_prefix,
            tmp_path / "other",
            *("participant", "run", "seats", "--catalogue", "tests.test_instance_claims:SEATS"),
        )
        _refused_naming_this_process(done)
        assert runtime.health() is None and serving.thread.is_alive()
    finally:
        runtime.stop()
        serving.thread.join(60)


def test_coordinator_run_beside_a_coordinator_with_its_instance_id_exits_naming_its_pid(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Two coordinators with one instance id on a machine (`sagaline coordinator run`
    twice: the default id is $HOSTNAME) have the same static member and
    transactional id: the second fenced the first, whose loop died on _FENCED. Now the
    second exits 2 with one line naming the holder's pid; once the first stopped, a
    coordinator with that id starts again."""
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path / "state")
    ensure_topics(kafka_bootstrap, settings.topics, [], 1)
    first = Coordinator(settings, kafka_bootstrap, instance_id="claims-1")
    serving = _Serving(first.run)
    assert serving.started(), serving.failed
    try:
        done = _cli(
            kafka_bootstrap,
            unique_prefix,
            tmp_path / "other",
            *("coordinator", "run", "--instance-id", "claims-1"),
        )
        _refused_naming_this_process(done)
        assert first.health() is None and serving.thread.is_alive()
    finally:
        first.stop()
        serving.thread.join(60)
    again = Coordinator(settings, kafka_bootstrap, instance_id="claims-1")
    restarted = _Serving(again.run)
    try:
        assert restarted.started(), restarted.failed
    finally:
        again.stop()
        restarted.thread.join(60)


def test_run_called_again_on_a_runtime_that_serves_is_refused_and_it_serves_on(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """``run()`` called a second time on a runtime whose loop serves (a supervisor
    thread retrying it, a service starting it twice) was refused by the claim, which
    then closed what the constructor opened: the serving loop's own tool pool, ledger
    writer and journal. Its next command ran no tool and was answered by nobody. The
    second call is refused now, saying that a runtime runs once, and closes nothing."""
    from schemas import StepCommitted
    from tests.test_participant_runtime import Harness, _of

    harness = Harness(kafka_bootstrap, unique_prefix, tmp_path)
    harness.start()
    runtime = harness.runtime
    assert runtime is not None
    try:
        refused = _raised(runtime.run)
        harness.send(harness.execute("s1", {"sku": "a", "quantity": 1}))
        harness.wait_for(lambda rs: bool(_of(rs, StepCommitted)))
        assert runtime.health() is None
        assert "runs once" in str(refused), refused
        assert not isinstance(refused, sagaline.kafka.InstanceClaimed), refused
    finally:
        harness.stop()
    with pytest.raises(RuntimeError, match="runs once"):  # nor after it ran: not a traceback
        runtime.run()  # from its closed journal


def test_run_called_again_on_a_coordinator_that_serves_is_refused_and_it_serves_on(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The coordinator's kind of it: a second ``run()`` on a coordinator that serves
    closed its consumer and its sender under its loop, which died at its next poll.
    Worse, closing the consumer under its poll hung both: the second ``run()`` and the
    loop, which no stop() ended. Refused now, closing nothing; the loop goes on deciding
    sagas. (tests.coordinator_turns is imported here: `participant run` imports this
    module for SEATS, without the tests directory on its path.)"""
    from tests.coordinator_turns import append, executes, one_saga

    settings, ledger, first, participant = one_saga(kafka_bootstrap, unique_prefix, "saga-twice")
    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="twice-1")
    serving = _Serving(coordinator.run)
    assert serving.started(), serving.failed
    try:
        refused = _raised(coordinator.run)
        append(settings, kafka_bootstrap, ledger.started(), first)
        wait_until(
            lambda: executes(settings, kafka_bootstrap, participant) or serving.failed,
            60,
            "the step dispatched",
        )
        assert serving.failed == [] and coordinator.health() is None
        assert "runs once" in str(refused), refused
        assert not isinstance(refused, sagaline.kafka.InstanceClaimed), refused
    finally:
        coordinator.stop()
        serving.thread.join(60)
    assert serving.failed == []
    with pytest.raises(RuntimeError, match="runs once"):
        coordinator.run()


def test_a_runtime_whose_temporary_directory_cannot_hold_the_lock_serves_unchecked(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A container with a read-only root file system (its state directory on a
    volume, /tmp not writable) served before instance claims; the claim's lock file
    then stopped every runtime and coordinator at start with an OSError traceback (a
    lock file another user planted under the name: PermissionError alike). The
    claim only guards against a twin on this machine: it is skipped with a warning
    naming the lock file and what to do, and the runtime serves."""
    import tempfile

    not_a_directory = tmp_path / "tmp"
    not_a_directory.write_text("")  # as a read-only /tmp: no lock file can be made in it
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(not_a_directory))
    settings = _settings(kafka_bootstrap, unique_prefix, tmp_path / "state")
    runtime = ParticipantRuntime(SEATS, settings, kafka_bootstrap)
    serving = _Serving(runtime.run)
    try:
        assert serving.started(), serving.failed
        assert runtime.health() is None
    finally:
        runtime.stop()
        serving.thread.join(60)
    assert serving.failed == []
    [warning] = [r for r in caplog.records if "not claimed" in r.getMessage()]
    assert str(not_a_directory) in warning.getMessage() and "TMPDIR" in warning.getMessage()


def test_one_broker_list_spelled_otherwise_is_the_same_claim() -> None:
    """The claim was keyed by the bootstrap string as given: `participant run` with
    KAFKA_BOOTSTRAP_SERVERS="k1:9092,k2:9092" and a twin with "k2:9092, k1:9092" (or
    "K1:9092,...") took different lock files, joined as one static member and fenced
    each other, unrefused. The broker list is compared as a set of addresses now
    (order, spaces and case do not count)."""
    from uuid import uuid4

    from sagaline.kafka._claims import claim_member, release_member

    member = f"claims-spelling-{uuid4().hex[:8]}"
    claim = claim_member("k1:9092,k2:9092", member, lambda holder, path: f"{holder} {path}")
    try:
        for spelled in (" k2:9092, k1:9092 ", "K1:9092,k2:9092", "k1:9092,k2:9092,"):
            with pytest.raises(sagaline.kafka.InstanceClaimed, match="this process"):
                claim_member(spelled, member, lambda holder, path: f"{holder} {path}")
        other = claim_member("k3:9092", member, lambda holder, path: f"{holder} {path}")
        release_member(other)  # another broker: another claim
    finally:
        release_member(claim)


def test_a_lock_file_whose_file_system_cannot_lock_it_starts_unclaimed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A temporary directory that holds the lock file but cannot lock it (an NFS
    mount without a lock daemon: flock fails with ENOLCK) stopped the instance at
    start with an OSError traceback, where one that cannot hold the file starts it
    unclaimed with a warning. Alike now; a held claim (EWOULDBLOCK) is still refused."""
    import errno
    import fcntl
    from uuid import uuid4

    from sagaline.kafka._claims import claim_member, release_member

    member = f"claims-nolock-{uuid4().hex[:8]}"
    held = claim_member("k1:9092", member, lambda holder, path: f"{holder} {path}")
    try:
        with pytest.raises(sagaline.kafka.InstanceClaimed, match="this process"):
            claim_member("k1:9092", member, lambda holder, path: f"{holder} {path}")
    finally:
        release_member(held)

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    opened = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    assert claim_member("k1:9092", member, lambda holder, path: f"{holder} {path}") is None
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) == opened  # its descriptor closed
    [warning] = [r for r in caplog.records if "not claimed" in r.getMessage()]
    assert os.strerror(errno.ENOLCK) in warning.getMessage() and "TMPDIR" in warning.getMessage()
