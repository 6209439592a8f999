"""Read the vLLM-HUST plugin's JSONL files into per-process record streams.

A file may hold the lines of several processes: with
``VLLM_HUST_KV_TRANSFER_OBSERVABILITY_EVENT_PATH`` set, the scheduler and
every worker append to one file, whole lines under a lock (the plugin's
``events.py``). No line carries a process id or a writer sequence; what
identifies the writing process is in the records themselves
(``plugin_records`` validates them):

| schema | stream (one process's records) |
| --- | --- |
| correlated-host v2, scheduler events | ``scheduler_generation`` |
| correlated-host v2, rank events | ``worker_generation`` (and ``rank``) |
| host-fact v1 | ``process_uuid`` |
| kv-transfer-event v2 | ``identity.worker_generation`` and ``identity.rank`` |

(A kv-transfer-event's transfer and receipt ids carry the writing process's
32-hex scope too; they are kept as ids.) Within a stream, records are ordered
by ``observed_at_ns``, which is that process's monotonic clock, then by their
place in the files; times of different streams are never compared.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.hosts.hust import plugin_records as P
from kvobs_otel.hosts.hust import records as R

MAX_LINE_BYTES = 1024 * 1024  # the plugin's max_record_bytes and its validator's limit

TOO_LARGE = "line_too_large"
NOT_JSON = "line_not_json"
TRUNCATED = "line_truncated"
DUPLICATE_KEY = "line_duplicate_key"
NON_FINITE = "line_non_finite_number"
NOT_OBJECT = "line_not_object"
UNKNOWN_SCHEMA = "line_unknown_schema"


class _Refuse(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of repeated keys silently; evidence with two
    # values for one field is ambiguous, so the line is refused.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refuse(DUPLICATE_KEY)
        out[k] = v
    return out


def _non_finite(_text: str) -> Any:
    raise _Refuse(NON_FINITE)  # NaN, Infinity: not JSON, and never written


@dataclass
class Stream:
    """One process's records of one schema family, in that process's order."""

    schema: str
    key: tuple[Any, ...]
    role: str  # "scheduler" or "worker"
    rank: int | None
    # (observed_at_ns, file index, line number, record fields)
    records: list[tuple[int, int, int, dict[str, Any]]] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    mtime_ns: int = 0  # of the file holding its latest record
    last_ns: int = -1  # that record's observed_at_ns

    def ordered(self) -> list[dict[str, Any]]:
        return [r[3] for r in sorted(self.records, key=lambda r: r[:3])]


@dataclass
class Evidence:
    streams: dict[tuple[Any, ...], Stream] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    lines: int = 0
    by_schema: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (path, why)

    @property
    def records(self) -> int:
        return sum(len(s.records) for s in self.streams.values())


def stream_of(schema: str, d: dict[str, Any]) -> tuple[tuple[Any, ...], str, int | None]:
    """(stream key, role, rank) of a valid record."""
    if schema == P.CORRELATED_SCHEMA:
        if d["event"] in R.V2_SCHEDULER_EVENTS:
            return (schema, "scheduler", d["scheduler_generation"]), "scheduler", None
        return (schema, "worker", d["worker_generation"]), "worker", d["rank"]
    if schema == P.HOST_FACT_SCHEMA:
        if d["event"] == "first_compute":
            return (schema, "worker", d["process_uuid"]), "worker", d["rank"]
        return (schema, "scheduler", d["process_uuid"]), "scheduler", None
    return (schema, "worker", d["worker_generation"], d["rank"]), "worker", d["rank"]


def _line(ev: Evidence, index: int, path: str, mtime: int, number: int, raw: bytes,
          last: bool) -> None:
    if len(raw) > MAX_LINE_BYTES:
        ev.refused[TOO_LARGE] += 1
        return
    try:
        obj = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_non_finite)
    except _Refuse as r:
        ev.refused[r.reason] += 1
        return
    except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, deep nesting
        ev.refused[TRUNCATED if last else NOT_JSON] += 1
        return
    if not isinstance(obj, dict):
        ev.refused[NOT_OBJECT] += 1
        return
    if obj.get("schema") not in P.SCHEMAS:
        ev.refused[UNKNOWN_SCHEMA] += 1
        return
    schema, d, reason = P.check_line(obj)
    if d is None or schema is None:
        ev.refused[reason or R.NOT_A_RECORD] += 1
        return
    key, role, rank = stream_of(schema, d)
    stream = ev.streams.get(key)
    if stream is None:
        stream = ev.streams[key] = Stream(schema, key, role, rank)
    t = d["observed_at_ns"]
    if t >= stream.last_ns:  # kept as lines arrive: a max per line would be quadratic
        stream.last_ns, stream.mtime_ns = t, mtime
    stream.records.append((t, index, number, d))
    stream.files.add(path)
    ev.by_schema[schema] += 1


def read_evidence(paths: list[str], progress: Any = None) -> Evidence:
    """Read every file; unreadable files are listed, bad lines counted."""
    ev = Evidence()
    for index, path in enumerate(paths):
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            mtime = os.stat(path).st_mtime_ns
        except OSError as e:
            ev.unreadable.append((path, e.strerror or str(e)))
            continue
        ev.files.append(path)
        chunks = data.split(b"\n")
        complete, tail = chunks[:-1], chunks[-1]  # no newline after tail: cut off mid-write?
        for number, raw in enumerate(complete + ([tail] if tail.strip() else [])):
            if not raw.strip():
                continue
            ev.lines += 1
            _line(ev, index, path, mtime, number, raw, last=number == len(complete))
        if progress is not None:
            progress(path, len(complete))
    return ev
