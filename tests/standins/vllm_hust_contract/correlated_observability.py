"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
reproduces its documented public surface; see shared/design/hust-contract.md.

Contract v2: ``vllm.kv-transfer.observer.v2``, API version "2.0" (the fork's
``.../kv_connector/v1/offloading/correlated_observability.py``).

Public (documented) surface::

    register_correlated_observer(observer) -> ObserverHandle  (.contract, .token)
    unregister_correlated_observer(handle)      idempotent, returns None
    correlated_observers_configured() -> bool
    reset_correlated_observers()
    CorrelatedObservation                        frozen record
    KV_TRANSFER_OBSERVER_CONTRACT, KV_TRANSFER_OBSERVABILITY_API_VERSION,
    MAX_CORRELATED_ROSTER

Host side (for tests only)::

    validate_correlated_observation(record)  raises InvalidObservation
    emit_v2(record)                           validate, then dispatch inline

Validation (documented: "the host validates every record before dispatch"):

- ``event`` one of the six v2 events;
- ``scheduler_generation`` and any ``worker_generation`` (also inside
  ``workers``/``roster``): exactly 32 lowercase hex characters;
- ``request_id``: str, 1..128 characters, each printable ASCII (0x20-0x7E);
- ``recovery_epoch``: int > 0; ``observed_at_ns``: int >= 0;
- required fields per event: ``recovery_requeued`` none extra;
  ``restore_submitted`` job_id, rank, worker_generation, block_count;
  ``restore_completed`` job_id, rank, worker_generation; ``transfer_receipt``
  job_id, workers; ``recovery_admitted`` roster; ``first_compute`` rank,
  worker_generation, roster, compute_kind (``prefill``/``decode``);
- ``workers`` is a non-empty tuple of ``(rank, worker_generation)`` sorted by
  rank with one entry per rank; ``roster`` is a non-empty tuple of
  ``(job_id, workers)`` sorted by job id with one entry per job; neither holds
  more than ``MAX_CORRELATED_ROSTER`` entries;
- ids and counts are non-negative ints (never bool); ``block_count`` >= 1.

Stand-in decisions (the doc does not say): an invalid record is refused by
raising ``InvalidObservation`` (a ``ValueError``) to the HOST caller of
``emit_v2``, and no observer sees it; optional fields an event does not need
are allowed but still type-checked; rosters and workers must be tuples.
Observers' return values are ignored (documented); an observer that raises is
logged and removed, and observers are dropped in a forked child, as in v1
(assumed for v2).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .observability import ObserverHandle

logger = logging.getLogger(__name__)

KV_TRANSFER_OBSERVER_CONTRACT = "vllm.kv-transfer.observer.v2"
KV_TRANSFER_OBSERVABILITY_API_VERSION = "2.0"
MAX_CORRELATED_ROSTER = 4096
MAX_REQUEST_ID_LEN = 128

# event -> fields that must be present (besides the always-present ones)
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "recovery_requeued": (),
    "restore_submitted": ("job_id", "rank", "worker_generation", "block_count"),
    "restore_completed": ("job_id", "rank", "worker_generation"),
    "transfer_receipt": ("job_id", "workers"),
    "recovery_admitted": ("roster",),
    "first_compute": ("rank", "worker_generation", "roster", "compute_kind"),
}
EVENTS = frozenset(REQUIRED_FIELDS)
COMPUTE_KINDS = frozenset({"prefill", "decode"})

Workers = tuple[tuple[int, str], ...]  # ((rank, worker_generation), ...)
Roster = tuple[tuple[int, Workers], ...]  # ((job_id, workers), ...)

_GENERATION = re.compile(r"[0-9a-f]{32}")


class InvalidObservation(ValueError):
    """A v2 record the host refuses to dispatch (raised to the emitting host code)."""


@dataclass(frozen=True)
class CorrelatedObservation:
    event: str
    scheduler_generation: str
    request_id: str
    recovery_epoch: int
    observed_at_ns: int  # per-process monotonic clock
    job_id: int | None = None
    rank: int | None = None
    worker_generation: str | None = None
    block_count: int | None = None
    workers: Workers | None = None
    roster: Roster | None = None
    compute_kind: str | None = None


Observer = Callable[[CorrelatedObservation], Any]

_lock = threading.Lock()
_tokens = itertools.count(1)
_observers: dict[int, Observer] = {}


def register_correlated_observer(observer: Observer) -> ObserverHandle:
    if not callable(observer):
        raise TypeError("observer must be callable")
    with _lock:
        token = next(_tokens)
        _observers[token] = observer
    return ObserverHandle(KV_TRANSFER_OBSERVER_CONTRACT, token)


