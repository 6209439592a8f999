"""Validate one line of the vLLM-HUST plugin's JSONL files.

The plugin (``vllm-hust-kv-transfer-observability``) writes three schemas,
one record per line, each serialised by its own record class; we read them
exactly as those classes write them and refuse what the plugin's own
validator refuses (``validation.py``: closed field sets, canonical form, no
nulls, no unknown fields), each refusal counted by reason:

- ``vllm-hust.kv-transfer-event.v2``: the plugin's own records of transfers
  in one worker process: nested ``identity`` (request id, rank, recovery
  epoch, an integer ``worker_generation``), process-scoped
  ``<32 hex>:t:<n>`` transfer and ``<32 hex>:k:<n>`` receipt ids;
- ``vllm-hust.kv-transfer-host-fact.v1``: what a contract-v1 host reported
  (receipt, requeue, admission, first compute), with the writing process's
  ``process_uuid``, explicitly not joined to other processes
  (``scope: host_reported_unjoined``);
- ``vllm-hust.kv-transfer-correlated-host.v2``: a contract-v2 host record,
  field for field, rosters as JSON objects.

Never raises. docs/hosts.md lists each rule with its source file and commit.
"""

from __future__ import annotations

from typing import Any

from kvobs_otel.hosts.hust import records as R

EVENT_SCHEMA = "vllm-hust.kv-transfer-event.v2"
HOST_FACT_SCHEMA = "vllm-hust.kv-transfer-host-fact.v1"
CORRELATED_SCHEMA = "vllm-hust.kv-transfer-correlated-host.v2"
SCHEMAS = (EVENT_SCHEMA, HOST_FACT_SCHEMA, CORRELATED_SCHEMA)
HOST_FACT_SCOPE = "host_reported_unjoined"

BAD_IDENTITY = "record_bad_identity"
BAD_SCOPED_ID = "record_bad_scoped_id"
NONCANONICAL = "record_noncanonical"
RULE_BROKEN = "record_rule_broken"
LINE_REASONS = (BAD_IDENTITY, BAD_SCOPED_ID, NONCANONICAL, RULE_BROKEN)

UINT64 = (1 << 64) - 1
_HEX = frozenset("0123456789abcdef")

# ---------------------------------------------------------------- event v2

EVENT_IDENTITY = frozenset({"request_id", "worker_generation", "rank", "recovery_epoch"})
# JSON key -> kind of value. Every event carries exactly the keys of its shape.
_EVENT_VALUES = {
    "transfer_id": "t", "direction": {"d2h", "h2d"}, "receipt_id": "k",
    "associated_transfer_ids": "t*", "compute_kind": R.COMPUTE_KINDS,
    "requeue_reason": {"lora_capacity", "prefill_throttled", "token_budget", "encoder_budget",
                       "block_capacity", "unclassified"},
    "terminal_reason": {"submission_rejected", "backend_failure", "invalid_measurement",
                        "request_cancelled", "worker_generation_changed", "host_shutdown"},
    "bytes_moved": (1, UINT64), "block_count": (1, R.UINT32), "duration_ns": (0, UINT64),
    "device_duration_ns": (1, UINT64),
}
EVENT_SHAPES = {
    "preserve_started": {"transfer_id", "direction", "block_count"},
    "preserve_completed": {"transfer_id", "direction", "bytes_moved", "block_count",
                           "duration_ns"},
    "transfer_started": {"transfer_id", "direction", "bytes_moved"},
    "transfer_completed": {"transfer_id", "direction", "bytes_moved", "duration_ns"},
    "transfer_failed": {"transfer_id", "direction", "terminal_reason"},
    "transfer_cancelled": {"transfer_id", "direction", "terminal_reason"},
    "restore_started": {"transfer_id", "direction", "block_count"},
    "restore_completed": {"transfer_id", "direction", "receipt_id", "bytes_moved",
                          "block_count", "duration_ns"},
    "recovery_requeued": {"requeue_reason"},
    "recovery_admitted": {"associated_transfer_ids"},
    "first_compute": {"receipt_id", "associated_transfer_ids", "compute_kind"},
}
# The host's device-side duration, when it measured one (normalization.py).
_MAY_CARRY = {e: {"device_duration_ns"} for e in
              ("preserve_completed", "transfer_completed", "restore_completed")}
