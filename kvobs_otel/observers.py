"""The export side of one vLLM process: lifecycles, builders and providers.

It runs wherever the process's events are exported from: in a sidecar
process (the default, ``sidecar/``) or on the process's own drain thread
(``KVOBS_OTEL_EXPORT=in-process``). Either way it is fed the same plain
event tuples ``(observer key, kind, t_ns, *fields)``; ``pipeline.py`` is the
part that stays in vLLM.

One ``Observer`` per observed connector role, each with its own providers so
its resource says which role and rank it is; one process meter for what the
process as a whole dropped, failed and delivered.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvobs_otel import identity
from kvobs_otel.clock import wall_anchor_ns
from kvobs_otel.config import Settings

logger = logging.getLogger("kvobs_otel")

# Every stage is reported from the start (at 0), so dashboards and alerts see
# a series before the first failure.
ERROR_STAGES = ("seam", "lifecycle", "deadline", "span_build", "metric_record",
                "shutdown", "export_shutdown", "sidecar", "drain")

# vLLM gives its EngineCore and workers 5 s after SIGTERM before it kills
# them (--shutdown-timeout; vllm/v1/utils.py, shutdown): the final flush of
# spans and counts must fit well inside that.
CLOSE_TIMEOUT_S = 3.0
# Then the process's own counts (delivered, dropped) get their final export.
METRICS_CLOSE_TIMEOUT_S = 1.5

# (factory, keyword arguments): the factory is called as
# ``factory(sink=..., **kwargs)`` (plus ``stepped=True`` for a host that
# counts its engine steps: its deadlines run in event time). For
# the sidecar both must pickle: a module-level class and plain values.
LifecycleSpec = tuple[Callable[..., Any], dict[str, Any]]

# Controls travel among the events (key 0) so that they keep their order:
# a role's registration before its first event, its close after its last.
CONTROL_KEY = 0
REGISTER = "register"  # (0, REGISTER, key, spec, resource, stepped)
CLOSE = "close"  # (0, CLOSE, key)


class Observer:
    """Lifecycle + builders + providers for one connector role instance."""

    def __init__(self, owner: ObserverSet, spec: LifecycleSpec,
                 resource_attributes: dict[str, Any], stepped: bool = False) -> None:
        # Imported here: with observation disabled the SDK is never imported.
        from kvobs_otel.telemetry.metrics import MetricsBuilder
        from kvobs_otel.telemetry.providers import make_providers
        from kvobs_otel.telemetry.spans import SpanBuilder

        s = owner.settings
        self.owner = owner
        self.providers = make_providers(resource_attributes)
        self.spans = SpanBuilder(self.providers, s.traffic_sample_ratio, s.roster_cap,
                                 offset_ns=owner.clock_offset_ns)
        self.pseudonym = (identity.RequestIdHasher(s.request_id_key)
                          if s.request_id_key else None)
        factory, kwargs = spec
        if stepped:
            kwargs = {**kwargs, "stepped": True}
        self.lifecycle = lc = factory(sink=self, **kwargs)
        # Drops, errors and deliveries are per process: the process meter.
        self.metrics = MetricsBuilder(
            self.providers,
            open_receipts=((lambda: lc.open_receipts) if hasattr(lc, "open_receipts") else None),
            anomalies=lc.anomalies, refused=getattr(lc, "refusals", None),
            tiers=getattr(lc, "tier", None),
            scheduler=lc.role == "scheduler",
            worker_rank=getattr(lc, "rank", None) if lc.role == "worker" else None)
        self.closed = False

    # RecordSink
    def emit(self, record: Any) -> None:
        if self.pseudonym is not None:
            try:
                self.pseudonym.apply(record)
            except Exception:
                self.owner.count_error("span_build")
                return  # never export the raw id instead
        try:
            self.spans.build(record)
        except Exception:
            self.owner.count_error("span_build")
        try:
            self.metrics.record(record)
        except Exception:
            self.owner.count_error("metric_record")

    def tick(self, now: int) -> None:
        tick = getattr(self.lifecycle, "tick", None)
        if tick is not None:
            tick(now)

    def advance(self, t: int, steps: int) -> None:
        advance = getattr(self.lifecycle, "advance", None)
        if advance is not None:
            advance(t, steps)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush and stop exporting (the events must have been handled)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.providers.close(timeout_s)
        except Exception:
            self.owner.count_error("export_shutdown")


class ObserverSet:
    """Every observer of one vLLM process, by key, and the process meter.

    ``pid`` and ``clock_offset_ns`` are the observed process's: in a sidecar
    its resources still name the vLLM process, and its spans use that
    process's wall clock. ``remote`` counts come from the vLLM process (what
    its buffer and seams lost); the rest is counted here."""

    def __init__(self, settings: Settings, *, pid: int | None = None,
                 clock_offset_ns: int | None = None, mode: str = "in-process") -> None:
        self.settings = settings
        self.pid = os.getpid() if pid is None else pid
        self.clock_offset_ns = (wall_anchor_ns() if clock_offset_ns is None
                                else clock_offset_ns)
        self.mode = mode
        self.observers: dict[int, Observer] = {}
        self.process_metrics: Any = None
        self.remote_drops: dict[str, int] = {}
        self.remote_errors: dict[str, int] = {}
        self._errors: Counter[str] = Counter()
        self._drops: Counter[str] = Counter()  # counted here (process_killed)
        self._logged: set[str] = set()
        self.controls_seen = 0
        self.last_event_ns = 0  # the newest event handled (its seam's t_ns)
        if mode != "in-process":
            # From 0, so that an alert's increase() sees the first loss.
            self._drops["process_killed"] = 0

    # -- counters ----------------------------------------------------------------
    def count_error(self, stage: str) -> None:
        self._errors[stage] += 1
        if stage not in self._logged:
            # Once per stage, not per event: a broken stage must not flood logs.
            self._logged.add(stage)
            logger.warning("kvobs-otel: internal failure in %s (contained, counted; "
                           "further ones are only counted)", stage, exc_info=True)

    def error_counts(self) -> dict[str, int]:
        from kvobs_otel.telemetry import export

        out = Counter(dict.fromkeys(ERROR_STAGES, 0))
        out.update(self.remote_errors)
        out.update(self._errors)
        out.update(export.STATS.snapshot()[2])
        return dict(out)

    def drop_counts(self) -> dict[str, int]:
        """Everything recorded but not delivered, by where it was lost."""
        from kvobs_otel.telemetry import export

        out = Counter(self.remote_drops)
        out.update(self._drops)
        out.update(export.STATS.snapshot()[1])
        return dict(out)

    @staticmethod
    def exported_spans() -> int:
        from kvobs_otel.telemetry import export

        return export.STATS.snapshot()[0]

    # -- observers -------------------------------------------------------------------
    def add(self, key: int, spec: LifecycleSpec, resource: dict[str, Any],
            stepped: bool = False) -> Observer | None:
        attrs = {"process.pid": self.pid, **resource}
        try:
            observer = Observer(self, spec, attrs, stepped)
        except Exception:
            logger.warning("kvobs-otel: could not make an observer for %s; its events are "
                           "counted as lifecycle failures", resource.get("kvobs.role"),
                           exc_info=True)
            return None
        self.observers[key] = observer
        if self.process_metrics is None:
            self.process_metrics = self._make_process_metrics()
        return observer

    def _make_process_metrics(self) -> Any:
        """One meter for the process as a whole (drops, errors, deliveries):
        reported once per process, by a resource that lives as long as it."""
        from kvobs_otel.telemetry import attributes as A
        from kvobs_otel.telemetry.metrics import MetricsBuilder
        from kvobs_otel.telemetry.providers import make_providers

        # A stable identity: if a connector (or the sidecar) comes back later,
        # the counts continue the same series instead of starting a second.
        providers = make_providers({
            A.RES_ROLE: "process", A.RES_EXPORT: self.mode, "process.pid": self.pid,
            "service.instance.id": f"{socket.gethostname()}:{self.pid}:process"},
            traces=False)
        MetricsBuilder(providers, drops=self.drop_counts, errors=self.error_counts,
                       exported=lambda: {"spans": self.exported_spans()})
        return providers

    # -- events ------------------------------------------------------------------------
    def handle(self, events: list[tuple[Any, ...]]) -> None:
        observers = self.observers
        for event in events:
            try:
                key = event[0]
                if key == CONTROL_KEY:
                    self._control(event)
                else:
                    observers[key].lifecycle.handle(event)
            except Exception:
                self.count_error("lifecycle")
        for event in reversed(events):  # controls carry no time
            if event[0] != CONTROL_KEY:
                self.last_event_ns = event[2]
                break

    def _control(self, event: tuple[Any, ...]) -> None:
        self.controls_seen += 1
        if event[1] == REGISTER:
            _k, _c, key, spec, resource, stepped = event
            if key not in self.observers:  # a restarted sidecar was told already
                self.add(key, spec, resource, stepped)
        elif event[1] == CLOSE:
            self.close_observer(event[2])

    def tick(self, now: int) -> None:
        """The processing clock (deadlines of hosts without a step count)."""
        for obs in list(self.observers.values()):
            try:
                obs.tick(now)
            except Exception:
                self.count_error("deadline")

    def advance(self, t: int, progress: dict[int, int]) -> None:
        """A drain cycle's mark, in the vLLM process's clock: by ``t`` each
        keyed scheduler had taken ``progress[key]`` engine steps."""
        for key, steps in progress.items():
            obs = self.observers.get(key)
            if obs is None:
                continue
            try:
                obs.advance(t, steps)
            except Exception:
                self.count_error("deadline")

    def close_observer(self, key: int, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        observer = self.observers.pop(key, None)
        if observer is not None:
            observer.close(timeout_s)
        if not self.observers:
            # The connector shut down (vLLM's workers may leave through
            # os._exit, skipping atexit): report the final counts now.
            self.close_process_metrics()

    def close_process_metrics(self, timeout_s: float = METRICS_CLOSE_TIMEOUT_S) -> None:
        providers, self.process_metrics = self.process_metrics, None
        if providers is not None:
            self.log_final_counts()
            try:
                providers.close(timeout_s)
            except Exception:
                self.count_error("export_shutdown")

    def log_final_counts(self) -> None:
        """One line at the end of an observing process when anything was lost,
        so that a loss is never silent even where no metrics are exported."""
        drops = {k: v for k, v in self.drop_counts().items() if v}
        if drops:
            logger.warning("kvobs-otel: %d observations dropped in process %d (%s); "
                           "%d spans delivered", sum(drops.values()), self.pid,
                           ", ".join(f"{k}={v}" for k, v in sorted(drops.items())),
                           self.exported_spans())

    def end_open(self, cause: str) -> None:
        """The process stopped: each role's lifecycle ends what it still has
        open (jobs, episodes, transfers) as abandoned, saying ``cause``.
        Without this they would never become spans at all."""
        now = time.monotonic_ns()
        for obs in list(self.observers.values()):
            shutdown = getattr(obs.lifecycle, "shutdown", None)
            if shutdown is None:
                continue
            try:
                shutdown(now, cause)
            except Exception:
                self.count_error("shutdown")

    def process_killed(self, unsent: int) -> None:
        """The observed process ended without closing (killed): a
        ``kv.process.end`` span per role, for the window in which its
        events may have been lost, and the loss counted."""
        from kvobs_otel.lifecycle import records as rec

        now = time.monotonic_ns()
        self._drops["process_killed"] += unsent
        for obs in list(self.observers.values()):
            lc = obs.lifecycle
            role = getattr(lc, "role", "unknown")
            gen = getattr(lc, "gen", "") if role == "scheduler" else getattr(lc, "sched_gen", "")
            obs.emit(rec.ProcessEndRecord(
                role=role, rank=getattr(lc, "rank", None) if role == "worker" else None,
                sched_gen=gen or "", last_event_ns=self.last_event_ns, end_ns=now,
                unsent_events=unsent))

    def close(self, cause: str | None = None, timeout_s: float = CLOSE_TIMEOUT_S,
              metrics_timeout_s: float = METRICS_CLOSE_TIMEOUT_S) -> None:
        """End what is still open (``cause``: the process's end, see
        ``end_open``), then every observer's spans out first, so that the
        delivery counts the process meter exports last are final. One
        deadline for all of it: a hanging endpoint must not hold a
        shutting-down process for long."""
        from kvobs_otel.lifecycle import records as rec

        self.end_open(cause or rec.END_PROCESS_EXIT)
        deadline = time.monotonic() + timeout_s
        observers = list(self.observers.values())
        for observer in observers:
            try:
                left = max(0.0, deadline - time.monotonic())
                observer.providers.tracer_provider.force_flush(int(left * 1000))
            except Exception:
                self.count_error("export_shutdown")
        for observer in observers:
            observer.close(max(0.1, deadline - time.monotonic()))
        self.observers.clear()
        self.close_process_metrics(metrics_timeout_s)  # last: the final delivery counts
