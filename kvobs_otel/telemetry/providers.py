"""Private OpenTelemetry providers, one pair per observed connector role.

Never the global providers: vLLM sets the global TracerProvider itself when
``--otlp-traces-endpoint`` is given. Exporters are chosen by the standard
variables: ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` (otlp,
console, none), ``OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_PROTOCOL`` (grpc,
http/protobuf); endpoint, headers, TLS and timeouts are read by the OTLP
exporters, batch sizes by the export stage (``OTEL_BSP_*``, telemetry/export.py).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvobs_otel.package import __version__
from kvobs_otel.telemetry.export import (
    CountingMetricExporter,
    CountingSpanProcessor,
    batch_settings,
)
from kvobs_otel.telemetry.histograms import Histograms

SERVICE_NAME_DEFAULT = "kvobs-otel"
SCOPE = "kvobs_otel"


@dataclass
class ExportOverrides:
    """Test and demo hook: build exporters/readers instead of reading env."""

    span_processor: Callable[[], SpanProcessor] | None = None
    metric_reader: Callable[[], MetricReader] | None = None


_overrides = ExportOverrides()


def set_export_overrides(span_processor: Callable[[], SpanProcessor] | None = None,
                         metric_reader: Callable[[], MetricReader] | None = None) -> None:
    _overrides.span_processor = span_processor
    _overrides.metric_reader = metric_reader


def _protocol(signal: str) -> str:
    return (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()


ENV_TRACES_FILE = "KVOBS_OTEL_TRACES_FILE"


def make_span_exporter() -> SpanExporter | None:
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if choice == "none":
        return None
    if choice == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if choice != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={choice!r}: expected otlp, console or none")
    proto = _protocol("TRACES")
    from kvobs_otel.telemetry import exporters

    if proto == "grpc":
        return exporters.grpc_span_exporter()
    if proto in ("http/protobuf", "http"):
        return exporters.http_span_exporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={proto!r}: expected grpc or http/protobuf")


def make_metric_exporter() -> CountingMetricExporter | None:
    choice = os.environ.get("OTEL_METRICS_EXPORTER", "otlp").strip().lower()
    if choice == "none":
        return None
    if choice == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        return CountingMetricExporter(ConsoleMetricExporter())
    if choice != "otlp":
        raise ValueError(f"OTEL_METRICS_EXPORTER={choice!r}: expected otlp, console or none")
    proto = _protocol("METRICS")
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        exporter: Any = OTLPMetricExporter()
    elif proto in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HTTPMetricExporter,
        )
        exporter = HTTPMetricExporter()
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={proto!r}: expected grpc or http/protobuf")
    return CountingMetricExporter(exporter)


def validate_exporter_env() -> None:
    """Raise ValueError naming the variable when an exporter choice is bad."""
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        value = os.environ.get(var, "otlp").strip().lower()
        if value not in ("otlp", "console", "none"):
            raise ValueError(f"{var}={value!r}: expected otlp, console or none")
    for signal in ("TRACES", "METRICS"):
        if _protocol(signal) not in ("grpc", "http/protobuf", "http"):
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={_protocol(signal)!r}: "
                             "expected grpc or http/protobuf")
    batch_settings()


def make_resource(attributes: dict[str, Any]) -> Resource:
    """Our attributes, overridable by OTEL_RESOURCE_ATTRIBUTES/OTEL_SERVICE_NAME."""
    # The observed process's pid: a sidecar exports for its vLLM process.
    pid = attributes.get("process.pid", os.getpid())
    base = {
        "service.name": SERVICE_NAME_DEFAULT,
        "service.version": __version__,
        "service.instance.id": f"{socket.gethostname()}:{pid}:{id(attributes):x}",
        "host.name": socket.gethostname(),
        "process.pid": pid,
    }
    base.update({k: v for k, v in attributes.items() if v is not None})
    # The user's OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME win over ours.
    return Resource.create(base).merge(OTELResourceDetector().detect())


@dataclass
class Providers:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    spans: SpanProcessor  # where finished spans go (every processor of the provider)
    resource: Resource
    histograms: Histograms  # aggregated by us, collected by every reader (histograms.py)
    metric_exporters: list[CountingMetricExporter] = field(default_factory=list)
    # where the span builder sends encoded spans; empty: it sends ReadableSpans
    encoded_sinks: list[CountingSpanProcessor] = field(default_factory=list)
    # every export stage of the tracer provider (their shutdown is bounded by close)
    stages: list[CountingSpanProcessor] = field(default_factory=list)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and shut down within ``timeout_s``, even when the endpoint
        accepts connections and never answers: what is unanswered by then is
        counted as dropped, not waited for."""
        deadline = time.monotonic() + timeout_s

        def left_ms() -> int:
            return max(1, int((deadline - time.monotonic()) * 1000))

        # Closing: a metric endpoint that just failed is not retried for the
        # final exports, so a dead Collector cannot hold the process.
        for exporter in self.metric_exporters:
            exporter.closing = True
            exporter.deadline = deadline
        for stage in self.stages:
            stage.deadline = deadline
        steps = [lambda: self.tracer_provider.force_flush(left_ms()),
                 self.tracer_provider.shutdown,
                 lambda: self.meter_provider.shutdown(timeout_millis=left_ms())]
        if not self.metric_exporters:
            # A reader without an exporting thread (tests read theirs) collects
            # on flush. An exporting reader is not flushed: its final export
            # comes with shutdown, on its own thread, waited for only until the
            # deadline (a flush would wait, unbounded, for an export in flight).
            steps.insert(1, lambda: self.meter_provider.force_flush(left_ms()))
        # Each step on its own: a timed-out flush must not skip the shutdown.
        failed: Exception | None = None
        for step in steps:
            try:
                step()
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed


def make_providers(resource_attributes: dict[str, Any],
                   span_exporters: list[SpanExporter] | None = None,
                   metrics: bool = True, traces: bool = True) -> Providers:
    """Providers exporting as the OTEL_* variables say, or to ``span_exporters``
    (then with metrics only if ``metrics``)."""
    resource = make_resource(resource_attributes)
    # Sampling is decided before a span is built (per trace, identically in
    # every process); spans are handed to ``spans`` directly (telemetry/spans.py).
    # Shut down by the pipeline (bounded), not by the SDK's own exit hook.
    spans = SynchronousMultiSpanProcessor()
    tp = TracerProvider(resource=resource, sampler=ALWAYS_ON, active_span_processor=spans,
                        shutdown_on_exit=False)
    processors: list[SpanProcessor] = []
    if not traces:  # a meter-only pair (the per-process counts)
        pass
    elif _overrides.span_processor is not None:
        processors.append(_overrides.span_processor())
    elif span_exporters is not None:
        processors += [CountingSpanProcessor(exporter) for exporter in span_exporters]
    else:
        exporter = make_span_exporter()
        if exporter is not None:
            processors.append(CountingSpanProcessor(exporter))
        path = os.environ.get(ENV_TRACES_FILE, "").strip()
        if path:
            # Beside (or, with OTEL_TRACES_EXPORTER=none, instead of) OTLP.
            from kvobs_otel.telemetry.otlp_json import OtlpJsonFileSpanExporter
            processors.append(CountingSpanProcessor(OtlpJsonFileSpanExporter(path)))
    for processor in processors:
        tp.add_span_processor(processor)
    # Spans are encoded by the builder when every exporter takes OTLP bytes.
    encoded = [p for p in processors
               if isinstance(p, CountingSpanProcessor) and p.takes_encoded]
    if len(encoded) != len(processors):
        encoded = []
    metric_exporters: list[CountingMetricExporter] = []
    readers: list[MetricReader] = []
    if metrics and _overrides.metric_reader is not None:
        readers = [_overrides.metric_reader()]
    elif metrics:
        metric_exporter = make_metric_exporter()
        if metric_exporter is not None:
            metric_exporters.append(metric_exporter)
            readers = [PeriodicExportingMetricReader(metric_exporter)]
    mp = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    histograms = Histograms(resource, InstrumentationScope(SCOPE, __version__))
    for reader in readers:
        if not histograms.attach(reader):
            raise RuntimeError("this OpenTelemetry SDK's metric reader cannot be extended")
    stages = [p for p in processors if isinstance(p, CountingSpanProcessor)]
    return Providers(tp, mp, spans, resource, histograms, metric_exporters, encoded, stages)
