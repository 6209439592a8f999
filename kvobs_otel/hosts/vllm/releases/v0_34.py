"""vLLM 0.34: the offloading worker takes resolved device pointers instead of
the GPU spec (``submit_store(job_id, device_ptrs, dst_spec)``,
``submit_load(job_id, src_spec, device_ptrs, expedited)``), and transfer
failures are reported instead of asserted away: ``failed_jobs`` in the worker
metadata, ``failed_recving`` for loads, then ``kv_load_failure_policy``. Only
the V2 model runner (V1 and ``kv_connector_model_runner_mixin`` are gone)."""

from __future__ import annotations

from operator import attrgetter

from kvobs_otel.hosts.vllm.releases import v0_33
from kvobs_otel.hosts.vllm.releases.shape import COMMON, OFFLOAD_BASE, Release

METHODS = {
    **v0_33.METHODS,
    f"{OFFLOAD_BASE}:OffloadingWorker.submit_store": ("self", "job_id", "device_ptrs",
                                                      "dst_spec"),
    f"{OFFLOAD_BASE}:OffloadingWorker.submit_load": ("self", "job_id", "src_spec",
                                                     "device_ptrs", "expedited"),
}
FIELDS = {
    **v0_33.FIELDS,
    f"{COMMON}:OffloadingWorkerMetadata": ("completed_jobs", "failed_jobs"),
}


# vLLM's own set (a C-level read: no Python frame per worker metadata).
failed_jobs = attrgetter("failed_jobs")


RELEASE = Release(
    series=(0, 34), tested="0.34.0", methods=METHODS, dataclass_fields=FIELDS,
    load_row=v0_33.load_row, failed_jobs=failed_jobs, runners=("v2",),
    tier_methods=v0_33.TIER_METHODS, tier_fields=v0_33.TIER_FIELDS,
    multi_methods=v0_33.MULTI_METHODS,
    notes=("failed transfers, failed restores (kv_load_failure_policy) and failed stores "
           "are traced",),
)
