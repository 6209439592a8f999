"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
canonical event sequences, as the fork's host emits them, for tests of an adapter.

A chain is a tuple of ``Emission(process, record)`` in one plausible global
delivery order; ``process`` says which process emitted the record (scheduler,
or the worker of one rank) and carries its generation. Records are
built with the stand-in's classes (``CorrelatedObservation`` with
``WorkerReceipt``/``JobReceipt``; ``KVTransferObservation`` with the enum
members and ``KVRegionDescriptor``), with the values the host's call sites
pass. ``play(chain)`` emits a chain through the real emit functions
(``replay``); ``observed_at_ns`` is monotonic PER PROCESS (each process has
its own clock base), so timestamps never order records across processes.

Facts the chains rely on (fork.md §4), with the fork file and commit:

- scheduler.py @ 65cc5678b0d5: the scheduler generation is ``secrets.token_hex(16)``
  per connector-scheduler instance, a worker generation the same per worker-connector
  instance (worker.py @ 65cc5678b0d5): 32 lowercase hex. Job ids come from one counter
  per connector, starting at 0, shared by loads and stores. ``recovery_epoch`` is the
  request's ``num_preemptions``. ``compute_kind`` is decided at admission (prefill
  while ``num_computed_tokens < num_prompt_tokens``, else decode).
- Chain order, confirmed by test_observability_recovery.py @ 65cc5678b0d5
  (``test_correlated_recovery_attests_exact_worker_generations``, 2 ranks):
  requeued, submitted, completed, submitted, completed, receipt, admitted,
  first_compute, first_compute. Per epoch: scheduler v1 ``recovery_requeued`` -> v2
  ``recovery_requeued`` (scheduler.py); each rank: v1 ``transfer_descriptors`` (rank
  None; gpu_worker.py @ 115e5f6b0d2c, before the connector's submit) -> v2
  ``restore_submitted`` -> v1 ``transfer_submitted`` (h2d_restore) (worker.py), then in
  ``get_finished`` v1 ``transfer_completed`` -> v2 ``restore_completed``; scheduler,
  after all ranks reported: v1 ``transfer_receipt`` (rank None, h2d_restore, success
  True, ``ranks=sorted(...)``, for every exact load) -> v2 ``transfer_receipt``
  (``workers`` sorted ``WorkerReceipt``s); scheduler: v1 ``recovery_admitted`` -> v2
  ``recovery_admitted`` (roster of ``JobReceipt``s); each rank before the forward: v1
  ``first_compute`` -> v2 ``first_compute`` (one per rank).
- worker.py @ 65cc5678b0d5: v2 ``restore_submitted.block_count`` is
  ``len(dst_spec.block_ids)``; v1 ``transfer_completed`` has ``success=True``,
  ``bytes_moved`` = transfer size, ``duration_ns`` = transfer time; ``shutdown`` emits
  v1 ``transfer_cancelled(reason=HOST_SHUTDOWN)`` for each open load or store.
- gpu_worker.py @ 115e5f6b0d2c: descriptors' region id is the tensor index and offsets
  are relative to the tensor's ``data_ptr()``; at most ``MAX_DESCRIPTOR_REGIONS``.

Stand-in decisions (the facts do not say): the ids, generations, block counts,
sizes and clock bases; job 7 (epoch 1) and job 12 (epoch 2), the jobs in between
being stores and other requests' loads not shown; one descriptor per block (region 0
to region 0, 64 KiB); ranks' records interleaved as in the fork's test (rank 0's
submit and completion, then rank 1's); epoch 1 admitted in prefill, epoch 2 in decode;
a v1 load's ``transfer_submitted.block_count`` equals the v2 one. A chain holds the
records of ONE contract: the host's interleaving of v1 and v2 records (v2 before v1 for
a submit, v1 first elsewhere) is not modelled, as an adapter registers with one.

- ``recovery_chain()``       two ranks, epochs 1 then 2, v2 records.
- ``dropped_stage()``        the canonical chain minus one emission.
- ``duplicated_stage()``     one emission delivered twice (identical record).
- ``restarted_worker_chain()`` rank 1's worker process restarts between the
  epochs: a new worker generation, its clock starts again.
- ``over_cap_admission()``   a recovery_admitted whose roster exceeds
  MAX_CORRELATED_ROSTER (``unchecked``: the host refuses it), and
  ``at_cap_admission()`` exactly at it (valid).
