"""The recorded episodes: kvobs-otel's harness demo written as OTLP JSON, one
trace per kv.recovery root, re-sent with fresh ids."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, progress
from benchmarks.gateway_sizing.plan import DEMO_ARGS


# -- the recorded episodes -------------------------------------------------------------
def _b64_ids(node: Any) -> Any:
    """OTLP/JSON writes ids in hex; protobuf's JSON mapping wants base64."""
    if isinstance(node, dict):
        return {k: (base64.b64encode(bytes.fromhex(v)).decode()
                    if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
                    else _b64_ids(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_b64_ids(v) for v in node]
    return node


@dataclass
class Episode:
    """One recorded recovery trace as serialized OTLP ``ResourceSpans``
    (a fragment of an ExportTraceServiceRequest: fragments concatenate into
    one request, protobuf's repeated-field rule), with the ids to replace."""

    data: bytes
    trace_id: bytes
    span_ids: list[bytes]
    names: Counter[str]
    resources: int

    @property
    def spans(self) -> int:
        return sum(self.names.values())

    def fresh(self, rng: random.Random) -> bytes:
        """A copy with a new trace id and new span ids. Each id is a fixed
        16- or 8-byte field; the load checked that every occurrence in the
        bytes is one of this trace's id fields, so a replace is exact."""
        out = self.data.replace(self.trace_id, rng.randbytes(16))
        for old in self.span_ids:
            out = out.replace(old, rng.randbytes(8))
        return out


def _shift_times(node: Any, delta: int) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("startTimeUnixNano", "endTimeUnixNano", "timeUnixNano"):
                node[k] = str(int(v) + delta)
            else:
                _shift_times(v, delta)
    elif isinstance(node, list):
        for v in node:
            _shift_times(v, delta)


def load_episodes(lines: Iterable[str], now_ns: int | None = None) -> tuple[list[Episode],
                                                                             dict[str, Any]]:
    """Recovery traces (those with a ``kv.recovery`` span) from OTLP JSON
    lines, and what else the file held. Timestamps move so that the last
    span ends ``now_ns`` (durations and order kept)."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    # trace id -> (resource json, scope json) -> spans, in file order
    traces: dict[str, dict[tuple[str, str], list[dict[str, Any]]]] = defaultdict(dict)
    resources: dict[str, dict[str, Any]] = {}
    scopes: dict[str, dict[str, Any]] = {}
    last_end = 0
    for line in lines:
        if not line.strip():
            continue
        doc = json.loads(line)
        for rs in doc.get("resourceSpans", []):
            res = rs.get("resource", {})
            rkey = json.dumps(res, sort_keys=True)
            resources[rkey] = res
            for ss in rs.get("scopeSpans", []):
                scope = ss.get("scope", {})
                skey = json.dumps(scope, sort_keys=True)
                scopes[skey] = scope
                for span in ss.get("spans", []):
                    traces[span["traceId"]].setdefault((rkey, skey), []).append(span)
                    last_end = max(last_end, int(span.get("endTimeUnixNano", 0)))
    delta = (time.time_ns() if now_ns is None else now_ns) - last_end
    episodes: list[Episode] = []
    other: Counter[str] = Counter()
    for tid, groups in traces.items():
        spans = [s for group in groups.values() for s in group]
        if not any(s["name"] == "kv.recovery" for s in spans):
            root = next((s["name"] for s in spans if not s.get("parentSpanId")), "no root")
            other[root] += 1
            continue
        doc = {"resourceSpans": [
            {"resource": resources[rk], "scopeSpans": [{"scope": scopes[sk],
                                                         "spans": group}]}
            for (rk, sk), group in groups.items()]}
        _shift_times(doc, delta)
        data = ParseDict(_b64_ids(doc), ExportTraceServiceRequest()).SerializeToString()
        trace_id = bytes.fromhex(tid)
        span_ids = [bytes.fromhex(s["spanId"]) for s in spans]
        # Every occurrence of an id must be an id field: the trace id once per
        # span, a span id once plus once per child naming it as parent.
        parents = Counter(s.get("parentSpanId", "") for s in spans)
        exact = data.count(trace_id) == len(spans) and all(
            data.count(bytes.fromhex(s["spanId"])) == 1 + parents[s["spanId"]] for s in spans)
        if not exact:
            other["(ids also found outside their fields: skipped)"] += 1
            continue
        episodes.append(Episode(data, trace_id, span_ids, Counter(s["name"] for s in spans),
                                len(groups)))
    return episodes, {"other_traces_by_root": dict(other)}


def record_demo(path: Path) -> dict[str, Any]:
    """Runs ``kvobs-otel demo`` (harness mode) to write the recording."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kvobs_otel", "demo", *DEMO_ARGS, "-o", str(tmp), "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    progress(f"recording episodes: {' '.join(cmd[2:])} (about a minute)")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, timeout=900)
    if proc.returncode not in (0, 1) or not tmp.exists():
        raise RuntimeError(f"kvobs-otel demo failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    tmp.rename(path)
    return {"command": ["kvobs-otel", "demo", *DEMO_ARGS, "-o", str(path)],
            "exit_status": proc.returncode}


def default_recording() -> Path:
    import kvobs_otel

    cache = Path(os.environ.get("KVOBS_CACHE_DIR") or Path.home() / ".cache" / "kvobs-otel")
    tag = "-".join(a.lstrip("-") for a in DEMO_ARGS)
    return cache / "gateway-sizing" / f"demo-{tag}-kvobs{kvobs_otel.__version__}.otlp.jsonl"
