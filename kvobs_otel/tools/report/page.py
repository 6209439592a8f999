"""A self-contained HTML report of recorded recovery episodes.

``render_report(spans)`` returns one HTML page (inline CSS and inline SVG, no
script, no external resource): a summary of the source, plots of recovery
latency and transfer throughput, and a timeline of each episode with a lane
for the scheduler and one per rank. Episodes and their problems come from
``kvobs_otel.tools.analysis.episodes.rebuild``. Every string taken from the data is
HTML-escaped.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone

from kvobs_otel.tools.analysis.episodes import Episode, rebuild
from kvobs_otel.tools.analysis.stats import percentile
from kvobs_otel.tools.otlp_file import FileSpan
from kvobs_otel.tools.report.plots import (
    collect_transfers,
    latency_histogram,
    throughput_legend,
    throughput_scatter,
    throughput_spread,
    throughput_table,
)
from kvobs_otel.tools.report.svg import esc, fmt_ms
from kvobs_otel.tools.report.timeline import ERROR_STROKE, KINDS, render_timeline

DEFAULT_TITLE = "kvobs-otel recovery report"
MAX_EPISODES = 200

_OK_OUTCOMES = {"recovered"}
# recomputed: the request came back, but from scratch (its restore failed);
# restore_failed stays an error.
_BENIGN_OUTCOMES = {"finished_before_resume", "aborted_before_resume", "preempted_again",
                    "recomputed"}


def write_report(spans: list[FileSpan], path: str, title: str | None = None) -> None:
    """Render the report and write it to ``path`` (UTF-8). OSError propagates."""
    text = render_report(spans, title=title)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def render_report(spans: list[FileSpan], title: str | None = None, *,
                  max_episodes: int = MAX_EPISODES) -> str:
    """The whole HTML page for ``spans``."""
    title = title or DEFAULT_TITLE
    episodes = rebuild(spans)
    shown, left_out_note = _select(episodes, max_episodes)
    transfers, skipped = collect_transfers(spans)
    recovered = [e.latency_ms for e in episodes if e.outcome == "recovered"]
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    body = [f"<header><h1>{esc(title)}</h1>"
            f'<p class="generated">generated {esc(generated)} by kvobs-otel report</p></header>',
            _summary(spans, episodes, recovered)]
    if not episodes:
        body.append('<div class="empty-banner" id="no-episodes"><strong>No recovery episodes'
                    '</strong> in this source: it holds no <code>kv.recovery</code> span '
                    f"({len(spans)} span{'s' if len(spans) != 1 else ''} in all). Episodes "
                    "appear when vLLM preempts a request whose KV blocks the "
                    "OffloadingConnector stores and restores.</div>")

    body.append('<section id="plots"><h2>Plots</h2><div class="cards">')
    body.append('<figure class="card wide" id="latency-plot"><figcaption>Recovery latency '
                f'<span class="sub">{len(recovered)} recovered episode'
                f'{"s" if len(recovered) != 1 else ""}; kv.recovery duration, preemption '
                "\u2192 last rank's first compute</span></figcaption>"
                '<div class="pair">' + latency_histogram(recovered)
                + _latency_stats(recovered, episodes) + "</div></figure>")
    body.append('<figure class="card wide" id="throughput-plot"><figcaption>Transfer '
                f'throughput <span class="sub">{len(transfers)} kv.transfer span'
                f'{"s" if len(transfers) != 1 else ""} with kvobs.bytes; MB/s = bytes / span '
                "duration (submit called \u2192 result seen) / 10\u2076</span></figcaption>"
                + throughput_legend(transfers)
                + '<div class="pair"><div><h4>throughput against transfer size</h4>'
                + throughput_scatter(transfers)
                + '</div><div><h4>median per direction and rank, whiskers p10\u2013p90</h4>'
                + throughput_spread(transfers) + "</div></div>"
                + (throughput_table(transfers) if transfers else "")
                + _skipped_note(skipped) + "</figure>")
    body.append("</div></section>")

    if episodes:
        body.append('<section id="episodes"><h2>Episodes</h2>')
        body.append('<p class="note">Times come from different processes: each converts '
                    "its own monotonic clock to wall time, so lanes can be offset from each "
                    "other by that conversion. Read positions across lanes as approximate; "
                    "the page orders nothing beyond what is drawn. Hover a bar for its "
                    "span name, duration, bytes and job id.</p>")
        if left_out_note:
            body.append(f'<p class="cap-note" id="left-out">{esc(left_out_note)}</p>')
        body.append(_legend())
        body.append(_index(shown))
        for i, ep in enumerate(shown, 1):
            body.append(_episode_section(ep, i))
        body.append("</section>")

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{_CSS}</style></head><body><main>"
            + "".join(body) + "</main></body></html>\n")


# -- selection ----------------------------------------------------------------

def _select(episodes: list[Episode], cap: int) -> tuple[list[Episode], str]:
    """At most ``cap`` episodes in start order: every incomplete one first, then
    the earliest complete ones; and a note saying what was left out."""
    if len(episodes) <= cap:
        return episodes, ""
    bad = [e for e in episodes if not e.complete]
    good = [e for e in episodes if e.complete]
    chosen = bad[:cap] + good[:max(cap - len(bad), 0)]
    chosen.sort(key=lambda e: (e.start_ns, e.request_id, e.epoch))
    left_bad = len(bad) - min(len(bad), cap)
    left_good = len(good) - max(cap - len(bad), 0)
    parts = []
    if left_bad:
        parts.append(f"{left_bad} incomplete")
    if left_good:
        parts.append(f"{left_good} complete")
    return chosen, (f"Showing {len(chosen)} of {len(episodes)} episodes "
                    f"({len(episodes) - len(chosen)} left out: {' and '.join(parts)}). "
                    "Incomplete episodes are kept first, then the earliest complete ones; "
                    "the plots and the summary count every episode.")


# -- summary ------------------------------------------------------------------

def _summary(spans: list[FileSpan], episodes: list[Episode], recovered: list[float]) -> str:
    outcomes = Counter(e.outcome for e in episodes)
    complete = sum(1 for e in episodes if e.complete)
    names = Counter(s.name for s in spans)
    procs = {(str(s.resource.get("service.instance.id", "")), str(s.resource.get("host.name", "")),
              str(s.resource.get("process.pid", ""))) for s in spans}
    ranks = {s.attributes.get("kvobs.rank", s.resource.get("kvobs.rank")) for s in spans}
    ranks.discard(None)
    cards = [
        ("episodes", f"{len(episodes)}", "kv.recovery roots"),
        ("complete", f"{complete}", "whole chain, however it ended"),
        ("not complete", f"{len(episodes) - complete}",
         "problems marked in red below" if complete < len(episodes) else "\u2013"),
        ("spans", f"{len(spans)}", f"from {len(procs)} process{'es' if len(procs) != 1 else ''}"
         f", {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"),
    ]
    if recovered:
        cards.append(("recovery p50 / p99",
                      f"{fmt_ms(percentile(recovered, 50) or 0)}",
                      f"p99 {fmt_ms(percentile(recovered, 99) or 0)}"))
    out = ['<section id="summary"><div class="stats">']
    for label, value, sub in cards:
        cls = " bad" if label == "not complete" and value != "0" else ""
        out.append(f'<div class="stat{cls}"><div class="label">{esc(label)}</div>'
                   f'<div class="value">{esc(value)}</div><div class="sub">{esc(sub)}</div></div>')
    out.append("</div><dl class=\"facts\">")
    out.append("<dt>outcomes</dt><dd>" + (", ".join(
        f'<span class="badge {_outcome_class(o)}">{esc(o)}</span>\u00a0{n}'
        for o, n in sorted(outcomes.items())) or "none") + "</dd>")
    out.append("<dt>spans by name</dt><dd>" + (", ".join(
        f"<code>{esc(n)}</code>\u00a0{c}" for n, c in sorted(names.items())) or "none") + "</dd>")
    if spans:
        t0 = min(s.start_ns for s in spans)
        t1 = max(s.end_ns for s in spans)
        out.append(f"<dt>time range</dt><dd>{esc(_utc(t0))} \u2013 {esc(_utc(t1))} "
                   f"({esc(fmt_ms((t1 - t0) / 1e6))})</dd>")
        services = sorted({str(s.resource.get("service.name", "?")) for s in spans})
        out.append(f"<dt>services</dt><dd>{esc(', '.join(services))}</dd>")
    out.append("</dl></section>")
    return "".join(out)


def _latency_stats(recovered: list[float], episodes: list[Episode]) -> str:
    rows = []
    if recovered:
        v = sorted(recovered)
        rows += [("recovered", str(len(v)))] + [
            (k, fmt_ms(x)) for k, x in (
                ("min", v[0]), ("p50", percentile(v, 50) or 0), ("p90", percentile(v, 90) or 0),
                ("p99", percentile(v, 99) or 0), ("max", v[-1]))]
    others = Counter(e.outcome for e in episodes if e.outcome != "recovered")
    rows += [(f"{o} (not in the plot)", str(n)) for o, n in sorted(others.items())]
    if not rows:
        return ""
    return ('<table class="data stats-table"><tbody>' + "".join(
        f"<tr><th>{esc(k)}</th><td class=num>{esc(x)}</td></tr>" for k, x in rows)
        + "</tbody></table>")


def _skipped_note(skipped: dict[str, int]) -> str:
    if not skipped:
        return ""
    return ('<p class="note">Left out of the throughput plots: ' + ", ".join(
        f"{n} ({esc(reason)})" for reason, n in sorted(skipped.items())) + ".</p>")


# -- episodes -----------------------------------------------------------------

def _legend() -> str:
    items = []
    for kind, (label, colour) in KINDS.items():
        if kind == "episode":
            sw = f'<rect x="1" y="8" width="26" height="5" rx="2" fill="{colour}"/>'
        elif kind == "receipt":
            sw = (f'<polygon points="14,3 20,10.5 14,18 8,10.5" fill="{colour}" '
                  'stroke="#fff" stroke-width="1"/>')
        else:
            sw = f'<rect x="1" y="5" width="26" height="11" rx="2" fill="{colour}"/>'
        items.append(f'<li><svg width="28" height="21">{sw}</svg>{esc(label)}</li>')
    items.append(f'<li><svg width="28" height="21"><rect x="2" y="5" width="24" height="11" '
                 f'rx="2" fill="#e5e7eb" stroke="{ERROR_STROKE}" stroke-width="2"/></svg>'
                 "span with ERROR status (red outline)</li>")
    items.append('<li><svg width="28" height="21"><line x1="14" y1="1" x2="14" y2="20" '
                 'class="guide"/></svg>preemption / episode end</li>')
    return ('<div class="legend-box" id="legend"><h3>Legend</h3><ul class="legend">'
            + "".join(items) + "</ul></div>")


def _index(shown: list[Episode]) -> str:
    rows = []
    for i, e in enumerate(shown, 1):
        problems = esc("; ".join(e.problems)) if e.problems else "\u2013"
        rows.append(
            f'<tr class="{"" if e.complete else "bad"}"><td class="num">'
            f'<a href="#episode-{i}">#{i}</a></td>'
            f"<td><code>{esc(e.request_id)}</code></td><td class=num>{e.epoch}</td>"
            f'<td><span class="badge {_outcome_class(e.outcome)}">{esc(e.outcome)}</span></td>'
            f"<td class=num>{esc(fmt_ms(e.latency_ms))}</td>"
            f'<td class="when">{esc(_utc(e.start_ns))}</td>'
            f'<td class="problem-cell">{problems}</td></tr>')
    return (f'<details class="index"{" open" if len(shown) <= 30 else ""}>'
            f"<summary>Episode index ({len(shown)})</summary>"
            '<table class="data"><thead><tr><th class=num>#</th><th>request</th>'
            "<th class=num>epoch</th><th>outcome</th><th class=num>latency</th>"
            "<th>preempted at</th><th>problems</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></details>")


def _episode_section(ep: Episode, i: int) -> str:
    problems = ""
    if ep.problems:
        problems = ('<span class="problems">\u26a0 ' + esc("; ".join(ep.problems))
                    + "</span>")
    a = ep.root.attributes
    facts = [("trace", ep.trace_id), ("preempted at", _utc(ep.start_ns)),
             ("expected ranks", str(ep.expected_ranks)),
             ("preserve jobs", _ids(a.get("kvobs.preserve.job_ids"))),
             ("restore jobs", _ids(a.get("kvobs.restore.job_ids")))]
    if a.get("kvobs.compute.kind"):
        facts.append(("compute", str(a["kvobs.compute.kind"])))
    if ep.root.events:
        facts.append(("events", ", ".join(ep.root.events)))
    meta = " ".join(f"<span><b>{esc(k)}</b> {esc(v)}</span>" for k, v in facts)
    return (f'<section class="episode{"" if ep.complete else " bad"}" id="episode-{i}">'
            f'<h3><span class="num">#{i}</span> request <code>{esc(ep.request_id)}</code> '
            f'<span class="epoch">epoch {ep.epoch}</span> '
            f'<span class="badge {_outcome_class(ep.outcome)}">{esc(ep.outcome)}</span> '
            f'<span class="latency">{esc(fmt_ms(ep.latency_ms))}</span> {problems}</h3>'
            f'<p class="meta">{meta}</p><div class="scroll">{render_timeline(ep, i)}</div>'
            "</section>")


def _ids(v: object) -> str:
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) if v else "none"
    return "none" if v is None else str(v)


def _outcome_class(outcome: str) -> str:
    if outcome in _OK_OUTCOMES:
        return "ok"
    if outcome in _BENIGN_OUTCOMES:
        return "neutral"
    return "err"


def _utc(ns: int) -> str:
    try:
        dt = datetime.fromtimestamp(ns / 1e9, tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return str(ns)
    return dt.strftime("%Y-%m-%d %H:%M:%S.") + f"{dt.microsecond // 1000:03d}"


_CSS = """
:root{--fg:#1f2937;--muted:#6b7280;--line:#e5e7eb;--bg:#f6f7f9;--card:#fff;--err:#d7263d;
--ok:#18794e;--accent:#1668b8}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1260px;margin:0 auto;padding:20px 24px 48px}
header{display:flex;align-items:baseline;justify-content:space-between;flex-wrap:wrap;gap:8px;
border-bottom:3px solid var(--accent);padding-bottom:8px;margin-bottom:16px}
h1{font-size:24px;margin:0}
h2{font-size:18px;margin:28px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:15px;margin:0 0 6px}
h4{font-size:12px;font-weight:600;color:var(--muted);margin:6px 0 2px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#eef1f5;
padding:0 4px;border-radius:3px;word-break:break-all}
.generated{color:var(--muted);margin:0}
.stats{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:10px}
.stat{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 16px;
min-width:170px}
.stat .label{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.stat .value{font-size:26px;font-weight:650}
.stat .sub{color:var(--muted);font-size:12px}
.stat.bad{border-color:var(--err)}.stat.bad .value{color:var(--err)}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:6px 0 0;
background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 16px}
dl.facts dt{color:var(--muted)}dl.facts dd{margin:0}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;font-weight:600;
line-height:18px;vertical-align:1px}
.badge.ok{background:#dcf3e6;color:var(--ok)}.badge.neutral{background:#eceff3;color:#374151}
.badge.err{background:#fde2e4;color:var(--err)}
.empty-banner{background:#fff8e6;border:1px solid #f2c94c;border-radius:8px;padding:16px 18px;
margin:16px 0;font-size:15px}
.cards{display:flex;flex-wrap:wrap;gap:16px}
figure.card{margin:0;background:var(--card);border:1px solid var(--line);border-radius:8px;
padding:12px 14px}
figure.card.wide{flex:1 1 100%}
figcaption{font-weight:650;font-size:15px;margin-bottom:6px}
figcaption .sub{font-weight:400;color:var(--muted);font-size:12.5px;margin-left:6px}
.pair{display:flex;flex-wrap:wrap;gap:18px}
svg{max-width:100%;height:auto;font-family:inherit}
svg text{fill:var(--fg)}
.tick{font-size:11px;fill:#4b5563}.tick.small{font-size:10px;fill:var(--muted)}
.axis-title{font-size:12px;fill:#374151}
line.axis{stroke:#6b7280;stroke-width:1}
line.grid{stroke:#e8ebef;stroke-width:1}
rect.hist-bar{fill:#7aa6d8;stroke:#3f73b0;stroke-width:.8}
rect.hist-bar:hover{fill:#4f86c6}
line.pct{stroke-width:1.6;stroke-dasharray:5 3}
line.pct.p50{stroke:#1f2937}line.pct.p99{stroke:#c2410c}
text.pct-label{font-size:12px;font-weight:600}
text.pct-label.p99,text.pct-tag.p99{fill:#c2410c}
text.pct-tag{font-size:10.5px;font-weight:600}
text.panel-label{font-size:11.5px;font-weight:600;fill:#4b5563}
rect.zoom-window{fill:#fde68a;fill-opacity:.22;stroke:#d4a72c;stroke-width:1;stroke-dasharray:3 2}
table.stats-table{align-self:flex-start;margin-top:40px}
table.stats-table th{background:none;font-size:12.5px;color:var(--muted);font-weight:500}
.pt{fill-opacity:.55;stroke-width:1.2}.pt:hover{fill-opacity:1}
.pt.median{fill-opacity:1}
.pt-key{fill:#9ca3af;stroke:#374151;stroke-width:1}
rect.spread-bar{fill-opacity:.28}
line.whisker{stroke:#1f2937;stroke-width:1.5}
path.bracket{fill:none;stroke:#9ca3af;stroke-width:1}
rect.plot-empty{fill:#fafbfc;stroke:#d1d5db;stroke-dasharray:6 4}
text.empty-text{font-size:15px;fill:var(--muted)}
table.data{border-collapse:collapse;margin-top:10px;font-size:13px;background:var(--card)}
table.data th,table.data td{border-bottom:1px solid var(--line);padding:4px 10px;
text-align:left;vertical-align:top}
table.data th{background:#f1f3f6;font-weight:600;font-size:12px;color:#374151}
.num{text-align:right!important;font-variant-numeric:tabular-nums;white-space:nowrap}
td.when{white-space:nowrap}
tr.bad td{background:#fff3f4}
.problem-cell{color:var(--err);max-width:480px}
details.index{margin:10px 0 18px}
details.index summary{cursor:pointer;font-weight:600}
.kv{margin:6px 0 0;color:#374151}.kv span{margin-right:14px}.kv b{color:var(--muted);
font-weight:600}
.note{color:var(--muted);font-size:12.5px;margin:6px 0}
.cap-note{background:#fff8e6;border:1px solid #f2c94c;border-radius:6px;padding:8px 12px}
.legend-box{background:var(--card);border:1px solid var(--line);border-radius:8px;
padding:8px 14px;margin:10px 0;position:sticky;top:0;z-index:2}
.legend-box h3{font-size:12px;color:var(--muted);text-transform:uppercase;margin:0 0 2px}
ul.legend{list-style:none;margin:0;padding:0;display:flex;flex-wrap:wrap;gap:2px 18px;
font-size:12.5px}
ul.legend li{display:flex;align-items:center;gap:6px}
ul.legend.inline{margin:0 0 4px}
section.episode{background:var(--card);border:1px solid var(--line);border-left:4px solid #9aa5b4;
border-radius:8px;padding:10px 14px 6px;margin:14px 0}
section.episode.bad{border-left-color:var(--err)}
section.episode{scroll-margin-top:96px}
section.episode h3 .num{color:var(--muted);font-weight:500;margin-right:4px}
section.episode h3 .epoch{color:#374151;font-weight:500;margin:0 4px}
section.episode h3 .latency{font-variant-numeric:tabular-nums;margin-left:4px}
.problems{color:var(--err);font-weight:600;margin-left:10px}
p.meta{margin:0 0 4px;color:#374151;font-size:12px}
p.meta span{margin-right:14px}p.meta b{color:var(--muted);font-weight:500}
.scroll{overflow-x:auto}
rect.lane-bg{fill:#fbfcfd}rect.lane-bg.alt{fill:#f2f4f7}
text.lane-label{font-size:12.5px;font-weight:600;fill:#374151}
line.guide{stroke:#374151;stroke-width:1;stroke-dasharray:4 3}
line.guide.end{stroke:#9aa5b4}
text.guide-label{font-size:11px;fill:#4b5563}
rect.span{stroke:rgba(0,0,0,.25);stroke-width:.6}
rect.span:hover{stroke:#111827;stroke-width:1.5}
rect.span.error{stroke:""" + ERROR_STROKE + """;stroke-width:2.2}
polygon.receipt{stroke:#fff;stroke-width:1.2}
""" + "".join(f"rect.k-{k}{{fill:{c}}}polygon.{k}{{fill:{c}}}" for k, (_, c) in KINDS.items())
