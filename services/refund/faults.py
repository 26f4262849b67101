"""Fault injection for the example participants, by configuration.

A ``FaultPlan`` is a seed and a list of ``FaultRule``s. A rule names a method (a
tool, or a compensation such as ``release_hold``), a mode, and which calls it hits:
those whose arguments match ``where`` (for a compensation, the forward call's
arguments) and, among them, a ``probability`` share chosen by hashing (seed, rule,
method, idempotency key). The choice is a pure function of those, so a seeded demo
run injects the same faults every time, in every process.

Modes:

- ``reject``: raise a business rejection (never retried, R9).
- ``transient``: fail ``times`` times per idempotency key, then succeed (``times``
  null: always fail, e.g. a compensation that never succeeds, R8).
- ``commit_then_timeout``: perform the effect, then sleep past the tool's deadline
  (``times`` times per key), so the runtime reports an unknown outcome and
  reconciles by lookup (R11).
- ``slow``: sleep ``delay_ms`` before the call.
- ``throttle``: a transient ``Throttled`` error when matching calls exceed
  ``max_per_second`` in the last second (per process).

Attempt counts live in a small SQLite file in the state directory, so a restarted
participant does not fail a key all over again.

The plan comes from ``SAGALINE_FAULTS`` (JSON text, or ``@/path/to/plan.json``), a
file (``FaultPlan.load``), or code.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from services.refund._store import SqliteStore
from services.refund.errors import (
    FaultPlanError,
    InjectedRejection,
    InjectedTransientFailure,
    Throttled,
)

__all__ = ["FAULTS_ENV", "FaultInjector", "FaultMode", "FaultPlan", "FaultRule"]

FAULTS_ENV = "SAGALINE_FAULTS"
T = TypeVar("T")
Scalar = str | int | float | bool


class FaultMode(StrEnum):
    REJECT = "reject"
    TRANSIENT = "transient"
    COMMIT_THEN_TIMEOUT = "commit_then_timeout"
    SLOW = "slow"
    THROTTLE = "throttle"


class FaultRule(BaseModel):
    """One injected fault. See the module docstring for the modes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field(description="tool or compensation method name, e.g. issue_credit")
    mode: FaultMode
    where: dict[str, list[Scalar]] = Field(
        default_factory=dict,
        description="argument -> accepted values; all must match (empty: every call)",
    )
    probability: float = Field(default=1.0, ge=0.0, le=1.0)
    times: int | None = Field(default=1, ge=1, description="per idempotency key; null = always")
    delay_ms: int | None = Field(
        default=None,
        ge=0,
        description="slow: the delay; commit_then_timeout: the sleep (default deadline + 500)",
    )
    max_per_second: float = Field(default=10.0, gt=0)
    message: str | None = None

    def matches(self, args: Mapping[str, Any]) -> bool:
        return all(args.get(name) in accepted for name, accepted in self.where.items())


