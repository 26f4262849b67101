"""The codec: single-object framing, round trips, evolution and typed errors.

Every failure mode raises a CodecError subclass with a stable ``reason``, which is
what lets a consumer loop dead-letter bad input instead of crashing (R16).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import io
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from fastavro import schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas.codec import HEADER_LEN, MAGIC, Codec, decode, encode
from schemas.errors import (
    CodecError,
    InvalidRecord,
    MalformedRecord,
    SchemaMismatch,
    UnknownFingerprint,
)
from schemas.examples import example_records
from schemas.models import RECORD_TYPES, Envelope, Record, SagaStarted, StepCommitted
from schemas.registry import AVSC_DIR, SchemaRegistry, default_registry
from schemas.signing import Signer
from schemas.wire import to_message

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TEXT = st.text(max_size=16)


def _strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_strategy_for(a) for a in typing.get_args(tp)])
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(_strategy_for(item), max_size=4)
    if tp is type(None):
        return st.none()
    if tp is str:
        return TEXT
    if tp is int:
        return INT64
    if tp is bool:
        return st.booleans()
    if tp is bytes:
        return st.binary(max_size=48)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _model_strategy(tp)
    raise TypeError(f"no strategy for {tp!r}")


def _model_strategy(
    model: type[BaseModel], **fixed: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """Every field generated from its annotation; fields with defaults sometimes omitted."""
    hints = typing.get_type_hints(model)
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for name, info in model.model_fields.items():
        strategy = fixed[name] if name in fixed else _strategy_for(hints[name])
        has_default = info.default is not PydanticUndefined or info.default_factory is not None
        (optional if has_default and name not in fixed else required)[name] = strategy
    return st.fixed_dictionaries(required, optional=optional).map(lambda d: model(**d))


def _record_strategy(record_type: type[Record]) -> st.SearchStrategy[Any]:
    envelope = _model_strategy(Envelope, type=st.just(record_type.TYPE))
    return _model_strategy(record_type, envelope=envelope)


def _older_step_committed() -> dict[str, Any]:
    """StepCommitted as it was before ``provider_operation_id`` was added."""
    schema = json.loads((AVSC_DIR / "StepCommitted.avsc").read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "provider_operation_id"]
    return dict(schema)


def _frame(fingerprint: bytes, parsed_schema: dict[str, Any], datum: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    buf.write(MAGIC + fingerprint)
    schemaless_writer(buf, parsed_schema, datum)
    return buf.getvalue()


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("record_type", list(RECORD_TYPES.values()), ids=list(RECORD_TYPES))
def test_decode_inverts_encode_for_generated_records(record_type: type[Record]) -> None:
    """Property: decode(encode(r)) == r for every record type (issue 2 acceptance)."""

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_record_strategy(record_type))
    def round_trips(record: Record) -> None:
        assert decode(encode(record), expected=record_type) == record

    round_trips()


def test_encoding_is_framed_as_avro_single_object() -> None:
    record = example_records()[0]
    data = encode(record)
    assert data[:2] == b"\xc3\x01"
    assert data[2:HEADER_LEN] == default_registry().reader(record.TYPE).fingerprint


def test_record_type_names_each_type_from_the_frame_alone() -> None:
    record_type = Codec().record_type
    for record in example_records():
        assert record_type(encode(record)) is type(record)
    data = encode(example_records()[0])
    assert record_type(data[:HEADER_LEN]) is type(example_records()[0])  # body not read
    assert record_type(b"") is None
    assert record_type(b"\x00\x01" + data[2:]) is None  # not a single-object frame
    assert record_type(data[:2] + b"\xff" * 8 + data[HEADER_LEN:]) is None  # unknown schema


def test_every_record_type_has_a_distinct_fingerprint() -> None:
    registry = default_registry()
    fingerprints = {registry.reader(name).fingerprint for name in RECORD_TYPES}
    assert len(fingerprints) == len(RECORD_TYPES)


def test_fingerprint_is_crc64_avro_of_the_canonical_form() -> None:
    """Matches the Avro spec's reference implementation, not only fastavro's."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    schema = default_registry().reader("SagaStarted")
    fp = empty
    for byte in schema.canonical.encode():
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    assert schema.fingerprint == fp.to_bytes(8, "little")


# ----------------------------------------------------------------- evolution


def test_record_written_with_an_older_schema_is_read_by_the_current_one() -> None:
    """Adding an optional field keeps old records readable: it takes its default."""
    codec = Codec(SchemaRegistry())
    old = codec.registry.register_writer(_older_step_committed())
    current = next(r for r in example_records() if isinstance(r, StepCommitted))
    datum = current.model_dump()
    del datum["provider_operation_id"]
    data = _frame(old.fingerprint, old.parsed, datum)

    decoded = codec.decode(data, expected=StepCommitted)

    assert decoded == current.model_copy(update={"provider_operation_id": None})


