"""Exit instead of hanging forever in a Kafka call that ignores its timeout.

librdkafka's ``send_offsets_to_transaction()`` can block past its timeout for good
when the group coordinator broker goes away mid-transaction and comes back (seen
here with librdkafka 2.16 after a ``kill -9`` of the broker; upstream
confluentinc/librdkafka#5456 and #5511). A coordinator stuck there holds its
partitions and finishes no saga. The cure is crash-only: past the call's own
timeout plus a margin, the process exits with :data:`EXIT_WEDGED` and its
supervisor starts it again (compose ``restart: unless-stopped``, a Kubernetes
Deployment); the new incarnation's ``init_transactions`` fences the old
transaction and the batch is re-decided from the committed offsets (R5).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["EXIT_WEDGED", "WEDGE_MARGIN_S", "deadline"]

EXIT_WEDGED = 70
"""Exit status of a process that gave up on a hung Kafka call (EX_SOFTWARE)."""

WEDGE_MARGIN_S = 30.0

log = logging.getLogger("sagaline.coordinator")


def _exit(what: str, seconds: float) -> None:
    log.critical(
        "%s did not return within %.0f s (librdkafka ignores its timeout here); exiting "
        "with status %d so that the supervisor restarts this instance",
        what,
        seconds,
        EXIT_WEDGED,
    )
    logging.shutdown()
    os._exit(EXIT_WEDGED)


class _Watchdog:
    """The calls in progress and when each gives up, checked by one daemon thread.

    A timer thread per call (``threading.Timer``) would be cheap in C but not here: the
    caller waits for each new thread to take the GIL, which a busy loop on another
    thread holds for up to the interpreter's switch interval (5 ms), several times a
    call. Entries are plain dict operations (atomic under the GIL), so arming and
    disarming never waits on this thread either."""

    _POLL_S = 1.0  # a wedge is noticed within a second of its limit

    def __init__(self) -> None:
        self._armed: dict[int, tuple[float, str, float, Callable[[str, float], None]]] = {}
        self._ids = itertools.count()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, what: str, limit_s: float, on_wedged: Callable[[str, float], None]) -> int:
        token = next(self._ids)
        self._armed[token] = (time.monotonic() + limit_s, what, limit_s, on_wedged)
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._watch, name="sagaline-watchdog", daemon=True
                    )
                    self._thread.start()
        return token

    def disarm(self, token: int) -> None:
        self._armed.pop(token, None)

    def armed(self) -> int:
        return len(self._armed)

    def _watch(self) -> None:
        while True:
            now = time.monotonic()
            for token, (at, what, limit_s, on_wedged) in list(self._armed.items()):
                if at <= now and self._armed.pop(token, None) is not None:
                    on_wedged(what, limit_s)
            soonest = min((entry[0] for entry in list(self._armed.values())), default=None)
            wait_s = self._POLL_S if soonest is None else soonest - time.monotonic()
            time.sleep(min(self._POLL_S, max(0.001, wait_s)))


_WATCHDOG = _Watchdog()


@contextmanager
def deadline(
    what: str,
    timeout_s: float,
    *,
    margin_s: float = WEDGE_MARGIN_S,
    on_wedged: Callable[[str, float], None] = _exit,
) -> Iterator[None]:
    """Run the block; if it is still running ``timeout_s`` + ``margin_s`` later, call
    ``on_wedged`` (by default: exit the process with :data:`EXIT_WEDGED`), from the
    watchdog thread."""
    token = _WATCHDOG.arm(what, timeout_s + margin_s, on_wedged)
    try:
        yield
    finally:
        _WATCHDOG.disarm(token)
