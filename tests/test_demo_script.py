"""``scripts/demo.sh``, the project's main job, around a broken ``sagaline`` command:
it must fail as that command fails, never run something else and exit 0."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_demo_sh_fails_when_the_sagaline_demo_command_is_broken(tmp_path: Path) -> None:
    # A checkout whose bootstrap succeeded but whose `sagaline` CLI cannot start
    # (an import error in some command module, say), and whose broker is given.
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "scripts" / "bootstrap.sh").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    _executable(
        bin_dir / "sagaline",
        "#!/bin/sh\necho 'ImportError: cannot import name X' >&2\nexit 1\n",
    )
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "__init__.py").write_text("")
    (tmp_path / "services" / "smoke.py").write_text("print('smoke: 22/22 records round-tripped')\n")
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}
    env.pop("PYTHONPATH", None)

    done = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "demo.sh"), "--sagas", "5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode != 0, done.stdout + done.stderr
    assert "smoke" not in done.stdout, done.stdout
    assert "ImportError" in done.stderr, done.stderr
