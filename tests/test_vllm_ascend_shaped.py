"""vllm-ascend's connector shape (stand-in; no NPU here) through the real-vLLM
CPU harness: the automatic instrumentation reaches its subclasses and the
traces are the same as with the base OffloadingConnector."""

from __future__ import annotations

from collections import Counter

import pytest

from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig

from chains import assert_recovered_chain, by_trace, episodes, view
from test_vllm_episodes import start_recovery

pytestmark = pytest.mark.vllm

ASCEND = {"connector": "AscendOffloadingConnector",
          "connector_module_path": "vllm_ascend_shaped"}


def shape(spans) -> Counter:
    """The trace without ids and times: what, where, parent, on which rank."""
    views = [view(s) for s in spans]
    names = {v.span_id: v.name for v in views}
    return Counter((v.name, names.get(v.parent_id), v.attrs.get("kvobs.rank"),
                    v.attrs.get("kvobs.direction"), v.attrs.get("kvobs.job.role"),
                    v.attrs.get("kvobs.outcome")) for v in views)


def run(telemetry, **connector) -> list:
    telemetry.exporter.clear()
    with Harness(HarnessConfig(num_ranks=2, **connector)) as h:
        start_recovery(h, "asc", prompt_len=80)
        h.add_request("plain", 48, max_tokens=6)
        h.run_until_idle(400)
    current_pipeline().flush()
    return telemetry.spans()


def test_ascend_shaped_connector_gives_the_same_traces_as_the_base(observe, monkeypatch):
    import vllm_ascend_shaped
    from vllm.platforms import current_platform

    base = run(observe)
    monkeypatch.setattr(current_platform, "device_type", "npu")
    calls = vllm_ascend_shaped.AscendOffloadingConnectorWorker.register_calls
    ascend = run(observe, **ASCEND)
    assert vllm_ascend_shaped.AscendOffloadingConnectorWorker.register_calls == calls + 2
    assert shape(ascend) == shape(base)
    ((_root, trace),) = episodes(ascend)
    assert_recovered_chain(trace, {0, 1})
    workers = {(v.resource["kvobs.rank"], v.resource["kvobs.host.adapter"],
                v.resource["kvobs.device.type"]) for v in map(view, ascend)
               if v.resource.get("kvobs.role") == "worker"}
    assert workers == {(0, "vllm-ascend", "npu"), (1, "vllm-ascend", "npu")}
    assert len(by_trace(ascend)) == len(by_trace(base))
