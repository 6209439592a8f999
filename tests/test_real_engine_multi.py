"""The OffloadingConnector inside vLLM's MultiConnector in a real engine:
``vllm serve`` (the CPU build, TP 2) with MultiConnector([OffloadingConnector,
another connector]) under load from the ``openai`` client. The other
connector is harness/companion.py (vLLM's DecodeBenchConnector serving
re-admissions; the stand-in for Nixl, LMCache...), second, so it serves the
re-admissions the OffloadingConnector's small CPU tier cannot. Judged against
vLLM's own counters (preemptions, CPU->device transfers and bytes) and the
other connector's own ledger of what it claimed."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from oracle import assert_engine_traces_match_vllm
from test_real_engine import otel_env, serve_once

from kvobs_otel.tools.harness import companion
from kvobs_otel.tools.harness.config import OFFLOADING
from kvobs_otel.tools.harness.server import ServeConfig, engine_available
from kvobs_otel.tools.otlp_file import read_spans

from chains import episodes

SKIP = engine_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

# A CPU tier smaller than the working set: it still holds some preempted
# requests' blocks at their re-admission and has evicted others'.
CPU_BYTES = 3 << 20


@pytest.fixture(scope="module")
def model() -> str:
    from kvobs_otel.tools.harness.model_files import ensure_model

    return ensure_model()


def test_inside_multiconnector_a_real_engine_is_traced_and_accounted_as_vllm_counted(
        stack, model, tmp_path):
    service = "kvobs-engine-multi"
    endpoint = f"http://127.0.0.1:{stack.ports['otlp_grpc']}"
    out, ledger = tmp_path / "spans.otlp.jsonl", tmp_path / "companion.jsonl"
    cfg = ServeConfig(observe="plugin", cpu_bytes=CPU_BYTES,
                      multi=(OFFLOADING, companion.config(ledger=str(ledger))))
    # (3 s: the drain thread hands the last events over before vLLM stops)
    truth, _result = serve_once(
        model, tmp_path, cfg, {**otel_env(endpoint, service), "KVOBS_OTEL_TRACES_FILE": str(out)},
        service, settle_s=3.0)
    assert truth.preemptions > 0, "no KV pressure: nothing to observe"

    # One recovery per preemption vLLM counted; every CPU->device transfer
    # vLLM counted, with its bytes, on both ranks; admissions and first
    # computes: as without MultiConnector.
    spans = read_spans(str(out))
    assert_engine_traces_match_vllm(truth, spans)
    roots = [root.attrs for root, _ in episodes(spans)]
    assert len(roots) == truth.preemptions
    # The preemption hook found the OffloadingConnector inside (issue 33:
    # 0 of 11 episodes had it): every episode says what was discarded.
    assert all("kvobs.tokens.discarded" in a for a in roots), roots

    # What the other connector claimed at each re-admission, as its own
    # ledger says, is that connector's, not the device prefix cache's.
    claimed: Counter[str] = Counter()
    for line in ledger.read_text().splitlines() if ledger.exists() else ():
        row = json.loads(line)
        claimed[row["request"]] += row["tokens"]
    resumed = [a for a in roots if "kvobs.tokens.restored" in a]
    other: Counter[str] = Counter()
    for a in resumed:
        other[a["kvobs.request.id"]] += a["kvobs.tokens.other_connector"]
        held = (a["kvobs.tokens.resident"] + a["kvobs.tokens.restored"]
                + a["kvobs.tokens.other_connector"])
        assert a["kvobs.tokens.recomputed"] == max(0, a["kvobs.tokens.discarded"] - held), a
    assert +other == claimed
    print(f"MultiConnector real engine: {truth.preemptions} preemptions, {len(roots)} episodes, "
          f"{truth.loads} restores ({truth.load_bytes} B) as vLLM counted; tokens "
          + str({k: sum(a.get(f"kvobs.tokens.{k}", 0) for a in roots) for k in (
              "discarded", "restored", "other_connector", "resident", "recomputed")})
          + f"; the other connector's ledger: {sum(claimed.values())} tokens, "
          f"{len(claimed)} requests")
    # Both served re-admissions in this run: the CPU tier restored some
    # (vLLM counted the transfers) and the other connector the rest.
    assert truth.loads > 0 and sum(a["kvobs.tokens.restored"] for a in resumed) > 0
    assert claimed, "the other connector served no re-admission"
