"""Gateway sizing: how many spans per second one gateway Collector sustains,
and how much memory its tail sampler needs per 1,000 open traces.

``python -m benchmarks.gateway_sizing [--quick] [-o FILE]`` (from the
repository root). Not part of ``python -m benchmarks`` (B1-B5 measure
kvobs-otel's cost on vLLM; this measures the Collector that receives it).

What runs: ONE real gateway, the Go-built Collector (``KVOBS_OTELCOL_BIN``,
else .ci/otel-bins/build.sh) with the shipped ``deploy/otel-collector.yaml``;
only ports and ``KVOBS_TAIL_DECISION_WAIT`` come from the environment, as in
tests/stack.py. Its Jaeger and Tempo exporters point at an OTLP/gRPC sink in
this process that answers every export at once without decoding it, so the
stores never throttle the gateway; what reached them is counted by the
gateway's own ``otelcol_exporter_sent_spans``.

What is sent: recovery-episode traces recorded from kvobs-otel itself
(``kvobs-otel demo --mode harness`` writes OTLP JSON: vLLM's real scheduler
and connector, N rank processes), one trace per ``kv.recovery`` root with all
its spans, resources and attributes as exported. Each copy gets a fresh
trace id and fresh span ids (parent links kept), so the gateway sees
distinct traces of the recorded shapes and sizes. A recording is used rather
than spans built here because it is what the exporter really emits, from the
scheduler's and every rank's resource, with no second model of it to keep in
step. Requests are raw OTLP protobuf over gRPC with gzip, as an agent's
loadbalancing exporter sends them (its otlp protocol compresses with gzip by
default), about 1,024 spans per request (the agent outline's batch size).

Two phases:

- throughput: paced steps of rising spans/s (two ladders, each on a fresh
  gateway); a step is clean when the sender achieved the rate, the receiver
  refused nothing (memory_limiter), every trace was decided and every span
  delivered to the sink within decision_wait plus a margin, and nothing was
  evicted before its decision. Reported: the highest rate clean in every
  ladder on this machine, and the spans per CPU-second of the gateway
  process (its utime+stime over the step, less its idle rate). The
  shipped tail_sampling runs one event loop (num_shards 1) for ingest and
  decisions: a decision tick holds the receiver, so the limit shows as
  export latency and a missed rate well before the cores are busy;
- memory: a long decision_wait keeps every trace open; traces are sent in
  levels (e.g. 0, 10k, 30k, 60k) and the gateway's RSS (/proc, and its own
  otelcol_process_memory_rss) and Go heap are read at each level; a least
  squares line gives MiB per 1,000 open traces (at the recording's spans per
  trace) and the base. After the decisions, the RSS and heap are read again:
  v0.161.0 keeps a decided trace's entry (spans released) until num_traces
  newer ones push it out, unless a decision cache is configured.

Progress on stderr, a table and the scaled recommendation on stdout, all
figures in the JSON file. Exit status 0, 2 when it could not run (or bad
arguments).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, progress, quantile, read_status_kib

DEPLOY_CONFIG = Path(REPO_ROOT) / "deploy" / "otel-collector.yaml"
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SPANS_PER_REQUEST = 1024  # the agent outline's batch.send_batch_size (deploy/README.md)
IN_FLIGHT = 10            # concurrent exports: a sending queue's default num_consumers
HEADROOM = 2.0            # num_traces = new traces/s x decision_wait x HEADROOM
SCALE_RATES = (50, 200, 1_000, 3_000)  # new traces/s of the example deployments printed

# The recording: kvobs-otel's harness demo (vLLM's scheduler and connector,
# rank processes) with 4 ranks, tensor parallel 4, the README's example size.
DEMO_ARGS = ("--mode", "harness", "--ranks", "4", "--seed", "0")


@dataclass(frozen=True)
class Plan:
    rates: tuple[int, ...]            # offered spans/s, rising; stop at the first unclean
    step_s: float                     # sending time per step
    throughput_wait_s: int            # decision_wait during the throughput steps
    levels: tuple[int, ...]           # open traces at each memory reading
    memory_wait_s: int                # decision_wait during the memory phase
    idle_s: float                     # the idle gateway's CPU, measured before the steps
    rounds: int                       # throughput ladders, each on a fresh gateway


FULL = Plan(rates=(5_000, 10_000, 15_000, 20_000, 25_000, 30_000, 40_000, 60_000, 80_000),
            step_s=15.0, throughput_wait_s=10, levels=(0, 10_000, 30_000, 60_000),
            memory_wait_s=90, idle_s=6.0, rounds=2)
QUICK = Plan(rates=(2_000, 8_000), step_s=4.0, throughput_wait_s=2,
             levels=(0, 1_000, 3_000), memory_wait_s=20, idle_s=2.0, rounds=1)


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


# -- the stores' stand-in ---------------------------------------------------------------
class RawSink:
    """OTLP/gRPC trace endpoint that accepts every export without decoding it
    (the empty ExportTraceServiceResponse is zero bytes). grpc decompresses
    in its C core; the handler holds the GIL for a counter increment only."""

    def __init__(self) -> None:
        import grpc

        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()

        def export(request: bytes, context: Any) -> bytes:
            with self._lock:
                self.requests += 1
                self.bytes += len(request)
            return b""

        handler = grpc.unary_unary_rpc_method_handler(export)  # bytes in, bytes out

        class Handlers(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                return handler if details.method == EXPORT_METHOD else None

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  options=[("grpc.max_receive_message_length", 64 << 20)])
        self.server.add_generic_rpc_handlers((Handlers(),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


# -- the gateway ------------------------------------------------------------------------
def _otel_servers() -> Any:
    """tests/otel_servers.py: one way to find, start and stop the Go-built
    Collector for tests and this benchmark (its log, SIGTERM then SIGKILL)."""
    tests = str(Path(REPO_ROOT) / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import otel_servers

    return otel_servers


def parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text exposition -> name -> [(label text, value)]."""
    out: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        try:
            out[name].append((labels.rstrip("}"), float(value)))
        except ValueError:
            continue
    return out


