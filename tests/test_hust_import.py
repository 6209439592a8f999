"""``kvobs-otel import-hust``: the vLLM-HUST plugin's JSONL files -> spans.

The fixtures (``tests/fixtures/hust/``, see its README) are lines in the
layout the plugin's record classes write: nested ``identity``,
process-scoped transfer and receipt ids, closed field sets, sorted keys,
one process's clock per stream. Each test damages or rearranges them.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
from oracle import assert_traces_hold, chain_truth
from vllm_hust_contract import chains, jsonl
from vllm_hust_contract import correlated_observability as v2
from vllm_hust_contract import observability as v1

import kvobs_otel
from kvobs_otel.config import Settings
from kvobs_otel.hosts.hust import contracts
from kvobs_otel.telemetry.otlp_json import spans_to_otlp_json
from kvobs_otel.tools import cli
from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.otlp_file import FileSpan, read_spans, spans_from_document

from chains import by_trace
from conftest import run_cli
from otlp_receiver import HttpReceiver

FIXTURES = Path(__file__).parent / "fixtures" / "hust"
COMPLETE = ("correlated-2rank-complete", "v1-host-2rank-complete", "event-v2-2rank-complete")
INCOMPLETE = ("correlated-2rank-incomplete", "v1-host-2rank-incomplete")


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "KVOBS_")):
            monkeypatch.delenv(k)


def fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.jsonl")


def lines(name: str) -> list[dict]:
    return [json.loads(x) for x in Path(fixture(name)).read_text().splitlines()]


def dump(records: list[dict]) -> str:
    # The plugin's sink: compact, sorted keys, ASCII, one record per line (events.py).
    return "".join(json.dumps(r, ensure_ascii=True, separators=(",", ":"), sort_keys=True)
                   + "\n" for r in records)


def run(capsys, *args: str) -> tuple[int, dict]:
    code = cli.main(["import-hust", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip().startswith("{") else {}


def shape(spans: Path | list[FileSpan]) -> list:
    """Every trace as (span, parent span, rank, outcome, job, blocks, bytes),
    ids and times left out."""
    out = []
    found = read_spans(str(spans)) if isinstance(spans, Path) else spans
    for trace in by_trace(found).values():
        names = {v.span_id: v.name for v in trace}
        out.append(sorted(
            (v.name, names.get(v.parent_id), *(v.attrs.get(f"kvobs.{a}") for a in (
                "rank", "outcome", "job.id", "blocks", "bytes", "request.id",
                "recovery.epoch", "join.scope"))) for v in trace))
    return sorted(out)


def test_fixtures_are_in_the_plugins_serialisation():
    for path in sorted(FIXTURES.glob("*.jsonl")):
        text = path.read_text()
        assert dump([json.loads(x) for x in text.splitlines()]) == text, path.name


@pytest.mark.parametrize("name", COMPLETE)
def test_a_complete_chain_imports_with_exit_0_and_checks(tmp_path, capsys, name):
    out = tmp_path / "spans.json"
    code, s = run(capsys, fixture(name), "-o", str(out))
    assert code == 0, s
    assert s["refused"] == {} and s["anomalies"] == {} and s["unfinished_transfers"] == []
    assert s["records"] == len(lines(name))
    spans = read_spans(str(out))
    episodes = rebuild(spans)
    assert episodes and all(e.complete and e.outcome == "recovered" for e in episodes)
    assert {e.request_id for e in episodes} == {"cmpl-4f1c2a9e-0"}
    # Both ranks are in the evidence, each on its own resource.
    assert {sp.resource.get("kvobs.rank") for sp in spans} >= {0, 1}
    assert run_cli("check", str(out)).returncode == 0


def test_correlated_chain_joins_all_three_processes_in_one_trace(tmp_path, capsys):
    out = tmp_path / "spans.json"
    assert run(capsys, fixture("correlated-2rank-complete"), "-o", str(out))[0] == 0
    assert_as_emitted("correlated-2rank-complete", read_spans(str(out)))
    (ep,) = rebuild(read_spans(str(out)))
    assert ep.join_scope == "cluster" and ep.expected_ranks == 2
    assert sorted((s.name, s.attributes.get("kvobs.rank")) for s in ep.spans
                  if s.name in ("kv.transfer", "kv.first_compute")) == [
        ("kv.first_compute", 0), ("kv.first_compute", 1), ("kv.transfer", 0),
        ("kv.transfer", 1)]
    (job,) = ep.named("kv.job")
    assert job.attributes["kvobs.receipt.ranks"] == [0, 1]


def test_v1_host_facts_stay_in_their_process(tmp_path, capsys):
    out = tmp_path / "spans.json"
    code, s = run(capsys, fixture("v1-host-2rank-complete"), "-o", str(out))
    assert code == 0
    assert s["by_schema"] == {"vllm-hust.kv-transfer-event.v2": 8,
                              "vllm-hust.kv-transfer-host-fact.v1": 5}
    spans = read_spans(str(out))
    (ep,) = rebuild(spans)
    assert ep.join_scope == "process" and ep.restore_jobs == [4]
    transfers = [sp for sp in spans if sp.name == "kv.transfer"]
    # The plugin's own records: bytes, blocks, job = the id's number; roots of their own.
    assert sorted((sp.attributes["kvobs.direction"], sp.attributes["kvobs.rank"],
                   sp.attributes["kvobs.job.id"], sp.attributes["kvobs.bytes"])
                  for sp in transfers) == [("d2h", 0, 3, 2097152), ("d2h", 1, 3, 2097152),
                                           ("h2d", 0, 4, 2097152), ("h2d", 1, 4, 2097152)]
    assert all(not sp.parent_span_id for sp in transfers)
    h2d0 = next(sp for sp in transfers if sp.attributes["kvobs.direction"] == "h2d"
                and sp.attributes["kvobs.rank"] == 0)
    assert h2d0.end_ns - h2d0.start_ns == 43_311_950 - 41_877_203  # one process's clock


@pytest.mark.parametrize("name", INCOMPLETE)
def test_an_incomplete_chain_exits_1_naming_the_missing_rank(tmp_path, capsys, name):
    out = tmp_path / "spans.json"
    code, s = run(capsys, fixture(name), "-o", str(out))
    assert code == 1
    assert s["refused"] == {}
    assert s["unfinished_transfers"] == [{"request_id": "cmpl-4f1c2a9e-0", "rank": 1,
                                          "direction": "h2d", "job_id": 4}]
    assert s["episodes"]["incomplete"] == 1
    code, _ = run(capsys, fixture(name), "-o", str(out))
    res = run_cli("import-hust", fixture(name), "-o", str(out))
    assert res.returncode == 1 and "rank 1: h2d transfer 4" in res.stdout
    check = run_cli("check", str(out))
    assert check.returncode == 1
    if name.startswith("correlated"):
        # The rank's restores joined the episode's trace: check names the rank too.
        assert "missing on ranks [1]" in check.stdout


def test_one_file_per_process_any_order_gives_the_same_traces(tmp_path, capsys):
    records = lines("correlated-2rank-complete")
    by_process: dict[str, list] = {}
    for r in records:
        by_process.setdefault(r.get("worker_generation", r["scheduler_generation"])
                              if r["event"] not in ("recovery_requeued", "transfer_receipt",
                                                    "recovery_admitted")
                              else r["scheduler_generation"], []).append(r)
    files = []
    for i, recs in enumerate(by_process.values()):
        f = tmp_path / f"p{i}.jsonl"
        f.write_text(dump(list(reversed(recs))))  # line order is not the process's order
        files.append(str(f))
    assert run(capsys, *reversed(files), "-o", str(tmp_path / "a.json"))[0] == 0
    assert run(capsys, fixture("correlated-2rank-complete"), "-o",
               str(tmp_path / "b.json"))[0] == 0
    assert shape(tmp_path / "a.json") == shape(tmp_path / "b.json")


def test_clocks_of_different_processes_are_never_compared(tmp_path, capsys):
    """Shift each process's clock arbitrarily: the same traces."""
    rng = random.Random(7)
    for name in ("correlated-2rank-complete", "v1-host-2rank-complete"):
        records = lines(name)
        keys = {json.dumps([r.get("process_uuid"), r.get("worker_generation"),
                            (r.get("identity") or {}).get("worker_generation"),
                            r.get("scheduler_generation") if r["event"] in (
                                "recovery_requeued", "transfer_receipt", "recovery_admitted")
                            else None]) for r in records}
        shift = {k: rng.randrange(-10**12, 10**12) for k in keys}
        for r in records:
            k = json.dumps([r.get("process_uuid"), r.get("worker_generation"),
                            (r.get("identity") or {}).get("worker_generation"),
                            r.get("scheduler_generation") if r["event"] in (
                                "recovery_requeued", "transfer_receipt", "recovery_admitted")
                            else None])
            r["observed_at_ns"] += shift[k] + 10**13
        f = tmp_path / f"{name}.jsonl"
        f.write_text(dump(records))
        assert run(capsys, str(f), "-o", str(tmp_path / "a.json"))[0] == 0
        assert run(capsys, fixture(name), "-o", str(tmp_path / "b.json"))[0] == 0
        assert shape(tmp_path / "a.json") == shape(tmp_path / "b.json")


