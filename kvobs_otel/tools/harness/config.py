"""Build a real vLLM ``VllmConfig`` and KV cache layout for the CPU harness.

Everything here mirrors what vLLM's engine core does at start-up
(``EngineCore._initialize_kv_caches``), minus the model: the per-layer KV cache
specs are the ones a Llama attention layer would report, and the real
``get_kv_cache_configs`` / ``generate_scheduler_kv_cache_config`` turn them into
the scheduler's and every worker's ``KVCacheConfig``.

vLLM is imported lazily inside the functions: process-mode ranks must apply
their environment before the first vLLM import (plugins read it then).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvobs_otel.tools.harness import compat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

# The spec class the harness plugs into the stock OffloadingConnector.
HARNESS_SPEC_NAME = "HarnessCPUOffloadingSpec"
HARNESS_SPEC_MODULE = "kvobs_otel.tools.harness.cpu_backend"
# The same copy engine under vLLM's TieringOffloadingSpec (secondary tiers).
TIERING_SPEC_NAME = "HarnessTieringOffloadingSpec"

# The CPU attention backend only reads head-major block interiors (LBHNC), and
# LBHNC is also what OffloadingConnector asks for: both agree, so use it.
KV_CACHE_LAYOUT = "LBHNC"

# kv_connector_extra_config keys read by the harness' CPU backend.
STALL_KEY = "harness_stall"
FAIL_KEY = "harness_fail"
RECORD_KEY = "harness_record_transfers"
COPY_DELAY_KEY = "harness_copy_s"


@dataclass(frozen=True)
class TinyLlama:
    """Shape of the fake model: only the KV cache geometry matters."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 256
    max_position_embeddings: int = 2048
    dtype: str = "float16"

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_names(self) -> list[str]:
        # The names vLLM's Llama gives its attention layers.
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]

    def hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": 2 * self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "num_hidden_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "torch_dtype": self.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        }


@dataclass
class EngineShape:
    """Knobs of the engine the harness builds (kept small for 2 cores)."""

    num_ranks: int = 1
    num_gpu_blocks: int = 24
    block_size: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    max_model_len: int = 256
    async_scheduling: bool = False
    connector: str = "OffloadingConnector"
    connector_module_path: str | None = None
    # CPU tier size in offload chunks (one chunk = one GPU block here).
    num_cpu_chunks: int = 256
    # Merged over the harness defaults (spec_name, spec_module_path, ...).
    extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str = "kvobs-harness"
    model: TinyLlama = field(default_factory=TinyLlama)
    # "v1" | "v2": the runner the ranks emulate (the config is validated for it).
    model_runner: str = "v2"
    # KVTransferConfig.kv_load_failure_policy ("fail" | "recompute"); None
    # keeps vLLM's default.
    kv_load_failure_policy: str | None = None
    # vLLM's MultiConnector: its children in order, OFFLOADING standing for
    # the OffloadingConnector above, the others KVTransferConfig dicts.
    multi: tuple[Any, ...] | None = None


# In EngineShape.multi / HarnessConfig.multi: where the OffloadingConnector goes.
OFFLOADING = "offloading"


def offloading_part(obj: Any) -> Any:
    """The OffloadingConnector inside vLLM's MultiConnector (its children:
    ``_connectors``), or its metadata inside a MultiKVConnectorMetadata (one
    per child: ``metadata``), nested or not; ``obj`` itself when it is one
    (None when there is none)."""
    if obj is None or hasattr(obj, "load_jobs"):  # every step's metadata: no import
        return obj
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    if isinstance(obj, OffloadingConnector):
        return obj
    for part in getattr(obj, "_connectors", None) or getattr(obj, "metadata", None) or ():
        found = offloading_part(part)
        if found is not None:
            return found
    return None


