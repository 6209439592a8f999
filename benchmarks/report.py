"""``python -m benchmarks.report [--check | --write] [--results FILE] [--root DIR]``

The figures of README.md ("Overhead") and docs/benchmarks.md ("Latest
results") are rendered from one committed results file,
``benchmarks/results/latest.json``, which ``make bench`` writes
(``python -m benchmarks --record``). Each document holds the rendered text
between two markers:

- README.md: ``<!-- bench:readme:begin -->`` ... ``<!-- bench:readme:end -->``
- docs/benchmarks.md: ``<!-- bench:results:begin -->`` ... ``<!-- bench:results:end -->``

``--check`` (the default) compares those blocks with what the results file
renders to; ``--write`` replaces them. The rendering is a pure function of
the results file (and of the path it is cited by). Exit status: 0 the
documents agree (or were written), 1 they differ (a unified diff is printed),
2 bad input (no results file, not a full run's, missing fields, missing or
misplaced markers).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import REPO_ROOT, Spread

RESULTS = os.path.join("benchmarks", "results", "latest.json")
WRITE_HINT = "python -m benchmarks.report --write"

README = "README.md"
DOCS = os.path.join("docs", "benchmarks.md")
README_MARKERS = ("<!-- bench:readme:begin -->", "<!-- bench:readme:end -->")
DOCS_MARKERS = ("<!-- bench:results:begin -->", "<!-- bench:results:end -->")



class BadInput(Exception):
    """The results file or a document cannot be used (exit status 2)."""


# -- the results file ----------------------------------------------------------------------
def load(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise BadInput(f"no results file: {path} (`make bench` writes it: a full run of "
                       "`python -m benchmarks --record`)")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: not a readable JSON file: {e}") from e
    validate(report, path)
    return report


def _need(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise BadInput(f"{where}: missing {key!r}")
    return obj[key]


def validate(report: Any, where: str = "results") -> None:
    """Everything the rendering uses is there, and the file is a full run's."""
    if _need(report, "quick", where):
        raise BadInput(f"{where}: a --quick run's figures are not to be published")
    command = _need(report, "command", where)
    if not isinstance(command, list) or any(a == "--only" or a.startswith("--only=")
                                            for a in command):
        raise BadInput(f"{where}: not a full run (command {command!r})")
    machine = _need(report, "machine", where)
    for key in ("timestamp_utc", "cpu_count", "load_average", "load_average_end", "vllm",
                "git_commit", "git_dirty"):
        _need(machine, key, f"{where}: machine")
    try:
        datetime.datetime.fromisoformat(machine["timestamp_utc"])
    except (TypeError, ValueError) as e:
        raise BadInput(f"{where}: machine.timestamp_utc: {e}") from e
    for key in ("seconds", "goals_total", "goals_met"):
        _need(report, key, where)
    results = _need(report, "results", where)
    goals = 0
    for name, res in results.items():
        for key in ("title", "seconds", "goals", "info"):
            _need(res, key, f"{where}: results.{name}")
        for i, goal in enumerate(res["goals"]):
            for key in ("name", "unit", "op", "target", "met", "spread", "fmt"):
                _need(goal, key, f"{where}: results.{name}.goals[{i}]")
            for key in ("median", "p25", "p75", "min", "max", "n"):
                _need(goal["spread"], key, f"{where}: results.{name}.goals[{i}].spread")
        goals += len(res["goals"])
    met = sum(bool(g["met"]) for r in results.values() for g in r["goals"])
    if (report["goals_total"], report["goals_met"]) != (goals, met):
        raise BadInput(f"{where}: goals_total/goals_met ({report['goals_total']}/"
                       f"{report['goals_met']}) disagree with the goals listed ({goals}/{met})")


