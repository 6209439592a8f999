"""Recovery episodes and offload traffic on the real vLLM scheduler, KV cache
manager and OffloadingConnector (CPU harness, ranks inline), exported through
the SDK's in-memory exporter."""

from __future__ import annotations

import pytest
import vllm
from oracle import assert_traces_match_vllm

from kvobs_otel.hosts.vllm import releases
from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.workload import pressure_workload

from chains import assert_recovered_chain, by_trace, episodes, view

pytestmark = pytest.mark.vllm
# The installed release: its model runners (0.34 has only V2) and facts.
RELEASE = releases.select(vllm.__version__).release


def start_recovery(h: Harness, req_id: str, **request) -> None:
    """Run a request a few steps, preempt it and evict its GPU prefix-cache
    blocks, so that its re-admission must restore from CPU."""
    h.add_request(req_id, request.pop("prompt_len", 64), max_tokens=request.pop("max_tokens", 24),
                  **request)
    for _ in range(3):
        h.step()
    h.preempt(req_id)
    # Before re-admission: the freed blocks leave the GPU prefix cache.
    assert h.evict_gpu_prefix_cache() > 0


def run(cfg: HarnessConfig, **workload) -> Harness:
    with Harness(cfg) as h:
        pressure_workload(h, **workload)
        h.run_until_idle(2000)
    current_pipeline().flush()
    return h


@pytest.mark.parametrize("model_runner", RELEASE.runners)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_recovery_is_one_complete_trace_across_two_ranks(
        observe, model_runner, async_scheduling):
    h = run(HarnessConfig(num_ranks=2, model_runner=model_runner,
                          async_scheduling=async_scheduling))
    # Judged against vLLM's own record of what it did, not our checker.
    assert assert_traces_match_vllm(h, observe.spans()) >= 1
    eps = episodes(observe.spans())
    recovered = [(r, t) for r, t in eps if r.attrs["kvobs.outcome"] == "recovered"]
    assert recovered, [r.attrs for r, _ in eps]
    restored = 0
    for root, trace in recovered:
        assert_recovered_chain(trace, {0, 1})
        restored += bool(root.attrs.get("kvobs.restore.job_ids"))
    assert restored >= 1, "the workload must exercise the restore path"
    assert not any(current_pipeline().error_counts().values())
    assert observe.metric_total("kvobs.recovery.episodes", outcome="recovered") == len(recovered)
    assert observe.metric_total("kvobs.receipts.incomplete") == 0


def test_preserve_flush_transfers_belong_to_the_episode(observe):
    run(HarnessConfig(num_ranks=2))
    checked = 0
    for root, trace in episodes(observe.spans()):
        preserved = set(root.attrs.get("kvobs.preserve.job_ids", ()))
        checked += len(preserved)
        flushed = [s for s in trace if s.name == "kv.transfer" and s.attrs["kvobs.job.id"]
                   in preserved]
        # A preserve job is a store: only the writer ranks copy (all, here).
        assert all(s.attrs["kvobs.direction"] == "d2h" for s in flushed)
        for job_id in preserved:
            job = [s for s in trace if s.name == "kv.job" and s.attrs["kvobs.job.id"] == job_id]
            assert job and job[0].attrs["kvobs.job.role"] == "preserve"
        assert len(flushed) >= len(preserved) * 2  # both ranks copied every preserve job
    assert checked, "the workload must preserve blocks of a preempted request"


def test_ordinary_stores_form_per_request_traces(observe):
    with Harness(HarnessConfig(num_ranks=2)) as h:
        h.add_request("solo", 64, max_tokens=8)
        h.run_until_idle(200)
    current_pipeline().flush()
    spans = [view(s) for s in observe.spans()]
    assert not [s for s in spans if s.name == "kv.recovery"]
    (root,) = [s for s in spans if s.name == "kv.request"]
    assert root.parent_id is None and root.attrs["kvobs.request.id"] == "solo"
    assert root.attrs["kvobs.outcome"] == "finished"
    trace = by_trace(observe.spans())[root.trace_id]
    jobs = [s for s in trace if s.name == "kv.job"]
    assert jobs and all(j.attrs["kvobs.job.kind"] == "store" for j in jobs)
    for job in jobs:
        transfers = [s for s in trace if s.name == "kv.transfer"
                     and s.parent_id == job.span_id]
        assert {t.attrs["kvobs.rank"] for t in transfers} == {0, 1}
        assert all(t.attrs["kvobs.direction"] == "d2h" for t in transfers)
    assert observe.metric_total("kvobs.transfers", direction="d2h", outcome="ok") == len(
        [s for s in trace if s.name == "kv.transfer"])
    assert observe.metric_total("kvobs.transfer.bytes", direction="d2h") > 0


