"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
contract v1, the fork's
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/observability.py``.

Written from facts read in the fork's source (no code copied). Each fact
this module relies on, with the fork file and commit it was read at
(``observability.py`` = the module above):

- observability.py @ 65cc5678b0d5: constants ``KV_TRANSFER_OBSERVER_CONTRACT =
  "vllm.kv-transfer.observer.v1"``, ``KV_TRANSFER_OBSERVABILITY_API_VERSION = "1.0"``,
  ``MAX_DESCRIPTOR_REGIONS = 4096``; the names in ``__all__``.
- observability.py @ 65cc5678b0d5: the ``(str, Enum)`` enums ``KVTransferEvent`` (eight
  events, in source order), ``TransferOperation`` (``.direction`` is "d2h"/"h2d"),
  ``TransferCancellationReason`` (only ``HOST_SHUTDOWN``), ``RecoveryRequeueReason``
  (only ``UNCLASSIFIED``), ``ComputeKind`` (``PREFILL``, ``DECODE``).
- observability.py @ 65cc5678b0d5: ``KVRegionDescriptor`` and ``KVTransferObservation``
  are frozen slots dataclasses without ``__post_init__``: v1 validates nothing. The
  observation has 18 fields; only ``event`` and ``observed_at_ns`` are required, the
  rest default to None, ``()`` (``ranks``, ``job_ids``, ``descriptors``) or 0
  (``dropped_descriptors``).
- observability.py @ 65cc5678b0d5: ``KVTransferObserverHandle(contract, token)``; tokens
  from a module counter, incremented under ``_registry_lock``, starting at 1.
- observability.py @ 65cc5678b0d5: ``register_kv_transfer_observer(name, observer)``
  raises ValueError unless ``name`` is a str with non-whitespace content and
  ``observer`` is callable; no duplicate check. ``unregister_kv_transfer_observer``
  raises ValueError for a handle of another contract and is otherwise idempotent.
  ``kv_transfer_observers_configured()`` is ``bool(_observers)`` without the lock;
  ``reset_kv_transfer_observers()`` clears under the lock.
- observability.py @ 65cc5678b0d5: every ``emit_kv_*`` is keyword-only, returns at once
  when no observer is registered (no clock read, no record), and stamps
  ``observed_at_ns`` with ``time.monotonic_ns()``. ``emit_kv_transfer_receipt`` also
  sets ``operation=H2D_RESTORE`` and ``success=True``; ``emit_kv_recovery_requeued``
  puts ``reason`` into ``requeue_reason``; ``emit_kv_transfer_descriptors`` has
  ``dropped_descriptors=0``; ``emit_kv_first_compute`` takes ``compute_kind`` None.
