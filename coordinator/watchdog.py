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

import logging
import os
import threading
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


@contextmanager
def deadline(
    what: str,
    timeout_s: float,
    *,
    margin_s: float = WEDGE_MARGIN_S,
    on_wedged: Callable[[str, float], None] = _exit,
) -> Iterator[None]:
    """Run the block; if it is still running ``timeout_s`` + ``margin_s`` later, call
    ``on_wedged`` (by default: exit the process with :data:`EXIT_WEDGED`)."""
    limit = timeout_s + margin_s
    timer = threading.Timer(limit, on_wedged, args=(what, limit))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
