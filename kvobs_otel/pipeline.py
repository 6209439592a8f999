"""The export pipeline of one process.

serving thread --offer()--> EventBuffer --drain thread--> lifecycle state
machines --records--> span/metric builders --> private providers
(BatchSpanProcessor, periodic metric reader) --> OTLP.

One ``Pipeline`` per process (recreated in a forked child); one ``Observer``
per observed connector role, each with its own providers so its resource
says which role and rank it is.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvobs_otel import identity
from kvobs_otel.buffer import EventBuffer
from kvobs_otel.config import Settings

logger = logging.getLogger("kvobs_otel")

# Every stage is reported from the start (at 0), so dashboards and alerts see
# a series before the first failure.
ERROR_STAGES = ("seam", "lifecycle", "deadline", "span_build", "metric_record",
                "shutdown", "export_shutdown")


class Observer:
    """Lifecycle + builders + providers for one connector role instance."""

    def __init__(self, pipeline: Pipeline, make_lifecycle: Callable[[Any], Any],
                 resource_attributes: dict[str, Any]) -> None:
        # Imported here: with observation disabled the SDK is never imported.
        from kvobs_otel.telemetry.metrics import MetricsBuilder
        from kvobs_otel.telemetry.providers import make_providers
        from kvobs_otel.telemetry.spans import SpanBuilder

        s = pipeline.settings
        self.pipeline = pipeline
        self.providers = make_providers(resource_attributes)
        self.spans = SpanBuilder(self.providers, s.traffic_sample_ratio, s.roster_cap)
        self.pseudonym = (identity.RequestIdHasher(s.request_id_key)
                          if s.request_id_key else None)
        self.lifecycle = lc = make_lifecycle(self)
        # Drops, errors and deliveries are per process: the pipeline reports them.
        self.metrics = MetricsBuilder(
            self.providers,
            open_receipts=((lambda: lc.open_receipts) if hasattr(lc, "open_receipts") else None),
            anomalies=lc.anomalies, refused=getattr(lc, "refusals", None),
            scheduler=lc.role == "scheduler",
            worker_rank=getattr(lc, "rank", None) if lc.role == "worker" else None)
        self.closed = False

    # RecordSink
    def emit(self, record: Any) -> None:
        if self.pseudonym is not None:
            try:
                self.pseudonym.apply(record)
            except Exception:
                self.pipeline.count_error("span_build")
                return  # never export the raw id instead
        try:
            self.spans.build(record)
        except Exception:
            self.pipeline.count_error("span_build")
        try:
            self.metrics.record(record)
        except Exception:
            self.pipeline.count_error("metric_record")

    def tick(self, now: int) -> None:
        tick = getattr(self.lifecycle, "tick", None)
        if tick is not None:
            tick(now)

    def close(self, timeout_s: float = 10.0) -> None:
        """Drain what this process recorded, then flush and stop exporting."""
        if self.closed:
            return
        self.closed = True
        self.pipeline.flush()
        try:
            self.providers.close(timeout_s)
        except Exception:
            self.pipeline.count_error("export_shutdown")
        self.pipeline.unregister(self)


class Pipeline:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.buffer = EventBuffer(settings.buffer_size)
        self.offer = self.buffer.offer  # the serving path's only call
        self.observers: list[Observer] = []
        self.process_metrics: Any = None
        self._errors: Counter[str] = Counter(dict.fromkeys(ERROR_STAGES, 0))
        self._logged: set[str] = set()
        # Reentrant: a consumer may register an observer while being drained
        # (the vLLM-HUST adapter makes one per role and rank it first sees).
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    # -- counters ----------------------------------------------------------------
    def count_error(self, stage: str) -> None:
        self._errors[stage] += 1
        if stage not in self._logged:
            # Once per stage, not per event: a broken stage must not flood logs.
            self._logged.add(stage)
            logger.warning("kvobs-otel: internal failure in %s (contained, counted; "
                           "further ones are only counted)", stage, exc_info=True)

    def error_counts(self) -> dict[str, int]:
        from kvobs_otel.telemetry import export

        return {**self._errors, **export.STATS.snapshot()[2]}

    def drop_counts(self) -> dict[str, int]:
        """Everything recorded but not delivered, by where it was lost."""
        from kvobs_otel.telemetry import export

        return {"buffer_full": self.buffer.dropped_full, **export.STATS.snapshot()[1]}

    @staticmethod
    def exported_spans() -> int:
        from kvobs_otel.telemetry import export

        return export.STATS.snapshot()[0]

    # -- observers -------------------------------------------------------------------
    def register(self, observer: Observer) -> None:
        with self._lock:
            self.observers.append(observer)
            if self.process_metrics is None:
                self.process_metrics = self._make_process_metrics()
        self._ensure_thread()

    def _make_process_metrics(self) -> Any:
        """One meter for the process as a whole (drops, errors, deliveries):
        reported once per process, by a resource that lives as long as it."""
        import socket

        from kvobs_otel.telemetry.metrics import MetricsBuilder
        from kvobs_otel.telemetry.providers import make_providers

        # A stable identity: if a connector comes back later in this process,
        # the counts continue the same series instead of starting a second.
        providers = make_providers({"kvobs.role": "process", "service.instance.id":
                                    f"{socket.gethostname()}:{os.getpid()}:process"},
                                   traces=False)
        MetricsBuilder(providers, drops=self.drop_counts, errors=self.error_counts,
                       exported=lambda: {"spans": self.exported_spans()})
        return providers

    def close_process_metrics(self) -> None:
        providers, self.process_metrics = self.process_metrics, None
        if providers is not None:
            self.log_final_counts()
            try:
                providers.close(METRICS_CLOSE_TIMEOUT_S)
            except Exception:
                self.count_error("export_shutdown")

    def log_final_counts(self) -> None:
        """One line at the end of an observing process when anything was lost,
        so that a loss is never silent even where no metrics are exported."""
        drops = {k: v for k, v in self.drop_counts().items() if v}
        if drops:
            logger.warning("kvobs-otel: %d observations dropped in this process (%s); "
                           "%d spans delivered", sum(drops.values()),
                           ", ".join(f"{k}={v}" for k, v in sorted(drops.items())),
                           self.exported_spans())

    def unregister(self, observer: Observer) -> None:
        with self._lock:
            if observer in self.observers:
                self.observers.remove(observer)
            last = not self.observers
        if last:
            # The connector shut down (vLLM's workers may leave through
            # os._exit, skipping atexit): report the final counts now.
            self.close_process_metrics()

    # -- drain thread ------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvobs-otel-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.settings.drain_interval_s
        while not self._stop:
            self._wake.wait(interval)
            self._wake.clear()
            self.drain_once()

    def drain_once(self) -> int:
        """Process everything buffered now, then run deadlines. Thread-safe."""
        n = 0
        with self._lock:
            while True:
                batch = self.buffer.drain()
                if not batch:
                    break
                n += len(batch)
                for event in batch:
                    try:
                        event[0].handle(event)
                    except Exception:
                        self.count_error("lifecycle")
            now = time.monotonic_ns()
            for obs in self.observers:
                try:
                    obs.tick(now)
                except Exception:
                    self.count_error("deadline")
        return n

    def flush(self) -> None:
        self.drain_once()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
        self.drain_once()


_pipeline: Pipeline | None = None
_pipeline_lock = threading.Lock()


def get_pipeline(settings: Settings) -> Pipeline:
    """The process's pipeline, made on first use (and anew after a fork)."""
    global _pipeline
    with _pipeline_lock:
        if _pipeline is None or _pipeline._pid != os.getpid():
            _pipeline = Pipeline(settings)
        return _pipeline


