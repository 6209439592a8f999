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


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.ports = {k: free_port() for k in (
            "otlp_grpc", "otlp_http", "prom_exporter", "telemetry", "health",
            "j_grpc", "j_http", "j_query", "j_query_grpc", "j_health", "j_metrics", "prometheus")}
        p = self.ports
        self.tempo = GrpcReceiver()  # stand-in for Tempo's OTLP intake
        self.tempo.__enter__()
        self.jaeger = start_jaeger(DEPLOY / "jaeger.yaml", {
            "JAEGER_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{p['j_grpc']}",
            "JAEGER_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{p['j_http']}",
            "JAEGER_QUERY_HTTP_ENDPOINT": f"127.0.0.1:{p['j_query']}",
            "JAEGER_QUERY_GRPC_ENDPOINT": f"127.0.0.1:{p['j_query_grpc']}",
            "JAEGER_HEALTH_ENDPOINT": f"127.0.0.1:{p['j_health']}",
            "JAEGER_METRICS_HOST": "127.0.0.1",
            "JAEGER_METRICS_PORT": str(p["j_metrics"]),
        }, ready_url=f"http://127.0.0.1:{p['j_query']}/api/services")
        self.collector = start_collector(DEPLOY / "otel-collector.yaml", {
            "KVOBS_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{p['otlp_grpc']}",
            "KVOBS_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{p['otlp_http']}",
            "KVOBS_JAEGER_OTLP_ENDPOINT": f"127.0.0.1:{p['j_grpc']}",
            "KVOBS_TEMPO_OTLP_ENDPOINT": f"127.0.0.1:{self.tempo.port}",
            "KVOBS_PROMETHEUS_EXPORTER_ENDPOINT": f"127.0.0.1:{p['prom_exporter']}",
            "KVOBS_COLLECTOR_TELEMETRY_HOST": "127.0.0.1",
            "KVOBS_COLLECTOR_TELEMETRY_PORT": str(p["telemetry"]),
            "KVOBS_COLLECTOR_HEALTH_ENDPOINT": f"127.0.0.1:{p['health']}",
            # Only timing differs from the shipped default (30 s): keep the test short.
            "KVOBS_TAIL_DECISION_WAIT": "5s",
        }, ready_url=f"http://127.0.0.1:{p['health']}/")
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
        q = urllib.parse.urlencode({"service": "kvobs-otel", "limit": "1000",
                                    "lookback": "1h", **params})
        return get_json(f"{self.jaeger_url}/api/traces?{q}").get("data") or []

    def promql(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        return get_json(f"{self.prom_url}/api/v1/query?{q}")["data"]["result"]

    def firing(self, alert: str) -> list[dict]:
        return [a for a in get_json(f"{self.prom_url}/api/v1/alerts")["data"]["alerts"]
                if a["labels"]["alertname"] == alert and a["state"] == "firing"]

    def collector_accepted_spans(self) -> float:
        """The Collector's own count of spans its OTLP receiver accepted."""
        from kvobs_otel.harness.server import sum_samples

        text = urllib.request.urlopen(
            f"http://127.0.0.1:{self.ports['telemetry']}/metrics", timeout=5).read().decode()
        return sum_samples(text, "otelcol_receiver_accepted_spans", receiver="otlp")


def tag(span_or_process: dict, key: str):
    for t in span_or_process.get("tags", []):
        if t["key"] == key:
            return t["value"]
    return None


def ranks_of(trace: dict, operation: str) -> set[int]:
    """Ranks (from the process resource) of the spans of one operation."""
    return {tag(trace["processes"][s["processID"]], "kvobs.rank") for s in trace["spans"]
            if s["operationName"] == operation}
