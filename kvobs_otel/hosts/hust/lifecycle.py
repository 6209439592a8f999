"""vLLM-HUST records -> the lifecycle records every host produces.

Input is validated records (``records.check_v1``/``check_v2``) of ONE
process, in that process's order, each with a time ``t`` on that process's
clock. Nothing here compares times of different processes: scheduler and
ranks are joined only by ids (scheduler generation, request id, epoch, job
id), exactly as on the stock-vLLM path, so the spans land in the same traces.

What the contracts do not carry is not invented:

- v2 has no job-creation event: a ``kv.job`` is the receipt instant;
- v2's scheduler never sees first compute: an episode ends at admission
  (``first_compute_observed=False``) and the ranks' ``kv.first_compute``
  spans complete the trace; first compute itself is an instant;
- v1 has no generations and per-instance job ids: it joins only within a
  process (``join_scope="process"``).

Anomalies (duplicates, stages out of order, rosters that disagree) are
counted by kind; the evidence is still turned into spans where it can be.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.lifecycle import records as rec
from kvobs_otel.lifecycle.scheduler_state import RecordSink

# Bounds on remembered state: a host that never closes what it opens costs
# a counted eviction, not memory.
OPEN_CAP = 65536
SEEN_CAP = 65536


class _Seen:
    """A bounded set of recently seen keys."""

    def __init__(self, cap: int = SEEN_CAP) -> None:
        self.cap = cap
        self._keys: OrderedDict[Any, None] = OrderedDict()

    def add(self, key: Any) -> bool:
        """True when ``key`` is new."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self.cap:
            self._keys.popitem(last=False)
        return True


@dataclass
class _Episode:
    epoch: int
    start_ns: int
    events: list[rec.EpisodeEvent]
    receipts: dict[int, tuple[int, Any]] = field(default_factory=dict)  # job -> (t, ranks)
    incomplete: list[int] = field(default_factory=list)


class _Base:
    """Shared bookkeeping: anomaly counts and exact-duplicate detection."""

    role = "worker"

    def __init__(self, sink: RecordSink) -> None:
        self.sink = sink
        self.counts: Counter[str] = Counter()
        self._records = _Seen()

    def _duplicate(self, d: dict[str, Any]) -> bool:
        # The same record delivered twice (a duplicated stage) is seen once.
        if self._records.add(tuple(d.items())):
            return False
        self.counts["duplicate_record"] += 1
        return True

    def anomalies(self) -> dict[str, int]:
        return dict(self.counts)


