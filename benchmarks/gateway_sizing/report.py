"""The summary, the scaled recommendation and the rendered tables."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.gateway_sizing.fit import fit_line, shipped_settings, size_gateway
from benchmarks.gateway_sizing.plan import HEADROOM
from benchmarks.gateway_sizing.recording import Episode


# -- main -------------------------------------------------------------------------------
def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarize(episodes: Sequence[Episode], throughput: dict[str, Any],
              mem: dict[str, Any]) -> dict[str, Any]:
    spans_per_trace = statistics.fmean(e.spans for e in episodes)
    best_by_round, unclean_by_round, cores_at_best = [], [], []
    per_cpu: list[float] = []
    for rnd in throughput["rounds"]:
        clean = [s for s in rnd["steps"] if s["clean"]]
        unclean = [s for s in rnd["steps"] if not s["clean"]]
        best = max(clean, key=lambda s: s["offered_spans_per_s"]) if clean else None
        best_by_round.append(best["offered_spans_per_s"] if best else 0)
        cores_at_best.append(best["gateway_cores_while_sending"] if best else None)
        first = min(unclean, key=lambda s: s["offered_spans_per_s"]) if unclean else None
        unclean_by_round.append(
            {"spans_per_s": first["offered_spans_per_s"],
             "checks": [k for k, v in first["checks"].items() if not v],
             "export_latency_ms_p99": first["send"]["latency_ms_p99"]} if first else None)
        # Per-span CPU at low rates is blurred by the idle cost subtracted;
        # the loaded steps tell the cost at work.
        per_cpu += [s["spans_per_gateway_cpu_s"] for s in clean
                    if s["spans_per_gateway_cpu_s"] and s["offered_spans_per_s"] >= 10_000]
    xs = [r["open_traces"] / 1000 for r in mem["readings"]]
    rss_fit = fit_line(xs, [r["rss_mib"] for r in mem["readings"]])
    heap_fit = fit_line(xs, [r["heap_alloc_mib"] for r in mem["readings"]])
    return {
        "spans_per_trace": round(spans_per_trace, 2),
        # the lowest round's: what one gateway sustained every time here
        "highest_clean_spans_per_s": min(best_by_round),
        "highest_clean_spans_per_s_by_round": best_by_round,
        "first_unclean_by_round": unclean_by_round,
        "gateway_cores_at_highest_clean_by_round": cores_at_best,
        "spans_per_gateway_cpu_s": round(statistics.median(per_cpu)) if per_cpu else None,
        "spans_per_gateway_cpu_s_range": [min(per_cpu), max(per_cpu)] if per_cpu else None,
        "idle_gateway_cores": round(statistics.fmean(
            r["idle_gateway_cores"] for r in throughput["rounds"]), 4),
        "rss_mib_per_1k_open_traces": round(rss_fit["slope"], 3),
        "rss_base_mib": round(rss_fit["intercept"], 1), "rss_fit_r2": round(rss_fit["r2"], 4),
        "rss_idle_mib": mem["readings"][0]["rss_mib"],
        "heap_mib_per_1k_open_traces": round(heap_fit["slope"], 3),
        # the Go heap swings with GC timing; a fitted base below the idle heap
        # would understate small gateways
        "heap_base_mib": round(max(heap_fit["intercept"], mem["readings"][0]["heap_alloc_mib"]),
                               1),
        "heap_fit_r2": round(heap_fit["r2"], 4),
        # MiB per 1,000 traces -> KiB per span (for other tensor-parallel sizes)
        "rss_kib_per_open_span": round(rss_fit["slope"] * 1024 / 1000 / spans_per_trace, 3),
        "rss_at_top_level_mib": mem["readings"][-1]["rss_mib"],
        "rss_after_decisions_mib": mem["after_decisions"]["rss_mib"],
        "entries_kept_after_decisions": mem["after_decisions"]["traces_on_memory"],
    }


def scaled(summary: dict[str, Any], rates: Sequence[float], wait_s: float,
           headroom: float = HEADROOM) -> list[dict[str, float]]:
    shipped = shipped_settings()
    soft = (shipped["limit_percentage"] - shipped["spike_limit_percentage"]) / 100
    return [size_gateway(r, wait_s, summary["spans_per_trace"],
                         summary["rss_mib_per_1k_open_traces"], summary["rss_base_mib"],
                         summary["spans_per_gateway_cpu_s"] or math.nan,
                         headroom, summary["idle_gateway_cores"],
                         summary["heap_mib_per_1k_open_traces"], summary["heap_base_mib"],
                         soft, summary["highest_clean_spans_per_s"] or math.inf)
            for r in rates]



def render(report: dict[str, Any]) -> str:
    s, rec = report["summary"], report["recommendation"]
    rows = [["round", "offered spans/s", "achieved", "gateway cores", "sender cores",
             "spans/gw CPU-s", "export p99 ms", "drain s", "RSS MiB", "clean"]]
    for i, st in ((i, st) for i, rnd in enumerate(report["throughput"]["rounds"])
                  for st in rnd["steps"]):
        rows.append([str(i + 1), f"{st['offered_spans_per_s']:,}",
                     f"{st['achieved_spans_per_s']:,}",
                     f"{st['gateway_cores_while_sending']:.2f}",
                     f"{st['sender_process_cores_while_sending']:.2f}",
                     f"{st['spans_per_gateway_cpu_s'] or 0:,}",
                     f"{st['send']['latency_ms_p99']}", f"{st['drain_s']:.1f}",
                     f"{st['rss_mib_end']:.0f}",
                     "yes" if st["clean"] else "NO: " + ",".join(
                         k for k, v in st["checks"].items() if not v)])
    mrows = [["open traces", "spans", "RSS MiB", "otelcol rss MiB", "Go heap MiB"]]
    for r in report["memory"]["readings"]:
        mrows.append([f"{r['open_traces']:,}", f"{r['spans']:,}", f"{r['rss_mib']:.1f}",
                      f"{r['otelcol_process_memory_rss_mib']:.1f}",
                      f"{r['heap_alloc_mib']:.1f}"])
    srows = [["new traces/s", "decision_wait s", "gateways", "open traces", "num_traces",
              "RSS MiB", "heap MiB", "container MiB", "spans/s", "cores"]]
    for x in report["scaled"]:
        srows.append([f"{x['new_traces_per_s']:,.0f}", f"{x['decision_wait_s']:g}",
                      f"{x['gateways']}",
                      f"{x['open_traces']:,.0f}", f"{x['num_traces']:,}",
                      f"{x['memory_mib']:,.0f}", f"{x['heap_mib']:,.0f}",
                      f"{x['container_limit_mib']:,.0f}", f"{x['spans_per_s']:,.0f}",
                      f"{x['cores']:.2f}"])
    la0, la1 = report["load_average_start"], report["load_average_end"]
    after = report["memory"]["after_decisions"]
    return "\n".join([
        f"Gateway sizing (deploy/otel-collector.yaml on the Go-built Collector; this machine: "
        f"{report['machine']['cpu_count']} cores, shared; load average {la0[0]:.2f} at start, "
        f"{la1[0]:.2f} at end)",
        f"Traces: {report['recording']['episodes']} recorded recovery episodes re-sent with "
        f"fresh ids, {s['spans_per_trace']} spans/trace",
        "", _table(rows), "", _table(mrows), "",
        f"sustained (clean) up to {s['highest_clean_spans_per_s']:,} spans/s in every round "
        f"(by round: {s['highest_clean_spans_per_s_by_round']}; first unclean: "
        + "; ".join(f"{u['spans_per_s']:,} ({', '.join(u['checks'])}, export p99 "
                    f"{u['export_latency_ms_p99']} ms)" if u else "none"
                    for u in s["first_unclean_by_round"])
        + "), the sender on the same 2 cores",
        f"gateway CPU: {s['spans_per_gateway_cpu_s'] or 0:,} spans per CPU-second (median of the "
        f"loaded clean steps, range {s['spans_per_gateway_cpu_s_range']}), idle "
        f"{s['idle_gateway_cores']:.3f} cores",
        f"memory: {s['rss_mib_per_1k_open_traces']:.2f} MiB RSS per 1,000 open traces "
        f"({s['spans_per_trace']} spans each, {s['rss_kib_per_open_span']:.2f} KiB per span; "
        f"r2 {s['rss_fit_r2']}), base {s['rss_base_mib']:.0f} MiB; Go heap "
        f"{s['heap_mib_per_1k_open_traces']:.2f} MiB per 1,000",
        f"after the decisions: RSS {after['rss_mib']:.0f} MiB, "
        f"{after['traces_on_memory']:,.0f} decided entries still held (no decision cache)",
        "", _table(srows), "",
        "(per gateway from 'open traces' on; gateways = spans/s over the rate one sustained)",
        "",
        f"For {rec['new_traces_per_s']:g} new traces/s and decision_wait "
        f"{rec['decision_wait_s']:g} s (x{rec['headroom']:g} headroom), "
        f"{rec['gateways']} gateway(s), each: num_traces >= "
        f"{rec['num_traces']:,}, memory ~ {rec['memory_mib']:.0f} MiB "
        f"({s['rss_mib_per_1k_open_traces']:.2f} x {rec['num_traces'] / 1000:g} + "
        f"{s['rss_base_mib']:.0f}), container limit >= {rec['container_limit_mib']:.0f} MiB "
        f"(memory_limiter refuses data once the Go heap passes limit - spike of it), "
        f"{rec['spans_per_s']:,.0f} spans/s ~ {rec['cores']:.2f} cores (figures from this "
        f"machine)",
    ])
