"""The gateway under test (the Go-built Collector with the shipped config),
the stores' stand-in it exports to, and its own metrics."""

from __future__ import annotations

import os
import sys
import threading
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, read_status_kib
from benchmarks.gateway_sizing.plan import DEPLOY_CONFIG, EXPORT_METHOD


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
def servers_module() -> Any:
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
        servers = servers_module()
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


def counter_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in b}
