"""The MCP proxy's declaration file, checked on its own (no upstream, no broker)."""

from __future__ import annotations

import pytest

from sagaline.agents.declaration import DeclarationError, parse_declaration


def test_a_write_tool_with_compensation_null_is_refused_in_the_declarations_terms_R4() -> None:
    """``compensation: null`` (or ``compensation:`` with nothing after it in YAML) on
    a COMPENSATABLE tool was accepted here and failed later in ``wrap()`` with advice
    for Python code (``@compensable(by="undo_...")``) that a declaration cannot follow."""
    with pytest.raises(DeclarationError) as err:
        parse_declaration(
            {
                "upstreams": {"desk": {"command": "desk"}},
                "tools": {"create_ticket": {"compensation": None}},
            },
            "desk.yaml",
        )
    assert err.value.problems == [
        "tool 'create_ticket': a write tool needs compensation: {tool: ..., args: {...}},"
        " reversibility: IRREVERSIBLE, or read_only: true"
    ]
