"""A first saga: reserve a seat, charge the card; the charge is declined, so the seat
is released. With a broker configured (``docs/quickstart.md``)::

    python examples/first_saga.py
"""

# --- Your existing code: two actions and their undos. Nothing Sagaline here. ---
SEATS: set[str] = set()


def reserve_seat(flight: str) -> str:
    """Reserve a seat on a flight; returns the reservation id."""
    SEATS.add(f"r-{flight}")
    return f"r-{flight}"


def release_seat(reservation_id: str) -> None:
    SEATS.discard(reservation_id)


def charge_card(amount: int) -> str:
    """Charge the traveller's card; returns the charge id."""
    if amount > 500:
        raise ValueError(f"card declined for {amount}")  # a rejection: not retried
    return f"ch-{amount}"


def refund_card(charge_id: str) -> None:
    print(f"refunded {charge_id}")


# --- Sagaline: ten lines. ---
from contextlib import suppress  # noqa: E402

import sagaline  # noqa: E402

sagaline.compensable(by=release_seat, args=lambda c: {"reservation_id": c.result})(reserve_seat)
sagaline.compensable(by=refund_card, args=lambda c: {"charge_id": c.result})(charge_card)
with sagaline.connect(reserve_seat, charge_card, name="trip", coordinator=True) as client:
    with suppress(sagaline.SagaCallError), client.saga("trip", principal="me") as saga:
        saga.call(reserve_seat, flight="LX38")
        saga.call(charge_card, amount=900)
    receipt = saga.wait()
print(receipt.status, [(s.tool, s.disposition.value) for s in receipt.steps], "held:", SEATS)
