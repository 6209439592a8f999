"""Smoke tests of the Go programs .ci/otel-bins/build.sh builds: Jaeger v2,
the project's Collector distribution (otelcol-kvobs) and Prometheus 3.5.0 with
promtool, run on 127.0.0.1 with throwaway configs and fed by the real Python
OTLP exporters (gRPC and HTTP). The Collector and Prometheus are the releases
docker-compose.yml ships (checked here against the built programs).

The Collector config here uses every component the distribution ships but
the ``bearertokenauth`` extension (tests/test_security_tls.py runs that one,
with TLS), so a component that failed to build or to start shows up here
first.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from otel_servers import (
    BUILD_SCRIPT,
    free_port,
    get_json,
    http_get,
    otel_binaries,
    poll,
    prometheus_binaries,
    start_collector,
    start_jaeger,
    start_prometheus,
    validate_collector_config,
    wait_http,
)
from otlp_receiver import HttpReceiver

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OTEL_BINS = ROOT / ".ci" / "otel-bins"

JAEGER_YAML = """
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none          # else it binds localhost:8888
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: ${env:J_HEALTH:-127.0.0.1:13133}
  jaeger_query:
    enable_tracing: false  # default true: traces itself to localhost:4317
    storage:
      traces: mem
    http:
      endpoint: ${env:J_QUERY_HTTP:-127.0.0.1:16686}
    grpc:
      endpoint: ${env:J_QUERY_GRPC:-127.0.0.1:16685}
  jaeger_storage:
    backends:
      mem:
        memory:
          max_traces: 10000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: ${env:J_OTLP_GRPC:-127.0.0.1:4317}
      http:
        endpoint: ${env:J_OTLP_HTTP:-127.0.0.1:4318}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: mem
"""

# Every component of otelcol-kvobs but bearertokenauth (test_security_tls.py),
# under the names of this release
# (otlp_grpc / otlp_http / span_metrics; otlp / otlphttp / spanmetrics are
# accepted as deprecated aliases).
COLLECTOR_YAML = """
extensions:
  health_check:
    endpoint: ${env:C_HEALTH:-127.0.0.1:13133}
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: ${env:C_OTLP_GRPC:-127.0.0.1:4317}
      http:
        endpoint: ${env:C_OTLP_HTTP:-127.0.0.1:4318}
processors:
  memory_limiter:
    check_interval: 1s
    limit_mib: 512
    spike_limit_mib: 128
  attributes:
    actions:
      - key: smoke.pipeline
        value: collector
        action: upsert
  transform:
    error_mode: ignore
    trace_statements:
      - set(span.attributes["smoke.transformed"], true)
  tail_sampling:
    decision_wait: 1s
    num_traces: 1000
    policies:
      - name: errors
        type: status_code
        status_code:
          status_codes: [ERROR]
      - name: marked
        type: string_attribute
        string_attribute:
          key: smoke.keep
          values: ["yes"]
  batch:
    timeout: 100ms
connectors:
  forward/sampling: {}
  span_metrics:
    metrics_flush_interval: 1s     # default 60s at this release
    histogram:
      explicit:
        buckets: [1ms, 10ms, 100ms, 1s]
