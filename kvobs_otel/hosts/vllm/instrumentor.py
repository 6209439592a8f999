"""Patch vLLM's OffloadingConnector classes; undo it exactly.

Patching the classes (not instances) reaches every subclass that inherits
the methods, such as vllm-ascend's AscendOffloadingConnector and its worker
(which overrides only ``register_kv_caches`` and still ends in
``_init_worker``). Wrappers call vLLM first or last, outside any ``try``, so
vLLM's own exceptions pass unchanged; the seams never raise.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from kvobs_otel.config import Settings
from kvobs_otel.hosts.vllm import patching, releases
from kvobs_otel.hosts.vllm.patching import ATTR as _ATTR
from kvobs_otel.hosts.vllm.patching import default as _default
from kvobs_otel.hosts.vllm.patching import wrap as _wrap

logger = logging.getLogger("kvobs_otel")
_now = time.monotonic_ns

_connectors: weakref.WeakSet[Any] = weakref.WeakSet()
# OffloadingWorkers given seams (their _kvobs is removed on uninstrument).
_workers: weakref.WeakSet[Any] = weakref.WeakSet()
_settings: Settings | None = None
_release: releases.Release | None = None
# Why this process's vLLM was refused (set once; vLLM then stays untouched).
_refusal: releases.Selection | None = None


# -- wrapper factories (one per seam) -------------------------------------------------
def _init(orig):
    def __init__(self, vllm_config, role, *args, **kwargs):
        # Its first attribute, whatever the role: the per-step wrappers' load
        # of it stays a specialized one on every connector of a process.
        self._kvobs = None
        orig(self, vllm_config, role, *args, **kwargs)
        _attach(self)
    return __init__


def _after(method: str):
    """Call vLLM, then the seam ``method`` with the same arguments."""
    def make(orig):
        def wrapper(self, *args, **kwargs):
            result = orig(self, *args, **kwargs)
            s = self._kvobs
            if s is not None:
                getattr(s, method)(*args, **kwargs)
            return result
        return wrapper
    return make


# Per-step seams: wrappers spelled out, with vLLM's exact parameters (the
# release's shape check, releases/, refuses a vLLM whose differ), so a call
# packs no tuple or dict of extra arguments: the seams' cost on the serving
# thread is mostly the Python they run, every step. They call the seam only
# when it can record something: most steps of most ranks have nothing.
# handle_preemptions, start_load_kv and wait_for_save are not watched: a
# step's extension is noted at bind_connector_metadata, which every runner
# calls each step (V2 right after handle_preemptions), and a rank's first
# computes are recorded when its worker metadata is built, after its forward
# (seams.WorkerSeams); the scheduler confirms them when the step's output
# comes back (_step_output).
def _note_step_bind(orig):
    def bind_connector_metadata(self, connector_metadata):
        s = self._kvobs
        if s is not None:
            step = connector_metadata.kvobs_step
            if step is not None and step is not s.last_step:
                s.note_step(step)
        return orig(self, connector_metadata)
    return bind_connector_metadata


def _worker_meta(orig):
    def build_connector_worker_meta(self):
        meta = orig(self)
        s = self._kvobs
        if s is not None and (meta is not None or s.pending):
            s.worker_meta(meta)
        return meta
    return build_connector_worker_meta


def _after_alloc(orig):
    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        result = orig(self, request, blocks, num_external_tokens, *args, **kwargs)
        s = self._kvobs
        if s is not None and request.num_preemptions:  # may be a re-admission
            s.after_alloc(request, num_external_tokens)
        return result
    return update_state_after_alloc


def _matched(orig):
    # Every waiting request, every scheduling pass: a pass that stays "not
    # yet" is only counted, here; the transitions into and out of it reach
    # the seam. (Our part in a try: it reads vLLM's request.)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        result = orig(self, request, num_computed_tokens)
        s = self._kvobs
        if s is not None:
            try:
                waits = s.waits
                if result[0] is None:
                    r = request.request_id
                    n = waits.get(r)
                    if n is None:
                        s.on_wait(r)
                    else:
                        waits[r] = n + 1
                elif waits:
                    r = request.request_id
                    if r in waits:
                        s.on_wait_end(r)
            except Exception:
                s.pipeline.count_error("seam")
        return result
    return get_num_new_matched_tokens


def _preempt(orig):
    # vllm.v1.core.sched.scheduler.Scheduler._preempt_request zeroes the
    # request's computed tokens: read them first (preemptions are rare).
    def _preempt_request(self, request, *args, **kwargs):
        connector = getattr(self, "connector", None)
        s = getattr(connector, _ATTR, None)
        if s is not None:
            s.on_preempt(request)
        elif connector is not None:  # a MultiConnector, perhaps
            for s, composed in scheduler_seams(connector):
                s.on_preempt(request, composed)
        return orig(self, request, *args, **kwargs)
    return _preempt_request


# MultiConnector.update_state_after_alloc calls in progress (the scheduler
# thread only): a MultiConnector inside another reports nothing itself.
_composing = [0]
_MAX_CONNECTORS = 32  # connectors scheduler_seams looks at, at most


def scheduler_seams(connector: Any) -> list[tuple[Any, bool]]:
    """The scheduler seams of every OffloadingConnector in the scheduler's
    connector: itself, or the children of vLLM's MultiConnector
    (multi_connector.py keeps them in ``_connectors``), nested or not; each
    with whether it is composed. Never raises."""
    out: list[tuple[Any, bool]] = []
    try:
        todo = [(connector, False)]
        # Bounded: a composition that refers to itself must not loop here.
        for _ in range(_MAX_CONNECTORS):
            if not todo:
                break
            c, composed = todo.pop()
            s = getattr(c, _ATTR, None)
            if s is not None:
                out.append((s, composed))
            else:
                todo.extend((child, True) for child in getattr(c, "_connectors", None) or ())
    except Exception:
        pass
    return out


def _multi_after_alloc(orig):
    # The scheduler's one call says what all connectors together bring back
    # (vLLM then gives it to the chosen child, 0 to the others): each
    # OffloadingConnector inside can tell its own tokens from the others'.
    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        _composing[0] += 1
        try:
            result = orig(self, request, blocks, num_external_tokens, *args, **kwargs)
        finally:
            _composing[0] -= 1
        if not _composing[0] and getattr(request, "num_preemptions", 0):
            for s, _c in scheduler_seams(self):
                s.after_alloc_composed(request, num_external_tokens)
        return result
    return update_state_after_alloc


def _connector_output(orig):
    # Only worker metadata a rank attached receipts to carries them
    # (metadata.py; vLLM's class reads None while patched): a step no rank
    # reported in costs two attribute loads.
    def update_connector_output(self, connector_output):
        result = orig(self, connector_output)
        s = self._kvobs
        if s is not None:
            meta = connector_output.kv_connector_worker_meta
            if meta is not None:
                receipts = meta.kvobs_receipts
                if receipts is not None:
                    s.on_receipts(receipts)
        return result
    return update_connector_output


def _step_output(orig):
    # A step that re-admitted requests (seams.AWAITING): its output, every
    # rank's, has come back; any other step costs a test of an empty dict.
    from kvobs_otel.hosts.vllm.seams import AWAITING

    def update_from_output(self, scheduler_output, model_runner_output):
        result = orig(self, scheduler_output, model_runner_output)
        if AWAITING:
            entry = AWAITING.pop(id(scheduler_output), None)
            if entry is not None:
                for s, admitted in entry[1]:
                    s.on_step_output(admitted)
        return result
    return update_from_output


def _aggregate(orig):
    # vLLM's KVOutputAggregator calls aggregate() for the second and every
    # further rank that returned worker metadata in a step; vLLM's builds a
    # new object from its own fields: the ranks' receipts are joined onto it.
    from kvobs_otel.hosts.vllm.metadata import RECEIPTS_ATTR, merged

    def aggregate(self, other):
        mine, theirs = self.kvobs_receipts, getattr(other, RECEIPTS_ATTR, None)
        out = orig(self, other)
        if mine is not None or theirs is not None:
            out.kvobs_receipts = merged(mine, theirs)
        return out
    return aggregate


def _build_meta(orig):
    def build_connector_meta(self, scheduler_output):
        meta = orig(self, scheduler_output)
        s = self._kvobs
        if s is not None:
            s.after_build_meta(scheduler_output, meta)
        return meta
    return build_connector_meta


def _shutdown(orig):
    def shutdown(self):
        try:
            orig(self)
        finally:
            s = self._kvobs
            if s is not None:
                s.on_shutdown()
    return shutdown


def _init_worker(orig):
    def _init_worker(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        s = self._kvobs
        if s is not None:
            _observe_worker(self, s)
    return _init_worker


def _register_kv_caches(orig):
    def register_kv_caches(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        s = self._kvobs
        if s is not None and getattr(self, "connector_worker", None) is not None:
            _observe_worker(self.connector_worker, s)
        return result
    return register_kv_caches


# The OffloadingWorker (the copy engine: vLLM's, the harness's, vllm-ascend's)
# is one of several classes, known once _init_worker built it: its class is
# watched then (patching.watch). A transfer starts when it is submitted (a
# copy engine may copy inside submit: the harness's CPU backend, some device
# handlers). Positional like vLLM's calls (connector worker.py); the
# parameters after job_id are named differently by each release.
def _submit_store(orig):
    def submit_store(self, job_id, src, dst):
        s = self._kvobs
        if s is None:
            return orig(self, job_id, src, dst)
        t = _now()
        ok = orig(self, job_id, src, dst)
        s.on_submit(t, job_id, False, ok, False)
        return ok
    return submit_store


def _submit_load(orig):
    def submit_load(self, job_id, src, dst, *args, **kwargs):
        s = self._kvobs
        if s is None:
            return orig(self, job_id, src, dst, *args, **kwargs)
        t = _now()
        ok = orig(self, job_id, src, dst, *args, **kwargs)
        s.on_submit(t, job_id, True, ok, kwargs.get("expedited", args[0] if args else False))
        return ok
    return submit_load


def _get_finished(orig):
    def get_finished(self):
        results = orig(self)
        if results:  # most steps finish nothing
            s = self._kvobs
            if s is not None:
                s.on_results(results)
        return results
    return get_finished


_WORKER_WRAPPERS = {"submit_store": _submit_store, "submit_load": _submit_load,
                    "get_finished": _get_finished}


def _observe_worker(connector_worker: Any, s: Any) -> None:
    """The connector's OffloadingWorker gets the worker seams; called after
    _init_worker and again after register_kv_caches, for a subclass that swaps
    its worker in after construction (vllm-ascend does). Never raises."""
    try:
        connector_worker._kvobs = s
        worker = getattr(connector_worker, "worker", None)
        if worker is not None and getattr(worker, _ATTR, None) is not s:
            patching.watch(type(worker), _WORKER_WRAPPERS)
            worker._kvobs = s
            _workers.add(worker)
    except Exception:
        s.pipeline.count_error("seam")


def _attach(connector: Any) -> None:
    """Give a freshly built connector its role's seams (never raises)."""
    settings, release = _settings, _release
    if settings is None or release is None or not settings.enabled:
        return
    try:
        from kvobs_otel.hosts.vllm.seams import SchedulerSeams, WorkerSeams
        from kvobs_otel.pipeline import get_pipeline

        pipeline = get_pipeline(settings)
        if getattr(connector, "connector_scheduler", None) is not None:
            setattr(connector, _ATTR, SchedulerSeams(connector, settings, pipeline, release))
        elif getattr(connector, "connector_worker", None) is not None:
            seams = WorkerSeams(connector, settings, pipeline, release)
            setattr(connector, _ATTR, seams)
            setattr(connector.connector_worker, _ATTR, seams)
        _connectors.add(connector)
    except Exception:
        logger.warning("kvobs-otel: could not attach to %s; observation off for it",
                       type(connector).__name__, exc_info=True)


