"""The live vLLM-HUST adapter: observers registered with the fork's registry.

Serving path (the fork calls the observer inline with one frozen record):
take the time, ``offer`` one tuple to the bounded buffer, return None. The
record is validated and joined later, on the drain thread, by ``Router``.
Returning None matters for v1: ``True`` would ask the host to emit its own
evidence event.

One ``Router`` per process. It owns an observer for the process itself (its
resource says ``kvobs.role=host``; it exports the refusals)
and makes one observer per role and rank the first time a record of that
role arrives, so each rank's spans carry that rank's resource.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvobs_otel import identity
from kvobs_otel.config import Settings
from kvobs_otel.hosts.hust import contracts, lifecycle, records
from kvobs_otel.hosts.platform import device_type, vllm_version
from kvobs_otel.telemetry import attributes as A

if TYPE_CHECKING:  # the pipeline (and the SDK) load only once observation is on
    from kvobs_otel.pipeline import Pipeline

logger = logging.getLogger("kvobs_otel")

HOST = "vllm-hust"
_RECORD = 1  # event kind: (router's key, _RECORD, t_ns, record)


class Router:
    """Drain-thread consumer of one process's vLLM-HUST records."""

    role = "host"

    def __init__(self, pipeline: Pipeline, settings: Settings, detection: contracts.Detection
                 ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.contract = detection.chosen
        self.refused: Counter[str] = Counter(
            dict.fromkeys(contracts.CONTRACT_REASONS + records.RECORD_REASONS, 0))
        for _c, reason, _detail in detection.refused:
            self.refused[reason] += 1
        self._logged: set[str] = set()
        self.gen = identity.new_generation()  # v1 records carry none: ours
        self.roles: dict[tuple[str, int | None], int] = {}  # -> observer key
        self.key = pipeline.register((lambda sink: self, {}), self._resource("host", None))

    # Observer's lifecycle protocol (the host observer has no spans of its own)
    def refusals(self) -> dict[str, int]:
        return dict(self.refused)

    def anomalies(self) -> dict[str, int]:
        return {}

    def _resource(self, role: str, rank: int | None) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            A.RES_ROLE: role, A.RES_DEVICE: device_type(self.settings),
            A.RES_VLLM_VERSION: vllm_version(), A.RES_HOST_ADAPTER: HOST,
            A.RES_HOST_CONTRACT: self.contract.name if self.contract else "none",
        }
        if rank is not None:
            attrs[A.RES_RANK] = rank
        return attrs

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)  # once per reason, not per record
            logger.warning("kvobs-otel: vLLM-HUST record refused (%s); further ones are "
                           "only counted in kvobs.host.refused", reason)

    def _lifecycle(self, role: str, rank: int | None) -> Any:
        key = self.roles.get((role, rank))
        if key is None:
            make = lifecycle.lifecycle_for(self.contract is contracts.V2, role, rank, self.gen)
            key = self.roles[(role, rank)] = self.pipeline.register(
                (lambda sink: make(sink), {}), self._resource(role, rank))
        return self.pipeline.lifecycle(key)

    def handle(self, event: tuple[Any, ...]) -> None:
        t, record = event[2], event[3]
        if self.contract is contracts.V2:
            d, reason = records.check_v2(record)
            scheduler_events = records.V2_SCHEDULER_EVENTS
        else:
            d, reason = records.check_v1(record)
            scheduler_events = records.V1_SCHEDULER_EVENTS
        if d is None:
            self._refuse(reason or records.NOT_A_RECORD)
            return
        role = records.role_of(d, scheduler_events)
        if role is not None:
            self._lifecycle(*role).record(d, t)

    def close(self) -> None:
        now = time.monotonic_ns()
        self.pipeline.flush()
        for key in list(self.roles.values()):
            shutdown = getattr(self.pipeline.lifecycle(key), "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown(now)
                except Exception:
                    self.pipeline.count_error("shutdown")
            self.pipeline.close_observer(key)
        self.pipeline.close_observer(self.key)


class Adapter:
    """Registration with the fork, for one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.router: Router | None = None
        self.handles: list[tuple[Any, Any]] = []  # (module, handle)
        # Cleared in a forked child: some fork versions keep v1 observers
        # registered across fork() (observability.py before its fork reset),
        # and this process's buffer has no drain thread there.
        self.live = [True]

    def attach(self, settings: Settings, detection: contracts.Detection) -> bool:
        from kvobs_otel.pipeline import get_pipeline

        # In-process: the fork hands its own frozen record objects, validated
        # on the drain thread; a sidecar would have to import the fork (all of
        # vLLM) to unpickle them.
        pipeline = get_pipeline(settings, in_process=True)
        self.router = router = Router(pipeline, settings, detection)
        chosen = detection.chosen
        if chosen is None:
            return False  # every contract refused: fail closed, refusals exported
        module = detection.admitted[chosen.key]
        offer = pipeline.offer
        now = time.monotonic_ns
        live = self.live
        key = router.key

        def observe(record: Any) -> None:
            if live[0]:
                try:
                    offer((key, _RECORD, now(), record))
                except Exception:
                    pipeline.count_error("seam")
            return None

        register = getattr(module, chosen.register)
        handle = register(observe) if chosen is contracts.V2 else register("kvobs-otel", observe)
        if getattr(handle, "contract", chosen.name) != chosen.name:
            # The registry answered for another contract: do not trust it.
            getattr(module, chosen.unregister)(handle)
            router.refused[contracts.UNKNOWN_CONTRACT] += 1
            logger.error("kvobs-otel: vLLM-HUST %s handed back a handle for %r; refused",
                         chosen.key, getattr(handle, "contract", None))
            return False
        self.handles.append((getattr(module, chosen.unregister), handle))
        logger.info("kvobs-otel: observing vLLM-HUST through %s (API %s)", chosen.name,
                    chosen.api_version)
        return True

    def detach(self) -> None:
        for unregister, handle in self.handles:
            try:
                unregister(handle)  # idempotent by contract
            except Exception:
                logger.warning("kvobs-otel: unregistering from vLLM-HUST failed", exc_info=True)
        self.handles.clear()
        if self.router is not None and self.pid == os.getpid():
            self.router.close()
        self.router = None

    @property
    def observing(self) -> bool:
        return bool(self.handles)


_adapter: Adapter | None = None
_lock = threading.Lock()


def current() -> Adapter | None:
    """This process's adapter; one inherited through fork() does not count
    (the fork drops observers in a forked child)."""
    a = _adapter
    return a if a is not None and a.pid == os.getpid() else None


def _after_fork_in_child() -> None:
    a = _adapter
    if a is not None:
        a.live[0] = False  # the plugin registers anew in the child


os.register_at_fork(after_in_child=_after_fork_in_child)


def attach(settings: Settings, detection: contracts.Detection) -> bool:
    global _adapter
    with _lock:
        if current() is not None:
            return current().observing  # type: ignore[union-attr]
        _adapter = Adapter()
        return _adapter.attach(settings, detection)


def detach() -> None:
    global _adapter
    with _lock:
        a, _adapter = current(), None
        if a is not None:
            a.detach()
