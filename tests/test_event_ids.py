"""Random event ids: version 4 UUIDs, unique, and never shared with a forked child."""

from __future__ import annotations

import os
import uuid

from schemas import new_event_id


def test_an_event_id_is_a_canonical_version_4_uuid() -> None:
    for _ in range(600):  # more than one block of randomness
        event_id = new_event_id()
        parsed = uuid.UUID(event_id)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == event_id


def test_event_ids_do_not_repeat() -> None:
    ids = [new_event_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)


def test_a_forked_child_does_not_hand_out_the_parents_ids() -> None:
    new_event_id()  # the parent holds a block it has only begun to use
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, ",".join(new_event_id() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = set(pipe.read().decode().split(","))
    os.waitpid(pid, 0)
    parent = {new_event_id() for _ in range(50)}
    assert len(child) == 50
    assert not child & parent
