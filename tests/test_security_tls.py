"""OTLP over mutual TLS with a bearer token, against the real Collector.

The Collector (otelcol-kvobs, built by .ci/otel-bins) listens for OTLP gRPC and
OTLP/HTTP on 127.0.0.1 with TLS, demands a client certificate signed by the
test CA (``client_ca_file``) and a bearer token (the ``bearertokenauth``
extension, token read from a file). Whatever it accepts it forwards, plain and
synchronously (no queue), to an in-process OTLP receiver: that receiver holds
exactly what the Collector accepted. The certificates are made with ``openssl``
at test time (tests/otel_servers.py make_pki) in a tmp dir.

The sender is the product's own export path: ``kvobs-otel demo`` (the real vLLM
scheduler + 2 rank processes on CPU, kvobs_otel.tools.demo.run_demo) in a subprocess,
configured only through the standard OTEL_EXPORTER_OTLP_* variables. The demo
also writes every span to its OTLP JSON file, which is what the Collector must
have received: all of it with the right credentials, none of it otherwise,
while the vLLM run itself completes unchanged.

Rank processes are forked (``start_method="fork"``) instead of the CLI's spawn:
the same demo code, but each run is ~12 s faster on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvobs_otel.tools.otlp_file import FileSpan, read_spans

from otel_servers import (
    Pki,
    free_port,
    make_pki,
    otel_binaries,
    poll,
    start_collector,
)
from otlp_receiver import HttpReceiver

pytestmark = pytest.mark.vllm

# requests (under the OTLP/HTTP exporter) lets these override the exporter's own
# CA file: set, OTEL_EXPORTER_OTLP_CERTIFICATE is ignored for http/protobuf (see
# test_a_requests_ca_bundle_overrides_the_otlp_certificate_for_http). Some
# machines (this CI's) set them globally, so the demo runs without them.
CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
TOKEN = "kvobs-test-token-5f0c"  # noqa: S105 (a throwaway test token)
REQUESTS = 4

COLLECTOR_YAML = """
extensions:
  health_check:
    endpoint: ${env:HEALTH}
  bearertokenauth:
    filename: ${env:TOKEN_FILE}
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: ${env:GRPC}
        tls: &tls
          cert_file: ${env:TLS_DIR}/server.pem
          key_file: ${env:TLS_DIR}/server.key
          client_ca_file: ${env:TLS_DIR}/ca.pem
        auth: &auth
          authenticator: bearertokenauth
      http:
        endpoint: ${env:HTTP}
        tls: *tls
        auth: *auth
exporters:
  otlp_http/sink:
    endpoint: ${env:SINK}
    compression: none          # tests/otlp_receiver.py reads raw protobuf
    sending_queue:
      enabled: false           # forward before answering the sender
service:
  extensions: [health_check, bearertokenauth]
  telemetry:
    metrics:
      level: none              # else it binds localhost:8888
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [otlp_http/sink]
    metrics:
      receivers: [otlp]
      exporters: [otlp_http/sink]
"""

DRIVER = """
import json, sys
from kvobs_otel.tools.demo import DemoOptions, run_demo
requests, seed, out, endpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
summary = run_demo(DemoOptions(ranks=2, requests=requests, seed=seed, out=out,
                               otlp_endpoint=endpoint, start_method="fork", mode="harness"))
