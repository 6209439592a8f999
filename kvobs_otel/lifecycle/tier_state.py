"""Secondary tiers and the connector's "not yet": tier jobs and waits.

Part of the scheduler lifecycle (``scheduler_state.py`` owns the episodes and
requests these attach to). A tier job belongs to the open episode of its
request when that episode has not been admitted yet, else to the request's
ordinary trace. A wait is the window in which vLLM's scheduler skipped the
request because the connector answered ``None`` (its own job in flight, a
promotion, an asynchronous tier lookup); its reasons are read from what the
request had open while it waited.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvobs_otel.lifecycle import records as rec


class _Owner(Protocol):
    """The part of scheduler_state.SchedulerLifecycle a ledger works on,
    named here so that the ledger does not import its owner."""

    gen: str
    sink: Any
    jobs: dict[int, Any]
    episodes: dict[str, Any]
    requests: dict[str, Any]

    def _request(self, t: int, req_id: str) -> Any: ...
    def _end_episode(self, req_id: str, ep: Any, t: int, outcome: str,
                     cause: str | None = None) -> None: ...
    def _maybe_end_request(self, req_id: str, r: Any, force: str | None = None,
                           cause: str | None = None) -> None: ...


@dataclass(slots=True)
class _TierJob:
    tier: int
    is_promotion: bool
    req_id: str
    chunks: int
    start_ns: int
    epoch: int = 0
    overdue_at: int | None = None


@dataclass(slots=True)
class _Wait:
    start_ns: int
    epoch: int
    reasons: set[str] = field(default_factory=set)
    tiers: set[int] = field(default_factory=set)
    overdue_at: int | None = None


class TierLedger:
    # Remember this many tier jobs reported hung, to tell a late result.
    _HUNG_MEMORY = 4096

    def __init__(self, owner: _Owner, tiers: list[tuple[str, str, str]]) -> None:
        self.owner = owner
        self.tiers = tiers
        self.jobs: dict[int, _TierJob] = {}
        self.waits: dict[str, _Wait] = {}
        self._hung: dict[int, None] = {}
        # Counters the metric builder reads.
        self.late_results = 0
        self.unknown_results = 0
        # (from 0 for every tier: an alert's increase() needs the first sample)
        self.no_room_count = dict.fromkeys(range(len(tiers)), 0)  # promotions, no CPU chunk
        self.skipped_chunks = dict.fromkeys(range(len(tiers)), 0)  # chunks back-pressure kept off
        self.pressure: dict[int, bool] = {}  # tier -> back-pressure on

    # -- tier jobs ---------------------------------------------------------------
    def job(self, t: int, tier: int, job_id: int, is_promotion: bool, req_id: str,
            chunks: int) -> None:
        o = self.owner
        job = self.jobs[job_id] = _TierJob(tier, is_promotion, req_id, chunks, t)
        ep = o.episodes.get(req_id)
        if ep is not None and ep.admitted_ns is None:
            job.epoch = ep.epoch
            ep.tier_jobs.append(job_id)
        wait = self.waits.get(req_id)
        if wait is not None and is_promotion:
            wait.reasons.add(rec.WAIT_PROMOTION)
            wait.tiers.add(tier)
        r = o._request(t, req_id)
        r.open_jobs += 1
        r.tier_jobs += 1

    def done(self, t: int, job_id: int, success: bool, ok_chunks: int | None,
             size: int | None, io_time: float | None, deferred: bool) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            if job_id in self._hung:  # its result came after it was reported hung
                del self._hung[job_id]
                self.late_results += 1
            else:
                self.unknown_results += 1
            return
        if success:
            outcome, ok = rec.TIER_OK, job.chunks
        else:
            ok = ok_chunks or 0
            outcome = rec.TIER_PARTIAL if ok else rec.TIER_FAILED
        self._emit(job_id, job, t, outcome, ok, size, io_time, deferred)
        if not job.is_promotion and ok:
            r = self.owner.requests.get(job.req_id)
            if r is not None:
                r.cascaded += ok
        ep = self.owner.episodes.get(job.req_id)
        if (not job.is_promotion and outcome != rec.TIER_OK and ep is not None
                and ep.admitted_ns is None):
            ep.cascade_lost = rec.RECOMPUTE_CASCADE_FAILED
        if job.is_promotion and ep is not None and ep.epoch == job.epoch and job.epoch:
            if ok:
                ep.promoted[job.tier] = ep.promoted.get(job.tier, 0) + ok
            if outcome != rec.TIER_OK:
                ep.recompute_reason = rec.RECOMPUTE_PROMOTION_FAILED
                ep.failed_tier_jobs.append(job_id)
        self._job_ended(t, job.req_id)

    def no_room(self, t: int, tier: int, req_id: str) -> None:
        self.no_room_count[tier] = self.no_room_count.get(tier, 0) + 1
        ep = self.owner.episodes.get(req_id)
        if ep is not None and ep.admitted_ns is None:
            ep.recompute_reason = ep.recompute_reason or rec.RECOMPUTE_NO_ROOM
            ep.events.append(rec.EpisodeEvent("kv.tier.no_room", t, {
                "kvobs.tier.index": tier, "kvobs.tier.type": self._tier(tier)[0]}))

    def skipped(self, t: int, tier: int, req_id: str | None, chunks: int) -> None:
        self.skipped_chunks[tier] = self.skipped_chunks.get(tier, 0) + chunks
        ep = self.owner.episodes.get(req_id) if req_id is not None else None
        if ep is not None and ep.admitted_ns is None:
            ep.cascade_lost = ep.cascade_lost or rec.RECOMPUTE_CASCADE_DROPPED
            ep.events.append(rec.EpisodeEvent("kv.tier.cascade_skipped", t, {
                "kvobs.tier.index": tier, "kvobs.tier.type": self._tier(tier)[0],
                "kvobs.tier.chunks": chunks}))

    def _tier(self, index: int) -> tuple[str, str, str]:
        return self.tiers[index] if 0 <= index < len(self.tiers) else ("unknown", "", "")

    def _emit(self, job_id: int, job: _TierJob, t: int, outcome: str, ok: int | None = None,
              size: int | None = None, io_time: float | None = None, deferred: bool = False,
              cause: str | None = None) -> None:
        kind, medium, locality = self._tier(job.tier)
        self.owner.sink.emit(rec.TierJobRecord(
            sched_gen=self.owner.gen, tier_job_id=job_id, tier_index=job.tier, tier_type=kind,
            medium=medium, locality=locality,
            kind=rec.PROMOTION if job.is_promotion else rec.CASCADE, req_id=job.req_id,
            chunks=job.chunks, outcome=outcome, start_ns=job.start_ns, end_ns=t, chunks_ok=ok,
            size_bytes=size, io_time_s=io_time, release_deferred=deferred,
            episode_epoch=job.epoch, end_cause=cause))

    def _job_ended(self, t: int, req_id: str, cause: str | None = None) -> None:
        o = self.owner
        r = o.requests.get(req_id)
        if r is not None:
            r.open_jobs -= 1
            r.last_ns = max(r.last_ns, t)
            o._maybe_end_request(req_id, r, cause=cause)

    def open_state(self) -> dict[tuple[str, str], tuple[int, float]]:
        """{(tier type, kind): (open jobs, oldest age in s)}, for the gauges
        (read on the metric reader's thread: a copy of the table first)."""
        now = time.monotonic_ns()
        out: dict[tuple[str, str], tuple[int, float]] = {}
        for job in list(self.jobs.values()):
            key = (self._tier(job.tier)[0], rec.PROMOTION if job.is_promotion else rec.CASCADE)
            n, age = out.get(key, (0, 0.0))
            out[key] = (n + 1, max(age, (now - job.start_ns) * 1e-9))
        for kind, _m, _l in self.tiers:
            for k in (rec.PROMOTION, rec.CASCADE):
                out.setdefault((kind, k), (0, 0.0))
        return out

    # -- waits -------------------------------------------------------------------
    def wait(self, t: int, req_id: str) -> None:
        o = self.owner
        ep = o.episodes.get(req_id)
        w = self.waits[req_id] = _Wait(t, ep.epoch if ep is not None and ep.admitted_ns is None
                                       else 0)
        if any(j.req_id == req_id for j in o.jobs.values()):
            w.reasons.add(rec.WAIT_TRANSFER)
        o._request(t, req_id).waits += 1

    def wait_end(self, t: int, req_id: str, passes: int, answered: bool) -> None:
        w = self.waits.pop(req_id, None)
        if w is None:
            return  # reported hung already
        self._emit_wait(req_id, w, t, passes,
                        rec.WAIT_ANSWERED if answered else rec.WAIT_REQUEST_ENDED)
        ep = self.owner.episodes.get(req_id)
        if answered and ep is not None and ep.epoch == w.epoch and w.epoch:
            ep.wait_end_ns = t

    def _emit_wait(self, req_id: str, w: _Wait, t: int, passes: int, outcome: str,
                   cause: str | None = None) -> None:
        self.owner.sink.emit(rec.WaitRecord(
            sched_gen=self.owner.gen, req_id=req_id, start_ns=w.start_ns, end_ns=t,
            passes=passes, reasons=sorted(w.reasons or {rec.WAIT_LOOKUP}), outcome=outcome,
            tiers=sorted(w.tiers), episode_epoch=w.epoch, end_cause=cause))

    # -- time --------------------------------------------------------------------
    def tick(self, now: int, limit: int, overdue: Any) -> None:
        """Report tier jobs and waits past the deadline now, while they hang:
        ERROR spans naming the tier, and the episode they hold ends."""
        o = self.owner
        for job_id in [j for j, job in self.jobs.items()
                       if job.start_ns < limit and overdue(job)]:
            job = self.jobs.pop(job_id)
            self._hung[job_id] = None
            if len(self._hung) > self._HUNG_MEMORY:
                del self._hung[next(iter(self._hung))]
            self._emit(job_id, job, now, rec.TIER_HUNG)
            ep = o.episodes.get(job.req_id)
            if ep is not None and job.epoch and ep.epoch == job.epoch:
                ep.failed_tier_jobs.append(job_id)
                o._end_episode(job.req_id, o.episodes.pop(job.req_id), now, rec.TIER_STALLED)
            self._job_ended(now, job.req_id)
        for req_id in [r for r, w in self.waits.items() if w.start_ns < limit and overdue(w)]:
            w = self.waits.pop(req_id)
            self._emit_wait(req_id, w, now, 0, rec.TIER_HUNG)
            ep = o.episodes.get(req_id)
            if ep is not None and w.epoch and ep.epoch == w.epoch:
                o._end_episode(req_id, o.episodes.pop(req_id), now, rec.TIER_STALLED)

    def shutdown(self, t: int, cause: str) -> None:
        for job_id in list(self.jobs):
            job = self.jobs.pop(job_id)
            self._emit(job_id, job, t, rec.ABANDONED, cause=cause)
            self._job_ended(t, job.req_id, cause)
        for req_id in list(self.waits):
            self._emit_wait(req_id, self.waits.pop(req_id), t, 0, rec.ABANDONED, cause)

    def anomalies(self) -> dict[str, int]:
        return {"late_tier_result": self.late_results,
                "unknown_tier_result": self.unknown_results}
