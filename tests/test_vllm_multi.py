"""The OffloadingConnector composed in vLLM's real MultiConnector (as P/D and
cache deployments run it) beside another connector that serves KV too
(harness/companion.py: vLLM's DecodeBenchConnector, serving re-admissions),
in either order: traced as alone, and the tokens the other connector brought
back told apart from the device prefix cache's."""

from __future__ import annotations

from collections import Counter

import pytest
from oracle import assert_traces_match_vllm

from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.tools.harness import companion
from kvobs_otel.tools.harness.config import OFFLOADING
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.workload import pressure_workload

from chains import episodes

pytestmark = pytest.mark.vllm

# (children, CPU tier chunks): with the OffloadingConnector first and a CPU
# tier too small for the working set, it restores what the tier still holds
# and the other connector serves the re-admissions it cannot.
ORDERS = {
    "offloading_first": ((OFFLOADING, companion.config()), 5),
    "companion_first": ((companion.config(), OFFLOADING), 256),
}


def run(cfg: HarnessConfig) -> tuple[Harness, dict[str, int]]:
    with Harness(cfg) as h:
        pressure_workload(h)
        h.run_until_idle(2000)
        (other,) = [c for c in h.scheduler.connector._connectors
                    if isinstance(c, companion.CompanionConnector)]
        served = dict(other.connector_scheduler.served)
    current_pipeline().flush()
    return h, served


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_composed_connector_is_traced_and_accounted_as_vllm_served(observe, order):
    children, chunks = ORDERS[order]
    h, served = run(HarnessConfig(num_ranks=2, multi=children, num_cpu_chunks=chunks))
    assert type(h.scheduler.connector).__name__ == "MultiConnector"
    # Every recovery vLLM made, one complete trace (restore jobs, receipts
    # from both ranks, admission, first computes), as without MultiConnector.
    assert assert_traces_match_vllm(h, observe.spans()) >= 1
    roots = [root.attrs for root, _ in episodes(observe.spans())]
    resumed = [a for a in roots if "kvobs.tokens.restored" in a]
    assert resumed and served, (roots, served)
    # The preemption hook found the OffloadingConnector inside: every episode
    # says what its preemption discarded.
    assert all("kvobs.tokens.discarded" in a for a in roots), roots
    # What the other connector claimed at each re-admission, by request, as
    # it counted it itself; nothing of it counted as device prefix cache.
    other = Counter()
    for a in resumed:
        other[a["kvobs.request.id"]] += a["kvobs.tokens.other_connector"]
    assert +other == served
    for a in resumed:
        held = (a["kvobs.tokens.resident"] + a["kvobs.tokens.restored"]
                + a["kvobs.tokens.other_connector"])
        assert a["kvobs.tokens.recomputed"] == max(0, a["kvobs.tokens.discarded"] - held), a
    # The metric says the same.
    assert observe.metric_total("kvobs.recovery.tokens", source="other_connector") == sum(
        served.values())
    if order == "companion_first":
        # It claims every re-admission first: nothing is restored from CPU.
        assert not h.restore_jobs
        assert all(a["kvobs.tokens.restored"] == 0 for a in resumed)
    else:
        assert h.restore_jobs  # the OffloadingConnector restored some itself
    assert not any(current_pipeline().error_counts().values())


def test_the_connector_walk_finds_nested_children_and_stops_on_a_cycle():
    from types import SimpleNamespace

    from kvobs_otel.hosts.vllm.instrumentor import _ATTR, scheduler_seams

    seams = object()
    child = SimpleNamespace(**{_ATTR: seams})
    inner = SimpleNamespace(_connectors=[SimpleNamespace(), child])
    outer = SimpleNamespace(_connectors=[inner])
    assert scheduler_seams(outer) == [(seams, True)]
    assert scheduler_seams(child) == [(seams, False)]
    loop = SimpleNamespace(_connectors=[])
    loop._connectors.append(loop)  # a composition that refers to itself
    assert scheduler_seams(loop) == []
