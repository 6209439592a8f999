"""CPU offloading backend for the harness: a stand-in for the GPU copy engine,
which cannot run here.

``HarnessCPUOffloadingSpec`` subclasses vLLM's ``CPUOffloadingSpec`` so the
scheduler side (its real ``CPUOffloadingManager``, chunk sizing, eviction
policy) is untouched. Only ``get_worker`` differs: instead of the CUDA/XPU
``CPUOffloadingWorker`` it returns ``HarnessCPUOffloadingWorker``, which really
copies the blocks between the registered "device" KV tensors (plain CPU
tensors here) and a host tensor pool it allocates, with the same block/chunk
addressing as ``vllm/v1/kv_offload/cpu/gpu_worker.py`` (direct layout):

* The device side of a transfer names device blocks, split per KV cache
  group; each group carries the logical index of its first block inside the
  request, so a transfer may start in the middle of its first host chunk
  (``block_index % blocks_per_chunk``). Up to vLLM 0.33 it is the
  ``GPULoadStoreSpec`` (``block_ids``, ``group_sizes``, ``block_indices``);
  from 0.34 it is ``DevicePointers`` (``vllm/v1/kv_offload/base.py``, built by
  ``pointer_utils.resolve_device_pointers``): one pointer per (group, data
  ref, block), walked like vLLM's CPU worker does (``iter_pointer_groups``).
  The worker maps every pointer back to a row of the registered KV tensor it
  falls in (and checks size and alignment), inside this process only; the
  addresses are never logged, recorded or exported.
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
With ``"release_after_s": N`` each completion is reported N seconds late
instead (a copy that hung for N s): the requests waiting on it then finish.

::

    "harness_fail": {"rank": 1, "kind": "load", "count": 1}

makes the worker of rank 1 report ``TransferResult(job_id, success=False)``
for its first ``count`` jobs of that kind (``count`` omitted: all of them)
without copying any byte: a failed copy. ``kind`` and ``rank`` work as for
``harness_stall``. Only vLLM releases that report transfer failures (0.34:
``OffloadingWorkerMetadata.failed_jobs``) accept it; older ones assert that
every transfer succeeded, so there the rule is refused (``compat``).

A slow copy engine that copies inside submit: ``"harness_copy_s": 0.02``
adds 20 ms to every copy (inside the measured ``transfer_time``).

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
from collections.abc import Iterator
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
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvobs_otel.tools.harness import compat
from kvobs_otel.tools.harness.config import COPY_DELAY_KEY, FAIL_KEY, RECORD_KEY, STALL_KEY

KINDS = frozenset({"load", "store", "any"})


def _rule_for_rank(key: str, raw: dict[str, Any] | None, rank: int) -> frozenset[str] | None:
    """The kinds a ``harness_stall`` / ``harness_fail`` rule covers on ``rank``
    (None: the rule does not apply to this rank)."""
    if not raw:
        return None
    ranks = raw.get("rank", 0)
    ranks = set(ranks) if isinstance(ranks, (list, tuple, set)) else {ranks}
    if rank not in ranks:
        return None
    kind = raw.get("kind", "load")
    kinds = frozenset(kind) if isinstance(kind, (list, tuple, set)) else frozenset({kind})
    unknown = set(kinds) - KINDS
    if unknown:
        raise ValueError(f"unknown {key} kind(s): {sorted(unknown)}")
    return kinds


@dataclass
class StallRule:
    """Which of this rank's completions to withhold, and for how long (None:
    for ever)."""

    kinds: frozenset[str]
    release_after_s: float | None = None

    def withholds(self, kind: str) -> bool:
        return "any" in self.kinds or kind in self.kinds


def parse_stall(extra_config: dict[str, Any], rank: int) -> StallRule | None:
    """The stall rule that applies to ``rank``, if any."""
    raw = extra_config.get(STALL_KEY)
    kinds = _rule_for_rank(STALL_KEY, raw, rank)
    if kinds is None:
        return None
    release = raw.get("release_after_s")
    if release is not None and not (isinstance(release, (int, float)) and release >= 0):
        raise ValueError(f"{STALL_KEY}.release_after_s must be a number >= 0: {release!r}")
    return StallRule(kinds, None if release is None else float(release))


@dataclass
class FailRule:
    """Which of this rank's jobs fail: the first ``remaining`` of ``kinds``
    (``remaining`` None: every one)."""

    kinds: frozenset[str]
    remaining: int | None = None

    def take(self, kind: str) -> bool:
        """Whether the next job of ``kind`` fails (and count it)."""
        if not ("any" in self.kinds or kind in self.kinds):
            return False
        if self.remaining is None:
            return True
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


def parse_fail(extra_config: dict[str, Any], rank: int) -> FailRule | None:
    """The fail rule that applies to ``rank``, if any."""
    raw = extra_config.get(FAIL_KEY)
    if raw:
        # Refused on every rank, not only the failing one: the scenario cannot
        # exist where vLLM asserts that transfers succeed.
        compat.check_fail_supported()
    kinds = _rule_for_rank(FAIL_KEY, raw, rank)
    if kinds is None:
        return None
    assert raw is not None
    count = raw.get("count")
    if count is not None and (not isinstance(count, int) or count < 0):
        raise ValueError(f"{FAIL_KEY} count must be a non-negative int, not {count!r}")
    return FailRule(kinds, count)


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
    # Reported failed by fault injection (nothing was copied).
    failed: bool = False


@dataclass
class DeviceGroup:
    """The device side of one KV cache group of a transfer."""

    group_idx: int
    num_blocks: int
    # Sub-blocks to skip in the first host chunk.
    skip: int
    # Device block ids (rows) per data ref of the group, in copy order.
    rows_per_ref: list[np.ndarray]


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
        fail: FailRule | None = None,
        copy_delay_s: float = 0.0,
        host_region: SharedOffloadRegion | None = None,
    ):
        self.rank = rank
        self.copy_delay_s = copy_delay_s
        # Tiered: the host pool is this rank's share of vLLM's shared region,
        # which the scheduler's secondary tiers read (cascade) and write
        # (promotion); closed with the worker.
        self.host_region = host_region
        if host_region is not None and blocks_per_chunk != 1:
            raise ValueError("the harness's tiered host pool needs one GPU block per chunk")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_cpu_chunks = num_cpu_chunks
        self.layer_refs_per_group: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        # Device side viewed as (num_blocks, page) rows, host side as
        # (num_chunks * blocks_per_chunk, page) rows: one row per sub-block,
        # the same addressing compute_sub_block_ptrs does with pointers.
        self.device_tensors: list[torch.Tensor] = []
        self.host_tensors: list[torch.Tensor] = []
        # (base address, row stride in bytes, rows) of each registered tensor,
        # as resolve_device_pointers addresses it; only to map pointers back.
        self._device_geometry: list[tuple[int, int, int]] = []
        for kv_tensor in kv_caches.tensors:
            page = kv_tensor.page_size_bytes
            device = kv_tensor.tensor.view(torch.int8).view((-1, page))
            if host_region is not None:
                # (num_chunks, page) rows strided by the region's chunk row:
                # vLLM's own layout (SharedOffloadRegion.create_next_worker_view).
                self.host_tensors.append(host_region.create_next_worker_view(page))
            else:
                host = torch.zeros((num_cpu_chunks, page * blocks_per_chunk), dtype=torch.int8)
                self.host_tensors.append(host.view(num_cpu_chunks * blocks_per_chunk, page))
            self.device_tensors.append(device)
            t = kv_tensor.tensor
            self._device_geometry.append((t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]))
        self.stall = stall
        self.fail = fail
        self.record_transfers = record_transfers
        self.transfer_log: list[TransferRecord] = []
        # Done copies, reported in submission order by the next get_finished.
        self._done: deque[TransferResult] = deque()
        self._withheld: dict[int, tuple[TransferResult, float]] = {}  # (result, since)
        self._kinds: dict[int, str] = {}
        self.failed_job_ids: list[int] = []

    # -- OffloadingWorker ---------------------------------------------------
    # vLLM's connector passes the device side positionally: a GPULoadStoreSpec
    # up to 0.33, DevicePointers from 0.34 (compat.worker_takes_device_pointers).

    def submit_store(self, job_id: int, device: Any, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, "store", device, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        device: Any,
        expedited: bool = False,
    ) -> bool:
        # expedited (0.33+) only picks a separate CUDA stream in vLLM's worker;
        # copies here are done at submit time anyway.
        return self._submit(job_id, "load", device, src_spec)

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        stall = self.stall
        if stall is not None and stall.release_after_s is not None and self._withheld:
            # Copies that hung long enough: reported now, late.
            due = time.monotonic() - stall.release_after_s
            for job_id, (result, since) in list(self._withheld.items()):
                if since <= due:
                    del self._withheld[job_id]
                    self._kinds.pop(job_id, None)
                    results.append(result)
        while self._done:
            result = self._done.popleft()
            kind = self._kinds.get(result.job_id, "store")
            if stall is not None and stall.withholds(kind):
                # The hung copy: this rank does not report the job (yet).
                self._withheld[result.job_id] = (result, time.monotonic())
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
        if self.host_region is not None:
            self.host_tensors.clear()
            self.host_region.cleanup()
            self.host_region = None

    # -- introspection for tests --------------------------------------------

    @property
    def withheld_job_ids(self) -> list[int]:
        return sorted(self._withheld)

    def host_rows(self, tensor_idx: int, host_slots: list[int]) -> torch.Tensor:
        return self.host_tensors[tensor_idx][host_slots].clone()

    def device_rows(self, tensor_idx: int, blocks: list[int]) -> torch.Tensor:
        return self.device_tensors[tensor_idx][blocks].clone()

    # -- the device side of a transfer ------------------------------------------

    def _device_groups(self, device: Any) -> Iterator[DeviceGroup]:
        if compat.worker_takes_device_pointers():
            return self._groups_of_pointers(device)
        return self._groups_of_spec(device)

    def _groups_of_spec(self, spec: GPULoadStoreSpec) -> Iterator[DeviceGroup]:
        # Up to vLLM 0.33: block ids, split by group_sizes.
        assert isinstance(spec, GPULoadStoreSpec)
        assert len(spec.group_sizes) == len(self.layer_refs_per_group)
        offset = 0
        for g_idx, (size, block_idx) in enumerate(
            zip(spec.group_sizes, spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            rows = spec.block_ids[offset : offset + size].astype(np.int64)
            assert len(rows) == size
            offset += size
            refs = self.layer_refs_per_group[g_idx]
            yield DeviceGroup(g_idx, size, block_idx % self.blocks_per_chunk, [rows] * len(refs))
        assert offset == len(spec.block_ids)

    def _groups_of_pointers(self, device_ptrs: Any) -> Iterator[DeviceGroup]:
        # vLLM 0.34 (v1/kv_offload/base.py DevicePointers): pointers laid out
        # group by group, data ref by data ref, block by block; walked with
        # vLLM's own iterator, as its CPU worker does (cpu/gpu_worker.py).
        from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups

        assert len(device_ptrs.group_block_counts) == len(self.layer_refs_per_group)
        for g in iter_pointer_groups(device_ptrs, self.blocks_per_chunk):
            refs = self.layer_refs_per_group[g.group_idx]
            assert g.n_data_refs == len(refs)
            rows_per_ref = []
            for d, ref in enumerate(refs):
                start = g.dev_ptr_offset + d * g.group_size
                end = start + g.group_size
                rows_per_ref.append(
                    self._rows_of(ref, device_ptrs.ptrs[start:end], device_ptrs.sizes[start:end])
                )
            yield DeviceGroup(g.group_idx, g.group_size, g.skip, rows_per_ref)

    def _rows_of(self, ref: CanonicalKVCacheRef, ptrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Rows of the ref's device tensor that ``ptrs`` address (no address
        ever leaves this function, not even in an error)."""
        base, stride, num_rows = self._device_geometry[ref.tensor_idx]
        offsets = ptrs.astype(np.uint64) - np.uint64(base)  # wraps if below base
        rows = offsets // np.uint64(stride)
        if (offsets % np.uint64(stride)).any() or (rows >= np.uint64(num_rows)).any():
            raise ValueError(
                f"rank {self.rank}: a device pointer is not a block of KV tensor {ref.tensor_idx}"
            )
        if (sizes != ref.page_size_bytes).any():
            raise ValueError(
                f"rank {self.rank}: copy size differs from the page size of KV tensor "
                f"{ref.tensor_idx}"
            )
        return rows.astype(np.int64)

    # -- the copy -------------------------------------------------------------

    def _submit(self, job_id: int, kind: str, device: Any, host_spec: LoadStoreSpec) -> bool:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        self._kinds[job_id] = kind
        if self.fail is not None and self.fail.take(kind):
            # A failed copy: nothing moved, reported like vLLM's CPU worker
            # reports one (success=False, no size or time).
            self.failed_job_ids.append(job_id)
            self._done.append(TransferResult(job_id, False))
            if self.record_transfers:
                self.transfer_log.append(TransferRecord(job_id, kind, failed=True))
            return True
        self._transfer(job_id, kind, device, host_spec)
        return True

    def _transfer(
        self, job_id: int, kind: str, device: Any, host_spec: BlockIDsLoadStoreSpec
    ) -> None:
        to_host = kind == "store"
        host_ids = host_spec.block_ids
        start = time.perf_counter()
        num_bytes = 0
        record = TransferRecord(job_id, kind) if self.record_transfers else None
        host_off = 0
        for group in self._device_groups(device):
            bpc = self.blocks_per_chunk
            num_chunks = -(-(group.num_blocks + group.skip) // bpc)
            chunks = host_ids[host_off : host_off + num_chunks]
            assert len(chunks) == num_chunks
            host_off += num_chunks
            slots = (chunks.astype(np.int64)[:, None] * bpc + np.arange(bpc)).ravel()[
                group.skip : group.skip + group.num_blocks
            ]
            host_idx = torch.from_numpy(slots)
            for ref, rows in zip(
                self.layer_refs_per_group[group.group_idx], group.rows_per_ref, strict=True
            ):
                device_idx = torch.from_numpy(rows)
                n = ref.page_size_bytes
                host = self.host_tensors[ref.tensor_idx]
                dev = self.device_tensors[ref.tensor_idx]
                if to_host:
                    host[host_idx, :n] = dev[device_idx, :n]
                    copied = host[host_idx, :n]
                else:
                    dev[device_idx, :n] = host[host_idx, :n]
                    copied = dev[device_idx, :n]
                num_bytes += group.num_blocks * n
                if record is not None:
                    record.segments.append(
                        CopySegment(ref.tensor_idx, slots.tolist(), rows.tolist(), copied.clone())
                    )
        assert host_off == len(host_ids)
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        elapsed = time.perf_counter() - start
        self._done.append(TransferResult(job_id, True, num_bytes, elapsed))
        if record is not None:
            record.transfer_size, record.transfer_time = num_bytes, elapsed
            self.transfer_log.append(record)


class HarnessCPUOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose worker runs on a CPU-only machine."""

    def _uses_shared_region(self) -> bool:
        # The shared /dev/shm region needs a worker barrier over a
        # torch.distributed group; the harness has none.
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = _harness_worker(self, kv_caches)  # type: ignore[assignment]
        assert self._worker is not None
        return self._worker


def _harness_worker(spec: CPUOffloadingSpec, kv_caches: CanonicalKVCaches,
                    host_region: SharedOffloadRegion | None = None
                    ) -> HarnessCPUOffloadingWorker:
    rank = spec.config.parallel.rank
    extra = dict(spec.extra_config)
    return HarnessCPUOffloadingWorker(
        kv_caches=kv_caches,
        blocks_per_chunk=spec.blocks_per_chunk,
        num_cpu_chunks=spec.num_chunks,
        rank=rank,
        stall=parse_stall(extra, rank),
        record_transfers=bool(extra.get(RECORD_KEY, False)),
        fail=parse_fail(extra, rank),
        copy_delay_s=float(extra.get(COPY_DELAY_KEY, 0.0)),
        host_region=host_region,
    )


class HarnessTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec, whole (its TieringOffloadingManager, the
    CPU primary tier and the configured secondary tiers, all real), with the
    harness's copy engine as the GPU <-> CPU worker. The worker copies into
    its share of the same ``SharedOffloadRegion`` (``/dev/shm``, named by the
    engine id) the primary tier hands to the secondary tiers, laid out as
    vLLM's ``TieringOffloadingSpec.create_worker`` lays it out."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = _harness_worker(self, kv_caches, region)  # type: ignore[assignment]
            except BaseException:
                region.cleanup()
                raise
        assert self._worker is not None
        return self._worker
