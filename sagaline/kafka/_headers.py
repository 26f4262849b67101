"""A consumed message's headers, read without crashing on names that are not UTF-8.

Kafka does not check header names; confluent-kafka turns each into a ``str``. For a
name that is not UTF-8, ``Message.headers()`` raises ``SystemError`` (from a
``UnicodeDecodeError``) and keeps the half-built list on the message: a second
``headers()`` returns it, and touching its bad entry crashes the interpreter
(SIGSEGV). So consumers read headers through :func:`headers_of` once: it turns that
failure into a :class:`~schemas.errors.MalformedRecord` (to the DLQ with reason
``malformed``) and clears the message's headers, so later reads (the DLQ copy) get
``None`` instead of the broken list.
"""

from __future__ import annotations

import operator
from typing import Any

from schemas.errors import MalformedRecord
from schemas.signing import HeaderList

# Called through methodcaller, never as ``msg.headers()``: once that call site is hot,
# CPython (3.11+) specializes it and no longer checks a C method's result, so the
# failure goes unnoticed (the broken list is returned, its exception left pending to
# surface at some later, unrelated call). The generic call path always checks.
_HEADERS = operator.methodcaller("headers")


def headers_of(msg: Any) -> HeaderList | None:
    """``msg.headers()``; :class:`MalformedRecord` when they cannot be read."""
    try:
        headers: HeaderList | None = _HEADERS(msg)
    except (SystemError, UnicodeDecodeError) as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        msg.set_headers(None)  # never hand the half-built list out again
        raise MalformedRecord(
            f"its headers cannot be read: a header name is not UTF-8 ({cause}); "
            "the DLQ copy keeps its key and value, not its headers"
        ) from None
    return headers


def readable_headers(msg: Any) -> HeaderList | None:
    """:func:`headers_of`, or ``None`` when they cannot be read (for a DLQ copy)."""
    try:
        return headers_of(msg)
    except MalformedRecord:
        return None


__all__ = ["headers_of", "readable_headers"]
