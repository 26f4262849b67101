"""``sagaline drill``: the fault drill from the shell (see :mod:`services.drill`)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from participants.catalogue import Catalogue
from participants.discovery import DiscoveryError, load_catalogue
from participants.errors import CatalogueError
from sagaline.kafka import DeliveryFailed, KafkaException, TopicSetupError
from services.drill._inject import Seam
from services.drill._run import run_drill, unknown_tools

EXIT_OK, EXIT_FAILED, EXIT_UNREADABLE = 0, 1, 2


def register(subparsers: Any) -> None:
    """Add ``drill`` to the ``sagaline`` parser."""
    drill = subparsers.add_parser(
        "drill",
        help="run a plan with a fault at every seam, for every step (seed 004)",
        description='Run PLAN (JSON: {"calls": [{"tool": NAME, "args": {...}}, ...],'
        ' optionally "modules": ["MODULE:ATTR", ...]}) against the catalogues on the'
        " configured broker once per seam and step, then print the seam x step matrix:"
        " converged, escalated (truthfully, with an incident) or FAILED. In args,"
        ' "$tool.field" is a field of an earlier result and {case} a per-case id.'
        " Exit 1 when a case FAILED.",
    )
    drill.add_argument("--plan", type=Path, required=True, metavar="FILE")
    drill.add_argument(
        "--catalogue",
        action="append",
        default=None,
        metavar="MODULE[:ATTR]",
        help="a participant catalogue (repeat for several); ATTR may also be a function"
        " taking the state directory and returning catalogues. Default: the plan's modules",
    )
    drill.add_argument(
        "--seam",
        action="append",
        choices=[s.value for s in Seam],
        default=None,
        help="only these seams (repeat); default: all",
    )
    drill.add_argument(
        "--step", action="append", type=int, default=None, help="only these steps, 1-based"
    )
    drill.add_argument("--state-dir", type=Path, default=None, help="for the providers")
    drill.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    drill.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    drill.set_defaults(func=_drill)


def _drill(args: argparse.Namespace) -> int:
    try:
        plan = json.loads(args.plan.read_text())
        calls = plan["calls"]
        _check_calls(calls)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"sagaline drill: cannot read the plan {args.plan}: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    outside = [n for n in args.step or [] if not 1 <= n <= len(calls)]
    if outside:
        print(
            f"sagaline drill: --step {outside[0]}: the plan has {len(calls)} steps,"
            f" numbered 1 to {len(calls)}",
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    refs = (
        args.catalogue
        or plan.get("modules")
        or ([plan["module"]] if isinstance(plan.get("module"), str) else [])
    )
    if not refs:
        print(
            "sagaline drill: name the catalogue with --catalogue MODULE:ATTR"
            ' or "modules" in the plan',
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="sagaline-drill-"))
    try:
        catalogues = [c for ref in refs for c in load_catalogues(ref, state_dir)]
    except (CatalogueError, DiscoveryError) as exc:
        print(f"sagaline drill: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    unknown = unknown_tools(catalogues, calls)
    if unknown:
        print(f"sagaline drill: {args.plan}: {unknown}", file=sys.stderr)
        return EXIT_UNREADABLE
    from services.broker import settings_and_bootstrap

    _settings, bootstrap = settings_and_bootstrap()
    try:
        report = run_drill(
            catalogues,
            calls,
            bootstrap=bootstrap,
            state_dir=state_dir,
            seams=[Seam(s) for s in args.seam] if args.seam else None,
            steps=[n - 1 for n in args.step] if args.step else None,
            case_timeout_s=args.timeout,
        )
    except (KafkaException, TopicSetupError, DeliveryFailed) as exc:
        error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
        text = getattr(error, "str", None)
        words = text() if callable(text) else exc
        print(
            f"sagaline drill: the broker at {bootstrap} did not answer as needed ({words});"
            " check KAFKA_BOOTSTRAP_SERVERS and that the broker is up",
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "seam": r.seam.value,
                        "step": r.step + 1,
                        "tool": r.tool,
                        "saga_id": r.saga_id,
                        "verdict": r.verdict.value,
                        "status": r.status,
                        "detail": r.detail,
                    }
                    for r in report.results
                ],
                indent=2,
            )
        )
    else:
        print(report.matrix())
    return EXIT_OK if report.ok else EXIT_FAILED


def _check_calls(calls: Any) -> None:
    """``calls`` is a non-empty list of ``{"tool": NAME, "args": {...}}`` (ValueError)."""
    if not isinstance(calls, list) or not calls:
        raise ValueError('"calls" must be a non-empty list of {"tool": NAME, "args": {...}}')
    for n, call in enumerate(calls, 1):
        if not isinstance(call, dict) or not isinstance(call.get("tool"), str):
            raise ValueError(f'call {n} is not {{"tool": NAME, "args": {{...}}}}: {call!r}')
        if not isinstance(call.get("args", {}), dict):
            raise ValueError(f'call {n} ({call["tool"]}): "args" must be an object')


def load_catalogues(reference: str, state_dir: Path) -> list[Catalogue]:
    """``MODULE:ATTR`` as :func:`participants.discovery.load_catalogue` reads it
    (catalogues, participants, zero-argument factories), or, when ATTR is a function
    of one argument, what it returns for ``state_dir``: a catalogue or a list of them
    (several participants, each with its own topic, whose providers keep state)."""
    module_name, _, attr = reference.partition(":")
    if attr:
        try:
            value: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError):
            value = None
        if inspect.isfunction(value) and len(inspect.signature(value).parameters) == 1:
            made = value(state_dir)
            found = made if isinstance(made, (list, tuple)) else [made]
            if not all(isinstance(c, Catalogue) for c in found):
                raise DiscoveryError(
                    f"{reference} returned {type(made).__name__}; a catalogue factory must"
                    " return a Catalogue or a list of them"
                )
            return list(found)
    return [load_catalogue(reference)]