- ``malformed_v2_records()`` individually invalid v2 records (``unchecked``), by name.
- ``v1_recovery_chain()``    the same recovery in v1 records.
- ``v1_shutdown_cancel()``   a v1 store cancelled at shutdown.
- ``unknown_version_module()`` a contract module whose real-named constants name a
  contract/API version no adapter knows.

Every record of the dropped/duplicated/restarted variants is individually
valid: those are chain-level anomalies for the adapter to judge.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import correlated_observability as v2
from . import observability as v1
from .correlated_observability import (
    CorrelatedEvent,
    CorrelatedObservation,
    JobReceipt,
    WorkerReceipt,
)
from .observability import (
    ComputeKind,
    KVRegionDescriptor,
    KVTransferEvent,
    KVTransferObservation,
    RecoveryRequeueReason,
    TransferCancellationReason,
    TransferOperation,
)

SCHEDULER_GENERATION = "5c4e0d1a9b2f4e7c8d6a3b1f0e9c7a52"
WORKER_GENERATIONS = {0: "a0a0b1b1c2c2d3d3e4e4f5f5a6a6b7b7",
                      1: "01234567890abcdef0123456789abcde"}
RESTARTED_WORKER_GENERATION = "ffeeddccbbaa99887766554433221100"
REQUEST_ID = "chatcmpl-7f3a-0001"
JOB_IDS = {1: 7, 2: 12}  # epoch -> load job id (one counter per connector, from 0)
BLOCKS = {1: 16, 2: 24}  # epoch -> restored blocks
BLOCK_BYTES = 65536
RANKS = (0, 1)
COMPUTE_KINDS = {1: "prefill", 2: "decode"}  # epoch -> kind decided at admission


@dataclass(frozen=True)
class Process:
    """One emitting process: ``role`` "scheduler" or "worker" (with ``rank``)."""

    role: str
    rank: int | None
    generation: str  # scheduler or worker generation: one per process here


@dataclass(frozen=True)
class Emission:
    process: Process
    record: Any  # CorrelatedObservation or KVTransferObservation


Chain = tuple[Emission, ...]

SCHEDULER = Process("scheduler", None, SCHEDULER_GENERATION)
WORKERS = {
    0: Process("worker", 0, WORKER_GENERATIONS[0]),
    1: Process("worker", 1, WORKER_GENERATIONS[1]),
}
RESTARTED_WORKER_1 = Process("worker", 1, RESTARTED_WORKER_GENERATION)

# per-process clock bases (ns); unrelated to one another on purpose
_CLOCK_BASE = {SCHEDULER.generation: 1_000_000_000_000,
               WORKERS[0].generation: 52_000_000_000,
               WORKERS[1].generation: 987_000_000_000,
               RESTARTED_WORKER_1.generation: 3_000_000_000}


