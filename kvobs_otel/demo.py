"""``kvobs-otel demo``: the real vLLM scheduler and OffloadingConnector under
KV pressure, with N rank processes and a CPU copy backend, observed and
exported. No GPU, no Docker, no network needed."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TextIO

from kvobs_otel.analysis.stats import percentile
from kvobs_otel.otlp_file import FileSpan, read_spans


@dataclass
class DemoOptions:
    ranks: int = 2
    requests: int = 12
    seed: int = 0
    max_steps: int = 5000
    out: str = "kvobs-demo.otlp.jsonl"
    otlp_endpoint: str | None = None
    start_method: str = "spawn"
    duration_s: float | None = None
    withhold_rank: int | None = None


def _export_env(opts: DemoOptions) -> dict[str, str]:
    env = {
        "KVOBS_OTEL_ENABLED": "1",
        "KVOBS_OTEL_TRACES_FILE": os.path.abspath(opts.out),
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "KVOBS_OTEL_DEVICE_TYPE": "cpu",
    }
    endpoint = opts.otlp_endpoint
    configured = any(os.environ.get(v) for v in (
        "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    elif not configured:
        # Embedded default: the file only.
        env["OTEL_TRACES_EXPORTER"] = "none"
        env["OTEL_METRICS_EXPORTER"] = "none"
    return env


class Progress:
    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self._last = 0.0
        self._last_done = -1

    def update(self, step: int, done: int, preemptions: int) -> None:
        now = time.monotonic()
        if not self.tty and (now - self._last < 2.0 or done == self._last_done) and (
                done < self.total or done == self._last_done):
            return
        self._last, self._last_done = now, done
        width = 30
        filled = width * done // max(1, self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, "
                f"step {step}, {preemptions} preemptions")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def run_demo(opts: DemoOptions, stream: TextIO = sys.stderr) -> dict:
    env = _export_env(opts)
    stall = (None if opts.withhold_rank is None
             else {"rank": opts.withhold_rank, "kind": "load"})
    if stall:
        # A withheld receipt must outlive its deadline before the run ends.
        env.setdefault("KVOBS_OTEL_RECEIPT_DEADLINE_S", "1")
    with open(env["KVOBS_OTEL_TRACES_FILE"], "w", encoding="utf-8"):
        pass  # one run, one file
    os.environ.update(env)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import kvobs_otel
    from kvobs_otel.harness.engine import Harness, HarnessConfig
    from kvobs_otel.harness.workload import pressure_workload
    from kvobs_otel.pipeline import current_pipeline

    kvobs_otel.instrument()
    stream.write(f"kvobs-otel demo: vLLM scheduler + {opts.ranks} rank processes, "
                 f"{opts.requests} requests, seed {opts.seed}\n")
    cfg = HarnessConfig(num_ranks=opts.ranks, rank_mode="process", seed=opts.seed,
                        extra_env=env, start_method=opts.start_method, stall=stall)
    dropped: dict[str, int] = {}
    with Harness(cfg) as h:
        pressure_workload(h, num_requests=opts.requests)
        bar = Progress(opts.requests, stream)
        step = idle = 0
        until = None if opts.duration_s is None else time.monotonic() + opts.duration_s
        while h.has_work() and step < opts.max_steps:
            if until is not None and time.monotonic() > until:
                stream.write(f"\nstopping after {opts.duration_s:g} s\n")
                break
            idle = 0 if h.step().executed else idle + 1
            step += 1
            bar.update(step, len(h.finished), len(h.preemptions))
            if idle >= 50:
                # Nothing computed for 50 steps: requests wait on receipts that
                # never come (a withheld rank). End the run rather than spin.
                stream.write("\nno progress for 50 steps (waiting on incomplete receipts)\n")
                break
        bar.close()
        if stall:
            time.sleep(1.5)  # let the receipt deadline pass while ranks still run
        pipeline = current_pipeline()
        if pipeline is not None:
            dropped = pipeline.drop_counts()
    kvobs_otel.uninstrument()
    spans = read_spans(env["KVOBS_OTEL_TRACES_FILE"])
    summary = summarize(spans)
    summary["dropped"] = dropped
    summary["file"] = env["KVOBS_OTEL_TRACES_FILE"]
    summary["steps"] = step
    return summary


def summarize(spans: list[FileSpan]) -> dict:
    roots = [s for s in spans if s.name == "kv.recovery"]
    latencies = [(s.end_ns - s.start_ns) / 1e6 for s in roots
                 if s.attributes.get("kvobs.outcome") == "recovered"]
    transfers: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for s in spans:
        if s.name == "kv.transfer" and s.attributes.get("kvobs.outcome") == "ok":
            key = (s.attributes.get("kvobs.direction", "?"), s.attributes.get("kvobs.rank", -1))
            transfers[key][0] += 1
            transfers[key][1] += int(s.attributes.get("kvobs.bytes") or 0)
    incomplete = [s for s in spans if s.name == "kv.job"
                  and s.attributes.get("kvobs.outcome") != "complete"]
    return {
        "episodes": dict(Counter(s.attributes.get("kvobs.outcome") for s in roots)),
        "max_epoch": max((s.attributes.get("kvobs.recovery.epoch", 0) for s in roots),
                         default=0),
        "recovery_ms_p50": percentile(latencies, 50),
        "recovery_ms_p99": percentile(latencies, 99),
        "transfers": {f"{d} rank {r}": {"count": c, "bytes": b}
                      for (d, r), (c, b) in sorted(transfers.items())},
        "incomplete_receipts": len(incomplete),
        "spans": len(spans),
    }


def format_summary(s: dict) -> str:
    lines = ["", "Recovery episodes: " + (", ".join(f"{n} {k}" for k, n in
                                                      sorted(s["episodes"].items()))
                                           or "none"),
             f"  highest epoch: {s['max_epoch']}"]
    if s["recovery_ms_p50"] is not None:
        lines.append(f"  recovery latency p50 {s['recovery_ms_p50']:.2f} ms, "
                     f"p99 {s['recovery_ms_p99']:.2f} ms")
    lines.append("Completed transfers:")
    for key, v in s["transfers"].items():
        lines.append(f"  {key}: {v['count']} transfers, {v['bytes']} bytes")
    lines.append(f"Incomplete receipts: {s['incomplete_receipts']}")
    lines.append("Dropped observations (scheduler process): "
                 + (", ".join(f"{k}={v}" for k, v in s["dropped"].items()) or "0"))
    lines.append(f"\n{s['spans']} spans written to {s['file']} (OTLP JSON, one export "
                 "request per line)")
    return "\n".join(lines)
