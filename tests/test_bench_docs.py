"""The benchmark figures of README.md and docs/benchmarks.md come from the
committed results file (benchmarks/results/latest.json, written by
``make bench``) through benchmarks/report.py; the renderer and its CLI."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
# `benchmarks` is not installed (kvobs_otel is): import it from this checkout
# whichever way pytest was started.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchmarks.__main__ as bench_main  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks.common import Goal, Result, Spread  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "latest.json"


def test_docs_agree_with_committed_results(capsys: pytest.CaptureFixture[str]) -> None:
    # Committed with the figures it backs: its absence is a failure.
    assert RESULTS.exists(), "benchmarks/results/latest.json is missing (`make bench`)"
    rc = report.main(["--check", "--root", str(REPO)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err


# -- a results file made in the test -------------------------------------------------------
def _goals() -> dict[str, list[Goal]]:
    return {
        "B1": [Goal("disabled/uninstrumented time per seam call",
                    Spread(1.0031, 0.926, 1.1, 0.81, 1.3, 1400), "<=", 1.02),
               Goal("enabled cost per event", Spread(1.134, 0.871, 1.36, 0.5, 2.9, 200), "<=",
                    2.0, unit=" us", fmt=".2f"),
               Goal("naive SDK span / enabled", Spread(25.64, 21.7, 31.8, 12.0, 40.1, 200),
                    ">=", 8.0, fmt=".1f")],
        "B3": [Goal("highest zero-drop span rate", Spread(25000, 21250, 27500, 17500, 30000, 3),
                    ">=", 20000.0, unit=" spans/s", fmt=".0f", note="default buffer")],
    }


def _sample() -> dict[str, Any]:
    results = {}
    for bench, goals in _goals().items():
        res = Result(bench, f"title of {bench}", goals,
                     [f"{bench} info one: 5.52 us", f"{bench} info `two` | *x*"],
                     {"raw": [1, 2, 3]}, 12.3)
        results[bench] = res.as_json()
    goals = [g for r in results.values() for g in r["goals"]]
    met = sum(g["met"] for g in goals)
    full = {"schema": 1, "command": ["python", "-m", "benchmarks", "--record"],
            "quick": False,
            "machine": {"timestamp_utc": "2026-12-05T10:11:12.345678+00:00", "cpu_count": 2,
                        "load_average": [1.5, 2.25, 3.0], "load_average_end": [2.0, 2.5, 3.125],
                        "vllm": "0.34.0", "git_commit": "0123456789abcdef" * 2 + "01234567",
                        "git_dirty": False},
            "results": results, "errors": {}, "skipped": {}, "seconds": 461.2,
            "goals_total": len(goals), "goals_met": met, "all_goals_met": met == len(goals)}
    return bench_main.recorded(full)


def _row(text: str, goal_name: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith("| ") and goal_name in line]
    assert len(rows) == 1, rows
    return rows[0]


def _root(tmp_path: Path, results: dict[str, Any] | None) -> Path:
    """A copy of the repository's two documents (with their markers) and, when
    given, a results file at the default place."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    shutil.copy(REPO / "README.md", root / "README.md")
    shutil.copy(REPO / "docs" / "benchmarks.md", root / "docs" / "benchmarks.md")
    if results is not None:
        path = root / "benchmarks" / "results" / "latest.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(results, indent=1))
    return root


def _run(root: Path, *args: str) -> int:
    return report.main([*args, "--root", str(root)])


def test_goal_rows_show_the_figures_the_goal_lines_printed() -> None:
    sample = _sample()
    text = report.render_readme(sample, "benchmarks/results/latest.json")
    for bench, goals in _goals().items():
        for goal in goals:
            # Goal.line: "B1 name: <spread text>; goal <op target>: MET"
            line = goal.line(bench)
            figure = line[len(f"{bench} {goal.name}: "):line.index("; goal ")]
            target = line[line.index("; goal ") + 7:line.rindex(": ")]
            assert _row(text, goal.name) == (f"| {bench} | {goal.name} | {figure} | {target} | "
                                             f"{'MET' if goal.met else 'NOT MET'} |")
    assert "1.003x (IQR 0.926-1.100, min-max 0.810-1.300, n=1400)" in text
    assert "1.13 us (IQR 0.87-1.36" in text
    assert "25.6x (IQR 21.7-31.8" in text
    assert "25000 spans/s (IQR 21250-27500, min-max 17500-30000, n=3) | >= 20000 spans/s" in text


