"""vLLM's secondary tiers (TieringOffloadingSpec) traced: its real tiering
manager and a real ``fs`` tier in a temporary directory, behind the harness's
CPU copy engine, on the installed release. Faults come from an out-of-tree
tier wrapping the real fs tier (kvobs_otel/tools/harness/faulty_tier.py).
Each trace is judged against what vLLM's tiering manager did, recorded as it
ran (its job registry's calls), not against kvobs-otel's own checker."""

from __future__ import annotations

import contextlib
import time

import pytest
import vllm
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.metrics import TieringMetricsTracker

from kvobs_otel import identity
from kvobs_otel.hosts.vllm import releases
from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.fabricate import random_tokens
from kvobs_otel.tools.harness.workload import pressure_workload

from chains import by_trace, view

pytestmark = pytest.mark.vllm
RELEASE = releases.select(vllm.__version__).release

FAULTY = {"type": "FaultyFsTier", "module_path": "kvobs_otel.tools.harness.faulty_tier"}


class Journal(dict):
    """tier job id -> what vLLM did with it; ``skipped``: the chunks of each
    cascade vLLM's back-pressure dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[int] = []


@contextlib.contextmanager
def tier_journal():
    """What vLLM's tiering manager did: every tier job its registry reported
    to vLLM's own metrics tracker (patched on the class, below kvobs-otel's
    instance wrappers), and each job's result as it came."""
    jobs = Journal()
    registered = TieringMetricsTracker.on_job_registered
    finished = TieringMetricsTracker.on_job_finished
    should_store = TieringOffloadingManager._should_store_to_tier

    def _should_store_to_tier(self, tier, num_blocks):
        store = should_store(self, tier, num_blocks)
        if not store:
            jobs.skipped.append(num_blocks)
        return store

    def on_job_registered(self, job_metadata):
        job = job_metadata.transfer_job
        jobs[job.job_id] = dict(tier=job_metadata.tier_idx, promotion=job.is_promotion,
                                req=job.req_context.req_id, chunks=len(job.keys), result=None)
        return registered(self, job_metadata)

    def on_job_finished(self, job_metadata, result):
        ok = result.successful_keys
        jobs[result.job_id]["result"] = (bool(result.success), result.transfer_bytes,
                                         None if ok is None else len(ok))
        jobs[result.job_id]["finished_ns"] = time.time_ns()
        return finished(self, job_metadata, result)

    TieringMetricsTracker.on_job_registered = on_job_registered
    TieringMetricsTracker.on_job_finished = on_job_finished
    TieringOffloadingManager._should_store_to_tier = _should_store_to_tier
    try:
        yield jobs
    finally:
        TieringMetricsTracker.on_job_registered = registered
        TieringMetricsTracker.on_job_finished = finished
        TieringOffloadingManager._should_store_to_tier = should_store


def pressure_spans(observe, num_cpu_chunks: int, **cfg) -> list:
    """The pressure workload on a tiered harness, run to idle: its spans."""
    with Harness(HarnessConfig(num_ranks=2, tier="fs", num_cpu_chunks=num_cpu_chunks,
                               **cfg)) as h:
        pressure_workload(h)
        h.run_until_idle(2000)
    current_pipeline().flush()
    return [view(s) for s in observe.spans()]


def tier_spans(spans) -> dict[int, object]:
    return {s.attrs["kvobs.tier.job.id"]: s for s in spans if s.name == "kv.tier.job"}


