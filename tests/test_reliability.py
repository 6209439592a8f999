"""A Collector that is absent, slow, or killed and restarted; rank processes
started by fork and by spawn, stopped by SIGTERM: vLLM runs on, memory stays
bounded, every span is either delivered once or counted as lost, and what
each process says it sent is what the Collector received.

Real parts: the real-vLLM CPU harness, the real OTLP/HTTP exporters, and the
Collector built by .ci/otel-bins (forwarding to an in-process receiver that
counts what arrived).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from oracle import assert_traces_match_vllm

import kvobs_otel
from kvobs_otel.config import Settings
from kvobs_otel.identity import RequestIdHasher
from kvobs_otel.pipeline import CLOSE_TIMEOUT_S, METRICS_CLOSE_TIMEOUT_S, current_pipeline
from kvobs_otel.telemetry import export
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.workload import pressure_workload

from otel_servers import free_port, start_collector, wait_for
from otlp_receiver import HttpReceiver, latest_total, metric_values, received_ids

pytestmark = pytest.mark.vllm

KEY = b"reliability-test-key-0123456789"
# In-process where a test looks inside the export stage (its queue, its
# counts); the sidecar's own failures are tests/test_sidecar.py's.
SETTINGS = Settings(enabled=True, receipt_deadline_s=1.0, drain_interval_s=0.02,
                    export="in-process")
# What the README promises for closing (spans, then the process's counts),
# whatever the exporter's own timeout; plus slack for a busy machine.
CLOSE_BOUND_S = CLOSE_TIMEOUT_S + METRICS_CLOSE_TIMEOUT_S + 2.0


@pytest.fixture
def stats(monkeypatch) -> export.ExportStats:
    fresh = export.ExportStats()
    monkeypatch.setattr(export, "STATS", fresh)
    return fresh


def otlp_env(monkeypatch, endpoint: str, **extra: str) -> dict[str, str]:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "300",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1", **extra}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def built_spans() -> int:
    return sum(o.spans.spans_built for o in current_pipeline().observers)


def run_workload(h: Harness, prefix: str, n: int | None = None) -> None:
    pressure_workload(h, prefix=prefix, num_requests=n)
    h.run_until_idle(2000)


def test_collector_absent_for_the_whole_run(monkeypatch, stats, caplog):
    otlp_env(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nobody listens
    assert kvobs_otel.instrument(SETTINGS)
    with caplog.at_level(logging.WARNING, logger="kvobs_otel"), \
            Harness(HarnessConfig(num_ranks=2)) as h:
        run_workload(h, "absent")
        current_pipeline().flush()
        built = built_spans()
        t0 = time.monotonic()
        kvobs_otel.uninstrument()
        closing = time.monotonic() - t0
    sent, dropped, errors = stats.snapshot()
    assert built > 20 and sent == 0
    # Every span is accounted for: lost, and counted as lost.
    assert dropped["export_failed"] + dropped["export_shutdown"] + dropped[
        "export_queue_full"] == built
    assert dropped["metric_export_failed"] > 0 and errors["metric_export"] == 0
    lines = [r.getMessage() for r in caplog.records]
    # One line per kind of loss as it starts, and one with the totals at the end.
    (final,) = [m for m in lines if f"observations dropped in process {os.getpid()}" in m]
    assert f"export_failed={dropped['export_failed']}" in final, final
    lines.remove(final)
    assert sum("not delivered (export_failed)" in m for m in lines) == 1
    assert sum("metric_export_failed" in m for m in lines) == 1
    assert not [r for r in caplog.records if r.exc_info]  # a dead endpoint is no bug
    assert closing < CLOSE_BOUND_S, closing  # shutdown stays bounded


class SilentServer:
    """Accepts TCP connections and never answers (a hung Collector)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_slow_collector_never_answers(monkeypatch, stats):
    silent = SilentServer()
    # The exporter's own timeout is its default (10 s), longer than the whole
    # close may take: the bound must come from kvobs-otel, not from it.
    otlp_env(monkeypatch, f"http://127.0.0.1:{silent.port}",
             OTEL_BSP_MAX_QUEUE_SIZE="16", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="4",
             OTEL_EXPORTER_OTLP_TIMEOUT="10")
    try:
        assert kvobs_otel.instrument(SETTINGS)
        with Harness(HarnessConfig(num_ranks=2)) as h:
            run_workload(h, "slow")
            steps = len(h.outputs)
            current_pipeline().flush()
            built = built_spans()
            # Bounded memory: the export queue never exceeds its bound.
            for o in current_pipeline().observers:
                for p in o.providers.tracer_provider._active_span_processor._span_processors:
                    assert len(p._queue) <= 16
            t0 = time.monotonic()
            kvobs_otel.uninstrument()
            closing = time.monotonic() - t0
    finally:
        silent.close()
    sent, dropped, _ = stats.snapshot()
    assert steps > 0 and silent.conns  # vLLM ran; the exporter did connect
    dropped.pop("metric_export_failed")
    assert sent == 0 and sum(dropped.values()) == built
    assert dropped["export_queue_full"] > 0  # the queue bound held under pressure
    assert closing < CLOSE_BOUND_S, closing


