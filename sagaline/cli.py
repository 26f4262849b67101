"""``sagaline status`` and ``sagaline mcp proxy``.

Imports stay inside the commands: ``sagaline --help`` must work with only the core
dependencies installed, and the MCP SDK is an optional extra (``sagaline[mcp]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from participants.readiness import GroupStatus


def register(subparsers: Any) -> None:
    status = subparsers.add_parser(
        "status",
        help="is the coordinator and each participant consuming? (exit 1 if not)",
        description="Reads the consumer groups of the coordinator and of every participant"
        " with tools on the catalogue (plus any named with --participant) through the Kafka"
        " admin API. Exit 0 when all consume, 1 when one does not, 2 when the broker does"
        " not answer or will not describe a group to this principal (shown UNKNOWN).",
    )
    status.add_argument(
        "--participant",
        action="append",
        default=[],
        metavar="NAME",
        help="a participant that must be consuming (repeatable)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_cmd_status)

    mcp = subparsers.add_parser("mcp", help="MCP integration (needs sagaline[mcp])")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", required=True, metavar="COMMAND")
    proxy = mcp_sub.add_parser(
        "proxy",
        help="an MCP server (stdio) fronting upstream MCP servers: every write is a saga step",
        description="Serve, over stdio, the tools of the upstream MCP servers named in"
        " DECLARATION (YAML or JSON). Each MCP session is one saga; compensations and"
        " lookups call the upstream servers. Refuses to start on a declaration that cannot"
        ' work. See docs/agents.md ("sagaline mcp proxy").',
    )
    proxy.add_argument("declaration", type=Path, metavar="DECLARATION")
    proxy.add_argument(
        "--check", action="store_true", help="validate against the upstream servers and exit"
    )
    proxy.set_defaults(func=_cmd_mcp_proxy)


def _cmd_status(args: argparse.Namespace) -> int:
    from participants.readiness import coordinator_group, participant_group
    from sagaline.kafka import KafkaException, TopicNotAuthorized, configured_broker

    settings, bootstrap = configured_broker("sagaline status", answering=True)
    try:
        names = sorted({*_published_participants(bootstrap, settings.topics.catalogue)})
        names = sorted({*names, *args.participant})
        groups = [("coordinator", coordinator_group(settings))]
        groups += [(f"participant {n}", participant_group(settings, n)) for n in names]
        rows = [(role, group, _group_row(bootstrap, group)) for role, group in groups]
    except TopicNotAuthorized as exc:
        print(f"sagaline status: cannot tell which participants to check: {exc}", file=sys.stderr)
        return 2
    except (ConnectionError, KafkaException, TimeoutError) as exc:
        print(f"sagaline status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "role": role,
                        "group": group,
                        "state": s.state if s else None,
                        "members": s.members if s else None,
                        "consuming": s.consuming if s else None,
                    }
                    | ({} if s else {"error": _hidden(group)})
                    for role, group, s in rows
                ],
                indent=2,
            )
        )
    else:
        print(f"broker {bootstrap}, topics {settings.topics.events} ...")
        width = max(len(role) for role, _, _ in rows)
        for role, group, s in rows:
            if s is None:
                print(f"  {role:<{width}}  {'UNKNOWN':<13}  {_hidden(group)}")
                continue
            verdict = "consuming" if s.consuming else "NOT consuming"
            print(f"  {role:<{width}}  {verdict:<13}  {s.state} ({s.members} member(s), {s.group})")
    if any(s is not None and not s.consuming for _, _, s in rows):
        return 1
    return 2 if any(s is None for _, _, s in rows) else 0


def _group_row(bootstrap: str, group: str) -> GroupStatus | None:
    """The group's status; None when the broker hides it from this principal (no
    Describe ACL on it), which the listing alone would show as a stopped group."""
    from participants.readiness import group_status
    from sagaline.kafka import GroupNotAuthorized

    try:
        return group_status(bootstrap, group, hidden_is_error=True)
    except GroupNotAuthorized:
        return None


def _hidden(group: str) -> str:
    return (
        f"the broker will not describe {group} to this principal: grant it Describe on"
        f" group {group} (docs/security.md)"
    )


def _published_participants(bootstrap: str, topic: str) -> set[str]:
    """The participants with tools on the catalogue now (a withdrawn one is not)."""
    from participants.published import fold, publishers
    from sagaline.kafka import LedgerReader, TopicMissing, TopicNotAuthorized

    try:
        current = fold((k, v) for k, v, _h in LedgerReader(bootstrap).records(topic))
    except TopicNotAuthorized:
        raise  # not "nothing published": which participants to check is unknown
    except TopicMissing:
        return set()  # nothing published yet
    return publishers(current)


def _cmd_mcp_proxy(args: argparse.Namespace) -> int:
    try:
        from sagaline.agents.mcp_proxy import main as proxy_main
    except ImportError as exc:  # the adapter's MissingExtra names the extra to install
        print(f"sagaline mcp proxy: {exc}", file=sys.stderr)
        return 2
    return proxy_main(args.declaration, check_only=args.check)
