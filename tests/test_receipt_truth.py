"""The receipt tells the truth (R14), without a broker: what the pure core puts in it,
and what the text rendering (``saga show``, the dashboard) makes of it."""

from __future__ import annotations

from coordinator_ledger import fresh, incidents, receipt_of

from sagaline.ops.actions import incident_resolved
from schemas import SagaOutcome


def test_an_unknown_outcome_settled_by_a_person_names_them_on_every_incident_R11_R14() -> None:
    """A new generation asked again about the unknown step; carol settles the new
    incident COMMITTED. The old incident is resolved with it: by carol, not "observed in
    the ledger" (nothing in the ledger but carol's word says it committed)."""
    ledger, h = fresh()
    h.feed(ledger.started(), ledger.scheduled("pay"))
    [first] = incidents(h.feed(ledger.unknown("pay")))
    ledger.generation = 2
    [again] = incidents(h.feed(ledger.started()))
    h.feed(incident_resolved(again, operator="carol", resolution="COMMITTED", now=h.now))
    receipt = receipt_of(h.feed(ledger.end(SagaOutcome.COMPLETE)))
    resolutions = {i.incident_id: i.resolution for i in receipt.incidents}
    assert resolutions == {
        first.incident_id: "COMMITTED (by carol)",
        again.incident_id: "COMMITTED (by carol)",
    }
