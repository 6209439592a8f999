"""An OTLP/HTTP endpoint on loopback that accepts every export and counts it.

The enabled variant of B2 then runs kvobs-otel exactly as configured by a
user (its own export stage, encoder and the SDK's OTLP/HTTP exporters, from
the standard OTEL_* variables), minus a real Collector: the cost of sending
is in the measurement, and this sink proves spans really left the process.

It also measures how far behind the export runs: per span, the time from
its end (the seam that closed it: a transfer's result, a job's last receipt,
an episode's last first compute) to its arrival here, on the same host's
wall clock (``lags``). ``SinkProcess`` runs it in a process of its own
(``python -m benchmarks.otlp_sink``): B5's client is busy Python, and a
sink thread sharing its GIL took the client's time into every lag.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpSink:
    """Counts per sender: a sender uses ``endpoint_for(name)`` as its
    OTEL_EXPORTER_OTLP_ENDPOINT (the exporters append ``/v1/traces``)."""

    def __init__(self) -> None:
        self.spans: dict[str, Counter[str]] = {}
        self.requests: Counter[str] = Counter()
        self.lags: dict[str, list[float]] = {}  # seconds, per sender
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as a Collector does: with HTTP/1.0 every response
            # closes the connection and the exporters' pooled connection
            # can fail the next export (counted as a loss that is ours).
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                sink.record(self.path, body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802 (SinkProcess asks here)
                what, _, sender = self.path.strip("/").partition("/")
                if what == "lags":
                    data = sink.take_lags(sender)
                elif what == "counts":
                    data = sink.counts()
                else:
                    self.send_error(404)
                    return
                body = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass  # one line per export would bury the progress lines

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                # A sender that exits closes its pooled connection: not news.
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="otlp-sink", daemon=True)
        self._thread.start()

    def endpoint_for(self, sender: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/{sender}"

    def record(self, path: str, body: bytes) -> None:
        now = time.time_ns()
        names: list[str] = []
        lags: list[float] = []
        sender = path.strip("/").split("/", 1)[0]
        if path.endswith("/v1/traces"):
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                ExportTraceServiceRequest,
            )

            req = ExportTraceServiceRequest.FromString(body)
            spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
            names = [s.name for s in spans]
            lags = [(now - s.end_time_unix_nano) * 1e-9 for s in spans]
        with self._lock:
            self.requests[path] += 1
            self.spans.setdefault(sender, Counter()).update(names)
            self.lags.setdefault(sender, []).extend(lags)

    def take_lags(self, sender: str) -> list[float]:
        """The lags measured for ``sender`` since the last call."""
        with self._lock:
            return self.lags.pop(sender, [])

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {"spans": {k: dict(v) for k, v in self.spans.items()},
                    "requests": dict(self.requests)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SinkProcess:
    """An OtlpSink in a process of its own, with the same methods."""

    def __init__(self) -> None:
        from benchmarks.common import REPO_ROOT

        # Its own session, as a Collector is its own service: with the
        # kernel's autogroup scheduling a session shares the CPU as one, and
        # in the benchmark's session the sink waited on the busy client.
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.otlp_sink"],
                                     stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                     start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"the OTLP sink process did not start: {line!r}")
        self.port = int(line)

    def endpoint_for(self, sender: str) -> str:
        return f"http://127.0.0.1:{self.port}/{sender}"

    def _get(self, path: str) -> Any:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/{path}", timeout=60) as r:
            return json.loads(r.read())

    def take_lags(self, sender: str) -> list[float]:
        return self._get(f"lags/{sender}")

    def counts(self) -> dict[str, Any]:
        return self._get("counts")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    """Serve until SIGTERM or SIGINT; the port goes to stdout first."""
    import signal

    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # (the server's threads inherit it)
    sink = OtlpSink()
    print(sink._server.server_address[1], flush=True)
    signal.sigwait(stop)
    sink.close()


if __name__ == "__main__":
    main()