def current_pipeline() -> Pipeline | None:
    return _pipeline


# vLLM gives its EngineCore and workers 5 s after SIGTERM before it kills
# them (--shutdown-timeout; vllm/v1/utils.py, shutdown): the final flush of
# spans and counts must fit well inside that.
CLOSE_TIMEOUT_S = 3.0
# Then the process's own counts (delivered, dropped) get their final export.
METRICS_CLOSE_TIMEOUT_S = 1.5


def close_pipeline() -> None:
    """Flush and close every observer, stop the drain thread (uninstrument)."""
    global _pipeline
    with _pipeline_lock:
        pipeline, _pipeline = _pipeline, None
    if pipeline is None or pipeline._pid != os.getpid():
        return
    # Every observer's spans out first, so that the delivery counts the
    # process meter exports last are final. One deadline for all of it: a
    # hanging endpoint must not hold a shutting-down process for long.
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    pipeline.flush()
    for observer in list(pipeline.observers):
        try:
            left = max(0.0, deadline - time.monotonic())
            observer.providers.tracer_provider.force_flush(int(left * 1000))
        except Exception:
            pipeline.count_error("export_shutdown")
    for observer in list(pipeline.observers):
        observer.close(max(0.1, deadline - time.monotonic()))
    pipeline.stop()
    pipeline.close_process_metrics()  # last: the final delivery counts


def _after_fork_in_child() -> None:
    # The child's copy of the buffer holds the parent's events and its drain
    # thread does not exist: start clean. Observers made before the fork keep
    # their (now stale) pipeline; connectors are built after worker start, so
    # in practice they are made in the child.
    global _pipeline
    _pipeline = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# A clean exit, and SIGTERM where the process turns it into SystemExit (vLLM's
# engine core and workers do), flush what was recorded. Bounded: each
# observer's flush and the export stage's shutdown have timeouts.
atexit.register(close_pipeline)
