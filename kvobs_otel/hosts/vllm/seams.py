"""What each seam records, per connector role.

Serving-path rules: read what vLLM already computed, build one compact tuple,
``offer`` it to the bounded buffer, return. Every recording step sits in a
``try`` so an observer bug is counted and never reaches vLLM; vLLM's own
exceptions are never caught here (the wrappers call vLLM outside the ``try``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvobs_otel import identity
from kvobs_otel.config import Settings
from kvobs_otel.hosts.platform import device_type, vllm_version
from kvobs_otel.hosts.vllm.releases import Release
from kvobs_otel.hosts.vllm.releases import blocks as _blocks
from kvobs_otel.hosts.vllm.tier_seams import TierSeams, describe, tiering_manager
from kvobs_otel.lifecycle import events as ev
from kvobs_otel.lifecycle.events import COMPUTE_DECODE, COMPUTE_PREFILL
from kvobs_otel.lifecycle.scheduler_state import SchedulerLifecycle
from kvobs_otel.lifecycle.worker_state import WorkerLifecycle
from kvobs_otel.pipeline import Pipeline
from kvobs_otel.telemetry import attributes as A

logger = logging.getLogger("kvobs_otel")
_now = time.monotonic_ns
_MARK_MASK = ev.MARK_EVERY_STEPS - 1


def _adapter(connector: Any) -> str:
    module = type(connector).__module__
    return "vllm-ascend" if module.startswith("vllm_ascend") else "vllm"


def _resource(connector: Any, settings: Settings, role: str, **extra: Any) -> dict[str, Any]:
    cfg = getattr(connector, "_vllm_config", None)
    ktc = getattr(cfg, "kv_transfer_config", None)
    attrs = {
        A.RES_ROLE: role,
        A.RES_ENGINE: getattr(ktc, "engine_id", None),
        A.RES_DEVICE: device_type(settings),
        A.RES_VLLM_VERSION: vllm_version(),
        A.RES_HOST_ADAPTER: _adapter(connector),
    }
    attrs.update(extra)
    return attrs


def _tokens_per_chunk(connector: Any) -> int | None:
    """Tokens one offloaded chunk holds (the first KV cache group's; vLLM's
    SchedulerOffloadConfig in offloading/scheduler.py), or None."""
    try:
        groups = connector.connector_scheduler.config.kv_group_configs
        return int(groups[0].tokens_per_chunk) if groups else None
    except Exception:
        return None


# vllm/v1/request.py RequestStatus: how the request ended.
_FINISH_STATUS = {"FINISHED_ABORTED": ev.FINISHED_ABORTED, "FINISHED_ERROR": ev.FINISHED_ERROR}


# id(SchedulerOutput) -> (that SchedulerOutput, [(SchedulerSeams, admitted),
# ...]): the steps that re-admitted requests, until their output reaches
# Scheduler.update_from_output (instrumentor.py). Holding the object keeps its
# id from being reused; a few steps are in flight at most (vLLM's batch
# queue), more only when a step's output never comes (a failed engine step):
# the oldest is let go, and its episodes stay open until the receipt deadline
# reports them.
AWAITING: dict[int, tuple[Any, list[tuple[Any, dict[str, tuple[int, str]]]]]] = {}
_MAX_AWAITING = 64


def awaiting_output(so: Any, seams: Any, admitted: dict[str, tuple[int, str]]) -> None:
    entry = AWAITING.get(id(so))
    if entry is not None:
        entry[1].append((seams, admitted))  # another connector of a MultiConnector
        return
    if len(AWAITING) >= _MAX_AWAITING:
        del AWAITING[next(iter(AWAITING))]
    AWAITING[id(so)] = (so, [(seams, admitted)])


class SchedulerSeams:
    """Scheduler role: job creation, preemption, admission, receipts."""

    def __init__(self, connector: Any, settings: Settings, pipeline: Pipeline,
                 release: Release) -> None:
        cfg = connector._vllm_config
        self.gen = identity.new_generation()
        self.load_row = release.load_row
        world = int(cfg.parallel_config.world_size)
        self.pipeline = pipeline
        # Engine steps (schedule() calls): the receipt deadline only runs out
        # while the engine steps (scheduler_state.py).
        self.steps = 0
        manager = tiering_manager(connector)
        tiers, refused = None, False
        if manager is not None:
            problems = release.tier_problems()
            if problems:
                # GPU <-> CPU tracing goes on; the tiers stay untraced, said once.
                logger.warning("kvobs-otel: vLLM's secondary tiers are not traced: its tiering "
                               "classes differ from the %s seams: %s", release.name,
                               "; ".join(problems))
                manager, refused = None, True
            else:
                tiers = [describe(t) for t in manager.secondary_tiers]
        # The lifecycle is made where the events are exported (a sidecar by
        # default): described here, by a class and plain values.
        self.consumer = pipeline.register(
            (SchedulerLifecycle, {"sched_gen": self.gen, "world_size": world,
                                  "deadline_s": settings.receipt_deadline_s, "tiers": tiers,
                                  "tiers_refused": refused,
                                  "tier_deadline_s": settings.tier_deadline_s,
                                  "tokens_per_chunk": _tokens_per_chunk(connector)}),
            _resource(connector, settings, "scheduler"), progress=lambda: self.steps)
        self.offer = pipeline.offer
        self.tier_seams = (TierSeams(manager, self.offer, self.consumer, pipeline.count_error)
                           if manager is not None else None)
        # req_id -> scheduling passes the connector answered "not yet" (None).
        self.waits: dict[str, int] = {}
        # req_id -> Request: read num_preemptions when it is preempted.
        self.requests: dict[str, Any] = {}
        # req_id -> epoch of an episode whose request is not yet re-admitted.
        self.open: dict[str, int] = {}
        # Preempted requests vLLM allocated for in this scheduling pass
        # (update_state_after_alloc): the only ones this step can re-admit.
        self.ready: list[str] = []
        # req_id -> computed tokens the preemption discards (read just before
        # vLLM zeroes them), until the step that reports the preemption.
        self.discarded: dict[str, int] = {}
        # req_id -> tokens the connector will load from the host tier for an
        # open episode (update_state_after_alloc), until its admission.
        self.restored: dict[str, int] = {}
        # Inside vLLM's MultiConnector: req_id -> tokens every connector
        # together will load for an open episode, until its admission (the
        # others' = this minus restored). ``composed``: a MultiConnector child.
        self.external: dict[str, int] = {}
        self.composed = False

    def on_preempt(self, request: Any, composed: bool = False) -> None:
        try:
            r = request.request_id
            self.discarded[r] = request.num_computed_tokens
            self.restored.pop(r, None)
            self.external.pop(r, None)
            self.composed = self.composed or composed
        except Exception:
            self.pipeline.count_error("seam")

    def after_alloc_composed(self, request: Any, num_external_tokens: int) -> None:
        """After MultiConnector.update_state_after_alloc, for a preempted
        request: what all its connectors bring back (summed, as restored)."""
        try:
            r = request.request_id
            self.external[r] = self.external.get(r, 0) + int(num_external_tokens)
            self.composed = True
        except Exception:
            self.pipeline.count_error("seam")

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """vLLM allocated for a request it once preempted (instrumentor.py
        tests num_preemptions): the scheduler moves a request from waiting to
        running only after this call (vllm/v1/core/sched/scheduler.py, also
        after an async load, with 0 external tokens), so only such a request
        can be re-admitted this step. Its re-admission may be planned in the
        very step that reports its preemption: not yet among the open
        episodes here, checked against them in after_build_meta."""
        try:
            r = request.request_id
            self.ready.append(r)
            if num_external_tokens:
                self.restored[r] = self.restored.get(r, 0) + int(num_external_tokens)
        except Exception:
            self.pipeline.count_error("seam")

    def on_wait(self, r: str) -> None:
        """The connector answered "not yet" (None) for a request that was not
        waiting (get_num_new_matched_tokens, instrumentor.py)."""
        try:
            self.waits[r] = 1
            self.offer((self.consumer, ev.S_WAIT, _now(), r))
        except Exception:
            self.pipeline.count_error("seam")

    def on_wait_end(self, r: str) -> None:
        """It answered a waiting request."""
        try:
            self.offer((self.consumer, ev.S_WAIT_END, _now(), r, self.waits.pop(r), True))
        except Exception:
            self.pipeline.count_error("seam")

    def on_new_request(self, request: Any) -> None:
        try:
            self.requests[request.request_id] = request
            headers = request.trace_headers
            if headers:
                tp = headers.get("traceparent")
                if tp:
                    self.offer((self.consumer, ev.S_REQUEST, _now(), request.request_id, str(tp)))
        except Exception:
            self.pipeline.count_error("seam")

    def after_build_meta(self, so: Any, meta: Any) -> None:
        self.steps = steps = self.steps + 1
        try:
            # (a local: an instance attribute holding a callable is looked up
            # generically by a method-call site, every time)
            offer = self.offer
            if not steps & _MARK_MASK:
                offer((self.consumer, ev.S_MARK, _now(), steps))
            loads, stores, flushed = meta.load_jobs, meta.store_jobs, meta.jobs_to_flush
            preempted_ids, ready = so.preempted_req_ids, self.ready
            if not (preempted_ids or ready or loads or stores or flushed):
                # An idle step: nothing for the workers (vLLM's metadata keeps
                # the class default, None) or the drain thread.
                return
            open_ = self.open
            # (list comprehensions, not tuple(generator): about half the cost)
            episodes: dict[str, int] = {}
            preempted: tuple[tuple[str, int], ...] = ()
            if preempted_ids:
                reqs, discarded = self.requests, self.discarded
                preempted = tuple([(r, reqs[r].num_preemptions, discarded.pop(r, None))
                                   for r in preempted_ids if r in reqs])
                for r, epoch, _d in preempted:
                    open_[r] = episodes[r] = epoch
            admitted: dict[str, tuple[int, str]] = {}
            if ready:
                # A request with an open episode was preempted and not yet
                # re-admitted: if this step schedules tokens for it, this step
                # resumes it (the V2 runner sends it in scheduled_new_reqs, V1
                # in resumed_req_ids; vLLM unschedules a request it preempts
                # within the same step).
                n = so.num_scheduled_tokens
                for r in ready:
                    epoch = open_.get(r)
                    if epoch is not None:
                        tokens = n.get(r)
                        if tokens:
                            # All KV back: only the next token is computed.
                            admitted[r] = (epoch, COMPUTE_DECODE if tokens == 1
                                           else COMPUTE_PREFILL)
                ready.clear()
                for r, (epoch, _k) in admitted.items():
                    episodes[r] = epoch
                    del open_[r]
            if loads and open_:
                for job in loads.values():
                    epoch = open_.get(job.req_id)
                    if epoch is not None:
                        episodes[job.req_id] = epoch
            if not (preempted or loads or stores or flushed or admitted):
                return
            load_row = self.load_row
            load_rows = tuple([load_row(j, x) for j, x in loads.items()]) if loads else ()
            store_rows = tuple([(j, x.req_id, _blocks(x.src_spec), _blocks(x.dst_spec))
                                for j, x in stores.items()]) if stores else ()
            flushed = tuple(flushed) if flushed else ()
            # The workers get the same rows (every rank would build them):
            # loads with their device blocks, stores with theirs.
            meta.kvobs_step = (self.gen, episodes, admitted, load_rows, store_rows, flushed)
            if admitted:
                awaiting_output(so, self, admitted)
            offer((self.consumer, ev.S_STEP, _now(), steps, preempted, load_rows,
                   store_rows, flushed, self._accounted(admitted) if admitted else ()))
        except Exception:
            self.pipeline.count_error("seam")

    def _accounted(self, admitted: dict[str, tuple[int, str]]) -> tuple[tuple[Any, ...], ...]:
        # Before vLLM adds this step's tokens: what the request already holds
        # on the device (prefix-cache hit + what the host tier restored +
        # what other connectors of a MultiConnector brought).
        reqs, rows = self.requests, []
        for r, (e, k) in admitted.items():
            ours = self.restored.pop(r, 0)
            total = self.external.pop(r, None)
            other = (None if not self.composed
                     else ev.OTHER_UNKNOWN if total is None else max(0, total - ours))
            rows.append((r, e, k, reqs[r].num_computed_tokens if r in reqs else None, ours,
                         other))
        return tuple(rows)

    def on_receipts(self, reporters: Any) -> None:
        """The ranks' receipts on vLLM's aggregated worker metadata (called
        only when it carries some)."""
        try:
            offer = self.offer
            offer((self.consumer, ev.S_RECEIPTS, _now(), self.steps, reporters))
        except Exception:
            self.pipeline.count_error("seam")

    def on_step_output(self, admitted: dict[str, tuple[int, str]]) -> None:
        """The output of a step that re-admitted requests reached the
        scheduler: with a KV connector vLLM's executor waits for every rank's
        output of a step (vllm/v1/executor/multiproc_executor.py
        collective_rpc, its KVOutputAggregator), so every rank has run that
        step's forward, the first compute of each of them."""
        try:
            offer = self.offer
            offer((self.consumer, ev.S_COMPUTED, _now(), self.steps, admitted))
        except Exception:
            self.pipeline.count_error("seam")

    def on_request_finished(self, request: Any, *_ignored: Any) -> None:
        try:
            r = request.request_id
            self.requests.pop(r, None)
            self.open.pop(r, None)
            self.discarded.pop(r, None)
            self.restored.pop(r, None)
            self.external.pop(r, None)
            passes = self.waits.pop(r, None)
            if passes is not None:
                self.offer((self.consumer, ev.S_WAIT_END, _now(), r, passes, False))
            self.offer((self.consumer, ev.S_FINISHED, _now(), r,
                        _FINISH_STATUS.get(getattr(request.status, "name", ""), ev.FINISHED_OK)))
        except Exception:
            self.pipeline.count_error("seam")

    def on_reset_cache(self) -> None:
        try:
            self.offer((self.consumer, ev.S_RESET, _now()))
        except Exception:
            self.pipeline.count_error("seam")

    def on_shutdown(self) -> None:
        try:
            self.offer((self.consumer, ev.S_SHUTDOWN, _now()))
            self.pipeline.close_observer(self.consumer)
        except Exception:
            self.pipeline.count_error("shutdown")

    def unwrap(self) -> None:
        if self.tier_seams is not None:
            self.tier_seams.unwrap()
            self.tier_seams = None


