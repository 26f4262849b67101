"""The topics a test session made are deleted when it ends (tests/conftest.py).

A long-lived development broker keeps every topic ever created: a suite that leaves
its uniquely prefixed topics behind on every run eventually gives the broker more
partition directories than it may open files, and it shuts down ("Too many open
files", then "all log dirs have failed"). So every prefix a session hands out
(``unique_prefix``, ``new_topic_prefix``), and every prefix a test learns from what it
ran (``record_prefix``: a demo run's), is recorded here, and at the end of the
session (each pytest-xdist worker has its own) the topics whose names start with one
of *those* prefixes -- and no other topic -- are deleted.

``SAGALINE_KEEP_TEST_TOPICS=1`` keeps them (to look at a failed test's topics).
``SAGALINE_TEST_TOPIC_PREFIX_FILE=PATH`` appends the prefixes to PATH instead of
deleting (scripts/test.sh: the secret scan, run after the suite, reads the suite's
topics); ``python -m tests.topic_cleanup PATH`` deletes them afterwards.
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


def is_session_prefix(prefix: str) -> bool:
    return any(p.fullmatch(prefix) is not None for p in (_PREFIX, _DEMO_RUN_PREFIX))


def delete_topics_with_prefixes(
    bootstrap: str, prefixes: Iterable[str], timeout_s: float = 60.0
) -> list[str]:
    """Delete every topic whose name starts with one of ``prefixes`` (each must look
    like a session prefix, else ValueError); wait until the broker no longer lists
    them. Returns the names deleted."""
    wanted = sorted(set(prefixes))
    bad = [p for p in wanted if not is_session_prefix(p)]
    if bad:
        raise ValueError(f"refusing to delete topics by prefixes that are not unique: {bad}")
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
        """At the session's end: delete (or record, or keep) its topics. Returns a
        line for the report."""
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
        deleted = delete_topics_with_prefixes(bootstrap, prefixes)
        return f"test topics deleted: {len(deleted)}"


# This process's session (tests/conftest.py hands its prefixes out and deletes them).
SESSION = SessionTopics()


def record_prefix(prefix: str) -> str:
    """For a helper without fixtures: record ``prefix`` (e.g. a demo run's, learned
    from the run) so the session deletes its topics like ``unique_prefix``'s."""
    return SESSION.record(prefix)


def main(argv: list[str]) -> int:
    """``python -m tests.topic_cleanup PREFIX_FILE [BOOTSTRAP]``: delete the topics of
    the prefixes recorded in PREFIX_FILE (bootstrap default: KAFKA_BOOTSTRAP_SERVERS)."""
    if len(argv) not in (1, 2):
        print("usage: python -m tests.topic_cleanup PREFIX_FILE [BOOTSTRAP]", file=sys.stderr)
        return 2
    bootstrap = argv[1] if len(argv) == 2 else os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
    if not bootstrap:
        print("topic_cleanup: no bootstrap (set KAFKA_BOOTSTRAP_SERVERS)", file=sys.stderr)
        return 2
    path = Path(argv[0])
    prefixes = path.read_text(encoding="utf-8").split() if path.exists() else []
    deleted = delete_topics_with_prefixes(bootstrap, prefixes)
    print(f"topic_cleanup: deleted {len(deleted)} test topics", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
