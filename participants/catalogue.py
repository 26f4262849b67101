"""The catalogue: ``wrap()`` turns participant objects into checked tool specs.

A ``ToolSpec`` is everything the rest of Sagaline needs to know about one tool: its
argument schema (for the model and for validation), its contract (snapshotted into
the ledger for the coordinator), and handles to call the tool, its compensation, its
lookup and its verification, sync or async.

``wrap()`` checks every declaration before anything runs and raises one
``CatalogueError`` that lists every problem (R4): a typo in ``by=`` fails on boot,
not during a refund.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import functools
import inspect
import re
import time
import types
import typing
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from participants.context import async_tool_loop, call_deadline
from participants.declarations import (
    DETERMINISTIC_ERRORS,
    Accepted,
    BusinessRejection,
    CompensableDeclaration,
    CompensationArgs,
    CompensationContext,
    LookupResult,
    ToolDeclaration,
    TransientError,
    compensable_declaration,
    tool_declaration,
)
from participants.errors import (
    CatalogueError,
    CatalogueProblem,
    ContractViolation,
    InvalidArgumentsError,
    NotDeclaredError,
    UnknownToolError,
)
from schemas.models import CompensationApproval, RetryPolicy, Reversibility, StepContract
from schemas.redaction import redact, secret_paths, spelled_paths

__all__ = ["TOOL_SHAPES", "Catalogue", "ToolKind", "ToolSpec", "wrap"]

TOOL_SHAPES = ("anthropic", "openai", "openai-responses", "mcp")
"""The vendor shapes ``tool_definitions()`` can emit."""

# LLM tool-calling APIs accept these names; Kafka topics accept these participant names.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PARTICIPANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
# Keyword arguments of Saga.call itself: a tool parameter of that name could not be passed.
_RESERVED_ARGS = frozenset({"step_id", "depends_on", "timeout_s"})


class ToolKind(StrEnum):
    """How a tool's effect can be recovered, as the plan check and tables show it."""

    READ_ONLY = "READ_ONLY"
    REVERSIBLE = "REVERSIBLE"
    COMPENSATABLE = "COMPENSATABLE"
    IRREVERSIBLE = "IRREVERSIBLE"


