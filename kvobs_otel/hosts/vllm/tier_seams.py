"""Secondary tiers of vLLM's TieringOffloadingSpec: what the seams record.

The tiers live in the scheduler process only (EngineCore). Every tier job,
whatever the tier (vLLM's ``fs``, ``obj``, ``p2p``, ``kvcr`` or an
out-of-tree ``SecondaryTierManager``), passes through the tiering manager's
own job registry, which reports it to vLLM's ``TieringMetricsTracker``
(``vllm/v1/kv_offload/tiering/manager.py``: ``_register_job`` just before
``tier.submit_load``/``submit_store``, ``_process_finished_jobs`` for each
``JobResult``). The seams wrap that tracker, so one generic seam sees every
tier. A promotion that found no free CPU chunk is seen at the tracker's
``on_promotion_allocation_failure()``, which vLLM calls without arguments
only from ``TieringOffloadingManager._initiate_promotion(tier_idx, key,
req_context)``: which tier and request it was are read from that caller's
arguments, on this rare path, rather than wrapping the promotion start that
every scheduling pass calls (the release shapes check both signatures). A
cascade declined by back-pressure is seen around ``_should_store_to_tier``
(inside ``complete_store`` or
``_cascade_existing_chunks_to_request_level_tiers``, which say whose chunks
they were), back-pressure turning on or off around ``_update_backpressure``.
The wrappers sit on the tracker's and the manager's classes (patching.py).

These run under the tiering manager's lock, on the scheduler thread or
(0.33+, tiers that poll off-thread, such as p2p) on vLLM's tier-poll
thread: they only read the job and offer a tuple.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvobs_otel.hosts.vllm import patching
from kvobs_otel.lifecycle import events as ev

_now = time.monotonic_ns


def describe(tier: Any) -> tuple[str, str, str]:
    """(type, medium, locality) of a tier as vLLM names them ("" unknown)."""
    def name(value: Any) -> str:
        return "" if value is None else str(getattr(value, "name", value)).lower()
    return (str(getattr(tier, "tier_type", "") or type(tier).__name__),
            name(getattr(tier, "medium", None)), name(getattr(tier, "locality", None)))


def tiering_manager(connector: Any) -> Any | None:
    """The connector's TieringOffloadingManager, or None (no secondary tiers)."""
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    if manager is None or not getattr(manager, "secondary_tiers", None):
        return None
    return manager if hasattr(manager, "_metrics") else None


