"""vLLM's own tests of the OffloadingConnector, stock and with kvobs-otel on.

The tests are the release's own (``tests/v1/kv_connector/unit/
offloading_connector/`` of its source distribution on the package registry,
fetched once by .ci/setup-vllm-tests.sh), run against this environment's
vLLM twice in child processes: stock, and with kvobs-otel instrumented before
any test builds a connector (tests/vllm_own/kvobs_suite_plugin.py). Every
test must end the same way in both runs: whatever vLLM's own tests observe of
the connector (its scheduler output, metadata, worker results, events,
metrics) kvobs-otel leaves as it was. Some tests fail or are skipped stock on
this CPU machine; they must fail or be skipped alike with kvobs-otel on.

The tests build their vLLM config for ``facebook/opt-125m`` and read its
config.json from the Hugging Face Hub, which this machine cannot reach: the
runs get an offline Hub cache holding that model's public config.json
(tests/vllm_own/opt-125m-config.json, no weights; ``HF_HUB_OFFLINE=1``), so
those tests run instead of failing on a network wait.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from kvobs_otel.hosts.platform import vllm_version
from kvobs_otel.tools.otlp_file import read_spans

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
SUITE = "tests/v1/kv_connector/unit/offloading_connector"
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_own"
# A child run that takes longer has hung beyond the per-test limit.
RUN_TIMEOUT_S = 1800


def vllm_release() -> str:
    version = vllm_version().split("+")[0]  # (a local build tag is not a release)
    if version == "unknown":
        pytest.fail("vLLM is not importable in this environment")
    return version


def vllm_tests_dir() -> Path:
    """This release's tests (cached; fetched once, as CI's setup does)."""
    proc = subprocess.run(["bash", str(REPO / ".ci" / "setup-vllm-tests.sh"), vllm_release()],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
        out[f"{case.get('classname')}::{case.get('name')}"] = (
            "failed" if outcome == "failure" else outcome)
    return out


def offline_hub(tmp: Path) -> Path:
    """An HF_HOME whose Hub cache holds facebook/opt-125m's config.json."""
    home = tmp / "hf"
    repo = home / "hub" / "models--facebook--opt-125m"
    (repo / "snapshots" / "local").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    (repo / "snapshots" / "local" / "config.json").write_bytes(
        (PLUGIN_DIR / "opt-125m-config.json").read_bytes())
    return home


def start_suite(src: Path, tmp: Path, observed: bool) -> tuple[str, subprocess.Popen, Path]:
    name = "observed" if observed else "stock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVOBS_OTEL_", "OTEL_"))}
    env.update({
        "HF_HOME": str(offline_hub(tmp)), "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep),
        "KVOBS_SUITE_ON": "1" if observed else "0",
        # No general plugin: stock is stock, and on is only our instrument().
        "VLLM_PLUGINS": "",
    })
    if observed:
        # In-process export: its internal error counts are this process's to report.
        env.update({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                    "KVOBS_OTEL_TRACES_FILE": str(tmp / "spans.otlp.jsonl"),
                    "KVOBS_OTEL_EXPORT": "in-process",
                    "KVOBS_SUITE_REPORT": str(tmp / "kvobs-counts.json")})
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "kvobs_suite_plugin",
             "-p", "no:cacheprovider", "--rootdir", str(src),
             f"--confcutdir={src / 'tests/v1/kv_connector/unit'}",
             f"--junitxml={tmp / f'{name}.xml'}", SUITE],
            cwd=src, env=env, stdout=out, stderr=subprocess.STDOUT)
    return name, proc, log


def finish_suite(run: tuple[str, subprocess.Popen, Path], tmp: Path) -> tuple[dict[str, str], str]:
    name, proc, log = run
    try:
        code = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    text = log.read_text(errors="replace")[-4000:]
    assert code in (0, 1), f"{name} run: exit {code}\n{text}"
    return outcomes(tmp / f"{name}.xml"), text


def test_vllm_own_offloading_connector_tests_end_alike_with_kvobs_on(tmp_path):
    src = vllm_tests_dir()
    # Side by side (one core each): the runs do not share state.
    runs = [start_suite(src, tmp_path, observed) for observed in (False, True)]
    try:
        (stock, stock_log), (observed, observed_log) = [finish_suite(r, tmp_path) for r in runs]
    finally:
        for _name, proc, _log in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    counts = {"stock": dict(Counter(stock.values())),
              "kvobs on": dict(Counter(observed.values()))}
    line = f"vLLM {vllm_release()}  its own OffloadingConnector tests: {counts}"
    print(line)
    if os.environ.get("KVOBS_OWN_TESTS_DIR"):  # .ci/test-all.sh prints it in its summary
        Path(os.environ["KVOBS_OWN_TESTS_DIR"], f"{vllm_release()}.txt").write_text(line + "\n")
    assert sum(v == "passed" for v in stock.values()) > 0, stock_log
    differ = {t: (stock.get(t), observed.get(t)) for t in sorted(stock.keys() | observed.keys())
              if stock.get(t) != observed.get(t)}
    assert not differ, (differ, observed_log)
    # kvobs-otel was on and observed the connectors the tests built.
    spans = read_spans(str(tmp_path / "spans.otlp.jsonl"))
    print(f"kvobs-otel: {dict(Counter(s.name for s in spans))}, "
          f"{(tmp_path / 'kvobs-counts.json').read_text()}")
    assert spans, observed_log
    # ... and nothing of what vLLM's tests do to the connector tripped it
    # (a seam's failure is contained, so it would not change an outcome).
    counted = json.loads((tmp_path / "kvobs-counts.json").read_text())
    assert not any(counted["errors"].values()), counted
    assert not any(counted["drops"].values()), counted