class FaultPlan(BaseModel):
    """The faults to inject: a seed and rules. The empty plan injects nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    rules: list[FaultRule] = Field(default_factory=list)

    @classmethod
    def none(cls) -> FaultPlan:
        return cls()

    @classmethod
    def parse(cls, text: str, *, source: str = "fault plan") -> FaultPlan:
        try:
            return cls.model_validate_json(text)
        except pydantic.ValidationError as exc:
            raise FaultPlanError(f"{source} is not a valid fault plan: {exc}") from exc

    @classmethod
    def load(cls, path: Path) -> FaultPlan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise FaultPlanError(f"cannot read fault plan file {path}: {exc}") from exc
        return cls.parse(text, source=str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan:
        """The plan in ``SAGALINE_FAULTS``: JSON, or ``@path`` to a JSON file; none
        when unset or empty."""
        value = (os.environ if environ is None else environ).get(FAULTS_ENV, "").strip()
        if not value:
            return cls.none()
        if value.startswith("@"):
            return cls.load(Path(value[1:]))
        return cls.parse(value, source=f"${FAULTS_ENV}")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    def for_method(self, method: str) -> list[tuple[int, FaultRule]]:
        return [(i, r) for i, r in enumerate(self.rules) if r.method == method]


class FaultInjector:
    """Applies a ``FaultPlan`` around provider calls.

    ``state_dir`` holds the per-key attempt counts (``faults.sqlite3``); without it
    they are kept in memory.
    """

    def __init__(self, plan: FaultPlan, state_dir: Path | None = None) -> None:
        self.plan = plan
        self._store = (
            SqliteStore(
                Path(state_dir) / "faults.sqlite3",
                "CREATE TABLE IF NOT EXISTS attempts ("
                " rule INTEGER, method TEXT, key TEXT, count INTEGER NOT NULL,"
                " PRIMARY KEY (rule, method, key));",
            )
            if state_dir is not None and plan.rules
            else None
        )
        self._counts: dict[tuple[int, str, str], int] = {}
        self._lock = threading.Lock()
        self._calls: dict[int, deque[float]] = {}

    def call(
        self,
        method: str,
        key: str,
        args: Mapping[str, Any],
        perform: Callable[[], T],
        *,
        deadline_ms: int,
    ) -> T:
        """Run ``perform`` (the provider call) with the faults the plan picks for
        this (method, key, args)."""
        rules = [
            (i, r)
            for i, r in self.plan.for_method(method)
            if r.matches(args) and self._chosen(i, r, method, key)
        ]
        for index, rule in rules:
            self._before(index, rule, method, key)
        result = perform()
        for index, rule in rules:
            if rule.mode is FaultMode.COMMIT_THEN_TIMEOUT and self._take(index, rule, method, key):
                delay = rule.delay_ms if rule.delay_ms is not None else deadline_ms + 500
                time.sleep(delay / 1000)
        return result

    def _before(self, index: int, rule: FaultRule, method: str, key: str) -> None:
        if rule.mode is FaultMode.SLOW:
            time.sleep((rule.delay_ms or 0) / 1000)
        elif rule.mode is FaultMode.THROTTLE:
            if not self._admit(index, rule.max_per_second):
                raise Throttled(
                    rule.message
                    or f"{method}: more than {rule.max_per_second:g} calls per second;"
                    " slow down and retry"
                )
        elif rule.mode is FaultMode.REJECT:
            raise InjectedRejection(rule.message or f"{method}: rejected by the fault plan")
        elif rule.mode is FaultMode.TRANSIENT and self._take(index, rule, method, key):
            raise InjectedTransientFailure(
                rule.message or f"{method}: provider unavailable (injected), try again"
            )

    def _chosen(self, index: int, rule: FaultRule, method: str, key: str) -> bool:
        if rule.probability >= 1.0:
            return True
        material = f"{self.plan.seed}/{index}/{method}/{key}".encode()
        draw = int.from_bytes(hashlib.sha256(material).digest()[:8], "big") / 2**64
        return draw < rule.probability

    def _take(self, index: int, rule: FaultRule, method: str, key: str) -> bool:
        """Count one injection for this key; False once ``times`` are used up."""
        if rule.times is None:
            return True
        if self._store is None:
            with self._lock:
                used = self._counts.get((index, method, key), 0)
                if used >= rule.times:
                    return False
                self._counts[(index, method, key)] = used + 1
                return True
        with self._store.transaction() as conn:
            row = conn.execute(
                "SELECT count FROM attempts WHERE rule = ? AND method = ? AND key = ?",
                (index, method, key),
            ).fetchone()
            used = row[0] if row else 0
            if used >= rule.times:
                return False
            conn.execute(
                "INSERT INTO attempts VALUES (?, ?, ?, 1) ON CONFLICT(rule, method, key)"
                " DO UPDATE SET count = count + 1",
                (index, method, key),
            )
            return True

    def _admit(self, index: int, max_per_second: float) -> bool:
        now = time.monotonic()
        with self._lock:
            window = self._calls.setdefault(index, deque())
            while window and now - window[0] >= 1.0:
                window.popleft()
            if len(window) >= max_per_second:
                return False
            window.append(now)
            return True