def refusal() -> releases.Selection | None:
    return _refusal


def choose_release(settings: Settings) -> releases.Release | None:
    """The release adapter for the installed vLLM, or None after refusing
    (one log line, counted in kvobs.host.refused, nothing patched)."""
    global _refusal
    import vllm

    sel = releases.decide(str(vllm.__version__))
    if sel.release is not None:
        if sel.untested:
            logger.warning("kvobs-otel: vLLM %s is newer than the newest tested %s; "
                           "its shape matches the %s seams, observing (untested)",
                           sel.version, sel.release.tested, sel.release.name)
        return sel.release
    _refusal = sel
    logger.error("kvobs-otel: observation stays off, vLLM untouched: %s", sel.detail)
    _export_refusal(settings, sel)
    return None


def _export_refusal(settings: Settings, sel: releases.Selection) -> None:
    try:
        from kvobs_otel.hosts.platform import device_type
        from kvobs_otel.lifecycle.refused import RefusedHost
        from kvobs_otel.pipeline import get_pipeline
        from kvobs_otel.telemetry import attributes as A

        pipeline = get_pipeline(settings)
        pipeline.register(
            (RefusedHost, {"reasons": releases.REFUSAL_REASONS, "reason": sel.reason or ""}),
            {A.RES_ROLE: "host", A.RES_VLLM_VERSION: sel.version, A.RES_HOST_ADAPTER: "vllm",
             A.RES_DEVICE: device_type(settings)})
    except Exception:
        logger.warning("kvobs-otel: could not export the refusal", exc_info=True)


