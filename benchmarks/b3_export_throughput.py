"""B3: export throughput of one vLLM process to a real Collector on loopback.

A paced generator offers the worker seam's own event tuples (W_STEP,
W_SUBMIT, W_RESULT: one ``kv.transfer`` span per transfer) into the real
pipeline at the default buffer size; by default they go through the export
sidecar (pipe, lifecycle, builder, export stage, OTLP/HTTP exporter) to the
Collector built by .ci/otel-bins. Each rate step runs for a fixed time, then
everything is flushed: a step is clean when nothing was dropped anywhere
(serving buffer, pipe, export queue, export) and the Collector accepted
every span. Reported: the highest clean rate, where drops begin, and, side
by side at the goal rate, the in-process export path and the SDK's
BatchSpanProcessor with its default settings and encoder on the same
Collector.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, Goal, Result, Spread, progress
from kvobs_otel.tools.harness.server import free_port

GOAL = 40_000.0  # spans per second per process, zero drops
RATES = (10_000, 20_000, 30_000, 40_000, 50_000, 60_000, 80_000)
QUICK_RATES = (5_000, 40_000)
SIDECAR, IN_PROCESS, SDK_DEFAULT = "sidecar", "in-process", "sdk_default"

COLLECTOR = """
extensions:
  health_check: {{endpoint: "127.0.0.1:{health}"}}
receivers:
  otlp:
    protocols:
      http: {{endpoint: "127.0.0.1:{port}"}}
exporters:
  debug: {{verbosity: basic, sampling_initial: 1, sampling_thereafter: 100000}}
service:
  extensions: [health_check]
  telemetry:
    logs: {{level: warn}}
    metrics:
      readers:
        - pull: {{exporter: {{prometheus: {{host: 127.0.0.1, port: {telemetry}}}}}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [debug]}}
"""


def _collector_binary() -> str:
    path = os.environ.get("KVOBS_OTELCOL_BIN")
    if path and Path(path).exists():
        return path
    out = subprocess.run(["bash", str(Path(REPO_ROOT) / ".ci/otel-bins/build.sh")],
                         capture_output=True, text=True, check=True).stdout
    return re.search(r"^OTELCOL=(.+)$", out, re.M).group(1)  # type: ignore[union-attr]


class Collector:
    def __init__(self) -> None:
        self.port, health, self.telemetry = free_port(), free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="kvobs-b3-")
        cfg = Path(self.dir) / "collector.yaml"
        cfg.write_text(COLLECTOR.format(port=self.port, health=health, telemetry=self.telemetry))
        self.log = open(Path(self.dir) / "collector.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([_collector_binary(), f"--config={cfg}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{health}/", timeout=1)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"Collector did not start; log in {self.dir}") from None
                time.sleep(0.2)

    def accepted_spans(self) -> int:
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{self.telemetry}/metrics", timeout=5).read().decode()
        return int(sum(float(m) for m in re.findall(
            r"^otelcol_receiver_accepted_spans\S*\{[^}]*\} (\S+)$", text, re.M)))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


class _DropLog(logging.Handler):
    """Counts the SDK BatchSpanProcessor's per-span "Queue full" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Queue full" in record.getMessage():
            self.dropped += 1