_DIRECTION = {"preserve_started": "d2h", "preserve_completed": "d2h",
              "restore_started": "h2d", "restore_completed": "h2d"}
_TERMINAL = {"transfer_failed": {"submission_rejected", "backend_failure", "invalid_measurement"},
             "transfer_cancelled": {"request_cancelled", "worker_generation_changed",
                                    "host_shutdown"}}
_NEEDS_EPOCH = {"recovery_requeued", "recovery_admitted", "first_compute"}

# ---------------------------------------------------------------- host fact v1

_FACT_VALUES = {"job_id": (0, R.MAX_ID), "rank": (0, R.UINT32), "recovery_epoch": (1, R.MAX_ID),
                "job_ids": "ids", "ranks": "ranks", "compute_kind": R.COMPUTE_KINDS,
                "requeue_reason": _EVENT_VALUES["requeue_reason"]}
FACT_SHAPES = {
    "transfer_receipt": {"job_id", "ranks"},
    "recovery_requeued": {"recovery_epoch", "requeue_reason"},
    "recovery_admitted": {"recovery_epoch", "job_ids"},
    "first_compute": {"rank", "recovery_epoch", "job_ids", "compute_kind"},
}
_FACT_ALWAYS = {"schema", "scope", "event", "process_uuid", "observed_at_ns", "request_id"}

_CORRELATED_ALWAYS = {"schema", "event", "scheduler_generation", "request_id", "recovery_epoch",
                      "observed_at_ns"}


def process_uuid(value: Any) -> str:
    if type(value) is not str or len(value) != 32 or not set(value) <= _HEX:
        raise R.Refused(BAD_SCOPED_ID)
    return value


def scoped_id(value: Any, kind: str) -> tuple[str, int]:
    """``<32 hex>:<kind>:<n>`` -> (process scope, n)."""
    if type(value) is not str:
        raise R.Refused(BAD_SCOPED_ID)
    scope, sep, rest = value.partition(":")
    got, sep2, number = rest.partition(":")
    if (not sep or not sep2 or got != kind or not number.isascii() or not number.isdigit()
            or (len(number) > 1 and number[0] == "0") or len(number) > 20
            or int(number) > UINT64):
        raise R.Refused(BAD_SCOPED_ID)
    return process_uuid(scope), int(number)


def _no_nulls(obj: dict[str, Any]) -> None:
    # The writer omits what an event does not carry; a null or an empty
    # array is not something it writes.
    for v in obj.values():
        if v is None or v == []:
            raise R.Refused(NONCANONICAL)


def _closed(obj: dict[str, Any], always: set[str], shape: set[str],
            may: frozenset[str] | set[str] = frozenset()) -> None:
    """Exactly the keys of the event's shape (plus ``may``), none missing."""
    keys = set(obj) - always
    if shape - keys or always - set(obj):
        raise R.Refused(R.MISSING_FIELD)
    if keys - shape - may:
        raise R.Refused(R.UNEXPECTED_FIELD)


