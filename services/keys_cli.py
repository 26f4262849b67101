"""``sagaline keys``: make an Ed25519 identity key and print its trust-file entry;
hash a dashboard password.

The private key goes to a file only its owner can read; the entry printed on stdout
holds only the public key, ready to merge into the trust file (docs/security.md).
``keys password NAME`` prints ``{"NAME": "scrypt$..."}`` for SAGALINE_DASHBOARD_USERS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from schemas.trust import Role, new_key_pair


def _names(text: str | None) -> list[str] | None:
    """A comma-separated list, each name stripped ("acme, globex": both)."""
    if text is None:
        return None
    return [n for n in (part.strip() for part in text.split(",")) if n]


def _cmd_new(args: argparse.Namespace) -> int:
    identity = args.identity.strip()
    tenants, principals = _names(args.tenants), _names(args.principals)
    problem = None
    if not identity:
        problem = "the identity is blank: name who signs (a participant, an operator, ...)"
    elif tenants == []:
        problem = "--tenants names no tenant (the key could act for none); leave it out for all"
    elif principals == []:
        problem = "--principals names no principal; leave it out for the identity's own name"
    if problem is not None:
        print(f"keys new: {problem}; nothing written", file=sys.stderr)
        return 2
    pem, kid, entry = new_key_pair(identity, Role(args.role), args.key_id)
    ident = entry["identities"][identity]
    if tenants:
        ident["tenants"] = tenants
    if principals:
        ident["principals"] = principals
    out = Path(args.out) if args.out else Path(f"{kid}.pem")
    try:
        # O_EXCL: never overwrite a key someone may still sign with.
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"keys new: {out} exists; choose another --out", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing directory, no permission: one line, not a traceback
        print(
            f"keys new: cannot create {out}: {exc.strerror}; choose another --out", file=sys.stderr
        )
        return 2
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    print(json.dumps(entry, indent=2))
    print(
        f"# private key written to {out} (mode 600): give it to {identity} as "
        f"SAGALINE_SIGNING_KEY; merge the entry above into the trust file",
        file=sys.stderr,
    )
    return 0


def _cmd_password(args: argparse.Namespace) -> int:
    from services.dashboard.auth import hash_password

    if args.operator != args.operator.strip() or not args.operator.strip():
        print(
            f"keys password: the name {args.operator!r} is blank or begins or ends with "
            "whitespace: the dashboard strips a typed name, so it could never log in",
            file=sys.stderr,
        )
        return 2
    if sys.stdin.isatty():
        import getpass

        password = getpass.getpass(f"password for {args.operator}: ")
    else:
        password = sys.stdin.readline().rstrip("\n")
    if len(password) < 12:
        print("keys password: use at least 12 characters", file=sys.stderr)
        return 2
    print(json.dumps({args.operator: hash_password(password)}))
    return 0


def register(subparsers: Any) -> None:
    keys = subparsers.add_parser("keys", help="identity keys for signing records")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    new = keys_sub.add_parser("new", help="a new Ed25519 key pair and its trust entry")
    new.add_argument("identity", help="who signs: a participant name, an operator, ...")
    new.add_argument("--role", required=True, choices=[r.value for r in Role])
    new.add_argument("--key-id", help="default: IDENTITY.<12 hex of the public key>")
    new.add_argument("--tenants", help="comma-separated tenants it may act for (default: all)")
    new.add_argument("--principals", help="agents: principals it may start sagas for")
    new.add_argument("--out", help="private key file (default: KEY_ID.pem)")
    new.set_defaults(func=_cmd_new)
    password = keys_sub.add_parser(
        "password",
        help="a dashboard login: the users-file entry (scrypt hash) for a password on stdin",
    )
    password.add_argument("operator")
    password.set_defaults(func=_cmd_password)
