"""Replays of captured seam calls: the same calls, in several variants.

What runs on vLLM's serving thread at a seam is: vLLM's facade method (or,
for transfers, the OffloadingWorker method), then the seam. A replay keeps
all of that real except vLLM's own work behind the facade, which returns
what it returned in the captured run (``_Replay*``): its cost is the same in
every variant, so subtracting the uninstrumented variant leaves exactly what
observation adds per call.

Variants (one batch = every captured call of a seam, cycled to ~``calls``):

- ``uninstrumented``: vLLM's original facade function (the object the
  patch wraps, ``__wrapped__``), on a facade without seams.
- ``disabled``: the same function. With KVOBS_OTEL_ENABLED off nothing is
  patched at all (checked by ``check_disabled_patches_nothing``), so this is
  the uninstrumented variant by construction; timing it separately shows
  the noise floor of the comparison.
- ``unobserved``: the real patched wrapper on a facade without seams: the
  worst case of "patched, but this connector not observed" (one
  attribute load). For the transfer seams: the watched copy-engine class's
  wrapper on a worker without seams.
- ``enabled``: the real patched wrapper on a facade carrying the harness'
  live seams; they record into the real bounded buffer.
- ``python_call`` (a yardstick, not a variant of the product): the same loop
  calling an empty function with the same arguments, so a cost can also be
  given in "empty Python calls", which does not change with the machine's
  speed the way microseconds do.
- ``naive``: the same seams, but every event becomes an OpenTelemetry SDK
  span (started with the event's fields as attributes, then ended) on the
  serving thread, with a real TracerProvider + BatchSpanProcessor in front of
  an exporter that drops everything.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.capture import FACADE_SEAMS, WORKER_SEAMS, Call, Capture, discard_buffer

VARIANTS = ("uninstrumented", "disabled", "unobserved", "enabled", "naive", "python_call")
_ATTR = "_kvobs"  # where the instrumentor hangs a connector's seams


class _ReplayScheduler:
    def __init__(self, metas: dict[int, Any]) -> None:
        self._metas = metas

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self._metas[id(scheduler_output)]

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def request_finished(self, request: Any) -> tuple[bool, None]:
        return False, None


class _ReplayConnectorWorker:
    """The facade's worker side: the replayed worker seam (bind) delegates
    nothing to it; it only makes the facade a worker-role connector."""


class _ReplayOffloadingWorker:
    """Stands in for the CPU copy engine: accepts every job at once and
    returns the captured results of get_finished in turn."""

    def __init__(self, finished: list[Any]) -> None:
        self._finished = itertools.cycle(finished or [[]])

    def submit_store(self, job_id: int, src: Any, dst: Any) -> bool:
        return True

    def submit_load(self, job_id: int, src: Any, dst: Any, expedited: bool = False) -> bool:
        return True

    def get_finished(self) -> Any:
        return next(self._finished)


@dataclass
class SeamReplay:
    name: str
    calls_per_batch: int
    # variant -> one batch of calls (untimed setup is done by ``prepare``)
    batches: dict[str, Callable[[], None]] = field(default_factory=dict)
    events_per_batch: int = 0


class NaiveSpans:
    """The naive design's recording primitive: one SDK span per event."""

    _PRIMITIVE = (bool, int, float, str)

    def __init__(self) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from benchmarks.exporters import CountingSpanExporter

        self.exporter = CountingSpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "naive"}))
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("kvobs_otel.naive")
        self.keys = tuple(f"kvobs.field.{i}" for i in range(16))

    def offer(self, event: tuple[Any, ...]) -> bool:
        # The event's fields as attributes; collections become their length
        # (OTel attributes cannot nest), which keeps the naive side cheap.
        attrs: dict[str, Any] = {}
        keys = self.keys
        for i, v in enumerate(event[3:]):
            if v is not None:
                attrs[keys[i]] = v if isinstance(v, self._PRIMITIVE) else len(v)
        self.tracer.start_span(f"kv.event.{event[1]}", attributes=attrs).end()
        return True

    def flush(self) -> None:
        self.provider.force_flush()

    def close(self) -> int:
        self.provider.force_flush()
        self.provider.shutdown()
        return sum(self.exporter.by_name.values())


