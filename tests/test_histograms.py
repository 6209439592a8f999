"""Our histograms (telemetry/histograms.py) give what the SDK's own explicit-
bucket histogram gives for the same measurements, through the same readers."""

from __future__ import annotations

import random

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvobs_otel.telemetry.histograms import Histograms
from kvobs_otel.telemetry.metrics import LATENCY_BUCKETS


def _ctx(tid: int, sid: int):
    return trace.set_span_in_context(NonRecordingSpan(SpanContext(
        tid, sid, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))


def _points(reader: InMemoryMetricReader, name: str) -> dict:
    data = reader.get_metrics_data()
    out = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    for p in m.data.data_points:
                        out[tuple(sorted(p.attributes.items()))] = (
                            m.data.aggregation_temporality, p.count, round(p.sum, 9),
                            p.min, p.max, tuple(p.bucket_counts), tuple(p.explicit_bounds),
                            sorted((e.trace_id, e.span_id, e.value) for e in p.exemplars))
    return out


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE,
                                         AggregationTemporality.DELTA])
def test_same_points_as_the_sdk_histogram(temporality, monkeypatch) -> None:
    monkeypatch.delenv("OTEL_METRICS_EXEMPLAR_FILTER", raising=False)
    resource = Resource.create({"service.name": "t"})
    sdk_reader = InMemoryMetricReader(preferred_temporality={Histogram: temporality})
    sdk = MeterProvider(resource=resource, metric_readers=[sdk_reader], views=[View(
        instrument_name="h", aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS))])
    sdk_h = sdk.get_meter("s").create_histogram("h", unit="s")

    our_reader = InMemoryMetricReader(preferred_temporality={Histogram: temporality})
    mp = MeterProvider(resource=resource, metric_readers=[our_reader])
    hs = Histograms(resource, InstrumentationScope("s"))
    assert hs.attach(our_reader)
    ours = hs.create("h", "s", "", LATENCY_BUCKETS)

    rng = random.Random(7)
    for collection in range(3):
        # Values on the bucket bounds too: a bound belongs to its own bucket.
        for _ in range(200 if collection != 1 else 0):
            value = rng.choice([rng.uniform(0, 0.2), rng.choice(LATENCY_BUCKETS), 100.0])
            direction = rng.choice(["load", "store"])
            tid, sid = rng.getrandbits(128) or 1, rng.getrandbits(64) or 1
            sdk_h.record(value, {"direction": direction, "clock": "host"},
                         context=_ctx(tid, sid))
            ours.record((("direction", direction), ("clock", "host")), value, tid, sid)
        want, got = _points(sdk_reader, "h"), _points(our_reader, "h")
        assert got == want, f"collection {collection}"
        if collection == 0:
            assert len(got) == 2 and all(p[7] for p in got.values())  # exemplars kept
    sdk.shutdown()
    mp.shutdown()


def test_exemplars_off_by_the_standard_variable(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "always_off")
    resource = Resource.create({})
    reader = InMemoryMetricReader()
    mp = MeterProvider(resource=resource, metric_readers=[reader])
    hs = Histograms(resource, InstrumentationScope("s"))
    hs.attach(reader)
    hs.create("h", "s", "", (1.0,)).record((), 0.5, 5, 6)
    (point,) = _points(reader, "h").values()
    assert point[1:6] == (1, 0.5, 0.5, 0.5, (1, 0)) and point[7] == []
    mp.shutdown()


def test_merged_beside_the_sdk_instruments_of_the_same_scope() -> None:
    resource = Resource.create({})
    reader = InMemoryMetricReader()
    mp = MeterProvider(resource=resource, metric_readers=[reader])
    scope = InstrumentationScope("kvobs_otel", "1")
    mp.get_meter("kvobs_otel", "1").create_counter("c").add(3)
    hs = Histograms(resource, scope)
    hs.attach(reader)
    hs.create("h", "s", "", (1.0,)).record((("rank", 0),), 2.0)
    data = reader.get_metrics_data()
    (rm,) = data.resource_metrics
    (sm,) = rm.scope_metrics
    assert sorted(m.name for m in sm.metrics) == ["c", "h"]
    mp.shutdown()
