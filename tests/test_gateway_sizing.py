"""The pure-Python parts of benchmarks/gateway_sizing/: re-sent episodes
keep the recorded shapes with fresh ids, the line fit, the sizing
arithmetic and the reading of the Collector's metrics. No Collector, no
timing."""

from __future__ import annotations

import json
import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from benchmarks.gateway_sizing.fit import fit_line, shipped_settings, size_gateway
from benchmarks.gateway_sizing.gateway import counters, parse_metrics
from benchmarks.gateway_sizing.recording import load_episodes

TRACE = "0af7651916cd43dd8448eb211c80319c"
REQUEST_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _attr(key: str, value: object) -> dict:
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _span(name: str, span_id: str, parent: str = "", trace: str = TRACE, t: int = 0,
          **attrs: object) -> dict:
    out = {"traceId": trace, "spanId": span_id, "name": name, "kind": 1,
           "startTimeUnixNano": str(1_700_000_000_000_000_000 + t),
           "endTimeUnixNano": str(1_700_000_000_000_000_000 + t + 1_000_000),
           "attributes": [_attr(k.replace("_", "."), v) for k, v in attrs.items()]}
    if parent:
        out["parentSpanId"] = parent
    return out


def _doc(role: str, spans: list[dict]) -> str:
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [_attr("service.name", "kvobs-otel"),
                                    _attr("kvobs.role", role)]},
        "scopeSpans": [{"scope": {"name": "kvobs_otel", "version": "0.1.0"},
                        "spans": spans}]}]})


# One episode as the scheduler and one rank export it (two export requests,
# two resources), and an ordinary-traffic trace that is not an episode.
RECORDING = [
    _doc("scheduler", [
        _span("kv.recovery", "1111111111111111", kvobs_recovery_epoch=1),
        _span("kv.job", "2222222222222222", "1111111111111111", t=10, kvobs_job_id=7),
        _span("kv.admission", "3333333333333333", "1111111111111111", t=20),
        _span("kv.request", "9999999999999999", trace=REQUEST_TRACE),
    ]),
    _doc("worker", [
        _span("kv.transfer", "4444444444444444", "2222222222222222", t=11, kvobs_rank=0),
        _span("kv.first_compute", "5555555555555555", "3333333333333333", t=21),
    ]),
]


