"""One saga's timeline as an inline SVG picture (pure: view in, markup out).

Rows are steps in the order they were scheduled. On each row the upper lane shows the
forward path (approval wait, attempts, retry waits, unknown outcome) and the lower lane
the compensation. The background is split at the moment the pivot committed, as in
seed 003: left of it the reversible zone (a failure unwinds), right of it the saga only
goes forward (R6).
"""

from __future__ import annotations

import html

from sagaline.ops.receipts import format_duration
from schemas.models import Reversibility
from services.dashboard.view import SagaView, Span, SpanKind, StepView

WIDTH = 1100
LABEL_W = 260
PLOT_X0 = LABEL_W + 10
PLOT_X1 = WIDTH - 30
ROW_H = 46
TOP = 56
_TICK_STEPS_MS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 15_000, 30_000,
    60_000, 120_000, 300_000, 600_000, 900_000, 1_800_000, 3_600_000, 7_200_000,
    21_600_000, 43_200_000, 86_400_000,
)  # fmt: skip

# Outcome -> fill colour. Colours are also explained by the legend.
_FILL = {
    "committed": "#2e7d32",
    "pending": "#1565c0",
    "failed": "#c62828",
    "rejected": "#ad1457",
    "timed out": "#6a1b9a",
    "verified": "#ef6c00",
    "compensated": "#fb8c00",
    "verification failed": "#c62828",
    "accepted, awaiting completion": "#ffb74d",
}
_KIND_FILL = {
    SpanKind.APPROVAL: "#f9a825",
    SpanKind.UNKNOWN: "url(#hatch-unknown)",
    SpanKind.RETRY_WAIT: "#eeeeee",
}


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _tick_step(span_ms: int) -> int:
    """A round step giving at most 8 ticks; past the largest round step, an eighth of
    the span (one record from a broken clock must not draw a tick per day of it)."""
    for step in _TICK_STEPS_MS:
        if span_ms / step <= 8:
            return step
    return -(-span_ms // 8)


def _rel(ms: int) -> str:
    if ms == 0:
        return "0"
    if ms < 1000:
        return f"+{ms} ms"
    if ms < 60_000:
        return f"+{ms / 1000:g} s"
    if ms < 3_600_000:
        return f"+{ms / 60_000:g} min"
    return f"+{ms / 3_600_000:g} h"


class _Scale:
    def __init__(self, t0: int, t1: int) -> None:
        self.t0, self.t1 = t0, max(t1, t0 + 1)

    def x(self, t: int) -> float:
        frac = (t - self.t0) / (self.t1 - self.t0)
        return PLOT_X0 + max(0.0, min(1.0, frac)) * (PLOT_X1 - PLOT_X0)


def _bounds(saga: SagaView, now: int) -> tuple[int, int]:
    starts = [saga.started_at] if saga.started_at is not None else []
    # An ended saga's axis ends with what is drawn: records after its terminal one (a
    # resolution days later) are no bar and would squeeze the saga into a sliver.
    ends: list[int] = [saga.last_at] if saga.terminal_at is None else []
    for step in saga.steps.values():
        if step.scheduled_at is not None:
            starts.append(step.scheduled_at)
        for span in step.spans:
            starts.append(span.start)
            ends.append(span.end if span.end is not None else span.start)
    t0 = min(starts) if starts else now
    t1 = max([saga.terminal_at, *ends]) if saga.terminal_at is not None else max([now, *ends])
    # A little air on the right so the last marker is not glued to the edge.
    return t0, t1 + max((t1 - t0) // 40, 1)


def _bar(
    scale: _Scale,
    span: Span,
    y: float,
    h: float,
    open_end: int,
    room: tuple[float, float] = (PLOT_X0, PLOT_X1 + 24),
) -> str:
    """One span as a bar; its caption goes inside, else right or left of it within
    ``room`` (the free stretch of the lane between its neighbours), else only in the
    tooltip."""
    end = span.end if span.end is not None else open_end
    x0, x1 = scale.x(span.start), scale.x(end)
    w = max(x1 - x0, 3.0)
    fill = _KIND_FILL.get(span.kind) or _FILL.get(span.outcome, "#1565c0")
    if span.kind is SpanKind.APPROVAL and span.outcome.startswith("denied"):
        fill = _FILL["rejected"]
    duration = format_duration(max(end - span.start, 0))
    still = "" if span.end is not None else " (still open)"
    title = f"{span.label or span.kind.value}: {span.outcome}{still}, {duration}"
    dash = ' stroke-dasharray="4 3"' if span.kind is SpanKind.RETRY_WAIT else ""
    classes = f"span span-{span.kind.value}"
    parts = [
        f'<g class="{classes}"><title>{_esc(title)}</title>',
        f'<rect x="{x0:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="2" '
        f'fill="{fill}" stroke="#37474f" stroke-width="0.6"{dash}/>',
    ]
    if span.end is None:
        duration += " so far"
    text = duration if span.kind is not SpanKind.APPROVAL else f"{span.outcome} · {duration}"
    if span.kind is SpanKind.COMPENSATION:
        mark = "✓ " if span.outcome == "verified" else ("✗ " if "fail" in span.outcome else "")
        text = f"{mark}{span.label} · {duration}"
    text_w = 6.2 * len(text)
    light = span.kind in (SpanKind.RETRY_WAIT, SpanKind.APPROVAL, SpanKind.UNKNOWN)
    if w >= text_w + 6:
        colour = "#212121" if light else "#ffffff"
        halo = " halo" if light else ""
        parts.append(
            f'<text x="{x0 + 4:.1f}" y="{y + h - 3:.1f}" class="bar-text{halo}" '
            f'fill="{colour}">{_esc(text)}</text>'
        )
    elif x0 + w + 4 + text_w < room[1]:
        parts.append(
            f'<text x="{x0 + w + 4:.1f}" y="{y + h - 3:.1f}" class="bar-text halo" '
            f'fill="#37474f">{_esc(text)}</text>'
        )
    elif x0 - 4 - text_w > room[0]:
        parts.append(
            f'<text x="{x0 - 4:.1f}" y="{y + h - 3:.1f}" class="bar-text halo" '
            f'fill="#37474f" text-anchor="end">{_esc(text)}</text>'
        )
    parts.append("</g>")
    return "".join(parts)


def _end(span: Span, open_end: int) -> int:
    return span.end if span.end is not None else open_end


def _step_label(step: StepView, y: float) -> str:
    badge = {
        Reversibility.REVERSIBLE: ("reversible", "#2e7d32"),
        Reversibility.COMPENSATABLE: ("compensatable", "#1565c0"),
        Reversibility.IRREVERSIBLE: ("irreversible", "#c62828"),
    }[step.reversibility]
    extras = []
    if step.pivot:
        extras.append("PIVOT")
    if step.read_only:
        extras.append("read-only")
    tail = f" · {' · '.join(extras)}" if extras else ""
    return (
        f'<text x="8" y="{y + 20:.1f}" class="step-name">{_esc(step.tool)}'
        f"<title>step {_esc(step.step_id)} on {_esc(step.participant)}</title></text>"
        f'<text x="8" y="{y + 36:.1f}" class="step-meta">'
        f'<tspan fill="{badge[1]}">{badge[0]}</tspan>{_esc(tail)} · {_esc(step.state)}</text>'
    )


def render_timeline_svg(saga: SagaView, now: int) -> str:
    """The SVG markup of ``saga``'s timeline; ``now`` closes spans still open."""
    t0, t1 = _bounds(saga, now)
    scale = _Scale(t0, t1)
    steps = list(saga.steps.values())
    rows_h = max(len(steps), 1) * ROW_H
    legend_y = TOP + rows_h + 50
    height = legend_y + 44
    open_end = saga.terminal_at if saga.terminal_at is not None else max(now, t0)
    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {WIDTH} '
        f'{height}" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="timeline of saga {_esc(saga.saga_id)}">',
        "<defs>"
        '<pattern id="hatch-unknown" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e1bee7"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#6a1b9a" stroke-width="3"/></pattern>'
        "</defs>",
        "<style>.step-name{font:600 13px sans-serif;fill:#212121}"
        ".step-meta{font:11px sans-serif;fill:#616161}.bar-text{font:11px sans-serif}"
        ".halo{paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}"
        ".axis{font:11px sans-serif;fill:#616161}.zone{font:600 12px sans-serif}"
        ".marker{font:600 11px sans-serif}</style>",
    ]

    # Zones (seed 003): reversible until the pivot commits, forward-only after it.
    zone_top, zone_h = TOP - 22, rows_h + 26
    pivot_at = saga.pivot_at
    split = scale.x(pivot_at) if pivot_at is not None else PLOT_X1
    out.append(
        f'<rect class="zone-reversible" x="{PLOT_X0}" y="{zone_top}" width="{split - PLOT_X0:.1f}" '
        f'height="{zone_h}" fill="#e8f5e9"/>'
        f'<text class="zone" x="{PLOT_X0 + 6}" y="{zone_top + 14}" fill="#2e7d32">'
        "REVERSIBLE ZONE: a failure here unwinds</text>"
    )
    if pivot_at is not None:
        pivot_step = next(s for s in steps if s.pivot and s.committed_at == pivot_at)
        out.append(
            f'<rect class="zone-irreversible" x="{split:.1f}" y="{zone_top}" '
            f'width="{PLOT_X1 - split:.1f}" height="{zone_h}" fill="#fdecea"/>'
            f'<text class="zone" x="{PLOT_X1 - 6}" y="{zone_top + 14}" fill="#c62828" '
            'text-anchor="end">PAST THE PIVOT: a failure here goes forward</text>'
            f'<line class="pivot-line" x1="{split:.1f}" y1="{zone_top - 6}" x2="{split:.1f}" '
            f'y2="{zone_top + zone_h}" stroke="#212121" stroke-width="2.5"/>'
            f'<text class="marker" x="{split:.1f}" y="{zone_top - 10}" text-anchor="middle">'
            f"PIVOT: {_esc(pivot_step.tool)} committed</text>"
        )

    # Time axis.
    step_ms = _tick_step(t1 - t0)
    tick = 0
    while t0 + tick <= t1:
        x = scale.x(t0 + tick)
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" y2="{TOP + rows_h}" '
            'stroke="#cfd8dc" stroke-width="0.6"/>'
            f'<text class="axis" x="{x:.1f}" y="{TOP + rows_h + 14}" '
            f'text-anchor="middle">{_rel(tick)}</text>'
        )
        tick += step_ms

    # Steps.
    for i, step in enumerate(steps):
        y = TOP + i * ROW_H
        if i % 2:
            out.append(f'<rect x="0" y="{y}" width="{LABEL_W}" height="{ROW_H}" fill="#fafafa"/>')
        out.append(f'<g class="step" data-step="{_esc(step.step_id)}">{_step_label(step, y)}')
        first = min((sp.start for sp in step.spans), default=None)
        if step.scheduled_at is not None and first is not None and first > step.scheduled_at:
            # Scheduled but not yet running: gated by ordering, approval or dispatch.
            x0, x1 = scale.x(step.scheduled_at), scale.x(first)
            out.append(
                f'<g class="span span-waiting"><title>waiting to run: '
                f"{format_duration(first - step.scheduled_at)}</title>"
                f'<line x1="{x0:.1f}" y1="{y + 18.5}" x2="{x1:.1f}" y2="{y + 18.5}" '
                'stroke="#90a4ae" stroke-width="1.5" stroke-dasharray="2 2"/>'
                f'<circle cx="{x0:.1f}" cy="{y + 18.5}" r="2.5" fill="#90a4ae"/></g>'
            )
        lanes = (
            ([sp for sp in step.spans if sp.kind is not SpanKind.COMPENSATION], y + 11, 15.0),
            ([sp for sp in step.spans if sp.kind is SpanKind.COMPENSATION], y + 29, 13.0),
        )
        for lane, lane_y, lane_h in lanes:
            lane.sort(key=lambda sp: sp.start)
            for j, span in enumerate(lane):
                left = scale.x(_end(lane[j - 1], open_end)) + 4 if j else float(PLOT_X0)
                right = scale.x(lane[j + 1].start) - 4 if j + 1 < len(lane) else PLOT_X1 + 24
                out.append(_bar(scale, span, lane_y, lane_h, open_end, (left, right)))
        for at, kind in step.incidents:
            x = scale.x(at)
            out.append(
                f'<g class="incident-marker"><title>incident raised: {_esc(kind)} at '
                f'{_rel(at - t0)}</title><path d="M{x:.1f},{y + 0.5:.1f} l6,10 l-12,0 z" '
                'fill="#c62828" stroke="#fff" stroke-width="0.8"/>'
                f'<text x="{x:.1f}" y="{y + 9.5:.1f}" text-anchor="middle" fill="#fff" '
                'style="font:700 8px sans-serif">!</text></g>'
            )
        if step.committed_at is not None:
            x = scale.x(step.committed_at)
            out.append(
                f'<circle cx="{x:.1f}" cy="{y + 18.5}" r="3.5" fill="#1b5e20">'
                f"<title>committed at {_rel(step.committed_at - t0)}</title></circle>"
            )
        out.append("</g>")
    if not steps:
        out.append(f'<text class="axis" x="{PLOT_X0}" y="{TOP + 24}">no steps yet</text>')

    # Saga-level markers: first failure and the terminal record.
    if saga.failure_at is not None:
        x = scale.x(saga.failure_at)
        out.append(
            f'<g class="failure-marker"><line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" '
            f'y2="{TOP + rows_h}" stroke="#c62828" stroke-dasharray="5 3"/>'
            f'<text class="marker" x="{x + 3:.1f}" y="{TOP + rows_h + 42}" fill="#c62828">'
            f"first failure {_rel(saga.failure_at - t0)}</text></g>"
        )
    if saga.terminal_at is not None and saga.terminal_status is not None:
        x = scale.x(saga.terminal_at)
        out.append(
            f'<g class="terminal-marker"><line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" '
            f'y2="{TOP + rows_h}" stroke="#263238" stroke-width="2"/>'
            f'<text class="marker" x="{x - 3:.1f}" y="{TOP + rows_h + 28}" '
            f'text-anchor="end">{_esc(saga.terminal_status.value)} '
            f"{_rel(saga.terminal_at - t0)}</text></g>"
        )

    # Legend.
    legend = [
        ("#f9a825", "approval wait"),
        ("#1565c0", "attempt running"),
        ("#2e7d32", "committed"),
        ("#c62828", "failed"),
        ("#ad1457", "rejected / denied"),
        ("url(#hatch-unknown)", "outcome unknown"),
        ("#eeeeee", "retry backoff"),
        ("#90a4ae", "scheduled, waiting to run"),
        ("#ef6c00", "compensation (✓ verified)"),
    ]
    out.append(
        f'<path d="M{8:.1f},{legend_y + 28:.1f} l6,-10 l6,10 z" fill="#c62828"/>'
        f'<text class="axis" x="26" y="{legend_y + 27}">incident raised</text>'
    )
    x = 8.0
    for fill, name in legend:
        out.append(
            f'<rect x="{x:.1f}" y="{legend_y}" width="14" height="10" fill="{fill}" '
            f'stroke="#37474f" stroke-width="0.6"/><text class="axis" x="{x + 18:.1f}" '
            f'y="{legend_y + 9}">{_esc(name)}</text>'
        )
        x += 26 + 6.3 * len(name)
    out.append("</svg>")
    return "\n".join(out)
