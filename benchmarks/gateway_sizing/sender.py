"""The sender: raw OTLP protobuf over gRPC with gzip, paced, as an agent's
loadbalancing exporter sends it."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import quantile
from benchmarks.gateway_sizing.plan import EXPORT_METHOD, IN_FLIGHT, SPANS_PER_REQUEST
from benchmarks.gateway_sizing.recording import Episode


# -- the sender -------------------------------------------------------------------------
@dataclass
class SendStats:
    requests: int = 0
    spans: int = 0
    traces: int = 0
    failed_spans: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    issue_s: float = 0.0    # from the first export issued to the loop's end
    seconds: float = 0.0    # ... to the last answer
    blocked_s: float = 0.0  # waiting for a free in-flight slot: the gateway was slower
    latencies_s: list[float] = field(default_factory=list)  # issue -> answer, per export

    @property
    def achieved(self) -> float:
        """Spans/s issued (answers that come later are the latency's, not the rate's)."""
        return self.spans / self.issue_s if self.issue_s else 0.0

    def as_json(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {"requests": self.requests, "spans": self.spans, "traces": self.traces,
                "failed_spans": self.failed_spans, "errors": dict(self.errors),
                "issue_s": round(self.issue_s, 3), "seconds": round(self.seconds, 3),
                "blocked_s": round(self.blocked_s, 3),
                "achieved_spans_per_s": round(self.achieved),
                "latency_ms_p50": round(1000 * quantile(lat, 0.5), 1) if lat else None,
                "latency_ms_p99": round(1000 * quantile(lat, 0.99), 1) if lat else None,
                "latency_ms_max": round(1000 * lat[-1], 1) if lat else None}


class Sender:
    """Paced raw OTLP/gRPC exports of fresh copies of the episodes."""

    def __init__(self, endpoint: str, episodes: Sequence[Episode], seed: int = 0) -> None:
        import grpc

        self.channel = grpc.insecure_channel(
            endpoint, options=[("grpc.max_send_message_length", 64 << 20)],
            compression=grpc.Compression.Gzip)
        self.export = self.channel.unary_unary(EXPORT_METHOD)  # bytes pass through
        self.episodes = list(episodes)
        self.rng = random.Random(seed)
        self._next = 0

    def _request(self, max_traces: int | None) -> tuple[bytes, int, int]:
        parts: list[bytes] = []
        spans = traces = 0
        while spans < SPANS_PER_REQUEST and (max_traces is None or traces < max_traces):
            ep = self.episodes[self._next % len(self.episodes)]
            self._next += 1
            parts.append(ep.fresh(self.rng))
            spans += ep.spans
            traces += 1
        return b"".join(parts), spans, traces

    def run(self, rate: float | None = None, seconds: float | None = None,
            traces: int | None = None) -> SendStats:
        """Send at ``rate`` spans/s (None: as fast as the in-flight bound
        lets) for ``seconds`` or until ``traces`` traces are sent."""
        stats = SendStats()
        slots = threading.Semaphore(IN_FLIGHT)
        lock = threading.Lock()
        pending: list[Any] = []

        def done(fut: Any, spans: int, issued: float) -> None:
            slots.release()
            err = fut.exception()
            with lock:
                stats.latencies_s.append(time.monotonic() - issued)
                if err is not None:
                    stats.failed_spans += spans
                    code = err.code() if hasattr(err, "code") else None
                    stats.errors[getattr(code, "name", type(err).__name__)] += 1

        t0 = time.monotonic()
        due = t0
        while True:
            now = time.monotonic()
            if seconds is not None and now - t0 >= seconds:
                break
            if traces is not None and stats.traces >= traces:
                break
            data, n_spans, n_traces = self._request(
                None if traces is None else traces - stats.traces)
            if rate:
                if due > now:
                    time.sleep(due - now)
                due += n_spans / rate
            b0 = time.monotonic()
            slots.acquire()
            stats.blocked_s += time.monotonic() - b0
            issued = time.monotonic()
            fut = self.export.future(data, timeout=60)
            fut.add_done_callback(lambda f, n=n_spans, t=issued: done(f, n, t))
            pending.append(fut)
            stats.requests += 1
            stats.spans += n_spans
            stats.traces += n_traces
        stats.issue_s = time.monotonic() - t0
        for fut in pending:  # every export answered before the step is judged
            with contextlib.suppress(Exception):  # counted in done()
                fut.result()
        stats.seconds = time.monotonic() - t0
        return stats

    def close(self) -> None:
        self.channel.close()


def wait_until(pred: Any, timeout: float, interval: float = 0.25) -> tuple[bool, float]:
    t0 = time.monotonic()
    while True:
        if pred():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        time.sleep(interval)
