"""The topics and consumer groups a test session made are deleted when it ends
(tests/conftest.py).

A long-lived development broker keeps every topic ever created: a suite that leaves
its uniquely prefixed topics behind on every run eventually gives the broker more
partition directories than it may open files, and it shuts down ("Too many open
files", then "all log dirs have failed"). Consumer groups stay too: deleting a topic
drops a group's offsets of it, not the group, which the broker removes only at its
next offset-retention check (every 10 minutes; a week when its topics stay).
So every prefix a session hands out (``unique_prefix``, ``new_topic_prefix``), and
every prefix a test learns from what it ran (``record_prefix``: a demo run's), is
recorded here, and at the end of the session (each pytest-xdist worker has its own)
the topics and the consumer groups whose names start with one of *those* prefixes --
and no other -- are deleted. Every group a test or a service under test commits
offsets in is named after its topic prefix (the coordinator's
``<prefix>sagaline-coordinator``, a participant's
``<prefix>sagaline-participant-<name>``, a test's ``f"{unique_prefix}..."``); the
throw-away readers named without one (``sagaline-reader-*``, ``sagaline-probe-*``,
``demo-follower-*``, ``secret-scan-*``) only assign partitions and never commit, so
the broker never makes a group of them. A group a member is still in (a static
member -- coordinator, participant -- stays until its session times out) cannot be
deleted: it is left and named in the report line, the run does not fail for it, and
the broker drops it at a retention check once it is empty (its offsets went with the
topics).

``SAGALINE_KEEP_TEST_TOPICS=1`` keeps them (to look at a failed test's topics).
``SAGALINE_TEST_TOPIC_PREFIX_FILE=PATH`` appends the prefixes to PATH instead of
deleting (scripts/test.sh: the secret scan, run after the suite, reads the suite's
topics); ``python -m tests.topic_cleanup PATH`` deletes their topics and groups
afterwards.
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

KEEP_VAR = "SAGALINE_KEEP_TEST_TOPICS"
PREFIX_FILE_VAR = "SAGALINE_TEST_TOPIC_PREFIX_FILE"

# What a session's prefix looks like: a short lower-case kind, 8+ random hex digits and
# a dot. Anything else (an empty prefix, "t.", "sagaline.") is refused, so a cleanup
# can never match topics it did not make.
_PREFIX = re.compile(r"[a-z]{1,16}[0-9a-f]{8,32}\.")
# ``sagaline demo`` picks its run's prefix itself (services/demo.py: ``demo-`` + the
# run id, its start second and 4 random hex digits): the tests that run the demo learn
# it from the run and record it (:func:`record_prefix`). Just as unique to that run.
_DEMO_RUN_PREFIX = re.compile(r"demo-[0-9]{8}-[0-9]{6}-[0-9a-f]{4}\.")
_BATCH = 200
_IN_USE = " (still in use)"


def is_session_prefix(prefix: str) -> bool:
    return any(p.fullmatch(prefix) is not None for p in (_PREFIX, _DEMO_RUN_PREFIX))


def _session_prefixes(prefixes: Iterable[str], what: str) -> list[str]:
    wanted = sorted(set(prefixes))
    bad = [p for p in wanted if not is_session_prefix(p)]
    if bad:
        raise ValueError(f"refusing to delete {what} by prefixes that are not unique: {bad}")
    return wanted


def delete_topics_with_prefixes(
    bootstrap: str, prefixes: Iterable[str], timeout_s: float = 60.0
) -> list[str]:
    """Delete every topic whose name starts with one of ``prefixes`` (each must look
    like a session prefix, else ValueError); wait until the broker no longer lists
    them. Returns the names deleted."""
    wanted = _session_prefixes(prefixes, "topics")
    if not wanted:
        return []
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = sorted(
        name
        for name in admin.list_topics(timeout=timeout_s).topics
        if name.startswith(tuple(wanted))
    )
    errors: list[str] = []
    for start in range(0, len(names), _BATCH):
        batch = names[start : start + _BATCH]
        futures = admin.delete_topics(batch, operation_timeout=timeout_s, request_timeout=timeout_s)
        for name, future in futures.items():
            try:
                future.result(timeout=timeout_s)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    errors.append(f"{name}: {exc.args[0].str()}")
    if errors:
        raise RuntimeError(f"could not delete test topics: {errors[:10]}")
    # A deleted topic leaves the broker's metadata shortly after the call returns.
    deadline = time.monotonic() + timeout_s
    while True:
        listed = admin.list_topics(timeout=timeout_s).topics
        left = [n for n in names if n in listed]
        if not left:
            return names
        if time.monotonic() > deadline:
            raise RuntimeError(f"test topics still listed after deletion: {left[:10]}")
        time.sleep(0.2)


def delete_groups_with_prefixes(
    bootstrap: str, prefixes: Iterable[str], timeout_s: float = 60.0
) -> tuple[list[str], list[str]]:
    """Delete every consumer group whose id starts with one of ``prefixes`` (each must
    look like a session prefix, else ValueError). Returns the groups deleted and, for
    each one the broker would not delete (a member still in it), ``"group (reason)"``:
    those are left, not raised."""
    wanted = _session_prefixes(prefixes, "consumer groups")
    if not wanted:
        return [], []
    admin = AdminClient({"bootstrap.servers": bootstrap})
    listed = admin.list_consumer_groups(request_timeout=timeout_s).result(timeout=timeout_s)
    left = [f"(a broker did not list its groups: {e})" for e in listed.errors]
    names = sorted(g.group_id for g in listed.valid if g.group_id.startswith(tuple(wanted)))
    deleted: list[str] = []
    for start in range(0, len(names), _BATCH):
        batch = names[start : start + _BATCH]
        futures = admin.delete_consumer_groups(batch, request_timeout=timeout_s)
        for name, future in futures.items():
            try:
                future.result(timeout=timeout_s)
            except KafkaException as exc:
                code = exc.args[0].code()
                if code == KafkaError.NON_EMPTY_GROUP:
                    left.append(f"{name}{_IN_USE}")
                elif code != KafkaError.GROUP_ID_NOT_FOUND:
                    left.append(f"{name} ({exc.args[0].str()})")
            else:
                deleted.append(name)
    return sorted(deleted), left


def _deleted_line(bootstrap: str, prefixes: list[str]) -> str:
    """Delete the topics and groups of ``prefixes``; one line saying what went."""
    try:
        topics = delete_topics_with_prefixes(bootstrap, prefixes)
    finally:  # the groups go even if a topic would not (and that is raised)
        groups, left = delete_groups_with_prefixes(bootstrap, prefixes)
    line = f"test topics deleted: {len(topics)}, consumer groups deleted: {len(groups)}"
    if left:
        shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
        line += f"; {len(left)} consumer group(s) left: {shown}"
        if any(g.endswith(_IN_USE) for g in left):
            line += " (a group in use goes once it is empty, at the broker's retention check)"
    return line


class SessionTopics:
    """The topic prefixes one pytest session handed out."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []

    def new_prefix(self, kind: str = "t") -> str:
        """A fresh prefix, e.g. ``t3f9a0c1d.``, recorded for deletion at the end."""
        prefix = f"{kind}{uuid.uuid4().hex[:8]}."
        if not is_session_prefix(prefix):
            raise ValueError(f"topic prefix kind must be 1-16 lower-case letters: {kind!r}")
        self.prefixes.append(prefix)
        return prefix

    def record(self, prefix: str) -> str:
        """Record a prefix something else chose (a demo run's), for deletion at the end."""
        if not is_session_prefix(prefix):
            raise ValueError(f"not a unique test topic prefix, not recorded: {prefix!r}")
        if prefix not in self.prefixes:
            self.prefixes.append(prefix)
        return prefix

    def finish(self, bootstrap: str) -> str:
        """At the session's end: delete (or record, or keep) its topics and consumer
        groups. Returns a line for the report."""
        prefixes, self.prefixes = self.prefixes, []
        if not prefixes:
            return ""
        if os.environ.get(KEEP_VAR) == "1":
            return f"test topics kept ({KEEP_VAR}=1): {len(prefixes)} prefixes"
        record = os.environ.get(PREFIX_FILE_VAR, "")
        if record:
            with open(record, "a", encoding="utf-8") as out:
                out.write("".join(f"{p}\n" for p in prefixes))  # one append per session
            return f"test topic prefixes recorded in {record} for deletion later"
        return _deleted_line(bootstrap, prefixes)


# This process's session (tests/conftest.py hands its prefixes out and deletes them).
SESSION = SessionTopics()


def record_prefix(prefix: str) -> str:
    """For a helper without fixtures: record ``prefix`` (e.g. a demo run's, learned
    from the run) so the session deletes its topics like ``unique_prefix``'s."""
    return SESSION.record(prefix)


def main(argv: list[str]) -> int:
    """``python -m tests.topic_cleanup PREFIX_FILE [BOOTSTRAP]``: delete the topics and
    consumer groups of the prefixes recorded in PREFIX_FILE (bootstrap default:
    KAFKA_BOOTSTRAP_SERVERS)."""
    if len(argv) not in (1, 2):
        print("usage: python -m tests.topic_cleanup PREFIX_FILE [BOOTSTRAP]", file=sys.stderr)
        return 2
    bootstrap = argv[1] if len(argv) == 2 else os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
    if not bootstrap:
        print("topic_cleanup: no bootstrap (set KAFKA_BOOTSTRAP_SERVERS)", file=sys.stderr)
        return 2
    path = Path(argv[0])
    prefixes = path.read_text(encoding="utf-8").split() if path.exists() else []
    print(f"topic_cleanup: {_deleted_line(bootstrap, prefixes)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