- observability.py @ 65cc5678b0d5: dispatch snapshots the registry under the lock and
  calls observers outside it, in token order (one registered mid-dispatch misses that
  record). An observer raising ``Exception`` is logged ("KV transfer observer %d
  failed; removing it"), its token popped, and the loop goes on. A return value that
  ``is True`` calls ``vllm.plugins.evidence._emit_host_event("effective",
  DEFAULT_PLUGINS_GROUP, <observer name>, "vllm.kv-transfer.observer.v1",
  detail=<event value>, occurrence_id=<observed_at_ns>,
  observation_kind="runtime_effective")``; if that raises, it is logged ("... evidence
  delivery failed") and the observer is kept. Any other return value is ignored.
- observability.py @ 65cc5678b0d5: ``os.register_at_fork(after_in_child=...)`` gives a
  forked child an empty observer dict and a new lock and keeps the token counter.
  observability.py @ 115e5f6b0d2c is otherwise identical but has no fork hook.

Stand-in decisions (the facts do not say):

- log levels: ``logger.exception`` (ERROR with the traceback) for both messages, and
  the start of the second ("KV transfer observer %d evidence delivery failed");
- there is no lazy import: ``_emit_host_event`` below stands for the fork's callee;
- the emit functions store the values they are given (no conversion to tuples);
- the value of ``DEFAULT_PLUGINS_GROUP`` ("vllm.general_plugins", upstream vLLM's).

STAND-IN-ONLY helpers (not in the fork; for tests): ``effective_evidence_requests()``
(what the real host hands to ``_emit_host_event``, which is not available here),
``set_clock()`` (a per-module clock, so a test can give each emitting process its own
monotonic base), ``replay(record)`` (re-emit a prebuilt record through the real emit
function of its event), ``set_fork_reset()`` (emulate observability.py @ 115e5f6b0d2c,
which has no fork reset).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Final

logger = logging.getLogger(__name__)

KV_TRANSFER_OBSERVER_CONTRACT: Final = "vllm.kv-transfer.observer.v1"
KV_TRANSFER_OBSERVABILITY_API_VERSION: Final = "1.0"
MAX_DESCRIPTOR_REGIONS: Final = 4096

__all__ = [
    "KV_TRANSFER_OBSERVABILITY_API_VERSION",
    "KV_TRANSFER_OBSERVER_CONTRACT",
    "MAX_DESCRIPTOR_REGIONS",
    "ComputeKind",
    "KVRegionDescriptor",
    "KVTransferEvent",
    "KVTransferObservation",
    "KVTransferObserver",
    "KVTransferObserverHandle",
    "RecoveryRequeueReason",
    "TransferCancellationReason",
    "TransferOperation",
    "emit_kv_first_compute",
    "emit_kv_recovery_admitted",
    "emit_kv_recovery_requeued",
    "emit_kv_transfer_cancelled",
    "emit_kv_transfer_completed",
    "emit_kv_transfer_descriptors",
    "emit_kv_transfer_receipt",
    "emit_kv_transfer_submitted",
    "kv_transfer_observers_configured",
    "register_kv_transfer_observer",
    "reset_kv_transfer_observers",
    "unregister_kv_transfer_observer",
]


class KVTransferEvent(str, Enum):
    TRANSFER_SUBMITTED = "transfer_submitted"
    TRANSFER_COMPLETED = "transfer_completed"
    TRANSFER_CANCELLED = "transfer_cancelled"
    TRANSFER_RECEIPT = "transfer_receipt"
    TRANSFER_DESCRIPTORS = "transfer_descriptors"
    RECOVERY_REQUEUED = "recovery_requeued"
    RECOVERY_ADMITTED = "recovery_admitted"
    FIRST_COMPUTE = "first_compute"


class TransferOperation(str, Enum):
    D2H_PRESERVE = "d2h_preserve"
    H2D_RESTORE = "h2d_restore"

    @property
    def direction(self) -> str:
        return "d2h" if self is TransferOperation.D2H_PRESERVE else "h2d"


class TransferCancellationReason(str, Enum):
    HOST_SHUTDOWN = "host_shutdown"


class RecoveryRequeueReason(str, Enum):
    UNCLASSIFIED = "unclassified"


class ComputeKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class KVRegionDescriptor:
    src_region_id: int
    dst_region_id: int
    src_offset: int
    dst_offset: int
    size: int


@dataclass(frozen=True, slots=True)
class KVTransferObservation:
    event: KVTransferEvent
    observed_at_ns: int
    operation: TransferOperation | None = None
    job_id: int | None = None
    rank: int | None = None
    request_id: str | None = None
    block_count: int | None = None
    success: bool | None = None
    bytes_moved: int | None = None
    duration_ns: int | None = None
    reason: TransferCancellationReason | None = None
    ranks: tuple[int, ...] = ()
    recovery_epoch: int | None = None
    job_ids: tuple[int, ...] = ()
    requeue_reason: RecoveryRequeueReason | None = None
    descriptors: tuple[KVRegionDescriptor, ...] = ()
    dropped_descriptors: int = 0
    compute_kind: ComputeKind | None = None


KVTransferObserver = Callable[[KVTransferObservation], "bool | None"]


@dataclass(frozen=True, slots=True)
class KVTransferObserverHandle:
    contract: str
    token: int


_registry_lock = threading.Lock()
_observers: dict[int, tuple[str, KVTransferObserver]] = {}
_next_token = 1


def register_kv_transfer_observer(name: str,
                                  observer: KVTransferObserver) -> KVTransferObserverHandle:
    global _next_token
    if not isinstance(name, str) or not name.strip():
        raise ValueError("KV transfer observer name must be a non-blank str")
    if not callable(observer):
        raise ValueError("KV transfer observer must be callable")
    with _registry_lock:
        token = _next_token
        _next_token += 1
        _observers[token] = (name, observer)
    return KVTransferObserverHandle(KV_TRANSFER_OBSERVER_CONTRACT, token)


def unregister_kv_transfer_observer(handle: KVTransferObserverHandle) -> None:
    if handle.contract != KV_TRANSFER_OBSERVER_CONTRACT:
        raise ValueError("KV transfer observer handle has the wrong contract")
    with _registry_lock:
        _observers.pop(handle.token, None)


def kv_transfer_observers_configured() -> bool:
    return bool(_observers)


def reset_kv_transfer_observers() -> None:
    with _registry_lock:
        _observers.clear()


# ---------------------------------------------------------------- dispatch


def _publish(record: KVTransferObservation) -> None:
    with _registry_lock:
        snapshot = sorted(_observers.items())
    for token, (name, observer) in snapshot:
        try:
            result = observer(record)
        except Exception:
            logger.exception("KV transfer observer %d failed; removing it", token)
            with _registry_lock:
                _observers.pop(token, None)
            continue
        if result is True:
            try:
                _emit_host_event("effective", DEFAULT_PLUGINS_GROUP, name,
                                 KV_TRANSFER_OBSERVER_CONTRACT, detail=record.event.value,
                                 occurrence_id=record.observed_at_ns,
                                 observation_kind="runtime_effective")
            except Exception:
                logger.exception("KV transfer observer %d evidence delivery failed", token)


def emit_kv_transfer_submitted(*, operation: TransferOperation, job_id: int, rank: int,
                               request_id: str, block_count: int) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.TRANSFER_SUBMITTED, observed_at_ns=_clock(),
        operation=operation, job_id=job_id, rank=rank, request_id=request_id,
        block_count=block_count))


def emit_kv_transfer_completed(*, operation: TransferOperation, job_id: int, rank: int,
                               request_id: str, success: bool, bytes_moved: int | None,
                               duration_ns: int | None) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.TRANSFER_COMPLETED, observed_at_ns=_clock(),
        operation=operation, job_id=job_id, rank=rank, request_id=request_id,
        success=success, bytes_moved=bytes_moved, duration_ns=duration_ns))


