"""The broker's requests during a measured run, counted per client process and API.

On a small VM a Kafka request costs the broker a few hundred microseconds of CPU, so
the number of requests a saga causes is what its broker CPU follows.
``bench/e2e.py --broker-requests`` uses this around each level (and the raw floor's):

* it switches the local broker's ``kafka.request.logger`` to DEBUG for the run (a
  dynamic broker-logger config, set with ``kafka.admin.ConfigCommand`` from the
  broker's own class path) and back to WARN after, so every request the broker
  completed meanwhile is one JSON line in its ``broker.log``;
* it maps each request's client port to a process (``/proc/<pid>/fd`` socket inodes
  against ``/proc/net/tcp``); requests the broker sends itself (a KIP-890
  verification of every transactional produce, the transaction markers) are
  "broker (internal)".

The logging itself costs the broker CPU, so a run measured this way is slower:
read its requests, not its sagas/s or CPU.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

_MARK = "Completed request:"
INTERNAL = "broker (internal)"


class RequestLog:
    """Counts the local broker's requests between :meth:`start` and :meth:`stop`."""

    def __init__(self, broker_pid: int, state_dir: Path, bootstrap: str) -> None:
        self._log = state_dir / "broker.log"
        self._bootstrap = bootstrap
        self._broker_pid = broker_pid
        argv = Path(f"/proc/{broker_pid}/cmdline").read_bytes().split(b"\0")
        args = [a.decode() for a in argv if a]
        if "-cp" not in args[:-1]:
            raise SystemExit(
                f"--broker-requests: broker pid {broker_pid} is not a java -cp process "
                "(it needs the local broker started by `sagaline kafka up`)"
            )
        self._java = args[0]
        self._classpath = args[args.index("-cp") + 1]
        self._offset = 0
        self._on = False

    def _level(self, level: str) -> None:
        subprocess.run(
            [
                self._java,
                "-cp",
                self._classpath,
                "kafka.admin.ConfigCommand",
                "--bootstrap-server",
                self._bootstrap,
                "--alter",
                "--entity-type",
                "broker-loggers",
                "--entity-name",
                "1",
                "--add-config",
                f"kafka.request.logger={level}",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        self._offset = self._log.stat().st_size
        self._level("DEBUG")
        self._on = True

    def off(self) -> None:
        """Switch the broker's request log off again (once; later calls do nothing)."""
        if self._on:
            self._on = False
            self._level("WARN")

    def stop(self, roles: Mapping[str, int]) -> dict[str, collections.Counter[str]]:
        """Per role (``roles``: name -> pid; the broker's own requests are
        :data:`INTERNAL`), how many requests of each API the broker completed."""
        ports = _ports_of({**roles, INTERNAL: self._broker_pid})
        self.off()
        with self._log.open("rb") as f:
            f.seek(self._offset)
            text = f.read().decode("utf-8", "replace")
        out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for line in text.splitlines():
            at = line.find(_MARK)
            if at < 0:
                continue
            body = line[at + len(_MARK) :]
            body = body[: body.rfind("}") + 1]
            try:
                request = json.loads(body)
            except ValueError:
                continue
            api = request["requestHeader"]["requestApiKeyName"]
            if api == "INCREMENTAL_ALTER_CONFIGS":
                continue  # the switch itself
            # "<broker host:port>-<client host:port>-<processor>-<index>"
            client = request.get("connection", "").split("-")
            port = int(client[1].rsplit(":", 1)[1]) if len(client) > 1 else -1
            out[ports.get(port, "other")][api] += 1
        return dict(out)


def _ports_of(roles: Mapping[str, int]) -> dict[int, str]:
    """Local TCP port -> role, for every socket the roles' processes hold now."""
    inode_role: dict[str, str] = {}
    for role, pid in roles.items():
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inode_role[target[8:-1]] = role
    ports: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            role = inode_role.get(cols[9])
            if role is not None:
                ports[int(cols[1].rsplit(":", 1)[1], 16)] = role
    return ports


def per_saga(counts: Mapping[str, Mapping[str, int]], sagas: int) -> str:
    """The report's line: all requests a saga, then per role with the APIs behind them."""
    total = sum(sum(c.values()) for c in counts.values())
    parts = [f"all {total / sagas:.1f}"]
    for role, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        apis = ", ".join(f"{api} {n / sagas:.1f}" for api, n in c.most_common())
        parts.append(f"{role} {sum(c.values()) / sagas:.1f} ({apis})")
    return "   broker requests/saga: " + "; ".join(parts)
