"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
reproduces its documented public surface; see shared/design/hust-contract.md.

JSONL writers (and a reader) for the fork plugin's three file schemas, as the
future ``import-hust`` command will read them. The doc names the schemas
(``vllm-hust.kv-transfer-event.v2``, ``vllm-hust.host-fact.v1``,
``vllm-hust.correlated-host.v2``) but NOT their fields: THE FIELD LAYOUT
BELOW IS THIS STAND-IN'S ASSUMPTION, to be checked against the fork plugin's
real files when they can be reached.

Assumed layout: UTF-8, one JSON object per line, keys sorted, no blank lines.
Every line has::

    "schema"            one of the three schema names
    "pid"               int, the emitting process's pid
    "process_start_id"  str, 32 lowercase hex, unique per process lifetime
                        (pids are reused; this is not)
    "seq"               int, 0, 1, 2, ... per writer (one writer per process file)

then the record's own fields, flat, under their record names:

``vllm-hust.kv-transfer-event.v2`` (one contract v1 ``KVTransferObservation``)::

    "contract": "vllm.kv-transfer.observer.v1", "api_version": "1.0",
    every KVTransferObservation field: event, observed_at_ns, operation,
    job_id, rank, request_id, block_count, success, bytes_moved, duration_ns,
    reason, ranks [int], recovery_epoch, job_ids [int],
    requeue_reason, descriptors [[src_region_id, dst_region_id, src_offset,
    dst_offset, size]], dropped_descriptors, compute_kind
    (unused fields written as the record holds them: null, [] or 0)

``vllm-hust.correlated-host.v2`` (one contract v2 ``CorrelatedObservation``)::

    "contract": "vllm.kv-transfer.observer.v2", "api_version": "2.0",
    event, scheduler_generation, request_id, recovery_epoch, observed_at_ns,
    job_id, rank, worker_generation, block_count (null when absent),
    workers [[rank, worker_generation]] or null,
    roster [[job_id, [[rank, worker_generation]]]] or null, compute_kind

``vllm-hust.host-fact.v1`` (one fact about the emitting process, written
first in each file)::

    observed_at_ns   per-process monotonic, as the records'
    role             "scheduler" or "worker"
    rank             int or null (scheduler)
    generation       the process's scheduler/worker generation (32 hex) or null
    contracts        [{"contract": str, "api_version": str}] the host admitted
    host             "vllm-hust"

``observed_at_ns`` is the process's monotonic clock: comparable only between
lines with the same ``process_start_id``. The fork's plugin writes through a
bounded queue and a background thread; this stand-in writes synchronously.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from . import correlated_observability as v2
from . import observability as v1
from .chains import Chain, Process
from .correlated_observability import CorrelatedObservation
from .observability import KVTransferObservation

TRANSFER_EVENT_SCHEMA = "vllm-hust.kv-transfer-event.v2"
HOST_FACT_SCHEMA = "vllm-hust.host-fact.v1"
CORRELATED_SCHEMA = "vllm-hust.correlated-host.v2"
SCHEMAS = (TRANSFER_EVENT_SCHEMA, HOST_FACT_SCHEMA, CORRELATED_SCHEMA)

_IDENTITY = ("schema", "pid", "process_start_id", "seq")


@dataclass(frozen=True)
class HostFact:
    observed_at_ns: int
    role: str
    rank: int | None
    generation: str | None
    contracts: tuple[tuple[str, str], ...] = (
        (v1.KV_TRANSFER_OBSERVER_CONTRACT, v1.KV_TRANSFER_OBSERVABILITY_API_VERSION),
        (v2.KV_TRANSFER_OBSERVER_CONTRACT, v2.KV_TRANSFER_OBSERVABILITY_API_VERSION),
    )
    host: str = "vllm-hust"


@dataclass(frozen=True)
class Line:
    """One parsed line: identity plus the record it carries."""

    schema: str
    pid: int
    process_start_id: str
    seq: int
    record: KVTransferObservation | CorrelatedObservation | HostFact