class _Clocks:
    """Monotonic observed_at_ns per process."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}

    def tick(self, process: Process, step_ns: int = 1_500_000) -> int:
        t = self.now.get(process.generation, _CLOCK_BASE.get(process.generation, 10**9)) + step_ns
        self.now[process.generation] = t
        return t


def records(chain: Chain) -> list[Any]:
    return [e.record for e in chain]


def play(chain: Chain) -> None:
    """Emit every record of ``chain``, in order, through the stand-in's real
    emit functions (``replay``: each at its own ``observed_at_ns``)."""
    for e in chain:
        if isinstance(e.record, KVTransferObservation):
            v1.replay(e.record)
        else:
            v2.replay(e.record)


def _workers(procs: dict[int, Process]) -> tuple[WorkerReceipt, ...]:
    return tuple(sorted(WorkerReceipt(r, procs[r].generation) for r in RANKS))


def recovery_chain(workers: dict[int, Process] | None = None,
                   epoch_workers: dict[int, dict[int, Process]] | None = None) -> Chain:
    """Two-rank recovery, epochs 1 then 2, v2 records in the host's order.

    ``epoch_workers`` overrides the worker processes per epoch (restarts)."""
    clocks = _Clocks()
    out: list[Emission] = []
    E = CorrelatedEvent
    for epoch in (1, 2):
        procs = (epoch_workers or {}).get(epoch) or workers or WORKERS
        job = JOB_IDS[epoch]
        receipt_workers = _workers(procs)
        roster = (JobReceipt(job, receipt_workers),)

        def sched(event: CorrelatedEvent, epoch: int = epoch, **kw: Any) -> Emission:
            return Emission(SCHEDULER, CorrelatedObservation(
                event, SCHEDULER_GENERATION, REQUEST_ID, epoch, clocks.tick(SCHEDULER), **kw))

        def work(event: CorrelatedEvent, rank: int, epoch: int = epoch, procs: Any = procs,
                 **kw: Any) -> Emission:
            p = procs[rank]
            return Emission(p, CorrelatedObservation(
                event, SCHEDULER_GENERATION, REQUEST_ID, epoch, clocks.tick(p),
                rank=rank, worker_generation=p.generation, **kw))

        out.append(sched(E.RECOVERY_REQUEUED))
        for r in RANKS:
            out.append(work(E.RESTORE_SUBMITTED, r, job_id=job, block_count=BLOCKS[epoch]))
            out.append(work(E.RESTORE_COMPLETED, r, job_id=job))
        out.append(sched(E.TRANSFER_RECEIPT, job_id=job, workers=receipt_workers))
        out.append(sched(E.RECOVERY_ADMITTED, roster=roster))
        for r in RANKS:
            out.append(work(E.FIRST_COMPUTE, r, roster=roster,
                            compute_kind=COMPUTE_KINDS[epoch]))
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
    """A recovery_admitted naming ``n_jobs`` jobs (0, 1, ...), one worker each,
    so the roster's worker total stays at ``n_jobs``."""
    worker = (WorkerReceipt(0, WORKER_GENERATIONS[0]),)
    roster = tuple(JobReceipt(job, worker) for job in range(n_jobs))
    return v2.unchecked(event=CorrelatedEvent.RECOVERY_ADMITTED,
                        scheduler_generation=SCHEDULER_GENERATION, request_id=REQUEST_ID,
                        recovery_epoch=1, observed_at_ns=1_000_000_000_123, roster=roster)


def at_cap_admission() -> CorrelatedObservation:
    """Exactly MAX_CORRELATED_ROSTER jobs (and workers): the host accepts it."""
    rec = _admission(v2.MAX_CORRELATED_ROSTER)
    v2.validate_correlated_observation(rec)
    return rec


def over_cap_admission() -> CorrelatedObservation:
    """One job over MAX_CORRELATED_ROSTER: ``unchecked``, the host refuses it."""
    return _admission(v2.MAX_CORRELATED_ROSTER + 1)


def over_cap_receipt() -> CorrelatedObservation:
    """A receipt with MAX_CORRELATED_ROSTER + 1 workers: ``unchecked``."""
    gen = WORKER_GENERATIONS[0]
    return v2.unchecked(
        event=CorrelatedEvent.TRANSFER_RECEIPT, scheduler_generation=SCHEDULER_GENERATION,
        request_id=REQUEST_ID, recovery_epoch=1, observed_at_ns=1_000_000_000_123,
        job_id=JOB_IDS[1],
        workers=tuple(WorkerReceipt(r, gen) for r in range(v2.MAX_CORRELATED_ROSTER + 1)))


def _canonical(event: str, epoch: int = 1, rank: int | None = None) -> CorrelatedObservation:
    chain = recovery_chain()
    return chain[_find(chain, event, epoch, rank)].record


