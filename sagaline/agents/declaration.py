"""The MCP proxy's declaration file: which upstream tool is undone by which, and how.

A YAML (or JSON) file; every key is checked, so a typo is an error, not a default::

    participant: helpdesk            # command topic sagaline.commands.helpdesk
    workflow: helpdesk-agent         # the saga's workflow name (default: participant)
    principal: agent:helpdesk        # who the sagas run for
    upstreams:
      desk: {command: python, args: [desk_server.py]}      # stdio
      billing: {url: "http://127.0.0.1:8000/mcp"}          # streamable HTTP
    tools:
      create_ticket:
        upstream: desk               # optional when there is one upstream (else an error)
        compensation: {tool: delete_ticket, args: {ticket_id: "{result.id}"}}
        lookup: {tool: find_ticket, args: {key: "{idempotency_key}"}, not_found: "no ticket"}
        idempotency_arg: request_id  # upstream argument that receives the key
        reversibility: REVERSIBLE    # default COMPENSATABLE
        resources: [tickets]
      send_email: {reversibility: IRREVERSIBLE}
      list_tickets: {read_only: true}
    internal: [delete_ticket, find_ticket]   # never offered to the agent

Argument templates: a string that is exactly ``"{input.X}"``, ``"{result.X.Y}"``,
``"{idempotency_key}"``, ``"{compensation_key}"`` or ``"{saga_id}"`` becomes that
value (any JSON type); in a longer string the placeholders are formatted in.
Tools named as a compensation or lookup are internal automatically.

:func:`check` compares a declaration with the tools the upstream servers list and
returns every problem (a write tool with no mapping, a name that is no upstream
tool, arguments that cannot be built), each naming the tool and the bad name.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from participants.declarations import CompensationContext
from schemas.models import Reversibility

__all__ = [
    "CallMapping",
    "Declaration",
    "DeclarationError",
    "ToolMapping",
    "UpstreamSpec",
    "UpstreamTool",
    "build_args",
    "check",
    "load_declaration",
]

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_ROOTS = ("input", "result", "idempotency_key", "compensation_key", "saga_id")


class DeclarationError(ValueError):
    """The declaration cannot work; lists every problem, each naming tool and name."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n{lines}")


@dataclass(frozen=True)
class UpstreamSpec:
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    url: str | None = None


@dataclass(frozen=True)
class CallMapping:
    """An upstream call made on the saga's behalf (a compensation or a lookup).

    ``not_found`` (a lookup only): text that the lookup's error answer, or its plain
    text answer, contains when the upstream has no such operation; any other error
    answer says it could not tell, any other answer that it happened."""

    tool: str
    args: Mapping[str, Any]
    not_found: str | None = None


@dataclass(frozen=True)
class ToolMapping:
    name: str
    upstream: str | None = None
    read_only: bool = False
    reversibility: Reversibility = Reversibility.COMPENSATABLE
    compensation: CallMapping | None = None
    lookup: CallMapping | None = None
    idempotency_arg: str | None = None
    resources: tuple[str, ...] = ()
    pivot: bool = False
    deadline: float = 10.0
    owner: str = "operations"
    # Texts of the forward call's error answers that are transient failures (a brief
    # unavailability), retried; any other error answer is a business rejection (R9).
    transient: tuple[str, ...] = ()


@dataclass(frozen=True)
class Declaration:
    source: str
    participant: str
    workflow: str
    principal: str
    upstreams: Mapping[str, UpstreamSpec]
    tools: Mapping[str, ToolMapping]
    internal: frozenset[str] = field(default_factory=frozenset)

    @property
    def file(self) -> str | None:
        """The file it was read from; None when parsed from data (no file to name)."""
        return None if self.source == UNNAMED_SOURCE else self.source

    def upstream_of(self, tool: str) -> str:
        mapping = self.tools.get(tool)
        if mapping is not None and mapping.upstream:
            return mapping.upstream
        # parse_declaration refuses a tool without upstream: when there are several.
        return next(iter(self.upstreams))

    def internal_tools(self) -> set[str]:
        names = set(self.internal)
        for mapping in self.tools.values():
            for call in (mapping.compensation, mapping.lookup):
                if call is not None:
                    names.add(call.tool)
        return names


