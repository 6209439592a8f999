"""The workers -> scheduler extension of vLLM's worker metadata, on whatever
vLLM is installed: every field vLLM defines (0.34 added ``failed_jobs`` as
its second field) arrives at vLLM's aggregator and scheduler exactly as vLLM's
own metadata would, through a rank's pickle and vLLM's ``KVOutputAggregator``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvobs_otel.hosts.vllm.metadata import VLLM_FIELDS, ReceiptWorkerMetadata, extend

pytestmark = pytest.mark.vllm


def stock_meta(jobs: tuple[int, ...], failed: tuple[int, ...] = (), stored: int = 0,
               loaded: int = 0) -> OffloadingWorkerMetadata:
    """What vLLM's worker builds, through vLLM's own API."""
    meta = OffloadingWorkerMetadata()
    for job in jobs:
        if job in failed:
            # 0.34+: a failed transfer is reported, and counted as completed.
            meta.mark_completed(job, success=False)
        else:
            meta.mark_completed(job)
    if stored:
        meta.transfer_stats.store.record(stored, 0.25)
    if loaded:
        meta.transfer_stats.load.record(loaded, 0.5)
    return meta


def vllm_fields(meta: object) -> dict[str, object]:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(OffloadingWorkerMetadata)}


def supports_failures() -> bool:
    return "failed_jobs" in VLLM_FIELDS


def rank_metas() -> list[OffloadingWorkerMetadata]:
    failed = (4,) if supports_failures() else ()
    return [stock_meta((3, 4), failed, stored=4096), stock_meta((3,), loaded=1024),
            stock_meta((4,), failed)]


def test_the_extension_names_every_field_the_installed_vllm_defines():
    names = [f.name for f in dataclasses.fields(OffloadingWorkerMetadata)]
    assert list(VLLM_FIELDS) == names
    ours = [f.name for f in dataclasses.fields(ReceiptWorkerMetadata)]
    assert ours[:len(names)] == names and ours[len(names):] == ["reporters", "computed"]


def test_a_rank_metadata_carries_every_vllm_field_through_pickle():
    for rank, meta in enumerate(rank_metas()):
        ours = extend(meta, ((rank, f"g{rank}", tuple(meta.completed_jobs), ()),), ())
        back = pickle.loads(pickle.dumps(ours))
        assert type(back) is ReceiptWorkerMetadata
        assert back == ours
        assert vllm_fields(back) == vllm_fields(meta)
    # vLLM had nothing, a first compute is reported: vLLM's defaults.
    only_compute = pickle.loads(pickle.dumps(extend(None, (), ((1, "g1", "r", 2),))))
    assert vllm_fields(only_compute) == vllm_fields(OffloadingWorkerMetadata())
    assert only_compute.computed == ((1, "g1", "r", 2),)


def test_the_wire_form_is_compact():
    # No field names; empty stats travel as None (no stats classes to look up).
    wire = pickle.dumps(extend(stock_meta((3,)), ((1, "g1", (3,), ()),), ()))
    assert b"completed_jobs" not in wire and b"TransferStats" not in wire
    assert b"TransferStats" in pickle.dumps(extend(stock_meta((3,), stored=4096), (), ()))


# req_id_to_index is required up to 0.33 and gone in 0.34.
RUNNER_OUTPUT = {k: v for k, v in {"req_ids": [], "req_id_to_index": {}}.items()
                 if k in {f.name for f in dataclasses.fields(ModelRunnerOutput)}}


def aggregate(metas: list[object]) -> object:
    outputs = []
    for meta in metas:
        out = ModelRunnerOutput(**RUNNER_OUTPUT)
        out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
        outputs.append(pickle.loads(pickle.dumps(out)))  # as a worker sends it
    merged = KVOutputAggregator(expected_finished_count=len(metas)).aggregate(outputs)
    return merged.kv_connector_output.kv_connector_worker_meta


def test_vllm_aggregates_observed_ranks_exactly_as_its_own():
    stock = rank_metas()
    observed = [extend(m, ((r, f"g{r}", tuple(m.completed_jobs), ()),),
                       ((r, f"g{r}", "req", 1),) if r == 1 else ())
                for r, m in enumerate(stock)]
    got = aggregate(observed)
    want = aggregate(stock)
    assert isinstance(got, ReceiptWorkerMetadata)
    assert vllm_fields(got) == vllm_fields(want)
    assert got.completed_jobs == {3: 2, 4: 2}
    if supports_failures():
        assert got.failed_jobs == {4}
    assert got.reporters == ((0, "g0", (3, 4), ()), (1, "g1", (3,), ()), (2, "g2", (4,), ()))
    assert got.computed == ((1, "g1", "req", 1),)
    # A rank that reported nothing this step (None) and a stock rank mixed in.
    mixed = aggregate([observed[0], stock[1], observed[2]])
    assert vllm_fields(mixed) == vllm_fields(want)
    assert mixed.reporters == ((0, "g0", (3, 4), ()), (2, "g2", (4,), ()))