exporters:
  debug:
    verbosity: detailed
  otlp_grpc/jaeger:
    endpoint: ${env:JAEGER_OTLP_GRPC:-127.0.0.1:4317}
    tls:
      insecure: true
  otlp_http/sink:
    endpoint: ${env:SINK_OTLP_HTTP:-http://127.0.0.1:4318}
    compression: none              # default gzip; tests/otlp_receiver.py reads raw protobuf
  prometheus:
    endpoint: ${env:C_PROM:-127.0.0.1:8889}
service:
  extensions: [health_check]
  telemetry:
    metrics:
      readers:
        - pull:
            exporter:
              prometheus:
                host: 127.0.0.1
                port: ${env:C_TELEMETRY_PORT:-8888}
  pipelines:
    traces/in:
      receivers: [otlp]
      processors: [memory_limiter, attributes, transform]
      exporters: [span_metrics, forward/sampling]
    traces/out:
      receivers: [forward/sampling]
      processors: [tail_sampling, batch]
      exporters: [otlp_grpc/jaeger, otlp_http/sink, debug]
    metrics/spans:
      receivers: [span_metrics]
      processors: [batch]
      exporters: [prometheus]
"""




def send_trace(exporter, service: str, root: str, *, keep: bool = False,
               error: bool = False) -> str:
    """One root span with a child, through the real SDK and ``exporter``; returns
    the trace id (hex)."""
    tp = TracerProvider(resource=Resource.create({"service.name": service}))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tp.get_tracer("kvobs.smoke")
    with tracer.start_as_current_span(root) as span:
        if keep:
            span.set_attribute("smoke.keep", "yes")
        with tracer.start_as_current_span(f"{root}.child"):
            pass
        if error:
            span.set_status(Status(StatusCode.ERROR, "boom"))
        trace_id = format(span.get_span_context().trace_id, "032x")
    tp.shutdown()
    return trace_id


def grpc_exporter(port: int) -> GrpcSpanExporter:
    return GrpcSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=10)


def http_exporter(port: int) -> HttpSpanExporter:
    return HttpSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=10)


def jaeger_env() -> dict[str, str]:
    return {k: f"127.0.0.1:{free_port()}" for k in
            ("J_HEALTH", "J_QUERY_HTTP", "J_QUERY_GRPC", "J_OTLP_GRPC", "J_OTLP_HTTP")}


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def jaeger_trace_ids(query_url: str, service: str) -> set[str]:
    q = urllib.parse.urlencode({"service": service, "lookback": "1h", "limit": "100"})
    return {t["traceID"] for t in get_json(f"{query_url}/api/traces?{q}").get("data") or []}


def compose_image_tag(service: str) -> str:
    """The image tag docker-compose.yml runs for ``service`` (``prom/prometheus:v3.5.0``
    -> ``v3.5.0``)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    image = compose["services"][service]["image"]
    _, sep, tag = image.rpartition(":")
    assert sep and tag, f"{service}: image {image!r} has no tag"
    return tag


def version_of(binary: Path) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def otel_bins() -> tuple[Path, Path]:
    return otel_binaries()


@pytest.fixture(scope="session")
def prom_bins() -> tuple[Path, Path]:
    return prometheus_binaries()


def test_build_script_is_cached_and_prints_every_path(otel_bins, prom_bins):
    # Cached means nothing is built again: the binaries are the same files.
    bins = [*otel_bins, *prom_bins]
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in bins]
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [f"JAEGER={otel_bins[0]}", f"OTELCOL={otel_bins[1]}",
                     f"PROMETHEUS={prom_bins[0]}", f"PROMTOOL={prom_bins[1]}"], proc.stdout
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in bins] == before
    assert "up to date" in proc.stderr and "building" not in proc.stderr
    for p in bins:
        assert p.is_absolute() and ROOT not in p.parents
    assert re.search(r"otelcol-kvobs version v0\.\d+\.\d+", version_of(otel_bins[1]))


def test_built_prometheus_is_the_release_compose_ships(prom_bins):
    tag = compose_image_tag("prometheus")  # prom/prometheus:v3.5.0
    assert tag.startswith("v"), tag
    release = tag[1:]
    for binary, name in zip(prom_bins, ("prometheus", "promtool"), strict=True):
        first = version_of(binary).splitlines()[0]
        assert first.startswith(f"{name}, version {release} "), first
    # The version above is stamped by build.sh (-X ...version.Version): check it
    # against the source that was built, the VERSION file of the module
    # prometheus/go.mod pins, in the module cache next to the binaries.
    go_mod = (OTEL_BINS / "prometheus" / "go.mod").read_text()
    (module_version,) = re.findall(r"^\s*github\.com/prometheus/prometheus (v\S+)", go_mod, re.M)
    source = (prom_bins[0].parent.parent / "go" / "mod" / "github.com" / "prometheus"
              / f"prometheus@{module_version}")
    assert (source / "VERSION").is_file(), f"no module source at {source}"
    assert (source / "VERSION").read_text().strip() == release


