"""vLLM 0.33: sync loads (``TransferJob.sync``, ``submit_load(expedited=)``),
both model runners (V2 the default). Transfer failures are asserted away by
vLLM itself, so none is ever reported."""

from __future__ import annotations

from typing import Any

from kvobs_otel.hosts.vllm.releases.shape import (
    BASE_CONNECTOR,
    COMMON,
    CONNECTOR,
    CONNECTOR_WORKER,
    MULTI,
    OFFLOAD_BASE,
    SCHEDULER,
    TIERING,
    Release,
    blocks,
)

# What every seam wraps or reads; the other releases state how they differ.
METHODS: dict[str, tuple[str, ...]] = {
    f"{CONNECTOR}.__init__": ("self", "vllm_config", "role", "kv_cache_config"),
    f"{CONNECTOR}.on_new_request": ("self", "request"),
    f"{CONNECTOR}.get_num_new_matched_tokens": ("self", "request", "num_computed_tokens"),
    f"{CONNECTOR}.update_state_after_alloc": ("self", "request", "blocks",
                                              "num_external_tokens"),
    f"{CONNECTOR}.build_connector_meta": ("self", "scheduler_output"),
    f"{CONNECTOR}.update_connector_output": ("self", "connector_output"),
    f"{CONNECTOR}.request_finished": ("self", "request", "block_ids"),
    f"{CONNECTOR}.request_finished_all_groups": ("self", "request", "block_ids"),
    f"{CONNECTOR}.reset_cache": ("self",),
    f"{CONNECTOR}.build_connector_worker_meta": ("self",),
    f"{CONNECTOR}.register_kv_caches": ("self", "kv_caches"),
    f"{CONNECTOR}.shutdown": ("self",),
    f"{BASE_CONNECTOR}.bind_connector_metadata": ("self", "connector_metadata"),
    f"{CONNECTOR_WORKER}._init_worker": ("self", "kv_caches"),
    f"{OFFLOAD_BASE}:OffloadingWorker.submit_store": ("self", "job_id", "src_spec",
                                                      "dst_spec"),
    f"{OFFLOAD_BASE}:OffloadingWorker.submit_load": ("self", "job_id", "src_spec",
                                                     "dst_spec", "expedited"),
    f"{OFFLOAD_BASE}:OffloadingWorker.get_finished": ("self",),
    # Its merge of the ranks' metadata (the receipts are joined onto it).
    f"{COMMON}:OffloadingWorkerMetadata.aggregate": ("self", "other"),
    # Read the computed tokens a preemption discards before vLLM zeroes them.
    f"{SCHEDULER}._preempt_request": ("self", "request", "timestamp", "drop_stale_output"),
    # A step's output, every rank's: the first computes of its admissions ran.
    f"{SCHEDULER}.update_from_output": ("self", "scheduler_output", "model_runner_output"),
}

FIELDS: dict[str, tuple[str, ...]] = {
    f"{COMMON}:TransferJob": ("req_id", "src_spec", "dst_spec", "sync"),
    f"{COMMON}:OffloadingConnectorMetadata": ("load_jobs", "store_jobs", "jobs_to_flush"),
    f"{COMMON}:OffloadingWorkerMetadata": ("completed_jobs",),
    f"{OFFLOAD_BASE}:TransferResult": ("job_id", "success", "transfer_size", "transfer_time"),
}


# Secondary tiers: vLLM's own tier-job hooks (TieringMetricsTracker) and the
# manager methods the seams wrap or read; the same in 0.32, 0.33 and 0.34 (0.34 adds
# JobResult.deferred_release, read when present).
TIER_METHODS: dict[str, tuple[str, ...]] = {
    f"{TIERING}.metrics:TieringMetricsTracker.on_job_registered": ("self", "job_metadata"),
    f"{TIERING}.metrics:TieringMetricsTracker.on_job_finished": ("self", "job_metadata",
                                                                 "result"),
    # The no-room hook has no arguments: tier_seams.py reads them from its
    # one caller, _initiate_promotion.
    f"{TIERING}.metrics:TieringMetricsTracker.on_promotion_allocation_failure": ("self",),
    f"{TIERING}.manager:TieringOffloadingManager._initiate_promotion": (
        "self", "tier_idx", "key", "req_context"),
    f"{TIERING}.manager:TieringOffloadingManager.complete_store": (
        "self", "keys", "req_context", "success"),
    f"{TIERING}.manager:TieringOffloadingManager."
    "_cascade_existing_chunks_to_request_level_tiers": (
        "self", "keys", "req_context", "request_level_tiers"),
    f"{TIERING}.manager:TieringOffloadingManager._should_store_to_tier": (
        "self", "tier", "num_blocks"),
    f"{TIERING}.manager:TieringOffloadingManager._update_backpressure": (
        "self", "tier", "job_metadata", "completed_job"),
    f"{TIERING}.backpressure:BackpressureDetector.is_under_pressure": ("self",),
    f"{TIERING}.base:SecondaryTierManager.__init__": (
        "self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"),
}
TIER_FIELDS: dict[str, tuple[str, ...]] = {
    f"{TIERING}.base:TransferJob": ("job_id", "keys", "is_promotion", "req_context"),
    f"{TIERING}.base:JobResult": ("job_id", "success", "successful_keys", "transfer_time",
                                  "transfer_bytes"),
}


# MultiConnector (multi_connector.py): the seam reads what every connector
# brought a request (the scheduler's one call) after vLLM shared it out
# among the children (``_connectors``). The same in 0.32, 0.33 and 0.34.
MULTI_METHODS: dict[str, tuple[str, ...]] = {
    f"{MULTI}.update_state_after_alloc": ("self", "request", "blocks", "num_external_tokens"),
}


def load_row(job_id: int, job: Any) -> tuple[Any, ...]:
    return (job_id, job.req_id, job.sync, blocks(job.dst_spec))


RELEASE = Release(
    series=(0, 33), tested="0.33.0", methods=METHODS, dataclass_fields=FIELDS,
    load_row=load_row, runners=("v2", "v1"),
    tier_methods=TIER_METHODS, tier_fields=TIER_FIELDS, multi_methods=MULTI_METHODS,
)