def test_spans_are_anchored_to_the_file_of_their_process(tmp_path, capsys):
    f = tmp_path / "c.jsonl"
    f.write_text(Path(fixture("correlated-2rank-complete")).read_text())
    anchor = 1_700_000_000_000_000_000
    os.utime(f, ns=(anchor, anchor))
    out = tmp_path / "out.json"
    assert run(capsys, str(f), "-o", str(out))[0] == 0
    for sp in read_spans(str(out)):
        # Each process's latest record is placed at the file's last write.
        assert anchor - 70 * 10**6 <= sp.start_ns <= sp.end_ns <= anchor


# ------------------------------------------- the same chains, observed live


@pytest.fixture
def fork(monkeypatch: pytest.MonkeyPatch, telemetry):
    """The stand-in of the fork's contract modules under their real paths."""
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    for contract, module in ((contracts.V1, v1), (contracts.V2, v2)):
        monkeypatch.setitem(sys.modules, contract.module, module)
    yield telemetry
    kvobs_otel.uninstrument()
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()


def assert_as_emitted(name: str, spans: list[FileSpan]) -> None:
    """The spans hold every recovery of the host records behind a correlated
    (cluster-joined) fixture, judged by tests/oracle.py, not by kvobs-otel."""
    truth = chain_truth(jsonl.host_records(lines(name)))
    assert assert_traces_hold(truth, set(chains.RANKS), spans) == len(truth) > 0


