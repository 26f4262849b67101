"""Under load a batch with outputs lingers (``coordinator.shell._LINGER_S``): while it
holds records of at least two sagas it is carried into the next batch's transaction,
so one transaction (one changelog record per saga, one set of offsets) takes what
several commit round trips would have. Nothing of it is committed before then, so a
coordinator that dies holding it loses nothing and its successor sends every command
once (exactly-once, as for any batch). A lone saga's outputs are never held: its
next record waits on them. Run on both transports.

The windows are an hour here, so no test depends on how fast the machine is: what
ends a held batch is the batch size, or a successor."""

from __future__ import annotations

import time

from coordinator_ledger import Ledger

from coordinator.shell import Coordinator
from schemas.settings import Settings
from tests.coordinator_turns import append, executes, one_saga, turn_until
from tests.test_coordinator_carry import _changelog, _committed

HOUR_MS = 3_600_000


def _holds(coordinator: Coordinator, records: int) -> bool:
    """The coordinator carries ``records`` records, nothing of them committed."""
    carry = coordinator._carry
    return carry is not None and sum(len(s) for s in carry.sources.values()) == records


def test_a_lone_sagas_outputs_are_never_held(transport: str, unique_prefix: str) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, "saga-lone")
    one = Coordinator(settings, transport, instance_id="lone-1", carry_ms=0, linger_ms=HOUR_MS)
    one._join()
    append(settings, transport, ledger.started(), first)

    def sent() -> bool:
        assert one._carry is None, "a lone saga's batch was held"
        return executes(settings, transport, participant) == ["reserve"]

    turn_until(one, sent)
    one._consumer.close()


def test_a_batch_of_several_sagas_lingers_into_one_transaction(
    transport: str, unique_prefix: str
) -> None:
    settings, b, participant, group, one = _two_sagas_held(transport, unique_prefix, 4)
    turn_until(one, lambda: _holds(one, 3) or one._committing is not None)
    assert one._carry is not None and one._lingering, "the batch was not held"
    assert executes(settings, transport, participant) == []
    assert _committed(settings, transport, group) == 0

    # The fourth record fills the batch: one transaction for all four.
    append(settings, transport, b.scheduled("reserve"))
    turn_until(one, lambda: one._carry is None and one.state_of("saga-b") is not None)
    one._settle()
    assert executes(settings, transport, participant) == ["reserve", "reserve"]
    assert _committed(settings, transport, group) == 4
    # One changelog record per saga for the transaction, not one per batch.
    assert _changelog(settings, transport, "saga-a") == 1
    assert _changelog(settings, transport, "saga-b") == 1
    one._consumer.close()


def test_a_coordinator_that_dies_holding_a_lingering_batch_loses_nothing(
    transport: str, unique_prefix: str
) -> None:
    settings, b, participant, group, one = _two_sagas_held(transport, unique_prefix)
    turn_until(one, lambda: _holds(one, 3) or one._committing is not None)
    assert _holds(one, 3), "the batch was not held"
    one._consumer.close()  # dies holding it: no transaction was begun for it
    assert _committed(settings, transport, group) == 0
    assert executes(settings, transport, participant) == []

    two = Coordinator(settings, transport, instance_id="linger-1", carry_ms=0, linger_ms=0)
    two._join()
    append(settings, transport, b.scheduled("reserve"))
    turn_until(two, lambda: _committed(settings, transport, group) == 4)
    assert executes(settings, transport, participant) == ["reserve", "reserve"]
    two._consumer.close()


def _two_sagas_held(
    transport: str, unique_prefix: str, batch_size: int = 500
) -> tuple[Settings, Ledger, str, str, Coordinator]:
    """A coordinator that lingers (an hour) and three records on its ledger: saga-b's
    start changes state only (carried); saga-a's step is an output, held because the
    batch then holds two sagas. Returns saga-b's ledger for more records."""
    settings, a, first_a, participant = one_saga(transport, unique_prefix, "saga-a")
    b = Ledger(saga_id="saga-b", t0=int(time.time() * 1000))
    one = Coordinator(
        settings,
        transport,
        instance_id="linger-1",
        carry_ms=HOUR_MS,
        linger_ms=HOUR_MS,
        batch_size=batch_size,
    )
    one._join()
    append(settings, transport, b.started(), a.started(), first_a)
    return settings, b, participant, f"{unique_prefix}sagaline-coordinator", one
