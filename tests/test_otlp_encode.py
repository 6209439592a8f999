"""Our OTLP encoder sends exactly the message the SDK's encoder would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.telemetry.otlp_encode import SpanEncoder
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig

from test_vllm_episodes import start_recovery

pytestmark = pytest.mark.vllm


def same(encoder: SpanEncoder, spans: list) -> None:
    ours = ExportTraceServiceRequest.FromString(encoder.request(spans))
    assert ours == encode_spans(spans)


def recovery_with_link_and_traffic() -> None:
    """A real recovery whose request carries a W3C traceparent, and a plain request."""
    with Harness(HarnessConfig(num_ranks=2)) as h:
        start_recovery(h, "rec", trace_headers={
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        h.add_request("plain", 48, max_tokens=6)
        h.run_until_idle(400)
    current_pipeline().flush()


def test_every_span_of_a_real_recovery(observe):
    recovery_with_link_and_traffic()
    spans = list(observe.spans())
    assert {s.name for s in spans} >= {"kv.recovery", "kv.job", "kv.transfer", "kv.admission",
                                       "kv.first_compute", "kv.request"}
    enc = SpanEncoder()
    same(enc, spans)
    same(enc, spans[::-1])  # again, from the caches, other grouping order
    for s in spans:
        same(enc, [s])


class _Encoded:
    """Stands in the export stage: keeps what the span builder hands over."""

    takes_encoded = True

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def on_encoded(self, resource, scope, data: bytes) -> None:
        self.items.append((resource, scope, data))


def test_spans_encoded_by_the_builder_are_the_sdk_spans_it_would_build(observe, monkeypatch):
    """The builder's direct path (record fields -> Span bytes) sends what its
    ReadableSpan path, encoded by the SDK, sends - for every record of a real
    recovery with a W3C link and ordinary traffic."""
    import random

    from kvobs_otel.pipeline import Observer
    from kvobs_otel.telemetry.providers import make_providers
    from kvobs_otel.telemetry.spans import SpanBuilder

    records: list = []
    emit = Observer.emit
    monkeypatch.setattr(Observer, "emit", lambda self, r: (records.append(r), emit(self, r)))
    recovery_with_link_and_traffic()
    assert {type(r).__name__ for r in records} >= {
        "EpisodeRecord", "JobRecord", "TransferRecord", "FirstComputeRecord", "RequestRecord"}

    providers = make_providers({"kvobs.role": "test"})  # the in-memory exporter of `observe`
    sdk_path = SpanBuilder(providers, 1.0, 64)
    direct = SpanBuilder(providers, 1.0, 64)
    sink = _Encoded()
    direct.encoded_sinks, direct.encoder = [sink], SpanEncoder()
    direct.offset_ns = sdk_path.offset_ns
    before = len(observe.spans())
    for builder in (sdk_path, direct):
        random.seed(5)  # the same random ids (kv.transfer, kv.request roots)
        for r in records:
            builder.build(r)
    built = observe.spans()[before:]
    assert len(built) == len(sink.items) == sdk_path.spans_built > 10
    assert (ExportTraceServiceRequest.FromString(SpanEncoder().frame(sink.items))
            == encode_spans(built))
    providers.close()


ints = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
scalars = st.one_of(st.text(max_size=12), st.booleans(), ints,
                    st.floats(allow_nan=False), st.binary(max_size=6))
values = st.one_of(scalars, st.lists(st.text(max_size=5), max_size=4),
                   st.lists(ints, max_size=4), st.lists(st.booleans(), max_size=3),
                   st.lists(st.floats(allow_nan=False), max_size=3))
attributes = st.dictionaries(st.sampled_from(["a", "b", "kvobs.rank", "ключ", "x.y"]), values,
                             max_size=5)
ids64 = st.integers(min_value=1, max_value=(1 << 64) - 1)
contexts = st.builds(
    lambda t, s, remote, flags, state: SpanContext(
        t, s, is_remote=remote, trace_flags=TraceFlags(flags),
        trace_state=TraceState([("k", state)]) if state else TraceState()),
    st.integers(min_value=1, max_value=(1 << 128) - 1), ids64, st.booleans(),
    st.sampled_from([0, 1]), st.sampled_from(["", "v1"]))
resources = st.sampled_from([Resource.create({"service.name": "a", "kvobs.rank": 1}),
                             Resource.create({"service.name": "b"}, schema_url="https://s/1"),
                             Resource.get_empty()])
scopes = st.sampled_from([InstrumentationScope("kvobs_otel", "0.1"),
                          InstrumentationScope("other", None, "https://s/2"), None])


@st.composite
def spans(draw):
    start = draw(st.integers(min_value=0, max_value=1 << 62))
    status = draw(st.sampled_from([Status(StatusCode.UNSET), Status(StatusCode.OK),
                                   Status(StatusCode.ERROR, "boom"), Status(StatusCode.ERROR)]))
    return ReadableSpan(
        draw(st.text(min_size=1, max_size=10)), draw(contexts),
        draw(st.one_of(st.none(), contexts)), draw(resources), draw(attributes),
        events=tuple(Event(n, a, t) for n, a, t in draw(st.lists(
            st.tuples(st.text(max_size=6), attributes, st.integers(0, 1 << 62)), max_size=2))),
        links=tuple(Link(c, a) for c, a in draw(st.lists(st.tuples(contexts, attributes),
                                                          max_size=2))),
        kind=draw(st.sampled_from(list(SpanKind))), status=status, start_time=start,
        end_time=start + draw(st.integers(0, 10**12)), instrumentation_scope=draw(scopes))


@settings(max_examples=150, deadline=None)
@given(st.lists(spans(), min_size=1, max_size=6))
def test_any_spans_encode_as_the_sdk_encodes_them(batch):
    enc = SpanEncoder()
    same(enc, batch)
    same(enc, batch)  # cached pairs (True vs 1, 1.0 vs 1) stay distinct


def test_bool_int_and_float_values_never_share_a_cache_entry():
    ctx = SpanContext(1, 2, is_remote=False)

    def mk(v: object) -> ReadableSpan:
        return ReadableSpan("s", ctx, None, Resource.get_empty(), {"k": v}, start_time=1,
                            end_time=2)

    enc = SpanEncoder()
    for batch in ([mk(True), mk(1), mk(1.0)], [mk(1), mk(True), mk(1.0)]):
        same(enc, batch)