def test_a_transfer_span_covers_a_copy_made_inside_submit(observe):
    # A copy engine that copies inside submit (the harness's CPU backend, some
    # device handlers), slowed to 20 ms a copy: the span starts at the call.
    with Harness(HarnessConfig(num_ranks=2, extra_config={"harness_copy_s": 0.02})) as h:
        h.add_request("solo", 64, max_tokens=4)
        h.run_until_idle(200)
    current_pipeline().flush()
    transfers = [view(s) for s in observe.spans("kv.transfer")]
    assert transfers
    for t in transfers:
        copy_s = t.attrs["kvobs.device.duration_s"]  # vLLM's own transfer_time
        assert copy_s >= 0.02
        assert (t.end_ns - t.start_ns) / 1e9 >= copy_s, (t.attrs, t.end_ns - t.start_ns)


def test_restore_through_cpu_when_gpu_prefix_cache_is_evicted(observe):
    with Harness(HarnessConfig(num_ranks=2)) as h:
        start_recovery(h, "r")
        h.run_until_idle(400)
    current_pipeline().flush()
    ((root, trace),) = episodes(observe.spans())
    assert_recovered_chain(trace, {0, 1})
    assert root.attrs["kvobs.restore.job_ids"]
    # Where the KV came back from: the evicted prefix from the host tier, the
    # rest (the tokens past the last full block) computed again.
    a = root.attrs
    assert a["kvobs.tokens.discarded"] >= a["kvobs.tokens.restored"] > 0
    assert a["kvobs.tokens.resident"] == 0
    assert a["kvobs.tokens.discarded"] == a["kvobs.tokens.restored"] + a["kvobs.tokens.recomputed"]
    assert a["kvobs.tokens.restored"] % 16 == 0  # whole blocks
    # Which rank's receipt came last, and the spread between the first and last.
    for job in (s for s in trace if s.name == "kv.job"):
        assert set(job.attrs["kvobs.receipt.last_ranks"]) <= {0, 1}
        assert job.attrs["kvobs.receipt.spread_s"] >= 0.0
    assert observe.metric_total("kvobs.recovery.tokens", source="restored") == \
        a["kvobs.tokens.restored"]


def test_sync_load_restores_before_the_forward(observe):
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    if "sync" not in {f.name for f in dataclasses.fields(TransferJob)}:
        pytest.skip("this vLLM has no sync loads (TransferJob.sync is new in 0.33)")
    cfg = HarnessConfig(num_ranks=2, extra_config={"sync_load_budget_bytes": 1 << 30})
    with Harness(cfg) as h:
        start_recovery(h, "s")
        h.run_until_idle(400)
    current_pipeline().flush()
    ((root, trace),) = episodes(observe.spans())
    assert_recovered_chain(trace, {0, 1})
    (job_id,) = root.attrs["kvobs.restore.job_ids"]
    job = next(s for s in trace if s.name == "kv.job" and s.attrs["kvobs.job.id"] == job_id)
    assert job.attrs["kvobs.job.sync"] is True
    transfers = [s for s in trace if s.name == "kv.transfer" and s.attrs["kvobs.job.id"] == job_id]
    assert transfers and all(t.attrs["kvobs.expedited"] for t in transfers)


def test_withheld_rank_ends_job_as_error_naming_it(observe):
    cfg = HarnessConfig(num_ranks=2, stall={"rank": 1, "kind": "load"})
    with Harness(cfg) as h:
        start_recovery(h, "w")
        h.run_for(2.0)  # past the 1 s receipt deadline of the fixture, stepping
        current_pipeline().flush()
        spans = [view(s) for s in observe.spans()]
        (job,) = [s for s in spans if s.name == "kv.job" and s.attrs["kvobs.job.kind"] == "load"]
        assert job.error and job.attrs["kvobs.outcome"] == "receipt_incomplete"
        assert list(job.attrs["kvobs.receipt.missing_ranks"]) == [1]
        assert list(job.attrs["kvobs.receipt.ranks"]) == [0]
        (root,) = [s for s in spans if s.name == "kv.recovery"]
        assert root.error and root.attrs["kvobs.outcome"] == "receipt_incomplete"
        assert observe.metric_total("kvobs.receipts.incomplete", kind="load") == 1


def test_a_receipt_is_not_missing_while_the_engine_takes_no_step(observe):
    """Ranks report finished transfers only inside engine steps. In the real
    engine the first forward pass took 2.7 s and, later, vLLM went idle after
    its last request: no step, so no report, and the 1 s deadline ended a
    finished store as receipt_incomplete on all ranks (a false
    KvobsReceiptIncomplete). Only a deadline the engine stepped through
    counts."""
    import time

    with Harness(HarnessConfig(num_ranks=2)) as h:
        h.add_request("slow", 64, max_tokens=8)
        while not [j for j in h.jobs if j.kind == "store"]:
            h.step()
        (sched,) = [o.lifecycle for o in current_pipeline().observers
                    if o.lifecycle.role == "scheduler"]
        current_pipeline().flush()
        pending = sched.open_receipts
        time.sleep(1.3)  # a long step (or an idle engine): past the 1 s deadline
        current_pipeline().flush()
        assert not observe.spans("kv.job"), "a job ended while the engine took no step"
        h.run_until_idle(200)
        current_pipeline().flush()
        jobs = [view(s) for s in observe.spans("kv.job")]
    assert pending and len(jobs) >= pending
    assert all(j.attrs["kvobs.outcome"] == "complete" for j in jobs), [
        (j.attrs["kvobs.request.id"], j.attrs["kvobs.outcome"]) for j in jobs]


