"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
reproduces its documented public surface; see shared/design/hust-contract.md.

Canonical event sequences, as the fork's host would emit them, for tests of an
adapter. A chain is a tuple of ``Emission(process, record)`` in one plausible
global delivery order; ``process`` says which process emitted the record
(scheduler, or the worker of one rank) and carries its pid and start id, which
the JSONL files record. ``observed_at_ns`` is monotonic PER PROCESS: each
process has its own clock base, so timestamps never order records across
processes.

- ``recovery_chain()``       two ranks, epochs 1 then 2, v2 records:
  recovery_requeued, restore_submitted/restore_completed per rank,
  transfer_receipt, recovery_admitted, first_compute per rank.
- ``dropped_stage()``        the canonical chain minus one emission.
- ``duplicated_stage()``     one emission delivered twice (identical record).
- ``restarted_worker_chain()`` rank 1's worker process restarts between the
  epochs: new pid, new start id, new worker generation, clock starts again.
- ``over_cap_admission()``   a recovery_admitted whose roster exceeds
  MAX_CORRELATED_ROSTER (and ``at_cap_admission()`` exactly at it).
- ``malformed_v2_records()`` individually invalid v2 records, by name.
- ``v1_recovery_chain()``    the same recovery in v1 records (scheduler records
  carry no rank or generation; ranks only as sets).
- ``unknown_version_module()`` a module object shaped like a contract module
  whose constants name a contract/API version no adapter knows.

Every record of the dropped/duplicated/restarted variants is individually
valid: those are chain-level anomalies for the adapter to judge, the host's
per-record validation accepts them.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import correlated_observability as v2
from . import observability as v1
from .correlated_observability import CorrelatedObservation
from .observability import KVTransferObservation

SCHEDULER_GENERATION = "5c4e0d1a9b2f4e7c8d6a3b1f0e9c7a52"
WORKER_GENERATIONS = {0: "a0a0b1b1c2c2d3d3e4e4f5f5a6a6b7b7",
                      1: "01234567890abcdef0123456789abcde"}
RESTARTED_WORKER_GENERATION = "ffeeddccbbaa99887766554433221100"
REQUEST_ID = "chatcmpl-7f3a-0001"
JOB_IDS = {1: 7, 2: 12}  # epoch -> load job id
BLOCKS = {1: 16, 2: 24}  # epoch -> restored blocks
RANKS = (0, 1)


@dataclass(frozen=True)
class Process:
    """One emitting process: ``role`` "scheduler" or "worker" (with ``rank``)."""

    role: str
    rank: int | None
    pid: int
    start_id: str  # 32 hex, unique per process lifetime (pids are reused)
    generation: str  # scheduler or worker generation


@dataclass(frozen=True)
class Emission:
    process: Process
    record: Any  # CorrelatedObservation or KVTransferObservation


Chain = tuple[Emission, ...]

SCHEDULER = Process("scheduler", None, 4100, "9d0c6f0e1b7a4a3c8e2f5d6b7a8c9d01",
                    SCHEDULER_GENERATION)
WORKERS = {
    0: Process("worker", 0, 4201, "3e1f00aa42b84c6d9e7f1a2b3c4d5e60", WORKER_GENERATIONS[0]),
    1: Process("worker", 1, 4202, "3e1f00aa42b84c6d9e7f1a2b3c4d5e61", WORKER_GENERATIONS[1]),
}
RESTARTED_WORKER_1 = Process("worker", 1, 4377, "77aa00bb11cc22dd33ee44ff55006601",
                             RESTARTED_WORKER_GENERATION)

# per-process clock bases (ns); unrelated to one another on purpose
_CLOCK_BASE = {SCHEDULER.start_id: 1_000_000_000_000,
               WORKERS[0].start_id: 52_000_000_000,
               WORKERS[1].start_id: 987_000_000_000,
               RESTARTED_WORKER_1.start_id: 3_000_000_000}


