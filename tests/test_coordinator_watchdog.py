"""The coordinator's way out of a Kafka call that ignores its timeout (see
coordinator/watchdog.py): past the timeout plus a margin, the wedge handler runs
(in production it exits the process, which its supervisor restarts)."""

from __future__ import annotations

import threading

from coordinator.watchdog import EXIT_WEDGED, deadline


def test_a_block_that_outlives_its_deadline_triggers_the_wedge_handler() -> None:
    fired: list[tuple[str, float]] = []
    wedged = threading.Event()

    def on_wedged(what: str, seconds: float) -> None:
        fired.append((what, seconds))
        wedged.set()

    with deadline("send_offsets_to_transaction", 0.0, margin_s=0.05, on_wedged=on_wedged):
        assert wedged.wait(30), "the wedge handler never ran"  # the block "hangs" until then
    assert fired == [("send_offsets_to_transaction", 0.05)]


def test_a_block_that_returns_cancels_its_watchdog() -> None:
    calls: list[str] = []
    with deadline("x", 3600.0, on_wedged=lambda what, _s: calls.append(what)):
        pass
    for timer in [t for t in threading.enumerate() if isinstance(t, threading.Timer)]:
        timer.join(30)  # a cancelled timer ends at once; a live one would run for an hour
        assert not timer.is_alive(), "the watchdog was not cancelled"
    assert calls == [] and EXIT_WEDGED == 70
