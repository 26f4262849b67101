"""Declarations: the Python twin of seed 000's ``@Tool``, ``@Compensable`` and
``@Compensation``, plus the rest of a tool's contract (seed 004).

The decorators only *record* what a method declares, as an attribute on the function,
and return the function unchanged. Nothing is checked here: ``wrap()`` checks every
declaration of a participant at once and reports every problem in one error, which
is what a person fixing a deploy wants. Because each decorator writes its own
attribute, their order does not matter; one decorator given twice on a function with
different declarations is such a problem (the outer would silently replace the inner).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, TypeVar

from schemas.keys import compensation_key as derive_compensation_key
from schemas.models import CompensationApproval, ReconcileResult, RetryPolicy, Reversibility

__all__ = [
    "DEFAULT_COMPENSATION_RETRY",
    "Accepted",
    "BusinessRejection",
    "CompensableDeclaration",
    "CompensationApproval",
    "CompensationArgs",
    "CompensationContext",
    "LookupResult",
    "ReconcileResult",
    "RetryPolicy",
    "Reversibility",
    "ToolDeclaration",
    "TransientError",
    "compensable",
    "compensation",
    "tool",
]

F = TypeVar("F", bound=Callable[..., Any])

TOOL_ATTR = "__sagaline_tool__"
COMPENSABLE_ATTR = "__sagaline_compensable__"
COMPENSATION_ATTR = "__sagaline_compensation__"

DEFAULT_COMPENSATION_RETRY = RetryPolicy(
    max_attempts=8, initial_backoff_ms=200, max_backoff_ms=10_000
)
"""Compensations are the last line of defence: retried harder than forward steps (R8)."""

Duration = timedelta | float | int
"""A duration: a ``timedelta`` or a number of seconds."""


def _duration_s(value: Duration) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _to_ms(value: Duration | None) -> int | None:
    return None if value is None else round(_duration_s(value) * 1000)


def _checked_ms(
    field: str, value: Duration | None, problems: list[str], default: int | None = None
) -> int | None:
    """``value`` in milliseconds; ``default`` and a problem for ``wrap()`` to report
    (naming the tool) when it is no duration: ``"1h"``, ``inf``, ``nan``, ``True``."""
    try:
        if isinstance(value, bool):
            raise TypeError(field)
        return _to_ms(value)
    except (TypeError, ValueError, OverflowError):
        problems.append(f"{field} is {value!r}; give a timedelta or a number of seconds")
        return default


_EXCEPTIONS = "exception classes"


def _entries(field: str, value: Any, problems: list[str], wanted: str) -> tuple[Any, ...]:
    """A declared collection as a tuple; one string or one class is one entry.

    ``resources=("inventory")`` (a forgotten trailing comma) is a string, and
    ``tuple()`` of it would be one-letter resources; ``non_retryable=KeyError`` is one
    class, and ``tuple()`` of it a TypeError at import naming no tool. A value that is
    no collection (``resources=None``) is ``()`` and a problem for ``wrap()`` to
    report, naming the tool.
    """
    if isinstance(value, str | type):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        problems.append(f"{field} is {value!r}; give a list of {wanted}")
        return ()


class BusinessRejection(Exception):
    """The provider said no for a business reason ("credit limit exceeded").

    It would fail the same way forever, so it is never retried and the saga starts
    compensating at once (R9). Subclass it for your own rejections, or list other
    exception types in ``@tool(non_retryable=...)``.
    """


class TransientError(Exception):
    """A failure that may pass if the call is repeated (a provider briefly down).

    Retried with the same idempotency key under the tool's retry policy. Subclass it,
    or list other exception types in ``@tool(transient=...)``.
    """


DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    LookupError,
    AttributeError,
    ArithmeticError,
    NotImplementedError,
    AssertionError,
    PermissionError,
)
"""Built-in errors that fail the same way on every attempt (bad input, a bug, a
refusal): treated as rejections, never retried, unless the tool lists them in
``transient=``. Retrying them would only delay the compensation."""


@dataclass(frozen=True)
class Accepted:
    """Returned by a compensation that the provider accepted but has not finished.

    The step is not compensated until the completion receipt for ``operation_id``
    arrives (R12); a cancellation accepted is not yet a released reservation.
    """

    operation_id: str


@dataclass(frozen=True)
class LookupResult:
    """What a ``lookup`` found for an idempotency key (R11).

    Return ``LookupResult.committed(result)`` when the operation happened,
    ``LookupResult.pending()`` when the provider has not settled it yet, and ``None``
    (or ``LookupResult.not_found()``) when no such operation exists.
    """

    status: ReconcileResult
    result: Any = None
    provider_operation_id: str | None = None

    @classmethod
    def committed(cls, result: Any, provider_operation_id: str | None = None) -> LookupResult:
        return cls(ReconcileResult.COMMITTED, result, provider_operation_id)

    @classmethod
    def not_found(cls) -> LookupResult:
        return cls(ReconcileResult.NOT_FOUND)

    @classmethod
    def pending(cls) -> LookupResult:
        return cls(ReconcileResult.PENDING)


@dataclass(frozen=True)
class CompensationContext:
    """Passed to a compensation so it knows what to undo (seed 000).

    ``input`` is the exact JSON arguments the tool was called with and ``result`` what
    it returned, usually the handle the undo needs. ``compensation_key`` is derived
    from ``idempotency_key`` so a retried compensation repeats the same provider
    operation (R8); pass it to the provider as its idempotency key.
    """

    saga_id: str
    tool_name: str
    input: dict[str, Any]
    result: Any
    idempotency_key: str
    compensation_key: str = ""
    # What the provider called the forward operation; also when an operator settled
    # an unknown outcome as COMMITTED and gave it (``incidents resolve --operation-id``).
    provider_operation_id: str | None = None

    def __post_init__(self) -> None:
        if not self.compensation_key:
            object.__setattr__(
                self, "compensation_key", derive_compensation_key(self.idempotency_key)
            )


@dataclass(frozen=True)
class ToolDeclaration:
    """What ``@tool`` recorded. Durations are already in milliseconds."""

    description: str | None
    name: str | None
    read_only: bool
    pivot: bool
    lookup: str | Callable[..., Any] | None
    verify: str | Callable[..., Any] | None
    resources: tuple[str, ...]
    reversal_window_ms: int | None
    compensation_approval: CompensationApproval
    retry: RetryPolicy
    compensation_retry: RetryPolicy
    non_retryable: tuple[Any, ...]
    transient: tuple[Any, ...]
    owner: str
    deadline_ms: int
    secret_fields: tuple[str, ...]
    operation_id: str | Callable[[Any], str | None] | None
    problems: tuple[str, ...] = ()  # values that are not what their field takes


CompensationArgs = Callable[[CompensationContext], Mapping[str, Any]]
"""Builds a compensation's keyword arguments from the forward call (``ctx.input``,
``ctx.result``, ``ctx.idempotency_key``...)."""


@dataclass(frozen=True)
class CompensableDeclaration:
    """What ``@compensable`` recorded."""

    by: str | Callable[..., Any] | None
    reversibility: Reversibility
    args: CompensationArgs | None = None
    completion_within_ms: int | None = None
    problems: tuple[str, ...] = ()  # values that are not what their field takes


def tool(
    *,
    description: str | None = None,
    name: str | None = None,
    read_only: bool = False,
    pivot: bool = False,
    lookup: str | Callable[..., Any] | None = None,
    verify: str | Callable[..., Any] | None = None,
    resources: Sequence[str] = (),
    reversal_window: Duration | None = None,
    compensation_approval: CompensationApproval = CompensationApproval.INHERIT,
    retry: RetryPolicy | None = None,
    compensation_retry: RetryPolicy | None = None,
    non_retryable: Sequence[type[BaseException]] = (),
    transient: Sequence[type[BaseException]] = (),
    owner: str = "operations",
    deadline: Duration = 10.0,
    secret_fields: Sequence[str] = (),
    operation_id: str | Callable[[Any], str | None] | None = None,
) -> Callable[[F], F]:
    """Declare a method as a tool an agent may call.

    - ``description``: what the model reads; defaults to the docstring's first
      paragraph.
    - ``name``: the tool name; defaults to the method name.
    - ``read_only``: the tool changes nothing, so needs no compensation.
    - ``pivot``: once this commits the saga goes forward only (R6).
    - ``lookup``: a method ``(idempotency_key: str) -> LookupResult | None`` that
      finds an operation whose outcome is unknown (R11): its name, or (like ``by=``)
      the function itself.
    - ``verify``: a method ``(ctx: CompensationContext) -> bool`` that checks the
      business state after the compensation (R12): its name, or the function.
    - ``resources``: what the tool touches; compensations on a shared resource are
      serialized (R2).
    - ``reversal_window``: how long the effect can be undone (``timedelta`` or
      seconds); past it a compensation becomes an incident (R13).
    - ``compensation_approval``: whether undoing needs the forward approval, a new
      one, or none (R13).
    - ``retry`` / ``compensation_retry``: bounded backoff for the forward step and
      the (more generous) compensation (R8).
    - ``non_retryable``: the tool's business rejections by exception type (R9),
      besides ``BusinessRejection``: never retried, the saga compensates at once.
    - ``transient``: exception types worth retrying, besides ``TransientError``.

    How an exception raised by the tool is classified, first match wins:
    ``BusinessRejection`` or a ``non_retryable`` type is a rejection;
    ``TransientError`` or a ``transient`` type is transient; a built-in error that
    fails the same way every time (``ValueError``, ``TypeError``, ``LookupError``,
    ``AttributeError``, ``ArithmeticError``, ``NotImplementedError``,
    ``AssertionError``, ``PermissionError``) is a rejection; anything else
    (``ConnectionError``, ``TimeoutError``, other ``OSError``, your own exceptions)
    is transient and retried under ``retry``.
    - ``owner``: who is handed the problem when recovery runs out (R8).
    - ``deadline``: how long a call may take before its outcome is unknown (R11).
    - ``secret_fields``: argument names (or dotted paths into them, ``card.number``,
      ``*`` for every item) redacted before they reach the ledger.
    - ``operation_id``: how to read the provider operation id from the result: a key
      or attribute name, or a callable; by default a ``str`` result is the id.
    """

    problems: list[str] = []
    deadline_ms = _checked_ms("deadline", deadline, problems, default=10_000)
    window_ms = _checked_ms("reversal_window", reversal_window, problems)
    declaration = ToolDeclaration(
        description=description,
        name=name,
        read_only=read_only,
        pivot=pivot,
        lookup=lookup,
        verify=verify,
        resources=_entries("resources", resources, problems, "strings"),
        reversal_window_ms=window_ms,
        compensation_approval=compensation_approval,
        retry=retry if retry is not None else RetryPolicy(),
        compensation_retry=(
            compensation_retry if compensation_retry is not None else DEFAULT_COMPENSATION_RETRY
        ),
        non_retryable=_entries("non_retryable", non_retryable, problems, _EXCEPTIONS),
        transient=_entries("transient", transient, problems, _EXCEPTIONS),
        owner=owner,
        deadline_ms=deadline_ms if deadline_ms is not None else 10_000,
        secret_fields=_entries("secret_fields", secret_fields, problems, "strings"),
        operation_id=operation_id,
        problems=tuple(problems),
    )

    def mark(func: F) -> F:
        _record(
            func,
            TOOL_ATTR,
            _once("@tool", tool_declaration(_inner(func)), declaration, extra=_ANOTHER_TOOL),
        )
        return func

    return mark


def compensable(
    by: str | Callable[..., Any] | None = None,
    *,
    args: CompensationArgs | None = None,
    reversibility: Reversibility = Reversibility.COMPENSATABLE,
    completion_within: Duration | None = None,
) -> Callable[[F], F]:
    """Declare how a tool's effect is undone (seed 000 ``@Compensable``).

    ``by`` is the compensation: the name of a method of the same class (or
    participant object), or any function or callable, such as an undo function you
    already have (a method of the same class given as itself, ``by=release_seat``
    in the class body, is bound to the object like its name). It is required
    unless ``reversibility`` is IRREVERSIBLE; an IRREVERSIBLE tool may still name
    one, as a correction (a follow-up message).

    How the compensation is called:

    - with ``args=``: ``by(**args(ctx))``, where ``args`` builds the keyword
      arguments from the :class:`CompensationContext` of the forward call, e.g.
      ``@compensable(by=release_seat, args=lambda ctx: {"reservation_id":
      ctx.result["id"]})`` (``ctx.input`` holds the forward arguments);
    - without: ``by(ctx)`` when it takes one argument (or its first parameter, with a
      default, is typed ``CompensationContext | None``), ``by()`` when it takes none.

    ``wrap()`` checks at start-up that ``by`` exists and that its signature fits.

    ``completion_within`` (``timedelta`` or seconds) is how long the provider may take
    to finish a compensation it only accepted: required when the compensation can
    return :class:`Accepted` (its return annotation admits ``Accepted``). The
    coordinator counts it from the acceptance, durably; a completion that has not
    arrived by then is an incident (R12).
    """

    problems: list[str] = []
    try:
        declared = Reversibility(reversibility)
    except ValueError:
        problems.append(
            f"reversibility is {reversibility!r}; use one of"
            f" {', '.join(r.value for r in Reversibility)} (Reversibility)"
        )
        declared = Reversibility.COMPENSATABLE  # not used: wrap() refuses the tool
    declaration = CompensableDeclaration(
        by=by,
        reversibility=declared,
        args=args,
        completion_within_ms=_checked_ms("completion_within", completion_within, problems),
        problems=tuple(problems),
    )

    def mark(func: F) -> F:
        existing = compensable_declaration(_inner(func))
        _record(func, COMPENSABLE_ATTR, _once("@compensable", existing, declaration))
        return func

    return mark


def compensation(func: F) -> F:
    """Mark a method as a compensation (seed 000 ``@Compensation``).

    Documentation only: binding is by the name given in ``@compensable(by=...)``.
    The marker makes the pairing greppable; omitting it changes nothing.
    """

    _record(func, COMPENSATION_ATTR, True)
    return func


_ANOTHER_TOOL = " (declare another tool with a method of its own)"

D = TypeVar("D", ToolDeclaration, CompensableDeclaration)


def _inner(func: object) -> object:
    """The function inside ``@staticmethod`` / ``@classmethod``, where declarations
    are read from; ``func`` itself otherwise."""
    return func.__func__ if isinstance(func, staticmethod | classmethod) else func


def _once(decorator: str, existing: D | None, declaration: D, extra: str = "") -> D:
    """``declaration``, with a problem for ``wrap()`` when the same decorator already
    declared something else on the function: the outer one would silently replace
    the inner one (a dropped ``by=``, a vanished tool name), and which one won would
    depend on the order. The same declaration given twice changes nothing."""
    if existing is None:
        return declaration
    before: tuple[str, ...] = existing.problems
    pairs = [
        (f.name, getattr(existing, f.name), getattr(declaration, f.name))
        for f in fields(declaration)
    ]
    differ = [
        f"{name}={inner!r} and {name}={outer!r}"
        for name, inner, outer in pairs
        if name != "problems" and not _same(inner, outer)
    ]
    if not differ:
        return declaration
    problem = (
        f"{decorator} is given twice, with different declarations"
        f" ({'; '.join(differ)}); keep one{extra}"
    )
    problems = (*before, *declaration.problems, problem)
    return replace(declaration, problems=tuple(dict.fromkeys(problems)))


def _same(a: object, b: object) -> bool:
    """Equal values; two functions of the same code and closure count as one (a
    session that runs ``compensable(by=..., args=lambda ctx: ...)(func)`` again, as a
    notebook cell does, declares nothing new)."""
    if a == b:
        return True
    if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)):
        return False
    cells = [(x.__closure__ or ()) for x in (a, b)]
    return (
        a.__code__ == b.__code__
        and len(cells[0]) == len(cells[1])
        and all(_cell(x) is _cell(y) for x, y in zip(*cells, strict=True))
    )


def _cell(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _record(func: object, attr: str, value: object) -> None:
    """Write a declaration on ``func``; above ``@staticmethod`` or ``@classmethod``
    also on the function inside, which is what ``wrap()`` reads (the descriptor is
    never bound), so the decorators' order does not matter there either."""
    setattr(func, attr, value)
    if isinstance(func, staticmethod | classmethod):
        setattr(func.__func__, attr, value)


def tool_declaration(func: object) -> ToolDeclaration | None:
    """The ``@tool`` declaration recorded on ``func``, if any."""
    found = getattr(func, TOOL_ATTR, None)
    return found if isinstance(found, ToolDeclaration) else None


def compensable_declaration(func: object) -> CompensableDeclaration | None:
    """The ``@compensable`` declaration recorded on ``func``, if any."""
    found = getattr(func, COMPENSABLE_ATTR, None)
    return found if isinstance(found, CompensableDeclaration) else None


def is_compensation(func: object) -> bool:
    """Whether ``func`` carries the ``@compensation`` marker."""
    return getattr(func, COMPENSATION_ATTR, False) is True
