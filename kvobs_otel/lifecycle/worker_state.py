"""Worker-side lifecycle: real submissions and their TransferResults.

A transfer starts when ``submit_store``/``submit_load`` is called (a copy
engine may copy inside the call) and ends when its ``TransferResult`` is
seen. Queued stores (``prepare_store_kv``) and
non-writer acknowledgements are not transfers and never become one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvobs_otel.lifecycle import events as ev
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.lifecycle.scheduler_state import RecordSink


class WorkerLifecycle:
    role = "worker"
    # Job contexts of jobs this rank never submits (non-writer stores) would
    # otherwise accumulate: keep the newest ones only.
    _CTX_CAP = 65536

    def __init__(self, rank: int, worker_gen: str, sink: RecordSink) -> None:
        self.rank = rank
        self.gen = worker_gen
        self.sink = sink
        self.sched_gen = ""
        # job_id -> [req_id, is_load, blocks, epoch]
        self.ctx: OrderedDict[int, list[Any]] = OrderedDict()
        # job_id -> (submit_ns, is_load, expedited)
        self.inflight: dict[int, tuple[int, bool]] = {}
        self.unknown_results = 0
        self.unjoined_results = 0

    def handle(self, event: tuple[Any, ...]) -> None:
        kind, t = event[1], event[2]
        if kind == ev.W_STEP:
            self._step(*event[3])
        elif kind == ev.W_SUBMIT:
            self._submit(t, *event[3:])
        elif kind == ev.W_RESULT:
            self._result(t, *event[3:])
        elif kind == ev.W_FIRST_COMPUTE:
            start, sched_gen, admitted = event[3:]
            for req_id, (epoch, kind_) in admitted.items():
                self.sink.emit(rec.FirstComputeRecord(
                    sched_gen=sched_gen, req_id=req_id, epoch=epoch, rank=self.rank,
                    worker_gen=self.gen, compute_kind=kind_, start_ns=start, end_ns=t))
        elif kind == ev.W_SHUTDOWN:
            self.shutdown(t, rec.END_CONNECTOR_SHUTDOWN)

    def _step(self, sched_gen: str, episodes, _admitted, loads, stores, flushed) -> None:
        self.sched_gen = sched_gen
        ctx = self.ctx
        # The scheduler's rows (events.py): a load's device blocks are its
        # destination, a store's its source.
        for job_id, req_id, _sync, blocks in loads:
            ctx[job_id] = [req_id, True, blocks, episodes.get(req_id, 0)]
        for job_id, req_id, blocks, _host_blocks in stores:
            ctx[job_id] = [req_id, False, blocks, 0]
        for job_id in flushed:
            c = ctx.get(job_id)
            # A store flushed because its request was preempted this step is
            # the episode's preserve phase.
            if c is not None and not c[1] and c[0] in episodes:
                c[3] = episodes[c[0]]
        while len(ctx) > self._CTX_CAP:
            ctx.popitem(last=False)

    def _submit(self, t: int, job_id: int, is_load: bool, accepted: bool, expedited: bool) -> None:
        if accepted:
            self.inflight[job_id] = (t, is_load, expedited)
        else:
            self._emit(job_id, is_load, t, t, rec.TRANSFER_REJECTED, None, None, expedited)

    def _result(self, t: int, job_id: int, success: bool, size, device_time) -> None:
        start = self.inflight.pop(job_id, None)
        if start is None:
            self.unknown_results += 1
            c = self.ctx.get(job_id)
            start = (t, bool(c and c[1]), False)
        self._emit(job_id, start[1], start[0], t,
                   rec.TRANSFER_OK if success else rec.TRANSFER_FAILED, size, device_time,
                   start[2])

    def _emit(self, job_id, is_load, start, end, outcome, size, device_time, expedited,
              cause: str | None = None) -> None:
        c = self.ctx.pop(job_id, None)
        if c is None:
            # No step metadata named this job: metrics only, no trace to join.
            self.unjoined_results += 1
        self.sink.emit(rec.TransferRecord(
            sched_gen=self.sched_gen, job_id=job_id, req_id=c[0] if c else None,
            direction="h2d" if is_load else "d2h", blocks=c[2] if c else 0,
            size_bytes=size, device_time_s=device_time, rank=self.rank, worker_gen=self.gen,
            outcome=outcome, start_ns=start, end_ns=end, episode_epoch=c[3] if c else 0,
            expedited=expedited, end_cause=cause))

    def anomalies(self) -> dict[str, int]:
        return {"result_without_submit": self.unknown_results,
                "transfer_without_job": self.unjoined_results}

    def shutdown(self, t: int, cause: str = rec.END_CONNECTOR_SHUTDOWN) -> None:
        for job_id, (start, is_load, expedited) in list(self.inflight.items()):
            self._emit(job_id, is_load, start, t, rec.TRANSFER_CANCELLED, None, None, expedited,
                       cause)
        self.inflight.clear()