class _EpisodeTable(_Base):
    """Scheduler side: requeue -> receipts -> admission, keyed by request."""

    role = "scheduler"

    def __init__(self, sink: RecordSink, join_scope: str) -> None:
        super().__init__(sink)
        self.join_scope = join_scope
        self.episodes: OrderedDict[tuple[str, str], _Episode] = OrderedDict()
        self.known_ranks: dict[str, set[int]] = {}

    def _requeued(self, gen: str, req: str, epoch: int, t: int, reason: str) -> None:
        key = (gen, req)
        ep = self.episodes.get(key)
        if ep is not None:
            if ep.epoch >= epoch:
                self.counts["duplicate_stage" if ep.epoch == epoch else "stale_epoch"] += 1
                return
            self._end(key, t, rec.PREEMPTED_AGAIN)
        self._open(key, epoch, t, rec.EpisodeEvent("kv.requeued", t,
                                                   {"kvobs.requeue.reason": reason}))

    def _open(self, key: tuple[str, str], epoch: int, t: int,
              first: rec.EpisodeEvent) -> _Episode:
        ep = self.episodes[key] = _Episode(epoch, t, [first])
        while len(self.episodes) > OPEN_CAP:
            self.counts["episode_evicted"] += 1
            self._end(next(iter(self.episodes)), t, rec.ABANDONED)
        return ep

    def _episode(self, gen: str, req: str, epoch: int, t: int) -> _Episode | None:
        """The open episode (gen, req, epoch); one is opened when its requeue
        record is missing, so the rest of the evidence still has a root."""
        key = (gen, req)
        ep = self.episodes.get(key)
        if ep is not None and ep.epoch == epoch:
            return ep
        if ep is not None and ep.epoch > epoch:
            self.counts["stale_epoch"] += 1
            return None
        if ep is not None:
            self._end(key, t, rec.PREEMPTED_AGAIN)
        self.counts["requeue_missing"] += 1
        return self._open(key, epoch, t, rec.EpisodeEvent("kv.requeue_missing", t))

    def _ranks(self, gen: str, ranks: Any) -> set[int]:
        known = self.known_ranks.setdefault(gen, set())
        known.update(ranks)
        return known

    def _job(self, gen: str, job: int, req: str | None, epoch: int, ranks: list[int],
             t_receipt: int, kind: str = "load") -> str:
        """One receipt as a job record; returns its outcome."""
        # Expected: every rank this scheduler generation has been seen with.
        expected = self._ranks(gen, ranks)
        missing = sorted(expected - set(ranks))
        outcome = rec.RECEIPT_INCOMPLETE if missing else rec.COMPLETE
        self.sink.emit(rec.JobRecord(
            sched_gen=gen, job_id=job, req_id=req, kind=kind, sync=False, blocks=0,
            expected_ranks=len(expected), receipt_ranks=sorted(ranks), missing_ranks=missing,
            duplicate_receipts=0, outcome=outcome, start_ns=t_receipt, end_ns=t_receipt,
            episode_epoch=epoch if req is not None else 0,
            episode_role=rec.RESTORE if req is not None and epoch and kind == "load" else None))
        return outcome

    def _admitted(self, gen: str, req: str, epoch: int, jobs: list[int], ranks: set[int],
                  t: int) -> None:
        ep = self._episode(gen, req, epoch, t)
        if ep is None:
            return
        expected = self._ranks(gen, ranks)
        ready = max((ep.receipts[j][0] for j in jobs if j in ep.receipts), default=ep.start_ns)
        del self.episodes[(gen, req)]
        self.sink.emit(rec.EpisodeRecord(
            sched_gen=gen, req_id=req, epoch=epoch, start_ns=ep.start_ns, end_ns=t,
            outcome=rec.RECOVERED, traceparent=None, preserve_jobs=[], restore_jobs=jobs,
            events=ep.events, expected_ranks=len(expected), ready_ns=ready, admitted_ns=t,
            incomplete_jobs=ep.incomplete, first_compute_observed=False,
            join_scope=self.join_scope))

    def _end(self, key: tuple[str, str], t: int, outcome: str, cause: str | None = None) -> None:
        ep = self.episodes.pop(key)
        self.sink.emit(rec.EpisodeRecord(
            sched_gen=key[0], req_id=key[1], epoch=ep.epoch, start_ns=ep.start_ns, end_ns=t,
            outcome=outcome, traceparent=None, preserve_jobs=[],
            restore_jobs=sorted(ep.receipts), events=ep.events,
            expected_ranks=len(self.known_ranks.get(key[0], ())) or 1,
            incomplete_jobs=ep.incomplete, first_compute_observed=False,
            join_scope=self.join_scope, end_cause=cause))

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN) -> None:
        for key in list(self.episodes):
            self._end(key, t, rec.ABANDONED, cause)


# ---------------------------------------------------------------- contract v2


class CorrelatedScheduler(_EpisodeTable):
    """Contract v2, scheduler records: recovery_requeued, transfer_receipt,
    recovery_admitted."""

    def __init__(self, sink: RecordSink) -> None:
        super().__init__(sink, rec.JOIN_CLUSTER)

    def record(self, d: dict[str, Any], t: int) -> None:
        if self._duplicate(d):
            return
        event, gen, req, epoch = (d["event"], d["scheduler_generation"], d["request_id"],
                                  d["recovery_epoch"])
        if event == "recovery_requeued":
            self._requeued(gen, req, epoch, t, "unclassified")
        elif event == "transfer_receipt":
            ep = self._episode(gen, req, epoch, t)
            if ep is None:
                return
            job, ranks = d["job_id"], [r for r, _ in d["workers"]]
            if job in ep.receipts:
                self.counts["duplicate_stage"] += 1
                return
            ep.receipts[job] = (t, d["workers"])
            if self._job(gen, job, req, epoch, ranks, t) != rec.COMPLETE:
                ep.incomplete.append(job)
        elif event == "recovery_admitted":
            ep = self.episodes.get((gen, req))
            roster = d["roster"]
            if ep is not None and ep.epoch == epoch:
                for job, workers in roster:
                    got = ep.receipts.get(job)
                    if got is None:
                        self.counts["admitted_without_receipt"] += 1
                    elif got[1] != workers:
                        self.counts["roster_mismatch"] += 1
            ranks = {r for _, workers in roster for r, _ in workers}
            self._admitted(gen, req, epoch, [job for job, _ in roster], ranks, t)
        else:
            self.counts["worker_record_at_scheduler"] += 1


