"""Rebuild recovery episodes from exported spans and judge each chain.

Input: flat spans (``FileSpan``) from an OTLP JSON file or a Jaeger query.
An episode is complete when it ended properly (see ``ENDED_OK``) and its
trace holds the whole chain: every restore job's receipt from every rank, a
restore transfer from every rank and, when the request came back (recovered,
recomputed), exactly one admission and exactly one first compute per rank.

A failed restore (vLLM 0.34+) is a properly ended episode too: its restore
transfers may have failed, and at least one did, on a rank the episode names
(``kvobs.restore.failed_ranks``). ``restore_failed`` (vLLM ended the request
with an error) has no admission; ``recomputed`` (vLLM computed the request
again from scratch) has one, of compute kind prefill.

An episode cut short by a process stop is not incomplete: ``abandoned``
(vLLM stopped the scheduler first; ``kvobs.end.cause`` says how) is judged
on what finished before, and spans missing on a rank whose process was
killed before it handed them over (its ``kv.process.end`` span, whose start
is the last event that left it, precedes the episode's end) are that kill's
doing, not a rank that failed to answer. Both are listed in ``cut_short``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvobs_otel.tools.analysis import tiers
from kvobs_otel.tools.otlp_file import FileSpan

# Episodes that ended properly. "recovered" and "recomputed" have an
# admission and first computes; the others ended before the request came back,
# which is no fault of the chain.
ENDED_OK = {"recovered", "finished_before_resume", "aborted_before_resume", "preempted_again",
            "restore_failed", "recomputed"}
# Ended because the scheduler's process stopped first (kvobs.end.cause one of
# these; another cause, such as imported evidence that ended, is no stop).
CUT_SHORT = "abandoned"
STOP_CAUSES = ("connector_shutdown", "process_exit", "process_killed")
PROCESS_END = "kv.process.end"
# A restore failed on some rank (vLLM 0.34+): the request ended with an error
# (kv_load_failure_policy "fail") or was computed again from scratch ("recompute").
FAILED_RESTORE = ("restore_failed", "recomputed")
# The request came back: one admission, one first compute per rank.
ADMITTED = ("recovered", "recomputed")


@dataclass
class Episode:
    trace_id: str
    request_id: str
    epoch: int
    sched_gen: str
    outcome: str
    start_ns: int
    end_ns: int
    expected_ranks: int
    root: FileSpan
    spans: list[FileSpan]
    problems: list[str] = field(default_factory=list)
    # Why it is not whole, where a process stop explains it (no problem).
    cut_short: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def latency_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def named(self, name: str) -> list[FileSpan]:
        return [s for s in self.spans if s.name == name]

    @property
    def join_scope(self) -> str:
        return str(self.root.attributes.get("kvobs.join.scope", "cluster"))

    @property
    def restore_jobs(self) -> list[int]:
        return [int(j) for j in self.root.attributes.get("kvobs.restore.job_ids") or []]

    @property
    def failed_restore_jobs(self) -> list[int]:
        return [int(j) for j in self.root.attributes.get("kvobs.restore.failed_job_ids") or []]

    @property
    def failed_ranks(self) -> list[int]:
        return [int(r) for r in self.root.attributes.get("kvobs.restore.failed_ranks") or []]


def _rank(span: FileSpan) -> int | None:
    rank = span.attributes.get("kvobs.rank", span.resource.get("kvobs.rank"))
    return int(rank) if rank is not None else None


def _sorted_ranks(ranks: Iterable[int | None]) -> list[int | None]:
    """Distinct ranks in order; a span without one (None) last."""
    return sorted(set(ranks), key=lambda r: (r is None, r or 0))


def _name_unreceipted(ep: Episode, transfers: list[FileSpan], ranks: set[int]) -> None:
    """An episode that never ended properly may hold restores whose receipt
    never came (a rank that never reported): name the ranks from the
    restores in its trace. The scheduler could not: it never saw them."""
    loads = [s for s in transfers if s.attributes.get("kvobs.direction") == "h2d"]
    expected = ranks | {r for r in map(_rank, loads) if r is not None}
    for job_id in sorted({int(s.attributes.get("kvobs.job.id", -1)) for s in loads}
                         - set(ep.restore_jobs)):
        done = {_rank(s) for s in loads if int(s.attributes.get("kvobs.job.id", -1)) == job_id
                and s.attributes.get("kvobs.outcome") == "ok"}
        ep.problems.append(f"restore job {job_id}: no receipt; restored on ranks "
                           f"{sorted(r for r in done if r is not None)}, missing on ranks "
                           f"{sorted(expected - done)}")


# (scheduler generation, rank or None for the scheduler) -> the time of the
# last event that left that killed process (kv.process.end spans)
Killed = dict[tuple[str, int | None], int]


def _killed(spans: Iterable[FileSpan]) -> Killed:
    out: Killed = {}
    for s in spans:
        if s.name == PROCESS_END:
            gen = str(s.attributes.get("kvobs.scheduler.generation", ""))
            rank = s.attributes.get("kvobs.rank")
            key = (gen, int(rank) if rank is not None else None)
            out[key] = min(out.get(key, s.start_ns), s.start_ns)
    return out


def _missing(ep: Episode, what: str, missing: Iterable[int], killed: Killed) -> list[int]:
    """The ranks of ``missing`` no kill explains; notes the others."""
    left = []
    for r in sorted(missing):
        last = killed.get((ep.sched_gen, r))
        if last is not None and last <= ep.end_ns:
            ep.cut_short.append(f"{what} on rank {r}: its process was killed before "
                                "handing it over (kv.process.end)")
        else:
            left.append(r)
    return left


def _check(ep: Episode, killed: Killed | None = None) -> None:
    p = ep.problems
    killed = killed or {}
    ranks = set(range(ep.expected_ranks))
    cause = ep.root.attributes.get("kvobs.end.cause")
    cut = ep.outcome == CUT_SHORT and cause in STOP_CAUSES
    if cut:
        ep.cut_short.append(f"abandoned: {cause}")
    elif ep.outcome not in ENDED_OK and ep.outcome != tiers.STALLED:
        p.append(f"outcome {ep.outcome}")
    p.extend(tiers.check_episode(ep.root, ep.spans))  # (a stall, naming its tier)
    failed_restore = ep.outcome in FAILED_RESTORE
    # A failed restore's transfers may have failed; any other episode's
    # restores all succeeded.
    transfer_ok = ("ok", "failed") if failed_restore else ("ok",)
    # A host that cannot join processes (vLLM-HUST contract v1) leaves the
    # ranks' spans in their own traces: judge only what the scheduler saw.
    ranks_joined = ep.join_scope == "cluster"
    jobs = {int(s.attributes.get("kvobs.job.id", -1)): s for s in ep.named("kv.job")}
    transfers = ep.named("kv.transfer")
    for job_id in ep.restore_jobs:
        job = jobs.get(job_id)
        if cut and (job is None or job.attributes.get("kvobs.outcome") == CUT_SHORT):
            continue  # stopped with the process: nothing more to expect of it
        if job is None:
            p.append(f"restore job {job_id}: no kv.job span")
        else:
            roster = {int(r) for r in job.attributes.get("kvobs.receipt.ranks") or []}
            if not ranks_joined and not roster <= ranks:
                # One process's own account (the vLLM-HUST plugin's transfer
                # records): it knows how many ranks, not which.
                if len(roster) != ep.expected_ranks:
                    p.append(f"restore job {job_id}: receipt roster {sorted(roster)}, "
                             f"{ep.expected_ranks} expected")
            elif roster != ranks:
                missing = sorted(ranks - roster)
                p.append(f"restore job {job_id}: receipt roster {sorted(roster)}"
                         + (f", missing ranks {missing}" if missing else ""))
        if not ranks_joined:
            continue
        got = {_rank(s) for s in transfers
               if int(s.attributes.get("kvobs.job.id", -1)) == job_id
               and s.attributes.get("kvobs.outcome") in transfer_ok}
        absent = _missing(ep, f"restore job {job_id}: restore", ranks - got, killed)
        if absent:
            p.append(f"restore job {job_id}: restore missing on ranks {absent}")
    if ranks_joined and ep.outcome not in ENDED_OK and not cut:
        _name_unreceipted(ep, transfers, ranks)
    if failed_restore:
        _check_failure(ep, transfers, ranks_joined)
    n_adm = len(ep.named("kv.admission"))
    if ep.outcome == "restore_failed":
        # vLLM ended the request: it never came back.
        if n_adm:
            p.append(f"admission present ({n_adm}) after the request failed")
        fc_ranks = _sorted_ranks(_rank(s) for s in ep.named("kv.first_compute"))
        if fc_ranks:
            p.append(f"first compute present on ranks {fc_ranks} after the request failed")
        return
    if ep.outcome not in ADMITTED:
        return
    if n_adm != 1:
        p.append("admission missing" if n_adm == 0 else f"admission duplicated ({n_adm})")
    elif ep.outcome == "recomputed":
        kind = ep.named("kv.admission")[0].attributes.get("kvobs.compute.kind")
        if kind != "prefill":
            p.append(f"recomputed but admitted as {kind or 'unknown'}, not prefill")
    if not ranks_joined:
        return
    fc = Counter(_rank(s) for s in ep.named("kv.first_compute"))
    absent = _missing(ep, "first compute", ranks - set(fc), killed)
    if absent:
        p.append(f"first compute missing on ranks {absent}")
    dup = sorted(r for r, n in fc.items() if n > 1)
    if dup:
        p.append(f"first compute duplicated on ranks {dup}")


def _check_failure(ep: Episode, transfers: list[FileSpan], ranks_joined: bool) -> None:
    """A failed restore names its failed jobs and ranks, and (when the ranks'
    spans are joined) a failed restore transfer on one of those ranks shows it."""
    p = ep.problems
    failed_jobs, failed_ranks = ep.failed_restore_jobs, set(ep.failed_ranks)
    if not failed_jobs:
        p.append("failed restore names no job (kvobs.restore.failed_job_ids)")
    stray = sorted(set(failed_jobs) - set(ep.restore_jobs))
    if stray and "kvobs.restore.job_ids.dropped" not in ep.root.attributes:  # list capped
        p.append(f"failed restore jobs {stray} are not restore jobs of the episode")
    if not failed_ranks:
        p.append("failed restore names no rank (kvobs.restore.failed_ranks)")
    if not ranks_joined or not failed_jobs or not failed_ranks:
        return
    failed = {_rank(s) for s in transfers
              if int(s.attributes.get("kvobs.job.id", -1)) in failed_jobs
              and s.attributes.get("kvobs.outcome") == "failed"}
    if not failed & failed_ranks:
        p.append(f"no failed restore transfer on failed ranks {sorted(failed_ranks)}"
                 + (f" (failed on ranks {_sorted_ranks(failed)})" if failed else ""))


def rebuild(spans: list[FileSpan]) -> list[Episode]:
    """Every kv.recovery root with its trace, checked; ordered by start."""
    traces: dict[str, list[FileSpan]] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    episodes = []
    for trace_id, trace in traces.items():
        for root in (s for s in trace if s.name == "kv.recovery"):
            a = root.attributes
            episodes.append(Episode(
                trace_id=trace_id, request_id=str(a.get("kvobs.request.id", "")),
                epoch=int(a.get("kvobs.recovery.epoch", 0)),
                sched_gen=str(a.get("kvobs.scheduler.generation", "")),
                outcome=str(a.get("kvobs.outcome", "unknown")), start_ns=root.start_ns,
                end_ns=root.end_ns, expected_ranks=int(a.get("kvobs.receipt.expected_ranks", 1)),
                root=root, spans=trace))
    # Ids reused: one trace holding several roots, one episode key in several
    # traces, or one restore job claimed by several episodes.
    roots_per_trace = Counter(e.trace_id for e in episodes)
    traces_per_key = defaultdict(set)
    episodes_per_job = defaultdict(set)
    for e in episodes:
        traces_per_key[(e.sched_gen, e.request_id, e.epoch)].add(e.trace_id)
        for job in e.restore_jobs:
            episodes_per_job[(e.sched_gen, job)].add((e.request_id, e.epoch))
    killed = _killed(spans)
    for e in episodes:
        _check(e, killed)
        if roots_per_trace[e.trace_id] > 1:
            e.problems.append(f"trace id shared by {roots_per_trace[e.trace_id]} episodes")
        if len(traces_per_key[(e.sched_gen, e.request_id, e.epoch)]) > 1:
            e.problems.append("episode key appears in several traces")
        for job in e.restore_jobs:
            if len(episodes_per_job[(e.sched_gen, job)]) > 1:
                e.problems.append(f"restore job {job} reused by another episode")
    episodes.sort(key=lambda e: (e.start_ns, e.request_id, e.epoch))
    return episodes