COLLECTOR = """
extensions:
  health_check: {{endpoint: "127.0.0.1:{health}"}}
receivers:
  otlp:
    protocols:
      http: {{endpoint: "127.0.0.1:{port}"}}
exporters:
  otlphttp:
    endpoint: "{downstream}"
    compression: none
service:
  extensions: [health_check]
  telemetry:
    metrics: {{level: none}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [otlphttp]}}
    metrics: {{receivers: [otlp], exporters: [otlphttp]}}
"""


def collector(tmp_path: Path, port: int, downstream: str):
    health = free_port()
    cfg = tmp_path / f"collector-{port}-{health}.yaml"
    cfg.write_text(COLLECTOR.format(port=port, health=health, downstream=downstream))
    return start_collector(cfg, ready_url=f"http://127.0.0.1:{health}/")


def test_collector_killed_and_restarted_mid_run(monkeypatch, stats, tmp_path):
    with HttpReceiver() as rx:
        port = free_port()
        otlp_env(monkeypatch, f"http://127.0.0.1:{port}")
        col = collector(tmp_path, port, rx.endpoint)
        assert kvobs_otel.instrument(SETTINGS)
        try:
            with Harness(HarnessConfig(num_ranks=2)) as h:
                run_workload(h, "before", 4)
                # Everything built so far out of the export stage too: a span
                # the Collector accepted just before it is killed dies with it.
                current_pipeline().flush()
                for o in current_pipeline().observers:
                    o.providers.tracer_provider.force_flush(10_000)
                wait_for(lambda: stats.snapshot()[0] > 0 and len(received_ids(rx))
                         == stats.snapshot()[0], "the first spans at the Collector")
                col.proc.kill()  # a crash, not a clean stop
                col.proc.wait(10)
                run_workload(h, "down", 4)
                current_pipeline().flush()
                wait_for(lambda: stats.snapshot()[1]["export_failed"] > 0,
                         "a failed export while the Collector is down")
                col = collector(tmp_path, port, rx.endpoint)
                run_workload(h, "after", 4)
            kvobs_otel.uninstrument()
            sent, dropped, _ = stats.snapshot()
            wait_for(lambda: len(received_ids(rx)) >= sent,
                     lambda: f"every delivered span ({len(received_ids(rx))} of {sent})")
            # The loss reached the Collector once it was back.
            wait_for(lambda: latest_total(rx, "kvobs.observer.dropped", reason="export_failed")
                     == dropped["export_failed"], "the loss reported through the Collector")
        finally:
            kvobs_otel.uninstrument()
            col.stop()
        ids = received_ids(rx)
    assert len(ids) == len(set(ids)) == sent  # every delivered span once, nothing twice
    assert dropped["export_failed"] > 0
    assert latest_total(rx, "kvobs.observer.exported", signal="spans") == sent
    # Spans of the requests before the crash and after the restart both
    # arrived (which kinds of span a request makes depends on how the
    # workload ran: a busy machine turns its traffic into recoveries).
    prefixes = {s.attributes.get("kvobs.request.id", "")[:5] for s in rx.store.spans}
    assert {"befor", "after"} <= prefixes, prefixes


