"""Extensions of vLLM's own step metadata (never a side channel).

scheduler -> workers: an attribute ``kvobs_step`` on the
``OffloadingConnectorMetadata`` object, pickled with it to every worker:
``(scheduler_generation, {req_id: epoch}, {req_id: (epoch, compute_kind)},
load_rows, store_rows, flushed_job_ids)`` - the episodes this step touches,
the requests admitted this step, and the rows every rank needs of the step's
jobs (``(job_id, req_id, device_blocks)``, built once by the scheduler). None
on a step with none of these; set on every step (the class has a default of
None while patched), so the objects keep one attribute layout.

workers -> scheduler: ``ReceiptWorkerMetadata``, a subclass of
``OffloadingWorkerMetadata`` that adds who reported: ``reporters`` =
((rank, worker_generation, (job_id, ...), (failed_job_id, ...)), ...) and
``computed`` = ((rank, worker_generation, req_id, epoch), ...).

Every field vLLM defines (``completed_jobs``, ``transfer_stats``, and from 0.34
``failed_jobs``; whatever the installed version has) is carried by name, never
by position, and merged by vLLM's own ``aggregate()``: the scheduler reads
exactly what it would read without kvobs-otel. It pickles as ``_rebuild`` and
a tuple: vLLM's field values in the installed class's field order (the same
vLLM on both ends of the pipe), then ours.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)

STEP_ATTR = "kvobs_step"

# vLLM's fields, read from the installed class: a field a release adds is
# carried without a change here.
VLLM_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(OffloadingWorkerMetadata))
# Fields whose empty value travels as None and is rebuilt from the field's
# default (TransferStats: its classes would be looked up by import on both
# ends of every pickle).
_DEFAULTS = {f.name: f.default_factory for f in fields(OffloadingWorkerMetadata)
             if f.default_factory is not MISSING}


@dataclass
class ReceiptWorkerMetadata(OffloadingWorkerMetadata):
    reporters: tuple[tuple[int, str, tuple[int, ...], tuple[int, ...]], ...] = ()
    computed: tuple[tuple[int, str, str, int], ...] = ()

    def aggregate(self, other: Any) -> Any:
        # vLLM merges its own fields (sums counts, unions failures, adds stats).
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        # vLLM's fresh object, held by no one else: ours by a change of class
        # (every field it has stays as vLLM set it).
        merged.__class__ = ReceiptWorkerMetadata
        merged.reporters = self.reporters + getattr(other, "reporters", ())
        merged.computed = self.computed + getattr(other, "computed", ())
        return merged

    def __reduce__(self) -> tuple[Any, ...]:
        # Every rank pickles one of these per step that finished a transfer or
        # a first compute, and the scheduler unpickles them all: a function
        # and a tuple, not the dataclass's default form (the class, a dict of
        # field names, and the stats classes looked up by import on both ends).
        values = []
        for name in VLLM_FIELDS:
            value = getattr(self, name)
            empty = getattr(value, "is_empty", None)
            values.append(None if empty is not None and name in _DEFAULTS and empty() else value)
        return (_rebuild, (tuple(values), self.reporters, self.computed))


def extend(meta: Any, reporters: tuple[Any, ...], computed: tuple[Any, ...]
           ) -> ReceiptWorkerMetadata:
    """vLLM's worker metadata ``meta`` (any version), every field by name, plus
    who reported. ``meta`` None: vLLM had nothing to report this step."""
    if meta is None:
        return ReceiptWorkerMetadata(reporters=reporters, computed=computed)
    # A copy of vLLM's object (never changed: vLLM may still hold it), every
    # attribute as vLLM set it; no __init__ (it runs per rank and step).
    out = ReceiptWorkerMetadata.__new__(ReceiptWorkerMetadata)
    out.__dict__.update(meta.__dict__)
    out.reporters, out.computed = reporters, computed
    return out


def _rebuild(values: tuple[Any, ...], reporters: tuple[Any, ...],
             computed: tuple[Any, ...]) -> ReceiptWorkerMetadata:
    out = ReceiptWorkerMetadata.__new__(ReceiptWorkerMetadata)
    d = out.__dict__
    for name, value in zip(VLLM_FIELDS, values, strict=True):
        d[name] = _DEFAULTS[name]() if value is None and name in _DEFAULTS else value
    d["reporters"], d["computed"] = reporters, computed
    return out