def _cycled(calls: list[Call], target: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    # Whole cycles only, so every batch offers the same number of events.
    reps = max(1, -(-target // max(1, len(calls))))
    return [(c.args, c.kwargs) for c in calls] * reps


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _loop(fn: Callable[..., Any], obj: Any, argseq: list[Any]) -> Callable[[], None]:
    def batch() -> None:
        for a, kw in argseq:
            fn(obj, *a, **kw)
    return batch


def _loop_free(fn: Callable[..., Any], argseq: list[Any]) -> Callable[[], None]:
    def batch() -> None:
        for a, kw in argseq:
            fn(*a, **kw)
    return batch


def _with_offer(seams: Any, offer: Callable[..., Any], batch: Callable[[], None]
                ) -> Callable[[], None]:
    # Swapping the recording primitive costs one attribute store per batch.
    def run() -> None:
        real, seams.offer = seams.offer, offer
        try:
            batch()
        finally:
            seams.offer = real
    return run


def facade_replay(cap: Capture, name: str, target: int, naive: NaiveSpans | None
                  ) -> SeamReplay | None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    calls = cap.calls.get(name) or []
    if not calls:
        return None
    role, facade, _inner = FACADE_SEAMS[name]
    wrapper = OffloadingConnector.__dict__[facade]
    if not getattr(wrapper, "__kvobs_wrapped__", False):
        raise RuntimeError(f"OffloadingConnector.{facade} is not patched")
    original = wrapper.__wrapped__
    seams = cap.scheduler_seams if role == "scheduler" else cap.worker_seams
    if facade == "bind_connector_metadata" and len(calls) == 1:
        # The wrapper skips a step extension just seen: alternate two.
        calls = calls + [Call(*_recopy(calls[0]))]
    metas = {id(c.args[0]): c.result for c in calls if facade == "build_connector_meta"}

    def facade_obj(observed: bool) -> Any:
        f = object.__new__(OffloadingConnector)
        f.connector_scheduler = _ReplayScheduler(metas)
        f.connector_worker = _ReplayConnectorWorker()
        if observed:
            setattr(f, _ATTR, seams)  # (not via __dict__: it would unspecialize f's loads)
        return f

    argseq = _cycled(calls, target)
    plain, observed = facade_obj(False), facade_obj(True)
    enabled = _loop(wrapper, observed, argseq)
    replay = SeamReplay(name, len(argseq), {
        "uninstrumented": _loop(original, plain, argseq),
        "disabled": _loop(original, plain, argseq),
        "unobserved": _loop(wrapper, plain, argseq),
        "enabled": enabled,
        "python_call": _loop(_noop, plain, argseq),
    })
    if naive is not None:
        replay.batches["naive"] = _with_offer(seams, naive.offer, enabled)
    return replay


def _recopy(call: Call) -> tuple[Any, ...]:
    import pickle

    return (pickle.loads(pickle.dumps(call.args)), call.kwargs, call.result, call.events)


class _ObservedReplayWorker(_ReplayOffloadingWorker):
    """The same copy engine, its class watched as the instrumentor watches a
    real one's (hosts/vllm/instrumentor.py, patching.watch)."""


def worker_replay(cap: Capture, method: str, target: int, naive: NaiveSpans | None
                  ) -> SeamReplay | None:
    from kvobs_otel.hosts.vllm import instrumentor, patching

    name = f"worker.{method}"
    calls = cap.calls.get(name) or []
    if not calls:
        return None
    finished = [c.result for c in cap.calls.get("worker.get_finished") or []]
    ws = cap.worker_seams
    patching.watch(_ObservedReplayWorker, instrumentor._WORKER_WRAPPERS)
    wrapper = _ObservedReplayWorker.__dict__[method]
    plain, unobserved = _ReplayOffloadingWorker(finished), _ObservedReplayWorker(finished)
    observed = _ObservedReplayWorker(finished)
    observed._kvobs = ws  # type: ignore[attr-defined]
    argseq = _cycled(calls, target)
    if method == "get_finished":
        argseq = [((), {})] * len(argseq)
    enabled = _loop(wrapper, observed, argseq)
    replay = SeamReplay(name, len(argseq), {
        "uninstrumented": _loop(wrapper.__wrapped__, plain, argseq),
        "disabled": _loop(wrapper.__wrapped__, plain, argseq),
        "unobserved": _loop(wrapper, unobserved, argseq),
        "enabled": enabled,
        "python_call": _loop_free(_noop, argseq),
    })
    if naive is not None:
        replay.batches["naive"] = _with_offer(ws, naive.offer, enabled)
    return replay


def all_replays(cap: Capture, target: int, naive: NaiveSpans | None) -> list[SeamReplay]:
    replays = [facade_replay(cap, name, target, naive) for name in FACADE_SEAMS]
    replays += [worker_replay(cap, m, target, naive) for m in WORKER_SEAMS]
    out = [r for r in replays if r is not None]
    for r in out:
        r.events_per_batch = count_events(cap, r.batches["enabled"])
    return out


def restore_seam_state(cap: Capture) -> None:
    """Put back what a replayed preemption needs (the captured run finished
    those requests) before each seam's block of samples."""
    cap.scheduler_seams.requests.update(cap.preempted)
    discard_buffer(cap.pipeline)


def count_events(cap: Capture, batch: Callable[[], None]) -> int:
    restore_seam_state(cap)
    buf = cap.pipeline.buffer
    n0 = buf.accepted + buf.dropped_full
    batch()
    n = buf.accepted + buf.dropped_full - n0
    discard_buffer(cap.pipeline)
    return n
