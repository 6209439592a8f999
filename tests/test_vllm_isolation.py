"""Never hurt serving: off means off, on changes no scheduling decision, and
the observer's own failures, full buffer or bad settings never reach vLLM."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)

import kvobs_otel
from kvobs_otel.config import Settings
from kvobs_otel.hosts.vllm import instrumentor, releases
from kvobs_otel.lifecycle.scheduler_state import SchedulerLifecycle
from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.telemetry.metrics import MetricsBuilder
from kvobs_otel.telemetry.spans import SpanBuilder
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.workload import pressure_workload

from otel_servers import wait_for
from vllm_fields import VLLM_FIELDS

pytestmark = pytest.mark.vllm

# The installed vLLM's adapter (reads TransferJob.sync where the release has it).
RELEASE = releases.select(vllm.__version__).release
EXPLICIT = {"connector": "KvobsOffloadingConnector",
            "connector_module_path": "kvobs_otel.connector"}


def vllm_view(meta: object) -> tuple:
    """vLLM's own fields of the worker metadata its scheduler-side connector
    reads (None reads as the defaults; transfer times are wall-clock)."""
    meta = OffloadingWorkerMetadata() if meta is None else meta
    out = []
    for name in VLLM_FIELDS:
        value = getattr(meta, name)
        if name == "transfer_stats":
            value = (value.load.bytes, tuple(value.load.sizes),
                     value.store.bytes, tuple(value.store.sizes))
        elif isinstance(value, dict):
            value = tuple(sorted(value.items()))
        elif isinstance(value, (set, frozenset)):
            value = tuple(sorted(value))
        out.append((name, value))
    return tuple(out)


def plain(value: object, depth: int = 0) -> object:
    """A comparable copy of anything in a SchedulerOutput: dataclasses and
    objects by their fields, mappings and sets sorted."""
    if depth > 8:
        return type(value).__name__
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, dict):
        return tuple(sorted(((plain(k, depth + 1), plain(v, depth + 1))
                             for k, v in value.items()), key=repr))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted((plain(v, depth + 1) for v in value), key=repr))
    if isinstance(value, (list, tuple)):
        return tuple(plain(v, depth + 1) for v in value)
    if hasattr(value, "tolist"):  # tensors, arrays
        return plain(value.tolist(), depth + 1)
    names = [f.name for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) \
        else list(getattr(value, "__struct_fields__", ())) or list(vars(value)) \
        if hasattr(value, "__dict__") or hasattr(value, "__struct_fields__") else None
    if names is None:
        return repr(value)
    return (type(value).__name__,
            tuple((n, plain(getattr(value, n, None), depth + 1)) for n in names))


def decisions(connector: dict | None = None, before_close=None, each_step=None,
              **cfg) -> list[tuple]:
    """Every step's SchedulerOutput, reduced to what the scheduler decided,
    then what vLLM's scheduler-side connector read from the workers each step
    and how every request finished. ``each_step`` runs on the scheduler's
    thread as vLLM's connector reads each step's worker output."""
    out = []
    received: list[tuple] = []
    with Harness(HarnessConfig(num_ranks=2, **(connector or {}), **cfg)) as h:
        # Below kvobs-otel's patch of the facade: what vLLM itself gets.
        conn = h.scheduler.connector.connector_scheduler
        update = conn.update_connector_output

        def spy(connector_output):
            if each_step is not None:
                each_step()
            received.append(vllm_view(connector_output.kv_connector_worker_meta))
            return update(connector_output)

        conn.update_connector_output = spy
        pressure_workload(h)
        records = h.run_until_idle(2000)
        if before_close is not None:
            before_close()
        for rec in records:
            so = rec.scheduler_output
            if so is None:
                out.append(None)
                continue
            meta = so.kv_connector_metadata
            out.append((
                # The whole SchedulerOutput but the connector's metadata, whose
                # vLLM fields follow (kvobs-otel extends it when observing).
                plain({f.name: getattr(so, f.name) for f in dataclasses.fields(so)
                       if f.name != "kv_connector_metadata"}),
                sorted(RELEASE.load_row(j, x) for j, x in meta.load_jobs.items()),
                sorted((j, x.req_id) for j, x in meta.store_jobs.items()),
                sorted(meta.jobs_to_flush or ()),
                sorted(rec.finished_req_ids),
            ))
    out.append(("vllm reads", received))
    out.append(("finished", sorted(h.finished.items()), sorted(
        (r, len(t)) for r, t in h.outputs.items())))
    return out


@pytest.fixture(scope="module")
def stock() -> list[tuple]:
    return decisions()


def test_disabled_is_identical_to_uninstrumented_and_emits_nothing(
        stock, telemetry, monkeypatch):
    monkeypatch.setenv("KVOBS_OTEL_ENABLED", "0")
    assert decisions(EXPLICIT) == stock
    assert not kvobs_otel.is_instrumented()
    assert telemetry.spans() == [] and telemetry.readers == []


def test_enabled_changes_no_scheduling_decision(stock, observe):
    assert decisions(EXPLICIT) == stock
    current_pipeline().flush()
    assert observe.spans("kv.recovery")


def test_killed_sidecar_changes_no_scheduling_decision_and_is_counted(stock, monkeypatch):
    """The export sidecar (the default) stopped, then killed, mid-run: vLLM
    decides exactly as without observation, and the loss is counted."""
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        monkeypatch.setenv(var, "none")  # the sidecar's export is not the question
    assert kvobs_otel.instrument(Settings(enabled=True, drain_interval_s=0.02))
    killed: list[int] = []
    seen: dict[str, dict[str, int]] = {}
    stopped: list[tuple[int, int]] = []  # (pid, events written when stopped)

    def each_step() -> None:
        # On the scheduler's thread and with synchronous drains, so the stop
        # and the kill fall mid-workload however slow the machine is (a
        # thread polling beside it could wake only after the last event).
        p = current_pipeline()
        p.drain_once()
        link = p.link
        if killed or link is None or link.proc is None:
            return
        if not stopped and link.written > 5:
            os.kill(link.pid, signal.SIGSTOP)  # what it has not read yet is lost with it
            stopped.append((link.pid, link.written))
        elif stopped and link.written >= stopped[0][1] + 5:
            os.kill(stopped[0][0], signal.SIGKILL)
            killed.append(stopped[0][0])

    def counts() -> None:
        if stopped and not killed:  # never left stopped, whatever failed
            os.kill(stopped[0][0], signal.SIGKILL)
        assert killed, f"the workload ended before the kill (stopped: {stopped})"
        p = current_pipeline()
        wait_for(lambda: (p.drain_once(), p.error_counts()["sidecar"])[1], "the death noticed")
        seen.update(drops=p.drop_counts(), errors=p.error_counts())
        seen["sidecar"] = {"pid": p.link.pid}

    try:
        assert decisions(EXPLICIT, before_close=counts, each_step=each_step) == stock
    finally:
        kvobs_otel.uninstrument()
    assert len(killed) == 1 and seen["sidecar"]["pid"] not in (None, killed[0])
    assert seen["errors"]["sidecar"] == 1 and seen["drops"]["sidecar_lost"] >= 5


# The other model runners and async scheduling this vLLM has (the default
# run above: the first runner, sync scheduling).
OTHER_RUNS = [dict(model_runner=r, async_scheduling=a) for r in RELEASE.runners
              for a in (False, True)][1:]


@pytest.mark.parametrize("run", OTHER_RUNS, ids=lambda r: f"{r['model_runner']}-"
                         f"{'async' if r['async_scheduling'] else 'sync'}")
def test_enabled_changes_no_scheduling_decision_on_every_runner(telemetry, run):
    stock_run = decisions(**run)
    assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                          drain_interval_s=0.02))
    try:
        assert decisions(EXPLICIT, **run) == stock_run
        current_pipeline().flush()
        assert telemetry.spans("kv.recovery")
    finally:
        kvobs_otel.uninstrument()


# vLLM 0.34 reports failed transfers; its scheduler then acts on failed_jobs
# and failed_recving. With observation on, it must act exactly the same.
FAILURES = {
    "load-fail": {"fail": {"rank": 1, "kind": "load"}, "kv_load_failure_policy": "fail"},
    "load-recompute": {"fail": {"rank": 1, "kind": "load"},
                       "kv_load_failure_policy": "recompute"},
    "store-fail": {"fail": {"rank": 1, "kind": "store"}},
}


@pytest.mark.parametrize("scenario", sorted(FAILURES))
def test_vllm_reads_its_own_metadata_unchanged_when_transfers_fail(observe, scenario):
    if "failed_jobs" not in VLLM_FIELDS:
        pytest.skip(f"vLLM {vllm.__version__} asserts every transfer succeeded (failures are "
                    "reported from 0.34)")
    cfg = FAILURES[scenario]
    kvobs_otel.uninstrument()
    stock_run = decisions(**cfg)
    failed = [r for r in stock_run[-2][1] if any(dict(r).get("failed_jobs", ()))]
    assert failed, "the scenario must make vLLM see failed jobs"
    assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                          drain_interval_s=0.02))
    assert decisions(EXPLICIT, **cfg) == stock_run
    current_pipeline().flush()
    assert [s for s in observe.spans("kv.job") if s.attributes["kvobs.outcome"] == "failed"]


def test_plugin_default_off_imports_no_sdk_and_patches_nothing():
    from kvobs_otel.hosts.vllm import releases

    classes = [releases.CONNECTOR, releases.BASE_CONNECTOR, releases.CONNECTOR_WORKER,
               releases.SCHEDULER]
    code = "\n".join([
        "import importlib, sys",
        "def members():",
        "    out = {}",
        f"    for path in {classes!r}:",
        "        mod, _, name = path.partition(':')",
        "        cls = getattr(importlib.import_module(mod), name)",
        "        out.update({(path, k): v for k, v in vars(cls).items()})",
        "    return out",
        "before = members()",
        "import vllm.plugins as p; p.load_general_plugins()",
        "import kvobs_otel",
        "assert 'kvobs_otel' in sys.modules  # the plugin was loaded",
        "assert not kvobs_otel.is_instrumented()",
        "sdk = sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk'))",
        "assert not sdk, sdk",
        "assert 'kvobs_otel.pipeline' not in sys.modules",
        "assert 'kvobs_otel.telemetry.providers' not in sys.modules",
        "after = members()",
        "changed = sorted(str(k) for k in before.keys() | after.keys()",
        "                 if before.get(k) is not after.get(k))",
        "assert not changed, changed  # every vLLM class member is the same object",
        "print('ok')"])
    env = {"PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "ERROR"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@pytest.mark.parametrize(("target", "stage"), [
    ((SpanBuilder, "build"), "span_build"),
    ((MetricsBuilder, "record"), "metric_record"),
    ((SchedulerLifecycle, "handle"), "lifecycle"),
    (("kvobs_otel.hosts.vllm.seams._blocks", None), "seam"),
])
def test_internal_failure_never_reaches_vllm_and_is_counted_once_logged(
        stock, observe, monkeypatch, caplog, target, stage):
    def boom(*_a, **_k):
        raise RuntimeError("injected")

    owner, name = target
    if name is None:
        monkeypatch.setattr(owner, boom)
    else:
        monkeypatch.setattr(owner, name, boom)
    with caplog.at_level(logging.WARNING, logger="kvobs_otel"):
        assert decisions(EXPLICIT) == stock
        current_pipeline().flush()
    errors = current_pipeline().error_counts()
    assert errors.get(stage, 0) > 1
    logged = [r for r in caplog.records if f"internal failure in {stage}" in r.getMessage()]
    assert len(logged) == 1


def test_full_buffer_drops_and_counts_without_blocking(stock, telemetry):
    # A tiny buffer and a drain thread that never gets to run in time.
    assert kvobs_otel.instrument(Settings(enabled=True, buffer_size=16, drain_interval_s=10.0))
    seen = {}

    def check() -> None:
        pipeline = current_pipeline()
        pipeline.flush()
        seen["dropped"] = pipeline.drop_counts()["buffer_full"]
        # Reported once per process, not once per observed connector.
        seen["metric"] = telemetry.metric_total("kvobs.observer.dropped", reason="buffer_full")

    try:
        assert decisions(EXPLICIT, before_close=check) == stock
        assert seen["dropped"] > 0 and seen["metric"] == seen["dropped"]
    finally:
        kvobs_otel.uninstrument()


def test_uninstrument_restores_vllm_exactly(telemetry):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.sched.scheduler import Scheduler

    classes = (OffloadingConnector, OffloadingConnectorWorker, Scheduler)
    before = [dict(vars(c)) for c in classes]
    assert kvobs_otel.instrument(Settings(enabled=True))
    assert vars(OffloadingConnector)["build_connector_meta"] is not before[0][
        "build_connector_meta"]
    assert vars(Scheduler)["_preempt_request"] is not before[2]["_preempt_request"]
    kvobs_otel.uninstrument()
    assert [dict(vars(c)) for c in classes] == before
    decisions()
    assert telemetry.spans() == []


@pytest.mark.parametrize(("var", "value"), [
    ("KVOBS_OTEL_ENABLED", "maybe"),
    ("KVOBS_OTEL_RECEIPT_DEADLINE_S", "-3"),
    ("KVOBS_OTEL_TIER_DEADLINE_S", "soon"),
    ("KVOBS_OTEL_BUFFER_SIZE", "lots"),
    ("OTEL_TRACES_EXPORTER", "carrier-pigeon"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "smoke-signals"),
])
def test_bad_setting_keeps_observation_off_with_one_clear_error(monkeypatch, caplog, var, value):
    monkeypatch.setenv("KVOBS_OTEL_ENABLED", "1")
    monkeypatch.setenv(var, value)
    with caplog.at_level(logging.ERROR, logger="kvobs_otel"):
        assert kvobs_otel.instrument() is False
    assert not kvobs_otel.is_instrumented()
    (record,) = [r for r in caplog.records if r.name == "kvobs_otel"]
    assert var in record.getMessage() and "observation stays off" in record.getMessage()


def refused_once(caplog, reason: str, telemetry) -> str:
    """instrument() refused: False, nothing patched, one error line, and the
    refusal exported as kvobs.host.refused{reason}."""
    with caplog.at_level(logging.WARNING, logger="kvobs_otel"):
        assert kvobs_otel.instrument(Settings(enabled=True)) is False
        assert kvobs_otel.instrument(Settings(enabled=True)) is False  # said once per process
    assert not kvobs_otel.is_instrumented() and not instrumentor.is_patched()
    lines = [r for r in caplog.records if r.name == "kvobs_otel"]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, [r.getMessage() for r in lines]
    current_pipeline().flush()
    assert telemetry.metric_total("kvobs.host.refused", reason=reason) == 1
    return lines[0].getMessage()


def test_older_vllm_is_refused_with_one_clear_error(monkeypatch, caplog, telemetry):
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    message = refused_once(caplog, releases.REFUSED_VERSION, telemetry)
    assert "0.31.2" in message and "vllm>=0.32.0,<0.35" in message
    kvobs_otel.uninstrument()


def pretend_newer(monkeypatch) -> str:
    """Announce the installed vLLM as the next, untested release (the
    installed release's adapter then is the newest one kvobs-otel has)."""
    rels = releases.supported()
    mine = [r.series for r in rels].index(RELEASE.series)
    monkeypatch.setattr(releases, "supported", lambda: rels[: mine + 1])
    newer = f"{RELEASE.series[0]}.{RELEASE.series[1] + 1}.0"
    monkeypatch.setattr(vllm, "__version__", newer)
    return newer


def test_newer_untested_vllm_is_refused_unless_allowed(monkeypatch, caplog, telemetry):
    newer = pretend_newer(monkeypatch)
    message = refused_once(caplog, releases.REFUSED_UNTESTED, telemetry)
    assert newer in message and releases.ENV_ALLOW_UNTESTED in message
    kvobs_otel.uninstrument()
    # Allowed: the newest release's seams, after the same shape check.
    monkeypatch.setenv(releases.ENV_ALLOW_UNTESTED, "1")
    with caplog.at_level(logging.WARNING, logger="kvobs_otel"):
        assert kvobs_otel.instrument(Settings(enabled=True))
    assert "untested" in caplog.records[-1].getMessage()
    kvobs_otel.uninstrument()


def test_a_newer_vllm_with_a_changed_signature_is_refused_and_runs_unobserved(
        stock, monkeypatch, caplog, telemetry):
    """Stand-in for a future vLLM (none exists yet): the installed release with
    one seam's signature changed, announced as an untested newer version that
    the operator allowed. The shape check refuses it; vLLM runs untouched."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    original = OffloadingConnector.build_connector_meta

    def build_connector_meta(self, scheduler_output, step_budget=None):
        return original(self, scheduler_output)

    monkeypatch.setattr(OffloadingConnector, "build_connector_meta", build_connector_meta)
    pretend_newer(monkeypatch)
    monkeypatch.setenv(releases.ENV_ALLOW_UNTESTED, "1")
    message = refused_once(caplog, releases.REFUSED_SHAPE, telemetry)
    assert "build_connector_meta(self, scheduler_output, step_budget)" in message
    assert OffloadingConnector.build_connector_meta is build_connector_meta  # untouched
    assert not any(getattr(v, "__kvobs_wrapped__", False)
                   for v in vars(OffloadingConnector).values())
    monkeypatch.setenv("KVOBS_OTEL_ENABLED", "1")  # the plugin in every process: still off
    spans_before = len(telemetry.spans())
    assert decisions() == stock
    assert len(telemetry.spans()) == spans_before == 0
    kvobs_otel.uninstrument()


def test_every_supported_release_fits_the_installed_vllm_exactly_once():
    """The installed vLLM matches its own release's shape and no other's, so
    each adapter describes a real release (CI runs this on each of them)."""
    sel = releases.select(vllm.__version__)
    assert sel.release is not None and not sel.untested
    fits = [r.name for r in releases.supported() if not releases.check_shape(r)]
    assert fits == [sel.release.name]
    from kvobs_otel import package
    low, high = releases.window()[2:].split(",<")
    assert package._instruments == (f"vllm >= {low}, < {high}",)


class _RaisingSpanExporter:
    def export(self, spans):
        raise RuntimeError("injected exporter failure")

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@pytest.mark.parametrize("stage", ["buffer", "exporter", "metric_export"])
def test_export_side_failures_never_reach_vllm_counted_and_logged_once(
        stock, monkeypatch, caplog, stage):
    """The serving buffer, the span exporter and the metric exporter, each
    broken for the whole run of the real scheduler + connector."""
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricExporter,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvobs_otel.buffer import EventBuffer
    from kvobs_otel.telemetry import export
    from kvobs_otel.telemetry.providers import set_export_overrides

    monkeypatch.setattr(export, "STATS", export.ExportStats())

    class RaisingMetricExporter(MetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            raise RuntimeError("injected metric export failure")

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    spans = lambda: SimpleSpanProcessor(InMemorySpanExporter())  # noqa: E731
    metrics = InMemoryMetricReader
    if stage == "buffer":
        def boom(*_a, **_k):
            raise RuntimeError("injected buffer failure")
        monkeypatch.setattr(EventBuffer, "offer", boom)
    elif stage == "exporter":
        spans = lambda: export.CountingSpanProcessor(  # noqa: E731
            _RaisingSpanExporter(), export.BatchSettings(0.01, 256, 16, 1.0))
    else:
        metrics = lambda: PeriodicExportingMetricReader(  # noqa: E731
            export.CountingMetricExporter(RaisingMetricExporter()), export_interval_millis=50)
    set_export_overrides(span_processor=spans, metric_reader=metrics)
    try:
        assert kvobs_otel.instrument(Settings(enabled=True, drain_interval_s=0.02))
        with caplog.at_level(logging.WARNING):
            assert decisions(EXPLICIT) == stock
            errors = current_pipeline().error_counts()
            kvobs_otel.uninstrument()
    finally:
        kvobs_otel.uninstrument()
        set_export_overrides(None, None)
    counted = {"buffer": "seam"}.get(stage, stage)  # the buffer is part of the seam's step
    assert errors[counted] > 1 if stage != "exporter" else export.STATS.errors["exporter"] > 1
    ours = [r for r in caplog.records if f"internal failure in {counted}" in r.getMessage()]
    assert len(ours) == 1
    # Every traceback logged is a first one for its stage: nothing per failure
    # (not the SDK's reader, not the seams).
    from collections import Counter
    per_message = Counter(r.getMessage() for r in caplog.records if r.exc_info)
    assert per_message and max(per_message.values()) == 1, per_message


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="reads CPython 3.11's specializer")
def test_the_seams_leave_the_objects_vllm_reads_every_step_as_fast_to_read(observe):
    """Observed, vLLM's copy engine, tiering manager and tracker keep their
    methods on their classes (nothing stored on the instance to shadow one)
    and nothing of ours read their ``__dict__``: CPython then still
    specializes the attribute loads vLLM makes on them every step, which an
    instance-level wrapper or a ``__dict__`` read would turn into generic
    lookups for the rest of the run."""
    import dis

    with Harness(HarnessConfig(num_ranks=2, tier="fs", num_cpu_chunks=16)) as h:
        pressure_workload(h)
        for _ in range(30):
            h.step()
        manager = h.scheduler.connector.connector_scheduler.manager
        worker = h.runner(0).connector.connector_worker.worker
        objects = {"copy engine": (worker, "get_finished"),
                   "tiering manager": (manager, "_should_store_to_tier"),
                   "tracker": (manager._metrics, "on_job_registered")}
        for label, (obj, method) in objects.items():
            assert getattr(obj, "_kvobs", None) is not None, label  # observed
            # The method vLLM calls is the class's (our wrapper), not an
            # instance attribute in front of it.
            assert getattr(obj, method).__func__ is getattr(type(obj), method), label
            scope: dict = {}
            exec("def probe(o):\n    return o._kvobs", scope)
            for _ in range(64):
                scope["probe"](obj)
            ops = [i.opname for i in dis.get_instructions(scope["probe"], adaptive=True)
                   if i.opname.startswith("LOAD_ATTR")]
            assert ops in (["LOAD_ATTR_INSTANCE_VALUE"], ["LOAD_ATTR_WITH_HINT"]), (label, ops)
