"""Reading exported spans back as recovery chains, for assertions.

Works on SDK ``ReadableSpan`` objects (in-memory exporter) and on
``FileSpan`` (OTLP receiver, OTLP JSON files) through one small view.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kvobs_otel import identity


@dataclass
class SpanView:
    name: str
    trace_id: int
    span_id: int
    parent_id: int | None
    attrs: dict[str, Any]
    resource: dict[str, Any]
    error: bool
    events: list[str]
    start_ns: int
    end_ns: int


def view(span: Any) -> SpanView:
    if hasattr(span, "context"):  # SDK ReadableSpan
        return SpanView(
            span.name, span.context.trace_id, span.context.span_id,
            span.parent.span_id if span.parent else None, dict(span.attributes),
            dict(span.resource.attributes), span.status.status_code.name == "ERROR",
            [e.name for e in span.events], span.start_time, span.end_time)
    return SpanView(  # kvobs_otel.tools.otlp_file.FileSpan (OTLP receiver, OTLP JSON file)
        span.name, int(span.trace_id, 16), int(span.span_id, 16),
        int(span.parent_span_id, 16) if span.parent_span_id else None,
        dict(span.attributes), dict(span.resource), span.error,
        list(span.events), span.start_ns, span.end_ns)


def by_trace(spans: list[Any]) -> dict[int, list[SpanView]]:
    out: dict[int, list[SpanView]] = defaultdict(list)
    for s in spans:
        v = view(s)
        out[v.trace_id].append(v)
    return out


def assert_recovered_chain(trace: list[SpanView], ranks: set[int]) -> SpanView:
    """One recovered episode: the full chain, every rank, right parentage."""
    roots = [s for s in trace if s.name == "kv.recovery"]
    assert len(roots) == 1, [s.name for s in trace]
    root = roots[0]
    assert root.parent_id is None
    a = root.attrs
    assert a["kvobs.outcome"] == "recovered", a
    tid, sid = identity.episode_ids(a["kvobs.scheduler.generation"], a["kvobs.request.id"],
                                    a["kvobs.recovery.epoch"])
    assert (root.trace_id, root.span_id) == (tid, sid)
    assert "kv.requeued" in root.events and "kv.preserve" in root.events
    assert not root.error

    jobs = {s.attrs["kvobs.job.id"]: s for s in trace if s.name == "kv.job"}
    for job in jobs.values():
        assert job.parent_id == root.span_id
        assert set(job.attrs["kvobs.receipt.ranks"]) == ranks, job.attrs
        assert job.attrs["kvobs.outcome"] == "complete"
    restores = list(a.get("kvobs.restore.job_ids", ()))
    for job_id in restores:
        assert jobs[job_id].attrs["kvobs.job.role"] == "restore"
        transfers = [s for s in trace if s.name == "kv.transfer"
                     and s.attrs["kvobs.job.id"] == job_id]
        assert {t.attrs["kvobs.rank"] for t in transfers} == ranks
        for t in transfers:
            assert t.attrs["kvobs.direction"] == "h2d"
            assert t.parent_id == jobs[job_id].span_id
            assert t.attrs["kvobs.bytes"] > 0 and len(t.attrs["kvobs.worker.generation"]) == 32

    (adm,) = [s for s in trace if s.name == "kv.admission"]
    assert adm.parent_id == root.span_id
    assert list(adm.attrs["kvobs.admission.roster"]) == sorted(restores)
    fcs = [s for s in trace if s.name == "kv.first_compute"]
    assert sorted(s.attrs["kvobs.rank"] for s in fcs) == sorted(ranks)
    assert all(s.parent_id == adm.span_id for s in fcs)
    assert set(a["kvobs.first_compute.ranks"]) == ranks
    # The worker generations of first compute match the ones on transfers.
    gens = {s.attrs["kvobs.rank"]: s.attrs["kvobs.worker.generation"] for s in fcs}
    for t in (s for s in trace if s.name == "kv.transfer"):
        assert gens[t.attrs["kvobs.rank"]] == t.attrs["kvobs.worker.generation"]
    return root


def episodes(spans: list[Any]) -> list[tuple[SpanView, list[SpanView]]]:
    """(root, whole trace) for every kv.recovery root."""
    traces = by_trace(spans)
    return [(s, traces[s.trace_id]) for t in traces.values() for s in t
            if s.name == "kv.recovery"]
