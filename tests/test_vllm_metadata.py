"""The workers -> scheduler extension of vLLM's worker metadata: what a rank
pickles arrives equal, and vLLM's own aggregation and scheduler read it as
they read ``OffloadingWorkerMetadata``."""

from __future__ import annotations

import pickle

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
    TransferStats,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvobs_otel.hosts.vllm.metadata import ReceiptWorkerMetadata


def rank_meta(rank: int, jobs: tuple[int, ...], stored: int = 0,
              computed: tuple = ()) -> ReceiptWorkerMetadata:
    stats = TransferStats()
    if stored:
        stats.store.record(stored, 0.25)
    return ReceiptWorkerMetadata({j: 1 for j in jobs}, stats,
                                 ((rank, f"g{rank}", jobs),) if jobs else (), computed)


def test_rank_metadata_round_trips_through_pickle_equal():
    cases = [
        rank_meta(0, (3, 4), stored=4096),
        rank_meta(1, (3,)),                                   # stats empty
        rank_meta(1, (), computed=((1, "g1", "req-7", 2),)),  # first compute only
    ]
    for meta in cases:
        back = pickle.loads(pickle.dumps(meta))
        assert type(back) is ReceiptWorkerMetadata
        assert back == meta
        assert isinstance(back.transfer_stats, TransferStats)
    # The compact wire form: no field names, and empty stats travel as None
    # (no stats classes to look up on either side).
    wire = pickle.dumps(cases[1])
    assert b"completed_jobs" not in wire and b"TransferStats" not in wire
    assert b"TransferStats" in pickle.dumps(cases[0])


def test_vllm_aggregates_unpickled_ranks_as_it_does_its_own():
    ranks = [rank_meta(0, (3, 4), stored=4096), rank_meta(1, (3,), stored=1024,
                                                           computed=((1, "g1", "r", 1),))]
    outputs = []
    for meta in ranks:
        out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
        outputs.append(pickle.loads(pickle.dumps(out)))
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    got = merged.kv_connector_output.kv_connector_worker_meta
    stock = OffloadingWorkerMetadata.aggregate(*ranks)
    assert isinstance(got, ReceiptWorkerMetadata)
    assert got.completed_jobs == stock.completed_jobs == {3: 2, 4: 1}
    assert got.transfer_stats == stock.transfer_stats
    assert got.reporters == ((0, "g0", (3, 4)), (1, "g1", (3,)))
    assert got.computed == ((1, "g1", "r", 1),)