def test_record_written_with_a_newer_schema_is_read_by_the_current_one() -> None:
    """A field a newer producer added is skipped by today's reader."""
    codec = Codec(SchemaRegistry())
    newer = json.loads((AVSC_DIR / "StepCommitted.avsc").read_text())
    newer["fields"].append({"name": "region", "type": "string", "default": "eu-west"})
    writer = codec.registry.register_writer(newer)
    current = next(r for r in example_records() if isinstance(r, StepCommitted))
    data = _frame(writer.fingerprint, writer.parsed, {**current.model_dump(), "region": "us"})

    assert codec.decode(data) == current


def test_current_record_is_read_by_an_older_reader(tmp_path: Path) -> None:
    """The reverse direction: an older deployment reads today's records, dropping the
    field it does not know (here the model's default stands in for it)."""
    for path in AVSC_DIR.glob("*.avsc"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "StepCommitted.avsc").write_text(json.dumps(_older_step_committed()))
    old_codec = Codec(SchemaRegistry(tmp_path))
    old_codec.registry.register_writer(json.loads((AVSC_DIR / "StepCommitted.avsc").read_text()))
    current = next(r for r in example_records() if isinstance(r, StepCommitted))
    assert current.provider_operation_id is not None

    decoded = old_codec.decode(encode(current), expected=StepCommitted)

    assert decoded == current.model_copy(update={"provider_operation_id": None})


# The full-schema fingerprints of record types as earlier versions of Sagaline wrote
# them, each other than today's: a process not yet upgraded still writes these.
EARLIER_WRITERS = [
    ("ExecuteStep", "47bbf6cd6f162bb8"),  # before ledger references (args_ref)
    ("CompensateStep", "d796c975216b18bf"),  # before provider_operation_id
    ("CompensateStep", "2fcec3c8abedf8f6"),  # with it, before ledger references
    ("StepScheduled", "22f998d090c72041"),  # StepContract before completion_within_ms
    ("IncidentResolved", "51bde6635f23e37c"),  # before provider_operation_id and result
]


@pytest.mark.parametrize(("name", "fingerprint"), EARLIER_WRITERS)
def test_every_earlier_version_of_a_record_type_is_a_known_writer(
    name: str, fingerprint: str
) -> None:
    """A StepScheduled of an agent not yet upgraded (StepContract before
    completion_within_ms) and a CompensateStep of a coordinator not yet upgraded
    (before ledger references) went to the DLQ as unknown-fingerprint: the saga never
    ran its step, the compensation never ran. schemas/avsc/history had neither."""
    writer = default_registry().by_fingerprint(bytes.fromhex(fingerprint))
    assert writer.name == name
    assert writer is not default_registry().reader(name)


def test_a_step_scheduled_of_the_previous_version_is_read_by_the_current_one(
    tmp_path: Path,
) -> None:
    """The previous version's StepContract had no completion_within_ms; its records
    read as today's with the default (None: no Accepted expected)."""
    for path in AVSC_DIR.glob("*.avsc"):
        (tmp_path / path.name).write_text(path.read_text())
    contract = json.loads((AVSC_DIR / "StepContract.avsc").read_text())
    contract["fields"] = [f for f in contract["fields"] if f["name"] != "completion_within_ms"]
    (tmp_path / "StepContract.avsc").write_text(json.dumps(contract))
    previous = Codec(SchemaRegistry(tmp_path))
    assert previous.registry.reader("StepScheduled").fingerprint_hex == "22f998d090c72041"
    current = next(r for r in example_records() if r.TYPE == "StepScheduled")
    assert current.contract.completion_within_ms is None

    assert decode(previous.encode(current)) == current


def test_writer_missing_a_required_field_is_a_schema_mismatch() -> None:
    """Where Avro does not allow evolution (a field removed that has no default), the
    error says so instead of inventing a value."""
    codec = Codec(SchemaRegistry())
    schema = json.loads((AVSC_DIR / "StepCommitted.avsc").read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "response_fingerprint"]
    writer = codec.registry.register_writer(schema)
    current = next(r for r in example_records() if isinstance(r, StepCommitted))
    datum = current.model_dump()
    del datum["response_fingerprint"]

    with pytest.raises(SchemaMismatch, match="response_fingerprint") as err:
        codec.decode(_frame(writer.fingerprint, writer.parsed, datum))
    assert err.value.reason == "schema-mismatch"


def test_registering_a_writer_for_an_unknown_record_type_is_refused() -> None:
    schema = {**_older_step_committed(), "name": "NoSuchRecord"}
    with pytest.raises(ValueError, match="NoSuchRecord"):
        SchemaRegistry().register_writer(schema)


