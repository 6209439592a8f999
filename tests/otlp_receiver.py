"""An in-process OTLP receiver (gRPC and HTTP/protobuf) for tests.

It decodes what the real OTLP exporters send with the official protobuf
definitions (opentelemetry-proto), so a test sees exactly the bytes a
Collector would receive. Loopback only.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)


class Store:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metric_requests: list[Any] = []
        self.lock = threading.Lock()

    def add_traces(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        out = []
        for rs in req.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(ReceivedSpan(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                        resource=res, status_code=s.status.code,
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links]))
        with self.lock:
            self.spans.extend(out)

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
