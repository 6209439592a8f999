"""B6: the instructions the seams add to vLLM's serving thread per step, exact.

B2's timed ratio swings by several percent between runs on a shared machine;
an instruction count does not. Each variant of B2's workload (same seed,
inline ranks: scheduler, connectors and both ranks on one thread) runs in its
own process under valgrind's callgrind (benchmarks/b6_counted.py), which
counts the serving thread's instructions over the measured steps. What a
step costs also depends on where objects sit (CPython's type-attribute cache
is indexed by addresses: benchmarks/b6_layout.py), so each process runs in a
fixed memory layout: within a layout the same code counts the same (disabled
to the instruction, enabled within about 2,000 per step), between layouts it
moves by several thousand per step.
``disabled`` and ``enabled`` are counted in the same three layouts and
compared layout by layout; the line is the median of the three differences.

- ``enabled`` over ``disabled``: what the seams add, per step and per role.
- Per seam: the seams are added one at a time, in the order the next reads
  the previous one's work (``b6_counted.SEAMS``), each variant a process of
  its own, in layout 1: the steps of the split sum to the whole (each also
  moves what the layout costs).
- ``enabled+fs`` over ``disabled+fs``: the same with vLLM's fs tier.

Sampled: every variant counts the same contiguous window of B2's workload
(a fresh repeat after one uncounted warm-up repeat), the first
``STEPS`` steps (all 530 in a full run; ``QUICK_STEPS`` with --quick). What
runs outside the window (imports, warm-up) runs under valgrind uncounted.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.b6_counted import SEAMS
from benchmarks.common import (
    REPO_ROOT,
    Goal,
    Result,
    Spread,
    Unavailable,
    clean_env,
    progress,
)
from benchmarks.otlp_sink import OtlpSink

NAME = "B6"
TITLE = "instructions the seams add to vLLM's serving thread per step (callgrind)"
STEPS = 530  # B2's repeat, whole
QUICK_STEPS = 60
GOAL_PER_STEP = 45_000
# disabled and enabled each counted in three layouts (b6_layout.py: the
# suffix @K is layout K, none is layout 1), compared layout by layout; so is
# the tiered pair (one layout with --quick). The per-seam split runs in
# layout 1.
DISABLED_RUNS = ("disabled", "disabled@2", "disabled@3")
ENABLED_RUNS = ("enabled", "enabled@2", "enabled@3")
DISABLED_FS_RUNS = ("disabled+fs", "disabled+fs@2", "disabled+fs@3")
ENABLED_FS_RUNS = ("enabled+fs", "enabled+fs@2", "enabled+fs@3")
PARALLEL = 2
TIMEOUT_S = 1800


def _no_aslr() -> list[str]:
    """A prefix that runs the process without address randomization: the
    addresses steer CPython's type-attribute cache (it hashes the name's
    address) and the order of sets of objects. It removes one source of
    difference between processes, not all (DISABLED_RUNS)."""
    setarch = shutil.which("setarch")
    return [setarch, platform.machine(), "-R"] if setarch else []


def valgrind() -> str | None:
    """valgrind's path, if callgrind_control (which the child needs) is there too."""
    return shutil.which("valgrind") if shutil.which("callgrind_control") else None


