"""The two phases: throughput ladders of rising spans/s and the memory
levels of open traces."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import progress
from benchmarks.gateway_sizing.gateway import Gateway, RawSink, counter_delta, counters
from benchmarks.gateway_sizing.plan import Plan
from benchmarks.gateway_sizing.recording import Episode
from benchmarks.gateway_sizing.sender import Sender, wait_until


# -- phases -----------------------------------------------------------------------------
def _step(gw: Gateway, sender: Sender, rate: int, plan: Plan,
          idle_cores: float) -> dict[str, Any]:
    """Offer ``rate`` spans/s for ``plan.step_s``, wait for every span to
    reach the sink, judge the step by the gateway's own counts."""
    c0, cpu0, own0, t0 = counters(gw.metrics()), gw.cpu_s(), time.process_time(), time.monotonic()
    s = sender.run(rate=rate, seconds=plan.step_s)
    cpu_sent, own_sent = gw.cpu_s(), time.process_time()
    ok_spans = s.spans - s.failed_spans
    # Every episode is kept (the recovery-episodes policy): all spans must
    # reach the sink once decision_wait has passed for the last trace.
    delivered, drain_s = wait_until(
        lambda: counters(gw.metrics())["delivered"] - c0["delivered"] >= ok_spans,
        plan.throughput_wait_s + 15)
    c1, cpu1, t1 = counters(gw.metrics()), gw.cpu_s(), time.monotonic()
    d = counter_delta(c0, c1)
    # The gateway's CPU for these spans: the whole step (receive, decide,
    # export) less what it spends idle (ticks, span metrics flushes, scrapes).
    marginal = (cpu1 - cpu0) - idle_cores * (t1 - t0)
    achieved = s.achieved
    margin_s = 5.0  # the 1 s decision tick, the 1 s batch timeout, our polling
    checks = {
        "rate_achieved": achieved >= 0.97 * rate,
        "nothing_refused": s.failed_spans == 0 and d["refused"] == 0,
        "all_accepted": d["accepted"] == s.spans,
        "all_decided": d["decided"] >= s.traces,
        "all_delivered": delivered and d["delivered"] >= ok_spans,
        "decisions_in_time": drain_s <= plan.throughput_wait_s + margin_s,
        "none_evicted_undecided": d["dropped_too_early"] == 0,
        "export_ok": d["export_failed"] == 0,
    }
    return {
        "offered_spans_per_s": rate, "achieved_spans_per_s": round(achieved),
        "send": s.as_json(), "drain_s": round(drain_s, 2), "seconds": round(t1 - t0, 2),
        "gateway_cpu_s": round(cpu1 - cpu0, 2),
        "gateway_cores_while_sending": round((cpu_sent - cpu0) / s.seconds, 3),
        "sender_process_cores_while_sending": round((own_sent - own0) / s.seconds, 3),
        "spans_per_gateway_cpu_s": round(s.spans / marginal) if marginal > 0 else None,
        "rss_mib_end": round(gw.rss_mib(), 1),
        "tick_ms_mean": round(d["tick_ms_sum"] / d["ticks"], 1) if d["ticks"] else None,
        "ticks_over_1s": d["tick_over_1s"],
        "counters": {k: round(v, 1) for k, v in d.items()},
        "checks": checks, "clean": all(checks.values()), "load_average": os.getloadavg(),
    }


