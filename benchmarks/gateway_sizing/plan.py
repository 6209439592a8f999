"""The benchmark's constants and its two plans (full, --quick)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO_ROOT

DEPLOY_CONFIG = Path(REPO_ROOT) / "deploy" / "otel-collector.yaml"
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SPANS_PER_REQUEST = 1024  # the agent outline's batch.send_batch_size (deploy/README.md)
IN_FLIGHT = 10            # concurrent exports: a sending queue's default num_consumers
HEADROOM = 2.0            # num_traces = new traces/s x decision_wait x HEADROOM
SCALE_RATES = (50, 200, 1_000, 3_000)  # new traces/s of the example deployments printed

# The recording: kvobs-otel's harness demo (vLLM's scheduler and connector,
# rank processes) with 4 ranks, tensor parallel 4, the README's example size.
DEMO_ARGS = ("--mode", "harness", "--ranks", "4", "--seed", "0")


@dataclass(frozen=True)
class Plan:
    rates: tuple[int, ...]            # offered spans/s, rising; stop at the first unclean
    step_s: float                     # sending time per step
    throughput_wait_s: int            # decision_wait during the throughput steps
    levels: tuple[int, ...]           # open traces at each memory reading
    memory_wait_s: int                # decision_wait during the memory phase
    idle_s: float                     # the idle gateway's CPU, measured before the steps
    rounds: int                       # throughput ladders, each on a fresh gateway


FULL = Plan(rates=(5_000, 10_000, 15_000, 20_000, 25_000, 30_000, 40_000, 60_000, 80_000),
            step_s=15.0, throughput_wait_s=10, levels=(0, 10_000, 30_000, 60_000),
            memory_wait_s=90, idle_s=6.0, rounds=2)
QUICK = Plan(rates=(2_000, 8_000), step_s=4.0, throughput_wait_s=2,
             levels=(0, 1_000, 3_000), memory_wait_s=20, idle_s=2.0, rounds=1)
