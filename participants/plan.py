"""Plan check (R17): before running, classify each proposed call and flag ordering
that would leave an effect nobody can undo.

The rule it applies is seed 003's: everything fallible before the pivot, everything
irreversible after it. A failure before the pivot unwinds what ran; a failure after
it goes forward. So an irreversible step that something fallible still follows,
before any pivot, is an error: if that later step fails, the saga unwinds and the
irreversible effect stays. Reversible work after the pivot is only a warning: it is
retried forward, never compensated (R6), which is sometimes exactly what is wanted
(seed 003's ``close_ticket``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from participants.catalogue import ToolKind, ToolSpec
from participants.errors import InvalidArgumentsError

__all__ = [
    "CallClass",
    "ClassifiedCall",
    "Finding",
    "FindingCode",
    "PlanReport",
    "PlannedCall",
    "Severity",
    "check_plan",
]


class CallClass(StrEnum):
    """What a proposed call is, for recovery purposes."""

    READ_ONLY = "READ_ONLY"
    REVERSIBLE = "REVERSIBLE"
    COMPENSATABLE = "COMPENSATABLE"
    PIVOT = "PIVOT"
    IRREVERSIBLE = "IRREVERSIBLE"
    UNKNOWN = "UNKNOWN"


class Severity(StrEnum):
    ERROR = "ERROR"  # the plan can leave an effect nobody can undo, or cannot run
    WARNING = "WARNING"  # legal, but check it is what you mean
    INFO = "INFO"  # what will happen (an approval to wait for)


class FindingCode(StrEnum):
    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    AMBIGUOUS_TOOL = "AMBIGUOUS_TOOL"
    INVALID_ARGS = "INVALID_ARGS"
    IRREVERSIBLE_BEFORE_FALLIBLE = "IRREVERSIBLE_BEFORE_FALLIBLE"
    MULTIPLE_PIVOTS = "MULTIPLE_PIVOTS"
    WORK_AFTER_PIVOT = "WORK_AFTER_PIVOT"
    NO_COMPENSATION = "NO_COMPENSATION"
    NEEDS_APPROVAL = "NEEDS_APPROVAL"


@dataclass(frozen=True)
class PlannedCall:
    """One call an agent proposes: a tool name and its JSON arguments."""

    tool: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClassifiedCall:
    index: int
    tool: str
    call_class: CallClass
    compensation: str | None = None
    participant: str | None = None


@dataclass(frozen=True)
class Finding:
    code: FindingCode
    severity: Severity
    step: int
    tool: str
    message: str

    def __str__(self) -> str:
        where = f"step {self.step} {self.tool}"
        return f"{self.severity.value} {self.code.value} {where}: {self.message}"


@dataclass(frozen=True)
class PlanReport:
    """The classified calls and what is wrong with their order."""

    calls: tuple[ClassifiedCall, ...]
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """No finding of ERROR severity."""
        return not self.errors

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.ERROR)

    def codes(self) -> list[FindingCode]:
        return [f.code for f in self.findings]

    def render(self) -> str:
        """A plain-text report a person can read."""
        counts = {s: sum(1 for f in self.findings if f.severity is s) for s in Severity}
        header = (
            f"plan of {len(self.calls)} call(s): {counts[Severity.ERROR]} error(s),"
            f" {counts[Severity.WARNING]} warning(s), {counts[Severity.INFO]} note(s)"
        )
        rows = [("step", "tool", "class", "compensation")] + [
            (str(c.index), c.tool, c.call_class.value, c.compensation or "-") for c in self.calls
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [header, ""]
        lines += [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        if self.findings:
            lines += ["", "findings:"]
            lines += [f"  {f}" for f in self.findings]
        lines += ["", "OK" if self.ok else "NOT OK: fix the errors above before running"]
        return "\n".join(lines)


def check_plan(
    calls: Iterable[PlannedCall | Mapping[str, Any]],
    catalogue: Mapping[str, ToolSpec] | Iterable[Mapping[str, ToolSpec]],
    *,
    reads_are_steps: bool = True,
) -> PlanReport:
    """Classify each call and flag ordering problems (R17).

    ``catalogue`` is one ``Catalogue`` or several (an agent may call tools of more
    than one participant). ``calls`` are ``PlannedCall`` or ``{"tool": ..., "args":
    {...}}`` mappings. ``reads_are_steps``: a read-only call is a step of the saga (as
    with the saga client), whose failure before the pivot unwinds the saga like a
    write's; False where reads are not steps (``sagaline mcp proxy`` passes them
    straight through), so an irreversible step before one is not flagged.
    """
    if isinstance(calls, Mapping) or not isinstance(calls, Iterable):
        shown = "one call object" if isinstance(calls, Mapping) else type(calls).__name__
        raise ValueError(
            'the planned calls must be a list of {"tool": ..., "args": {...}} objects,'
            f" got {shown}"
        )
    tools, declared_by = _merge(catalogue)
    planned = [_planned(i, c) for i, c in enumerate(calls)]
    findings: list[Finding] = []
    classified: list[ClassifiedCall] = []
    specs: list[ToolSpec | None] = []

    for index, call in enumerate(planned):
        spec = tools.get(call.tool)
        specs.append(spec)
        if spec is None:
            findings.append(
                Finding(
                    FindingCode.UNKNOWN_TOOL,
                    Severity.ERROR,
                    index,
                    call.tool,
                    f"no catalogue has a tool {call.tool!r}; known tools:"
                    f" {', '.join(sorted(tools)) or '(none)'}",
                )
            )
            classified.append(ClassifiedCall(index, call.tool, CallClass.UNKNOWN))
            continue
        classified.append(
            ClassifiedCall(index, call.tool, _classify(spec), spec.compensation, spec.participant)
        )
        owners = declared_by.get(call.tool, ())
        if len(owners) > 1:
            findings.append(
                Finding(
                    FindingCode.AMBIGUOUS_TOOL,
                    Severity.ERROR,
                    index,
                    call.tool,
                    f"is declared by {len(owners)} participants"
                    f" ({', '.join(repr(o) for o in owners)}); a call by name reaches only"
                    f" one of them, so this plan was checked against {spec.participant!r}'s"
                    " and may run the other's. Rename one with @tool(name=...)",
                )
            )
        try:
            spec.validate_args(call.args)
        except InvalidArgumentsError as exc:
            findings.append(
                Finding(FindingCode.INVALID_ARGS, Severity.ERROR, index, call.tool, exc.detail)
            )

    findings += _ordering(classified, specs, reads_are_steps)
    findings.sort(key=lambda f: (f.step, list(Severity).index(f.severity)))
    return PlanReport(tuple(classified), tuple(findings))


def _ordering(
    calls: list[ClassifiedCall], specs: list[ToolSpec | None], reads_are_steps: bool
) -> list[Finding]:
    findings: list[Finding] = []
    pivots = [c for c in calls if c.call_class is CallClass.PIVOT]
    first_pivot = pivots[0].index if pivots else None
    for extra in pivots[1:]:
        findings.append(
            Finding(
                FindingCode.MULTIPLE_PIVOTS,
                Severity.ERROR,
                extra.index,
                extra.tool,
                f"is a second pivot (step {first_pivot} {pivots[0].tool} is the first);"
                " a saga commits at one point: make this step run after the pivot as"
                " forward work, or split the plan into two sagas",
            )
        )

    for call, spec in zip(calls, specs, strict=True):
        after_pivot = first_pivot is not None and call.index > first_pivot
        if spec is not None and spec.kind is ToolKind.IRREVERSIBLE:
            findings.append(
                Finding(
                    FindingCode.NEEDS_APPROVAL,
                    Severity.INFO,
                    call.index,
                    call.tool,
                    "is IRREVERSIBLE: the saga suspends for human approval before it runs (R7)",
                )
            )
        later = (
            _fallible_until_pivot(calls, call.index, reads_are_steps)
            if call.call_class is CallClass.IRREVERSIBLE and not after_pivot
            else []
        )
        if later:
            first = later[0]
            more = f" and {len(later) - 1} more" if len(later) > 1 else ""
            findings.append(
                Finding(
                    FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE,
                    Severity.ERROR,
                    call.index,
                    call.tool,
                    f"is IRREVERSIBLE but step {first.index} {first.tool}"
                    f" ({first.call_class.value}){more} can still fail after it; the"
                    f" saga would then unwind and {call.tool} cannot be undone. Move it"
                    " after the fallible steps (after the pivot), or make it the pivot",
                )
            )
        if (
            after_pivot
            and call.call_class in (CallClass.REVERSIBLE, CallClass.COMPENSATABLE)
            and first_pivot is not None
        ):
            findings.append(
                Finding(
                    FindingCode.WORK_AFTER_PIVOT,
                    Severity.WARNING,
                    call.index,
                    call.tool,
                    f"runs after the pivot (step {first_pivot} {calls[first_pivot].tool}):"
                    " if it fails it is retried forward and escalated, never compensated"
                    " (R6). If a failure here would need undoing, move it before the pivot",
                )
            )
        if spec is not None and not spec.read_only and spec.compensation is None:
            findings.append(
                Finding(
                    FindingCode.NO_COMPENSATION,
                    Severity.WARNING,
                    call.index,
                    call.tool,
                    "declares no compensation, not even a correction: once it commits, its"
                    " effect stays; if the saga fails it is handed to"
                    f" {spec.owner!r}",
                )
            )
    return findings


def _fallible_until_pivot(
    calls: list[ClassifiedCall], after: int, reads_are_steps: bool
) -> list[ClassifiedCall]:
    """Steps after step ``after`` whose failure would still unwind the saga: every
    later step up to and including the next pivot. A read counts when it is a step:
    a read that fails (an order not found, a timeout) turns the saga around too."""
    found: list[ClassifiedCall] = []
    for call in calls[after + 1 :]:
        if call.call_class is CallClass.UNKNOWN:
            continue
        if call.call_class is CallClass.READ_ONLY and not reads_are_steps:
            continue
        found.append(call)
        if call.call_class is CallClass.PIVOT:
            break
    return found


def _classify(spec: ToolSpec) -> CallClass:
    if spec.pivot:
        return CallClass.PIVOT
    return {
        ToolKind.READ_ONLY: CallClass.READ_ONLY,
        ToolKind.REVERSIBLE: CallClass.REVERSIBLE,
        ToolKind.COMPENSATABLE: CallClass.COMPENSATABLE,
        ToolKind.IRREVERSIBLE: CallClass.IRREVERSIBLE,
    }[spec.kind]


def _planned(index: int, call: object) -> PlannedCall:
    """A call as a ``PlannedCall``; ValueError naming the call (by its position, never
    by its argument values, which may be secret) when it is not one."""
    if isinstance(call, PlannedCall):
        return call
    if not isinstance(call, Mapping):
        raise ValueError(
            f'planned call {index} must be an object {{"tool": ..., "args": {{...}}}},'
            f" got {type(call).__name__}{_short(call)}"
        )
    tool = call.get("tool")
    if not isinstance(tool, str):
        raise ValueError(
            f"planned call {index} needs a 'tool' name; it has the keys"
            f" {sorted(str(k) for k in call)}"
        )
    args = call.get("args", {})
    if not isinstance(args, Mapping):
        raise ValueError(
            f"the 'args' of planned call {index} ({tool!r}) must be an object,"
            f" got {type(args).__name__}"
        )
    return PlannedCall(tool, args)


def _short(value: object) -> str:
    """A bare string (a tool name without its object) is shown; anything else only
    by type, since it may hold arguments."""
    return f" {value[:64]!r}" if isinstance(value, str) else ""


def _merge(
    catalogue: Mapping[str, ToolSpec] | Iterable[Mapping[str, ToolSpec]],
) -> tuple[dict[str, ToolSpec], dict[str, tuple[str, ...]]]:
    """The tools by name (a later catalogue's spec wins, as in ``SagaClient``), and
    for each name the participants that declare it: tool names are one namespace for
    an agent, so a name two participants declare is ambiguous (one participant's
    catalogue given twice is not)."""
    if isinstance(catalogue, Mapping):
        return dict(catalogue), {}
    merged: dict[str, ToolSpec] = {}
    owners: dict[str, dict[str, None]] = {}
    for one in catalogue:
        merged.update(one)
        for name, spec in one.items():
            owners.setdefault(name, {})[spec.participant] = None
    return merged, {name: tuple(found) for name, found in owners.items()}
