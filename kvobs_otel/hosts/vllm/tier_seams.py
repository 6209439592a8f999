"""Secondary tiers of vLLM's TieringOffloadingSpec: what the seams record.

The tiers live in the scheduler process only (EngineCore). Every tier job,
whatever the tier (vLLM's ``fs``, ``obj``, ``p2p``, ``kvcr`` or an
out-of-tree ``SecondaryTierManager``), passes through the tiering manager's
own job registry, which reports it to vLLM's ``TieringMetricsTracker``
(``vllm/v1/kv_offload/tiering/manager.py``: ``_register_job`` just before
``tier.submit_load``/``submit_store``, ``_process_finished_jobs`` for each
``JobResult``). The seams wrap that one tracker instance, so one generic
seam sees every tier. A promotion that found no free CPU chunk is seen
around ``TieringOffloadingManager._initiate_promotion`` (it returns False), a
cascade declined by back-pressure around ``_should_store_to_tier`` (inside
``complete_store`` or ``_cascade_existing_chunks_to_request_level_tiers``,
which say whose chunks they were), back-pressure turning on or off around
``_update_backpressure``.

These run under the tiering manager's lock, on the scheduler thread or
(0.33+, tiers that poll off-thread, such as p2p) on vLLM's tier-poll
thread: they only read the job and offer a tuple.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvobs_otel.lifecycle import events as ev

logger = logging.getLogger("kvobs_otel")
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
    """Wraps one tiering manager's tracker and promotion start (instance
    attributes only: ``unwrap`` restores the class's methods)."""

    def __init__(self, manager: Any, offer: Any, consumer: int, count: Any) -> None:
        self.manager = manager
        self.tiers = [describe(t) for t in manager.secondary_tiers]
        tracker = manager._metrics
        registered, finished = tracker.on_job_registered, tracker.on_job_finished
        initiate = manager._initiate_promotion
        complete, cascade_existing = (manager.complete_store,
                                      manager._cascade_existing_chunks_to_request_level_tiers)
        should_store, update_pressure = (manager._should_store_to_tier,
                                         manager._update_backpressure)
        tiers = list(manager.secondary_tiers)
        # The request whose chunks complete_store / the request-level cascade
        # is cascading now (under the manager's lock: one at a time).
        current: list[Any] = [None]

        def on_job_registered(job_metadata: Any) -> None:
            registered(job_metadata)
            try:
                job = job_metadata.transfer_job
                offer((consumer, ev.S_TIER_JOB, _now(), job_metadata.tier_idx, job.job_id,
                       bool(job.is_promotion), job.req_context.req_id, len(job.keys)))
            except Exception:
                count("seam")

        def on_job_finished(job_metadata: Any, result: Any) -> None:
            finished(job_metadata, result)
            try:
                ok = result.successful_keys
                offer((consumer, ev.S_TIER_DONE, _now(), result.job_id, bool(result.success),
                       None if ok is None else len(ok), result.transfer_bytes,
                       result.transfer_time,
                       getattr(result, "deferred_release", None) is not None))
            except Exception:
                count("seam")

        def _initiate_promotion(tier_idx: int, key: Any, req_context: Any) -> bool:
            started = initiate(tier_idx, key, req_context)
            if not started:
                try:
                    offer((consumer, ev.S_TIER_NO_ROOM, _now(), tier_idx, req_context.req_id))
                except Exception:
                    count("seam")
            return started

        def complete_store(keys: Any, req_context: Any, success: bool = True) -> None:
            current[0] = req_context
            try:
                return complete(keys, req_context, success)
            finally:
                current[0] = None

        def _cascade_existing_chunks_to_request_level_tiers(
                keys: Any, req_context: Any, request_level_tiers: Any) -> None:
            current[0] = req_context
            try:
                return cascade_existing(keys, req_context, request_level_tiers)
            finally:
                current[0] = None

        def _should_store_to_tier(tier: Any, num_blocks: int) -> bool:
            store = should_store(tier, num_blocks)
            if not store:
                try:
                    ctx = current[0]
                    offer((consumer, ev.S_TIER_SKIP, _now(), tiers.index(tier),
                           None if ctx is None else ctx.req_id, int(num_blocks)))
                except Exception:
                    count("seam")
            return store

        def _update_backpressure(tier: Any, job_metadata: Any, completed_job: Any) -> None:
            detector = tier.bp_detector
            before = detector is not None and detector.is_under_pressure()
            update_pressure(tier, job_metadata, completed_job)
            try:
                after = detector is not None and detector.is_under_pressure()
                if after != before:
                    offer((consumer, ev.S_TIER_PRESSURE, _now(), tiers.index(tier), after))
            except Exception:
                count("seam")

        self._wrapped = [(tracker, "on_job_registered", on_job_registered),
                         (tracker, "on_job_finished", on_job_finished),
                         (manager, "_initiate_promotion", _initiate_promotion),
                         (manager, "complete_store", complete_store),
                         (manager, "_cascade_existing_chunks_to_request_level_tiers",
                          _cascade_existing_chunks_to_request_level_tiers),
                         (manager, "_should_store_to_tier", _should_store_to_tier),
                         (manager, "_update_backpressure", _update_backpressure)]
        for obj, name, fn in self._wrapped:
            setattr(obj, name, fn)

    def unwrap(self) -> None:
        for obj, name, fn in self._wrapped:
            if obj.__dict__.get(name) is fn:
                del obj.__dict__[name]
        self._wrapped = []