def metric(m: dict[str, list[tuple[str, float]]], name: str, *match: str) -> float:
    """Sum of ``name``'s samples whose labels contain every ``match`` text."""
    return sum(v for labels, v in m.get(name, []) if all(x in labels for x in match))


class Gateway:
    def __init__(self, sink_port: int, decision_wait_s: int, log_dir: Path,
                 extra_args: Sequence[str] = ()) -> None:
        servers = _otel_servers()
        self.decision_wait_s = decision_wait_s
        self.ports = {k: servers.free_port() for k in ("grpc", "http", "prom", "tel", "health")}
        p = self.ports
        env = {
            "KVOBS_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{p['grpc']}",
            "KVOBS_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{p['http']}",
            "KVOBS_JAEGER_OTLP_ENDPOINT": f"127.0.0.1:{sink_port}",
            "KVOBS_TEMPO_OTLP_ENDPOINT": f"127.0.0.1:{sink_port}",
            "KVOBS_PROMETHEUS_EXPORTER_ENDPOINT": f"127.0.0.1:{p['prom']}",
            "KVOBS_COLLECTOR_TELEMETRY_HOST": "127.0.0.1",
            "KVOBS_COLLECTOR_TELEMETRY_PORT": str(p["tel"]),
            "KVOBS_COLLECTOR_HEALTH_ENDPOINT": f"127.0.0.1:{p['health']}",
            "KVOBS_TAIL_DECISION_WAIT": f"{decision_wait_s}s",
        }
        self.binary = str(servers.built_binary("OTELCOL"))
        self.server = servers.start_process(
            "otelcol", [self.binary, f"--config=file:{DEPLOY_CONFIG}", *extra_args], env,
            ready_url=f"http://127.0.0.1:{p['health']}/", ready_log=servers.READY_LOG_LINE,
            log_dir=log_dir)
        self.pid = self.server.pid
        self.endpoint = f"127.0.0.1:{p['grpc']}"

    def metrics(self) -> dict[str, list[tuple[str, float]]]:
        url = f"http://127.0.0.1:{self.ports['tel']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return parse_metrics(r.read().decode())

    def cpu_s(self) -> float:
        """utime + stime of the Collector process, seconds (/proc/PID/stat)."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        return read_status_kib("VmRSS", self.pid) / 1024

    def stop(self) -> None:
        self.server.stop()


def counters(m: dict[str, list[tuple[str, float]]]) -> dict[str, float]:
    """The gateway's own counts this benchmark judges by (v0.161.0 names)."""
    ts = "otelcol_processor_tail_sampling_"
    return {
        "accepted": metric(m, "otelcol_receiver_accepted_spans", 'receiver="otlp"'),
        # memory_limiter refusals reach the receiver as refused spans
        "refused": metric(m, "otelcol_receiver_refused_spans")
        + metric(m, "otelcol_receiver_failed_spans"),
        "delivered": metric(m, "otelcol_exporter_sent_spans", 'exporter="otlp/jaeger"'),
        "delivered_tempo": metric(m, "otelcol_exporter_sent_spans", 'exporter="otlp/tempo"'),
        "export_failed": metric(m, "otelcol_exporter_send_failed_spans"),
        "new_traces": metric(m, ts + "new_trace_id_received"),
        "decided": metric(m, ts + "global_count_traces_sampled"),
        "dropped_too_early": metric(m, ts + "sampling_trace_dropped_too_early"),
        "on_memory": metric(m, ts + "sampling_traces_on_memory"),
        "tick_ms_sum": metric(m, ts + "sampling_decision_timer_latency_sum"),
        "ticks": metric(m, ts + "sampling_decision_timer_latency_count"),
        "tick_over_1s": metric(m, ts + "sampling_decision_timer_latency_count")
        - metric(m, ts + "sampling_decision_timer_latency_bucket", 'le="1000"'),
        "rss_mib": metric(m, "otelcol_process_memory_rss") / 2**20,
        "heap_alloc_mib": metric(m, "otelcol_process_runtime_heap_alloc_bytes") / 2**20,
        "sys_mib": metric(m, "otelcol_process_runtime_total_sys_memory_bytes") / 2**20,
    }


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in b}