def live(name: str, telemetry, monkeypatch) -> list[FileSpan]:
    """Replay the host records behind a fixture through the live adapter."""
    records = jsonl.host_records(lines(name))
    if not any(isinstance(r, v2.CorrelatedObservation) for r in records):
        monkeypatch.setitem(sys.modules, contracts.V2.module, None)  # a v1-only host
    assert kvobs_otel.instrument(Settings(enabled=True, drain_interval_s=0.02))
    chains.play(tuple(chains.Emission(chains.SCHEDULER, r) for r in records))
    kvobs_otel.uninstrument()  # drains, ends what is open, flushes
    return spans_from_document(spans_to_otlp_json(telemetry.spans()))


@pytest.mark.vllm
@pytest.mark.parametrize("name", COMPLETE[:2] + INCOMPLETE)
def test_imported_and_live_give_the_same_spans(tmp_path, fork, monkeypatch, name):
    out = tmp_path / "spans.json"
    # In its own process: the in-memory export of this test is the live side's.
    run_cli("import-hust", fixture(name), "-o", str(out))
    imported = shape(out)
    observed = shape(live(name, fork, monkeypatch))
    if name in INCOMPLETE:
        # The one difference: a restore still open when the evidence ends is
        # "unfinished"; live, the process shutting down cancels it.
        observed = sorted(sorted((*v[:3], "unfinished", *v[4:]) if v[3] == "cancelled" else v
                                 for v in t) for t in observed)
    assert imported == observed
    assert sum(map(len, imported)) >= 3


# --------------------------------------------------------------- refusals


def _event(name: str, event: str, rank: int = 0) -> dict:
    return next(r for r in lines(name) if r["event"] == event and (
        r.get("rank", (r.get("identity") or {}).get("rank")) in (rank, None)))


def _with(record: dict, **changes) -> dict:
    out = json.loads(json.dumps(record))
    for k, v in changes.items():
        if v is ...:
            out.pop(k)
        else:
            out[k] = v
    return out


def _identity(record: dict, **changes) -> dict:
    out = json.loads(json.dumps(record))
    out["identity"].update(changes)
    return out


