"""Delivery reports reach an event loop in bursts: one wake-up of the loop for all
the reports that came while it had not run yet, and every awaiting future settled."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

from sagaline.kafka._writers import _Inbox


def test_reports_that_arrive_together_wake_the_loop_once_and_settle_every_future() -> None:
    loop = asyncio.new_event_loop()
    wakes: list[Any] = []
    real = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any) -> Any:
        wakes.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    try:
        inbox = _Inbox(loop)
        futures = [loop.create_future() for _ in range(100)]
        errors: list[Any] = [None if i % 10 else f"error {i}" for i in range(100)]

        def serve_reports() -> None:  # a burst, while the loop is busy elsewhere
            for future, error in zip(futures, errors, strict=True):
                inbox.put(future, error)

        poller = threading.Thread(target=serve_reports)
        poller.start()
        poller.join()
        assert len(wakes) == 1
        results = loop.run_until_complete(asyncio.gather(*futures))
        assert results == errors
        inbox.put(loop.create_future(), None)  # after the drain, the next report wakes it again
        assert len(wakes) == 2
    finally:
        loop.close()


def test_a_report_for_a_closed_loop_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    inbox = _Inbox(loop)
    future = loop.create_future()
    loop.close()
    inbox.put(future, None)  # the poller thread must not die of it
    assert not future.done()


def test_an_inbox_does_not_keep_its_loop_alive() -> None:
    # the writer keeps one inbox per loop in a WeakKeyDictionary keyed by the loop
    inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = (
        weakref.WeakKeyDictionary()
    )
    loop = asyncio.new_event_loop()
    inboxes[loop] = _Inbox(loop)
    gone = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert gone() is None
    assert len(inboxes) == 0
