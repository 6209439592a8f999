"""B2: step time of the real vLLM scheduler + connector loop, per variant.

Each variant (benchmarks/b2_variant.py) runs in its own process: the harness
with inline ranks (scheduler, connectors and both ranks in one thread, so a
step's wall time is the whole engine step), the same seed and the same
heavy-offload workload (benchmarks/workload.py), repeated.

The processes of one block run in lockstep, ``CHUNK`` steps per turn, in an
order shuffled every round, and every process not having its turn is
SIGSTOPped. Comparing whole runs one after another is hopeless on a noisy
2-core machine (run-to-run speed varies by 15% and more); in lockstep, step i
of every variant runs within a fraction of a second of the others, and all
variants run exactly the same steps. Stopping the idle processes matters for
the enabled variant: its drain and export threads can then only run during
its own turns, competing with its own serving thread for the GIL, as they
would in vLLM. (With the 50 ms drain interval they run at least as often per
step as in a real process, since they catch up at the start of every turn.)

A process also has a speed of its own (a few percent, stable over its life:
the core it gets, its pages), so the repeats are spread over many blocks,
each with a freshly forked process per variant (from two zygote processes
that imported everything once), and every ratio is pooled over all blocks.
"""

from __future__ import annotations

import json
import random
import signal
import time
from statistics import median
from typing import Any

from benchmarks.b2_procs import ForkedChild, Zygote
from benchmarks.common import Goal, Result, Spread, paired_ratios, progress
from benchmarks.otlp_sink import OtlpSink

TIER_SUFFIX = "+fs"  # benchmarks/b2_variant.py: the variant with vLLM's fs tier
NAME = "B2"
TITLE = "step overhead on the real vLLM scheduler + connector loop"
CHUNK = 40  # steps per turn (~50 ms)
BLOCKS, REPS = 15, 2  # process sets, and workload repeats in each (full run)
TIER_EVERY = 3  # a tiered block before every third block (quick: one)


def _lockstep(children: dict[str, ForkedChild], rng: random.Random, strict: bool = True) -> int:
    """Turns of CHUNK steps until every variant is done. ``strict``: every
    variant runs exactly the same steps (not so with a secondary tier, whose
    asynchronous lookups answer when its threads got to it)."""
    rounds = 0
    names = list(children)
    while not all(c.done for c in children.values()):
        lengths = set()
        for name in rng.sample(names, len(names)):
            c = children[name]
            if c.done:
                continue
            c.signal(signal.SIGCONT)
            c.send({"cmd": "run", "steps": CHUNK})
            msg = c.read()
            c.signal(signal.SIGSTOP)
            c.ns.extend(msg["ns"])
            c.done = msg["done"]
            lengths.add((len(msg["ns"]), c.done))
        if strict and len(lengths) != 1:
            raise RuntimeError(f"B2: variants diverged in round {rounds}: {lengths}")
        rounds += 1
    return rounds


def _block(zygote: Zygote, variants: tuple[str, ...], reps: int, rng: random.Random,
           sink: OtlpSink, strict: bool = True
           ) -> tuple[dict[str, ForkedChild], dict[str, Any], int]:
    children: dict[str, ForkedChild] = {}
    try:
        for v in rng.sample(variants, len(variants)):  # no variant always forked first
            children[v] = zygote.fork(v, reps, sink.endpoint_for(v))
        ready = {v: c.read() for v, c in children.items()}
        for c in children.values():
            c.signal(signal.SIGSTOP)
        rounds = _lockstep(children, rng, strict)
        final = {v: {**children[v].finish(), "ready": ready[v]} for v in variants}
    finally:
        for c in children.values():
            c.kill()
    return {v: children[v] for v in variants}, final, rounds


def _split(ns: list[int], reps: list[dict[str, int]]) -> list[list[int]]:
    out, i = [], 0
    for r in reps:
        out.append(ns[i:i + r["steps"]])
        i += r["steps"]
    return out


