"""The local Kafka launcher (services/kafka_local.py) against a real broker.

These tests check what the rest of the project relies on: records go through a
real broker, the broker is reused rather than restarted, its config has the
settings a single node needs, port conflicts fail clearly, transactions work (the
coordinator's exactly-once loop needs them), and a broker killed with SIGKILL
comes back on the same data.
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import socket
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from services import broker, kafka_cli, kafka_local

ROOT = Path(__file__).resolve().parents[1]


def cli_main(argv: list[str]) -> int:
    """`sagaline ARGV`, restricted to the kafka commands (other areas' commands are
    not under test here)."""
    parser = argparse.ArgumentParser(prog="sagaline")
    kafka_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def _local_or_skip(**kwargs: object) -> kafka_local.UpResult:
    """ensure_running(); skip only when an external broker is configured and this
    machine cannot run the local one (then the launcher is not what is under test)."""
    try:
        return kafka_local.ensure_running(**kwargs)  # type: ignore[arg-type]
    except kafka_local.ToolMissingError as exc:
        if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            pytest.skip(f"local broker unavailable here: {exc}")
        raise


def _create_topic(admin: AdminClient, name: str, partitions: int = 1) -> None:
    futures = admin.create_topics([NewTopic(name, partitions, 1)], operation_timeout=30)
    futures[name].result(timeout=30)


def _consume(bootstrap: str, topic: str, group: str, want: int, **extra: str) -> list[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **extra,
        }
    )
    consumer.subscribe([topic])
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    try:
        while len(got) < want and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                raise KafkaException(msg.error())
            value = msg.value()
            assert isinstance(value, bytes)
            got.append(value)
    finally:
        consumer.close()
    return got


def _parse_properties(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


# ----------------------------------------------------------------- against the broker


@pytest.mark.kafka
def test_produce_and_consume_through_a_unique_topic(
    kafka_bootstrap: str, admin: AdminClient, unique_prefix: str
) -> None:
    topic = f"{unique_prefix}roundtrip"
    _create_topic(admin, topic, partitions=3)
    producer = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "enable.idempotence": True,
            "partitioner": "murmur2_random",
        }
    )
    for i in range(5):
        producer.produce(topic, key=b"saga-1", value=f"v{i}".encode())
    assert producer.flush(30) == 0
    got = _consume(kafka_bootstrap, topic, f"{unique_prefix}g", want=5)
    # One key, one partition: order is preserved.
    assert got == [f"v{i}".encode() for i in range(5)]


@pytest.mark.kafka
def test_auto_topic_creation_is_off(kafka_bootstrap: str, unique_prefix: str) -> None:
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.timeout.ms": 3000})
    errors: list[object] = []
    producer.produce(
        f"{unique_prefix}never-created", value=b"x", on_delivery=lambda err, _m: errors.append(err)
    )
    producer.flush(10)
    assert errors and errors[0] is not None


@pytest.mark.kafka
def test_transactional_produce_commit_and_abort(
    kafka_bootstrap: str, admin: AdminClient, unique_prefix: str
) -> None:
    topic = f"{unique_prefix}tx"
    _create_topic(admin, topic)
    producer = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "transactional.id": f"{unique_prefix}txid",
            "transaction.timeout.ms": 10000,
            "partitioner": "murmur2_random",
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"k", value=b"aborted")
    producer.abort_transaction(30)
    producer.begin_transaction()
    for value in (b"c1", b"c2"):
        producer.produce(topic, key=b"k", value=value)
    producer.commit_transaction(30)
    got = _consume(
        kafka_bootstrap, topic, f"{unique_prefix}g", want=2, **{"isolation.level": "read_committed"}
    )
    assert got == [b"c1", b"c2"]


@pytest.mark.kafka
def test_up_twice_reuses_the_running_broker(kafka_bootstrap: str) -> None:
    first = _local_or_skip()
    second = _local_or_skip()
    assert second.bootstrap == first.bootstrap
    assert second.pid == first.pid
    assert second.started is False
    assert kafka_local.up() == first.bootstrap
    st = kafka_local.status()
    assert st.running and st.bootstrap == first.bootstrap


@pytest.mark.kafka
def test_running_broker_config_has_required_settings(kafka_bootstrap: str) -> None:
    res = _local_or_skip()
    props = _parse_properties((res.state_dir / "server.properties").read_text())
    port = res.bootstrap.rpartition(":")[2]
    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{port}"
    assert props["controller.quorum.voters"].startswith("1@127.0.0.1:")
    assert "127.0.0.1" in props["listeners"] and "0.0.0.0" not in props["listeners"]
    for key, value in {
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }.items():
        assert props[key] == value, key
    assert int(props["transaction.max.timeout.ms"]) >= 60000  # client defaults still work
    assert (res.state_dir / "bootstrap").read_text().strip() == res.bootstrap
    assert (res.state_dir / "broker.pid").read_text().strip() == str(res.pid)


@pytest.mark.kafka
def test_cli_up_prints_bootstrap_last_and_status_exits_0(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    res = _local_or_skip()
    assert cli_main(["kafka", "up"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == res.bootstrap
    assert cli_main(["kafka", "status"]) == 0


@pytest.mark.kafka
def test_restart_after_sigkill_keeps_data(tmp_path: Path) -> None:
    """A broker killed uncleanly (stale pid file, stale data-dir lock) comes back."""
    state = tmp_path / "broker"
    first = _local_or_skip(state_dir=state)
    try:
        topic = "survives-kill"
        _create_topic(AdminClient({"bootstrap.servers": first.bootstrap}), topic)
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kafka_local.status(state, timeout=1).running and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not kafka_local.status(state, timeout=1).running
        second = kafka_local.ensure_running(state)
        assert second.started and second.pid != first.pid
        assert second.bootstrap == first.bootstrap  # remembered ports are reused
        md = AdminClient({"bootstrap.servers": second.bootstrap}).list_topics(timeout=10)
        assert topic in md.topics
    finally:
        assert kafka_local.down(state) in (True, False)
    assert not kafka_local.status(state).running


@pytest.mark.kafka
def test_up_fresh_restarts_on_an_empty_data_dir_with_the_same_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What CI relies on: no earlier run's topics survive ``up --fresh``."""
    state = tmp_path / "broker"
    first = _local_or_skip(state_dir=state)
    try:
        _create_topic(AdminClient({"bootstrap.servers": first.bootstrap}), "left-behind")
        assert cli_main(["kafka", "up", "--fresh", "--state-dir", str(state)]) == 0
        bootstrap = capsys.readouterr().out.strip().splitlines()[-1]
        assert bootstrap == first.bootstrap  # the ports are kept
        second = kafka_local.status(state)
        assert second.running and second.pid != first.pid
        md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        assert "left-behind" not in md.topics
    finally:
        kafka_local.down(state)


