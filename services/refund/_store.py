"""The one SQLite store every example provider stands on.

A provider in the refund example is a stand-in for someone else's system (a payment
processor, a warehouse, a mail gateway). What makes it worth testing against is that
it keeps real state on disk and behaves the way a good provider API does: an
idempotency key names one operation forever, so a retry, a redelivery or a restarted
process gets the first answer back instead of a second effect. Every effect is also
appended to an ordered log, so a test can check "compensated exactly once" and "in
this order" against the provider's own record rather than the coordinator's.

Concurrency: one connection per store, guarded by a lock (a couple of runtime threads
share it), and ``BEGIN IMMEDIATE`` transactions in WAL mode, so two processes on the
same file (a killed service and its restart) serialise on SQLite's write lock.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from schemas.keys import canonical_json
from services.refund.errors import IdempotencyKeyReused

_BASE_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    idempotency_key TEXT PRIMARY KEY,
    kind            TEXT NOT NULL,
    request         BLOB NOT NULL,
    operation_id    TEXT NOT NULL,
    result          BLOB NOT NULL,
    at              REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS effects (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    at              REAL NOT NULL,
    kind            TEXT NOT NULL,
    idempotency_key TEXT,
    operation_id    TEXT,
    detail          BLOB NOT NULL
);
"""


@dataclass(frozen=True)
class Operation:
    """One provider operation, as first performed under its idempotency key.

    ``replayed`` is True when this call found the operation already done and
    changed nothing.
    """

    idempotency_key: str
    kind: str
    operation_id: str
    result: dict[str, Any]
    at: float
    replayed: bool = False


@dataclass(frozen=True)
class Effect:
    """One entry of a provider's ordered effect log."""

    seq: int
    at: float
    kind: str
    idempotency_key: str | None
    operation_id: str | None
    detail: dict[str, Any]


Apply = Callable[[sqlite3.Connection], tuple[str, dict[str, Any]]]
"""Applies an operation inside the open transaction; returns (operation id, result)."""


class SqliteStore:
    """A SQLite file with an idempotent ``perform`` and an effect log.

    ``schema`` is the provider's own tables (``CREATE TABLE IF NOT EXISTS ...``).
    """

    def __init__(self, path: Path, schema: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a transaction is
        # exactly one `perform` and nothing is committed implicitly.
        self._conn = sqlite3.connect(
            path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # durable across process kills
        self._conn.execute("PRAGMA busy_timeout=30000")
        with self._lock:
            self._conn.executescript(_BASE_SCHEMA + schema)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; rolled back if the block raises."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """Read rows (as ``sqlite3.Row``) outside any write transaction."""
        with self._lock:
            cursor = self._conn.execute(sql, params)
            cursor.row_factory = sqlite3.Row
            return list(cursor.fetchall())

    def perform(
        self, idempotency_key: str, kind: str, request: dict[str, Any], apply: Apply
    ) -> Operation:
        """Run ``apply`` once per idempotency key.

        The first call applies the operation and stores its result in the same
        transaction; every later call with the key returns that stored result and
        changes nothing. Reusing a key for a different kind of operation or other
        arguments raises ``IdempotencyKeyReused``: that is a caller bug, and
        answering it with the first result would hide it.
        """
        if not idempotency_key:
            raise ValueError(f"{kind}: an idempotency key is required (got an empty key)")
        request_bytes = canonical_json(request)
        with self.transaction() as conn:
            row = conn.execute(
                "SELECT kind, request, operation_id, result, at FROM operations"
                " WHERE idempotency_key = ?",
                (idempotency_key,),
            ).fetchone()
            if row is not None:
                if row[0] != kind or bytes(row[1]) != request_bytes:
                    raise IdempotencyKeyReused(
                        idempotency_key,
                        first=f"{row[0]} {bytes(row[1]).decode()}",
                        now=f"{kind} {request_bytes.decode()}",
                    )
                return Operation(
                    idempotency_key, kind, row[2], orjson.loads(row[3]), row[4], replayed=True
                )
            operation_id, result = apply(conn)
            at = time.time()
            conn.execute(
                "INSERT INTO operations VALUES (?, ?, ?, ?, ?, ?)",
                (idempotency_key, kind, request_bytes, operation_id, orjson.dumps(result), at),
            )
            return Operation(idempotency_key, kind, operation_id, result, at)

    def lookup(self, idempotency_key: str) -> Operation | None:
        """The operation performed under ``idempotency_key``, or None if none was."""
        rows = self.query(
            "SELECT kind, operation_id, result, at FROM operations WHERE idempotency_key = ?",
            (idempotency_key,),
        )
        if not rows:
            return None
        row = rows[0]
        return Operation(
            idempotency_key,
            row["kind"],
            row["operation_id"],
            orjson.loads(row["result"]),
            row["at"],
            replayed=True,
        )

    @staticmethod
    def record_effect(
        conn: sqlite3.Connection,
        kind: str,
        *,
        idempotency_key: str | None = None,
        operation_id: str | None = None,
        **detail: Any,
    ) -> None:
        """Append to the effect log, inside the caller's transaction."""
        conn.execute(
            "INSERT INTO effects (at, kind, idempotency_key, operation_id, detail)"
            " VALUES (?, ?, ?, ?, ?)",
            (time.time(), kind, idempotency_key, operation_id, orjson.dumps(detail)),
        )

    def effects(self, kind: str | None = None) -> list[Effect]:
        """The effect log in order; only entries of ``kind`` when given."""
        sql = "SELECT seq, at, kind, idempotency_key, operation_id, detail FROM effects"
        params: tuple[Any, ...] = ()
        if kind is not None:
            sql += " WHERE kind = ?"
            params = (kind,)
        return [
            Effect(
                r["seq"],
                r["at"],
                r["kind"],
                r["idempotency_key"],
                r["operation_id"],
                orjson.loads(r["detail"]),
            )
            for r in self.query(sql + " ORDER BY seq", params)
        ]