def test_built_collector_is_the_release_compose_ships(otel_bins):
    tag = compose_image_tag("otel-collector")  # otel/opentelemetry-collector-contrib:0.161.0
    version = version_of(otel_bins[1])
    assert re.search(rf"otelcol-kvobs version v{re.escape(tag)}\b", version), (tag, version)
    # ... and every contrib module (and every v0 core module) the build pins is
    # that release (the version string above is stamped by build.sh).
    go_mod = (OTEL_BINS / "otelcol" / "go.mod").read_text()
    pins = re.findall(r"^\s*(github\.com/open-telemetry/opentelemetry-collector-contrib/\S+"
                      r"|go\.opentelemetry\.io/collector/\S+) (v0\.\S+)", go_mod, re.M)
    assert pins
    other = sorted(f"{module} {v}" for module, v in pins if v != f"v{tag}")
    assert not other, other


def test_jaeger_stores_spans_from_grpc_and_http_exporters(otel_bins, tmp_path):
    (tmp_path / "jaeger.yaml").write_text(JAEGER_YAML)
    env = jaeger_env()
    query = f"http://{env['J_QUERY_HTTP']}"
    jaeger = start_jaeger(tmp_path / "jaeger.yaml", env, log_dir=tmp_path,
                          ready_url=f"http://{env['J_HEALTH']}/status")
    try:
        assert json.loads(wait_http(f"http://{env['J_HEALTH']}/status"))["healthy"] is True
        wait_http(f"{query}/api/services", timeout=10)
        via_grpc = send_trace(grpc_exporter(port_of(env["J_OTLP_GRPC"])), "smoke-grpc", "g")
        via_http = send_trace(http_exporter(port_of(env["J_OTLP_HTTP"])), "smoke-http", "h")

        assert poll(lambda: via_grpc in jaeger_trace_ids(query, "smoke-grpc")), jaeger.log_tail()
        assert poll(lambda: via_http in jaeger_trace_ids(query, "smoke-http")), jaeger.log_tail()
        services = get_json(f"{query}/api/services")["data"]
        assert {"smoke-grpc", "smoke-http"} <= set(services)

        # Each span is exported when it ends (the child first): a trace is
        # found as soon as one of its spans is stored, so wait for both.
        def v1_names() -> list[str]:
            trace = get_json(f"{query}/api/traces/{via_grpc}")["data"][0]
            return sorted(s["operationName"] for s in trace["spans"])

        assert poll(lambda: v1_names() == ["g", "g.child"]), v1_names()
        # The v3 API (OTLP JSON); query.num_traces is required with memory storage.
        q = urllib.parse.urlencode({
            "query.service_name": "smoke-http", "query.num_traces": "20",
            "query.start_time_min": "2000-01-01T00:00:00Z",
            "query.start_time_max": "2100-01-01T00:00:00Z"})

        def v3_names() -> set[str]:
            v3 = get_json(f"{query}/api/v3/traces?{q}")
            return {s["name"] for rs in v3["result"]["resourceSpans"]
                    for ss in rs["scopeSpans"] for s in ss["spans"]}

        assert poll(lambda: v3_names() == {"h", "h.child"}), v3_names()
        assert json.loads(wait_http(f"{query}/api/v3/services"))["services"]
        # Without UI assets the UI route still answers (a placeholder page).
        assert http_get(f"{query}/")[0] == 200
    finally:
        assert jaeger.stop() == 0, jaeger.log_tail()
    assert not jaeger.alive()


