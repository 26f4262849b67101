"""Deterministic identities: fingerprints, idempotency keys and event ids.

Every party derives the same key from the same facts, so a retry, a redelivery or a
replay lands on the same provider operation instead of creating a second one.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from typing import Any

import orjson

_NAMESPACE = uuid.UUID("8f0b1d0e-5a6c-4c8e-9a57-5a9a11e0c0de")
_NAMESPACE_BYTES = _NAMESPACE.bytes


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: equal values give equal bytes."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def fingerprint(data: bytes) -> str:
    """A short, stable fingerprint of bytes (sha256, hex, 32 chars)."""
    return hashlib.sha256(data).hexdigest()[:32]


SEALED = "$sealed"
"""The key of a sealed secret argument (``schemas.sealing``)."""
_SEALED_JSON = b'"$sealed"'


def args_fingerprint(args_json: bytes) -> str:
    """Fingerprint of tool arguments, normalised so key order does not matter.

    A sealed secret counts as its keyed marker (``"fp"``, an HMAC of the clear value),
    not its nonce and ciphertext: sealing is randomised, so the same call sealed
    again (a repeat under its step id) has other bytes but the same fingerprint, and
    the fingerprint tells no more of the secret than the marker already on the record.
    """
    args = orjson.loads(args_json)
    if _SEALED_JSON in args_json:  # the common case, no secret sealed, is not walked
        args = sealed_as_markers(args)
    return fingerprint(canonical_json(args))


def sealed_as_markers(value: Any) -> Any:
    """``value`` with every sealed secret in it as its keyed marker only."""
    if isinstance(value, dict):
        if SEALED in value and isinstance(value.get("fp"), str):
            return {SEALED: True, "fp": value["fp"]}
        return {k: sealed_as_markers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [sealed_as_markers(v) for v in value]
    return value


def idempotency_key(saga_id: str, step_id: str, tool: str, args_json: bytes) -> str:
    """The forward key: the same saga, step, tool and arguments give the same key."""
    material = canonical_json([saga_id, step_id, tool, orjson.loads(args_json)])
    return "idem-" + hashlib.sha256(material).hexdigest()[:40]


def compensation_key(forward_key: str) -> str:
    """The compensation key derives from the forward key, so retries repeat it (R8)."""
    return "comp-" + hashlib.sha256(b"compensate:" + forward_key.encode()).hexdigest()[:40]


def key_hash(key: str) -> str:
    """What a receipt shows of a key: enough to correlate, not enough to replay."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


STEP_ID_SEPARATOR = "/"


def step_id_problem(step_id: str) -> str | None:
    """Why ``step_id`` cannot name a step, or ``None``.

    :func:`derived_event_id` joins its parts with ``/``, so a step id holding one
    would make ids collide (generation 1's step ``"2/x"`` and generation 2's step
    ``"x"`` would get the same approval id). Checked where step ids enter: the
    agent's client refuses the call, the coordinator rejects the record."""
    if STEP_ID_SEPARATOR in step_id:
        return (
            f"step id {step_id!r} contains {STEP_ID_SEPARATOR!r}, which derived ids use "
            "as their separator; use another character (e.g. '-' or ':')"
        )
    return None


def derived_event_id(*parts: str | int) -> str:
    """A deterministic event id, so re-deciding the same input emits the same ids
    (replays and retries are deduplicated downstream).

    ``str(uuid.uuid5(_NAMESPACE, "/".join(parts)))``, computed without building a
    ``UUID`` (the coordinator derives one per output record)."""
    name = "/".join(p if isinstance(p, str) else str(p) for p in parts)
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_event_id() -> str:
    """A random event id (a version 4 UUID, as ``str(uuid.uuid4())``).

    The randomness is read from ``os.urandom`` a block at a time: one system call
    per 256 ids instead of one per id (an agent makes an id for every record it
    writes). A forked child drops the parent's unread block, so the two never hand
    out the same ids."""
    global _random, _random_at
    with _random_lock:
        if _random_at >= len(_random):
            _random, _random_at = os.urandom(16 * 256), 0
        raw = bytearray(_random[_random_at : _random_at + 16])
        _random_at += 16
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_random_lock = threading.Lock()
_random = b""
_random_at = 0


def _forget_random() -> None:
    global _random, _random_at, _random_lock
    _random, _random_at = b"", 0
    _random_lock = threading.Lock()  # a thread of the parent may have held it


os.register_at_fork(after_in_child=_forget_random)