def _step(rate: int, seconds: float, mode: str, collector: Collector) -> dict[str, Any]:
    """Offer ``rate`` transfers/s for ``seconds``; flush; count everything."""
    from kvobs_otel import identity
    from kvobs_otel.config import Settings
    from kvobs_otel.lifecycle import events as ev
    from kvobs_otel.lifecycle.worker_state import WorkerLifecycle
    from kvobs_otel.pipeline import close_pipeline, get_pipeline
    from kvobs_otel.telemetry import export
    from kvobs_otel.telemetry.providers import set_export_overrides

    export.STATS = export.ExportStats()
    drop_log = _DropLog()
    sdk_default = mode == SDK_DEFAULT
    if sdk_default:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        set_export_overrides(span_processor=lambda: BatchSpanProcessor(OTLPSpanExporter()))
        logging.getLogger("opentelemetry").addHandler(drop_log)
    accepted_before = collector.accepted_spans()
    # Default buffer and drain interval.
    pipeline = get_pipeline(Settings(enabled=True, export=SIDECAR if mode == SIDECAR
                                     else IN_PROCESS))
    gen = identity.new_generation()
    sched = identity.new_generation()
    consumer = pipeline.register((WorkerLifecycle, {"rank": 0, "worker_gen": gen}),
                                 {"kvobs.role": "worker", "kvobs.rank": 0})
    offer = pipeline.offer
    now = time.monotonic_ns
    tick_s = 0.01
    per_tick = max(1, round(rate * tick_s))
    job = 0
    t0 = time.monotonic()
    ticks = int(seconds / tick_s)
    for i in range(ticks):
        loads = tuple((job + k, f"req-{(job + k) // 8}", False, 16) for k in range(per_tick))
        offer((consumer, ev.W_STEP, now(), (sched, {}, {}, loads, (), ())))
        for j, _req, _s, _b in loads:
            offer((consumer, ev.W_SUBMIT, now(), j, True, True, False))
            offer((consumer, ev.W_RESULT, now(), j, True, 1 << 20, 0.001))
        job += per_tick
        # Pace: sleep until this tick's slot (the generator is the serving thread).
        lag = t0 + (i + 1) * tick_s - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    offered_s = time.monotonic() - t0
    pipeline.flush()
    link = pipeline.link
    close_pipeline()
    set_export_overrides(None, None)
    logging.getLogger("opentelemetry").removeHandler(drop_log)
    if link is not None:  # the sidecar's side, as it published it
        side = link.sidecar_counts()
        sent, dropped = side["exported"], {"export (sidecar)": side["dropped"]}
    else:
        sent, dropped, _ = export.STATS.snapshot()
    dropped.update(pipeline.own_drops())
    if sdk_default:
        dropped["sdk_queue_full"] = drop_log.dropped  # logged per span, counted nowhere
    # Wait until the Collector has everything sent, or stops receiving.
    accepted, last_change = -1, time.monotonic()
    while time.monotonic() - last_change < 3:
        now_accepted = collector.accepted_spans() - accepted_before
        if now_accepted != accepted:
            accepted, last_change = now_accepted, time.monotonic()
        if not sdk_default and accepted >= sent:
            break
        time.sleep(0.2)
    achieved = job / offered_s
    # End to end: every transfer offered must arrive as a span.
    lost = job - accepted
    return {"rate": rate, "mode": mode, "achieved_rate": round(achieved), "transfers": job,
            "exported": sent, "collector_accepted": accepted,
            "dropped": {k: v for k, v in dropped.items() if v}, "lost": lost,
            # our counters must explain every loss (never silent)
            "accounted": sdk_default or sum(dropped.values()) == lost,
            "clean": lost == 0 and achieved >= 0.97 * rate}


def run(quick: bool) -> Result:
    t_start = time.monotonic()
    result = Result("B3", "export throughput to a real Collector (one process, OTLP/HTTP)")
    saved = dict(os.environ)  # restored at the end: later benchmarks see a clean process
    os.environ.pop("OTEL_TRACES_EXPORTER", None)  # the real OTLP exporter this time
    os.environ["OTEL_METRICS_EXPORTER"] = "none"
    collector = Collector()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{collector.port}"
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
    seconds = 1.5 if quick else 5.0
    repeats = 1 if quick else 3
    steps: list[dict[str, Any]] = []
    try:
        best: list[float] = []
        first_drop: list[float] = []
        for r in range(repeats):
            clean_max = 0.0
            drop_at = float("nan")
            for rate in QUICK_RATES if quick else RATES:
                s = _step(rate, seconds, SIDECAR, collector)
                s["repeat"] = r
                steps.append(s)
                progress(f"B3 round {r + 1}/{repeats}: {rate}/s -> achieved "
                         f"{s['achieved_rate']}/s, lost {s['lost']}, dropped {s['dropped']}")
                if s["clean"]:
                    clean_max = max(clean_max, float(rate))
                elif drop_at != drop_at:  # first unclean rate of this round
                    drop_at = float(rate)
                    break
            best.append(clean_max)
            first_drop.append(drop_at)
        inproc = _step(int(GOAL), seconds, IN_PROCESS, collector)
        progress(f"B3 in-process export at {int(GOAL)}/s: lost {inproc['lost']}")
        sdk = _step(int(GOAL), seconds, SDK_DEFAULT, collector)
        progress(f"B3 SDK BatchSpanProcessor defaults at {int(GOAL)}/s: lost {sdk['lost']}")
    finally:
        collector.stop()
        os.environ.clear()
        os.environ.update(saved)
    result.goals.append(Goal("highest zero-drop span rate, through the sidecar",
                             Spread.of(best), ">=", GOAL, unit=" spans/s", fmt=".0f",
                             note="default buffer; loss counted anywhere from the serving "
                                  "buffer to the Collector's receiver"))
    ours_at_goal = [s for s in steps if s["rate"] == int(GOAL)]
    result.info.append("drops begin at: " + ", ".join(
        "none up to the highest rate tried" if d != d else f"{d:.0f} spans/s"
        for d in first_drop))
    if ours_at_goal:
        lost = ours_at_goal[0]["lost"]
        result.info.append(f"at {int(GOAL)} spans/s, side by side: kvobs-otel through the "
                           f"sidecar lost {lost} of {ours_at_goal[0]['transfers']}, in-process "
                           f"{inproc['lost']} of {inproc['transfers']}; the SDK's "
                           f"BatchSpanProcessor with default settings lost {sdk['lost']} of "
                           f"{sdk['transfers']}")
    result.data = {"steps": steps, "in_process_at_goal": inproc, "sdk_default_at_goal": sdk,
                   "seconds_per_step": seconds}
    result.seconds = time.monotonic() - t_start
    return result
