"""Scheduler-side lifecycle: jobs, per-rank receipts, recovery episodes.

Fed with S_* events on the drain thread; hands finished records to a sink.
A receipt is complete when every expected rank reported exactly once; a job
still missing ranks ``deadline`` after creation ends as RECEIPT_INCOMPLETE,
once the engine has also taken ``STEPS_PAST_DEADLINE`` steps since then.
Ranks report finished transfers only inside engine steps: while vLLM is idle
(nothing to schedule) a finished store is reported at the next step, and a
step may be long (a first forward pass takes seconds); neither is a missing
receipt. With async scheduling a step's reports reach the scheduler up to two
schedule() calls later, hence three.

Deadlines are judged in event time (``stepped``): the host stamps its count of
schedule() calls on its step and receipt events, and the drain thread reports
(time, count) marks between them (``advance``). Events can reach this object
tens of seconds late (a starved drain thread, a sidecar behind); judged in
processing time, a job's creation and its late receipt would arrive together
and the missing receipt would never be seen. Without a step count (``stepped``
false) jobs are judged by the processing clock alone (``tick``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvobs_otel.lifecycle import events as ev
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.lifecycle.tier_state import TierLedger


class RecordSink(Protocol):
    def emit(self, record: Any) -> None: ...


@dataclass(slots=True)
class _Job:
    req_id: str
    is_store: bool
    sync: bool
    blocks: int
    start_ns: int
    host_chunks: int = 0
    received: dict[int, int] = field(default_factory=dict)  # rank -> receipt time
    failed: set[int] = field(default_factory=set)  # ranks whose transfer failed
    duplicates: int = 0
    flushed: bool = False
    epoch: int = 0
    role: str | None = None
    overdue_at: int | None = None  # engine steps when first past the deadline


@dataclass(slots=True)
class _Episode:
    epoch: int
    start_ns: int
    traceparent: str | None
    events: list[rec.EpisodeEvent] = field(default_factory=list)
    preserve_jobs: list[int] = field(default_factory=list)
    restore_jobs: list[int] = field(default_factory=list)
    open_restores: set[int] = field(default_factory=set)
    incomplete_jobs: list[int] = field(default_factory=list)
    ready_ns: int | None = None
    admitted_ns: int | None = None
    compute_kind: str | None = None
    # Every rank ran its first compute (the admitting step came back): all
    # or none, so a flag (scheduler_state._computed).
    computed: bool = False
    failed_jobs: list[int] = field(default_factory=list)
    failed_ranks: set[int] = field(default_factory=set)
    # The request ended with an error while a restore was still out: the
    # episode ends when that restore's receipts say whether it failed.
    finished_error: bool = False
    discarded: int | None = None
    held: int | None = None
    restored: int = 0
    other: int | None = None  # brought by other connectors (events.S_STEP)
    overdue_at: int | None = None  # engine steps when first past the deadline
    # Secondary tiers (tier_state.py)
    tier_jobs: list[int] = field(default_factory=list)
    failed_tier_jobs: list[int] = field(default_factory=list)
    promoted: dict[int, int] = field(default_factory=dict)  # tier -> chunks
    recompute_reason: str | None = None
    cascade_lost: str | None = None  # RECOMPUTE_CASCADE_*: a weaker explanation
    wait_end_ns: int | None = None  # the connector's answer after "not yet"


@dataclass(slots=True)
class _Request:
    start_ns: int
    traceparent: str | None
    open_jobs: int = 0  # connector and tier jobs
    jobs: int = 0
    tier_jobs: int = 0
    waits: int = 0
    cascaded: int = 0  # chunks of it a tier stored
    last_ns: int = 0
    finished: str | None = None  # ev.FINISHED_*


_ENDED_BEFORE_RESUME = {ev.FINISHED_OK: rec.FINISHED_BEFORE_RESUME,
                        ev.FINISHED_ABORTED: rec.ABORTED_BEFORE_RESUME,
                        ev.FINISHED_ERROR: rec.FINISHED_BEFORE_RESUME}


STEPS_PAST_DEADLINE = 3
# Deadlines are looked at no more often than this, in event time: a backlog
# of thousands of events must not scan the open jobs thousands of times.
JUDGE_EVERY_NS = 10_000_000


class SchedulerLifecycle:
    role = "scheduler"
    # Remember this many closed jobs so a late receipt is told from an unknown one.
    _CLOSED_MEMORY = 8192

    def __init__(self, sched_gen: str, world_size: int, deadline_s: float,
                 sink: RecordSink, stepped: bool = False,
                 tiers: list[tuple[str, str, str]] | None = None,
                 tiers_refused: bool = False, tokens_per_chunk: int | None = None,
                 tier_deadline_s: float | None = None) -> None:
        self.gen = sched_gen
        self.stepped = stepped
        self._t = 0  # event time: the newest (t, steps) mark seen
        self._steps = 0
        self._judged_t = 0
        self.world = world_size
        self.deadline_ns = int(deadline_s * 1e9)
        self.sink = sink
        self.jobs: dict[int, _Job] = {}
        self.episodes: dict[str, _Episode] = {}
        self.requests: dict[str, _Request] = {}
        self._closed: OrderedDict[int, None] = OrderedDict()
        # Secondary tiers' jobs and the connector's waits; tiers: (type,
        # medium, locality) by tier index, None when the spec has none.
        self.tier = TierLedger(self, [tuple(t) for t in tiers or ()])  # type: ignore[misc]
        # The spec has secondary tiers, but this vLLM's tiering classes do not
        # fit the tier seams: GPU <-> CPU is traced, the tiers are not.
        self.tiers_refused = tiers_refused
        self.tokens_per_chunk = tokens_per_chunk
        # Tier jobs and waits: their own deadline (None: the receipt deadline).
        self.tier_deadline_ns = (self.deadline_ns if tier_deadline_s is None
                                 else int(tier_deadline_s * 1e9))
        # Counters the metric builder reads.
        self.late_receipts = 0
        self.unknown_receipts = 0
        self.duplicate_receipts = 0

    def refusals(self) -> dict[str, int]:
        return {"vllm_tier_shape_changed": 1} if self.tiers_refused else {}

    # -- dispatch ------------------------------------------------------------
    def handle(self, event: tuple[Any, ...]) -> None:
        kind, t = event[1], event[2]
        # Deadlines first, as of this event's time: a receipt that comes
        # after its job was overdue is late, however late it reached us.
        if kind == ev.S_STEP:
            self.advance(t, event[3])
            self._step(t, *event[4:])
            return
        if kind == ev.S_RECEIPTS:
            self.advance(t, event[3])
            self._receipts(t, event[4])
            return
        if kind == ev.S_COMPUTED:
            self.advance(t, event[3])
            self._computed(t, event[4])
            return
        self.advance(t, event[3] if kind == ev.S_MARK else 0)
        if kind == ev.S_REQUEST:
            self._request(t, event[3]).traceparent = event[4]
        elif kind == ev.S_FINISHED:
            self._finished(t, event[3], event[4])
        elif kind == ev.S_WAIT:
            self.tier.wait(t, event[3])
        elif kind == ev.S_WAIT_END:
            self.tier.wait_end(t, *event[3:])
        elif kind == ev.S_TIER_JOB:
            self.tier.job(t, *event[3:])
        elif kind == ev.S_TIER_DONE:
            self.tier.done(t, *event[3:])
        elif kind == ev.S_TIER_NO_ROOM:
            self.tier.no_room(t, *event[3:])
        elif kind == ev.S_TIER_SKIP:
            self.tier.skipped(t, *event[3:])
        elif kind == ev.S_TIER_PRESSURE:
            self.tier.pressure[event[3]] = bool(event[4])
        elif kind == ev.S_RESET:
            for ep in self.episodes.values():
                ep.events.append(rec.EpisodeEvent("kv.cache_reset", t))
        elif kind == ev.S_SHUTDOWN:
            self.shutdown(t, rec.END_CONNECTOR_SHUTDOWN)

    def _request(self, t: int, req_id: str) -> _Request:
        r = self.requests.get(req_id)
        if r is None:
            r = self.requests[req_id] = _Request(start_ns=t, traceparent=None, last_ns=t)
        return r

    # -- step metadata ---------------------------------------------------------
    def _step(self, t: int, preempted, loads, stores, flushed, admitted) -> None:
        preempted_now = {}
        for req_id, epoch, discarded in preempted:
            old = self.episodes.pop(req_id, None)
            if old is not None:
                self._end_episode(req_id, old, t, rec.PREEMPTED_AGAIN)
            ep = _Episode(epoch=epoch, start_ns=t,
                          traceparent=self._request(t, req_id).traceparent, discarded=discarded)
            # The connector cannot see why the scheduler preempted: say so.
            ep.events.append(rec.EpisodeEvent("kv.requeued", t, {"kvobs.requeue.reason":
                                                                 "unclassified"}))
            self.episodes[req_id] = ep
            preempted_now[req_id] = ep
        for job_id in flushed:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            job.flushed = True
            ep = preempted_now.get(job.req_id)
            if ep is not None and job.is_store:
                job.epoch, job.role = ep.epoch, rec.PRESERVE
                ep.preserve_jobs.append(job_id)
        for ep in preempted_now.values():
            ep.events.append(rec.EpisodeEvent("kv.preserve", t, {
                "kvobs.job.ids": list(ep.preserve_jobs)}))
        for job_id, req_id, sync, blocks in loads:
            job = self._new_job(t, job_id, req_id, False, sync, blocks)
            ep = self.episodes.get(req_id)
            if ep is not None and ep.admitted_ns is None:
                job.epoch, job.role = ep.epoch, rec.RESTORE
                ep.restore_jobs.append(job_id)
                ep.open_restores.add(job_id)
        for job_id, req_id, blocks, chunks in stores:
            self._new_job(t, job_id, req_id, True, False, blocks).host_chunks = chunks
        for req_id, epoch, kind, held, restored, other in admitted:
            ep = self.episodes.get(req_id)
            if ep is None or ep.epoch != epoch or ep.admitted_ns is not None:
                continue
            ep.admitted_ns = t
            ep.compute_kind = kind
            ep.held, ep.restored, ep.other = held, restored, other
            if ep.ready_ns is None and not ep.open_restores:
                # Nothing to restore (GPU prefix hit) or all restores in: ready
                # since the last of them, else since the connector's answer
                # after a wait (a tier lookup, a promotion), else since
                # preemption.
                ep.ready_ns = ep.wait_end_ns or ep.start_ns

    def _new_job(self, t, job_id, req_id, is_store, sync, blocks) -> _Job:
        job = self.jobs[job_id] = _Job(req_id, is_store, sync, blocks, t)
        r = self._request(t, req_id)
        r.open_jobs += 1
        r.jobs += 1
        return job

    # -- receipts ------------------------------------------------------------------
    def _receipts(self, t: int, reporters) -> None:
        for rank, _wgen, job_ids, failed in reporters:
            for job_id in job_ids:
                job = self.jobs.get(job_id)
                if job is None:
                    if job_id in self._closed:
                        self.late_receipts += 1
                    else:
                        self.unknown_receipts += 1
                    continue
                if rank in job.received:
                    job.duplicates += 1
                    self.duplicate_receipts += 1
                    continue
                job.received[rank] = t
                if failed and job_id in failed:
                    job.failed.add(rank)
                if len(job.received) >= self.world:
                    self._end_job(job_id, t, rec.JOB_FAILED if job.failed else rec.COMPLETE)

    def _computed(self, t: int, admitted: dict[str, tuple[int, str]]) -> None:
        """Every rank ran the first compute of these re-admitted requests."""
        for req_id, (epoch, _kind) in admitted.items():
            ep = self.episodes.get(req_id)
            if ep is None or ep.epoch != epoch:
                continue
            ep.computed = True
            del self.episodes[req_id]
            # A failed restore that vLLM recomputed: the request came back,
            # from scratch.
            self._end_episode(req_id, ep, t, rec.RECOMPUTED
                              if ep.failed_jobs or ep.failed_tier_jobs else rec.RECOVERED)

    def _end_job(self, job_id: int, t: int, outcome: str, cause: str | None = None) -> None:
        job = self.jobs.pop(job_id)
        self._closed[job_id] = None
        if len(self._closed) > self._CLOSED_MEMORY:
            self._closed.popitem(last=False)
        received = job.received
        reported = sorted(received)
        missing = sorted(set(range(self.world)) - received.keys())
        last_t = max(received.values(), default=0)
        self.sink.emit(rec.JobRecord(
            sched_gen=self.gen, job_id=job_id, req_id=job.req_id,
            kind="store" if job.is_store else "load", sync=job.sync, blocks=job.blocks,
            expected_ranks=self.world, receipt_ranks=reported, missing_ranks=missing,
            duplicate_receipts=job.duplicates, outcome=outcome, start_ns=job.start_ns,
            end_ns=t, flushed=job.flushed, episode_epoch=job.epoch, episode_role=job.role,
            failed_ranks=sorted(job.failed),
            last_ranks=sorted(r for r, rt in received.items() if rt == last_t),
            receipt_spread_ns=last_t - min(received.values(), default=0),
            host_chunks=job.host_chunks, end_cause=cause))
        ep = self.episodes.get(job.req_id)
        if ep is not None and job.role == rec.RESTORE and ep.epoch == job.epoch:
            ep.open_restores.discard(job_id)
            if outcome == rec.JOB_FAILED:
                ep.failed_jobs.append(job_id)
                ep.failed_ranks |= job.failed
            if outcome not in (rec.COMPLETE, rec.JOB_FAILED):
                ep.incomplete_jobs.append(job_id)
                del self.episodes[job.req_id]
                self._end_episode(job.req_id, ep, t, outcome, cause)
            elif not ep.open_restores:
                ep.ready_ns = t
                if ep.finished_error:
                    del self.episodes[job.req_id]
                    self._end_episode(job.req_id, ep, t, rec.RESTORE_FAILED if ep.failed_jobs
                                      else rec.FINISHED_BEFORE_RESUME)
        r = self.requests.get(job.req_id)
        if r is not None:
            r.open_jobs -= 1
            r.last_ns = max(r.last_ns, t)
            self._maybe_end_request(job.req_id, r, cause=cause)

    # -- requests and episodes --------------------------------------------------------
    def _finished(self, t: int, req_id: str, status: str) -> None:
        ep = self.episodes.get(req_id)
        if ep is not None and ep.admitted_ns is None:
            if status == ev.FINISHED_ERROR and ep.open_restores:
                # vLLM fails a request whose restore failed (policy "fail") in
                # the step that reports it, before it reads the receipts.
                ep.finished_error = True
            else:
                del self.episodes[req_id]
                self._end_episode(req_id, ep, t, _ENDED_BEFORE_RESUME[status]
                                  if not ep.failed_jobs else rec.RESTORE_FAILED)
        r = self.requests.get(req_id)
        if r is not None:
            r.finished = status
            r.last_ns = max(r.last_ns, t)
            self._maybe_end_request(req_id, r)

    def _maybe_end_request(self, req_id: str, r: _Request, force: str | None = None,
                           cause: str | None = None) -> None:
        if force is None and (r.finished is None or r.open_jobs > 0):
            return
        del self.requests[req_id]
        if not (r.jobs or r.tier_jobs or r.waits):
            return  # no offload traffic: no trace
        self.sink.emit(rec.RequestRecord(
            sched_gen=self.gen, req_id=req_id, start_ns=r.start_ns, end_ns=r.last_ns,
            outcome=force or r.finished or "finished", traceparent=r.traceparent,
            jobs=r.jobs, end_cause=cause if force == rec.ABANDONED else None,
            tier_jobs=r.tier_jobs, waits=r.waits))

    def _end_episode(self, req_id: str, ep: _Episode, t: int, outcome: str,
                     cause: str | None = None) -> None:
        missing_fc = []
        computed_fc = list(range(self.world)) if ep.computed else []
        restored = resident = recomputed = other = None
        by_tier: dict[int, int] = {}
        if ep.admitted_ns is not None:
            missing_fc = [] if ep.computed else list(range(self.world))
            # A failed restore brought nothing back, whatever was planned.
            restored = 0 if ep.failed_jobs else ep.restored
            if ep.promoted and restored and self.tokens_per_chunk:
                left = restored
                for tier, chunks in sorted(ep.promoted.items()):
                    by_tier[tier] = n = min(left, chunks * self.tokens_per_chunk)
                    left -= n
            if ep.held is not None:
                # Device prefix cache: what the request holds that neither the
                # host tier nor another connector (MultiConnector) brought.
                if ep.other is None:
                    resident = max(0, ep.held - restored)
                elif ep.other != ev.OTHER_UNKNOWN:
                    other = ep.other
                    resident = max(0, ep.held - restored - other)
                if ep.discarded is not None:
                    recomputed = max(0, ep.discarded - ep.held)
        self.sink.emit(rec.EpisodeRecord(
            sched_gen=self.gen, req_id=req_id, epoch=ep.epoch, start_ns=ep.start_ns,
            end_ns=t, outcome=outcome, traceparent=ep.traceparent,
            preserve_jobs=ep.preserve_jobs, restore_jobs=ep.restore_jobs, events=ep.events,
            expected_ranks=self.world, ready_ns=ep.ready_ns, admitted_ns=ep.admitted_ns,
            compute_kind=ep.compute_kind, first_compute_ranks=computed_fc,
            missing_first_compute_ranks=missing_fc, incomplete_jobs=ep.incomplete_jobs,
            failed_restore_jobs=ep.failed_jobs, failed_ranks=sorted(ep.failed_ranks),
            tokens_discarded=ep.discarded, tokens_restored=restored, tokens_resident=resident,
            tokens_recomputed=recomputed, tokens_other_connector=other,
            end_cause=cause if outcome == rec.ABANDONED else None,
            tier_jobs=ep.tier_jobs, promoted_chunks=dict(ep.promoted),
            tokens_restored_by_tier=by_tier,
            recompute_reason=self._recompute_reason(req_id, ep) if recomputed
            or outcome in (rec.RECOMPUTED, rec.TIER_STALLED) else None))

    def _recompute_reason(self, req_id: str, ep: _Episode) -> str | None:
        reason = ep.recompute_reason or ep.cascade_lost
        if reason is None and self.tier.tiers:
            r = self.requests.get(req_id)
            if r is not None and r.cascaded and not ep.promoted:
                return rec.RECOMPUTE_NOT_FOUND
        return reason

    # -- time ---------------------------------------------------------------------------
    def advance(self, t: int, steps: int) -> None:
        """The engine had taken ``steps`` steps by ``t`` (the host's clock and
        count, stamped where it happened). Judges deadlines as of then, before
        any later event is applied."""
        if not self.stepped:
            return
        if t > self._t:
            self._t = t
        if steps > self._steps:
            self._steps = steps
        if self._t - self._judged_t >= JUDGE_EVERY_NS:
            self._judge(self._t)

    def tick(self, now: int) -> None:
        """The processing clock: judges deadlines for a host without a step
        count. A stepped host is judged in event time only (``advance``):
        with no event and no mark, its engine is not known to have stepped."""
        if not self.stepped:
            self._judge(now)

    def _judge(self, now: int) -> None:
        """End jobs and admitted episodes that outlived the receipt deadline
        at ``now`` (and, when stepped, the engine's next
        ``STEPS_PAST_DEADLINE`` steps since it ran out)."""
        self._judged_t = now
        limit = now - self.deadline_ns
        if not self.stepped:
            def overdue(item: Any) -> bool:
                return True
        else:
            steps = self._steps

            def overdue(item: Any) -> bool:
                if item.overdue_at is None:
                    item.overdue_at = steps
                return steps >= item.overdue_at + STEPS_PAST_DEADLINE
        for job_id in [j for j, job in self.jobs.items()
                       if job.start_ns < limit and overdue(job)]:
            self._end_job(job_id, now, rec.RECEIPT_INCOMPLETE)
        for req_id in [r for r, ep in self.episodes.items()
                       if ep.admitted_ns is not None and ep.admitted_ns < limit and overdue(ep)]:
            self._end_episode(req_id, self.episodes.pop(req_id), now,
                              rec.FIRST_COMPUTE_INCOMPLETE)
        self.tier.tick(now, now - self.tier_deadline_ns, overdue)

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN) -> None:
        """End everything still open as ABANDONED, saying why (``cause``):
        the process stopped first, which is no failure of the chain."""
        for job_id in list(self.jobs):
            self._end_job(job_id, t, rec.ABANDONED, cause)
        self.tier.shutdown(t, cause)
        for req_id in list(self.episodes):
            self._end_episode(req_id, self.episodes.pop(req_id), t, rec.ABANDONED, cause)
        for req_id in list(self.requests):
            r = self.requests[req_id]
            r.last_ns = max(r.last_ns, t)
            self._maybe_end_request(req_id, r, force=r.finished or rec.ABANDONED, cause=cause)

    @property
    def open_receipts(self) -> int:
        return len(self.jobs)

    def anomalies(self) -> dict[str, int]:
        return {"late_receipt": self.late_receipts, "unknown_job_receipt": self.unknown_receipts,
                "duplicate_receipt": self.duplicate_receipts,
                # (only with secondary tiers: no series nobody can have)
                **(self.tier.anomalies() if self.tier.tiers else {})}
