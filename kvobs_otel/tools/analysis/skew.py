"""Clock skew between the processes of recorded episodes (offline only).

Every process stamps its spans with its own clock: times are its
``time.monotonic_ns()``, turned into wall-clock time by one anchor
(wall - monotonic) taken once per process. Durations therefore never depend
on the wall clock, but a rank on another host places its spans by that
host's wall clock. Episodes join by derived ids (``identity.py``), never by
time, so skew cannot break a trace; it only shifts a process's spans on a
timeline such as Jaeger's.

The span model orders some events across processes whatever the clocks say;
each such order bounds the offset ``d`` of the child's process against the
parent's (child clock = parent clock + d):

- a cross-process child started after its parent started (the parent's
  process asked for the work): ``d <= child.start - parent.start``;
- ``kv.first_compute`` started after its ``kv.admission`` ended (the rank
  binds the step metadata that carried the admission): ``d <= child.start -
  parent.end``;
- ``kv.transfer`` ended before its ``kv.job`` when the job got that rank's
  receipt (the job ends at the last receipt): ``d >= child.end - parent.end``;
- ``kv.first_compute`` ended before its episode's root when the episode came
  back (recovered, recomputed: the root ends when every rank reported it):
  ``d >= child.end - root.end``.

A process whose interval [lower, upper] excludes 0 by more than the
tolerance has a clock offset of at least that much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.tools.analysis.episodes import ADMITTED, Episode
from kvobs_otel.tools.otlp_file import FileSpan

# Job outcomes whose end is the last rank's receipt (receipt_incomplete and
# abandoned end at a deadline or shutdown, before a late rank's transfer).
_RECEIPTED_JOBS = ("complete", "failed")
# Default tolerance: the error of two processes' anchors on one host (two
# clock reads each) is microseconds; Jaeger keeps microseconds.
DEFAULT_TOLERANCE_S = 0.001

ProcessKey = tuple[str, str]  # (host.name, process.pid): one anchor each


def process_key(span: FileSpan) -> ProcessKey:
    r = span.resource
    return (str(r.get("host.name", "")), str(r.get("process.pid", "")))


def _label(span: FileSpan) -> dict[str, Any]:
    r = span.resource
    return {k: r.get(k) for k in ("kvobs.role", "kvobs.rank", "host.name", "process.pid")}


@dataclass
class ProcessSkew:
    """What the episodes say about one process's clock against another's."""

    process: dict[str, Any]
    reference: dict[str, Any]
    lower_s: float = float("-inf")  # offset >= lower
    upper_s: float = float("inf")  # offset <= upper
    pairs: int = 0  # parent-child pairs that bounded it
    episodes: set[tuple[str, int]] = field(default_factory=set)
    complete: set[tuple[str, int]] = field(default_factory=set)

    def bound(self, lower: float | None = None, upper: float | None = None) -> None:
        if lower is not None:
            self.lower_s = max(self.lower_s, lower)
        if upper is not None:
            self.upper_s = min(self.upper_s, upper)
        self.pairs += 1

    def direction(self, tolerance_s: float) -> str | None:
        """"ahead", "behind", "inconsistent" (the bounds contradict each
        other: the offset changed during the recording), or None (within
        the tolerance)."""
        if self.lower_s > self.upper_s + tolerance_s:
            return "inconsistent"
        if self.lower_s > tolerance_s:
            return "ahead"
        if self.upper_s < -tolerance_s:
            return "behind"
        return None

    def at_least_s(self) -> float:
        """A lower bound of the offset's size."""
        return max(self.lower_s, -self.upper_s, 0.0)

    def to_dict(self, tolerance_s: float) -> dict[str, Any]:
        def finite(v: float) -> float | None:  # JSON has no infinity
            return round(v, 6) if abs(v) != float("inf") else None

        return {"process": self.process, "reference": self.reference,
                "skewed": self.direction(tolerance_s) is not None,
                "direction": self.direction(tolerance_s),
                "offset_at_least_s": round(self.at_least_s(), 6),
                "offset_min_s": finite(self.lower_s), "offset_max_s": finite(self.upper_s),
                "pairs": self.pairs, "episodes": len(self.episodes),
                "episodes_complete": len(self.complete)}


