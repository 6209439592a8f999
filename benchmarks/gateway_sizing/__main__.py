"""python -m benchmarks.gateway_sizing: the driver (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import progress
from benchmarks.gateway_sizing.gateway import RawSink, servers_module
from benchmarks.gateway_sizing.ladders import memory_phase, throughput_phase
from benchmarks.gateway_sizing.plan import DEMO_ARGS, DEPLOY_CONFIG, FULL, QUICK, SCALE_RATES
from benchmarks.gateway_sizing.recording import default_recording, load_episodes, record_demo
from benchmarks.gateway_sizing.report import render, scaled, summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_sizing",
        description="Sizing of one gateway Collector (deploy/otel-collector.yaml, the "
                    "Go-built Collector): sustainable spans/s through its tail sampler, and "
                    "RSS per 1,000 open traces, with recorded kvobs-otel recovery episodes "
                    "re-sent over OTLP/gRPC with fresh ids; a scaled recommendation for "
                    "num_traces and memory. Figures are from this machine. Run from the "
                    "repository root.",
        epilog="Exit status: 0 measured, 2 could not run (or bad arguments).")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (about a minute, plus a first recording): small levels, "
                         "two short rate steps; the figures mean little")
    ap.add_argument("-o", "--output", default="gateway-sizing.json",
                    help="JSON results file (default: %(default)s)")
    ap.add_argument("--recording", type=Path,
                    help="OTLP JSON lines with kvobs-otel recovery episodes (default: made "
                         "once with `kvobs-otel demo " + " ".join(DEMO_ARGS) + "` and cached)")
    ap.add_argument("--rate", type=float, default=200.0,
                    help="new traces/s of the deployment to size for (default: %(default)g, "
                         "the config's expected_new_traces_per_sec)")
    ap.add_argument("--decision-wait", type=float, default=30.0,
                    help="decision_wait of that deployment, seconds (default: %(default)g, "
                         "the shipped default)")
    ap.add_argument("--num-shards", type=int, metavar="N",
                    help="tail_sampling.num_shards for this run (--set on the Collector's "
                         "command line; the shipped config leaves it at 1: one event loop "
                         "for ingest and decisions)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    extra = ([f"--set=processors::tail_sampling::num_shards={args.num_shards}"]
             if args.num_shards else [])
    t_start = time.monotonic()
    load_start = os.getloadavg()
    from benchmarks.__main__ import machine_info

    report: dict[str, Any] = {"schema": 1, "command": ["python", "-m", "benchmarks.gateway_sizing",
                                                       *(argv if argv is not None
                                                         else sys.argv[1:])],
                              "quick": args.quick, "machine": machine_info(),
                              "collector_args": extra,
                              "plan": plan.__dict__}
    try:
        path = args.recording or default_recording()
        provenance: dict[str, Any] = {"path": str(path)}
        if args.recording is None and not path.exists():
            provenance.update(record_demo(path))
        elif args.recording is None:
            provenance["command"] = ["kvobs-otel", "demo", *DEMO_ARGS, "-o", str(path)]
        with open(path, encoding="utf-8") as f:
            episodes, other = load_episodes(f)
        if not episodes:
            raise RuntimeError(f"{path}: no recovery episode (kv.recovery) in it")
        shapes = Counter(tuple(sorted(e.names.items())) for e in episodes)
        provenance.update(other, episodes=len(episodes),
                          spans_per_trace=[e.spans for e in episodes],
                          bytes_per_trace=[len(e.data) for e in episodes],
                          shapes={" ".join(f"{n}x{k}" for k, n in shape): c
                                  for shape, c in shapes.items()})
        report["recording"] = provenance
        progress(f"{len(episodes)} episodes from {path}: "
                 f"{statistics.fmean(e.spans for e in episodes):.1f} spans/trace, "
                 f"{statistics.fmean(len(e.data) for e in episodes):.0f} bytes/trace "
                 f"(uncompressed OTLP); load average {load_start[0]:.2f}")
        log_dir = Path(tempfile.mkdtemp(prefix="kvobs-gateway-sizing-"))
        sink = RawSink()
        try:
            progress(f"throughput: steps of {plan.step_s:g} s, decision_wait "
                     f"{plan.throughput_wait_s} s")
            throughput = throughput_phase(plan, episodes, sink, log_dir, extra)
            progress(f"memory: levels {plan.levels} open traces, decision_wait "
                     f"{plan.memory_wait_s} s")
            mem = memory_phase(plan, episodes, sink, log_dir, extra)
        finally:
            sink.close()
        report["collector"] = {"binary": str(servers_module().built_binary("OTELCOL")),
                               "config": str(DEPLOY_CONFIG), "logs": str(log_dir)}
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError, TimeoutError) as e:
        first = str(e).splitlines()[0] if str(e) else repr(e)
        print(f"gateway sizing could not run: {first}", file=sys.stderr)
        if str(e).count("\n"):  # a Collector's or the demo's log tail
            progress(str(e))
        return 2
    load_end = os.getloadavg()
    summary = summarize(episodes, throughput, mem)
    (rec,) = scaled(summary, [args.rate], args.decision_wait)
    report.update(throughput=throughput, memory=mem, summary=summary, recommendation=rec,
                  scaled=scaled(summary, SCALE_RATES, args.decision_wait),
                  load_average_start=load_start, load_average_end=load_end,
                  seconds=round(time.monotonic() - t_start, 1))
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(render(report))
    print(f"results in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
