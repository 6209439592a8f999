"""The export stage: finished spans -> exporter, with every loss counted.

Why not the SDK's BatchSpanProcessor: it logs a warning per dropped span when
its queue is full and a traceback per failed batch, and counts neither where
an alert can see it. Serving vLLM needs the opposite: bounded memory, bounded
shutdown, and each kind of loss counted (``kvobs.observer.dropped``) and
logged once. Same knobs: ``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``,
``OTEL_BSP_EXPORT_TIMEOUT`` (milliseconds / spans).

Metric exports go through ``CountingMetricExporter`` for the same reason.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger("kvobs_otel")

# Reasons a span is not delivered (kvobs.observer.dropped{reason}).
QUEUE_FULL = "export_queue_full"
EXPORT_FAILED = "export_failed"
SHUTDOWN = "export_shutdown"
# Metric exports the endpoint refused or never answered (counted per export;
# the next successful export carries the cumulative totals).
METRIC_EXPORT_FAILED = "metric_export_failed"
DROP_REASONS = (QUEUE_FULL, EXPORT_FAILED, SHUTDOWN, METRIC_EXPORT_FAILED)
# Internal stages (kvobs.observer.errors{stage}).
STAGE_EXPORTER = "exporter"
STAGE_METRIC_EXPORT = "metric_export"


class ExportStats:
    """Process-wide delivery counts, read by the metric builder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exported = 0
        self.dropped: Counter[str] = Counter(dict.fromkeys(DROP_REASONS, 0))
        self.errors: Counter[str] = Counter({STAGE_EXPORTER: 0, STAGE_METRIC_EXPORT: 0})
        self._logged: set[str] = set()

    def sent(self, n: int) -> None:
        with self._lock:
            self.exported += n

    def drop(self, reason: str, n: int, detail: str = "", what: str = "span(s)") -> None:
        with self._lock:
            self.dropped[reason] += n
            first = reason not in self._logged
            self._logged.add(reason)
        if first:  # once per reason: a dead Collector must not flood the log
            logger.warning("kvobs-otel: %d %s not delivered (%s)%s; further losses are "
                           "only counted in kvobs.observer.dropped", n, what, reason,
                           f": {detail}" if detail else "")

    def error(self, stage: str) -> None:
        with self._lock:
            self.errors[stage] += 1
            first = stage not in self._logged
            self._logged.add(stage)
        if first:
            logger.warning("kvobs-otel: internal failure in %s (contained, counted; further "
                           "ones are only counted)", stage, exc_info=True)

    def snapshot(self) -> tuple[int, dict[str, int], dict[str, int]]:
        with self._lock:
            return self.exported, dict(self.dropped), dict(self.errors)


STATS = ExportStats()


def _reset_after_fork() -> None:
    global STATS
    STATS = ExportStats()  # the child counts its own deliveries


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


@dataclass(frozen=True)
class BatchSettings:
    schedule_delay_s: float = 1.0
    max_queue_size: int = 16384
    max_export_batch_size: int = 2048
    export_timeout_s: float = 30.0


_BSP_VARS = {  # variable -> (field, scale to our unit, low, high)
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_s", 1e-3, 1, 3_600_000),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 1, 1, 1 << 22),
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", 1, 1, 1 << 20),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_s", 1e-3, 1, 3_600_000),
}