def refusals() -> dict[str, tuple[dict, str]]:
    """name -> (a line the plugin's validator refuses, our reason)."""
    restored = _event("v1-host-2rank-complete", "restore_completed")
    started = _event("v1-host-2rank-complete", "restore_started")
    preserve = _event("v1-host-2rank-complete", "preserve_started")
    fact_adm = _event("v1-host-2rank-complete", "recovery_admitted")
    fact_rcpt = _event("v1-host-2rank-complete", "transfer_receipt")
    ev_req = _event("event-v2-2rank-complete", "recovery_requeued")
    ev_first = _event("event-v2-2rank-complete", "first_compute")
    c_sub = _event("correlated-2rank-complete", "restore_submitted")
    c_rcpt = _event("correlated-2rank-complete", "transfer_receipt")
    c_adm = _event("correlated-2rank-complete", "recovery_admitted")
    other = "0" * 32
    w0, w1 = c_rcpt["workers"]
    return {
        # kv-transfer-event v2
        "event_null_optional": (_with(started, bytes_moved=None), "record_noncanonical"),
        "event_unknown_key": (_with(started, pid=4242), "record_unexpected_field"),
        "event_field_of_another_event": (_with(started, receipt_id=restored["receipt_id"]),
                                         "record_unexpected_field"),
        "event_missing_shape_field": (_with(restored, duration_ns=...), "record_missing_field"),
        "event_flat_identity": (_with(_with(started, identity=...), request_id="r", rank=0),
                                "record_bad_identity"),
        "event_identity_extra_key": (_identity(started, pid=1), "record_bad_identity"),
        "event_generation_as_hex": (_identity(started, worker_generation="c04e8b2f71a95d3e"),
                                    "record_bad_number"),
        "event_rank_bool": (_identity(started, rank=True), "record_bad_number"),
        "event_request_id_non_ascii": (_identity(started, request_id="r\u00e9q"),
                                       "record_bad_request_id"),
        "event_transfer_id_kind": (_with(started, transfer_id=restored["receipt_id"]),
                                   "record_bad_scoped_id"),
        "event_transfer_id_leading_zero": (
            _with(started, transfer_id=started["transfer_id"].replace(":t:4", ":t:04")),
            "record_bad_scoped_id"),
        "event_transfer_id_uppercase": (_with(started, transfer_id=started["transfer_id"]
                                              .upper().replace(":T:", ":t:")),
                                        "record_bad_scoped_id"),
        "event_preserve_h2d": (_with(preserve, direction="h2d"), "record_rule_broken"),
        "event_receipt_other_process": (
            _with(restored, receipt_id=f"{other}:k:4"), "record_rule_broken"),
        "event_failed_with_shutdown": (
            _with(_with(started, event="transfer_failed", block_count=...),
                  terminal_reason="host_shutdown"), "record_rule_broken"),
        "event_requeue_without_epoch": (_identity(ev_req, recovery_epoch=None),
                                        "record_rule_broken"),
        "event_epoch_zero": (_identity(ev_req, recovery_epoch=0), "record_bad_number"),
        "event_associated_unsorted": (
            _with(ev_first, associated_transfer_ids=[f"{other}:t:9",
                                                     ev_first["associated_transfer_ids"][0]]),
            "record_rule_broken"),
        "event_zero_blocks": (_with(started, block_count=0), "record_bad_number"),
        "event_unknown_direction": (_with(started, event="transfer_started", block_count=...,
                                          bytes_moved=1, direction="d2d"), "record_bad_enum"),
        "event_no_timestamp": (_with(started, observed_at_ns=...), "record_missing_field"),
        # kv-transfer-host-fact v1
        "fact_wrong_scope": (_with(fact_adm, scope="correlated"), "record_noncanonical"),
        "fact_job_ids_unsorted": (_with(fact_adm, job_ids=[8, 7]), "record_bad_roster"),
        "fact_job_ids_duplicate": (_with(fact_adm, job_ids=[7, 7]), "record_bad_roster"),
        "fact_job_ids_bool": (_with(fact_adm, job_ids=[True]), "record_bad_number"),
        "fact_job_ids_empty": (_with(fact_adm, job_ids=[]), "record_noncanonical"),
        "fact_unknown_key": (_with(fact_adm, unexpected="0xdeadbeef"),
                             "record_unexpected_field"),
        "fact_receipt_with_rank": (_with(fact_rcpt, rank=0), "record_unexpected_field"),
        "fact_process_uuid_short": (_with(fact_rcpt, process_uuid="51c9e07a"),
                                    "record_bad_scoped_id"),
        "fact_unknown_requeue_reason": (
            _with(_event("v1-host-2rank-complete", "recovery_requeued"), requeue_reason="oom"),
            "record_bad_enum"),
        # kv-transfer-correlated-host v2
        "correlated_worker_as_pair": (_with(c_rcpt, workers=[[0, w0["worker_generation"]]]),
                                      "record_bad_roster"),
        "correlated_worker_extra_key": (_with(c_rcpt, workers=[dict(w0, pid=1), w1]),
                                        "record_bad_roster"),
        "correlated_workers_unsorted": (_with(c_rcpt, workers=[w1, w0]), "record_bad_roster"),
        "correlated_roster_job_extra_key": (
            _with(c_adm, roster=[dict(c_adm["roster"][0], epoch=1)]), "record_bad_roster"),
        "correlated_unexpected_field": (_with(c_sub, workers=[w0]), "record_unexpected_field"),
        "correlated_missing_field": (_with(c_sub, block_count=...), "record_missing_field"),
        "correlated_generation_upper": (
            _with(c_sub, worker_generation=c_sub["worker_generation"].upper()),
            "record_bad_generation"),
        "correlated_unknown_key": (_with(c_sub, contract="vllm.kv-transfer.observer.v2"),
                                   "record_unexpected_field"),
        "correlated_null": (_with(c_sub, compute_kind=None), "record_noncanonical"),
        # names this project once assumed: not the plugin's schemas
        "assumed_host_fact_name": (_with(fact_adm, schema="vllm-hust.host-fact.v1"),
                                   "line_unknown_schema"),
        "assumed_correlated_name": (_with(c_sub, schema="vllm-hust.correlated-host.v2"),
                                    "line_unknown_schema"),
    }


