"""The arithmetic: a least-squares line and the gateway's size for a rate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.gateway_sizing.plan import DEPLOY_CONFIG, HEADROOM


# -- arithmetic -------------------------------------------------------------------------
def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares y = slope * x + intercept, with r^2."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept,
            "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def shipped_settings(path: Path = DEPLOY_CONFIG) -> dict[str, float]:
    """The gateway settings the sizing depends on, from the shipped config."""
    import yaml

    procs = yaml.safe_load(path.read_text())["processors"]
    ml, ts = procs["memory_limiter"], procs["tail_sampling"]
    return {"num_traces": ts["num_traces"],
            "limit_percentage": ml["limit_percentage"],
            "spike_limit_percentage": ml["spike_limit_percentage"]}


def size_gateway(new_traces_per_s: float, decision_wait_s: float, spans_per_trace: float,
                 mib_per_1k_traces: float, base_mib: float, spans_per_core_s: float,
                 headroom: float = HEADROOM, idle_cores: float = 0.0,
                 heap_mib_per_1k_traces: float = 0.0, heap_base_mib: float = 0.0,
                 soft_limit_fraction: float = 0.6,
                 sustained_spans_per_s: float = math.inf) -> dict[str, float]:
    """One gateway's settings for R new traces/s and decision_wait W:
    num_traces >= R x W x headroom; memory ~ slope x num_traces/1000 + base
    (every slot holding an open trace: the bound to give the container, as
    v0.161.0 fills every slot, decided entries included); cores = idle +
    spans/s over the spans per CPU-second measured. memory_limiter refuses
    data once the Go heap passes (limit - spike) of the container's memory
    (``soft_limit_fraction``), so the container needs the heap bound over
    that fraction too. Past the rate one gateway sustained, the traffic is
    spread over ``gateways`` (by trace id): the figures are per gateway."""
    spans_total = new_traces_per_s * spans_per_trace
    gateways = max(1, math.ceil(spans_total / sustained_spans_per_s))
    new_traces_per_s /= gateways
    num_traces = math.ceil(new_traces_per_s * decision_wait_s * headroom)
    spans_per_s = new_traces_per_s * spans_per_trace
    rss = base_mib + mib_per_1k_traces * num_traces / 1000
    heap = heap_base_mib + heap_mib_per_1k_traces * num_traces / 1000
    return {"new_traces_per_s": new_traces_per_s * gateways, "gateways": gateways,
            "per_gateway_new_traces_per_s": new_traces_per_s,
            "decision_wait_s": decision_wait_s, "headroom": headroom, "num_traces": num_traces,
            "open_traces": new_traces_per_s * decision_wait_s,
            "memory_mib": rss, "heap_mib": heap,
            "container_limit_mib": max(rss, heap / soft_limit_fraction),
            "spans_per_s": spans_per_s, "cores": idle_cores + spans_per_s / spans_per_core_s}