def batch_settings(env: Mapping[str, str] | None = None) -> BatchSettings:
    """Read ``OTEL_BSP_*``; raise ValueError naming the variable on a bad value."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for var, (name, scale, low, high) in _BSP_VARS.items():
        raw = env.get(var, "").strip()
        if not raw:
            continue
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r}: expected an integer") from None
        if not low <= n <= high:
            raise ValueError(f"{var}={raw!r}: must be between {low} and {high}")
        values[name] = n * scale if scale != 1 else n
    s = BatchSettings(**values)
    if s.max_export_batch_size > s.max_queue_size:
        raise ValueError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE must not exceed OTEL_BSP_MAX_QUEUE_SIZE")
    return s


class CountingSpanProcessor(SpanProcessor):
    """Queue finished spans (bounded), export them in batches on one thread."""

    def __init__(self, exporter: SpanExporter, settings: BatchSettings | None = None) -> None:
        self.exporter = exporter
        self.settings = s = settings or batch_settings()
        # ReadableSpan, or (resource, scope, Span bytes) for an exporter that
        # takes encoded spans (telemetry/spans.py, telemetry/exporters.py)
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._flush_requested = False
        self._flush_timed_out = False
        self._shutdown = False
        # Set when shutdown gave up on an export the endpoint never answered:
        # its spans are then counted as dropped, and its late result ignored.
        self._abandoned = False
        # Monotonic time by which shutdown() returns (Providers.close sets it).
        self.deadline: float | None = None
        self._batch = s.max_export_batch_size
        self._thread = threading.Thread(target=self._run, name="kvobs-otel-export", daemon=True)
        self._thread.start()

    # SpanProcessor ---------------------------------------------------------------
    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    @property
    def takes_encoded(self) -> bool:
        """The exporter sends OTLP ``Span`` bytes encoded by the span builder."""
        return bool(getattr(self.exporter, "takes_encoded", False))

    def on_encoded(self, resource: Any, scope: Any, data: bytes) -> None:
        self.on_end((resource, scope, data))  # type: ignore[arg-type]

    def on_end(self, span: ReadableSpan) -> None:
        with self._cond:
            if self._shutdown:
                STATS.drop(SHUTDOWN, 1)
                return
            if len(self._queue) >= self.settings.max_queue_size:
                STATS.drop(QUEUE_FULL, 1, "the exporter does not keep up; raise "
                           "OTEL_BSP_MAX_QUEUE_SIZE or check the Collector")
                return
            self._queue.append(span)
            if len(self._queue) >= self._batch:
                self._cond.notify_all()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export everything queued now; False if that took longer than allowed."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._queue or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    self._flush_timed_out = True
                    return False
                self._cond.wait(min(left, 0.1))
            self._flush_timed_out = False
            return True

    def shutdown(self) -> None:
        timeout = self.settings.export_timeout_s
        if self.deadline is not None:
            timeout = min(timeout, max(0.0, self.deadline - time.monotonic()))
        end = time.monotonic() + timeout
        # A flush that already timed out (endpoint hanging) is not retried:
        # shutting down must stay bounded.
        if not self._flush_timed_out:
            self.force_flush(int(timeout * 1000))
        with self._cond:
            self._shutdown = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if left:
            STATS.drop(SHUTDOWN, left, "still queued when the exporter was shut down")
        self._thread.join(max(0.0, end - time.monotonic()))
        with self._cond:
            # An export the endpoint has not answered by now is not waited
            # for (the thread is a daemon): its spans count as lost, once.
            hung = self._inflight if self._thread.is_alive() else 0
            if hung:
                self._abandoned = True
                self._inflight = 0
        if hung:
            STATS.drop(SHUTDOWN, hung, "an export still unanswered at shutdown")
        try:
            self.exporter.shutdown()
        except Exception:
            STATS.error(STAGE_EXPORTER)

    # export thread -------------------------------------------------------------------
    def _run(self) -> None:
        delay = self.settings.schedule_delay_s
        while True:
            with self._cond:
                if not self._shutdown and len(self._queue) < self._batch \
                        and not self._flush_requested:
                    self._cond.wait(delay)
                if self._shutdown:
                    return
                self._flush_requested = False
                n = min(len(self._queue), self._batch)
                batch = [self._queue.popleft() for _ in range(n)]
                self._inflight = n
            if batch:
                self._export(batch)
            with self._cond:
                self._inflight = 0
                self._cond.notify_all()

    def _export(self, batch: Sequence[Any]) -> None:
        try:
            if isinstance(batch[0], tuple):
                result = self.exporter.export_encoded(batch)
            else:
                result = self.exporter.export(batch)
        except Exception:
            result = None
        with self._cond:
            if self._abandoned:  # already counted as lost by shutdown()
                return
        if result is None:
            STATS.error(STAGE_EXPORTER)
            STATS.drop(EXPORT_FAILED, len(batch))
        elif result == SpanExportResult.SUCCESS:
            STATS.sent(len(batch))
        else:
            STATS.drop(EXPORT_FAILED, len(batch), "the endpoint refused or could not be reached")


class CountingMetricExporter(MetricExporter):
    """Delegates to a real metric exporter; a failure is counted and logged
    once, never raised into the SDK's reader (which would log every time)."""

    def __init__(self, inner: MetricExporter) -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner = inner
        self.closing = False  # set when the provider shuts down
        self.last_failed = False
        # Monotonic time no export may wait past (Providers.close sets it):
        # the SDK's OTLP exporters wait for their own timeout, not the
        # reader's, and a closing process cannot wait that long.
        self.deadline: float | None = None

    def _failed(self) -> MetricExportResult:
        self.last_failed = True
        STATS.drop(METRIC_EXPORT_FAILED, 1, "the endpoint refused or could not be reached",
                   what="metric export(s)")
        return MetricExportResult.FAILURE

    def _call(self, metrics_data: MetricsData, timeout_millis: float,
              **kwargs: Any) -> MetricExportResult | None:
        try:
            return self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            STATS.error(STAGE_METRIC_EXPORT)  # a bug in the exporter, with its traceback
            return None

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        if self.closing and self.last_failed:
            return self._failed()  # not retried on the way out
        deadline = self.deadline
        if deadline is None:
            result = self._call(metrics_data, timeout_millis, **kwargs)
        else:
            box: list[MetricExportResult | None] = []
            worker = threading.Thread(
                target=lambda: box.append(self._call(metrics_data, timeout_millis, **kwargs)),
                name="kvobs-otel-metric-export", daemon=True)
            worker.start()
            worker.join(max(0.0, deadline - time.monotonic()))
            if not box:  # unanswered by the deadline: counted, not waited for
                return self._failed()
            result = box[0]
        if result is None:
            self.last_failed = True
            return MetricExportResult.FAILURE
        if result != MetricExportResult.SUCCESS:
            return self._failed()
        self.last_failed = False
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis=timeout_millis)
        except Exception:
            STATS.error(STAGE_METRIC_EXPORT)
            return False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)
        except Exception:
            STATS.error(STAGE_METRIC_EXPORT)
