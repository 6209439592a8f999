"""``python -m benchmarks [--only B1,B2,...] [--quick] [-o FILE] [--record]``
(from the repository root; ``make bench`` does that with the cached
environment, and records).

Prints one line per goal (measured median with its spread, the goal, MET or
NOT MET) and "info" lines, writes everything as JSON, progress on stderr.
Exit status: 0 every goal met, 1 some goal not met, 2 a benchmark could not
run (or bad arguments). With ``--quick`` (a smoke run of a few minutes, too
short for the figures to mean much) goals are printed but not enforced: the
status is 0 unless something failed to run.

``--record`` (a full run only: neither ``--only`` nor ``--quick``) also writes
``benchmarks/results/latest.json``: the report without each result's bulky
``data``. That committed file is where every figure of README.md and
docs/benchmarks.md comes from (``python -m benchmarks.report --write``).

A benchmark is a module in ``REGISTRY`` with ``NAME``, ``TITLE`` and
``run(quick: bool) -> benchmarks.common.Result``. A registered module that
does not exist (yet) is skipped with a note.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from importlib import metadata
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    Result,
    Unavailable,
    apply_clean_env,
    progress,
    single_thread_torch,
)
from benchmarks.report import RESULTS as RESULTS_FILE

REGISTRY: list[tuple[str, str]] = [
    ("B1", "benchmarks.b1_seam_cost"),
    ("B2", "benchmarks.b2_step_overhead"),
    ("B3", "benchmarks.b3_export_throughput"),
    ("B4", "benchmarks.b4_burst_memory"),
    ("B5", "benchmarks.b5_real_engine"),
    ("B6", "benchmarks.b6_instructions"),
]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    import kvobs_otel

    status = _git("status", "--porcelain")
    return {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm": _version("vllm"),
        "opentelemetry_sdk": _version("opentelemetry-sdk"),
        "torch": _version("torch"),
        "kvobs_otel": getattr(kvobs_otel, "__version__", None),
        "kvobs_otel_path": os.path.dirname(kvobs_otel.__file__),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }


def _select(ap: argparse.ArgumentParser, only: str | None) -> list[tuple[str, str]]:
    if not only:
        return REGISTRY
    wanted = [w.strip().upper() for w in only.split(",") if w.strip()]
    known = {name for name, _ in REGISTRY}
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        ap.error(f"--only: unknown benchmark(s) {', '.join(unknown) or '(none given)'}; "
                 f"known: {', '.join(sorted(known))}")
    return [(n, m) for n, m in REGISTRY if n in wanted]


def _load(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        raise


def _print(result: Result) -> None:
    print(f"{result.bench}: {result.title} ({result.seconds:.0f} s)")
    for goal in result.goals:
        print("  " + goal.line(result.bench))
    for line in result.info:
        print(f"  {result.bench} info: {line}")
    sys.stdout.flush()


def recorded(report: dict[str, Any]) -> dict[str, Any]:
    """What --record keeps: the report without each result's ``data``."""
    out = dict(report)
    out["results"] = {name: {k: v for k, v in res.items() if k != "data"}
                      for name, res in report["results"].items()}
    return out


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="kvobs-otel's cost on vLLM's serving path: B1 seam cost per event, "
                    "B2 step overhead, B3 export throughput, B4 memory under a burst, "
                    "B5 a real vLLM engine under a real client (docs/benchmarks.md). "
                    "Run from the repository root.",
        epilog="Exit status: 0 every goal met, 1 some goal not met, 2 a benchmark could "
               "not run. With --quick goals are not enforced.")
    ap.add_argument("--only", metavar="B1,B2,...", help="run only these benchmarks")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (~1 min): goals printed, not enforced")
    ap.add_argument("-o", "--output", default="benchmarks-results.json",
                    help="JSON results file (default: %(default)s)")
    ap.add_argument("--record", action="store_true",
                    help=f"also write {RESULTS_FILE} (the report without each result's "
                         "data), the source of the figures in README.md and "
                         "docs/benchmarks.md; a full run only (not with --only or --quick)")
    args = ap.parse_args(argv)
    if args.record and (args.only or args.quick):
        ap.error("--record needs a full run: not with "
                 + " or ".join(o for o, on in (("--only", args.only), ("--quick", args.quick))
                               if on))
    selected = _select(ap, args.only)
    # Before vLLM is imported anywhere in this process (B1 runs here).
    apply_clean_env()
    single_thread_torch()
    t0 = time.monotonic()
    report: dict[str, Any] = {"schema": 1, "command": ["python", "-m", "benchmarks",
                                                       *(argv or sys.argv[1:])],
                              "quick": args.quick, "machine": machine_info(),
                              "results": {}, "errors": {}, "skipped": {}}
    print(f"kvobs-otel benchmarks{' (quick: goals not enforced)' if args.quick else ''}: "
          f"{', '.join(n for n, _ in selected)}")
    for name, module_name in selected:
        try:
            module = _load(module_name)
        except Exception:
            report["errors"][name] = traceback.format_exc()
            progress(f"{name}: FAILED TO LOAD\n{report['errors'][name]}")
            print(f"{name}: FAILED TO LOAD (see stderr and the JSON file)")
            continue
        if module is None:
            report["skipped"][name] = f"{module_name} not present"
            progress(f"{name}: skipped ({module_name} not present)")
            if args.only:  # asked for by name: not having it is an error
                report["errors"][name] = f"{module_name} not present"
            continue
        progress(f"{name}: {getattr(module, 'TITLE', module_name)}")
        try:
            result = module.run(args.quick)
        except Unavailable as e:
            report["skipped"][name] = str(e)
            progress(f"{name}: skipped ({e})")
            print(f"{name}: skipped ({e})")
            continue
        except Exception:
            report["errors"][name] = traceback.format_exc()
            progress(f"{name}: FAILED TO RUN\n{report['errors'][name]}")
            print(f"{name}: FAILED TO RUN (see stderr and the JSON file)")
            continue
        report["results"][name] = result.as_json()
        _print(result)
    goals = [g for r in report["results"].values() for g in r["goals"]]
    met = sum(g["met"] for g in goals)
    report["machine"]["load_average_end"] = os.getloadavg()
    report.update(seconds=round(time.monotonic() - t0, 1), goals_total=len(goals),
                  goals_met=met, all_goals_met=met == len(goals))
    _write_json(args.output, report)
    print(f"{met}/{len(goals)} goals met in {report['seconds']:.0f} s; results in {args.output}")
    if args.record:
        path = os.path.join(REPO_ROOT, RESULTS_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_json(path, recorded(report))
        print(f"recorded in {RESULTS_FILE}; `python -m benchmarks.report --write` puts its "
              "figures in README.md and docs/benchmarks.md")
    if report["errors"]:
        return 2
    if args.quick or met == len(goals):
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
