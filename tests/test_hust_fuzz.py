"""Malformed vLLM-HUST records, fuzzed with hypothesis: none may raise, every one is counted.

``tests/standins/vllm_hust_contract`` is a STAND-IN for the vLLM-HUST fork's
contract modules (the fork cannot be installed here), written from facts read
in the fork's source. Mutations start from records of the real shapes
(``WorkerReceipt``/``JobReceipt`` objects, ``str`` Enum members,
``KVRegionDescriptor`` objects). The stand-in's
``validate_correlated_observation`` (what the real ``CorrelatedObservation``
constructor refuses) is the oracle for "the host would refuse this record":
our own validation must be at least as strict. v2 records the host would
refuse are built with the stand-in's ``unchecked`` (no validation), as a
host without validation might hand them over.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from enum import Enum
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_traces_hold, chain_truth
from vllm_hust_contract import chains
from vllm_hust_contract import correlated_observability as v2
from vllm_hust_contract import observability as v1
from vllm_hust_contract.correlated_observability import (
    CorrelatedEvent,
    JobReceipt,
    WorkerReceipt,
)
from vllm_hust_contract.observability import (
    ComputeKind,
    KVRegionDescriptor,
    KVTransferEvent,
    RecoveryRequeueReason,
    TransferCancellationReason,
    TransferOperation,
)

import kvobs_otel
from kvobs_otel.config import Settings
from kvobs_otel.hosts.hust import contracts
from kvobs_otel.hosts.hust import records as R
from kvobs_otel.telemetry.otlp_json import spans_to_otlp_json
from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.otlp_file import spans_from_document

pytestmark = pytest.mark.vllm

PURE = settings(max_examples=150, deadline=None)
LIVE = settings(max_examples=15, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
SETTINGS = Settings(enabled=True, drain_interval_s=0.02)

# The contracts' rules, written out here from the fork's source (docs/hosts.md,
# "Facts ..."), not read from the code under test, so that a drift between the
# two fails: correlated_observability.py and observability.py @ 65cc5678b0d5.
UINT32 = 2**32 - 1
INT64 = 2**63 - 1  # ids above it: valid for the host, not an OTel int (our documented bound)
MAX_ROSTER = v2.MAX_CORRELATED_ROSTER
COMPUTE_KINDS = {"prefill", "decode"}
OPERATIONS = {"d2h_preserve", "h2d_restore"}
V2_SHAPE = {
    "recovery_requeued": set(),
    "restore_submitted": {"job_id", "rank", "worker_generation", "block_count"},
    "restore_completed": {"job_id", "rank", "worker_generation"},
    "transfer_receipt": {"job_id", "workers"},
    "recovery_admitted": {"roster"},
    "first_compute": {"rank", "worker_generation", "roster", "compute_kind"},
}
# What each v1 emit function always fills in (compute_kind may be None).
V1_FILLED = {
    "transfer_submitted": ("operation", "job_id", "rank", "request_id"),
    "transfer_completed": ("operation", "job_id", "rank", "success"),
    "transfer_cancelled": ("operation", "job_id", "rank", "reason"),
    "transfer_receipt": ("job_id", "ranks"),
    "recovery_requeued": ("request_id", "recovery_epoch"),
    "recovery_admitted": ("request_id", "recovery_epoch", "job_ids"),
    "transfer_descriptors": ("job_id",),
    "first_compute": ("rank", "request_id", "recovery_epoch"),
}
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(v2.CorrelatedObservation)) + tuple(
    f.name for f in dataclasses.fields(v1.KVTransferObservation))

V2_CHAIN = tuple(e.record for e in chains.recovery_chain())
V1_CHAIN = tuple(e.record for e in chains.v1_recovery_chain())
V1_RECORDS = (*V1_CHAIN, chains.v1_shutdown_cancel().record)
GEN = chains.WORKER_GENERATIONS[0]
W0, W1 = WorkerReceipt(0, GEN), WorkerReceipt(1, chains.WORKER_GENERATIONS[1])
WORKERS = (W0, W1)
ROSTER = (JobReceipt(7, WORKERS),)
OVER = MAX_ROSTER + 1
WORKERS_OVER = (tuple(WorkerReceipt(r, GEN) for r in range(OVER)), (W0,) * OVER)
_HALF = tuple(WorkerReceipt(r, GEN) for r in range(MAX_ROSTER // 2 + 1))
ROSTER_OVER = (tuple(JobReceipt(j, (W0,)) for j in range(OVER)), (ROSTER[0],) * OVER,
               (JobReceipt(7, _HALF), JobReceipt(8, _HALF)))  # 4098 workers in all
DESCRIPTORS_OVER = (KVRegionDescriptor(0, 1, 0, 0, 65536),) * OVER
MEMBERS = tuple(m for enum in (KVTransferEvent, TransferOperation, TransferCancellationReason,
                               RecoveryRequeueReason, ComputeKind, CorrelatedEvent)
                for m in enum)
V2_EVENT_NAMES = tuple(m.value for m in CorrelatedEvent)

# ------------------------------------------------------------------ values
JUNK = st.one_of(st.floats(), st.binary(max_size=8), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                 st.tuples(st.integers()), st.builds(object), st.complex_numbers())
NON_INT = st.one_of(JUNK, st.booleans(), st.text(max_size=8), st.sampled_from(MEMBERS))
NON_STR = st.one_of(JUNK, st.booleans(), st.integers())
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


def plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def spliced(odd: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A printable ASCII request id with one ``odd`` character in it."""
    return st.builds(lambda a, c, b: a + c + b, st.text(PRINTABLE, max_size=64), odd,
                     st.text(PRINTABLE, max_size=63))