@pytest.mark.kafka
def test_up_after_an_interrupted_up_reuses_the_half_started_broker(tmp_path: Path) -> None:
    """An `up` stopped (Ctrl-C, killed) after it started the broker but before it
    answered leaves a running broker with a pid file and no bootstrap file. The next
    `up` must adopt that broker, not start a second JVM on the same data dir (which
    dies on the data-dir lock and leaves the first one running, unstoppable)."""
    state = tmp_path / "broker"
    first = _local_or_skip(state_dir=state)
    try:
        (state / "bootstrap").unlink()  # what an interrupted up leaves behind
        second = kafka_local.ensure_running(state, timeout=120)
        assert second.pid == first.pid and not second.started
        assert second.bootstrap == first.bootstrap
        assert (state / "bootstrap").read_text().strip() == first.bootstrap
    finally:
        kafka_local.down(state)
    assert not kafka_local._pid_alive(first.pid)


def test_relative_cache_dir_gives_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SAGALINE_CACHE_DIR=.cache sagaline kafka up`: the broker runs with its state
    dir as working directory, so a relative state dir or jar dir would point
    nowhere (java cannot find kafka.Kafka, or reads the wrong config)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAGALINE_CACHE_DIR", "rel-cache")
    assert kafka_local.default_cache_dir() == tmp_path.resolve() / "rel-cache"
    assert kafka_local.default_state_dir() == tmp_path.resolve() / "rel-cache" / "broker"
    assert kafka_local.default_cluster_dir(3).is_absolute()


def test_up_interrupted_while_waiting_stops_the_broker_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `up`'s wait for the broker stops the JVM it just started."""
    spawned: list[int] = []
    real_spawn = kafka_local._spawn

    def spawn(*args: object, **kwargs: object) -> int:
        pid = real_spawn(*args, **kwargs)  # type: ignore[arg-type]
        spawned.append(pid)
        return pid

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kafka_local, "_spawn", spawn)
    monkeypatch.setattr(kafka_local, "_wait_ready", interrupted)
    state = tmp_path / "broker"
    try:
        with pytest.raises(KeyboardInterrupt):
            _local_or_skip(state_dir=state)
        assert len(spawned) == 1
        assert not kafka_local._pid_alive(spawned[0])
        assert not (state / "broker.pid").exists()
    finally:
        for pid in spawned:
            if kafka_local._is_our_broker(pid, state.resolve()):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------- unit level


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(kafka_local.PortInUseError, match=str(port)):
            kafka_local.ensure_port_free(port)
        try:
            kafka_local.up(tmp_path / "b", port=port, timeout=30)
        except kafka_local.ToolMissingError:
            pass  # no Java here: the port check itself was covered above
        except kafka_local.PortInUseError as exc:
            assert f"127.0.0.1:{port}" in str(exc)
            assert "already in use" in str(exc)
        else:
            kafka_local.down(tmp_path / "b")
            pytest.fail("up() on a taken port should raise PortInUseError")
    free = kafka_local.free_port()
    kafka_local.ensure_port_free(free)


def test_cluster_id_is_22_char_base64url_of_16_bytes() -> None:
    for _ in range(50):
        cid = kafka_local.new_cluster_id()
        assert len(cid) == 22 and not cid.startswith("-")
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_rendered_config_uses_given_ports_and_data_dir(tmp_path: Path) -> None:
    props = _parse_properties(
        kafka_local.render_server_properties(port=1111, controller_port=2222, data_dir=tmp_path)
    )
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:1111,CONTROLLER://127.0.0.1:2222"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:2222"
    assert props["log.dirs"] == str(tmp_path)
    assert "authorizer.class.name" not in props  # ACLs only when asked (acls=True)


def test_status_and_down_of_an_empty_state_dir(tmp_path: Path) -> None:
    st = kafka_local.status(tmp_path)
    assert not st.running and "no pid file" in st.detail
    assert kafka_local.down(tmp_path) is False
    (tmp_path / "broker.pid").write_text(f"{os.getpid()}\n")  # alive, but not a broker
    assert "stale pid file" in kafka_local.status(tmp_path).detail
    assert cli_main(["kafka", "status", "--state-dir", str(tmp_path)]) == 1


def _kernel_thread_pid() -> int | None:
    """A live process with an empty command line (a kernel thread), if /proc shows one."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes() and " Z " not in (entry / "stat").read_text():
                return int(entry.name)
        except OSError:
            continue
    return None


def test_a_stale_pid_naming_a_kernel_thread_is_not_our_broker(tmp_path: Path) -> None:
    """After a reboot the pid file can name a kernel thread (empty /proc cmdline). It
    is not our broker: `up` must not wait for it and signal it, `down` must not
    claim to have stopped it."""
    pid = _kernel_thread_pid()
    if pid is None:
        pytest.skip("no kernel thread visible in /proc here")
    (tmp_path / "broker.pid").write_text(f"{pid}\n")
    (tmp_path / "bootstrap").write_text("127.0.0.1:9\n")
    st = kafka_local.status(tmp_path)
    assert not st.running
    assert "stale pid file" in st.detail
    assert kafka_local.down(tmp_path) is False  # nothing of ours was running


def test_up_on_a_cluster_state_dir_is_refused(tmp_path: Path) -> None:
    """`up --state-dir <a cluster's dir>` (no --brokers) must not start a single broker
    there: `down`/`status` on that dir act on the cluster, so nothing could stop it."""
    (tmp_path / "nodes").write_text("3\n")
    with pytest.raises(kafka_local.KafkaLauncherError, match="3-node cluster"):
        try:
            res = kafka_local.ensure_running(tmp_path, timeout=120)
        except kafka_local.ToolMissingError:
            pytest.skip("no Java/Maven here")
        else:
            os.kill(res.pid, signal.SIGKILL)  # the broker `down` could not have stopped
    assert not (tmp_path / "broker.pid").exists()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SAGALINE_KAFKA_START_TIMEOUT", "2min"),
        ("SAGALINE_KAFKA_PORT", "nine-thousand"),
        ("SAGALINE_KAFKA_PORT", "90920"),
    ],
)
def test_a_malformed_launcher_variable_is_a_clear_error_not_a_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
) -> None:
    monkeypatch.setenv(name, value)
    assert cli_main(["kafka", "up", "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert name in err and repr(value) in err
    assert not (tmp_path / "broker.pid").exists()


def test_a_port_out_of_range_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["kafka", "up", "--state-dir", str(tmp_path), "--port", "90920"]) == 1
    assert "90920 is not a TCP port" in capsys.readouterr().err
    assert not (tmp_path / "broker.pid").exists()


def test_up_fresh_never_deletes_a_data_dir_the_launcher_did_not_make(tmp_path: Path) -> None:
    """`up --fresh --state-dir DIR` empties DIR/data: only when DIR is a broker state
    dir of ours, never someone's own `data/` folder (a mistyped --state-dir)."""
    precious = tmp_path / "data" / "precious.csv"
    precious.parent.mkdir()
    precious.write_text("keep me\n")
    try:
        with pytest.raises(kafka_local.KafkaLauncherError, match="not a broker state dir"):
            _local_or_skip(state_dir=tmp_path, fresh=True, timeout=120)
    finally:
        kafka_local.down(tmp_path)
    assert precious.read_text() == "keep me\n"