def _count(key: str, steps: int, quick: bool, endpoint: str, workdir: str
           ) -> dict[str, Any]:
    variant, _, layout = key.partition("@")
    tag = key.replace(":", "_").replace(",", "_").replace("+", "_").replace("@", "_")
    out = os.path.join(workdir, f"{tag}.json")
    cg = os.path.join(workdir, f"{tag}.cg")
    # The child's command line is the same length for every variant (its
    # layout starts with it): the rest goes in a file of a fixed-length name.
    job = os.path.join(workdir, hashlib.sha1(key.encode()).hexdigest()[:16] + ".job")
    with open(job, "w") as f:
        json.dump({"variant": variant, "steps": steps, "endpoint": endpoint, "out": out,
                   "quick": quick}, f)
    cmd = [*_no_aslr(), str(valgrind()), "--tool=callgrind", "--instr-atstart=no",
           "--collect-atstart=no", "--toggle-collect=math_fsum", "--separate-threads=yes",
           f"--callgrind-out-file={cg}", sys.executable, "-m", "benchmarks.b6_counted",
           "--layout", str(int(layout or 1)), "--job", job]
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), stdout=log, stderr=log,
                              timeout=TIMEOUT_S)
        if proc.returncode != 0 or not os.path.exists(out):
            log.seek(0)
            raise RuntimeError(f"B6 {variant}: exit {proc.returncode}\n{log.read()[-3000:]}")
    with open(out) as f:
        summary = json.load(f)
    threads = _thread_totals(cg)
    serving = threads.get(1, 0)
    if summary["dropped"]:
        raise RuntimeError(f"B6 {key}: {summary['dropped']} events dropped in the window")
    if summary["steps"] <= 0 or serving <= 0:
        raise RuntimeError(f"B6 {variant}: nothing counted ({summary['steps']} steps)")
    progress(f"B6: {key}: {serving / summary['steps'] / 1e6:.3f} M instructions per "
             f"step over {summary['steps']} steps ({time.monotonic() - t0:.0f} s)")
    return {**summary, "serving": serving, "other_threads": sum(
        n for t, n in threads.items() if t != 1)}


def _thread_totals(prefix: str) -> dict[int, int]:
    """Thread number -> instructions counted (callgrind's ``totals:`` line of
    each ``<prefix>-NN`` file; ``math_fsum`` entered once, on thread 1)."""
    out: dict[int, int] = {}
    directory, base = os.path.split(prefix)
    for name in os.listdir(directory):
        if not name.startswith(base + "-"):
            continue
        thread = int(name.rsplit("-", 1)[1])
        with open(os.path.join(directory, name)) as f:
            text = f.read()
        totals = [ln for ln in text.splitlines() if ln.startswith("totals:")]
        out[thread] = int(totals[-1].split()[1]) if totals else 0
        if thread == 1 and "fn=" not in text:
            raise RuntimeError(f"B6: {name} holds no function costs")
    return out


def variants(quick: bool) -> list[str]:
    """disabled, then the seams added one by one (the last is every seam:
    ``enabled``), then the tiered pair."""
    names = list(SEAMS)
    split = [] if quick else [f"enabled:{','.join(names[:i])}" for i in range(1, len(names))]
    fs = [*DISABLED_FS_RUNS[:1], *ENABLED_FS_RUNS[:1]] if quick else [
        *DISABLED_FS_RUNS, *ENABLED_FS_RUNS]
    return [*DISABLED_RUNS, *split, *ENABLED_RUNS, *fs]


def run(quick: bool) -> Result:
    t_start = time.monotonic()
    if not valgrind():
        raise Unavailable("valgrind (with callgrind_control) is not installed: "
                          "apt install valgrind")
    steps = QUICK_STEPS if quick else STEPS
    todo = variants(quick)
    sink = OtlpSink()
    # KVOBS_B6_KEEP=DIR keeps callgrind's files (callgrind_annotate reads them).
    keep = os.environ.get("KVOBS_B6_KEEP")
    workdir = keep or tempfile.mkdtemp(prefix="kvobs-bench-b6-")
    os.makedirs(workdir, exist_ok=True)
    try:
        progress(f"B6: {len(todo)} variants under callgrind, {PARALLEL} at a time")
        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
            futures = {v: pool.submit(_count, v, steps, quick, sink.endpoint_for(v), workdir)
                       for v in todo}
            counts = {v: f.result() for v, f in futures.items()}
    finally:
        sink.close()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return _result(counts, quick, time.monotonic() - t_start)


def _per_step(c: dict[str, Any]) -> float:
    return c["serving"] / c["steps"]