# How a rank process ends, how it was started, and where it exports: the
# sidecar (the default) must deliver all a rank recorded even when the rank
# leaves without a word (SIGKILL, os._exit): its pipe's end is the signal.
ENDINGS = [("sigterm", "fork", "sidecar"), ("sigterm", "spawn", "sidecar"),
           ("sigkill", "fork", "sidecar"), ("os_exit", "spawn", "sidecar"),
           ("sigterm", "fork", "in-process")]


@pytest.mark.parametrize(("end", "start_method", "export_mode"), ENDINGS)
def test_rank_processes_end_sent_equals_received(
        monkeypatch, stats, tmp_path, end, start_method, export_mode):
    with HttpReceiver() as rx:
        port = free_port()
        # Every process shares the request-id key: the pseudonyms, made in each
        # process's export side, must still join the ranks' spans to the episode.
        env = otlp_env(monkeypatch, f"http://127.0.0.1:{port}", KVOBS_OTEL_ENABLED="1",
                       KVOBS_OTEL_EXPORT=export_mode, KVOBS_OTEL_REQUEST_ID_KEY=KEY.decode(),
                       OTEL_BSP_SCHEDULE_DELAY="60000")  # nothing leaves before the end
        col = collector(tmp_path, port, rx.endpoint)
        assert kvobs_otel.instrument(dataclasses.replace(SETTINGS, export=export_mode,
                                                         request_id_key=KEY))
        try:
            cfg = HarnessConfig(num_ranks=2, rank_mode="process", start_method=start_method,
                                extra_env=env)
            with Harness(cfg) as h:
                run_workload(h, "term", 3)
                pids = [r.process.pid for r in h.ranks]
                # Everything the ranks recorded handed to their export side.
                seen = [r.call("observation") for r in h.ranks]
                for r in h.ranks:
                    if end == "os_exit":
                        r.exit_now()
                    else:  # SIGTERM as the executor sends on shutdown
                        os.kill(r.process.pid, signal.SIGTERM if end == "sigterm"
                                else signal.SIGKILL)
                for r in h.ranks:
                    r.process.join(30)
                codes = [r.process.exitcode for r in h.ranks]
            kvobs_otel.uninstrument()
            # Each process reports what it delivered; the Collector passes it on.
            wait_for(lambda: len({i for i, _ in metric_values(rx, "kvobs.observer.exported")})
                     == 3 and latest_total(rx, "kvobs.observer.exported", signal="spans")
                     == len(received_ids(rx)) > 0,
                     "spans sent (the three processes' counts) == spans received")
        finally:
            kvobs_otel.uninstrument()
            col.stop()
        spans = list(rx.store.spans)
    assert codes == {"sigterm": [0, 0], "sigkill": [-9, -9], "os_exit": [0, 0]}[end]
    assert {o["export"] for o in seen} == {export_mode}
    sidecars = {o["sidecar_pid"] for o in seen}
    assert len(sidecars) == 2 and not sidecars & set(pids) if export_mode == "sidecar" \
        else sidecars == {None}
    senders = {i for i, _ in metric_values(rx, "kvobs.observer.exported")}
    assert len(senders) == 3  # the scheduler process and both ranks
    ids = [(s.trace_id, s.span_id) for s in spans]
    assert len(ids) == len(set(ids))
    workers = {(s.resource.get("process.pid"), s.resource.get("kvobs.worker.generation"))
               for s in spans if s.resource.get("kvobs.role") == "worker"}
    # Each rank exported under its own identity (its pid, not its sidecar's;
    # one worker generation each), whichever way it was started.
    assert {pid for pid, _ in workers} == set(pids)
    assert len({gen for _, gen in workers}) == 2
    # Every recovery vLLM made, complete, judged against its own record.
    assert assert_traces_match_vllm(h, spans, request_id=RequestIdHasher(KEY)) >= 1
    assert all(s.attributes["kvobs.request.id"].startswith("rid-") for s in spans
               if "kvobs.request.id" in s.attributes)
