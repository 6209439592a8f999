"""Realistic seam calls, captured from a real instrumented harness run.

With instrumentation on, the heavy-offload workload runs on the harness
(inline ranks) and every call of an observed vLLM method whose seam recorded
at least one event is kept: its arguments (a pickled copy, as they were when
vLLM got them), what it returned, and how many events it offered. The inner vLLM calls
behind the facade seams are timed too, for the cost of the real call.

The harness is left open: its connectors' seams (and their observers and the
process pipeline) are the real objects the replays then call into.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import HeavyOffload, WorkloadShape, harness_config

# Seams on the connector facade: benchmark name -> (role, facade method,
# inner object attribute or ""). The wrapper on the facade method calls vLLM
# (which delegates to the inner object), then its seam; the capture records
# the facade's arguments and result.
FACADE_SEAMS: dict[str, tuple[str, str, str]] = {
    "scheduler.build_connector_meta": ("scheduler", "build_connector_meta",
                                       "connector_scheduler"),
    "scheduler.update_connector_output": ("scheduler", "update_connector_output",
                                          "connector_scheduler"),
    "scheduler.request_finished": ("scheduler", "request_finished", "connector_scheduler"),
    # (vLLM's base class keeps the metadata itself: no inner object to time)
    "worker.bind_connector_metadata": ("worker", "bind_connector_metadata", ""),
}
# Seams wrapped on the OffloadingWorker instance (only when observed).
WORKER_SEAMS = ("submit_store", "submit_load", "get_finished")


@dataclass
class Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any
    events: int


@dataclass
class Capture:
    harness: Any
    pipeline: Any
    scheduler_seams: Any
    worker_seams: Any
    # seam name (FACADE_SEAMS key or "worker.<method>") -> captured calls
    calls: dict[str, list[Call]] = field(default_factory=dict)
    # facade seam name -> wall time of each real inner vLLM call (ns)
    real_ns: dict[str, list[int]] = field(default_factory=dict)
    # Requests that were preempted, so a replayed preemption finds them.
    preempted: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        # Replayed events are not a real lifecycle: drop them before the
        # connectors' shutdown flushes the buffer into the state machines.
        discard_buffer(self.pipeline)
        self.harness.close()


def discard_buffer(pipeline: Any) -> int:
    n = 0
    while len(pipeline.buffer):
        n += len(pipeline.buffer.drain(1 << 20))
    return n


def _copy(obj: Any) -> Any:
    # The harness pickles every SchedulerOutput and rank output too; objects
    # that do not pickle (a live Request) are kept by reference.
    try:
        return pickle.loads(pickle.dumps(obj))
    except Exception:
        return obj


def _offered(pipeline: Any) -> int:
    return pipeline.buffer.accepted + pipeline.buffer.dropped_full


def _recorder(pipeline: Any, out: list[Call], fn: Callable[..., Any],
              before: Callable[..., None] | None = None) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args)
        n0 = _offered(pipeline)
        result = fn(*args, **kwargs)
        n = _offered(pipeline) - n0
        if n:
            out.append(Call(_copy(args), _copy(kwargs), _copy(result), n))
        return result
    return record


def _timer(out: list[int], fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            out.append(time.perf_counter_ns() - t0)
    return timed


def run_capture(shape: WorkloadShape) -> Capture:
    """Run the workload once with observation on (the caller instrumented)
    and capture every event-producing seam call."""
    from kvobs_otel.pipeline import current_pipeline
    from kvobs_otel.tools.harness import Harness

    h = Harness(harness_config(shape))
    try:
        sched_conn = h.scheduler.connector
        work_conn = h.runner(0).connector
        ss, ws = getattr(sched_conn, "_kvobs", None), getattr(work_conn, "_kvobs", None)
        pipeline = current_pipeline()
        if ss is None or ws is None or pipeline is None:
            raise RuntimeError("the harness' connectors are not observed: is instrumentation on?")
        cap = Capture(h, pipeline, ss, ws)
        undo: list[Callable[[], None]] = []

        def snap_preempted(so: Any, *_: Any) -> None:
            for r in so.preempted_req_ids or ():
                if r in ss.requests:
                    cap.preempted[r] = ss.requests[r]

        def shadow(obj: Any, name: str, replacement: Callable[..., Any]) -> None:
            # An instance attribute in front of the method; undone after the run.
            had, old = name in obj.__dict__, obj.__dict__.get(name)
            obj.__dict__[name] = replacement
            undo.append(lambda: obj.__dict__.__setitem__(name, old) if had
                        else obj.__dict__.pop(name))

        for name, (role, facade, inner_attr) in FACADE_SEAMS.items():
            conn = sched_conn if role == "scheduler" else work_conn
            before = snap_preempted if facade == "build_connector_meta" else None
            # (the instance's attribute is found before the class's wrapper)
            shadow(conn, facade, _recorder(pipeline, cap.calls.setdefault(name, []),
                                           getattr(conn, facade), before))
            if inner_attr:
                inner = getattr(conn, inner_attr)
                shadow(inner, facade, _timer(cap.real_ns.setdefault(name, []),
                                             getattr(inner, facade)))
        worker = work_conn.connector_worker.worker
        for method in WORKER_SEAMS:
            # worker.<method> is already the seam's wrapper of vLLM's method.
            shadow(worker, method, _recorder(pipeline, cap.calls.setdefault(f"worker.{method}", []),
                                             getattr(worker, method)))

        run = HeavyOffload(h, shape)
        run.run()
        cap.workload = run.summary()
        for fn in reversed(undo):
            fn()
        return cap
    except BaseException:
        h.close()
        raise