@pytest.fixture(scope="module")
def pipeline(otel_bins, tmp_path_factory):
    """Jaeger + the Collector (every component) + an OTLP/HTTP sink, fed once."""
    tmp = tmp_path_factory.mktemp("otelcol")
    (tmp / "jaeger.yaml").write_text(JAEGER_YAML)
    (tmp / "otelcol.yaml").write_text(COLLECTOR_YAML)
    jenv = jaeger_env()
    servers = []
    with HttpReceiver() as sink:
        try:
            servers.append(start_jaeger(tmp / "jaeger.yaml", jenv, log_dir=tmp,
                                        ready_url=f"http://{jenv['J_HEALTH']}/status"))
            cenv = {
                "C_HEALTH": f"127.0.0.1:{free_port()}",
                "C_OTLP_GRPC": f"127.0.0.1:{free_port()}",
                "C_OTLP_HTTP": f"127.0.0.1:{free_port()}",
                "C_PROM": f"127.0.0.1:{free_port()}",
                "C_TELEMETRY_PORT": str(free_port()),
                "JAEGER_OTLP_GRPC": jenv["J_OTLP_GRPC"],
                "SINK_OTLP_HTTP": sink.endpoint,
            }
            validate_collector_config(tmp / "otelcol.yaml", cenv)
            collector = start_collector(tmp / "otelcol.yaml", cenv, log_dir=tmp,
                                        ready_url=f"http://{cenv['C_HEALTH']}/")
            servers.append(collector)
            grpc_port, http_port = port_of(cenv["C_OTLP_GRPC"]), port_of(cenv["C_OTLP_HTTP"])
            # Dropped by tail sampling first, so its decision precedes the kept ones'.
            ids = {"dropped": send_trace(grpc_exporter(grpc_port), "smoke-col", "dropped")}
            ids["kept"] = send_trace(grpc_exporter(grpc_port), "smoke-col", "kept", keep=True)
            ids["error"] = send_trace(http_exporter(http_port), "smoke-col", "failed",
                                      error=True)
            yield {"collector": collector, "jaeger_query": f"http://{jenv['J_QUERY_HTTP']}",
                   "sink": sink, "env": cenv, "ids": ids}
        finally:
            for server in reversed(servers):
                server.stop()


def test_collector_tail_samples_into_jaeger_and_otlp_http(pipeline):
    ids, query, sink = pipeline["ids"], pipeline["jaeger_query"], pipeline["sink"]
    want = {ids["kept"], ids["error"]}
    found = poll(lambda: want <= jaeger_trace_ids(query, "smoke-col"))
    assert found, (jaeger_trace_ids(query, "smoke-col"), pipeline["collector"].log_tail())
    assert poll(lambda: want <= {s.trace_id for s in sink.store.spans})
    # The dropped trace was sent first: its decision came no later than the
    # kept ones', which have arrived (the fixture's order; no sleep needed).
    assert ids["dropped"] not in jaeger_trace_ids(query, "smoke-col")
    assert ids["dropped"] not in {s.trace_id for s in sink.store.spans}

    # attributes and transform processors ran before the exporters.
    trace = get_json(f"{query}/api/traces/{ids['kept']}")["data"][0]
    for span in trace["spans"]:
        tags = {t["key"]: t["value"] for t in span["tags"]}
        assert tags["smoke.pipeline"] == "collector"
        assert tags["smoke.transformed"] is True
    # debug exporter (verbosity: detailed) wrote the sampled spans to the log.
    assert poll(lambda: "Name           : kept.child" in pipeline["collector"].log_text())