def test_missing_tools_give_an_actionable_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_local.shutil, "which", lambda _name: None)
    monkeypatch.setenv("SAGALINE_NO_APT", "1")
    with pytest.raises(kafka_local.ToolMissingError, match="apt-get install"):
        kafka_local.ensure_tools()


def test_cli_registers_kafka_commands() -> None:
    parser = argparse.ArgumentParser()
    kafka_cli.register(parser.add_subparsers())
    for cmd in ("up", "down", "status"):
        assert callable(parser.parse_args(["kafka", cmd]).func)


# A Debian 13 (trixie) apt, faked: no openjdk-17 there, Java 21 is the default.
_FAKE_APT_CACHE = """#!/bin/sh
# apt-cache policy PKG: trixie has no openjdk-17-jre-headless
[ "$1" = policy ] || exit 1
case "$2" in
    openjdk-17-jre-headless) exit 0 ;;
    openjdk-21-jre-headless|default-jre-headless|maven)
        printf '%s:\\n  Installed: (none)\\n  Candidate: 1.0\\n' "$2" ;;
esac
"""
_FAKE_APT_GET = """#!/bin/sh
echo "$@" >>"$(dirname "$0")/apt.log"
case " $* " in *" update "*) exit 0 ;; esac
for pkg in "$@"; do
    case "$pkg" in
        openjdk-17-jre-headless)
            echo "E: Package 'openjdk-17-jre-headless' has no installation candidate" >&2
            exit 100 ;;
        openjdk-21-jre-headless|default-jre-headless)
            printf '#!/bin/sh\\necho '"'"'openjdk version "21.0.8" 2025-07-15'"'"' >&2\\n' \\
                >"$(dirname "$0")/java"; chmod +x "$(dirname "$0")/java" ;;
        maven)
            printf '#!/bin/sh\\n' >"$(dirname "$0")/mvn"; chmod +x "$(dirname "$0")/mvn" ;;
    esac
done
"""


