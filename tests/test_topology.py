"""The two-tier topology of deploy/README.md ("More than one machine") run
for real on loopback (tests/topology.py): two agent Collectors
(deploy/otel-agent.yaml, one per "node"), two gateway Collectors (the shipped
deploy/otel-collector.yaml), Jaeger v2 on Badger (deploy/jaeger-badger.yaml).

The real-vLLM harness plays two nodes: the scheduler (this process) and rank
0 export to agent A as node-a, rank 1 exports to agent B as node-b, so every
recovery episode leaves through both agents. Each process also writes every
span it exports to its own OTLP JSON file (KVOBS_OTEL_TRACES_FILE): the
record of what was sent, against which Jaeger's contents are judged trace by
trace (whole, partial, absent). vLLM's own record of what it did
(tests/oracle.py) judges the episodes themselves.

Figures (episodes sent, kept whole, dropped whole, split, lost) are printed
(run with -s to see them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from oracle import assert_traces_match_vllm
from topology import AGENTS, DEPLOY, GATEWAYS, Topology

import kvobs_otel
from kvobs_otel.tools.check import check_spans
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.workload import PromptSpec, pressure_workload
from kvobs_otel.tools.otlp_file import FileSpan, read_spans
from kvobs_otel.tools.sources import jaeger_spans, load_spans

from conftest import run_cli
from otel_servers import poll, wait_for

# Where each process of the harness sends: the scheduler and rank 0 on node a,
# rank 1 on node b (its own agent, its own host.name).
NODE_OF = {"scheduler": "agent-a", 0: "agent-a", 1: "agent-b"}
RECEIPT_DEADLINE_S = 1.0
# A gateway's count of the traces it decided on (label sampled: kept or not).
DECIDED = "otelcol_processor_tail_sampling_global_count_traces_sampled"


@pytest.fixture(scope="module")
def topo(tmp_path_factory) -> Iterator[Topology]:
    t = Topology(tmp_path_factory.mktemp("topology"))
    try:
        yield t
    finally:
        t.close()


# -- what was sent ---------------------------------------------------------------
@dataclasses.dataclass
class SentTrace:
    trace_id: str
    spans: dict[str, FileSpan]  # span id -> span

    @property
    def episode(self) -> bool:
        """A recovery episode's trace (its spans carry the epoch)."""
        return any("kvobs.recovery.epoch" in s.attributes for s in self.spans.values())

    @property
    def error(self) -> bool:
        return any(s.error for s in self.spans.values())

    @property
    def root(self) -> FileSpan | None:
        return next((s for s in self.spans.values() if s.name == "kv.recovery"), None)


def traffic_policy_keeps(trace_id: str) -> bool:
    """The shipped gateway's probabilistic ``traffic`` policy for one trace,
    computed as the tail sampler (v0.161, no tracestate) does: FNV-1a 64 of
    its default salt and the trace id's bytes, kept at or below
    percentage/100 x (2^64 - 1). The same on every gateway, so a trace's
    fate does not depend on which gateway holds which of its spans."""
    import yaml

    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    (policy,) = [p for p in config["processors"]["tail_sampling"]["policies"]
                 if p["name"] == "traffic"]
    assert "hash_salt" not in policy["probabilistic"]
    percentage = Fraction(str(policy["probabilistic"]["sampling_percentage"]))
    h = 0xCBF29CE484222325
    for byte in b"default-hash-seed" + bytes.fromhex(trace_id.rjust(32, "0")):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h <= int((2**64 - 1) * percentage / 100)


def _key(trace_id: str, span_id: str) -> tuple[str, str]:
    # Jaeger drops leading zeros of ids.
    return trace_id.rjust(32, "0"), span_id.rjust(16, "0")


def sent_traces(files: list[Path]) -> dict[str, SentTrace]:
    out: dict[str, SentTrace] = {}
    for path in files:
        for s in read_spans(str(path)):
            tid, sid = _key(s.trace_id, s.span_id)
            out.setdefault(tid, SentTrace(tid, {})).spans[sid] = s
    return out


@dataclasses.dataclass
class Run:
    """One harness run through the topology, and what it sent."""

    harness: Harness
    specs: list[PromptSpec]
    files: dict[str | int, Path]  # process ("scheduler", rank) -> its spans file
    sent: dict[str, SentTrace] = dataclasses.field(default_factory=dict)
    observations: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def spans_of(self, process: str | int) -> int:
        return sum(1 for _ in read_spans(str(self.files[process])))


