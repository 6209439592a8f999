"""The two-tier Collector topology of deploy/README.md ("More than one
machine"), on loopback: two agent Collectors (deploy/otel-agent.yaml, one per
"node", each listing both gateways), two gateway Collectors (the shipped
deploy/otel-collector.yaml: tail sampling and span metrics), and Jaeger v2
with durable local storage (deploy/jaeger-badger.yaml, its Badger directory
in the test's tmp dir). Only ports, directories and the tail-sampling wait
are set; the files run unchanged. Tempo cannot run here (its code is AGPL
and not built): the gateways' Tempo exporter sends to an in-process OTLP
receiver, a stand-in for Tempo's intake, labelled as such.

Any one server can be stopped and started again on the same ports (Jaeger
on the same Badger directory): ``stop(name)``, ``start(name)``,
``restart(name)``; names are ``jaeger``, ``gateway-0``, ``gateway-1``,
``agent-a``, ``agent-b``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from otel_servers import Server, free_port, http_get, start_collector, start_jaeger
from otlp_receiver import GrpcReceiver
from stack import DEPLOY, collector_listen_env, collector_metric, gateway_env, jaeger_env

AGENTS = ("agent-a", "agent-b")
GATEWAYS = ("gateway-0", "gateway-1")
COLLECTOR_PORTS = ("otlp_grpc", "otlp_http", "prom_exporter", "telemetry", "health")
JAEGER_PORTS = ("j_grpc", "j_http", "j_query", "j_query_grpc", "j_health", "j_metrics")


class Topology:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.badger_dir = tmp / "badger"
        self.ports: dict[str, dict[str, int]] = {
            "jaeger": {k: free_port() for k in JAEGER_PORTS},
            **{name: {k: free_port() for k in COLLECTOR_PORTS} for name in GATEWAYS + AGENTS},
        }
        self.tempo = GrpcReceiver()  # stand-in for Tempo's OTLP intake
        self.tempo.__enter__()
        j = self.ports["jaeger"]
        self.jaeger_url = f"http://127.0.0.1:{j['j_query']}"
        gateways = ", ".join(f"127.0.0.1:{self.ports[g]['otlp_grpc']}" for g in GATEWAYS)
        self._starters: dict[str, Callable[[], Server]] = {
            "jaeger": lambda: start_jaeger(
                DEPLOY / "jaeger-badger.yaml",
                {**jaeger_env(j), "JAEGER_BADGER_DIR": str(self.badger_dir)},
                ready_url=f"{self.jaeger_url}/api/services", log_dir=tmp / "jaeger"),
            **{g: self._collector_starter(g, "otel-collector.yaml", gateway_env(
                self.ports[g], jaeger_grpc=j["j_grpc"], tempo_port=self.tempo.port))
               for g in GATEWAYS},
            # Each agent lists both gateways, in the same order (YAML flow list).
            **{a: self._collector_starter(a, "otel-agent.yaml", {
                **collector_listen_env(self.ports[a]),
                "KVOBS_GATEWAY_ENDPOINTS": f"[{gateways}]"}) for a in AGENTS},
        }
        # On top of each Collector's environment at its next start (agents_with).
        self.overrides: dict[str, dict[str, str]] = {}
        self.servers: dict[str, Server] = {}
        self.restarts: dict[str, int] = dict.fromkeys(self._starters, 0)
        try:
            for name in ("jaeger", *GATEWAYS, *AGENTS):  # downstream first
                self.start(name)
        except BaseException:
            self.close()
            raise

    def _collector_starter(self, name: str, config: str,
                           env: dict[str, str]) -> Callable[[], Server]:
        health = self.ports[name]["health"]

        def start() -> Server:
            # One log per start (the Server truncates its log file).
            log_dir = self.tmp / f"{name}-{self.restarts[name]}"
            return start_collector(DEPLOY / config, {**env, **self.overrides.get(name, {})},
                                   ready_url=f"http://127.0.0.1:{health}/", log_dir=log_dir)
        return start

    # -- lifecycle ------------------------------------------------------------------
    def start(self, name: str) -> Server:
        assert name not in self.servers, f"{name} is running"
        self.servers[name] = server = self._starters[name]()
        return server

    def stop(self, name: str, kill: bool = False) -> int | None:
        """SIGTERM (the server flushes what it can; SIGKILL after 10 s), or
        with ``kill`` SIGKILL at once: a crash."""
        server = self.servers.pop(name)
        if kill:
            server.proc.kill()
        return server.stop()

    def restart(self, name: str, down_s: float = 0.0, kill: bool = False) -> Server:
        """Stop (``kill``: crash), stay down ``down_s`` seconds, start again
        on the same ports."""
        self.stop(name, kill)
        time.sleep(down_s)
        self.restarts[name] += 1
        return self.start(name)

    @contextlib.contextmanager
    def agents_with(self, env: dict[str, str]) -> Iterator[None]:
        """Both agents restarted with ``env`` on top of their own, and
        restarted as shipped afterwards."""
        try:
            for a in AGENTS:
                self.overrides[a] = env
                self.restart(a)
            yield
        finally:
            for a in AGENTS:
                self.overrides.pop(a, None)
                if a in self.servers:
                    self.restart(a)

    def close(self) -> None:
        for name in (*AGENTS, *GATEWAYS, "jaeger"):  # upstream first
            if name in self.servers:
                with contextlib.suppress(Exception):
                    self.stop(name)
        self.tempo.__exit__()

    # -- where to send, what to ask ------------------------------------------------
    def agent_endpoint(self, agent: str, protocol: str = "http/protobuf") -> str:
        port = self.ports[agent]["otlp_grpc" if protocol == "grpc" else "otlp_http"]
        return f"http://127.0.0.1:{port}"

    def metric(self, name: str, metric: str, **labels: str) -> float:
        """One of a Collector's own metrics (``otelcol_*``)."""
        return collector_metric(self.ports[name]["telemetry"], metric, **labels)

    def exported_metric_text(self, name: str) -> str:
        """What a Collector's Prometheus exporter (:8889) exposes."""
        status, body = http_get(f"http://127.0.0.1:{self.ports[name]['prom_exporter']}/metrics")
        assert status == 200, (name, status)
        return body.decode()

    def trace(self, trace_id: str) -> dict | None:
        """One trace from Jaeger by id (hex), or None when Jaeger has none."""
        status, body = http_get(f"{self.jaeger_url}/api/traces/{trace_id}", timeout=10)
        if status == 404:
            return None
        assert status == 200, (trace_id, status, body[:300])
        (trace,) = json.loads(body)["data"]
        return trace