def emit_kv_transfer_cancelled(*, operation: TransferOperation, job_id: int, rank: int,
                               request_id: str, reason: TransferCancellationReason) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.TRANSFER_CANCELLED, observed_at_ns=_clock(),
        operation=operation, job_id=job_id, rank=rank, request_id=request_id, reason=reason))


def emit_kv_transfer_receipt(*, job_id: int, rank: int | None, request_id: str,
                             ranks: tuple[int, ...]) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.TRANSFER_RECEIPT, observed_at_ns=_clock(),
        operation=TransferOperation.H2D_RESTORE, job_id=job_id, rank=rank,
        request_id=request_id, success=True, ranks=ranks))


def emit_kv_recovery_requeued(*, request_id: str, recovery_epoch: int,
                              reason: RecoveryRequeueReason) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.RECOVERY_REQUEUED, observed_at_ns=_clock(),
        request_id=request_id, recovery_epoch=recovery_epoch, requeue_reason=reason))


def emit_kv_recovery_admitted(*, request_id: str, recovery_epoch: int,
                              job_ids: tuple[int, ...]) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.RECOVERY_ADMITTED, observed_at_ns=_clock(),
        request_id=request_id, recovery_epoch=recovery_epoch, job_ids=job_ids))


def emit_kv_transfer_descriptors(*, job_id: int, rank: int | None,
                                 operation: TransferOperation,
                                 descriptors: tuple[KVRegionDescriptor, ...],
                                 dropped_descriptors: int = 0) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.TRANSFER_DESCRIPTORS, observed_at_ns=_clock(),
        operation=operation, job_id=job_id, rank=rank, descriptors=descriptors,
        dropped_descriptors=dropped_descriptors))


def emit_kv_first_compute(*, request_id: str, recovery_epoch: int, job_ids: tuple[int, ...],
                          compute_kind: ComputeKind | None, rank: int) -> None:
    if not _observers:
        return
    _publish(KVTransferObservation(
        event=KVTransferEvent.FIRST_COMPUTE, observed_at_ns=_clock(),
        request_id=request_id, recovery_epoch=recovery_epoch, job_ids=job_ids,
        compute_kind=compute_kind, rank=rank))


# ---------------------------------------------------------------- fork


_fork_reset = True  # STAND-IN-ONLY switch, see set_fork_reset()


def _reset_after_fork() -> None:
    global _registry_lock, _observers
    if not _fork_reset:
        return  # observability.py @ 115e5f6b0d2c: the child keeps the parent's observers
    _observers = {}
    _registry_lock = threading.Lock()
    # _next_token is kept: a parent handle copied into the child cannot
    # remove an entry the child registers.


os.register_at_fork(after_in_child=_reset_after_fork)


# ------------------------------------------ STAND-IN-ONLY (not in the fork)


DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"  # lives in vllm.plugins; stand-in decision


