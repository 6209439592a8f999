"""Trace completeness judged against ground truth recorded from the host as
it ran, not by the product's own checker (``kvobs_otel.tools.analysis.episodes``).

- The harness (``recoveries``): its record of vLLM's own decisions: every
  preemption vLLM's scheduler made (``SchedulerOutput.preempted_req_ids``),
  every load job its connector created for a preempted request (the step
  metadata's ``load_jobs``, with the request's ``num_preemptions``), every
  re-admission (the request scheduled again after its n-th preemption).
- A vLLM-HUST stand-in chain (``chain_truth``): the records the host emitted.
- A real engine (``EngineTruth``): vLLM's own Prometheus counts and the
  client's view.

The spans must hold exactly one recovery per preemption and, for each, every
restore job with a full receipt, a restore transfer from every rank, and,
when the request was re-admitted, one admission and a first compute from
every rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chains import SpanView, by_trace


@dataclass
class Recovery:
    request_id: str
    epoch: int
    restore_jobs: set[int] = field(default_factory=set)
    resumed: bool = False


def recoveries(h: Any) -> dict[tuple[str, int], Recovery]:
    """(request, epoch) -> what vLLM did for that preemption."""
    out: dict[tuple[str, int], Recovery] = {}
    seen: Counter[str] = Counter()
    for _step, req in h.preemptions:
        seen[req] += 1
        out[(req, seen[req])] = Recovery(req, seen[req])
    for job in h.jobs:
        if job.kind == "load" and job.num_preemptions > 0:
            out[(job.req_id, job.num_preemptions)].restore_jobs.add(job.job_id)
    for req, n in h.resumed:
        out[(req, n)].resumed = True
    return out


def _rank(s: SpanView) -> Any:
    # Inline harness ranks share a process (rank attribute); a real engine's
    # workers are processes of their own (rank in the resource).
    return s.attrs.get("kvobs.rank", s.resource.get("kvobs.rank"))


def chain_truth(chain: Any) -> dict[tuple[str, int], Recovery]:
    """The same truth from what a vLLM-HUST host emitted (a stand-in chain of
    v2 ``CorrelatedObservation`` or v1 ``KVTransferObservation`` records, or
    the records behind a plugin file, ``vllm_hust_contract.jsonl``):
    each requeue opens a recovery, each restore submitted belongs to it (v1
    restores carry no epoch: the request's latest), an admission resumes it."""
    out: dict[tuple[str, int], Recovery] = {}
    latest: dict[str, int] = {}
    for emission in chain:
        r = getattr(emission, "record", emission)  # an Emission, or the record itself
        event = getattr(r.event, "value", r.event)
        epoch = getattr(r, "recovery_epoch", None) or latest.get(r.request_id or "")
        if event == "recovery_requeued":
            latest[r.request_id] = r.recovery_epoch
            out[(r.request_id, r.recovery_epoch)] = Recovery(r.request_id, r.recovery_epoch)
        elif event in ("restore_submitted", "transfer_submitted") and epoch:
            out[(r.request_id, epoch)].restore_jobs.add(r.job_id)
        elif event == "recovery_admitted":
            out[(r.request_id, epoch)].resumed = True
    return out


def assert_traces_match_vllm(h: Any, spans: list[Any], request_id: Any = None) -> int:
    """Assert the spans hold every recovery vLLM made in harness ``h``,
    complete; returns how many. ``request_id`` maps vLLM's request ids to the
    exported ones (a keyed pseudonym)."""
    return assert_traces_hold(recoveries(h), set(range(h.config.num_ranks)), spans, request_id)


def assert_traces_hold(truth: dict[tuple[str, int], Recovery], ranks: set[int],
                       spans: list[Any], request_id: Any = None) -> int:
    """Exactly one trace per recovery of ``truth``, each holding every restore
    job with a full receipt and an ok transfer from every rank, and, when the
    request was resumed, one admission and a first compute from every rank."""
    exported = request_id or (lambda r: r)
    truth = {(exported(r), n): rec for (r, n), rec in truth.items()}
    traces = by_trace(spans)
    roots: dict[tuple[str, int], list[SpanView]] = {}
    for trace in traces.values():
        for s in trace:
            if s.name == "kv.recovery":
                key = (s.attrs["kvobs.request.id"], s.attrs["kvobs.recovery.epoch"])
                assert key not in roots, f"two recovery traces for {key}"
                roots[key] = trace
    assert set(roots) == set(truth), (sorted(truth), sorted(roots))
    for key, rec in truth.items():
        trace = roots[key]
        jobs = {s.attrs["kvobs.job.id"]: s for s in trace if s.name == "kv.job"}
        for job_id in rec.restore_jobs:
            job = jobs.get(job_id)
            assert job is not None, f"{key}: the restore job {job_id} has no kv.job"
            assert set(job.attrs["kvobs.receipt.ranks"]) == ranks, (key, job.attrs)
            assert job.attrs["kvobs.outcome"] == "complete", (key, job.attrs)
            # A restore is the job's child (the span model), not only named by it.
            moved = {_rank(s) for s in trace if s.name == "kv.transfer"
                     and s.attrs["kvobs.job.id"] == job_id and s.parent_id == job.span_id
                     and s.attrs["kvobs.outcome"] == "ok"}
            assert moved == ranks, f"{key}: job {job_id} restored on ranks {sorted(moved)}"
        admissions = [s for s in trace if s.name == "kv.admission"]
        if rec.resumed:
            assert len(admissions) == 1, f"{key}: {len(admissions)} admissions"
            computed = Counter(_rank(s) for s in trace if s.name == "kv.first_compute"
                               and s.parent_id == admissions[0].span_id)
            assert computed == Counter(ranks), f"{key}: first computes {dict(computed)}"
        else:
            computed = Counter(_rank(s) for s in trace if s.name == "kv.first_compute")
            assert not admissions and not computed, f"{key}: admitted, never resumed"
    return len(truth)


@dataclass
class EngineTruth:
    """What a real vLLM engine itself says it did (its Prometheus endpoint)
    and what its client saw."""

    preemptions: int  # vllm:num_preemptions_total
    loads: int  # vllm:kv_offload_load_size_count: CPU->device transfers, every rank
    load_bytes: int  # vllm:kv_offload_load_bytes_total
    all_finished: bool  # the client got every request's tokens
    ranks: frozenset[int]

    @classmethod
    def read(cls, metrics_text: str, all_finished: bool, num_ranks: int) -> EngineTruth:
        # vLLM sums every worker's transfer stats before counting them:
        # KVOutputAggregator.aggregate ("Aggregate kv_connector_worker_meta
        # from all workers", vllm/distributed/kv_transfer/kv_connector/utils.py)
        # and TransferStats.aggregate (.../v1/offloading/common.py), counted in
        # update_connector_output (.../v1/offloading/scheduler.py), 0.32.0.
        from kvobs_otel.tools.harness.server import sum_samples

        return cls(int(sum_samples(metrics_text, "vllm:num_preemptions_total")),
                   int(sum_samples(metrics_text, "vllm:kv_offload_load_size_count")),
                   int(sum_samples(metrics_text, "vllm:kv_offload_load_bytes_total")),
                   all_finished, frozenset(range(num_ranks)))


def assert_engine_traces_match_vllm(truth: EngineTruth, spans: list[Any]) -> int:
    """Assert the recovery traces of a real engine hold what vLLM counted:
    one recovery per preemption; every CPU->device transfer vLLM counted, with
    its bytes, each job on every rank; and, when every request finished (so
    vLLM re-admitted every preempted one), one admission and a first compute
    on every rank per recovery. Returns the number of recoveries."""
    traces = [t for t in by_trace(spans).values() if any(s.name == "kv.recovery" for s in t)]
    roots = Counter((s.attrs["kvobs.request.id"], s.attrs["kvobs.recovery.epoch"])
                    for t in traces for s in t if s.name == "kv.recovery")
    assert sum(roots.values()) == truth.preemptions, (truth.preemptions, len(roots))
    assert set(roots.values()) <= {1}, [k for k, n in roots.items() if n > 1]
    loads = [s for t in traces for s in t
             if s.name == "kv.transfer" and s.attrs.get("kvobs.direction") == "h2d"]
    assert len(loads) == truth.loads, f"{len(loads)} restores traced, vLLM counted {truth.loads}"
    traced_bytes = sum(s.attrs.get("kvobs.bytes", 0) for s in loads)
    assert traced_bytes == truth.load_bytes, f"{traced_bytes} B traced, vLLM {truth.load_bytes}"
    per_job: dict[Any, set[Any]] = {}
    for s in loads:
        per_job.setdefault((s.trace_id, s.attrs["kvobs.job.id"]), set()).add(_rank(s))
    assert all(r == truth.ranks for r in per_job.values()), per_job
    if truth.all_finished:
        for t in traces:
            (root,) = [s for s in t if s.name == "kv.recovery"]
            key = (root.attrs["kvobs.request.id"], root.attrs["kvobs.recovery.epoch"])
            admissions = [s for s in t if s.name == "kv.admission"]
            computed = Counter(_rank(s) for s in t if s.name == "kv.first_compute")
            assert len(admissions) == 1, f"{key}: {len(admissions)} admissions"
            assert computed == Counter(truth.ranks), f"{key}: first computes {dict(computed)}"
    return len(traces)