# ------------------------------------------------------------------ errors


def test_empty_bytes_are_malformed_and_say_truncated() -> None:
    with pytest.raises(MalformedRecord, match="truncated") as err:
        decode(b"")
    assert err.value.reason == "malformed"


def test_bad_magic_is_malformed_and_names_the_magic() -> None:
    data = encode(example_records()[0])
    with pytest.raises(MalformedRecord, match="bad magic 7b22"):
        decode(b'{"' + data[2:])


def test_truncated_body_is_malformed_and_names_the_type() -> None:
    data = encode(example_records()[0])
    with pytest.raises(MalformedRecord, match=r"SagaStarted body .* does not parse"):
        decode(data[:-3])


def test_trailing_bytes_are_malformed() -> None:
    data = encode(example_records()[0])
    with pytest.raises(MalformedRecord, match="2 trailing bytes"):
        decode(data + b"\x00\x00")


def test_unknown_fingerprint_names_the_fingerprint_in_hex() -> None:
    data = MAGIC + bytes.fromhex("0123456789abcdef") + b"\x00"
    with pytest.raises(UnknownFingerprint, match="0123456789abcdef") as err:
        decode(data)
    assert err.value.reason == "unknown-fingerprint"
    assert err.value.fingerprint == bytes.fromhex("0123456789abcdef")


def test_decoded_record_failing_validation_is_invalid_and_names_type_and_field() -> None:
    """Avro-valid bytes whose envelope.type disagrees with the record type."""
    reader = default_registry().reader("SagaStarted")
    datum = example_records()[0].model_dump()
    datum["envelope"]["type"] = "StepCommitted"
    with pytest.raises(InvalidRecord, match="SagaStarted") as err:
        decode(_frame(reader.fingerprint, reader.parsed, datum))
    assert err.value.record_type == "SagaStarted"
    assert err.value.reason == "invalid-record"
    assert "envelope.type" in str(err.value)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("occurred_at", 2**63, "long"),
        ("generation", -(2**63) - 1, "long"),
        ("saga_id", "saga-\udcff", "surrogate"),
        ("producer", "agent-\ud800", "surrogate"),
    ],
)
def test_a_value_the_wire_cannot_carry_is_an_invalid_record_naming_the_field(
    field: str, value: Any, says: str
) -> None:
    """The models take any Python int and any str, Avro only a 64-bit long and UTF-8:
    encode (and to_message) raised OverflowError or UnicodeEncodeError from inside
    fastavro, naming no field and no CodecError, so a caller could not tell which value
    was at fault (a file name read with surrogateescape, an overflowing deadline)."""
    record = example_records()[0]
    envelope = record.envelope.model_copy(update={field: value})
    record = type(record).model_validate({**dict(record), "envelope": envelope})

    for write in (encode, lambda r: to_message(r, Signer(None))):
        with pytest.raises(InvalidRecord, match=f"envelope.{field}.*{says}") as err:
            write(record)
        assert err.value.fields == [f"envelope.{field}"]
        assert err.value.reason == "invalid-record"


def test_unexpected_type_is_a_schema_mismatch() -> None:
    with pytest.raises(SchemaMismatch, match="expected a StepCommitted, got a SagaStarted"):
        decode(encode(example_records()[0]), expected=StepCommitted)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\x00" * 12, MAGIC + b"\xff" * 8, b"\xc3\x01" + b"\x00" * 40],
    ids=["empty", "one-byte", "zeros", "ones-fingerprint", "zero-fingerprint"],
)
def test_garbage_raises_only_codec_errors(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=21), st.integers(0, 200))
def test_corrupted_bodies_raise_only_codec_errors(noise: bytes, which: int, cut: int) -> None:
    """Whatever the bytes after a valid header, decode returns a record or raises a
    CodecError: never another exception that would escape a consumer loop (R16)."""
    record = example_records()[which]
    data = encode(record)
    corrupted = data[:HEADER_LEN] + noise + data[HEADER_LEN + cut :]
    with contextlib.suppress(CodecError):
        decode(corrupted)


def test_schema_files_are_not_mutated_by_registration() -> None:
    registry = SchemaRegistry()
    before = copy.deepcopy(dict(registry.definitions()))
    registry.register_writer(_older_step_committed())
    assert dict(registry.definitions()) == before


def test_sagastarted_minimal_record_uses_model_defaults_on_the_wire() -> None:
    record = SagaStarted(
        envelope=Envelope(
            event_id="e",
            saga_id="s",
            tenant_id="t",
            type="SagaStarted",
            occurred_at=0,
            producer="p",
        ),
        workflow="w",
        principal="p",
    )
    assert decode(encode(record)) == record
