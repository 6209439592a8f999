"""B6 child: one variant of B2's engine loop, its steps counted by callgrind.

``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no
--toggle-collect=math_fsum ... python -m benchmarks.b6_counted --layout K
--job FILE`` (benchmarks/b6_instructions.py builds the command and writes
FILE: the variant, the steps, the endpoint, where to write the summary).
``--layout`` is read first, by benchmarks/b6_layout.py.

The process imports, builds the variant and runs one repeat of the
workload natively fast (valgrind translates but does not instrument), turns
callgrind's instrumentation on for itself (``callgrind_control -i on``),
then runs the measured steps of a fresh repeat, each inside a ``math.fsum``
call: ``--toggle-collect=math_fsum`` counts exactly those steps and nothing
between or around them (neither vLLM, torch nor kvobs-otel calls
``math.fsum``: a call inside a step would switch counting off, and the
counts of identical variants would then differ). With ``--separate-threads=yes`` the
serving thread's count is its own file.

Variants: ``disabled`` and ``enabled`` as in B2 (benchmarks/b2_variant.py),
and ``enabled:<seam>,<seam>...``: enabled with only those seams patched
(every other wrapper put back to vLLM's method), for the per-seam split.
``+fs`` after either: vLLM's fs tier behind a small CPU tier.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

# First: the process's memory layout, before the imports below allocate.
from benchmarks.b6_layout import LAYOUT

# isort: split
from benchmarks.b2_variant import Variant
from benchmarks.common import apply_clean_env, single_thread_torch
from benchmarks.workload import QUICK_SHAPE, HeavyOffload, WorkloadShape

# Seams by the vLLM methods kvobs_otel/hosts/vllm/instrumentor.py wraps, in
# the order the per-seam split adds them (a seam after those it feeds: the
# worker's step-metadata seam reads what the scheduler's step seam attached).
# The constructor and shutdown wrappers are always kept (they attach), and
# the class defaults instrumentor.py sets.
SEAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "step": ("scheduler", ("build_connector_meta",)),
    "receipts": ("scheduler", ("update_connector_output",)),
    "waits": ("scheduler", ("get_num_new_matched_tokens",)),
    "admission": ("scheduler", ("update_state_after_alloc",)),
    # (confirms the admissions the step seam saw, when their step's output comes)
    "first_compute": ("scheduler", ("update_from_output",)),
    "preemption": ("scheduler", ("_preempt_request",)),
    "request": ("scheduler", ("on_new_request", "request_finished",
                              "request_finished_all_groups", "reset_cache")),
    "worker_step": ("worker", ("bind_connector_metadata",)),
    # (vLLM's aggregate() of the ranks' metadata runs at the scheduler)
    "worker_meta": ("worker", ("build_connector_worker_meta", "aggregate")),
    "transfers": ("worker", ("_init_worker", "register_kv_caches")),
}
ALWAYS = ("__init__", "shutdown", "_kvobs", "kvobs_step", "kvobs_receipts")
DRAIN_EVERY = 8  # steps


def keep_only(seams: list[str]) -> list[str]:
    """Put back vLLM's own method for every wrapper outside ``seams``."""
    from kvobs_otel.hosts.vllm import patching

    keep = set(ALWAYS).union(*(SEAMS[s][1] for s in seams))
    known = set(ALWAYS).union(*(m for _r, m in SEAMS.values()))
    removed = []
    for cls, name, original in list(patching._patches):
        if name not in known:
            raise RuntimeError(f"B6: instrumentor wraps {name}, which no seam names")
        if name in keep:
            continue
        if original is patching._MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
        removed.append(name)
    return removed


def _instrumentation_on() -> None:
    """callgrind_control answers once this process runs code again: it must
    not block in a wait meanwhile (that would never end)."""
    proc = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("B6: callgrind_control did not answer")
        sum(range(1000))


def _secondary_tiers(work: HeavyOffload) -> list[Any]:
    manager = getattr(work.harness.scheduler.connector.connector_scheduler, "manager", None)
    return list(getattr(manager, "secondary_tiers", None) or ())


