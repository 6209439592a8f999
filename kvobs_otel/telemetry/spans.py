"""Records -> OpenTelemetry spans, with explicit timestamps and derived ids.

Runs on the drain thread only. Parentage:

    kv.recovery (root, scheduler; id from the episode key)
      kv.job      (scheduler; id from (scheduler generation, job id))
        kv.transfer   (each rank)
      kv.admission  (scheduler; id from the episode key)
        kv.first_compute (each rank)

Ordinary offload traffic has the same shape under a ``kv.request`` root whose
trace id comes from (scheduler generation, request id).
"""

from __future__ import annotations

import random
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kvobs_otel import identity
from kvobs_otel.clock import wall_anchor_ns
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.package import __version__
from kvobs_otel.telemetry import attributes as A
from kvobs_otel.telemetry.otlp_encode import SpanEncoder
from kvobs_otel.telemetry.providers import SCOPE, Providers

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _context(parent: tuple[int, int]) -> SpanContext:
    return SpanContext(parent[0], parent[1], is_remote=True, trace_flags=_SAMPLED)


def parse_traceparent(value: str | None) -> SpanContext | None:
    """W3C traceparent -> remote SpanContext, or None when malformed."""
    if not value or not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        tid, sid, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not tid or not sid:
        return None
    return SpanContext(tid, sid, is_remote=True, trace_flags=TraceFlags(flags))


_UNSET = Status(StatusCode.UNSET)
_random_bits = random.getrandbits  # as the SDK's RandomIdGenerator
_ERROR = StatusCode.ERROR.value

# A parent or link target: (trace_id, span_id); parents are always remote
# contexts (another process, or a span this builder derived but never holds).
Ref = tuple[int, int]
# A link: (trace_id, span_id, is_remote, trace_flags, attributes)
LinkT = tuple[int, int, bool, int, dict[str, Any]]


# Outcomes that end a span with ERROR status (error.type named here). An
# abandoned job or episode is not one: its process stopped before it could
# finish (kvobs.end.cause says how), which no rank or transfer did wrong.
_JOB_ERROR = {rec.JOB_FAILED: "transfer_failed"}
_EPISODE_ERRORS = frozenset((rec.RECEIPT_INCOMPLETE, rec.FIRST_COMPUTE_INCOMPLETE,
                             rec.ABANDONED, rec.RESTORE_FAILED, rec.TIER_STALLED))


def _random_id(bits: int) -> int:
    return _random_bits(bits) or 1