def _compare(a: list[list[int]], b: list[list[int]], ns_a: list[int], ns_b: list[int]
             ) -> dict[str, Spread]:
    chunks_a = [sum(ns_a[i:i + CHUNK]) for i in range(0, len(ns_a), CHUNK)]
    chunks_b = [sum(ns_b[i:i + CHUNK]) for i in range(0, len(ns_b), CHUNK)]
    return {
        "median_step": Spread.of([median(x) / median(y) for x, y in zip(a, b, strict=True)]),
        "mean_step": Spread.of([sum(x) / sum(y) for x, y in zip(a, b, strict=True)]),
        "per_turn": Spread.of(paired_ratios(chunks_a, chunks_b)),
    }


def run(quick: bool) -> Result:
    t_start = time.monotonic()
    variants = ("uninstrumented", "enabled") if quick else (
        "uninstrumented", "disabled", "unobserved", "enabled", "in_process", "seams_only")
    blocks, reps = (1, 1) if quick else (BLOCKS, REPS)
    rng = random.Random(2)
    progress(f"B2: starting {1 if quick else 2} zygote process(es)")
    zygotes = [Zygote(quick) for _ in range(1 if quick else 2)]
    sink = OtlpSink()
    ns: dict[str, list[int]] = {v: [] for v in variants}
    tiered = tuple(v + TIER_SUFFIX for v in (variants[0] if quick else "disabled", "enabled"))
    tiered_reps: dict[str, list[list[int]]] = {v: [] for v in tiered}
    tiered_finals: list[dict[str, Any]] = []
    per_rep: dict[str, list[list[int]]] = {v: [] for v in variants}
    finals: list[dict[str, Any]] = []
    rounds = 0
    try:
        for z in zygotes:
            z.wait_ready()
        for b in range(blocks):
            if b % TIER_EVERY == 0:
                # The tiered pair, in a block of its own (its runs are not
                # step-for-step identical: see _lockstep).
                t_children, t_final, _n = _block(zygotes[b % len(zygotes)], tiered, reps, rng,
                                                 sink, strict=False)
                for v in tiered:
                    tiered_reps[v].extend(_split(t_children[v].ns, t_final[v]["reps"]))
                tiered_finals.append(t_final)
            children, final, n = _block(zygotes[b % len(zygotes)], variants, reps, rng, sink)
            rounds += n
            finals.append(final)
            summaries = {v: final[v]["reps"] for v in variants}
            if len({json.dumps(x, sort_keys=True) for x in summaries.values()}) != 1:
                raise RuntimeError(f"B2: the variants did not run the same workload: "
                                   f"{summaries}")
            for v in variants:
                ns[v].extend(children[v].ns)
                per_rep[v].extend(_split(children[v].ns, final[v]["reps"]))
            progress(f"B2: block {b + 1}/{blocks} done ({n} lockstep rounds)")
    finally:
        warnings = [w for z in zygotes for w in z.warnings()]
        for z in zygotes:
            z.close()
        sink.close()
    result = _result(variants, ns, per_rep, finals, sink.counts(), rounds, blocks, reps,
                     time.monotonic() - t_start)
    _tiered_result(result, tiered, tiered_reps, tiered_finals)
    result.data["kvobs_warnings"] = warnings
    result.info += [f"logged by a variant process: {w}" for w in warnings[:3]]
    return result


def _tiered_result(result: Result, tiered: tuple[str, ...],
                   per_rep: dict[str, list[list[int]]], finals: list[dict[str, Any]]) -> None:
    """The tiered pair's goal lines, beside the untiered ones (same run)."""
    base, enabled = tiered
    if not per_rep[enabled]:
        return
    tier_jobs = _timed_count(finals, enabled, "events_accepted")
    if tier_jobs <= 0:
        raise RuntimeError(f"B2: the {enabled} variant observed nothing")
    ratios = {
        "median_step": Spread.of([median(x) / median(y) for x, y in
                                  zip(per_rep[enabled], per_rep[base], strict=True)]),
        "mean_step": Spread.of([(sum(x) / len(x)) / (sum(y) / len(y)) for x, y in
                                zip(per_rep[enabled], per_rep[base], strict=True)]),
    }
    key = f"{enabled}/{base}"
    result.goals += [
        Goal(f"{key} step time (vLLM's fs tier), ratio of median steps per repeat",
             ratios["median_step"], "<=", 1.03),
        Goal(f"{key} step time (vLLM's fs tier), ratio of mean steps per repeat",
             ratios["mean_step"], "<=", 1.03)]
    steps = {v: [len(x) for x in per_rep[v]] for v in tiered}
    summaries = {v: [r for f in finals for r in f[v]["reps"]] for v in tiered}
    result.info.append(
        f"{key}: median steps {ratios['median_step'].text()}; mean steps "
        f"{ratios['mean_step'].median:.3f}; {len(finals)} tiered blocks; steps per repeat "
        f"{steps}; workload per repeat {summaries[enabled][:1]}; enabled+fs observed "
        f"{tier_jobs} events")
    result.data["tiered"] = {
        "variants": list(tiered), "ratios": {key: {m: vars(v) for m, v in ratios.items()}},
        "steps_per_rep": steps, "median_step_us": {
            v: median([n for x in per_rep[v] for n in x]) / 1e3 for v in tiered}}