def _event(obj: dict[str, Any]) -> dict[str, Any]:
    event = obj.get("event")
    if type(event) is not str or event not in EVENT_SHAPES:
        raise R.Refused(R.UNKNOWN_EVENT)
    ident = obj.get("identity")
    if not isinstance(ident, dict) or set(ident) != EVENT_IDENTITY:
        raise R.Refused(BAD_IDENTITY)
    always = {"schema", "event", "identity", "observed_at_ns"}
    if "observed_at_ns" not in obj:
        raise R.Refused(R.MISSING_FIELD)  # never replaced by a reader's clock
    _no_nulls({k: v for k, v in obj.items() if k != "identity"})
    _closed(obj, always, EVENT_SHAPES[event], _MAY_CARRY.get(event, set()))
    epoch = ident["recovery_epoch"]
    d: dict[str, Any] = {
        "event": event, "request_id": R.request_id(ident["request_id"]),
        "worker_generation": R.uint(ident["worker_generation"], 0, UINT64),
        "rank": R.uint(ident["rank"], 0, R.UINT32),
        "recovery_epoch": None if epoch is None else R.uint(epoch, 1, R.MAX_ID),
        "observed_at_ns": R.uint(obj["observed_at_ns"], 0, R.MAX_ID),
    }
    for key in set(obj) - always:
        kind, value = _EVENT_VALUES[key], obj[key]
        if kind == "t" or kind == "k":
            d[key] = scoped_id(value, kind)
        elif kind == "t*":
            ids = tuple(scoped_id(v, "t") for v in R._sequence(value))
            if any(a >= b for a, b in zip(value, value[1:], strict=False)):
                raise R.Refused(R.BAD_ROSTER)  # sorted and unique, as strings
            d[key] = ids
        elif isinstance(kind, tuple):
            d[key] = R.uint(value, *kind)
        elif type(value) is not str or value not in kind:
            raise R.Refused(R.BAD_ENUM)
        else:
            d[key] = value
    # Rules the plugin's record class checks beyond the shape (schema.py).
    if event in _DIRECTION and d["direction"] != _DIRECTION[event]:
        raise R.Refused(RULE_BROKEN)
    if event in _TERMINAL and d["terminal_reason"] not in _TERMINAL[event]:
        raise R.Refused(RULE_BROKEN)
    if event in _NEEDS_EPOCH and d["recovery_epoch"] is None:
        raise R.Refused(RULE_BROKEN)
    receipt = d.get("receipt_id")
    if receipt is not None:
        scopes = {d["transfer_id"][0]} if "transfer_id" in d else {
            t[0] for t in d["associated_transfer_ids"]}
        if scopes - {receipt[0]}:
            raise R.Refused(RULE_BROKEN)  # receipt and transfers share one process scope
    return d


def _fact(obj: dict[str, Any]) -> dict[str, Any]:
    event = obj.get("event")
    if type(event) is not str or event not in FACT_SHAPES:
        raise R.Refused(R.UNKNOWN_EVENT)
    if obj.get("scope") != HOST_FACT_SCOPE:
        raise R.Refused(NONCANONICAL)
    _no_nulls(obj)
    _closed(obj, _FACT_ALWAYS, FACT_SHAPES[event])
    d: dict[str, Any] = {
        "event": event, "process_uuid": process_uuid(obj["process_uuid"]),
        "observed_at_ns": R.uint(obj["observed_at_ns"], 0, R.MAX_ID),
        "request_id": R.request_id(obj["request_id"]),
    }
    for key in set(obj) - _FACT_ALWAYS:
        kind, value = _FACT_VALUES[key], obj[key]
        if isinstance(kind, tuple):
            d[key] = R.uint(value, *kind)
        elif kind in ("ids", "ranks"):
            high = R.MAX_ID if kind == "ids" else R.UINT32
            d[key] = R._int_tuple(R._sequence(value), 0, high, sorted_unique=True)
        elif type(value) is not str or value not in kind:
            raise R.Refused(R.BAD_ENUM)
        else:
            d[key] = value
    return d


def _correlated(obj: dict[str, Any]) -> dict[str, Any]:
    _no_nulls(obj)
    unknown = set(obj) - _CORRELATED_ALWAYS - set(R.V2_OPTIONAL)
    if unknown:
        raise R.Refused(R.UNEXPECTED_FIELD)
    if _CORRELATED_ALWAYS - set(obj):
        raise R.Refused(R.MISSING_FIELD)
    d, reason = R.check_v2(obj)
    if d is None:
        raise R.Refused(reason or R.NOT_A_RECORD)
    return d


def check_line(obj: Any) -> tuple[str | None, dict[str, Any] | None, str | None]:
    """(schema, fields, None) for a valid record of a known schema, else
    (schema or None, None, reason); the caller has checked ``obj`` is a dict
    whose "schema" is one of ``SCHEMAS``."""
    schema = obj.get("schema")
    try:
        if schema == EVENT_SCHEMA:
            return schema, _event(obj), None
        if schema == HOST_FACT_SCHEMA:
            return schema, _fact(obj), None
        return schema, _correlated(obj), None
    except R.Refused as r:
        return schema, None, r.reason
    except Exception:
        return schema, None, R.NOT_A_RECORD
