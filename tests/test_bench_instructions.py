"""B6 (benchmarks/b6_instructions.py): what it counts and how it splits it,
without valgrind (the counting itself runs in ``make bench``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import b6_counted, b6_instructions  # noqa: E402
from benchmarks.b6_counted import SEAMS  # noqa: E402

WORKLOAD = {"steps": 10, "forced_preemptions": 2}


def _count(per_step: float, steps: int = 10, events: int = 30,
           workload: dict[str, int] | None = None) -> dict[str, Any]:
    return {"steps": steps, "serving": int(per_step * steps), "workload": workload or WORKLOAD,
            "before": {"events_accepted": 0}, "after": {"events_accepted": events}}


def _counts(added: dict[str, float], base: float = 1_000_000) -> dict[str, dict[str, Any]]:
    """Synthetic counts: disabled at ``base``, each seam adding ``added``."""
    counts = {d: _count(base + 100 * i) for i, d in enumerate(b6_instructions.DISABLED_RUNS)}
    # The tiered pair: three processes each, one enabled+fs far off.
    counts |= {d: _count(2 * base + 100 * i)
               for i, d in enumerate(b6_instructions.DISABLED_FS_RUNS)}
    counts |= {e: _count(2 * base + 5_000 + (40_000 if i == 2 else 0))
               for i, e in enumerate(b6_instructions.ENABLED_FS_RUNS)}
    total = base
    names = list(SEAMS)
    for i, seam in enumerate(names):
        total += added[seam]
        key = "enabled" if i == len(names) - 1 else f"enabled:{','.join(names[:i + 1])}"
        counts[key] = _count(total)
    # The other layouts: enabled over disabled +100 in one, +50,000 in the
    # other (a layout that happens to cost the seams more does not move the
    # median).
    (d2, d3), (e2, e3) = b6_instructions.DISABLED_RUNS[1:], b6_instructions.ENABLED_RUNS[1:]
    counts[e2] = _count(counts[d2]["serving"] / 10 + total - base + 100)
    counts[e3] = _count(counts[d3]["serving"] / 10 + total - base + 50_000)
    return counts


def test_the_variants_add_the_seams_one_at_a_time() -> None:
    full = b6_instructions.variants(quick=False)
    names = list(SEAMS)
    split = [v for v in full if v.startswith("enabled:")]
    assert split == [f"enabled:{','.join(names[:i])}" for i in range(1, len(names))]
    assert full[:3] == list(b6_instructions.DISABLED_RUNS)
    assert {*b6_instructions.ENABLED_RUNS, *b6_instructions.DISABLED_FS_RUNS,
            *b6_instructions.ENABLED_FS_RUNS} <= set(full)
    assert set(b6_instructions.variants(quick=True)) == {
        *b6_instructions.DISABLED_RUNS, *b6_instructions.ENABLED_RUNS, "disabled+fs",
        "enabled+fs"}


def test_the_split_sums_to_the_whole_and_names_each_seam_and_role() -> None:
    added = {seam: 1_000.0 * (i + 1) for i, seam in enumerate(SEAMS)}
    result = b6_instructions._result(_counts(added), quick=False, seconds=1.0)
    assert result.data["per_seam"] == pytest.approx(added)
    whole = sum(added.values())
    for role in ("scheduler", "worker"):
        assert result.data["per_role"][role] == pytest.approx(
            sum(v for s, v in added.items() if SEAMS[s][0] == role))
    # Enabled over disabled layout by layout (the disabled counts themselves
    # 100 apart between layouts): the median of the three.
    pairs = result.data["added_pairs"]
    assert pairs == pytest.approx([whole, whole + 100, whole + 50_000])
    goal, goal_fs = result.goals
    assert goal.value == pytest.approx(whole + 100) and goal.met == (whole + 100 <= 45_000)
    # The tiered pair (vLLM's tier threads make its processes inexact): each
    # enabled+fs over each disabled+fs (0, 100, 200 apart; one enabled+fs
    # 40,000 off): the median of the nine.
    assert len(result.data["added_fs_pairs"]) == 9
    assert goal_fs.value == pytest.approx(5_000)


def test_variants_that_ran_other_steps_are_refused() -> None:
    counts = _counts({seam: 1_000.0 for seam in SEAMS})
    counts["enabled"] = _count(2_000_000, workload={"steps": 10, "forced_preemptions": 3})
    with pytest.raises(RuntimeError, match="not the same workload"):
        b6_instructions._result(counts, quick=False, seconds=1.0)


def test_an_enabled_variant_that_recorded_nothing_is_refused() -> None:
    counts = _counts({seam: 1_000.0 for seam in SEAMS})
    counts["enabled"]["after"] = {"events_accepted": 0}
    with pytest.raises(RuntimeError, match="recorded no event"):
        b6_instructions._result(counts, quick=False, seconds=1.0)


def test_callgrind_totals_are_read_per_thread(tmp_path: Path) -> None:
    prefix = tmp_path / "enabled.cg"
    (tmp_path / "enabled.cg-01").write_text(
        "# callgrind format\nthread: 1\nevents: Ir\nfn=(1) math_fsum\n5 100\ntotals: 12345\n")
    (tmp_path / "enabled.cg-02").write_text("# callgrind format\nthread: 2\ntotals: 0\n")
    (tmp_path / "other.cg-01").write_text("totals: 99\n")
    assert b6_instructions._thread_totals(str(prefix)) == {1: 12345, 2: 0}


@pytest.mark.vllm
def test_every_wrapper_the_instrumentor_installs_is_a_named_seam() -> None:
    # A wrapper added to instrumentor.py and not to b6_counted.SEAMS would make
    # the per-seam split fail (keep_only refuses it): caught here first.
    import kvobs_otel
    from kvobs_otel.config import Settings
    from kvobs_otel.hosts.vllm import patching

    assert kvobs_otel.instrument(Settings(enabled=True, export="in-process"))
    try:
        wrapped = {name for _cls, name, _orig in patching._patches}
        named = set(b6_counted.ALWAYS).union(*(m for _r, m in SEAMS.values()))
        assert wrapped <= named, wrapped - named
        assert {"build_connector_meta", "bind_connector_metadata"} <= wrapped
    finally:
        kvobs_otel.uninstrument()
