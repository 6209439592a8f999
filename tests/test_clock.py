"""The wall-clock anchor (kvobs_otel/clock.py)."""

from __future__ import annotations

import time

from kvobs_otel import clock


def test_anchor_is_wall_minus_monotonic():
    before = time.time_ns() - time.monotonic_ns()
    anchor = clock.wall_anchor_ns()
    after = time.time_ns() - time.monotonic_ns()
    # Each plain difference errs by at most the gap between its two reads.
    assert abs(anchor - before) < 50_000_000 and abs(anchor - after) < 50_000_000


def test_a_preempted_read_does_not_place_the_anchor(monkeypatch):
    # The first bracket was preempted for 30 ms before its wall read; the
    # later ones took 1 us. True offset: 1_000_000_000.
    mono = iter([0, 30_000_500,             # try 1: preempted before the wall read
                 40_000_000, 40_001_000,    # tries 2-5: tight
                 50_000_000, 50_001_000,
                 60_000_000, 60_001_000,
                 70_000_000, 70_001_000])
    wall = iter([1_000_000_000 + 30_000_000,
                 1_000_000_000 + 40_000_500,
                 1_000_000_000 + 50_000_500,
                 1_000_000_000 + 60_000_500,
                 1_000_000_000 + 70_000_500])
    monkeypatch.setattr(clock.time, "monotonic_ns", lambda: next(mono))
    monkeypatch.setattr(clock.time, "time_ns", lambda: next(wall))
    # One (wall - monotonic) pair from try 1 would be 15-30 ms off.
    assert clock.wall_anchor_ns() == 1_000_000_000
