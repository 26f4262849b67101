"""A tool that writes down every call it gets (when, in which process), for the
participant concurrency test. Served by ``sagaline participant run`` in its own
process (``--catalogue tests.concurrency_tools:catalogue``), so a kill -9 is real.
Not a test module."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from participants import CompensationContext, compensable, current_call, tool, wrap
from participants.catalogue import Catalogue

PARTICIPANT = "conc"
DB_VAR = "CONCURRENCY_TOOL_DB"


def open_calls(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS calls (key TEXT, saga_id TEXT, seq INTEGER, pid INTEGER, "
        "start_ns INTEGER, end_ns INTEGER)"
    )
    return db


class Worker:
    def __init__(self) -> None:
        self.db = open_calls(Path(os.environ[DB_VAR]))
        self.lock = threading.Lock()

    @tool(description="Does a little work and writes down that it did", deadline=30.0)
    @compensable(by="undo")
    def work(self, saga: str, seq: int) -> dict[str, int]:
        call = current_call()
        with self.lock:
            row = self.db.execute(
                "INSERT INTO calls VALUES (?, ?, ?, ?, ?, NULL)",
                (call.idempotency_key, call.saga_id, seq, os.getpid(), time.time_ns()),
            ).lastrowid
        time.sleep(0.02)  # the work itself, so that calls of different sagas overlap
        with self.lock:
            self.db.execute("UPDATE calls SET end_ns = ? WHERE rowid = ?", (time.time_ns(), row))
        return {"seq": seq}

    def undo(self, ctx: CompensationContext) -> None:
        pass


def catalogue() -> Catalogue:
    return wrap(Worker(), name=PARTICIPANT)