# -- the sender -------------------------------------------------------------------------
@dataclass
class SendStats:
    requests: int = 0
    spans: int = 0
    traces: int = 0
    failed_spans: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    issue_s: float = 0.0    # from the first export issued to the loop's end
    seconds: float = 0.0    # ... to the last answer
    blocked_s: float = 0.0  # waiting for a free in-flight slot: the gateway was slower
    latencies_s: list[float] = field(default_factory=list)  # issue -> answer, per export

    @property
    def achieved(self) -> float:
        """Spans/s issued (answers that come later are the latency's, not the rate's)."""
        return self.spans / self.issue_s if self.issue_s else 0.0

    def as_json(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {"requests": self.requests, "spans": self.spans, "traces": self.traces,
                "failed_spans": self.failed_spans, "errors": dict(self.errors),
                "issue_s": round(self.issue_s, 3), "seconds": round(self.seconds, 3),
                "blocked_s": round(self.blocked_s, 3),
                "achieved_spans_per_s": round(self.achieved),
                "latency_ms_p50": round(1000 * quantile(lat, 0.5), 1) if lat else None,
                "latency_ms_p99": round(1000 * quantile(lat, 0.99), 1) if lat else None,
                "latency_ms_max": round(1000 * lat[-1], 1) if lat else None}


class Sender:
    """Paced raw OTLP/gRPC exports of fresh copies of the episodes."""

    def __init__(self, endpoint: str, episodes: Sequence[Episode], seed: int = 0) -> None:
        import grpc

        self.channel = grpc.insecure_channel(
            endpoint, options=[("grpc.max_send_message_length", 64 << 20)],
            compression=grpc.Compression.Gzip)
        self.export = self.channel.unary_unary(EXPORT_METHOD)  # bytes pass through
        self.episodes = list(episodes)
        self.rng = random.Random(seed)
        self._next = 0

    def _request(self, max_traces: int | None) -> tuple[bytes, int, int]:
        parts: list[bytes] = []
        spans = traces = 0
        while spans < SPANS_PER_REQUEST and (max_traces is None or traces < max_traces):
            ep = self.episodes[self._next % len(self.episodes)]
            self._next += 1
            parts.append(ep.fresh(self.rng))
            spans += ep.spans
            traces += 1
        return b"".join(parts), spans, traces

    def run(self, rate: float | None = None, seconds: float | None = None,
            traces: int | None = None) -> SendStats:
        """Send at ``rate`` spans/s (None: as fast as the in-flight bound
        lets) for ``seconds`` or until ``traces`` traces are sent."""
        stats = SendStats()
        slots = threading.Semaphore(IN_FLIGHT)
        lock = threading.Lock()
        pending: list[Any] = []

        def done(fut: Any, spans: int, issued: float) -> None:
            slots.release()
            err = fut.exception()
            with lock:
                stats.latencies_s.append(time.monotonic() - issued)
                if err is not None:
                    stats.failed_spans += spans
                    code = err.code() if hasattr(err, "code") else None
                    stats.errors[getattr(code, "name", type(err).__name__)] += 1

        t0 = time.monotonic()
        due = t0
        while True:
            now = time.monotonic()
            if seconds is not None and now - t0 >= seconds:
                break
            if traces is not None and stats.traces >= traces:
                break
            data, n_spans, n_traces = self._request(
                None if traces is None else traces - stats.traces)
            if rate:
                if due > now:
                    time.sleep(due - now)
                due += n_spans / rate
            b0 = time.monotonic()
            slots.acquire()
            stats.blocked_s += time.monotonic() - b0
            issued = time.monotonic()
            fut = self.export.future(data, timeout=60)
            fut.add_done_callback(lambda f, n=n_spans, t=issued: done(f, n, t))
            pending.append(fut)
            stats.requests += 1
            stats.spans += n_spans
            stats.traces += n_traces
        stats.issue_s = time.monotonic() - t0
        for fut in pending:  # every export answered before the step is judged
            with contextlib.suppress(Exception):  # counted in done()
                fut.result()
        stats.seconds = time.monotonic() - t0
        return stats

    def close(self) -> None:
        self.channel.close()


def wait_until(pred: Any, timeout: float, interval: float = 0.25) -> tuple[bool, float]:
    t0 = time.monotonic()
    while True:
        if pred():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        time.sleep(interval)


# -- phases -----------------------------------------------------------------------------
def _step(gw: Gateway, sender: Sender, rate: int, plan: Plan,
          idle_cores: float) -> dict[str, Any]:
    """Offer ``rate`` spans/s for ``plan.step_s``, wait for every span to
    reach the sink, judge the step by the gateway's own counts."""
    c0, cpu0, own0, t0 = counters(gw.metrics()), gw.cpu_s(), time.process_time(), time.monotonic()
    s = sender.run(rate=rate, seconds=plan.step_s)
    cpu_sent, own_sent = gw.cpu_s(), time.process_time()
    ok_spans = s.spans - s.failed_spans
    # Every episode is kept (the recovery-episodes policy): all spans must
    # reach the sink once decision_wait has passed for the last trace.
    delivered, drain_s = wait_until(
        lambda: counters(gw.metrics())["delivered"] - c0["delivered"] >= ok_spans,
        plan.throughput_wait_s + 15)
    c1, cpu1, t1 = counters(gw.metrics()), gw.cpu_s(), time.monotonic()
    d = _delta(c0, c1)
    # The gateway's CPU for these spans: the whole step (receive, decide,
    # export) less what it spends idle (ticks, span metrics flushes, scrapes).
    marginal = (cpu1 - cpu0) - idle_cores * (t1 - t0)
    achieved = s.achieved
    margin_s = 5.0  # the 1 s decision tick, the 1 s batch timeout, our polling
    checks = {
        "rate_achieved": achieved >= 0.97 * rate,
        "nothing_refused": s.failed_spans == 0 and d["refused"] == 0,
        "all_accepted": d["accepted"] == s.spans,
        "all_decided": d["decided"] >= s.traces,
        "all_delivered": delivered and d["delivered"] >= ok_spans,
        "decisions_in_time": drain_s <= plan.throughput_wait_s + margin_s,
        "none_evicted_undecided": d["dropped_too_early"] == 0,
        "export_ok": d["export_failed"] == 0,
    }
    return {
        "offered_spans_per_s": rate, "achieved_spans_per_s": round(achieved),
        "send": s.as_json(), "drain_s": round(drain_s, 2), "seconds": round(t1 - t0, 2),
        "gateway_cpu_s": round(cpu1 - cpu0, 2),
        "gateway_cores_while_sending": round((cpu_sent - cpu0) / s.seconds, 3),
        "sender_process_cores_while_sending": round((own_sent - own0) / s.seconds, 3),
        "spans_per_gateway_cpu_s": round(s.spans / marginal) if marginal > 0 else None,
        "rss_mib_end": round(gw.rss_mib(), 1),
        "tick_ms_mean": round(d["tick_ms_sum"] / d["ticks"], 1) if d["ticks"] else None,
        "ticks_over_1s": d["tick_over_1s"],
        "counters": {k: round(v, 1) for k, v in d.items()},
        "checks": checks, "clean": all(checks.values()), "load_average": os.getloadavg(),
    }


def throughput_phase(plan: Plan, episodes: Sequence[Episode], sink: RawSink,
                     log_dir: Path, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """``plan.rounds`` rising ladders, each on a fresh gateway: on a shared
    machine one ladder's limit is one sample."""
    rounds = []
    for r in range(plan.rounds):
        progress(f"throughput round {r + 1}/{plan.rounds}")
        rounds.append(_ladder(plan, episodes, sink, log_dir, extra_args, seed=10 + r))
    return {"rounds": rounds}


def _ladder(plan: Plan, episodes: Sequence[Episode], sink: RawSink, log_dir: Path,
            extra_args: Sequence[str], seed: int) -> dict[str, Any]:
    gw = Gateway(sink.port, plan.throughput_wait_s, log_dir, extra_args)
    sender = Sender(gw.endpoint, episodes, seed=seed)
    steps: list[dict[str, Any]] = []
    try:
        time.sleep(2)  # past start-up work
        cpu0, t0 = gw.cpu_s(), time.monotonic()
        time.sleep(plan.idle_s)
        idle_cores = (gw.cpu_s() - cpu0) / (time.monotonic() - t0)
        progress(f"throughput: idle gateway {idle_cores:.3f} cores")
        rates = list(plan.rates)
        refined = False
        while rates:
            rate = rates.pop(0)
            step = _step(gw, sender, rate, plan, idle_cores)
            steps.append(step)
            failed = [k for k, v in step["checks"].items() if not v]
            progress(f"throughput {rate:>6}/s: achieved {step['achieved_spans_per_s']:,}/s, "
                     f"gateway {step['gateway_cores_while_sending']:.2f} cores, sender "
                     f"{step['sender_process_cores_while_sending']:.2f} "
                     f"({step['spans_per_gateway_cpu_s']} spans per gateway CPU-s), export "
                     f"p99 {step['send']['latency_ms_p99']} ms, all delivered "
                     f"{step['drain_s']:.1f} s after the last send, "
                     f"{'NOT clean: ' + ', '.join(failed) if failed else 'clean'}")
            if failed:
                clean = [st["offered_spans_per_s"] for st in steps if st["clean"]]
                # One step between the last clean rate and this one.
                if clean and not refined and rate - clean[-1] > 0.2 * rate:
                    rates = [int(round((clean[-1] + rate) / 2, -3))]
                    refined = True
                    continue
                break
    finally:
        sender.close()
        gw.stop()
    return {"idle_gateway_cores": round(idle_cores, 4), "steps": steps}


def _rss_reading(gw: Gateway, reads: int = 3) -> dict[str, float]:
    rss, heap, prss = [], [], []
    for i in range(reads):
        if i:
            time.sleep(0.5)
        c = counters(gw.metrics())
        rss.append(gw.rss_mib())
        heap.append(c["heap_alloc_mib"])
        prss.append(c["rss_mib"])
    c = counters(gw.metrics())
    return {"rss_mib": round(statistics.median(rss), 2),
            "otelcol_process_memory_rss_mib": round(statistics.median(prss), 2),
            "heap_alloc_mib": round(statistics.median(heap), 2),
            "traces_on_memory": c["on_memory"], "decided": c["decided"],
            "accepted_spans": c["accepted"]}


def memory_phase(plan: Plan, episodes: Sequence[Episode], sink: RawSink,
                 log_dir: Path, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    gw = Gateway(sink.port, plan.memory_wait_s, log_dir, extra_args)
    sender = Sender(gw.endpoint, episodes, seed=2)
    readings: list[dict[str, Any]] = []
    fill: dict[str, Any] = {}
    try:
        time.sleep(3)  # start-up allocations settle
        t_first: float | None = None
        sent_traces = sent_spans = 0
        for level in plan.levels:
            if level > sent_traces:
                if t_first is None:
                    t_first = time.monotonic()
                s = sender.run(traces=level - sent_traces)
                if s.failed_spans:
                    raise RuntimeError(f"the gateway refused spans while filling: {s.errors}")
                sent_traces += s.traces
                sent_spans += s.spans
                fill = s.as_json()
                def held(spans: int = sent_spans, traces: int = sent_traces) -> bool:
                    c = counters(gw.metrics())
                    return c["accepted"] >= spans and c["on_memory"] >= traces

                if not wait_until(held, 30)[0]:
                    raise RuntimeError(f"the gateway did not hold {sent_traces} traces")
                time.sleep(2)  # the tick records traces_on_memory; let GC catch up
            r = _rss_reading(gw)
            r.update(open_traces=sent_traces, spans=sent_spans,
                     fill=fill if level else None,
                     seconds_since_first=round(time.monotonic() - t_first, 1)
                     if t_first else 0.0)
            if r["decided"]:
                raise RuntimeError(f"decisions began at {sent_traces} traces "
                                   f"({r['seconds_since_first']} s): raise memory_wait_s")
            readings.append(r)
            progress(f"memory: {sent_traces:>6} open traces ({sent_spans} spans): RSS "
                     f"{r['rss_mib']:.1f} MiB, Go heap {r['heap_alloc_mib']:.1f} MiB, "
                     f"tail sampler holds {r['traces_on_memory']:.0f}")
        # After the decisions: what stays until num_traces newer traces evict it.
        progress(f"memory: waiting for the decisions (decision_wait {plan.memory_wait_s} s)")
        wait_until(lambda: counters(gw.metrics())["decided"] >= sent_traces,
                   plan.memory_wait_s + 30, interval=1.0)
        wait_until(lambda: counters(gw.metrics())["delivered"] >= sent_spans, 30)
        time.sleep(5)
        after = _rss_reading(gw)
        after.update(decided_traces=after["decided"], open_traces=0)
        progress(f"memory: after the decisions: RSS {after['rss_mib']:.1f} MiB, Go heap "
                 f"{after['heap_alloc_mib']:.1f} MiB, entries kept "
                 f"{after['traces_on_memory']:.0f}")
    finally:
        sender.close()
        gw.stop()
    return {"readings": readings, "after_decisions": after}


# -- arithmetic -------------------------------------------------------------------------
def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares y = slope * x + intercept, with r^2."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept,
            "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def shipped_settings(path: Path = DEPLOY_CONFIG) -> dict[str, float]:
    """The gateway settings the sizing depends on, from the shipped config."""
    import yaml

    procs = yaml.safe_load(path.read_text())["processors"]
    ml, ts = procs["memory_limiter"], procs["tail_sampling"]
    return {"num_traces": ts["num_traces"],
            "limit_percentage": ml["limit_percentage"],
            "spike_limit_percentage": ml["spike_limit_percentage"]}


def size_gateway(new_traces_per_s: float, decision_wait_s: float, spans_per_trace: float,
                 mib_per_1k_traces: float, base_mib: float, spans_per_core_s: float,
                 headroom: float = HEADROOM, idle_cores: float = 0.0,
                 heap_mib_per_1k_traces: float = 0.0, heap_base_mib: float = 0.0,
                 soft_limit_fraction: float = 0.6,
                 sustained_spans_per_s: float = math.inf) -> dict[str, float]:
    """One gateway's settings for R new traces/s and decision_wait W:
    num_traces >= R x W x headroom; memory ~ slope x num_traces/1000 + base
    (every slot holding an open trace: the bound to give the container, as
    v0.161.0 fills every slot, decided entries included); cores = idle +
    spans/s over the spans per CPU-second measured. memory_limiter refuses
    data once the Go heap passes (limit - spike) of the container's memory
    (``soft_limit_fraction``), so the container needs the heap bound over
    that fraction too. Past the rate one gateway sustained, the traffic is
    spread over ``gateways`` (by trace id): the figures are per gateway."""
    spans_total = new_traces_per_s * spans_per_trace
    gateways = max(1, math.ceil(spans_total / sustained_spans_per_s))
    new_traces_per_s /= gateways
    num_traces = math.ceil(new_traces_per_s * decision_wait_s * headroom)
    spans_per_s = new_traces_per_s * spans_per_trace
    rss = base_mib + mib_per_1k_traces * num_traces / 1000
    heap = heap_base_mib + heap_mib_per_1k_traces * num_traces / 1000
    return {"new_traces_per_s": new_traces_per_s * gateways, "gateways": gateways,
            "per_gateway_new_traces_per_s": new_traces_per_s,
            "decision_wait_s": decision_wait_s, "headroom": headroom, "num_traces": num_traces,
            "open_traces": new_traces_per_s * decision_wait_s,
            "memory_mib": rss, "heap_mib": heap,
            "container_limit_mib": max(rss, heap / soft_limit_fraction),
            "spans_per_s": spans_per_s, "cores": idle_cores + spans_per_s / spans_per_core_s}


# -- main -------------------------------------------------------------------------------
def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarize(episodes: Sequence[Episode], throughput: dict[str, Any],
              mem: dict[str, Any]) -> dict[str, Any]:
    spans_per_trace = statistics.fmean(e.spans for e in episodes)
    best_by_round, unclean_by_round, cores_at_best = [], [], []
    per_cpu: list[float] = []
    for rnd in throughput["rounds"]:
        clean = [s for s in rnd["steps"] if s["clean"]]
        unclean = [s for s in rnd["steps"] if not s["clean"]]
        best = max(clean, key=lambda s: s["offered_spans_per_s"]) if clean else None
        best_by_round.append(best["offered_spans_per_s"] if best else 0)
        cores_at_best.append(best["gateway_cores_while_sending"] if best else None)
        first = min(unclean, key=lambda s: s["offered_spans_per_s"]) if unclean else None
        unclean_by_round.append(
            {"spans_per_s": first["offered_spans_per_s"],
             "checks": [k for k, v in first["checks"].items() if not v],
             "export_latency_ms_p99": first["send"]["latency_ms_p99"]} if first else None)
        # Per-span CPU at low rates is blurred by the idle cost subtracted;
        # the loaded steps tell the cost at work.
        per_cpu += [s["spans_per_gateway_cpu_s"] for s in clean
                    if s["spans_per_gateway_cpu_s"] and s["offered_spans_per_s"] >= 10_000]
    xs = [r["open_traces"] / 1000 for r in mem["readings"]]
    rss_fit = fit_line(xs, [r["rss_mib"] for r in mem["readings"]])
    heap_fit = fit_line(xs, [r["heap_alloc_mib"] for r in mem["readings"]])
    return {
        "spans_per_trace": round(spans_per_trace, 2),
        # the lowest round's: what one gateway sustained every time here
        "highest_clean_spans_per_s": min(best_by_round),
        "highest_clean_spans_per_s_by_round": best_by_round,
        "first_unclean_by_round": unclean_by_round,
        "gateway_cores_at_highest_clean_by_round": cores_at_best,
        "spans_per_gateway_cpu_s": round(statistics.median(per_cpu)) if per_cpu else None,
        "spans_per_gateway_cpu_s_range": [min(per_cpu), max(per_cpu)] if per_cpu else None,
        "idle_gateway_cores": round(statistics.fmean(
            r["idle_gateway_cores"] for r in throughput["rounds"]), 4),
        "rss_mib_per_1k_open_traces": round(rss_fit["slope"], 3),
        "rss_base_mib": round(rss_fit["intercept"], 1), "rss_fit_r2": round(rss_fit["r2"], 4),
        "rss_idle_mib": mem["readings"][0]["rss_mib"],
        "heap_mib_per_1k_open_traces": round(heap_fit["slope"], 3),
        # the Go heap swings with GC timing; a fitted base below the idle heap
        # would understate small gateways
        "heap_base_mib": round(max(heap_fit["intercept"], mem["readings"][0]["heap_alloc_mib"]),
                               1),
        "heap_fit_r2": round(heap_fit["r2"], 4),
        # MiB per 1,000 traces -> KiB per span (for other tensor-parallel sizes)
        "rss_kib_per_open_span": round(rss_fit["slope"] * 1024 / 1000 / spans_per_trace, 3),
        "rss_at_top_level_mib": mem["readings"][-1]["rss_mib"],
        "rss_after_decisions_mib": mem["after_decisions"]["rss_mib"],
        "entries_kept_after_decisions": mem["after_decisions"]["traces_on_memory"],
    }


def scaled(summary: dict[str, Any], rates: Sequence[float], wait_s: float,
           headroom: float = HEADROOM) -> list[dict[str, float]]:
    shipped = shipped_settings()
    soft = (shipped["limit_percentage"] - shipped["spike_limit_percentage"]) / 100
    return [size_gateway(r, wait_s, summary["spans_per_trace"],
                         summary["rss_mib_per_1k_open_traces"], summary["rss_base_mib"],
                         summary["spans_per_gateway_cpu_s"] or math.nan,
                         headroom, summary["idle_gateway_cores"],
                         summary["heap_mib_per_1k_open_traces"], summary["heap_base_mib"],
                         soft, summary["highest_clean_spans_per_s"] or math.inf)
            for r in rates]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_sizing",
        description="Sizing of one gateway Collector (deploy/otel-collector.yaml, the "
                    "Go-built Collector): sustainable spans/s through its tail sampler, and "
                    "RSS per 1,000 open traces, with recorded kvobs-otel recovery episodes "
                    "re-sent over OTLP/gRPC with fresh ids; a scaled recommendation for "
                    "num_traces and memory. Figures are from this machine. Run from the "
                    "repository root.",
        epilog="Exit status: 0 measured, 2 could not run (or bad arguments).")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (about a minute, plus a first recording): small levels, "
                         "two short rate steps; the figures mean little")
    ap.add_argument("-o", "--output", default="gateway-sizing.json",
                    help="JSON results file (default: %(default)s)")
    ap.add_argument("--recording", type=Path,
                    help="OTLP JSON lines with kvobs-otel recovery episodes (default: made "
                         "once with `kvobs-otel demo " + " ".join(DEMO_ARGS) + "` and cached)")
    ap.add_argument("--rate", type=float, default=200.0,
                    help="new traces/s of the deployment to size for (default: %(default)g, "
                         "the config's expected_new_traces_per_sec)")
    ap.add_argument("--decision-wait", type=float, default=30.0,
                    help="decision_wait of that deployment, seconds (default: %(default)g, "
                         "the shipped default)")
    ap.add_argument("--num-shards", type=int, metavar="N",
                    help="tail_sampling.num_shards for this run (--set on the Collector's "
                         "command line; the shipped config leaves it at 1: one event loop "
                         "for ingest and decisions)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    extra = ([f"--set=processors::tail_sampling::num_shards={args.num_shards}"]
             if args.num_shards else [])
    t_start = time.monotonic()
    load_start = os.getloadavg()
    from benchmarks.__main__ import machine_info

    report: dict[str, Any] = {"schema": 1, "command": ["python", "-m", "benchmarks.gateway_sizing",
                                                       *(argv if argv is not None
                                                         else sys.argv[1:])],
                              "quick": args.quick, "machine": machine_info(),
                              "collector_args": extra,
                              "plan": plan.__dict__}
    try:
        path = args.recording or default_recording()
        provenance: dict[str, Any] = {"path": str(path)}
        if args.recording is None and not path.exists():
            provenance.update(record_demo(path))
        elif args.recording is None:
            provenance["command"] = ["kvobs-otel", "demo", *DEMO_ARGS, "-o", str(path)]
        with open(path, encoding="utf-8") as f:
            episodes, other = load_episodes(f)
        if not episodes:
            raise RuntimeError(f"{path}: no recovery episode (kv.recovery) in it")
        shapes = Counter(tuple(sorted(e.names.items())) for e in episodes)
        provenance.update(other, episodes=len(episodes),
                          spans_per_trace=[e.spans for e in episodes],
                          bytes_per_trace=[len(e.data) for e in episodes],
                          shapes={" ".join(f"{n}x{k}" for k, n in shape): c
                                  for shape, c in shapes.items()})
        report["recording"] = provenance
        progress(f"{len(episodes)} episodes from {path}: "
                 f"{statistics.fmean(e.spans for e in episodes):.1f} spans/trace, "
                 f"{statistics.fmean(len(e.data) for e in episodes):.0f} bytes/trace "
                 f"(uncompressed OTLP); load average {load_start[0]:.2f}")
        log_dir = Path(tempfile.mkdtemp(prefix="kvobs-gateway-sizing-"))
        sink = RawSink()
        try:
            progress(f"throughput: steps of {plan.step_s:g} s, decision_wait "
                     f"{plan.throughput_wait_s} s")
            throughput = throughput_phase(plan, episodes, sink, log_dir, extra)
            progress(f"memory: levels {plan.levels} open traces, decision_wait "
                     f"{plan.memory_wait_s} s")
            mem = memory_phase(plan, episodes, sink, log_dir, extra)
        finally:
            sink.close()
        report["collector"] = {"binary": str(_otel_servers().built_binary("OTELCOL")),
                               "config": str(DEPLOY_CONFIG), "logs": str(log_dir)}
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError, TimeoutError) as e:
        first = str(e).splitlines()[0] if str(e) else repr(e)
        print(f"gateway sizing could not run: {first}", file=sys.stderr)
        if str(e).count("\n"):  # a Collector's or the demo's log tail
            progress(str(e))
        return 2
    load_end = os.getloadavg()
    summary = summarize(episodes, throughput, mem)
    (rec,) = scaled(summary, [args.rate], args.decision_wait)
    report.update(throughput=throughput, memory=mem, summary=summary, recommendation=rec,
                  scaled=scaled(summary, SCALE_RATES, args.decision_wait),
                  load_average_start=load_start, load_average_end=load_end,
                  seconds=round(time.monotonic() - t_start, 1))
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(render(report))
    print(f"results in {args.output}")
    return 0


