"""Our threads and the export sidecar off the cores vLLM pinned its compute to.

vLLM's CPU backend binds each worker to its cores
(``VLLM_CPU_OMP_THREADS_BIND``), and a thread or child process inherits that
mask (``exec`` keeps it): the drain thread then waits for a core the
worker's OMP threads keep busy, and the export sidecar competes with its own
worker. Both are light and any core serves them: measured on the real
engine (2 cores, TP 2), pinned like that the worker's events reached its
sidecar about 1 s after their seam (p50), spans left it 2 s after.
"""

from __future__ import annotations

import os

_CPUSET = "/sys/fs/cgroup/cpuset.cpus.effective"  # cgroup v2: what this container may use


def allowed_cpus() -> set[int]:
    """Every CPU this process may be given (its cgroup's cpuset, else all)."""
    try:
        with open(_CPUSET) as f:
            text = f.read().strip()
        out: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        if out:
            return out
    except (OSError, ValueError):
        pass
    return set(range(os.cpu_count() or 1))


def unpin() -> bool:
    """Let the calling thread (Linux: affinity is per thread) run on any
    allowed CPU; False where that cannot be done (it then stays as it was)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        cpus = allowed_cpus()
        if cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)
        return True
    except (OSError, ValueError):
        return False