def test_header_cites_the_file_and_the_run() -> None:
    text = report.render_readme(_sample(), "benchmarks/results/latest.json")
    head = text.splitlines()[0]
    for part in ("`benchmarks/results/latest.json`", "`python -m benchmarks --record`",
                 "commit 0123456 ", "2026-12-05 10:11 UTC", "vLLM 0.34.0", "2 CPUs",
                 "1.50/2.25/3.00 at the start", "2.00/2.50/3.12 at the end", "461 s",
                 "4 of 4 goal lines met"):
        assert part in head, part
    dirty = _sample()
    dirty["machine"]["git_dirty"] = True
    assert "0123456 with uncommitted changes" in report.render_readme(dirty, "f.json")


def test_a_changed_figure_changes_the_rendering() -> None:
    before = _sample()
    after = copy.deepcopy(before)
    after["results"]["B1"]["goals"][0]["spread"]["median"] = 1.0107
    for render in (report.render_readme, report.render_docs):
        a, b = render(before, "f.json"), render(after, "f.json")
        assert "1.003x (IQR" in a and "1.011x (IQR" not in a
        assert "1.011x (IQR" in b and "1.003x (IQR" not in b


def test_a_goal_not_met_shows_not_met() -> None:
    sample = _sample()
    goal = sample["results"]["B3"]["goals"][0]
    goal["spread"]["median"] = goal["value"] = 17500
    goal["met"] = False
    sample["goals_met"] -= 1
    text = report.render_readme(sample, "f.json")
    assert _row(text, "highest zero-drop span rate").endswith("| NOT MET |")
    assert _row(text, "enabled cost per event").endswith("| MET |")
    assert "3 of 4 goal lines met" in text


def test_docs_block_has_info_lines_verbatim_notes_errors_and_skips() -> None:
    sample = _sample()
    sample["errors"] = {"B2": "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n"}
    sample["skipped"] = {"B5": "benchmarks.b5_real_engine not present"}
    text = report.render_docs(sample, "benchmarks/results/latest.json")
    assert "- `B1 info one: 5.52 us`" in text
    assert "- ``B3 info `two` | *x*``" in text
    assert "goal note, highest zero-drop span rate: default buffer" in text
    assert "B2 could not run: `RuntimeError: boom`" in text
    assert "B5 skipped: benchmarks.b5_real_engine not present." in text
    assert "| B2 | (could not run) |" in report.render_readme(sample, "f.json")


def test_write_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path, _sample())
    assert _run(root, "--check") == 1  # the repository's blocks are not this sample's
    assert _run(root, "--write") == 0
    capsys.readouterr()
    assert _run(root, "--check") == 0
    assert _run(root) == 0  # --check is the default
    readme = (root / "README.md").read_text()
    docs = (root / "docs" / "benchmarks.md").read_text()
    assert "Figures from `benchmarks/results/latest.json`" in readme
    assert "| B1 | enabled cost per event | 1.13 us" in readme
    assert "- `B1 info one: 5.52 us`" in docs
    # Everything outside the blocks is the repository's text, unchanged.
    for doc, text in (("README.md", readme), ("docs/benchmarks.md", docs)):
        markers = report.README_MARKERS if doc == "README.md" else report.DOCS_MARKERS
        orig = (REPO / doc).read_text()
        head, _, tail = report.split(orig, markers, doc)
        assert text.startswith(head) and text.endswith(tail)