def test_every_tier_job_is_a_span_in_its_request_or_episode_trace(observe):
    with tier_journal() as journal, Harness(HarnessConfig(num_ranks=2, tier="fs",
                                                          num_cpu_chunks=16)) as h:
        pressure_workload(h)
        h.run_until_idle(2000)
        gen = h.scheduler.connector.__dict__["_kvobs"].gen
    current_pipeline().flush()
    spans = [view(s) for s in observe.spans()]
    tier = tier_spans(spans)
    assert journal and set(tier) == set(journal)
    assert any(not j["promotion"] for j in journal.values())
    traces = by_trace(observe.spans())
    for job_id, job in journal.items():
        s = tier[job_id]
        success, size, _ok = job["result"]
        assert s.attrs["kvobs.tier.job.kind"] == ("promotion" if job["promotion"] else "cascade")
        assert (s.attrs["kvobs.tier.index"], s.attrs["kvobs.tier.type"]) == (job["tier"], "fs")
        assert s.attrs["kvobs.tier.medium"] == "storage"
        assert s.attrs["kvobs.request.id"] == job["req"]
        assert s.attrs["kvobs.tier.chunks"] == job["chunks"]
        assert s.attrs["kvobs.outcome"] == ("ok" if success else "failed") and not s.error
        assert s.attrs.get("kvobs.bytes") == size
        assert s.span_id == identity.tier_job_span_id(gen, job_id)  # not a connector job's id
        # Its trace: the open episode's, else the request's ordinary one.
        epoch = s.attrs.get("kvobs.recovery.epoch", 0)
        root = [x for x in traces[s.trace_id] if x.parent_id is None]
        assert len(root) == 1 and s.parent_id == root[0].span_id
        assert root[0].name == ("kv.recovery" if epoch else "kv.request")
        if epoch:
            assert job_id in root[0].attrs["kvobs.tier.job_ids"]
    # The metrics say the same, by tier, kind and outcome.
    for kind, promotion in (("cascade", False), ("promotion", True)):
        mine = [j for j in journal.values() if j["promotion"] is promotion]
        assert observe.metric_total("kvobs.tier.jobs", tier="fs", kind=kind,
                                    outcome="ok") == len(mine)
        assert observe.metric_total("kvobs.tier.bytes", tier="fs", kind=kind) == sum(
            j["result"][1] or 0 for j in mine)


PROMPT = random_tokens(7, "disk", 64, 512)


def kv_on_disk(h: Harness) -> None:
    """A prompt computed once, cascaded to fs and evicted from the small CPU
    tier by others; then asked again ("again"): vLLM promotes it from fs
    before loading it (on every release: it is a new request)."""
    h.add_request("first", PROMPT, max_tokens=2)
    h.run_until_idle(300)
    for i in range(3):
        h.add_request(f"filler{i}", 64, max_tokens=2)
        h.run_until_idle(300)
    h.evict_gpu_prefix_cache()
    h.add_request("again", PROMPT, max_tokens=2)


def test_a_request_whose_kv_is_on_disk_waits_for_its_promotion_in_its_trace(observe):
    with tier_journal() as journal, Harness(HarnessConfig(num_ranks=2, tier="fs",
                                                          num_cpu_chunks=8)) as h:
        kv_on_disk(h)
        h.run_until_idle(300)
    current_pipeline().flush()
    promotions = {j: x for j, x in journal.items() if x["promotion"] and x["req"] == "again"}
    assert promotions, journal
    spans = [view(s) for s in observe.spans()]
    tier = tier_spans(spans)
    (root,) = [s for s in spans if s.name == "kv.request" and s.attrs["kvobs.request.id"]
               == "again"]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    for job_id in promotions:
        assert tier[job_id].trace_id == root.trace_id
        assert tier[job_id].attrs["kvobs.outcome"] == "ok"
    (wait,) = [s for s in trace if s.name == "kv.wait"]
    assert "promotion" in wait.attrs["kvobs.wait.reasons"] and wait.attrs["kvobs.wait.passes"] >= 1
    assert wait.attrs["kvobs.tier.indexes"] == [0]
    # The wait covers the promotion; the GPU <- CPU load follows it.
    first = min(tier[j].start_ns for j in promotions)
    assert wait.start_ns <= first and wait.end_ns >= max(tier[j].end_ns for j in promotions)
    loads = [s for s in trace if s.name == "kv.job" and s.attrs["kvobs.job.kind"] == "load"]
    assert loads and min(s.start_ns for s in loads) >= wait.end_ns


def faulty_run(fault: dict, workload=pressure_workload, steps_after=None):
    with tier_journal() as journal, Harness(HarnessConfig(
            num_ranks=2, tier="fs", num_cpu_chunks=8 if workload is kv_on_disk else 16,
            tier_config={**FAULTY, "fault": fault})) as h:
        workload(h)
        if steps_after is not None:
            steps_after(h, journal)
        h.run_until_idle(3000)
        tier = h.scheduler.connector.connector_scheduler.manager.secondary_tiers[0]
        faulted = dict(tier.faulted)
    current_pipeline().flush()
    return journal, faulted