@dataclass(frozen=True)
class UpstreamTool:
    """What an upstream server lists for one tool (the parts the proxy checks)."""

    name: str
    upstream: str
    input_schema: Mapping[str, Any]
    output_schema: Mapping[str, Any] | None = None
    description: str = ""
    read_only_hint: bool | None = None

    @property
    def properties(self) -> Mapping[str, Any]:
        props = self.input_schema.get("properties") or {}
        return props if isinstance(props, Mapping) else {}

    @property
    def required(self) -> list[str]:
        req = self.input_schema.get("required") or []
        return [str(r) for r in req] if isinstance(req, list) else []


# ------------------------------------------------------------------------ loading

_TOP_KEYS = ("participant", "workflow", "principal", "upstreams", "tools", "internal")
_UPSTREAM_KEYS = ("command", "args", "env", "cwd", "url")
_TOOL_KEYS = (
    "upstream",
    "read_only",
    "reversibility",
    "compensation",
    "lookup",
    "idempotency_arg",
    "resources",
    "pivot",
    "deadline",
    "owner",
    "transient",
)
_CALL_KEYS = ("tool", "args")
_LOOKUP_KEYS = (*_CALL_KEYS, "not_found")


def load_declaration(path: Path) -> Declaration:
    """Read and check the file's own structure (not yet the upstream servers)."""
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeclarationError(source, [f"cannot read the declaration: {exc}"]) from exc
    data = _parse(source, path.suffix.lower(), text)
    return parse_declaration(data, source)


def _parse(source: str, suffix: str, text: str) -> Any:
    if suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise DeclarationError(source, [f"not valid JSON: {exc}"]) from exc
    try:
        import yaml
    except ImportError as exc:
        raise DeclarationError(
            source, ["reading YAML needs PyYAML: pip install 'sagaline[mcp]' or use .json"]
        ) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeclarationError(source, [f"not valid YAML: {exc}"]) from exc


# The source of a declaration parsed from data rather than read from a file.
UNNAMED_SOURCE = "declaration"


def parse_declaration(data: Any, source: str = UNNAMED_SOURCE) -> Declaration:
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise DeclarationError(source, ["the top level must be a mapping (tools:, upstreams:)"])
    _unknown_keys(problems, "the declaration", data, _TOP_KEYS)
    participant = str(data.get("participant") or "mcp-proxy")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", participant):
        problems.append(f"participant {participant!r} cannot be part of a Kafka topic name")

    upstreams: dict[str, UpstreamSpec] = {}
    raw_upstreams = data.get("upstreams")
    if not isinstance(raw_upstreams, Mapping) or not raw_upstreams:
        problems.append("upstreams: name at least one upstream MCP server (command: or url:)")
        raw_upstreams = {}
    for name, raw in raw_upstreams.items():
        where = f"upstream {name!r}"
        if not isinstance(raw, Mapping):
            problems.append(f"{where}: must be a mapping with command: (stdio) or url: (HTTP)")
            continue
        _unknown_keys(problems, where, raw, _UPSTREAM_KEYS)
        if bool(raw.get("command")) == bool(raw.get("url")):
            problems.append(f"{where}: give exactly one of command: (stdio) or url: (HTTP)")
        # Passed on as they are, another shape failed only when connecting (a pydantic
        # dump as an upstream that "cannot be reached", or a traceback).
        if raw.get("command") and not isinstance(raw["command"], str):
            problems.append(
                f"{where}: command must be the program to start (a string), with its"
                " arguments under args:, e.g. command: python, args: [desk_server.py]"
            )
        if raw.get("url") and not isinstance(raw["url"], str):
            problems.append(
                f'{where}: url must be the server\'s URL (a string), e.g. url: "http://127.0.0.1:8000/mcp"'
            )
        if raw.get("cwd") is not None and not isinstance(raw["cwd"], str):
            problems.append(f"{where}: cwd must be a directory (a string), not {raw['cwd']!r}")
        args = _list(problems, where, "args", raw.get("args"))
        env = raw.get("env")
        if env is not None and not isinstance(env, Mapping):
            problems.append(f"{where}: env must be a mapping of variable name to value")
        for variable, value in env.items() if isinstance(env, Mapping) else ():
            if not isinstance(value, (str, int, float)):  # bool is an int
                # the type, not the value: an env entry is where credentials live
                kind = "null" if value is None else type(value).__name__
                problems.append(
                    f"{where}: env {variable} must be a string, number or true/false, not a {kind}"
                )
        upstreams[str(name)] = UpstreamSpec(
            name=str(name),
            command=raw.get("command"),
            args=tuple(str(a) for a in args),
            env={str(k): str(v) for k, v in env.items()} if isinstance(env, Mapping) else None,
            cwd=raw.get("cwd"),
            url=raw.get("url"),
        )

    tools: dict[str, ToolMapping] = {}
    raw_tools = data.get("tools")
    if not isinstance(raw_tools, Mapping):
        problems.append("tools: map each upstream tool to its compensation (or read_only)")
        raw_tools = {}
    for name, raw in raw_tools.items():
        mapping = _tool(problems, str(name), raw if raw is not None else {}, upstreams)
        if mapping is not None:
            tools[str(name)] = mapping

    internal = data.get("internal") or []
    if not isinstance(internal, list):
        problems.append("internal: must be a list of upstream tool names")
        internal = []
    if problems:
        raise DeclarationError(source, problems)
    return Declaration(
        source=source,
        participant=participant,
        workflow=str(data.get("workflow") or participant),
        principal=str(data.get("principal") or f"agent:{participant}"),
        upstreams=upstreams,
        tools=tools,
        internal=frozenset(str(t) for t in internal),
    )


