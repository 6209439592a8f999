"""Skewed clocks (issue 19): a rank whose host's wall clock is off.

Real parts: the real-vLLM harness with rank processes (spawn), rank 1 run
under Debian's libfaketime with its wall clock 5 s ahead and its monotonic
clock untouched (as on another host), on its own ``host.name``; the real
Collector and Jaeger v2 with the configs deploy/ ships (tests/stack.py).

What holds: the recovery episodes still join by ids (one trace each, every
rank); the skewed rank's spans are shifted by the offset and, shifted back,
each lies where the causal order puts it (so its duration is its own: times
are monotonic with one wall-clock anchor per process; a constant offset alone
could not tell that from wall-clock durations, the code does); Jaeger, whose
clock-skew adjustment deploy/jaeger.yaml leaves off, shows them shifted and
says so in span warnings; ``kvobs-otel check`` reports the rank's clock
ahead by at least about the offset, as a warning (exit 0).

The analysis itself is also tested on constructed spans (fast).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from itertools import count
from pathlib import Path

import pytest

from kvobs_otel import identity
from kvobs_otel.tools import cli
from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.analysis.skew import clock_skew
from kvobs_otel.tools.check import check_spans, format_table
from kvobs_otel.tools.otlp_file import FileSpan
from kvobs_otel.tools.sources import load_spans

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
OFFSET_S = 5.0
SKEWED_HOST = "kvobs-skewed-host"
# Timeline slack: how far a real causal gap (IPC between the scheduler and a
# rank, one engine step) may widen an offset bound on a loaded 2-core machine.
SLACK_S = 1.0


# -- the analysis on constructed spans ----------------------------------------------

_ids = count(1)
HOST = "sched-host"


def _span(name: str, trace: str, parent: str, attrs: dict, start: int, end: int,
          rank: int | None = None, host: str = HOST, pid: int = 100) -> FileSpan:
    resource = {"service.name": "kvobs-otel", "host.name": host, "process.pid": pid,
                "kvobs.role": "scheduler" if rank is None else "worker"}
    if rank is not None:
        resource["kvobs.rank"] = rank
        attrs = {**attrs, "kvobs.rank": rank}
    return FileSpan(name=name, trace_id=trace, span_id=f"{next(_ids):016x}",
                    parent_span_id=parent, start_ns=start, end_ns=end, attributes=attrs,
                    resource=resource, error=False)


MS = 1_000_000


def recovered_episode(offsets_ms: dict[int, float], req: str = "r") -> list[FileSpan]:
    """One recovered episode with a restore, as kvobs-otel writes it, the
    times true up to each rank's clock offset (rank -> ms; rank r runs on
    host h<r>, pid 200+r). True order: job 0-40 ms with the transfers 5-30 ms;
    admission 45-50 ms; first computes 52-70 ms; root 0-80 ms."""
    trace = hashlib.sha256(f"{req}/{next(_ids)}".encode()).hexdigest()[:32]
    t0 = 1_000_000 * MS
    ranks = sorted(offsets_ms)
    root = _span("kv.recovery", trace, "", {
        "kvobs.request.id": req, "kvobs.recovery.epoch": 1, "kvobs.scheduler.generation": "g",
        "kvobs.outcome": "recovered", "kvobs.receipt.expected_ranks": len(ranks),
        "kvobs.restore.job_ids": [7], "kvobs.first_compute.ranks": ranks,
        "kvobs.compute.kind": "prefill"}, t0, t0 + 80 * MS)
    job = _span("kv.job", trace, root.span_id, {
        "kvobs.job.id": 7, "kvobs.job.kind": "load", "kvobs.outcome": "complete",
        "kvobs.receipt.ranks": ranks}, t0, t0 + 40 * MS)
    adm = _span("kv.admission", trace, root.span_id, {}, t0 + 45 * MS, t0 + 50 * MS)
    spans = [root, job, adm]
    for r in ranks:
        d = int(offsets_ms[r] * MS)
        kw = {"rank": r, "host": f"h{r}", "pid": 200 + r}
        spans.append(_span("kv.transfer", trace, job.span_id, {
            "kvobs.job.id": 7, "kvobs.direction": "h2d", "kvobs.outcome": "ok"},
            t0 + 5 * MS + d, t0 + 30 * MS + d, **kw))
        spans.append(_span("kv.first_compute", trace, adm.span_id, {},
                           t0 + 52 * MS + d, t0 + 70 * MS + d, **kw))
    return spans


def by_rank(spans: list[FileSpan]) -> dict[int, dict]:
    _eps, summary = check_spans(spans)
    return {e["process"]["kvobs.rank"]: e for e in summary["clock_skew"]}


def test_agreeing_clocks_are_no_skew():
    spans = recovered_episode({0: 0, 1: 0})
    skew = by_rank(spans)
    assert set(skew) == {0, 1}
    for e in skew.values():
        assert not e["skewed"] and e["direction"] is None
        # True gaps: transfer end 10 ms before the job's, first compute
        # starting 2 ms after the admission ended.
        assert e["offset_min_s"] == pytest.approx(-0.010)
        assert e["offset_max_s"] == pytest.approx(0.002)
        assert e["reference"]["kvobs.role"] == "scheduler"
    episodes, summary = check_spans(spans)
    assert summary["clock_skewed_processes"] == 0
    assert "clock skew" not in format_table(episodes, summary=summary)


@pytest.mark.parametrize("offset_ms", [3000, 250, 12])
def test_a_rank_ahead_is_bounded_by_its_transfers_ending_after_their_job(offset_ms):
    skew = by_rank(recovered_episode({0: 0, 1: offset_ms}))
    assert not skew[0]["skewed"]
    e = skew[1]
    assert e["skewed"] and e["direction"] == "ahead"
    # At least offset - 10 ms (the transfer really ended 10 ms before the
    # job), at most offset + 2 ms (the first compute really started 2 ms
    # after the admission ended): the true offset is inside.
    assert e["offset_at_least_s"] == pytest.approx(offset_ms / 1e3 - 0.010)
    assert e["offset_min_s"] <= offset_ms / 1e3 <= e["offset_max_s"]
    assert e["offset_max_s"] == pytest.approx(offset_ms / 1e3 + 0.002)
    assert e["process"]["host.name"] == "h1" and e["episodes"] == e["episodes_complete"] == 1


@pytest.mark.parametrize("offset_ms", [-3000, -40])
def test_a_rank_behind_is_bounded_by_its_spans_starting_before_their_parents(offset_ms):
    e = by_rank(recovered_episode({0: 0, 1: offset_ms}))[1]
    assert e["direction"] == "behind"
    # Its first compute seemingly started before the admission ended.
    assert e["offset_at_least_s"] == pytest.approx(-offset_ms / 1e3 - 0.002)
    assert e["offset_min_s"] <= offset_ms / 1e3 <= e["offset_max_s"]


def test_offsets_within_the_tolerance_are_not_reported():
    # 10.5 ms ahead: its transfer seems to end 0.5 ms after its job (it
    # really ended 10 ms before), under the default tolerance of 1 ms.
    spans = recovered_episode({0: 0, 1: 10.5})
    e = by_rank(spans)[1]
    assert not e["skewed"] and e["offset_min_s"] == pytest.approx(0.0005)
    e = {x["process"]["kvobs.rank"]: x
         for x in check_spans(spans, clock_tolerance_s=0)[1]["clock_skew"]}[1]
    assert e["direction"] == "ahead" and e["offset_at_least_s"] == pytest.approx(0.0005)


def test_only_causal_orders_bound_the_offset():
    """A job that never got the rank's receipt (receipt_incomplete: it ended
    at the deadline) says nothing about when the rank's transfer ended; a
    first compute under an episode that did not come back neither."""
    spans = recovered_episode({0: 0, 1: 0})
    for s in spans:
        if s.name == "kv.job":
            s.attributes["kvobs.outcome"] = "receipt_incomplete"
            s.attributes["kvobs.receipt.ranks"] = [0]
            s.end_ns = s.start_ns + 8 * MS  # the transfers end later
        if s.name == "kv.recovery":
            s.attributes["kvobs.outcome"] = "receipt_incomplete"
    skew = by_rank(spans)
    assert not skew[1]["skewed"]
    # Nothing bounds either rank from below (had the job's end counted,
    # rank 1 would be "ahead" by 22 ms).
    assert skew[0]["offset_min_s"] is None and skew[1]["offset_min_s"] is None


def test_a_clock_that_stepped_during_the_recording_is_inconsistent():
    ahead = recovered_episode({0: 0, 1: 2000}, req="a")
    behind = recovered_episode({0: 0, 1: -2000}, req="b")
    e = by_rank(ahead + behind)[1]
    assert e["direction"] == "inconsistent" and e["episodes"] == 2
    assert e["offset_min_s"] > e["offset_max_s"]


def test_same_process_spans_are_not_compared():
    # Every span in one process (all ranks inline, scheduler included): no
    # cross-process pair, nothing to say, whatever the times.
    spans = recovered_episode({0: 3000})
    for s in spans:
        s.resource.update({"host.name": HOST, "process.pid": 100})
    assert clock_skew(rebuild(spans)) == []


def _otlp_file(path: Path, spans: list[FileSpan]) -> None:
    """FileSpans back to an OTLP JSON file, one resource per process."""
    def attrs(d: dict) -> list[dict]:
        out = []
        for k, v in d.items():
            if isinstance(v, bool):
                val = {"boolValue": v}
            elif isinstance(v, int):
                val = {"intValue": str(v)}
            elif isinstance(v, list):
                val = {"arrayValue": {"values": [{"intValue": str(x)} for x in v]}}
            else:
                val = {"stringValue": str(v)}
            out.append({"key": k, "value": val})
        return out

    groups: dict[str, list[FileSpan]] = {}
    for s in spans:
        groups.setdefault(json.dumps(s.resource, sort_keys=True), []).append(s)
    doc = {"resourceSpans": [{
        "resource": {"attributes": attrs(json.loads(res))},
        "scopeSpans": [{"spans": [{
            "name": s.name, "traceId": s.trace_id, "spanId": s.span_id,
            "parentSpanId": s.parent_span_id, "startTimeUnixNano": str(s.start_ns),
            "endTimeUnixNano": str(s.end_ns), "attributes": attrs(s.attributes)}
            for s in group]}]} for res, group in groups.items()]}
    path.write_text(json.dumps(doc) + "\n")


def test_check_cli_reports_skew_as_a_warning_with_exit_0(tmp_path, capsys):
    path = tmp_path / "skewed.otlp.jsonl"
    _otlp_file(path, recovered_episode({0: 0, 1: 3000}))
    assert cli.main(["check", str(path)]) == 0  # complete: skew alone is no failure
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 recovery episodes: 1 complete, 0 incomplete; restore_failed: 0, " \
        "recomputed: 0"
    assert out[1].startswith("clock skew (a warning")
    assert out[2] == "  rank 1 (host h1, pid 201): clock ahead of scheduler (host sched-host, " \
        "pid 100) by at least 2.990 s; 1 of 1 episodes with its spans complete, joined by ids"
    assert len(out) == 3
    assert cli.main(["check", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["clock_skewed_processes"] == 1
    # A tolerance above the offset: nothing reported.
    assert cli.main(["check", str(path), "--clock-tolerance-ms", "4000"]) == 0
    assert "clock skew" not in capsys.readouterr().out
    assert cli.main(["check", str(path), "--clock-tolerance-ms", "-1"]) == 2
    assert "--clock-tolerance-ms" in capsys.readouterr().err


# -- the real thing -------------------------------------------------------------------


# libfaketime 0.9.10 (Debian's) with FAKETIME_DONT_FAKE_MONOTONIC passes a
# negative time to clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME), which
# Python 3.11+'s time.sleep uses: every sleep fails with EINVAL
# (wolfcw/libfaketime#426). A host whose clock is merely off has no such bug,
# so the skewed processes sleep through select() (not faked) instead.
SLEEP_SHIM = """\
import select
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)


