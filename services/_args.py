"""Argument types the `sagaline` sub-commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``; anything else is a
    usage error that says what was given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return parse
