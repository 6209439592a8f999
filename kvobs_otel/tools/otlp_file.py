"""Reading OTLP JSON span files (one ExportTraceServiceRequest per line, or
one whole JSON document) back into flat span dicts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class OtlpFileError(ValueError):
    """The file is not OTLP JSON; the message says where."""


@dataclass
class FileSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    error: bool
    events: list[str] = field(default_factory=list)


def _value(v: dict[str, Any]) -> Any:
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])  # OTLP/JSON writes int64 as a string
    return None


def _attrs(kvs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in kvs or ()}


def spans_from_document(doc: dict[str, Any]) -> list[FileSpan]:
    """Flatten one OTLP/JSON ExportTraceServiceRequest document."""
    out = []
    for rs in doc.get("resourceSpans", []):
        res = _attrs(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                out.append(FileSpan(
                    name=s["name"], trace_id=s["traceId"], span_id=s["spanId"],
                    parent_span_id=s.get("parentSpanId", ""),
                    start_ns=int(s.get("startTimeUnixNano", 0)),
                    end_ns=int(s.get("endTimeUnixNano", 0)),
                    attributes=_attrs(s.get("attributes")), resource=res,
                    error=s.get("status", {}).get("code") == 2,
                    events=[e.get("name", "") for e in s.get("events", [])]))
    return out


def read_spans(path: str) -> list[FileSpan]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise OtlpFileError(f"{path}: {e.strerror}") from None
    spans: list[FileSpan] = []
    try:
        docs = [json.loads(text)] if text.lstrip().startswith("{") and "\n{" not in text \
            else [json.loads(line) for line in text.splitlines() if line.strip()]
        for doc in docs:
            spans.extend(spans_from_document(doc))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise OtlpFileError(f"{path}: not OTLP JSON spans ({e})") from None
    return spans
