"""Each rank in its own process, attached by the vLLM general-plugin entry
point, exporting through the real OTLP exporters (gRPC and HTTP) into an
OTLP receiver: the recovery chain must come out whole, with every process's
identity on its resource."""

from __future__ import annotations

import os

import pytest

import kvobs_otel
from kvobs_otel.plugin import register
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.workload import pressure_workload

from chains import assert_recovered_chain, episodes
from otel_servers import wait_for
from otlp_receiver import GrpcReceiver, HttpReceiver

pytestmark = pytest.mark.vllm




@pytest.mark.parametrize(("start_method", "protocol"),
                         [("spawn", "grpc"), ("fork", "http/protobuf")])
def test_rank_processes_export_recovery_chain_over_otlp(monkeypatch, start_method, protocol):
    receiver_cls = GrpcReceiver if protocol == "grpc" else HttpReceiver
    with receiver_cls() as rx:
        env = {
            "KVOBS_OTEL_ENABLED": "1",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
            "OTEL_SERVICE_NAME": "kvobs-test",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        # This process plays the engine core: vLLM runs the plugin entry point here too.
        register()
        assert kvobs_otel.is_instrumented()
        try:
            cfg = HarnessConfig(num_ranks=2, rank_mode="process", start_method=start_method,
                                extra_env=env)
            with Harness(cfg) as h:
                pressure_workload(h)
                h.run_until_idle(2000)
                rank_pids = {rank.process.pid for rank in h.ranks}
        finally:
            kvobs_otel.uninstrument()

        wait_for(lambda: {"kvobs.transfers", "kvobs.jobs"} <= rx.store.metric_names(),
                 "the ranks' metrics at the receiver", timeout=15, interval=0.1)
        spans = list(rx.store.spans)

    roles = {(s.resource.get("kvobs.role"), s.resource.get("kvobs.rank"),
              s.resource.get("process.pid")) for s in spans}
    assert ("scheduler", None, os.getpid()) in roles
    worker_pids = {pid for role, _rank, pid in roles if role == "worker"}
    assert {rank for role, rank, _ in roles if role == "worker"} == {0, 1}
    assert worker_pids == rank_pids and os.getpid() not in worker_pids
    assert {s.resource["service.name"] for s in spans} == {"kvobs-test"}
    import vllm

    assert all(s.resource["kvobs.vllm.version"] == vllm.__version__ for s in spans)

    eps = episodes(spans)
    assert eps
    for _root, trace in eps:
        assert_recovered_chain(trace, {0, 1})
        # Restores really came from the two rank processes.
        pids = {s.resource["process.pid"] for s in trace if s.name == "kv.transfer"}
        assert pids == rank_pids
    assert {"kvobs.transfers", "kvobs.transfer.bytes", "kvobs.recovery.episodes",
            "kvobs.recovery.latency"} <= rx.store.metric_names()
