"""Records -> OpenTelemetry metrics (the alerting side; spans carry evidence).

Dimensions stay low-cardinality: direction, outcome, rank, role, reason -
never ids. Names follow OTel conventions (dots, units); the Prometheus
exporter turns ``kvobs.receipts.incomplete`` into
``kvobs_receipts_incomplete_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from kvobs_otel import identity
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.telemetry.providers import SCOPE, Providers

_NS = 1e-9
# Seconds, from a 100 us copy to a minute-long recovery (the SDK's default
# boundaries start at 5 and would put every KV transfer in the first bucket).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# Receipts that never completed. A job abandoned because its process stopped
# (kvobs.end.cause) is not one: no rank failed to answer, so it is counted in
# kvobs.jobs{outcome="abandoned"} only, and pages nobody.
_INCOMPLETE = frozenset((rec.RECEIPT_INCOMPLETE, rec.ABANDONED))


class MetricsBuilder:
    def __init__(self, providers: Providers, *,
                 open_receipts: Callable[[], int] | None = None,
                 drops: Callable[[], dict[str, int]] | None = None,
                 errors: Callable[[], dict[str, int]] | None = None,
                 anomalies: Callable[[], dict[str, int]] | None = None,
                 refused: Callable[[], dict[str, int]] | None = None,
                 exported: Callable[[], dict[str, int]] | None = None,
                 tiers: Any = None,
                 scheduler: bool = False, worker_rank: int | None = None) -> None:
        m = providers.meter_provider.get_meter(SCOPE)
        self._meter = m
        # Counted here and read by the SDK at collection time; histograms
        # aggregated here too (histograms.py): an SDK measurement costs
        # 5-15 us (attribute hashing, views, exemplars), paid per record on
        # the drain thread, which shares the GIL with vLLM's serving thread.
        self.transfers = self._counter(
            "kvobs.transfers", "{transfer}", "KV transfers by direction/outcome",
            ("direction", "outcome", "rank"))
        self.bytes = self._counter("kvobs.transfer.bytes", "By", "Bytes moved by KV transfers",
                                   ("direction", "rank"))
        self.jobs = self._counter("kvobs.jobs", "{job}",
                                  "Transfer jobs by kind and receipt outcome", ("kind", "outcome"))
        self.incomplete = self._counter(
            "kvobs.receipts.incomplete", "{job}",
            "Jobs whose receipt still missed ranks at the deadline",
            ("kind", "outcome"))
        self.episodes = self._counter("kvobs.recovery.episodes", "{episode}",
                                      "Recovery episodes by outcome", ("outcome",))
        self.tokens = self._counter(
            "kvobs.recovery.tokens", "{token}",
            "Recovered requests' tokens by where their KV came from (restored from the host "
            "tier, resident in the device prefix cache, recomputed, other_connector inside "
            "vLLM's MultiConnector) and the computed tokens preemptions discarded", ("source",))
        self.first_compute = self._counter("kvobs.first_compute", "{event}",
                                           "First computes after recovery",
                                           ("rank", "compute_kind"))
        h = self._histograms = providers.histograms
        self.duration = h.create(
            "kvobs.transfer.duration", "s",
            "Transfer duration: clock=host (submit->result) or device", LATENCY_BUCKETS)
        self.recovery = h.create("kvobs.recovery.latency", "s", "Preemption -> first compute",
                                 LATENCY_BUCKETS)
        self.admission_wait = h.create("kvobs.admission.wait", "s",
                                       "Restore received -> re-admission", LATENCY_BUCKETS)
        self.wait = None
        if scheduler:
            self.wait = h.create("kvobs.wait.duration", "s",
                                 "Connector's first 'not yet' -> its answer, by main reason",
                                 LATENCY_BUCKETS)
            # Counters an alert takes increase() of start at 0: a series whose
            # first sample is already 1 shows no increase to Prometheus.
            for kind in ("load", "store"):
                self.incomplete[(kind, rec.RECEIPT_INCOMPLETE)] += 0
                self.jobs[(kind, rec.JOB_FAILED)] += 0
            for outcome in (rec.RECOVERED, rec.FINISHED_BEFORE_RESUME, rec.ABORTED_BEFORE_RESUME,
                            rec.PREEMPTED_AGAIN, rec.RECEIPT_INCOMPLETE,
                            rec.FIRST_COMPUTE_INCOMPLETE, rec.ABANDONED, rec.RESTORE_FAILED,
                            rec.RECOMPUTED):
                self.episodes[(outcome,)] += 0
        self._tiers: list[Any] = []
        if tiers is not None and tiers.tiers:
            self._tier_metrics(m, tiers)
        if worker_rank is not None:
            # Failed transfers (vLLM 0.34+) from 0, for rate() and increase().
            for direction in ("d2h", "h2d"):
                self.transfers[(direction, rec.TRANSFER_FAILED, worker_rank)] += 0
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
             "Hosts, host contracts and records refused (vLLM versions or shapes the seams "
             "do not fit, unknown vLLM-HUST contracts, malformed records), by reason"),
        ):
            if source is not None:
                m.create_observable_counter(name, unit=unit, description=description,
                                            callbacks=[self._by(key, source)])

    def _tier_metrics(self, m: Any, ledger: Any) -> None:
        """Secondary tiers (only where the spec has them): vLLM exports the
        per-tier aggregates itself; these add the outcome and, through
        exemplars, the request or episode trace."""
        self.restored_by_tier = self._counter(
            "kvobs.recovery.tokens.restored", "{token}",
            "Recovered requests' restored tokens by the tier they came from (cpu: already in "
            "the CPU tier; else the secondary tier that promoted them)", ("tier",))
        self.tier_jobs = self._counter(
            "kvobs.tier.jobs", "{job}", "Secondary-tier jobs by tier, kind and outcome",
            ("tier", "tier_index", "kind", "outcome"))
        self.tier_bytes = self._counter("kvobs.tier.bytes", "By",
                                        "Bytes secondary-tier jobs moved", ("tier", "kind"))
        m.create_observable_counter(
            "kvobs.tier.promotion.no_room", unit="{chunk}",
            description="Secondary hits not promoted: no free CPU chunk",
            callbacks=[lambda _o: [Observation(n, {"tier": ledger._tier(i)[0]})
                                   for i, n in list(ledger.no_room_count.items())]])
        m.create_observable_counter(
            "kvobs.tier.cascade.skipped", unit="{chunk}",
            description="Chunks a tier's back-pressure kept from cascading to it",
            callbacks=[lambda _o: [Observation(n, {"tier": ledger._tier(i)[0]})
                                   for i, n in list(ledger.skipped_chunks.items())]])
        m.create_observable_gauge(
            "kvobs.tier.backpressure", unit="{state}",
            description="1 while a tier's back-pressure holds cascades back",
            callbacks=[lambda _o: [Observation(int(ledger.pressure.get(i, False)),
                                               {"tier": t[0], "tier_index": i})
                                   for i, t in enumerate(ledger.tiers)]])
        self.waits_stalled = self._counter(
            "kvobs.waits.stalled", "{request}",
            "Requests the connector still answered 'not yet' at the tier deadline, by the "
            "main reason of their wait", ("reason",))
        for reason in rec.WAIT_REASONS:
            self.waits_stalled[(reason,)] += 0
        self.tier_duration = self._histograms.create(
            "kvobs.tier.job.duration", "s", "Secondary-tier job: registered -> result seen",
            LATENCY_BUCKETS)
        for i, (kind_name, _medium, _loc) in enumerate(ledger.tiers):
            for kind in (rec.PROMOTION, rec.CASCADE):
                for outcome in (rec.TIER_FAILED, rec.TIER_HUNG):
                    self.tier_jobs[(kind_name, i, kind, outcome)] += 0
        self._tiers = ledger.tiers

        def open_jobs(_o: CallbackOptions) -> list[Observation]:
            return [Observation(n, {"tier": t, "kind": k}) for (t, k), (n, _a)
                    in ledger.open_state().items()]

        def oldest(_o: CallbackOptions) -> list[Observation]:
            return [Observation(a, {"tier": t, "kind": k}) for (t, k), (_n, a)
                    in ledger.open_state().items()]

        m.create_observable_gauge("kvobs.tier.jobs.open", unit="{job}",
                                  description="Secondary-tier jobs without a result yet",
                                  callbacks=[open_jobs])
        m.create_observable_gauge("kvobs.tier.jobs.oldest_age", unit="s",
                                  description="Age of the oldest secondary-tier job without a "
                                              "result", callbacks=[oldest])

    def _counter(self, name: str, unit: str, description: str,
                 keys: tuple[str, ...]) -> Counter[tuple[Any, ...]]:
        """A monotonic sum kept as a Counter of attribute-value tuples."""
        counts: Counter[tuple[Any, ...]] = Counter()
        self._meter.create_observable_counter(
            name, unit=unit, description=description,
            callbacks=[lambda _o: [Observation(v, dict(zip(keys, k, strict=True)))
                                   for k, v in list(counts.items())]])
        return counts

    @staticmethod
    def _by(key: str, source: Callable[[], dict[str, int]]
            ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {key: k}) for k, v in source().items()]
        return callback

    def record(self, r: object) -> None:
        if isinstance(r, rec.TransferRecord):
            self.transfers[(r.direction, r.outcome, r.rank)] += 1
            if r.outcome == rec.TRANSFER_OK:
                if r.size_bytes:
                    self.bytes[(r.direction, r.rank)] += int(r.size_bytes)
                tid = sid = 0
                if r.req_id is not None and r.join_scope == rec.JOIN_CLUSTER:
                    # exemplar -> the transfer's job span
                    tid = identity.trace_id(r.sched_gen, r.req_id, r.episode_epoch)
                    sid = identity.job_span_id(r.sched_gen, r.job_id)
                self.duration.record((("direction", r.direction), ("rank", r.rank),
                                      ("clock", "host")), (r.end_ns - r.start_ns) * _NS, tid, sid)
                if r.device_time_s is not None:
                    self.duration.record((("direction", r.direction), ("rank", r.rank),
                                          ("clock", "device")), float(r.device_time_s), tid, sid)
        elif isinstance(r, rec.JobRecord):
            self.jobs[(r.kind, r.outcome)] += 1
            # (a failed transfer's receipt is complete)
            if r.outcome in _INCOMPLETE and not rec.stopped(r.outcome, r.end_cause):
                self.incomplete[(r.kind, r.outcome)] += 1
        elif isinstance(r, rec.EpisodeRecord):
            self.episodes[(r.outcome,)] += 1
            tid, sid = identity.episode_ids(r.sched_gen, r.req_id, r.epoch)
            # Preemption -> first compute; a host that sees first compute only
            # on the ranks (vLLM-HUST) cannot measure it in the scheduler.
            if r.outcome == rec.RECOVERED and r.first_compute_observed:
                self.recovery.record((), (r.end_ns - r.start_ns) * _NS, tid, sid)
            if r.admitted_ns is not None and r.ready_ns is not None:
                self.admission_wait.record((), max(0, r.admitted_ns - r.ready_ns) * _NS, tid, sid)
            for source, n in r.tokens():
                if n:
                    self.tokens[(source,)] += n
            if self._tiers and r.tokens_restored:
                by = r.tokens_restored_by_tier
                for i, n in by.items():
                    if n:
                        self.restored_by_tier[(self._tiers[i][0] if i < len(self._tiers)
                                               else "unknown",)] += n
                cpu = r.tokens_restored - sum(by.values())
                if cpu:
                    self.restored_by_tier[("cpu",)] += cpu
        elif isinstance(r, rec.FirstComputeRecord):
            self.first_compute[(r.rank, r.compute_kind)] += 1
        elif isinstance(r, rec.TierJobRecord) and self._tiers:
            self.tier_jobs[(r.tier_type, r.tier_index, r.kind, r.outcome)] += 1
            if r.size_bytes:
                self.tier_bytes[(r.tier_type, r.kind)] += int(r.size_bytes)
            if r.outcome != rec.TIER_HUNG and not rec.stopped(r.outcome, r.end_cause):
                self.tier_duration.record(
                    (("tier", r.tier_type), ("kind", r.kind)), (r.end_ns - r.start_ns) * _NS,
                    identity.trace_id(r.sched_gen, r.req_id, r.episode_epoch),
                    identity.tier_job_span_id(r.sched_gen, r.tier_job_id))
        elif isinstance(r, rec.WaitRecord):
            reason = rec.main_wait_reason(r.reasons)
            if r.outcome == rec.TIER_HUNG and self._tiers:
                self.waits_stalled[(reason,)] += 1
            elif r.outcome == rec.WAIT_ANSWERED and self.wait is not None:
                self.wait.record((("reason", reason),), (r.end_ns - r.start_ns) * _NS,
                                 identity.trace_id(r.sched_gen, r.req_id, r.episode_epoch),
                                 identity.wait_span_id(r.sched_gen, r.req_id, r.start_ns))
