"""An out-of-tree secondary tier for fault injection: vLLM's real ``fs`` tier
(``vllm/v1/kv_offload/tiering/fs/manager.py``, FileSystemTierManager) with
some of its jobs failed, delayed or hung. Loaded the way vLLM loads any
out-of-tree tier (``tiering/factory.py``: ``type`` = the class name plus
``module_path``), so kvobs-otel sees it through the same seams as every
tier. The jobs it does not alter are the fs tier's own.

Config (the tier's entry in ``secondary_tiers``)::

    {"type": "FaultyFsTier", "module_path": "kvobs_otel.tools.harness.faulty_tier",
     "root_dir": ..., "fault": {"kind": "promotion", "mode": "fail", "count": 1}}

``kind``: "promotion" or "cascade". ``mode``: "fail" (nothing is read or
written; the job reports ``success=False``), "slow" (the fs job runs; its
result is held ``delay_s`` more) or "hang" (nothing is read or written and
no result comes until ``delay_s`` passed, if given, else until vLLM drains
the tier). ``count``: how many jobs of that kind (omitted: all).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

MODES = ("fail", "slow", "hang")
KINDS = ("promotion", "cascade")


class FaultyFsTier(FileSystemTierManager):
    def __init__(self, *args: Any, fault: dict[str, Any] | None = None, **kwargs: Any) -> None:
        fault = dict(fault or {})
        self.fault_kind = fault.get("kind", "promotion")
        self.fault_mode = fault.get("mode", "fail")
        if self.fault_kind not in KINDS or self.fault_mode not in MODES:
            raise ValueError(f"fault kind must be one of {KINDS} and mode one of {MODES}: "
                             f"{fault!r}")
        self.fault_delay_s = fault.get("delay_s")
        self.fault_remaining: int | None = fault.get("count")
        # job_id -> (result, due monotonic time or None: at drain)
        self._held: dict[int, tuple[JobResult, float | None]] = {}
        # What this tier did to which job, for tests: job_id -> mode.
        self.faulted: dict[int, str] = {}
        self._failed_loads: dict[int, list[Any]] = {}
        super().__init__(*args, **kwargs)

    def _takes(self, job: TransferJob) -> bool:
        kind = "promotion" if job.is_promotion else "cascade"
        if kind != self.fault_kind or self.fault_remaining == 0:
            return False
        if self.fault_remaining is not None:
            self.fault_remaining -= 1
        self.faulted[job.job_id] = self.fault_mode
        return True

    def _submit(self, job: TransferJob, real: Any) -> None:
        if not self._takes(job):
            real(job)
        elif self.fault_mode == "slow":
            real(job)  # its result is held in get_finished_jobs
        else:
            due = (time.monotonic() + float(self.fault_delay_s)
                   if self.fault_mode == "hang" and self.fault_delay_s is not None
                   else None if self.fault_mode == "hang" else 0.0)
            self._held[job.job_id] = (JobResult(job.job_id, False), due)
            if job.is_promotion:
                # As the fs tier does for a failed read (its get_finished_jobs):
                # those keys are a miss from now on, so vLLM recomputes them.
                self._failed_loads[job.job_id] = list(job.keys)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, super().submit_load)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, super().submit_store)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        now = time.monotonic()
        out = []
        for result in super().get_finished_jobs():
            if self.faulted.get(result.job_id) == "slow":
                self._held[result.job_id] = (result, now + float(self.fault_delay_s or 0.0))
            else:
                out.append(result)
        for job_id, (result, due) in list(self._held.items()):
            if due is not None and due <= now:
                del self._held[job_id]
                keys = self._failed_loads.pop(job_id, None)
                if keys:
                    self._lookup_manager.mark_miss(keys)
                out.append(result)
        return out

    def has_pending_work(self) -> bool:
        return bool(self._held) or super().has_pending_work()

    def drain_jobs(self) -> None:
        super().drain_jobs()
        # Everything held is due now: vLLM waits for every job here.
        self._held = {j: (r, 0.0) for j, (r, _due) in self._held.items()}