BAD_REQUEST_ID = st.one_of(
    spliced(st.characters(min_codepoint=0x80)),  # non-ASCII
    spliced(st.characters(max_codepoint=0x1F) | st.just("\x7f")),  # control characters
    st.just(""), st.text(PRINTABLE, min_size=129, max_size=300), NON_STR)
BAD_GEN = st.one_of(st.text(max_size=40), st.text("0123456789abcdefABCDEF-", min_size=31,
                                                  max_size=33), st.just(GEN.upper()), NON_STR
                    ).filter(lambda g: not (isinstance(g, str) and re.fullmatch("[0-9a-f]{32}", g)))


def bad_enum(allowed: frozenset[str] | set[str]) -> st.SearchStrategy[Any]:
    """Not a value of ``allowed``: odd strings, numbers, other enums' members."""
    return st.one_of(st.text(max_size=10), st.integers(), st.floats(), st.binary(max_size=4),
                     st.sampled_from(["PREFILL", "verify", "decode ", "H2D_RESTORE"]),
                     st.sampled_from(MEMBERS)).filter(lambda k: plain(k) not in allowed)


def bad_int(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.one_of(NON_INT, st.integers(max_value=low - 1), st.integers(min_value=high + 1),
                     st.sampled_from([low - 1, high + 1, 2**63, 2**64, -(2**63), True, False]))


DESCENDING = st.tuples(st.integers(0, 99), st.integers(0, 99)).map(sorted).map(lambda p: p[::-1])
# workers the host's constructor refuses (each a bad roster for ours)
BAD_WORKERS = st.one_of(
    st.just(None), st.just(list(WORKERS)), st.just(((0, GEN), (1, GEN))),
    st.just(({"rank": 0, "worker_generation": GEN},)),
    st.just((SimpleNamespace(rank=0, worker_generation=GEN),)), st.just(ROSTER),
    st.just((W0, W0)), st.just(tuple(sorted((W0, WorkerReceipt(0, W1.worker_generation))))),
    DESCENDING.map(lambda p: tuple(WorkerReceipt(r, GEN) for r in p)))
BAD_ROSTER = st.one_of(
    st.just(None), st.just(list(ROSTER)), st.just(((7, WORKERS),)), st.just((7,)),
    st.just(({"job_id": 7, "workers": WORKERS},)), st.just(WORKERS),
    st.just((ROSTER[0], ROSTER[0])),
    DESCENDING.map(lambda p: tuple(JobReceipt(j, WORKERS) for j in p)))
V2_INTS = {"recovery_epoch": (1, INT64), "observed_at_ns": (0, INT64),
           "job_id": (0, INT64), "rank": (0, UINT32), "block_count": (1, UINT32)}
V1_INTS = {"observed_at_ns": (0, INT64), "job_id": (0, INT64), "rank": (0, UINT32),
           "recovery_epoch": (1, INT64), "block_count": (0, UINT32),
           "bytes_moved": (0, INT64), "duration_ns": (0, INT64),
           "dropped_descriptors": (0, INT64)}
# one valid value for every v2 optional field
V2_VALID = {"job_id": 7, "rank": 1, "worker_generation": GEN, "block_count": 16,
            "workers": WORKERS, "roster": ROSTER, "compute_kind": "decode"}


def _pick(draw: Any, *cases: tuple[str, st.SearchStrategy[Any], str]) -> tuple[str, Any, str]:
    name, values, reason = draw(st.sampled_from(cases))
    return name, draw(values), reason


def v2_replace(record: Any, **changes: Any) -> Any:
    """``record`` with ``changes``, built without validation."""
    return v2.unchecked(**{**v2.fields_of(record), **changes})


@st.composite
def v2_one_bad(draw: Any) -> tuple[Any, str]:
    """A canonical v2 record with ONE field made invalid, and the reason it must get."""
    rec = draw(st.sampled_from(V2_CHAIN))
    shape = V2_SHAPE[rec.event.value]
    cases = [(n, bad_int(*V2_INTS[n]), R.BAD_NUMBER)
             for n in ("recovery_epoch", "observed_at_ns")]
    cases += [(n, bad_int(*V2_INTS[n]), R.BAD_NUMBER) for n in shape if n in V2_INTS]
    cases += [(n, st.just(() if n in ("workers", "roster") else None), R.MISSING_FIELD)
              for n in shape]
    cases += [(n, st.just(V2_VALID[n]), R.UNEXPECTED_FIELD) for n in V2_VALID if n not in shape]
    cases += [(n, st.none(), R.BAD_ROSTER) for n in ("workers", "roster")]  # not a tuple
    if "worker_generation" in shape:
        cases.append(("worker_generation", BAD_GEN, R.BAD_GENERATION))
    if "compute_kind" in shape:
        cases.append(("compute_kind", bad_enum(COMPUTE_KINDS), R.BAD_ENUM))
    if "workers" in shape:
        cases += [("workers", BAD_WORKERS, R.BAD_ROSTER),
                  ("workers", st.sampled_from(WORKERS_OVER), R.ROSTER_OVER_CAP)]
    if "roster" in shape:
        cases += [("roster", BAD_ROSTER, R.BAD_ROSTER),
                  ("roster", st.sampled_from(ROSTER_OVER), R.ROSTER_OVER_CAP)]
    name, value, reason = _pick(
        draw, *cases,
        # the host's constructor takes only its CorrelatedEvent members
        ("event", st.one_of(st.text(max_size=24), st.sampled_from(V2_EVENT_NAMES),
                            st.sampled_from(MEMBERS).filter(lambda m: type(m) is not
                                                            CorrelatedEvent), NON_STR),
         R.UNKNOWN_EVENT),
        ("scheduler_generation", BAD_GEN, R.BAD_GENERATION),
        ("request_id", BAD_REQUEST_ID | st.sampled_from(MEMBERS), R.BAD_REQUEST_ID))
    return v2_replace(rec, **{name: value}), reason


@st.composite
def v1_one_bad(draw: Any) -> tuple[Any, str]:
    """A canonical v1 record with ONE field made invalid, and the reason it must get."""
    rec = draw(st.sampled_from(V1_RECORDS))
    event = plain(rec.event)
    ints = [(n, bad_int(*b), R.BAD_NUMBER) for n, b in V1_INTS.items()]
    needed = [(n, st.none(), R.MISSING_FIELD) for n in V1_FILLED[event]
              if n not in ("ranks", "job_ids")]  # v1 defaults them to ()
    enums = [(n, bad_enum(allowed), R.BAD_ENUM) for n, allowed in (
        ("operation", OPERATIONS), ("compute_kind", COMPUTE_KINDS),
        ("reason", {"host_shutdown"}), ("requeue_reason", {"unclassified"}))]
    name, value, reason = _pick(
        draw, *ints, *needed, *enums,
        ("event", bad_enum(set(V1_FILLED)), R.UNKNOWN_EVENT),
        ("request_id", BAD_REQUEST_ID, R.BAD_REQUEST_ID),
        ("success", NON_INT.filter(lambda s: not isinstance(s, bool)), R.BAD_NUMBER),
        ("ranks", DESCENDING.map(tuple), R.BAD_ROSTER),
        ("ranks", st.just(tuple(range(OVER))), R.ROSTER_OVER_CAP),
        ("job_ids", DESCENDING.map(tuple), R.BAD_ROSTER),
        ("descriptors", st.just(DESCRIPTORS_OVER), R.ROSTER_OVER_CAP),
        ("descriptors", st.sampled_from([((7,),), (131300,), ((0, 1, 2, 3, 4),),
                                         ({"src_region_id": 0},), (W0,)]), R.NOT_A_RECORD),
        ("descriptors", st.sampled_from([(KVRegionDescriptor(0, 1, -1, 0, 65536),),
                                         (KVRegionDescriptor(0, 1, 0, 0, True),),
                                         (KVRegionDescriptor(0, "1", 0, 0, 1),)]),
         R.BAD_NUMBER))
    return dataclasses.replace(rec, **{name: value}), reason


ANY_VALUE = st.one_of(
    st.none(), NON_STR, st.text(max_size=8), BAD_REQUEST_ID, BAD_GEN,
    st.sampled_from([GEN, 0, 1, 7, "prefill", "h2d_restore", WORKERS, ROSTER, (), W0,
                     ROSTER[0], (KVRegionDescriptor(0, 0, 0, 0, 1),), list(WORKERS), [],
                     *V2_EVENT_NAMES]),
    st.sampled_from(MEMBERS), BAD_WORKERS, BAD_ROSTER,
    st.sampled_from(WORKERS_OVER + ROSTER_OVER))


@st.composite
def mutated(draw: Any, records: tuple[Any, ...]) -> Any:
    """A canonical record with 1..4 fields replaced by anything, valid or not."""
    rec = draw(st.sampled_from(records))
    names = draw(st.lists(st.sampled_from([f.name for f in dataclasses.fields(rec)]),
                          min_size=1, max_size=4, unique=True))
    changes = {n: draw(ANY_VALUE) for n in names}
    if isinstance(rec, v2.CorrelatedObservation):
        return v2_replace(rec, **changes)
    return dataclasses.replace(rec, **changes)


class Hostile:
    """Reading any field raises (something other than AttributeError)."""

    def __init__(self, exc: type[Exception]) -> None:
        self.exc = exc

    def __getattr__(self, name: str) -> Any:
        raise self.exc(name)


ANYTHING = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text()
                        | st.binary(), lambda c: st.lists(c, max_size=3) | st.tuples(c, c)
                        | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8)