def _shape(data: bytes) -> dict[bytes, list[tuple[str, str, str, str]]]:
    """trace id -> [(role, name, span id, parent's name)], ids hidden."""
    req = ExportTraceServiceRequest.FromString(data)
    spans = [(rs.resource.attributes, s) for rs in req.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    name_of = {s.span_id: s.name for _, s in spans}
    out: dict[bytes, list] = {}
    for attrs, s in spans:
        role = next(a.value.string_value for a in attrs if a.key == "kvobs.role")
        out.setdefault(s.trace_id, []).append(
            (role, s.name, s.span_id, name_of.get(s.parent_span_id, "")))
    return out


def test_episodes_are_resent_with_the_recorded_shape_and_fresh_ids():
    episodes, other = load_episodes(RECORDING, now_ns=1_800_000_000_000_000_000)
    assert other == {"other_traces_by_root": {"kv.request": 1}}
    (ep,) = episodes
    assert ep.spans == 5 and ep.resources == 2
    original = _shape(ep.data)
    assert list(original) == [bytes.fromhex(TRACE)]

    rng = random.Random(0)
    copies = [ep.fresh(rng) for _ in range(3)]
    # Fragments concatenate into one export request: three distinct traces.
    traces = _shape(b"".join(copies))
    assert len(traces) == 3 and bytes.fromhex(TRACE) not in traces
    want = sorted((role, name, parent) for role, name, _, parent in original[bytes.fromhex(TRACE)])
    seen_ids: set[bytes] = {sid for *_, sid, _ in original[bytes.fromhex(TRACE)]}
    for spans in traces.values():
        assert sorted((role, name, parent) for role, name, _, parent in spans) == want
        ids = {sid for _, _, sid, _ in spans}
        assert len(ids) == 5 and not ids & seen_ids  # fresh, never reused
        seen_ids |= ids

    # Attributes and durations are the recorded ones; times moved to now.
    req = ExportTraceServiceRequest.FromString(copies[0])
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    job = next(s for s in spans if s.name == "kv.job")
    assert [(a.key, a.value.int_value) for a in job.attributes] == [("kvobs.job.id", 7)]
    assert all(s.end_time_unix_nano - s.start_time_unix_nano == 1_000_000 for s in spans)
    assert max(s.end_time_unix_nano for s in spans) <= 1_800_000_000_000_000_000
    assert len(copies[0]) == len(ep.data)


def test_fit_line_and_sizing_arithmetic():
    fit = fit_line([0, 10, 30, 60], [50.0, 70.0, 110.0, 170.0])
    assert fit["slope"] == pytest.approx(2.0) and fit["intercept"] == pytest.approx(50.0)
    assert fit["r2"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        fit_line([1.0], [1.0])

    rec = size_gateway(new_traces_per_s=200, decision_wait_s=30, spans_per_trace=7,
                       mib_per_1k_traces=2.0, base_mib=50, spans_per_core_s=70_000,
                       headroom=2.0, idle_cores=0.01, heap_mib_per_1k_traces=1.5,
                       heap_base_mib=10, soft_limit_fraction=0.6)
    assert rec["num_traces"] == 12_000 and rec["open_traces"] == 6_000
    assert rec["memory_mib"] == pytest.approx(50 + 2.0 * 12)
    assert rec["heap_mib"] == pytest.approx(10 + 1.5 * 12)
    # the heap must stay under memory_limiter's soft limit: 28 MiB / 0.6 < 74 MiB RSS
    assert rec["container_limit_mib"] == pytest.approx(74)
    assert rec["spans_per_s"] == 1400 and rec["cores"] == pytest.approx(0.03)
    assert rec["gateways"] == 1

    # Past what one gateway sustained, the load is shared (by trace id).
    big = size_gateway(new_traces_per_s=3000, decision_wait_s=30, spans_per_trace=10,
                       mib_per_1k_traces=2.0, base_mib=50, spans_per_core_s=70_000,
                       headroom=2.0, sustained_spans_per_s=20_000)
    assert big["gateways"] == 2 and big["new_traces_per_s"] == 3000
    assert big["per_gateway_new_traces_per_s"] == 1500 and big["num_traces"] == 90_000
    assert big["spans_per_s"] == 15_000


def test_the_shipped_limits_are_read_from_the_gateway_config():
    shipped = shipped_settings()
    assert shipped["num_traces"] > 0
    assert 0 < shipped["spike_limit_percentage"] < shipped["limit_percentage"] <= 100


def test_counters_read_the_collectors_own_metrics():
    text = "\n".join([
        "# HELP otelcol_receiver_accepted_spans x",
        'otelcol_receiver_accepted_spans{receiver="otlp",transport="grpc"} 70',
        'otelcol_receiver_refused_spans{receiver="otlp",transport="grpc"} 0',
        'otelcol_exporter_sent_spans{exporter="otlp/jaeger",server_port="1"} 63',
        'otelcol_exporter_sent_spans{exporter="otlp/tempo",server_port="1"} 63',
        'otelcol_processor_tail_sampling_global_count_traces_sampled{decision="sampled",'
        'sampled="true"} 9',
        "otelcol_processor_tail_sampling_sampling_traces_on_memory 10",
        'otelcol_processor_tail_sampling_sampling_decision_timer_latency_bucket{le="1000"} 4',
        "otelcol_processor_tail_sampling_sampling_decision_timer_latency_count 5",
        "otelcol_process_memory_rss 1.048576e+08",
    ])
    c = counters(parse_metrics(text))
    assert c["accepted"] == 70 and c["refused"] == 0
    assert c["delivered"] == 63 and c["delivered_tempo"] == 63
    assert c["decided"] == 9 and c["on_memory"] == 10
    assert c["tick_over_1s"] == 1 and c["rss_mib"] == 100