# -- rendering ------------------------------------------------------------------------------
def _loads(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def header(report: dict[str, Any], cited: str) -> str:
    m = report["machine"]
    when = datetime.datetime.fromisoformat(m["timestamp_utc"])
    if when.tzinfo is not None:
        when = when.astimezone(datetime.timezone.utc)
    commit = (m["git_commit"] or "unknown")[:7]
    if m["git_dirty"]:
        commit += " with uncommitted changes"
    return (f"Figures from `{cited}`, written by `{' '.join(report['command'])}` "
            f"(what `make bench` runs) at commit {commit} on {when:%Y-%m-%d %H:%M} UTC: "
            f"vLLM {m['vllm']}, {m['cpu_count']} CPUs, load average (1/5/15 min) "
            f"{_loads(m['load_average'])} at the start and {_loads(m['load_average_end'])} "
            f"at the end, {report['seconds']:.0f} s; "
            f"**{report['goals_met']} of {report['goals_total']} goal lines met.**")


def measured(goal: dict[str, Any]) -> str:
    """The goal's figure exactly as its goal line printed it (Spread.text)."""
    s = goal["spread"]
    spread = Spread(*(math.nan if s[k] is None else s[k]
                      for k in ("median", "p25", "p75", "min", "max")), n=s["n"])
    return spread.text(goal["fmt"], goal["unit"])


def target(goal: dict[str, Any]) -> str:
    """As Goal.line prints it."""
    return f"{goal['op']} {goal['target']:g}{goal['unit']}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(report: dict[str, Any]) -> str:
    rows = ["| benchmark | goal line | measured: median (IQR p25-p75, min-max, n) | target "
            "| verdict |",
            "| --- | --- | --- | --- | --- |"]
    for bench, res in report["results"].items():
        for goal in res["goals"]:
            rows.append(f"| {bench} | {_cell(goal['name'])} | {measured(goal)} | "
                        f"{_cell(target(goal))} | {'MET' if goal['met'] else 'NOT MET'} |")
    for bench in report.get("errors") or {}:
        rows.append(f"| {bench} | (could not run) | - | - | NOT RUN |")
    for bench in report.get("skipped") or {}:
        if bench in (report.get("errors") or {}):
            continue
        rows.append(f"| {bench} | (skipped) | - | - | NOT RUN |")
    return "\n".join(rows)


def _code(text: str) -> str:
    """``text`` verbatim as a Markdown code span."""
    text = " ".join(text.split("\n"))
    ticks = "`"
    while ticks in text:
        ticks += "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _last_line(text: str) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def render_readme(report: dict[str, Any], cited: str) -> str:
    return f"{header(report, cited)}\n\n{table(report)}\n"


def render_docs(report: dict[str, Any], cited: str) -> str:
    parts = [header(report, cited), table(report)]
    for bench, res in report["results"].items():
        lines = [f"{bench}: {res['title']} ({res['seconds']:.0f} s), info lines:", ""]
        lines += [f"- {_code(line)}" for line in res["info"]] or ["- (none)"]
        lines += [f"- goal note, {goal['name']}: {goal['note']}"
                  for goal in res["goals"] if goal.get("note")]
        parts.append("\n".join(lines))
    for bench, err in (report.get("errors") or {}).items():
        parts.append(f"{bench} could not run: {_code(_last_line(err))} (the traceback is in "
                     f"`{cited}`).")
    for bench, why in (report.get("skipped") or {}).items():
        if bench in (report.get("errors") or {}):
            continue
        parts.append(f"{bench} skipped: {why}.")
    return "\n\n".join(parts) + "\n"


# -- the documents --------------------------------------------------------------------------
BLOCKS: list[tuple[str, tuple[str, str], Callable[[dict[str, Any], str], str]]] = [
    (README, README_MARKERS, render_readme),
    (DOCS, DOCS_MARKERS, render_docs),
]


def split(text: str, markers: tuple[str, str], where: str) -> tuple[str, str, str]:
    """(before and the begin marker's line, the block, the end marker and after)."""
    begin, end = markers
    for marker in markers:
        if text.count(marker) != 1:
            raise BadInput(f"{where}: {marker} found {text.count(marker)} times (want once)")
    i = text.index(begin)
    j = text.index(end)
    if j < i:
        raise BadInput(f"{where}: {end} comes before {begin}")
    head_end = text.find("\n", i)
    if head_end == -1 or head_end > j:
        raise BadInput(f"{where}: {begin} must end its line")
    head_end += 1
    tail_start = text.rfind("\n", 0, j) + 1
    if text[tail_start:j].strip():
        raise BadInput(f"{where}: {end} must start its line")
    return text[:head_end], text[head_end:tail_start], text[tail_start:]


def cited_path(results: str, root: str) -> str:
    """How the documents name the results file: relative to the repository."""
    rel = os.path.relpath(os.path.abspath(results), os.path.abspath(root))
    return results if rel.startswith("..") else rel.replace(os.sep, "/")


def expected(report: dict[str, Any], root: str, cited: str) -> dict[str, tuple[str, str]]:
    """{document: (its text now, its text with the rendered blocks)}."""
    out = {}
    for doc, markers, render in BLOCKS:
        path = os.path.join(root, doc)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise BadInput(f"{path}: {e}") from e
        head, _, tail = split(text, markers, path)
        out[doc] = (text, head + "\n" + render(report, cited) + "\n" + tail)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Render the benchmark figures of README.md and docs/benchmarks.md from "
                    "the committed results file (written by `make bench`), or check them.",
        epilog="Exit status: 0 the documents agree (or were written), 1 they differ, "
               "2 bad input (no results file, missing fields or markers).")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="compare the documents with the results file (the default)")
    mode.add_argument("--write", action="store_true",
                      help="rewrite the generated blocks of the documents")
    ap.add_argument("--results", metavar="FILE",
                    help=f"results file (default: ROOT/{RESULTS.replace(os.sep, '/')})")
    ap.add_argument("--root", metavar="DIR", default=REPO_ROOT,
                    help="repository root whose README.md and docs/benchmarks.md are "
                         "checked or written (default: this checkout)")
    args = ap.parse_args(argv)
    results = args.results or os.path.join(args.root, RESULTS)
    try:
        report = load(results)
        docs = expected(report, args.root, cited_path(results, args.root))
    except BadInput as e:
        print(f"benchmarks.report: {e}", file=sys.stderr)
        return 2
    if args.write:
        for doc, (now, want) in docs.items():
            if now != want:
                with open(os.path.join(args.root, doc), "w", encoding="utf-8") as f:
                    f.write(want)
                print(f"wrote {doc}")
            else:
                print(f"{doc} up to date")
        return 0
    differ = False
    for doc, (now, want) in docs.items():
        if now != want:
            differ = True
            sys.stdout.writelines(difflib.unified_diff(
                now.splitlines(keepends=True), want.splitlines(keepends=True),
                fromfile=f"{doc} (now)", tofile=f"{doc} (from {cited_path(results, args.root)})"))
    if differ:
        print(f"The benchmark figures differ from {results}: run `{WRITE_HINT}`.")
        return 1
    print(f"README.md and docs/benchmarks.md agree with {results}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
