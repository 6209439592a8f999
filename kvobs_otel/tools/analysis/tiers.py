"""Judge the secondary tiers' spans (``kv.tier.job``, ``kv.wait``): which tier
did what, and what hung or failed, naming the tier.

A hung tier job (no result at the deadline while the engine stepped) or a
wait that hung is a failure of the chain: ``check`` lists it and exits 1. A
failed or partial promotion is vLLM doing its job (it recomputes): counted
and listed, like a failed restore, without changing the exit status; its
episode must say so (``recomputed``, ``kvobs.recompute.reason``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvobs_otel.tools.otlp_file import FileSpan

TIER_JOB = "kv.tier.job"
WAIT = "kv.wait"
HUNG = "hung"
STALLED = "tier_stalled"  # an episode ended by its hung promotion or wait
FAILED = ("failed", "partial")


def tier_name(span: FileSpan) -> str:
    a = span.attributes
    return f"tier {a.get('kvobs.tier.index', '?')} ({a.get('kvobs.tier.type', 'unknown')})"


def describe(span: FileSpan) -> str:
    a = span.attributes
    return (f"{a.get('kvobs.tier.job.kind', 'tier')} job {a.get('kvobs.tier.job.id', '?')} "
            f"of request {a.get('kvobs.request.id', '?')} on {tier_name(span)}: "
            f"{a.get('kvobs.outcome', 'unknown')}")


def summarize(spans: list[FileSpan]) -> dict[str, Any]:
    jobs = [s for s in spans if s.name == TIER_JOB]
    waits = [s for s in spans if s.name == WAIT]
    by: Counter[tuple[str, str, str]] = Counter(
        (tier_name(s), str(s.attributes.get("kvobs.tier.job.kind", "")),
         str(s.attributes.get("kvobs.outcome", ""))) for s in jobs)
    hung = [describe(s) for s in jobs if s.attributes.get("kvobs.outcome") == HUNG]
    hung += [f"wait of request {s.attributes.get('kvobs.request.id', '?')} hung "
             f"({', '.join(s.attributes.get('kvobs.wait.reasons') or [])})"
             for s in waits if s.attributes.get("kvobs.outcome") == HUNG]
    return {
        "tier_jobs": len(jobs),
        "tier_jobs_by": [{"tier": t, "kind": k, "outcome": o, "count": n}
                         for (t, k, o), n in sorted(by.items())],
        "tier_failed": [describe(s) for s in jobs if s.attributes.get("kvobs.outcome") in FAILED],
        "tier_hung": hung,
        "waits": len(waits),
    }


def check_episode(root: FileSpan, trace: list[FileSpan]) -> list[str]:
    """Problems of one episode's tier evidence (its root's claims against its
    trace's kv.tier.job spans)."""
    p = []
    a = root.attributes
    jobs = {int(s.attributes.get("kvobs.tier.job.id", -1)): s for s in trace
            if s.name == TIER_JOB}
    listed = [int(j) for j in a.get("kvobs.tier.job_ids") or []]
    missing = [j for j in listed if j not in jobs]
    if missing and "kvobs.tier.job_ids.dropped" not in a:
        p.append(f"tier jobs {missing} have no kv.tier.job span")
    if a.get("kvobs.outcome") == STALLED:
        hung = [describe(s) for s in jobs.values() if s.attributes.get("kvobs.outcome") == HUNG]
        waits = [s for s in trace if s.name == WAIT and s.attributes.get("kvobs.outcome") == HUNG]
        p.append("tier stalled: " + ("; ".join(hung) if hung else
                                      "its wait hung" if waits else "no hung tier job or wait"))
    if a.get("kvobs.recompute.reason") == "promotion_failed" and not any(
            s.attributes.get("kvobs.tier.job.kind") == "promotion"
            and s.attributes.get("kvobs.outcome") in FAILED + (HUNG,) for s in jobs.values()):
        p.append("recompute reason promotion_failed, but no failed promotion in its trace")
    return p
