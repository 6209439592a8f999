"""The vLLM-HUST contract stand-in (tests/standins/vllm_hust_contract/) behaves
as the fork's real modules do, per the facts read in the fork's source (each
stand-in module lists them with file and commit), so an adapter tested
against it is tested against the fork's behaviour."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from vllm_hust_contract import chains
from vllm_hust_contract import correlated_observability as v2
from vllm_hust_contract import observability as v1
from vllm_hust_contract.correlated_observability import (
    CorrelatedEvent,
    CorrelatedObservation,
    JobReceipt,
    WorkerReceipt,
)
from vllm_hust_contract.observability import (
    ComputeKind,
    KVRegionDescriptor,
    KVTransferEvent,
    KVTransferObservation,
    RecoveryRequeueReason,
    TransferCancellationReason,
    TransferOperation,
)

MALFORMED = chains.malformed_v2_records()
G0, G1 = chains.WORKER_GENERATIONS[0], chains.WORKER_GENERATIONS[1]
SG = chains.SCHEDULER_GENERATION


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    v1.clear_effective_evidence_requests()
    yield
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    v1.clear_effective_evidence_requests()
    v1.set_clock(None)
    v2.set_clock(None)


def _submitted(**kw: Any) -> None:
    args = {"operation": TransferOperation.H2D_RESTORE, "job_id": 3, "rank": 0,
            "request_id": "r", "block_count": 2, **kw}
    v1.emit_kv_transfer_submitted(**args)


def _requeued(**kw: Any) -> None:
    args = {"scheduler_generation": SG, "request_id": "r", "recovery_epoch": 1, **kw}
    v2.emit_correlated_observation(CorrelatedEvent.RECOVERY_REQUEUED, **args)


# ------------------------------------------------------------- v1: surface


def test_v1_constants_and_all() -> None:
    assert v1.KV_TRANSFER_OBSERVER_CONTRACT == "vllm.kv-transfer.observer.v1"
    assert v1.KV_TRANSFER_OBSERVABILITY_API_VERSION == "1.0"
    assert v1.MAX_DESCRIPTOR_REGIONS == 4096
    assert set(v1.__all__) == {
        "KV_TRANSFER_OBSERVER_CONTRACT", "KV_TRANSFER_OBSERVABILITY_API_VERSION",
        "MAX_DESCRIPTOR_REGIONS", "ComputeKind", "KVRegionDescriptor", "KVTransferEvent",
        "KVTransferObservation", "KVTransferObserver", "KVTransferObserverHandle",
        "RecoveryRequeueReason", "TransferCancellationReason", "TransferOperation",
        "emit_kv_transfer_submitted", "emit_kv_transfer_completed",
        "emit_kv_transfer_cancelled", "emit_kv_transfer_receipt",
        "emit_kv_recovery_requeued", "emit_kv_recovery_admitted",
        "emit_kv_transfer_descriptors", "emit_kv_first_compute",
        "kv_transfer_observers_configured", "register_kv_transfer_observer",
        "reset_kv_transfer_observers", "unregister_kv_transfer_observer"}
    assert all(hasattr(v1, name) for name in v1.__all__)


def test_v1_enums() -> None:
    for enum in (KVTransferEvent, TransferOperation, TransferCancellationReason,
                 RecoveryRequeueReason, ComputeKind):
        assert issubclass(enum, str) and issubclass(enum, Enum)
    assert [(m.name, m.value) for m in KVTransferEvent] == [
        ("TRANSFER_SUBMITTED", "transfer_submitted"),
        ("TRANSFER_COMPLETED", "transfer_completed"),
        ("TRANSFER_CANCELLED", "transfer_cancelled"),
        ("TRANSFER_RECEIPT", "transfer_receipt"),
        ("TRANSFER_DESCRIPTORS", "transfer_descriptors"),
        ("RECOVERY_REQUEUED", "recovery_requeued"),
        ("RECOVERY_ADMITTED", "recovery_admitted"),
        ("FIRST_COMPUTE", "first_compute")]
    assert [m.value for m in TransferOperation] == ["d2h_preserve", "h2d_restore"]
    assert TransferOperation.D2H_PRESERVE.direction == "d2h"
    assert TransferOperation.H2D_RESTORE.direction == "h2d"
    assert [m.value for m in TransferCancellationReason] == ["host_shutdown"]
    assert [m.value for m in RecoveryRequeueReason] == ["unclassified"]
    assert [m.value for m in ComputeKind] == ["prefill", "decode"]
    # str enums: equal to their value and hashed as it (str comes first in
    # the MRO), but not of type str: an exact type check must read .value
    assert ComputeKind.PREFILL == "prefill" and ComputeKind.PREFILL in {"prefill"}
    assert type(ComputeKind.PREFILL) is not str


def test_v1_records_have_the_real_fields_and_validate_nothing() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(KVTransferObservation)}
    assert list(fields) == [
        "event", "observed_at_ns", "operation", "job_id", "rank", "request_id", "block_count",
        "success", "bytes_moved", "duration_ns", "reason", "ranks", "recovery_epoch",
        "job_ids", "requeue_reason", "descriptors", "dropped_descriptors", "compute_kind"]
    assert fields["event"] is fields["observed_at_ns"] is dataclasses.MISSING
    assert {k: d for k, d in fields.items() if d is not None and d is not dataclasses.MISSING
            } == {"ranks": (), "job_ids": (), "descriptors": (), "dropped_descriptors": 0}
    rec = KVTransferObservation(KVTransferEvent.TRANSFER_RECEIPT, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.rank = 1  # type: ignore[misc]
    assert not hasattr(rec, "__dict__")  # slots
    # v1 has no __post_init__: nonsense is stored as given
    odd = KVTransferObservation("no such event", -1, rank="x", ranks=[3, 1],  # type: ignore
                                descriptors=(object(),))
    assert odd.rank == "x" and odd.ranks == [3, 1]
    assert [f.name for f in dataclasses.fields(KVRegionDescriptor)] == [
        "src_region_id", "dst_region_id", "src_offset", "dst_offset", "size"]
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(KVRegionDescriptor))
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVRegionDescriptor(0, 0, 0, 0, 1).size = 2  # type: ignore[misc]


EMIT_SIGNATURES = {
    "emit_kv_transfer_submitted": ["operation", "job_id", "rank", "request_id", "block_count"],
    "emit_kv_transfer_completed": ["operation", "job_id", "rank", "request_id", "success",
                                   "bytes_moved", "duration_ns"],
    "emit_kv_transfer_cancelled": ["operation", "job_id", "rank", "request_id", "reason"],
    "emit_kv_transfer_receipt": ["job_id", "rank", "request_id", "ranks"],
    "emit_kv_recovery_requeued": ["request_id", "recovery_epoch", "reason"],
    "emit_kv_recovery_admitted": ["request_id", "recovery_epoch", "job_ids"],
    "emit_kv_transfer_descriptors": ["job_id", "rank", "operation", "descriptors",
                                     "dropped_descriptors"],
    "emit_kv_first_compute": ["request_id", "recovery_epoch", "job_ids", "compute_kind",
                              "rank"],
}


@pytest.mark.parametrize("name", sorted(EMIT_SIGNATURES))
def test_v1_emit_signatures_are_keyword_only(name: str) -> None:
    params = inspect.signature(getattr(v1, name)).parameters
    assert list(params) == EMIT_SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    assert defaults == ({"dropped_descriptors": 0} if name.endswith("descriptors") else {})


def test_v1_emit_functions_build_the_real_records() -> None:
    seen: list[KVTransferObservation] = []
    v1.register_kv_transfer_observer("t", seen.append)
    with v1.clock(lambda: 77):
        v1.emit_kv_transfer_receipt(job_id=7, rank=None, request_id="r", ranks=[0, 1])
        v1.emit_kv_recovery_requeued(request_id="r", recovery_epoch=2,
                                     reason=RecoveryRequeueReason.UNCLASSIFIED)
        v1.emit_kv_first_compute(request_id="r", recovery_epoch=2, job_ids=(7,),
                                 compute_kind=None, rank=1)
        v1.emit_kv_transfer_descriptors(job_id=7, rank=None,
                                        operation=TransferOperation.H2D_RESTORE,
                                        descriptors=(KVRegionDescriptor(0, 0, 0, 0, 8),))
    receipt, requeued, first, descs = seen
    assert receipt == KVTransferObservation(
        KVTransferEvent.TRANSFER_RECEIPT, 77, operation=TransferOperation.H2D_RESTORE,
        job_id=7, request_id="r", success=True, ranks=[0, 1])  # type: ignore[arg-type]
    assert requeued.requeue_reason is RecoveryRequeueReason.UNCLASSIFIED
    assert requeued.reason is None
    assert first.compute_kind is None and first.rank == 1 and first.job_ids == (7,)
    assert descs.dropped_descriptors == 0 and descs.rank is None and descs.request_id is None


def test_v1_disabled_emit_reads_no_clock_and_builds_nothing() -> None:
    def clock() -> int:
        raise AssertionError("clock read with no observer")

    v1.set_clock(clock)
    _submitted()
    for e in chains.v1_recovery_chain():
        v1.replay(e.record)  # every emit function returns at once
    v1.register_kv_transfer_observer("t", lambda r: None)
    with pytest.raises(AssertionError, match="clock read"):
        _submitted()


def test_v1_observed_at_comes_from_the_module_clock() -> None:
    seen: list[KVTransferObservation] = []
    v1.register_kv_transfer_observer("t", seen.append)
    _submitted()
    ticks = iter([10, 20])
    v1.set_clock(lambda: next(ticks))
    _submitted()
    _submitted()
    assert seen[0].observed_at_ns > 20  # time.monotonic_ns()
    assert [r.observed_at_ns for r in seen[1:]] == [10, 20]


# ------------------------------------------------------------- v1: registry


def test_v1_register_validates_name_and_observer() -> None:
    for name in ("", "   ", "\t\n", None, 7, b"x"):
        with pytest.raises(ValueError):
            v1.register_kv_transfer_observer(name, lambda r: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        v1.register_kv_transfer_observer("t", "not callable")  # type: ignore[arg-type]
    assert not v1.kv_transfer_observers_configured()
    h1 = v1.register_kv_transfer_observer("same", lambda r: None)
    h2 = v1.register_kv_transfer_observer("same", lambda r: None)  # no duplicate check
    assert isinstance(h1, v1.KVTransferObserverHandle)
    assert h1.contract == h2.contract == v1.KV_TRANSFER_OBSERVER_CONTRACT
    assert h2.token == h1.token + 1 and h1.token >= 1
    assert len(v1._observers) == 2


def test_v1_unregister_is_idempotent_and_refuses_foreign_handles() -> None:
    h1 = v1.register_kv_transfer_observer("a", lambda r: None)
    h2 = v1.register_kv_transfer_observer("b", lambda r: None)
    v1.unregister_kv_transfer_observer(h1)
    v1.unregister_kv_transfer_observer(h1)
    v1.unregister_kv_transfer_observer(v1.KVTransferObserverHandle(
        v1.KV_TRANSFER_OBSERVER_CONTRACT, 10**9))  # unknown token: no-op
    assert v1.kv_transfer_observers_configured()
    with pytest.raises(ValueError):
        v1.unregister_kv_transfer_observer(v2.CorrelatedObserverHandle(
            v2.KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT, h2.token))  # type: ignore[arg-type]
    assert v1.kv_transfer_observers_configured()
    v1.unregister_kv_transfer_observer(h2)
    assert not v1.kv_transfer_observers_configured()
    v1.register_kv_transfer_observer("c", lambda r: None)
    v1.reset_kv_transfer_observers()
    assert not v1.kv_transfer_observers_configured()


# ------------------------------------------------------------- v1: dispatch


def test_v1_dispatch_in_token_order_on_a_snapshot() -> None:
    seen: list[tuple[str, int]] = []

    def late(r: KVTransferObservation) -> None:
        seen.append(("late", r.observed_at_ns))

    def first(r: KVTransferObservation) -> None:
        seen.append(("first", r.observed_at_ns))
        if len(seen) == 1:
            v1.register_kv_transfer_observer("late", late)  # registered mid-dispatch

    v1.register_kv_transfer_observer("first", first)
    v1.register_kv_transfer_observer("second", lambda r: seen.append(("second",
                                                                       r.observed_at_ns)))
    ticks = iter([1, 2])
    v1.set_clock(lambda: next(ticks))
    _submitted()
    _submitted()
    assert seen == [("first", 1), ("second", 1), ("first", 2), ("second", 2), ("late", 2)]


def test_v1_raising_observer_logged_removed_and_others_still_run(caplog) -> None:
    calls = {"bad": 0, "good": 0}

    def bad(r: Any) -> None:
        calls["bad"] += 1
        raise RuntimeError("observer bug")

    def good(r: Any) -> None:
        calls["good"] += 1

    bad_handle = v1.register_kv_transfer_observer("bad", bad)
    v1.register_kv_transfer_observer("good", good)
    with caplog.at_level(logging.WARNING, logger=v1.__name__):
        _submitted()  # does not raise
        _submitted()
    assert calls == {"bad": 1, "good": 2}
    (logged,) = [r for r in caplog.records if r.name == v1.__name__]
    assert logged.getMessage() == f"KV transfer observer {bad_handle.token} failed; removing it"
    assert logged.exc_info
    assert bad_handle.token not in v1._observers


def test_v1_base_exception_is_not_swallowed() -> None:
    class Stop(BaseException):
        pass

    def stop(r: Any) -> None:
        raise Stop

    h = v1.register_kv_transfer_observer("stop", stop)
    with pytest.raises(Stop):
        _submitted()
    assert h.token in v1._observers  # only Exception removes an observer


def test_v1_exactly_true_requests_effective_evidence() -> None:
    v1.register_kv_transfer_observer("yes", lambda r: True)
    v1.register_kv_transfer_observer("one", lambda r: 1)  # truthy only: ignored
    v1.register_kv_transfer_observer("str", lambda r: "True")
    v1.register_kv_transfer_observer("none", lambda r: None)
    with v1.clock(lambda: 4242):
        v1.emit_kv_recovery_admitted(request_id="r", recovery_epoch=1, job_ids=(7,))
    assert v1.effective_evidence_requests() == (v1.EffectiveEvidence(
        "effective", v1.DEFAULT_PLUGINS_GROUP, "yes", "vllm.kv-transfer.observer.v1",
        detail="recovery_admitted", occurrence_id=4242, observation_kind="runtime_effective"),)


def test_v1_failed_evidence_is_logged_and_the_observer_kept(monkeypatch, caplog) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("evidence sink down")

    monkeypatch.setattr(v1, "_emit_host_event", broken)
    calls: list[int] = []
    h = v1.register_kv_transfer_observer("yes", lambda r: calls.append(1) or True)
    with caplog.at_level(logging.WARNING, logger=v1.__name__):
        _submitted()
        _submitted()
    assert calls == [1, 1] and h.token in v1._observers
    msgs = [r.getMessage() for r in caplog.records if r.name == v1.__name__]
    assert msgs == [f"KV transfer observer {h.token} evidence delivery failed"] * 2


# ------------------------------------------------------------- fork


def _in_child(body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``body`` in a forked child; return what it reported."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # multi-threaded fork notice
        pid = os.fork()
    if pid == 0:  # child: report, never return into pytest
        code = 1
        try:
            os.write(write_fd, json.dumps(body()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return json.loads(data)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_resets_both_registries_and_keeps_the_token_counters() -> None:
    parent_seen: list[object] = []
    h1 = v1.register_kv_transfer_observer("parent", parent_seen.append)
    h2 = v2.register_correlated_observer(parent_seen.append)
    parent_lock = v1._registry_lock

    def child() -> dict[str, Any]:
        out: dict[str, Any] = {"v1": v1.kv_transfer_observers_configured(),
                               "v2": v2.correlated_observers_configured(),
                               "new_lock": v1._registry_lock is not parent_lock}
        mine: list[object] = []
        c1 = v1.register_kv_transfer_observer("child", mine.append)
        c2 = v2.register_correlated_observer(mine.append)
        out["tokens_after_parent"] = c1.token > h1.token and c2.token > h2.token
        # a parent handle copied into the child removes nothing of the child's
        v1.unregister_kv_transfer_observer(h1)
        v2.unregister_correlated_observer(h2)
        _submitted()
        _requeued()
        out["child_saw"] = len(mine)
        out["parent_saw"] = len(parent_seen)
        return out

    assert _in_child(child) == {"v1": False, "v2": False, "new_lock": True,
                                "tokens_after_parent": True, "child_saw": 2,
                                "parent_saw": 0}
    assert v1.kv_transfer_observers_configured() and v2.correlated_observers_configured()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_v1_without_fork_reset_the_child_keeps_the_parents_observers() -> None:
    """observability.py @ 115e5f6 has no fork hook (v2 resets in both versions)."""
    inherited: list[object] = []
    v1.register_kv_transfer_observer("parent", inherited.append)
    v2.register_correlated_observer(inherited.append)
    previous = v1.set_fork_reset(False)
    try:
        def child() -> dict[str, Any]:
            _submitted()
            _requeued()
            return {"v1": v1.kv_transfer_observers_configured(),
                    "v2": v2.correlated_observers_configured(), "calls": len(inherited)}

        assert _in_child(child) == {"v1": True, "v2": False, "calls": 1}
    finally:
        v1.set_fork_reset(previous)
    assert inherited == []  # the child's calls stayed in the child


# ------------------------------------------------------------- v2: surface


def test_v2_constants_use_the_real_names() -> None:
    assert v2.KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT == "vllm.kv-transfer.observer.v2"
    assert v2.KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION == "2.0"
    assert v2.MAX_CORRELATED_ROSTER == 4096
    assert v2._MAX_UINT64 == 2**64 - 1 and v2._MAX_UINT32 == 2**32 - 1
    assert not hasattr(v2, "KV_TRANSFER_OBSERVER_CONTRACT")
    assert not hasattr(v2, "KV_TRANSFER_OBSERVABILITY_API_VERSION")
    assert not hasattr(v2, "__all__")
    assert issubclass(CorrelatedEvent, str) and issubclass(CorrelatedEvent, Enum)
    assert [m.value for m in CorrelatedEvent] == [
        "recovery_requeued", "restore_submitted", "restore_completed", "transfer_receipt",
        "recovery_admitted", "first_compute"]


def test_v2_record_fields_and_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(CorrelatedObservation)}
    assert list(fields) == ["event", "scheduler_generation", "request_id", "recovery_epoch",
                            "observed_at_ns", "job_id", "rank", "worker_generation",
                            "block_count", "workers", "roster", "compute_kind"]
    assert all(fields[n] is dataclasses.MISSING for n in list(fields)[:5])
    assert {n: fields[n] for n in list(fields)[5:]} == {
        "job_id": None, "rank": None, "worker_generation": None, "block_count": None,
        "workers": (), "roster": (), "compute_kind": None}
    r = CorrelatedObservation(CorrelatedEvent.RECOVERY_REQUEUED, SG, "r", 1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rank = 1  # type: ignore[misc]
    assert not hasattr(r, "__dict__")


def test_worker_and_job_receipts() -> None:
    w0, w1 = WorkerReceipt(0, G0), WorkerReceipt(1, G1)
    assert w0 < w1 and sorted([w1, w0]) == [w0, w1]  # order=True
    assert WorkerReceipt(0, G1) < WorkerReceipt(0, G0)  # by (rank, worker_generation)
    assert WorkerReceipt(2**32 - 1, G0).rank == 2**32 - 1
    for rank, gen in ((-1, G0), (2**32, G0), (True, G0), (1.0, G0), ("0", G0),
                      (0, G0.upper()), (0, G0[:-1]), (0, None)):
        with pytest.raises(ValueError):
            WorkerReceipt(rank, gen)  # type: ignore[arg-type]
    job = JobReceipt(7, (w0, w1))
    assert JobReceipt(7, (w0,)) < job < JobReceipt(8, (w0,))
    message = "workers must be a bounded exact rank/generation roster"
    for workers in ((), (w1, w0), (w0, w0), [w0, w1], ((0, G0),),
                    tuple(sorted((WorkerReceipt(0, G0), WorkerReceipt(0, G1)))),
                    tuple(WorkerReceipt(r, G0) for r in range(4097))):
        with pytest.raises(ValueError, match=message):
            JobReceipt(7, workers)  # type: ignore[arg-type]
    assert len(JobReceipt(7, tuple(WorkerReceipt(r, G0) for r in range(4096))).workers) == 4096
    for job_id in (-1, 2**64, True, "7"):
        with pytest.raises(ValueError):
            JobReceipt(job_id, (w0,))  # type: ignore[arg-type]
    assert JobReceipt(2**64 - 1, (w0,)).job_id == 2**64 - 1


# ------------------------------------------------------------- v2: validation


def test_every_canonical_record_is_valid_and_real() -> None:
    for chain in (chains.recovery_chain(), chains.restarted_worker_chain()):
        for e in chain:
            r = e.record
            assert type(r) is CorrelatedObservation and type(r.event) is CorrelatedEvent
            assert all(type(w) is WorkerReceipt for w in r.workers)
            assert all(type(j) is JobReceipt for j in r.roster)
            v2.validate_correlated_observation(r)
            assert r.compute_kind is None or type(r.compute_kind) is str


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_records_are_refused_by_the_real_constructor(name: str) -> None:
    record = MALFORMED[name]
    assert type(record) is CorrelatedObservation  # built by unchecked()
    with pytest.raises(ValueError):
        CorrelatedObservation(**v2.fields_of(record))
    with pytest.raises((ValueError, TypeError)):
        v2.validate_correlated_observation(record)


# event -> one valid value for each optional field
VALID = {"job_id": 7, "rank": 1, "worker_generation": G1, "block_count": 16,
         "workers": (WorkerReceipt(0, G0), WorkerReceipt(1, G1)),
         "roster": (JobReceipt(7, (WorkerReceipt(0, G0), WorkerReceipt(1, G1))),),
         "compute_kind": "decode"}


@pytest.mark.parametrize("event", list(CorrelatedEvent))
def test_each_event_has_an_exact_shape(event: CorrelatedEvent) -> None:
    canonical = next(e.record for e in chains.recovery_chain() if e.record.event is event)
    needed = {n for n in VALID if getattr(canonical, n) not in (None, ())}
    CorrelatedObservation(**v2.fields_of(canonical))
    for name in VALID:
        changed = v2.fields_of(canonical)
        if name in needed:  # missing
            changed[name] = () if name in ("workers", "roster") else None
        else:  # unexpected, though valid in itself
            changed[name] = VALID[name]
        with pytest.raises(ValueError):
            CorrelatedObservation(**changed)


def test_v2_boundaries() -> None:
    base = v2.fields_of(chains.recovery_chain()[1].record)  # restore_submitted
    ok = [("request_id", "r" * 128), ("request_id", " ~"), ("recovery_epoch", 2**64 - 1),
          ("observed_at_ns", 0), ("observed_at_ns", 2**64 - 1), ("job_id", 0),
          ("job_id", 2**64 - 1), ("rank", 2**32 - 1), ("block_count", 2**32 - 1)]
    for name, value in ok:
        CorrelatedObservation(**{**base, name: value})
    bad = [("request_id", "r" * 129), ("request_id", "\x7f"), ("recovery_epoch", 0),
           ("observed_at_ns", 2**64), ("job_id", 2**64), ("job_id", False),
           ("rank", 2**32), ("block_count", 0), ("block_count", 2**32),
           ("worker_generation", G1.upper())]
    for name, value in bad:
        with pytest.raises(ValueError):
            CorrelatedObservation(**{**base, name: value})
    v2.validate_correlated_observation(chains.at_cap_admission())
    for over in (chains.over_cap_admission(), chains.over_cap_receipt()):
        with pytest.raises(ValueError):
            v2.validate_correlated_observation(over)


def test_unchecked_builds_without_validation_and_checks_its_field_names() -> None:
    r = v2.unchecked(event="nonsense", scheduler_generation=1, request_id=None,
                     recovery_epoch=-1, observed_at_ns="x")
    assert type(r) is CorrelatedObservation and r.event == "nonsense"
    assert (r.job_id, r.workers, r.roster) == (None, (), ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        v2.unchecked(event=CorrelatedEvent.FIRST_COMPUTE)  # required fields missing
    with pytest.raises(TypeError):
        v2.unchecked(**v2.fields_of(r), colour="red")


# ------------------------------------------------------------- v2: registry, dispatch


def test_v2_registry() -> None:
    with pytest.raises(ValueError):
        v2.register_correlated_observer("not callable")  # type: ignore[arg-type]
    assert "name" not in inspect.signature(v2.register_correlated_observer).parameters
    h1 = v2.register_correlated_observer(lambda r: None)
    h2 = v2.register_correlated_observer(lambda r: None)
    assert isinstance(h1, v2.CorrelatedObserverHandle)
    assert h1.contract == v2.KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT
    assert h2.token == h1.token + 1
    v2.unregister_correlated_observer(h1)
    v2.unregister_correlated_observer(h1)  # idempotent
    with pytest.raises(ValueError, match="correlated observer handle has the wrong contract"):
        v2.unregister_correlated_observer(v1.KVTransferObserverHandle(  # type: ignore[arg-type]
            v1.KV_TRANSFER_OBSERVER_CONTRACT, h2.token))
    assert v2.correlated_observers_configured()
    v2.reset_correlated_observers()
    assert not v2.correlated_observers_configured()


def test_v2_emit_signature() -> None:
    params = inspect.signature(v2.emit_correlated_observation).parameters
    assert list(params) == ["event", "scheduler_generation", "request_id", "recovery_epoch",
                            "job_id", "rank", "worker_generation", "block_count", "workers",
                            "roster", "compute_kind"]
    assert params["event"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in params.items()
               if n != "event")
    assert {n: p.default for n, p in params.items() if p.default is not p.empty} == {
        "job_id": None, "rank": None, "worker_generation": None, "block_count": None,
        "workers": (), "roster": (), "compute_kind": None}


def test_v2_emit_builds_the_record_with_the_module_clock() -> None:
    seen: list[CorrelatedObservation] = []
    v2.register_correlated_observer(seen.append)
    with v2.clock(lambda: 99):
        _requeued()
    assert seen == [CorrelatedObservation(CorrelatedEvent.RECOVERY_REQUEUED, SG, "r", 1, 99)]


def test_v2_invalid_emit_is_logged_and_reaches_no_observer(caplog) -> None:
    seen: list[object] = []
    v2.register_correlated_observer(seen.append)
    with caplog.at_level(logging.WARNING, logger=v2.__name__):
        _requeued(job_id=7)  # recovery_requeued carries nothing optional
        _requeued(recovery_epoch=0)
        v2.emit_correlated_observation("recovery_requeued", scheduler_generation=SG,
                                       request_id="r", recovery_epoch=1)  # a plain str
    assert seen == []
    msgs = [r.getMessage() for r in caplog.records if r.name == v2.__name__]
    assert msgs == ["Invalid correlated KV observation; leaving serving unchanged"] * 3
    _requeued()
    assert len(seen) == 1 and v2.correlated_observers_configured()


def test_v2_raising_observer_removed_and_return_ignored(caplog) -> None:
    calls: list[str] = []
    v2.register_correlated_observer(lambda r: calls.append("true") or True)

    def bad(r: Any) -> None:
        calls.append("bad")
        raise ValueError("boom")

    bad_handle = v2.register_correlated_observer(bad)
    v2.register_correlated_observer(lambda r: calls.append("last"))
    with caplog.at_level(logging.WARNING, logger=v2.__name__):
        _requeued()
        _requeued()
    assert calls == ["true", "bad", "last", "true", "last"]
    (logged,) = [r for r in caplog.records if r.name == v2.__name__]
    assert logged.getMessage() == f"Correlated KV observer {bad_handle.token} failed; removing it"
    assert v1.effective_evidence_requests() == ()  # v2 asks for no evidence


def test_v2_disabled_emit_reads_no_clock() -> None:
    def clock() -> int:
        raise AssertionError("clock read with no observer")

    v2.set_clock(clock)
    _requeued()
    v2.emit_correlated_observation(CorrelatedEvent.FIRST_COMPUTE, scheduler_generation="bad",
                                   request_id="", recovery_epoch=0)  # not even validated


def test_v2_dispatch_snapshot() -> None:
    seen: list[str] = []

    def first(r: Any) -> None:
        seen.append("first")
        if len(seen) == 1:
            v2.register_correlated_observer(lambda r: seen.append("late"))

    v2.register_correlated_observer(first)
    _requeued()
    _requeued()
    assert seen == ["first", "first", "late"]


# ------------------------------------------------------------- replay


def test_replay_goes_through_the_real_emit_functions() -> None:
    seen1: list[KVTransferObservation] = []
    seen2: list[CorrelatedObservation] = []
    v1.register_kv_transfer_observer("t", seen1.append)
    v2.register_correlated_observer(seen2.append)
    c1, c2 = chains.v1_recovery_chain(), chains.recovery_chain()
    chains.play(c1 + (chains.v1_shutdown_cancel(),) + c2)
    assert seen1 == chains.records(c1) + [chains.v1_shutdown_cancel().record]
    assert seen2 == chains.records(c2)
    assert all(a is not b for a, b in zip(seen2, chains.records(c2), strict=True))


def test_v1_replay_refuses_records_its_emit_function_cannot_produce() -> None:
    v1.register_kv_transfer_observer("t", lambda r: None)
    completed = next(e.record for e in chains.v1_recovery_chain()
                     if e.record.event is KVTransferEvent.TRANSFER_COMPLETED)
    receipt = next(e.record for e in chains.v1_recovery_chain()
                   if e.record.event is KVTransferEvent.TRANSFER_RECEIPT)
    for odd in (dataclasses.replace(completed, block_count=16),  # not an argument
                dataclasses.replace(receipt, success=False),  # emit fixes success=True
                dataclasses.replace(receipt, operation=TransferOperation.D2H_PRESERVE),
                dataclasses.replace(receipt, event="no_such_event")):
        with pytest.raises(ValueError):
            v1.replay(odd)


def test_v2_replay_of_an_invalid_record_reaches_no_observer() -> None:
    seen: list[object] = []
    v2.register_correlated_observer(seen.append)
    for record in MALFORMED.values():
        v2.replay(record)
    assert seen == []


# ------------------------------------------------------------- chains


def test_v2_chain_follows_the_hosts_order() -> None:
    chain = chains.recovery_chain()
    events = [(e.record.event.value, e.record.recovery_epoch, e.record.rank) for e in chain]
    per_epoch = [
        ("recovery_requeued", None), ("restore_submitted", 0), ("restore_completed", 0),
        ("restore_submitted", 1), ("restore_completed", 1), ("transfer_receipt", None),
        ("recovery_admitted", None), ("first_compute", 0), ("first_compute", 1)]
    assert events == [(ev, ep, r) for ep in (1, 2) for ev, r in per_epoch]
    # monotonic per process, and the processes' clocks are unrelated
    last: dict[str, int] = {}
    for e in chain:
        assert e.record.observed_at_ns > last.get(e.process.generation, -1)
        last[e.process.generation] = e.record.observed_at_ns
        if e.process.role == "worker":
            assert e.record.worker_generation == e.process.generation
            assert e.record.rank == e.process.rank
    assert len(last) == 3
    assert {e.record.scheduler_generation for e in chain} == {SG}
    for e in chain:
        r = e.record
        if r.event is CorrelatedEvent.TRANSFER_RECEIPT:
            assert r.workers == (WorkerReceipt(0, G0), WorkerReceipt(1, G1))
            assert r.job_id == chains.JOB_IDS[r.recovery_epoch]
        if r.event in (CorrelatedEvent.RECOVERY_ADMITTED, CorrelatedEvent.FIRST_COMPUTE):
            assert r.roster == (JobReceipt(chains.JOB_IDS[r.recovery_epoch],
                                           (WorkerReceipt(0, G0), WorkerReceipt(1, G1))),)
        if r.event is CorrelatedEvent.FIRST_COMPUTE:
            assert r.compute_kind == chains.COMPUTE_KINDS[r.recovery_epoch]
    assert len(chains.dropped_stage()) == len(chain) - 1
    assert len(chains.duplicated_stage()) == len(chain) + 1


def test_restarted_worker_generation() -> None:
    chain = chains.restarted_worker_chain()
    gens = {(e.record.recovery_epoch, e.record.worker_generation)
            for e in chain if e.record.rank == 1}
    assert gens == {(1, G1), (2, chains.RESTARTED_WORKER_GENERATION)}
    (admitted2,) = [e.record for e in chain
                    if e.record.event == "recovery_admitted" and e.record.recovery_epoch == 2]
    assert admitted2.roster[0].workers[1] == WorkerReceipt(1, chains.RESTARTED_WORKER_GENERATION)


def test_v1_chain_follows_the_hosts_order_and_values() -> None:
    chain = chains.v1_recovery_chain()
    K = KVTransferEvent
    per_epoch = [(K.RECOVERY_REQUEUED, None, None)]
    for r in chains.RANKS:
        per_epoch += [(K.TRANSFER_DESCRIPTORS, r, None), (K.TRANSFER_SUBMITTED, r, r),
                      (K.TRANSFER_COMPLETED, r, r)]
    per_epoch += [(K.TRANSFER_RECEIPT, None, None), (K.RECOVERY_ADMITTED, None, None)]
    per_epoch += [(K.FIRST_COMPUTE, r, r) for r in chains.RANKS]
    assert [(e.record.event, e.process.rank, e.record.rank) for e in chain] == per_epoch * 2
    for e in chain:
        r = e.record
        assert type(r.event) is KVTransferEvent
        for name, enum in (("operation", TransferOperation), ("reason",
                           TransferCancellationReason), ("requeue_reason",
                           RecoveryRequeueReason), ("compute_kind", ComputeKind)):
            assert getattr(r, name) is None or type(getattr(r, name)) is enum
        assert not hasattr(r, "worker_generation") and not hasattr(r, "scheduler_generation")
        if r.event is K.TRANSFER_DESCRIPTORS:
            assert r.request_id is None and r.rank is None and r.dropped_descriptors == 0
            assert r.descriptors and all(type(d) is KVRegionDescriptor for d in r.descriptors)
            assert len(r.descriptors) <= v1.MAX_DESCRIPTOR_REGIONS
        if r.event is K.TRANSFER_RECEIPT:
            assert (r.rank, r.operation, r.success, r.ranks, r.request_id) == (
                None, TransferOperation.H2D_RESTORE, True, [0, 1], chains.REQUEST_ID)
        if r.event is K.TRANSFER_COMPLETED:
            assert r.success is True and r.block_count is None and r.bytes_moved > 0
        if r.event is K.FIRST_COMPUTE:
            assert r.compute_kind.value == chains.COMPUTE_KINDS[r.recovery_epoch]
            assert r.job_ids == (chains.JOB_IDS[r.recovery_epoch],)
        if r.event is K.RECOVERY_REQUEUED:
            assert r.requeue_reason is RecoveryRequeueReason.UNCLASSIFIED
    cancel = chains.v1_shutdown_cancel().record
    assert cancel.reason is TransferCancellationReason.HOST_SHUTDOWN
    assert cancel.operation is TransferOperation.D2H_PRESERVE


@pytest.mark.parametrize("base,names", [
    (v2, ("KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT",
          "KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION")),
    (v1, ("KV_TRANSFER_OBSERVER_CONTRACT", "KV_TRANSFER_OBSERVABILITY_API_VERSION")),
])
def test_unknown_version_module_uses_the_real_constant_names(base: Any, names: Any) -> None:
    mod = chains.unknown_version_module(base, "vllm.kv-transfer.observer.v9", "9.1")
    assert (getattr(mod, names[0]), getattr(mod, names[1])) == (
        "vllm.kv-transfer.observer.v9", "9.1")
    assert getattr(base, names[1]) in ("1.0", "2.0")  # the base is untouched
    if base is v2:
        h = mod.register_correlated_observer(lambda r: None)
        assert v2.correlated_observers_configured()
        mod.unregister_correlated_observer(h)
        assert not v2.correlated_observers_configured()
        assert mod.CorrelatedObservation is CorrelatedObservation
    else:
        h = mod.register_kv_transfer_observer("t", lambda r: None)
        mod.unregister_kv_transfer_observer(h)
        assert not v1.kv_transfer_observers_configured()
        assert mod.KVTransferObservation is KVTransferObservation
    assert h.contract == "vllm.kv-transfer.observer.v9"


# ------------------------------------------------------------- labels


def test_every_module_is_labelled_and_cites_the_fork() -> None:
    package = Path(v1.__file__).parent
    label = ("STAND-IN for the vLLM-HUST fork's observer contract "
             "(the fork cannot be installed here)")
    sources = sorted(package.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "observability.py",
                                         "correlated_observability.py", "chains.py",
                                         "jsonl.py"}
    for path in sources:
        assert ast_docstring(path).startswith(label), path.name
    for mod in (v1, v2, chains):
        assert "@ 65cc5678b0d5" in mod.__doc__
        assert "hust-contract.md" not in mod.__doc__
        assert "stand-in decision" in mod.__doc__.lower()
    assert "@ 115e5f6b0d2c" in v1.__doc__


def ast_docstring(path: Path) -> str:
    import ast

    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
