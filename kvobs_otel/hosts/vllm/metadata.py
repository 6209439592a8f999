"""Extensions of vLLM's own step metadata (never a side channel).

scheduler -> workers: an attribute ``kvobs_step`` on the
``OffloadingConnectorMetadata`` object, pickled with it to every worker:
``(scheduler_generation, {req_id: epoch}, {req_id: (epoch, compute_kind)},
load_rows, store_rows, flushed_job_ids)`` - the episodes this step touches,
the requests admitted this step, and the rows every rank needs of the step's
jobs (the scheduler's own S_STEP rows, lifecycle/events.py: built once for
all ranks). Set only on a step with some of these; the others read the class
default, None (instrumentor.py), and pickle as vLLM's own.

workers -> scheduler: an attribute ``kvobs_receipts`` = ``(reporters,
computed)`` on the worker metadata: who reported, ``reporters`` = ((rank,
worker_generation, job_ids, failed_job_ids), ...) where the ids are vLLM's own
``completed_jobs`` dict and ``failed_jobs`` set of that object (pickled once
with it, our reference costs a memo entry), and the first computes,
``computed`` = ((rank, worker_generation, req_id, epoch), ...).

- A step vLLM reports completed jobs in: the attribute is set on vLLM's own
  ``OffloadingWorkerMetadata`` object (vLLM's worker hands it over and starts
  a fresh one), which then pickles exactly as vLLM's does, plus one small
  tuple. vLLM's fields are never touched: the scheduler reads what it would
  read without kvobs-otel.
- A step with first computes and nothing of vLLM's (vLLM returns None):
  ``ReceiptWorkerMetadata``, vLLM's class with every field at vLLM's
  default ("nothing completed"; the empty transfer stats one shared object,
  which vLLM only reads), pickled as the receipts alone (vLLM's default
  pickle of its empty transfer stats costs several times more, on the
  serving thread of both ends).
- vLLM's ``aggregate()`` builds its merged object from its own fields:
  ``merged`` joins the ranks' receipts onto it (instrumentor.py wraps it).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)

STEP_ATTR = "kvobs_step"
RECEIPTS_ATTR = "kvobs_receipts"

Receipts = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]


# vLLM's default transfer stats, made once by vLLM's own factory: a
# ReceiptWorkerMetadata shares it (vLLM only reads it from a received object:
# offloading/scheduler.py _update_connector_output; building one is two
# dataclasses per object, at both ends).
_EMPTY_STATS = OffloadingWorkerMetadata().transfer_stats
_HAS_FAILED_JOBS = "failed_jobs" in {f.name for f in fields(OffloadingWorkerMetadata)}


class ReceiptWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata with every field vLLM defines at its default
    ("nothing completed"), carrying first computes on a step vLLM had
    nothing to report."""

    transfer_stats = _EMPTY_STATS

    def __init__(self, receipts: Receipts) -> None:  # (vLLM's defaults, cheaper)
        self.completed_jobs: dict[int, int] = {}
        if _HAS_FAILED_JOBS:
            self.failed_jobs: set[int] = set()
        self.kvobs_receipts = receipts

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReceiptWorkerMetadata, (self.kvobs_receipts,))


def attach(meta: Any, reporters: tuple[Any, ...], computed: tuple[Any, ...]) -> Any:
    """vLLM's worker metadata ``meta`` with who reported attached; ``meta``
    None: a ``ReceiptWorkerMetadata``."""
    if meta is None:
        return ReceiptWorkerMetadata((reporters, computed))
    meta.kvobs_receipts = (reporters, computed)
    return meta


def merged(mine: Receipts | None, theirs: Receipts | None) -> Receipts | None:
    """Two metadata objects' receipts as one (either may have none)."""
    if mine is None or theirs is None:
        return theirs if mine is None else mine
    return (mine[0] + theirs[0], mine[1] + theirs[1])