def run_through(topo: Topology, tmp: Path, name: str,
                body: Callable[[Harness], list[PromptSpec]], *,
                stall: dict[str, Any] | None = None, extra: dict[str, str] | None = None) -> Run:
    """Run ``body`` on a 2-rank harness (rank processes, observation on)
    whose processes export as two nodes; returns the run and what it sent."""
    files: dict[str | int, Path] = {p: tmp / f"{name}-{p}.jsonl" for p in NODE_OF}

    def process_env(p: str | int) -> dict[str, str]:
        node = NODE_OF[p]
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": topo.agent_endpoint(node),
                "OTEL_RESOURCE_ATTRIBUTES": f"host.name=node-{node[-1]}",
                "KVOBS_OTEL_TRACES_FILE": str(files[p])}

    env = {
        "KVOBS_OTEL_ENABLED": "1",
        "KVOBS_OTEL_RECEIPT_DEADLINE_S": str(RECEIPT_DEADLINE_S),
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        **process_env("scheduler"), **(extra or {}),
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert kvobs_otel.instrument()
        try:
            cfg = HarnessConfig(num_ranks=2, rank_mode="process", start_method="fork",
                                extra_env=env, rank_env={r: process_env(r) for r in (0, 1)},
                                stall=stall)
            with Harness(cfg) as h:
                specs = body(h)
                observations = [r.call("observation") for r in h.ranks]
        finally:
            kvobs_otel.uninstrument()
    run = Run(h, specs, files, observations=observations)
    run.sent = sent_traces(list(files.values()))
    return run


def run_until_idle(h: Harness, within_s: float = 180.0) -> None:
    """Step until no request is left. Bounded by wall time, not steps: a
    withheld restore keeps vLLM's loop stepping (idle steps) until it comes."""
    until = time.monotonic() + within_s
    while h.has_work():
        assert time.monotonic() < until, f"the harness still had work after {within_s:g} s"
        h.step()


def workload(prefix: str, rounds: int, num_requests: int = 8) -> Callable[[Harness],
                                                                          list[PromptSpec]]:
    """``rounds`` pressure workloads one after the other (each preempts and
    restores), run until idle."""
    def body(h: Harness) -> list[PromptSpec]:
        specs = []
        for i in range(rounds):
            specs += pressure_workload(h, prefix=f"{prefix}{i}-", num_requests=num_requests)
            run_until_idle(h)
        return specs
    return body


# -- what arrived ----------------------------------------------------------------
def decided(topo: Topology, gateway: str, **sampled: str) -> float:
    return topo.metric(gateway, DECIDED, **sampled)


def jaeger_span_ids(trace: dict | None) -> set[str]:
    if trace is None:
        return set()
    return {_key(s["traceID"], s["spanID"])[1] for s in trace["spans"]}


@dataclasses.dataclass
class Verdict:
    whole: list[str] = dataclasses.field(default_factory=list)
    partial: list[str] = dataclasses.field(default_factory=list)
    absent: list[str] = dataclasses.field(default_factory=list)
    foreign: list[str] = dataclasses.field(default_factory=list)  # spans nobody sent


def judge(topo: Topology, traces: dict[str, SentTrace]) -> tuple[Verdict, dict[str, dict]]:
    """Each sent trace against Jaeger's copy of it."""
    v = Verdict()
    stored: dict[str, dict] = {}
    for tid, sent in traces.items():
        got = topo.trace(tid)
        ids = jaeger_span_ids(got)
        if got is not None:
            stored[tid] = got
        v.foreign += [f"{tid}/{sid}" for sid in ids - set(sent.spans)]
        if not ids:
            v.absent.append(tid)
        elif ids == set(sent.spans):
            v.whole.append(tid)
        else:
            v.partial.append(tid)
    return v, stored


def settle(topo: Topology, before: dict[str, float], traces: dict[str, SentTrace],
           timeout: float = 90) -> None:
    """Wait until the gateways decided on as many traces as were sent, and
    Jaeger holds every episode trace with all its spans (or time ran out;
    the assertions then say what is missing)."""
    poll(lambda: sum(decided(topo, g) - before[g] for g in GATEWAYS) >= len(traces),
         timeout=timeout, interval=1.0)
    keep = [t for t in traces.values() if t.episode or t.error]
    poll(lambda: all(jaeger_span_ids(topo.trace(t.trace_id)) >= set(t.spans) for t in keep),
         timeout=30, interval=1.0)


def figures(label: str, traces: dict[str, SentTrace], v: Verdict) -> dict[str, int]:
    eps = {t for t, s in traces.items() if s.episode}
    traffic = set(traces) - eps
    keeps = {t for t in traffic if traffic_policy_keeps(t)}
    out = {
        "episodes sent": len(eps),
        "episodes kept whole": len(eps & set(v.whole)),
        "episodes split (partial in Jaeger)": len(eps & set(v.partial)),
        "episodes lost": len(eps & set(v.absent)),
        "error episodes sent": sum(s.episode and s.error for s in traces.values()),
        "traffic traces sent": len(traffic),
        "traffic kept whole": len(traffic & set(v.whole)),
        "traffic dropped whole (policy)": len((traffic - keeps) & set(v.absent)),
        "traffic split": len(traffic & set(v.partial)),
        "traffic lost (policy keeps, absent)": len(keeps & set(v.absent)),
    }
    print(f"\n[topology] {label}: " + ", ".join(f"{k} {n}" for k, n in out.items()), flush=True)
    return out


# -- the main run: clean episodes, then episodes whose receipt stays incomplete --
@dataclasses.dataclass
class Main:
    clean: Run
    withheld: Run
    traces: dict[str, SentTrace]
    verdict: Verdict
    stored: dict[str, dict]
    decided: dict[str, float]
    kept: dict[str, float]
    accepted: dict[str, float]
    jaeger_url: str


@pytest.fixture(scope="module")
def main(topo: Topology, tmp_path_factory) -> Main:
    tmp = tmp_path_factory.mktemp("main-run")
    before = {g: decided(topo, g) for g in GATEWAYS}
    kept_before = {g: decided(topo, g, sampled="true") for g in GATEWAYS}
    accepted_before = {n: topo.metric(n, "otelcol_receiver_accepted_spans", receiver="otlp")
                       for n in GATEWAYS + AGENTS}
    t0 = time.monotonic()
    clean = run_through(topo, tmp, "clean", workload("c", rounds=3))
    # Rank 1 reports each restore 3 s late, past the 1 s receipt deadline:
    # those episodes end as ERROR (receipt incomplete), then vLLM finishes.
    withheld = run_through(topo, tmp, "withheld", workload("w", rounds=2),
                           stall={"rank": 1, "kind": "load", "release_after_s": 3.0})
    print(f"\n[topology] harness runs took {time.monotonic() - t0:.1f} s", flush=True)
    traces = {**clean.sent, **withheld.sent}
    t0 = time.monotonic()
    settle(topo, before, traces)
    verdict, stored = judge(topo, traces)
    print(f"[topology] decided and stored after {time.monotonic() - t0:.1f} s", flush=True)
    figures("main run (both agents, both gateways up)", traces, verdict)
    return Main(clean, withheld, traces, verdict, stored,
                {g: decided(topo, g) - before[g] for g in GATEWAYS},
                {g: decided(topo, g, sampled="true") - kept_before[g] for g in GATEWAYS},
                {n: topo.metric(n, "otelcol_receiver_accepted_spans", receiver="otlp")
                 - accepted_before[n] for n in GATEWAYS + AGENTS}, topo.jaeger_url)


def test_every_recovery_episode_is_kept_whole_and_is_what_vllm_did(main: Main) -> None:
    eps = [t for t in main.traces.values() if t.episode]
    assert len(eps) >= 10, f"only {len(eps)} episodes: the workload must recover often"
    missing = [t.trace_id for t in eps if t.trace_id not in main.verdict.whole]
    assert not missing, f"episodes not whole in Jaeger: {missing}"
    # Every episode vLLM made in the clean run, complete, as Jaeger has it.
    clean_ids = {t for t, s in main.clean.sent.items() if s.episode}
    spans = jaeger_spans({"data": [main.stored[t] for t in clean_ids]})
    assert assert_traces_match_vllm(main.clean.harness, spans) == len(clean_ids)
    # ... and each crossed both nodes: spans from node-a's and node-b's processes.
    for tid in clean_ids:
        hosts = {p.get("host.name") for p in
                 ({t["key"]: t["value"] for t in proc["tags"]}
                  for proc in main.stored[tid]["processes"].values())}
        assert hosts == {"node-a", "node-b"}, (tid, hosts)


def test_every_error_episode_is_kept_whole(main: Main) -> None:
    errors = [t for t in main.withheld.sent.values() if t.episode and t.error]
    assert errors, "the withheld rank made no ERROR episode"
    assert not [t.trace_id for t in errors if t.trace_id not in main.verdict.whole]
    for t in errors:
        root = t.root
        assert root is not None and root.attributes["kvobs.outcome"] == "receipt_incomplete"


def test_dropped_traces_are_dropped_whole(main: Main) -> None:
    v = main.verdict
    assert not v.partial, f"partial traces in Jaeger: {v.partial}"
    assert not v.foreign, f"spans in Jaeger nobody sent: {v.foreign[:5]}"
    dropped = [main.traces[t] for t in v.absent]
    # Only ordinary offload traffic is dropped, exactly what the probabilistic
    # policy drops (and it keeps the rest).
    assert not [t.trace_id for t in dropped if t.episode or t.error]
    traffic = {t for t, s in main.traces.items() if not s.episode}
    assert {t for t in traffic if not traffic_policy_keeps(t)} == set(v.absent)
    assert dropped, "the traffic policy dropped nothing (no traffic traces?)"
    # Not trivially whole: dropped traces held spans from both nodes.
    assert any({s.resource.get("host.name") for s in t.spans.values()} == {"node-a", "node-b"}
               for t in dropped)


def test_each_trace_was_decided_by_one_gateway(topo: Topology, main: Main) -> None:
    # Each agent routes over both gateways: KVOBS_GATEWAY_ENDPOINTS, one
    # variable, became a list of two.
    for agent in AGENTS:
        assert topo.metric(agent, "otelcol_loadbalancer_num_backends", resolver="static") == 2
    # A trace split over the gateways would be decided (and counted) by each.
    assert sum(main.decided.values()) == len(main.traces), main.decided
    assert all(n > 0 for n in main.decided.values()), main.decided  # both gateways used
    assert sum(main.kept.values()) == len(main.verdict.whole), main.kept
    # Every span the agents received reached exactly one gateway, once.
    spans_sent = sum(len(t.spans) for t in main.traces.values())
    agents = {a: main.accepted[a] for a in AGENTS}
    gateways = {g: main.accepted[g] for g in GATEWAYS}
    assert sum(agents.values()) == sum(gateways.values()) == spans_sent, (agents, gateways)
    # Rank 1's spans, and only they, came through node b's agent.
    from_b = sum(r.spans_of(1) for r in (main.clean, main.withheld))
    assert agents["agent-b"] == from_b, (agents, from_b)


def test_kvobs_otel_check_on_jaeger_agrees(main: Main) -> None:
    _episodes, summary = check_spans(load_spans(main.jaeger_url))
    error_roots = {(r.attributes["kvobs.request.id"], r.attributes["kvobs.recovery.epoch"])
                   for t in main.withheld.sent.values() if t.error and (r := t.root) is not None}
    incomplete = {(e["request_id"], e["epoch"]) for e in summary["incomplete_episodes"]}
    assert incomplete == error_roots
    for e in summary["incomplete_episodes"]:
        assert any("missing ranks [1]" in p for p in e["problems"]), e
    assert summary["episodes"] == sum(t.root is not None for t in main.traces.values())
    proc = run_cli("check", main.jaeger_url, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    n = summary["episodes"]
    assert f"{n} recovery episodes: {n - len(error_roots)} complete" in proc.stdout, proc.stdout


def test_jaeger_restart_on_the_same_badger_directory_keeps_every_trace(
        topo: Topology, main: Main) -> None:
    before = {t: jaeger_span_ids(trace) for t, trace in main.stored.items()}
    assert before
    topo.restart("jaeger")
    after = {t: jaeger_span_ids(topo.trace(t)) for t in before}
    lost = [t for t in before if after[t] != before[t]]
    print(f"\n[topology] Jaeger restart: {len(before)} traces stored before, "
          f"{len(before) - len(lost)} returned whole after", flush=True)
    assert not lost, f"{len(lost)} traces changed across the restart: {lost[:5]}"


# -- failures: a gateway restarted, an agent stopped -------------------------------
def settle_stable(topo: Topology, traces: dict[str, SentTrace],
                  timeout: float = 120) -> tuple[Verdict, dict[str, dict]]:
    """After a failure the gateways' counts say nothing certain (a restarted
    one starts from zero): wait until Jaeger's copy of every sent trace stops
    changing (three looks 3 s apart, the first after a decision wait and the
    agents' first retries), then judge."""
    time.sleep(8)
    seen: list[dict[str, int]] = []
    until = time.monotonic() + timeout
    while True:
        v, stored = judge(topo, traces)
        seen.append({t: len(tr["spans"]) for t, tr in stored.items()})
        if (len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]) or time.monotonic() > until:
            return v, stored
        time.sleep(3)


def lost_by_vllm(topo: Topology, agent: str) -> float:
    """Spans the node's processes counted as not delivered, as the node's
    agent (its Prometheus exporter) shows their counts."""
    from kvobs_otel.tools.harness.server import sum_samples

    text = topo.exported_metric_text(agent)
    return sum(sum_samples(text, "kvobs_observer_dropped_total", reason=r)
               for r in ("export_failed", "export_shutdown", "export_queue_full"))


def step_until_preempted(h: Harness, n: int, within_s: float = 120.0) -> None:
    until = time.monotonic() + within_s
    while len(h.preemptions) < n:
        assert h.has_work() and time.monotonic() < until, "no preemption to fail during"
        h.step()


def after_spans_at(topo: Topology, server: str, n: int, what: str,
                   act: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """A thread that does ``act`` once ``server``'s OTLP receiver took ``n``
    more spans (so the failure hits a run in flight), and the exception it
    met, for the test's thread to re-raise. Started by the caller."""
    failure: list[BaseException] = []
    accepted = "otelcol_receiver_accepted_spans"

    def run() -> None:
        try:
            start = topo.metric(server, accepted, receiver="otlp")
            wait_for(lambda: topo.metric(server, accepted, receiver="otlp") >= start + n,
                     what, timeout=120, interval=0.1)
            act()
        except BaseException as e:  # re-raised in the test's thread
            failure.append(e)
    return threading.Thread(target=run), failure


NO_QUEUE_NO_RETRY = {"KVOBS_GATEWAY_QUEUE": "false", "KVOBS_GATEWAY_RETRY": "false"}


def agents_failed_spans(topo: Topology) -> float:
    """Spans the agents' exporters gave up on (their own count)."""
    return sum(topo.metric(a, "otelcol_exporter_send_failed_spans") for a in AGENTS)


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "sigterm-no-retry"])
def test_a_gateway_restarted_mid_run(topo: Topology, tmp_path: Path, how: str) -> None:
    """Gateway 1 is stopped (SIGTERM: a rolling restart; SIGKILL: a crash)
    while episodes are open, and started again on the same address 3 s
    later; the agents keep its share queued and retry (their shipped
    settings), or, in ``sigterm-no-retry``, have queue and retry switched
    off to show what those settings are worth. Measured, not required: how
    many episodes end whole, split or lost. Required: vLLM lost nothing (the
    agents took every span), every request finished, nothing reached Jaeger
    that was not sent, the traffic policy's verdicts hold for every trace
    that is whole, and the agents gave up on spans only without retry."""
    drops_before = {a: lost_by_vllm(topo, a) for a in AGENTS}
    # Once gateway 1 holds spans of this run (its share of about a round).
    restart, failure = after_spans_at(
        topo, "gateway-1", 40, "40 spans at gateway 1",
        lambda: topo.restart("gateway-1", down_s=3.0, kill=how == "sigkill"))
    settings = topo.agents_with(NO_QUEUE_NO_RETRY) if how.endswith("no-retry") \
        else contextlib.nullcontext()

    def body(h: Harness) -> list[PromptSpec]:
        restart.start()  # while this thread keeps vLLM stepping
        specs = []
        for i in range(3):
            specs += pressure_workload(h, prefix=f"{how}{i}-")
            run_until_idle(h)
        restart.join(120)
        return specs

    with settings:
        failed_before = agents_failed_spans(topo)
        run = run_through(topo, tmp_path, f"gateway-{how}", body)
        # (read before agents_with restarts the agents and zeroes their counts)
        gave_up = agents_failed_spans(topo) - failed_before
    assert not failure and not restart.is_alive(), failure
    assert "gateway-1" in topo.servers and topo.restarts["gateway-1"] >= 1
    assert set(run.harness.finished.values()) == {"length"}, run.harness.finished
    assert len(run.harness.finished) == len(run.specs)
    v, _stored = settle_stable(topo, run.sent)
    figs = figures(f"gateway-1 restarted mid-run ({how}, down 3 s; agents gave up on "
                   f"{gave_up:.0f} spans)", run.sent, v)
    assert not v.foreign, v.foreign[:5]
    assert (gave_up > 0) == how.endswith("no-retry"), gave_up
    assert figs["episodes sent"] >= 10
    whole_traffic = [t for t in v.whole if not run.sent[t].episode]
    assert all(traffic_policy_keeps(t) for t in whole_traffic)
    assert {a: lost_by_vllm(topo, a) for a in AGENTS} == drops_before  # vLLM lost nothing


