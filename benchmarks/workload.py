"""Heavy offload traffic with preemptions, on the project's one CPU harness.

``pressure_workload`` alone makes vLLM's scheduler preempt a few times per
run. On top of it, every ``preempt_every`` steps the newest running request
is preempted through the scheduler's own ``_preempt_request`` and the GPU
prefix cache is evicted (``Harness.preempt`` / ``evict_gpu_prefix_cache``,
as the tests do), so its re-admission restores from the CPU tier: a recovery
episode (preserve flush, restore on every rank, receipts, admission, first
compute) every few steps, besides the ordinary store traffic.

Everything depends only on the scheduler's state, never on timing, so every
variant of a benchmark runs exactly the same steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.tools.harness import Harness, HarnessConfig, pressure_workload


@dataclass(frozen=True)
class WorkloadShape:
    num_ranks: int = 2
    num_requests: int = 12
    preempt_every: int = 4
    seed: int = 0


QUICK_SHAPE = WorkloadShape(num_requests=6)


def harness_config(shape: WorkloadShape, **overrides: Any) -> HarnessConfig:
    # Inline ranks: scheduler, connectors and ranks share this process, so
    # one thread's step time is the whole engine step.
    return HarnessConfig(num_ranks=shape.num_ranks, rank_mode="inline", seed=shape.seed,
                         **overrides)


@dataclass
class HeavyOffload:
    """Drives one harness through the workload, one timed step at a time."""

    harness: Harness
    shape: WorkloadShape
    index: int = 0
    forced: int = 0
    step_ns: list[int] = field(default_factory=list)
    # CPU time during each step: of this (serving) thread, and of the whole
    # process (so the difference is what other threads burnt meanwhile).
    thread_cpu_ns: list[int] = field(default_factory=list)
    process_cpu_ns: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        pressure_workload(self.harness, num_requests=self.shape.num_requests)

    def done(self) -> bool:
        return not self.harness.has_work()

    def step(self) -> int:
        """One engine step; returns its wall time in ns (the forced
        preemption before it is not part of it: it stands for an external
        event, like a cache reset)."""
        h, every = self.harness, self.shape.preempt_every
        if every and self.index % every == every - 1:
            running = h.scheduler.running
            if len(running) >= 2:
                h.preempt(running[-1].request_id)
                h.evict_gpu_prefix_cache()
                self.forced += 1
        c0, p0 = time.thread_time_ns(), time.process_time_ns()
        t0 = time.perf_counter_ns()
        h.step()
        dt = time.perf_counter_ns() - t0
        self.thread_cpu_ns.append(time.thread_time_ns() - c0)
        self.process_cpu_ns.append(time.process_time_ns() - p0)
        self.index += 1
        self.step_ns.append(dt)
        return dt

    def run(self, max_steps: int = 20_000) -> None:
        while not self.done():
            if self.index >= max_steps:
                raise RuntimeError(f"workload still busy after {max_steps} steps")
            self.step()

    def summary(self) -> dict[str, int]:
        h = self.harness
        return {"steps": self.index, "forced_preemptions": self.forced,
                "preemptions": len(h.preemptions), "restore_jobs": len(h.restore_jobs),
                "jobs": len(h.jobs), "finished": len(h.finished)}
