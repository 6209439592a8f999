"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
contract v2, the fork's
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/correlated_observability.py``.

Written from facts read in the fork's source (no code copied). Each fact
this module relies on, with the fork file and commit it was read at
(``correlated_observability.py`` = the module above; the version
@ 5a820400f656 differs only in importing ``regex as re``):

- correlated_observability.py @ 65cc5678b0d5: constants
  ``KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT = "vllm.kv-transfer.observer.v2"``,
  ``KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION = "2.0"``,
  ``MAX_CORRELATED_ROSTER = 4096``; private ``_UUID`` (fullmatch ``[0-9a-f]{32}``),
  ``_MAX_UINT64``, ``_MAX_UINT32``; no ``__all__``.
- correlated_observability.py @ 65cc5678b0d5: "uintN" = type exactly ``int`` (bool
  refused) in 0..2^N-1.
- correlated_observability.py @ 65cc5678b0d5: ``WorkerReceipt(rank, worker_generation)``
  and ``JobReceipt(job_id, workers)`` are frozen slots dataclasses with ``order=True``.
  ``WorkerReceipt``: rank uint32, worker_generation exactly ``str`` and 32 lowercase hex.
  ``JobReceipt``: job_id uint64; workers exactly a ``tuple`` of 1..4096 exact
  ``WorkerReceipt`` items, ``== tuple(sorted(set(workers)))``, ranks unique; else
  "workers must be a bounded exact rank/generation roster".
- correlated_observability.py @ 65cc5678b0d5: ``CorrelatedEvent(str, Enum)`` with six
  events; ``CorrelatedObservation`` frozen slots dataclass, fields in order ``event,
  scheduler_generation, request_id, recovery_epoch, observed_at_ns`` (required), then
  ``job_id, rank, worker_generation, block_count`` (None), ``workers, roster`` (``()``),
  ``compute_kind`` (None, a plain str). ``__post_init__`` validates in the order of
  steps 1-10 below and raises ValueError.
