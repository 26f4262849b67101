"""The coordinator's way out of a Kafka call that ignores its timeout (see
coordinator/watchdog.py): past the timeout plus a margin, the wedge handler runs
(in production it exits the process, which its supervisor restarts)."""

from __future__ import annotations

import threading

from coordinator.watchdog import _WATCHDOG, EXIT_WEDGED, deadline


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
    before = _WATCHDOG.armed()
    with deadline("x", 3600.0, on_wedged=lambda what, _s: calls.append(what)):
        assert _WATCHDOG.armed() == before + 1
    assert _WATCHDOG.armed() == before, "the watchdog was not disarmed"
    assert calls == [] and EXIT_WEDGED == 70


def test_blocks_start_no_thread_of_their_own() -> None:
    """One watchdog thread for every call: a thread per call would make the caller
    wait for it to take the GIL (the coordinator's commit thread, several times a
    batch, while the loop decides)."""
    with deadline("warm-up", 3600.0):
        pass
    threads = threading.active_count()
    for n in range(50):
        with deadline(f"call {n}", 3600.0):
            assert threading.active_count() == threads
    assert [t.name for t in threading.enumerate()].count("sagaline-watchdog") == 1
