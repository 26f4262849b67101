"""Argument types the `sagaline` sub-commands share."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from schemas.settings import Settings


class FromEnv(str):
    """A default read from an environment variable: a bad one is a usage error of the
    option it stands for, and the message names the variable, since the person never
    typed the option."""

    variable: str

    def __new__(cls, value: str, variable: str) -> FromEnv:
        text = super().__new__(cls, value)
        text.variable = variable
        return text


def got(text: str, shown: object | None = None) -> str:
    """``got 'x'`` for a usage error, plus where the value came from when it was the
    environment's (``shown``: the value as parsed, when that reads better)."""
    said = f"got {text!r}" if shown is None else f"got {shown}"
    if isinstance(text, FromEnv):
        said += f" from ${text.variable}"
    return said


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``; anything else is a
    usage error that says what was given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, {got(text)}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, {got(text, value)}"
            )
        return value

    return parse


def between(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``minimum`` to ``maximum``; anything else
    is a usage error that says what was given and the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"expected a whole number between {minimum} and {maximum}, {got(text)}"
            )
        return value

    return parse


def instance_id(text: str) -> str:
    """An argparse type: an instance id, not empty or blank (an empty one, e.g.
    ``--instance-id "$ID"`` with ID unset, gave every such instance the same
    transactional id or static member, so they fenced each other)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a non-empty id, distinct per instance, {got(text)}"
        )
    return text


def env_default(*names: str) -> str | None:
    """The first of these environment variables that is set and not blank, else None:
    an empty variable (``${VAR:-}`` in compose, ``HOSTNAME=``) counts as unset. The
    value is a :class:`FromEnv`, so a bad one is blamed on its variable."""
    for name in names:
        value = os.environ.get(name, "")
        if value.strip():
            return FromEnv(value, name)
    return None


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (0: the server is off, or any free
    port, as the option says); anything else is a usage error, not a traceback from
    the server's bind."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port (0-65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port (0-65535), got {value}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, positive and finite (0, a negative
    number, ``nan`` or ``inf`` would make a wait end at once, never, or crash deep in
    the client); anything else is a usage error that says what was given."""
    value = _finite(text, "a number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    """As :func:`seconds`, but 0 is allowed: a wait that only looks once."""
    value = _finite(text, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {text!r}")
    return value


def _finite(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds ({what}), got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected seconds ({what}), got {text!r}")
    return value


def unusable_participant(settings: Settings, participants: list[str]) -> str | None:
    """Why one of ``--participants`` cannot name a command topic (characters a topic
    name cannot hold, too long with the prefix), else None: checked before any topic
    is made, one line rather than a traceback."""
    for participant in participants:
        try:
            settings.topics.commands(participant)
        except ValueError as exc:
            return f"--participants: {exc}; use letters, digits, '.', '_' or '-'"
    return None