def test_a_failed_promotion_is_an_error_span_and_the_request_recomputes(observe):
    journal, faulted = faulty_run({"kind": "promotion", "mode": "fail"}, kv_on_disk)
    failed = {j for j, mode in faulted.items() if mode == "fail"}
    assert failed and all(journal[j]["result"][0] is False for j in failed)
    spans = [view(s) for s in observe.spans()]
    tier = tier_spans(spans)
    (root,) = [s for s in spans if s.name == "kv.request" and s.attrs["kvobs.request.id"]
               == "again"]
    for j in failed:
        assert tier[j].error and tier[j].attrs["kvobs.outcome"] == "failed"
        assert tier[j].trace_id == root.trace_id
    assert observe.metric_total("kvobs.tier.jobs", kind="promotion",
                                outcome="failed") == len(failed)
    # Nothing came back from the tier: vLLM loaded nothing for it.
    assert not [s for s in spans if s.trace_id == root.trace_id and s.name == "kv.job"
                and s.attrs["kvobs.job.kind"] == "load"]


def test_a_failed_promotion_of_a_preempted_request_is_a_recomputed_episode(observe):
    if not RELEASE.series >= (0, 34):
        pytest.skip("vLLM < 0.34's fs tier never promotes a preempted request's own prompt "
                    "(it keeps its first 'absent' answer)")
    journal, faulted = faulty_run({"kind": "promotion", "mode": "fail"})
    failed = {j for j, mode in faulted.items() if mode == "fail"}
    assert failed and all(journal[j]["result"][0] is False for j in failed)
    spans = [view(s) for s in observe.spans()]
    eps = [s for s in spans if s.name == "kv.recovery"
           and set(s.attrs.get("kvobs.tier.job_ids", ())) & failed]
    assert eps
    for ep in eps:
        assert ep.attrs["kvobs.outcome"] == "recomputed"
        assert ep.attrs["kvobs.recompute.reason"] == "promotion_failed"
    assert observe.metric_total("kvobs.recovery.episodes", outcome="recomputed") >= len(eps)


def test_an_episode_restored_through_a_promotion_says_which_tier_its_tokens_came_from(observe):
    if not RELEASE.series >= (0, 34):
        pytest.skip("vLLM < 0.34's fs tier never promotes a preempted request's own prompt")
    with tier_journal() as journal:
        spans = pressure_spans(observe, 8)
    promoted = [s for s in spans if s.name == "kv.recovery"
                and s.attrs.get("kvobs.tier.promoted_chunks")]
    assert promoted, "the workload must restore an episode through a promotion"
    for ep in promoted:
        # Its promotions vLLM finished while the episode was open. (On 0.34
        # results come on vLLM's tier-poll thread: one that lands between a
        # rank's first compute and the scheduler hearing of it may count.)
        mine = [j for j in ep.attrs["kvobs.tier.job_ids"] if journal[j]["promotion"]
                and journal[j]["result"][0]]
        before = sum(journal[j]["chunks"] for j in mine
                     if journal[j]["finished_ns"] <= ep.end_ns)
        chunks = ep.attrs["kvobs.tier.promoted_chunks"]
        assert before <= chunks, (before, chunks)
        if not ep.attrs.get("kvobs.tier.job_ids.dropped"):  # (a long list is capped)
            assert chunks <= sum(journal[j]["chunks"] for j in mine), (before, chunks)
        restored = ep.attrs.get("kvobs.tokens.restored", 0)
        if not restored:  # promoted, then recomputed all the same: nothing by tier
            assert "kvobs.tokens.restored.by_tier" not in ep.attrs, ep.attrs
            continue
        by_tier = ep.attrs["kvobs.tokens.restored.by_tier"]
        assert by_tier == [min(restored, chunks * 16)]  # 16-token blocks, one per chunk
        assert ep.attrs["kvobs.tokens.restored.cpu"] == restored - by_tier[0]
    assert observe.metric_total("kvobs.recovery.tokens.restored", tier="fs") == sum(
        ep.attrs.get("kvobs.tokens.restored.by_tier", [0])[0] for ep in promoted)