class _Clocks:
    """Monotonic observed_at_ns per process."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}

    def tick(self, process: Process, step_ns: int = 1_500_000) -> int:
        t = self.now.get(process.start_id, _CLOCK_BASE.get(process.start_id, 10**9)) + step_ns
        self.now[process.start_id] = t
        return t


def records(chain: Chain) -> list[Any]:
    return [e.record for e in chain]


def recovery_chain(workers: dict[int, Process] | None = None,
                   epoch_workers: dict[int, dict[int, Process]] | None = None) -> Chain:
    """Two-rank recovery, epochs 1 then 2, in delivery order.

    ``epoch_workers`` overrides the worker processes per epoch (restarts)."""
    clocks = _Clocks()
    out: list[Emission] = []
    for epoch in (1, 2):
        procs = (epoch_workers or {}).get(epoch) or workers or WORKERS
        job = JOB_IDS[epoch]
        roster_workers = tuple((r, procs[r].generation) for r in RANKS)
        roster = ((job, roster_workers),)

        def sched(event: str, epoch: int = epoch, **kw: Any) -> Emission:
            return Emission(SCHEDULER, CorrelatedObservation(
                event, SCHEDULER_GENERATION, REQUEST_ID, epoch, clocks.tick(SCHEDULER), **kw))

        def work(event: str, rank: int, epoch: int = epoch, procs: Any = procs,
                 **kw: Any) -> Emission:
            p = procs[rank]
            return Emission(p, CorrelatedObservation(
                event, SCHEDULER_GENERATION, REQUEST_ID, epoch, clocks.tick(p),
                rank=rank, worker_generation=p.generation, **kw))

        out.append(sched("recovery_requeued"))
        for r in RANKS:
            out.append(work("restore_submitted", r, job_id=job, block_count=BLOCKS[epoch]))
        for r in RANKS:
            out.append(work("restore_completed", r, job_id=job))
        out.append(sched("transfer_receipt", job_id=job, workers=roster_workers))
        out.append(sched("recovery_admitted", roster=roster))
        kind = "prefill" if epoch == 1 else "decode"
        for r in RANKS:
            out.append(work("first_compute", r, roster=roster, compute_kind=kind))
    return tuple(out)


def _find(chain: Chain, event: str, epoch: int, rank: int | None) -> int:
    for i, e in enumerate(chain):
        rec = e.record
        if rec.event == event and rec.recovery_epoch == epoch and rec.rank == rank:
            return i
    raise LookupError(f"no {event} epoch={epoch} rank={rank}")


def dropped_stage(event: str = "restore_completed", epoch: int = 2,
                  rank: int | None = 1, chain: Chain | None = None) -> Chain:
    chain = chain or recovery_chain()
    i = _find(chain, event, epoch, rank)
    return chain[:i] + chain[i + 1:]


def duplicated_stage(event: str = "transfer_receipt", epoch: int = 1,
                     rank: int | None = None, chain: Chain | None = None) -> Chain:
    chain = chain or recovery_chain()
    i = _find(chain, event, epoch, rank)
    return chain[:i + 1] + (chain[i],) + chain[i + 1:]


def restarted_worker_chain() -> Chain:
    """Rank 1's worker restarted between epoch 1 and epoch 2."""
    return recovery_chain(epoch_workers={1: WORKERS, 2: {0: WORKERS[0], 1: RESTARTED_WORKER_1}})


def _admission(n_jobs: int) -> CorrelatedObservation:
    workers = tuple((r, WORKER_GENERATIONS[r]) for r in RANKS)
    roster = tuple((job, workers) for job in range(n_jobs))
    return CorrelatedObservation("recovery_admitted", SCHEDULER_GENERATION, REQUEST_ID, 1,
                                 1_000_000_000_123, roster=roster)


def at_cap_admission() -> CorrelatedObservation:
    return _admission(v2.MAX_CORRELATED_ROSTER)


def over_cap_admission() -> CorrelatedObservation:
    return _admission(v2.MAX_CORRELATED_ROSTER + 1)


def over_cap_receipt() -> CorrelatedObservation:
    gen = WORKER_GENERATIONS[0]
    return CorrelatedObservation(
        "transfer_receipt", SCHEDULER_GENERATION, REQUEST_ID, 1, 1_000_000_000_123, job_id=7,
        workers=tuple((r, gen) for r in range(v2.MAX_CORRELATED_ROSTER + 1)))


def _canonical(event: str, epoch: int = 1, rank: int | None = None) -> CorrelatedObservation:
    chain = recovery_chain()
    return chain[_find(chain, event, epoch, rank)].record


