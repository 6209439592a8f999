"""``kvobs-otel import-hust FILE...``: recorded vLLM-HUST evidence -> spans.

Each process's records go, in that process's own order, through the same
translators as the live adapter (``hosts/hust/lifecycle.py``) and the same
span builder as every host, so an imported recovery is the same trace as a
live one. Spans are timed on each process's own clock, anchored to wall time
at its file's last write (the file's mtime is when its last record was
written, give or take the writer's queue): spans of different processes are
placed side by side but never ordered by one another's clocks. No metrics:
the evidence is history, not a live rate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.hosts.hust import contracts, lifecycle, records
from kvobs_otel.hosts.hust.adapter import HOST
from kvobs_otel.hosts.hust.jsonl import Evidence, ProcessEvidence
from kvobs_otel.identity import RequestIdHasher
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.telemetry import attributes as A
from kvobs_otel.telemetry.providers import Providers
from kvobs_otel.telemetry.spans import SpanBuilder

ROSTER_CAP = 64  # as KVOBS_OTEL_ROSTER_CAP's default


@dataclass
class ImportResult:
    spans: int = 0
    processes: int = 0
    superseded_v1: int = 0  # v1 lines of a process that also wrote v2
    unrouted: int = 0  # v1 descriptor records: nothing to join, never exported
    anomalies: Counter[str] = field(default_factory=Counter)


class _Sink:
    def __init__(self, spans: SpanBuilder, pseudonym: RequestIdHasher | None) -> None:
        self.spans = spans
        self.pseudonym = pseudonym

    def emit(self, record: Any) -> None:
        if self.pseudonym is not None:
            self.pseudonym.apply(record)
        self.spans.build(record)


def _resource(proc: ProcessEvidence, contract: contracts.Contract, role: str,
              rank: int | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        A.RES_ROLE: role, A.RES_HOST_ADAPTER: HOST, A.RES_HOST_CONTRACT: contract.name,
        A.RES_PROCESS_START_ID: proc.start_id, "process.pid": proc.pid,
        "service.instance.id": f"{proc.start_id}:{role}" + (f":{rank}" if rank is not None
                                                             else ""),
        "kvobs.import.files": sorted(proc.files),
    }
    if rank is not None:
        attrs[A.RES_RANK] = rank
    return attrs


def _import_process(proc: ProcessEvidence, make_providers: Callable[[dict], Providers],
                    result: ImportResult, pseudonym: RequestIdHasher | None
                    ) -> list[Providers]:
    lines = proc.ordered()
    correlated = any(key == "v2" for key, _ in lines)
    if correlated:
        result.superseded_v1 += sum(key == "v1" for key, _ in lines)
        lines = [x for x in lines if x[0] == "v2"]
    if not lines:
        return []
    contract = contracts.V2 if correlated else contracts.V1
    events = records.V2_SCHEDULER_EVENTS if correlated else records.V1_SCHEDULER_EVENTS
    last = max(d["observed_at_ns"] for _, d in lines)
    offset = proc.mtime_ns - last  # this process's clock -> wall time
    made: dict[tuple[str, int | None], tuple[Any, SpanBuilder, Providers]] = {}
    for _key, d in lines:
        role = records.role_of(d, events)
        if role is None:
            result.unrouted += 1
            continue
        entry = made.get(role)
        if entry is None:
            providers = make_providers(_resource(proc, contract, *role))
            spans = SpanBuilder(providers, 1.0, ROSTER_CAP)
            spans.offset_ns = offset
            # v1 records carry no generation: the process start id is unique per process.
            lc = lifecycle.lifecycle_for(correlated, role[0], role[1], proc.start_id)(
                _Sink(spans, pseudonym))
            entry = made[role] = (lc, spans, providers)
        entry[0].record(d, d["observed_at_ns"])
    for lc, spans, _p in made.values():
        if lc.role == "scheduler":
            lc.shutdown(last)
        else:
            lc.shutdown(last, rec.TRANSFER_UNFINISHED)
        result.anomalies.update(lc.anomalies())
        result.spans += spans.spans_built
    return [p for _lc, _s, p in made.values()]


def import_evidence(evidence: Evidence, make_providers: Callable[[dict], Providers],
                    pseudonym: RequestIdHasher | None = None) -> ImportResult:
    """``pseudonym``: replaces request ids (KVOBS_OTEL_REQUEST_ID_KEY), as live."""
    result = ImportResult()
    all_providers: list[Providers] = []
    for proc in evidence.processes.values():
        made = _import_process(proc, make_providers, result, pseudonym)
        result.processes += bool(made)
        all_providers.extend(made)
    for p in all_providers:
        p.flush()
        p.shutdown()
    return result


def summary(evidence: Evidence, result: ImportResult, out: str | None,
            endpoint: str | None) -> dict[str, Any]:
    return {
        "files": len(evidence.files), "unreadable": [p for p, _ in evidence.unreadable],
        "lines": evidence.lines, "records": evidence.records,
        "refused": dict(sorted((k, v) for k, v in evidence.refused.items() if v)),
        "superseded_v1": result.superseded_v1, "processes": result.processes,
        "spans": result.spans,
        "anomalies": dict(sorted((k, v) for k, v in result.anomalies.items() if v)),
        "out": out, "otlp_endpoint": endpoint,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"read {s['lines']} lines from {s['files']} files: {s['records']} records "
             f"of {s['processes']} processes -> {s['spans']} spans"]
    for path in s["unreadable"]:
        lines.append(f"  unreadable: {path}")
    if s["refused"]:
        lines.append("  refused lines: " + ", ".join(f"{k}={v}" for k, v in s["refused"].items()))
    if s["anomalies"]:
        lines.append("  anomalies: " + ", ".join(f"{k}={v}" for k, v in s["anomalies"].items()))
    if s["superseded_v1"]:
        lines.append(f"  {s['superseded_v1']} v1 records not used: their processes wrote v2")
    if s["out"]:
        lines.append(f"wrote {s['out']}")
    if s["otlp_endpoint"]:
        lines.append(f"exported to {s['otlp_endpoint']}")
    return "\n".join(lines)
