"""The vLLM-HUST contract stand-in behaves as shared/design/hust-contract.md
documents (tests/standins/vllm_hust_contract/), so an adapter tested against
it is tested against the documented contract."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator

import pytest
from vllm_hust_contract import chains, jsonl
from vllm_hust_contract import correlated_observability as v2
from vllm_hust_contract import observability as v1

MALFORMED = chains.malformed_v2_records()


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    yield
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()


def _v1_record() -> v1.KVTransferObservation:
    return chains.v1_recovery_chain()[2].record


# ------------------------------------------------------------- constants, records


def test_constants() -> None:
    assert v1.KV_TRANSFER_OBSERVER_CONTRACT == "vllm.kv-transfer.observer.v1"
    assert v1.KV_TRANSFER_OBSERVABILITY_API_VERSION == "1.0"
    assert v1.MAX_DESCRIPTOR_REGIONS == 4096
    assert v2.KV_TRANSFER_OBSERVER_CONTRACT == "vllm.kv-transfer.observer.v2"
    assert v2.KV_TRANSFER_OBSERVABILITY_API_VERSION == "2.0"
    assert v2.MAX_CORRELATED_ROSTER == 4096


def test_record_fields_and_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(v1.KVTransferObservation)}
    assert list(fields) == [
        "event", "observed_at_ns", "operation", "job_id", "rank", "request_id", "block_count",
        "success", "bytes_moved", "duration_ns", "reason", "ranks", "recovery_epoch",
        "job_ids", "requeue_reason", "descriptors", "dropped_descriptors", "compute_kind"]
    rec = v1.KVTransferObservation("transfer_receipt", 5)
    assert all(getattr(rec, k) in (None, (), 0) for k in list(fields)[2:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.rank = 1  # type: ignore[misc]

    names = [f.name for f in dataclasses.fields(v2.CorrelatedObservation)]
    assert names[:5] == ["event", "scheduler_generation", "request_id", "recovery_epoch",
                         "observed_at_ns"]
    assert set(names[5:]) == {"job_id", "rank", "worker_generation", "block_count",
                              "workers", "roster", "compute_kind"}
    r2 = v2.CorrelatedObservation("recovery_requeued", "0" * 32, "r", 1, 0)
    assert all(getattr(r2, k) is None for k in names[5:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        r2.rank = 1  # type: ignore[misc]


# ------------------------------------------------------------- registration


@pytest.mark.parametrize("mod,register,unregister,configured", [
    (v1, lambda o: v1.register_kv_transfer_observer("t", o),
     v1.unregister_kv_transfer_observer, v1.kv_transfer_observers_configured),
    (v2, v2.register_correlated_observer, v2.unregister_correlated_observer,
     v2.correlated_observers_configured),
])
def test_register_unregister_idempotent(mod, register, unregister, configured) -> None:
    assert not configured()
    h1 = register(lambda r: None)
    h2 = register(lambda r: None)
    assert h1.contract == h2.contract == mod.KV_TRANSFER_OBSERVER_CONTRACT
    assert h1.token != h2.token
    assert configured()
    unregister(h1)
    unregister(h1)  # idempotent
    assert configured()
    unregister(h2)
    unregister(h2)
    assert not configured()
    unregister(h1)  # still fine


def test_foreign_handle_is_noop() -> None:
    h = v1.register_kv_transfer_observer("t", lambda r: None)
    v2.unregister_correlated_observer(v1.ObserverHandle(v2.KV_TRANSFER_OBSERVER_CONTRACT + "x",
                                                        h.token))
    v2.unregister_correlated_observer(h)  # a v1 handle does nothing to v2 (or v1)
    assert v1.kv_transfer_observers_configured()
    v1.reset_kv_transfer_observers()
    assert not v1.kv_transfer_observers_configured()


def test_v1_inline_dispatch_and_effective_evidence() -> None:
    seen: list[tuple[str, object]] = []
    v1.register_kv_transfer_observer("a", lambda r: seen.append(("a", r)) or True)
    v1.register_kv_transfer_observer("b", lambda r: seen.append(("b", r)) or 1)  # truthy only
    v1.register_kv_transfer_observer("c", lambda r: seen.append(("c", r)) or "yes")
    rec = _v1_record()
    v1.emit_v1(rec)
    assert seen == [("a", rec), ("b", rec), ("c", rec)]  # inline, registration order
    assert v1.effective_evidence_requests() == (v1.EffectiveEvidence("a", rec),)
    v1.reset_kv_transfer_observers()
    assert v1.effective_evidence_requests() == ()


def test_v1_raising_observer_logged_and_removed(caplog) -> None:
    calls = {"bad": 0, "good": 0}

    def bad(r):
        calls["bad"] += 1
        raise RuntimeError("observer bug")

    def good(r):
        calls["good"] += 1

    v1.register_kv_transfer_observer("bad", bad)
    v1.register_kv_transfer_observer("good", good)
    with caplog.at_level(logging.WARNING, logger=v1.__name__):
        v1.emit_v1(_v1_record())  # does not raise
        v1.emit_v1(_v1_record())
    assert calls == {"bad": 1, "good": 2}
    logged = [r for r in caplog.records if r.name == v1.__name__]
    assert len(logged) == 1 and "'bad'" in logged[0].getMessage() and logged[0].exc_info
    assert v1.kv_transfer_observers_configured()


def test_v2_raising_observer_removed_and_return_ignored(caplog) -> None:
    calls: list[str] = []
    v2.register_correlated_observer(lambda r: calls.append("true") or True)

    def bad(r):
        calls.append("bad")
        raise ValueError("boom")

    v2.register_correlated_observer(bad)
    rec = chains.recovery_chain()[0].record
    with caplog.at_level(logging.WARNING, logger=v2.__name__):
        v2.emit_v2(rec)
        v2.emit_v2(rec)
    assert calls == ["true", "bad", "true"]
    assert any(r.name == v2.__name__ and r.exc_info for r in caplog.records)


def test_disabled_emit_calls_nothing() -> None:
    v1.emit_v1(_v1_record())
    v2.emit_v2(chains.recovery_chain()[0].record)
    assert v1.effective_evidence_requests() == ()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_drops_observers() -> None:
    v1.register_kv_transfer_observer("parent", lambda r: True)
    v2.register_correlated_observer(lambda r: None)
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # multi-threaded fork notice
        pid = os.fork()
    if pid == 0:  # child: report, never return into pytest
        try:
            v1.emit_v1(_v1_record())
            result = {"v1": v1.kv_transfer_observers_configured(),
                      "v2": v2.correlated_observers_configured(),
                      "effective": len(v1.effective_evidence_requests())}
            os.write(write_fd, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert json.loads(data) == {"v1": False, "v2": False, "effective": 0}
    # the parent keeps its observers
    assert v1.kv_transfer_observers_configured() and v2.correlated_observers_configured()


# ------------------------------------------------------------- v2 validation


CANONICAL = {
    "recovery": chains.recovery_chain,
    "dropped_stage": chains.dropped_stage,
    "duplicated_stage": chains.duplicated_stage,
    "restarted_worker": chains.restarted_worker_chain,
}


@pytest.mark.parametrize("name", sorted(CANONICAL))
def test_v2_accepts_chains(name: str) -> None:
    seen: list[v2.CorrelatedObservation] = []
    v2.register_correlated_observer(seen.append)
    chain = CANONICAL[name]()
    for e in chain:
        v2.emit_v2(e.record)
    assert seen == chains.records(chain)


def test_canonical_chain_shape() -> None:
    chain = chains.recovery_chain()
    events = [(e.record.event, e.record.recovery_epoch, e.record.rank) for e in chain]
    per_epoch = [
        ("recovery_requeued", None), ("restore_submitted", 0), ("restore_submitted", 1),
        ("restore_completed", 0), ("restore_completed", 1), ("transfer_receipt", None),
        ("recovery_admitted", None), ("first_compute", 0), ("first_compute", 1)]
    assert events == [(ev, ep, r) for ep in (1, 2) for ev, r in per_epoch]
    # monotonic per process, and the processes' clocks are unrelated
    last: dict[str, int] = {}
    for e in chain:
        assert e.record.observed_at_ns > last.get(e.process.start_id, -1)
        last[e.process.start_id] = e.record.observed_at_ns
        if e.process.role == "worker":
            assert e.record.worker_generation == e.process.generation
    assert len(last) == 3
    assert {e.record.scheduler_generation for e in chain} == {chains.SCHEDULER_GENERATION}
    dropped = chains.dropped_stage()
    assert len(dropped) == len(chain) - 1
    assert len(chains.duplicated_stage()) == len(chain) + 1


def test_restarted_worker_generation() -> None:
    chain = chains.restarted_worker_chain()
    gens = {(e.record.recovery_epoch, e.record.worker_generation)
            for e in chain if e.record.rank == 1}
    assert gens == {(1, chains.WORKER_GENERATIONS[1]), (2, chains.RESTARTED_WORKER_GENERATION)}
    admitted2 = [e.record for e in chain
                 if e.record.event == "recovery_admitted" and e.record.recovery_epoch == 2]
    assert admitted2[0].roster[0][1][1] == (1, chains.RESTARTED_WORKER_GENERATION)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_v2_rejects_malformed(name: str) -> None:
    seen: list[object] = []
    v2.register_correlated_observer(seen.append)
    with pytest.raises(v2.InvalidObservation):
        v2.emit_v2(MALFORMED[name])
    assert seen == []  # refused before dispatch
    assert v2.correlated_observers_configured()


def test_v2_caps() -> None:
    v2.validate_correlated_observation(chains.at_cap_admission())
    with pytest.raises(v2.InvalidObservation, match="MAX_CORRELATED_ROSTER"):
        v2.validate_correlated_observation(chains.over_cap_admission())
    with pytest.raises(v2.InvalidObservation, match="MAX_CORRELATED_ROSTER"):
        v2.validate_correlated_observation(chains.over_cap_receipt())
    rid = chains.recovery_chain()[0].record
    v2.validate_correlated_observation(dataclasses.replace(rid, request_id="r" * 128))


def test_v1_descriptor_cap() -> None:
    seen: list[object] = []
    v1.register_kv_transfer_observer("t", seen.append)
    descs = [(0, 1, i, i, 1) for i in range(v1.MAX_DESCRIPTOR_REGIONS + 3)]
    kept, dropped = v1.bound_descriptors(descs)
    assert len(kept) == v1.MAX_DESCRIPTOR_REGIONS and dropped == 3
    ok = v1.KVTransferObservation("transfer_descriptors", 1, job_id=3, descriptors=kept,
                                  dropped_descriptors=dropped)
    v1.emit_v1(ok)
    with pytest.raises(v1.InvalidObservation):
        v1.emit_v1(dataclasses.replace(ok, descriptors=tuple(descs)))
    assert seen == [ok]


def test_v1_chain_limits() -> None:
    seen: list[object] = []
    v1.register_kv_transfer_observer("t", seen.append)
    chain = chains.v1_recovery_chain()
    for e in chain:
        v1.emit_v1(e.record)
    assert seen == chains.records(chain)
    for e in chain:
        r = e.record
        if e.process.role == "scheduler":
            assert r.rank is None
        if r.event == "transfer_descriptors":
            assert r.request_id is None and r.rank is None
        assert not hasattr(r, "worker_generation") and not hasattr(r, "scheduler_generation")
    receipts = [e.record for e in chain if e.record.event == "transfer_receipt"]
    assert [r.ranks for r in receipts] == [(0, 1), (0, 1)]
    # descriptors arrive before the submit of the same job, per rank process
    idx = {(e.record.event, e.process.rank, e.record.job_id): i for i, e in enumerate(chain)}
    for job in chains.JOB_IDS.values():
        for rank in chains.RANKS:
            assert idx[("transfer_descriptors", rank, job)] < idx[("transfer_submitted", rank, job)]
    v1.emit_v1(chains.v1_shutdown_cancel().record)


def test_unknown_version_module() -> None:
    mod = chains.unknown_version_module()
    assert mod.KV_TRANSFER_OBSERVER_CONTRACT == "vllm.kv-transfer.observer.v3"
    assert mod.KV_TRANSFER_OBSERVABILITY_API_VERSION == "3.0"
    assert v2.KV_TRANSFER_OBSERVER_CONTRACT == "vllm.kv-transfer.observer.v2"  # untouched
    h = mod.register_correlated_observer(lambda r: None)
    assert h.contract == "vllm.kv-transfer.observer.v3"
    mod.unregister_correlated_observer(h)
    assert not v2.correlated_observers_configured()
    m1 = chains.unknown_version_module(v1, "vllm.kv-transfer.observer.v1", "1.7")
    assert m1.KV_TRANSFER_OBSERVABILITY_API_VERSION == "1.7"
    assert m1.KVTransferObservation is v1.KVTransferObservation


# ------------------------------------------------------------- JSONL


def test_jsonl_round_trip(tmp_path) -> None:
    # two separate runs (each chain has its own per-process clocks): v2 and v1
    v2_chain, v1_chain = chains.restarted_worker_chain(), chains.v1_recovery_chain()
    paths = jsonl.write_chain_files(tmp_path / "v2", v2_chain)
    assert len(paths) == 4  # scheduler, rank 0, rank 1, restarted rank 1
    paths += jsonl.write_chain_files(tmp_path / "v1", v1_chain)
    chain = v2_chain + v1_chain
    lines = jsonl.read_records(paths)
    facts = [ln for ln in lines if ln.schema == jsonl.HOST_FACT_SCHEMA]
    assert len(facts) == 7
    data = [ln for ln in lines if ln.schema != jsonl.HOST_FACT_SCHEMA]
    # every record back, equal, with its process identity
    by_start = {e.process.start_id: e.process for e in chain}
    assert sorted(map(repr, (ln.record for ln in data))) == sorted(
        map(repr, chains.records(chain)))
    for ln in lines:
        assert by_start[ln.process_start_id].pid == ln.pid
    for p in paths:
        per = jsonl.read_jsonl(p)
        assert [ln.seq for ln in per] == list(range(len(per)))
        assert per[0].schema == jsonl.HOST_FACT_SCHEMA
        stamps = [ln.record.observed_at_ns for ln in per]
        assert stamps == sorted(stamps)
        for text in p.read_text().splitlines():
            obj = json.loads(text)
            assert obj["schema"] in jsonl.SCHEMAS
            assert {"pid", "process_start_id", "seq"} <= obj.keys()
    schemas = {ln.schema for ln in lines}
    assert schemas == set(jsonl.SCHEMAS)
    corr = next(ln.record for ln in data if ln.schema == jsonl.CORRELATED_SCHEMA
                and ln.record.event == "first_compute")
    v2.validate_correlated_observation(corr)  # tuples restored
    assert isinstance(corr.roster[0][1], tuple)


def test_jsonl_writer_direct(tmp_path) -> None:
    path = tmp_path / "one.jsonl"
    rec = chains.v1_shutdown_cancel().record
    fact = jsonl.HostFact(1, "worker", 0, chains.WORKER_GENERATIONS[0])
    with jsonl.JsonlWriter(path, pid=11, process_start_id="0" * 32) as w:
        w.write_host_fact(fact)
        w.write(rec)
    first, second = (json.loads(t) for t in path.read_text().splitlines())
    assert first["contracts"] == [
        {"contract": "vllm.kv-transfer.observer.v1", "api_version": "1.0"},
        {"contract": "vllm.kv-transfer.observer.v2", "api_version": "2.0"}]
    assert second["schema"] == "vllm-hust.kv-transfer-event.v2"
    assert second["contract"] == "vllm.kv-transfer.observer.v1" and second["seq"] == 1
    assert [ln.record for ln in jsonl.read_jsonl(path)] == [fact, rec]
    with pytest.raises(TypeError), jsonl.JsonlWriter(path, pid=1, process_start_id="0" * 32) as w:
        w.write(object())


def test_every_module_labelled() -> None:
    import vllm_hust_contract

    for mod in (vllm_hust_contract, v1, v2, chains, jsonl):
        assert mod.__doc__.startswith("STAND-IN for the vLLM-HUST fork's observer contract")
        assert "hust-contract.md" in mod.__doc__
    assert "stand-in's assumption" in jsonl.__doc__.lower() or "ASSUMPTION" in jsonl.__doc__
    assert sys.modules[v1.__name__] is v1
