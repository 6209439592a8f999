"""Extensions of vLLM's own step metadata (never a side channel).

scheduler -> workers: an attribute ``kvobs_step`` on the
``OffloadingConnectorMetadata`` object, pickled with it to every worker:
``(scheduler_generation, {req_id: epoch}, {req_id: (epoch, compute_kind)})``
- the episodes this step touches and the requests admitted this step.

workers -> scheduler: ``ReceiptWorkerMetadata``, a subclass of
``OffloadingWorkerMetadata`` that adds who reported: ``reporters`` =
((rank, worker_generation, (job_id, ...)), ...) and ``computed`` =
((rank, worker_generation, req_id, epoch), ...). vLLM's ``completed_jobs``
counts and their summing in ``aggregate()`` are left exactly as they are.
It pickles as ``_rebuild`` and a tuple of its four fields (``__reduce__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
    TransferStats,
)

STEP_ATTR = "kvobs_step"


@dataclass
class ReceiptWorkerMetadata(OffloadingWorkerMetadata):
    reporters: tuple[tuple[int, str, tuple[int, ...]], ...] = ()
    computed: tuple[tuple[int, str, str, int], ...] = ()

    def aggregate(self, other: Any) -> Any:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        return ReceiptWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            reporters=self.reporters + getattr(other, "reporters", ()),
            computed=self.computed + getattr(other, "computed", ()),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Every rank pickles one of these per step that finished a transfer or
        # a first compute, and the scheduler unpickles them all. The default
        # form (the class, a dict of field names, and the classes of the
        # transfer stats, each looked up by import on both sides) cost the
        # serving thread more than everything else kvobs-otel does per step;
        # this one is a function and a tuple, and empty stats travel as None.
        stats = self.transfer_stats
        return (_rebuild, (self.completed_jobs, None if stats.is_empty() else stats,
                           self.reporters, self.computed))


def _rebuild(completed_jobs: dict[int, int], stats: TransferStats | None,
             reporters: tuple[Any, ...], computed: tuple[Any, ...]) -> ReceiptWorkerMetadata:
    return ReceiptWorkerMetadata(completed_jobs, stats if stats is not None else TransferStats(),
                                 reporters, computed)