time.sleep = _sleep
"""


@pytest.fixture
def faketime(tmp_path: Path) -> dict[str, str]:
    """A process environment whose wall clock runs OFFSET_S ahead; its
    monotonic clock is left alone, as another host's would be."""
    if not LIBFAKETIME.exists():
        # A failure, not a skip: CI installs it (.ci/setup-servers.sh), and a
        # missing component must not pass unnoticed.
        pytest.fail(f"libfaketime is not installed ({LIBFAKETIME}): 'sudo apt-get install "
                    "libfaketime' (Debian's package; .ci/setup-servers.sh installs it)")
    (tmp_path / "sitecustomize.py").write_text(SLEEP_SHIM)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"+{OFFSET_S:g}",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "PYTHONPATH": path}


# Two processes' wall-clock anchors on one host disagree by the time between
# two clock reads (microseconds, more when preempted on a loaded machine).
ANCHOR_TOL_S = 0.005
DELTA = re.compile(r"^clock skew adjustment disabled; not applying calculated delta of "
                   r"(-?[0-9.]+)(s|ms|µs)$")


def _delta_s(warning: str) -> float:
    """The delta, in seconds, of Jaeger's clock-skew adjuster's warning."""
    m = DELTA.match(warning)
    assert m, warning
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[m.group(2)]