- correlated_observability.py @ 65cc5678b0d5: ``CorrelatedObserverHandle(contract,
  token)``, token counter separate from v1's, starting at 1;
  ``register_correlated_observer(observer)`` (no name; ValueError if not callable),
  ``unregister_correlated_observer`` (ValueError "correlated observer handle has the
  wrong contract" on a foreign handle, idempotent otherwise),
  ``correlated_observers_configured()`` (``bool(_observers)``, no lock),
  ``reset_correlated_observers()`` (clears under ``_lock``).
- correlated_observability.py @ 65cc5678b0d5: ``emit_correlated_observation(event, *,
  ...)``: returns at once without observers; builds the record with
  ``observed_at_ns=time.monotonic_ns()``; on TypeError/ValueError logs "Invalid
  correlated KV observation; leaving serving unchanged" and returns without calling
  any observer; snapshots the registry under the lock and calls observers outside
  it; an observer raising ``Exception`` is logged ("Correlated KV observer %d failed;
  removing it") and its token popped; return values are ignored (no evidence).
- correlated_observability.py @ 65cc5678b0d5 and @ 5a820400f656:
  ``os.register_at_fork(after_in_child=_reset_after_fork)`` gives the child a new dict
  and a new lock and keeps the token counter.

Validation, in order (``CorrelatedObservation.__post_init__``):
1 ``type(event) is CorrelatedEvent``; 2 scheduler_generation exactly str, 32 lowercase
hex; 3 request_id exactly str, ``isascii()`` and ``isprintable()``, 1..128 long;
4 recovery_epoch uint64 and > 0; 5 observed_at_ns uint64; 6 when not None: job_id
uint64, rank uint32, worker_generation 32 lowercase hex, block_count uint32 and > 0;
7 workers exactly a tuple of <= 4096 exact WorkerReceipts, sorted and unique when
non-empty, ranks unique; 8 roster exactly a tuple of <= 4096 exact JobReceipts,
``tuple(sorted(set(roster))) == roster``, job ids unique, <= 4096 workers in all;
9 the optional fields whose value is not in ``(None, ())`` are exactly the event's
set (requeued: none; restore_submitted: job_id, rank, worker_generation,
block_count; restore_completed: job_id, rank, worker_generation; transfer_receipt:
job_id, workers; recovery_admitted: roster; first_compute: rank, worker_generation,
roster, compute_kind); 10 compute_kind, when not None, in {"prefill", "decode"}.

Stand-in decisions (the facts do not say): the error messages other than the two
quoted above; log levels (``logger.exception``); in step 6, ``worker_generation``
must be exactly a str (a str subclass is refused).

STAND-IN-ONLY helpers (not in the fork; for tests): ``set_clock()`` / ``clock()`` (a
per-module clock, so a test can give each emitting process its own monotonic base),
``replay(record)`` (re-emit a prebuilt record through ``emit_correlated_observation``
at its ``observed_at_ns``), ``unchecked(**fields)`` (a ``CorrelatedObservation`` built
WITHOUT validation: what a host without validation might hand over) and
``validate_correlated_observation(record)`` (raises as the real constructor would for
the record's fields: the fuzz oracle).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Any, Final

logger = logging.getLogger(__name__)

KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT: Final = "vllm.kv-transfer.observer.v2"
KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION: Final = "2.0"
MAX_CORRELATED_ROSTER: Final = 4096

_UUID = re.compile(r"[0-9a-f]{32}")
_MAX_UINT64 = 2**64 - 1
_MAX_UINT32 = 2**32 - 1
_MAX_REQUEST_ID = 128
_COMPUTE_KINDS = frozenset({"prefill", "decode"})


def _uint(value: Any, maximum: int) -> bool:
    return type(value) is int and 0 <= value <= maximum


def _generation(value: Any) -> bool:
    return type(value) is str and _UUID.fullmatch(value) is not None


@dataclass(frozen=True, slots=True, order=True)
class WorkerReceipt:
    rank: int
    worker_generation: str

    def __post_init__(self) -> None:
        if not _uint(self.rank, _MAX_UINT32):
            raise ValueError("worker receipt rank must be a uint32")
        if not _generation(self.worker_generation):
            raise ValueError("worker receipt generation must be 32 lowercase hex")


def _exact_workers(workers: Any, *, allow_empty: bool) -> bool:
    if type(workers) is not tuple or len(workers) > MAX_CORRELATED_ROSTER:
        return False
    if not workers:
        return allow_empty
    if any(type(w) is not WorkerReceipt for w in workers):
        return False
    if workers != tuple(sorted(set(workers))):
        return False
    return len({w.rank for w in workers}) == len(workers)


@dataclass(frozen=True, slots=True, order=True)
class JobReceipt:
    job_id: int
    workers: tuple[WorkerReceipt, ...]

    def __post_init__(self) -> None:
        if not _uint(self.job_id, _MAX_UINT64):
            raise ValueError("job receipt job_id must be a uint64")
        if not _exact_workers(self.workers, allow_empty=False):
            raise ValueError("workers must be a bounded exact rank/generation roster")


class CorrelatedEvent(str, Enum):
    RECOVERY_REQUEUED = "recovery_requeued"
    RESTORE_SUBMITTED = "restore_submitted"
    RESTORE_COMPLETED = "restore_completed"
    TRANSFER_RECEIPT = "transfer_receipt"
    RECOVERY_ADMITTED = "recovery_admitted"
    FIRST_COMPUTE = "first_compute"


_OPTIONAL = ("job_id", "rank", "worker_generation", "block_count", "workers", "roster",
             "compute_kind")
_SHAPES: dict[CorrelatedEvent, frozenset[str]] = {
    CorrelatedEvent.RECOVERY_REQUEUED: frozenset(),
    CorrelatedEvent.RESTORE_SUBMITTED: frozenset(
        {"job_id", "rank", "worker_generation", "block_count"}),
    CorrelatedEvent.RESTORE_COMPLETED: frozenset({"job_id", "rank", "worker_generation"}),
    CorrelatedEvent.TRANSFER_RECEIPT: frozenset({"job_id", "workers"}),
    CorrelatedEvent.RECOVERY_ADMITTED: frozenset({"roster"}),
    CorrelatedEvent.FIRST_COMPUTE: frozenset(
        {"rank", "worker_generation", "roster", "compute_kind"}),
}


def _validate(r: Any) -> None:
    """Steps 1-10 of ``CorrelatedObservation.__post_init__`` on ``r``'s fields."""
    if type(r.event) is not CorrelatedEvent:  # 1
        raise ValueError("event must be a CorrelatedEvent")
    if not _generation(r.scheduler_generation):  # 2
        raise ValueError("scheduler_generation must be 32 lowercase hex")
    rid = r.request_id  # 3
    if (type(rid) is not str or not rid.isascii() or not rid.isprintable()
            or not 0 < len(rid) <= _MAX_REQUEST_ID):
        raise ValueError("request_id must be 1..128 printable ASCII characters")
    if not _uint(r.recovery_epoch, _MAX_UINT64) or r.recovery_epoch <= 0:  # 4
        raise ValueError("recovery_epoch must be a positive uint64")
    if not _uint(r.observed_at_ns, _MAX_UINT64):  # 5
        raise ValueError("observed_at_ns must be a uint64")
    if r.job_id is not None and not _uint(r.job_id, _MAX_UINT64):  # 6
        raise ValueError("job_id must be a uint64")
    if r.rank is not None and not _uint(r.rank, _MAX_UINT32):
        raise ValueError("rank must be a uint32")
    if r.worker_generation is not None and not _generation(r.worker_generation):
        raise ValueError("worker_generation must be 32 lowercase hex")
    if r.block_count is not None and (not _uint(r.block_count, _MAX_UINT32)
                                      or r.block_count <= 0):
        raise ValueError("block_count must be a positive uint32")
    if not _exact_workers(r.workers, allow_empty=True):  # 7
        raise ValueError("workers must be a bounded exact rank/generation roster")
    roster = r.roster  # 8
    if (type(roster) is not tuple or len(roster) > MAX_CORRELATED_ROSTER
            or any(type(j) is not JobReceipt for j in roster)):
        raise ValueError("roster must be a bounded tuple of JobReceipt")
    if roster and (tuple(sorted(set(roster))) != roster
                   or len({j.job_id for j in roster}) != len(roster)
                   or sum(len(j.workers) for j in roster) > MAX_CORRELATED_ROSTER):
        raise ValueError("roster must be sorted, unique and bounded")
    present = {n for n in _OPTIONAL if getattr(r, n) not in (None, ())}  # 9
    if present != _SHAPES[r.event]:
        raise ValueError(f"{r.event.value} carries {sorted(present)}, "
                         f"needs exactly {sorted(_SHAPES[r.event])}")
    if r.compute_kind is not None and r.compute_kind not in _COMPUTE_KINDS:  # 10
        raise ValueError("compute_kind must be prefill or decode")


@dataclass(frozen=True, slots=True)
class CorrelatedObservation:
    event: CorrelatedEvent
    scheduler_generation: str
    request_id: str
    recovery_epoch: int
    observed_at_ns: int
    job_id: int | None = None
    rank: int | None = None
    worker_generation: str | None = None
    block_count: int | None = None
    workers: tuple[WorkerReceipt, ...] = ()
    roster: tuple[JobReceipt, ...] = ()
    compute_kind: str | None = None

    def __post_init__(self) -> None:
        _validate(self)


CorrelatedObserver = Callable[[CorrelatedObservation], "bool | None"]


@dataclass(frozen=True, slots=True)
class CorrelatedObserverHandle:
    contract: str
    token: int


_lock = threading.Lock()
_observers: dict[int, CorrelatedObserver] = {}
_next_token = 1


def register_correlated_observer(observer: CorrelatedObserver) -> CorrelatedObserverHandle:
    global _next_token
    if not callable(observer):
        raise ValueError("correlated observer must be callable")
    with _lock:
        token = _next_token
        _next_token += 1
        _observers[token] = observer
    return CorrelatedObserverHandle(KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT, token)


def unregister_correlated_observer(handle: CorrelatedObserverHandle) -> None:
    if handle.contract != KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT:
        raise ValueError("correlated observer handle has the wrong contract")
    with _lock:
        _observers.pop(handle.token, None)


def correlated_observers_configured() -> bool:
    return bool(_observers)


def reset_correlated_observers() -> None:
    with _lock:
        _observers.clear()


def emit_correlated_observation(
        event: CorrelatedEvent, *, scheduler_generation: str, request_id: str,
        recovery_epoch: int, job_id: int | None = None, rank: int | None = None,
        worker_generation: str | None = None, block_count: int | None = None,
        workers: tuple[WorkerReceipt, ...] = (), roster: tuple[JobReceipt, ...] = (),
        compute_kind: str | None = None) -> None:
    if not _observers:
        return
    try:
        record = CorrelatedObservation(
            event=event, scheduler_generation=scheduler_generation, request_id=request_id,
            recovery_epoch=recovery_epoch, observed_at_ns=_clock(), job_id=job_id, rank=rank,
            worker_generation=worker_generation, block_count=block_count, workers=workers,
            roster=roster, compute_kind=compute_kind)
    except (TypeError, ValueError):
        logger.exception("Invalid correlated KV observation; leaving serving unchanged")
        return
    with _lock:
        snapshot = sorted(_observers.items())
    for token, observer in snapshot:
        try:
            observer(record)  # the return value is ignored
        except Exception:
            logger.exception("Correlated KV observer %d failed; removing it", token)
            with _lock:
                _observers.pop(token, None)


def _reset_after_fork() -> None:
    global _lock, _observers
    _observers = {}
    _lock = threading.Lock()  # _next_token is kept


os.register_at_fork(after_in_child=_reset_after_fork)


# ------------------------------------------ STAND-IN-ONLY (not in the fork)


_clock: Callable[[], int] = time.monotonic_ns


def set_clock(clock: Callable[[], int] | None) -> Callable[[], int]:
    """STAND-IN-ONLY: the clock ``emit_correlated_observation`` reads (the real
    one reads ``time.monotonic_ns()``); None restores it. Returns the previous clock."""
    global _clock
    previous, _clock = _clock, (clock or time.monotonic_ns)
    return previous


@contextmanager
def clock(fn: Callable[[], int]) -> Iterator[None]:
    """STAND-IN-ONLY: ``set_clock(fn)`` for the ``with`` block."""
    previous = set_clock(fn)
    try:
        yield
    finally:
        set_clock(previous)


_FIELDS = tuple(fields(CorrelatedObservation))


def _field_values(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in _FIELDS}


def replay(record: Any) -> None:
    """STAND-IN-ONLY: emit ``record``'s fields again through the real
    ``emit_correlated_observation``, at its ``observed_at_ns``. A record the
    constructor refuses (``unchecked``) is logged and reaches no observer,
    as in the real emit."""
    values = _field_values(record)
    event = values.pop("event")
    at = values.pop("observed_at_ns")
    with clock(lambda: at):
        emit_correlated_observation(event, **values)


def unchecked(**values: Any) -> CorrelatedObservation:
    """STAND-IN-ONLY: a ``CorrelatedObservation`` with these fields (defaults
    for the rest) built WITHOUT validation, as a host without validation might
    hand one over. TypeError for an unknown field or a missing required one."""
    unknown = set(values) - {f.name for f in _FIELDS}
    if unknown:
        raise TypeError(f"unknown fields {sorted(unknown)}")
    record = object.__new__(CorrelatedObservation)
    for f in _FIELDS:
        if f.name in values:
            value = values[f.name]
        elif f.default is not MISSING:
            value = f.default
        else:
            raise TypeError(f"missing required field {f.name}")
        object.__setattr__(record, f.name, value)
    return record


def fields_of(record: Any) -> dict[str, Any]:
    """STAND-IN-ONLY: a record's fields by name (``dataclasses.asdict`` would
    also turn the receipts into dicts)."""
    return _field_values(record)


def validate_correlated_observation(record: Any) -> None:
    """STAND-IN-ONLY: raise ValueError (or TypeError) when the real
    ``CorrelatedObservation`` constructor would refuse ``record``'s fields."""
    CorrelatedObservation(**_field_values(record))
