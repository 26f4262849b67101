"""The published catalogue: what participants put on ``sagaline.catalogue``, folded.

Each participant runtime publishes, as it starts, one entry per tool it serves::

    key   "<participant>/<tool>"   (a participant name has no "/", a tool name neither)
    value {"participant", "contract", "definition", "secret_paths"} as JSON

and the same entry under the bare tool name, the key earlier versions used (so their
agents still find the tool). The topic has one partition and is compacted, so the
last record of a key in offset order is its current value, and a tombstone (a null
value) deletes the key. Keys per participant let every participant's declaration of
a tool survive compaction: two participants serving one tool name stay visible as
two, instead of whichever restarted last silently taking every call.

Folding, per tool: the live ``participant/tool`` entries; plus the bare-name entry
when its participant has no ``participant/tool`` key of that tool (live or
tombstoned), i.e. was published by a participant of an earlier version. More than
one participant left: the tool is ambiguous.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas import StepContract

SEPARATOR = "/"


def entry_key(participant: str, tool: str) -> bytes:
    """The key of ``participant``'s entry for ``tool``."""
    return f"{participant}{SEPARATOR}{tool}".encode()


@dataclass(frozen=True)
class Entry:
    """One participant's current declaration of one tool, as published."""

    participant: str
    contract: StepContract
    secret_paths: tuple[str, ...]


@dataclass
class Published:
    """The catalogue topic folded: per tool, the participants declaring it."""

    tools: dict[str, dict[str, Entry]] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    """Tools with an entry that cannot be read and may be a current declaration, with
    why (refused, never replaced by an older entry)."""
    skipped: dict[str, list[str]] = field(default_factory=dict)
    """Per tool, the keys of unreadable entries left out because a readable declaration
    of the tool was published after them (e.g. a stale key of a participant that no
    longer exists): to report, and to tombstone."""
    latest: dict[str, bytes | None] = field(default_factory=dict)
    """The current value of every key (None: tombstoned)."""

    def owners(self, tool: str) -> list[str]:
        return sorted(self.tools.get(tool, {}))


def fold(
    records: Iterable[tuple[bytes | None, bytes | None]],
    refused: Mapping[str, str] | None = None,
) -> Published:
    """Fold (key, value) records of the catalogue topic, in offset order.

    ``refused``: keys whose current value must not be believed, with why (with
    identities, not signed by the participant it belongs to): read as unreadable, so
    its tool is refused rather than taken from it. An entry under a
    ``participant/tool`` key that names another participant is unreadable too."""
    refused = refused or {}
    out = Published()
    at: dict[str, int] = {}  # key -> position of its current value
    for position, (raw_key, raw_value) in enumerate(records):
        if raw_key is not None:
            key = raw_key.decode("utf-8", "replace")
            out.latest.pop(key, None)  # keep offset order in the dict too
            out.latest[key] = raw_value
            at[key] = position
    qualified: dict[str, set[str]] = {}  # tool -> participants with a key (live or not)
    for key in out.latest:
        participant, sep, tool = key.partition(SEPARATOR)
        if sep:
            qualified.setdefault(tool, set()).add(participant)
    unreadable: dict[str, list[tuple[int, str, str]]] = {}  # tool -> (position, key, why)
    readable_at: dict[str, int] = {}  # tool -> position of its first readable entry
    for key, value in out.latest.items():
        if value is None:
            continue
        _owner, sep, tool = key.partition(SEPARATOR)
        if not sep:
            tool = key
            if named_participant(value) in qualified.get(tool, ()):
                continue  # a newer version of this participant publishes per participant
        try:
            if key in refused:
                raise PermissionError(refused[key])
            entry = _entry(value)
            if sep and entry.participant != _owner:
                raise PermissionError(
                    f"names participant {entry.participant!r} under {_owner!r}'s key"
                )
            # A call of the key's tool is scheduled as its contract says: a contract
            # of another tool or participant would send it elsewhere.
            if entry.contract.tool != tool:
                raise PermissionError(
                    f"holds the contract of tool {entry.contract.tool!r} under {tool!r}"
                )
            if entry.contract.participant != entry.participant:
                raise PermissionError(
                    f"holds a contract of participant {entry.contract.participant!r}"
                    f" in {entry.participant!r}'s entry"
                )
        except (ValueError, TypeError, KeyError, AttributeError, PermissionError) as exc:
            why = f"{type(exc).__name__}: {exc}"[:300]
            unreadable.setdefault(tool, []).append((at[key], key, why))
            continue
        if not sep and entry.participant in qualified.get(tool, ()):
            continue  # a newer version of this participant publishes per participant
        out.tools.setdefault(tool, {})[entry.participant] = entry
        readable_at.setdefault(tool, at[key])
    for tool, bad in unreadable.items():
        # Skipped only when older than every readable declaration of the tool: one
        # published after may be a redeclaration (e.g. now IRREVERSIBLE, in a form
        # this version cannot read) or the tool moved, so it is refused, not guessed.
        first_readable = readable_at.get(tool)
        if first_readable is not None and all(p < first_readable for p, _k, _w in bad):
            out.skipped[tool] = [f"{k} ({why})" for _p, k, why in bad]
        else:
            out.unreadable[tool] = bad[-1][2]
    return out


