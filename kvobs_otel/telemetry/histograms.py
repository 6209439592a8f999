"""Explicit-bucket histograms aggregated here, collected through the SDK's reader.

Why not the SDK's synchronous Histogram: one ``record`` costs 10-15 us
(attribute hashing, view matching, exemplar filter and reservoir), paid per
transfer on the drain thread, which shares the GIL with vLLM's serving
thread. Here a measurement is a dict lookup, a ``bisect`` and a few adds.

The Python SDK has no MetricProducer, so ``attach`` wraps the collect
callback the MeterProvider gave each reader: whatever reads metrics (the
periodic OTLP reader, an in-memory reader) gets these histograms beside the
SDK's own instruments, in the reader's temporality, as ordinary
``HistogramDataPoint``s. Semantics follow the SDK's explicit-bucket
aggregation: bucket ``i`` holds ``bounds[i-1] < v <= bounds[i]``; exemplars
are the last measurement per bucket since the previous collection, kept
unless ``OTEL_METRICS_EXEMPLAR_FILTER=always_off``.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

try:  # exemplars in the SDK's data model since 1.28
    from opentelemetry.sdk.metrics import Exemplar
except ImportError:  # pragma: no cover - older SDKs: histograms without exemplars
    Exemplar = None

AttrKey = tuple[tuple[str, Any], ...]


def exemplars_enabled() -> bool:
    if Exemplar is None:
        return False
    return os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "").strip().lower() != "always_off"


class _Point:
    """One attribute set's aggregate: of the measurements since the last
    collection (with their exemplars), or of all of them (the running total)."""

    __slots__ = ("count", "sum", "min", "max", "buckets", "exemplars", "start_ns")

    def __init__(self, n: int, start_ns: int = 0) -> None:
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")
        self.buckets = [0] * n
        # bucket -> (value, time_unix_nano, trace_id, span_id)
        self.exemplars: dict[int, tuple[float, int, int, int]] = {}
        self.start_ns = start_ns


class ExplicitHistogram:
    """One histogram metric; ``record`` from one thread, ``collect`` from another."""

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float],
                 exemplars: bool | None = None) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.bounds = tuple(float(b) for b in bounds)
        self.exemplars = exemplars_enabled() if exemplars is None else exemplars
        self._n = len(self.bounds) + 1
        self._lock = threading.Lock()
        self._interval: dict[AttrKey, _Point] = {}
        self._totals: dict[AttrKey, _Point] = {}
        self._last_collect_ns = time.time_ns()

    def record(self, key: AttrKey, value: float, trace_id: int = 0, span_id: int = 0) -> None:
        i = bisect_left(self.bounds, value)
        with self._lock:
            p = self._interval.get(key)
            if p is None:
                p = self._interval[key] = _Point(self._n)
            p.count += 1
            p.sum += value
            if value < p.min:
                p.min = value
            if value > p.max:
                p.max = value
            p.buckets[i] += 1
            if self.exemplars and trace_id:
                p.exemplars[i] = (value, time.time_ns(), trace_id, span_id)

    def collect(self, temporality: AggregationTemporality) -> Metric | None:
        now = time.time_ns()
        with self._lock:
            interval, self._interval = self._interval, {}
            start, self._last_collect_ns = self._last_collect_ns, now
            for key, p in interval.items():  # fold into the running totals
                t = self._totals.get(key)
                if t is None:
                    t = self._totals[key] = _Point(self._n, start)
                t.count += p.count
                t.sum += p.sum
                t.min = min(t.min, p.min)
                t.max = max(t.max, p.max)
                t.buckets = [a + b for a, b in zip(t.buckets, p.buckets, strict=True)]
            if temporality == AggregationTemporality.DELTA:
                # As the SDK: an attribute set with no new measurement has no point.
                rows = [(k, p, start) for k, p in interval.items()]
            else:
                rows = [(k, t, t.start_ns) for k, t in self._totals.items()]
        if not rows:
            return None
        points = []
        for key, p, t0 in rows:
            ex = interval.get(key)
            extra = {}
            if ex is not None and ex.exemplars:
                extra["exemplars"] = [Exemplar({}, v, ts, sid, tid)
                                      for v, ts, tid, sid in ex.exemplars.values()]
            points.append(HistogramDataPoint(
                attributes=dict(key), start_time_unix_nano=t0, time_unix_nano=now,
                count=p.count, sum=p.sum, bucket_counts=tuple(p.buckets),
                explicit_bounds=self.bounds, min=p.min, max=p.max, **extra))
        return Metric(self.name, self.description, self.unit,
                      HistogramData(points, temporality))


class Histograms:
    """The histograms of one MeterProvider, merged into every collection.

    A collection takes the measurements made since the previous one, so a
    provider has one reader (as every provider kvobs-otel makes has): two
    readers would each see part of the deltas."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        self.resource, self.scope = resource, scope
        self.histograms: list[ExplicitHistogram] = []

    def create(self, name: str, unit: str, description: str,
               bounds: Sequence[float]) -> ExplicitHistogram:
        h = ExplicitHistogram(name, unit, description, bounds)
        self.histograms.append(h)
        return h

    def attach(self, reader: Any) -> bool:
        """Wrap the reader's collect callback (set by the MeterProvider)."""
        inner = getattr(reader, "_collect", None)
        if inner is None:
            return False
        # Keyed by the SDK's internal instrument classes: match by name.
        by_name = {getattr(k, "__name__", "").lstrip("_"): v
                   for k, v in getattr(reader, "_instrument_class_temporality", {}).items()}
        temporality = by_name.get("Histogram", AggregationTemporality.CUMULATIVE)

        def collect(r: Any, timeout_millis: float = 10_000) -> MetricsData | None:
            return self.merge(inner(r, timeout_millis=timeout_millis), temporality)

        reader._collect = collect
        return True

    def merge(self, data: MetricsData | None,
              temporality: AggregationTemporality) -> MetricsData | None:
        ours = [m for m in (h.collect(temporality) for h in self.histograms) if m is not None]
        if not ours:
            return data
        resources = list(data.resource_metrics) if data is not None else []
        for i, rm in enumerate(resources):
            if rm.resource is not self.resource and rm.resource != self.resource:
                continue
            scopes = list(rm.scope_metrics)
            for j, sm in enumerate(scopes):
                if sm.scope.name == self.scope.name:
                    scopes[j] = replace(sm, metrics=list(sm.metrics) + ours)
                    break
            else:
                scopes.append(ScopeMetrics(self.scope, ours, ""))
            resources[i] = replace(rm, scope_metrics=scopes)
            break
        else:
            resources.append(ResourceMetrics(self.resource, [ScopeMetrics(self.scope, ours, "")],
                                             ""))
        return MetricsData(resources)