def malformed_v2_records() -> dict[str, CorrelatedObservation]:
    """name -> a record the host's v2 validation must refuse."""
    rep = dataclasses.replace
    sub = _canonical("restore_submitted", rank=0)
    receipt = _canonical("transfer_receipt")
    admitted = _canonical("recovery_admitted")
    first = _canonical("first_compute", rank=1)
    requeued = _canonical("recovery_requeued")
    w0, w1 = receipt.workers  # type: ignore[misc]
    return {
        "unknown_event": rep(requeued, event="restore_started"),
        "scheduler_generation_uppercase": rep(requeued,
                                              scheduler_generation=SCHEDULER_GENERATION.upper()),
        "scheduler_generation_short": rep(requeued, scheduler_generation="5c4e0d1a"),
        "scheduler_generation_uuid_dashes": rep(
            requeued, scheduler_generation="5c4e0d1a-9b2f-4e7c-8d6a-3b1f0e9c7a52"),
        "worker_generation_not_hex": rep(sub, worker_generation="g" * 32),
        "request_id_empty": rep(requeued, request_id=""),
        "request_id_too_long": rep(requeued, request_id="r" * 129),
        "request_id_non_ascii": rep(requeued, request_id="req-\u00e9"),
        "request_id_control_char": rep(requeued, request_id="req\n1"),
        "epoch_zero": rep(requeued, recovery_epoch=0),
        "epoch_negative": rep(requeued, recovery_epoch=-1),
        "epoch_bool": rep(requeued, recovery_epoch=True),
        "observed_at_negative": rep(requeued, observed_at_ns=-5),
        "submitted_missing_job": rep(sub, job_id=None),
        "submitted_missing_rank": rep(sub, rank=None),
        "submitted_missing_worker_generation": rep(sub, worker_generation=None),
        "submitted_missing_blocks": rep(sub, block_count=None),
        "submitted_zero_blocks": rep(sub, block_count=0),
        "completed_missing_worker_generation": rep(_canonical("restore_completed", rank=1),
                                                   worker_generation=None),
        "receipt_missing_workers": rep(receipt, workers=None),
        "receipt_missing_job": rep(receipt, job_id=None),
        "receipt_workers_unsorted": rep(receipt, workers=(w1, w0)),
        "receipt_workers_duplicate": rep(receipt, workers=(w0, w0)),
        "receipt_two_entries_one_rank": rep(receipt, workers=(w0, (0, w1[1]))),
        "receipt_workers_empty": rep(receipt, workers=()),
        "receipt_workers_list": rep(receipt, workers=[w0, w1]),
        "receipt_workers_over_cap": over_cap_receipt(),
        "admitted_missing_roster": rep(admitted, roster=None),
        "admitted_roster_unsorted": rep(admitted, roster=((12, (w0, w1)), (7, (w0, w1)))),
        "admitted_roster_duplicate_job": rep(admitted, roster=((7, (w0, w1)), (7, (w0, w1)))),
        "admitted_roster_workers_unsorted": rep(admitted, roster=((7, (w1, w0)),)),
        "admitted_roster_over_cap": over_cap_admission(),
        "first_compute_missing_kind": rep(first, compute_kind=None),
        "first_compute_unknown_kind": rep(first, compute_kind="verify"),
        "first_compute_missing_roster": rep(first, roster=None),
        "first_compute_missing_rank": rep(first, rank=None),
    }


# ---------------------------------------------------------------- v1