class TierSeams:
    """What one tiering manager's jobs, no-room promotions, declined
    cascades and back-pressure changes record. vLLM's tracker and manager
    classes are watched (their methods wrapped on the class, patching.py);
    the wrappers find this object through the instances' ``_kvobs``."""

    def __init__(self, manager: Any, offer: Any, consumer: int, count: Any) -> None:
        self.manager = manager
        self.offer, self.consumer, self.count = offer, consumer, count
        self.tier_objects = list(manager.secondary_tiers)
        # The request whose chunks complete_store / the request-level cascade
        # is cascading now (under the manager's lock: one at a time).
        self.current: Any = None
        self.tracker = manager._metrics
        patching.watch(type(self.tracker), _TRACKER_WRAPPERS)
        patching.watch(type(manager), _MANAGER_WRAPPERS)
        self.tracker._kvobs = self
        manager._kvobs = self

    def unwrap(self) -> None:
        for obj in (self.tracker, self.manager):
            patching.forget(obj)

    def job_registered(self, job_metadata: Any) -> None:
        try:
            job = job_metadata.transfer_job
            offer = self.offer
            offer((self.consumer, ev.S_TIER_JOB, _now(), job_metadata.tier_idx, job.job_id,
                   bool(job.is_promotion), job.req_context.req_id, len(job.keys)))
        except Exception:
            self.count("seam")

    def job_finished(self, result: Any) -> None:
        try:
            ok = result.successful_keys
            offer = self.offer
            offer((self.consumer, ev.S_TIER_DONE, _now(), result.job_id, bool(result.success),
                   None if ok is None else len(ok), result.transfer_bytes,
                   result.transfer_time,
                   getattr(result, "deferred_release", None) is not None))
        except Exception:
            self.count("seam")

    def no_room(self, caller: Any) -> None:
        """``caller``: the frame that reported the failure (vLLM's
        _initiate_promotion, whose arguments say which tier and request)."""
        try:
            if caller.f_code.co_name != "_initiate_promotion":
                raise LookupError("no promotion to attribute the failure to")
            args = caller.f_locals
            self.offer((self.consumer, ev.S_TIER_NO_ROOM, _now(), args["tier_idx"],
                        args["req_context"].req_id))
        except Exception:
            self.count("seam")

    def skipped(self, tier: Any, num_blocks: int) -> None:
        try:
            ctx = self.current
            self.offer((self.consumer, ev.S_TIER_SKIP, _now(), self.tier_objects.index(tier),
                        None if ctx is None else ctx.req_id, int(num_blocks)))
        except Exception:
            self.count("seam")

    def pressure(self, tier: Any, before: bool) -> None:
        try:
            detector = tier.bp_detector
            after = detector is not None and detector.is_under_pressure()
            if after != before:
                self.offer((self.consumer, ev.S_TIER_PRESSURE, _now(),
                            self.tier_objects.index(tier), after))
        except Exception:
            self.count("seam")


# -- wrappers on vLLM's classes (parameters as the release shapes check them) ----------
def _on_job_registered(orig):
    def on_job_registered(self, job_metadata):
        orig(self, job_metadata)
        s = self._kvobs
        if s is not None:
            s.job_registered(job_metadata)
    return on_job_registered


def _on_job_finished(orig):
    def on_job_finished(self, job_metadata, result):
        orig(self, job_metadata, result)
        s = self._kvobs
        if s is not None:
            s.job_finished(result)
    return on_job_finished


def _on_promotion_allocation_failure(orig):
    def on_promotion_allocation_failure(self):
        orig(self)
        s = self._kvobs
        if s is not None:
            s.no_room(sys._getframe(1))
    return on_promotion_allocation_failure


def _whose_chunks(orig):
    # complete_store and _cascade_existing_chunks_to_request_level_tiers: the
    # request whose chunks _should_store_to_tier is asked about meanwhile.
    def cascading(self, keys, req_context, *args, **kwargs):
        s = self._kvobs
        if s is None:
            return orig(self, keys, req_context, *args, **kwargs)
        s.current = req_context
        try:
            return orig(self, keys, req_context, *args, **kwargs)
        finally:
            s.current = None
    return cascading


def _should_store_to_tier(orig):
    def _should_store_to_tier(self, tier, num_blocks):
        store = orig(self, tier, num_blocks)
        if not store:
            s = self._kvobs
            if s is not None:
                s.skipped(tier, num_blocks)
        return store
    return _should_store_to_tier


def _update_backpressure(orig):
    def _update_backpressure(self, tier, job_metadata, completed_job):
        s = self._kvobs
        if s is None:
            return orig(self, tier, job_metadata, completed_job)
        detector = tier.bp_detector
        before = detector is not None and detector.is_under_pressure()
        orig(self, tier, job_metadata, completed_job)
        s.pressure(tier, before)
    return _update_backpressure


_TRACKER_WRAPPERS = {"on_job_registered": _on_job_registered,
                     "on_job_finished": _on_job_finished,
                     "on_promotion_allocation_failure": _on_promotion_allocation_failure}
_MANAGER_WRAPPERS = {"complete_store": _whose_chunks,
                     "_cascade_existing_chunks_to_request_level_tiers": _whose_chunks,
                     "_should_store_to_tier": _should_store_to_tier,
                     "_update_backpressure": _update_backpressure}
