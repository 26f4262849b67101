"""A service the demo (or a test) started stops by itself when its starter dies
without stopping it (``SAGALINE_PARENT_PID``, ``services.cli.watch_parent``).

Seen here: a test process aborted by librdkafka left its coordinator and five
participants polling a dead broker for the rest of the session, stealing the CPU of
every later test and benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli import PARENT_PID_VAR

# A middle process starts the "service" (watch_parent, then a long sleep) and exits
# at once, as a supervisor killed by a signal would.
_MIDDLE = """
import os, subprocess, sys
service = (
    "from services.cli import watch_parent; import time; "
    "watch_parent(interval_s=0.2); print('watching', flush=True); time.sleep(600)"
)
env = {**os.environ, sys.argv[1]: str(os.getpid())}
child = subprocess.Popen([sys.executable, "-c", service], env=env, stdout=subprocess.PIPE)
assert child.stdout is not None and child.stdout.readline().strip() == b"watching"
print(child.pid, flush=True)
os._exit(0)
"""


def _orphan(var: str) -> int:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", _MIDDLE, var],
        capture_output=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=120,
    )
    return int(out.stdout.split()[-1])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_a_service_whose_starter_died_stops_by_itself() -> None:
    pid = _orphan(PARENT_PID_VAR)
    while _alive(pid):  # bounded by the test's timeout; it stops within a poll interval
        time.sleep(0.1)
