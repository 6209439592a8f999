"""The workers -> scheduler extension of vLLM's worker metadata, on whatever
vLLM is installed: receipts attached to vLLM's own object, so every field
vLLM defines (0.34 added ``failed_jobs`` as its second field) arrives at
vLLM's aggregator and scheduler exactly as vLLM's own metadata would, through
a rank's pickle and vLLM's ``KVOutputAggregator``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

import kvobs_otel
from kvobs_otel.hosts.vllm.metadata import RECEIPTS_ATTR

from vllm_fields import VLLM_FIELDS

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


def with_receipts(meta: OffloadingWorkerMetadata, reporters: tuple) -> OffloadingWorkerMetadata:
    """What the worker seam does to a step's metadata (seams.WorkerSeams)."""
    meta.kvobs_receipts = reporters
    return meta


def vllm_fields(meta: object) -> dict[str, object]:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(OffloadingWorkerMetadata)}


def supports_failures() -> bool:
    return "failed_jobs" in VLLM_FIELDS


def rank_metas() -> list[OffloadingWorkerMetadata]:
    failed = (4,) if supports_failures() else ()
    return [stock_meta((3, 4), failed, stored=4096), stock_meta((3,), loaded=1024),
            stock_meta((4,), failed)]


def test_a_rank_metadata_carries_every_vllm_field_through_pickle(observe):
    for rank, meta in enumerate(rank_metas()):
        want = vllm_fields(meta)
        ours = with_receipts(meta, ((rank, f"g{rank}", tuple(meta.completed_jobs), ()),))
        back = pickle.loads(pickle.dumps(ours))
        assert type(back) is OffloadingWorkerMetadata
        assert vllm_fields(back) == want
        assert back.kvobs_receipts == ((rank, f"g{rank}", tuple(meta.completed_jobs), ()),)
    # Nothing attached: the class default, nothing extra on the wire.
    assert pickle.loads(pickle.dumps(stock_meta((3,)))).kvobs_receipts is None


def test_the_wire_form_adds_only_the_receipts(observe):
    # vLLM's own pickle of its object, plus one attribute and its tuples.
    stock = pickle.dumps(stock_meta((3,), stored=4096))
    ours = pickle.dumps(with_receipts(stock_meta((3,), stored=4096), ((1, "g1", (3,), ()),)))
    assert RECEIPTS_ATTR.encode() in ours and len(ours) - len(stock) < 80
    assert RECEIPTS_ATTR.encode() not in stock
    # Uninstrumented, vLLM's class has no such attribute left.
    kvobs_otel.uninstrument()
    assert not hasattr(OffloadingWorkerMetadata(), RECEIPTS_ATTR)


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


def test_vllm_aggregates_observed_ranks_exactly_as_its_own(observe):
    want = aggregate(rank_metas())
    assert type(want) is OffloadingWorkerMetadata and want.kvobs_receipts is None

    def observed() -> list[OffloadingWorkerMetadata]:
        return [with_receipts(m, ((r, f"g{r}", tuple(m.completed_jobs), ()),))
                for r, m in enumerate(rank_metas())]

    got = aggregate(observed())
    assert type(got) is OffloadingWorkerMetadata
    assert vllm_fields(got) == vllm_fields(want)
    assert got.completed_jobs == {3: 2, 4: 2}
    if supports_failures():
        assert got.failed_jobs == {4}
    assert got.kvobs_receipts == ((0, "g0", (3, 4), ()), (1, "g1", (3,), ()),
                                  (2, "g2", (4,), ()))
    # A stock rank (no receipts) mixed in, between observed ones or first.
    ranks = observed()
    mixed = aggregate([ranks[0], rank_metas()[1], ranks[2]])
    assert vllm_fields(mixed) == vllm_fields(want)
    assert mixed.kvobs_receipts == ((0, "g0", (3, 4), ()), (2, "g2", (4,), ()))
    ranks = observed()
    first_stock = aggregate([rank_metas()[0], ranks[1], ranks[2]])
    assert first_stock.kvobs_receipts == ((1, "g1", (3,), ()), (2, "g2", (4,), ()))
    # A rank that reported nothing returns None, as vLLM's own does: vLLM
    # passes the other rank's object on, receipts and all.
    ranks = observed()
    none_first = aggregate([None, ranks[1]])
    assert vllm_fields(none_first) == vllm_fields(aggregate([rank_metas()[1]]))
    assert none_first.kvobs_receipts == ((1, "g1", (3,), ()),)
    # One rank reported: vLLM passes its object on unaggregated.
    alone = aggregate([observed()[1]])
    assert alone.kvobs_receipts == ((1, "g1", (3,), ()),)
