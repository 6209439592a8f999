"""Validate one vLLM-HUST record, as the fork publishes it (contract v1 or v2).

Runs on the drain thread (live) or the importer, never on the serving path.
Never raises: a record is either returned as a plain dict of known fields
or refused with a stable, low-cardinality reason that is counted.

The rules are the fork's (docs/hosts.md lists each with its source file):
v2 records are validated by the host before dispatch
(``CorrelatedObservation.__post_init__``); we check again because the same
code reads the plugin's files, and a bad record must cost a count, not a
crash. v1 records are not validated by the host at all.

Shapes as the fork publishes them: enum-typed fields (``str`` enums) are
read by value; v2 ``workers`` are ``WorkerReceipt(rank, worker_generation)``
objects and ``roster`` entries ``JobReceipt(job_id, workers)`` (the importer
passes the JSON objects the plugin writes for them); v1 descriptors are
``KVRegionDescriptor`` objects. Validated rosters come out as plain tuples:
``workers`` ((rank, generation), ...), ``roster`` ((job_id, workers), ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

MAX_ROSTER = 4096  # MAX_CORRELATED_ROSTER (v2): workers per job, jobs, workers per roster
MAX_DESCRIPTORS = 4096  # MAX_DESCRIPTOR_REGIONS (v1)
MAX_REQUEST_ID = 128
UINT32 = (1 << 32) - 1  # ranks, block counts (the host's bound)
# The host allows uint64 ids; OTel int attributes are int64. Job ids count up
# from 0 per connector and epochs are preemption counts: neither gets there.
MAX_ID = (1 << 63) - 1

V2_FIELDS = ("event", "scheduler_generation", "request_id", "recovery_epoch", "observed_at_ns",
             "job_id", "rank", "worker_generation", "block_count", "workers", "roster",
             "compute_kind")
V2_OPTIONAL = ("job_id", "rank", "worker_generation", "block_count", "workers", "roster",
               "compute_kind")
# The exact set of optional fields each event carries (no more, no fewer).
V2_SHAPES = {
    "recovery_requeued": frozenset(),
    "restore_submitted": frozenset({"job_id", "rank", "worker_generation", "block_count"}),
    "restore_completed": frozenset({"job_id", "rank", "worker_generation"}),
    "transfer_receipt": frozenset({"job_id", "workers"}),
    "recovery_admitted": frozenset({"roster"}),
    "first_compute": frozenset({"rank", "worker_generation", "roster", "compute_kind"}),
}
V2_SCHEDULER_EVENTS = frozenset({"recovery_requeued", "transfer_receipt", "recovery_admitted"})

V1_FIELDS = ("event", "observed_at_ns", "operation", "job_id", "rank", "request_id",
             "block_count", "success", "bytes_moved", "duration_ns", "reason", "ranks",
             "recovery_epoch", "job_ids", "requeue_reason", "descriptors",
             "dropped_descriptors", "compute_kind")
# What each v1 emit function always fills in (observability.py emit_kv_*).
V1_REQUIRED = {
    "transfer_submitted": ("operation", "job_id", "rank", "request_id"),
    "transfer_completed": ("operation", "job_id", "rank", "success"),
    "transfer_cancelled": ("operation", "job_id", "rank", "reason"),
    "transfer_receipt": ("job_id", "ranks"),
    "recovery_requeued": ("request_id", "recovery_epoch"),
    "recovery_admitted": ("request_id", "recovery_epoch", "job_ids"),
    "transfer_descriptors": ("job_id",),
    # compute_kind may be None: the worker warns and emits without one.
    "first_compute": ("rank", "request_id", "recovery_epoch"),
}
V1_SCHEDULER_EVENTS = frozenset({"recovery_requeued", "transfer_receipt", "recovery_admitted"})
_V1_DEFAULTS = {"block_count": 0, "bytes_moved": 0, "duration_ns": 0, "dropped_descriptors": 0,
                "ranks": (), "job_ids": (), "descriptors": ()}
OPERATIONS = frozenset({"d2h_preserve", "h2d_restore"})
COMPUTE_KINDS = frozenset({"prefill", "decode"})
_DESCRIPTOR_FIELDS = ("src_region_id", "dst_region_id", "src_offset", "dst_offset", "size")

# Refusal reasons (metric label values; keep stable and few).
NOT_A_RECORD = "record_malformed"
UNKNOWN_EVENT = "record_unknown_event"
MISSING_FIELD = "record_missing_field"
UNEXPECTED_FIELD = "record_unexpected_field"
BAD_GENERATION = "record_bad_generation"
BAD_REQUEST_ID = "record_bad_request_id"
BAD_NUMBER = "record_bad_number"
BAD_ROSTER = "record_bad_roster"
ROSTER_OVER_CAP = "record_roster_over_cap"
BAD_ENUM = "record_bad_enum"
RECORD_REASONS = (NOT_A_RECORD, UNKNOWN_EVENT, MISSING_FIELD, UNEXPECTED_FIELD, BAD_GENERATION,
                  BAD_REQUEST_ID, BAD_NUMBER, BAD_ROSTER, ROSTER_OVER_CAP, BAD_ENUM)


class Refused(Exception):
    """Internal: carries the reason out of nested checks."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _plain(value: Any) -> Any:
    # The fork's enums are ``str`` enums: a member equals its value but is
    # not of type ``str``, which the exact type checks below insist on.
    return value.value if isinstance(value, Enum) else value


