"""The MCP proxy's declaration file, checked on its own (no upstream, no broker)."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_a_list_or_flag_key_given_another_shape_is_a_problem_not_misread() -> None:
    """``resources: tickets`` (no brackets) was read as the resources ``t, i, c, k, e,
    s`` (so compensations on tickets were not serialized with ``[tickets]``, R2),
    ``args: server.py`` started the upstream with no arguments, and ``read_only:
    "false"`` was read as true (a write tool without a compensation then passed
    straight through, nothing to undo)."""
    with pytest.raises(DeclarationError) as err:
        parse_declaration(
            {
                "upstreams": {"desk": {"command": "python", "args": "desk_server.py"}},
                "tools": {
                    "create_ticket": {"compensation": "delete_ticket", "resources": "tickets"},
                    "close_ticket": {"compensation": "reopen_ticket", "read_only": "false"},
                },
            },
            "desk.yaml",
        )
    assert err.value.problems == [
        "upstream 'desk': args must be a list, e.g. args: [desk_server.py]",
        "tool 'create_ticket': resources must be a list, e.g. resources: [tickets]",
        "tool 'close_ticket': read_only must be true or false, not 'false'",
    ]


def test_an_idempotency_arg_that_is_not_a_name_is_a_problem_not_a_traceback() -> None:
    """``idempotency_arg: [request_id]`` (or a number) was accepted as is and then
    crashed ``check()`` (``unhashable type: 'list'``) instead of being listed with the
    declaration's other problems."""
    from sagaline.agents.declaration import UpstreamTool, check

    data = {
        "upstreams": {"desk": {"command": "desk"}},
        "tools": {
            "create_ticket": {"reversibility": "IRREVERSIBLE", "idempotency_arg": ["request_id"]},
            "close_ticket": {"reversibility": "IRREVERSIBLE", "idempotency_arg": 7},
        },
    }
    schema = {"type": "object", "properties": {"request_id": {"type": "string"}}}
    listed = [
        UpstreamTool(upstream="desk", name=n, input_schema=schema)
        for n in ("create_ticket", "close_ticket")
    ]
    try:
        problems = check(parse_declaration(data, "desk.yaml"), listed)
    except DeclarationError as err:
        problems = err.problems
    assert problems == [
        "tool 'create_ticket': idempotency_arg must be the name of one argument,"
        " e.g. idempotency_arg: request_id",
        "tool 'close_ticket': idempotency_arg must be the name of one argument,"
        " e.g. idempotency_arg: request_id",
    ]


def test_the_declaration_in_docs_agents_md_is_accepted(tmp_path: Path) -> None:
    """The example a newcomer copies from docs/agents.md loads as it stands."""
    from sagaline.agents.declaration import load_declaration

    doc = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)\n```", doc, re.S)
    assert len(blocks) == 1
    path = tmp_path / "desk.yaml"
    path.write_text(blocks[0])
    declared = load_declaration(path)
    assert declared.participant == "helpdesk" and set(declared.upstreams) == {"desk", "billing"}
    assert set(declared.tools) == {"create_ticket", "charge", "send_email", "list_tickets"}
    assert declared.internal_tools() >= {"delete_ticket", "find_ticket", "refund"}


def test_a_deadline_that_is_no_finite_positive_number_is_a_problem_not_a_traceback() -> None:
    """``deadline: .inf`` (meant as "no deadline"), ``.nan``, ``0`` or ``true`` were
    accepted here; the first two then crashed `sagaline mcp proxy` at start-up with an
    OverflowError / ValueError traceback (converting them to milliseconds) naming no
    tool, and ``true`` became a deadline of one second."""
    tools = {
        name: {"reversibility": "IRREVERSIBLE", "deadline": value}
        for name, value in (
            ("send_email", float("inf")),
            ("send_sms", float("nan")),
            ("post", 0),
            ("page", True),
        )
    }
    with pytest.raises(DeclarationError) as err:
        parse_declaration({"upstreams": {"desk": {"command": "desk"}}, "tools": tools})
    assert err.value.problems == [
        f"tool {name!r}: deadline must be a positive number of seconds, not {value!r}"
        for name, value in (
            ("send_email", float("inf")),
            ("send_sms", float("nan")),
            ("post", 0),
            ("page", True),
        )
    ]


def test_an_upstream_command_url_cwd_or_env_of_another_shape_is_a_problem_not_a_traceback() -> None:
    """``command: [python, desk_server.py]`` (a compose file's shape) was accepted and
    then refused at connect time as an upstream that "cannot be reached", with a
    pydantic validation dump; ``url: {host: ...}`` crashed `sagaline mcp proxy` with
    ``TypeError: unhashable type: 'dict'``; ``cwd: 5`` and ``env: {DEBUG: [1]}`` were
    likewise passed on as they were. Each is named with the file's other problems."""
    with pytest.raises(DeclarationError) as err:
        parse_declaration(
            {
                "upstreams": {
                    "desk": {"command": ["python", "desk_server.py"]},
                    "billing": {"url": {"host": "billing"}},
                    "mail": {"command": "mail", "cwd": 5, "env": {"DEBUG": [1]}},
                },
                "tools": {"send_email": {"upstream": "mail", "reversibility": "IRREVERSIBLE"}},
            },
            "desk.yaml",
        )
    assert err.value.problems == [
        "upstream 'desk': command must be the program to start (a string), with its"
        " arguments under args:, e.g. command: python, args: [desk_server.py]",
        "upstream 'billing': url must be the server's URL (a string),"
        ' e.g. url: "http://127.0.0.1:8000/mcp"',
        "upstream 'mail': cwd must be a directory (a string), not 5",
        "upstream 'mail': env DEBUG must be a string, number or true/false, not a list",
    ]
