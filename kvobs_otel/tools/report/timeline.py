"""One recovery episode as an inline-SVG timeline: a lane per participant.

Lanes: ``scheduler`` (the episode root as a thin bar, preserve and restore
``kv.job`` spans, ``kv.wait``, ``kv.admission``), ``tier N (type)`` (vLLM's
secondary tiers: ``kv.tier.job`` promotions and cascades) and ``rank N``
(``kv.transfer`` D2H/H2D, ``kv.first_compute``). The axis is milliseconds since the episode's
preemption (the root span's start). Each process converts its own monotonic
clock to wall time, so positions across lanes are only as good as those
clocks: nothing here orders spans beyond drawing them where they say they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from kvobs_otel.tools.analysis.episodes import Episode
from kvobs_otel.tools.otlp_file import FileSpan
from kvobs_otel.tools.report.svg import LinearScale, esc, f1, fmt_bytes, fmt_ms, fmt_num, x_axis

# kind -> (legend label, fill colour). Order is the legend's order.
KINDS: dict[str, tuple[str, str]] = {
    "episode": ("episode: preemption \u2192 end (kv.recovery)", "#7c8799"),
    "preserve": ("preserve job (kv.job role=preserve)", "#f6c177"),
    "d2h": ("D2H transfer (kv.transfer d2h)", "#d9730d"),
    "restore": ("restore job: receipt interval (kv.job role=restore)", "#9cc9ee"),
    "receipt": ("receipt complete (end of restore job)", "#0b3a6e"),
    "h2d": ("H2D transfer (kv.transfer h2d)", "#1668b8"),
    "wait": ("wait for the connector's answer (kv.wait)", "#b8b1d9"),
    "promotion": ("promotion: secondary tier \u2192 CPU (kv.tier.job)", "#2a9d8f"),
    "cascade": ("cascade: CPU \u2192 secondary tier (kv.tier.job)", "#e9c46a"),
    "admission": ("admission (kv.admission)", "#18a06a"),
    "first_compute": ("first compute (kv.first_compute)", "#8e44ad"),
    "other": ("other span in the trace", "#c4c9d2"),
}
ERROR_STROKE = "#d7263d"

WIDTH = 1180
LABEL_W = 112
RIGHT_PAD = 28
TOP = 34
TRACK_H = 16
BAR_H = 11
ROOT_H = 5
LANE_PAD = 6
AXIS_H = 42
MIN_W = 2.5


def span_rank(span: FileSpan) -> int | None:
    rank = span.attributes.get("kvobs.rank", span.resource.get("kvobs.rank"))
    try:
        return int(rank) if rank is not None else None
    except (TypeError, ValueError):
        return None


def kind_of(span: FileSpan, root: FileSpan) -> str:
    a = span.attributes
    if span is root:
        return "episode"
    if span.name == "kv.job":
        role = a.get("kvobs.job.role")
        return role if role in ("preserve", "restore") else "other"
    if span.name == "kv.transfer":
        d = a.get("kvobs.direction")
        return d if d in ("d2h", "h2d") else "other"
    if span.name == "kv.admission":
        return "admission"
    if span.name == "kv.wait":
        return "wait"
    if span.name == "kv.tier.job":
        kind = a.get("kvobs.tier.job.kind")
        return kind if kind in ("promotion", "cascade") else "other"
    if span.name == "kv.first_compute":
        return "first_compute"
    return "other"


def lane_of(span: FileSpan) -> str:
    if span.name in ("kv.recovery", "kv.job", "kv.admission", "kv.request", "kv.wait"):
        return "scheduler"
    if span.name == "kv.tier.job":
        a = span.attributes
        return f"tier {a.get('kvobs.tier.index', '?')} ({a.get('kvobs.tier.type', '?')})"
    rank = span_rank(span)
    if rank is not None:
        return f"rank {rank}"
    if span.resource.get("kvobs.role") == "scheduler":
        return "scheduler"
    return "rank ?"


def _int(v: object, default: int = 0) -> int:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def lanes_for(ep: Episode) -> list[str]:
    ranks = set(range(max(ep.expected_ranks, 0)))
    tiers: set[str] = set()
    unknown = False
    for s in ep.spans:
        lane = lane_of(s)
        if lane == "rank ?":
            unknown = True
        elif lane.startswith("tier "):
            tiers.add(lane)
        elif lane != "scheduler":
            ranks.add(int(lane.split()[1]))
    return (["scheduler"] + sorted(tiers) + [f"rank {r}" for r in sorted(ranks)]
            + (["rank ?"] if unknown else []))


def hover_text(span: FileSpan, kind: str, ep: Episode) -> str:
    a = span.attributes
    dur_ms = max(span.end_ns - span.start_ns, 0) / 1e6
    lines = [span.name + (f" ({a['kvobs.job.role']})" if "kvobs.job.role" in a else "")
             + (f" {a['kvobs.direction']}" if "kvobs.direction" in a else ""),
             f"start {fmt_ms((span.start_ns - ep.start_ns) / 1e6)} after preemption, "
             f"duration {fmt_ms(dur_ms)}"]
    if "kvobs.job.id" in a:
        lines.append(f"job id {a['kvobs.job.id']}")
    if "kvobs.bytes" in a:
        b = _int(a["kvobs.bytes"])
        line = f"bytes {b} ({fmt_bytes(b)})"
        if dur_ms > 0 and b > 0:
            line += f", {fmt_num(b / (dur_ms / 1e3) / 1e6)} MB/s"
        lines.append(line)
    if "kvobs.blocks" in a:
        lines.append(f"blocks {a['kvobs.blocks']}")
    if "kvobs.device.duration_s" in a:
        with contextlib.suppress(TypeError, ValueError):
            lines.append(f"device duration {fmt_ms(float(a['kvobs.device.duration_s']) * 1e3)}")
    rank = span_rank(span)
    if rank is not None:
        lines.append(f"rank {rank}")
    for key, label in (("kvobs.tier.type", "tier"), ("kvobs.tier.job.id", "tier job id"),
                       ("kvobs.tier.chunks", "chunks"), ("kvobs.tier.chunks_ok", "chunks ok"),
                       ("kvobs.tier.io.duration_s", "tier I/O s"),
                       ("kvobs.wait.reasons", "waited for"), ("kvobs.wait.passes", "passes"),
                       ("kvobs.receipt.ranks", "receipts from ranks"),
                       ("kvobs.receipt.missing_ranks", "missing ranks"),
                       ("kvobs.admission.roster", "admission roster"),
                       ("kvobs.compute.kind", "compute kind"),
                       ("kvobs.outcome", "outcome"),
                       ("error.type", "error.type")):
        v = a.get(key)
        if v not in (None, [], ""):
            lines.append(f"{label} {v}")
    if kind == "episode":
        lines.append(f"request {ep.request_id}, epoch {ep.epoch}")
        if span.events:
            lines.append("events " + ", ".join(span.events))
    lines.append("status ERROR" if span.error else "status OK")
    return "\n".join(lines)


@dataclass
class _Item:
    span: FileSpan
    kind: str
    lane: str
    x0: float
    x1: float
    track: int = 0


def _pack(items: list[_Item], first_track: int) -> int:
    """Greedy interval packing in pixel space; returns the number of tracks used."""
    ends: list[float] = []
    for it in sorted(items, key=lambda i: (i.x0, i.x1)):
        for t, end in enumerate(ends):
            if end + 2 <= it.x0:
                it.track = first_track + t
                ends[t] = it.x1
                break
        else:
            it.track = first_track + len(ends)
            ends.append(it.x1)
    return len(ends)


def render_timeline(ep: Episode, index: int) -> str:
    """The ``<svg class="timeline">`` of one episode: the whole episode, and
    below it a detail panel when the spans other than the root crowd into a
    small part of it (typically the restore, admission and first compute at
    the end of a long wait)."""
    t0 = ep.start_ns
    end_ms = max(ep.end_ns - t0, 0) / 1e6
    rel = [((s.start_ns - t0) / 1e6, (max(s.end_ns, s.start_ns) - t0) / 1e6) for s in ep.spans]
    lo = min([0.0] + [r[0] for r in rel])
    hi = max([end_ms] + [r[1] for r in rel])
    px0, px1 = LABEL_W + 8, WIDTH - RIGHT_PAD
    span_ms = max(hi - lo, 1e-3)
    full = LinearScale(lo - span_ms * 0.01, hi + span_ms * 0.01, px0, px1, ticks=10,
                       tight=True)

    inner = [r for s, r in zip(ep.spans, rel, strict=True) if s is not ep.root]
    window: tuple[float, float] | None = None
    if inner:
        dlo, dhi = min(r[0] for r in inner), max(r[1] for r in inner)
        if 0 < dhi - dlo < 0.3 * (full.hi - full.lo):
            pad = (dhi - dlo) * 0.08
            window = (dlo - pad, dhi + pad)

    lanes = lanes_for(ep)
    body: list[str] = []
    y, h = _panel(body, ep, lanes, full, float(TOP), "ms since preemption", window)
    if window is not None:
        y += h + 34
        detail = LinearScale(window[0], window[1], px0, px1, ticks=10, tight=True)
        body.append(f'<text class="panel-label" x="10" y="{f1(y - 20)}">detail</text>')
        _, h = _panel(body, ep, lanes, detail, y, "ms since preemption (detail of the "
                      "shaded part above)", None)
    height = y + h
    return (f'<svg class="timeline" id="timeline-{index}" width="{WIDTH}" '
            f'height="{f1(height)}" viewBox="0 0 {WIDTH} {f1(height)}" role="img" '
            f'aria-label="timeline of episode {index}">' + "".join(body) + "</svg>")


def _panel(out: list[str], ep: Episode, lanes: list[str], scale: LinearScale, top: float,
           axis_title: str, window: tuple[float, float] | None) -> tuple[float, float]:
    """Draw lanes, axis, guides and spans on ``scale`` from ``top``; returns
    (top, height including the axis)."""
    t0 = ep.start_ns
    px0, px1 = scale.px0, scale.px1
    lo_ms, hi_ms = scale.lo, scale.hi
    items: dict[str, list[_Item]] = {lane: [] for lane in lanes}
    root_item: _Item | None = None
    for s in ep.spans:
        a_ms = (s.start_ns - t0) / 1e6
        b_ms = (max(s.end_ns, s.start_ns) - t0) / 1e6
        if b_ms < lo_ms or a_ms > hi_ms:
            continue
        kind = kind_of(s, ep.root)
        lane = "scheduler" if kind == "episode" else lane_of(s)
        x0 = max(scale(a_ms), px0)
        x1 = min(max(scale(b_ms), x0 + MIN_W), px1 + MIN_W)
        it = _Item(s, kind, lane, x0, x1)
        if kind == "episode":
            root_item = it
        else:
            items.setdefault(lane, []).append(it)

    # Lane geometry: the scheduler lane keeps track 0 for the episode root.
    lane_top: dict[str, float] = {}
    lane_h: dict[str, float] = {}
    y = top
    for lane in lanes:
        first = 1 if lane == "scheduler" else 0
        n = _pack(items.get(lane, []), first) + first
        lane_top[lane] = y
        lane_h[lane] = max(n, 1) * TRACK_H + 2 * LANE_PAD
        y += lane_h[lane]
    bottom = y

    def track_y(lane: str, track: int) -> float:
        return lane_top[lane] + LANE_PAD + track * TRACK_H + TRACK_H / 2

    for i, lane in enumerate(lanes):
        lt = lane_top[lane]
        out.append(f'<rect class="lane-bg{" alt" if i % 2 else ""}" x="0" y="{f1(lt)}" '
                   f'width="{WIDTH}" height="{f1(lane_h[lane])}"/>')
        out.append(f'<text class="lane-label" x="10" y="{f1(lt + lane_h[lane] / 2)}" '
                   f'dominant-baseline="middle">{esc(lane)}'
                   f'<title>{esc(_lane_title(lane, ep))}</title></text>')
    out.append(x_axis(scale, bottom, top, fmt_num, axis_title, title_y=bottom + 34))
    if window is not None:  # where the detail panel below looks
        wx0, wx1 = scale(window[0]), scale(window[1])
        out.append(f'<rect class="zoom-window" x="{f1(wx0)}" y="{f1(top)}" '
                   f'width="{f1(max(wx1 - wx0, 1))}" height="{f1(bottom - top)}">'
                   f'<title>shown in detail below</title></rect>')

    # Preemption and episode-end guides (where they fall inside this panel).
    xp, xe = scale(0.0), scale((max(ep.end_ns, ep.start_ns) - t0) / 1e6)
    if px0 - 0.5 <= xp <= px1 + 0.5:
        out.append(f'<line class="guide" x1="{f1(xp)}" y1="{f1(top - 30)}" x2="{f1(xp)}" '
                   f'y2="{f1(bottom)}"/>')
        out.append(f'<text class="guide-label" x="{f1(xp + 3)}" y="{f1(top - 20)}">'
                   "preemption</text>")
    else:
        xp = -1e9
    if px0 - 0.5 <= xe <= px1 + 0.5:
        out.append(f'<line class="guide end" x1="{f1(xe)}" y1="{f1(top - 30)}" '
                   f'x2="{f1(xe)}" y2="{f1(bottom)}"/>')
        label = f"end: {ep.outcome} ({fmt_ms(ep.latency_ms)})"
        if xe - max(xp, px0 - 300) > 220:  # first row, left of the end line
            anchor, lx, ly = "end", xe - 3, top - 20
        elif xe < px1 - 220:  # second row, right of the end line
            anchor, lx, ly = "start", xe + 3, top - 6
        else:
            anchor, lx, ly = "end", xe - 3, top - 6
        out.append(f'<text class="guide-label" x="{f1(lx)}" y="{f1(ly)}" '
                   f'text-anchor="{anchor}">{esc(label)}</text>')

    if root_item is not None:
        out.append(_bar(root_item, track_y("scheduler", 0), ROOT_H, ep))
    for lane in lanes:
        for it in items.get(lane, []):
            out.append(_bar(it, track_y(lane, it.track), BAR_H, ep))
    # Receipt completion markers on top of their restore jobs.
    for it in items.get("scheduler", []):
        if it.kind == "restore" and not it.span.error \
                and it.span.attributes.get("kvobs.outcome", "complete") == "complete":
            cx = scale((max(it.span.end_ns, it.span.start_ns) - t0) / 1e6)
            if not px0 - 1 <= cx <= px1 + 1:
                continue
            cy = track_y("scheduler", it.track)
            out.append(
                f'<polygon class="receipt" points="{f1(cx)},{f1(cy - 7)} {f1(cx + 6)},{f1(cy)} '
                f'{f1(cx)},{f1(cy + 7)} {f1(cx - 6)},{f1(cy)}"><title>'
                f'{esc(_receipt_title(it.span, ep))}</title></polygon>')
    return top, bottom - top + AXIS_H


def _bar(it: _Item, cy: float, h: float, ep: Episode) -> str:
    cls = f"span k-{it.kind}" + (" error" if it.span.error else "")
    return (f'<rect class="{cls}" x="{f1(it.x0)}" y="{f1(cy - h / 2)}" '
            f'width="{f1(it.x1 - it.x0)}" height="{f1(h)}" rx="2">'
            f'<title>{esc(hover_text(it.span, it.kind, ep))}</title></rect>')


def _receipt_title(span: FileSpan, ep: Episode) -> str:
    a = span.attributes
    return (f"receipt complete: restore job {a.get('kvobs.job.id', '?')}, ranks "
            f"{a.get('kvobs.receipt.ranks', [])}, "
            f"{fmt_ms((span.end_ns - ep.start_ns) / 1e6)} after preemption")


def _lane_title(lane: str, ep: Episode) -> str:
    if lane == "scheduler":
        return f"scheduler (generation {ep.sched_gen})"
    procs = sorted({(str(s.resource.get("host.name", "?")), str(s.resource.get("process.pid", "?")),
                     str(s.attributes.get("kvobs.worker.generation",
                                          s.resource.get("kvobs.worker.generation", "?"))))
                    for s in ep.spans if lane_of(s) == lane and s.name != "kv.recovery"})
    if not procs:
        return f"{lane}: no span from this rank in the trace"
    return lane + "\n" + "\n".join(f"host {h}, pid {p}, worker generation {g}"
                                   for h, p, g in procs)
