"""``kvobs-otel import-hust FILE...``: recorded vLLM-HUST evidence -> spans.

Each stream's records (one process, one schema family; ``hosts/hust/jsonl``)
go, in that process's own order, through a translator of
``hosts/hust/lifecycle.py`` and the span builder every host uses, so an
imported recovery is the same trace as a live one:

- correlated-host v2: the live contract-v2 translators, joined across
  processes by scheduler generation, request, epoch and job id;
- host-fact v1: the live contract-v1 translators; the plugin marks these
  facts unjoined, so each stays in the process that wrote it;
- kv-transfer-event v2: the plugin's own transfer records, per process.

Spans are timed on each process's own clock, anchored to wall time at the
modification time of the file holding its latest record (give or take the
writer's queue): spans of different processes are placed side by side but
never ordered by one another's clocks. No metrics: the evidence is history,
not a live rate. The spans are then judged as ``kvobs-otel check`` judges
them, and unfinished transfers are named by rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.hosts.hust import lifecycle
from kvobs_otel.hosts.hust import plugin_records as P
from kvobs_otel.hosts.hust import records as R
from kvobs_otel.hosts.hust.adapter import HOST
from kvobs_otel.hosts.hust.jsonl import Evidence, Stream
from kvobs_otel.identity import RequestIdHasher
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.telemetry import attributes as A
from kvobs_otel.telemetry.providers import Providers
from kvobs_otel.telemetry.spans import SpanBuilder

ROSTER_CAP = 64  # as KVOBS_OTEL_ROSTER_CAP's default


@dataclass
class ImportResult:
    spans: int = 0
    streams: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)
    # (request id, rank, direction, job) of transfers the evidence never ends
    unfinished: list[tuple[str | None, int, str, int]] = field(default_factory=list)


class _Sink:
    def __init__(self, spans: SpanBuilder, pseudonym: RequestIdHasher | None,
                 unfinished: list[tuple[str | None, int, str, int]]) -> None:
        self.spans = spans
        self.pseudonym = pseudonym
        self.unfinished = unfinished

    def emit(self, record: Any) -> None:
        if self.pseudonym is not None:
            self.pseudonym.apply(record)
        if isinstance(record, rec.TransferRecord) and record.outcome == rec.TRANSFER_UNFINISHED:
            self.unfinished.append((record.req_id, record.rank, record.direction,
                                    record.job_id))
        self.spans.build(record)


def _v1_shape(d: dict[str, Any]) -> dict[str, Any]:
    """A host fact as the contract-v1 record it was made from (native.py):
    the plugin records a receipt only for a successful restore."""
    out: dict[str, Any] = dict.fromkeys(R.V1_FIELDS)
    out.update(ranks=(), job_ids=(), block_count=0, bytes_moved=0, duration_ns=0,
               dropped_descriptors=0, descriptor_count=0)
    out.update({k: v for k, v in d.items() if k in out})
    if d["event"] == "transfer_receipt":
        out.update(operation="h2d_restore", success=True)
    return out


def _translator(stream: Stream) -> tuple[Callable[[Any], Any], Callable[[dict], dict]]:
    """(lifecycle factory, record adapter) for one stream."""
    rank = stream.rank or 0
    if stream.schema == P.CORRELATED_SCHEMA:
        make = lifecycle.lifecycle_for(True, stream.role, stream.rank, "")
        return make, lambda d: d
    if stream.schema == P.HOST_FACT_SCHEMA:
        make = lifecycle.lifecycle_for(False, stream.role, stream.rank, stream.key[2])
        return make, _v1_shape
    gen = f"{stream.key[2]:016x}"  # the plugin's 64-bit worker generation
    return (lambda sink: lifecycle.PluginTransfers(sink, rank, gen)), lambda d: d


def _resource(stream: Stream) -> dict[str, Any]:
    ident = stream.key[2] if isinstance(stream.key[2], str) else f"{stream.key[2]:016x}"
    attrs: dict[str, Any] = {
        A.RES_ROLE: stream.role, A.RES_HOST_ADAPTER: HOST, A.RES_HOST_CONTRACT: stream.schema,
        "service.instance.id": f"{ident}:{stream.role}"
        + (f":{stream.rank}" if stream.rank is not None else ""),
        "kvobs.import.files": sorted(stream.files),
    }
    if stream.rank is not None:
        attrs[A.RES_RANK] = stream.rank
    return attrs


def _import_stream(stream: Stream, make_providers: Callable[[dict], Providers],
                   result: ImportResult, pseudonym: RequestIdHasher | None) -> Providers:
    providers = make_providers(_resource(stream))
    spans = SpanBuilder(providers, 1.0, ROSTER_CAP)
    last = stream.last_ns
    spans.offset_ns = stream.mtime_ns - last  # this process's clock -> wall time
    make, adapt = _translator(stream)
    lc = make(_Sink(spans, pseudonym, result.unfinished))
    for d in stream.ordered():
        lc.record(adapt(d), d["observed_at_ns"])
    # The evidence ends; what is open did not (no process stop: still incomplete).
    if stream.role == "scheduler":
        lc.shutdown(last, rec.END_EVIDENCE_ENDED)
    else:
        lc.shutdown(last, rec.END_EVIDENCE_ENDED, outcome=rec.TRANSFER_UNFINISHED)
    result.anomalies.update(lc.anomalies())
    result.spans += spans.spans_built
    return providers


IMPORT_CLOSE_TIMEOUT_S = 30.0


def import_evidence(evidence: Evidence, make_providers: Callable[[dict], Providers],
                    pseudonym: RequestIdHasher | None = None) -> ImportResult:
    """``pseudonym``: replaces request ids (KVOBS_OTEL_REQUEST_ID_KEY), as live."""
    result = ImportResult()
    made = [_import_stream(s, make_providers, result, pseudonym)
            for s in evidence.streams.values()]
    result.streams = len(made)
    for p in made:
        # Not a serving process: an import may wait for a slow endpoint
        # (OTEL_BSP_EXPORT_TIMEOUT's default).
        p.close(IMPORT_CLOSE_TIMEOUT_S)
    return result


def summary(evidence: Evidence, result: ImportResult, judged: dict[str, Any] | None,
            out: str | None, endpoint: str | None) -> dict[str, Any]:
    return {
        "files": len(evidence.files), "unreadable": [p for p, _ in evidence.unreadable],
        "lines": evidence.lines, "records": evidence.records,
        "by_schema": dict(sorted(evidence.by_schema.items())),
        "refused": dict(sorted((k, v) for k, v in evidence.refused.items() if v)),
        "streams": result.streams, "spans": result.spans,
        "anomalies": dict(sorted((k, v) for k, v in result.anomalies.items() if v)),
        "unfinished_transfers": [
            {"request_id": req, "rank": rank, "direction": d, "job_id": job}
            for req, rank, d, job in sorted(result.unfinished, key=lambda u: (str(u[0]),
                                                                                u[1], u[3]))],
        "episodes": judged, "out": out, "otlp_endpoint": endpoint,
    }


def incomplete(s: dict[str, Any]) -> bool:
    """Anything to report: exit status 1."""
    judged = s["episodes"] or {}
    return bool(s["refused"] or s["anomalies"] or s["unreadable"] or s["unfinished_transfers"]
                or judged.get("incomplete"))


def format_summary(s: dict[str, Any], table: str | None = None) -> str:
    lines = [f"read {s['lines']} lines from {s['files']} files: {s['records']} records "
             f"of {s['streams']} processes -> {s['spans']} spans"]
    if s["by_schema"]:
        lines.append("  " + ", ".join(f"{k}: {v}" for k, v in s["by_schema"].items()))
    for path in s["unreadable"]:
        lines.append(f"  unreadable: {path}")
    if s["refused"]:
        lines.append("  refused lines: " + ", ".join(f"{k}={v}" for k, v in s["refused"].items()))
    if s["anomalies"]:
        lines.append("  anomalies: " + ", ".join(f"{k}={v}" for k, v in s["anomalies"].items()))
    for u in s["unfinished_transfers"]:
        lines.append(f"  rank {u['rank']}: {u['direction']} transfer {u['job_id']} of request "
                     f"{u['request_id']} never completed in the evidence")
    if table:
        lines.append(table)
    if s["out"]:
        lines.append(f"wrote {s['out']}")
    if s["otlp_endpoint"]:
        lines.append(f"exported to {s['otlp_endpoint']}")
    return "\n".join(lines)