def _jaeger_times(trace: dict) -> dict[str, tuple[str, int | None, float, float]]:
    """span id -> (operation, rank, start s, end s) of a Jaeger v1 trace."""
    from stack import tag

    return {s["spanID"]: (s["operationName"], tag(trace["processes"][s["processID"]],
                                                  "kvobs.rank"),
                          s["startTime"] / 1e6, (s["startTime"] + s["duration"]) / 1e6)
            for s in trace["spans"]}


def _v3_warnings(jaeger_url: str, trace_id: str) -> dict[str, list[str]]:
    """span id -> distinct warnings, from Jaeger's /api/v3 (the OTLP view).
    Distinct: with the memory store, Jaeger 2.12's v3 adjusters add their
    warnings to the stored trace itself, once more with every query."""
    from otel_servers import get_json

    doc = get_json(f"{jaeger_url}/api/v3/traces/{trace_id}")
    out = {}
    for rs in doc["result"]["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for a in s.get("attributes", []):
                    if a["key"] == "@jaeger@warnings":
                        out[s["spanId"]] = sorted({v["stringValue"]
                                                   for v in a["value"]["arrayValue"]["values"]})
    return out


def _parent(span: dict) -> str | None:
    return next((r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"), None)


def test_a_rank_with_a_skewed_clock_joins_by_ids_and_check_reports_it(
        stack, monkeypatch, faketime, capfd):
    from test_e2e_stack import export_env, run_harness

    from otel_servers import poll
    from stack import tag
    from test_vllm_episodes import start_recovery

    requests = ("skew-a", "skew-b")
    rank_env = {1: {**faketime, "OTEL_RESOURCE_ATTRIBUTES": f"host.name={SKEWED_HOST}"}}
    offset = {0: 0.0, 1: OFFSET_S}

    def run(h) -> None:
        assert h.rank_call(1, "env", "FAKETIME")[1] == faketime["FAKETIME"]  # exec'd with it
        for req in requests:
            start_recovery(h, req)
            h.run_until_idle(400)
        for r in (0, 1):
            seen = h.rank_call(r, "observation")
            assert not any(seen["errors"].values()) and not any(seen["drops"].values()), seen

    h = run_harness(monkeypatch, export_env(stack, "grpc"), "spawn",
                    {"run": run, "config": {"rank_env": rank_env}})
    assert all(h.finished[r] == "length" for r in requests)
    # No process failed or lost anything on the way, shutdown included (the
    # ranks' stderr is this process's).
    assert "kvobs-otel: internal failure" not in capfd.readouterr().err

    def traces() -> dict[str, list[dict]] | None:
        """request -> its episodes' traces (a request's ordinary traffic, a
        kv.request trace, may be sampled too), once both ranks' spans are in."""
        out = {}
        for req in requests:
            found = [t for t in stack.traces(tags=json.dumps({"kvobs.request.id": req}))
                     if any(s["operationName"] == "kv.recovery" for s in t["spans"])]
            kinds = {(s["operationName"], tag(t["processes"][s["processID"]], "kvobs.rank"))
                     for t in found for s in t["spans"]}
            if not {("kv.recovery", None), ("kv.transfer", 0), ("kv.transfer", 1),
                    ("kv.first_compute", 0), ("kv.first_compute", 1)} <= kinds:
                return None
            out[req] = found
        return out

    found = poll(traces, timeout=60)
    assert found, "the episodes never reached Jaeger with both ranks' spans"
    for req, req_traces in found.items():
        # Joined by ids: one trace, whose id and the ranks' parents are
        # derived from (scheduler generation, request, epoch / job id).
        (trace,) = req_traces
        spans = {s["spanID"]: s for s in trace["spans"]}
        times = _jaeger_times(trace)
        (root,) = [s for s in spans.values() if s["operationName"] == "kv.recovery"]
        gen, epoch = tag(root, "kvobs.scheduler.generation"), tag(root, "kvobs.recovery.epoch")
        tid, sid = identity.episode_ids(gen, req, epoch)
        assert (int(trace["traceID"], 16), int(root["spanID"], 16)) == (tid, sid)
        hosts = {tag(p, "kvobs.rank"): tag(p, "host.name") for p in trace["processes"].values()}
        assert hosts[1] == SKEWED_HOST and hosts[0] == hosts[None] != SKEWED_HOST
        restored_on = set()
        for span_id, (name, rank, start, end) in times.items():
            s = spans[span_id]
            if rank is None:
                assert not s.get("warnings"), s  # the scheduler's own spans nest
                continue
            d = offset[rank]
            if name == "kv.transfer":
                job = _parent(s)
                assert job == f"{identity.job_span_id(gen, tag(s, 'kvobs.job.id')):016x}"
                _n, _r, job_start, job_end = times[job]
                # Its start is shifted by its host's offset (plus the real
                # gap: the rank submits after the scheduler made the job) ...
                assert d - ANCHOR_TOL_S <= start - job_start <= d + SLACK_S, (rank, start)
                # ... and its duration is not: shifted back, it lies inside
                # its job, which ended at the rank's receipt.
                assert end - d <= job_end + ANCHOR_TOL_S, (rank, end - d, job_end)
                if tag(s, "kvobs.direction") == "h2d":
                    restored_on.add(rank)
            else:
                assert name == "kv.first_compute"
                adm = _parent(s)
                assert adm == f"{identity.admission_span_id(gen, req, epoch):016x}"
                # After the admission ended (the rank binds the step that
                # carried it), before the root ended (at the rank's report).
                assert 0 - ANCHOR_TOL_S <= start - d - times[adm][3] <= SLACK_S, (rank, start)
                assert end - d <= times[root["spanID"]][3] + ANCHOR_TOL_S, (rank, end)
            # What Jaeger displays: the rank's spans where its clock put them,
            # and, where the adjuster (off in deploy/jaeger.yaml) would have
            # moved one, a warning with the delta it computed. It moves only a
            # child shorter than its parent that lies outside it: the skewed
            # rank's transfers, by the rank's offset. A first compute starts
            # after its admission ended and usually outlasts it; when the
            # admission (restore done -> admitted) took longer than the
            # forward, as on a loaded machine, the adjuster proposes to move
            # it by its host's offset and the gap (milliseconds).
            warnings = s.get("warnings") or []
            if rank == 1 and name == "kv.transfer":
                (w,) = warnings
                assert -OFFSET_S - SLACK_S <= _delta_s(w) <= -OFFSET_S + SLACK_S, w
            elif name == "kv.first_compute":
                assert all(abs(_delta_s(w) + d) < SLACK_S for w in warnings), (rank, warnings)
            else:
                assert not warnings, (rank, name, warnings)
        assert restored_on == {0, 1}  # each rank restored the episode's KV
        # The v3 API (OTLP; its adjuster tells hosts apart by host.name) says
        # the same, on the same spans.
        assert _v3_warnings(stack.jaeger_url, trace["traceID"]) == {
            sid: w for sid, w in ((k, spans[k].get("warnings")) for k in spans) if w}

    # kvobs-otel check, on what Jaeger holds: complete, and rank 1's clock
    # ahead by about the offset, as a warning.
    episodes, summary = check_spans(load_spans(stack.jaeger_url))
    mine = [e for e in episodes if e.request_id in requests]
    assert len(mine) == 2 and all(e.complete for e in mine), [e.problems for e in mine]
    skewed = [e for e in summary["clock_skew"] if e["skewed"]]
    assert len(skewed) == 1, summary["clock_skew"]
    (e,) = skewed
    assert (e["process"]["kvobs.rank"], e["process"]["host.name"]) == (1, SKEWED_HOST)
    assert e["reference"]["kvobs.role"] == "scheduler" and e["direction"] == "ahead"
    assert OFFSET_S - SLACK_S <= e["offset_at_least_s"] <= OFFSET_S + ANCHOR_TOL_S, e
    assert e["offset_min_s"] - ANCHOR_TOL_S <= OFFSET_S <= e["offset_max_s"] + ANCHOR_TOL_S, e
    assert e["episodes_complete"] == e["episodes"] >= 2
    assert cli.main(["check", stack.jaeger_url]) == 0
    out = capfd.readouterr().out
    assert re.search(rf"rank 1 \(host {SKEWED_HOST}, pid \d+\): clock ahead of scheduler "
                     r"\(host \S+, pid \d+\) by at least [45]\.\d{3} s", out), out
