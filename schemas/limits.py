"""Declared size limits: the one place that says how big a saga may get.

Kafka refuses a record over the broker's ``message.max.bytes`` (1 MB by default), and
one record that can never be written must not stop every other saga. So the limits
below are checked where data enters, well under that size:

* the saga client refuses a call whose arguments are too big (or not JSON at all:
  NaN/Infinity), or a step past ``max_steps``, before anything is produced
  (:class:`participants.client.CallRefused`); the coordinator rejects a step past its
  own ``max_steps`` (``too-many-steps``), whoever wrote it;
* a participant whose tool returns a result over ``max_result_bytes`` publishes the
  commit without the result (a marker with size and fingerprint) plus an incident;
* the coordinator checks every state record and output against ``max_record_bytes``
  before its transaction and parks the one saga that does not fit;
* the coordinator makes command topics for at most ``max_participants`` participants
  (those whose topics exist included): a saga naming another one is parked, so a
  writer naming made-up participants cannot have a topic made for each.

=====================================  =========================  =========================
environment variable                   field                      default
=====================================  =========================  =========================
``SAGALINE_MAX_ARGS_BYTES``            ``max_args_bytes``         256 KiB
``SAGALINE_MAX_RESULT_BYTES``          ``max_result_bytes``       256 KiB
``SAGALINE_MAX_STEPS``                 ``max_steps``              256 steps per saga
``SAGALINE_MAX_RECORD_BYTES``          ``max_record_bytes``       900 KiB (at least 64 KiB)
``SAGALINE_MAX_PARTICIPANTS``          ``max_participants``       1000 with a command topic
``SAGALINE_TERMINAL_MEMORY_MS``        ``terminal_memory_ms``     373 days (events kept, a day)
=====================================  =========================  =========================

``terminal_memory_ms`` is how long the coordinator remembers that a saga ended (a
tiny marker in its changelog), so that re-delivered history of a finished saga
changes nothing. It defaults to the longest ``sagaline.events`` keeps a record as
created (``retention.ms`` 365 days, plus ``segment.ms`` 7 days: Kafka deletes whole
segments) plus :data:`RETENTION_MARGIN_MS`, after which that history cannot be
re-delivered anyway. The coordinator refuses to start with less than its events
topic keeps a record, as the broker says (``coordinator.shell``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.topics import EVENTS_RETENTION_MS, EVENTS_SEGMENT_MS

KIB = 1024
DAY_MS = 24 * 3600 * 1000
RETENTION_MARGIN_MS = DAY_MS
"""What a memory of a topic's records (the coordinator's terminal markers, a
participant's journal) outlasts the topic's ``retention.ms + segment.ms`` by: the
broker's retention check (``log.retention.check.interval.ms``, 5 min by default) and
a writer's clock ahead of the reader's (records carry the writer's timestamps)."""

RESULT_OMITTED = "sagaline_result_omitted"
"""Key of the marker that stands in for a tool result over the limit:
``{"sagaline_result_omitted": {"bytes": N, "limit": L, "fingerprint": F}}``."""

RESULT_TOO_LARGE = "result-too-large"
"""Kind of the incident a participant raises next to an omitted result."""

PARKED_INCIDENT = "saga-parked"
"""Kind of the incident the coordinator raises when it parks a saga (and the DLQ
reason of the saga's records it receives afterwards)."""


MAX_OPERATOR_TEXT_BYTES = 8 * KIB
"""The most bytes of an operator's free text: a denial's reason, an incident
resolution's resolution or note, the operator's name. The coordinator copies them
into the saga's state and receipt; the operator channel refuses longer ones
(:class:`sagaline.ops.actions.DecisionTooLarge`), and the coordinator keeps only
this much of a longer one written past it (:func:`cut_operator_text`)."""


def cut_operator_text(text: str) -> str:
    """``text`` as the coordinator copies it into a saga's state, receipt or a
    refusal's detail: unchanged up to :data:`MAX_OPERATOR_TEXT_BYTES`, else its first
    that many bytes (never half a character) and a marker with its full size, so one
    long note written past the operator channel (or an agent's long abort reason)
    cannot get the saga parked.
    Deterministic: the same text is always cut the same way."""
    if len(text) <= MAX_OPERATOR_TEXT_BYTES // 4:  # at most 4 bytes a character
        return text
    raw = text.encode()
    if len(raw) <= MAX_OPERATOR_TEXT_BYTES:
        return text
    kept = raw[:MAX_OPERATOR_TEXT_BYTES].decode("utf-8", "ignore")
    return f"{kept}… [cut: {len(raw)} bytes in all]"


MIN_RECORD_BYTES = 64 * KIB
"""The least ``SAGALINE_MAX_RECORD_BYTES`` may be. The coordinator copies an operator's
decision (up to three texts of :data:`MAX_OPERATOR_TEXT_BYTES`: a resolution, a note,
the operator's name) into the saga's state and receipt, and a saga's state holds its
steps; below this every saga's state, or the decisions the operator channel takes,
would be over the limit: every saga parked (an incident each), every decision
refused. A smaller value is a typo (KiB meant), refused at start."""


class LimitsError(ValueError):
    """An environment variable holds a limit Sagaline cannot use."""


@dataclass(frozen=True)
class Limits:
    """Sizes in bytes of the JSON bodies as written to the ledger."""

    max_args_bytes: int = 256 * KIB
    max_result_bytes: int = 256 * KIB
    max_steps: int = 256
    max_record_bytes: int = 900 * KIB
    max_participants: int = 1000
    terminal_memory_ms: int = EVENTS_RETENTION_MS + EVENTS_SEGMENT_MS + RETENTION_MARGIN_MS

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Limits:
        """The defaults, overridden by the ``SAGALINE_MAX_*`` variables that are set
        (empty or blank counts as unset, as for every variable)."""
        values: dict[str, int] = {}
        for var, name in _ENV.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                value = int(raw)
            except ValueError:
                raise LimitsError(f"{var}={raw!r} is not an integer") from None
            least = _LEAST.get(var, 1)
            if value < least:
                why = _LEAST_WHY.get(var, "")
                raise LimitsError(f"{var}={value} must be at least {least}{why}")
            values[name] = value
        return cls(**values)


_ENV = {
    "SAGALINE_MAX_ARGS_BYTES": "max_args_bytes",
    "SAGALINE_MAX_RESULT_BYTES": "max_result_bytes",
    "SAGALINE_MAX_STEPS": "max_steps",
    "SAGALINE_MAX_RECORD_BYTES": "max_record_bytes",
    "SAGALINE_MAX_PARTICIPANTS": "max_participants",
    "SAGALINE_TERMINAL_MEMORY_MS": "terminal_memory_ms",
}
LIMIT_ENV_VARS: tuple[str, ...] = tuple(_ENV)
# The least value of a variable, where it is more than 1, and why (MIN_RECORD_BYTES)
_LEAST = {"SAGALINE_MAX_RECORD_BYTES": MIN_RECORD_BYTES}
_LEAST_WHY = {
    "SAGALINE_MAX_RECORD_BYTES": (
        f" ({MIN_RECORD_BYTES // KIB} KiB: below it every saga's state, or an operator's "
        "decision, would be over it and every saga parked; the value is in bytes, the "
        f"default {900 * KIB})"
    )
}

DEFAULT_LIMITS = Limits()


def omitted_result(size: int, limit: int, result_fingerprint: str) -> dict[str, object]:
    """The marker a participant publishes instead of a result over the limit."""
    return {RESULT_OMITTED: {"bytes": size, "limit": limit, "fingerprint": result_fingerprint}}


def is_omitted_result(value: object) -> bool:
    return isinstance(value, dict) and set(value) == {RESULT_OMITTED}


__all__ = [
    "DEFAULT_LIMITS",
    "LIMIT_ENV_VARS",
    "MIN_RECORD_BYTES",
    "PARKED_INCIDENT",
    "RESULT_OMITTED",
    "RESULT_TOO_LARGE",
    "RETENTION_MARGIN_MS",
    "Limits",
    "LimitsError",
    "is_omitted_result",
    "omitted_result",
]