def clock_skew(episodes: list[Episode]) -> list[ProcessSkew]:
    """Bounds of every process's offset against the process of its spans'
    parents, from every cross-process parent-child pair of the episodes."""
    out: dict[tuple[ProcessKey, ProcessKey], ProcessSkew] = {}
    for ep in episodes:
        by_id = {s.span_id: s for s in ep.spans}
        key = (ep.request_id, ep.epoch)
        for child in ep.spans:
            parent = by_id.get(child.parent_span_id) if child.parent_span_id else None
            if parent is None or process_key(parent) == process_key(child):
                continue
            pk = (process_key(child), process_key(parent))
            skew = out.get(pk)
            if skew is None:
                skew = out[pk] = ProcessSkew(_label(child), _label(parent))
            skew.episodes.add(key)
            if ep.complete:
                skew.complete.add(key)
            _bound(skew, child, parent, ep)
    return sorted(out.values(), key=lambda s: (str(s.process["kvobs.rank"]),
                                               str(s.process["host.name"]),
                                               str(s.process["process.pid"])))


def _bound(skew: ProcessSkew, child: FileSpan, parent: FileSpan, ep: Episode) -> None:
    ns = 1e-9
    if child.name == "kv.first_compute" and parent.name == "kv.admission":
        lower = None
        rank = child.resource.get("kvobs.rank", child.attributes.get("kvobs.rank"))
        reported = ep.root.attributes.get("kvobs.first_compute.ranks") or []
        if ep.outcome in ADMITTED and rank is not None and int(rank) in map(int, reported):
            lower = (child.end_ns - ep.root.end_ns) * ns
        skew.bound(lower, (child.start_ns - parent.end_ns) * ns)
        return
    lower = None
    if child.name == "kv.transfer" and parent.name == "kv.job":
        rank = child.attributes.get("kvobs.rank")
        roster = parent.attributes.get("kvobs.receipt.ranks") or []
        if parent.attributes.get("kvobs.outcome") in _RECEIPTED_JOBS and rank is not None \
                and int(rank) in map(int, roster):
            lower = (child.end_ns - parent.end_ns) * ns
    skew.bound(lower, (child.start_ns - parent.start_ns) * ns)


def _who(p: dict[str, Any]) -> str:
    what = f"rank {p['kvobs.rank']}" if p.get("kvobs.rank") is not None \
        else str(p.get("kvobs.role") or "process")
    return f"{what} (host {p.get('host.name') or '?'}, pid {p.get('process.pid') or '?'})"


def format_skew(entries: list[dict[str, Any]], tolerance_s: float) -> list[str]:
    """Lines for the skewed processes of ``ProcessSkew.to_dict`` entries
    (none when the clocks agree)."""
    lines = []
    for e in entries:
        if not e["skewed"]:
            continue
        joined = (f"{e['episodes_complete']} of {e['episodes']} episodes with its spans "
                  "complete, joined by ids")
        who, ref = _who(e["process"]), _who(e["reference"])
        if e["direction"] == "inconsistent":
            lines.append(f"  {who}: clock offset against {ref} changed during the recording "
                         f"(bounds {e['offset_min_s']:+.3f} s > {e['offset_max_s']:+.3f} s); "
                         f"{joined}")
        else:
            # Rounded down: a lower bound must not grow in print.
            at_least = math.floor(e["offset_at_least_s"] * 1e3 + 1e-6) / 1e3
            lines.append(f"  {who}: clock {e['direction']} of {ref} by at least "
                         f"{at_least:.3f} s; {joined}")
    if lines:
        lines.insert(0, "clock skew (a warning: each host's spans are placed by its own clock; "
                     f"episodes are joined by ids; tolerance {tolerance_s * 1e3:g} ms):")
    return lines
