"""CPU offloading backend for the harness: a stand-in for the GPU copy engine,
which cannot run here.

``HarnessCPUOffloadingSpec`` subclasses vLLM's ``CPUOffloadingSpec`` so the
scheduler side (its real ``CPUOffloadingManager``, chunk sizing, eviction
policy) is untouched. Only ``get_worker`` differs: instead of the CUDA/XPU
``CPUOffloadingWorker`` it returns ``HarnessCPUOffloadingWorker``, which really
copies the blocks between the registered "device" KV tensors (plain CPU
tensors here) and a host tensor pool it allocates, with the same block/chunk
addressing as ``vllm/v1/kv_offload/cpu/gpu_worker.py`` (direct layout):

* ``GPULoadStoreSpec.block_ids`` are device block ids, split per KV cache
  group by ``group_sizes``; ``block_indices[g]`` is the logical index of the
  group's first block inside the request, so a transfer may start in the
  middle of its first host chunk (``block_indices[g] % blocks_per_chunk``).
* ``CPULoadStoreSpec.block_ids`` are host chunk ids; chunk ``c`` holds
  ``blocks_per_chunk`` device-sized sub-blocks.
* For every group, every data ref of the group copies its un-padded page
  bytes for each block. ``transfer_size`` is the number of bytes copied and
  ``transfer_time`` the wall time measured around the copy.

Async semantics: the copy happens at submit time; the job's completion is
reported by the next ``get_finished()`` call (the GPU worker reports it once
its CUDA event fired). ``wait(job_ids)`` therefore has nothing left to do.

Fault injection (tests), set in ``kv_connector_extra_config``::

    "harness_stall": {"rank": 1, "kind": "load"}

makes the worker of rank 1 withhold the completions of its load jobs forever
(``kind`` is ``"load"``, ``"store"`` or ``"any"``; ``rank`` may be a list):
the copy still happens, but the job is never reported, as if the copy hung
on that rank. The scheduler's job then stays pending (pending_count > 0).

Test hook: with ``"harness_record_transfers": true`` the worker keeps, per
job, the host chunk slots and device blocks it touched and a clone of the
bytes it copied (``transfer_log``), so tests can compare stored and loaded
bytes.

The scheduler side never needs a torch.distributed group: the shared-memory
region (and its barrier) of the real spec is disabled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvobs_otel.harness.config import RECORD_KEY, STALL_KEY


@dataclass
class StallRule:
    """Which of this rank's completions to withhold."""

    kinds: frozenset[str]

    def withholds(self, kind: str) -> bool:
        return "any" in self.kinds or kind in self.kinds


def parse_stall(extra_config: dict[str, Any], rank: int) -> StallRule | None:
    """The stall rule that applies to ``rank``, if any."""
    raw = extra_config.get(STALL_KEY)
    if not raw:
        return None
    ranks = raw.get("rank", 0)
    ranks = set(ranks) if isinstance(ranks, (list, tuple, set)) else {ranks}
    if rank not in ranks:
        return None
    kind = raw.get("kind", "load")
    kinds = frozenset(kind) if isinstance(kind, (list, tuple, set)) else {kind}
    unknown = set(kinds) - {"load", "store", "any"}
    if unknown:
        raise ValueError(f"unknown {STALL_KEY} kind(s): {sorted(unknown)}")
    return StallRule(frozenset(kinds))


@dataclass
class CopySegment:
    """One data ref's part of a transfer: rows copied between the pools."""

    tensor_idx: int
    # Flat host sub-block slots (chunk * blocks_per_chunk + j), in copy order.
    host_slots: list[int]
    # Device block ids, in the same order.
    device_blocks: list[int]
    # The copied bytes, shape (len(host_slots), page_size_bytes).
    data: torch.Tensor


@dataclass
class TransferRecord:
    """What one job copied (kept only when recording is on)."""

    job_id: int
    kind: str  # "store" | "load"
    segments: list[CopySegment] = field(default_factory=list)
    transfer_size: int = 0
    transfer_time: float = 0.0


