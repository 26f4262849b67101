"""Operator and observability layer: what people and dashboards use on top of the
coordinator and the participants.

* :mod:`sagaline.ops.actions`: an operator's approve / deny / resolve as signed
  records on the ledger, each acknowledged (the CLI's and the dashboard's one path).
* :mod:`sagaline.ops.receipts`: receipts as a person reads them (text and HTML).
* :mod:`sagaline.ops.metrics`: the Prometheus metrics of every component, derived from
  the ledger; what is application-specific (the economic effect of a tool call) is
  passed in by the deployable, never known here.

Example::

    from sagaline.ops import CoordinatorMetrics, OperatorChannel, grant_approval

    metrics = CoordinatorMetrics(effect=my_effect_measure)
    coordinator = Coordinator(settings, bootstrap, metrics=metrics)
    grant_approval(OperatorChannel.from_settings(settings), request, operator="alice")

It imports the transport, the contract and nothing above it; the coordinator and the
participant runtime accept its metrics through their own small protocols.
"""

from sagaline.ops.actions import (
    MissingOperatorIdentity,
    OperatorActionError,
    OperatorChannel,
    UnknownRequest,
    approval_denied,
    approval_granted,
    deny_approval,
    find_approval_request,
    find_incident,
    grant_approval,
    incident_resolved,
    resolve_incident,
)
from sagaline.ops.metrics import (
    CoordinatorMetrics,
    EffectMeasure,
    MeasuresSnapshot,
    ParticipantMetrics,
    SagalineMetrics,
    start_metrics_server,
)
from sagaline.ops.receipts import (
    describe_receipt,
    format_duration,
    format_ms,
    later_resolutions,
    render_receipt_html,
    render_receipt_text,
)

__all__ = [
    "CoordinatorMetrics",
    "EffectMeasure",
    "MeasuresSnapshot",
    "MissingOperatorIdentity",
    "OperatorActionError",
    "OperatorChannel",
    "ParticipantMetrics",
    "SagalineMetrics",
    "UnknownRequest",
    "approval_denied",
    "approval_granted",
    "deny_approval",
    "describe_receipt",
    "find_approval_request",
    "find_incident",
    "format_duration",
    "format_ms",
    "grant_approval",
    "incident_resolved",
    "later_resolutions",
    "render_receipt_html",
    "render_receipt_text",
    "resolve_incident",
    "start_metrics_server",
]
