"""``kvobs-otel check SOURCE``: is every recorded recovery a complete chain?

A failed restore (``restore_failed``, ``recomputed``; vLLM 0.34+) whose chain
is consistent is complete: the check judges the evidence, not the outcome
(the alert ``KvobsRestoreFailed`` is what reports the failure). Such episodes
are counted on their own in the summary, so a failure is visible here too
without turning the exit status to 1.

An episode cut short because a vLLM process stopped (``abandoned``, or
spans a killed process never handed over; ``analysis/episodes.py``) is not
incomplete either: stopping or restarting vLLM is no receipt failure. Such
episodes are counted and listed on their own (``cut_short``).

Clock skew between processes (a rank on a host whose clock is off) is
reported as a warning and leaves the exit status alone: episodes join by
ids, so the evidence is whole; only the timeline is shifted
(``analysis/skew.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from kvobs_otel.tools.analysis import tiers
from kvobs_otel.tools.analysis.episodes import FAILED_RESTORE, Episode, rebuild
from kvobs_otel.tools.analysis.skew import DEFAULT_TOLERANCE_S, clock_skew, format_skew
from kvobs_otel.tools.otlp_file import FileSpan


def check_spans(spans: list[FileSpan], clock_tolerance_s: float = DEFAULT_TOLERANCE_S,
                ) -> tuple[list[Episode], dict[str, Any]]:
    episodes = rebuild(spans)
    skew = [s.to_dict(clock_tolerance_s) for s in clock_skew(episodes)]
    incomplete = [e for e in episodes if not e.complete]
    failed = [e for e in episodes if e.outcome in FAILED_RESTORE]
    cut = [e for e in episodes if e.cut_short]
    summary = {
        "spans": len(spans),
        "episodes": len(episodes),
        "complete": len(episodes) - len(incomplete),
        "incomplete": len(incomplete),
        # Episodes whose ranks could not be joined (vLLM-HUST contract v1):
        # judged on the scheduler's evidence only.
        "scheduler_only": sum(e.join_scope != "cluster" for e in episodes),
        # Failed restores by outcome, complete or not (an inconsistent one is
        # in incomplete_episodes as well).
        **{outcome: sum(e.outcome == outcome for e in failed) for outcome in FAILED_RESTORE},
        "incomplete_episodes": [{
            "request_id": e.request_id, "epoch": e.epoch, "trace_id": e.trace_id,
            "outcome": e.outcome, "ranks": e.expected_ranks, "problems": e.problems,
        } for e in incomplete],
        # Cut short by a process stop (complete or not): why, per episode.
        "cut_short": len(cut),
        "cut_short_episodes": [{
            "request_id": e.request_id, "epoch": e.epoch, "trace_id": e.trace_id,
            "outcome": e.outcome, "why": e.cut_short, "complete": e.complete,
        } for e in cut],
        "failed_restore_episodes": [{
            "request_id": e.request_id, "epoch": e.epoch, "trace_id": e.trace_id,
            "outcome": e.outcome, "failed_job_ids": e.failed_restore_jobs,
            "failed_ranks": e.failed_ranks, "complete": e.complete,
        } for e in failed],
        # Every process compared with the process of its spans' parents;
        # skewed ones are a warning, not a failure (joined by ids anyway).
        "clock_tolerance_s": clock_tolerance_s,
        "clock_skewed_processes": sum(s["skewed"] for s in skew),
        "clock_skew": skew,
        # vLLM's secondary tiers: jobs by tier, kind and outcome; failed ones
        # (vLLM recomputed) and hung ones (a failure: exit status 1).
        **tiers.summarize(spans),
    }
    return episodes, summary


def failed(summary: dict[str, Any]) -> bool:
    """The exit status: incomplete episodes, or a tier job or wait that hung
    (in an episode or in ordinary traffic)."""
    return bool(summary["incomplete"] or summary["tier_hung"])


def format_table(episodes: list[Episode], show_all: bool = False,
                 summary: dict[str, Any] | None = None) -> str:
    """The episodes (incomplete ones unless ``show_all``), the counts, and the
    clock-skew warnings of ``summary`` (``check_spans``) when given."""
    rows = [e for e in episodes if show_all or not e.complete]
    cut = sum(bool(e.cut_short) for e in episodes)
    lines = []
    if rows:
        header = ("REQUEST", "EPOCH", "OUTCOME", "RANKS", "LATENCY_MS", "PROBLEMS")
        table = [header] + [(e.request_id, str(e.epoch), e.outcome, str(e.expected_ranks),
                             f"{e.latency_ms:.1f}",
                             "; ".join(e.problems + [f"cut short: {c}" for c in e.cut_short])
                             or "-")
                            for e in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
        for r in table:
            cells = (c.ljust(w) for c, w in zip(r, widths, strict=False))
            lines.append("  ".join(cells) + "  " + r[-1])
    done = sum(e.complete for e in episodes)
    failed = ", ".join(f"{outcome}: {sum(e.outcome == outcome for e in episodes)}"
                       for outcome in FAILED_RESTORE)
    lines.append(f"{len(episodes)} recovery episodes: {done} complete, "
                 f"{len(episodes) - done} incomplete; {failed}")
    if cut:
        lines.append(f"{cut} cut short when a vLLM process stopped (not failures: "
                     "--all or --json lists them)")
    unjoined = sum(e.join_scope != "cluster" for e in episodes)
    if unjoined:
        lines.append(f"{unjoined} judged on scheduler evidence only (ranks not joinable: "
                     "vLLM-HUST contract v1)")
    if summary is not None:
        if summary["tier_jobs"]:
            counts = Counter()
            for row in summary["tier_jobs_by"]:
                counts[(row["tier"], row["outcome"])] += row["count"]
            lines.append(f"{summary['tier_jobs']} secondary-tier jobs: " + ", ".join(
                f"{t} {o}: {n}" for (t, o), n in sorted(counts.items()))
                + f"; {summary['waits']} waits")
            lines.extend(f"tier failed (vLLM recomputed): {d}" for d in summary["tier_failed"])
            lines.extend(f"TIER HUNG: {d}" for d in summary["tier_hung"])
        lines.extend(format_skew(summary["clock_skew"], summary["clock_tolerance_s"]))
    return "\n".join(lines)


def to_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2)