class CorrelatedWorker(_Base):
    """Contract v2, one rank's records: restore_submitted, restore_completed,
    first_compute."""

    def __init__(self, sink: RecordSink, rank: int) -> None:
        super().__init__(sink)
        self.rank = rank
        # (gen, job) -> (t, req, epoch, blocks, worker_gen)
        self.inflight: OrderedDict[tuple[str, int], tuple[int, str, int, int, str]] = \
            OrderedDict()
        self.done = _Seen()
        self.computed = _Seen()

    def record(self, d: dict[str, Any], t: int) -> None:
        if self._duplicate(d):
            return
        event, gen = d["event"], d["scheduler_generation"]
        if event == "restore_submitted":
            key = (gen, d["job_id"])
            if key in self.inflight:
                self.counts["duplicate_stage"] += 1
                return
            self.inflight[key] = (t, d["request_id"], d["recovery_epoch"], d["block_count"],
                                  d["worker_generation"])
            while len(self.inflight) > OPEN_CAP:
                self.counts["transfer_evicted"] += 1
                self._transfer(*next(iter(self.inflight)), t, rec.TRANSFER_UNFINISHED)
        elif event == "restore_completed":
            key = (gen, d["job_id"])
            if not self.done.add(key):
                self.counts["duplicate_stage"] += 1
                return
            if key not in self.inflight:
                self.counts["result_without_submit"] += 1
                self.inflight[key] = (t, d["request_id"], d["recovery_epoch"], 0,
                                      d["worker_generation"])
            elif self.inflight[key][4] != d["worker_generation"]:
                self.counts["generation_mismatch"] += 1
            self._transfer(gen, d["job_id"], t, rec.TRANSFER_OK)
        elif event == "first_compute":
            req, epoch, wgen = d["request_id"], d["recovery_epoch"], d["worker_generation"]
            if not self.computed.add((gen, req, epoch)):
                self.counts["duplicate_stage"] += 1
                return
            for _job, workers in d["roster"]:
                if dict(workers).get(self.rank) != wgen:
                    self.counts["roster_mismatch"] += 1
                    break
            self.sink.emit(rec.FirstComputeRecord(
                sched_gen=gen, req_id=req, epoch=epoch, rank=self.rank, worker_gen=wgen,
                compute_kind=d["compute_kind"], start_ns=t, end_ns=t))
        else:
            self.counts["scheduler_record_at_worker"] += 1

    def _transfer(self, gen: str, job: int, t: int, outcome: str) -> None:
        start, req, epoch, blocks, wgen = self.inflight.pop((gen, job))
        self.sink.emit(rec.TransferRecord(
            sched_gen=gen, job_id=job, req_id=req, direction="h2d", blocks=blocks,
            size_bytes=None, device_time_s=None, rank=self.rank, worker_gen=wgen,
            outcome=outcome, start_ns=start, end_ns=t, episode_epoch=epoch))

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN,
                 outcome: str = rec.TRANSFER_CANCELLED) -> None:
        for gen, job in list(self.inflight):
            self._transfer(gen, job, t, outcome)


# ---------------------------------------------------------------- contract v1


class ProcessScheduler(_EpisodeTable):
    """Contract v1, scheduler records. No generation in the records: ``gen``
    is this process's own, and every span stays in this process's traces."""

    def __init__(self, sink: RecordSink, gen: str) -> None:
        super().__init__(sink, rec.JOIN_PROCESS)
        self.gen = gen
        # Restore receipts wait for the admission that names their request.
        self.pending: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()

    def record(self, d: dict[str, Any], t: int) -> None:
        if self._duplicate(d):
            return
        event = d["event"]
        if event == "recovery_requeued":
            self._requeued(self.gen, d["request_id"], d["recovery_epoch"], t,
                           d["requeue_reason"] or "unclassified")
        elif event == "transfer_receipt":
            job, ranks, req = d["job_id"], d["ranks"], d["request_id"]
            if d["operation"] == "d2h_preserve":
                self._job(self.gen, job, req, 0, list(ranks), t, kind="store")
                return
            if req is not None and (self.gen, req) not in self.episodes:
                # The host sends a receipt for every load, not only restores
                # (scheduler.py update_connector_output): with no recovery
                # open for its request, this one is ordinary traffic.
                self._job(self.gen, job, req, 0, list(ranks), t)
                return
            if job in self.pending:
                self.counts["duplicate_stage"] += 1
                return
            self.pending[job] = (t, ranks)
            while len(self.pending) > OPEN_CAP:
                old, (t_old, r_old) = self.pending.popitem(last=False)
                self.counts["receipt_unjoined"] += 1
                self._job(self.gen, old, None, 0, list(r_old), t_old)
        elif event == "recovery_admitted":
            req, epoch = d["request_id"], d["recovery_epoch"]
            ep = self._episode(self.gen, req, epoch, t)
            if ep is None:
                return
            ranks: set[int] = set()
            for job in d["job_ids"]:
                got = self.pending.pop(job, None)
                if got is None:
                    self.counts["admitted_without_receipt"] += 1
                    continue
                ep.receipts[job] = got
                ranks.update(got[1])
                if self._job(self.gen, job, req, epoch, list(got[1]), got[0]) != rec.COMPLETE:
                    ep.incomplete.append(job)
            self._admitted(self.gen, req, epoch, sorted(set(d["job_ids"])), ranks, t)
        else:
            self.counts["worker_record_at_scheduler"] += 1

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN) -> None:
        for job, (t_r, ranks) in list(self.pending.items()):
            self._job(self.gen, job, None, 0, list(ranks), t_r)
        self.pending.clear()
        super().shutdown(t, cause)