def throughput_phase(plan: Plan, episodes: Sequence[Episode], sink: RawSink,
                     log_dir: Path, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """``plan.rounds`` rising ladders, each on a fresh gateway: on a shared
    machine one ladder's limit is one sample."""
    rounds = []
    for r in range(plan.rounds):
        progress(f"throughput round {r + 1}/{plan.rounds}")
        rounds.append(_ladder(plan, episodes, sink, log_dir, extra_args, seed=10 + r))
    return {"rounds": rounds}


def _ladder(plan: Plan, episodes: Sequence[Episode], sink: RawSink, log_dir: Path,
            extra_args: Sequence[str], seed: int) -> dict[str, Any]:
    gw = Gateway(sink.port, plan.throughput_wait_s, log_dir, extra_args)
    sender = Sender(gw.endpoint, episodes, seed=seed)
    steps: list[dict[str, Any]] = []
    try:
        time.sleep(2)  # past start-up work
        cpu0, t0 = gw.cpu_s(), time.monotonic()
        time.sleep(plan.idle_s)
        idle_cores = (gw.cpu_s() - cpu0) / (time.monotonic() - t0)
        progress(f"throughput: idle gateway {idle_cores:.3f} cores")
        rates = list(plan.rates)
        refined = False
        while rates:
            rate = rates.pop(0)
            step = _step(gw, sender, rate, plan, idle_cores)
            steps.append(step)
            failed = [k for k, v in step["checks"].items() if not v]
            progress(f"throughput {rate:>6}/s: achieved {step['achieved_spans_per_s']:,}/s, "
                     f"gateway {step['gateway_cores_while_sending']:.2f} cores, sender "
                     f"{step['sender_process_cores_while_sending']:.2f} "
                     f"({step['spans_per_gateway_cpu_s']} spans per gateway CPU-s), export "
                     f"p99 {step['send']['latency_ms_p99']} ms, all delivered "
                     f"{step['drain_s']:.1f} s after the last send, "
                     f"{'NOT clean: ' + ', '.join(failed) if failed else 'clean'}")
            if failed:
                clean = [st["offered_spans_per_s"] for st in steps if st["clean"]]
                # One step between the last clean rate and this one.
                if clean and not refined and rate - clean[-1] > 0.2 * rate:
                    rates = [int(round((clean[-1] + rate) / 2, -3))]
                    refined = True
                    continue
                break
    finally:
        sender.close()
        gw.stop()
    return {"idle_gateway_cores": round(idle_cores, 4), "steps": steps}


def _rss_reading(gw: Gateway, reads: int = 3) -> dict[str, float]:
    rss, heap, prss = [], [], []
    for i in range(reads):
        if i:
            time.sleep(0.5)
        c = counters(gw.metrics())
        rss.append(gw.rss_mib())
        heap.append(c["heap_alloc_mib"])
        prss.append(c["rss_mib"])
    c = counters(gw.metrics())
    return {"rss_mib": round(statistics.median(rss), 2),
            "otelcol_process_memory_rss_mib": round(statistics.median(prss), 2),
            "heap_alloc_mib": round(statistics.median(heap), 2),
            "traces_on_memory": c["on_memory"], "decided": c["decided"],
            "accepted_spans": c["accepted"]}


def memory_phase(plan: Plan, episodes: Sequence[Episode], sink: RawSink,
                 log_dir: Path, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    gw = Gateway(sink.port, plan.memory_wait_s, log_dir, extra_args)
    sender = Sender(gw.endpoint, episodes, seed=2)
    readings: list[dict[str, Any]] = []
    fill: dict[str, Any] = {}
    try:
        time.sleep(3)  # start-up allocations settle
        t_first: float | None = None
        sent_traces = sent_spans = 0
        for level in plan.levels:
            if level > sent_traces:
                if t_first is None:
                    t_first = time.monotonic()
                s = sender.run(traces=level - sent_traces)
                if s.failed_spans:
                    raise RuntimeError(f"the gateway refused spans while filling: {s.errors}")
                sent_traces += s.traces
                sent_spans += s.spans
                fill = s.as_json()
                def held(spans: int = sent_spans, traces: int = sent_traces) -> bool:
                    c = counters(gw.metrics())
                    return c["accepted"] >= spans and c["on_memory"] >= traces

                if not wait_until(held, 30)[0]:
                    raise RuntimeError(f"the gateway did not hold {sent_traces} traces")
                time.sleep(2)  # the tick records traces_on_memory; let GC catch up
            r = _rss_reading(gw)
            r.update(open_traces=sent_traces, spans=sent_spans,
                     fill=fill if level else None,
                     seconds_since_first=round(time.monotonic() - t_first, 1)
                     if t_first else 0.0)
            if r["decided"]:
                raise RuntimeError(f"decisions began at {sent_traces} traces "
                                   f"({r['seconds_since_first']} s): raise memory_wait_s")
            readings.append(r)
            progress(f"memory: {sent_traces:>6} open traces ({sent_spans} spans): RSS "
                     f"{r['rss_mib']:.1f} MiB, Go heap {r['heap_alloc_mib']:.1f} MiB, "
                     f"tail sampler holds {r['traces_on_memory']:.0f}")
        # After the decisions: what stays until num_traces newer traces evict it.
        progress(f"memory: waiting for the decisions (decision_wait {plan.memory_wait_s} s)")
        wait_until(lambda: counters(gw.metrics())["decided"] >= sent_traces,
                   plan.memory_wait_s + 30, interval=1.0)
        wait_until(lambda: counters(gw.metrics())["delivered"] >= sent_spans, 30)
        time.sleep(5)
        after = _rss_reading(gw)
        after.update(decided_traces=after["decided"], open_traces=0)
        progress(f"memory: after the decisions: RSS {after['rss_mib']:.1f} MiB, Go heap "
                 f"{after['heap_alloc_mib']:.1f} MiB, entries kept "
                 f"{after['traces_on_memory']:.0f}")
    finally:
        sender.close()
        gw.stop()
    return {"readings": readings, "after_decisions": after}