def test_tools_install_on_a_debian_without_openjdk_17(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("apt-cache", _FAKE_APT_CACHE), ("apt-get", _FAKE_APT_GET)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(
        kafka_local.shutil,
        "which",
        lambda name: str(bin_dir / name) if (bin_dir / name).exists() else None,
    )
    monkeypatch.setattr(kafka_local.os, "geteuid", lambda: 0)
    monkeypatch.delenv("SAGALINE_NO_APT", raising=False)
    java, mvn = kafka_local.ensure_tools()
    assert (java, mvn) == (str(bin_dir / "java"), str(bin_dir / "mvn"))
    installs = [
        line.split() for line in (bin_dir / "apt.log").read_text().splitlines() if "install" in line
    ]
    assert [words[-2:] for words in installs] == [["openjdk-21-jre-headless", "maven"]]


def test_java_package_candidates_are_tried_in_order() -> None:
    assert kafka_local.JAVA_APT_PACKAGES[0] == "openjdk-17-jre-headless"
    assert kafka_local.JAVA_APT_PACKAGES[-1] == "default-jre-headless"
    assert kafka_local.choose_java_package(lambda p: True) == "openjdk-17-jre-headless"
    assert kafka_local.choose_java_package(lambda p: p != "openjdk-17-jre-headless") == (
        "openjdk-21-jre-headless"
    )
    assert kafka_local.choose_java_package(lambda p: p == "default-jre-headless") == (
        "default-jre-headless"
    )
    assert kafka_local.choose_java_package(lambda p: False) is None


class _LegacyKafkaContainer:
    """testcontainers 4.8-4.14's ``testcontainers.kafka.KafkaContainer``, faked."""

    def with_kraft(self) -> _LegacyKafkaContainer:
        return self

    def start(self) -> None:
        pass

    def get_bootstrap_server(self) -> str:
        return "legacy-container:9093"


def test_testcontainers_fallback_works_with_the_oldest_allowed_testcontainers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before 4.15 there is no testcontainers.community (None: the import fails).
    monkeypatch.setitem(sys.modules, "testcontainers.community.kafka", None)
    monkeypatch.setitem(sys.modules, "testcontainers.community", None)
    legacy = types.ModuleType("testcontainers.kafka")
    legacy.KafkaContainer = _LegacyKafkaContainer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "testcontainers.kafka", legacy)
    monkeypatch.setattr(broker, "_container", None)
    assert broker._testcontainers_bootstrap() == "legacy-container:9093"


