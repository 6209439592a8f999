"""Read the vLLM-HUST plugin's JSONL evidence files, one process at a time.

Schemas: ``vllm-hust.kv-transfer-event.v2`` (a contract v1 record per line),
``vllm-hust.correlated-host.v2`` (a contract v2 record) and
``vllm-hust.host-fact.v1`` (a fact about the writing process). The fork's
docs name these schemas, not their fields; the layout read here is the one
documented in docs/hosts.md: every line carries ``schema``, ``pid``,
``process_start_id`` (32 hex, unique per process lifetime), ``seq`` (the
writer's line number) and the record's own fields, flat, plus ``contract``
and ``api_version`` on record lines.

Records are grouped by ``process_start_id`` and ordered by ``seq``, never by
``observed_at_ns``: each process has its own monotonic clock. Every line that
cannot be used is counted by reason; none raises.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.hosts.hust import contracts, records

TRANSFER_EVENT_SCHEMA = "vllm-hust.kv-transfer-event.v2"
CORRELATED_SCHEMA = "vllm-hust.correlated-host.v2"
HOST_FACT_SCHEMA = "vllm-hust.host-fact.v1"
_RECORD_SCHEMAS = {TRANSFER_EVENT_SCHEMA: contracts.V1, CORRELATED_SCHEMA: contracts.V2}

# Line-level refusal reasons (record-level ones come from ``records``).
NOT_JSON = "line_not_json"
TRUNCATED = "line_truncated"
DUPLICATE_KEY = "line_duplicate_key"
NOT_OBJECT = "line_not_object"
BAD_IDENTITY = "line_bad_identity"
UNKNOWN_SCHEMA = "line_unknown_schema"
DUPLICATE_SEQ = "line_duplicate_seq"
BAD_HOST_FACT = "line_bad_host_fact"


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of repeated keys silently; evidence with two
    # values for one field is ambiguous, so the line is refused.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


@dataclass
class ProcessEvidence:
    """Everything one process wrote (it may span several files)."""

    start_id: str
    pid: int
    files: set[str] = field(default_factory=set)
    role: str | None = None  # from its host fact
    rank: int | None = None
    generation: str | None = None
    # seq -> (contract key, validated record fields)
    lines: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    mtime_ns: int = 0

    def ordered(self) -> list[tuple[str, dict[str, Any]]]:
        return [self.lines[s] for s in sorted(self.lines)]


@dataclass
class Evidence:
    processes: dict[str, ProcessEvidence] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    lines: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (path, why)

    @property
    def records(self) -> int:
        return sum(len(p.lines) for p in self.processes.values())


def _identity(obj: dict[str, Any]) -> tuple[str, int, str, int] | None:
    schema, pid, start, seq = (obj.get("schema"), obj.get("pid"), obj.get("process_start_id"),
                               obj.get("seq"))
    ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= records.MAX_ID
                  for v in (pid, seq))
    start_ok = (isinstance(start, str) and len(start) == 32
                and all(c in "0123456789abcdef" for c in start))
    if not (isinstance(schema, str) and ints_ok and start_ok):
        return None
    return schema, pid, start, seq  # type: ignore[return-value]


def _host_fact(proc: ProcessEvidence, obj: dict[str, Any]) -> str | None:
    role, rank, gen = obj.get("role"), obj.get("rank"), obj.get("generation")
    if role not in ("scheduler", "worker"):
        return BAD_HOST_FACT
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                             or not 0 <= rank < records.MAX_RANK):
        return BAD_HOST_FACT
    if gen is not None:
        try:
            records._generation(gen)
        except records.Refused:
            return BAD_HOST_FACT
    if proc.role is not None and (proc.role, proc.rank) != (role, rank):
        return BAD_HOST_FACT  # two different facts about one process
    proc.role, proc.rank, proc.generation = role, rank, gen
    return None


def _record(obj: dict[str, Any], contract: contracts.Contract) -> tuple[dict | None, str | None]:
    if obj.get("contract") != contract.name:
        return None, contracts.UNKNOWN_CONTRACT
    if obj.get("api_version") != contract.api_version:
        return None, contracts.UNKNOWN_API_VERSION
    if contract is contracts.V2:
        fields = {k: records.json_tuples(obj.get(k)) for k in records.V2_FIELDS}
        return records.check_v2(fields)
    fields = {k: records.json_tuples(obj.get(k)) for k in records.V1_FIELDS}
    return records.check_v1(fields)


def _line(ev: Evidence, path: str, text: str, last: bool) -> None:
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey:
        ev.refused[DUPLICATE_KEY] += 1
        return
    except ValueError:  # JSONDecodeError, bad UTF-8 surrogates, huge numbers
        ev.refused[TRUNCATED if last else NOT_JSON] += 1
        return
    if not isinstance(obj, dict):
        ev.refused[NOT_OBJECT] += 1
        return
    ident = _identity(obj)
    if ident is None:
        ev.refused[BAD_IDENTITY] += 1
        return
    schema, pid, start, seq = ident
    if schema != HOST_FACT_SCHEMA and schema not in _RECORD_SCHEMAS:
        ev.refused[UNKNOWN_SCHEMA] += 1
        return
    proc = ev.processes.get(start)
    if proc is None:
        proc = ev.processes[start] = ProcessEvidence(start, pid)
    if proc.pid != pid:
        ev.refused[BAD_IDENTITY] += 1  # one process start id, two pids
        return
    proc.files.add(path)
    if schema == HOST_FACT_SCHEMA:
        reason = _host_fact(proc, obj)
        if reason:
            ev.refused[reason] += 1
        return
    contract = _RECORD_SCHEMAS[schema]
    fields, reason = _record(obj, contract)
    if fields is None:
        ev.refused[reason or records.NOT_A_RECORD] += 1
        return
    if seq in proc.lines:
        ev.refused[DUPLICATE_SEQ] += 1
        return
    proc.lines[seq] = (contract.key, fields)


def read_evidence(paths: list[str], progress: Any = None) -> Evidence:
    """Read every file; unreadable files are listed, bad lines counted."""
    ev = Evidence()
    for path in paths:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            mtime = os.stat(path).st_mtime_ns
        except OSError as e:
            ev.unreadable.append((path, e.strerror or str(e)))
            continue
        ev.files.append(path)
        text = data.decode("utf-8", errors="replace")  # bad bytes -> a line that fails
        chunks = text.split("\n")
        complete = chunks[:-1]
        tail = chunks[-1]  # no newline after it: the writer may have been cut off
        for i, chunk in enumerate(complete + ([tail] if tail.strip() else [])):
            if not chunk.strip():
                continue
            ev.lines += 1
            _line(ev, path, chunk, last=i == len(complete))
        for proc in ev.processes.values():
            if path in proc.files:
                proc.mtime_ns = max(proc.mtime_ns, mtime)
        if progress is not None:
            progress(path, len(complete))
    return ev
