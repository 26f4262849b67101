"""Run a real single-node Apache Kafka (KRaft) broker on this machine, without Docker.

Why this exists: Sagaline's tests, demo and CI must talk to a *real* Kafka broker
(transactions, consumer groups and partitioning behave in ways no fake reproduces),
but our machines and CI have no Docker engine. They do have Java and Maven (or can
get them from Debian), and Maven Central serves the Kafka broker itself as ordinary
jars. So this module:

1. resolves ``org.apache.kafka:kafka_2.13`` plus log4j2/slf4j with Maven into a
   per-version cache folder, once (a marker file records success; later runs never
   touch the network);
2. keeps a *state dir* per broker (``~/.cache/sagaline/broker`` by default) with a
   generated ``server.properties``, a log4j2 config, the cluster id, the chosen
   ports, the KRaft data dir, the broker log, a pid file and a ``bootstrap`` file;
3. formats the data dir with ``kafka.tools.StorageTool`` (first start only) and
   starts ``kafka.Kafka`` detached, so the broker outlives the command or test
   session that started it and is reused by the next one (a JVM start costs
   seconds on two cores; reuse costs one metadata request);
4. treats "running" as *pid alive, and that pid is our broker, and it answers a
   metadata request*, so stale pid files (after ``kill -9``, a reboot, or a CI
   machine that ended every process) are detected and the broker is simply started
   again on the same data dir (KRaft recovers its log; the OS releases the data-dir
   lock when the process dies).

Everything that can go wrong for a user is raised as :class:`KafkaLauncherError`
(or a subclass) with a message that says what to do.

Environment:

``SAGALINE_CACHE_DIR``
    Root of the cache (default ``$XDG_CACHE_HOME/sagaline`` or ``~/.cache/sagaline``).
    Jars go to ``<root>/kafka/<version>/libs``, the default broker to ``<root>/broker``.
``SAGALINE_KAFKA_VERSION``
    Pin one Kafka version instead of trying :data:`CANDIDATE_VERSIONS` in order.
``SAGALINE_KAFKA_START_TIMEOUT``
    Seconds to wait for the broker to answer after start (default 120).
``SAGALINE_NO_APT``
    Set to ``1`` to never ``apt-get install`` Java or Maven, even as root.

``ensure_running(..., sasl=True)`` adds a second listener, SASL_PLAINTEXT with the
PLAIN mechanism, for testing clients configured like production ones: one generated
password per principal (``coordinator``, ``participant``, ``agent``, ``operator``),
kept in the state dir (mode 0600) and returned by :func:`sasl_listener`.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CANDIDATE_VERSIONS",
    "BrokerStatus",
    "ClusterNode",
    "KafkaLauncherError",
    "MavenResolutionError",
    "PortInUseError",
    "SaslListener",
    "StartupError",
    "ToolMissingError",
    "UpResult",
    "cluster_down",
    "cluster_nodes",
    "cluster_status",
    "default_cache_dir",
    "default_cluster_dir",
    "default_state_dir",
    "down",
    "ensure_cluster",
    "ensure_port_free",
    "ensure_running",
    "free_port",
    "kill",
    "kill_node",
    "metadata_answers",
    "new_cluster_id",
    "render_server_properties",
    "resolve_jars",
    "sasl_listener",
    "start_node",
    "status",
    "stop_node",
    "up",
]

#: Kafka versions tried in order when none is pinned. 4.1.0 first (what we develop
#: against); the others are known to be served by Maven Central here.
CANDIDATE_VERSIONS: tuple[str, ...] = ("4.1.0", "4.1.1", "4.0.1", "4.2.0", "4.0.0")
LOG4J_VERSION = "2.25.1"
SLF4J_VERSION = "2.0.17"
DEPENDENCY_PLUGIN_VERSION = "3.8.1"

HOST = "127.0.0.1"
DEFAULT_START_TIMEOUT = 120.0
DEFAULT_STOP_TIMEOUT = 30.0
# The shared development broker accumulates every test run's topics (unique prefixes,
# never deleted): at ~12,000 partitions a 512 MB heap ran out (OutOfMemoryError, a
# crash loop). A ceiling, not a reservation: the JVM only grows into it when needed.
JVM_HEAP = ("-Xms256m", "-Xmx2g")

# Files inside a state dir.
PID_FILE = "broker.pid"
BOOTSTRAP_FILE = "bootstrap"
CLUSTER_ID_FILE = "cluster.id"
PORTS_FILE = "ports"
VERSION_FILE = "kafka.version"
LOG_FILE = "broker.log"
START_MARKER = "===== sagaline: starting broker at"  # opens each start's lines in LOG_FILE
LOCK_FILE = "launcher.lock"
SERVER_PROPERTIES = "server.properties"
SASL_FILE = "sasl.json"  # the SASL listener's port and the principals' passwords
SASL_PRINCIPALS = ("coordinator", "participant", "agent", "operator")
LOG4J_PROPERTIES = "log4j2.properties"
DATA_DIR = "data"


class KafkaLauncherError(RuntimeError):
    """Something stops the local broker from running; the message says what to do."""


class ToolMissingError(KafkaLauncherError):
    """Java or Maven is missing (or too old) and could not be installed."""


class MavenResolutionError(KafkaLauncherError):
    """Maven could not resolve the Kafka jars for any candidate version."""


class PortInUseError(KafkaLauncherError):
    """A port the broker must listen on is taken by another process."""


class StartupError(KafkaLauncherError):
    """The broker process exited, or did not answer in time, after being started."""


@dataclass(frozen=True)
class UpResult:
    """What :func:`ensure_running` found or did."""

    bootstrap: str
    started: bool  # False when an already-running broker was reused
    pid: int
    version: str
    state_dir: Path


@dataclass(frozen=True)
class SaslListener:
    """The SASL_PLAINTEXT (PLAIN) listener of a local broker and who may log in."""

    bootstrap: str
    passwords: dict[str, str]  # principal -> password

    def client_env(self, principal: str) -> dict[str, str]:
        """The environment a Sagaline process needs to connect as ``principal``."""
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "SAGALINE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "SAGALINE_KAFKA_SASL_MECHANISM": "PLAIN",
            "SAGALINE_KAFKA_SASL_USERNAME": principal,
            "SAGALINE_KAFKA_SASL_PASSWORD": self.passwords[principal],
        }

    def __repr__(self) -> str:  # never print the passwords
        return f"SaslListener({self.bootstrap!r}, principals={sorted(self.passwords)})"


@dataclass(frozen=True)
class BrokerStatus:
    """A snapshot of one state dir, as reported by :func:`status`."""

    running: bool
    state_dir: Path
    bootstrap: str | None
    pid: int | None
    version: str | None
    log_file: Path
    detail: str


# --------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """``$SAGALINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/sagaline``, else ``~/.cache/sagaline``.

    Always absolute (a relative setting is taken from the current directory): the
    broker runs with its state dir as working directory, where a relative jar or
    config path would point nowhere. Not resolved, so a running broker's command
    line, which names this path, still matches it.
    """
    env = os.environ.get("SAGALINE_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "sagaline").absolute()


def default_state_dir() -> Path:
    """The state dir of the shared, reused broker: ``<cache>/broker``."""
    return default_cache_dir() / "broker"


def _state(state_dir: Path | str | None) -> Path:
    return Path(state_dir).expanduser().resolve() if state_dir else default_state_dir()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------- tools


def _apt_allowed() -> bool:
    return (
        os.geteuid() == 0
        and shutil.which("apt-get") is not None
        and os.environ.get("SAGALINE_NO_APT", "") not in ("1", "true", "yes")
    )


# The Debian/Ubuntu package that gives Java 17+, first one the archive has: Debian 12
# and Ubuntu 22.04/24.04 ship openjdk-17, Debian 13 only openjdk-21 (and its
# default-jre-headless). scripts/bootstrap.sh installs through ensure_tools() too.
JAVA_APT_PACKAGES = ("openjdk-17-jre-headless", "openjdk-21-jre-headless", "default-jre-headless")
MAVEN_APT_PACKAGE = "maven"
_TOOLS_HINT = (
    f"Install Java 17+ and Maven (Debian/Ubuntu: `sudo apt-get install JAVA {MAVEN_APT_PACKAGE}`,"
    f" JAVA the first of {', '.join(JAVA_APT_PACKAGES)} that `apt-cache policy` offers), "
    "or point KAFKA_BOOTSTRAP_SERVERS at a running Kafka broker."
)


def choose_java_package(available: Callable[[str], bool]) -> str | None:
    """The first of :data:`JAVA_APT_PACKAGES` for which ``available`` says yes."""
    return next((pkg for pkg in JAVA_APT_PACKAGES if available(pkg)), None)


def _apt_has_candidate(package: str) -> bool:
    """Whether apt can install ``package`` (``apt-cache policy`` names a candidate)."""
    proc = subprocess.run(
        ["apt-cache", "policy", package], capture_output=True, text=True, check=False
    )
    match = re.search(r"^\s*Candidate:\s*(\S+)", proc.stdout, re.MULTILINE)
    return proc.returncode == 0 and match is not None and match.group(1) != "(none)"


def _apt_install(tools: list[str]) -> str | None:
    """Install the Debian packages for ``tools`` (``java``, ``mvn``); return None on
    success, else what went wrong."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    update = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-qq"]
    proc = subprocess.run(update, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return (proc.stdout + proc.stderr)[-2000:]
    packages = []
    if "java" in tools:
        java = choose_java_package(_apt_has_candidate)
        if java is None:
            return f"apt offers none of {', '.join(JAVA_APT_PACKAGES)}"
        packages.append(java)
    if "mvn" in tools:
        packages.append(MAVEN_APT_PACKAGE)
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-qq"]
    install += ["--no-install-recommends", *packages]
    proc = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"`apt-get install {' '.join(packages)}`: " + (proc.stdout + proc.stderr)[-2000:]
    return None


def _java_major(java: str) -> int | None:
    proc = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def ensure_tools() -> tuple[str, str]:
    """Return paths of ``java`` (17+) and ``mvn``, installing them with apt if needed.

    Installing is only attempted as root with apt-get present (CI runs as root on a
    fresh machine); otherwise the error tells the user what to install.
    """
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        if not _apt_allowed():
            raise ToolMissingError(
                f"the local Kafka broker needs Java 17+ and Maven, but {', '.join(missing)} "
                f"is not installed (and apt-get is not used here: not root, or "
                f"SAGALINE_NO_APT). {_TOOLS_HINT}"
            )
        err = _apt_install(missing)
        if err is not None:
            raise ToolMissingError(
                f"installing {', '.join(missing)} with apt-get failed, so the local Kafka "
                f"broker cannot run:\n{err}\n{_TOOLS_HINT}"
            )
    java, mvn = shutil.which("java"), shutil.which("mvn")
    if java is None or mvn is None:
        raise ToolMissingError("java/mvn still not on PATH after installing them; check PATH.")
    major = _java_major(java)
    if major is not None and major < 17:
        raise ToolMissingError(
            f"{java} is Java {major}; Kafka 4.x needs Java 17 or newer. Install one of "
            f"{', '.join(JAVA_APT_PACKAGES)} and put it first on PATH."
        )
    return java, mvn


# --------------------------------------------------------------------------- jars


def _pom(version: str) -> str:
    deps = [
        ("org.apache.kafka", "kafka_2.13", version),
        ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-slf4j2-impl", LOG4J_VERSION),
        ("org.slf4j", "slf4j-api", SLF4J_VERSION),
    ]
    dep_xml = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in deps
    )
    # scala-library is deliberately not pinned: Kafka pins scala-reflect to the same
    # version and not every scala-reflect release is served.
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.sagaline</groupId>
  <artifactId>kafka-local-libs</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{dep_xml}
  </dependencies>
  <build><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId>
    <artifactId>maven-dependency-plugin</artifactId>
    <version>{DEPENDENCY_PLUGIN_VERSION}</version>
  </plugin></plugins></build>