class WorkerSeams:
    """Worker role: submissions, results, receipts, first compute."""

    def __init__(self, connector: Any, settings: Settings, pipeline: Pipeline,
                 release: Release) -> None:
        pc = connector._vllm_config.parallel_config
        self.failed_jobs = release.failed_jobs
        self.rank = int(pc.rank)
        tp = max(1, int(pc.tensor_parallel_size))
        self.gen = identity.new_generation()
        self.pipeline = pipeline
        self.consumer = pipeline.register(
            (WorkerLifecycle, {"rank": self.rank, "worker_gen": self.gen}),
            _resource(connector, settings, "worker", **{
                A.RES_RANK: self.rank, A.RES_TP_RANK: self.rank % tp,
                A.RES_PP_RANK: self.rank // tp,
                A.RES_DP_RANK: int(getattr(pc, "data_parallel_rank", 0) or 0),
                A.WORKER_GEN: self.gen}))
        self.offer = pipeline.offer
        # The step extension note_step saw last (ours, not vLLM's metadata:
        # holding that would keep the whole step's objects alive a step longer).
        self.last_step: Any = None
        # (bind_ns, step extension) of steps that admitted requests, their
        # first computes confirmed when the step's worker metadata is built
        # (after its forward).
        self.pending: list[tuple[int, Any]] = []

    # -- per step ---------------------------------------------------------------
    # instrumentor.py calls these from bind_connector_metadata (a step that
    # carries the scheduler's extension) and build_connector_worker_meta (a
    # step vLLM reports something in or with an admission); the
    # OffloadingWorker's calls are observed below. A step of an admitted
    # request runs a forward: the scheduler scheduled its tokens (that is how
    # it was found admitted, SchedulerSeams.after_build_meta), and a runner
    # skips the forward only for a step without tokens. Both runners build the
    # worker metadata after the step's forward and wait_for_save (V2's
    # post_forward, V1's _get_kv_connector_output), so that is when the first
    # compute is confirmed.
    def note_step(self, step: Any) -> None:
        """First sight of this step's extension (``step`` is not ``last_step``):
        offered as the scheduler built it (metadata.py), read on the drain
        side."""
        try:
            self.last_step = step
            t = _now()
            if step[2]:  # admitted
                self.pending.append((t, step))
            if step[3] or step[4] or step[5]:  # loads, stores, flushed
                offer = self.offer
                offer((self.consumer, ev.W_STEP, t, step))
        except Exception:
            self.pipeline.count_error("seam")

    def worker_meta(self, meta: Any) -> None:
        """Record this step's first computes (its forward has run) and attach
        who reported to vLLM's worker metadata (its fields untouched); called
        when vLLM has some or a first compute is pending."""
        try:
            pending = self.pending
            if pending:
                t, offer, consumer = _now(), self.offer, self.consumer
                for bind_ns, step in pending:
                    offer((consumer, ev.W_FIRST_COMPUTE, t, bind_ns, step[0], step[2]))
                pending.clear()
            if meta is not None:
                completed = meta.completed_jobs
                if completed:
                    # vLLM's own dict and set, not copies: pickled with
                    # vLLM's fields, they cost a reference (vLLM hands this
                    # object over and starts a new one; nothing writes them
                    # after).
                    meta.kvobs_receipts = ((self.rank, self.gen, completed,
                                            self.failed_jobs(meta)),)
        except Exception:
            self.pipeline.count_error("seam")

    # -- the OffloadingWorker's calls (instrumentor.py watches its class) ----------------
    def on_submit(self, t: int, job_id: int, is_load: bool, ok: Any, expedited: Any) -> None:
        try:
            offer = self.offer
            offer((self.consumer, ev.W_SUBMIT, t, job_id, is_load, bool(ok), bool(expedited)))
        except Exception:
            self.pipeline.count_error("seam")

    def on_results(self, results: Any) -> None:
        """TransferResults the worker returned (called only when it has some)."""
        try:
            t, offer, consumer = _now(), self.offer, self.consumer
            for r in results:
                offer((consumer, ev.W_RESULT, t, r.job_id, bool(r.success), r.transfer_size,
                       r.transfer_time))
        except Exception:
            self.pipeline.count_error("seam")

    def on_shutdown(self) -> None:
        try:
            self.offer((self.consumer, ev.W_SHUTDOWN, _now()))
            self.pipeline.close_observer(self.consumer)
        except Exception:
            self.pipeline.count_error("shutdown")
