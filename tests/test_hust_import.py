"""``kvobs-otel import-hust``: the vLLM-HUST plugin's JSONL evidence -> spans.

The golden files are written by the tests themselves, in each of the three
schemas, with the stand-in writer (``tests/standins/vllm_hust_contract/
jsonl.py``; the fork's real field layout could not be checked here, see its
docstring), then damaged on purpose: truncated lines, duplicate keys,
unknown schemas and versions.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from vllm_hust_contract import chains, jsonl

from kvobs_otel import cli
from kvobs_otel.analysis.episodes import rebuild
from kvobs_otel.otlp_file import read_spans

from chains import by_trace
from conftest import run_cli
from otlp_receiver import HttpReceiver


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "KVOBS_")):
            monkeypatch.delenv(k)


def write(directory: Path, chain: chains.Chain, host_facts: bool = True) -> list[str]:
    return sorted(str(p) for p in jsonl.write_chain_files(directory, chain, host_facts))


def run(capsys, *args: str) -> tuple[int, dict]:
    code = cli.main(["import-hust", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip().startswith("{") else {}


def test_v2_files_import_as_complete_joined_episodes(tmp_path, capsys):
    files = write(tmp_path / "in", chains.recovery_chain())
    out = tmp_path / "spans.json"
    code, s = run(capsys, *files, "-o", str(out))
    assert code == 0, s
    assert (s["files"], s["processes"], s["records"], s["refused"]) == (3, 3, 18, {})
    spans = read_spans(str(out))
    assert len(spans) == s["spans"]
    episodes = rebuild(spans)
    assert [(e.epoch, e.outcome, e.complete) for e in episodes] == [
        (1, "recovered", True), (2, "recovered", True)]
    # Each process keeps its identity: pid and process start id on its resource.
    pids = {(sp.resource["process.pid"], sp.resource["kvobs.process.start_id"])
            for sp in spans}
    assert pids == {(p.pid, p.start_id) for p in (chains.SCHEDULER, *chains.WORKERS.values())}


def test_each_schema_golden(tmp_path, capsys):
    """One file per schema: the host facts alone, v1 records, v2 records."""
    v2_files = write(tmp_path / "v2", chains.recovery_chain(), host_facts=False)
    v1_files = write(tmp_path / "v1", chains.v1_recovery_chain(), host_facts=False)
    facts = tmp_path / "facts.jsonl"
    with jsonl.JsonlWriter(facts, pid=1, process_start_id="ab" * 16) as w:
        w.write_host_fact(jsonl.host_fact_for(chains.SCHEDULER))
    assert {json.loads(line)["schema"] for f in v2_files
             for line in Path(f).read_text().splitlines()} == {
        jsonl.CORRELATED_SCHEMA}
    assert {json.loads(line)["schema"] for f in v1_files
             for line in Path(f).read_text().splitlines()} == {
        jsonl.TRANSFER_EVENT_SCHEMA}

    code, _ = run(capsys, str(facts), "-o", str(tmp_path / "f.json"))
    assert code == 2  # a host fact is no record: nothing to import
    code, s = run(capsys, *v1_files, "-o", str(tmp_path / "v1.json"))
    assert code == 0 and s["processes"] == 3
    v1_eps = rebuild(read_spans(str(tmp_path / "v1.json")))
    assert [(e.join_scope, e.complete) for e in v1_eps] == [("process", True)] * 2
    code, s = run(capsys, *v2_files, "-o", str(tmp_path / "v2.json"))
    assert code == 0
    assert all(e.complete for e in rebuild(read_spans(str(tmp_path / "v2.json"))))


def test_damaged_lines_are_refused_counted_and_the_rest_imported(tmp_path, capsys):
    files = write(tmp_path, chains.recovery_chain())
    sched = next(f for f in files if "scheduler" in f)
    good = Path(sched).read_text().splitlines()
    template = json.loads(good[-1])
    start = template["process_start_id"]

    def line(**changes) -> str:
        return json.dumps({**template, "seq": 1000 + len(extra), **changes})

    extra: list[str] = []
    extra.append("this is not json")
    extra.append('["a", "json", "array"]')
    extra.append(line().replace('"pid": ', '"pid": 1, "pid": ', 1))  # duplicate key
    extra.append(line(schema="vllm-hust.correlated-host.v3"))
    extra.append(line(contract="vllm.kv-transfer.observer.v3"))
    extra.append(line(api_version="2.1"))
    extra.append(line(process_start_id="not-hex"))
    extra.append(line(recovery_epoch=0))
    extra.append(line(request_id="req-\u00e9"))
    extra.append(json.dumps({**template}))  # same seq as an earlier line
    truncated = line()[:40]  # the writer was cut off mid-line: no newline
    Path(sched).write_text("\n".join(good + extra) + "\n" + truncated)
    code, s = run(capsys, *files, "-o", str(tmp_path / "out.json"))
    assert code == 1
    assert s["refused"] == {
        "contract_unknown": 1, "contract_unknown_api_version": 1, "line_bad_identity": 1,
        "line_duplicate_key": 1, "line_duplicate_seq": 1, "line_not_json": 1,
        "line_not_object": 1, "line_truncated": 1, "line_unknown_schema": 1,
        "record_bad_number": 1, "record_bad_request_id": 1}
    assert s["records"] == 18 and start
    assert all(e.complete for e in rebuild(read_spans(str(tmp_path / "out.json"))))


def test_clocks_of_different_processes_never_order_records(tmp_path, capsys):
    """Worker 1's clock is set far before the scheduler's and its lines are
    shuffled; the files are given in another order: the same traces result."""
    base = write(tmp_path / "a", chains.recovery_chain())
    code, s = run(capsys, *base, "-o", str(tmp_path / "a.json"))
    assert code == 0
    shifted = write(tmp_path / "b", chains.recovery_chain())
    w1 = next(f for f in shifted if "worker-1" in f)
    lines = [json.loads(x) for x in Path(w1).read_text().splitlines()]
    for obj in lines:
        obj["observed_at_ns"] -= 986_000_000_000  # now "earlier" than everyone
    random.Random(4).shuffle(lines)
    Path(w1).write_text("".join(json.dumps(o) + "\n" for o in lines))
    code, s2 = run(capsys, *reversed(shifted), "-o", str(tmp_path / "b.json"))
    assert code == 0 and s2["spans"] == s["spans"]

    def shape(path: Path) -> list:
        out = []
        for trace in by_trace(read_spans(str(path))).values():
            names = {v.span_id: v.name for v in trace}
            out.append(sorted((v.name, names.get(v.parent_id), v.attrs.get("kvobs.rank"),
                               v.attrs.get("kvobs.outcome")) for v in trace))
        return sorted(out)

    assert shape(tmp_path / "a.json") == shape(tmp_path / "b.json")


def test_spans_are_anchored_to_their_own_file(tmp_path, capsys):
    files = write(tmp_path, chains.recovery_chain())
    anchors = {}
    for i, f in enumerate(files):
        anchors[f] = 1_700_000_000_000_000_000 + i * 3_600_000_000_000  # hours apart
        os.utime(f, ns=(anchors[f], anchors[f]))
    out = tmp_path / "out.json"
    assert run(capsys, *files, "-o", str(out))[0] == 0
    by_file = {}
    for sp in read_spans(str(out)):
        (f,) = sp.resource["kvobs.import.files"]
        by_file.setdefault(f, []).append(sp)
    for f, spans in by_file.items():
        # The process's last record is written at its file's mtime.
        assert max(sp.end_ns for sp in spans) == anchors[f]
        assert min(sp.start_ns for sp in spans) > anchors[f] - 60 * 10**9


def test_restarted_worker_and_a_dropped_stage(tmp_path, capsys):
    files = write(tmp_path / "r", chains.restarted_worker_chain())
    code, s = run(capsys, *files, "-o", str(tmp_path / "r.json"))
    assert code == 0 and s["processes"] == 4
    assert all(e.complete for e in rebuild(read_spans(str(tmp_path / "r.json"))))

    files = write(tmp_path / "d", chains.dropped_stage("restore_completed", epoch=2, rank=1))
    code, s = run(capsys, *files, "-o", str(tmp_path / "d.json"))
    assert code == 0  # every line was usable; the chain itself is incomplete
    eps = {e.epoch: e for e in rebuild(read_spans(str(tmp_path / "d.json")))}
    assert eps[1].complete and not eps[2].complete
    unfinished = [sp for sp in read_spans(str(tmp_path / "d.json"))
                  if sp.attributes.get("kvobs.outcome") == "unfinished"]
    assert len(unfinished) == 1 and unfinished[0].error


def test_duplicated_lines_count_as_anomalies(tmp_path, capsys):
    files = write(tmp_path, chains.duplicated_stage("transfer_receipt", epoch=1))
    code, s = run(capsys, *files, "-o", str(tmp_path / "o.json"))
    assert code == 1 and s["anomalies"] == {"duplicate_record": 1}
    assert all(e.complete for e in rebuild(read_spans(str(tmp_path / "o.json"))))


def test_a_process_writing_both_contracts_is_read_once_through_v2(tmp_path, capsys):
    v2_chain = chains.recovery_chain()
    v1_chain = chains.v1_recovery_chain()
    files = write(tmp_path, v2_chain + v1_chain)  # same processes, both schemas
    code, s = run(capsys, *files, "-o", str(tmp_path / "o.json"))
    assert code == 0 and s["superseded_v1"] == len(v1_chain)
    single = write(tmp_path / "single", v2_chain)
    _, s_single = run(capsys, *single, "-o", str(tmp_path / "single.json"))
    assert s["spans"] == s_single["spans"]


def test_nothing_usable_and_unreadable_files(tmp_path, capsys):
    junk = tmp_path / "junk.jsonl"
    junk.write_text("{{{\n")
    assert cli.main(["import-hust", str(junk), "-o", str(tmp_path / "x.json")]) == 2
    assert "no usable record" in capsys.readouterr().err
    assert cli.main(["import-hust", str(tmp_path / "missing.jsonl")]) == 2
    files = write(tmp_path / "ok", chains.recovery_chain())
    code, s = run(capsys, *files, str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o"))
    assert code == 1 and s["unreadable"] == [str(tmp_path / "missing.jsonl")]


def test_import_to_an_otlp_endpoint_from_the_command_line(tmp_path):
    files = write(tmp_path, chains.recovery_chain())
    with HttpReceiver() as rx:
        res = run_cli("import-hust", *files, "--otlp-endpoint", rx.endpoint, "-o",
                      str(tmp_path / "o.json"))
        received = list(rx.store.spans)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    written = read_spans(str(tmp_path / "o.json"))
    assert sorted((s.trace_id, s.span_id) for s in received) == sorted(
        (s.trace_id, s.span_id) for s in written)
    assert all(e.complete for e in rebuild(received))


def test_help_and_usage_errors():
    res = run_cli("import-hust", "--help")
    assert res.returncode == 0 and "correlated-host.v2" in res.stdout
    res = run_cli("import-hust")
    assert res.returncode == 2 and "FILE" in res.stderr