def test_every_line_the_plugin_would_refuse_is_refused_with_its_reason(tmp_path, capsys):
    cases = refusals()
    for name, (record, reason) in cases.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text(dump([record]) + Path(fixture("correlated-2rank-complete")).read_text())
        code, s = run(capsys, str(f), "-o", str(tmp_path / "o.json"))
        assert (code, s["refused"]) == (1, {reason: 1}), name
        assert s["records"] == 9, name  # the good lines are still used


def test_damaged_lines_are_counted_by_reason(tmp_path, capsys):
    good = Path(fixture("correlated-2rank-complete")).read_text().splitlines()
    f = tmp_path / "damaged.jsonl"
    f.write_text("\n".join([
        good[0].replace('"schema"', '"schema":1,"schema"'),  # duplicate key
        good[1].replace('"observed_at_ns":', '"x":NaN,"observed_at_ns":'),
        "[1, 2]", "not json at all", json.dumps({"schema": "vllm-hust.kv-transfer-event.v1"}),
        '{"schema":"vllm-hust.kv-transfer-event.v2","pad":"' + "x" * (1 << 20) + '"}',
        *good[2:], good[0][: len(good[0]) // 2],  # the writer was cut off mid-line
    ]))
    code, s = run(capsys, str(f), "-o", str(tmp_path / "o.json"))
    assert code == 1
    assert s["refused"] == {"line_duplicate_key": 1, "line_non_finite_number": 1,
                            "line_not_object": 1, "line_not_json": 1,
                            "line_unknown_schema": 1, "line_too_large": 1,
                            "line_truncated": 1}
    assert s["records"] == len(good) - 2


def test_a_repeated_record_is_an_anomaly_used_once(tmp_path, capsys):
    f = tmp_path / "twice.jsonl"
    text = Path(fixture("correlated-2rank-complete")).read_text()
    receipt = next(x for x in text.splitlines() if "transfer_receipt" in x)
    f.write_text(text + receipt + "\n")
    code, s = run(capsys, str(f), "-o", str(tmp_path / "o.json"))
    assert code == 1 and s["anomalies"] == {"duplicate_record": 1}
    assert_as_emitted("correlated-2rank-complete", read_spans(str(tmp_path / "o.json")))


def test_nothing_usable_and_unreadable_files(tmp_path, capsys):
    junk = tmp_path / "junk.jsonl"
    junk.write_text("{{{\n")
    assert cli.main(["import-hust", str(junk), "-o", str(tmp_path / "x.json")]) == 2
    assert "no usable record" in capsys.readouterr().err
    assert cli.main(["import-hust", str(tmp_path / "missing.jsonl")]) == 2
    code, s = run(capsys, fixture("correlated-2rank-complete"), str(tmp_path / "missing.jsonl"),
                  "-o", str(tmp_path / "o"))
    assert code == 1 and s["unreadable"] == [str(tmp_path / "missing.jsonl")]


def test_import_to_an_otlp_endpoint_from_the_command_line(tmp_path):
    with HttpReceiver() as rx:
        res = run_cli("import-hust", fixture("correlated-2rank-complete"), "--otlp-endpoint",
                      rx.endpoint, "-o", str(tmp_path / "o.json"))
        received = list(rx.store.spans)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    written = read_spans(str(tmp_path / "o.json"))
    assert sorted((s.trace_id, s.span_id) for s in received) == sorted(
        (s.trace_id, s.span_id) for s in written)
    assert_as_emitted("correlated-2rank-complete", received)


def test_help_and_usage_errors():
    res = run_cli("import-hust", "--help")
    assert res.returncode == 0
    assert "vllm-hust.kv-transfer-correlated-host.v2" in "".join(res.stdout.split())
    res = run_cli("import-hust")
    assert res.returncode == 2 and "FILE" in res.stderr