def malformed_v2_records() -> dict[str, CorrelatedObservation]:
    """name -> a record (``unchecked``) the host's v2 constructor refuses."""

    def rep(record: CorrelatedObservation, **changes: Any) -> CorrelatedObservation:
        return v2.unchecked(**{**v2.fields_of(record), **changes})

    sub = _canonical("restore_submitted", rank=0)
    done = _canonical("restore_completed", rank=1)
    receipt = _canonical("transfer_receipt")
    admitted = _canonical("recovery_admitted")
    first = _canonical("first_compute", rank=1)
    requeued = _canonical("recovery_requeued")
    w0, w1 = receipt.workers
    g0, g1 = w0.worker_generation, w1.worker_generation
    jobs = admitted.roster[0]
    later = JobReceipt(JOB_IDS[2], (w0, w1))
    # two jobs of 2049 workers each: each job valid, 4098 workers in all
    half = tuple(WorkerReceipt(r, g0) for r in range(v2.MAX_CORRELATED_ROSTER // 2 + 1))
    return {
        "unknown_event": rep(requeued, event="restore_started"),
        "event_plain_str": rep(requeued, event="recovery_requeued"),
        "event_v1_enum": rep(requeued, event=KVTransferEvent.RECOVERY_REQUEUED),
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
        "epoch_over_uint64": rep(requeued, recovery_epoch=2**64),
        "observed_at_negative": rep(requeued, observed_at_ns=-5),
        "requeued_with_job": rep(requeued, job_id=JOB_IDS[1]),
        "submitted_missing_job": rep(sub, job_id=None),
        "submitted_missing_rank": rep(sub, rank=None),
        "submitted_missing_worker_generation": rep(sub, worker_generation=None),
        "submitted_missing_blocks": rep(sub, block_count=None),
        "submitted_zero_blocks": rep(sub, block_count=0),
        "submitted_blocks_over_uint32": rep(sub, block_count=2**32),
        "submitted_rank_over_uint32": rep(sub, rank=2**32),
        "completed_missing_worker_generation": rep(done, worker_generation=None),
        "completed_with_blocks": rep(done, block_count=BLOCKS[1]),
        "receipt_missing_workers": rep(receipt, workers=()),
        "receipt_workers_none": rep(receipt, workers=None),
        "receipt_missing_job": rep(receipt, job_id=None),
        "receipt_with_rank": rep(receipt, rank=0),
        "receipt_workers_unsorted": rep(receipt, workers=(w1, w0)),
        "receipt_workers_duplicate": rep(receipt, workers=(w0, w0)),
        "receipt_two_entries_one_rank": rep(
            receipt, workers=tuple(sorted((WorkerReceipt(0, g0), WorkerReceipt(0, g1))))),
        "receipt_workers_plain_tuples": rep(receipt, workers=((0, g0), (1, g1))),
        "receipt_workers_list": rep(receipt, workers=[w0, w1]),
        "receipt_workers_over_cap": over_cap_receipt(),
        "admitted_missing_roster": rep(admitted, roster=()),
        "admitted_roster_unsorted": rep(admitted, roster=(later, jobs)),
        "admitted_roster_duplicate_job": rep(admitted, roster=(jobs, jobs)),
        "admitted_roster_plain_tuples": rep(admitted, roster=((JOB_IDS[1], (w0, w1)),)),
        "admitted_roster_job_ids_not_receipts": rep(admitted, roster=(JOB_IDS[1],)),
        "admitted_roster_over_cap": over_cap_admission(),
        "admitted_roster_workers_over_cap": rep(
            admitted, roster=(JobReceipt(JOB_IDS[1], half), JobReceipt(JOB_IDS[2], half))),
        "first_compute_missing_kind": rep(first, compute_kind=None),
        "first_compute_unknown_kind": rep(first, compute_kind="verify"),
        "first_compute_missing_roster": rep(first, roster=()),
        "first_compute_missing_rank": rep(first, rank=None),
        "first_compute_with_job": rep(first, job_id=JOB_IDS[1]),
    }


# ---------------------------------------------------------------- v1


def _descriptors(blocks: int) -> tuple[KVRegionDescriptor, ...]:
    # CPU block i of the restore lands in GPU block 100 + i (stand-in layout)
    return tuple(KVRegionDescriptor(0, 0, i * BLOCK_BYTES, (100 + i) * BLOCK_BYTES,
                                    BLOCK_BYTES) for i in range(blocks))


def v1_recovery_chain(workers: dict[int, Process] | None = None) -> Chain:
    """The same two-epoch recovery in contract v1 records, in the host's order.

    v1's limits: scheduler records (recovery_requeued, transfer_receipt,
    recovery_admitted) carry no rank and no generation; ranks appear only as
    the receipt's sorted list; transfer_descriptors has no request id and
    rank None and comes before its rank's submit; job ids restart per
    connector instance (nothing in a record says which instance)."""
    procs = workers or WORKERS
    clocks = _Clocks()
    out: list[Emission] = []
    K, E, OP = KVTransferObservation, KVTransferEvent, TransferOperation.H2D_RESTORE
    for epoch in (1, 2):
        job = JOB_IDS[epoch]
        blocks = BLOCKS[epoch]
        out.append(Emission(SCHEDULER, K(
            E.RECOVERY_REQUEUED, clocks.tick(SCHEDULER), request_id=REQUEST_ID,
            recovery_epoch=epoch, requeue_reason=RecoveryRequeueReason.UNCLASSIFIED)))
        for r in RANKS:
            p = procs[r]
            out.append(Emission(p, K(E.TRANSFER_DESCRIPTORS, clocks.tick(p), operation=OP,
                                     job_id=job, rank=None, descriptors=_descriptors(blocks))))
            out.append(Emission(p, K(E.TRANSFER_SUBMITTED, clocks.tick(p), operation=OP,
                                     job_id=job, rank=r, request_id=REQUEST_ID,
                                     block_count=blocks)))
            out.append(Emission(p, K(E.TRANSFER_COMPLETED, clocks.tick(p, 4_000_000),
                                     operation=OP, job_id=job, rank=r, request_id=REQUEST_ID,
                                     success=True, bytes_moved=blocks * BLOCK_BYTES,
                                     duration_ns=3_900_000)))
        out.append(Emission(SCHEDULER, K(
            E.TRANSFER_RECEIPT, clocks.tick(SCHEDULER), operation=OP, job_id=job, rank=None,
            request_id=REQUEST_ID, success=True, ranks=sorted(RANKS))))
        out.append(Emission(SCHEDULER, K(
            E.RECOVERY_ADMITTED, clocks.tick(SCHEDULER), request_id=REQUEST_ID,
            recovery_epoch=epoch, job_ids=(job,))))
        for r in RANKS:
            p = procs[r]
            out.append(Emission(p, K(E.FIRST_COMPUTE, clocks.tick(p), request_id=REQUEST_ID,
                                     recovery_epoch=epoch, job_ids=(job,),
                                     compute_kind=ComputeKind(COMPUTE_KINDS[epoch]), rank=r)))
    return tuple(out)


def v1_shutdown_cancel(rank: int = 0, job_id: int = 31) -> Emission:
    """A still-open store cancelled at shutdown (the only v1 reason)."""
    p = WORKERS[rank]
    return Emission(p, KVTransferObservation(
        KVTransferEvent.TRANSFER_CANCELLED, 60_000_000_000,
        operation=TransferOperation.D2H_PRESERVE, job_id=job_id, rank=rank,
        request_id=REQUEST_ID, reason=TransferCancellationReason.HOST_SHUTDOWN))


# ---------------------------------------------------------------- versions


def unknown_version_module(base: types.ModuleType = v2,
                           contract: str = "vllm.kv-transfer.observer.v3",
                           api_version: str = "3.0") -> types.ModuleType:
    """A module object shaped like ``base`` (same functions and record types)
    whose contract constants, under the fork's names for ``base``
    (``KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT``/``..._API_VERSION`` for v2,
    ``KV_TRANSFER_OBSERVER_CONTRACT``/``..._API_VERSION`` for v1), and the handles
    it returns, claim another contract/API version: what an adapter must refuse
    (fail closed) on import."""
    correlated = hasattr(base, "register_correlated_observer")
    if correlated:
        names = ("KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT",
                 "KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION")
        handle_type: Any = v2.CorrelatedObserverHandle
        reg_name, unreg_name = "register_correlated_observer", "unregister_correlated_observer"
    else:
        names = ("KV_TRANSFER_OBSERVER_CONTRACT", "KV_TRANSFER_OBSERVABILITY_API_VERSION")
        handle_type = v1.KVTransferObserverHandle
        reg_name, unreg_name = "register_kv_transfer_observer", "unregister_kv_transfer_observer"
    base_contract = getattr(base, names[0])
    mod = types.ModuleType(f"{base.__name__}_{contract.rsplit('.', 1)[-1]}_{api_version}",
                           f"STAND-IN module claiming {contract} / {api_version}")
    for name in dir(base):
        if not name.startswith("__"):
            setattr(mod, name, getattr(base, name))
    setattr(mod, names[0], contract)
    setattr(mod, names[1], api_version)
    register: Callable[..., Any] = getattr(base, reg_name)
    unregister: Callable[[Any], None] = getattr(base, unreg_name)

    def reg(*args: Any) -> Any:
        return handle_type(contract, register(*args).token)

    def unreg(handle: Any) -> None:
        if handle.contract != contract:
            raise ValueError("observer handle has the wrong contract")
        unregister(handle_type(base_contract, handle.token))

    setattr(mod, reg_name, reg)
    setattr(mod, unreg_name, unreg)
    return mod
