"""Where recorded spans come from: an OTLP JSON file or a Jaeger query URL.

Both become the same flat ``FileSpan`` list. Any problem reading them is an
``OtlpFileError`` with a one-line message (the CLI's exit status 2).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvobs_otel.tools.otlp_file import FileSpan, OtlpFileError, read_spans

DEFAULT_QUERY = {"service": "kvobs-otel", "operation": "kv.recovery", "lookback": "24h",
                 "limit": "1000"}


def _jaeger_value(tag: dict[str, Any]) -> Any:
    value = tag.get("value")
    # Jaeger's JSON renders OTLP array attributes as JSON text.
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tags(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {t["key"]: _jaeger_value(t) for t in items or ()}


def jaeger_spans(doc: dict[str, Any]) -> list[FileSpan]:
    """Spans of a Jaeger ``/api/traces`` answer."""
    out = []
    for trace in doc.get("data") or []:
        processes = {pid: _tags(p.get("tags")) | {"service.name": p.get("serviceName")}
                     for pid, p in (trace.get("processes") or {}).items()}
        for s in trace.get("spans") or []:
            tags = _tags(s.get("tags"))
            parent = next((r["spanID"] for r in s.get("references") or []
                           if r.get("refType") == "CHILD_OF"), "")
            start = int(s["startTime"]) * 1000
            out.append(FileSpan(
                name=s["operationName"], trace_id=s["traceID"].rjust(32, "0"),
                span_id=s["spanID"], parent_span_id=parent, start_ns=start,
                end_ns=start + int(s.get("duration", 0)) * 1000, attributes=tags,
                resource=processes.get(s.get("processID"), {}),
                error=tags.get("error") in (True, "true"),
                events=[str(_tags(ev.get("fields")).get("event", ""))
                        for ev in s.get("logs") or []]))
    return out


def jaeger_url(source: str) -> str:
    """A bare Jaeger address gets the default query for recovery episodes."""
    u = urllib.parse.urlsplit(source)
    if u.path in ("", "/"):
        return urllib.parse.urlunsplit(
            (u.scheme, u.netloc, "/api/traces", urllib.parse.urlencode(DEFAULT_QUERY), ""))
    return source


# Spans a query for recovery traces never returns: a killed process's
# kv.process.end (each in its own trace), and secondary-tier jobs in ordinary
# request traces (a hung one is a failure check reports).
COMPANIONS = ("kv.process.end", "kv.tier.job")


def operation_url(url: str, operation: str) -> str | None:
    """The same Jaeger query for another operation's traces; None when the
    query names no service or asks for that operation already."""
    u = urllib.parse.urlsplit(url)
    q = dict(urllib.parse.parse_qsl(u.query))
    if "service" not in q or q.get("operation") == operation:
        return None
    q = {k: v for k, v in q.items() if k in ("service", "lookback", "start", "end", "limit")}
    q["operation"] = operation
    return urllib.parse.urlunsplit((u.scheme, u.netloc, u.path, urllib.parse.urlencode(q), ""))



def load_spans(source: str, timeout: float = 30.0) -> list[FileSpan]:
    """The spans of an OTLP JSON file, or of a Jaeger query together with the
    traces of its ``COMPANIONS`` in the same service."""
    if not source.startswith(("http://", "https://")):
        return read_spans(source)
    url = jaeger_url(source)
    spans = _jaeger_query(url, timeout)
    seen = {(s.trace_id, s.span_id) for s in spans}
    for operation in COMPANIONS:
        more = operation_url(url, operation)
        if more is None:
            continue
        for s in _jaeger_query(more, timeout):
            if (s.trace_id, s.span_id) not in seen:
                seen.add((s.trace_id, s.span_id))
                spans.append(s)
    return spans


def _jaeger_query(url: str, timeout: float) -> list[FileSpan]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise OtlpFileError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise OtlpFileError(f"{url}: cannot reach Jaeger ({reason})") from None
    except ValueError:
        raise OtlpFileError(f"{url}: the answer is not JSON") from None
    try:
        return jaeger_spans(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise OtlpFileError(f"{url}: not a Jaeger traces answer ({e})") from None
