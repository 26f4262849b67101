"""HMAC-SHA256 signatures on Kafka records, carried in headers.

The MAC covers the record key (the saga id) and the encoded value, so a signed value
can be neither altered nor replayed under another saga. It travels in header
``sagaline-sig`` (lower-case hex) with the key id in ``sagaline-kid``, outside the
Avro body: the body stays byte-for-byte what the codec wrote, and the signature can
be checked before anything is parsed.

With no key configured a :class:`Signer` neither signs nor checks: a development
setting, stated loudly by :attr:`Signer.enabled` being false.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas.errors import BadSignature, MissingSignature

if TYPE_CHECKING:
    from schemas.models import Record
    from schemas.trust import Identity

SIG_HEADER = "sagaline-sig"
KID_HEADER = "sagaline-kid"
ALG_HEADER = "sagaline-alg"  # "ed25519" for identity signatures (schemas.trust); absent: HMAC

HeaderList = Sequence[tuple[str, bytes | str | None]] | dict[str, bytes | str | None]
"""Headers as confluent-kafka hands them over (its stubs allow a list or a dict)."""

Headers = list[tuple[str, str | bytes | None]]
"""Headers as confluent-kafka's ``produce`` takes them."""


def signed_material(key: bytes | None, value: bytes) -> bytes:
    """The bytes a signature covers: the record key and value."""
    # Length-prefix the key so (key, value) pairs cannot be re-split to collide.
    k = key or b""
    return struct.pack(">I", len(k)) + k + value


def header_value(headers: HeaderList | None, name: str) -> bytes | None:
    """The last value of header ``name`` (confluent-kafka gives ``None`` or a list)."""
    found: bytes | None = None
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    for h_name, h_value in pairs:
        if h_name == name:
            found = h_value.encode() if isinstance(h_value, str) else h_value
    return found


class Signer:
    """Signs and verifies records with one shared secret (the development mode).

    The base of :class:`schemas.trust.IdentitySigner`, which signs with a per-process
    Ed25519 key and also checks who may write what (:meth:`authorize`).

    Example::

        signer = Signer(b"s3cret", key_id="k1")
        headers = signer.headers(key, value)
        signer.verify(key, value, headers)  # raises BadSignature if tampered
    """

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes | None, key_id: str = "k1") -> None:
        self._key = key or None
        self.key_id = key_id

    @property
    def enabled(self) -> bool:
        """True when a key is configured: records are signed and must verify."""
        return self._key is not None

    @property
    def signs_as(self) -> str | None:
        """The identity this process signs as (None: a shared key names no one)."""
        return None

    def __repr__(self) -> str:
        # Never the key itself, not even a hash of it.
        return f"Signer(enabled={self.enabled}, key_id={self.key_id!r})"

    def sign(self, key: bytes | None, value: bytes) -> bytes:
        """The raw 32-byte MAC of (key, value); requires a configured key."""
        if self._key is None:
            raise ValueError("Signer has no key configured; set SAGALINE_HMAC_KEY to sign")
        return hmac.new(self._key, signed_material(key, value), hashlib.sha256).digest()

    def headers(self, key: bytes | None, value: bytes) -> Headers:
        """Headers to send with (key, value): empty when no key is configured."""
        if self._key is None:
            return []
        return [
            (SIG_HEADER, self.sign(key, value).hex().encode("ascii")),
            (KID_HEADER, self.key_id.encode("utf-8")),
        ]

    def verify(
        self, key: bytes | None, value: bytes, headers: HeaderList | None
    ) -> Identity | None:
        """Raise unless (key, value) carries a valid signature by this signer's key.

        Passes without checking when no key is configured. Returns the writer's
        identity (None here: a shared key names no one), to hand to :meth:`authorize`.
        """
        if self._key is None:
            return None
        sig = header_value(headers, SIG_HEADER)
        if sig is None:
            raise MissingSignature(
                f"record has no {SIG_HEADER} header but signing is enabled (key id "
                f"{self.key_id!r}); was it produced without SAGALINE_HMAC_KEY?"
            )
        kid = header_value(headers, KID_HEADER)
        kid_text = kid.decode("utf-8", "replace") if kid is not None else None
        if kid_text is not None and kid_text != self.key_id:
            raise BadSignature(
                f"record is signed with key id {shown(kid_text)}, this service holds "
                f"{self.key_id!r}"
            )
        try:
            given = bytes.fromhex(sig.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise BadSignature(f"{SIG_HEADER} header is not hex: {sig[:80]!r}") from None
        if not hmac.compare_digest(given, self.sign(key, value)):
            raise BadSignature(
                f"HMAC-SHA256 mismatch for key {_show(key)} (key id {self.key_id!r}): the value "
                "was altered, moved from another saga, or signed with another secret"
            )
        return None

    def authorize(
        self, record: Record, headers: HeaderList | None, writer: Identity | None = None
    ) -> None:
        """Raise unless the signer of ``record`` may write it. ``writer``: what
        :meth:`verify` returned for it. A shared key names no writer, so here every
        verified record passes."""


def shown(text: str | bytes | None, limit: int = 80) -> str:
    """``text`` (a header or key, as received) for an error message: its repr, cut at
    ``limit`` characters with its full length said, so a record carrying a huge one
    cannot put megabytes into every log line and DLQ detail about it."""
    if text is None or len(text) <= limit:
        return repr(text)
    unit = "bytes" if isinstance(text, bytes) else "characters"
    return f"{text[:limit]!r}... ({len(text)} {unit})"


def _show(key: bytes | None) -> str:
    if key is None:
        return "<none>"
    return repr(key.decode("utf-8", "replace")[:80])


__all__ = [
    "ALG_HEADER",
    "KID_HEADER",
    "SIG_HEADER",
    "Signer",
    "header_value",
    "shown",
    "signed_material",
]
