"""vLLM 0.34's failure lifecycle, traced: a transfer that fails on one rank
(the harness's CPU copy backend injects it, as a failed GPU copy would be
reported), and what vLLM's scheduler then decides (kv_load_failure_policy),
on the real Scheduler, KV cache manager and OffloadingConnector."""

from __future__ import annotations

import pytest

from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig

from chains import episodes, view
from test_vllm_episodes import start_recovery
from vllm_fields import VLLM_FIELDS

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    "failed_jobs" not in VLLM_FIELDS,
    reason="this vLLM asserts every transfer succeeded (failures are reported from 0.34)")]


def run_failed_restore(policy: str, kind: str = "load") -> Harness:
    cfg = HarnessConfig(num_ranks=2, fail={"rank": 1, "kind": kind},
                        kv_load_failure_policy=policy)
    with Harness(cfg) as h:
        start_recovery(h, "r")
        h.run_until_idle(400)
    current_pipeline().flush()
    return h


def failed_transfers(spans, direction: str):
    return [s for s in spans if s.name == "kv.transfer" and s.attrs["kvobs.direction"] == direction
            and s.attrs["kvobs.outcome"] == "failed"]


def test_failed_restore_under_policy_fail_is_an_error_episode_naming_the_rank(observe):
    h = run_failed_restore("fail")
    assert h.finished["r"] == "error"  # vLLM ended the request with an error
    ((root, trace),) = episodes(observe.spans())
    assert root.error and root.attrs["kvobs.outcome"] == "restore_failed"
    assert root.attrs["error.type"] == "restore_failed"
    assert list(root.attrs["kvobs.restore.failed_ranks"]) == [1]
    (job_id,) = root.attrs["kvobs.restore.failed_job_ids"]
    assert list(root.attrs["kvobs.restore.job_ids"]) == [job_id]
    (job,) = [s for s in trace if s.name == "kv.job" and s.attrs["kvobs.job.id"] == job_id]
    assert job.error and job.attrs["kvobs.outcome"] == "failed"
    assert job.attrs["error.type"] == "transfer_failed"
    assert list(job.attrs["kvobs.receipt.ranks"]) == [0, 1]  # the receipt is complete
    assert list(job.attrs["kvobs.receipt.failed_ranks"]) == [1]
    transfers = {s.attrs["kvobs.rank"]: s for s in trace if s.name == "kv.transfer"
                 and s.attrs["kvobs.job.id"] == job_id}
    assert transfers[1].error and transfers[1].attrs["kvobs.outcome"] == "failed"
    assert not transfers[0].error and transfers[0].attrs["kvobs.outcome"] == "ok"
    assert not [s for s in trace if s.name in ("kv.admission", "kv.first_compute")]
    assert observe.metric_total("kvobs.recovery.episodes", outcome="restore_failed") == 1
    assert observe.metric_total("kvobs.transfers", direction="h2d", outcome="failed") == 1
    assert observe.metric_total("kvobs.jobs", kind="load", outcome="failed") == 1
    # A failed transfer is not a missing receipt.
    assert observe.metric_total("kvobs.receipts.incomplete") == 0
    assert not any(current_pipeline().error_counts().values())


def test_failed_restore_under_policy_recompute_follows_the_request_to_its_prefill(observe):
    h = run_failed_restore("recompute")
    assert h.finished["r"] == "length" and len(h.outputs["r"]) == 24
    ((root, trace),) = episodes(observe.spans())
    a = root.attrs
    assert not root.error and a["kvobs.outcome"] == "recomputed"
    assert list(a["kvobs.restore.failed_ranks"]) == [1]
    (adm,) = [s for s in trace if s.name == "kv.admission"]
    assert adm.attrs["kvobs.compute.kind"] == "prefill"
    fcs = [s for s in trace if s.name == "kv.first_compute"]
    assert sorted(s.attrs["kvobs.rank"] for s in fcs) == [0, 1]
    assert all(s.attrs["kvobs.compute.kind"] == "prefill" for s in fcs)
    # Nothing came back from the host tier; what was computed is computed again.
    assert a["kvobs.tokens.restored"] == 0
    assert a["kvobs.tokens.recomputed"] > 0
    assert a["kvobs.tokens.discarded"] == a["kvobs.tokens.resident"] + a["kvobs.tokens.recomputed"]
    assert observe.metric_total("kvobs.recovery.episodes", outcome="recomputed") == 1
    assert observe.metric_total("kvobs.recovery.episodes", outcome="recovered") == 0


def test_failed_store_shows_its_chunks_dropped_from_the_host_tier(observe):
    h = run_failed_restore("fail", kind="store")
    spans = [view(s) for s in observe.spans()]
    failed_jobs = [s for s in spans if s.name == "kv.job" and s.attrs["kvobs.outcome"] == "failed"]
    assert failed_jobs and all(j.attrs["kvobs.job.kind"] == "store" for j in failed_jobs)
    for job in failed_jobs:
        assert job.error and list(job.attrs["kvobs.receipt.failed_ranks"]) == [1]
        chunks = job.attrs["kvobs.host_tier.chunks"]
        assert chunks > 0 and job.attrs["kvobs.host_tier.dropped_chunks"] == chunks
        assert "kv.host_tier.dropped" in job.events
    d2h = failed_transfers(spans, "d2h")
    assert d2h and {s.attrs["kvobs.rank"] for s in d2h} == {1}
    assert observe.metric_total("kvobs.transfers", direction="d2h", outcome="failed") == len(d2h)
    # With its preserved KV dropped, the request came back by recomputing.
    assert h.finished["r"] == "length"
    ((root, _trace),) = episodes(observe.spans())
    assert root.attrs["kvobs.outcome"] == "recovered"
    assert root.attrs["kvobs.tokens.restored"] == 0