def test_status_of_a_cluster_with_a_damaged_ports_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "nodes").write_text("3\n")
    for node in (1, 2, 3):
        (tmp_path / f"node-{node}").mkdir()
        (tmp_path / f"node-{node}" / "ports").write_text("not ports\n")
    assert cli_main(["kafka", "status", "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "sagaline kafka status:" in err
    assert "missing or damaged" in err


# A Maven that copies one fake Kafka jar, and holds its output until a second run has
# started (at most 5 s): two resolutions at once then overlap for certain.
_FAKE_MVN = """#!/bin/sh
dir="$(dirname "$0")"
for arg in "$@"; do
    case "$arg" in -DoutputDirectory=*) out="${arg#-DoutputDirectory=}" ;; esac
done
echo run >>"$dir/mvn.log"
mkdir -p "$out" && : >"$out/kafka_2.13-9.9.9.jar"
i=0
while [ "$(wc -l <"$dir/mvn.log")" -lt 2 ] && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
"""


def test_two_launchers_resolving_the_same_jars_at_once_both_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two brokers started at once on a fresh machine (two state dirs, e.g. `kafka up`
    and `kafka up --brokers 3`, or two test sessions) share the jar cache: the second
    resolution deleted the first's half-copied jars, and one of them failed with
    "Maven could not resolve ... is Maven Central reachable?" (or deleted the libs
    folder the other had just made). Maven now runs once; the other waits for it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text(_FAKE_MVN)
    mvn.chmod(0o755)
    monkeypatch.setattr(kafka_local, "ensure_tools", lambda: ("java", str(mvn)))
    cache = tmp_path / "cache"

    def resolve() -> tuple[str, Path]:
        return kafka_local.resolve_jars("9.9.9", cache)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(resolve) for _ in range(2)]
        results = [future.result(timeout=60) for future in futures]
    libs = cache / "kafka" / "9.9.9" / "libs"
    assert results == [("9.9.9", libs), ("9.9.9", libs)]
    assert (libs / "kafka_2.13-9.9.9.jar").exists()
    assert (bin_dir / "mvn.log").read_text().splitlines() == ["run"]


@pytest.mark.parametrize(
    "argv",
    [["demo", "--sagas", "1", "--no-ui"], ["coordinator", "run", "--dev-broker"]],
    ids=["demo", "dev-broker"],
)
def test_a_command_that_cannot_start_the_local_broker_says_why_without_a_traceback(
    tmp_path: Path, argv: list[str]
) -> None:
    """`sagaline demo` (or a command with `--dev-broker`) on a machine without Java and
    Maven, not root: the launcher's message (what to install, or which variable to
    set) was the last line of a Python traceback. Now it is the whole output, exit 1."""
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env.update(
        PATH=str(tmp_path / "empty-bin"),  # no java, no mvn
        SAGALINE_NO_APT="1",
        SAGALINE_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: no Kafka broker available"), done.stderr
    assert "the local Kafka broker needs Java 17+ and Maven" in done.stderr
    assert "KAFKA_BOOTSTRAP_SERVERS" in done.stderr


def test_up_on_a_state_dir_that_cannot_be_made_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache or state dir that cannot be created (HOME read-only or missing,
    SAGALINE_CACHE_DIR naming a file, a mistyped --state-dir): `sagaline kafka up`
    ended in a FileExistsError/PermissionError traceback. Now it says which dir and
    what to set, exit 1."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    state = blocker / "broker"
    assert cli_main(["kafka", "up", "--state-dir", str(state)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"sagaline kafka up: cannot use {state}"), err
    assert "--state-dir" in err and "SAGALINE_CACHE_DIR" in err


def test_a_failed_start_quotes_its_own_log_lines_not_an_earlier_start(tmp_path: Path) -> None:
    """broker.log keeps every start's output. A start that died at once (a few lines:
    here java cannot find kafka.Kafka, e.g. a damaged jar cache) was reported from the
    last 40 lines of the whole file, so an earlier start's "Address already in use"
    made it a PortInUseError telling the user to run `up` again for free ports (and an
    earlier "Failed to acquire lock" one blaming another Kafka process). Now only this
    start's lines count."""
    state = tmp_path / "broker"
    state.mkdir()
    (state / "broker.log").write_text(
        "\n===== sagaline: starting broker at 2025-01-01 10:00:00 =====\n"
        "[2025-01-01 10:00:01] ERROR [KafkaServer] Address already in use (kafka.Kafka$)\n"
    )
    java = tmp_path / "java"
    java.write_text(
        "#!/bin/sh\necho 'Error: Could not find or load main class kafka.Kafka'\nexit 1\n"
    )
    java.chmod(0o755)
    pid = kafka_local._spawn(str(java), tmp_path / "libs", state)
    port = kafka_local.free_port()
    with pytest.raises(kafka_local.KafkaLauncherError) as raised:
        kafka_local._wait_ready(state, pid, f"127.0.0.1:{port}", port, 60.0)
    assert type(raised.value) is kafka_local.StartupError, raised.value
    message = str(raised.value)
    assert "exited during start-up" in message
    assert "Could not find or load main class kafka.Kafka" in message
    assert "Address already in use" not in message


@pytest.mark.kafka
def test_the_broker_is_known_by_its_state_dir_through_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default state dir is not resolved (the broker's command line names it as
    given), a --state-dir is. With a symlink on the way (a symlinked HOME or cache),
    `sagaline kafka status --state-dir <the same dir>` said "stale pid file", and
    `down --state-dir` deleted the running broker's pid file without stopping it:
    the next `up` then failed on the data dir's lock. Both now know it."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    version, libs = kafka_local.resolve_jars()  # the jars already cached, not a copy
    monkeypatch.setattr(kafka_local, "resolve_jars", lambda *_a: (version, libs))
    monkeypatch.setenv("SAGALINE_CACHE_DIR", str(tmp_path / "link" / "cache"))
    state = kafka_local.default_state_dir()
    res = _local_or_skip()
    try:
        assert kafka_local.status(str(state)).running
        assert kafka_local.down(str(state)) is True
        assert not kafka_local._pid_alive(res.pid)
    finally:
        if kafka_local._pid_alive(res.pid):
            os.kill(res.pid, signal.SIGKILL)


@pytest.mark.parametrize("command", ["up", "down", "status"])
@pytest.mark.parametrize("brokers", ["0", "-3"])
def test_a_broker_count_below_one_is_a_usage_error_not_the_single_broker(
    command: str, brokers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kafka up --brokers 0` started (and `down --brokers 0` stopped) the single
    broker, as if `--brokers 1` had been given: a typo acted on the shared broker."""
    from services.cli import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["kafka", command, "--brokers", brokers])
    assert stopped.value.code == 2
    assert "--brokers" in capsys.readouterr().err