print(json.dumps(summary))
sys.exit(1 if summary["incomplete_receipts"] else 0)   # as `kvobs-otel demo`
"""


@dataclass
class TlsCollector:
    pki: Pki
    sink: HttpReceiver
    ports: dict[str, int]
    collector: object

    def endpoint(self, protocol: str) -> str:
        return f"https://127.0.0.1:{self.ports['grpc' if protocol == 'grpc' else 'http']}"

    def received(self) -> tuple[int, int]:
        """(spans, metric export requests) the Collector accepted so far."""
        with self.sink.store.lock:
            return len(self.sink.store.spans), len(self.sink.store.metric_requests)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    _, otelcol = otel_binaries()
    components = subprocess.run([str(otelcol), "components"], capture_output=True, text=True,
                                timeout=60, stdin=subprocess.DEVNULL).stdout
    assert "bearertokenauth" in components, (
        f"{otelcol} has no bearertokenauth extension: a stale build. Rebuild and re-export "
        "with: eval \"$(bash .ci/setup-servers.sh)\"")
    tmp = tmp_path_factory.mktemp("tls")
    pki = make_pki(tmp / "pki")
    token_file = tmp / "pki" / "token"
    token_file.write_text(f"{TOKEN}\n")
    token_file.chmod(0o600)
    (tmp / "otelcol.yaml").write_text(COLLECTOR_YAML)
    ports = {k: free_port() for k in ("grpc", "http", "health")}
    sink = HttpReceiver()
    sink.__enter__()
    try:
        collector = start_collector(tmp / "otelcol.yaml", {
            "GRPC": f"127.0.0.1:{ports['grpc']}",
            "HTTP": f"127.0.0.1:{ports['http']}",
            "HEALTH": f"127.0.0.1:{ports['health']}",
            "TLS_DIR": str(pki.ca.parent),
            "TOKEN_FILE": str(token_file),
            "SINK": sink.endpoint,
        }, ready_url=f"http://127.0.0.1:{ports['health']}/", log_dir=tmp)
    except BaseException:
        sink.__exit__()
        raise
    yield TlsCollector(pki, sink, ports, collector)
    collector.stop()
    sink.__exit__()


@dataclass
class DemoRun:
    proc: subprocess.CompletedProcess
    summary: dict
    file_spans: list[FileSpan]
    seconds: float


def run_demo(tmp: Path, endpoint: str, env: dict[str, str], seed: int = 0) -> DemoRun:
    """The demo in a clean environment (no OTEL_/KVOBS_ of ours) plus ``env``."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OTEL_", "KVOBS_")) and k not in CA_BUNDLE_VARS}
    full_env.update(env)
    out = tmp / "demo.otlp.jsonl"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(REQUESTS), str(seed), str(out),
                           endpoint], cwd=tmp, env=full_env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - t0
    (tmp / "demo.stderr").write_text(proc.stderr)  # kept with the tmp dir, for a failure
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no summary (rc {proc.returncode}); stderr:\n{proc.stderr[-4000:]}"
    return DemoRun(proc, json.loads(lines[-1]), read_spans(str(out)), seconds)


def tls_env(tls: TlsCollector, protocol: str, *, ca: Path | None = None,
            client: tuple[Path | None, Path | None] | None = None, token: str = TOKEN,
            timeout: str | None = None) -> dict[str, str]:
    pki = tls.pki
    client_cert, client_key = client if client is not None else (pki.client_cert, pki.client_key)
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(ca or pki.ca),
        # The SDK URL-decodes header values: %20 is the space after "Bearer".
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{token}",
    }
    if client_cert is not None:
        env["OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"] = str(client_cert)
        env["OTEL_EXPORTER_OTLP_CLIENT_KEY"] = str(client_key)
    if timeout is not None:
        env["OTEL_EXPORTER_OTLP_TIMEOUT"] = timeout
    return env


def ids(spans) -> set[tuple[str, str]]:
    return {(s.trace_id.lower(), s.span_id.lower()) for s in spans}


def assert_vllm_run_completed(run: DemoRun) -> None:
    """The demo ended as it does without any OTLP endpoint: rc 0, every request
    finished, a recovered episode, every span in its file."""
    assert run.proc.returncode == 0, run.proc.stderr[-4000:]
    assert run.summary["episodes"].get("recovered", 0) >= 1, run.summary
    assert run.summary["incomplete_receipts"] == 0, run.summary
    assert run.summary["spans"] == len(run.file_spans) > 0, run.summary
    assert "Traceback (most recent call last)" not in run.proc.stderr, run.proc.stderr[-6000:]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_every_span_arrives_over_mutual_tls_with_the_token(tls, tmp_path, protocol):
    before = tls.received()
    run = run_demo(tmp_path, tls.endpoint(protocol), tls_env(tls, protocol))
    assert_vllm_run_completed(run)
    want = ids(run.file_spans)

    def arrived() -> set[tuple[str, str]]:
        got = ids(tls.sink.store.spans) & want
        return got if got == want else set()

    got = poll(arrived, timeout=15) or (ids(tls.sink.store.spans) & want)
    assert got == want, (f"{len(want - got)} of {len(want)} spans missing at the Collector;"
                         f"\ndemo stderr:\n{run.proc.stderr[-3000:]}"
                         f"\ncollector log:\n{tls.collector.log_tail()}")
    spans, metric_requests = tls.received()
    assert spans - before[0] == len(want), "the Collector accepted spans twice or from elsewhere"
    assert metric_requests > before[1], "no metrics arrived through the TLS receiver"
    assert "kvobs.transfers" in tls.sink.store.metric_names()