FIELDISH = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8),
                           ANYTHING, max_size=8)
JUNK_RECORDS = st.one_of(
    ANYTHING, FIELDISH, FIELDISH.map(lambda d: SimpleNamespace(**d)),
    st.sampled_from([ValueError, RuntimeError, KeyError, TypeError]).map(Hostile),
).filter(lambda r: not claims_known_event(r))


def claims_known_event(record: Any) -> bool:
    """Junk is only guaranteed junk if it does not name a known event."""
    event = record.get("event") if isinstance(record, dict) else vars(record).get("event") \
        if isinstance(record, SimpleNamespace) else None
    return isinstance(event, str) and event in (V1_FILLED.keys() | V2_SHAPE.keys())


def host_refuses_v2(record: Any) -> bool:
    """The oracle: the real constructor refuses these fields."""
    try:
        v2.validate_correlated_observation(record)
    except (ValueError, TypeError):
        return True
    return False


# ------------------------------------------------------------------ pure validation
def _expected_v2(rec: Any) -> dict[str, Any]:
    """What check_v2 gives for a valid record: plain values, receipts as tuples."""
    d = v2.fields_of(rec)
    d["event"] = rec.event.value
    d["workers"] = tuple((w.rank, w.worker_generation) for w in rec.workers) or None
    d["roster"] = tuple((j.job_id, tuple((w.rank, w.worker_generation) for w in j.workers))
                        for j in rec.roster) or None
    return d


