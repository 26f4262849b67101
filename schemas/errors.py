"""Typed errors of the record contract: decoding, validation and signing.

Every error carries a short, stable ``reason`` code. A consumer loop catches
:class:`CodecError`, sends the original bytes to the DLQ with ``reason`` in a header
(R16) and moves on; nothing here should ever stop a service.
"""

from __future__ import annotations

from typing import ClassVar


class CodecError(Exception):
    """Base of every error raised while turning bytes into a record (or back)."""

    reason: ClassVar[str] = "codec-error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class MalformedRecord(CodecError):
    """The bytes are not a single-object-encoded Avro record: bad magic, truncated,
    or a body that does not parse with the writer schema named in its header."""

    reason: ClassVar[str] = "malformed"


class UnknownFingerprint(CodecError):
    """The header names a writer schema this process has never seen.

    Usually a producer runs a newer contract: deploy the new ``.avsc`` (or register
    the writer schema) here, then replay the DLQ.
    """

    reason: ClassVar[str] = "unknown-fingerprint"

    def __init__(self, fingerprint: bytes, detail: str | None = None) -> None:
        self.fingerprint = fingerprint
        super().__init__(
            detail
            or f"no schema with CRC-64-AVRO fingerprint {fingerprint.hex()} is registered; "
            "register the writer schema (SchemaRegistry.register_writer) or deploy the "
            "contract version that produced it"
        )


class SchemaMismatch(CodecError):
    """The writer schema cannot be resolved to the reader's, or the record is not of
    the type the caller expected."""

    reason: ClassVar[str] = "schema-mismatch"


class InvalidRecord(CodecError):
    """The body decoded, but the model rejects it (e.g. envelope.type disagrees)."""

    reason: ClassVar[str] = "invalid-record"

    def __init__(self, record_type: str, fields: list[str], detail: str) -> None:
        self.record_type = record_type
        self.fields = fields
        super().__init__(detail)


class SignatureError(CodecError):
    """Base of the signing failures: the record is not provably ours."""

    reason: ClassVar[str] = "signature"


class BadSignature(SignatureError):
    """A signature is present but does not match the key and value (tampered, moved
    to another saga, or signed with another key)."""

    reason: ClassVar[str] = "bad-signature"


class MissingSignature(SignatureError):
    """A signing key is configured here, but the record carries no signature."""

    reason: ClassVar[str] = "missing-signature"


class UnknownKey(SignatureError):
    """A trust file is configured and the record's key id is not in it."""

    reason: ClassVar[str] = "unknown-key"


class RetiredKey(SignatureError):
    """The record's key id is marked retired in the trust file (rotated out)."""

    reason: ClassVar[str] = "retired-key"


class ForbiddenWriter(CodecError):
    """The signature is good, but its identity may not write this record (wrong role,
    another participant's step, an approval in someone else's name, ...)."""

    reason: ClassVar[str] = "forbidden-writer"


class TenantMismatch(CodecError):
    """The record's tenant is not one its writer (or this reader) may act for."""

    reason: ClassVar[str] = "tenant-mismatch"


__all__ = [
    "BadSignature",
    "CodecError",
    "ForbiddenWriter",
    "InvalidRecord",
    "MalformedRecord",
    "MissingSignature",
    "RetiredKey",
    "SchemaMismatch",
    "SignatureError",
    "TenantMismatch",
    "UnknownFingerprint",
    "UnknownKey",
]