def test_check_on_a_tampered_copy_fails_with_a_diff(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path, _sample())
    assert _run(root, "--write") == 0
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("1.13 us (IQR", "0.46 us (IQR"))
    capsys.readouterr()
    assert _run(root, "--check") == 1
    out = capsys.readouterr().out
    assert "-| B1 | enabled cost per event | 0.46 us" in out
    assert "+| B1 | enabled cost per event | 1.13 us" in out
    assert "python -m benchmarks.report --write" in out
    # Only the tampered document differs.
    assert "--- README.md (now)" in out
    assert "--- docs/benchmarks.md" not in out


def test_check_sees_a_new_results_file(tmp_path: Path) -> None:
    root = _root(tmp_path, _sample())
    assert _run(root, "--write") == 0
    newer = _sample()
    newer["results"]["B3"]["goals"][0]["spread"]["p75"] = 28750
    (root / "benchmarks" / "results" / "latest.json").write_text(json.dumps(newer))
    assert _run(root, "--check") == 1


@pytest.mark.parametrize("doc,marker", [("README.md", report.README_MARKERS[1]),
                                        ("docs/benchmarks.md", report.DOCS_MARKERS[0])])
def test_missing_markers_are_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       doc: str, marker: str) -> None:
    root = _root(tmp_path, _sample())
    path = root / doc
    path.write_text(path.read_text().replace(marker, ""))
    before = path.read_text()
    assert _run(root, "--check") == 2
    assert _run(root, "--write") == 2
    assert marker in capsys.readouterr().err
    assert path.read_text() == before


def test_no_results_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path, None)
    assert _run(root, "--check") == 2
    assert "no results file" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["quick", "only", "no_end_load", "totals"])
def test_results_not_from_a_full_recorded_run_are_bad_input(tmp_path: Path, change: str) -> None:
    sample = _sample()
    if change == "quick":
        sample["quick"] = True
    elif change == "only":
        sample["command"] += ["--only", "B2"]
    elif change == "no_end_load":
        del sample["machine"]["load_average_end"]
    else:
        sample["goals_met"] += 1
    assert _run(_root(tmp_path, sample), "--check") == 2


# -- python -m benchmarks --record --------------------------------------------------------
@pytest.mark.parametrize("args", [["--quick"], ["--only", "B2"]])
def test_record_needs_a_full_run(args: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main.main(["--record", *args])
    assert e.value.code == 2


def test_record_writes_the_results_file_without_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = types.ModuleType("fake_bench")
    fake.TITLE = "fake"
    fake.run = lambda quick: Result("B1", "fake", _goals()["B1"], ["an info line"],
                                    {"raw": list(range(1000))}, 1.0)
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(bench_main, "REGISTRY", [("B1", "fake_bench")])
    monkeypatch.setattr(bench_main, "REPO_ROOT", str(tmp_path))
    monkeypatch.setattr(bench_main, "apply_clean_env", lambda: None)
    monkeypatch.setattr(bench_main, "single_thread_torch", lambda: None)
    out = tmp_path / "full.json"
    assert bench_main.main(["--record", "-o", str(out)]) == 0
    full = json.loads(out.read_text())
    recorded = json.loads((tmp_path / "benchmarks" / "results" / "latest.json").read_text())
    assert full["results"]["B1"]["data"] == {"raw": list(range(1000))}
    assert "data" not in recorded["results"]["B1"]
    del full["results"]["B1"]["data"]
    assert recorded == full
    assert len(recorded["machine"]["load_average_end"]) == 3
    assert [g["fmt"] for g in recorded["results"]["B1"]["goals"]] == [".3f", ".2f", ".1f"]
    assert recorded["command"][-3:] == ["--record", "-o", str(out)]
    # What it wrote renders.
    text = report.render_readme(recorded, "f.json")
    assert "25.6x (IQR 21.7-31.8" in text and "3 of 3 goal lines met" in text
    # Without --record nothing is recorded.
    os.remove(tmp_path / "benchmarks" / "results" / "latest.json")
    assert bench_main.main(["-o", str(out)]) == 0
    assert not (tmp_path / "benchmarks" / "results" / "latest.json").exists()
