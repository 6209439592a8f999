"""The real observability stack of the end-to-end tests, on loopback: the
Go-built Collector with deploy/otel-collector.yaml, Jaeger v2 with
deploy/jaeger.yaml, Prometheus 3.5.0 (Go-built too: the release
docker-compose.yml ships) with deploy/prometheus.yml and alerts.yml. Only
ports and storage are parametrised. Tempo cannot run here (its code is AGPL
and not built): its OTLP intake is played by an in-process OTLP receiver,
labelled as such. The ``stack`` fixture (conftest) starts one per test module.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from otel_servers import free_port, get_json, start_collector, start_jaeger, start_prometheus
from otlp_receiver import GrpcReceiver

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY.parent / "docker-compose.yml"


def compose_prometheus_flags() -> list[str]:
    """The flags docker-compose.yml gives Prometheus (exemplar storage...),
    but its paths: the stack runs the Prometheus users get."""
    import yaml

    command = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["command"]
    return [c for c in command if not c.startswith(("--config.file", "--storage.tsdb.path"))]


def jaeger_env(p: Mapping[str, int]) -> dict[str, str]:
    """deploy/jaeger.yaml's (and jaeger-badger.yaml's) listen addresses on
    loopback, from ports named j_grpc, j_http, j_query, j_query_grpc,
    j_health, j_metrics."""
    return {
        "JAEGER_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{p['j_grpc']}",
        "JAEGER_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{p['j_http']}",
        "JAEGER_QUERY_HTTP_ENDPOINT": f"127.0.0.1:{p['j_query']}",
        "JAEGER_QUERY_GRPC_ENDPOINT": f"127.0.0.1:{p['j_query_grpc']}",
        "JAEGER_HEALTH_ENDPOINT": f"127.0.0.1:{p['j_health']}",
        "JAEGER_METRICS_HOST": "127.0.0.1",
        "JAEGER_METRICS_PORT": str(p["j_metrics"]),
    }


def collector_listen_env(p: Mapping[str, int]) -> dict[str, str]:
    """Where a Collector with deploy/otel-collector.yaml or otel-agent.yaml
    listens, on loopback, from ports named otlp_grpc, otlp_http,
    prom_exporter, telemetry, health."""
    return {
        "KVOBS_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{p['otlp_grpc']}",
        "KVOBS_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{p['otlp_http']}",
        "KVOBS_PROMETHEUS_EXPORTER_ENDPOINT": f"127.0.0.1:{p['prom_exporter']}",
        "KVOBS_COLLECTOR_TELEMETRY_HOST": "127.0.0.1",
        "KVOBS_COLLECTOR_TELEMETRY_PORT": str(p["telemetry"]),
        "KVOBS_COLLECTOR_HEALTH_ENDPOINT": f"127.0.0.1:{p['health']}",
    }


def gateway_env(p: Mapping[str, int], *, jaeger_grpc: int, tempo_port: int) -> dict[str, str]:
    """deploy/otel-collector.yaml on loopback, exporting to Jaeger's OTLP
    gRPC port and to the Tempo stand-in."""
    return {
        **collector_listen_env(p),
        "KVOBS_JAEGER_OTLP_ENDPOINT": f"127.0.0.1:{jaeger_grpc}",
        "KVOBS_TEMPO_OTLP_ENDPOINT": f"127.0.0.1:{tempo_port}",
        # Only timing differs from the shipped default (30 s): keep the test short.
        "KVOBS_TAIL_DECISION_WAIT": "5s",
    }


def collector_metric(telemetry_port: int, name: str, **labels: str) -> float:
    """Sum of one of a Collector's own metrics (its telemetry endpoint)."""
    from kvobs_otel.tools.harness.server import sum_samples

    text = urllib.request.urlopen(
        f"http://127.0.0.1:{telemetry_port}/metrics", timeout=5).read().decode()
    return sum_samples(text, name, **labels)


def jaeger_traces(jaeger_url: str, **params: str) -> list[dict]:
    """Jaeger's /api/traces for kvobs-otel's service (``params`` add to or
    override the query)."""
    q = urllib.parse.urlencode({"service": "kvobs-otel", "limit": "1000",
                                "lookback": "1h", **params})
    return get_json(f"{jaeger_url}/api/traces?{q}").get("data") or []


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.ports = {k: free_port() for k in (
            "otlp_grpc", "otlp_http", "prom_exporter", "telemetry", "health",
            "j_grpc", "j_http", "j_query", "j_query_grpc", "j_health", "j_metrics", "prometheus")}
        p = self.ports
        self.tempo = GrpcReceiver()  # stand-in for Tempo's OTLP intake
        self.tempo.__enter__()
        self.jaeger = start_jaeger(DEPLOY / "jaeger.yaml", jaeger_env(p),
                                   ready_url=f"http://127.0.0.1:{p['j_query']}/api/services")
        self.collector = start_collector(DEPLOY / "otel-collector.yaml", gateway_env(
            p, jaeger_grpc=p["j_grpc"], tempo_port=self.tempo.port),
            ready_url=f"http://127.0.0.1:{p['health']}/")
        # The shipped prometheus.yml and alerts.yml, with the Collector's
        # compose address replaced by this test's loopback ports.
        text = (DEPLOY / "prometheus.yml").read_text()
        text = text.replace("otel-collector:8889", f"127.0.0.1:{p['prom_exporter']}")
        text = text.replace("otel-collector:8888", f"127.0.0.1:{p['telemetry']}")
        (tmp / "prometheus.yml").write_text(text)
        (tmp / "alerts.yml").write_text((DEPLOY / "alerts.yml").read_text())
        self.prometheus = start_prometheus(tmp / "prometheus.yml", tmp / "tsdb", p["prometheus"],
                                           args=compose_prometheus_flags())
        self.jaeger_url = f"http://127.0.0.1:{p['j_query']}"
        self.prom_url = f"http://127.0.0.1:{p['prometheus']}"

    def close(self) -> None:
        for server in (self.prometheus, self.collector, self.jaeger):
            server.stop()
        self.tempo.__exit__()

    # -- queries ----------------------------------------------------------------
    def traces(self, **params: str) -> list[dict]:
        return jaeger_traces(self.jaeger_url, **params)

    def promql(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        return get_json(f"{self.prom_url}/api/v1/query?{q}")["data"]["result"]

    def firing(self, alert: str) -> list[dict]:
        return [a for a in get_json(f"{self.prom_url}/api/v1/alerts")["data"]["alerts"]
                if a["labels"]["alertname"] == alert and a["state"] == "firing"]

    def collector_accepted_spans(self) -> float:
        """The Collector's own count of spans its OTLP receiver accepted."""
        return collector_metric(self.ports["telemetry"], "otelcol_receiver_accepted_spans",
                                receiver="otlp")


def tag(span_or_process: dict, key: str):
    for t in span_or_process.get("tags", []):
        if t["key"] == key:
            return t["value"]
    return None


def ranks_of(trace: dict, operation: str) -> set[int]:
    """Ranks (from the process resource) of the spans of one operation."""
    return {tag(trace["processes"][s["processID"]], "kvobs.rank") for s in trace["spans"]
            if s["operationName"] == operation}
