"""Validate one vLLM-HUST record, as published by contract v1 or v2.

Runs on the drain thread (live) or the importer, never on the serving path.
Never raises: a record is either returned as a plain dict of known fields
or refused with a stable, low-
cardinality reason that is counted. The v2 host validates before dispatch;
we validate again because the same code reads files written by any version
of the fork plugin, and a bad record must cost a count, not a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_ROSTER = 4096  # MAX_CORRELATED_ROSTER (v2)
MAX_DESCRIPTORS = 4096  # MAX_DESCRIPTOR_REGIONS (v1)
MAX_REQUEST_ID = 128
MAX_ID = (1 << 63) - 1  # OTel int attributes are int64
MAX_RANK = 1 << 16
MAX_EPOCH = 1 << 31
MAX_BLOCKS = 1 << 40

V2_FIELDS = ("event", "scheduler_generation", "request_id", "recovery_epoch", "observed_at_ns",
             "job_id", "rank", "worker_generation", "block_count", "workers", "roster",
             "compute_kind")
V2_REQUIRED = {
    "recovery_requeued": (),
    "restore_submitted": ("job_id", "rank", "worker_generation", "block_count"),
    "restore_completed": ("job_id", "rank", "worker_generation"),
    "transfer_receipt": ("job_id", "workers"),
    "recovery_admitted": ("roster",),
    "first_compute": ("rank", "worker_generation", "roster", "compute_kind"),
}
V2_SCHEDULER_EVENTS = frozenset({"recovery_requeued", "transfer_receipt", "recovery_admitted"})

V1_FIELDS = ("event", "observed_at_ns", "operation", "job_id", "rank", "request_id",
             "block_count", "success", "bytes_moved", "duration_ns", "reason", "ranks",
             "recovery_epoch", "job_ids", "requeue_reason", "descriptors",
             "dropped_descriptors", "compute_kind")
V1_REQUIRED = {
    "transfer_submitted": ("operation", "job_id", "rank", "request_id"),
    "transfer_completed": ("operation", "job_id", "rank", "success"),
    "transfer_cancelled": ("operation", "job_id", "rank", "reason"),
    "transfer_receipt": ("job_id", "ranks"),
    "recovery_requeued": ("request_id", "recovery_epoch"),
    "recovery_admitted": ("request_id", "recovery_epoch", "job_ids"),
    "transfer_descriptors": ("job_id",),
    "first_compute": ("rank", "request_id", "recovery_epoch", "compute_kind"),
}
V1_SCHEDULER_EVENTS = frozenset({"recovery_requeued", "transfer_receipt", "recovery_admitted"})
_V1_DEFAULTS = {"block_count": 0, "bytes_moved": 0, "duration_ns": 0, "dropped_descriptors": 0,
                "ranks": (), "job_ids": (), "descriptors": ()}
OPERATIONS = frozenset({"d2h_preserve", "h2d_restore"})
COMPUTE_KINDS = frozenset({"prefill", "decode"})

# Refusal reasons (metric label values; keep stable and few).
NOT_A_RECORD = "record_malformed"
UNKNOWN_EVENT = "record_unknown_event"
MISSING_FIELD = "record_missing_field"
BAD_GENERATION = "record_bad_generation"
BAD_REQUEST_ID = "record_bad_request_id"
BAD_NUMBER = "record_bad_number"
BAD_ROSTER = "record_bad_roster"
ROSTER_OVER_CAP = "record_roster_over_cap"
BAD_ENUM = "record_bad_enum"
RECORD_REASONS = (NOT_A_RECORD, UNKNOWN_EVENT, MISSING_FIELD, BAD_GENERATION, BAD_REQUEST_ID,
                  BAD_NUMBER, BAD_ROSTER, ROSTER_OVER_CAP, BAD_ENUM)


class Refused(Exception):
    """Internal: carries the reason out of nested checks."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _fields(record: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(record, Mapping):
        return {n: record.get(n) for n in names}
    return {n: getattr(record, n, None) for n in names}


def json_tuples(value: Any) -> Any:
    """JSON arrays back to the (nested) tuples the contracts publish."""
    if isinstance(value, list):
        return tuple(json_tuples(v) for v in value)
    return value


def _int(value: Any, low: int, high: int) -> int:
    # bool is an int subclass; a True job id is a bug, not job 1.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(BAD_NUMBER)
    return int(value)


def _generation(value: Any) -> str:
    if (not isinstance(value, str) or len(value) != 32
            or any(c not in "0123456789abcdef" for c in value)):
        raise Refused(BAD_GENERATION)
    return value


def _request_id(value: Any) -> str:
    if (not isinstance(value, str) or not 1 <= len(value) <= MAX_REQUEST_ID
            or not all(" " <= c <= "~" for c in value)):
        raise Refused(BAD_REQUEST_ID)
    return value


def _sequence(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, tuple) or not value:
        raise Refused(BAD_ROSTER)
    if len(value) > MAX_ROSTER:
        raise Refused(ROSTER_OVER_CAP)
    return value


def _pairs(value: Any, key_high: int, check_value: Any) -> tuple[tuple[int, Any], ...]:
    """A non-empty tuple of (key, value) sorted by key, one entry per key."""
    out = []
    previous = -1
    for entry in _sequence(value):
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise Refused(BAD_ROSTER)
        key = _int(entry[0], 0, key_high)
        if key <= previous:
            raise Refused(BAD_ROSTER)
        previous = key
        out.append((key, check_value(entry[1])))
    return tuple(out)


