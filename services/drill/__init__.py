"""The fault drill: run a plan against your own tools with a fault at every seam.

Seed 004 asks that every step be tested with a failure before dispatch, after
dispatch but before the receipt, after commit, during the ledger append, during the
compensation and after it but before its acknowledgement; plus duplicates, stale
generations, concurrent cancellation, expired approval, provider throttling and a
partial outage; and that the ledger and the external state be asserted together.
``run_drill`` does that on the real broker for any catalogue, wrapping the tools
generically (their code is not changed), and judges each case through the tools'
own ``lookup`` and ``verify``::

    from services.drill import run_drill
    report = run_drill([wrap(Shop(), name="shop")],
                       [{"tool": "reserve", "args": {"sku": "a"}},
                        {"tool": "charge", "args": {"amount": 5}}],
                       bootstrap="127.0.0.1:9092", state_dir=tmp_path)
    print(report.matrix()); assert report.ok

From the shell: ``sagaline drill --catalogue MODULE:ATTR --plan plan.json``.
"""

from services.drill._inject import DrillFault, FaultBoard, ProviderThrottled, Seam, instrument
from services.drill._run import CaseResult, DrillReport, Verdict, run_drill

__all__ = [
    "CaseResult",
    "DrillFault",
    "DrillReport",
    "FaultBoard",
    "ProviderThrottled",
    "Seam",
    "Verdict",
    "instrument",
    "run_drill",
]
