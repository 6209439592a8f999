"""B2 child processes: one variant of the engine loop, stepped on command.

``python -m benchmarks.b2_variant --zygote [--quick]`` imports vLLM, torch,
the harness and OpenTelemetry once, then forks a fresh process per variant
and block on command (``{"cmd": "fork", ...}``), so the coordinator
(b2_step_overhead) can afford many independent process sets: a process's
speed differs from another's by a few percent for reasons of its own (the
core it runs on, its pages), which only averages out over many processes.

A forked child talks over two FIFOs (one JSON object per line): it builds
its variant, runs the workload once untimed (warm-up), replies
``{"ready": ...}``, then for every ``{"cmd": "run", "steps": K}`` runs the
next K steps of its repeats and replies their wall times;
``{"cmd": "finish"}`` closes everything, replies the counters and exits. The
coordinator keeps it SIGSTOPped while another variant has its turn.

Variants (what a user gets):

- ``uninstrumented``: stock OffloadingConnector, nothing patched (the
  harness still loads vLLM's plugins, ours included: default-off, a no-op).
- ``disabled``: the explicit ``KvobsOffloadingConnector`` with
  KVOBS_OTEL_ENABLED=0; its constructor calls instrument(), which patches
  nothing. (The plugin with observation off is the uninstrumented variant.)
- ``unobserved``: classes patched but the connectors built before, so every
  wrapper finds no seams: the worst case of "patched, not observed".
- ``enabled``: instrument(Settings(enabled=True)) before the harness, with
  OTLP/HTTP export configured the standard way (OTEL_* variables) to the
  coordinator's loopback sink (benchmarks/otlp_sink.py): seams, bounded
  buffer, a drain thread every 50 ms pickling events into the export
  sidecar's pipe; the sidecar builds, encodes and sends spans and metrics
  with kvobs-otel's own export stage, as in a deployment.
- ``in_process``: the same with KVOBS_OTEL_EXPORT=in-process: the drain
  thread builds, encodes and exports in the vLLM process (the previous
  default, kept as a setting).
- ``seams_only`` (diagnostic, not a product setting): enabled, but the
  buffer counts each offered event and discards it, so the drain and export
  threads idle. ``seams_only`` over ``disabled`` is what the seams cost the
  serving thread (wrappers, tuples, the step metadata's extension and its
  pickling); ``enabled`` over ``seams_only`` is what keeping, draining and
  exporting the events adds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import IO, Any

from benchmarks.common import apply_clean_env, protocol_stream, reply, single_thread_torch
from benchmarks.workload import QUICK_SHAPE, HeavyOffload, WorkloadShape, harness_config

VARIANTS = ("uninstrumented", "disabled", "unobserved", "enabled", "in_process", "seams_only")
# "<variant>+fs": the same with vLLM's TieringOffloadingSpec and its fs tier
# behind a CPU tier too small for the working set (promotions, cascades and
# waits on every repeat).
TIER_SUFFIX = "+fs"
TIER_CPU_CHUNKS = 16
EXPLICIT = {"connector": "KvobsOffloadingConnector",
            "connector_module_path": "kvobs_otel.connector",
            "extra_env": {"KVOBS_OTEL_ENABLED": "0"}}


class GcClock:
    """Collections and the time spent in them, per generation."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.ns = [0, 0, 0]
        self._t0 = 0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.ns[g] += time.perf_counter_ns() - self._t0

    def snapshot(self) -> dict[str, list[int]]:
        return {"collections": list(self.count), "ns": list(self.ns)}