def _workers(value: Any) -> tuple[tuple[int, str], ...]:
    return _pairs(value, MAX_RANK, _generation)  # ((rank, worker_generation), ...)


def _roster(value: Any) -> tuple[tuple[int, tuple[tuple[int, str], ...]], ...]:
    return _pairs(value, MAX_ID, _workers)  # ((job_id, workers), ...)


def _v2(d: dict[str, Any]) -> dict[str, Any]:
    event = d["event"]
    if not isinstance(event, str) or event not in V2_REQUIRED:
        raise Refused(UNKNOWN_EVENT)
    for name in V2_REQUIRED[event]:
        if d[name] is None:
            raise Refused(MISSING_FIELD)
    d["scheduler_generation"] = _generation(d["scheduler_generation"])
    d["request_id"] = _request_id(d["request_id"])
    d["recovery_epoch"] = _int(d["recovery_epoch"], 1, MAX_EPOCH)
    d["observed_at_ns"] = _int(d["observed_at_ns"], 0, MAX_ID)
    if d["job_id"] is not None:
        d["job_id"] = _int(d["job_id"], 0, MAX_ID)
    if d["rank"] is not None:
        d["rank"] = _int(d["rank"], 0, MAX_RANK)
    if d["worker_generation"] is not None:
        d["worker_generation"] = _generation(d["worker_generation"])
    if d["block_count"] is not None:
        d["block_count"] = _int(d["block_count"], 1, MAX_BLOCKS)
    if d["workers"] is not None:
        d["workers"] = _workers(d["workers"])
    if d["roster"] is not None:
        d["roster"] = _roster(d["roster"])
    kind = d["compute_kind"]
    if kind is not None and (not isinstance(kind, str) or kind not in COMPUTE_KINDS):
        raise Refused(BAD_ENUM)
    return d


def check_v2(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(fields, None) for a valid contract v2 record, else (None, reason)."""
    try:
        return _v2(_fields(record, V2_FIELDS)), None
    except Refused as r:
        return None, r.reason
    except Exception:  # anything else odd about the object: still only a count
        return None, NOT_A_RECORD


def _int_tuple(value: Any, low: int, high: int, *, sorted_unique: bool) -> tuple[int, ...]:
    if not isinstance(value, tuple):
        raise Refused(BAD_ROSTER)
    if len(value) > MAX_ROSTER:
        raise Refused(ROSTER_OVER_CAP)
    out = tuple(_int(v, low, high) for v in value)
    if sorted_unique and any(a >= b for a, b in zip(out, out[1:], strict=False)):
        raise Refused(BAD_ROSTER)
    return out


def _v1(d: dict[str, Any]) -> dict[str, Any]:
    event = d["event"]
    if not isinstance(event, str) or event not in V1_REQUIRED:
        raise Refused(UNKNOWN_EVENT)
    for name, default in _V1_DEFAULTS.items():
        if d[name] is None:
            d[name] = default
    for name in V1_REQUIRED[event]:
        if d[name] is None:
            raise Refused(MISSING_FIELD)
    d["observed_at_ns"] = _int(d["observed_at_ns"], 0, MAX_ID)
    for name, high in (("job_id", MAX_ID), ("rank", MAX_RANK), ("recovery_epoch", MAX_EPOCH)):
        if d[name] is not None:
            d[name] = _int(d[name], 1 if name == "recovery_epoch" else 0, high)
    for name, high in (("block_count", MAX_BLOCKS), ("bytes_moved", MAX_ID),
                       ("duration_ns", MAX_ID), ("dropped_descriptors", MAX_ID)):
        d[name] = _int(d[name], 0, high)
    if d["request_id"] is not None:
        d["request_id"] = _request_id(d["request_id"])
    if d["success"] is not None and not isinstance(d["success"], bool):
        raise Refused(BAD_NUMBER)
    for name, allowed in (("operation", OPERATIONS), ("compute_kind", COMPUTE_KINDS),
                          ("reason", {"host_shutdown"}), ("requeue_reason", {"unclassified"})):
        if d[name] is not None and (not isinstance(d[name], str) or d[name] not in allowed):
            raise Refused(BAD_ENUM)
    d["ranks"] = _int_tuple(d["ranks"], 0, MAX_RANK, sorted_unique=True)
    if event == "transfer_receipt" and not d["ranks"]:
        raise Refused(BAD_ROSTER)
    d["job_ids"] = _int_tuple(d["job_ids"], 0, MAX_ID, sorted_unique=False)
    # Descriptors hold raw region ids and offsets: only their number is kept.
    descriptors = d.pop("descriptors")
    if not isinstance(descriptors, tuple):
        raise Refused(NOT_A_RECORD)
    if len(descriptors) > MAX_DESCRIPTORS:
        raise Refused(ROSTER_OVER_CAP)
    for desc in descriptors:  # (src_region, dst_region, src_offset, dst_offset, size)
        if not isinstance(desc, tuple) or len(desc) != 5:
            raise Refused(NOT_A_RECORD)
        for value in desc:
            _int(value, 0, MAX_ID)
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
