"""Rebuild recovery episodes from exported spans and judge each chain.

Input: flat spans (``FileSpan``) from an OTLP JSON file or a Jaeger query.
An episode is complete when it ended properly (see ``ENDED_OK``) and its
trace holds the whole chain: every restore job's receipt from every rank, a
restore transfer from every rank and, when it recovered, exactly one
admission and exactly one first compute per rank.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from kvobs_otel.otlp_file import FileSpan

# Episodes that ended properly. Only "recovered" has an admission and first
# computes; the others ended before the request came back, which is no fault.
ENDED_OK = {"recovered", "finished_before_resume", "aborted_before_resume", "preempted_again"}


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


def _rank(span: FileSpan) -> int | None:
    rank = span.attributes.get("kvobs.rank", span.resource.get("kvobs.rank"))
    return int(rank) if rank is not None else None


def _check(ep: Episode) -> None:
    p = ep.problems
    ranks = set(range(ep.expected_ranks))
    if ep.outcome not in ENDED_OK:
        p.append(f"outcome {ep.outcome}")
    # A host that cannot join processes (vLLM-HUST contract v1) leaves the
    # ranks' spans in their own traces: judge only what the scheduler saw.
    ranks_joined = ep.join_scope == "cluster"
    jobs = {int(s.attributes.get("kvobs.job.id", -1)): s for s in ep.named("kv.job")}
    for job_id in ep.restore_jobs:
        job = jobs.get(job_id)
        if job is None:
            p.append(f"restore job {job_id}: no kv.job span")
        else:
            roster = {int(r) for r in job.attributes.get("kvobs.receipt.ranks") or []}
            if roster != ranks:
                missing = sorted(ranks - roster)
                p.append(f"restore job {job_id}: receipt roster {sorted(roster)}"
                         + (f", missing ranks {missing}" if missing else ""))
        if not ranks_joined:
            continue
        got = {_rank(s) for s in ep.named("kv.transfer")
               if int(s.attributes.get("kvobs.job.id", -1)) == job_id
               and s.attributes.get("kvobs.outcome") == "ok"}
        if got != ranks:
            p.append(f"restore job {job_id}: restore missing on ranks {sorted(ranks - got)}")
    if ep.outcome != "recovered":
        return
    n_adm = len(ep.named("kv.admission"))
    if n_adm != 1:
        p.append("admission missing" if n_adm == 0 else f"admission duplicated ({n_adm})")
    if not ranks_joined:
        return
    fc = Counter(_rank(s) for s in ep.named("kv.first_compute"))
    if set(fc) != ranks:
        p.append(f"first compute missing on ranks {sorted(ranks - set(fc))}")
    dup = sorted(r for r, n in fc.items() if n > 1)
    if dup:
        p.append(f"first compute duplicated on ranks {dup}")


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
    for e in episodes:
        _check(e)
        if roots_per_trace[e.trace_id] > 1:
            e.problems.append(f"trace id shared by {roots_per_trace[e.trace_id]} episodes")
        if len(traces_per_key[(e.sched_gen, e.request_id, e.epoch)]) > 1:
            e.problems.append("episode key appears in several traces")
        for job in e.restore_jobs:
            if len(episodes_per_job[(e.sched_gen, job)]) > 1:
                e.problems.append(f"restore job {job} reused by another episode")
    episodes.sort(key=lambda e: (e.start_ns, e.request_id, e.epoch))
    return episodes
