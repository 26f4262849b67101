"""``sagaline catalogue check``, ``sagaline catalogue withdraw`` and ``sagaline plan check``.

``catalogue check MODULE[:ATTR]`` imports a participant module (rule in
``participants.discovery``), prints its tools, and exits 1 listing every problem when
a declaration cannot work (R4), so CI fails before a deploy does.

``catalogue withdraw PARTICIPANT [--tool TOOL]...`` tombstones on ``sagaline.catalogue``
what a participant taken out of service published (``participants.published``).

``plan check FILE`` reads a proposed plan (JSON) and prints the R17 report; it exits 1
when a finding has ERROR severity. The file::

    {"module": "services.example_tools:CATALOGUE",      # or "modules": [...]
     "calls": [{"tool": "place_hold", "args": {"order_id": "o-1"}}, ...]}

Exit codes: 0 fine, 1 problems found (or nothing to withdraw, or refused), 2 the
module, file or broker could not be read (for withdraw, also: the broker will not
describe the participant's consumer group, so whether it runs is unknown).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from participants.catalogue import Catalogue, ToolKind, ToolSpec
from participants.discovery import DiscoveryError, load_catalogue
from participants.errors import CatalogueError
from participants.plan import check_plan

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_UNREADABLE = 2


def register(subparsers: Any) -> None:
    """Add ``catalogue check`` and ``plan check`` to the ``sagaline`` parser."""
    catalogue = subparsers.add_parser("catalogue", help="inspect a participant's tool catalogue")
    catalogue_sub = catalogue.add_subparsers(dest="catalogue_command", metavar="COMMAND")
    catalogue.set_defaults(func=lambda _args: _help(catalogue))
    check = catalogue_sub.add_parser(
        "check",
        help="validate every tool declaration of a module (R4)",
        description="Import MODULE, wrap its participants and print the catalogue; exit 1"
        " listing every problem. MODULE:ATTR names a Catalogue, a participant object or a"
        " list of them; MODULE alone uses CATALOGUE, catalogue, PARTICIPANTS, or every"
        " module-level object whose class has @tool methods.",
    )
    check.add_argument("module", metavar="MODULE[:ATTR]")
    check.add_argument(
        "--name",
        help="participant name to wrap with (default: derived); refused for a ready Catalogue",
    )
    check.add_argument("--json", action="store_true", help="print the contracts as JSON")
    check.set_defaults(func=_catalogue_check)
    withdraw = catalogue_sub.add_parser(
        "withdraw",
        help="take a retired participant's tools off the published catalogue",
        description="Tombstone on sagaline.catalogue what PARTICIPANT published (every"
        " tool, or those named with --tool), so agents no longer call them by name. Refused"
        " while PARTICIPANT is consuming: a running participant publishes its tools again"
        " when it restarts. Exit 0 withdrawn, 1 refused or nothing to withdraw, 2 the"
        " broker does not answer or will not describe PARTICIPANT's consumer group.",
    )
    withdraw.add_argument("participant", metavar="PARTICIPANT")
    withdraw.add_argument(
        "--tool",
        action="append",
        default=None,
        metavar="TOOL",
        help="withdraw only this tool (repeatable; default: every tool it published)",
    )
    withdraw.set_defaults(func=_catalogue_withdraw)

    plan = subparsers.add_parser("plan", help="check a proposed plan of tool calls (R17)")
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="COMMAND")
    plan.set_defaults(func=lambda _args: _help(plan))
    plan_check = plan_sub.add_parser(
        "check",
        help="classify each call and flag ordering problems",
        description='FILE is JSON: {"module": "MODULE[:ATTR]" (or "modules": [...]),'
        ' "calls": [{"tool": NAME, "args": {...}}, ...]}. Exit 1 on ERROR findings.',
    )
    plan_check.add_argument("file", type=Path, metavar="FILE")
    plan_check.add_argument(
        "--module",
        action="append",
        default=None,
        metavar="MODULE[:ATTR]",
        help="catalogue module(s) to check against, instead of the file's",
    )
    plan_check.add_argument("--json", action="store_true", help="print the report as JSON")
    plan_check.set_defaults(func=_plan_check)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return EXIT_UNREADABLE


# ------------------------------------------------------------------ catalogue check


def _catalogue_check(args: argparse.Namespace) -> int:
    try:
        catalogue = load_catalogue(args.module, name=args.name)
    except CatalogueError as exc:
        print(f"sagaline catalogue check {args.module}: FAILED", file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return EXIT_PROBLEMS
    except DiscoveryError as exc:
        print(f"sagaline catalogue check: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.name is not None and catalogue.name != args.name:
        # A ready Catalogue keeps the name wrap() gave it: say so, not a table under
        # another name than the one asked for.
        print(
            f"sagaline catalogue check: --name {args.name!r} cannot be applied: {args.module}"
            f" provides a ready Catalogue, named {catalogue.name!r} by its wrap(...,"
            " name=...); drop --name or change the name there",
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    if args.json:
        contracts = {n: c.model_dump(mode="json") for n, c in catalogue.contracts().items()}
        print(json.dumps({"participant": catalogue.name, "tools": contracts}, indent=2))
    else:
        print(render_catalogue(catalogue))
    return EXIT_OK


# --------------------------------------------------------------- catalogue withdraw


def _catalogue_withdraw(args: argparse.Namespace) -> int:
    from participants.published import SEPARATOR, fold, stale_keys
    from participants.readiness import group_status, participant_group
    from sagaline.kafka import (
        DeliveryFailed,
        GroupNotAuthorized,
        KafkaException,
        LedgerReader,
        LedgerWriter,
        TopicMissing,
        TopicNotAuthorized,
        configured_broker,
    )

    prog = "sagaline catalogue withdraw"
    name: str = args.participant
    settings, bootstrap = configured_broker(prog, answering=True)
    topic = settings.topics.catalogue
    try:
        try:
            current = fold((k, v) for k, v, _h in LedgerReader(bootstrap).records(topic))
        except TopicNotAuthorized as exc:
            print(f"{prog}: {exc}; nothing withdrawn", file=sys.stderr)
            return EXIT_UNREADABLE
        except TopicMissing:
            print(f"{prog}: {topic} does not exist: nothing is published", file=sys.stderr)
            return EXIT_PROBLEMS
        keys = stale_keys(current, name, ())
        if not keys:
            print(f"{prog}: participant {name!r} publishes no tools on {topic}", file=sys.stderr)
            return EXIT_PROBLEMS
        # Per tool, from its keys: an entry this version cannot read (a newer
        # participant's contract) is still one of its tools, withdrawn only when named.
        tool_of = {key: key.decode().rpartition(SEPARATOR)[2] for key in keys}
        if args.tool:
            published = sorted(set(tool_of.values()))
            unknown = sorted(set(args.tool) - set(published))
            if unknown:
                print(
                    f"{prog}: participant {name!r} publishes no tool {', '.join(unknown)}"
                    f" (it publishes {', '.join(published)}); nothing withdrawn",
                    file=sys.stderr,
                )
                return EXIT_PROBLEMS
            keys = [key for key in keys if tool_of[key] in args.tool]
        group = participant_group(settings, name)
        try:
            status = group_status(bootstrap, group, hidden_is_error=True)
        except GroupNotAuthorized:
            print(
                f"{prog}: cannot tell whether participant {name!r} is consuming: the broker"
                f" will not describe consumer group {group} to this principal, and would"
                f" show it as empty even with the participant running; grant Describe on"
                f" group {group} (docs/security.md); nothing withdrawn",
                file=sys.stderr,
            )
            return EXIT_UNREADABLE
        if status.consuming:
            print(
                f"{prog}: participant {name!r} is consuming ({status.members} member(s) in"
                f" {status.group}): it would publish its tools again when it restarts; stop"
                " it first (a stopped one leaves its group within its session timeout,"
                " 45 s), or redeploy it without the tools; nothing withdrawn",
                file=sys.stderr,
            )
            return EXIT_PROBLEMS
        writer = LedgerWriter(bootstrap, settings.topics, settings.signer())
        try:
            for key in keys:
                writer.write(topic, key, None)
                shown = key.decode()
                if SEPARATOR not in shown:
                    shown += " (the key agents of earlier versions read)"
                print(f"withdrew {shown}")
        finally:
            writer.close()
    except (ConnectionError, KafkaException, DeliveryFailed, TimeoutError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    return EXIT_OK


def render_catalogue(catalogue: Catalogue) -> str:
    """The catalogue as a table: one row per tool."""
    header = (
        "tool",
        "reversibility",
        "compensation",
        "lookup",
        "verify",
        "pivot",
        "approval",
        "undo approval",
    )
    rows = [header] + [_row(spec) for spec in catalogue.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"participant {catalogue.name}: {len(catalogue)} tool(s), all declarations valid"]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _row(spec: ToolSpec) -> tuple[str, ...]:
    return (
        spec.name,
        spec.kind.value,
        spec.compensation or "-",
        spec.lookup_name or "-",
        spec.verify_name or "-",
        "yes" if spec.pivot else "-",
        "required" if spec.kind is ToolKind.IRREVERSIBLE else "-",
        spec.compensation_approval.value if spec.compensation else "-",
    )


# ----------------------------------------------------------------------- plan check


def _plan_check(args: argparse.Namespace) -> int:
    try:
        plan = json.loads(args.file.read_text())
    except (OSError, ValueError) as exc:
        print(f"sagaline plan check: cannot read {args.file}: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if not isinstance(plan, dict) or not isinstance(plan.get("calls"), list):
        print(
            f"sagaline plan check: {args.file} must hold an object with a 'calls' list",
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    try:
        modules = args.module or _plan_modules(plan)
    except ValueError as exc:
        print(f"sagaline plan check: {args.file}: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if not modules:
        print(
            f"sagaline plan check: {args.file} names no catalogue; add"
            ' "module": "MODULE[:ATTR]" or pass --module',
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    try:
        catalogues = [load_catalogue(m) for m in modules]
        report = check_plan(plan["calls"], catalogues)
    except CatalogueError as exc:
        print(f"sagaline plan check: the catalogue is invalid\n{exc}", file=sys.stderr)
        return EXIT_PROBLEMS
    except (DiscoveryError, ValueError) as exc:
        print(f"sagaline plan check: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "calls": [
                        {"step": c.index, "tool": c.tool, "class": c.call_class.value}
                        for c in report.calls
                    ],
                    "findings": [
                        {
                            "code": f.code.value,
                            "severity": f.severity.value,
                            "step": f.step,
                            "tool": f.tool,
                            "message": f.message,
                        }
                        for f in report.findings
                    ],
                },
                indent=2,
            )
        )
    else:
        print(report.render())
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def _plan_modules(plan: dict[str, Any]) -> list[str]:
    """The file's ``"module"`` or ``"modules"``; ``ValueError`` saying what is wrong
    with one that is given but is not a reference (or a list of them)."""
    module = plan.get("module")
    if module is not None:
        if not isinstance(module, str) or not module:
            raise ValueError(
                f"'module' is {module!r}; give one \"MODULE[:ATTR]\" string"
                ' (several: "modules": [...])'
            )
        return [module]
    modules = plan.get("modules")
    if modules is None:
        return []
    if not isinstance(modules, list):
        raise ValueError(f"'modules' is {modules!r}; give a list of \"MODULE[:ATTR]\" strings")
    for n, entry in enumerate(modules):
        if not isinstance(entry, str) or not entry:
            raise ValueError(
                f"'modules' entry {n} is {entry!r}; each must be a \"MODULE[:ATTR]\" string"
            )
    return list(modules)