def test_canonical_records_are_accepted_unchanged() -> None:
    for rec in (*V2_CHAIN, *(e.record for e in chains.restarted_worker_chain()),
                chains.at_cap_admission()):
        got = R.check_v2(rec)
        assert got == (_expected_v2(rec), None)
        assert type(got[0]["event"]) is str
    for rec in V1_RECORDS:
        got, reason = R.check_v1(rec)
        assert reason is None and got["descriptor_count"] == len(rec.descriptors)
        assert all(type(got[n]) is str for n in ("event", "operation", "reason",
                                                 "requeue_reason", "compute_kind")
                   if got[n] is not None)


def test_the_oracle_refuses_every_malformed_record() -> None:
    for name, record in chains.malformed_v2_records().items():
        assert host_refuses_v2(record), name
        assert R.check_v2(record)[0] is None, name
    for rec in V2_CHAIN:
        assert not host_refuses_v2(rec)


@PURE
@given(case=v2_one_bad())
def test_v2_one_bad_field_is_refused_with_its_reason(case: tuple[Any, str]) -> None:
    record, reason = case
    assert R.check_v2(record) == (None, reason)
    assert host_refuses_v2(record) or reason == R.BAD_NUMBER  # ours: int64, the host's: uint64


@PURE
@given(record=mutated(V2_CHAIN))
def test_v2_never_raises_and_is_at_least_as_strict_as_the_host(record: Any) -> None:
    got, reason = R.check_v2(record)
    assert (got is None) != (reason is None)
    assert got is not None or reason in R.RECORD_REASONS
    if host_refuses_v2(record):
        assert got is None, f"host refuses, check_v2 accepted {record!r}"


