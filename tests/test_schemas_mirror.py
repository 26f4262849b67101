"""The Avro files and the pydantic models describe the same records (issue 2).

Walks every ``.avsc`` named type and every model reachable from ``RECORD_TYPES``
(nested records and enums included) and compares field names, types, optionality,
defaults and enum symbols, so the wire contract and the Python one cannot drift.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas import models
from schemas.models import RECORD_TYPES
from schemas.registry import AVSC_DIR, NAMESPACE

AVSC: dict[str, dict[str, Any]] = {
    json.loads(p.read_text())["name"]: json.loads(p.read_text()) for p in AVSC_DIR.glob("*.avsc")
}


def _reachable_types() -> dict[str, type]:
    """Every model and enum the record types use, by name."""
    found: dict[str, type] = {}

    def visit(tp: Any) -> None:
        origin = typing.get_origin(tp)
        if origin is not None:
            for arg in typing.get_args(tp):
                visit(arg)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum | BaseModel):
            if tp.__name__ in found:
                return
            found[tp.__name__] = tp
            if issubclass(tp, BaseModel):
                for hint in typing.get_type_hints(tp).values():
                    visit(hint)

    for record_type in RECORD_TYPES.values():
        visit(record_type)
    return found


REACHABLE = _reachable_types()


def _expected_avro_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        branches = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(branches) == 1, f"only X | None unions are mirrored, got {tp}"
        return ["null", _expected_avro_type(branches[0])]
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": _expected_avro_type(item)}
    primitives = {str: "string", int: "long", bool: "boolean", bytes: "bytes"}
    if tp in primitives:
        return primitives[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum | BaseModel):
        return f"{NAMESPACE}.{tp.__name__}"
    raise AssertionError(f"no Avro mapping for {tp!r}")


def _expected_avro_default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return value.decode("latin-1")  # Avro bytes defaults are code points 0-255
    if isinstance(value, BaseModel):
        return {k: _expected_avro_default(v) for k, v in value.model_dump().items()}
    if isinstance(value, list):
        return [_expected_avro_default(v) for v in value]
    return value


def test_every_record_type_has_an_avsc_file_and_every_avsc_file_a_model() -> None:
    assert set(AVSC) == set(REACHABLE)
    assert set(RECORD_TYPES) <= set(AVSC)


def _record_mismatches(model: type[BaseModel], schema: dict[str, Any]) -> list[str]:
    """Every difference between a model and its Avro record (empty when they agree)."""
    problems: list[str] = []
    if schema.get("type") != "record" or schema.get("namespace") != NAMESPACE:
        problems.append(f"not a record in namespace {NAMESPACE}")
    avro_fields = {f["name"]: f for f in schema["fields"]}
    if set(avro_fields) != set(model.model_fields):
        problems.append(
            f"fields only in Avro: {sorted(set(avro_fields) - set(model.model_fields))}, "
            f"only in model: {sorted(set(model.model_fields) - set(avro_fields))}"
        )
    hints = typing.get_type_hints(model)
    for field_name, info in model.model_fields.items():
        avro = avro_fields.get(field_name)
        if avro is None:
            continue
        expected_type = _expected_avro_type(hints[field_name])
        if avro["type"] != expected_type:
            problems.append(f"{field_name}: type {avro['type']!r} != {expected_type!r}")
        if info.default is not PydanticUndefined:
            has_default, default = True, _expected_avro_default(info.default)
        elif info.default_factory is not None:
            factory = typing.cast(typing.Callable[[], Any], info.default_factory)
            has_default, default = True, _expected_avro_default(factory())
        else:
            has_default, default = False, None
        if has_default != ("default" in avro):
            problems.append(f"{field_name}: default present in model={has_default}")
        elif has_default and avro["default"] != default:
            problems.append(f"{field_name}: default {avro['default']!r} != {default!r}")
    return problems


@pytest.mark.parametrize(
    "name", sorted(n for n, t in REACHABLE.items() if issubclass(t, BaseModel))
)
def test_avsc_record_mirrors_model(name: str) -> None:
    model = REACHABLE[name]
    assert issubclass(model, BaseModel)
    assert _record_mismatches(model, AVSC[name]) == []


@pytest.mark.parametrize(
    "name", sorted(n for n, t in REACHABLE.items() if issubclass(t, enum.Enum))
)
def test_avsc_enum_mirrors_model_enum(name: str) -> None:
    enum_type = REACHABLE[name]
    assert issubclass(enum_type, enum.Enum)
    schema = AVSC[name]
    assert schema["type"] == "enum"
    assert schema["namespace"] == NAMESPACE
    assert schema["symbols"] == [member.value for member in enum_type]


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_record_type_starts_with_the_envelope(name: str) -> None:
    assert AVSC[name]["fields"][0] == {"name": "envelope", "type": f"{NAMESPACE}.Envelope"}
    assert name == RECORD_TYPES[name].TYPE


@pytest.mark.parametrize(
    ("drift", "expected"),
    [
        (lambda fs: fs[:-1], "only in model"),
        (lambda fs: [*fs, {"name": "extra", "type": "string"}], "only in Avro"),
        (lambda fs: [{**f, "type": "string"} if f["name"] == "attempt" else f for f in fs], "type"),
        (
            lambda fs: [
                {**f, "default": "x"} if f["name"] == "provider_operation_id" else f for f in fs
            ],
            "default",
        ),
    ],
    ids=["missing-field", "extra-field", "changed-type", "changed-default"],
)
def test_mirror_check_reports_drift(drift: Any, expected: str) -> None:
    """The comparison can fail: each kind of drift in StepCommitted.avsc is reported."""
    schema = {**AVSC["StepCommitted"], "fields": drift(AVSC["StepCommitted"]["fields"])}
    problems = _record_mismatches(models.StepCommitted, schema)
    assert any(expected in p for p in problems), problems


def test_models_module_enums_are_all_mirrored() -> None:
    module_enums = {
        n for n, v in vars(models).items() if isinstance(v, type) and issubclass(v, enum.Enum)
    }
    assert module_enums - {"Enum"} <= set(AVSC)