def _tool(
    problems: list[str], name: str, raw: Any, upstreams: Mapping[str, UpstreamSpec]
) -> ToolMapping | None:
    where = f"tool {name!r}"
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping (compensation:, read_only:, ...)")
        return None
    before = len(problems)
    _unknown_keys(problems, where, raw, _TOOL_KEYS)
    upstream = raw.get("upstream")
    if upstream is not None and upstream not in upstreams:
        problems.append(
            f"{where}: upstream {upstream!r} is not declared{_close(upstream, upstreams)}"
        )
    elif upstream is None and len(upstreams) > 1:
        # Optional with one upstream only: guessing the first would send the call (and
        # its undo) to whichever server the file happens to list first.
        problems.append(
            f"{where}: name its upstream (upstream: NAME); there are several:"
            f" {', '.join(repr(u) for u in upstreams)}"
        )
    try:
        reversibility = Reversibility(str(raw.get("reversibility", "COMPENSATABLE")).upper())
    except ValueError:
        problems.append(
            f"{where}: reversibility {raw.get('reversibility')!r} is none of"
            " REVERSIBLE, COMPENSATABLE, IRREVERSIBLE"
        )
        reversibility = Reversibility.COMPENSATABLE
    read_only = _flag(problems, where, raw, "read_only")
    compensation = _call(problems, f"{where}: compensation", raw.get("compensation"))
    lookup = _call(problems, f"{where}: lookup", raw.get("lookup"), _LOOKUP_KEYS)
    if read_only and (compensation or raw.get("reversibility")):
        problems.append(f"{where}: is read_only and declares an undo; remove one of them")
    # ``compensation: null`` counts as none (wrap() would refuse it later, in terms of
    # Python decorators a declaration cannot follow); a malformed one is named above.
    if (
        not read_only
        and raw.get("compensation") is None
        and reversibility is not Reversibility.IRREVERSIBLE
    ):
        problems.append(
            f"{where}: a write tool needs compensation: {{tool: ..., args: {{...}}}},"
            " reversibility: IRREVERSIBLE, or read_only: true"
        )
    given = raw.get("deadline", 10.0)
    try:  # ``true`` is a number to Python; ``.inf`` / ``.nan`` are no time to wait for
        deadline = math.nan if isinstance(given, bool) else float(given)
    except (TypeError, ValueError):
        deadline = math.nan
    if not (math.isfinite(deadline) and deadline > 0):
        problems.append(f"{where}: deadline must be a positive number of seconds, not {given!r}")
        deadline = 10.0
    idempotency_arg = raw.get("idempotency_arg")
    if idempotency_arg is not None and not isinstance(idempotency_arg, str):
        problems.append(
            f"{where}: idempotency_arg must be the name of one argument,"
            " e.g. idempotency_arg: request_id"
        )
    resources = _list(problems, where, "resources", raw.get("resources"))
    pivot = _flag(problems, where, raw, "pivot")
    transient = raw.get("transient")
    transient = [transient] if isinstance(transient, str) else transient
    if transient is not None and (
        not isinstance(transient, list) or not all(isinstance(t, str) and t for t in transient)
    ):
        problems.append(
            f"{where}: transient must be the texts of the upstream's error answers worth"
            f' retrying, e.g. transient: ["rate limit"], not {raw.get("transient")!r}'
        )
    elif transient and read_only:
        problems.append(
            f"{where}: is read_only and declares transient:; a read-only call is passed"
            " straight through, never retried"
        )
    if len(problems) > before:
        return None
    return ToolMapping(
        name=name,
        upstream=upstream,
        read_only=read_only,
        reversibility=Reversibility.REVERSIBLE if read_only else reversibility,
        compensation=compensation,
        lookup=lookup,
        idempotency_arg=idempotency_arg or None,
        resources=tuple(str(r) for r in resources),
        pivot=pivot,
        deadline=deadline,
        owner=str(raw.get("owner") or "operations"),
        transient=tuple(transient or ()),
    )


