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

        takes_encoded = True

        def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
            # Parsing our bytes is C code (upb): far cheaper than building
            # the message field by field in Python.
            enc = self._kvobs_encoder
            body = (enc.frame(data) if data and isinstance(data[0], tuple)
                    else enc.request(data))
            return ExportTraceServiceRequest.FromString(body)

        def export_encoded(self, items: Sequence[tuple[Any, Any, bytes]]) -> SpanExportResult:
            return self.export(items)  # type: ignore[arg-type]  (_translate_data frames them)

    return GrpcSpanExporter()


def http_span_exporter() -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    class HttpSpanExporter(OTLPSpanExporter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._kvobs_encoder = SpanEncoder()

        @property
        def takes_encoded(self) -> bool:
            return hasattr(getattr(self, "_client", None), "export")

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if not self.takes_encoded or getattr(self, "_shutdown", False):
                return super().export(spans)  # another SDK version: its own path
            return self._post(self._kvobs_encoder.request(spans))

        def export_encoded(self, items: Sequence[tuple[Any, Any, bytes]]) -> SpanExportResult:
            if getattr(self, "_shutdown", False):
                return SpanExportResult.FAILURE
            return self._post(self._kvobs_encoder.frame(items))

        def _post(self, data: bytes) -> SpanExportResult:
            client = self._client
            limit = getattr(self, "_max_request_size", None)
            if limit and len(data) > limit:
                return SpanExportResult.FAILURE
            result = client.export(data)  # compression, retries, TLS: the SDK's
            return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

    return HttpSpanExporter()