@PURE
@given(case=v1_one_bad())
def test_v1_one_bad_field_is_refused_with_its_reason(case: tuple[Any, str]) -> None:
    record, reason = case
    assert R.check_v1(record) == (None, reason)


@PURE
@given(record=mutated(V1_RECORDS))
def test_v1_never_raises_and_reasons_are_known(record: Any) -> None:
    got, reason = R.check_v1(record)
    assert (got is None) != (reason is None)
    assert got is not None or reason in R.RECORD_REASONS
    if got is not None:
        assert isinstance(got["descriptor_count"], int) and "descriptors" not in got
        assert not any(isinstance(v, Enum) for v in got.values())


@PURE
@given(record=JUNK_RECORDS)
def test_arbitrary_objects_are_refused_never_raised(record: Any) -> None:
    for check in (R.check_v2, R.check_v1):
        got, reason = check(record)
        assert got is None and reason in R.RECORD_REASONS


# ------------------------------------------------------------------ the live adapter
def install(monkeypatch: pytest.MonkeyPatch, v1_module: ModuleType | None,
            v2_module: ModuleType | None) -> None:
    for contract, module in ((contracts.V1, v1_module), (contracts.V2, v2_module)):
        monkeypatch.setitem(sys.modules, contract.module, module)  # None: import fails


@pytest.fixture
def fork(telemetry: Any) -> Iterator[Any]:
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    v1.clear_effective_evidence_requests()
    yield telemetry
    kvobs_otel.uninstrument()
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()


@st.composite
def mixed(draw: Any, chain: tuple[Any, ...], bad: st.SearchStrategy[Any]
          ) -> tuple[list[Any], int]:
    """The canonical chain, in order, with malformed records inserted anywhere."""
    batch = list(chain)
    malformed = draw(st.lists(bad, min_size=1, max_size=10))
    for r in malformed:
        batch.insert(draw(st.integers(0, len(batch))), r)
    return batch, len(malformed)