def render(report: dict[str, Any]) -> str:
    s, rec = report["summary"], report["recommendation"]
    rows = [["round", "offered spans/s", "achieved", "gateway cores", "sender cores",
             "spans/gw CPU-s", "export p99 ms", "drain s", "RSS MiB", "clean"]]
    for i, st in ((i, st) for i, rnd in enumerate(report["throughput"]["rounds"])
                  for st in rnd["steps"]):
        rows.append([str(i + 1), f"{st['offered_spans_per_s']:,}",
                     f"{st['achieved_spans_per_s']:,}",
                     f"{st['gateway_cores_while_sending']:.2f}",
                     f"{st['sender_process_cores_while_sending']:.2f}",
                     f"{st['spans_per_gateway_cpu_s'] or 0:,}",
                     f"{st['send']['latency_ms_p99']}", f"{st['drain_s']:.1f}",
                     f"{st['rss_mib_end']:.0f}",
                     "yes" if st["clean"] else "NO: " + ",".join(
                         k for k, v in st["checks"].items() if not v)])
    mrows = [["open traces", "spans", "RSS MiB", "otelcol rss MiB", "Go heap MiB"]]
    for r in report["memory"]["readings"]:
        mrows.append([f"{r['open_traces']:,}", f"{r['spans']:,}", f"{r['rss_mib']:.1f}",
                      f"{r['otelcol_process_memory_rss_mib']:.1f}",
                      f"{r['heap_alloc_mib']:.1f}"])
    srows = [["new traces/s", "decision_wait s", "gateways", "open traces", "num_traces",
              "RSS MiB", "heap MiB", "container MiB", "spans/s", "cores"]]
    for x in report["scaled"]:
        srows.append([f"{x['new_traces_per_s']:,.0f}", f"{x['decision_wait_s']:g}",
                      f"{x['gateways']}",
                      f"{x['open_traces']:,.0f}", f"{x['num_traces']:,}",
                      f"{x['memory_mib']:,.0f}", f"{x['heap_mib']:,.0f}",
                      f"{x['container_limit_mib']:,.0f}", f"{x['spans_per_s']:,.0f}",
                      f"{x['cores']:.2f}"])
    la0, la1 = report["load_average_start"], report["load_average_end"]
    after = report["memory"]["after_decisions"]
    return "\n".join([
        f"Gateway sizing (deploy/otel-collector.yaml on the Go-built Collector; this machine: "
        f"{report['machine']['cpu_count']} cores, shared; load average {la0[0]:.2f} at start, "
        f"{la1[0]:.2f} at end)",
        f"Traces: {report['recording']['episodes']} recorded recovery episodes re-sent with "
        f"fresh ids, {s['spans_per_trace']} spans/trace",
        "", _table(rows), "", _table(mrows), "",
        f"sustained (clean) up to {s['highest_clean_spans_per_s']:,} spans/s in every round "
        f"(by round: {s['highest_clean_spans_per_s_by_round']}; first unclean: "
        + "; ".join(f"{u['spans_per_s']:,} ({', '.join(u['checks'])}, export p99 "
                    f"{u['export_latency_ms_p99']} ms)" if u else "none"
                    for u in s["first_unclean_by_round"])
        + "), the sender on the same 2 cores",
        f"gateway CPU: {s['spans_per_gateway_cpu_s'] or 0:,} spans per CPU-second (median of the "
        f"loaded clean steps, range {s['spans_per_gateway_cpu_s_range']}), idle "
        f"{s['idle_gateway_cores']:.3f} cores",
        f"memory: {s['rss_mib_per_1k_open_traces']:.2f} MiB RSS per 1,000 open traces "
        f"({s['spans_per_trace']} spans each, {s['rss_kib_per_open_span']:.2f} KiB per span; "
        f"r2 {s['rss_fit_r2']}), base {s['rss_base_mib']:.0f} MiB; Go heap "
        f"{s['heap_mib_per_1k_open_traces']:.2f} MiB per 1,000",
        f"after the decisions: RSS {after['rss_mib']:.0f} MiB, "
        f"{after['traces_on_memory']:,.0f} decided entries still held (no decision cache)",
        "", _table(srows), "",
        "(per gateway from 'open traces' on; gateways = spans/s over the rate one sustained)",
        "",
        f"For {rec['new_traces_per_s']:g} new traces/s and decision_wait "
        f"{rec['decision_wait_s']:g} s (x{rec['headroom']:g} headroom), "
        f"{rec['gateways']} gateway(s), each: num_traces >= "
        f"{rec['num_traces']:,}, memory ~ {rec['memory_mib']:.0f} MiB "
        f"({s['rss_mib_per_1k_open_traces']:.2f} x {rec['num_traces'] / 1000:g} + "
        f"{s['rss_base_mib']:.0f}), container limit >= {rec['container_limit_mib']:.0f} MiB "
        f"(memory_limiter refuses data once the Go heap passes limit - spike of it), "
        f"{rec['spans_per_s']:,.0f} spans/s ~ {rec['cores']:.2f} cores (figures from this "
        f"machine)",
    ])


if __name__ == "__main__":
    sys.exit(main())
