"""The record codec: Avro single-object encoding over the pydantic models.

Frame: ``C3 01`` + the writer schema's 8-byte CRC-64-AVRO fingerprint (little-endian)
+ the fastavro schemaless body. The fingerprint tells any reader which schema wrote
the bytes; the reader resolves that writer schema to its own current schema of the
same name, so fields added with defaults (or removed, where Avro allows) do not
break old or new consumers.

Example::

    from schemas.codec import decode, encode
    data = encode(event)
    assert decode(data, expected=type(event)) == event
"""

from __future__ import annotations

import io
from typing import Any, TypeVar, overload

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from pydantic import ValidationError

from schemas.errors import InvalidRecord, MalformedRecord, SchemaMismatch, UnknownFingerprint
from schemas.models import RECORD_TYPES, Record
from schemas.registry import SchemaRegistry, default_registry

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8

R = TypeVar("R", bound=Record)


class Codec:
    """Encodes records to framed Avro bytes and back, against one registry."""

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        self.registry = registry or default_registry()

    def encode(self, record: Record) -> bytes:
        """Frame and serialise ``record`` with the current schema of its type.

        Raises :class:`InvalidRecord` naming each field whose value the wire cannot
        carry (an int outside Avro's 64-bit long, a str with a lone surrogate)."""
        schema = self.registry.reader(record.TYPE)
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(schema.fingerprint)
        datum = _to_avro(record)
        try:
            schemaless_writer(buf, schema.parsed, datum)
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exc:
            raise _unwritable(record, datum, exc) from exc
        return buf.getvalue()

    def record_type(self, data: bytes) -> type[Record] | None:
        """The record type a frame's fingerprint names, without decoding the body.

        None when ``data`` is not a frame of a schema this registry knows (a full
        :meth:`decode` says why). Lets a reader skip, for the price of a dict lookup,
        records it has no use for.
        """
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            return None
        try:
            writer = self.registry.by_fingerprint(bytes(data[2:HEADER_LEN]))
        except UnknownFingerprint:
            return None
        return RECORD_TYPES.get(writer.name)

    @overload
    def decode(self, data: bytes, expected: None = None) -> Record: ...

    @overload
    def decode(self, data: bytes, expected: type[R]) -> R: ...

    def decode(self, data: bytes, expected: type[Record] | None = None) -> Record:
        """Parse framed bytes into a validated record.

        Raises :class:`MalformedRecord`, :class:`UnknownFingerprint`,
        :class:`SchemaMismatch` (including "not the ``expected`` type") or
        :class:`InvalidRecord`; all are :class:`CodecError`.
        """
        if len(data) < HEADER_LEN:
            raise MalformedRecord(
                f"truncated: {len(data)} bytes, but the single-object header alone is "
                f"{HEADER_LEN} (C3 01 + 8-byte fingerprint)"
            )
        if data[:2] != MAGIC:
            raise MalformedRecord(
                f"bad magic {bytes(data[:2]).hex()}: not Avro single-object encoding "
                "(expected c301); was this written by a Sagaline producer?"
            )
        writer = self.registry.by_fingerprint(bytes(data[2:HEADER_LEN]))
        reader = self.registry.reader(writer.name)
        body = io.BytesIO(data)
        body.seek(HEADER_LEN)
        try:
            datum = schemaless_reader(
                body, writer.parsed, None if writer is reader else reader.parsed
            )
        except SchemaResolutionError as exc:
            raise SchemaMismatch(
                f"{writer.name} written with schema {writer.fingerprint_hex} cannot be read "
                f"as the current {reader.name} schema {reader.fingerprint_hex}: {exc}"
            ) from exc
        except (EOFError, ValueError, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise MalformedRecord(
                f"{writer.name} body (schema {writer.fingerprint_hex}) does not parse: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if body.tell() != len(data):
            raise MalformedRecord(
                f"{writer.name} body has {len(data) - body.tell()} trailing bytes after the "
                f"record (schema {writer.fingerprint_hex})"
            )
        cls = RECORD_TYPES[reader.name]
        if expected is not None and not issubclass(cls, expected):
            raise SchemaMismatch(f"expected a {expected.__name__}, got a {cls.__name__}")
        try:
            return cls.model_validate(datum)
        except ValidationError as exc:
            fields = [".".join(str(p) for p in err["loc"]) or "<record>" for err in exc.errors()]
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<record>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise InvalidRecord(
                cls.TYPE, fields, f"{cls.TYPE} decoded but is invalid: {problems}"
            ) from exc


_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


def _unwritable(record: Record, datum: dict[str, Any], exc: Exception) -> InvalidRecord:
    """Why ``record`` cannot be written, naming each field the wire cannot carry: the
    models take any Python int and any str, Avro only a 64-bit long and UTF-8 (a str
    read with surrogateescape holds lone surrogates). Only on the failure path."""
    problems: list[tuple[str, str]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")
        elif isinstance(value, int) and not isinstance(value, bool):
            if not _LONG_MIN <= value <= _LONG_MAX:
                problems.append((path, f"{value} is outside Avro's long (-2**63 .. 2**63-1)"))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                problems.append(
                    (
                        path,
                        f"holds a lone surrogate ({value[err.start]!r} at character "
                        f"{err.start}), which UTF-8 cannot carry",
                    )
                )

    walk(datum, "")
    if not problems:
        problems.append(("<record>", f"{type(exc).__name__}: {exc}"))
    detail = "; ".join(f"{path}: {why}" for path, why in problems)
    return InvalidRecord(
        record.TYPE,
        [path for path, _why in problems],
        f"{record.TYPE} cannot be written: {detail}",
    )


def _to_avro(record: Record) -> dict[str, Any]:
    # model_dump runs in Rust and beats a Python walk over __dict__ (bench/codec.py);
    # str-enums pass through as their values, bytes stay bytes.
    return record.model_dump()


_DEFAULT: Codec | None = None


def default_codec() -> Codec:
    """The process-wide codec over the default registry."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Codec()
    return _DEFAULT


def record_type(data: bytes) -> type[Record] | None:
    """``default_codec().record_type(data)``."""
    return default_codec().record_type(data)


def encode(record: Record) -> bytes:
    """``default_codec().encode(record)``."""
    return default_codec().encode(record)


@overload
def decode(data: bytes, expected: None = None) -> Record: ...


@overload
def decode(data: bytes, expected: type[R]) -> R: ...


def decode(data: bytes, expected: type[Record] | None = None) -> Record:
    """``default_codec().decode(data, expected)``."""
    return default_codec().decode(data, expected)


__all__ = ["HEADER_LEN", "MAGIC", "Codec", "decode", "default_codec", "encode", "record_type"]
