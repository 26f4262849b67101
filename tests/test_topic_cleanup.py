"""A test session deletes the topics it made, and only those (tests/topic_cleanup.py).

Runs a small pytest session in a subprocess on the real broker, with this suite's
fixtures (tests/conftest.py as a plugin), and looks at the broker after it ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests import topic_cleanup

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent

INNER = """
import os
import time
import uuid
from pathlib import Path
from confluent_kafka.admin import AdminClient, NewTopic
from tests.topic_cleanup import record_prefix

def test_makes_topics(kafka_bootstrap, unique_prefix, new_topic_prefix):
    # As services/demo.py names a run's topics; the test learns it from the run.
    demo = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}."
    names = [f"{unique_prefix}made", f"{new_topic_prefix('drill')}made", f"{demo}made"]
    record_prefix(demo)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        future.result(timeout=60)
    Path(os.environ["INNER_OUT"]).write_text("\\n".join(names))
"""


def _create(admin: AdminClient, names: list[str]) -> None:
    for future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        future.result(timeout=60)


def _listed(admin: AdminClient) -> set[str]:
    return set(admin.list_topics(timeout=60).topics)


def _run_inner_session(tmp_path: Path, bootstrap: str, **env: str) -> list[str]:
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER)
    out = tmp_path / "names"
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "SAGALINE_KEEP", "SAGALINE_TEST_TOPIC"))
    }
    environ.update(
        KAFKA_BOOTSTRAP_SERVERS=bootstrap, PYTHONPATH=str(ROOT), INNER_OUT=str(out), **env
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.conftest", "--rootdir", str(tmp_path), str(test_file)],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out.read_text().split()


def test_a_sessions_topics_are_deleted_when_it_ends_and_no_other_topic(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # Another session's topic, named just like this one's: it must survive.
    other = f"t{uuid.uuid4().hex[:8]}.other"
    _create(admin, [other])
    try:
        made = _run_inner_session(tmp_path, kafka_bootstrap)
        listed = _listed(admin)
        assert len(made) == 3
        assert [n for n in made if n in listed] == []
        assert other in listed
    finally:
        admin.delete_topics([other])


def test_with_a_prefix_file_the_topics_stay_until_the_file_is_cleaned_up(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    record = tmp_path / "prefixes"
    made = _run_inner_session(
        tmp_path, kafka_bootstrap, SAGALINE_TEST_TOPIC_PREFIX_FILE=str(record)
    )
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    assert set(made) <= _listed(admin)  # kept for the secret scan
    proc = subprocess.run(
        [sys.executable, "-m", "tests.topic_cleanup", str(record), kafka_bootstrap],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [n for n in made if n in _listed(admin)] == []


@pytest.mark.parametrize(
    "prefix", ["", "t.", "sagaline.", "t3f9a0c1d", "demo-", "demo-20261203-054500.", "compose-"]
)
def test_cleanup_refuses_a_prefix_that_is_not_a_sessions(prefix: str) -> None:
    with pytest.raises(ValueError, match="not unique"):
        topic_cleanup.delete_topics_with_prefixes("127.0.0.1:1", ["t3f9a0c1d.", prefix])
