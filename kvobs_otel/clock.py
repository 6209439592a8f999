"""The wall-clock anchor of a process: wall time minus monotonic time.

Spans are timed with ``time.monotonic_ns()`` and placed on the wall clock by
this one offset, read once per process (and again when its export sidecar
restarts). Two clock reads with a preemption between them would misplace
every span of the process by that much, which ``kvobs-otel check`` would then
report as clock skew between processes of one host: so the wall clock is
read between two monotonic reads, a few times, and the tightest bracket wins.
"""

from __future__ import annotations

import time

_TRIES = 5


def wall_anchor_ns() -> int:
    """``time.time_ns() - time.monotonic_ns()``, to within the tightest of a
    few brackets (a few microseconds unless every try was preempted)."""
    best_gap, best = None, 0
    for _ in range(_TRIES):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        gap = m1 - m0
        if best_gap is None or gap < best_gap:
            best_gap, best = gap, w - (m0 + m1) // 2
    return best