def _fields(record: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(record, Mapping):
        return {n: _plain(record.get(n)) for n in names}
    return {n: _plain(getattr(record, n, None)) for n in names}


def _attr(entry: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The named fields of a record object, or of a JSON object with exactly them."""
    if isinstance(entry, Mapping):
        if set(entry) != set(names):
            raise Refused(BAD_ROSTER)
        return tuple(entry[n] for n in names)
    if isinstance(entry, (str, bytes, tuple, list)) or not all(hasattr(entry, n)
                                                               for n in names):
        raise Refused(BAD_ROSTER)
    return tuple(getattr(entry, n) for n in names)


def uint(value: Any, low: int, high: int) -> int:
    # bool is an int subclass; a True job id is a bug, not job 1.
    if type(value) is not int or not low <= value <= high:
        raise Refused(BAD_NUMBER)
    return value


def generation(value: Any) -> str:
    """32 lowercase hex digits (scheduler and worker generations)."""
    if (type(value) is not str or len(value) != 32
            or any(c not in "0123456789abcdef" for c in value)):
        raise Refused(BAD_GENERATION)
    return value


def request_id(value: Any) -> str:
    """1-128 printable ASCII characters."""
    if (type(value) is not str or not 1 <= len(value) <= MAX_REQUEST_ID
            or not all(" " <= c <= "~" for c in value)):
        raise Refused(BAD_REQUEST_ID)
    return value


def _sequence(value: Any, *, allow_empty: bool = False) -> tuple[Any, ...]:
    if isinstance(value, list):  # a JSON array
        value = tuple(value)
    if not isinstance(value, tuple) or not (value or allow_empty):
        raise Refused(BAD_ROSTER)
    if len(value) > MAX_ROSTER:
        raise Refused(ROSTER_OVER_CAP)
    return value


def _workers(value: Any) -> tuple[tuple[int, str], ...]:
    """WorkerReceipts, sorted, one per rank -> ((rank, worker_generation), ...)."""
    out = []
    for entry in _sequence(value):
        rank, gen = _attr(entry, ("rank", "worker_generation"))
        out.append((uint(rank, 0, UINT32), generation(gen)))
    if any(a[0] >= b[0] for a, b in zip(out, out[1:], strict=False)):
        raise Refused(BAD_ROSTER)  # unsorted, or two entries for one rank
    return tuple(out)


def _roster(value: Any) -> tuple[tuple[int, tuple[tuple[int, str], ...]], ...]:
    """JobReceipts sorted by job id, one per job, at most MAX_ROSTER workers
    in all -> ((job_id, workers), ...)."""
    out = []
    for entry in _sequence(value):
        job, workers = _attr(entry, ("job_id", "workers"))
        out.append((uint(job, 0, MAX_ID), _workers(workers)))
    if any(a[0] >= b[0] for a, b in zip(out, out[1:], strict=False)):
        raise Refused(BAD_ROSTER)
    if sum(len(w) for _, w in out) > MAX_ROSTER:
        raise Refused(ROSTER_OVER_CAP)
    return tuple(out)


def _v2_object(record: Any) -> dict[str, Any]:
    """The fields of a record object as the live host hands it over, with the
    exact types the host's constructor insists on (correlated_observability.py
    ``CorrelatedObservation.__post_init__``) and the JSON form cannot carry:
    ``event`` is the fork's ``CorrelatedEvent`` (a plain str, or another
    contract's enum, is refused); ``workers``/``roster`` are tuples (``()``
    when absent, never None or a list) of ``WorkerReceipt``/``JobReceipt``;
    ``compute_kind`` is compared by value, as the host does (it is a plain
    str there); every other field is read as is (an enum member in
    ``request_id`` or a generation is refused, as the host refuses it)."""
    d = {n: getattr(record, n, None) for n in V2_FIELDS}
    event = d["event"]
    if not isinstance(event, Enum) or type(event).__name__ != "CorrelatedEvent":
        raise Refused(UNKNOWN_EVENT)
    d["event"] = event.value
    d["compute_kind"] = _plain(d["compute_kind"])
    for name, entry in (("workers", "WorkerReceipt"), ("roster", "JobReceipt")):
        value = d[name]
        if type(value) is not tuple or any(type(e).__name__ != entry for e in value):
            raise Refused(BAD_ROSTER)
    return d


def _v2(d: dict[str, Any], *, exact: bool = False) -> dict[str, Any]:
    event = d["event"]
    if type(event) is not str or event not in V2_SHAPES:
        raise Refused(UNKNOWN_EVENT)
    d["scheduler_generation"] = generation(d["scheduler_generation"])
    d["request_id"] = request_id(d["request_id"])
    d["recovery_epoch"] = uint(d["recovery_epoch"], 1, MAX_ID)
    d["observed_at_ns"] = uint(d["observed_at_ns"], 0, MAX_ID)
    # Absent is None, or empty; in a record object only the tuple fields are
    # absent when empty (the host refuses an empty value elsewhere).
    for name in ("workers", "roster") if exact else V2_OPTIONAL:
        if d[name] in ((), []):
            d[name] = None
    present = {n for n in V2_OPTIONAL if d[n] is not None}
    shape = V2_SHAPES[event]
    if shape - present:
        raise Refused(MISSING_FIELD)
    if present - shape:
        raise Refused(UNEXPECTED_FIELD)
    for name, low, high in (("job_id", 0, MAX_ID), ("rank", 0, UINT32),
                            ("block_count", 1, UINT32)):
        if d[name] is not None:
            d[name] = uint(d[name], low, high)
    if d["worker_generation"] is not None:
        d["worker_generation"] = generation(d["worker_generation"])
    if d["workers"] is not None:
        d["workers"] = _workers(d["workers"])
    if d["roster"] is not None:
        d["roster"] = _roster(d["roster"])
    kind = d["compute_kind"]
    if kind is not None and (type(kind) is not str or kind not in COMPUTE_KINDS):
        raise Refused(BAD_ENUM)
    return d


def check_v2(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(fields, None) for a valid contract v2 record, else (None, reason)."""
    try:
        if isinstance(record, Mapping):  # the plugin's JSON object
            return _v2(_fields(record, V2_FIELDS)), None
        return _v2(_v2_object(record), exact=True), None
    except Refused as r:
        return None, r.reason
    except Exception:  # anything else odd about the object: still only a count
        return None, NOT_A_RECORD