def _sum_fields(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise sum of counters (numbers, lists of numbers, nested dicts)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, dict):
                out[k] = _sum_fields([out.get(k, {}), v])
            elif isinstance(v, list):
                prev = out.get(k, [0] * len(v))
                out[k] = [a + b for a, b in zip(prev, v, strict=True)]
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def _other_us(final: dict[str, Any], variant: str, steps: float) -> float:
    """One block's CPU per timed step outside the serving thread, in us."""
    c = final[variant]["cpu"]
    return (c["steps_process_ns"] - c["steps_serving_thread_ns"]) / steps / 1e3


def _timed_count(finals: list[dict[str, Any]], variant: str, key: str) -> int:
    """A counter's growth over the timed repeats (warm-ups excluded)."""
    return sum(f[variant]["after"].get(key, 0) - f[variant]["before"].get(key, 0)
               for f in finals)


def _result(variants: tuple[str, ...], ns: dict[str, list[int]],
            per_rep: dict[str, list[list[int]]], finals: list[dict[str, Any]],
            sink: dict[str, Any], rounds: int, blocks: int, reps: int, seconds: float
            ) -> Result:
    accepted = _timed_count(finals, "enabled", "events_accepted")
    enabled_after = _sum_fields([f["enabled"]["after"] for f in finals])
    spans = sink["spans"].get("enabled", {})
    if accepted <= 0 or sum(spans.values()) <= 0 or not spans.get("kv.recovery"):
        raise RuntimeError(f"B2: the enabled variant observed nothing ({accepted} events, "
                           f"spans {spans})")
    if "seams_only" in variants:
        # Same workload, same seams: the diagnostic must have offered exactly
        # what enabled recorded, or its ratio would not mean what it says.
        offered = _timed_count(finals, "seams_only", "events_offered")
        if offered != accepted:
            raise RuntimeError(f"B2: seams_only offered {offered} events, enabled "
                               f"recorded {accepted}")
    pairs = {f"{a}/{b}": _compare(per_rep[a], per_rep[b], ns[a], ns[b])
             for a, b in (("enabled", "disabled"), ("in_process", "disabled"),
                          ("enabled", "in_process"), ("disabled", "uninstrumented"),
                          ("unobserved", "uninstrumented"), ("enabled", "uninstrumented"),
                          ("seams_only", "disabled"), ("enabled", "seams_only"))
             if a in variants and b in variants}
    base = "disabled" if "disabled" in variants else "uninstrumented"
    e_key = f"enabled/{base}"
    goals = [Goal(f"enabled/{base} step time, ratio of median steps per repeat",
                  pairs[e_key]["median_step"], "<=", 1.03),
             Goal(f"enabled/{base} step time, ratio of mean steps per repeat",
                  pairs[e_key]["mean_step"], "<=", 1.03)]
    if "disabled/uninstrumented" in pairs:
        d = pairs["disabled/uninstrumented"]
        goals += [Goal("disabled/uninstrumented step time, ratio of median steps per repeat",
                       d["median_step"], "<=", 1.01),
                  Goal("disabled/uninstrumented step time, ratio of mean steps per repeat",
                       d["mean_step"], "<=", 1.01)]
    steps = len(ns[variants[0]])
    workload = finals[0][variants[0]]["reps"][0]
    by_block = [median(median(x) / median(y) for x, y in zip(per_rep["enabled"][i:i + reps],
                                                             per_rep[base][i:i + reps],
                                                             strict=True))
                for i in range(0, len(per_rep[base]), reps)]
    info = [f"{k}: median steps {v['median_step'].text()}; mean steps "
            f"{v['mean_step'].median:.3f}; per {CHUNK}-step turn {v['per_turn'].median:.3f}"
            for k, v in pairs.items()]
    info.append(f"{e_key} median-step ratio per block (one process set each): "
                + ", ".join(f"{r:.3f}" for r in by_block))
    info.append(f"workload per repeat: {workload}; {blocks} blocks x {reps} repeats, "
                f"{steps} steps per variant, {rounds} lockstep rounds")
    info.append(f"enabled observed {accepted} events ({accepted / steps:.2f}/step); the "
                f"OTLP sink received {sum(spans.values())} spans from it, warm-ups included "
                f"({spans.get('kv.recovery', 0)} kv.recovery); dropped "
                f"{enabled_after.get('events_dropped')}, errors "
                f"{sum(enabled_after.get('errors', {}).values())}")
    totals = {v: {k: _sum_fields([f[v][k] for f in finals]) for k in ("cpu", "gc")}
              for v in variants}
    for v in variants:
        cpu, g = totals[v]["cpu"], totals[v]["gc"]
        serving, process = cpu["steps_serving_thread_ns"], cpu["steps_process_ns"]
        info.append(f"{v}: median step {median(ns[v]) / 1e3:.0f} us; during the timed steps, "
                    f"CPU of the serving thread {serving / steps / 1e3:.0f} us/step, of other "
                    f"threads {(process - serving) / steps / 1e3:.0f} us/step; GC collections "
                    f"{g['collections']} taking {[round(x / 1e6) for x in g['ns']]} ms "
                    "(gen0, gen1, gen2; incl. rebuilds between repeats)")

    def cpu_us(v: str) -> tuple[float, float]:
        c = totals[v]["cpu"]
        serving = c["steps_serving_thread_ns"]
        return serving / steps / 1e3, (c["steps_process_ns"] - serving) / steps / 1e3

    # CPU time is less noisy than wall time here (processes running identical
    # code differ by ~0.1-2% of a step): the cost in absolute terms.
    (bs, bo), (es, eo) = cpu_us(base), cpu_us("enabled")
    # The vLLM process's other threads (drain, and in-process the export
    # stage and metric reader): what competes with vLLM for its GIL. Per
    # block, so the goal line shows a spread.
    others = [_other_us(f, "enabled", steps / blocks) - _other_us(f, base, steps / blocks)
              for f in finals]
    goals.append(Goal(f"enabled other threads' CPU per step over {base}, vLLM process",
                      Spread.of(others), "<=", 5.0, unit=" us", fmt=".1f"))
    line = (f"CPU per step over {base}: enabled serving thread {es - bs:+.0f} us "
            f"({(es - bs) / bs:+.1%}), other threads {eo - bo:+.1f} us")
    if "in_process" in variants:
        ps, po = cpu_us("in_process")
        line += (f"; in_process serving thread {ps - bs:+.0f} us, other threads "
                 f"{po - bo:+.1f} us")
    sidecar = totals["enabled"]["cpu"].get("children_ns", 0)
    line += (f"; the enabled variant's sidecars {sidecar / steps / 1e3:.0f} us/step "
             "(their own processes, start-up included)")
    if "seams_only" in variants:
        line += f"; seams_only serving thread {cpu_us('seams_only')[0] - bs:+.0f} us"
    info.append(line)
    data = {
        "chunk_steps": CHUNK, "blocks": blocks, "reps_per_block": reps, "rounds": rounds,
        "variants": list(variants), "workload_per_rep": workload,
        "ratios": {k: {m: vars(s) for m, s in v.items()} for k, v in pairs.items()},
        "enabled_over_base_by_block": by_block,
        "median_step_us": {v: median(ns[v]) / 1e3 for v in variants},
        "totals": totals, "enabled_events": accepted, "sink": sink,
        "blocks_detail": finals,
        "step_ns": ns,
    }
    return Result(NAME, TITLE, goals, info, data, seconds)