class ProcessWorker(_Base):
    """Contract v1, one rank's records: transfers and first compute, as
    root spans of this process (``gen`` is the process's own)."""

    def __init__(self, sink: RecordSink, rank: int, gen: str) -> None:
        super().__init__(sink)
        self.rank = rank
        self.gen = gen
        # job -> (t, direction, req, blocks)
        self.inflight: OrderedDict[int, tuple[int, str, str | None, int]] = OrderedDict()

    def record(self, d: dict[str, Any], t: int) -> None:
        if self._duplicate(d):
            return
        event = d["event"]
        direction = "h2d" if d["operation"] == "h2d_restore" else "d2h"
        if event == "transfer_submitted":
            if d["job_id"] in self.inflight:
                self.counts["duplicate_stage"] += 1
                return
            self.inflight[d["job_id"]] = (t, direction, d["request_id"], d["block_count"])
            while len(self.inflight) > OPEN_CAP:
                self.counts["transfer_evicted"] += 1
                self._transfer(next(iter(self.inflight)), t, rec.TRANSFER_UNFINISHED)
        elif event in ("transfer_completed", "transfer_cancelled"):
            job = d["job_id"]
            if job not in self.inflight:
                self.counts["result_without_submit"] += 1
                self.inflight[job] = (t, direction, d["request_id"], d["block_count"])
            if event == "transfer_cancelled":
                outcome = rec.TRANSFER_CANCELLED
            else:
                outcome = rec.TRANSFER_OK if d["success"] else rec.TRANSFER_FAILED
            self._transfer(job, t, outcome, d["bytes_moved"] or None,
                           d["duration_ns"] / 1e9 if d["duration_ns"] else None)
        elif event == "first_compute":
            self.sink.emit(rec.FirstComputeRecord(
                sched_gen=self.gen, req_id=d["request_id"], epoch=d["recovery_epoch"],
                rank=self.rank, worker_gen=self.gen, compute_kind=d["compute_kind"],
                start_ns=t, end_ns=t, join_scope=rec.JOIN_PROCESS))
        elif event == "transfer_descriptors":
            pass  # raw regions and offsets: never exported, and nothing to join
        else:
            self.counts["scheduler_record_at_worker"] += 1

    def _transfer(self, job: int, t: int, outcome: str, size: int | None = None,
                  duration_s: float | None = None) -> None:
        start, direction, req, blocks = self.inflight.pop(job)
        self.sink.emit(rec.TransferRecord(
            sched_gen=self.gen, job_id=job, req_id=req, direction=direction, blocks=blocks,
            size_bytes=size, device_time_s=duration_s, rank=self.rank, worker_gen=self.gen,
            outcome=outcome, start_ns=start, end_ns=t, join_scope=rec.JOIN_PROCESS))

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN,
                 outcome: str = rec.TRANSFER_CANCELLED) -> None:
        for job in list(self.inflight):
            self._transfer(job, t, outcome)


# ------------------------------------------------ the plugin's own records


_STARTED = frozenset({"preserve_started", "restore_started", "transfer_started"})
_ENDED = {"preserve_completed": rec.TRANSFER_OK, "restore_completed": rec.TRANSFER_OK,
          "transfer_completed": rec.TRANSFER_OK, "transfer_failed": rec.TRANSFER_FAILED,
          "transfer_cancelled": rec.TRANSFER_CANCELLED}


