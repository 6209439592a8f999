"""The report's plots, drawn as inline SVG: recovery-latency histogram and
transfer throughput (scatter against size, and per direction/rank spread)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from kvobs_otel.tools.analysis.stats import percentile
from kvobs_otel.tools.otlp_file import FileSpan
from kvobs_otel.tools.report.svg import (
    MARKERS,
    LinearScale,
    LogScale,
    esc,
    f1,
    fmt_bytes,
    fmt_ms,
    fmt_num,
    marker,
    nice_step,
    x_axis,
    y_axis,
)
from kvobs_otel.tools.report.timeline import KINDS, span_rank

DIRECTION_COLOUR = {"d2h": KINDS["d2h"][1], "h2d": KINDS["h2d"][1]}
OTHER_COLOUR = "#6b7280"
SCATTER_CAP = 5000


def _empty_plot(cls: str, width: int, height: int, message: str) -> str:
    height = min(height, 110)
    return (f'<svg class="plot {cls}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(message)}">'
            f'<rect class="plot-empty" x="1" y="1" width="{width - 2}" height="{height - 2}" '
            f'rx="6"/><text class="empty-text" x="{width / 2}" y="{height / 2}" '
            f'text-anchor="middle" dominant-baseline="middle">{esc(message)}</text></svg>')


# -- recovery latency -------------------------------------------------------

def latency_histogram(latencies_ms: list[float], width: int = 780, height: int = 330) -> str:
    """Histogram of recovery latencies (ms) with p50 and p99 marked."""
    if not latencies_ms:
        return _empty_plot("latency-histogram", width, height, "no recovered episodes")
    ml, mr, mt, mb = 62, 22, 50, 52
    vals = sorted(latencies_ms)
    vmin, vmax = vals[0], vals[-1]
    lo = 0.0 if vmin <= (vmax - vmin) or vmin <= 0 else vmin
    target = min(40, max(8, 2 * math.ceil(math.sqrt(len(vals)))))
    step = nice_step(max(vmax - lo, abs(vmax) * 0.05, 1e-3) / target)
    start = math.floor(lo / step) * step
    nbins = max(1, math.floor((vmax - start) / step) + 1)
    counts = [0] * nbins
    for v in vals:
        counts[min(max(int((v - start) // step), 0), nbins - 1)] += 1
    xs = LinearScale(start, start + nbins * step, ml, width - mr, ticks=8)
    cmax = max(counts)
    ys = LinearScale(0, cmax, height - mb, mt, ticks=min(5, cmax))
    out = [f'<svg class="plot latency-histogram" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="recovery latency histogram">']
    out.append(y_axis(ys, ml, width - mr, fmt_num, "episodes"))
    out.append(x_axis(xs, height - mb, mt, fmt_num, "recovery latency (ms)"))
    for i, c in enumerate(counts):
        if not c:
            continue
        a, b = start + i * step, start + (i + 1) * step
        x0, x1 = xs(a), xs(b)
        y = ys(c)
        tip = f"{fmt_num(a)}\u2013{fmt_num(b)} ms: {c} episode" + ("s" if c != 1 else "")
        out.append(f'<rect class="hist-bar" x="{f1(x0 + 0.5)}" y="{f1(y)}" '
                   f'width="{f1(max(x1 - x0 - 1, 1))}" height="{f1(ys(0) - y)}">'
                   f'<title>{esc(tip)}</title></rect>')
    p50, p99 = percentile(vals, 50), percentile(vals, 99)
    assert p50 is not None and p99 is not None
    close = abs(xs(p99) - xs(p50)) < 34
    key_x = ml
    for name, v, row in (("p50", p50, 0), ("p99", p99, 1 if close else 0)):
        x = xs(v)
        out.append(f'<line class="pct {name}" x1="{f1(x)}" y1="{mt - 16 - row * 12}" '
                   f'x2="{f1(x)}" y2="{f1(height - mb)}"><title>{esc(name)} '
                   f'{esc(fmt_ms(v))}</title></line>')
        out.append(f'<text class="pct-tag {name}" x="{f1(x + 3)}" y="{mt - 8 - row * 12}">'
                   f'{esc(name)}</text>')
        out.append(f'<line class="pct {name}" x1="{key_x}" y1="12" x2="{key_x + 22}" y2="12"/>'
                   f'<text class="pct-label {name}" x="{key_x + 27}" y="16">'
                   f'{esc(f"{name} {fmt_ms(v)}")}</text>')
        key_x += 130
    out.append("</svg>")
    return "".join(out)


# -- transfer throughput ----------------------------------------------------

@dataclass
class Transfer:
    direction: str
    rank: int | None
    nbytes: int
    host_s: float
    device_s: float | None
    job_id: object
    request_id: str

    @property
    def mbps(self) -> float:
        return self.nbytes / self.host_s / 1e6

    @property
    def device_mbps(self) -> float | None:
        return self.nbytes / self.device_s / 1e6 if self.device_s else None


def collect_transfers(spans: list[FileSpan]) -> tuple[list[Transfer], dict[str, int]]:
    """Transfers usable for throughput, and counts of those left out by reason."""
    out: list[Transfer] = []
    skipped: dict[str, int] = defaultdict(int)
    for s in spans:
        if s.name != "kv.transfer":
            continue
        a = s.attributes
        outcome = a.get("kvobs.outcome", "ok")
        if outcome != "ok":
            skipped[f"outcome {outcome}"] += 1
            continue
        try:
            nbytes = int(a.get("kvobs.bytes") or 0)
        except (TypeError, ValueError):
            nbytes = 0
        if nbytes <= 0:
            skipped["no kvobs.bytes"] += 1
            continue
        host_s = (s.end_ns - s.start_ns) / 1e9
        if host_s <= 0:
            skipped["zero duration"] += 1
            continue
        try:
            dev = float(a["kvobs.device.duration_s"]) if "kvobs.device.duration_s" in a else None
        except (TypeError, ValueError):
            dev = None
        out.append(Transfer(str(a.get("kvobs.direction", "?")), span_rank(s), nbytes, host_s,
                            dev if dev and dev > 0 else None, a.get("kvobs.job.id", "?"),
                            str(a.get("kvobs.request.id", ""))))
    return out, dict(skipped)


def _group_key(t: Transfer) -> tuple[int, str, int]:
    order = {"d2h": 0, "h2d": 1}.get(t.direction, 2)
    return (order, t.direction, t.rank if t.rank is not None else -1)


def _rank_label(rank: int) -> str:
    return f"rank {rank}" if rank >= 0 else "rank ?"


def _shape(rank: int | None) -> str:
    return MARKERS[rank % len(MARKERS)] if rank is not None and rank >= 0 else "cross"


def _colour(direction: str) -> str:
    return DIRECTION_COLOUR.get(direction, OTHER_COLOUR)


def throughput_scatter(transfers: list[Transfer], width: int = 580, height: int = 340) -> str:
    """Throughput (MB/s, log) against transfer size (bytes, log)."""
    if not transfers:
        return _empty_plot("throughput-scatter", width, height, "no transfers with bytes")
    ml, mr, mt, mb = 70, 20, 20, 52
    xs = LogScale(min(t.nbytes for t in transfers), max(t.nbytes for t in transfers),
                  ml, width - mr)
    ys = LogScale(min(t.mbps for t in transfers), max(t.mbps for t in transfers),
                  height - mb, mt)
    pts = transfers
    if len(pts) > SCATTER_CAP:  # an even, deterministic sample
        stride = len(pts) / SCATTER_CAP
        pts = [pts[int(i * stride)] for i in range(SCATTER_CAP)]
    out = [f'<svg class="plot throughput-scatter" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="transfer throughput against size">']
    out.append(y_axis(ys, ml, width - mr, fmt_num, "throughput (MB/s)"))
    out.append(x_axis(xs, height - mb, mt, fmt_bytes, "transfer size (kvobs.bytes)"))
    for t in pts:
        col = _colour(t.direction)
        title = (f"{t.direction} rank {t.rank if t.rank is not None else '?'}, job {t.job_id}, "
                 f"request {t.request_id}\n{t.nbytes} bytes in {fmt_ms(t.host_s * 1e3)}: "
                 f"{fmt_num(t.mbps)} MB/s")
        if t.device_mbps is not None:
            title += (f"\ndevice clock {fmt_ms(t.device_s * 1e3)}: "  # type: ignore[operator]
                      f"{fmt_num(t.device_mbps)} MB/s")
        out.append(marker(_shape(t.rank), xs(t.nbytes), ys(t.mbps), 4.2,
                          f'class="pt" fill="{col}" stroke="{col}"', title))
    out.append("</svg>")
    if len(pts) < len(transfers):
        out.append(f'<p class="note">{len(pts)} of {len(transfers)} transfers drawn '
                   f'(an even sample); the spread chart and table use all.</p>')
    return "".join(out)


def throughput_spread(transfers: list[Transfer], width: int = 580, height: int = 340) -> str:
    """Median throughput per (direction, rank) with p10..p90 whiskers, log scale."""
    if not transfers:
        return _empty_plot("throughput-spread", width, height, "no transfers with bytes")
    groups: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for t in transfers:
        groups[_group_key(t)].append(t.mbps)
    keys = sorted(groups)
    ml, mr, mt, mb = 70, 20, 20, 52
    ys = LogScale(min(t.mbps for t in transfers), max(t.mbps for t in transfers),
                  height - mb, mt)
    ngroups = len({k[1] for k in keys})
    gap = 0.8  # in bands, between directions
    band = (width - ml - mr) / (len(keys) + gap * (ngroups - 1))
    out = [f'<svg class="plot throughput-spread" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="median transfer throughput per direction and rank">']
    out.append(y_axis(ys, ml, width - mr, fmt_num, "throughput (MB/s)"))
    base = height - mb
    out.append(f'<line class="axis" x1="{ml}" y1="{base}" x2="{width - mr}" y2="{base}"/>')
    label_every = max(1, math.ceil(24 / band))
    slot, prev = 0.0, None
    group_x: dict[str, list[float]] = defaultdict(list)
    for key in keys:
        _, direction, rank = key
        if prev is not None and direction != prev:
            slot += gap
        prev = direction
        v = sorted(groups[key])
        med, p10, p90 = (percentile(v, q) for q in (50, 10, 90))
        assert med is not None and p10 is not None and p90 is not None
        cx = ml + band * (slot + 0.5)
        index_in_group = len(group_x[direction])
        group_x[direction].append(cx)
        slot += 1
        col = _colour(direction)
        half = min(band * 0.32, 26)
        title = (f"{direction} {_rank_label(rank)}: {len(v)} transfers\n"
                 f"median {fmt_num(med)} MB/s, p10 {fmt_num(p10)}, p90 {fmt_num(p90)}")
        out.append(f'<g class="spread"><title>{esc(title)}</title>')
        out.append(f'<rect class="spread-bar" x="{f1(cx - half)}" y="{f1(ys(med))}" '
                   f'width="{f1(2 * half)}" height="{f1(max(base - ys(med), 0))}" '
                   f'fill="{col}"/>')
        out.append(f'<line class="whisker" x1="{f1(cx)}" y1="{f1(ys(p10))}" x2="{f1(cx)}" '
                   f'y2="{f1(ys(p90))}"/>')
        for q in (p10, p90):
            out.append(f'<line class="whisker" x1="{f1(cx - half / 2)}" y1="{f1(ys(q))}" '
                       f'x2="{f1(cx + half / 2)}" y2="{f1(ys(q))}"/>')
        out.append(marker(_shape(rank if rank >= 0 else None), cx, ys(med),
                          min(4.5, max(band * 0.3, 2)),
                          f'class="pt median" fill="{col}" stroke="#1f2937"'))
        out.append("</g>")
        if index_in_group % label_every == 0:
            label = str(rank) if rank >= 0 else "?"
            out.append(f'<text class="tick" x="{f1(cx)}" y="{base + 14}" text-anchor="middle">'
                       f'{esc(label)}</text>')
            if band >= 44:
                out.append(f'<text class="tick small" x="{f1(cx)}" y="{base + 26}" '
                           f'text-anchor="middle">n={len(v)}</text>')
    # Direction brackets under each group.
    for direction, xs_ in group_x.items():
        x0, x1 = xs_[0] - band * 0.4, xs_[-1] + band * 0.4
        yb = base + (31 if band >= 44 else 20)
        out.append(f'<path class="bracket" d="M{f1(x0)},{yb - 3} V{yb} H{f1(x1)} V{yb - 3}"/>')
        out.append(f'<text class="axis-title" x="{f1((x0 + x1) / 2)}" y="{yb + 14}" '
                   f'text-anchor="middle">{esc(direction)} ranks</text>')
    out.append("</svg>")
    return "".join(out)


def throughput_legend(transfers: list[Transfer]) -> str:
    directions = sorted({t.direction for t in transfers}, key=lambda d: ({"d2h": 0, "h2d": 1}
                                                                         .get(d, 2), d))
    ranks = sorted({t.rank if t.rank is not None else -1 for t in transfers})
    items = []
    for d in directions:
        items.append(f'<li><svg width="14" height="14"><rect x="1" y="1" width="12" height="12" '
                     f'rx="2" fill="{_colour(d)}"/></svg>{esc(d)}</li>')
    for r in ranks[:12]:
        key = marker(_shape(r if r >= 0 else None), 7, 7, 4, 'class="pt-key"')
        items.append(f'<li><svg width="14" height="14">{key}</svg>{esc(_rank_label(r))}</li>')
    if len(ranks) > 12:
        items.append(f"<li>\u2026 {len(ranks) - 12} more ranks (shapes repeat)</li>")
    return '<ul class="legend inline">' + "".join(items) + "</ul>"


def throughput_table(transfers: list[Transfer]) -> str:
    groups: dict[tuple[int, str, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        groups[_group_key(t)].append(t)
    rows = []
    for key in sorted(groups):
        _, direction, rank = key
        ts = groups[key]
        host = sorted(t.mbps for t in ts)
        dev = sorted(t.device_mbps for t in ts if t.device_mbps is not None)
        cells = [direction, _rank_label(rank), str(len(ts)),
                 fmt_bytes(sum(t.nbytes for t in ts)),
                 fmt_num(percentile(host, 50) or 0), fmt_num(percentile(host, 10) or 0),
                 fmt_num(percentile(host, 90) or 0),
                 fmt_num(percentile(dev, 50) or 0) if dev else "\u2013"]
        rows.append("<tr>" + "".join(
            f'<td{" class=num" if i >= 2 else ""}>{esc(c)}</td>' for i, c in enumerate(cells))
            + "</tr>")
    head = ("<tr><th>direction</th><th>rank</th><th class=num>transfers</th>"
            "<th class=num>bytes</th><th class=num>median MB/s</th><th class=num>p10</th>"
            "<th class=num>p90</th><th class=num>median MB/s, device clock</th></tr>")
    return f'<table class="data throughput-table"><thead>{head}</thead><tbody>' \
           + "".join(rows) + "</tbody></table>"