def unregister_correlated_observer(handle: ObserverHandle) -> None:
    """Remove the observer; unknown, already removed or foreign handles are a no-op."""
    if getattr(handle, "contract", None) != KV_TRANSFER_OBSERVER_CONTRACT:
        return
    with _lock:
        _observers.pop(getattr(handle, "token", None), None)


def correlated_observers_configured() -> bool:
    return bool(_observers)


def reset_correlated_observers() -> None:
    with _lock:
        _observers.clear()


# ---------------------------------------------------------------- host side


def _fail(record: Any, why: str) -> InvalidObservation:
    event = getattr(record, "event", "?")
    return InvalidObservation(f"{event}: {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_generation(record: Any, value: Any, what: str) -> None:
    if not isinstance(value, str) or not _GENERATION.fullmatch(value):
        raise _fail(record, f"{what} must be 32 lowercase hex, got {value!r}")


def _check_count(record: Any, value: Any, what: str, minimum: int = 0) -> None:
    if not _is_int(value) or value < minimum:
        raise _fail(record, f"{what} must be an int >= {minimum}, got {value!r}")


def _check_workers(record: Any, workers: Any, what: str) -> None:
    if not isinstance(workers, tuple) or not workers:
        raise _fail(record, f"{what} must be a non-empty tuple")
    if len(workers) > MAX_CORRELATED_ROSTER:
        raise _fail(record, f"{what} has {len(workers)} entries > MAX_CORRELATED_ROSTER")
    previous = -1
    for entry in workers:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise _fail(record, f"{what} entry {entry!r} is not (rank, worker_generation)")
        rank, generation = entry
        _check_count(record, rank, f"{what} rank")
        _check_generation(record, generation, f"{what} worker_generation")
        if rank <= previous:
            raise _fail(record, f"{what} not sorted with one entry per rank at rank {rank}")
        previous = rank


def _check_roster(record: Any, roster: Any) -> None:
    if not isinstance(roster, tuple) or not roster:
        raise _fail(record, "roster must be a non-empty tuple")
    if len(roster) > MAX_CORRELATED_ROSTER:
        raise _fail(record, f"roster has {len(roster)} entries > MAX_CORRELATED_ROSTER")
    previous = -1
    for entry in roster:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise _fail(record, f"roster entry {entry!r} is not (job_id, workers)")
        job_id, workers = entry
        _check_count(record, job_id, "roster job_id")
        if job_id <= previous:
            raise _fail(record, f"roster not sorted/unique at job {job_id}")
        previous = job_id
        _check_workers(record, workers, f"roster[{job_id}] workers")


def validate_correlated_observation(record: Any) -> None:
    """Raise InvalidObservation unless the host would dispatch ``record``."""
    if not isinstance(record, CorrelatedObservation):
        raise InvalidObservation(f"not a CorrelatedObservation: {type(record).__name__}")
    if record.event not in EVENTS:
        raise _fail(record, "unknown event")
    _check_generation(record, record.scheduler_generation, "scheduler_generation")
    rid = record.request_id
    if (not isinstance(rid, str) or not 1 <= len(rid) <= MAX_REQUEST_ID_LEN
            or not all(" " <= c <= "~" for c in rid)):
        raise _fail(record, f"request_id must be 1..{MAX_REQUEST_ID_LEN} printable ASCII")
    _check_count(record, record.recovery_epoch, "recovery_epoch", 1)
    _check_count(record, record.observed_at_ns, "observed_at_ns")
    for name in REQUIRED_FIELDS[record.event]:
        if getattr(record, name) is None:
            raise _fail(record, f"missing required field {name}")
    if record.job_id is not None:
        _check_count(record, record.job_id, "job_id")
    if record.rank is not None:
        _check_count(record, record.rank, "rank")
    if record.worker_generation is not None:
        _check_generation(record, record.worker_generation, "worker_generation")
    if record.block_count is not None:
        _check_count(record, record.block_count, "block_count", 1)
    if record.workers is not None:
        _check_workers(record, record.workers, "workers")
    if record.roster is not None:
        _check_roster(record, record.roster)
    if record.compute_kind is not None and record.compute_kind not in COMPUTE_KINDS:
        raise _fail(record, f"unknown compute_kind {record.compute_kind!r}")


def emit_v2(record: CorrelatedObservation) -> None:
    """The host's dispatch: validate (raising to the caller), then call inline."""
    if not _observers:  # disabled: nothing happens at all
        return
    validate_correlated_observation(record)
    with _lock:
        snapshot = list(_observers.items())
    for token, observer in snapshot:
        try:
            observer(record)  # return value ignored
        except Exception:
            logger.warning("correlated observer %r raised on %s; removed", observer,
                           record.event, exc_info=True)
            with _lock:
                _observers.pop(token, None)


def _drop_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _observers.clear()


os.register_at_fork(after_in_child=_drop_in_child)