def feed(telemetry: Any, registry: dict[int, Any], batch: list[Any]) -> list[Any]:
    """Hand every record straight to the registered observer, as a host
    without validation would (the real v2 host never dispatches a bad one)."""
    telemetry.exporter.clear()
    telemetry.readers.clear()  # this example's pipeline only
    assert kvobs_otel.instrument(SETTINGS)
    try:
        (entry,) = list(registry.values())  # what the fork would call
        observer = entry[1] if isinstance(entry, tuple) else entry  # v1: (name, observer)
        for record in batch:
            assert observer(record) is None
    finally:
        kvobs_otel.uninstrument()  # drains, ends what is open, flushes
    return spans_from_document(spans_to_otlp_json(telemetry.spans()))


def assert_counted_and_joined(telemetry: Any, spans: list[Any], n_bad: int, scope: str) -> None:
    assert telemetry.metric_total("kvobs.host.refused") == n_bad
    assert telemetry.metric_total("kvobs.observer.anomalies") == 0
    assert [(e.request_id, e.epoch, e.outcome, e.join_scope)
            for e in rebuild(spans)] == [(chains.REQUEST_ID, ep, "recovered", scope)
                                         for ep in (1, 2)]
    if scope == "cluster":  # v1 joins per process: no one trace to judge
        # The valid records' recoveries, judged against what the host emitted.
        assert assert_traces_hold(chain_truth(chains.recovery_chain()), set(chains.RANKS),
                                  spans) == 2


def bad_request(records: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    def replace(r: Any, rid: Any) -> Any:
        if isinstance(r, v2.CorrelatedObservation):
            return v2_replace(r, request_id=rid)
        return dataclasses.replace(r, request_id=rid)

    return st.builds(replace, st.sampled_from(records), BAD_REQUEST_ID)


V2_BAD = st.one_of(v2_one_bad().map(lambda c: c[0]), mutated(V2_CHAIN).filter(host_refuses_v2),
                   bad_request(V2_CHAIN), JUNK_RECORDS)
V1_BAD = st.one_of(v1_one_bad().map(lambda c: c[0]), bad_request(V1_RECORDS), JUNK_RECORDS)


@LIVE
@given(case=mixed(V2_CHAIN, V2_BAD))
def test_live_v2_counts_every_malformed_record_and_keeps_the_chain(
        monkeypatch: pytest.MonkeyPatch, fork: Any, case: tuple[list[Any], int]) -> None:
    install(monkeypatch, v1, v2)
    spans = feed(fork, v2._observers, case[0])
    assert_counted_and_joined(fork, spans, case[1], "cluster")


@LIVE
@given(case=mixed(V1_CHAIN, V1_BAD))
def test_live_v1_counts_every_malformed_record_and_keeps_the_chain(
        monkeypatch: pytest.MonkeyPatch, fork: Any, case: tuple[list[Any], int]) -> None:
    install(monkeypatch, v1, None)
    spans = feed(fork, v1._observers, case[0])
    assert_counted_and_joined(fork, spans, case[1], "process")
    assert v1.effective_evidence_requests() == ()  # never asked the host for evidence


def _at_bounds(records: tuple[Any, ...], ints: dict[str, tuple[int, int]],
               replace: Any) -> list[tuple[str, str, int, Any]]:
    """(event, field, value, record) for each integer a record carries, at
    each bound and one past it (hypothesis rarely draws the exact edge)."""
    out = []
    for rec in records:
        for name, (low, high) in ints.items():
            if getattr(rec, name, None) is None:
                continue
            for value in (low - 1, low, high, high + 1):
                out.append((rec.event.value, name, value, replace(rec, **{name: value})))
    return out


@pytest.mark.parametrize("check,cases,ints", [
    (R.check_v1, _at_bounds(V1_RECORDS, V1_INTS, dataclasses.replace), V1_INTS),
    (R.check_v2, _at_bounds(V2_CHAIN, V2_INTS, v2_replace), V2_INTS)], ids=["v1", "v2"])
def test_integer_bounds_are_exact_on_both_sides(check: Any, cases: list, ints: dict) -> None:
    assert cases
    for event, name, value, record in cases:
        low, high = ints[name]
        got, reason = check(record)
        if low <= value <= high:
            assert got is not None, (event, name, value, reason)
        else:
            assert (got, reason) == (None, R.BAD_NUMBER), (event, name, value)
