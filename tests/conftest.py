"""Shared fixtures: observation switched on against in-memory exporters."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import kvobs_otel
from kvobs_otel.config import Settings
from kvobs_otel.telemetry.providers import set_export_overrides

# Stand-ins for hosts that cannot run here (see tests/standins/).
sys.path.insert(0, str(Path(__file__).resolve().parent / "standins"))

# Keep vLLM quiet and single-threaded enough for 2 cores.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class Telemetry:
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    readers: list[InMemoryMetricReader] = field(default_factory=list)

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        spans = list(self.exporter.get_finished_spans())
        return [s for s in spans if name is None or s.name == name]

    def metric_points(self, metric: str) -> list[tuple[dict, float]]:
        """(attributes, value) of every data point of ``metric`` across readers."""
        out = []
        for reader in self.readers:
            data = reader.get_metrics_data()
            for rm in data.resource_metrics if data else ():
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name != metric:
                            continue
                        for p in m.data.data_points:
                            value = getattr(p, "value", None)
                            if value is None:
                                value = getattr(p, "count", 0)
                            out.append((dict(p.attributes), value))
        return out

    def metric_total(self, metric: str, **match: object) -> float:
        return sum(v for a, v in self.metric_points(metric)
                   if all(a.get(k) == want for k, want in match.items()))


class _SharedExporterProcessor(SimpleSpanProcessor):
    """Every observer's provider feeds the one in-memory exporter of a test;
    a provider shutting down (connector shutdown) must not close it."""

    def shutdown(self) -> None:
        pass


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()

    def reader() -> InMemoryMetricReader:
        r = InMemoryMetricReader()
        t.readers.append(r)
        return r

    set_export_overrides(span_processor=lambda: _SharedExporterProcessor(t.exporter),
                         metric_reader=reader)
    yield t
    set_export_overrides(None, None)


@pytest.fixture
def observe(telemetry: Telemetry) -> Iterator[Telemetry]:
    """Instrumentation on (short receipt deadline), in-memory export."""
    assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                          tier_deadline_s=1.0,
                                          traffic_sample_ratio=1.0, drain_interval_s=0.02))
    yield telemetry
    kvobs_otel.uninstrument()


@pytest.fixture
def observe_patient_tiers(telemetry: Telemetry) -> Iterator[Telemetry]:
    """``observe`` with a 10 s tier deadline: for a test whose tier is slow
    on purpose (0.5 s) and must not be judged hung on a busy machine."""
    assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                          tier_deadline_s=10.0,
                                          traffic_sample_ratio=1.0, drain_interval_s=0.02))
    yield telemetry
    kvobs_otel.uninstrument()


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """``kvobs-otel ARGS`` in a clean environment (no OTEL_/KVOBS_ settings)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVOBS_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvobs_otel", *args], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One real ``kvobs-otel demo`` (vLLM scheduler + 2 rank processes on CPU),
    shared by the tests of every command that reads its output."""
    d = tmp_path_factory.mktemp("demo")
    return (run_cli("demo", "--mode", "harness", "--requests", "8", "--json", cwd=d),
            d / "kvobs-demo.otlp.jsonl")


# A test using a real-vLLM fixture is a vLLM test wherever it lives, even in a
# module without ``pytestmark = pytest.mark.vllm``: it runs on every supported
# vLLM release (`make test`, .ci/test-all.sh).
_VLLM_FIXTURES = {"observe", "demo_run"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _VLLM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Every request's output of the harness's pressure workload with nothing
    failing (V2 runner, sync scheduling, inline ranks)."""
    from test_harness_smoke import _run_pressure

    with _run_pressure() as h:
        assert set(h.finished.values()) == {"length"}
        return {k: list(v) for k, v in h.outputs.items()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The real Collector, Jaeger and Prometheus (tests/stack.py), one per module."""
    from stack import Stack

    s = Stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.close()