def _list(problems: list[str], where: str, key: str, raw: Any) -> list[Any]:
    """A list-valued key; a lone string would be read letter by letter, so it is a
    problem (``resources: tickets`` meant ``[tickets]``)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(f"{where}: {key} must be a list, e.g. {key}: [{raw}]")
        return []
    return raw


def _flag(problems: list[str], where: str, raw: Mapping[str, Any], key: str) -> bool:
    """A true/false key; ``bool("false")`` is True, so any other value is a problem."""
    value = raw.get(key, False)
    if isinstance(value, bool):
        return value
    problems.append(f"{where}: {key} must be true or false, not {value!r}")
    return False


def _call(
    problems: list[str], where: str, raw: Any, known: Sequence[str] = _CALL_KEYS
) -> CallMapping | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"tool": raw}
    if not isinstance(raw, Mapping) or not raw.get("tool"):
        problems.append(f"{where}: must be {{tool: NAME, args: {{...}}}}")
        return None
    _unknown_keys(problems, where, raw, known)
    not_found = raw.get("not_found")
    if not_found is not None and (not isinstance(not_found, str) or not not_found):
        problems.append(
            f"{where}: not_found must be the text the lookup's error says when it has no"
            f' such operation, e.g. not_found: "no ticket for", not {not_found!r}'
        )
        return None
    args = raw.get("args") or {}
    if not isinstance(args, Mapping):
        problems.append(f"{where}: args must be a mapping of argument name to value/template")
        return None
    for path in _placeholders(args):
        root = path.split(".", 1)[0]
        if root not in _ROOTS:
            problems.append(
                f"{where}: template {{{path}}} names {root!r}; use one of"
                f" {', '.join(_ROOTS)}{_close(root, _ROOTS)}"
            )
    return CallMapping(tool=str(raw["tool"]), args=dict(args), not_found=not_found)


def _unknown_keys(
    problems: list[str], where: str, raw: Mapping[str, Any], known: Sequence[str]
) -> None:
    for key in raw:
        if key not in known:
            problems.append(f"{where}: unknown key {key!r}{_close(str(key), known)}")


def _close(name: Any, known: Any) -> str:
    found = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f"; did you mean {found[0]!r}?" if found else ""


def _placeholders(value: Any) -> list[str]:
    if isinstance(value, str):
        return [m.strip() for m in _PLACEHOLDER.findall(value)]
    if isinstance(value, Mapping):
        return [p for v in value.values() for p in _placeholders(v)]
    if isinstance(value, list):
        return [p for v in value for p in _placeholders(v)]
    return []


# ---------------------------------------------------------- against the upstreams


def check(declaration: Declaration, listed: Sequence[UpstreamTool]) -> list[str]:
    """Every problem of ``declaration`` against what the upstream servers list."""
    problems: list[str] = []
    by_upstream: dict[str, dict[str, UpstreamTool]] = {}
    for tool in listed:
        by_upstream.setdefault(tool.upstream, {})[tool.name] = tool
    internal = declaration.internal_tools()

    def find(name: str, upstream: str, where: str) -> UpstreamTool | None:
        tools = by_upstream.get(upstream, {})
        if name in tools:
            return tools[name]
        problems.append(
            f"{where} names {name!r}, which upstream {upstream!r} does not list"
            f"{_close(name, tools)} (it lists: {', '.join(sorted(tools)) or 'nothing'})"
        )
        return None

    for name, mapping in declaration.tools.items():
        upstream = declaration.upstream_of(name)
        forward = find(name, upstream, f"tool {name!r}:")
        if forward is None:
            continue
        if mapping.idempotency_arg and mapping.idempotency_arg not in forward.properties:
            problems.append(
                f"tool {name!r}: idempotency_arg {mapping.idempotency_arg!r} is not an"
                f" argument of {name}{_close(mapping.idempotency_arg, forward.properties)}"
            )
        for role, call in (("compensation", mapping.compensation), ("lookup", mapping.lookup)):
            if call is None:
                continue
            target = find(call.tool, upstream, f"tool {name!r}: {role}")
            if role == "lookup":
                # A lookup runs with the idempotency key alone (after a crash, with
                # no input, result or saga id): anything else would be built empty.
                for path in _placeholders(call.args):
                    if path.split(".", 1)[0] != "idempotency_key":
                        problems.append(
                            f"tool {name!r}: lookup {call.tool}: {{{path}}} cannot be built;"
                            " a lookup has only {idempotency_key}"
                        )
            if target is not None:
                problems += _args_problems(
                    f"tool {name!r}: {role} {call.tool}", call, forward, target
                )

    for upstream, tools in by_upstream.items():
        for tool_name, tool in tools.items():
            if tool_name in declaration.tools or tool_name in internal:
                continue
            problems.append(
                f"upstream {upstream!r} tool {tool_name!r} has no declaration: add it under"
                " tools: with compensation:, reversibility: IRREVERSIBLE or read_only: true"
                f"{' (the server hints it is read-only)' if tool.read_only_hint else ''},"
                " or list it under internal:"
            )
    for name in declaration.internal:
        if not any(name in tools for tools in by_upstream.values()):
            all_names = [n for tools in by_upstream.values() for n in tools]
            problems.append(f"internal: {name!r} is no upstream tool{_close(name, all_names)}")
    return problems


def _args_problems(
    where: str, call: CallMapping, forward: UpstreamTool, target: UpstreamTool
) -> list[str]:
    problems = []
    for arg in call.args:
        if target.properties and arg not in target.properties:
            problems.append(
                f"{where}: argument {arg!r} is not a parameter of {target.name}"
                f"{_close(arg, target.properties)}"
            )
    for required in target.required:
        if required not in call.args:
            problems.append(
                f"{where}: required argument {required!r} of {target.name} is not built;"
                f' add it to args (e.g. {required}: "{{result.{required}}}")'
            )
    out_props = (forward.output_schema or {}).get("properties")
    for path in _placeholders(call.args):
        root, _, rest = path.partition(".")
        first = rest.split(".", 1)[0] if rest else ""
        if root == "input" and first and first not in forward.properties:
            problems.append(
                f"{where}: {{{path}}} names {first!r}, which is not an argument of"
                f" {forward.name}{_close(first, forward.properties)}"
            )
        if root == "result" and first and isinstance(out_props, Mapping) and first not in out_props:
            problems.append(
                f"{where}: {{{path}}} names {first!r}, which the output schema of"
                f" {forward.name} does not have{_close(first, out_props)}"
            )
    return problems


# ------------------------------------------------------------------- building args


def build_args(args: Mapping[str, Any], ctx: CompensationContext) -> dict[str, Any]:
    """The arguments of a compensation or lookup, filled from the forward call."""
    values = {
        "input": ctx.input,
        "result": ctx.result,
        "idempotency_key": ctx.idempotency_key,
        "compensation_key": ctx.compensation_key,
        "saga_id": ctx.saga_id,
    }
    return {k: _fill(v, values) for k, v in args.items()}


def _fill(value: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole:
            return _resolve(whole.group(1).strip(), values)
        return _PLACEHOLDER.sub(lambda m: str(_resolve(m.group(1).strip(), values)), value)
    if isinstance(value, Mapping):
        return {k: _fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, values) for v in value]
    return value


def _resolve(path: str, values: Mapping[str, Any]) -> Any:
    parts = path.split(".")
    current: Any = values
    for i, part in enumerate(parts):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            got = ".".join(parts[:i]) or "the context"
            raise KeyError(f"{{{path}}}: {got} has no {part!r} (it is {current!r:.200})")
    return current