@dataclass(frozen=True)
class EffectiveEvidence:
    """STAND-IN-ONLY: one call the real host makes to
    ``vllm.plugins.evidence._emit_host_event`` (positional args, then keywords)."""

    status: str
    group: str
    observer_name: str
    contract: str
    detail: str
    occurrence_id: int
    observation_kind: str


_effective: list[EffectiveEvidence] = []


def _emit_host_event(status: str, group: str, name: str, contract: str, *, detail: str,
                     occurrence_id: int, observation_kind: str) -> None:
    """STAND-IN-ONLY: stands for ``vllm.plugins.evidence._emit_host_event`` (not
    available here): records the request. Tests may monkeypatch it to fail."""
    _effective.append(EffectiveEvidence(status, group, name, contract, detail, occurrence_id,
                                        observation_kind))


def effective_evidence_requests() -> tuple[EffectiveEvidence, ...]:
    """STAND-IN-ONLY: the "effective" evidence requests made since the last clear."""
    return tuple(_effective)


def clear_effective_evidence_requests() -> None:
    """STAND-IN-ONLY."""
    _effective.clear()


_clock: Callable[[], int] = time.monotonic_ns


def set_clock(clock: Callable[[], int] | None) -> Callable[[], int]:
    """STAND-IN-ONLY: the clock the emit functions read (the real ones read
    ``time.monotonic_ns()``); None restores it. Returns the previous clock."""
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


def set_fork_reset(enabled: bool) -> bool:
    """STAND-IN-ONLY: False emulates observability.py @ 115e5f6b0d2c (no fork
    reset: a forked child keeps the parent's observers). Returns the previous value."""
    global _fork_reset
    previous, _fork_reset = _fork_reset, enabled
    return previous


# event -> (emit function, the record fields it takes, the values it fixes)
_EMITS: dict[KVTransferEvent, tuple[Callable[..., None], tuple[str, ...], dict[str, Any]]] = {
    KVTransferEvent.TRANSFER_SUBMITTED: (
        emit_kv_transfer_submitted,
        ("operation", "job_id", "rank", "request_id", "block_count"), {}),
    KVTransferEvent.TRANSFER_COMPLETED: (
        emit_kv_transfer_completed,
        ("operation", "job_id", "rank", "request_id", "success", "bytes_moved",
         "duration_ns"), {}),
    KVTransferEvent.TRANSFER_CANCELLED: (
        emit_kv_transfer_cancelled, ("operation", "job_id", "rank", "request_id", "reason"),
        {}),
    KVTransferEvent.TRANSFER_RECEIPT: (
        emit_kv_transfer_receipt, ("job_id", "rank", "request_id", "ranks"),
        {"operation": TransferOperation.H2D_RESTORE, "success": True}),
    KVTransferEvent.TRANSFER_DESCRIPTORS: (
        emit_kv_transfer_descriptors,
        ("job_id", "rank", "operation", "descriptors", "dropped_descriptors"), {}),
    KVTransferEvent.RECOVERY_REQUEUED: (
        emit_kv_recovery_requeued, ("request_id", "recovery_epoch", "requeue_reason"), {}),
    KVTransferEvent.RECOVERY_ADMITTED: (
        emit_kv_recovery_admitted, ("request_id", "recovery_epoch", "job_ids"), {}),
    KVTransferEvent.FIRST_COMPUTE: (
        emit_kv_first_compute,
        ("request_id", "recovery_epoch", "job_ids", "compute_kind", "rank"), {}),
}
_DEFAULTS = {f.name: f.default for f in fields(KVTransferObservation)}


def replay(record: KVTransferObservation) -> None:
    """STAND-IN-ONLY: emit ``record`` again through the real emit function of
    its event, with its fields, at its ``observed_at_ns`` (so observers get an
    equal, new record). Raises ValueError for a record that emit function
    cannot produce: an unknown event, a field it does not take holding a
    non-default value, or a field it fixes holding another value."""
    event = KVTransferEvent(record.event)
    emit, takes, fixed = _EMITS[event]
    for name, default in _DEFAULTS.items():
        if name in ("event", "observed_at_ns") or name in takes:
            continue
        want = fixed.get(name, default)
        if getattr(record, name) != want:
            raise ValueError(f"emit for {event.value} cannot produce {name}="
                             f"{getattr(record, name)!r} (it gives {want!r})")
    kwargs = {("reason" if n == "requeue_reason" else n): getattr(record, n) for n in takes}
    at = record.observed_at_ns
    with clock(lambda: at):
        emit(**kwargs)
