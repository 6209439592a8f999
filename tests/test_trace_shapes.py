"""The same trace shape on every supported vLLM release.

Each case runs on the real scheduler and connector of the installed release
(CPU harness) and reduces every recovery trace to its shape: which spans,
under which parent, on which rank, with which outcome and which attribute
keys (ids, times and byte counts left out). The shape is checked here against
the span model; with ``KVOBS_SHAPES_DIR`` set (``make test`` sets it), it is
also written there, and ``.ci/compare-shapes.py`` then requires the shapes of
every release to be equal, case by case.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import vllm

from kvobs_otel.hosts.vllm import releases
from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig

from chains import SpanView, by_trace, view
from test_vllm_episodes import start_recovery

pytestmark = pytest.mark.vllm
RELEASE = releases.select(vllm.__version__).release

# Attribute values that are part of the shape (the rest: keys only).
SHAPE_VALUES = ("kvobs.outcome", "kvobs.job.kind", "kvobs.job.role", "kvobs.direction",
                "kvobs.compute.kind", "kvobs.recovery.epoch", "kvobs.job.sync",
                "kvobs.receipt.ranks", "kvobs.receipt.missing_ranks",
                "kvobs.first_compute.ranks", "kvobs.receipt.expected_ranks")


def restore(runner: str, ranks: int = 2) -> None:
    with Harness(HarnessConfig(num_ranks=ranks, model_runner=runner)) as h:
        start_recovery(h, "r")
        h.run_until_idle(400)


def withheld(runner: str) -> None:
    with Harness(HarnessConfig(num_ranks=2, model_runner=runner,
                               stall={"rank": 1, "kind": "load"})) as h:
        start_recovery(h, "w")
        h.run_for(2.0)  # past the fixture's 1 s receipt deadline, stepping
        current_pipeline().flush()


def repeated(runner: str) -> None:
    with Harness(HarnessConfig(num_ranks=2, model_runner=runner)) as h:
        h.add_request("twice", 64, max_tokens=40)
        for _ in range(3):
            h.step()
        h.preempt("twice")
        for _ in range(6):
            h.step()
        h.preempt("twice")
        h.evict_gpu_prefix_cache()
        h.run_until_idle(400)


CASES = {
    "restore": restore,
    "withheld-rank": withheld,
    "repeated-preemption": repeated,
    "four-ranks": lambda runner: restore(runner, ranks=4),
}


def span_shape(s: SpanView, names: dict[int, str]) -> tuple:
    values = tuple((k, _plain(s.attrs[k])) for k in SHAPE_VALUES if k in s.attrs)
    return (s.name, names.get(s.parent_id) if s.parent_id else None, s.attrs.get("kvobs.rank"),
            s.error, tuple(sorted(s.attrs)), values, tuple(sorted(s.events)))


def _plain(value: object) -> object:
    return list(value) if isinstance(value, (list, tuple)) else value


def trace_shape(trace: list[SpanView]) -> list:
    names = {s.span_id: s.name for s in trace}
    counted = Counter(json.dumps(span_shape(s, names)) for s in trace)
    return sorted([json.loads(k), n] for k, n in counted.items())


@pytest.mark.parametrize("runner", RELEASE.runners)
@pytest.mark.parametrize("case", sorted(CASES))
def test_trace_shape(observe, case, runner):
    CASES[case](runner)
    current_pipeline().flush()
    traces = by_trace(observe.spans())
    shapes = []
    for trace in traces.values():
        roots = [s for s in trace if s.name == "kv.recovery"]
        if roots:
            shapes.append(trace_shape(trace))
    assert shapes, "every case makes at least one recovery episode"
    _check_span_model(case, [view(s) for s in observe.spans()])
    out = os.environ.get("KVOBS_SHAPES_DIR")
    if out:
        path = Path(out) / f"{case}.{runner}.{vllm.__version__}.json"
        path.write_text(json.dumps(sorted(shapes, key=json.dumps), indent=1))


def _check_span_model(case: str, spans: list[SpanView]) -> None:
    """The parts of the shape the span model fixes, whatever the release."""
    roots = [s for s in spans if s.name == "kv.recovery"]
    outcomes = sorted(r.attrs["kvobs.outcome"] for r in roots)
    if case == "withheld-rank":
        assert outcomes == ["receipt_incomplete"]
        (job,) = [s for s in spans if s.name == "kv.job" and s.attrs["kvobs.job.kind"] == "load"]
        assert job.error and list(job.attrs["kvobs.receipt.missing_ranks"]) == [1]
    elif case == "repeated-preemption":
        # A second preemption opens epoch 2, in a trace of its own.
        assert sorted(r.attrs["kvobs.recovery.epoch"] for r in roots) == [1, 2]
        assert len({r.trace_id for r in roots}) == 2
        assert outcomes == ["recovered", "recovered"]  # each epoch came back
    else:
        ranks = 4 if case == "four-ranks" else 2
        assert outcomes == ["recovered"]
        fcs = [s for s in spans if s.name == "kv.first_compute"]
        assert sorted(s.attrs["kvobs.rank"] for s in fcs) == list(range(ranks))
        restores = [s for s in spans if s.name == "kv.transfer"
                    and s.attrs["kvobs.direction"] == "h2d"]
        assert sorted(s.attrs["kvobs.rank"] for s in restores) == list(range(ranks))