class Variant:
    def __init__(self, name: str, shape: WorkloadShape, endpoint: str) -> None:
        import kvobs_otel
        from kvobs_otel.config import Settings

        name, plus, tier = name.partition("+")
        self.tier = tier if plus else None
        self.name, self.shape = name, shape
        self.kvobs = kvobs_otel
        self.settings = Settings(enabled=True,
                                 export="in-process" if name == "in_process" else "sidecar")
        self.observing = name in ("enabled", "in_process", "seams_only")
        self.discarded = 0
        if self.observing:
            # What a user configures: OTLP/HTTP to an endpoint (the
            # coordinator's sink), traces and metrics.
            os.environ.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
        if name == "seams_only":
            # Diagnostic: every event the seams offer is counted and dropped
            # on arrival (the pipeline binds EventBuffer.offer when the first
            # connector attaches, after this).
            from kvobs_otel.buffer import EventBuffer

            def discard(buffer: EventBuffer, event: tuple[Any, ...]) -> bool:
                self.discarded += 1
                return True

            EventBuffer.offer = discard  # type: ignore[method-assign]
        if self.observing and not kvobs_otel.instrument(self.settings):
            raise RuntimeError("instrument(Settings(enabled=True)) did not activate")

    def build(self) -> HeavyOffload:
        from kvobs_otel.pipeline import current_pipeline
        from kvobs_otel.tools.harness import Harness

        k = self.kvobs
        if self.name == "unobserved" and k.is_instrumented():
            k.uninstrument()  # so the next harness is built unpatched
        tiered = ({"tier": self.tier, "num_cpu_chunks": TIER_CPU_CHUNKS} if self.tier else {})
        h = Harness(harness_config(self.shape, **(EXPLICIT if self.name == "disabled" else {}),
                                   **tiered))
        # The harness's variables for the whole process: no variant then sets
        # any per call (disabled has one more than the others).
        os.environ.update(h.env)
        # (getattr, not __dict__: reading an instance's __dict__ turns its
        # attributes into a dict CPython 3.11 no longer specializes loads of,
        # vLLM's included, for the rest of the run)
        observed = getattr(h.scheduler.connector, "_kvobs", None) is not None
        # Each variant must really be what it claims, or B2 measures nothing.
        ok = observed == self.observing
        if self.name == "unobserved":
            ok = ok and k.instrument(self.settings) and current_pipeline() is None
        elif not self.observing:
            ok = ok and not k.is_instrumented()
        if not ok:
            h.close()
            raise RuntimeError(f"{self.name} variant: unexpected instrumentation state")
        return HeavyOffload(h, self.shape)

    def counters(self) -> dict[str, Any]:
        from kvobs_otel.pipeline import current_pipeline

        p = current_pipeline()
        out: dict[str, Any] = {}
        if self.name == "seams_only":
            out = {"events_offered": self.discarded}
        elif p is not None:
            out = {"events_accepted": p.buffer.accepted, "events_dropped": p.drop_counts(),
                   "errors": p.error_counts()}
        return out

    def close(self) -> None:
        if self.kvobs.is_instrumented():
            self.kvobs.uninstrument()


def serve(variant: Variant, reps: int, inp: IO[str], out: IO[str]) -> None:
    warm = variant.build()
    warm.run()
    warm.harness.close()
    gc.collect()
    clock = GcClock()
    # Process CPU minus this (serving) thread's CPU = what the background
    # threads (drain, span processor, metric reader) burnt meanwhile; also
    # counted during the timed steps alone (HeavyOffload).
    cpu0 = (time.process_time_ns(), time.thread_time_ns(), _children_ns())
    before = variant.counters()
    reply(out, {"ready": True, "pid": os.getpid(), "warmup": warm.summary()})
    finished: list[HeavyOffload] = []
    current: HeavyOffload | None = variant.build()
    for line in inp:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            ns: list[int] = []
            while current is not None and len(ns) < cmd["steps"]:
                if current.done():
                    finished.append(current)
                    current.harness.close()
                    current = variant.build() if len(finished) < reps else None
                    continue
                ns.append(current.step())
            reply(out, {"ns": ns, "done": current is None})
        elif cmd["cmd"] == "finish":
            if current is not None:
                current.harness.close()
            after = variant.counters()
            cpu = {"process_ns": time.process_time_ns() - cpu0[0],
                   "serving_thread_ns": time.thread_time_ns() - cpu0[1],
                   "steps_serving_thread_ns": sum(sum(w.thread_cpu_ns) for w in finished),
                   "steps_process_ns": sum(sum(w.process_cpu_ns) for w in finished),
                   # Reaped children: the export sidecars (one per repeat,
                   # their start-up included).
                   "children_ns": _children_ns() - cpu0[2]}
            variant.close()
            reply(out, {"reps": [w.summary() for w in finished], "gc": clock.snapshot(),
                        "cpu": cpu, "before": before, "after": after})
            return


def _children_ns() -> int:
    t = os.times()
    return int((t.children_user + t.children_system) * 1e9)


def _preload() -> None:
    """What every child needs, imported once in the zygote (nothing started:
    no thread of ours exists before the fork)."""
    import opentelemetry.exporter.otlp.proto.http.metric_exporter  # noqa: F401
    import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    import opentelemetry.sdk.metrics  # noqa: F401
    import opentelemetry.sdk.trace  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401

    import kvobs_otel.connector  # noqa: F401
    import kvobs_otel.hosts.vllm.seams  # noqa: F401
    import kvobs_otel.tools.harness.engine  # noqa: F401
    import kvobs_otel.tools.harness.runner  # noqa: F401


def _child(cmd: dict[str, Any], quick: bool) -> None:
    # Open order matches the coordinator's (in, then out): no deadlock.
    with open(cmd["fifo_in"]) as inp, open(cmd["fifo_out"], "w", buffering=1) as out:
        try:
            variant = Variant(cmd["variant"], QUICK_SHAPE if quick else WorkloadShape(),
                              cmd["endpoint"])
            serve(variant, cmd["reps"], inp, out)
        except Exception as e:
            reply(out, {"error": f"{type(e).__name__}: {e}"})
            raise


def zygote(out: IO[str], quick: bool) -> None:
    _preload()
    reply(out, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _child(cmd, quick)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the zygote's loop
        reply(out, {"pid": pid})
        _reap(block=False)
    _reap(block=True)


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.b2_variant")
    ap.add_argument("--zygote", action="store_true", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    out = protocol_stream()
    apply_clean_env()
    single_thread_torch()
    zygote(out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
