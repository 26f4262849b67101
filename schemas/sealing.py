"""Secret tool arguments, sealed so they reach the tool but never a topic in clear.

Redaction alone would starve the tool: a card number replaced by a marker cannot be
charged. So the agent seals each secret argument with AES-256-GCM under a key that
the agent and the participants share (``SAGALINE_SECRET_KEY``), and the participant
runtime opens it just before the tool runs. The ledger holds only the sealed form,
plus a keyed fingerprint of the clear value (an HMAC-SHA256 under a marker key
derived from the same secret) so whoever holds the key can still match it, and
nobody else can test guesses against it.

With no key configured, secrets are redacted instead: the tool then receives the
redaction marker (``"[redacted]"``, the same for every value), and the agent logs
that the tool will not see the value.

A sealed value is ``{"$sealed": "<base64 nonce|ciphertext>", "fp": "<marker>",
"kid": "<key id>"}``. The saga id and the argument path are the associated data, so a
sealed value copied to another saga or another field does not open.

Rotation: the AES key is derived with HKDF-SHA256 from the secret, with the key id in
the derivation, and every sealed value names its key id. A process seals with its
current key (``SAGALINE_SECRET_KEY`` / ``SAGALINE_SECRET_KEY_ID``) and opens with that
key or any old one it still holds (``SAGALINE_OLD_SECRET_KEYS``), so sagas in flight
survive a key change. Values sealed before key ids existed (no ``kid``) open with the
current secret under the original derivation.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from schemas.keys import SEALED, sealed_as_markers
from schemas.redaction import is_redacted, map_secrets, redaction_marker, reveal

_NONCE = 12  # bytes of AES-GCM nonce before the ciphertext
_TAG = 16  # bytes of AES-GCM tag at the ciphertext's end


class SealError(ValueError):
    """A sealed argument cannot be opened: wrong key, tampered, or moved."""


def derive_key(secret: str | bytes, key_id: str | None = None) -> bytes:
    """A 32-byte AES key from the configured secret (any length, any text).

    With a key id: HKDF-SHA256 bound to that id. Without: the original derivation,
    kept so values sealed before key ids still open.
    """
    raw = secret.encode() if isinstance(secret, str) else secret
    if key_id is None:
        return hashlib.sha256(b"sagaline-seal-v1:" + raw).digest()
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=b"sagaline-seal",
        info=b"sagaline-seal-v2:" + key_id.encode("utf-8"),
    ).derive(raw)


def derive_marker_key(secret: str | bytes) -> bytes:
    """The HMAC key of redaction markers (:func:`schemas.redaction.redaction_marker`),
    from the configured secret: never the AES key itself."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=b"sagaline-marker",
        info=b"sagaline-marker-v1",
    ).derive(raw)


class Sealer:
    """Seals and opens secret arguments; ``key=None`` means redact only.

    ``old_keys`` (key id -> secret) only open values sealed before a rotation.
    """

    def __init__(
        self,
        key: bytes | None,
        key_id: str = "s1",
        old_keys: Mapping[str, bytes] | None = None,
    ) -> None:
        self.key_id = key_id
        self._aead = AESGCM(derive_key(key, key_id)) if key else None
        self.marker_key: bytes | None = derive_marker_key(key) if key else None
        """Keys redaction markers (``None``: every marker is ``"[redacted]"``)."""
        self._openers = {
            kid: AESGCM(derive_key(secret, kid)) for kid, secret in (old_keys or {}).items()
        }
        if self._aead is not None and key:
            self._openers[key_id] = self._aead
            self._openers[""] = AESGCM(derive_key(key))  # sealed before key ids

    def __repr__(self) -> str:
        return f"Sealer(enabled={self.enabled})"

    @property
    def enabled(self) -> bool:
        return self._aead is not None

    def marker(self, value: Any) -> str:
        """The redaction marker of ``value`` under this process's marker key."""
        return redaction_marker(value, self.marker_key)

    def seal(
        self, args: Mapping[str, Any], secret_paths: Iterable[str], saga_id: str
    ) -> dict[str, Any]:
        """``args`` with every secret sealed (or redacted when no key is configured)."""
        aead = self._aead
        if aead is None:
            return map_secrets(args, secret_paths, self.marker)
        out: Mapping[str, Any] = args
        for path in secret_paths:

            def seal_one(value: Any, path: str = path) -> Any:
                if is_sealed(value):
                    return value
                nonce = os.urandom(_NONCE)
                clear = orjson.dumps(value, default=reveal)  # SecretStr: its value
                box = aead.encrypt(nonce, clear, _aad(saga_id, path))
                return {
                    SEALED: base64.b64encode(nonce + box).decode("ascii"),
                    # A secret sealed inside this one counts as its marker, not its
                    # random nonce: the same value, sealed again, has the same marker.
                    "fp": self.marker(sealed_as_markers(value)),
                    "kid": self.key_id,
                }

            out = map_secrets(out, [path], seal_one)
        return dict(out)

    def open(
        self,
        args: Mapping[str, Any],
        secret_paths: Iterable[str],
        saga_id: str,
        *,
        refuse_redacted: bool = False,
    ) -> dict[str, Any]:
        """``args`` with every sealed secret opened, for the tool itself.

        In the reverse order of :meth:`seal`: a path sealed later may hold one sealed
        earlier (``t.*`` around ``t.*.pin``), which opens only once the outer one has.
        ``refuse_redacted`` (a forward call): a secret that arrives as a redaction
        marker while this process holds a key is a :class:`SealError` too: the agent
        had no key, and the tool would get the marker for the secret."""
        out: Mapping[str, Any] = args
        for path in reversed(tuple(secret_paths)):

            def open_one(value: Any, path: str = path) -> Any:
                if not is_sealed(value):
                    if refuse_redacted and self.enabled and is_redacted(value):
                        raise SealError(
                            f"argument {path!r} arrived redacted, not sealed: the agent "
                            "that called the tool holds no SAGALINE_SECRET_KEY; set it "
                            "there as this participant has it"
                        )
                    return value
                kid = str(value.get("kid") or "")
                aead = self._openers.get(kid)
                if aead is None:
                    raise SealError(
                        f"argument {path!r} is sealed under key id {kid or '(none)'!r}, "
                        "which this process does not hold: set SAGALINE_SECRET_KEY (and "
                        "SAGALINE_OLD_SECRET_KEYS for rotated keys) as the agent has them"
                    )
                try:
                    data = base64.b64decode(value[SEALED])
                except (ValueError, TypeError):  # binascii.Error is a ValueError
                    data = b""
                if len(data) < _NONCE + _TAG:
                    raise SealError(
                        f"argument {path!r} of saga {saga_id} is malformed: its sealed value "
                        "is not the base64 of a 12-byte nonce and a ciphertext with its "
                        "16-byte tag"
                    )
                try:
                    clear = aead.decrypt(data[:_NONCE], data[_NONCE:], _aad(saga_id, path))
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