</project>
"""


def _cached_libs(cache: Path, version: str) -> Path | None:
    vdir = cache / "kafka" / version
    libs = vdir / "libs"
    if (vdir / ".resolved").exists() and (libs / f"kafka_2.13-{version}.jar").exists():
        return libs
    return None


def _resolve_one(mvn: str, cache: Path, version: str) -> Path:
    vdir = cache / "kafka" / version
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "pom.xml").write_text(_pom(version))
    tmp = vdir / "libs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        mvn, "-B", "-q", "-f", str(vdir / "pom.xml"),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={tmp}",
        "-DincludeScope=runtime",
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, check=False, cwd=vdir
        )
    except subprocess.TimeoutExpired as exc:
        raise MavenResolutionError(f"Kafka {version}: mvn timed out after 30 min") from exc
    if proc.returncode != 0 or not (tmp / f"kafka_2.13-{version}.jar").exists():
        out = (proc.stdout + proc.stderr).strip().splitlines()
        raise MavenResolutionError(f"Kafka {version}: " + "\n".join(out[-15:]))
    libs = vdir / "libs"
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    (vdir / ".resolved").write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    return libs


def resolve_jars(
    version: str | None = None, cache_dir: Path | str | None = None
) -> tuple[str, Path]:
    """Return ``(kafka_version, libs_dir)``, resolving with Maven only if not cached.

    With no ``version`` (and no ``SAGALINE_KAFKA_VERSION``), an already-cached
    candidate wins (so an offline machine keeps working); otherwise the candidates
    are resolved in order until one succeeds.
    """
    cache = Path(cache_dir).expanduser().absolute() if cache_dir else default_cache_dir()
    pinned = version or os.environ.get("SAGALINE_KAFKA_VERSION") or None
    candidates = (pinned,) if pinned else CANDIDATE_VERSIONS
    for v in candidates:
        libs = _cached_libs(cache, v)
        if libs is not None:
            return v, libs
    _, mvn = ensure_tools()
    errors: list[str] = []
    for v in candidates:
        # One resolution of a version at a time: launchers of other state dirs share
        # this cache, and a second Maven run would delete the first's jars mid-copy.
        with _locked(cache / "kafka" / v, "the Kafka jar cache"):
            libs = _cached_libs(cache, v)  # resolved meanwhile by the one we waited for
            if libs is not None:
                return v, libs
            try:
                return v, _resolve_one(mvn, cache, v)
            except MavenResolutionError as exc:
                errors.append(str(exc))
    raise MavenResolutionError(
        "Maven could not resolve the Kafka broker jars for any of "
        f"{', '.join(candidates)} (is Maven Central reachable? try "
        f"`mvn dependency:get -Dartifact=org.apache.kafka:kafka_2.13:{candidates[0]}`).\n"
        + "\n---\n".join(errors)
    )


# --------------------------------------------------------------------------- ports


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now (chosen by the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _port_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR mirrors what the JVM does, so TIME_WAIT leftovers of our own
        # broker's previous run do not count as "taken".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


PORT_RELEASE_WAIT = 30.0


def _port_freed(port: int, timeout: float = PORT_RELEASE_WAIT) -> bool:
    """True once ``port`` can be bound, polling up to ``timeout`` seconds.

    A broker restarted after ``kill -9`` must come back on its old address (its
    clients keep reconnecting there), but the port can stay taken for a moment:
    the dead broker's sockets are still closing, or a client's outgoing connection
    briefly got it as its ephemeral port. So a remembered port is waited for
    before the launcher gives up on it.
    """
    deadline = time.monotonic() + timeout
    while not _port_free(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def ensure_port_free(port: int, host: str = HOST, *, what: str = "Kafka") -> None:
    """Raise :class:`PortInUseError` if ``host:port`` cannot be bound."""
    if not 0 < port < 65536:
        raise KafkaLauncherError(f"{what} port {port} is not a TCP port (1-65535).")
    if not _port_free(port, host):
        raise PortInUseError(
            f"{what} port {host}:{port} is already in use by another process. Stop "
            f"that process (`ss -ltnp 'sport = :{port}'` shows which), or choose "
            "another port (or none, to let the launcher pick a free one)."
        )


def _accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- config


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes as 22-char unpadded base64url.

    Like Kafka's own ``Uuid.randomUuid()``, ids starting with ``-`` are avoided so
    they never look like a command-line flag to StorageTool.
    """
    while True:
        cid = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def render_server_properties(
    *,
    port: int,
    controller_port: int,
    data_dir: Path,
    host: str = HOST,
    sasl: SaslListener | None = None,
    acls: bool = False,
    node_id: int = 1,
    voters: str | None = None,
    replication: int = 1,
) -> str:
    """The broker+controller config for one node on loopback, sized for 2 cores;
    with ``sasl``, plus a SASL_PLAINTEXT listener (PLAIN) for its principals; with
    ``acls``, KRaft's ``StandardAuthorizer`` enforces ACLs, and ``User:ANONYMOUS`` (the
    PLAINTEXT and CONTROLLER listeners: the launcher, inter-broker traffic, and
    whoever administers ACLs) is the super user.

    A single node by default. For a node of an N-node cluster pass its ``node_id``,
    the static quorum ``voters`` (``1@host:cport,2@host:cport,...``) and
    ``replication`` = N (capped at 3): internal topics are then replicated N times
    and need ``min(2, N)`` in-sync replicas, so one node can be lost.
    """
    min_isr = 2 if replication >= 3 else 1
    props: dict[str, Any] = {
        # KRaft combined mode, static quorum (one voter, or every node of a
        # cluster): no --standalone needed.
        "process.roles": "broker,controller",
        "node.id": node_id,
        "controller.quorum.voters": voters or f"{node_id}@{host}:{controller_port}",
        "controller.listener.names": "CONTROLLER",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        # Topics are created explicitly by the code that owns them.
        "auto.create.topics.enable": "false",
        "num.partitions": 1,
        "default.replication.factor": replication,
        "min.insync.replicas": min_isr,
        # Internal topics: one partition; RF 1 on a single broker, RF N (min ISR 2)
        # on a cluster, so consumer offsets and transactions survive a lost node.
        "offsets.topic.replication.factor": replication,
        "offsets.topic.num.partitions": 1,
        "transaction.state.log.replication.factor": replication,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": 1,
        "share.coordinator.state.topic.replication.factor": replication,
        "share.coordinator.state.topic.min.isr": min_isr,
        "share.coordinator.state.topic.num.partitions": 1,
        # No 3 s wait before the first rebalance of a new group: tests start fast.
        "group.initial.rebalance.delay.ms": 0,
        # Cap client transaction timeouts at 2 min (librdkafka/Java default is 60 s,
        # so default clients still work) and abort timed-out transactions of crashed
        # producers within ~1 s of expiry instead of 10 s.
        "transaction.max.timeout.ms": 120000,
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": 1000,
        # After a SIGKILL the restarted broker is refused (DUPLICATE_BROKER_REGISTRATION)
        # until the dead incarnation's session expires: 9 s by default. 5 s (five
        # missed 1 s heartbeats) keeps restarts in fault tests quick without fencing a
        # live broker on a busy 2-core machine.
        "broker.session.timeout.ms": 5000,
        "broker.heartbeat.interval.ms": 1000,
        # Two cores: few threads.
        "num.network.threads": 2,
        "num.io.threads": 4,
        "background.threads": 4,
        "num.recovery.threads.per.data.dir": 1,
        "num.replica.fetchers": 1,
        "log.cleaner.threads": 1,
    }
    if sasl is not None:
        sasl_port = sasl.bootstrap.rpartition(":")[2]
        props["listeners"] += f",SASL_PLAINTEXT://{host}:{sasl_port}"
        props["advertised.listeners"] += f",SASL_PLAINTEXT://{host}:{sasl_port}"
        props["listener.security.protocol.map"] += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
        props["sasl.enabled.mechanisms"] = "PLAIN"
        # The JAAS config as a broker property: no JVM flag, no extra file.
        users = " ".join(f'user_{name}="{pw}"' for name, pw in sorted(sasl.passwords.items()))
        props["listener.name.sasl_plaintext.plain.sasl.jaas.config"] = (
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"
        )
    if acls:
        props["authorizer.class.name"] = AUTHORIZER
        props["super.users"] = "User:ANONYMOUS"
    lines = [GENERATED_HEADER]
    lines += [f"{k}={v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


GENERATED_HEADER = "# Generated by services/kafka_local.py; rewritten on every start."
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def _enforces_acls(state: Path) -> bool:
    """Whether the broker of ``state`` was started with an authorizer."""
    return f"authorizer.class.name={AUTHORIZER}" in (_read(state / SERVER_PROPERTIES) or "")


def _is_broker_state_dir(state: Path) -> bool:
    """Whether ``state`` holds a broker this launcher configured (its generated
    ``server.properties``), so its ``data/`` is a Kafka log dir of ours."""
    return (_read(state / SERVER_PROPERTIES) or "").startswith(GENERATED_HEADER)


LOG4J2_PROPERTIES = """\
# Generated by services/kafka_local.py. WARN and above to the console, which the
# launcher redirects to broker.log; plus the one INFO line that says "started".
status = warn
name = sagaline-kafka
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
logger.raftserver.name = kafka.server.KafkaRaftServer
logger.raftserver.level = INFO
"""


# --------------------------------------------------------------------------- process


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _pid_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _is_our_broker(pid: int, state: Path) -> bool:
    """Pid alive *and* it is ``kafka.Kafka`` with this state dir's config.

    Pids are reused after a reboot or a crash; a bare "pid exists" check would
    mistake an unrelated process for the broker.
    """
    if not _pid_alive(pid):
        return False
    cmd = _cmdline(pid)
    if not cmd:
        # No /proc (not Linux): trust the pid. With /proc, an empty command line is
        # a kernel thread (a pid reused after a reboot), never our JVM.
        return not Path("/proc/self/cmdline").exists()
    if "kafka.Kafka" not in cmd:
        return False
    # The config path as the broker was started with it: the default state dir is not
    # resolved, a --state-dir is, so the same dir may be spelled through a symlink.
    config = state / SERVER_PROPERTIES
    if str(config) in cmd:
        return True
    wanted = config.resolve()
    return any(arg.endswith(SERVER_PROPERTIES) and Path(arg).resolve() == wanted for arg in cmd)


def _read_pid(state: Path) -> int | None:
    text = _read(state / PID_FILE)
    return int(text) if text and text.isdigit() else None


def _log_tail(state: Path, lines: int = 40) -> str:
    """The last ``lines`` lines the latest start wrote (the log keeps every start's:
    an earlier start's error must not be taken for this one's)."""
    try:
        text = (state / LOG_FILE).read_text(errors="replace")
    except FileNotFoundError:
        return "(no broker log yet)"
    _, marker, text = text.rpartition(START_MARKER)
    if marker:
        text = text.partition("\n")[2]  # the rest of the marker's line
    tail = text.strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else "(nothing in the broker log from this start)"


def metadata_answers(bootstrap: str, timeout: float = 5.0) -> bool:
    """True if a broker at ``bootstrap`` answers a metadata request within ``timeout``."""
    from sagaline.kafka import ClientConfig, create_admin

    # The launcher's own plaintext listener: no deployment settings (SASL...) apply.
    client = create_admin(
        ClientConfig(bootstrap),
        **{
            "socket.connection.setup.timeout.ms": max(1000, int(timeout * 1000)),
            "log_level": 0,  # a probe: connection-refused chatter is expected
            "error_cb": lambda _err: None,
        },
    )
    try:
        md = client.list_topics(timeout=timeout)
    except Exception:
        return False
    return bool(md.brokers)


@contextlib.contextmanager
def _locked(state: Path, what: str = "the broker's state dir") -> Iterator[None]:
    """Serialize up/down across processes (parallel test runs, two shells)."""
    try:
        state.mkdir(parents=True, exist_ok=True)
        fh = open(state / LOCK_FILE, "a+")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise KafkaLauncherError(
            f"cannot use {state} as {what}: {exc.strerror or exc}. Point --state-dir, or "
            "SAGALINE_CACHE_DIR (default ~/.cache/sagaline), at a directory you can write."
        ) from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _choose_ports(state: Path, port: int | None, controller_port: int | None) -> tuple[int, int]:
    """Explicit ports must be free (else :class:`PortInUseError`); remembered ports are
    reused when free, so the bootstrap address stays stable across restarts; otherwise
    the OS picks free ones."""
    saved = (_read(state / PORTS_FILE) or "").split()
    saved_port = int(saved[0]) if len(saved) == 2 and saved[0].isdigit() else None
    saved_cport = int(saved[1]) if len(saved) == 2 and saved[1].isdigit() else None
    if port is None:
        port = _env_port()

    def pick(explicit: int | None, remembered: int | None, what: str, avoid: int) -> int:
        if explicit is not None:
            ensure_port_free(explicit, what=what)
            return explicit
        if remembered is not None and remembered != avoid and _port_freed(remembered):
            return remembered
        while True:
            candidate = free_port()
            if candidate != avoid:
                return candidate

    p = pick(port, saved_port, "Kafka", avoid=-1)
    c = pick(controller_port, saved_cport, "Kafka controller", avoid=p)
    if p == c:
        raise PortInUseError(f"broker and controller ports must differ (both {p}).")
    (state / PORTS_FILE).write_text(f"{p} {c}\n")
    return p, c


def sasl_listener(state_dir: Path | str | None = None) -> SaslListener | None:
    """The SASL listener of the broker of ``state_dir``, if it was started with one."""
    raw = _read(_state(state_dir) / SASL_FILE)
    if raw is None:
        return None
    saved = json.loads(raw)
    return SaslListener(f"{HOST}:{saved['port']}", dict(saved["passwords"]))


def _choose_sasl(state: Path, avoid: tuple[int, int]) -> SaslListener:
    """The SASL port (remembered when still free) and the principals' passwords
    (generated once per state dir)."""
    known = sasl_listener(state)
    port = int(known.bootstrap.rpartition(":")[2]) if known else None
    if port is None or port in avoid or not _port_free(port):
        port = next(p for p in iter(free_port, None) if p not in avoid)
    passwords = dict(known.passwords) if known else {}
    for name in SASL_PRINCIPALS:
        passwords.setdefault(name, secrets.token_urlsafe(18))
    path = state / SASL_FILE
    path.touch(mode=0o600)
    path.write_text(json.dumps({"port": port, "passwords": passwords}))
    return SaslListener(f"{HOST}:{port}", passwords)


def _format(java: str, libs: Path, state: Path) -> None:
    data = state / DATA_DIR
    meta = data / "meta.properties"
    if meta.exists():
        # Already formatted: keep its cluster id (the data dir is what matters).
        found = re.search(r"^cluster\.id=(\S+)$", meta.read_text(), re.M)
        if found:
            (state / CLUSTER_ID_FILE).write_text(found.group(1) + "\n")
        return
    cluster_id = _read(state / CLUSTER_ID_FILE) or new_cluster_id()
    (state / CLUSTER_ID_FILE).write_text(cluster_id + "\n")
    cmd = [
        java, *JVM_HEAP, f"-Dlog4j2.configurationFile={state / LOG4J_PROPERTIES}",
        "-cp", f"{libs}/*", "kafka.tools.StorageTool", "format",
        "-c", str(state / SERVER_PROPERTIES), "-t", cluster_id, "-g",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise StartupError(
            f"kafka.tools.StorageTool format failed (exit {proc.returncode}) for "
            f"{data}:\n{(proc.stdout + proc.stderr).strip()[-3000:]}\n"
            f"If the data dir is corrupt, remove {data} and run again."
        )


def _spawn(java: str, libs: Path, state: Path, heap: tuple[str, ...] = JVM_HEAP) -> int:
    """Start the broker detached and return its pid.

    A throw-away ``sh`` backgrounds java in a new session and prints its pid, then
    exits; java is re-parented to init. So the broker is not our child: it outlives
    us, leaves no zombie, and no ``Popen`` object warns about it at exit.
    """
    cmd = [
        java, *heap, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={state / LOG4J_PROPERTIES}",
        f"-Dkafka.logs.dir={state}",
        "-cp", f"{libs}/*", "kafka.Kafka", str(state / SERVER_PROPERTIES),
    ]  # fmt: skip
    log = state / LOG_FILE
    with open(log, "a") as fh:
        fh.write(f"\n{START_MARKER} {time.strftime('%F %T')} =====\n")
    proc = subprocess.run(
        ["sh", "-c", 'LOG="$1"; shift; "$@" </dev/null >>"$LOG" 2>&1 & echo $!', "sh",
         str(log), *cmd],
        capture_output=True, text=True, start_new_session=True, cwd=state, check=False,
        timeout=30,
    )  # fmt: skip
    pid_text = proc.stdout.strip()
    if proc.returncode != 0 or not pid_text.isdigit():
        raise StartupError(f"could not start java: {proc.stderr.strip() or pid_text}")
    return int(pid_text)


def _wait_ready(state: Path, pid: int, bootstrap: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            tail = _log_tail(state)
            if "Address already in use" in tail:
                raise PortInUseError(
                    f"the broker could not bind its ports (another process took them). "
                    f"Run `sagaline kafka up` again to pick free ones.\n{tail}"
                )
            if "Failed to acquire lock" in tail:
                raise StartupError(
                    f"another Kafka process is using {state / DATA_DIR} (one this launcher "
                    f"did not start, or whose pid file was lost). Find it with "
                    f"`pgrep -af {state / SERVER_PROPERTIES}`, stop it, and run again.\n{tail}"
                )
            raise StartupError(
                f"the Kafka broker (pid {pid}) exited during start-up. "
                f"Last lines of {state / LOG_FILE}:\n{tail}"
            )
        if _accepts(HOST, port) and metadata_answers(bootstrap, timeout=2.0):
            return
        time.sleep(0.25)
    raise StartupError(
        f"the Kafka broker (pid {pid}) did not answer a metadata request on {bootstrap} "
        f"within {timeout:.0f}s (raise SAGALINE_KAFKA_START_TIMEOUT if this machine is "
        f"slow). Last lines of {state / LOG_FILE}:\n{_log_tail(state)}"
    )


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM (clean KRaft shutdown), then SIGKILL after ``timeout`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.1)


def _env_number(name: str, kind: type[int] | type[float]) -> int | float | None:
    """A numeric launcher variable, or None when unset; a malformed one is a
    :class:`KafkaLauncherError` naming it (not a traceback)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value <= 0 or (kind is int and value > 65535):
        what = "a port number" if kind is int else "a number of seconds"
        raise KafkaLauncherError(f"{name}={raw!r} is not {what}; fix or unset it.")
    return value


def _env_port() -> int | None:
    port = _env_number("SAGALINE_KAFKA_PORT", int)
    return None if port is None else int(port)


def _start_timeout(timeout: float | None) -> float:
    if timeout is not None:
        return timeout
    env = _env_number("SAGALINE_KAFKA_START_TIMEOUT", float)
    return float(env) if env is not None else DEFAULT_START_TIMEOUT


# --------------------------------------------------------------------------- API


def ensure_running(
    state_dir: Path | str | None = None,
    *,
    port: int | None = None,
    controller_port: int | None = None,
    version: str | None = None,
    timeout: float | None = None,
    sasl: bool = False,
    acls: bool = False,
    fresh: bool = False,
) -> UpResult:
    """Reuse the broker of ``state_dir`` if it is running and answers; else start it.

    ``fresh=True`` stops a running broker of ``state_dir`` and starts it again on an
    empty data dir (same ports, a new cluster id). Nothing deletes topics on a
    long-lived development broker, and every test run and demo adds its own: at a few
    thousand partitions the broker spends its first minute after start-up loading
    them, and topics created meanwhile stay invisible long enough for setup to time
    out. CI starts fresh for that reason (``scripts/test.sh``).

    ``sasl=True`` starts it with a second, SASL_PLAINTEXT listener (see
    :func:`sasl_listener`); a running broker without one is refused, not reused.
    ``acls=True`` (with ``sasl=True``) starts it enforcing ACLs (KRaft's
    ``StandardAuthorizer``): the SASL principals get only what is granted them, and
    ``User:ANONYMOUS``, the PLAINTEXT listener, is the super user that grants it. A
    running broker that does not match ``acls`` is refused, not reused.

    ``port``/``controller_port`` fix the ports (a taken one raises
    :class:`PortInUseError`); by default the ports remembered in the state dir are
    reused, or free ones are picked on first start. Blocks until the broker answers a
    metadata request, or raises :class:`StartupError` quoting the broker log.
    """
    state = _state(state_dir)
    wait = _start_timeout(timeout)
    env_port = _env_port()
    if acls and not sasl:
        raise KafkaLauncherError(
            "acls=True needs sasl=True: without the SASL listener every client is"
            " User:ANONYMOUS, the super user"
        )
    with _locked(state):
        size = _cluster_size(state)
        if size is not None:
            # `down`/`status` on this dir act on the cluster: a single broker started
            # here could never be stopped.
            raise KafkaLauncherError(
                f"{state} holds a {size}-node cluster, not a single broker: use "
                f"`sagaline kafka up --brokers {size} --state-dir {state}`, or another "
                "--state-dir for a single broker."
            )
        pid = _read_pid(state)
        bootstrap = _read(state / BOOTSTRAP_FILE)
        recorded_version = _read(state / VERSION_FILE)
        if fresh:
            if (state / DATA_DIR).exists() and not _is_broker_state_dir(state):
                raise KafkaLauncherError(
                    f"{state} is not a broker state dir (no server.properties written by "
                    f"this launcher), so `--fresh` will not delete {state / DATA_DIR}. "
                    "Check --state-dir."
                )
            if pid is not None and _is_our_broker(pid, state):
                _terminate(pid, DEFAULT_STOP_TIMEOUT)
            shutil.rmtree(state / DATA_DIR, ignore_errors=True)
            (state / CLUSTER_ID_FILE).unlink(missing_ok=True)
            pid = None
        if pid is not None and not bootstrap and _is_our_broker(pid, state):
            # An `up` stopped (Ctrl-C, killed) after starting the broker and before it
            # answered: the broker is ours, on the ports written before its start.
            # Adopt it; a second JVM on the same data dir would die on its lock.
            saved = (_read(state / PORTS_FILE) or "").split()
            if saved and saved[0].isdigit():
                bootstrap = f"{HOST}:{saved[0]}"
            else:
                _terminate(pid, DEFAULT_STOP_TIMEOUT)
        if pid is not None and bootstrap and _is_our_broker(pid, state):
            wanted_port = port or env_port
            if wanted_port is not None and bootstrap != f"{HOST}:{wanted_port}":
                raise PortInUseError(
                    f"the local broker already runs on {bootstrap} (pid {pid}), not on port "
                    f"{wanted_port}. Use {bootstrap}, or stop it first with "
                    "`sagaline kafka down`."
                )
            if sasl and sasl_listener(state) is None:
                raise KafkaLauncherError(
                    f"the local broker at {bootstrap} (pid {pid}, state {state}) runs without "
                    "a SASL listener; use another state dir for a SASL broker"
                )
            if acls != _enforces_acls(state):
                raise KafkaLauncherError(
                    f"the local broker at {bootstrap} (pid {pid}, state {state}) runs"
                    f" {'without' if acls else 'with'} an ACL authorizer; use another"
                    " state dir for a broker that enforces ACLs"
                )
            running_port = int(bootstrap.rpartition(":")[2])
            try:
                _wait_ready(state, pid, bootstrap, running_port, min(wait, 60.0))
                if _read(state / BOOTSTRAP_FILE) != bootstrap:  # adopted just above
                    (state / BOOTSTRAP_FILE).write_text(bootstrap + "\n")
                return UpResult(bootstrap, False, pid, recorded_version or "?", state)
            except StartupError:
                _terminate(pid, DEFAULT_STOP_TIMEOUT)  # alive but deaf: restart it
        # Not running (or stale pid file): start it.
        (state / PID_FILE).unlink(missing_ok=True)
        (state / BOOTSTRAP_FILE).unlink(missing_ok=True)
        java, _ = ensure_tools()
        kafka_version, libs = resolve_jars(version or recorded_version)
        p, c = _choose_ports(state, port, controller_port)
        data = state / DATA_DIR
        if not sasl:
            (state / SASL_FILE).unlink(missing_ok=True)
        listener = _choose_sasl(state, (p, c)) if sasl else None
        properties = state / SERVER_PROPERTIES
        properties.touch(mode=0o600)  # may hold the SASL passwords
        properties.write_text(
            render_server_properties(
                port=p, controller_port=c, data_dir=data, sasl=listener, acls=acls
            )
        )
        (state / LOG4J_PROPERTIES).write_text(LOG4J2_PROPERTIES)
        (state / VERSION_FILE).write_text(kafka_version + "\n")
        _format(java, libs, state)
        bootstrap = f"{HOST}:{p}"
        pid = _spawn(java, libs, state)
        try:
            (state / PID_FILE).write_text(f"{pid}\n")
            _wait_ready(state, pid, bootstrap, p, wait)
        except BaseException:  # a failed start, or Ctrl-C: leave no half-started broker
            _terminate(pid, 5.0)
            (state / PID_FILE).unlink(missing_ok=True)
            raise
        (state / BOOTSTRAP_FILE).write_text(bootstrap + "\n")
        return UpResult(bootstrap, True, pid, kafka_version, state)


def up(
    state_dir: Path | str | None = None,
    *,
    port: int | None = None,
    controller_port: int | None = None,
    version: str | None = None,
    timeout: float | None = None,
) -> str:
    """Make sure the local broker runs and return its bootstrap (``127.0.0.1:PORT``)."""
    return ensure_running(
        state_dir, port=port, controller_port=controller_port, version=version, timeout=timeout
    ).bootstrap


def down(state_dir: Path | str | None = None, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> bool:
    """Stop the broker of ``state_dir``: SIGTERM, wait, SIGKILL after ``timeout``.

    Returns True if a running broker was stopped. Data and ports are kept, so the
    next :func:`up` resumes with the same topics on the same address.
    """
    state = _state(state_dir)
    if not state.exists():
        return False
    if _cluster_size(state) is not None:
        return cluster_down(state, timeout=timeout)
    with _locked(state):
        pid = _read_pid(state)
        stopped = False
        if pid is not None and _is_our_broker(pid, state):
            _terminate(pid, timeout)
            stopped = True
        (state / PID_FILE).unlink(missing_ok=True)
        (state / BOOTSTRAP_FILE).unlink(missing_ok=True)
        return stopped


def kill(state_dir: Path | str) -> int | None:
    """SIGKILL the broker of ``state_dir`` (a crash, for fault tests) and wait until
    the process is gone; returns its pid, or None if it was not running. Its data,
    ports and state stay, so :func:`ensure_running` starts it again where it was.
    Never point this at the shared broker's state dir."""
    state = _state(state_dir)
    with _locked(state):
        pid = _read_pid(state)
        if pid is None or not _is_our_broker(pid, state):
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _pid_alive(pid):
            time.sleep(0.05)
        (state / BOOTSTRAP_FILE).unlink(missing_ok=True)
        return pid


def status(state_dir: Path | str | None = None, *, timeout: float = 5.0) -> BrokerStatus:
    """Report whether the broker of ``state_dir`` runs and answers (does not start it)."""
    state = _state(state_dir)
    if _cluster_size(state) is not None:
        return cluster_status(state, timeout=timeout)
    pid = _read_pid(state)
    bootstrap = _read(state / BOOTSTRAP_FILE)
    version = _read(state / VERSION_FILE)
    log = state / LOG_FILE

    def result(running: bool, detail: str) -> BrokerStatus:
        return BrokerStatus(running, state, bootstrap, pid, version, log, detail)

    if pid is None:
        return result(False, "not running (no pid file)")
    if not _is_our_broker(pid, state):
        return result(False, f"not running (stale pid file: {pid} is not our broker)")
    if not bootstrap:
        return result(False, f"pid {pid} alive but not ready yet (no bootstrap file)")
    if not metadata_answers(bootstrap, timeout=timeout):
        return result(False, f"pid {pid} alive but {bootstrap} does not answer metadata")
    return result(True, f"running: pid {pid}, Kafka {version or '?'}, {bootstrap}")


# --------------------------------------------------------------------------- cluster
#
# A cluster state dir holds ``nodes`` (how many), ``cluster.id``, ``kafka.version``,
# ``bootstrap`` (every node's client address, only while all run), ``launcher.lock``
# and one ``node-<id>/`` dir per node laid out exactly like a single broker's state
# dir (its own config, ports, data, log and pid), so the single-node helpers above
# run each node unchanged. Every node is a combined broker+controller and a voter of
# the static quorum: three nodes tolerate the loss of one, for the metadata quorum
# and (with replication factor 3, ``min.insync.replicas`` 2) for every topic.

NODES_FILE = "nodes"
CLUSTER_HEAP = ("-Xms192m", "-Xmx384m")  # three JVMs on a shared 2-core machine


@dataclass(frozen=True)
class ClusterNode:
    """One node of a local cluster."""

    node_id: int
    state_dir: Path
    port: int
    controller_port: int

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"


def default_cluster_dir(brokers: int) -> Path:
    """The state dir of a local ``brokers``-node cluster: ``<cache>/cluster-<N>``.

    Never the single broker's dir, so a cluster never disturbs the shared broker.
    """
    return default_cache_dir() / f"cluster-{brokers}"


def _cluster_size(state: Path) -> int | None:
    text = _read(state / NODES_FILE)
    return int(text) if text and text.isdigit() else None


def cluster_nodes(state_dir: Path | str) -> list[ClusterNode]:
    """The nodes of the cluster in ``state_dir``, with the ports they were given."""
    state = _state(state_dir)
    size = _cluster_size(state)
    if size is None:
        raise KafkaLauncherError(
            f"{state} is not a cluster state dir (no {NODES_FILE} file); start one with "
            f"`sagaline kafka up --brokers 3 --state-dir {state}`."
        )
    nodes = []
    for node_id in range(1, size + 1):
        node_dir = state / f"node-{node_id}"
        saved = (_read(node_dir / PORTS_FILE) or "").split()
        if len(saved) != 2 or not all(x.isdigit() for x in saved):
            raise KafkaLauncherError(f"{node_dir / PORTS_FILE} is missing or damaged")
        nodes.append(ClusterNode(node_id, node_dir, int(saved[0]), int(saved[1])))
    return nodes


def _cluster_ports(state: Path, brokers: int) -> list[ClusterNode]:
    """Remembered ports when every one is still free (the quorum's addresses are in
    every node's config, so they change all together or not at all); else new ones."""
    taken: set[int] = set()
    remembered: list[tuple[int, int]] = []
    for node_id in range(1, brokers + 1):
        saved = (_read(state / f"node-{node_id}" / PORTS_FILE) or "").split()
        if len(saved) == 2 and all(x.isdigit() for x in saved):
            remembered.append((int(saved[0]), int(saved[1])))
    ports = list(remembered)
    if len(ports) != brokers or not all(_port_freed(p) and _port_freed(c) for p, c in ports):
        ports = []
        for _ in range(brokers):
            pair: list[int] = []
            while len(pair) < 2:
                candidate = free_port()
                if candidate not in taken:
                    taken.add(candidate)
                    pair.append(candidate)
            ports.append((pair[0], pair[1]))
    nodes = []
    for node_id, (p, c) in enumerate(ports, start=1):
        node_dir = state / f"node-{node_id}"
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / PORTS_FILE).write_text(f"{p} {c}\n")
        nodes.append(ClusterNode(node_id, node_dir, p, c))
    return nodes


def _write_node_config(node: ClusterNode, nodes: list[ClusterNode], cluster_id: str) -> None:
    voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in nodes)
    (node.state_dir / SERVER_PROPERTIES).write_text(
        render_server_properties(
            port=node.port,
            controller_port=node.controller_port,
            data_dir=node.state_dir / DATA_DIR,
            node_id=node.node_id,
            voters=voters,
            replication=min(3, len(nodes)),
        )
    )
    (node.state_dir / LOG4J_PROPERTIES).write_text(LOG4J2_PROPERTIES)
    (node.state_dir / CLUSTER_ID_FILE).write_text(cluster_id + "\n")


def _node_running(node: ClusterNode) -> int | None:
    pid = _read_pid(node.state_dir)
    return pid if pid is not None and _is_our_broker(pid, node.state_dir) else None


def _cluster_bootstrap(nodes: list[ClusterNode]) -> str:
    return ",".join(n.bootstrap for n in nodes)


def _brokers_registered(bootstrap: str, timeout: float = 5.0) -> set[int]:
    from sagaline.kafka import ClientConfig, create_admin

    # The launcher's own plaintext listeners: no deployment settings (SASL...) apply.
    client = create_admin(
        ClientConfig(bootstrap), **{"log_level": 0, "error_cb": lambda _err: None}
    )
    try:
        return set(client.list_topics(timeout=timeout).brokers)
    except Exception:
        return set()


def _wait_cluster(state: Path, nodes: list[ClusterNode], wanted: set[int], timeout: float) -> None:
    """Until every node in ``wanted`` answers and the cluster lists it as a broker."""
    deadline = time.monotonic() + timeout
    bootstrap = _cluster_bootstrap(nodes)
    for node in nodes:
        if node.node_id not in wanted:
            continue
        pid = _read_pid(node.state_dir)
        assert pid is not None
        _wait_ready(
            node.state_dir, pid, node.bootstrap, node.port, max(1.0, deadline - time.monotonic())
        )
    while not wanted <= _brokers_registered(bootstrap):
        if time.monotonic() > deadline:
            raise StartupError(
                f"the cluster in {state} did not list brokers {sorted(wanted)} within "
                f"{timeout:.0f}s; see the node logs under {state}/node-*/{LOG_FILE}"
            )
        time.sleep(0.25)


def ensure_cluster(
    state_dir: Path | str | None = None,
    *,
    brokers: int = 3,
    version: str | None = None,
    timeout: float | None = None,
) -> UpResult:
    """Reuse the ``brokers``-node KRaft cluster of ``state_dir``, or start it.

    Nodes that run and answer are kept; the others are (re)started on their
    remembered ports, so a cluster with one node down is completed, not restarted.
    ``UpResult.bootstrap`` lists every node; ``pid`` is node 1's.
    """
    if brokers < 2:
        raise KafkaLauncherError("a cluster needs at least 2 brokers; use ensure_running()")
    state = _state(state_dir) if state_dir else default_cluster_dir(brokers)
    wait = _start_timeout(timeout)
    with _locked(state):
        size = _cluster_size(state)
        if size is not None and size != brokers:
            raise KafkaLauncherError(
                f"{state} holds a {size}-node cluster, not {brokers}: use another "
                f"--state-dir, or `sagaline kafka down --state-dir {state}` and remove it."
            )
        if size is None and (state / DATA_DIR).exists():
            raise KafkaLauncherError(f"{state} holds a single broker; use another --state-dir")
        (state / NODES_FILE).write_text(f"{brokers}\n")
        nodes = cluster_nodes(state) if size is not None else []
        running = {n.node_id: pid for n in nodes if (pid := _node_running(n)) is not None}
        if len(running) < brokers:
            (state / BOOTSTRAP_FILE).unlink(missing_ok=True)
        else:
            bootstrap = _cluster_bootstrap(nodes)
            _wait_cluster(state, nodes, set(running), min(wait, 60.0))
            (state / BOOTSTRAP_FILE).write_text(bootstrap + "\n")
            return UpResult(bootstrap, False, running[1], _read(state / VERSION_FILE) or "?", state)
        java, _ = ensure_tools()
        kafka_version, libs = resolve_jars(version or _read(state / VERSION_FILE))
        (state / VERSION_FILE).write_text(kafka_version + "\n")
        # Ports change only when no node runs (a running node's quorum config is fixed).
        nodes = cluster_nodes(state) if running else _cluster_ports(state, brokers)
        cluster_id = _read(state / CLUSTER_ID_FILE) or new_cluster_id()
        (state / CLUSTER_ID_FILE).write_text(cluster_id + "\n")
        for node in nodes:
            if node.node_id not in running:
                _write_node_config(node, nodes, cluster_id)
                _format(java, libs, node.state_dir)
        started = []
        for node in nodes:
            if node.node_id not in running:
                wanted = ((node.port, "Kafka"), (node.controller_port, "Kafka controller"))
                for port, what in wanted:
                    if not _port_freed(port):
                        ensure_port_free(port, what=what)  # raises, saying what to do
                pid = _spawn(java, libs, node.state_dir, CLUSTER_HEAP)
                (node.state_dir / PID_FILE).write_text(f"{pid}\n")
                running[node.node_id] = pid
                started.append(node.node_id)
        try:
            _wait_cluster(state, nodes, set(range(1, brokers + 1)), wait)
        except KafkaLauncherError:
            for node in nodes:
                if node.node_id in started:
                    _terminate(running[node.node_id], 5.0)
                    (node.state_dir / PID_FILE).unlink(missing_ok=True)
            raise
        bootstrap = _cluster_bootstrap(nodes)
        (state / BOOTSTRAP_FILE).write_text(bootstrap + "\n")
        return UpResult(bootstrap, True, running[1], kafka_version, state)


def _node(state_dir: Path | str, node_id: int) -> ClusterNode:
    for node in cluster_nodes(state_dir):
        if node.node_id == node_id:
            return node
    raise KafkaLauncherError(f"the cluster in {state_dir} has no node {node_id}")


def stop_node(
    state_dir: Path | str,
    node_id: int,
    *,
    kill: bool = False,
    timeout: float = DEFAULT_STOP_TIMEOUT,
) -> bool:
    """Stop one node: SIGTERM (a controlled shutdown that moves its leaderships
    first), or with ``kill`` a SIGKILL (a crash). True if it was running."""
    node = _node(state_dir, node_id)
    state = _state(state_dir)
    with _locked(state):
        pid = _node_running(node)
        if pid is None:
            return False
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _pid_alive(pid):
                time.sleep(0.05)
        else:
            _terminate(pid, timeout)
        (node.state_dir / PID_FILE).unlink(missing_ok=True)
        (state / BOOTSTRAP_FILE).unlink(missing_ok=True)
        return True


def kill_node(state_dir: Path | str, node_id: int) -> bool:
    """SIGKILL one node of the cluster (see :func:`stop_node`)."""
    return stop_node(state_dir, node_id, kill=True)


def start_node(state_dir: Path | str, node_id: int, *, timeout: float | None = None) -> int:
    """Start a stopped node again on its ports and data; returns its pid once the
    cluster lists it as a broker again (running nodes are left alone)."""
    ensure_cluster(state_dir, brokers=len(cluster_nodes(state_dir)), timeout=timeout)
    pid = _node_running(_node(state_dir, node_id))
    if pid is None:
        raise StartupError(f"node {node_id} of {state_dir} is not running after start")
    return pid


def cluster_down(state_dir: Path | str, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> bool:
    """Stop every node (data and ports kept). True if any node was running."""
    state = _state(state_dir)
    with _locked(state):
        pids = {n: pid for n in cluster_nodes(state) if (pid := _node_running(n)) is not None}
        for pid in pids.values():  # all at once: the quorum shuts down together
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for node, pid in pids.items():
            _terminate(pid, timeout)
            (node.state_dir / PID_FILE).unlink(missing_ok=True)
        (state / BOOTSTRAP_FILE).unlink(missing_ok=True)
    return bool(pids)


def cluster_status(state_dir: Path | str, *, timeout: float = 5.0) -> BrokerStatus:
    """A cluster's status: running when every node runs and is listed as a broker."""
    state = _state(state_dir)
    nodes = cluster_nodes(state)
    bootstrap = _cluster_bootstrap(nodes)
    version = _read(state / VERSION_FILE)
    alive = {n.node_id: pid for n in nodes if (pid := _node_running(n)) is not None}
    listed = _brokers_registered(bootstrap, timeout) if alive else set()
    down_ids = [n.node_id for n in nodes if n.node_id not in alive or n.node_id not in listed]
    running = not down_ids
    detail = (
        f"running: {len(nodes)} nodes, Kafka {version or '?'}, {bootstrap}"
        if running
        else f"{len(nodes) - len(down_ids)} of {len(nodes)} nodes up (down: {down_ids})"
    )
    return BrokerStatus(
        running, state, bootstrap if running else None, alive.get(1), version,
        state / "node-1" / LOG_FILE, detail,
    )  # fmt: skip