def _result(counts: dict[str, dict[str, Any]], quick: bool, seconds: float) -> Result:
    for v, c in counts.items():
        base = "disabled+fs" if "+fs" in v else "disabled"
        if (c["steps"], c["workload"]) != (counts[base]["steps"], counts[base]["workload"]):
            raise RuntimeError(f"B6: {v} ran {c['steps']} steps ({c['workload']}), {base} "
                               f"{counts[base]['steps']} ({counts[base]['workload']}): "
                               "not the same workload")
    # Enabled over disabled in the same layout; the line is the median over
    # the layouts.
    pairs = [_per_step(counts[e]) - _per_step(counts[d])
             for e, d in zip(ENABLED_RUNS, DISABLED_RUNS, strict=True) if e in counts]
    disabled = [_per_step(counts[d]) for d in DISABLED_RUNS if d in counts]
    added = statistics.median(pairs)
    layout_spread = max(disabled) - min(disabled)
    # The tiered pair is not exact even within a layout: vLLM's tier threads
    # (I/O, lookups) run while a counted step runs, and perturb what the
    # serving thread finds in the caches. Each enabled+fs process over each
    # disabled+fs one, then; the line is the median of those differences.
    pairs_fs = [_per_step(counts[e]) - _per_step(counts[d])
                for e in ENABLED_FS_RUNS if e in counts
                for d in DISABLED_FS_RUNS if d in counts]
    added_fs = statistics.median(pairs_fs)
    base = _per_step(counts["disabled"])
    goals = [Goal(f"seams' serving-thread instructions per step over disabled (exact; "
                  f"median over n={len(pairs)} memory layouts)",
                  Spread.of(pairs), "<=", GOAL_PER_STEP, unit="", fmt=",.0f"),
             Goal(f"the same with vLLM's fs tier (enabled+fs over disabled+fs; "
                  f"n={len(pairs_fs)}: every process over every other)",
                  Spread.of(pairs_fs), "<=", GOAL_PER_STEP, unit="", fmt=",.0f")]
    info = [f"disabled: {base / 1e6:.3f} M instructions per step on the serving thread; "
            f"enabled +{added:,.0f} (+{100 * added / base:.2f}%); "
            f"{counts['enabled']['steps']} steps counted per variant; disabled moves by "
            f"{layout_spread:,.0f} per step between layouts (exact within one)"]
    split: dict[str, float] = {}
    roles: dict[str, float] = {}
    if not quick:
        prev = base
        for i, seam in enumerate(SEAMS):
            names = list(SEAMS)[:i + 1]
            key = "enabled" if i == len(SEAMS) - 1 else f"enabled:{','.join(names)}"
            now = _per_step(counts[key])
            split[seam] = now - prev
            role = SEAMS[seam][0]
            roles[role] = roles.get(role, 0.0) + now - prev
            prev = now
        info.append("per role: " + ", ".join(f"{r} +{v:,.0f}" for r, v in roles.items()))
        info.append("per seam (added in this order, in layout 1; each step of the split "
                    "also moves what the layout costs, by up to the spread above): " + ", ".join(
            f"{s} +{v:,.0f}" for s, v in split.items()))
    events = counts["enabled"]["after"].get("events_accepted", 0) - counts["enabled"][
        "before"].get("events_accepted", 0)
    if events <= 0:
        raise RuntimeError("B6: the enabled variant recorded no event")
    info.append(f"enabled recorded {events} events in the window "
                f"({events / counts['enabled']['steps']:.2f} per step): "
                f"{added * counts['enabled']['steps'] / events:,.0f} instructions per event")
    return Result(NAME, TITLE, goals, info, data={
        "per_step": {v: _per_step(c) for v, c in counts.items()},
        "added": added, "added_pairs": pairs, "added_fs": added_fs, "added_fs_pairs": pairs_fs,
        "per_role": roles,
        "per_seam": split,
        "counts": counts}, seconds=seconds)
