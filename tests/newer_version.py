"""Records as a later version of the contract writes them (not a test module).

A later version adds an optional field to a record's schema (rule 1 of
docs/event-contract.md), so its fingerprint is one this version does not know; the
schemas in ``schemas/avsc`` are left as they are.
"""

from __future__ import annotations

import io

from fastavro import schemaless_writer

from schemas import Record
from schemas.codec import MAGIC
from schemas.registry import SchemaRegistry


def framed_by_a_newer_version(record: Record) -> bytes:
    """``record`` framed under its schema with one more optional field."""
    registry = SchemaRegistry()  # a private one: this version's readers never learn it
    newer = dict(registry.reader(record.TYPE).schema)
    newer["fields"] = [
        *newer["fields"],
        {"name": "added_later", "type": ["null", "string"], "default": None},
    ]
    writer = registry.register_writer(newer)
    buf = io.BytesIO()
    buf.write(MAGIC + writer.fingerprint)
    schemaless_writer(buf, writer.parsed, {**record.model_dump(), "added_later": "x"})
    return buf.getvalue()