@dataclass(frozen=True, eq=False)
class ToolSpec:
    """One checked tool of a catalogue. Built by ``wrap()``, never by hand."""

    name: str
    description: str
    participant: str
    method_name: str
    func: Callable[..., Any]
    args_model: type[BaseModel]
    reversibility: Reversibility
    compensation: str | None
    compensation_func: Callable[..., Any] | None
    compensation_takes_context: bool
    compensation_args: CompensationArgs | None
    lookup_name: str | None
    lookup_func: Callable[[str], Any] | None
    verify_name: str | None
    verify_func: Callable[[CompensationContext], Any] | None
    read_only: bool
    pivot: bool
    resources: tuple[str, ...]
    reversal_window_ms: int | None
    compensation_approval: CompensationApproval
    retry: RetryPolicy
    compensation_retry: RetryPolicy
    non_retryable: tuple[type[BaseException], ...]
    transient: tuple[type[BaseException], ...]
    owner: str
    deadline_ms: int
    secret_fields: tuple[str, ...]
    operation_id: str | Callable[[Any], str | None] | None
    completion_within_ms: int | None = None  # the declared wait for an Accepted (R12)

    # ------------------------------------------------------------------ describing

    @property
    def kind(self) -> ToolKind:
        if self.read_only:
            return ToolKind.READ_ONLY
        return ToolKind(self.reversibility.value)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    @property
    def runs_async(self) -> bool:
        """Whether the tool, its compensation, its lookup or its verification is
        async (or wraps an async function): the participant runtime then serves them
        on its one long-lived event loop."""
        return any(
            _is_async(f)
            for f in (self.func, self.compensation_func, self.lookup_func, self.verify_func)
            if f is not None
        )

    def contract(self, participant: str | None = None) -> StepContract:
        """The snapshot the coordinator decides from (recorded in ``StepScheduled``).

        ``participant`` overrides the catalogue's name, for a tool served under
        another command topic.
        """
        return StepContract(
            tool=self.name,
            participant=participant or self.participant,
            reversibility=self.reversibility,
            compensation=self.compensation,
            read_only=self.read_only,
            pivot=self.pivot,
            has_lookup=self.lookup_func is not None,
            has_verify=self.verify_func is not None,
            resources=list(self.resources),
            reversal_window_ms=self.reversal_window_ms,
            compensation_approval=self.compensation_approval,
            retry=self.retry,
            compensation_retry=self.compensation_retry,
            deadline_ms=self.deadline_ms,
            owner=self.owner,
            completion_within_ms=self.completion_within_ms,
        )

    def input_schema(self) -> dict[str, Any]:
        """JSON Schema of the arguments (an object with one property per parameter)."""
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        return schema

    def model_description(self) -> str:
        """The description a model reads; an IRREVERSIBLE tool says so, so the model
        can plan around it (and expect to wait for a person)."""
        if self.kind is ToolKind.IRREVERSIBLE:
            return (
                f"{self.description} (IRREVERSIBLE: cannot be undone; runs only after a"
                " person approves)"
            )
        return self.description

    def definition(self, shape: str = "anthropic") -> dict[str, Any]:
        """The tool as an LLM tool-calling API takes it, in one of
        :data:`TOOL_SHAPES`: ``anthropic`` (Messages API), ``openai`` (Chat
        Completions), ``openai-responses`` (Responses API), ``mcp`` (an MCP ``Tool``,
        with ``readOnlyHint`` / ``destructiveHint`` annotations)."""
        name, description, schema = self.name, self.model_description(), self.input_schema()
        if shape == "anthropic":
            return {"name": name, "description": description, "input_schema": schema}
        if shape == "openai":
            return {
                "type": "function",
                "function": {"name": name, "description": description, "parameters": schema},
            }
        if shape == "openai-responses":
            return {
                "type": "function",
                "name": name,
                "description": description,
                "parameters": schema,
            }
        if shape == "mcp":
            return {
                "name": name,
                "description": description,
                "inputSchema": schema,
                "annotations": {
                    "readOnlyHint": self.read_only,
                    "destructiveHint": self.kind is ToolKind.IRREVERSIBLE,
                    "idempotentHint": self.read_only,
                },
            }
        raise ValueError(f"unknown tool shape {shape!r}; use one of {', '.join(TOOL_SHAPES)}")

    # ------------------------------------------------------------------- arguments

    def validate_args(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Validate ``args`` against the schema; returns the keyword arguments to call
        the tool with. Raises ``InvalidArgumentsError`` (the tool is not called)."""
        try:
            model = self.args_model.model_validate(dict(args))
        except pydantic.ValidationError as exc:
            raise InvalidArgumentsError(self.name, _short_errors(exc)) from exc
        except Exception as exc:
            # A validator of the tool's own types raising what pydantic does not turn
            # into a validation error (KeyError, TypeError): the arguments are still
            # what is wrong, and the plan check or the caller must say so, not crash.
            raise InvalidArgumentsError(
                self.name, f"a validator raised {type(exc).__name__}: {exc}"
            ) from exc
        return {field: getattr(model, field) for field in type(model).model_fields}

    @functools.cached_property
    def secret_paths(self) -> tuple[str, ...]:
        """Argument paths never written in clear: ``@tool(secret_fields=...)`` (under
        each key a part can arrive as: a field's name and its alias) plus fields typed
        ``schemas.redaction.Secret`` (or pydantic's ``SecretStr``, ``SecretBytes``,
        ``Secret[T]``). Worked out once per spec (the runtime asks for every command)."""
        declared = (p for f in self.secret_fields for p in spelled_paths(self.args_model, f))
        return tuple(dict.fromkeys((*declared, *secret_paths(self.args_model))))

    def redact(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``args`` with every secret replaced by its redaction marker, for the ledger."""
        return redact(args, self.secret_paths)

    def is_business_rejection(self, error: BaseException) -> bool:
        """Whether ``error`` is a rejection, never retried (R9); the order is
        documented on ``@tool``: declared rejections, declared transient types,
        deterministic built-in errors, and everything else is transient."""
        if isinstance(error, (BusinessRejection, *self.non_retryable)):
            return True
        if isinstance(error, (TransientError, *self.transient)):
            return False
        return isinstance(error, DETERMINISTIC_ERRORS)

    def provider_operation_id(self, result: Any) -> str | None:
        """The provider's operation id in a tool's result, as declared by
        ``@tool(operation_id=...)``; by default a ``str`` result is the id."""
        if self.operation_id is None:
            return result if isinstance(result, str) else None
        if callable(self.operation_id):
            found = self.operation_id(result)
        elif isinstance(result, Mapping):
            found = result.get(self.operation_id)
        else:
            found = getattr(result, self.operation_id, None)
        return None if found is None else str(found)

    # -------------------------------------------------------------------- calling

    def invoke(self, args: Mapping[str, Any]) -> Any:
        """Validate ``args`` and call the tool; an async tool runs in a fresh event
        loop (use ``ainvoke`` from inside one)."""
        kwargs = self.validate_args(args)
        return _call_sync(self.name, self.func, **kwargs)

    async def ainvoke(self, args: Mapping[str, Any]) -> Any:
        """Validate ``args`` and call the tool; a sync tool runs in a worker thread so
        a deadline can still be enforced around it."""
        kwargs = self.validate_args(args)
        return await _call_async(self.func, **kwargs)

    def compensate(self, ctx: CompensationContext) -> Any:
        """Run the declared compensation. It may return ``Accepted(operation_id)``
        when the provider finishes asynchronously (R12)."""
        return _call_sync(self.name, self._compensation_call(ctx))

    async def acompensate(self, ctx: CompensationContext) -> Any:
        return await _call_async(self._compensation_call(ctx))

    def lookup(self, idempotency_key: str) -> LookupResult:
        """Find the operation of ``idempotency_key`` (R11). ``None`` means not found."""
        return self._lookup_result(_call_sync(self.name, self._lookup_func(), idempotency_key))

    async def alookup(self, idempotency_key: str) -> LookupResult:
        return self._lookup_result(await _call_async(self._lookup_func(), idempotency_key))

    def verify(self, ctx: CompensationContext) -> bool:
        """Check the business state after the compensation (R12)."""
        return self._verify_result(_call_sync(self.name, self._verify_func(), ctx))

    async def averify(self, ctx: CompensationContext) -> bool:
        return self._verify_result(await _call_async(self._verify_func(), ctx))

    def _compensation_call(self, ctx: CompensationContext) -> Callable[[], Any]:
        comp = self.compensation_func
        if comp is None:
            raise NotDeclaredError(
                f"tool {self.name!r} declares no compensation"
                f" ({self.kind.value}); there is nothing to run"
            )
        if self.compensation_args is not None:
            built = self.compensation_args(ctx)
            if not isinstance(built, Mapping):
                raise ContractViolation(
                    f"@compensable(args=...) of tool {self.name!r} returned"
                    f" {type(built).__name__}; return a dict of keyword arguments for"
                    f" {self.compensation}"
                )
            kwargs = dict(built)
            return lambda: comp(**kwargs)
        if self.compensation_takes_context:
            return lambda: comp(ctx)
        return comp

    def _lookup_func(self) -> Callable[[str], Any]:
        if self.lookup_func is None:
            raise NotDeclaredError(
                f"tool {self.name!r} declares no lookup; an unknown outcome needs a person (R11)"
            )
        return self.lookup_func

    def _verify_func(self) -> Callable[[CompensationContext], Any]:
        if self.verify_func is None:
            raise NotDeclaredError(f"tool {self.name!r} declares no verification")
        return self.verify_func

    def _lookup_result(self, found: Any) -> LookupResult:
        if found is None:
            return LookupResult.not_found()
        if isinstance(found, LookupResult):
            return found
        raise ContractViolation(
            f"lookup {self.lookup_name!r} of tool {self.name!r} returned"
            f" {type(found).__name__}; return LookupResult.committed(...),"
            " LookupResult.pending() or None"
        )

    def _verify_result(self, ok: Any) -> bool:
        if isinstance(ok, bool):
            return ok
        raise ContractViolation(
            f"verify {self.verify_name!r} of tool {self.name!r} returned"
            f" {type(ok).__name__}; return True or False"
        )


class Catalogue(Mapping[str, ToolSpec]):
    """The checked tools of one participant, by name (iteration yields names)."""

    def __init__(self, name: str, specs: Mapping[str, ToolSpec], participants: tuple[object, ...]):
        self.name = name
        self._specs = dict(specs)
        self.participants = participants

    def __getitem__(self, name: str) -> ToolSpec:
        try:
            return self._specs[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._specs), n=1)
            raise UnknownToolError(
                name, self.name, self._specs, close[0] if close else ""
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"Catalogue({self.name!r}, tools={list(self._specs)})"

    def tool_definitions(self, shape: str = "anthropic") -> list[dict[str, Any]]:
        """Every tool as an LLM tool-calling API takes it (``shape``: one of
        :data:`TOOL_SHAPES`); IRREVERSIBLE tools say so in their description."""
        return [spec.definition(shape) for spec in self._specs.values()]

    def contracts(self) -> dict[str, StepContract]:
        return {name: spec.contract() for name, spec in self._specs.items()}


# ---------------------------------------------------------------------------- wrap


def wrap(*participants: object, name: str | None = None) -> Catalogue:
    """Build the catalogue of ``participants`` and check every declaration.

    Each participant is an object (usually an instance of a class) whose methods
    carry ``@tool``, or a plain function (a tool by being passed; it needs
    ``@compensable`` or ``@tool(read_only=True)``); compensations, lookups and
    verifications named by a string are found on the same object (a method, bound or
    taken from its class, is refused: pass its object). ``name`` is the
    participant name (its command topic is ``sagaline.commands.<name>``); by default
    it is derived from the first object's class name. Raises ``CatalogueError``
    listing every problem.
    """
    problems: list[CatalogueProblem] = []
    catalogue_name = name if name is not None else _default_name(participants)
    if not participants:
        problems.append(
            CatalogueProblem(
                "wrap()", "no participant objects given; call wrap(YourService(), name=...)"
            )
        )
    if not _PARTICIPANT_NAME.match(catalogue_name):
        problems.append(
            CatalogueProblem(
                "wrap()",
                f"participant name {catalogue_name!r} cannot be part of a Kafka topic name;"
                " use letters, digits, '.', '_' or '-'",
            )
        )

    methods = [(p, _given_method(p)) for p in participants]
    for given, message in methods:
        if message:
            problems.append(CatalogueProblem(_given_tool_name(given), message))

    specs: dict[str, ToolSpec] = {}
    owners: dict[str, list[str]] = {}
    for obj in _group_functions(tuple(p for p, message in methods if not message)):
        inspector = _Inspector(obj, catalogue_name, problems)
        for spec in inspector.specs():
            specs.setdefault(spec.name, spec)
        for tool_name, method in inspector.declared:
            owners.setdefault(tool_name, []).append(f"{inspector.label}.{method}")

    for tool_name, where in owners.items():
        if len(where) > 1:
            problems.append(
                CatalogueProblem(
                    tool_name,
                    f"tool name {tool_name!r} is declared {len(where)} times"
                    f" ({', '.join(where)}); tool names must be unique in a catalogue:"
                    " rename one with @tool(name=...)",
                )
            )

    if problems:
        raise CatalogueError(problems, catalogue=catalogue_name)
    return Catalogue(catalogue_name, specs, participants)


def _given_method(given: object) -> str:
    """Why ``given`` cannot be a participant of ``wrap()`` because it is a method, not
    the object that has it; "" when it is no method. A function written in a class
    body and taking ``self`` (``Shelf.peek``) would be a plain-function tool asking
    the model for a ``self`` argument; a bound method (``shelf.peek``) holds no tool
    methods of its own."""
    if inspect.ismethod(given):
        owner = given.__self__
        label = f"{_label(owner)}.{given.__name__}"
        return (
            f"wrap() was given the bound method {label}; pass the object itself,"
            " wrap(obj, ...): every @tool method of it is served"
        )
    if not inspect.isfunction(given):
        return ""
    owner_path = given.__qualname__.rpartition(".")[0]
    if not owner_path or owner_path.endswith("<locals>"):
        return ""  # a module-level or nested function, not one of a class body
    try:
        first = next(iter(inspect.signature(given).parameters), None)
    except (TypeError, ValueError):
        return ""
    if first != "self":
        return ""
    klass = owner_path.rpartition(".")[2]
    return (
        f"wrap() was given {klass}.{given.__name__}, a method of the class {klass} (it"
        f" takes self), as a plain function; pass an object of the class,"
        f" wrap({klass}(), ...): every @tool method of it is served"
    )


def _given_tool_name(given: object) -> str:
    func = getattr(given, "__func__", given)
    declared = tool_declaration(func)
    if declared is not None and isinstance(declared.name, str) and declared.name:
        return declared.name
    return _name(func)


def _group_functions(participants: tuple[object, ...]) -> list[object]:
    """Plain functions given to ``wrap()`` become the methods of one participant
    object; passing a function declares it a tool (its docstring describes it), so an
    existing function needs only ``@compensable``. The caller's functions are copied,
    never changed."""
    functions = [p for p in participants if inspect.isfunction(p)]
    if not functions:
        return list(participants)
    members: dict[str, Any] = {}
    for func in functions:
        if tool_declaration(func) is None:
            func = _tool_copy(func)
        members[func.__name__] = staticmethod(func)
    holder = type("functions", (), members)()
    return [holder, *(p for p in participants if not inspect.isfunction(p))]


def _tool_copy(func: types.FunctionType) -> types.FunctionType:
    from participants.declarations import tool

    copy = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__annotations__ = dict(func.__annotations__)
    copy.__doc__ = func.__doc__
    copy.__qualname__ = func.__qualname__
    copy.__module__ = func.__module__
    copy.__dict__.update(func.__dict__)
    return tool()(copy)


def _default_name(participants: tuple[object, ...]) -> str:
    if not participants:
        return "participant"
    first = participants[0]
    if inspect.isfunction(first):
        return "tools"
    if isinstance(first, types.ModuleType):
        base = first.__name__.rsplit(".", 1)[-1]
    else:
        base = (first if inspect.isclass(first) else type(first)).__name__
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()


def _label(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return (obj if inspect.isclass(obj) else type(obj)).__name__


class _Inspector:
    """Finds and checks the declarations of one participant object."""

    def __init__(self, obj: object, participant: str, problems: list[CatalogueProblem]):
        self.obj = obj
        self.participant = participant
        self.problems = problems
        self.label = _label(obj)
        self.declared: list[tuple[str, str]] = []  # (tool name, method), valid or not

    def problem(self, subject: str, message: str) -> None:
        self.problems.append(CatalogueProblem(subject, message))

    def specs(self) -> list[ToolSpec]:
        if inspect.isclass(self.obj):
            self.problem(
                self.label,
                f"wrap() was given the class {self.label}, not an instance;"
                f" pass {self.label}() so its tools are bound to an object",
            )
            return []
        found: list[ToolSpec] = []
        any_tool = False
        for attr in sorted(self._callable_names()):
            target = self._function(attr)
            decl = tool_declaration(target)
            comp = compensable_declaration(target)
            if decl is None:
                if comp is not None:
                    self.problem(
                        attr,
                        f"method {self.label}.{attr} has @compensable but no @tool;"
                        " add @tool(description=...) or remove @compensable",
                    )
                continue
            any_tool = True
            spec = self._spec(attr, target, decl, comp)
            if spec is not None:
                found.append(spec)
        if not any_tool:
            self.problem(
                self.label,
                f"{self.label} has no method decorated with @tool; decorate its tools"
                " or leave it out of wrap()",
            )
        return found

    # ------------------------------------------------------------------ finding

    def _callable_names(self) -> list[str]:
        names = []
        for attr in dir(self.obj):
            if attr.startswith("__"):
                continue
            if callable(self._function(attr)):
                names.append(attr)
        return names

    def _function(self, attr: str) -> Any:
        """The undecorated function behind ``attr``, without running descriptors."""
        try:
            raw = inspect.getattr_static(self.obj, attr)
        except AttributeError:
            return None
        if isinstance(raw, (staticmethod, classmethod)):
            return raw.__func__
        return raw

    def _bound(self, attr: str) -> Callable[..., Any] | None:
        if not callable(self._function(attr)):
            return None
        bound = getattr(self.obj, attr)
        return bound if callable(bound) else None

    def _own_method(self, declared: object) -> str | None:
        """The name of ``declared`` when it is a method of this object given as a
        function (``by=release_seat`` written in the class body hands over the plain
        function, which called as it is would miss ``self``): it is then bound like a
        name. None for anything else."""
        if not inspect.isfunction(declared) or isinstance(self.obj, types.ModuleType):
            return None
        # Written in the body of this object's class (or a base), not a free function
        # that a class also holds as an attribute: that one is called as it is.
        owner = declared.__qualname__.rpartition(".")[0]
        if not any(c.__qualname__ == owner for c in type(self.obj).__mro__):
            return None
        names = [declared.__name__, *sorted(self._callable_names())]
        for name in names:
            try:
                if inspect.getattr_static(self.obj, name) is declared:
                    return name
            except AttributeError:
                continue
        # Overridden in a subclass: the class that wrote it holds it under its name,
        # and the name, like ``by="name"`` and ``self.name()``, reaches the override.
        name = declared.__name__
        for klass in type(self.obj).__mro__:
            held = vars(klass).get(name)
            if getattr(held, "__func__", held) is declared and callable(self._function(name)):
                return name
        return None

    def _missing(self, tool_name: str, what: str, method: str, declared_as: str) -> None:
        close = difflib.get_close_matches(method, self._callable_names(), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; add a method {method}() to it"
        self.problem(
            tool_name,
            f"{declared_as} names the {what} method {method!r}, but {self.label} has no"
            f" method {method!r}{hint}",
        )

    # ------------------------------------------------------------------ checking

    def _spec(
        self,
        attr: str,
        target: Any,
        decl: ToolDeclaration,
        comp: CompensableDeclaration | None,
    ) -> ToolSpec | None:
        before = len(self.problems)
        tool_name = decl.name or attr
        if not isinstance(tool_name, str):
            tool_name = str(tool_name)
            self.problem(
                tool_name,
                f'tool name {decl.name!r} is not a string; set @tool(name="...")'
                f" (method {self.label}.{attr})",
            )
        self.declared.append((tool_name, attr))
        func = self._bound(attr)
        assert func is not None  # _callable_names only lists callables
        for flag in ("read_only", "pivot"):
            value = getattr(decl, flag)
            if not isinstance(value, bool):
                # The contract would read "no" as False while the plan check took it
                # as set: one declaration, two meanings.
                self.problem(tool_name, f"{flag} must be True or False, got {value!r}")

        if not _TOOL_NAME.match(tool_name):
            self.problem(
                tool_name,
                f"tool name {tool_name!r} is not accepted by LLM tool-calling APIs;"
                " use 1-64 letters, digits, '_' or '-' (set @tool(name=...))",
            )
        description = decl.description or _first_paragraph(inspect.getdoc(target))
        if not description:
            self.problem(
                tool_name,
                "has no description; pass @tool(description=...) or write a docstring,"
                " the model chooses tools by it",
            )
        args_model = self._args_model(tool_name, target, func)
        for problem in (*decl.problems, *(comp.problems if comp else ())):
            self.problem(tool_name, problem)

        reversibility = comp.reversibility if comp else Reversibility.COMPENSATABLE
        compensation_name, compensation_func, takes_context = self._compensation(
            tool_name, attr, decl, comp
        )
        lookup_func = self._lookup(tool_name, decl.lookup)
        verify_func = self._verify(tool_name, decl.verify, compensation_name)
        self._contract_fields(tool_name, decl, args_model)

        if len(self.problems) > before or args_model is None:
            return None
        spec = ToolSpec(
            name=tool_name,
            description=description or "",
            participant=self.participant,
            method_name=attr,
            func=func,
            args_model=args_model,
            reversibility=Reversibility.REVERSIBLE if decl.read_only else reversibility,
            compensation=compensation_name,
            compensation_func=compensation_func,
            compensation_takes_context=takes_context,
            compensation_args=comp.args if comp is not None and compensation_func else None,
            lookup_name=_helper_label(decl.lookup),
            lookup_func=lookup_func,
            verify_name=_helper_label(decl.verify),
            verify_func=verify_func,
            read_only=decl.read_only,
            pivot=decl.pivot,
            resources=decl.resources,
            reversal_window_ms=decl.reversal_window_ms,
            compensation_approval=CompensationApproval(decl.compensation_approval),
            retry=decl.retry,
            compensation_retry=decl.compensation_retry,
            non_retryable=decl.non_retryable,
            transient=decl.transient,
            owner=decl.owner,
            deadline_ms=decl.deadline_ms,
            secret_fields=decl.secret_fields,
            operation_id=decl.operation_id,
            completion_within_ms=comp.completion_within_ms if comp and compensation_name else None,
        )
        # The runtime snapshots this contract for every step: a field pydantic refuses
        # (retry=3) must fail here, naming the tool, not when the participant starts.
        try:
            spec.contract()
        except pydantic.ValidationError as exc:
            self.problem(tool_name, f"its contract cannot be built: {_short_errors(exc)}")
            return None
        return spec

    def _args_model(
        self, tool_name: str, target: Any, func: Callable[..., Any]
    ) -> type[BaseModel] | None:
        try:
            hints = typing.get_type_hints(target, include_extras=True)
        except Exception as exc:  # NameError, TypeError: an annotation that won't resolve
            self.problem(
                tool_name,
                f"the type hints of {self.label}.{_name(target)} cannot be resolved ({exc});"
                " import the types they name at module level",
            )
            return None
        fields: dict[str, Any] = {}
        for param in inspect.signature(func).parameters.values():
            if param.name in _RESERVED_ARGS:
                self.problem(
                    tool_name,
                    f"parameter {param.name!r} is reserved: saga.call(tool, step_id=...,"
                    " depends_on=..., timeout_s=..., **args) takes it for itself; rename it",
                )
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                self.problem(
                    tool_name,
                    f"parameter {param.name!r} is {param.kind.description}; a tool's"
                    " arguments must be named parameters so they have a JSON schema",
                )
                continue
            annotation = hints.get(param.name, Any)
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (annotation, default)
        try:
            model = pydantic.create_model(
                f"{_camel(tool_name)}Args",
                __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=False),
                **fields,
            )
        except Exception as exc:  # pydantic's schema errors name the field
            self.problem(
                tool_name,
                f"cannot build an argument schema from its type hints ({exc});"
                " use JSON-compatible types (str, int, float, bool, lists, dicts,"
                " pydantic models)",
            )
            return None
        # pydantic silently leaves out a field it reserves (``_private``,
        # ``model_config``): a required parameter it dropped could never be passed, and
        # every call would fail on the missing argument.
        dropped = [
            name
            for name, (_annotation, default) in fields.items()
            if default is ... and name not in model.model_fields
        ]
        for name in dropped:
            self.problem(
                tool_name,
                f"parameter {name!r} cannot be an argument: pydantic reserves the name"
                " (a leading underscore, or model_config), so no call could pass it;"
                " rename it",
            )
        if dropped:
            return None
        # A type pydantic validates but cannot describe (a Callable, ``type``) would
        # fail later, as the runtime publishes the tool's definition: say so now.
        try:
            model.model_json_schema()
        except Exception as exc:
            self.problem(
                tool_name,
                f"its arguments have no JSON schema ({str(exc).splitlines()[0]}), so no"
                " model could be told how to call it; use JSON-compatible types (str,"
                " int, float, bool, lists, dicts, pydantic models)",
            )
            return None
        return model

    def _compensation(
        self,
        tool_name: str,
        attr: str,
        decl: ToolDeclaration,
        comp: CompensableDeclaration | None,
    ) -> tuple[str | None, Callable[..., Any] | None, bool]:
        none: tuple[str | None, Callable[..., Any] | None, bool] = (None, None, False)
        if decl.read_only:
            if comp is not None:
                self.problem(
                    tool_name,
                    "is read_only but declares @compensable; a read-only tool has no"
                    " effect to undo: remove @compensable or read_only=True",
                )
            if decl.pivot:
                self.problem(
                    tool_name,
                    "is read_only and pivot; the pivot is the write after which the saga"
                    " only goes forward (R6): remove pivot=True or read_only=True",
                )
            return none
        if comp is None:
            self.problem(
                tool_name,
                "is a write tool with no declared compensation (R4); add"
                ' @compensable(by="<method that undoes it>"),'
                " @compensable(reversibility=Reversibility.IRREVERSIBLE) if no undo"
                " exists, or @tool(read_only=True) if it changes nothing",
            )
            return none
        if comp.by is None:
            unread = any(p.startswith("reversibility ") for p in comp.problems)  # reported
            if comp.reversibility is not Reversibility.IRREVERSIBLE and not unread:
                self.problem(
                    tool_name,
                    f"declares @compensable(reversibility={comp.reversibility.value})"
                    " without by=; name the method that undoes it, e.g."
                    ' @compensable(by="undo_...") or declare it IRREVERSIBLE',
                )
            return none
        if comp.args is not None and not _takes_one_argument(comp.args):
            self.problem(
                tool_name,
                f"@compensable(args={_name(comp.args)}) must be a callable taking one"
                " CompensationContext and returning the compensation's keyword arguments,"
                ' e.g. args=lambda ctx: {"reservation_id": ctx.result["id"]}',
            )
            return none
        by = self._own_method(comp.by) or comp.by
        if isinstance(by, str):
            declared_as = f'@compensable(by="{by}")'
            target = self._function(by)
            if not callable(target):
                self._missing(tool_name, "compensation", by, declared_as)
                return none
            if by == attr:
                self.problem(
                    tool_name,
                    f"{declared_as} names the tool itself; name the method that undoes it",
                )
                return none
            bound = self._bound(by)
            assert bound is not None
            label = by
        elif callable(by):
            # A plain function or a callable object (functools.partial, a class with
            # __call__): only functions carry type hints worth checking.
            target = by if inspect.isroutine(by) else None
            bound = by
            label = _name(by)
            if getattr(by, "__func__", by) is getattr(
                self._function(attr), "__func__", self._function(attr)
            ):
                self.problem(
                    tool_name,
                    f"@compensable(by={label}) is the tool itself; pass the function"
                    " that undoes it",
                )
                return none
        else:
            self.problem(
                tool_name,
                f"@compensable(by={by!r}) is neither a method name nor a callable;"
                " pass the name of a method of this class or the undo function itself",
            )
            return none
        self._completion_wait(tool_name, comp, label, target)
        if comp.args is not None:
            if not self._accepts_keywords(tool_name, label, bound):
                return none
            return label, bound, False
        takes_context = self._check_context_signature(
            tool_name, "compensation", label, target, bound, allow_none=True
        )
        if takes_context is None:
            return none
        return label, bound, takes_context

    def _accepts_keywords(self, tool_name: str, label: str, func: Callable[..., Any]) -> bool:
        """A compensation called as ``by(**args(ctx))`` must not need positional-only
        arguments (the names ``args`` returns can only be checked when it runs)."""
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            self.problem(tool_name, f"compensation {label!r} has no inspectable signature")
            return False
        for p in params:
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                self.problem(
                    tool_name,
                    f"compensation {label!r} has a required positional-only argument"
                    f" {p.name!r}; with args=... it is called with keyword arguments only",
                )
                return False
        return True

    def _completion_wait(
        self, tool_name: str, comp: CompensableDeclaration, label: str, target: Any
    ) -> None:
        """R12: a compensation that can answer ``Accepted`` (its return annotation
        admits it) must say how long the completion may take, so an acceptance that
        never completes becomes an incident at a known time instead of a wait forever."""
        try:
            returns = typing.get_type_hints(target).get("return") if target else None
        except Exception:  # reported by the signature check already
            return
        can_accept = returns is not None and returns is not Any and _allows(returns, Accepted)
        within = comp.completion_within_ms
        if can_accept and within is None and not comp.problems:  # else: reported as given
            self.problem(
                tool_name,
                f"compensation {label!r} can return Accepted but declares no completion wait;"
                " add @compensable(..., completion_within=<seconds or timedelta>)"
                " (how long the provider may take to finish it, R12)",
            )
        elif within is not None and within <= 0:
            self.problem(
                tool_name,
                f"@compensable(completion_within=...) is {within} ms; it must be positive",
            )
        elif within is not None and returns is not None and not can_accept and returns is not Any:
            self.problem(
                tool_name,
                f"@compensable(completion_within=...) is declared but compensation {label!r}"
                f" returns {_type_name(returns)}, which is never Accepted; annotate it"
                " -> ... | Accepted, or remove completion_within=",
            )

    def _helper(
        self, tool_name: str, role: str, declared: str | Callable[..., Any]
    ) -> tuple[str, Any, Callable[..., Any]] | None:
        """The (label, function to read hints from, callable) of a ``lookup=`` or
        ``verify=``: the name of a method of the same object, or, as with ``by=``,
        a function or callable itself (a plain-function tool has no sibling methods).
        None when it names nothing (a problem has been recorded)."""
        declared = self._own_method(declared) or declared
        if isinstance(declared, str):
            target = self._function(declared)
            if not callable(target):
                self._missing(tool_name, role, declared, f'@tool({role}="{declared}")')
                return None
            bound = self._bound(declared)
            assert bound is not None
            return declared, target, bound
        if callable(declared):
            target = declared if inspect.isroutine(declared) else None
            return _name(declared), target, declared
        self.problem(
            tool_name,
            f"@tool({role}={declared!r}) is neither a method name nor a callable;"
            f" pass the name of a method of this class or the {role} function itself",
        )
        return None

    def _lookup(
        self, tool_name: str, declared: str | Callable[..., Any] | None
    ) -> Callable[[str], Any] | None:
        if declared is None:
            return None
        found = self._helper(tool_name, "lookup", declared)
        if found is None:
            return None
        method, target, bound = found
        wanted = "one argument, the idempotency key (key: str) -> LookupResult | None"
        hints = self._hints(tool_name, "lookup", method, target)
        required = self._required_positional(tool_name, "lookup", method, bound, wanted)
        if required is None:
            return None
        if len(required) != 1:
            self.problem(
                tool_name,
                f"lookup method {method!r} takes {len(required)} arguments; it must take {wanted}",
            )
            return None
        param_hint = hints.get(required[0].name)
        if param_hint is not None and param_hint is not str:
            self.problem(
                tool_name,
                f"lookup method {method!r} takes {required[0].name}: {_type_name(param_hint)};"
                f" it must take {wanted}",
            )
            return None
        returns = hints.get("return")
        if returns is not None and not _allows(returns, LookupResult):
            self.problem(
                tool_name,
                f"lookup method {method!r} returns {_type_name(returns)}; it must return"
                " LookupResult | None",
            )
            return None
        return bound

    def _verify(
        self,
        tool_name: str,
        declared: str | Callable[..., Any] | None,
        compensation_name: str | None,
    ) -> Callable[[CompensationContext], Any] | None:
        if declared is None:
            return None
        found = self._helper(tool_name, "verify", declared)
        if found is None:
            return None
        method, target, bound = found
        if compensation_name is None:
            self.problem(
                tool_name,
                f'@tool(verify="{method}") is declared but the tool has no compensation to'
                " verify; remove verify= or declare @compensable(by=...)",
            )
            return None
        takes = self._check_context_signature(
            tool_name, "verify", method, target, bound, allow_none=False
        )
        if takes is None:
            return None
        returns = self._hints(tool_name, "verify", method, target).get("return")
        if returns is not None and returns is not bool:
            self.problem(
                tool_name,
                f"verify method {method!r} returns {_type_name(returns)}; it must return bool",
            )
            return None
        return bound

    def _check_context_signature(
        self,
        tool_name: str,
        role: str,
        method: str,
        target: Any,
        bound: Callable[..., Any],
        *,
        allow_none: bool,
    ) -> bool | None:
        """Whether the method takes a CompensationContext; None when its signature
        is wrong (a problem has been recorded)."""
        wanted = (
            "no argument or one CompensationContext (or declare"
            " @compensable(args=lambda ctx: {...}) to call it with keyword arguments)"
            if allow_none
            else "one CompensationContext (ctx: CompensationContext) -> bool"
        )
        required = self._required_positional(tool_name, role, method, bound, wanted)
        if required is None:
            return None
        if not required and self._optional_context(tool_name, role, method, target, bound):
            return True  # ``ctx: CompensationContext | None = None``: it is given ctx
        if len(required) > 1 or (not allow_none and len(required) == 0):
            self.problem(
                tool_name,
                f"{role} method {method!r} takes {len(required)} arguments"
                f" ({', '.join(p.name for p in required) or 'none'}); it must take {wanted}",
            )
            return None
        if not required:
            return False
        hint = self._hints(tool_name, role, method, target).get(required[0].name)
        if hint is not None and hint is not CompensationContext:
            self.problem(
                tool_name,
                f"{role} method {method!r} takes {required[0].name}: {_type_name(hint)};"
                f" it must take {wanted}",
            )
            return None
        return True

    def _optional_context(
        self, tool_name: str, role: str, method: str, target: Any, bound: Callable[..., Any]
    ) -> bool:
        """Whether the first positional parameter, having a default, is typed for the
        context (``ctx: CompensationContext | None = None``, callable by hand too):
        called without it, the method would run with its default instead of ``ctx``."""
        try:
            params = inspect.signature(bound).parameters.values()
        except (TypeError, ValueError):
            return False
        first = next(
            (p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None
        )
        if first is None:
            return False
        hint = self._hints(tool_name, role, method, target).get(first.name)
        return hint is not None and hint is not Any and _allows(hint, CompensationContext)

    def _required_positional(
        self, tool_name: str, role: str, method: str, bound: Callable[..., Any], wanted: str
    ) -> list[inspect.Parameter] | None:
        try:
            params = list(inspect.signature(bound).parameters.values())
        except (TypeError, ValueError):
            self.problem(tool_name, f"{role} method {method!r} has no inspectable signature")
            return None
        required = []
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
                continue
            if p.kind is p.KEYWORD_ONLY:
                self.problem(
                    tool_name,
                    f"{role} method {method!r} has a required keyword-only argument"
                    f" {p.name!r}; it must take {wanted}",
                )
                return None
            required.append(p)
        return required

    def _hints(self, tool_name: str, role: str, method: str, target: Any) -> dict[str, Any]:
        if target is None:
            return {}
        try:
            return typing.get_type_hints(target)
        except Exception as exc:
            self.problem(
                tool_name,
                f"the type hints of {role} method {method!r} cannot be resolved ({exc})",
            )
            return {}

    def _contract_fields(
        self, tool_name: str, decl: ToolDeclaration, args_model: type[BaseModel] | None
    ) -> None:
        if decl.compensation_approval not in tuple(CompensationApproval):
            self.problem(
                tool_name,
                f"compensation_approval is {decl.compensation_approval!r}; use one of"
                f" {', '.join(a.value for a in CompensationApproval)} (CompensationApproval)",
            )
        if decl.deadline_ms <= 0:
            self.problem(tool_name, f"deadline must be positive, got {decl.deadline_ms} ms")
        if decl.reversal_window_ms is not None:
            if decl.reversal_window_ms <= 0:
                self.problem(
                    tool_name,
                    f"reversal_window must be positive, got {decl.reversal_window_ms} ms",
                )
            if decl.read_only:
                self.problem(
                    tool_name,
                    "is read_only but declares a reversal_window; there is nothing to"
                    " reverse: remove reversal_window",
                )
        for field, types_ in (("non_retryable", decl.non_retryable), ("transient", decl.transient)):
            for exc_type in types_:
                if not (inspect.isclass(exc_type) and issubclass(exc_type, BaseException)):
                    self.problem(
                        tool_name,
                        f"{field} must list exception classes, got {exc_type!r}",
                    )
        for resource in decl.resources:
            if not isinstance(resource, str) or not resource:
                self.problem(tool_name, f"resources must be non-empty strings, got {resource!r}")
        if not decl.owner:
            self.problem(tool_name, "owner is empty; name who is handed this tool's incidents (R8)")
        bad_secrets = [s for s in decl.secret_fields if not isinstance(s, str)]
        for secret in bad_secrets:
            self.problem(
                tool_name,
                f"secret_fields must list argument names or dotted paths (strings), got {secret!r}",
            )
        if args_model is not None and not bad_secrets:
            # An argument arrives under its name or, when it has one, its alias (what
            # its JSON schema shows): a secret path names it either way.
            names = {
                key
                for name, info in args_model.model_fields.items()
                for key in (name, info.alias, info.validation_alias)
                if isinstance(key, str)
            }
            for secret in decl.secret_fields:
                # An argument, or a dotted path into one (``card.number``, ``keys.*``).
                if secret.split(".", 1)[0] not in names:
                    close = difflib.get_close_matches(secret, sorted(names), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    self.problem(
                        tool_name,
                        f"secret_fields names {secret!r}, which is not an argument of the"
                        f" tool{hint}",
                    )
        if decl.operation_id is not None and not (
            isinstance(decl.operation_id, str) or callable(decl.operation_id)
        ):
            self.problem(
                tool_name,
                "operation_id must be a key/attribute name or a callable(result) -> str",
            )


# ------------------------------------------------------------------------ helpers


def _call_sync(tool_name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; if it is async, run it to completion on the runtime's event loop
    (:func:`participants.context.serve_async_tools`), else in a fresh one."""
    result = fn(*args, **kwargs)
    if not inspect.isawaitable(result):
        return result
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # none in this thread: run it to completion here
    else:
        _close(result)
        raise RuntimeError(
            f"tool {tool_name!r} is async and an event loop is already running in this"
            " thread; use the async API (ainvoke, acompensate, alookup, averify)"
        )
    # Past the call's deadline (set by the runtime) the coroutine is cancelled: left
    # running it would keep its task, and this thread waiting on it, for good.
    deadline = call_deadline()
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    shared = async_tool_loop()  # the participant runtime's long-lived loop
    if shared is None:
        return asyncio.run(asyncio.wait_for(_await(result), timeout))
    future = asyncio.run_coroutine_threadsafe(_carried(result), shared)
    try:
        answer = future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()  # no-op when the tool itself raised a TimeoutError
        raise
    if isinstance(answer, _Raised):
        raise answer.error  # on this thread, where the runtime reports it
    return answer


async def _call_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await ``fn``; a sync ``fn`` runs in a worker thread so it does not block the
    loop and a deadline around it still fires (the thread's outcome is then unknown)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        return await result
    return result


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class _Raised:
    """A SystemExit or KeyboardInterrupt an async tool raised on the shared loop."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _carried(awaitable: Awaitable[Any]) -> Any:
    """Await ``awaitable`` on the shared loop. A SystemExit (a click/argparse-based
    library's bad input) or KeyboardInterrupt raised in a task leaves asyncio's task
    machinery and stops the loop running it, so that call and every later async tool
    of the process would hang: it is returned instead, and raised on the caller's
    thread."""
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as exc:
        return _Raised(exc)


def _close(awaitable: object) -> None:
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()  # no "coroutine was never awaited" warning


def _short_errors(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\-]+", name) if part)


def _name(obj: Any) -> str:
    return str(getattr(obj, "__name__", repr(obj)))


def _helper_label(declared: str | Callable[..., Any] | None) -> str | None:
    """How a ``lookup=`` / ``verify=`` is named in tables and messages."""
    if declared is None or isinstance(declared, str):
        return declared
    return _name(declared)


def _type_name(hint: Any) -> str:
    if inspect.isclass(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _is_async(fn: Callable[..., Any]) -> bool:
    """An ``async def`` (bound, in a ``partial``, or behind ``functools.wraps``), or a
    callable object whose ``__call__`` is one."""
    try:
        inner = inspect.unwrap(fn)
    except ValueError:  # a __wrapped__ cycle
        inner = fn
    call = None if inspect.isroutine(fn) else type(fn).__call__
    return any(inspect.iscoroutinefunction(f) for f in (fn, inner, call))


def _takes_one_argument(fn: Any) -> bool:
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(None)
    except (TypeError, ValueError):
        return False
    return True


def _allows(hint: Any, cls: type) -> bool:
    """Whether a return annotation admits ``cls`` (directly, in a union, or Any)."""
    if hint is Any or hint is cls:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_allows(arg, cls) for arg in typing.get_args(hint))
    return False
