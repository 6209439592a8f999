"""The real OTLP exporters of the SDK, with our encoder (otlp_encode.py).

Everything else - endpoint, headers, TLS, compression, retries, timeouts, all
from the standard OTEL_* variables - stays the SDK's. Where an SDK version
does not offer the seam used here, the SDK's own encoding is used unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvobs_otel.telemetry.otlp_encode import SpanEncoder


def grpc_span_exporter() -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class GrpcSpanExporter(OTLPSpanExporter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._kvobs_encoder = SpanEncoder()

        def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
            # Parsing our bytes is C code (upb): far cheaper than building
            # the message field by field in Python.
            return ExportTraceServiceRequest.FromString(self._kvobs_encoder.request(data))

    return GrpcSpanExporter()


def http_span_exporter() -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    class HttpSpanExporter(OTLPSpanExporter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._kvobs_encoder = SpanEncoder()

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            client = getattr(self, "_client", None)
            if (client is None or getattr(self, "_shutdown", False)
                    or not hasattr(client, "export")):
                return super().export(spans)  # another SDK version: its own path
            data = self._kvobs_encoder.request(spans)
            limit = getattr(self, "_max_request_size", None)
            if limit and len(data) > limit:
                return SpanExportResult.FAILURE
            result = client.export(data)  # compression, retries, TLS: the SDK's
            return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

    return HttpSpanExporter()
