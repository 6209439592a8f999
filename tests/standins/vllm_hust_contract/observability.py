"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
reproduces its documented public surface; see shared/design/hust-contract.md.

Contract v1: ``vllm.kv-transfer.observer.v1``, API version "1.0" (the fork's
``.../kv_connector/v1/offloading/observability.py``).

Public (documented) surface::

    register_kv_transfer_observer(name, observer) -> ObserverHandle  (.contract, .token)
    unregister_kv_transfer_observer(handle)        idempotent, returns None
    kv_transfer_observers_configured() -> bool
    reset_kv_transfer_observers()
    KVTransferObservation                          frozen record
    KV_TRANSFER_OBSERVER_CONTRACT, KV_TRANSFER_OBSERVABILITY_API_VERSION,
    MAX_DESCRIPTOR_REGIONS

Host side (what the fork's call sites do; for tests only)::

    emit_v1(record)                 dispatch inline to every observer
    effective_evidence_requests()   records whose observer returned exactly True
    bound_descriptors(descriptors)  (kept <= MAX_DESCRIPTOR_REGIONS, dropped count)

Dispatch semantics (documented): observers are called inline, in registration
order, with the one frozen record; an observer that raises is logged (logger
of this module, WARNING with the traceback) and removed, and dispatch goes on
to the others; a return value of exactly ``True`` (``is True``, not truthy)
asks the host for its own "effective" evidence event, which this stand-in
appends to a list read through ``effective_evidence_requests()``; every
observer is dropped in a forked child (``os.register_at_fork``).

Stand-in assumption (not documented by the fork): ``emit_v1`` refuses, with
``InvalidObservation``, a record carrying more than ``MAX_DESCRIPTOR_REGIONS``
descriptors, an unknown event, operation, reason, requeue reason or compute
kind: the real host never builds one (it bounds descriptors at the copy site
and counts the rest in ``dropped_descriptors``).

Defaults of unused record fields: counts (``block_count``, ``bytes_moved``,
``duration_ns``, ``dropped_descriptors``) are 0, tuples (``ranks``,
``job_ids``, ``descriptors``) are (), everything else is None.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

KV_TRANSFER_OBSERVER_CONTRACT = "vllm.kv-transfer.observer.v1"
KV_TRANSFER_OBSERVABILITY_API_VERSION = "1.0"
MAX_DESCRIPTOR_REGIONS = 4096

EVENTS = frozenset({
    "transfer_submitted", "transfer_completed", "transfer_cancelled", "transfer_receipt",
    "recovery_requeued", "recovery_admitted", "transfer_descriptors", "first_compute",
})
OPERATIONS = frozenset({"d2h_preserve", "h2d_restore"})
REASONS = frozenset({"host_shutdown"})
REQUEUE_REASONS = frozenset({"unclassified"})
COMPUTE_KINDS = frozenset({"prefill", "decode"})

# (src_region_id, dst_region_id, src_offset, dst_offset, size)
Descriptor = tuple[int, int, int, int, int]


class InvalidObservation(ValueError):
    """Raised by the host-side ``emit_v1`` for a record the host never builds."""


@dataclass(frozen=True)
class ObserverHandle:
    """What registration returns; pass it back to unregister."""

    contract: str
    token: int


@dataclass(frozen=True)
class KVTransferObservation:
    event: str
    observed_at_ns: int  # per-process monotonic clock
    operation: str | None = None  # d2h_preserve / h2d_restore
    job_id: int | None = None
    rank: int | None = None
    request_id: str | None = None
    block_count: int = 0
    success: bool | None = None
    bytes_moved: int = 0
    duration_ns: int = 0
    reason: str | None = None  # only "host_shutdown"
    ranks: tuple[int, ...] = ()
    recovery_epoch: int | None = None
    job_ids: tuple[int, ...] = ()
    requeue_reason: str | None = None  # only "unclassified"
    descriptors: tuple[Descriptor, ...] = ()
    dropped_descriptors: int = 0
    compute_kind: str | None = None  # prefill / decode


@dataclass(frozen=True)
class EffectiveEvidence:
    """One request for the host's own "effective" evidence event."""

    observer_name: str
    record: KVTransferObservation


Observer = Callable[[KVTransferObservation], Any]

_lock = threading.Lock()
_tokens = itertools.count(1)
_observers: dict[int, tuple[str, Observer]] = {}
_effective: list[EffectiveEvidence] = []


def register_kv_transfer_observer(name: str, observer: Observer) -> ObserverHandle:
    if not isinstance(name, str) or not name:
        raise ValueError("observer name must be a non-empty str")
    if not callable(observer):
        raise TypeError("observer must be callable")
    with _lock:
        token = next(_tokens)
        _observers[token] = (name, observer)
    return ObserverHandle(KV_TRANSFER_OBSERVER_CONTRACT, token)


def unregister_kv_transfer_observer(handle: ObserverHandle) -> None:
    """Remove the observer; unknown, already removed or foreign handles are a no-op."""
    if getattr(handle, "contract", None) != KV_TRANSFER_OBSERVER_CONTRACT:
        return
    with _lock:
        _observers.pop(getattr(handle, "token", None), None)


def kv_transfer_observers_configured() -> bool:
    return bool(_observers)


def reset_kv_transfer_observers() -> None:
    """Drop every observer and the recorded effective-evidence requests."""
    with _lock:
        _observers.clear()
        _effective.clear()


# ---------------------------------------------------------------- host side


def effective_evidence_requests() -> tuple[EffectiveEvidence, ...]:
    with _lock:
        return tuple(_effective)


def bound_descriptors(
    descriptors: Iterable[Descriptor],
) -> tuple[tuple[Descriptor, ...], int]:
    """What the copy site does: keep at most MAX_DESCRIPTOR_REGIONS, count the rest."""
    kept: list[Descriptor] = []
    dropped = 0
    for d in descriptors:
        if len(kept) < MAX_DESCRIPTOR_REGIONS:
            kept.append(tuple(d))  # type: ignore[arg-type]
        else:
            dropped += 1
    return tuple(kept), dropped


def check_v1(record: KVTransferObservation) -> None:
    """The stand-in's structural guard (see module docstring)."""
    if not isinstance(record, KVTransferObservation):
        raise InvalidObservation(f"not a KVTransferObservation: {type(record).__name__}")
    if record.event not in EVENTS:
        raise InvalidObservation(f"unknown event {record.event!r}")
    for value, allowed, what in (
        (record.operation, OPERATIONS, "operation"),
        (record.reason, REASONS, "reason"),
        (record.requeue_reason, REQUEUE_REASONS, "requeue_reason"),
        (record.compute_kind, COMPUTE_KINDS, "compute_kind"),
    ):
        if value is not None and value not in allowed:
            raise InvalidObservation(f"unknown {what} {value!r}")
    if len(record.descriptors) > MAX_DESCRIPTOR_REGIONS:
        raise InvalidObservation(
            f"{len(record.descriptors)} descriptors > MAX_DESCRIPTOR_REGIONS")
    for d in record.descriptors:
        if len(d) != 5:
            raise InvalidObservation(f"descriptor {d!r} is not a 5-tuple")


def emit_v1(record: KVTransferObservation) -> None:
    """The host's dispatch: inline, fail-open per observer."""
    if not _observers:  # disabled: nothing happens at all
        return
    check_v1(record)
    with _lock:
        snapshot = list(_observers.items())
    for token, (name, observer) in snapshot:
        try:
            result = observer(record)
        except Exception:
            logger.warning("kv transfer observer %r raised on %s; removed", name,
                           record.event, exc_info=True)
            with _lock:
                _observers.pop(token, None)
            continue
        if result is True:
            with _lock:
                _effective.append(EffectiveEvidence(name, record))


def _drop_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _observers.clear()
    _effective.clear()


os.register_at_fork(after_in_child=_drop_in_child)