def patch_classes(settings: Settings, release: releases.Release) -> None:
    global _settings, _release
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvobs_otel.hosts.vllm.metadata import RECEIPTS_ATTR, STEP_ATTR

    _settings, _release = settings, release
    C = OffloadingConnector
    _default(C, _ATTR, None)
    _default(OffloadingConnectorWorker, _ATTR, None)
    # The metadata extensions (metadata.py) read None where a step has none:
    # nothing to pickle on such a step, one attribute load to read it.
    _default(OffloadingConnectorMetadata, STEP_ATTR, None)
    _default(OffloadingWorkerMetadata, RECEIPTS_ATTR, None)
    _wrap(C, "__init__", _init)
    # scheduler role
    _wrap(C, "on_new_request", _after("on_new_request"))
    _wrap(C, "get_num_new_matched_tokens", _matched)
    _wrap(C, "update_state_after_alloc", _after_alloc)
    _wrap(C, "build_connector_meta", _build_meta)
    _wrap(C, "update_connector_output", _connector_output)
    _wrap(C, "request_finished", _after("on_request_finished"))
    _wrap(C, "request_finished_all_groups", _after("on_request_finished"))
    _wrap(C, "reset_cache", _after("on_reset_cache"))
    _wrap(Scheduler, "_preempt_request", _preempt)
    _wrap(Scheduler, "update_from_output", _step_output)
    # worker role
    _wrap(C, "bind_connector_metadata", _note_step_bind)
    _wrap(C, "build_connector_worker_meta", _worker_meta)
    _wrap(OffloadingWorkerMetadata, "aggregate", _aggregate)
    _wrap(C, "register_kv_caches", _register_kv_caches)
    _wrap(OffloadingConnectorWorker, "_init_worker", _init_worker)
    # both
    _wrap(C, "shutdown", _shutdown)
    # composed: the OffloadingConnector as a MultiConnector child
    problems = release.multi_problems()
    if problems:
        logger.warning("kvobs-otel: inside vLLM's MultiConnector, the tokens other connectors "
                       "bring back are not told apart (kvobs.tokens.resident stays unset): "
                       "its classes differ from the %s seams: %s", release.name,
                       "; ".join(problems))
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiConnector,
        )

        _wrap(MultiConnector, "update_state_after_alloc", _multi_after_alloc)


def unpatch_classes() -> None:
    global _settings, _release, _refusal
    from kvobs_otel.hosts.vllm.seams import SchedulerSeams

    patching.undo_all()
    for connector in list(_connectors):
        s = patching.forget(connector)
        patching.forget(getattr(connector, "connector_worker", None))
        if isinstance(s, SchedulerSeams):
            s.unwrap()
    for worker in list(_workers):
        patching.forget(worker)
    _connectors.clear()
    _workers.clear()
    _settings = _release = _refusal = None
    from kvobs_otel.pipeline import close_pipeline

    close_pipeline()


def is_patched() -> bool:
    return patching.patched()