def test_collector_span_metrics_on_prometheus_exporter(pipeline):
    prom = f"http://{pipeline['env']['C_PROM']}/metrics"

    def scrape() -> str:
        text = http_get(prom)[1].decode()
        return text if 'span_name="failed"' in text else ""

    text = poll(scrape)
    assert text, http_get(prom)[1].decode()[-2000:]
    # Before sampling: the dropped trace is counted too. Suffixes _total and the
    # unit (_milliseconds) are added by default.
    calls = re.findall(r'^traces_span_metrics_calls_total\{(.*)\} (\S+)$', text, re.M)
    by_name = {re.search(r'span_name="([^"]+)"', labels).group(1): (labels, float(v))
               for labels, v in calls}
    assert {"dropped", "kept", "failed", "kept.child"} <= set(by_name)
    assert 'status_code="STATUS_CODE_ERROR"' in by_name["failed"][0]
    assert 'service_name="smoke-col"' in by_name["kept"][0]
    assert by_name["kept"][1] == 1.0
    assert re.search(r'^traces_span_metrics_duration_milliseconds_bucket\{.*le="\+Inf"\} 1$',
                     text, re.M)
    # The Collector's own metrics, on the port set under service.telemetry.
    # (no _total suffix there: this release's internal-metrics reader defaults.)
    own = http_get(f"http://127.0.0.1:{pipeline['env']['C_TELEMETRY_PORT']}/metrics")[1]
    accepted = re.findall(r"^otelcol_receiver_accepted_spans\{(.*)\} (\S+)$", own.decode(), re.M)
    assert sum(float(v) for _labels, v in accepted) == 6, own.decode()[-3000:]


def test_prometheus_scrapes_span_metrics(pipeline, tmp_path):
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: otelcol\n    static_configs:\n"
        f"      - targets: ['{pipeline['env']['C_PROM']}']\n")
    with start_prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", port,
                          log_dir=tmp_path):
        q = urllib.parse.urlencode({"query": 'traces_span_metrics_calls_total{span_name="kept"}'})

        def result():
            return get_json(f"http://127.0.0.1:{port}/api/v1/query?{q}")["data"]["result"]

        rows = poll(result, timeout=30)
        assert rows and float(rows[0]["value"][1]) == 1.0


def test_prometheus_runs_the_shipped_config_with_the_compose_flags(prom_bins, tmp_path):
    """deploy/prometheus.yml and alerts.yml under the built Prometheus, started
    with docker-compose.yml's command line (its config and storage paths aside):
    every flag is known, every shipped rule loads, and the server reports the
    release compose ships."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = [str(a) for a in compose["services"]["prometheus"]["command"]]
    flags = [a for a in command if not a.startswith(("--config.file=", "--storage.tsdb.path="))]
    assert "--enable-feature=exemplar-storage" in flags, command
    for name in ("prometheus.yml", "alerts.yml"):
        (tmp_path / name).write_text((DEPLOY / name).read_text())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with start_prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", port, args=flags,
                          log_dir=tmp_path) as prom:
        build = get_json(f"{base}/api/v1/status/buildinfo")["data"]
        assert build["version"] == compose_image_tag("prometheus").removeprefix("v"), build
        features = get_json(f"{base}/api/v1/status/flags")["data"]["enable-feature"]
        assert "exemplar-storage" in features.split(","), features
        loaded = {(g["name"], r["name"]) for g in
                  get_json(f"{base}/api/v1/rules")["data"]["groups"] for r in g["rules"]}
        shipped = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
        assert loaded == {(g["name"], r.get("alert") or r.get("record"))
                          for g in shipped for r in g["rules"]}
        log = prom.log_text()
    assert "Unknown option" not in log and "level=ERROR" not in log, log[-3000:]


@pytest.mark.parametrize("name,binary", [("otel-collector.yaml", "otelcol"),
                                         ("otel-agent.yaml", "otelcol"),
                                         ("jaeger.yaml", "jaeger"),
                                         ("jaeger-badger.yaml", "jaeger")])
def test_deploy_configs_validate_with_the_built_binaries(otel_bins, name, binary):
    validate_collector_config(DEPLOY / name, {}, binary=binary)


def test_server_ports_are_never_ones_an_outgoing_connection_can_take():
    # An outgoing connection's local port comes from the ephemeral range; a
    # server port picked there can be taken between picking and binding.
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < floor for p in ports), (floor, sorted(ports)[-3:])