class JsonlWriter:
    """Writes one process's lines to ``path`` (appending)."""

    def __init__(self, path: str | Path, *, pid: int, process_start_id: str) -> None:
        self.path = Path(path)
        self.pid = pid
        self.process_start_id = process_start_id
        self.seq = 0
        self._fh: IO[str] = self.path.open("a", encoding="utf-8")

    def _write(self, schema: str, fields: dict[str, Any]) -> None:
        line = {"schema": schema, "pid": self.pid,
                "process_start_id": self.process_start_id, "seq": self.seq, **fields}
        self.seq += 1
        self._fh.write(json.dumps(line, sort_keys=True, ensure_ascii=True) + "\n")
        self._fh.flush()

    def write_transfer_event(self, record: KVTransferObservation) -> None:
        self._write(TRANSFER_EVENT_SCHEMA, {
            "contract": v1.KV_TRANSFER_OBSERVER_CONTRACT,
            "api_version": v1.KV_TRANSFER_OBSERVABILITY_API_VERSION, **asdict(record)})

    def write_correlated(self, record: CorrelatedObservation) -> None:
        self._write(CORRELATED_SCHEMA, {
            "contract": v2.KV_TRANSFER_OBSERVER_CONTRACT,
            "api_version": v2.KV_TRANSFER_OBSERVABILITY_API_VERSION, **asdict(record)})

    def write_host_fact(self, fact: HostFact) -> None:
        fields = asdict(fact)
        fields["contracts"] = [{"contract": c, "api_version": a} for c, a in fact.contracts]
        self._write(HOST_FACT_SCHEMA, fields)

    def write(self, record: Any) -> None:
        if isinstance(record, KVTransferObservation):
            self.write_transfer_event(record)
        elif isinstance(record, CorrelatedObservation):
            self.write_correlated(record)
        elif isinstance(record, HostFact):
            self.write_host_fact(record)
        else:
            raise TypeError(f"no schema for {type(record).__name__}")

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tuples(value: Any) -> Any:
    """JSON arrays back to (nested) tuples."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def parse_line(text: str) -> Line:
    obj = json.loads(text)
    schema = obj["schema"]
    ident = {k: obj.pop(k) for k in _IDENTITY}
    if schema == TRANSFER_EVENT_SCHEMA:
        obj.pop("contract"), obj.pop("api_version")
        for k in ("ranks", "job_ids", "descriptors"):
            obj[k] = _tuples(obj[k])
        record: Any = KVTransferObservation(**obj)
    elif schema == CORRELATED_SCHEMA:
        obj.pop("contract"), obj.pop("api_version")
        for k in ("workers", "roster"):
            obj[k] = _tuples(obj[k])
        record = CorrelatedObservation(**obj)
    elif schema == HOST_FACT_SCHEMA:
        obj["contracts"] = tuple((c["contract"], c["api_version"]) for c in obj["contracts"])
        record = HostFact(**obj)
    else:
        raise ValueError(f"unknown schema {schema!r}")
    return Line(ident["schema"], ident["pid"], ident["process_start_id"], ident["seq"], record)


def read_jsonl(path: str | Path) -> list[Line]:
    with Path(path).open(encoding="utf-8") as fh:
        return [parse_line(t) for t in fh if t.strip()]


def host_fact_for(process: Process, observed_at_ns: int = 0) -> HostFact:
    return HostFact(observed_at_ns, process.role, process.rank, process.generation)


def write_chain_files(directory: str | Path, chain: Chain,
                      host_facts: bool = True) -> list[Path]:
    """One file per emitting process, ``<role>[-<rank>]-<pid>.jsonl``, each
    opening with that process's host fact; lines in chain order."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    writers: dict[str, JsonlWriter] = {}
    try:
        for emission in chain:
            p = emission.process
            w = writers.get(p.start_id)
            if w is None:
                name = p.role + (f"-{p.rank}" if p.rank is not None else "") + f"-{p.pid}.jsonl"
                w = writers[p.start_id] = JsonlWriter(directory / name, pid=p.pid,
                                                      process_start_id=p.start_id)
                if host_facts:
                    first = emission.record.observed_at_ns
                    w.write_host_fact(host_fact_for(p, max(first - 1, 0)))
            w.write(emission.record)
    finally:
        for w in writers.values():
            w.close()
    return [w.path for w in writers.values()]


def read_records(paths: Iterable[str | Path]) -> list[Line]:
    out: list[Line] = []
    for p in paths:
        out.extend(read_jsonl(p))
    return out
