"""What stays in the vLLM process: the bounded buffer and its drain.

serving thread --offer()--> EventBuffer --drain thread--> export side

The export side (``observers.py``: lifecycle state machines, span and metric
builders, providers, OTLP) runs in a sidecar process by default: the drain
thread only pickles the plain event tuples into a pipe (``sidecar/``). With
``KVOBS_OTEL_EXPORT=in-process`` (or when the sidecar failed too often) it
runs on the drain thread itself.

One ``Pipeline`` per process (recreated in a forked child). Each observed
connector role registers once and gets a key; its events are tuples
``(key, kind, t_ns, *fields)``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvobs_otel.buffer import EventBuffer
from kvobs_otel.config import EXPORT_IN_PROCESS, Settings
from kvobs_otel.observers import (
    CLOSE_TIMEOUT_S,
    CONTROL_KEY,
    ERROR_STAGES,
    METRICS_CLOSE_TIMEOUT_S,
    REGISTER,
    LifecycleSpec,
    Observer,
    ObserverSet,
)

logger = logging.getLogger("kvobs_otel")

__all__ = ["CLOSE_TIMEOUT_S", "METRICS_CLOSE_TIMEOUT_S", "ERROR_STAGES", "Pipeline",
           "close_pipeline", "current_pipeline", "get_pipeline"]


def _overrides_set() -> bool:
    # Tests and the demo hand exporters of this process to the providers:
    # those cannot move to a sidecar. Read without importing the SDK.
    providers = sys.modules.get("kvobs_otel.telemetry.providers")
    o = getattr(providers, "_overrides", None)
    return o is not None and (o.span_processor is not None or o.metric_reader is not None)


class Pipeline:
    def __init__(self, settings: Settings, in_process: bool = False) -> None:
        self.settings = settings
        self.buffer = EventBuffer(settings.buffer_size)
        self.offer = self.buffer.offer  # the serving path's only call
        self._errors: Counter[str] = Counter()
        self._logged: set[str] = set()
        # Reentrant: a consumer may register an observer while being drained
        # (the vLLM-HUST adapter makes one per role and rank it first sees).
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._next_key = 1
        self._keys = threading.Lock()
        # Links given up on: their sidecar_lost still counts (read live: a
        # write in progress when the link was retired may still add to it).
        self._retired: list[Any] = []
        # key -> (spec, resource, progress): what a (re)started sidecar is told
        self.registered: dict[int, tuple[LifecycleSpec, dict[str, Any],
                                         Callable[[], int] | None]] = {}
        self.local: ObserverSet | None = None
        self.link: Any = None  # sidecar.link.SidecarLink
        if in_process or settings.export == EXPORT_IN_PROCESS or _overrides_set():
            self.local = ObserverSet(settings)
        else:
            from kvobs_otel.sidecar.link import SidecarLink

            self.link = SidecarLink(self)
            self.link.start()

    @property
    def observers(self) -> list[Observer]:
        """The in-process observers (none when a sidecar exports)."""
        return list(self.local.observers.values()) if self.local is not None else []

    # -- counters ----------------------------------------------------------------
    def count_error(self, stage: str, quiet: bool = False) -> None:
        """Count an internal failure; log the first of each stage (with its
        traceback) unless ``quiet`` (the caller said it already)."""
        self._errors[stage] += 1
        if not quiet and stage not in self._logged:
            # Once per stage, not per event: a broken stage must not flood logs.
            self._logged.add(stage)
            logger.warning("kvobs-otel: internal failure in %s (contained, counted; "
                           "further ones are only counted)", stage, exc_info=True)

    def own_drops(self) -> dict[str, int]:
        """What this process lost before the export side saw it."""
        lost = sum(link.lost for link in self._retired) + (
            self.link.lost if self.link is not None else 0)
        out = {"buffer_full": self.buffer.dropped_full}
        if lost or self.settings.export != EXPORT_IN_PROCESS:
            out["sidecar_lost"] = lost
        return out

    def own_errors(self) -> dict[str, int]:
        return dict(self._errors)

    def error_counts(self) -> dict[str, int]:
        if self.local is not None:
            self._share_counts(self.local)
            return self.local.error_counts()
        return {**dict.fromkeys(ERROR_STAGES, 0), **self._errors}

    def drop_counts(self) -> dict[str, int]:
        """Everything recorded but not delivered, by where it was lost (the
        export side's own losses only when it runs in this process)."""
        if self.local is not None:
            self._share_counts(self.local)
            return self.local.drop_counts()
        return self.own_drops()

    def exported_spans(self) -> int:
        return self.local.exported_spans() if self.local is not None else 0

    def _share_counts(self, local: ObserverSet) -> None:
        local.remote_drops = self.own_drops()
        local.remote_errors = self.own_errors()

    # -- observers -------------------------------------------------------------------
    def register(self, spec: LifecycleSpec, resource: dict[str, Any],
                 progress: Callable[[], int] | None = None) -> int:
        """A new observed role; returns the key its events carry."""
        if self.link is not None:
            # Called on vLLM's thread (connector init): never waits for the
            # drain thread, which may be waiting on the pipe.
            with self._keys:
                key = self._new_key(spec, resource, progress)
            self.link.register(key, spec, resource, progress is not None)
        else:
            with self._lock:
                key = self._new_key(spec, resource, progress)
                if self.local is not None:
                    self._share_counts(self.local)
                    self.local.add(key, spec, resource, progress is not None)
                else:  # the sidecar was given up on just now
                    self.buffer.put_control((CONTROL_KEY, REGISTER, key, spec, resource,
                                             progress is not None))
        self._ensure_thread()
        return key

    def _new_key(self, spec: LifecycleSpec, resource: dict[str, Any],
                 progress: Callable[[], int] | None) -> int:
        key = self._next_key
        self._next_key += 1
        self.registered[key] = (spec, resource, progress)
        return key

    def lifecycle(self, key: int) -> Any:
        """An in-process observer's lifecycle (tests, the vLLM-HUST router)."""
        obs = self.local.observers.get(key) if self.local is not None else None
        return obs.lifecycle if obs is not None else None

    def close_observer(self, key: int) -> None:
        """The role shut down: export what it recorded, then close it. The
        last one closes the process's export side (bounded)."""
        with self._lock:
            if self.registered.pop(key, None) is None:
                return
            self._drain_locked()
            if self.local is not None:
                self._share_counts(self.local)
                self.local.close_observer(key)
            else:
                self.link.close_observer(key)
                if not self.registered:
                    self.link.end(CLOSE_TIMEOUT_S + METRICS_CLOSE_TIMEOUT_S)

    def fall_back_in_process(self) -> None:
        """The sidecar failed past its restart budget: export from here,
        as with KVOBS_OTEL_EXPORT=in-process (called with the lock held)."""
        if self.link is not None:
            self.link.retire()
            self._retired.append(self.link)
            self.link = None
        local = self.local = ObserverSet(self.settings)
        self._share_counts(local)
        for key, (spec, resource, progress) in self.registered.items():
            local.add(key, spec, resource, progress is not None)

    # -- drain thread ------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvobs-otel-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.settings.drain_interval_s
        while not self._stop:
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self.drain_once()
            except Exception:
                self.count_error("drain")  # the thread must outlive a bug

    def drain_once(self) -> int:
        """Hand everything buffered now to the export side, then run its
        deadlines. Thread-safe."""
        with self._lock:
            return self._drain_locked()

    def _drain_locked(self) -> int:
        # The step counts, read before draining: every event of the steps
        # they count was offered by now, so the (time, count) mark follows
        # them in the stream (deadlines run in event time).
        progress = {key: p() for key, (_s, _r, p) in list(self.registered.items())
                    if p is not None}
        mark = (time.monotonic_ns(), progress)
        batches = []
        while True:
            batch = self.buffer.drain()
            if not batch:
                break
            batches.append(batch)
        if self.link is not None:
            self.link.check()  # (may fall back in-process)
        if self.link is not None:
            self.link.send(batches, mark)  # one write for the whole cycle
        else:
            local = self.local
            for batch in batches:
                local.handle(batch)
            local.advance(*mark)
            local.tick(time.monotonic_ns())
        return sum(len(b) for b in batches)

    def flush(self) -> None:
        """Everything recorded so far handed to the export side (in-process:
        handled; sidecar: written to its pipe)."""
        self.drain_once()

    def wake(self) -> None:
        """The drain thread runs its next cycle now (a registration waits)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
        self.drain_once()

    def close(self) -> None:
        """Flush and close the export side, bounded (uninstrument, exit)."""
        if self.link is not None:  # a write waiting on a stalled sidecar gives up by then
            self.link.closing_by = time.monotonic() + CLOSE_TIMEOUT_S + METRICS_CLOSE_TIMEOUT_S
        self.stop()
        with self._lock:
            self.registered.clear()
            if self.link is not None:
                self.link.end(CLOSE_TIMEOUT_S + METRICS_CLOSE_TIMEOUT_S)
            if self.local is not None:
                self._share_counts(self.local)
                self.local.close()

    def after_fork_in_child(self) -> None:
        """This process's copy, inherited by a forked child: let go of the
        sidecar's pipe so the sidecar still sees its parent's end."""
        if self.link is not None:
            self.link.forget()


_pipeline: Pipeline | None = None
_pipeline_lock = threading.Lock()


def get_pipeline(settings: Settings, in_process: bool = False) -> Pipeline:
    """The process's pipeline, made on first use (and anew after a fork)."""
    global _pipeline
    with _pipeline_lock:
        if _pipeline is None or _pipeline._pid != os.getpid():
            _pipeline = Pipeline(settings, in_process)
        return _pipeline


def current_pipeline() -> Pipeline | None:
    return _pipeline


def close_pipeline() -> None:
    """Flush and close every observer, stop the drain thread (uninstrument)."""
    global _pipeline
    with _pipeline_lock:
        pipeline, _pipeline = _pipeline, None
    if pipeline is None or pipeline._pid != os.getpid():
        return
    pipeline.close()


def _after_fork_in_child() -> None:
    # The child's copy of the buffer holds the parent's events and its drain
    # thread does not exist: start clean. Connectors are built after worker
    # start, so in practice they are made in the child.
    global _pipeline
    pipeline, _pipeline = _pipeline, None
    if pipeline is not None:
        pipeline.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# A clean exit, and SIGTERM where the process turns it into SystemExit (vLLM's
# engine core and workers do), flush what was recorded. Bounded: each
# observer's flush and the export stage's shutdown have timeouts.
atexit.register(close_pipeline)