def _int_tuple(value: Any, low: int, high: int, *, sorted_unique: bool) -> tuple[int, ...]:
    value = _sequence(value, allow_empty=True)
    out = tuple(uint(v, low, high) for v in value)
    if sorted_unique and any(a >= b for a, b in zip(out, out[1:], strict=False)):
        raise Refused(BAD_ROSTER)
    return out


def _v1(d: dict[str, Any]) -> dict[str, Any]:
    event = d["event"]
    if type(event) is not str or event not in V1_REQUIRED:
        raise Refused(UNKNOWN_EVENT)
    for name, default in _V1_DEFAULTS.items():
        if d[name] is None:
            d[name] = default
    for name in V1_REQUIRED[event]:
        if d[name] is None:
            raise Refused(MISSING_FIELD)
    d["observed_at_ns"] = uint(d["observed_at_ns"], 0, MAX_ID)
    for name, low, high in (("job_id", 0, MAX_ID), ("rank", 0, UINT32),
                            ("recovery_epoch", 1, MAX_ID)):
        if d[name] is not None:
            d[name] = uint(d[name], low, high)
    for name, high in (("block_count", UINT32), ("bytes_moved", MAX_ID),
                       ("duration_ns", MAX_ID), ("dropped_descriptors", MAX_ID)):
        d[name] = uint(d[name], 0, high)
    if d["request_id"] is not None:
        d["request_id"] = request_id(d["request_id"])
    if d["success"] is not None and type(d["success"]) is not bool:
        raise Refused(BAD_NUMBER)
    for name, allowed in (("operation", OPERATIONS), ("compute_kind", COMPUTE_KINDS),
                          ("reason", {"host_shutdown"}), ("requeue_reason", {"unclassified"})):
        if d[name] is not None and (type(d[name]) is not str or d[name] not in allowed):
            raise Refused(BAD_ENUM)
    d["ranks"] = _int_tuple(d["ranks"], 0, UINT32, sorted_unique=True)
    if event == "transfer_receipt" and not d["ranks"]:
        raise Refused(BAD_ROSTER)
    d["job_ids"] = _int_tuple(d["job_ids"], 0, MAX_ID, sorted_unique=True)
    # KVRegionDescriptors hold raw region ids and offsets: only their number is kept.
    descriptors = d.pop("descriptors")
    if not isinstance(descriptors, tuple):
        raise Refused(NOT_A_RECORD)
    if len(descriptors) > MAX_DESCRIPTORS:
        raise Refused(ROSTER_OVER_CAP)
    for desc in descriptors:
        if isinstance(desc, (tuple, list, Mapping)) or not all(
                hasattr(desc, n) for n in _DESCRIPTOR_FIELDS):
            raise Refused(NOT_A_RECORD)
        for n in _DESCRIPTOR_FIELDS:
            uint(getattr(desc, n), 0, MAX_ID)
    d["descriptor_count"] = len(descriptors)
    return d


def check_v1(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(fields, None) for a valid contract v1 record, else (None, reason)."""
    try:
        return _v1(_fields(record, V1_FIELDS)), None
    except Refused as r:
        return None, r.reason
    except Exception:
        return None, NOT_A_RECORD


def role_of(d: dict[str, Any], scheduler_events: frozenset[str]) -> tuple[str, int | None] | None:
    """Which lifecycle a valid record belongs to: ("scheduler", None),
    ("worker", rank), or None (v1 transfer_descriptors: rank None, joins nothing)."""
    if d["event"] in scheduler_events:
        return "scheduler", None
    if d["rank"] is not None:
        return "worker", d["rank"]
    return None
