"""The dashboard's pages: a small Starlette app over a :class:`DashboardState`.

Server-rendered HTML; live regions (``data-live``) re-fetch their fragment every two
seconds with a few lines of vanilla JS, and skip the swap while an operator is typing
in them. Approve / deny / resolve go through :mod:`sagaline.ops.actions`, the
same path as the CLI: a record on ``sagaline.events``, never a side door into a
service. With logins configured (:mod:`services.dashboard.auth`) the approver is the
logged-in operator and every action carries the session's CSRF token; without, the
form asks for a name (development mode, said on every page).
"""

from __future__ import annotations

import html
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sagaline.kafka import KafkaError, KafkaException
from sagaline.ops import actions as operator_actions
from sagaline.ops.metrics import HistogramSummary, MeasuresSnapshot
from sagaline.ops.receipts import format_duration, format_ms, render_receipt_html
from schemas.models import ApprovalRequested, IncidentRaised
from schemas.trust import IdentitySigner
from services.dashboard.auth import SESSION_COOKIE, OperatorAuth
from services.dashboard.consumer import LedgerFollower
from services.dashboard.timeline import render_timeline_svg
from services.dashboard.view import (
    DashboardState,
    SagaFilter,
    SagaStatus,
    SagaView,
    UncountedDecision,
)

_e = html.escape
log = logging.getLogger("sagaline.dashboard")

# After a decision: the record is on Kafka, but another operator may have decided the
# same request a moment earlier; the coordinator counts the first (R7, R11).
_FIRST_COUNTS = (
    ": recorded on Kafka. The first decision counts: if someone decided it a moment "
    "earlier, the saga page lists this one as not counted or refused."
)