class SpanBuilder:
    """Finished spans go to the export stage either as OTLP ``Span`` bytes,
    encoded here from the record's fields (when every exporter takes them:
    no SDK span object is made, and the export queue holds bytes the garbage
    collector never scans), or as the SDK's ``ReadableSpan`` (other
    exporters: console, file, tests' in-memory ones). Either way no tracer:
    every id and timestamp is known already, and the tracer API would only
    add per-span cost (context, sampler, locks)."""

    def __init__(self, providers: Providers, traffic_ratio: float, roster_cap: int,
                 offset_ns: int | None = None) -> None:
        self.sink = providers.spans
        self.resource = providers.resource
        self.scope = InstrumentationScope(SCOPE, __version__)
        self.encoded_sinks = list(providers.encoded_sinks)
        self.encoder = SpanEncoder() if self.encoded_sinks else None
        self.ratio = traffic_ratio
        self.cap = roster_cap
        # monotonic -> wall clock, once per observed process (explicit span
        # timestamps; a sidecar is given its vLLM process's)
        self.offset_ns = wall_anchor_ns() if offset_ns is None else offset_ns
        self.spans_built = 0
        self.unsampled = 0

    # -- helpers ------------------------------------------------------------------
    def _ids_list(self, attrs: dict[str, Any], key: str, values: list[int]) -> None:
        attrs[key] = list(values[: self.cap])
        if len(values) > self.cap:
            attrs[key + A.LIST_DROPPED_SUFFIX] = len(values) - self.cap

    def _span(self, name: str, parent: Ref | None, start_ns: int, end_ns: int,
              attrs: dict[str, Any], *, trace_id: int | None = None, span_id: int | None = None,
              error: str | None = None, links: list[LinkT] | None = None,
              events: list[rec.EpisodeEvent] | None = None) -> None:
        tid = parent[0] if parent is not None else trace_id or _random_id(128)
        sid = span_id or _random_id(64)
        if error is not None:
            attrs[A.ERROR_TYPE] = error
        off = self.offset_ns
        start, end = start_ns + off, max(end_ns, start_ns) + off
        if self.encoder is not None:
            data = self.encoder.encode(
                name, tid, sid, parent[1] if parent is not None else 0, parent is not None,
                start, end, attrs,
                [(e.name, e.t_ns + off, e.attributes, 0) for e in events] if events else (),
                [(lt, ls, remote, la, 0) for lt, ls, remote, _f, la in links] if links else (),
                _ERROR if error is not None else 0, error or "")
            for sink in self.encoded_sinks:
                sink.on_encoded(self.resource, self.scope, data)
        else:
            self.sink.on_end(ReadableSpan(
                name, SpanContext(tid, sid, is_remote=False, trace_flags=_SAMPLED),
                _context(parent) if parent is not None else None, self.resource,
                {k: v for k, v in attrs.items() if v is not None},
                events=tuple(Event(e.name, e.attributes, e.t_ns + off) for e in events or ()),
                links=tuple(Link(SpanContext(lt, ls, is_remote=remote,
                                             trace_flags=TraceFlags(flags)), la)
                            for lt, ls, remote, flags, la in links or ()),
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode.ERROR, error) if error is not None else _UNSET,
                start_time=start, end_time=end, instrumentation_scope=self.scope))
        self.spans_built += 1

    def _traffic_parent(self, sched_gen: str, req_id: str) -> Any | None:
        tid, sid = identity.request_ids(sched_gen, req_id)
        if not identity.traffic_sampled(tid, self.ratio):
            self.unsampled += 1
            return None
        return (tid, sid)

    def _trace_for(self, sched_gen: str, req_id: str | None, epoch: int) -> Any | None:
        if req_id is None:
            return None
        if epoch:
            return identity.episode_ids(sched_gen, req_id, epoch)
        return self._traffic_parent(sched_gen, req_id)

    @staticmethod
    def _link(traceparent: str | None) -> list[LinkT] | None:
        ctx = parse_traceparent(traceparent)
        return ([(ctx.trace_id, ctx.span_id, True, ctx.trace_flags, {"kvobs.link": "vllm.request"})]
                if ctx else None)

    # -- records ------------------------------------------------------------------
    def build(self, r: Any) -> None:
        if isinstance(r, rec.TransferRecord):
            self._transfer(r)
        elif isinstance(r, rec.JobRecord):
            self._job(r)
        elif isinstance(r, rec.EpisodeRecord):
            self._episode(r)
        elif isinstance(r, rec.FirstComputeRecord):
            self._first_compute(r)
        elif isinstance(r, rec.RequestRecord):
            self._request(r)
        elif isinstance(r, rec.ProcessEndRecord):
            self._process_end(r)
        elif isinstance(r, rec.TierJobRecord):
            self._tier_job(r)
        elif isinstance(r, rec.WaitRecord):
            self._wait(r)

    def _job(self, r: rec.JobRecord) -> None:
        root = self._trace_for(r.sched_gen, r.req_id, r.episode_epoch)
        if root is None:
            return
        attrs: dict[str, Any] = {
            A.REQUEST_ID: r.req_id, A.JOB_ID: r.job_id, A.JOB_KIND: r.kind,
            A.JOB_SYNC: r.sync, A.BLOCKS: r.blocks, A.SCHED_GEN: r.sched_gen,
            A.RECEIPT_EXPECTED: r.expected_ranks, A.OUTCOME: r.outcome,
            A.JOB_FLUSHED: r.flushed,
        }
        self._ids_list(attrs, A.RECEIPT_RANKS, r.receipt_ranks)
        self._ids_list(attrs, A.RECEIPT_MISSING, r.missing_ranks)
        if r.duplicate_receipts:
            attrs[A.RECEIPT_DUPLICATES] = r.duplicate_receipts
        if r.last_ranks:
            self._ids_list(attrs, A.RECEIPT_LAST, r.last_ranks)
            attrs[A.RECEIPT_SPREAD] = r.receipt_spread_ns * 1e-9
        events = None
        if r.kind == "store":
            attrs[A.HOST_CHUNKS] = r.host_chunks
        if r.failed_ranks:
            self._ids_list(attrs, A.RECEIPT_FAILED, r.failed_ranks)
            if r.kind == "store":
                # vLLM drops a failed store's chunks rather than publish them.
                attrs[A.HOST_DROPPED] = r.host_chunks
                events = [rec.EpisodeEvent("kv.host_tier.dropped", r.end_ns,
                                           {A.HOST_DROPPED: r.host_chunks})]
        if r.episode_role:
            attrs[A.JOB_ROLE] = r.episode_role
            attrs[A.EPOCH] = r.episode_epoch
        if r.end_cause:
            attrs[A.END_CAUSE] = r.end_cause
        self._span(A.SPAN_JOB, root, r.start_ns, r.end_ns, attrs,
                   span_id=identity.job_span_id(r.sched_gen, r.job_id),
                   error=None if r.outcome == rec.COMPLETE or rec.stopped(r.outcome, r.end_cause)
                   else _JOB_ERROR.get(r.outcome, r.outcome),
                   events=events)

    def _transfer(self, r: rec.TransferRecord) -> None:
        if r.join_scope == rec.JOIN_PROCESS:
            parent = None  # a root of its own: nothing to join it to
        elif self._trace_for(r.sched_gen, r.req_id, r.episode_epoch) is None:
            return
        else:
            tid = identity.trace_id(r.sched_gen, r.req_id, r.episode_epoch)
            parent = (tid, identity.job_span_id(r.sched_gen, r.job_id))
        attrs: dict[str, Any] = {
            A.REQUEST_ID: r.req_id, A.JOB_ID: r.job_id, A.DIRECTION: r.direction,
            A.BLOCKS: r.blocks, A.RANK: r.rank, A.WORKER_GEN: r.worker_gen,
            A.SCHED_GEN: r.sched_gen, A.OUTCOME: r.outcome, A.EXPEDITED: r.expedited,
        }
        if r.size_bytes is not None:
            attrs[A.BYTES] = int(r.size_bytes)
        if r.device_time_s is not None:
            attrs[A.DEVICE_DURATION] = float(r.device_time_s)
        if r.episode_epoch:
            attrs[A.EPOCH] = r.episode_epoch
        if r.join_scope != rec.JOIN_CLUSTER:
            attrs[A.JOIN_SCOPE] = r.join_scope
        if r.end_cause:  # cancelled because its process stopped: no fault
            attrs[A.END_CAUSE] = r.end_cause
        ok = r.outcome == rec.TRANSFER_OK or r.end_cause in rec.END_CAUSES
        self._span(A.SPAN_TRANSFER, parent, r.start_ns, r.end_ns, attrs,
                   error=None if ok else f"transfer_{r.outcome}")

    def _first_compute(self, r: rec.FirstComputeRecord) -> None:
        attrs: dict[str, Any] = {
            A.REQUEST_ID: r.req_id, A.EPOCH: r.epoch, A.RANK: r.rank,
            A.WORKER_GEN: r.worker_gen, A.SCHED_GEN: r.sched_gen}
        if r.compute_kind:  # a v1 host may not know it
            attrs[A.COMPUTE_KIND] = r.compute_kind
        if r.join_scope == rec.JOIN_PROCESS:
            attrs[A.JOIN_SCOPE] = r.join_scope
            parent = None
        else:
            tid, _ = identity.episode_ids(r.sched_gen, r.req_id, r.epoch)
            parent = (tid, identity.admission_span_id(r.sched_gen, r.req_id, r.epoch))
        self._span(A.SPAN_FIRST_COMPUTE, parent, r.start_ns, r.end_ns, attrs)

    def _episode(self, r: rec.EpisodeRecord) -> None:
        tid, sid = identity.episode_ids(r.sched_gen, r.req_id, r.epoch)
        attrs: dict[str, Any] = {
            A.REQUEST_ID: r.req_id, A.EPOCH: r.epoch, A.SCHED_GEN: r.sched_gen,
            A.OUTCOME: r.outcome, A.RECEIPT_EXPECTED: r.expected_ranks,
        }
        self._ids_list(attrs, A.PRESERVE_JOBS, r.preserve_jobs)
        self._ids_list(attrs, A.RESTORE_JOBS, r.restore_jobs)
        if r.admitted_ns is not None and r.first_compute_observed:
            self._ids_list(attrs, A.FIRST_COMPUTE_RANKS, r.first_compute_ranks)
        if r.join_scope != rec.JOIN_CLUSTER:
            attrs[A.JOIN_SCOPE] = r.join_scope
        if r.missing_first_compute_ranks:
            self._ids_list(attrs, A.FIRST_COMPUTE_MISSING, r.missing_first_compute_ranks)
        if r.incomplete_jobs:
            self._ids_list(attrs, A.INCOMPLETE_JOBS, r.incomplete_jobs)
        if r.compute_kind:
            attrs[A.COMPUTE_KIND] = r.compute_kind
        if r.failed_restore_jobs:
            self._ids_list(attrs, A.RESTORE_FAILED_JOBS, r.failed_restore_jobs)
            self._ids_list(attrs, A.RESTORE_FAILED_RANKS, r.failed_ranks)
        for source, n in r.tokens():
            if n is not None:
                attrs[A.TOKENS[source]] = n
        if r.tier_jobs:
            self._ids_list(attrs, A.TIER_JOB_IDS, r.tier_jobs)
        if r.promoted_chunks:
            by_tier = [r.promoted_chunks.get(i, 0) for i in range(max(r.promoted_chunks) + 1)]
            attrs[A.TIER_PROMOTED] = sum(by_tier)
            attrs[A.TIER_PROMOTED_BY] = by_tier
        if r.recompute_reason:
            attrs[A.RECOMPUTE_REASON] = r.recompute_reason
        if r.tokens_restored_by_tier and r.tokens_restored is not None:
            by = r.tokens_restored_by_tier
            attrs[A.TOKENS_RESTORED_BY_TIER] = [by.get(i, 0) for i in range(max(by) + 1)]
            attrs[A.TOKENS_RESTORED_CPU] = r.tokens_restored - sum(by.values())
        if r.end_cause:
            attrs[A.END_CAUSE] = r.end_cause
        failed = r.outcome in _EPISODE_ERRORS and not rec.stopped(r.outcome, r.end_cause)
        links = list(self._link(r.traceparent) or [])
        rtid, rsid = identity.request_ids(r.sched_gen, r.req_id)
        if identity.traffic_sampled(rtid, self.ratio):
            links.append((rtid, rsid, True, _SAMPLED, {"kvobs.link": "kv.request"}))
        self._span(A.SPAN_RECOVERY, None, r.start_ns, r.end_ns, attrs, trace_id=tid,
                   span_id=sid, error=r.outcome if failed else None, links=links or None,
                   events=r.events)
        if r.admitted_ns is not None:
            ready = r.ready_ns if r.ready_ns is not None else r.admitted_ns
            adm: dict[str, Any] = {A.REQUEST_ID: r.req_id, A.EPOCH: r.epoch,
                                   A.COMPUTE_KIND: r.compute_kind or "",
                                   A.SCHED_GEN: r.sched_gen}
            self._ids_list(adm, A.ROSTER, sorted(r.restore_jobs))
            self._span(A.SPAN_ADMISSION, (tid, sid), min(ready, r.admitted_ns),
                       r.admitted_ns, adm,
                       span_id=identity.admission_span_id(r.sched_gen, r.req_id, r.epoch))

    def _request(self, r: rec.RequestRecord) -> None:
        tid, sid = identity.request_ids(r.sched_gen, r.req_id)
        if not identity.traffic_sampled(tid, self.ratio):
            return
        attrs: dict[str, Any] = {A.REQUEST_ID: r.req_id, A.SCHED_GEN: r.sched_gen,
                                 A.OUTCOME: r.outcome, A.JOBS: r.jobs}
        if r.tier_jobs:
            attrs[A.TIER_JOBS] = r.tier_jobs
        if r.end_cause:
            attrs[A.END_CAUSE] = r.end_cause
        self._span(A.SPAN_REQUEST, None, r.start_ns, r.end_ns, attrs, trace_id=tid,
                   span_id=sid, links=self._link(r.traceparent),
                   error="abandoned" if r.outcome == rec.ABANDONED
                   and not rec.stopped(r.outcome, r.end_cause) else None)

    def _tier_job(self, r: rec.TierJobRecord) -> None:
        root = self._trace_for(r.sched_gen, r.req_id, r.episode_epoch)
        if root is None:
            return
        attrs: dict[str, Any] = {
            A.REQUEST_ID: r.req_id, A.SCHED_GEN: r.sched_gen, A.TIER_INDEX: r.tier_index,
            A.TIER_TYPE: r.tier_type, A.TIER_JOB_ID: r.tier_job_id, A.TIER_JOB_KIND: r.kind,
            A.TIER_CHUNKS: r.chunks, A.OUTCOME: r.outcome}
        if r.medium:
            attrs[A.TIER_MEDIUM] = r.medium
        if r.locality:
            attrs[A.TIER_LOCALITY] = r.locality
        if r.chunks_ok is not None:
            attrs[A.TIER_CHUNKS_OK] = r.chunks_ok
        if r.size_bytes is not None:
            attrs[A.BYTES] = int(r.size_bytes)
        if r.io_time_s is not None:
            attrs[A.TIER_IO_DURATION] = float(r.io_time_s)
        if r.release_deferred:
            attrs[A.TIER_RELEASE_DEFERRED] = True
        if r.episode_epoch:
            attrs[A.EPOCH] = r.episode_epoch
        if r.end_cause:
            attrs[A.END_CAUSE] = r.end_cause
        ok = r.outcome == rec.TIER_OK or rec.stopped(r.outcome, r.end_cause)
        self._span(A.SPAN_TIER_JOB, root, r.start_ns, r.end_ns, attrs,
                   span_id=identity.tier_job_span_id(r.sched_gen, r.tier_job_id),
                   error=None if ok else f"{r.kind}_{r.outcome}")

    def _wait(self, r: rec.WaitRecord) -> None:
        root = self._trace_for(r.sched_gen, r.req_id, r.episode_epoch)
        if root is None:
            return
        attrs: dict[str, Any] = {
            A.REQUEST_ID: r.req_id, A.SCHED_GEN: r.sched_gen, A.WAIT_PASSES: r.passes,
            A.WAIT_REASONS: list(r.reasons), A.OUTCOME: r.outcome}
        if r.tiers:
            attrs[A.TIER_INDEXES] = list(r.tiers)
        if r.episode_epoch:
            attrs[A.EPOCH] = r.episode_epoch
        if r.end_cause:
            attrs[A.END_CAUSE] = r.end_cause
        self._span(A.SPAN_WAIT, root, r.start_ns, r.end_ns, attrs,
                   span_id=identity.wait_span_id(r.sched_gen, r.req_id, r.start_ns),
                   error="wait_hung" if r.outcome == rec.TIER_HUNG else None)

    def _process_end(self, r: rec.ProcessEndRecord) -> None:
        """From the process's last event its sidecar got to the end of its
        pipe: what it recorded in that window may never have left it."""
        attrs: dict[str, Any] = {A.END_CAUSE: r.cause, A.SCHED_GEN: r.sched_gen,
                                 A.UNSENT_EVENTS: r.unsent_events}
        if r.rank is not None:
            attrs[A.RANK] = r.rank
        self._span(A.SPAN_PROCESS_END, None, r.last_event_ns or r.end_ns, r.end_ns, attrs)
