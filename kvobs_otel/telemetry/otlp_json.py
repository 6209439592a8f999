"""OTLP JSON file export: the embedded default when no endpoint is set.

One ``ExportTraceServiceRequest`` per line in the OTLP/JSON encoding (ids in
hex, enums as integers, lowerCamelCase keys): the format of the Collector's
file exporter and ``otlpjsonfile`` receiver, which Jaeger's UI can open too.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_HEX_KEYS = {"traceId", "spanId", "parentSpanId"}


def _hex_ids(node: Any) -> Any:
    # protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants hex ids.
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in _HEX_KEYS and isinstance(v, str)
                    else _hex_ids(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


def message_to_otlp_json(msg: Any) -> dict[str, Any]:
    """An OTLP protobuf message in the OTLP/JSON encoding."""
    return _hex_ids(MessageToDict(msg, use_integers_for_enums=True))


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    return message_to_otlp_json(encode_spans(spans))


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends to ``path``; several processes may share one file.

    Holds a shared ``flock`` on it while it may still write (until shutdown
    or exit), so a reader can wait for every writer to be done
    (``wait_for_writers``): an export sidecar finishes after its vLLM
    process is gone."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.exported = 0
        self._lock_fd = -1
        try:
            self._lock_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
        except OSError:
            pass  # no lock: a reader just cannot wait for this writer

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            line = json.dumps(spans_to_otlp_json(spans), separators=(",", ":")) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                # One write() per line: O_APPEND keeps processes' lines whole.
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
            self.exported += len(spans)
            return SpanExportResult.SUCCESS
        except OSError:
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)  # releases the lock

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def wait_for_writers(path: str, timeout_s: float) -> bool:
    """Wait until no exporter holds ``path`` open for writing (each holds a
    shared lock while it may write); False when some still did after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # no file: nothing writes it
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
    finally:
        os.close(fd)
