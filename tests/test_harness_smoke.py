"""Smoke tests of the real-vLLM CPU harness (kvobs_otel.tools.harness).

They drive the installed vLLM's (0.32, 0.33 or 0.34) real Scheduler, KV cache
manager and stock OffloadingConnector (both roles) with the harness' CPU copy
backend. Model Runner V1 cases run where vLLM still has that runner (0.32,
0.33); version facts come from kvobs_otel.tools.harness.compat.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from kvobs_otel.tools.harness import (
    Harness,
    HarnessConfig,
    compat,
    make_prompts,
    pressure_workload,
)
from kvobs_otel.tools.harness.rank_process import RankProcessError  # noqa: E402

pytestmark = pytest.mark.vllm

NUM_RANKS = 2

# Model Runner V1 was removed in vLLM 0.34.
RUNNERS = [
    pytest.param(
        runner,
        marks=pytest.mark.skipif(
            runner not in compat.available_model_runners(),
            reason=f"vLLM {compat.vllm_version()} has no Model Runner V1",
        ),
    )
    for runner in ("v1", "v2")
]


def _run_pressure(**overrides) -> Harness:
    """A harness that has run the pressure workload to completion."""
    cfg = HarnessConfig(num_ranks=NUM_RANKS, record_transfers=True, **overrides)
    h = Harness(cfg)
    try:
        pressure_workload(h)
        h.run_until_idle(max_steps=1000)
    except BaseException:
        h.close()
        raise
    return h


def _failed_job_ids(h: Harness) -> set[int]:
    return {job_id for rank in range(NUM_RANKS) for job_id in h.rank_call(rank, "failed_job_ids")}


def _restores_read_what_was_stored(h: Harness, rank: int) -> int:
    """Every restore copied back exactly the bytes last stored into its host
    slots, and never bytes of a store that failed (on any rank: vLLM drops
    such chunks). Returns the rows compared."""
    log = h.rank_call(rank, "transfer_log")
    failed = _failed_job_ids(h)
    restore_ids = {j.job_id for j in h.restore_jobs}
    compared = 0
    for i, rec in enumerate(log):
        if rec.kind != "load" or rec.job_id not in restore_ids or rec.failed:
            continue
        for seg in rec.segments:
            for row, slot in enumerate(seg.host_slots):
                last_store = next(
                    (
                        (prev.job_id, prev_seg.data[prev_seg.host_slots.index(slot)])
                        for prev in reversed(log[:i])
                        if prev.kind == "store"
                        for prev_seg in prev.segments
                        if prev_seg.tensor_idx == seg.tensor_idx and slot in prev_seg.host_slots
                    ),
                    None,
                )
                assert last_store is not None, f"rank {rank}: slot {slot} loaded, never stored"
                job_id, stored = last_store
                assert job_id not in failed, f"rank {rank}: restore read failed store {job_id}"
                assert torch.equal(seg.data[row], stored)
                compared += 1
    return compared



def test_stores_copy_bytes_and_complete():
    cfg = HarnessConfig(num_ranks=NUM_RANKS, record_transfers=True)
    with Harness(cfg) as h:
        prompts = make_prompts(2, 40, seed=1, shared_prefix_len=16)
        for i, prompt in enumerate(prompts):
            h.add_request(f"s{i}", prompt, max_tokens=6)
        records = h.run_until_idle(max_steps=200)
        stores = [j for j in h.jobs if j.kind == "store"]
        assert stores, "no store job was created"
        # The scheduler saw every rank's completion of every store job.
        reports: dict[int, int] = {}
        for rec in records:
            kv_out = rec.model_output.kv_connector_output if rec.model_output else None
            meta = kv_out.kv_connector_worker_meta if kv_out else None
            for job_id, n in (meta.completed_jobs if meta else {}).items():
                reports[job_id] = reports.get(job_id, 0) + n
        for job in stores:
            assert reports.get(job.job_id) == NUM_RANKS
        assert h.pending_jobs() == {}
        # Each rank really copied the bytes into its host pool.
        for rank in range(NUM_RANKS):
            worker = h.runner(rank).offloading_worker
            by_id = {r.job_id: r for r in worker.transfer_log if r.kind == "store"}
            assert set(by_id) == {j.job_id for j in stores}
            for rec in by_id.values():
                rows = sum(len(s.host_slots) for s in rec.segments)
                assert rows > 0 and rec.transfer_size == sum(s.data.numel() for s in rec.segments)
                assert rec.transfer_time > 0
                for seg in rec.segments:
                    assert seg.data.abs().sum() > 0  # real KV bytes, not zeros
                    assert torch.equal(worker.host_rows(seg.tensor_idx, seg.host_slots), seg.data)
        # Completed stores are loadable: drop the GPU prefix cache and ask again.
        assert h.evict_gpu_prefix_cache() > 0
        h.add_request("again", prompts[0], max_tokens=2)
        h.run_until_idle(max_steps=100)
        loads = [j for j in h.jobs if j.kind == "load" and j.req_id == "again"]
        assert len(loads) == 1
        assert h.runner(0).stats.kv_checked_tokens > 0


def test_pressure_preempts_and_restores_byte_identical(reference):
    with _run_pressure() as h:
        assert h.preemptions, "no request was preempted"
        restores = h.restore_jobs
        assert restores, "no preempted request was restored from CPU"
        for rank in range(NUM_RANKS):
            assert _restores_read_what_was_stored(h, rank) > 0
            # The restored blocks hold exactly what the model had written.
            assert h.runner(rank).stats.kv_checked_requests >= len(restores)
        restored = {j.req_id for j in restores}
        assert all(h.finished[r] == "length" for r in restored)
        assert h.outputs == reference


@pytest.mark.parametrize("model_runner", RUNNERS)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_runner_modes_complete(reference, model_runner, async_scheduling):
    with _run_pressure(model_runner=model_runner, async_scheduling=async_scheduling) as h:
        assert h.batch_queue_size == (2 if async_scheduling else 1)
        assert type(h.scheduler).__name__ == ("AsyncScheduler" if async_scheduling else "Scheduler")
        assert set(h.finished.values()) == {"length"}
        assert h.outputs == reference
        assert h.preemptions and h.restore_jobs
        assert h.pending_jobs() == {}
        assert h.runner(0).stats.no_forward_steps + h.runner(0).stats.forward_steps == len(
            [s for s in h.steps if s.scheduler_output is not None]
        )


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_process_mode(reference, start_method):
    h = _run_pressure(
        rank_mode="process",
        start_method=start_method,
        extra_env={"KVOBS_HARNESS_TEST": start_method},
        rank_env={1: {"KVOBS_HARNESS_RANK": "one"}},
    )
    with h:
        assert h.outputs == reference
        # A rank's own environment is in its process only, and a spawned one
        # was exec'd with it (as LD_PRELOAD needs).
        now, at_exec = h.rank_call(1, "env", "KVOBS_HARNESS_RANK")
        assert now == "one" and (at_exec == "one" or start_method == "fork")
        assert h.rank_call(0, "env", "KVOBS_HARNESS_RANK") == (None, None)
        assert h.rank_call(0, "env", "KVOBS_HARNESS_TEST")[0] == start_method
        assert "KVOBS_HARNESS_RANK" not in os.environ
        assert h.restore_jobs
        assert _restores_read_what_was_stored(h, 1) > 0
        assert h.rank_call(1, "stats")["kv_checked_requests"] >= 1
        assert h.rank_call(0, "connector_class").endswith("OffloadingConnector")
    for rank in h.ranks:
        assert rank.process.exitcode == 0


def _first_restore(h: Harness):
    """Run the pressure workload until vLLM submits its first restore."""
    pressure_workload(h)
    while not h.restore_jobs and len(h.steps) < 1000:
        h.step()
    assert h.restore_jobs
    return h.restore_jobs[0]


def test_stall_withholds_load_completions():
    cfg = HarnessConfig(num_ranks=NUM_RANKS, stall={"rank": 1, "kind": "load"})
    with Harness(cfg) as h:
        job = _first_restore(h)
        h.run(20)  # plenty of time for a CPU copy to be reported
        assert h.pending_jobs().get(job.job_id) == 1  # rank 0 reported, rank 1 never
        assert job.job_id in h.rank_call(1, "withheld_job_ids")
        assert h.rank_call(0, "withheld_job_ids") == []
        status = h.scheduler.requests[job.req_id].status
        assert status.name == "WAITING_FOR_REMOTE_KVS"


def test_stall_with_release_reports_completions_late():
    """``release_after_s``: the copy hangs that long, then is reported; the
    requests waiting on it finish."""
    release = 0.5
    cfg = HarnessConfig(num_ranks=NUM_RANKS,
                        stall={"rank": 1, "kind": "load", "release_after_s": release})
    with Harness(cfg) as h:
        job = _first_restore(h)
        t0 = time.monotonic()
        h.run(3)
        if time.monotonic() - t0 < release:  # still inside the hang
            assert h.pending_jobs().get(job.job_id) == 1
            assert job.job_id in h.rank_call(1, "withheld_job_ids")
        while job.job_id in h.pending_jobs() and time.monotonic() - t0 < 30:
            h.step()
        assert job.job_id not in h.pending_jobs()  # rank 1 reported it, late
        assert h.rank_call(1, "withheld_job_ids") == []
        # Every later restore on rank 1 hangs too: bounded by time, not steps
        # (a fast engine spins thousands of steps per hang).
        until = time.monotonic() + 120
        while h.has_work() and time.monotonic() < until:
            h.step()
        assert not h.has_work()  # every request finished


def test_preempt_evict_abort_reset_sync_loads():
    cfg = HarnessConfig(num_ranks=1, extra_config={"sync_load_budget_bytes": 1 << 30})
    with Harness(cfg) as h:
        h.add_request("d", 90, max_tokens=12)
        h.run(3)
        h.preempt("d")
        h.evict_gpu_prefix_cache()
        h.run_until_idle(max_steps=100)
        (restore,) = h.restore_jobs
        # Sync loads (TransferJob.sync) exist from vLLM 0.33; 0.32 loads async.
        assert restore.req_id == "d" and restore.sync == compat.has_sync_loads()
        assert len(h.outputs["d"]) == 12
        h.add_request("e", 50, max_tokens=100)
        h.run(3)
        h.abort("e")
        h.run_until_idle(max_steps=100)
        assert h.finished["e"] == "abort"
        assert h.reset_cache()


def test_process_rank_failure_is_reported_and_cleaned_up():
    # An invalid stall kind makes rank 1's worker fail while it starts.
    cfg = HarnessConfig(
        num_ranks=NUM_RANKS,
        rank_mode="process",
        start_method="fork",
        stall={"rank": 1, "kind": "bogus"},
    )
    with pytest.raises(RankProcessError, match="bogus"):
        Harness(cfg)
    leftovers = [p for p in mp.active_children() if p.name.startswith("kvobs-harness-rank")]
    assert leftovers == []


_LAYERS = ["wait_for_layer_load", "save_kv_layer"] * 2
_TAIL = ["wait_for_save", "get_finished", "build_connector_worker_meta", "clear_connector_metadata"]
_EXPECTED_ORDER = {
    # vllm/v1/worker/gpu/kv_connector.py ActiveKVConnector: async loads start
    # after the forward, outside the forward context, with batch kwargs.
    "v2": (
        ["handle_preemptions", "bind_connector_metadata", *_LAYERS, "finish_forward"]
        + ["start_load_kv", *_TAIL],
        ["num_tokens", "request_ids", "request_state_indices", "scheduler_output"],
        False,
    ),
    # vllm/v1/worker/kv_connector_model_runner_mixin.py: start_load_kv inside
    # the forward context, no kwargs.
    "v1": (
        ["handle_preemptions", "bind_connector_metadata", *_LAYERS, "start_load_kv", *_TAIL],
        [],
        True,
    ),
}


@pytest.mark.parametrize("model_runner", RUNNERS)
def test_connector_call_order(model_runner):
    cfg = HarnessConfig(
        num_ranks=1,
        model_runner=model_runner,
        connector="RecordingOffloadingConnector",
        connector_module_path="kvobs_otel.tools.harness.recording",
    )
    with Harness(cfg) as h:
        h.add_request("a", 40, max_tokens=2)
        h.run_until_idle(max_steps=10)
        steps: list[list[tuple]] = []
        for call in h.rank_call(0, "calls"):
            if call[0] == "handle_preemptions":
                steps.append([])
            steps[-1].append(call)
    assert [s.executed for s in h.steps] == [True, True, False]
    order, kwargs, in_forward_ctx = _EXPECTED_ORDER[model_runner]
    for step in steps[:2]:
        assert [c[0] for c in step] == order
        load = dict(step)["start_load_kv"]
        assert load == {"kwargs": kwargs, "attn_metadata": in_forward_ctx}
    # The 0-token step: no layers, and start_load_kv without request_ids.
    no_forward = [c[0] for c in steps[2]]
    assert "save_kv_layer" not in no_forward and "start_load_kv" in no_forward
    assert dict(steps[2])["start_load_kv"] == {"kwargs": [], "attn_metadata": False}