def _settle(tiers: list[Any]) -> None:
    """Let vLLM's secondary tiers finish what they were given before the next
    step, so that both variants of a tiered pair run the same steps (their
    threads otherwise answer when they get the CPU). Transfers: vLLM's own
    ``drain_jobs``. Lookups (vllm/v1/kv_offload/tiering/async_lookup.py): an
    empty batch behind the queued ones, which its thread skips; once the
    queue is empty again, every batch before it has its results posted."""
    for tier in tiers:
        tier.drain_jobs()
        lookups = getattr(tier, "_lookup_manager", None)
        queue = getattr(lookups, "_lookup_queue", None)
        if queue is not None:
            queue.put([])
            while not queue.empty():
                time.sleep(0.0005)


def _drain(pipeline: Any, i: int) -> None:
    if pipeline is not None and not i % DRAIN_EVERY:
        while pipeline.buffer.drain():
            pass


def _hold_drain() -> Any:
    """Stop kvobs-otel's drain thread for the window; this thread empties
    the buffer instead, every ``DRAIN_EVERY`` steps between counted steps,
    and drops what it takes. The serving thread's count is then the seams'
    own, whatever the timing of other threads and of the export sidecar
    (they would take turns on the GIL, trigger collections and fill caches at
    other moments); what draining and exporting cost is B2's other-threads
    line."""
    from kvobs_otel.pipeline import current_pipeline

    pipeline = current_pipeline()
    if pipeline is not None:
        pipeline.stop()
    return pipeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.b6_counted")
    ap.add_argument("--layout", type=int, required=True)
    ap.add_argument("--job", required=True)
    with open(ap.parse_args(argv).job) as f:
        args = argparse.Namespace(**json.load(f))
    apply_clean_env()
    single_thread_torch()
    name, _, seams = args.variant.partition(":")
    base, plus, tier = name.partition("+")
    variant = Variant(base + plus + tier, QUICK_SHAPE if args.quick else WorkloadShape(),
                      args.endpoint)
    removed = keep_only(seams.split(",")) if seams else []
    warm = variant.build()
    # Held from the start: the warm-up runs on this thread alone too, so
    # what it allocates and in which order types get their attribute-cache
    # tags (b6_layout.py) is the same in every process of a variant.
    pipeline = _hold_drain()
    while not warm.done():
        _drain(pipeline, warm.index)
        warm.step()
    warm.harness.close()
    before = variant.counters()
    work: HeavyOffload = variant.build()
    # As vLLM's EngineCore does once it is up (vllm/v1/engine/core.py calls
    # vllm.utils.gc_utils.freeze_gc_heap): what exists now is frozen, so a
    # collection in the window visits only what serving allocated, and every
    # variant starts the window with empty generations (a full collection of
    # the start-up heap falling inside one variant's window and outside
    # another's would swamp what is counted).
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    _instrumentation_on()

    tiers = _secondary_tiers(work)
    # Every counted step runs in one fresh, empty contextvars.Context. In the
    # start-up context torch has set a few ContextVars; a ContextVar hashes by
    # its address, and whether numpy's lookup of its own (unset) variable,
    # hundreds per step, meets one of them in the context's HAMT is a lottery
    # of where they were allocated: ~16,000 instructions per step between
    # processes of identical code. In an empty context that lookup is one
    # test, in every variant.
    context = contextvars.Context()

    def one_step() -> Any:
        context.run(work.step)
        yield 0.0

    for i in range(args.steps):
        if work.done():
            break
        # Uncounted: vLLM's tiers finish their work, and the buffer is emptied
        # as often as the drain thread would (every 200 ms: 8 steps of ~25 ms).
        _settle(tiers)
        _drain(pipeline, i)
        math.fsum(one_step())  # counted (--toggle-collect=math_fsum)
    dropped = pipeline.buffer.dropped_full if pipeline is not None else 0
    summary = {"steps": work.index, "dropped": dropped, "removed": removed, "layout": LAYOUT,
               "workload": work.summary(), "before": before, "after": variant.counters()}
    with open(args.out, "w") as f:
        json.dump(summary, f)
    # No orderly close: it would run instrumented, slowly, and count nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
