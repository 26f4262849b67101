"""Secret tool arguments, sealed so they reach the tool but never a topic in clear.

Redaction alone would starve the tool: a card number replaced by a marker cannot be
charged. So the agent seals each secret argument with AES-256-GCM under a key that
the agent and the participants share (``SAGALINE_SECRET_KEY``), and the participant
runtime opens it just before the tool runs. The ledger holds only the sealed form,
plus a fingerprint of the clear value so a person can still match it.

With no key configured, secrets are redacted instead: the tool then receives the
redaction marker, and the agent logs that the tool will not see the value.

A sealed value is ``{"$sealed": "<base64 nonce|ciphertext>", "fp": "<marker>"}``. The
saga id and the argument path are the associated data, so a sealed value copied to
another saga or another field does not open.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from schemas.redaction import map_secrets, redaction_marker

SEALED = "$sealed"


class SealError(ValueError):
    """A sealed argument cannot be opened: wrong key, tampered, or moved."""


def derive_key(secret: str | bytes) -> bytes:
    """A 32-byte AES key from the configured secret (any length, any text)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(b"sagaline-seal-v1:" + raw).digest()


class Sealer:
    """Seals and opens secret arguments; ``key=None`` means redact only."""

    def __init__(self, key: bytes | None) -> None:
        self._aead = AESGCM(derive_key(key)) if key else None

    def __repr__(self) -> str:
        return f"Sealer(enabled={self.enabled})"

    @property
    def enabled(self) -> bool:
        return self._aead is not None

    def seal(
        self, args: Mapping[str, Any], secret_paths: Iterable[str], saga_id: str
    ) -> dict[str, Any]:
        """``args`` with every secret sealed (or redacted when no key is configured)."""
        aead = self._aead
        if aead is None:
            return map_secrets(args, secret_paths, redaction_marker)
        out: Mapping[str, Any] = args
        for path in secret_paths:

            def seal_one(value: Any, path: str = path) -> Any:
                if is_sealed(value):
                    return value
                nonce = os.urandom(12)
                clear = orjson.dumps(value)
                box = aead.encrypt(nonce, clear, _aad(saga_id, path))
                return {
                    SEALED: base64.b64encode(nonce + box).decode("ascii"),
                    "fp": redaction_marker(value),
                }

            out = map_secrets(out, [path], seal_one)
        return dict(out)

    def open(
        self, args: Mapping[str, Any], secret_paths: Iterable[str], saga_id: str
    ) -> dict[str, Any]:
        """``args`` with every sealed secret opened, for the tool itself."""
        out: Mapping[str, Any] = args
        for path in secret_paths:

            def open_one(value: Any, path: str = path) -> Any:
                if not is_sealed(value):
                    return value
                if self._aead is None:
                    raise SealError(
                        f"argument {path!r} is sealed but this process has no "
                        "SAGALINE_SECRET_KEY: configure the same key as the agent"
                    )
                data = base64.b64decode(value[SEALED])
                try:
                    clear = self._aead.decrypt(data[:12], data[12:], _aad(saga_id, path))
                except InvalidTag:
                    raise SealError(
                        f"argument {path!r} of saga {saga_id} does not open with this key "
                        "(another key, tampered, or copied from another saga or field)"
                    ) from None
                return orjson.loads(clear)

            out = map_secrets(out, [path], open_one)
        return dict(out)


def is_sealed(value: Any) -> bool:
    return isinstance(value, Mapping) and SEALED in value


def _aad(saga_id: str, path: str) -> bytes:
    return f"{saga_id}\x00{path}".encode()