def test_a_stopped_agent_costs_vllm_nothing_and_its_losses_are_counted(
        topo: Topology, main: Main, tmp_path: Path) -> None:
    """Node b's agent is stopped mid-run (once it took some of rank 1's spans)
    and comes back only after vLLM finished: every request still finishes
    with the same tokens as in the main run (same requests), and rank 1
    counts what it could not deliver, reported once its agent is back. Node
    a loses nothing."""
    again = [s for s in main.clean.specs if s.req_id.startswith(("c0-", "c1-"))]
    drops_before = {a: lost_by_vllm(topo, a) for a in AGENTS}
    accepted = "otelcol_receiver_accepted_spans"
    accepted_before = {g: topo.metric(g, accepted, receiver="otlp") for g in GATEWAYS}
    stopper, failure = after_spans_at(topo, "agent-b", 5, "5 of rank 1's spans at agent B",
                                      lambda: topo.stop("agent-b"))

    def body(h: Harness) -> list[PromptSpec]:
        stopper.start()
        # The same request ids and prompts (the harness's tokens depend on both).
        for prefix in ("c0-", "c1-"):
            for s in again:
                if s.req_id.startswith(prefix):
                    h.add_request(s.req_id, s.prompt_token_ids, s.max_tokens)
            run_until_idle(h)
        stopper.join(120)
        assert not failure and "agent-b" not in topo.servers, failure
        # Down past rank 1's export timeout (2 s here): its exports fail.
        time.sleep(4)
        topo.start("agent-b")
        # Rank 1's processes report their losses through the agent, now back,
        # with their next periodic metric export (while they still run).
        wait_for(lambda: lost_by_vllm(topo, "agent-b") > drops_before["agent-b"],
                 "rank 1's count of undelivered spans", timeout=60, interval=1.0)
        return again

    run = run_through(topo, tmp_path, "agent-down", body,
                      extra={"OTEL_EXPORTER_OTLP_TIMEOUT": "2"})
    h = run.harness
    assert set(h.finished.values()) == {"length"}, h.finished
    assert {s.req_id: h.outputs[s.req_id] for s in run.specs} == {
        s.req_id: main.clean.harness.outputs[s.req_id] for s in again}
    assert h.preemptions
    assert lost_by_vllm(topo, "agent-a") == drops_before["agent-a"]
    # Accounting: every span rank 1 made either reached a gateway or is
    # counted lost (the count as its processes last reported it).
    built = {p: run.spans_of(p) for p in run.files}

    def accounted() -> tuple[float, float]:
        arrived = sum(topo.metric(g, "otelcol_receiver_accepted_spans", receiver="otlp")
                      - accepted_before[g] for g in GATEWAYS)
        return arrived - built["scheduler"] - built[0], (lost_by_vllm(topo, "agent-b")
                                                         - drops_before["agent-b"])
    poll(lambda: sum(accounted()) == built[1], timeout=30, interval=1.0)
    arrived_b, lost_b = accounted()
    print(f"\n[topology] agent-b stopped mid-run: {len(h.finished)} requests finished, "
          f"rank 1 made {built[1]} spans, {arrived_b:.0f} reached a gateway, "
          f"{lost_b:.0f} counted lost by rank 1; node a made "
          f"{built['scheduler'] + built[0]}, lost 0", flush=True)
    assert arrived_b > 0 and lost_b > 0, (arrived_b, lost_b)  # the stop came mid-run
    assert arrived_b + lost_b == built[1], (arrived_b, lost_b, built)