def v1_recovery_chain(workers: dict[int, Process] | None = None) -> Chain:
    """The same two-epoch recovery in contract v1 records.

    v1's limits: scheduler records (recovery_requeued, transfer_receipt,
    recovery_admitted) carry no rank and no generation; ranks appear only as
    the receipt's sorted set; transfer_descriptors has no request id and
    rank None and arrives before the submit; job ids restart per connector
    instance (nothing in a record says which instance)."""
    procs = workers or WORKERS
    clocks = _Clocks()
    out: list[Emission] = []
    K = KVTransferObservation
    for epoch in (1, 2):
        job = JOB_IDS[epoch]
        blocks = BLOCKS[epoch]
        out.append(Emission(SCHEDULER, K("recovery_requeued", clocks.tick(SCHEDULER),
                                         request_id=REQUEST_ID, recovery_epoch=epoch,
                                         requeue_reason="unclassified")))
        for r in RANKS:
            p = procs[r]
            descs = tuple((0, 1, i * 65536, i * 65536, 65536) for i in range(blocks))
            out.append(Emission(p, K("transfer_descriptors", clocks.tick(p), job_id=job,
                                     operation="h2d_restore", descriptors=descs)))
            out.append(Emission(p, K("transfer_submitted", clocks.tick(p),
                                     operation="h2d_restore", job_id=job, rank=r,
                                     request_id=REQUEST_ID, block_count=blocks)))
        for r in RANKS:
            p = procs[r]
            out.append(Emission(p, K("transfer_completed", clocks.tick(p, 4_000_000),
                                     operation="h2d_restore", job_id=job, rank=r,
                                     request_id=REQUEST_ID, block_count=blocks, success=True,
                                     bytes_moved=blocks * 65536, duration_ns=3_900_000)))
        out.append(Emission(SCHEDULER, K("transfer_receipt", clocks.tick(SCHEDULER),
                                         operation="h2d_restore", job_id=job, ranks=RANKS)))
        out.append(Emission(SCHEDULER, K("recovery_admitted", clocks.tick(SCHEDULER),
                                         request_id=REQUEST_ID, recovery_epoch=epoch,
                                         job_ids=(job,))))
        kind = "prefill" if epoch == 1 else "decode"
        for r in RANKS:
            p = procs[r]
            out.append(Emission(p, K("first_compute", clocks.tick(p), rank=r,
                                     request_id=REQUEST_ID, recovery_epoch=epoch,
                                     job_ids=(job,), compute_kind=kind)))
    return tuple(out)


def v1_shutdown_cancel(rank: int = 0, job_id: int = 31) -> Emission:
    """A still-open store cancelled at shutdown (the only v1 reason)."""
    p = WORKERS[rank]
    return Emission(p, KVTransferObservation(
        "transfer_cancelled", 60_000_000_000, operation="d2h_preserve", job_id=job_id, rank=rank,
        request_id=REQUEST_ID, block_count=8, reason="host_shutdown"))


# ---------------------------------------------------------------- versions


def unknown_version_module(base: types.ModuleType = v2,
                           contract: str = "vllm.kv-transfer.observer.v3",
                           api_version: str = "3.0") -> types.ModuleType:
    """A module object shaped like ``base`` (same functions and record type)
    whose constants, and the handles it returns, claim another contract/API
    version: what an adapter must refuse (fail closed) on import."""
    mod = types.ModuleType(f"{base.__name__}_{contract.rsplit('.', 1)[-1]}_{api_version}",
                           f"STAND-IN module claiming {contract} / {api_version}")
    for name in dir(base):
        if not name.startswith("__"):
            setattr(mod, name, getattr(base, name))
    mod.KV_TRANSFER_OBSERVER_CONTRACT = contract  # type: ignore[attr-defined]
    mod.KV_TRANSFER_OBSERVABILITY_API_VERSION = api_version  # type: ignore[attr-defined]

    def _wrap(register: Callable[..., v1.ObserverHandle]) -> Callable[..., v1.ObserverHandle]:
        def reg(*args: Any) -> v1.ObserverHandle:
            h = register(*args)
            return v1.ObserverHandle(contract, h.token)
        return reg

    def _unwrap(unregister: Callable[[Any], None]) -> Callable[[Any], None]:
        def unreg(handle: Any) -> None:
            if getattr(handle, "contract", None) == contract:
                unregister(v1.ObserverHandle(base.KV_TRANSFER_OBSERVER_CONTRACT, handle.token))
        return unreg

    for reg_name in ("register_kv_transfer_observer", "register_correlated_observer"):
        if hasattr(base, reg_name):
            setattr(mod, reg_name, _wrap(getattr(base, reg_name)))
    for unreg_name in ("unregister_kv_transfer_observer", "unregister_correlated_observer"):
        if hasattr(base, unreg_name):
            setattr(mod, unreg_name, _unwrap(getattr(base, unreg_name)))
    return mod
