"""A test session deletes the topics and consumer groups it made, and only those
(tests/topic_cleanup.py).

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
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests import topic_cleanup

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent

INNER = """
import os
import time
import uuid
from pathlib import Path
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from tests.topic_cleanup import record_prefix

def test_makes_topics_and_groups(kafka_bootstrap, unique_prefix, new_topic_prefix):
    # As services/demo.py names a run's topics; the test learns it from the run.
    demo = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}."
    names = [f"{unique_prefix}made", f"{new_topic_prefix('drill')}made", f"{demo}made"]
    record_prefix(demo)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        future.result(timeout=60)
    # A group per prefix, named as the coordinator and a participant name theirs.
    groups = [f"{unique_prefix}sagaline-coordinator", f"{demo}sagaline-participant-desk"]
    for group, topic in zip(groups, names[::2]):
        consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
        consumer.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
        consumer.close()
    Path(os.environ["INNER_OUT"]).write_text("\\n".join(names))
    Path(os.environ["INNER_OUT"] + ".groups").write_text("\\n".join(groups))
"""


def _create(admin: AdminClient, names: list[str]) -> None:
    for future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        future.result(timeout=60)


def _listed(admin: AdminClient) -> set[str]:
    return set(admin.list_topics(timeout=60).topics)


def _groups(admin: AdminClient) -> set[str]:
    listed = admin.list_consumer_groups(request_timeout=60).result()
    return {g.group_id for g in listed.valid}


def _commit_group(bootstrap: str, group: str, topic: str) -> None:
    """A consumer group with a committed offset (what a coordinator or a participant
    leaves behind), made without joining it."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        consumer.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
    finally:
        consumer.close()


def _made_groups(tmp_path: Path) -> list[str]:
    return (tmp_path / "names.groups").read_text().split()


def _run_inner_session(
    tmp_path: Path, bootstrap: str, *args: str, report: list[str] | None = None, **env: str
) -> list[str]:
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
         "-p", "tests.conftest", "--rootdir", str(tmp_path), *args, str(test_file)],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if report is not None:
        report.extend(proc.stdout.splitlines())
    return out.read_text().split()


def test_a_parallel_runs_workers_report_their_cleanup(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Each pytest-xdist worker cleans up at its own session's end, where nothing it
    prints is shown: the run's summary must still say what each worker deleted (or
    could not), else a failed cleanup goes unnoticed."""
    report: list[str] = []
    made = _run_inner_session(tmp_path, kafka_bootstrap, "-n", "1", report=report)
    assert [
        n for n in made if n in _listed(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    ] == []
    lines = [line for line in report if "test topics deleted: 3" in line]
    assert len(lines) == 1, "\n".join(report)
    assert lines[0].startswith("kafka: [gw0] ")


def test_a_sessions_consumer_groups_are_deleted_when_it_ends_and_no_other_group(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A long-lived broker otherwise keeps every test's consumer groups (deleting a
    topic drops its offsets, not the group): thousands of them after a day of runs."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # Another session's group, named just like this one's: it must survive.
    other_prefix = f"t{uuid.uuid4().hex[:8]}."
    other_topic, other = f"{other_prefix}other", f"{other_prefix}sagaline-coordinator"
    _create(admin, [other_topic])
    try:
        _commit_group(kafka_bootstrap, other, other_topic)
        _run_inner_session(tmp_path, kafka_bootstrap)
        made = _made_groups(tmp_path)
        groups = _groups(admin)
        assert len(made) == 2
        assert [g for g in made if g in groups] == []
        assert other in groups
    finally:
        admin.delete_topics([other_topic])
        admin.delete_consumer_groups([other])


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
    made_groups = _made_groups(tmp_path)
    assert set(made_groups) <= _groups(admin)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.topic_cleanup", str(record), kafka_bootstrap],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [n for n in made if n in _listed(admin)] == []
    assert [g for g in made_groups if g in _groups(admin)] == []


def test_a_group_still_in_use_does_not_fail_the_cleanup_and_is_reported(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member still in a session's group at its end (a static member stays until its
    session times out) keeps the group; the cleanup says so and deletes the rest."""
    # Under scripts/test.sh a session only records its prefixes (deleted after the
    # secret scan); this session deletes at once, as one run on its own does.
    monkeypatch.delenv(topic_cleanup.PREFIX_FILE_VAR, raising=False)
    monkeypatch.delenv(topic_cleanup.KEEP_VAR, raising=False)
    session = topic_cleanup.SessionTopics()
    prefix = session.new_prefix()
    topic, busy, idle = f"{prefix}in", f"{prefix}busy", f"{prefix}idle"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    _create(admin, [topic])
    _commit_group(kafka_bootstrap, idle, topic)
    member = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": busy})
    try:
        member.subscribe([topic])
        while not member.assignment():  # joined: the group has a member
            member.poll(0.5)
        line = session.finish(kafka_bootstrap)
        # What the broker answered each deletion: the idle group deleted, the busy one
        # refused as not empty (NON_EMPTY_GROUP); nothing raised.
        assert "consumer groups deleted: 1" in line, line
        assert f"1 consumer group(s) left: {busy} (still in use)" in line, line
    finally:
        member.close()
        admin.delete_consumer_groups([busy])


@pytest.mark.parametrize(
    "prefix", ["", "t.", "sagaline.", "t3f9a0c1d", "demo-", "demo-20261203-054500.", "compose-"]
)
def test_cleanup_refuses_a_prefix_that_is_not_a_sessions(prefix: str) -> None:
    with pytest.raises(ValueError, match="not unique"):
        topic_cleanup.delete_topics_with_prefixes("127.0.0.1:1", ["t3f9a0c1d.", prefix])