# name -> (protocol, tls_env overrides, what the exporter's log line must name,
# OTEL_EXPORTER_OTLP_TIMEOUT in seconds: refusals at the TLS layer are retried
# until then)
REFUSALS = {
    "wrong CA (server not trusted)": ("grpc", {"ca": "wrong_ca"}, r"CERTIFICATE_VERIFY_FAILED",
                                      "1"),
    # TLS 1.3: the refusal comes after the client's handshake; requests reports
    # the alert (CERTIFICATE_REQUIRED) or, racing it, an EOF: both as SSLError.
    # The HTTP exporter names the cause only in its "Transient error ...,
    # retrying" line, and retries only if its first backoff (1 s +-20%) fits
    # in what is left of the timeout: with 1 s that is a coin toss per export.
    "no client certificate": ("http/protobuf", {"client": (None, None)}, r"SSLError", "3"),
    "wrong token, grpc": ("grpc", {"token": "not-the-token"}, r"UNAUTHENTICATED", "1"),
    "wrong token, http": ("http/protobuf", {"token": "not-the-token"}, r"\b401\b", "1"),
}
# Any line that says an export failed: the SDK exporters' own lines ("Failed to
# export ...", "Transient error ... retrying") or kvobs-otel's ("... not delivered
# (export_failed) ...").
EXPORT_FAILED = re.compile(r"Failed to export|Transient error|export_failed|not delivered")


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_credentials_deliver_nothing_and_leave_vllm_alone(tls, tmp_path, case):
    protocol, overrides, cause, timeout = REFUSALS[case]
    kwargs = dict(overrides)
    if "ca" in kwargs:
        kwargs["ca"] = getattr(tls.pki, kwargs["ca"])
    env = tls_env(tls, protocol, timeout=timeout, **kwargs)
    before = tls.received()
    run = run_demo(tmp_path, tls.endpoint(protocol), env)
    # A refused export is a counted loss, not an internal failure: no traceback
    # (nor the empty one, 'NoneType: None') in any process's log.
    assert "NoneType: None" not in run.proc.stderr.splitlines(), case
    assert_vllm_run_completed(run)
    # Forwarding is synchronous, so by the time the demo has exited (and its
    # exporters have given up) anything accepted would already be at the sink.
    assert tls.received() == before, f"the Collector accepted data with {case}"
    assert not ids(tls.sink.store.spans) & ids(run.file_spans)
    failures = [line for line in run.proc.stderr.splitlines() if EXPORT_FAILED.search(line)]
    assert failures, f"{case}: no export failure logged; stderr:\n{run.proc.stderr[-4000:]}"
    assert any(re.search(cause, line) for line in failures), (
        f"{case}: no export failure names the cause ({cause}):\n" + "\n".join(failures))
    print(f"\n{case}: {run.seconds:.1f} s, {len(failures)} export-failure lines, "
          f"{len(run.file_spans)} spans")


def test_a_requests_ca_bundle_overrides_the_otlp_certificate_for_http(tls, monkeypatch):
    """The caveat deploy/README.md documents: with http/protobuf, requests takes
    REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) over the exporter's CA file, so the
    Collector is not trusted while one names a bundle without its CA. gRPC is not
    affected. Shown with the product's own exporter factory, one span each way."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from kvobs_otel.telemetry.providers import make_span_exporter

    def export_one(name: str) -> SpanExportResult:
        span = TracerProvider().get_tracer("tls-test").start_span(name)
        span.end()
        exporter = make_span_exporter()
        try:
            return exporter.export([span])
        finally:
            exporter.shutdown()

    for var in [v for v in os.environ if v.startswith("OTEL_")] + list(CA_BUNDLE_VARS):
        monkeypatch.delenv(var, raising=False)
    for k, v in {**tls_env(tls, "http/protobuf", timeout="2"),
                 "OTEL_EXPORTER_OTLP_ENDPOINT": tls.endpoint("http/protobuf")}.items():
        monkeypatch.setenv(k, v)
    before = tls.received()
    assert export_one("ca-file-only") == SpanExportResult.SUCCESS
    assert tls.received()[0] == before[0] + 1
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls.pki.wrong_ca))
    assert export_one("bundle-set") == SpanExportResult.FAILURE
    assert tls.received()[0] == before[0] + 1
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", tls.endpoint("grpc"))
    assert export_one("grpc-bundle-set") == SpanExportResult.SUCCESS
    assert tls.received()[0] == before[0] + 2
