"""Records -> OpenTelemetry metrics (the alerting side; spans carry evidence).

Dimensions stay low-cardinality: direction, outcome, rank, role, reason -
never ids. Names follow OTel conventions (dots, units); the Prometheus
exporter turns ``kvobs.receipts.incomplete`` into
``kvobs_receipts_incomplete_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from kvobs_otel.lifecycle import records as rec
from kvobs_otel.telemetry.providers import SCOPE, Providers

_NS = 1e-9


class MetricsBuilder:
    def __init__(self, providers: Providers,
                 open_receipts: Callable[[], int] | None = None,
                 drops: Callable[[], dict[str, int]] | None = None,
                 errors: Callable[[], dict[str, int]] | None = None,
                 anomalies: Callable[[], dict[str, int]] | None = None) -> None:
        m = providers.meter_provider.get_meter(SCOPE)
        self.transfers = m.create_counter(
            "kvobs.transfers", unit="{transfer}", description="KV transfers by direction/outcome")
        self.bytes = m.create_counter(
            "kvobs.transfer.bytes", unit="By", description="Bytes moved by KV transfers")
        self.duration = m.create_histogram(
            "kvobs.transfer.duration", unit="s",
            description="Transfer duration: clock=host (submit->result) or device")
        self.jobs = m.create_counter(
            "kvobs.jobs", unit="{job}", description="Transfer jobs by kind and receipt outcome")
        self.incomplete = m.create_counter(
            "kvobs.receipts.incomplete", unit="{job}",
            description="Jobs whose receipt still missed ranks at the deadline or shutdown")
        self.episodes = m.create_counter(
            "kvobs.recovery.episodes", unit="{episode}", description="Recovery episodes by outcome")
        self.recovery = m.create_histogram(
            "kvobs.recovery.latency", unit="s", description="Preemption -> first compute")
        self.admission_wait = m.create_histogram(
            "kvobs.admission.wait", unit="s", description="Restore received -> re-admission")
        self.first_compute = m.create_counter(
            "kvobs.first_compute", unit="{event}", description="First computes after recovery")
        if open_receipts is not None:
            m.create_observable_gauge(
                "kvobs.receipts.open", unit="{job}", description="Jobs with an open receipt",
                callbacks=[lambda _o: [Observation(open_receipts())]])
        if drops is not None:
            m.create_observable_counter(
                "kvobs.observer.dropped", unit="{event}",
                description="Observations dropped, by reason",
                callbacks=[self._by("reason", drops)])
        if errors is not None:
            m.create_observable_counter(
                "kvobs.observer.errors", unit="{error}",
                description="Internal observer failures contained, by stage",
                callbacks=[self._by("stage", errors)])

        if anomalies is not None:
            m.create_observable_counter(
                "kvobs.observer.anomalies", unit="{event}",
                description="Host records that could not be joined (late, unknown or "
                "duplicate receipts; results without a submission or job)",
                callbacks=[self._by("kind", anomalies)])

    @staticmethod
    def _by(key: str, source: Callable[[], dict[str, int]]
            ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {key: k}) for k, v in source().items()]
        return callback

    def record(self, r: object) -> None:
        if isinstance(r, rec.TransferRecord):
            labels = {"direction": r.direction, "outcome": r.outcome, "rank": r.rank}
            self.transfers.add(1, labels)
            if r.outcome == rec.TRANSFER_OK:
                d = {"direction": r.direction, "rank": r.rank}
                if r.size_bytes:
                    self.bytes.add(int(r.size_bytes), d)
                self.duration.record((r.end_ns - r.start_ns) * _NS, {**d, "clock": "host"})
                if r.device_time_s is not None:
                    self.duration.record(float(r.device_time_s), {**d, "clock": "device"})
        elif isinstance(r, rec.JobRecord):
            self.jobs.add(1, {"kind": r.kind, "outcome": r.outcome})
            if r.outcome != rec.COMPLETE:
                self.incomplete.add(1, {"kind": r.kind, "outcome": r.outcome})
        elif isinstance(r, rec.EpisodeRecord):
            self.episodes.add(1, {"outcome": r.outcome})
            if r.outcome == rec.RECOVERED:
                self.recovery.record((r.end_ns - r.start_ns) * _NS)
            if r.admitted_ns is not None and r.ready_ns is not None:
                self.admission_wait.record(max(0, r.admitted_ns - r.ready_ns) * _NS)
        elif isinstance(r, rec.FirstComputeRecord):
            self.first_compute.add(1, {"rank": r.rank, "compute_kind": r.compute_kind})