_STATUS_COLOUR = {
    SagaStatus.RUNNING: "#1565c0",
    SagaStatus.AWAITING_APPROVAL: "#f9a825",
    SagaStatus.UNKNOWN_OUTCOME: "#6a1b9a",
    SagaStatus.COMPENSATING: "#ef6c00",
    SagaStatus.COMPLETED: "#2e7d32",
    SagaStatus.COMPENSATED: "#00838f",
    SagaStatus.ESCALATED: "#c62828",
}

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#212121;background:#f5f7f8}
header{background:#263238;color:#fff;padding:10px 20px;display:flex;gap:24px;align-items:center}
header a{color:#cfd8dc;text-decoration:none} header h1{font-size:17px;margin:0}
main{padding:16px 20px;max-width:1180px}
.card{background:#fff;border:1px solid #dde3e6;border-radius:6px;padding:12px 16px;margin:0 0 16px}
h2{font-size:16px;margin:0 0 10px} h3{font-size:14px;margin:10px 0 4px}
table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:4px 8px;
border-bottom:1px solid #eceff1;vertical-align:top} th{font-weight:600;color:#455a64}
.pill{display:inline-block;border-radius:10px;padding:1px 9px;color:#fff;font-size:12px;
white-space:nowrap}
.counts{display:flex;flex-wrap:wrap;gap:8px}
.counts a{display:block;text-decoration:none;color:#fff;border-radius:6px;padding:6px 12px;
min-width:92px}
.counts a.sel{outline:3px solid #263238}
.counts b{display:block;font-size:20px}
form.inline{display:flex;flex-wrap:wrap;gap:6px;align-items:center;margin-top:6px}
input,select,button{font:inherit;padding:3px 6px}
button{border:1px solid #90a4ae;border-radius:4px;background:#eceff1;cursor:pointer}
button.grant{background:#2e7d32;color:#fff;border-color:#1b5e20}
button.deny{background:#c62828;color:#fff;border-color:#8e0000}
.notice{background:#e8f5e9;border:1px solid #a5d6a7;padding:8px 12px;border-radius:6px;
margin-bottom:12px}
.error{background:#fdecea;border-color:#ef9a9a}
.muted{color:#78909c} code{font-size:12px}
.measures{display:grid;grid-template-columns:repeat(auto-fill,minmax(250px,1fr));gap:10px}
.measure{border:1px solid #eceff1;border-radius:6px;padding:8px 10px}
.measure h3{margin:0 0 4px;font-size:13px;color:#455a64} .measure .v{font-size:18px}
.timeline-wrap{overflow-x:auto}
.receipt .headline{font-weight:600;font-size:15px}
.receipt .section-pending h3{color:#c62828} .receipt .section-irreversible h3{color:#ad1457}
.receipt .section-undone h3{color:#00838f} .receipt table.facts{width:auto}
.receipt details{display:inline} .receipt ul.details{color:#546e7a;font-size:12px}
"""

_JS = """
(function(){
  const KEY='sagaline.operator';
  function prefill(root){
    root.querySelectorAll('input[name=operator]').forEach(function(i){
      if(!i.value){i.value=localStorage.getItem(KEY)||'';}
      i.dataset.prefill=i.value;
      i.addEventListener('change',function(){localStorage.setItem(KEY,i.value);});
    });
  }
  function busy(el){
    if(el.contains(document.activeElement)&&document.activeElement!==document.body)return true;
    return Array.from(el.querySelectorAll('input,textarea')).some(function(i){
      return i.type!=='hidden'&&i.value!==(i.dataset.prefill||'');});
  }
  async function refresh(){
    for(const el of document.querySelectorAll('[data-live]')){
      if(busy(el))continue;
      try{const r=await fetch(el.dataset.live,{cache:'no-store'});
        if(r.ok){el.innerHTML=await r.text();prefill(el);}}catch(e){}
    }
  }
  prefill(document);
  setInterval(refresh,2000);
})();
"""


@dataclass(frozen=True)
class Viewer:
    """Who is looking at a page: decides what the action forms offer."""

    auth: bool = False  # logins configured
    operator: str | None = None  # the logged-in operator
    csrf: str | None = None

    @property
    def may_act(self) -> bool:
        return not self.auth or self.operator is not None


DEV = Viewer()


def _who_html(viewer: Viewer) -> str:
    """The form's "who decides" part: a name field (development mode), the session's
    operator and CSRF token, or a link to log in."""
    if not viewer.auth:
        return (
            '<input name="operator" placeholder="your name (required)" required '
            'aria-label="operator">'
        )
    if viewer.operator is None:
        return '<a class="login" href="/login">Log in to act</a>'
    return (
        f'<input type="hidden" name="csrf" value="{_e(viewer.csrf or "")}">'
        f'<span class="as">as <b>{_e(viewer.operator)}</b></span>'
    )


def _off(viewer: Viewer) -> str:
    return "" if viewer.may_act else " disabled"


def _pill(status: SagaStatus) -> str:
    return (
        f'<span class="pill status-{status.slug}" '
        f'style="background:{_STATUS_COLOUR[status]}">{_e(status.value)}</span>'
    )


def _page(
    title: str,
    body: str,
    notice: str | None = None,
    error: bool = False,
    viewer: Viewer = DEV,
    status: int | None = None,
) -> HTMLResponse:
    note = ""
    if notice:
        note = f'<div class="notice{" error" if error else ""}" role="status">{_e(notice)}</div>'
    if not viewer.auth:
        who = '<span class="muted">development mode: actions are not authenticated</span>'
    elif viewer.operator is None:
        who = '<a href="/login">Log in</a>'
    else:
        who = (
            f'<form class="inline" method="post" action="/logout" style="margin:0">'
            f'<input type="hidden" name="csrf" value="{_e(viewer.csrf or "")}">'
            f'<span>signed in as <b id="who">{_e(viewer.operator)}</b></span> '
            '<button type="submit">Log out</button></form>'
        )
    return HTMLResponse(
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>{_e(title)} · Sagaline</title><style>{_CSS}</style></head><body>"
        '<header><h1>Sagaline · operations</h1><a href="/">Sagas</a>'
        '<a href="/#actions">Approvals &amp; incidents</a><a href="/#measures">Measures</a>'
        f'<a href="/metrics">/metrics</a>{who}</header>'
        f"<main>{note}{body}</main><script>{_JS}</script></body></html>",
        status_code=status or (400 if error else 200),
    )


def _filter_from(request: Request) -> SagaFilter:
    q = request.query_params
    status = None
    if q.get("status"):
        status = next((s for s in SagaStatus if s.slug == q["status"]), None)
    return SagaFilter(
        tenant=q.get("tenant") or None,
        workflow=q.get("workflow") or None,
        tool=q.get("tool") or None,
        status=status,
    )


def _query(flt: SagaFilter, **override: str | None) -> str:
    params = {
        "tenant": flt.tenant,
        "workflow": flt.workflow,
        "tool": flt.tool,
        "status": flt.status.slug if flt.status else None,
    }
    params.update(override)
    return urlencode({k: v for k, v in params.items() if v})


API_SAGAS_DEFAULT = 500
API_SAGAS_MAX = 5000
"""Sagas in one ``/api/state`` answer: ``limit`` (default, most) from ``offset``."""


def _query_int(request: Request, name: str, default: int, low: int, high: int | None) -> int:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        most = f" to {high}" if high is not None else " or more"
        raise ValueError(f"{name}={raw!r}: expected a whole number, {low}{most}")
    return value


def _age(ms: int, now: int) -> str:
    return format_duration(max(now - ms, 0)) + " ago"


# ----------------------------------------------------------------- fragments


def _counts_html(state: DashboardState, flt: SagaFilter) -> str:
    counts = state.counts(flt)
    links = []
    for status, n in counts.items():
        selected = " sel" if flt.status is status else ""
        target = None if flt.status is status else status.slug
        links.append(
            f'<a class="count status-{status.slug}{selected}" data-status="{status.slug}" '
            f'href="/?{_query(flt, status=target)}" style="background:{_STATUS_COLOUR[status]}">'
            f'<b class="n">{n}</b>{_e(status.value)}</a>'
        )
    return f'<div class="counts">{"".join(links)}</div>'


def _sagas_html(state: DashboardState, flt: SagaFilter, now: int) -> str:
    sagas = state.select(flt)
    if not sagas:
        return '<p class="muted">No sagas match.</p>'
    rows = []
    for s in sagas[:500]:
        tools = ", ".join(sorted(s.tools - {"?"}))
        rows.append(
            f'<tr class="saga" data-saga="{_e(s.saga_id)}" data-status="{s.status.slug}">'
            f'<td><a href="/sagas/{quote(s.saga_id)}">{_e(s.saga_id)}</a></td>'
            f"<td>{_pill(s.status)}</td><td>{_e(s.tenant_id)}</td><td>{_e(s.workflow)}</td>"
            f"<td>{_e(tools)}</td><td>{len(s.steps)}</td>"
            f"<td>{_e(_age(s.last_at, now))}</td></tr>"
        )
    more = f'<p class="muted">{len(sagas) - 500} more not shown.</p>' if len(sagas) > 500 else ""
    return (
        "<table><thead><tr><th>saga</th><th>status</th><th>tenant</th><th>workflow</th>"
        "<th>tools</th><th>steps</th><th>last activity</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{more}"
    )


def _approval_html(
    saga: SagaView, req: ApprovalRequested, now: int, back: str, viewer: Viewer = DEV
) -> str:
    step = saga.steps.get(req.step_id)
    tool = step.tool if step else "?"
    expired = req.expires_at < now
    expiry = (
        f'<b style="color:#c62828">expired {format_duration(now - req.expires_at)} ago</b>'
        if expired
        else f"expires in {format_duration(req.expires_at - now)}"
    )
    base = f"/approvals/{quote(saga.saga_id)}/{quote(req.approval_id)}"
    uncounted = [u for u in saga.uncounted_decisions if u.step_id == req.step_id]
    return (
        f'<li class="approval" data-approval="{_e(req.approval_id)}" '
        f'data-saga="{_e(saga.saga_id)}"><b>{_e(tool)}</b> '
        f"({_e(req.purpose.value.lower())}) in saga "
        f'<a href="/sagas/{quote(saga.saga_id)}">{_e(saga.saga_id)}</a> · principal '
        f"{_e(req.principal)} · scope {_e(req.scope)} · arguments "
        f"<code>{_e(req.args_fingerprint[:12])}</code> · {expiry}"
        f"{_uncounted_html(uncounted)}"
        f'<form class="inline" method="post" action="{base}/grant">'
        f'<input type="hidden" name="next" value="{_e(back)}">{_who_html(viewer)}'
        '<input name="reason" placeholder="reason (for a denial)" aria-label="reason">'
        f'<button class="grant" type="submit" id="approve-{_e(req.approval_id)}"'
        f"{' disabled' if expired else _off(viewer)}>Approve</button>"
        f'<button class="deny" type="submit" formaction="{base}/deny" '
        f'id="deny-{_e(req.approval_id)}"{_off(viewer)}>Deny</button></form></li>'
    )


def _expired_html(saga: SagaView, req: ApprovalRequested, now: int) -> str:
    """A request past its expiry: nothing to decide any more (the coordinator failed the
    step, or gave the compensation to a person), so no buttons."""
    step = saga.steps.get(req.step_id)
    return (
        f'<li class="approval expired" data-approval="{_e(req.approval_id)}" '
        f'data-saga="{_e(saga.saga_id)}"><b>{_e(step.tool if step else "?")}</b> '
        f"({_e(req.purpose.value.lower())}) in saga "
        f'<a href="/sagas/{quote(saga.saga_id)}">{_e(saga.saga_id)}</a> · '
        f"{_e(req.purpose.value.lower())} approval expired "
        f"{_e(format_duration(max(now - req.expires_at, 0)))} ago, undecided"
        f"{_uncounted_html([u for u in saga.uncounted_decisions if u.step_id == req.step_id])}"
        "</li>"
    )


def _uncounted_html(decisions: list[UncountedDecision]) -> str:
    """Decisions on the ledger the coordinator rejects (R7): the step still waits."""
    if not decisions:
        return ""
    items = "".join(
        f'<li class="uncounted">{_e(u.kind)} by {_e(u.by)} of approval '
        f"{_e(u.approval_id)} (step {_e(u.step_id)}) at {_e(format_ms(u.at))}: "
        f"<b>not counted</b> by the coordinator: {_e(u.reason)}</li>"
        for u in decisions
    )
    return f'<ul class="uncounted">{items}</ul>'


def _incident_html(saga: SagaView, inc: IncidentRaised, back: str, viewer: Viewer = DEV) -> str:
    where = f" on {', '.join(inc.resources)}" if inc.resources else ""
    if "unknown" in inc.kind.lower():
        resolution = (
            '<select name="resolution" aria-label="resolution" required>'
            '<option value="">did it happen?</option>'
            '<option value="COMMITTED">COMMITTED: the effect happened</option>'
            '<option value="NOT_FOUND">NOT_FOUND: it did not happen</option></select>'
        )
    else:
        resolution = (
            '<input name="resolution" placeholder="what you did (required)" required '
            'aria-label="resolution">'
        )
    action = f"/incidents/{quote(saga.saga_id)}/{quote(inc.incident_id)}/resolve"
    return (
        f'<li class="incident" data-incident="{_e(inc.incident_id)}">'
        f"<b>{_e(inc.kind)}</b> in saga "
        f'<a href="/sagas/{quote(saga.saga_id)}">{_e(saga.saga_id)}</a>'
        f"{' step ' + _e(inc.step_id) if inc.step_id else ''} · owner <b>{_e(inc.owner)}</b>"
        f"<br>{_e(inc.inconsistency)}{_e(where)}. Still changed: {_e(inc.effect)}."
        f'<form class="inline" method="post" action="{action}">'
        f'<input type="hidden" name="next" value="{_e(back)}">{_who_html(viewer)}{resolution}'
        '<input name="note" placeholder="note" aria-label="note">'
        f'<button type="submit" id="resolve-{_e(inc.incident_id)}"{_off(viewer)}>Resolve'
        "</button></form></li>"
    )


ACTIONS_SHOWN = 200
"""How many pending approvals, expired approvals and open incidents the overview lists
each (the oldest first; the heading counts them all): escalated sagas' incidents stay
open until a person resolves them, and the region is fetched again every two seconds
by every open page. A saga's own page lists all of its own."""


def _shown(items: list[Any], render: Callable[[Any], str]) -> tuple[str, int]:
    """The first :data:`ACTIONS_SHOWN` of ``items`` rendered, and how many more there are."""
    return "".join(render(item) for item in items[:ACTIONS_SHOWN]), max(
        len(items) - ACTIONS_SHOWN, 0
    )


def _more(hidden: int) -> str:
    if not hidden:
        return ""
    return (
        f'<p class="muted more">{hidden} more not shown (the oldest {ACTIONS_SHOWN} are): '
        "filter the sagas above and open a saga's page, or read <code>/api/state</code>.</p>"
    )


def _actions_html(
    state: DashboardState, now: int, saga_id: str | None = None, viewer: Viewer = DEV
) -> str:
    back = f"/sagas/{quote(saga_id)}" if saga_id else "/"
    pending = [
        (s, a) for s, a in state.pending_approvals() if saga_id is None or s.saga_id == saga_id
    ]
    expired = [
        (s, a) for s, a in state.expired_approvals() if saga_id is None or s.saga_id == saga_id
    ]
    open_ = [(s, i) for s, i in state.open_incidents() if saga_id is None or s.saga_id == saga_id]
    approvals, more_approvals = _shown(
        pending, lambda p: _approval_html(p[0], p[1], now, back, viewer)
    )
    lapsed, more_lapsed = _shown(expired, lambda p: _expired_html(p[0], p[1], now))
    incidents, more_incidents = _shown(open_, lambda p: _incident_html(p[0], p[1], back, viewer))
    return (
        f"<h3>Pending approvals ({len(pending)})</h3>"
        + (f'<ul class="approvals">{approvals}</ul>' if pending else "")
        + _more(more_approvals)
        + ('<p class="muted">None.</p>' if not pending else "")
        + (
            f'<h3>Expired approvals ({len(expired)})</h3><ul class="approvals">'
            f"{lapsed}</ul>{_more(more_lapsed)}"
            if expired
            else ""
        )
        + f"<h3>Open incidents ({len(open_)})</h3>"
        + (f'<ul class="incidents">{incidents}</ul>' if open_ else "")
        + _more(more_incidents)
        + ('<p class="muted">None.</p>' if not open_ else "")
    )


def _hist(h: dict[str, HistogramSummary]) -> str:
    if not h:
        return '<span class="muted">no observations</span>'
    parts = []
    for label, s in sorted(h.items()):
        mean = s.mean_seconds
        shown = format_duration(int(mean * 1000)) if mean is not None else "-"
        parts.append(f"{_e(label)}: mean {shown} over {s.count}")
    return "<br>".join(parts)


def _measures_html(m: MeasuresSnapshot, state: DashboardState) -> str:
    success = m.compensation_success_by_tool()
    comp = (
        "<br>".join(
            f"{_e(tool)}: {ok}/{total} ({100 * ok // total}%)"
            for tool, (ok, total) in sorted(success.items())
            if total
        )
        or '<span class="muted">none yet</span>'
    )
    remaining = (
        "<br>".join(
            f"{_e(t)}: {cents / 100:,.2f}"
            for t, cents in sorted(m.remaining_effect_cents.items())
            if cents
        )
        or "0.00"
    )
    manual = sum(m.manual_interventions.values())
    manual_detail = ", ".join(
        f"{k.replace('_', ' ')} {v}" for k, v in sorted(m.manual_interventions.items())
    )
    cards = [
        ("Time in unknown state (by tool)", _hist(m.time_in_unknown), "time-in-unknown"),
        ("Time to acceptable recovery", _hist(m.time_to_recovery), "time-to-recovery"),
        ("Compensation success by tool", comp, "compensation-success"),
        (
            "Duplicates prevented",
            f'<span class="v">{state.ledger_duplicates}</span> duplicate records in the ledger',
            "duplicates",
        ),
        (
            "Manual interventions",
            f'<span class="v">{manual}</span> {_e(manual_detail)}',
            "manual",
        ),
        ("Expired reversal windows", f'<span class="v">{m.expired_windows}</span>', "expired"),
        ("Remaining economic effect (by tenant)", remaining, "remaining"),
        ("Disclosure latency (failure → terminal)", _hist(m.disclosure_latency), "disclosure"),
    ]
    return (
        '<div class="measures">'
        + "".join(
            f'<div class="measure" data-measure="{key}"><h3>{_e(title)}</h3>{value}</div>'
            for title, value, key in cards
        )
        + "</div>"
    )


def _overview_fragment(state: DashboardState, flt: SagaFilter, now: int) -> str:
    return (
        f'<div class="card"><h2>Sagas by status</h2>{_counts_html(state, flt)}</div>'
        f'<div class="card"><h2>Sagas</h2>{_sagas_html(state, flt, now)}</div>'
    )


def _filter_form(state: DashboardState, flt: SagaFilter) -> str:
    facets = state.facets()
    selects = []
    for name, options in facets.items():
        current = getattr(flt, name)
        opts = [f'<option value="">any {name}</option>'] + [
            f"<option{' selected' if o == current else ''}>{_e(o)}</option>" for o in options
        ]
        selects.append(f'<select name="{name}" aria-label="{name}">{"".join(opts)}</select>')
    status = f'<input type="hidden" name="status" value="{flt.status.slug}">' if flt.status else ""
    return (
        f'<form class="inline filters" method="get" action="/">{"".join(selects)}{status}'
        '<button type="submit">Filter</button> <a href="/">clear</a></form>'
    )


def _saga_fragment(saga: SagaView, now: int, viewer: Viewer = DEV) -> str:
    facts = [
        ("status", _pill(saga.status)),
        ("tenant", _e(saga.tenant_id)),
        ("workflow", _e(saga.workflow)),
        ("principal", _e(saga.principal)),
        # The receipt's, when the ledger's start of that run is not (yet) read: a copy
        # from the terminal topic does not move the view's generation.
        ("generation", str(max(saga.generation, saga.receipt.generation if saga.receipt else 0))),
        ("started", _e(format_ms(saga.started_at))),
        ("ended", _e(format_ms(saga.terminal_at))),
        ("records", str(saga.record_count)),
    ]
    if saga.history_dropped:
        facts.append(
            (
                "history",
                "ended, and was dropped from memory by this dashboard "
                "(<code>SAGALINE_DASHBOARD_ENDED_SAGAS</code>), then brought back by an "
                "incident raised after it ended; only what came since is shown. "
                f"<code>sagaline saga show {_e(saga.saga_id)}</code> reads all of it "
                "from the ledger.",
            )
        )
    if saga.settled_incidents:
        # Settled without a person (the ledger answered them): nothing to do, but an
        # operator who saw one open learns where it went and why.
        kinds = {i: kind for i, (kind, _step) in saga.incident_labels.items()}
        listed = "".join(
            f"<li>{_e(incident_id)} ({_e(kinds.get(incident_id, '?'))}): {_e(how)}</li>"
            for incident_id, how in saga.settled_incidents.items()
        )
        facts.append(("incidents settled by the coordinator", f"<ul>{listed}</ul>"))
    if saga.refused:
        listed = "".join(f"<li>{_e(why)}</li>" for why in saga.refused)
        facts.append(("refused by the coordinator", f'<ul class="refused">{listed}</ul>'))
    rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    steps = "".join(
        f'<tr data-step="{_e(s.step_id)}"><td>{_e(s.step_id)}</td><td>{_e(s.tool)}</td>'
        f"<td>{_e(s.participant)}</td><td>{_e(s.reversibility.value.lower())}"
        f"{' · pivot' if s.pivot else ''}</td><td>{_e(s.state)}</td><td>{s.attempts}</td>"
        f"<td>{_e(s.compensation or '-')}</td></tr>"
        for s in saga.steps.values()
    )
    if saga.receipt is not None:
        # Resolutions the view counts (the coordinator's first, of the saga's tenant);
        # only those of incidents the receipt left open change what it tells.
        later = {
            incident_id: f"{r.resolution} (by {r.resolved_by})"
            for incident_id, r in saga.resolved_incidents.items()
        }
        receipt = render_receipt_html(saga.receipt, later)
    elif saga.receipt_error:
        receipt = f'<p class="notice error">{_e(saga.receipt_error)}</p>'
    elif saga.history_dropped:
        receipt = (
            '<p class="muted">Dropped from memory with the saga\'s history: '
            f"<code>sagaline saga show {_e(saga.saga_id)}</code> shows it.</p>"
        )
    else:
        receipt = '<p class="muted">No receipt yet: the saga has not ended.</p>'
    return (
        f'<div class="card"><table class="facts" style="width:auto">{rows}</table></div>'
        f'<div class="card"><h2>Timeline</h2><div class="timeline-wrap">'
        f"{render_timeline_svg(saga, now)}</div></div>"
        f'<div class="card" id="actions"><h2>Needs a person</h2>'
        f"{_actions_html_for(saga, now, viewer)}</div>"
        f'<div class="card"><h2>Receipt</h2>{receipt}</div>'
        '<div class="card"><h2>Steps</h2><table><thead><tr><th>step</th><th>tool</th>'
        "<th>participant</th><th>reversibility</th><th>state</th><th>attempts</th>"
        f"<th>compensation</th></tr></thead><tbody>{steps}</tbody></table></div>"
    )


def _actions_html_for(saga: SagaView, now: int, viewer: Viewer = DEV) -> str:
    back = f"/sagas/{quote(saga.saga_id)}"
    approvals = [
        _approval_html(saga, a, now, back, viewer)
        for a in saga.pending_approvals.values()
        if saga.terminal_status is None
    ]
    if saga.terminal_status is None:
        approvals += [_expired_html(saga, a, now) for a in saga.expired_approvals.values()]
    incidents = [_incident_html(saga, i, back, viewer) for i in saga.open_incidents.values()]
    # Decisions not counted for a step no longer waiting (shown with it otherwise).
    waiting = (
        {a.step_id for a in (*saga.pending_approvals.values(), *saga.expired_approvals.values())}
        if approvals
        else set()
    )
    uncounted = _uncounted_html([u for u in saga.uncounted_decisions if u.step_id not in waiting])
    if not approvals and not incidents and not uncounted:
        return '<p class="muted">Nothing pending.</p>'
    return (
        f'<ul class="approvals">{"".join(approvals)}</ul><ul class="incidents">'
        + "".join(incidents)
        + "</ul>"
        + uncounted
    )


# ------------------------------------------------- requests from another web site

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def cross_origin(headers: Headers) -> str | None:
    """Why a state-changing request comes from a page of another origin (CSRF), or
    None. Only browsers send ``Origin`` and ``Sec-Fetch-Site``, and no page can forge
    them, so a client without them (curl, a script) is not a cross-site request.

    ``Sec-Fetch-Site`` is the browser's own verdict and counts first (it is right
    behind a reverse proxy that rewrites ``Host`` too); without it (an older browser)
    ``Origin`` must name the host asked for (``Host``, or a proxy's
    ``X-Forwarded-Host``: a page cannot add that header to a cross-origin request)."""
    site = headers.get("sec-fetch-site", "").strip().lower()
    origin = headers.get("origin", "").strip()
    if site:
        if site in ("same-origin", "none"):
            return None
        return f"Sec-Fetch-Site: {site}" + (f", Origin: {origin}" if origin else "")
    if not origin:
        return None
    if origin == "null":
        return "Origin: null"
    asked = {headers.get("host", "").strip().lower()}
    asked.update(
        h.strip().lower() for h in headers.get("x-forwarded-host", "").split(",") if h.strip()
    )
    if urlsplit(origin).netloc.lower() not in asked - {""}:
        return f"Origin: {origin}"
    return None


def unexpected_host(headers: Headers, names: frozenset[str]) -> str | None:
    """Why ``Host`` is not a name a person uses for a development-mode dashboard, or
    None. A page whose own DNS name was re-pointed at the dashboard (DNS rebinding)
    reads and posts to it as its own origin, which no Origin check sees; its Host is
    still its own name. localhost and IP addresses cannot be rebound."""
    host = headers.get("host", "").strip()
    if not host:
        return None  # not a browser
    try:
        name = (urlsplit(f"//{host}").hostname or "").rstrip(".")
    except ValueError:
        return f"Host: {host}"
    if name == "localhost" or name.endswith(".localhost") or name in names:
        return None
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return f"Host: {host}"
    return None


class SameOriginOnly:
    """Refuses (403) any request other than GET/HEAD/OPTIONS that a browser says comes
    from another origin: a page elsewhere cannot make an operator's browser approve,
    deny, resolve, log in or out here. In development mode (no logins) this is the only
    protection, with the ``Host`` check (:func:`unexpected_host`, when ``dev_hosts``
    is given); with logins it adds to the SameSite=Strict cookie and the CSRF token."""

    def __init__(
        self, app: ASGIApp, logins: bool = False, dev_hosts: frozenset[str] | None = None
    ) -> None:
        self.app = app
        self.logins = logins  # only for the page's header
        # Without logins (development mode): the Host names allowed besides localhost
        # and IP addresses; None: not checked.
        self.dev_hosts = None if logins else dev_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /healthz says nothing and does nothing: an orchestrator may probe it by any name.
        if scope["type"] == "http" and self.dev_hosts is not None and scope["path"] != "/healthz":
            why = unexpected_host(Headers(scope=scope), self.dev_hosts)
            if why is not None:
                response = _page(
                    "Refused",
                    "<p>Open the dashboard as <code>localhost</code> or by its IP address, "
                    "or list the name you use in <code>SAGALINE_DASHBOARD_HOSTS</code>.</p>",
                    f"Refused: this dashboard runs without logins (development mode) and "
                    f"answers only to localhost, an IP address or a name in "
                    f"SAGALINE_DASHBOARD_HOSTS, not {why}; nothing was recorded.",
                    error=True,
                    status=403,
                )
                await response(scope, receive, send)
                return
        if scope["type"] == "http" and scope["method"] not in _SAFE_METHODS:
            why = cross_origin(Headers(scope=scope))
            if why is not None:
                response = _page(
                    "Refused",
                    '<p><a href="/">Open the dashboard</a> and act from its own pages.</p>',
                    f"Refused: this request came from another web site ({why}); "
                    "decisions are only taken from the dashboard's own pages, so "
                    "nothing was recorded.",
                    error=True,
                    viewer=Viewer(auth=self.logins),
                    status=403,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Sent with every answer: no page of the dashboard may be shown in another site's
# frame (a click there would be a same-origin POST: clickjacking), and no answer is
# read as another type than it says.
SECURITY_HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
)


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every HTTP answer, the refusals included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(n, v) for n, v in SECURITY_HEADERS if n not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


MAX_BODY_BYTES = 256 * 1024
"""The largest request body the dashboard reads: its forms (a name, a reason, a
resolution and a note, or a login) need a few KiB; anything larger is refused 413."""


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuses a request whose body is over ``limit`` bytes with 413 before the app
    buffers it: at once by its ``Content-Length``, or, sent without one (chunked), as
    soon as what has arrived passes the limit. Nothing is recorded."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stated = Headers(scope=scope).get("content-length", "").strip()
        if stated.isdigit() and int(stated) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = _page(
            "Too large",
            '<p><a href="/">Back to the dashboard</a></p>',
            f"Refused: the request is over {self.limit // 1024} KiB, far more than any "
            "of the dashboard's forms needs; nothing was recorded.",
            error=True,
            status=413,
        )
        await response(scope, receive, send)


# --------------------------------------------------------------------- the app


def create_app(
    state: DashboardState,
    channel: operator_actions.OperatorChannel | None = None,
    follower: LedgerFollower | None = None,
    clock: Callable[[], int] | None = None,
    auth: OperatorAuth | None = None,
) -> Starlette:
    """The dashboard ASGI app. ``channel`` publishes operator decisions (None: the
    action buttons answer 503); ``follower`` is started and stopped with the app;
    ``auth`` decides who may act (None or not enabled: development mode)."""
    now_ms = clock or (lambda: int(time.time() * 1000))
    auth = auth or OperatorAuth()

    def _stale() -> str:
        """A notice atop the live regions while the view is not the topics' live state
        (refreshed with them, so it goes once the cause does)."""
        problem = follower.view_problem() if follower is not None else None
        if problem is None:
            return ""
        text, error = problem
        return f'<div class="notice{" error" if error else ""} stale" role="alert">{_e(text)}</div>'

    def _viewer(request: Request) -> tuple[Viewer, str | None]:
        """The caller, and a fresh session token to set (proxy logins)."""
        if not auth.enabled:
            return DEV, None
        session, fresh = auth.session(request.cookies.get(SESSION_COOKIE), request.headers)
        if session is None:
            return Viewer(auth=True), None
        return Viewer(True, session.operator, session.csrf), fresh

    def _with_session(request: Request, response: Response, token: str | None) -> Response:
        if token is not None:
            response.set_cookie(
                SESSION_COOKIE,
                token,
                httponly=True,
                samesite="strict",
                secure=auth.cookie_secure(request.url.scheme, request.headers),
                path="/",
            )
        return response

    def viewing(
        handler: Callable[[Request, Viewer], Any], page: bool = True, open_: bool = False
    ) -> Callable[[Request], Any]:
        """Reads need a login unless viewing is open (SAGALINE_DASHBOARD_READ_OPEN) or
        ``open_`` (/metrics with SAGALINE_DASHBOARD_METRICS_OPEN)."""

        async def endpoint(request: Request) -> Response:
            viewer, fresh = _viewer(request)
            if viewer.auth and viewer.operator is None and not (auth.read_open or open_):
                if not page:
                    return Response("log in first", status_code=401)
                target = urlencode({"next": request.url.path})
                return RedirectResponse(f"/login?{target}", status_code=303)
            state.expire_approvals(now_ms())  # what the coordinator no longer waits for
            response: Response = await handler(request, viewer)
            return _with_session(request, response, fresh)

        return endpoint

    async def overview(request: Request, viewer: Viewer) -> Response:
        flt = _filter_from(request)
        now = now_ms()
        live = f"/fragment/overview?{_query(flt)}"
        body = (
            f'<div class="card">{_filter_form(state, flt)}</div>'
            f'<div data-live="{_e(live)}">{_stale()}{_overview_fragment(state, flt, now)}</div>'
            '<div class="card" id="actions"><h2>Needs a person</h2>'
            f'<div data-live="/fragment/actions">{_actions_html(state, now, None, viewer)}'
            "</div></div>"
            '<div class="card" id="measures"><h2>Measures (seed 004)</h2>'
            f'<div data-live="/fragment/measures">'
            f"{_measures_html(state.metrics.snapshot(), state)}</div></div>"
        )
        return _page("Sagas", body, request.query_params.get("notice"), viewer=viewer)

    async def overview_fragment(request: Request, viewer: Viewer) -> Response:
        return HTMLResponse(_stale() + _overview_fragment(state, _filter_from(request), now_ms()))

    async def actions_fragment(request: Request, viewer: Viewer) -> Response:
        return HTMLResponse(_actions_html(state, now_ms(), None, viewer))

    async def measures_fragment(request: Request, viewer: Viewer) -> Response:
        return HTMLResponse(_measures_html(state.metrics.snapshot(), state))

    def _saga_or_404(saga_id: str) -> SagaView | None:
        with state.lock:
            return state.sagas.get(saga_id)

    async def saga_page(request: Request, viewer: Viewer) -> Response:
        saga_id = request.path_params["saga_id"]
        with state.lock:
            saga = _saga_or_404(saga_id)
            if saga is None and state.dropped(saga_id):
                return _page(
                    "Saga not kept",
                    f"<p>Saga {_e(saga_id)} ended and is no longer kept in this dashboard's "
                    "memory (it keeps the <code>SAGALINE_DASHBOARD_ENDED_SAGAS</code> that "
                    f"ended last). <code>sagaline saga show {_e(saga_id)}</code> reads it "
                    'from the ledger. <a href="/">All sagas</a></p>',
                    viewer=viewer,
                )
            if saga is None and state.forgotten_sagas:
                # Dropped so long ago that the dashboard no longer remembers it, or never
                # written: only the ledger can tell which.
                return _page(
                    "Unknown saga",
                    f"<p>No saga {_e(saga_id)} in this dashboard's memory: it is not in the "
                    "ledger (yet), or it ended long ago and is no longer remembered (the "
                    f"dashboard remembers the last {state.dropped_sagas} sagas it dropped). "
                    f"<code>sagaline saga show {_e(saga_id)}</code> reads it from the ledger. "
                    '<a href="/">All sagas</a></p>',
                    viewer=viewer,
                )
            if saga is None:
                return _page(
                    "Unknown saga",
                    f'<p>No saga {_e(saga_id)} in the ledger (yet). <a href="/">All sagas</a></p>',
                    viewer=viewer,
                )
            fragment = _stale() + _saga_fragment(saga, now_ms(), viewer)
        body = (
            f"<h2>Saga <code>{_e(saga_id)}</code></h2>"
            f'<div data-live="/fragment/saga/{quote(saga_id)}">{fragment}</div>'
        )
        return _page(f"Saga {saga_id}", body, request.query_params.get("notice"), viewer=viewer)

    async def saga_fragment(request: Request, viewer: Viewer) -> Response:
        with state.lock:
            saga = _saga_or_404(request.path_params["saga_id"])
            if saga is None:
                return HTMLResponse("", status_code=404)
            return HTMLResponse(_stale() + _saga_fragment(saga, now_ms(), viewer))

    async def timeline_svg(request: Request, viewer: Viewer) -> Response:
        with state.lock:
            saga = _saga_or_404(request.path_params["saga_id"])
            if saga is None:
                return Response("no such saga", status_code=404)
            svg = render_timeline_svg(saga, now_ms())
        return Response(svg, media_type="image/svg+xml")

    def _ids(request: Request, known: Callable[[SagaView, str], bool]) -> tuple[str, str]:
        """``(saga id, approval or incident id)`` of an action's path ``<saga>/<item>``.
        An agent's saga id may hold "/" (and so may an id derived from it), so the
        split is the one naming a saga that has that item; else one naming a saga."""
        ids = request.path_params["ids"]
        splits = [(ids[:i], ids[i + 1 :]) for i, c in enumerate(ids) if c == "/"]
        with state.lock:
            for saga_id, item in splits:
                saga = state.sagas.get(saga_id)
                if saga is not None and known(saga, item):
                    return saga_id, item
            found = [(s, i) for s, i in splits if s in state.sagas]
        return (found or splits or [(ids, "")])[-1]

    async def _decide(
        request: Request, saga_id: str, perform: Callable[[dict[str, str], SagaView], str]
    ) -> Response:
        viewer, _fresh = _viewer(request)
        if viewer.auth and viewer.operator is None:
            # No session: refused before the form is even read.
            return _refuse_unauthenticated(viewer, None) or Response(status_code=401)
        form = {k: str(v) for k, v in (await request.form()).items()}
        back = form.get("next") or "/"
        if not back.startswith("/") or back.startswith("//"):
            back = "/"
        if viewer.auth:
            # The approver is whoever holds the session, never what the form says.
            refused = _refuse_unauthenticated(viewer, form.get("csrf"))
            if refused is not None:
                return refused
            form["operator"] = viewer.operator or ""
        saga = _saga_or_404(saga_id)
        if saga is None:
            return _page(
                "Unknown saga",
                '<p><a href="/">All sagas</a></p>',
                f"no such saga {saga_id!r} in the ledger: nothing was recorded",
                error=True,
                viewer=viewer,
            )
        if not form.get("operator", "").strip():
            return _page(
                "Operator required",
                f'<p><a href="{_e(back)}">Back</a></p>',
                "Say who you are: the operator field is required for every decision.",
                error=True,
                viewer=viewer,
            )
        if channel is None:
            return _page("Read-only", "", "this dashboard is read-only (no producer)", True, viewer)
        unvouched = None if viewer.auth else _unvouched(form["operator"])
        if unvouched is not None:
            back_link = f'<p><a href="{_e(back)}">Back</a></p>'
            return _page("Not recorded", back_link, unvouched, True, viewer, status=403)
        try:
            notice = await run_in_threadpool(perform, form, saga)
        except operator_actions.OperatorActionError as exc:
            back_link = f'<p><a href="{_e(back)}">Back</a></p>'
            return _page("Not recorded", back_link, str(exc), True, viewer)
        except KafkaException as exc:
            # The producer refused the record before sending it (an unknown topic, a
            # fatal producer error...): not in the log. Said to the operator and
            # logged once for whoever runs the dashboard.
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            why = error.str() if error is not None else str(exc)
            log.error("decision on saga %s not recorded: the producer refused it: %s", saga_id, why)
            back_link = f'<p><a href="{_e(back)}">Back</a></p>'
            message = (
                f"the Kafka producer refused the decision ({why}): it was not sent, so "
                "nothing was recorded. Decide again once Kafka is fixed (the dashboard's "
                "log has the error)"
            )
            return _page("Not recorded", back_link, message, True, viewer, status=502)
        sep = "&" if "?" in back else "?"
        return RedirectResponse(f"{back}{sep}{urlencode({'notice': notice})}", status_code=303)

    def _unvouched(operator: str) -> str | None:
        """Without logins, why a decision typed in as ``operator`` is refused: a gateway
        key (``acts_for``) signs for another operator only after that operator logged
        in, so here it decides in its own name alone (None: allowed)."""
        signer = getattr(channel, "signer", None)
        own = signer.signs_as if isinstance(signer, IdentitySigner) else None
        who = operator.strip()
        if own is None or who == own:
            return None
        return (
            f"this dashboard runs without logins (development mode), so it cannot vouch "
            f"that you are {who!r}: its key signs as {own!r}, and decides for another "
            "operator only after they logged in (SAGALINE_DASHBOARD_USERS or "
            f"SAGALINE_DASHBOARD_PROXY_SECRET). Decide as {own!r}, or configure logins; "
            "nothing was recorded"
        )

    def _request_for(saga: SagaView, approval_id: str) -> ApprovalRequested:
        with state.lock:
            state.expire_approvals(now_ms())
            ended = saga.terminal_status is not None
            req = None if ended else saga.pending_approvals.get(approval_id)
            expired = None if ended else saga.expired_approvals.get(approval_id)
        if expired is not None:
            raise operator_actions.ApprovalExpired(
                f"approval {approval_id} of saga {saga.saga_id} expired at "
                f"{format_ms(expired.expires_at)}: the coordinator no longer waits for a "
                "decision on it, so nothing was recorded"
            )
        if req is None:
            raise operator_actions.UnknownRequest(
                f"approval {approval_id} of saga {saga.saga_id} is not pending (already "
                "decided, cancelled as the saga compensates, or the saga ended): nothing "
                "was recorded"
            )
        return req

    def _approval(saga: SagaView, approval_id: str) -> bool:
        return approval_id in saga.pending_approvals or approval_id in saga.expired_approvals

    async def grant(request: Request) -> Response:
        saga_id, approval_id = _ids(request, _approval)

        def perform(form: dict[str, str], saga: SagaView) -> str:
            assert channel is not None
            req = _request_for(saga, approval_id)
            rec = operator_actions.grant_approval(
                channel, req, operator=form["operator"], via="dashboard", now=now_ms()
            )
            return f"Approval {approval_id} granted by {rec.granted_by}{_FIRST_COUNTS}"

        return await _decide(request, saga_id, perform)

    async def deny(request: Request) -> Response:
        saga_id, approval_id = _ids(request, _approval)

        def perform(form: dict[str, str], saga: SagaView) -> str:
            assert channel is not None
            req = _request_for(saga, approval_id)
            rec = operator_actions.deny_approval(
                channel,
                req,
                operator=form["operator"],
                reason=form.get("reason", ""),
                via="dashboard",
            )
            return f"Approval {approval_id} denied by {rec.denied_by}{_FIRST_COUNTS}"

        return await _decide(request, saga_id, perform)

    async def resolve(request: Request) -> Response:
        saga_id, incident_id = _ids(request, lambda saga, i: i in saga.open_incidents)

        def perform(form: dict[str, str], saga: SagaView) -> str:
            assert channel is not None
            with state.lock:
                incident = saga.open_incidents.get(incident_id)
            first = saga.resolved_incidents.get(incident_id) if incident is None else None
            if first is not None:
                raise operator_actions.UnknownRequest(
                    f"incident {incident_id} of saga {saga.saga_id} is already resolved by "
                    f"{first.resolved_by}: {first.resolution}; the coordinator acts on the "
                    "first resolution only, so nothing was recorded"
                )
            settled = saga.settled_incidents.get(incident_id) if incident is None else None
            if settled is not None:
                raise operator_actions.UnknownRequest(
                    f"incident {incident_id} of saga {saga.saga_id} is already settled by "
                    f"the coordinator: {settled}; nothing was recorded"
                )
            if incident is None:
                raise operator_actions.UnknownRequest(
                    f"incident {incident_id} of saga {saga.saga_id} is not open: nothing "
                    "was recorded"
                )
            rec = operator_actions.resolve_incident(
                channel,
                incident,
                operator=form["operator"],
                resolution=form.get("resolution", ""),
                note=form.get("note", ""),
                via="dashboard",
            )
            return f"Incident {incident_id} resolved by {rec.resolved_by}{_FIRST_COUNTS}"

        return await _decide(request, saga_id, perform)

    def _refuse_unauthenticated(viewer: Viewer, csrf: str | None) -> Response | None:
        if viewer.operator is None:
            return _page(
                "Log in",
                '<p><a href="/login">Log in</a></p>',
                "Log in to act: every decision needs an authenticated operator.",
                error=True,
                viewer=viewer,
                status=401,
            )
        if not OperatorAuth.csrf_ok(viewer.csrf, csrf):
            return _page(
                "Refused",
                '<p><a href="/">Back</a></p>',
                "The form's security token is missing or stale: reload the page and act again.",
                error=True,
                viewer=viewer,
                status=403,
            )
        return None

    async def login_page(request: Request) -> Response:
        viewer, _fresh = _viewer(request)
        nxt = request.query_params.get("next", "/")
        if not auth.uses_passwords:
            body = "<p>Operators log in through the reverse proxy in front of this dashboard.</p>"
        else:
            body = (
                '<div class="card"><h2>Log in</h2><form method="post" action="/login">'
                f'<input type="hidden" name="next" value="{_e(nxt)}">'
                '<p><input name="name" autocomplete="username" placeholder="operator" '
                'aria-label="operator" required></p><p><input name="password" type="password" '
                'autocomplete="current-password" placeholder="password" aria-label="password" '
                'required></p><button type="submit" id="login">Log in</button></form></div>'
            )
        return _page("Log in", body, request.query_params.get("notice"), viewer=viewer)

    async def login(request: Request) -> Response:
        form = {k: str(v) for k, v in (await request.form()).items()}
        nxt = form.get("next") or "/"
        if not nxt.startswith("/") or nxt.startswith("//"):
            nxt = "/"
        token = await run_in_threadpool(
            auth.login, form.get("name", "").strip(), form.get("password", "")
        )
        if token is None:
            return _page(
                "Log in",
                '<p><a href="/login">Try again</a></p>',
                "Wrong operator name or password.",
                error=True,
                viewer=Viewer(auth=auth.enabled),
                status=401,
            )
        return _with_session(request, RedirectResponse(nxt, status_code=303), token)

    async def logout(request: Request) -> Response:
        viewer, _fresh = _viewer(request)
        if viewer.csrf is not None:  # a session to end: only then is the form read
            form = {k: str(v) for k, v in (await request.form()).items()}
            if OperatorAuth.csrf_ok(viewer.csrf, form.get("csrf")):
                auth.logout(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    async def api_state(request: Request, viewer: Viewer) -> Response:
        flt = _filter_from(request)
        try:
            limit = _query_int(request, "limit", API_SAGAS_DEFAULT, 1, API_SAGAS_MAX)
            offset = _query_int(request, "offset", 0, 0, None)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        asked = request.query_params.get("status")
        if asked and flt.status is None:
            # Not read as "any status": a typo would list every saga as if it matched.
            known = ", ".join(s.slug for s in SagaStatus)
            return JSONResponse(
                {"error": f"status={asked!r}: expected one of {known}"}, status_code=400
            )
        sagas = state.select(flt)  # sorted outside the lock
        page = sagas[offset : offset + limit]
        with state.lock:
            payload: dict[str, Any] = {
                "caught_up": follower.caught_up.is_set() if follower else True,
                # Why the broker cannot be read now (None: it can): the view is as last read.
                "kafka": follower.kafka_problem if follower else None,
                "follower": follower.health() if follower else None,
                # Topics that do not exist (yet): a wrong prefix, or no coordinator made them.
                "missing_topics": list(follower.missing_topics) if follower else [],
                "records_applied": state.records_applied,
                "ledger_duplicates": state.ledger_duplicates,
                "refused_records": state.refused_records,
                "evicted_sagas": state.evicted_sagas,
                "evicted_records": state.evicted_records,
                "late_records_of_forgotten_sagas": state.late_records_of_forgotten_sagas,
                "fold_errors": follower.fold_errors if follower else 0,
                "rejected_records": follower.rejected if follower else 0,
                "unreadable_records": follower.unreadable if follower else 0,
                "counts": {s.slug: n for s, n in state.counts(flt).items()},
                "total": len(sagas),
                "offset": offset,
                "limit": limit,
                "next_offset": offset + limit if offset + limit < len(sagas) else None,
                "sagas": [
                    {
                        "saga_id": s.saga_id,
                        "status": s.status.slug,
                        "tenant": s.tenant_id,
                        "workflow": s.workflow,
                        "tools": sorted(s.tools),
                        "steps": len(s.steps),
                        "records": s.record_count,
                    }
                    for s in page
                ],
                "pending_approvals": [
                    {"saga_id": s.saga_id, "approval_id": a.approval_id, "step_id": a.step_id}
                    for s, a in state.pending_approvals()
                ],
                "expired_approvals": [
                    {"saga_id": s.saga_id, "approval_id": a.approval_id, "step_id": a.step_id}
                    for s, a in state.expired_approvals()
                ],
                "open_incidents": [
                    {"saga_id": s.saga_id, "incident_id": i.incident_id, "kind": i.kind}
                    for s, i in state.open_incidents()
                ],
            }
        return JSONResponse(payload)

    async def metrics(request: Request, viewer: Viewer) -> Response:
        # Tenant names and amounts of money: behind the login like the pages, unless
        # opened for a scrape (SAGALINE_DASHBOARD_METRICS_OPEN, docs/security.md).
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        if follower is None:
            return JSONResponse({"caught_up": True})
        ready = follower.caught_up.is_set()
        body: dict[str, Any] = {
            "caught_up": ready,
            "fold_errors": follower.fold_errors,
            "rejected_records": follower.rejected,
            "unreadable_records": follower.unreadable,
        }
        # A follower thread that ended leaves a view that no longer moves: not healthy,
        # however caught up it once was (the orchestrator restarts us, which rebuilds).
        stopped = follower.health()
        if stopped is not None:
            body["follower"] = stopped
        # Said, not a 503: a restart cannot bring the broker back (the view catches
        # up by itself once it answers); the pages say it too.
        if follower.kafka_problem is not None:
            body["kafka"] = follower.kafka_problem
        # Named, not just a 503: a probe's log otherwise shows "not ready" for good when
        # the prefix is wrong or the coordinator never created them.
        if follower.missing_topics:
            body["missing_topics"] = list(follower.missing_topics)
        return JSONResponse(body, status_code=200 if ready and stopped is None else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if follower is not None:
            follower.start()
        try:
            yield
        finally:
            if follower is not None:
                follower.stop()

    return Starlette(
        routes=[
            Route("/", viewing(overview)),
            Route("/fragment/overview", viewing(overview_fragment, page=False)),
            Route("/fragment/actions", viewing(actions_fragment, page=False)),
            Route("/fragment/measures", viewing(measures_fragment, page=False)),
            # Agents choose saga ids, "/" included ("orders/42"): ``path`` takes them
            # whole (the actions' "<saga>/<item>" is split by ``_ids``).
            Route("/sagas/{saga_id:path}/timeline.svg", viewing(timeline_svg, page=False)),
            Route("/sagas/{saga_id:path}", viewing(saga_page)),
            Route("/fragment/saga/{saga_id:path}", viewing(saga_fragment, page=False)),
            Route("/login", login_page),
            Route("/login", login, methods=["POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/approvals/{ids:path}/grant", grant, methods=["POST"]),
            Route("/approvals/{ids:path}/deny", deny, methods=["POST"]),
            Route("/incidents/{ids:path}/resolve", resolve, methods=["POST"]),
            Route("/api/state", viewing(api_state, page=False)),
            Route("/metrics", viewing(metrics, page=False, open_=auth.metrics_open)),
            Route("/healthz", healthz),
        ],
        middleware=[
            Middleware(SecurityHeaders),
            Middleware(BodyLimit),
            Middleware(SameOriginOnly, logins=auth.enabled, dev_hosts=auth.dev_hosts),
        ],
        lifespan=lifespan,
    )
