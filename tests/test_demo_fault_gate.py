"""The demo's fault schedule holds agents back so every fault lands mid-run."""

from __future__ import annotations

import threading

from services.demo import FaultGate


def _start(gate: FaultGate, index: int) -> threading.Thread:
    thread = threading.Thread(target=gate, args=(index,), daemon=True)
    thread.start()
    return thread


def test_sagas_up_to_after_plus_concurrency_start_without_waiting() -> None:
    gate = FaultGate([5], concurrency=2)
    for index in range(7):  # 0..6: fewer than 5 + 2 sagas before them
        gate(index)  # returns at once (a hang fails the test by its timeout)


def test_a_later_saga_waits_until_the_fault_has_fired() -> None:
    gate = FaultGate([5, 9], concurrency=2)
    held = _start(gate, 7)
    held.join(0.2)
    assert held.is_alive(), "saga 7 started before the fault due after 5 terminal sagas"
    gate.fired()
    held.join(30)
    assert not held.is_alive()
    later = _start(gate, 11)  # also needs the fault due after 9
    later.join(0.2)
    assert later.is_alive()
    gate.open()  # the injector ended (all applied, or it gave up): nobody waits
    later.join(30)
    assert not later.is_alive()