class HarnessCPUOffloadingWorker(OffloadingWorker):
    """Copies KV blocks between CPU "device" tensors and a CPU host pool."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        rank: int = 0,
        stall: StallRule | None = None,
        record_transfers: bool = False,
    ):
        self.rank = rank
        self.blocks_per_chunk = blocks_per_chunk
        self.num_cpu_chunks = num_cpu_chunks
        self.layer_refs_per_group: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        # Device side viewed as (num_blocks, page) rows, host side as
        # (num_chunks * blocks_per_chunk, page) rows: one row per sub-block,
        # the same addressing compute_sub_block_ptrs does with pointers.
        self.device_tensors: list[torch.Tensor] = []
        self.host_tensors: list[torch.Tensor] = []
        for kv_tensor in kv_caches.tensors:
            page = kv_tensor.page_size_bytes
            device = kv_tensor.tensor.view(torch.int8).view((-1, page))
            host = torch.zeros((num_cpu_chunks, page * blocks_per_chunk), dtype=torch.int8)
            self.device_tensors.append(device)
            self.host_tensors.append(host.view(num_cpu_chunks * blocks_per_chunk, page))
        self.stall = stall
        self.record_transfers = record_transfers
        self.transfer_log: list[TransferRecord] = []
        # Done copies, reported in submission order by the next get_finished.
        self._done: deque[TransferResult] = deque()
        self._withheld: dict[int, TransferResult] = {}
        self._kinds: dict[int, str] = {}

    # -- OffloadingWorker ---------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, "store", src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._transfer(job_id, "load", src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        while self._done:
            result = self._done.popleft()
            kind = self._kinds.get(result.job_id, "store")
            if self.stall is not None and self.stall.withholds(kind):
                # The hung copy: this rank never reports the job.
                self._withheld[result.job_id] = result
                continue
            self._kinds.pop(result.job_id, None)
            results.append(result)
        return results

    def wait(self, job_ids: set[int]) -> None:
        # Copies complete at submit; the completions stay queued for the next
        # get_finished, as the GPU worker's do after event.synchronize().
        return

    def shutdown(self) -> None:
        self._done.clear()
        self._withheld.clear()
        self._kinds.clear()

    # -- introspection for tests --------------------------------------------

    @property
    def withheld_job_ids(self) -> list[int]:
        return sorted(self._withheld)

    def host_rows(self, tensor_idx: int, host_slots: list[int]) -> torch.Tensor:
        return self.host_tensors[tensor_idx][host_slots].clone()

    def device_rows(self, tensor_idx: int, blocks: list[int]) -> torch.Tensor:
        return self.device_tensors[tensor_idx][blocks].clone()

    # -- the copy -------------------------------------------------------------

    def _transfer(
        self,
        job_id: int,
        kind: str,
        src_spec: LoadStoreSpec,
        dst_spec: LoadStoreSpec,
    ) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        to_host = kind == "store"
        device_spec = src_spec if to_host else dst_spec
        host_spec = dst_spec if to_host else src_spec
        assert isinstance(device_spec, GPULoadStoreSpec)
        assert len(device_spec.group_sizes) == len(self.layer_refs_per_group)

        device_ids = device_spec.block_ids
        host_ids = host_spec.block_ids
        start = time.perf_counter()
        num_bytes = 0
        record = TransferRecord(job_id, kind) if self.record_transfers else None
        device_off = host_off = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            if group_size == 0:
                continue
            skip = block_idx % self.blocks_per_chunk
            num_chunks = -(-(group_size + skip) // self.blocks_per_chunk)
            chunks = host_ids[host_off : host_off + num_chunks]
            blocks = device_ids[device_off : device_off + group_size]
            assert len(chunks) == num_chunks and len(blocks) == group_size
            host_off += num_chunks
            device_off += group_size
            slots = (
                chunks.astype(np.int64)[:, None] * self.blocks_per_chunk
                + np.arange(self.blocks_per_chunk)
            ).ravel()[skip : skip + group_size]
            host_idx = torch.from_numpy(slots)
            device_idx = torch.from_numpy(blocks.astype(np.int64))
            for ref in self.layer_refs_per_group[g_idx]:
                n = ref.page_size_bytes
                host = self.host_tensors[ref.tensor_idx]
                device = self.device_tensors[ref.tensor_idx]
                if to_host:
                    host[host_idx, :n] = device[device_idx, :n]
                    copied = host[host_idx, :n]
                else:
                    device[device_idx, :n] = host[host_idx, :n]
                    copied = device[device_idx, :n]
                num_bytes += group_size * n
                if record is not None:
                    record.segments.append(
                        CopySegment(
                            ref.tensor_idx,
                            slots.tolist(),
                            blocks.tolist(),
                            copied.clone(),
                        )
                    )
        assert host_off == len(host_ids) and device_off == len(device_ids)
        elapsed = time.perf_counter() - start
        self._kinds[job_id] = kind
        self._done.append(TransferResult(job_id, True, num_bytes, elapsed))
        if record is not None:
            record.transfer_size, record.transfer_time = num_bytes, elapsed
            self.transfer_log.append(record)
        return True


class HarnessCPUOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose worker runs on a CPU-only machine."""

    def _uses_shared_region(self) -> bool:
        # The shared /dev/shm region needs a worker barrier over a
        # torch.distributed group; the harness has none.
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            self._worker = HarnessCPUOffloadingWorker(  # type: ignore[assignment]
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                rank=rank,
                stall=parse_stall(dict(self.extra_config), rank),
                record_transfers=bool(self.extra_config.get(RECORD_KEY, False)),
            )
        assert self._worker is not None
        return self._worker