def test_a_hung_promotion_is_an_error_while_it_hangs(observe):
    seen: dict[str, object] = {}

    def while_hung(h, journal):
        # The engine keeps stepping while the promotion hangs (vLLM's request
        # waits for it): the ERROR span must come now, not at shutdown.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "span" not in seen:
            h.step()
            current_pipeline().drain_once()
            hung = [view(s) for s in observe.spans("kv.tier.job")
                    if s.attributes.get("kvobs.outcome") == "hung"]
            if hung:
                seen["span"] = hung[0]
                seen["result"] = journal[hung[0].attrs["kvobs.tier.job.id"]]["result"]
            time.sleep(0.05)
        # Then until the tier answers (late), and vLLM carries on.
        while time.monotonic() < deadline and "span" in seen and journal[
                seen["span"].attrs["kvobs.tier.job.id"]]["result"] is None:
            h.step()
            time.sleep(0.02)

    journal, faulted = faulty_run({"kind": "promotion", "mode": "hang", "delay_s": 3.0,
                                   "count": 1}, kv_on_disk, steps_after=while_hung)
    assert "span" in seen, f"no hung tier job reported (faulted: {faulted})"
    span = seen["span"]
    assert seen["result"] is None  # vLLM still had no result for it
    assert span.error and span.attrs["kvobs.tier.type"] == "FaultyFsTier"
    assert span.attrs["kvobs.request.id"] == "again"
    assert faulted[span.attrs["kvobs.tier.job.id"]] == "hang"
    assert observe.metric_total("kvobs.tier.jobs", tier="FaultyFsTier", kind="promotion",
                                outcome="hung") == 1
    # Its request, told "not yet" all along, is counted as stalled (by the
    # main reason of its wait), beside the job.
    assert observe.metric_total("kvobs.waits.stalled", reason="promotion") == 1
    assert observe.metric_total("kvobs.waits.stalled", reason="lookup") == 0
    # The late result is counted, not a second span.
    assert [s.attributes["kvobs.tier.job.id"] for s in observe.spans("kv.tier.job")].count(
        span.attrs["kvobs.tier.job.id"]) == 1


def test_tiers_whose_classes_changed_are_refused_and_gpu_cpu_tracing_goes_on(
        observe, monkeypatch):
    # As if vLLM renamed a parameter of its tracker hook: the tier seams no
    # longer fit this vLLM, and must not be attached.
    def on_job_finished(self, job_metadata, job_result):
        return original(self, job_metadata, job_result)

    original = TieringMetricsTracker.on_job_finished
    monkeypatch.setattr(TieringMetricsTracker, "on_job_finished", on_job_finished)
    monkeypatch.setattr(releases.shape, "_PART_CHECKED", {})
    with Harness(HarnessConfig(num_ranks=2, tier="fs", num_cpu_chunks=16)) as h:
        pressure_workload(h)
        h.run_until_idle(2000)
        manager = h.scheduler.connector.connector_scheduler.manager
        assert "on_job_finished" not in vars(manager._metrics)  # untouched
    current_pipeline().flush()
    assert not observe.spans("kv.tier.job")
    assert observe.spans("kv.recovery") and observe.spans("kv.transfer")
    assert observe.metric_total("kvobs.host.refused", reason="vllm_tier_shape_changed") == 1


def test_a_failed_cascade_is_an_error_span_and_counted(observe):
    journal, faulted = faulty_run({"kind": "cascade", "mode": "fail", "count": 3})
    failed = {j for j, mode in faulted.items() if mode == "fail"}
    assert len(failed) == 3 and all(journal[j]["result"][0] is False for j in failed)
    tier = tier_spans([view(s) for s in observe.spans()])
    for j in failed:
        assert tier[j].error and tier[j].attrs["kvobs.tier.job.kind"] == "cascade"
        assert tier[j].attrs["kvobs.outcome"] == "failed"
    assert observe.metric_total("kvobs.tier.jobs", kind="cascade", outcome="failed") == 3


BACKPRESSURE = {
    # vLLM's own detector and policy, with water marks any store exceeds: on
    # after the first cascade, then every cascade is dropped.
    "backpressure_cls": "vllm.v1.kv_offload.tiering.backpressure.EMABackpressureDetector",
    "policy_cls": "vllm.v1.kv_offload.tiering.backpressure.DropStorePolicy",
    "high_water_s": 1e-12, "low_water_s": 1e-13, "warmup_completions": 1,
    "decay_half_life_s": 3600.0}


def test_cascades_back_pressure_drops_are_counted_where_vllm_dropped_them(observe):
    with tier_journal() as journal:
        spans = pressure_spans(observe, 16, tier_config={"backpressure": BACKPRESSURE})
    assert journal.skipped, "vLLM's back-pressure must drop cascades in this run"
    assert observe.metric_total("kvobs.tier.cascade.skipped", tier="fs") == sum(journal.skipped)
    assert observe.metric_total("kvobs.tier.backpressure", tier="fs") == 1
    # Only the cascades vLLM submitted are spans.
    assert len(tier_spans(spans)) == len(journal)


