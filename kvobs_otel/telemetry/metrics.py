"""Records -> OpenTelemetry metrics (the alerting side; spans carry evidence).

Dimensions stay low-cardinality: direction, outcome, rank, role, reason -
never ids. Names follow OTel conventions (dots, units); the Prometheus
exporter turns ``kvobs.receipts.incomplete`` into
``kvobs_receipts_incomplete_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanContext, TraceFlags

from kvobs_otel import identity
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.telemetry.providers import SCOPE, Providers

_NS = 1e-9
# Seconds, from a 100 us copy to a minute-long recovery (the SDK's default
# boundaries start at 5 and would put every KV transfer in the first bucket).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _in_trace(trace_id: int, span_id: int) -> Context:
    """A context whose span is the given one: the SDK takes exemplars' trace ids from it."""
    return trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))


class MetricsBuilder:
    def __init__(self, providers: Providers, *,
                 open_receipts: Callable[[], int] | None = None,
                 drops: Callable[[], dict[str, int]] | None = None,
                 errors: Callable[[], dict[str, int]] | None = None,
                 anomalies: Callable[[], dict[str, int]] | None = None,
                 refused: Callable[[], dict[str, int]] | None = None,
                 exported: Callable[[], dict[str, int]] | None = None,
                 scheduler: bool = False) -> None:
        m = providers.meter_provider.get_meter(SCOPE)
        # The per-transfer counters are summed here and read by the SDK at
        # collection time: an SDK measurement costs microseconds (attribute
        # hashing, views), and these two would be paid per transfer.
        self._transfers: Counter[tuple[str, str, int]] = Counter()  # direction, outcome, rank
        self._bytes: Counter[tuple[str, int]] = Counter()  # direction, rank
        m.create_observable_counter(
            "kvobs.transfers", unit="{transfer}", description="KV transfers by direction/outcome",
            callbacks=[lambda _o: [Observation(v, {"direction": d, "outcome": o, "rank": r})
                                   for (d, o, r), v in list(self._transfers.items())]])
        m.create_observable_counter(
            "kvobs.transfer.bytes", unit="By", description="Bytes moved by KV transfers",
            callbacks=[lambda _o: [Observation(v, {"direction": d, "rank": r})
                                   for (d, r), v in list(self._bytes.items())]])
        self.duration = m.create_histogram(
            "kvobs.transfer.duration", unit="s",
            description="Transfer duration: clock=host (submit->result) or device",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self.jobs = m.create_counter(
            "kvobs.jobs", unit="{job}", description="Transfer jobs by kind and receipt outcome")
        self.incomplete = m.create_counter(
            "kvobs.receipts.incomplete", unit="{job}",
            description="Jobs whose receipt still missed ranks at the deadline or shutdown")
        self.episodes = m.create_counter(
            "kvobs.recovery.episodes", unit="{episode}", description="Recovery episodes by outcome")
        self.recovery = m.create_histogram(
            "kvobs.recovery.latency", unit="s", description="Preemption -> first compute",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self.admission_wait = m.create_histogram(
            "kvobs.admission.wait", unit="s", description="Restore received -> re-admission",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self.first_compute = m.create_counter(
            "kvobs.first_compute", unit="{event}", description="First computes after recovery")
        if scheduler:
            # Counters an alert takes increase() of start at 0: a series whose
            # first sample is already 1 shows no increase to Prometheus.
            for kind in ("load", "store"):
                for outcome in (rec.RECEIPT_INCOMPLETE, rec.ABANDONED):
                    self.incomplete.add(0, {"kind": kind, "outcome": outcome})
            for outcome in (rec.RECOVERED, rec.FINISHED_BEFORE_RESUME, rec.ABORTED_BEFORE_RESUME,
                            rec.PREEMPTED_AGAIN, rec.RECEIPT_INCOMPLETE,
                            rec.FIRST_COMPUTE_INCOMPLETE, rec.ABANDONED):
                self.episodes.add(0, {"outcome": outcome})
        if open_receipts is not None:
            m.create_observable_gauge(
                "kvobs.receipts.open", unit="{job}", description="Jobs with an open receipt",
                callbacks=[lambda _o: [Observation(open_receipts())]])
        # Counts kept elsewhere (per process or per host), read at collection.
        for source, name, unit, key, description in (
            (drops, "kvobs.observer.dropped", "{event}", "reason",
             "Observations dropped, by reason"),
            (exported, "kvobs.observer.exported", "{span}", "signal",
             "Spans the exporter delivered (accepted by the endpoint or file)"),
            (errors, "kvobs.observer.errors", "{error}", "stage",
             "Internal observer failures contained, by stage"),
            (anomalies, "kvobs.observer.anomalies", "{event}", "kind",
             "Host records that could not be joined (late, unknown or duplicate receipts; "
             "results without a submission or job)"),
            (refused, "kvobs.host.refused", "{record}", "reason",
             "Host contracts and records refused (unknown versions, malformed records), "
             "by reason"),
        ):
            if source is not None:
                m.create_observable_counter(name, unit=unit, description=description,
                                            callbacks=[self._by(key, source)])

    @staticmethod
    def _by(key: str, source: Callable[[], dict[str, int]]
            ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {key: k}) for k, v in source().items()]
        return callback

    def record(self, r: object) -> None:
        if isinstance(r, rec.TransferRecord):
            self._transfers[(r.direction, r.outcome, r.rank)] += 1
            if r.outcome == rec.TRANSFER_OK:
                d = {"direction": r.direction, "rank": r.rank}
                if r.size_bytes:
                    self._bytes[(r.direction, r.rank)] += int(r.size_bytes)
                ctx = None
                if r.req_id is not None and r.join_scope == rec.JOIN_CLUSTER:
                    # exemplar -> the transfer's job span
                    tid = identity.trace_id(r.sched_gen, r.req_id, r.episode_epoch)
                    ctx = _in_trace(tid, identity.job_span_id(r.sched_gen, r.job_id))
                self.duration.record((r.end_ns - r.start_ns) * _NS, {**d, "clock": "host"},
                                     context=ctx)
                if r.device_time_s is not None:
                    self.duration.record(float(r.device_time_s), {**d, "clock": "device"},
                                         context=ctx)
        elif isinstance(r, rec.JobRecord):
            self.jobs.add(1, {"kind": r.kind, "outcome": r.outcome})
            if r.outcome != rec.COMPLETE:
                self.incomplete.add(1, {"kind": r.kind, "outcome": r.outcome})
        elif isinstance(r, rec.EpisodeRecord):
            self.episodes.add(1, {"outcome": r.outcome})
            ctx = _in_trace(*identity.episode_ids(r.sched_gen, r.req_id, r.epoch))
            # Preemption -> first compute; a host that sees first compute only
            # on the ranks (vLLM-HUST) cannot measure it in the scheduler.
            if r.outcome == rec.RECOVERED and r.first_compute_observed:
                self.recovery.record((r.end_ns - r.start_ns) * _NS, context=ctx)
            if r.admitted_ns is not None and r.ready_ns is not None:
                self.admission_wait.record(max(0, r.admitted_ns - r.ready_ns) * _NS,
                                           context=ctx)
        elif isinstance(r, rec.FirstComputeRecord):
            self.first_compute.add(1, {"rank": r.rank, "compute_kind": r.compute_kind})