class PluginTransfers(_EpisodeTable):
    """One worker process's ``vllm-hust.kv-transfer-event.v2`` records: the
    plugin's own account of its transfers (and, in the schema, of a recovery
    seen from that one process). Ids are the records' process-scoped transfer
    ids; nothing joins another process (``join_scope="process"``)."""

    role = "worker"

    def __init__(self, sink: RecordSink, rank: int, gen: str) -> None:
        super().__init__(sink, rec.JOIN_PROCESS)
        self.rank = rank
        self.gen = gen  # the records' worker generation, as hex
        # transfer id -> (t, direction, request, blocks, epoch)
        self.inflight: OrderedDict[tuple[str, int], tuple[int, str, str, int, int]] = \
            OrderedDict()
        self.restored: OrderedDict[tuple[str, int], int] = OrderedDict()  # id -> completed at

    def record(self, d: dict[str, Any], t: int) -> None:
        if self._duplicate(d):
            return
        event, req, epoch = d["event"], d["request_id"], d["recovery_epoch"] or 0
        if event in _STARTED:
            tid = d["transfer_id"]
            if tid in self.inflight:
                self.counts["duplicate_stage"] += 1
                return
            self.inflight[tid] = (t, d["direction"], req, d.get("block_count", 0), epoch)
            while len(self.inflight) > OPEN_CAP:
                self.counts["transfer_evicted"] += 1
                self._transfer(next(iter(self.inflight)), t, rec.TRANSFER_UNFINISHED)
        elif event in _ENDED:
            tid = d["transfer_id"]
            if tid not in self.inflight:
                self.counts["result_without_submit"] += 1
                # A completion says how long it took on this clock: start there.
                self.inflight[tid] = (t - d.get("duration_ns", 0), d["direction"], req,
                                      d.get("block_count", 0), epoch)
            device = d.get("device_duration_ns")
            self._transfer(tid, t, _ENDED[event], d.get("bytes_moved"),
                           device / 1e9 if device else None)
            if event == "restore_completed":
                self.restored[tid] = t
                while len(self.restored) > SEEN_CAP:
                    self.restored.popitem(last=False)
        elif event == "recovery_requeued":
            self._requeued(self.gen, req, epoch, t, d["requeue_reason"])
        elif event == "recovery_admitted":
            ep = self._episode(self.gen, req, epoch, t)
            if ep is None:
                return
            jobs = []
            for tid in d["associated_transfer_ids"]:
                jobs.append(tid[1])
                done = self.restored.get(tid)
                if done is None:
                    self.counts["admitted_without_receipt"] += 1
                    continue
                ep.receipts[tid[1]] = (done, (self.rank,))
                self._job(self.gen, tid[1], req, epoch, [self.rank], done)
            self._admitted(self.gen, req, epoch, jobs, {self.rank}, t)
        else:  # first_compute
            self.sink.emit(rec.FirstComputeRecord(
                sched_gen=self.gen, req_id=req, epoch=epoch, rank=self.rank,
                worker_gen=self.gen, compute_kind=d["compute_kind"], start_ns=t, end_ns=t,
                join_scope=rec.JOIN_PROCESS))

    def _transfer(self, tid: tuple[str, int], t: int, outcome: str, size: int | None = None,
                  device_s: float | None = None) -> None:
        start, direction, req, blocks, epoch = self.inflight.pop(tid)
        self.sink.emit(rec.TransferRecord(
            sched_gen=self.gen, job_id=tid[1], req_id=req, direction=direction, blocks=blocks,
            size_bytes=size, device_time_s=device_s, rank=self.rank, worker_gen=self.gen,
            outcome=outcome, start_ns=start, end_ns=t, episode_epoch=epoch,
            join_scope=rec.JOIN_PROCESS))

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN,
                 outcome: str = rec.TRANSFER_CANCELLED) -> None:
        for tid in list(self.inflight):
            self._transfer(tid, t, outcome)
        super().shutdown(t, cause)


def lifecycle_for(correlated: bool, role: str, rank: int | None, gen: str
                  ) -> Callable[[RecordSink], Any]:
    """The translator for one role (and rank) of one process: contract v2
    (``correlated``) or v1, whose records need the process's ``gen``."""
    if role == "scheduler":
        if correlated:
            return CorrelatedScheduler
        return lambda sink: ProcessScheduler(sink, gen)
    r = int(rank or 0)
    if correlated:
        return lambda sink: CorrelatedWorker(sink, r)
    return lambda sink: ProcessWorker(sink, r, gen)