def named_participant(value: bytes) -> str | None:
    """The participant an entry names, read from the raw JSON (None if it cannot be)."""
    try:
        raw: Any = orjson.loads(value)
    except ValueError:
        return None
    participant = raw.get("participant") if isinstance(raw, dict) else None
    return participant if isinstance(participant, str) else None


def _entry(value: bytes) -> Entry:
    raw: Any = orjson.loads(value)
    contract = StepContract.model_validate(raw["contract"])
    participant = raw.get("participant") or contract.participant
    if not isinstance(participant, str):
        raise TypeError(f"participant {participant!r} is not a name")
    # Absent in entries of earlier versions: none. Anything but a list of names is
    # refused: a string would be read as one path per letter, its secret in clear.
    paths = raw.get("secret_paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise TypeError(f"secret_paths {str(paths)[:80]!r} is not a list of argument paths")
    return Entry(participant, contract, tuple(paths))


def publishers(published: Published) -> set[str]:
    """The participants that still publish at least one tool: the live entries as
    :func:`fold` reads them (a bare-name entry only where its participant has no
    ``participant/tool`` key of that tool). An entry whose contract this version cannot
    read still names its participant, taken from the raw JSON."""
    qualified = {key for key in published.latest if SEPARATOR in key}
    found: set[str] = set()
    for key, value in published.latest.items():
        if value is None:
            continue
        try:
            raw: Any = orjson.loads(value)
        except ValueError:
            continue
        participant = raw.get("participant") if isinstance(raw, dict) else None
        if not isinstance(participant, str):
            continue
        if SEPARATOR not in key and f"{participant}{SEPARATOR}{key}" in qualified:
            continue  # superseded by that participant's own key (live or withdrawn)
        found.add(participant)
    return found


def stale_keys(published: Published, participant: str, serves: Iterable[str]) -> list[bytes]:
    """The keys ``participant`` published for tools it no longer serves: to tombstone
    as it starts, so a tool it dropped (or gave to another participant) is not
    declared by it any more. A bare-name entry counts when it names this participant
    (read from the raw JSON, so also when its contract cannot be read)."""
    served = set(serves)
    out: list[bytes] = []
    for key, value in published.latest.items():
        if value is None:
            continue
        owner, sep, tool = key.partition(SEPARATOR)
        if sep:
            if owner == participant and tool not in served:
                out.append(key.encode())
            continue
        if key in served:
            continue
        # Read from the raw JSON, as fold() does: an entry whose contract this
        # version cannot read (a newer participant's) still names its participant.
        named = named_participant(value)
        if named is None:
            try:
                named = _entry(value).participant  # named in its contract only
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
        if named == participant:
            out.append(key.encode())
    return out


__all__ = ["SEPARATOR", "Entry", "Published", "entry_key", "fold", "publishers", "stale_keys"]