def write_tiny_model_dir(directory: str, model: TinyLlama) -> str:
    """Write the ``config.json`` a ``ModelConfig`` needs; nothing is downloaded."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.hf_config(), f, indent=1)
    return directory


def worker_page_size_bytes(shape: EngineShape) -> int:
    """Bytes one rank holds per GPU block across all layers (K and V)."""
    m = shape.model
    dtype_size = 2 if m.dtype in ("float16", "bfloat16") else 4
    kv_heads_per_rank = max(1, m.num_kv_heads // shape.num_ranks)
    per_layer = shape.block_size * kv_heads_per_rank * 2 * m.head_size * dtype_size
    return per_layer * m.num_layers


def build_vllm_config(model_dir: str, shape: EngineShape) -> VllmConfig:
    """The engine-core ``VllmConfig`` (rank 0 view) for ``shape``."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=shape.model.dtype,
        max_model_len=shape.max_model_len,
        seed=0,
    )
    cache_config = CacheConfig(
        block_size=shape.block_size,
        enable_prefix_caching=True,
        num_gpu_blocks_override=shape.num_gpu_blocks,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=shape.max_model_len,
        is_encoder_decoder=False,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        async_scheduling=shape.async_scheduling,
    )
    # world_size == tensor_parallel_size is what the offloading scheduler uses
    # as the number of worker reports each job needs.
    parallel_config = ParallelConfig(
        tensor_parallel_size=shape.num_ranks,
        distributed_executor_backend="mp" if shape.num_ranks > 1 else "uni",
    )
    # One CPU chunk per GPU block: size the tier by chunks, with the 4 KiB
    # alignment CPUOffloadingSpec rounds every chunk up to.
    chunk_bytes = worker_page_size_bytes(shape) * shape.num_ranks
    aligned_chunk = -(-chunk_bytes // 4096) * 4096
    extra: dict[str, Any] = {
        "spec_name": HARNESS_SPEC_NAME,
        "spec_module_path": HARNESS_SPEC_MODULE,
        "cpu_bytes_to_use": aligned_chunk * shape.num_cpu_chunks,
    }
    extra.update(shape.extra_config)
    policy: dict[str, Any] = {}
    if shape.kv_load_failure_policy is not None:
        policy["kv_load_failure_policy"] = shape.kv_load_failure_policy
    offloading: dict[str, Any] = dict(
        kv_connector=shape.connector,
        kv_connector_module_path=shape.connector_module_path,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_buffer_device="cpu",
    )
    if shape.multi:
        # As a user composes it (multi_connector.py builds each child's
        # KVTransferConfig from its dict, with the parent's engine id).
        children = [offloading if c == OFFLOADING else dict(c) for c in shape.multi]
        offloading = dict(kv_connector="MultiConnector", kv_role="kv_both",
                          kv_connector_extra_config={"connectors": children},
                          kv_buffer_device="cpu")
    kv_transfer_config = KVTransferConfig(**offloading, engine_id=shape.engine_id, **policy)
    with compat.v2_config_validation(shape.model_runner):
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=kv_transfer_config,
        )
    compat.keep_async_scheduling(vllm_config, shape.async_scheduling)
    return vllm_config


def kv_cache_spec_for_rank(vllm_config: VllmConfig, model: TinyLlama) -> dict[str, KVCacheSpec]:
    """What ``Attention.get_kv_cache_spec`` reports on one TP rank."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    tp = vllm_config.parallel_config.tensor_parallel_size
    dtype = getattr(torch, model.dtype)
    return {
        name: FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=max(1, model.num_kv_heads // tp),
            head_size=model.head_size,
            dtype=dtype,
        )
        for name in model.layer_names()
    }


def build_kv_cache_configs(
    vllm_config: VllmConfig, model: TinyLlama
) -> tuple[KVCacheConfig, list[KVCacheConfig], tuple[int, int]]:
    """Mirror ``EngineCore._initialize_kv_caches`` for a model-less engine.

    Returns the scheduler's KVCacheConfig, one per rank, and the
    ``(scheduler_block_size, hash_block_size)`` the Scheduler is built with.
    Mutates ``vllm_config`` the way the engine core does (layout, block counts).
    """
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import (
        register_all_kvcache_specs,
    )

    register_all_kvcache_specs(vllm_config)
    world_size = vllm_config.parallel_config.world_size
    kv_cache_specs = [kv_cache_spec_for_rank(vllm_config, model)] * world_size
    resolve_kv_cache_layout(
        vllm_config,
        [[KV_CACHE_LAYOUT]] * world_size,
        [s for specs in kv_cache_specs for s in specs.values()],
    )
    # num_gpu_blocks_override decides the block count; the "available memory"
    # only has to be large enough not to trip the capacity check.
    available = [1 << 34] * world_size
    kv_cache_configs = compat.get_kv_cache_configs(vllm_config, kv_cache_specs, available)
    for kv_cache_config in kv_cache_configs:
        kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_kv = generate_scheduler_kv_cache_config(kv_cache_configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler_kv.num_blocks
    vllm_config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in scheduler_kv.kv_cache_groups
    )
    update_kv_cache_capacity(vllm_config, scheduler_kv)
    vllm_config.validate_block_size()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_kv, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(
        scheduler_kv, vllm_config, block_size, hash_block_size
    )
    for kv_cache_config in (*kv_cache_configs, scheduler_kv):
        kv_cache_config.hash_block_size = hash_block_size
        kv_cache_config.cache_hit_alignment_tokens = alignment
    return scheduler_kv, kv_cache_configs, (block_size, hash_block_size)


def worker_vllm_config(vllm_config: VllmConfig, rank: int) -> VllmConfig:
    """The config one worker sees: a private copy carrying its own rank.

    Workers take their rank from ``parallel_config.rank`` (vLLM's
    ``WorkerBase`` sets it), never from torch.distributed.
    """
    cfg = copy.deepcopy(vllm_config)
    cfg.parallel_config.rank = rank
    return cfg