def test_abort_while_restore_in_flight_ends_episode_before_resume(observe):
    cfg = HarnessConfig(num_ranks=2, stall={"rank": 0, "kind": "load"})
    with Harness(cfg) as h:
        start_recovery(h, "a")
        for _ in range(3):
            h.step()
        assert any(j.req_id == "a" for j in h.restore_jobs)
        h.abort("a")
        h.run(3)
    current_pipeline().flush()
    (root,) = [view(s) for s in observe.spans("kv.recovery")]
    assert root.attrs["kvobs.outcome"] == "aborted_before_resume"
    assert not root.error


def test_reset_cache_preempts_running_requests_and_loses_nothing(observe):
    with Harness(HarnessConfig(num_ranks=2)) as h:
        pressure_workload(h)
        for _ in range(40):
            h.step()
        running = {r.request_id for r in h.scheduler.running}
        assert running
        assert h.reset_cache(reset_running_requests=True)
        h.run_until_idle(2000)
    current_pipeline().flush()
    spans = [view(s) for s in observe.spans()]
    assert not any(current_pipeline().error_counts().values())
    # Jobs flushed by the reset still get every rank's receipt.
    jobs = [s for s in spans if s.name == "kv.job"]
    assert jobs and all(j.attrs["kvobs.outcome"] == "complete" for j in jobs)
    # reset_prefix_cache preempts every running request: each one is an episode.
    roots = [r for r in spans if r.name == "kv.recovery"]
    assert running <= {r.attrs["kvobs.request.id"] for r in roots}
    assert all(r.attrs["kvobs.outcome"] == "recovered" for r in roots)


def test_trace_headers_link_kv_traces_to_vllm_request_trace(observe):
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with Harness(HarnessConfig(num_ranks=1)) as h:
        h.add_request("t", 64, max_tokens=24, trace_headers={"traceparent": tp})
        for _ in range(3):
            h.step()
        h.preempt("t")
        h.run_until_idle(300)
    current_pipeline().flush()
    for name in ("kv.recovery", "kv.request"):
        (span,) = observe.spans(name)
        linked = {(ln.context.trace_id, ln.context.span_id) for ln in span.links}
        assert (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331) in linked


def test_traffic_sampling_drops_request_traces_but_keeps_episodes(telemetry):
    import kvobs_otel
    from kvobs_otel.config import Settings

    assert kvobs_otel.instrument(Settings(enabled=True, traffic_sample_ratio=0.0))
    try:
        with Harness(HarnessConfig(num_ranks=2)) as h:
            start_recovery(h, "k")
            h.add_request("plain", 64, max_tokens=8)
            h.run_until_idle(400)
        current_pipeline().flush()
    finally:
        kvobs_otel.uninstrument()
    names = {s.name for s in telemetry.spans()}
    assert "kv.request" not in names
    ((_root, trace),) = episodes(telemetry.spans())
    assert_recovered_chain(trace, {0, 1})
    # Ordinary stores are not in any trace, but still in the metrics.
    assert not [s for s in telemetry.spans() if s.attributes.get("kvobs.request.id") == "plain"]
    assert telemetry.metric_total("kvobs.transfers", direction="d2h") > 0


def test_latency_histograms_resolve_milliseconds_and_carry_episode_exemplars(observe):
    from kvobs_otel.telemetry.metrics import LATENCY_BUCKETS

    with Harness(HarnessConfig(num_ranks=2)) as h:
        start_recovery(h, "x")
        h.run_until_idle(400)
        current_pipeline().flush()
        (root,) = [r for r, _ in episodes(observe.spans())]
        roots = {root.trace_id}
        points = []
        for reader in observe.readers:
            data = reader.get_metrics_data()
            for rm in data.resource_metrics if data else ():
                for sm in rm.scope_metrics:
                    points += [p for m in sm.metrics if m.name == "kvobs.recovery.latency"
                               for p in m.data.data_points]
    (point,) = points
    assert tuple(point.explicit_bounds) == LATENCY_BUCKETS
    # The recovery lands in the bucket of its own duration (a harness
    # recovery takes milliseconds: the SDK's default boundaries 0, 5, 10, ...
    # s would put every one in the first bucket).
    latency_s = (root.end_ns - root.start_ns) / 1e9
    expected = next((i for i, b in enumerate(LATENCY_BUCKETS) if latency_s <= b),
                    len(LATENCY_BUCKETS))
    assert point.bucket_counts[expected] == 1 and sum(point.bucket_counts) == 1
    assert expected > 0  # not the first bucket: the boundaries resolve it
    assert {e.trace_id for e in point.exemplars} == roots
