"""Identities and the trace/span ids derived from them.

Every process derives the same ids from the same key, so the scheduler and
each rank place their spans in one trace without a round-trip:

- episode trace: key (scheduler generation, request id, epoch)
- request (traffic) trace: key (scheduler generation, request id)
- job span: key (scheduler generation, job id) - the parent of the ranks'
  transfer spans
- admission span: the episode key plus "admission" - the parent of the ranks'
  first-compute spans
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

_MASK64 = (1 << 64) - 1


def new_generation() -> str:
    """A random 128-bit id, hex: one per connector instance (restart = new)."""
    return secrets.token_hex(16)


def _digest(*parts: object) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(str(part).encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")  # unit separator: ("a","bc") != ("ab","c")
    return h.digest()


def _nonzero(value: int) -> int:
    # W3C forbids all-zero ids; a zero digest prefix is astronomically rare.
    return value or 1


@functools.lru_cache(maxsize=16384)  # the same keys recur for every span
def episode_ids(sched_gen: str, req_id: str, epoch: int) -> tuple[int, int]:
    """(trace id, root span id) of a recovery episode."""
    d = _digest("episode", sched_gen, req_id, epoch)
    return _nonzero(int.from_bytes(d[:16], "big")), _nonzero(int.from_bytes(d[16:24], "big"))


@functools.lru_cache(maxsize=16384)  # the same keys recur for every span
def request_ids(sched_gen: str, req_id: str) -> tuple[int, int]:
    """(trace id, root span id) of a request's ordinary offload traffic."""
    d = _digest("request", sched_gen, req_id)
    return _nonzero(int.from_bytes(d[:16], "big")), _nonzero(int.from_bytes(d[16:24], "big"))


def trace_id(sched_gen: str, req_id: str, epoch: int) -> int:
    """The trace a job's spans belong to: its episode's, else its request's."""
    return (episode_ids(sched_gen, req_id, epoch) if epoch
            else request_ids(sched_gen, req_id))[0]


@functools.lru_cache(maxsize=16384)  # the same keys recur for every span
def job_span_id(sched_gen: str, job_id: int) -> int:
    return _nonzero(int.from_bytes(_digest("job", sched_gen, job_id)[:8], "big"))


def tier_job_span_id(sched_gen: str, tier_job_id: int) -> int:
    """Tier job ids are the tiering manager's own: the same number occurs as a
    connector job id, so they are derived under their own key."""
    return _nonzero(int.from_bytes(_digest("tier-job", sched_gen, tier_job_id)[:8], "big"))


def wait_span_id(sched_gen: str, req_id: str, start_ns: int) -> int:
    return _nonzero(int.from_bytes(_digest("wait", sched_gen, req_id, start_ns)[:8], "big"))


@functools.lru_cache(maxsize=16384)  # the same keys recur for every span
def admission_span_id(sched_gen: str, req_id: str, epoch: int) -> int:
    return _nonzero(int.from_bytes(_digest("admission", sched_gen, req_id, epoch)[:8], "big"))


def traffic_sampled(trace_id: int, ratio: float) -> bool:
    """Deterministic per-trace decision, identical in every process.

    Same rule as the SDK's TraceIdRatioBased sampler (low 64 bits of the id).
    """
    if ratio >= 1.0:
        return True
    if ratio <= 0.0:
        return False
    return (trace_id & _MASK64) < int(ratio * (_MASK64 + 1))


class RequestIdHasher:
    """Replaces request ids by a keyed hash (HMAC-SHA256, 128 bits, hex).

    Same key, same pseudonym in every process, so the derived trace ids still
    join; without the key the id cannot be recovered or guessed from a list
    of candidate ids."""

    PREFIX = "rid-"
    _CACHE = 65536

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._cache: dict[str, str] = {}

    def apply(self, record: object) -> None:
        """Replace a lifecycle record's ``req_id`` (if it has one) in place."""
        req_id = getattr(record, "req_id", None)
        if req_id is not None:
            record.req_id = self(req_id)  # type: ignore[attr-defined]

    def __call__(self, req_id: str) -> str:
        out = self._cache.get(req_id)
        if out is None:
            digest = hmac.new(self._key, req_id.encode("utf-8", "surrogatepass"),
                              hashlib.sha256).hexdigest()
            out = self.PREFIX + digest[:32]
            if len(self._cache) >= self._CACHE:
                self._cache.clear()
            self._cache[req_id] = out
        return out