def test_a_promotion_without_a_free_cpu_chunk_is_counted_on_its_tier_and_request(observe):
    """vLLM reports a promotion the CPU tier had no room for through an
    argument-less tracker call; which tier and request it was must still reach
    the metric and the episode (judged against vLLM's own _initiate_promotion
    returning False, recorded at the class)."""
    if not RELEASE.series >= (0, 34):
        pytest.skip("vLLM < 0.34's fs tier never promotes a preempted request's own prompt")
    failed: list[tuple[int, str]] = []
    initiate = TieringOffloadingManager._initiate_promotion

    def _initiate_promotion(self, tier_idx, key, req_context):
        started = initiate(self, tier_idx, key, req_context)
        if not started:
            failed.append((tier_idx, req_context.req_id))
        return started

    TieringOffloadingManager._initiate_promotion = _initiate_promotion
    try:
        pressure_spans(observe, 6)
    finally:
        TieringOffloadingManager._initiate_promotion = initiate
    assert failed, "the CPU tier must run out of room for a promotion in this run"
    assert observe.metric_total("kvobs.tier.promotion.no_room", tier="fs") == len(failed)
    assert observe.metric_total("kvobs.observer.errors", stage="seam") == 0
    marked = [s for s in observe.spans("kv.recovery")
              if any(e.name == "kv.tier.no_room" for e in s.events)]
    assert marked
    for ep in marked:
        assert ep.attributes["kvobs.request.id"] in {r for _t, r in failed}
        for e in ep.events:
            if e.name == "kv.tier.no_room":
                assert (e.attributes["kvobs.tier.index"], e.attributes["kvobs.tier.type"]) \
                    == (0, "fs")


def test_a_recompute_of_kv_a_tier_holds_but_never_gave_back_says_not_found(observe):
    # vLLM 0.32/0.33: the fs tier keeps a request's first "absent" answer, so
    # a preempted request's own prompt, cascaded to fs meanwhile, is never
    # found there. 0.34 promotes it. Either way the trace must say what happened.
    spans = pressure_spans(observe, 8)
    recomputed = [s for s in spans if s.name == "kv.recovery"
                  and s.attrs.get("kvobs.tokens.recomputed")]
    assert recomputed
    for ep in recomputed:
        reason = ep.attrs.get("kvobs.recompute.reason")
        if ep.attrs.get("kvobs.tier.promoted_chunks"):
            continue  # promoted (0.34): not this case
        cascaded = [s for s in spans if s.name == "kv.tier.job"
                    and s.attrs["kvobs.request.id"] == ep.attrs["kvobs.request.id"]
                    and s.attrs["kvobs.tier.job.kind"] == "cascade"
                    and s.attrs["kvobs.outcome"] == "ok" and s.end_ns <= ep.end_ns]
        if cascaded:
            assert reason in ("not_found", "promotion_allocation_failed", "cascade_dropped",
                              "cascade_failed"), ep.attrs
    if RELEASE.series < (0, 34):
        assert any(ep.attrs.get("kvobs.recompute.reason") == "not_found" for ep in recomputed)


def test_a_slow_promotion_shows_the_time_it_waited_beside_its_io(observe_patient_tiers):
    observe = observe_patient_tiers
    # The fs tier's read is done in its own time; its result is held 0.5 s
    # more (FaultyFsTier "slow"): the span covers the wait, the tier's own I/O
    # time stays what vLLM measured, and the request's wait covers both.
    journal, faulted = faulty_run({"kind": "promotion", "mode": "slow", "delay_s": 0.5,
                                   "count": 1}, kv_on_disk)
    (slow,) = [j for j, mode in faulted.items() if mode == "slow"]
    assert journal[slow]["result"][0] is True
    spans = [view(s) for s in observe.spans()]
    span = tier_spans(spans)[slow]
    assert span.attrs["kvobs.outcome"] == "ok" and not span.error
    took = (span.end_ns - span.start_ns) / 1e9
    assert took >= 0.5 > span.attrs["kvobs.tier.io.duration_s"]
    (wait,) = [s for s in spans if s.name == "kv.wait" and s.trace_id == span.trace_id
               and "promotion" in s.attrs["kvobs.wait.reasons"]]
    assert wait.start_ns <= span.start_ns and wait.end_ns >= span.end_ns
