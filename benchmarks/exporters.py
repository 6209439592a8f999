"""A span exporter that sends nothing anywhere, for the naive variant of B1.

The SDK machinery in front of it is the real one (a BatchSpanProcessor and
its worker thread), so the naive design pays everything but the network. It
counts what it is given, so the benchmark can prove spans were made.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class CountingSpanExporter(SpanExporter):
    """Drops every span after counting it by name."""

    def __init__(self) -> None:
        self.by_name: Counter[str] = Counter()
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self.by_name.update(s.name for s in spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
