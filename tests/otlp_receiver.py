"""An in-process OTLP receiver (gRPC and HTTP/protobuf) for tests.

It decodes what the real OTLP exporters send with the official protobuf
definitions (opentelemetry-proto), so a test sees exactly the bytes a
Collector would receive. Loopback only.
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvobs_otel.telemetry.otlp_json import message_to_otlp_json
from kvobs_otel.tools.otlp_file import FileSpan, spans_from_document


class Store:
    def __init__(self) -> None:
        self.spans: list[FileSpan] = []
        self.metric_requests: list[Any] = []
        self.trace_requests: list[Any] = []  # as received (every attribute kept)
        self.lock = threading.Lock()

    def add_traces(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        # Decoded exactly as a file written by the product would be.
        spans = spans_from_document(message_to_otlp_json(req))
        with self.lock:
            self.spans.extend(spans)
            self.trace_requests.append(req)

    def metric_names(self) -> set[str]:
        names = set()
        with self.lock:
            for req in self.metric_requests:
                for rm in req.resource_metrics:
                    for sm in rm.scope_metrics:
                        names.update(m.name for m in sm.metrics)
        return names


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Export(self, request, context):  # noqa: N802 (gRPC naming)
        self.store.add_traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Export(self, request, context):  # noqa: N802
        with self.store.lock:
            self.store.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class GrpcReceiver:
    def __init__(self) -> None:
        self.store = Store()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self.store), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _Metrics(self.store), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GrpcReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)


class HttpReceiver:
    def __init__(self) -> None:
        self.store = store = Store()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    req = trace_service_pb2.ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    store.add_traces(req)
                    reply = trace_service_pb2.ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest()
                    req.ParseFromString(body)
                    with store.lock:
                        store.metric_requests.append(req)
                    reply = metrics_service_pb2.ExportMetricsServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HttpReceiver:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()


def received_ids(rx: HttpReceiver) -> list[tuple[str, str]]:
    with rx.store.lock:
        return [(s.trace_id, s.span_id) for s in rx.store.spans]


def metric_values(rx: HttpReceiver, name: str, **match: str) -> list[tuple[str, float]]:
    """(service.instance.id, value) of every point of ``name`` received."""
    out = []
    with rx.store.lock:
        requests = list(rx.store.metric_requests)
    for req in requests:
        for rm in req.resource_metrics:
            res = {a.key: a.value.string_value for a in rm.resource.attributes}
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name != name:
                        continue
                    for p in m.sum.data_points:
                        attrs = {a.key: a.value.string_value for a in p.attributes}
                        if all(attrs.get(k) == v for k, v in match.items()):
                            out.append((res.get("service.instance.id", ""), p.as_int))
    return out


def latest_total(rx: HttpReceiver, name: str, **match: str) -> int:
    """Sum over processes of the last (cumulative) value each reported."""
    last: dict[str, float] = {}
    for inst, v in metric_values(rx, name, **match):
        last[inst] = v
    return int(sum(last.values()))
