"""The live vLLM-HUST adapter against the stand-in of the fork's contracts.

The fork cannot be installed here; ``tests/standins/vllm_hust_contract`` is a
STAND-IN written from facts read in the fork's source (see its docstrings).
The stand-in modules are installed under the fork's module paths, so the
adapter finds them exactly as it would find the fork's; the fork's call sites
are played by its real emit functions (``chains.play`` / ``replay``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from enum import Enum
from types import ModuleType
from typing import Any

import pytest
from oracle import assert_traces_hold, chain_truth
from vllm_hust_contract import chains
from vllm_hust_contract import correlated_observability as v2
from vllm_hust_contract import observability as v1
from vllm_hust_contract.observability import (
    ComputeKind,
    KVRegionDescriptor,
    KVTransferEvent,
    KVTransferObservation,
    TransferOperation,
)

import kvobs_otel
from kvobs_otel.config import Settings
from kvobs_otel.hosts.hust import contracts
from kvobs_otel.hosts.hust import records as R
from kvobs_otel.hosts.vllm import instrumentor
from kvobs_otel.telemetry.otlp_json import spans_to_otlp_json
from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.otlp_file import spans_from_document

from chains import by_trace, view

pytestmark = pytest.mark.vllm

SETTINGS = Settings(enabled=True, drain_interval_s=0.02)


def install(monkeypatch: pytest.MonkeyPatch, v1_module: ModuleType | None = v1,
            v2_module: ModuleType | None = v2) -> None:
    """Make the stand-in modules importable under the fork's paths."""
    for contract, module in ((contracts.V1, v1_module), (contracts.V2, v2_module)):
        if module is None:
            monkeypatch.setitem(sys.modules, contract.module, None)  # import fails
        else:
            monkeypatch.setitem(sys.modules, contract.module, module)


@pytest.fixture
def fork(monkeypatch: pytest.MonkeyPatch, telemetry) -> Iterator:
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    install(monkeypatch)
    yield telemetry
    kvobs_otel.uninstrument()
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()


def export_to_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Any:
    """Spans of every process (forked ones too) to one OTLP JSON file; no
    in-memory override, no registered observers."""
    from kvobs_otel.telemetry.providers import set_export_overrides

    set_export_overrides(None, None)
    out = tmp_path / "spans.jsonl"
    for k, val in {"KVOBS_OTEL_TRACES_FILE": str(out), "OTEL_TRACES_EXPORTER": "none",
                   "OTEL_METRICS_EXPORTER": "none"}.items():
        monkeypatch.setenv(k, val)
    v1.reset_kv_transfer_observers()
    v2.reset_correlated_observers()
    return out


def run_forked(child: Any) -> int:
    """Run ``child`` in a forked process (as vLLM forks its workers); it must
    exit 0. Returns its pid."""
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    return proc.pid


def emit(chain: chains.Chain) -> None:
    chains.play(chain)  # the fork's emit functions, each record at its own time


def run(chain: chains.Chain, telemetry) -> list:
    assert kvobs_otel.instrument(SETTINGS)
    emit(chain)
    kvobs_otel.uninstrument()  # drains, ends what is open, flushes
    return telemetry.spans()


def file_spans(spans: list) -> list:
    return spans_from_document(spans_to_otlp_json(spans))


def restore_shape(spans: list) -> list[tuple]:
    """Per recovered episode, the restore chain as (span, parent span, rank):
    the part every host can report."""
    out = []
    for trace in by_trace(spans).values():
        ids = {s.span_id: s.name for s in trace}
        roots = [s for s in trace if s.name == "kv.recovery"]
        if not roots:
            continue  # ordinary offload traffic (kv.request)
        (root,) = roots
        restores = set(root.attrs.get("kvobs.restore.job_ids", ()))
        shape = []
        for s in trace:
            job = s.attrs.get("kvobs.job.id")
            if s.name in ("kv.job", "kv.transfer") and job not in restores:
                continue  # preserve (D2H) jobs: the v2 contract has none
            shape.append((s.name, ids.get(s.parent_id), s.attrs.get("kvobs.rank"),
                          s.attrs.get("kvobs.outcome")))
        out.append((root.attrs["kvobs.recovery.epoch"], sorted(shape, key=repr)))
    return sorted(out, key=repr)


def test_v2_recovery_chain_becomes_one_complete_trace_per_epoch(fork):
    chain = chains.recovery_chain()
    spans = run(chain, fork)
    # Judged against what the host emitted, not by kvobs-otel's own checker.
    assert assert_traces_hold(chain_truth(chain), set(chains.RANKS), spans) == 2
    episodes = rebuild(file_spans(spans))
    assert [(e.request_id, e.epoch, e.outcome) for e in episodes] == [
        (chains.REQUEST_ID, 1, "recovered"), (chains.REQUEST_ID, 2, "recovered")]
    for e in episodes:
        assert e.sched_gen == chains.SCHEDULER_GENERATION
        assert e.restore_jobs == [chains.JOB_IDS[e.epoch]]
        transfers = e.named("kv.transfer")
        assert {(s.attributes["kvobs.rank"], s.attributes["kvobs.worker.generation"])
                for s in transfers} == set(chains.WORKER_GENERATIONS.items())
        assert {s.attributes["kvobs.blocks"] for s in transfers} == {chains.BLOCKS[e.epoch]}
        kinds = {s.attributes["kvobs.compute.kind"] for s in e.named("kv.first_compute")}
        assert kinds == {"prefill" if e.epoch == 1 else "decode"}
        # The scheduler never sees first compute in v2: not claimed on the root.
        assert "kvobs.first_compute.ranks" not in e.root.attributes
    # Each role and rank exports under its own resource, saying which host.
    resources = {(s.resource.get("kvobs.role"), s.resource.get("kvobs.rank"))
                 for s in file_spans(spans)}
    assert resources == {("scheduler", None), ("worker", 0), ("worker", 1)}
    assert {s.resource["kvobs.host.adapter"] for s in file_spans(spans)} == {"vllm-hust"}
    assert {s.resource["kvobs.host.contract"] for s in file_spans(spans)} == {
        "vllm.kv-transfer.observer.v2"}
    # The same metrics as the stock path, from the same records.
    m = fork.metric_total
    assert m("kvobs.recovery.episodes", outcome="recovered") == 2
    assert m("kvobs.jobs", kind="load", outcome="complete") == 2
    assert m("kvobs.transfers", direction="h2d", outcome="ok", rank=1) == 2
    assert m("kvobs.first_compute", compute_kind="decode") == 2
    assert m("kvobs.receipts.incomplete") == 0 and m("kvobs.host.refused") == 0


def test_fork_present_means_no_patching_and_v2_preferred(fork):
    assert kvobs_otel.instrument(SETTINGS)
    assert not instrumentor.is_patched()  # the fork's own seams, nothing observed twice
    assert v2.correlated_observers_configured()
    assert not v1.kv_transfer_observers_configured()
    kvobs_otel.uninstrument()
    assert not v2.correlated_observers_configured()
    assert not kvobs_otel.is_instrumented()


def test_disabled_registers_nothing(fork):
    assert not kvobs_otel.instrument(Settings(enabled=False))
    assert not v2.correlated_observers_configured()
    assert not v1.kv_transfer_observers_configured()


def test_restarted_worker_generation_stays_joined(fork):
    chain = chains.restarted_worker_chain()
    spans = run(chain, fork)
    assert assert_traces_hold(chain_truth(chain), set(chains.RANKS), spans) == 2
    episodes = {e.epoch: e for e in rebuild(file_spans(spans))}
    gens = {ep: {s.attributes["kvobs.rank"]: s.attributes["kvobs.worker.generation"]
                 for s in e.named("kv.transfer") + e.named("kv.first_compute")}
            for ep, e in episodes.items()}
    assert gens[1][1] == chains.WORKER_GENERATIONS[1]
    assert gens[2][1] == chains.RESTARTED_WORKER_GENERATION
    assert fork.metric_total("kvobs.observer.anomalies") == 0


def test_dropped_stage_is_an_incomplete_episode(fork):
    spans = run(chains.dropped_stage("restore_completed", epoch=2, rank=1), fork)
    episodes = {e.epoch: e for e in rebuild(file_spans(spans))}
    assert episodes[1].complete
    assert not episodes[2].complete
    assert any("restore missing on ranks [1]" in p for p in episodes[2].problems)
    # The open restore is not lost: it ends, as an error, when observation stops.
    (open_t,) = [s for s in fork.spans("kv.transfer")
                 if s.attributes["kvobs.outcome"] != "ok"]
    assert open_t.attributes["kvobs.rank"] == 1
    assert open_t.status.status_code.name == "ERROR"


def test_dropped_requeue_still_roots_the_evidence(fork):
    spans = run(chains.dropped_stage("recovery_requeued", epoch=2, rank=None), fork)
    (ep2,) = [e for e in rebuild(file_spans(spans)) if e.epoch == 2]
    assert "kv.requeue_missing" in ep2.root.events
    assert fork.metric_total("kvobs.observer.anomalies", kind="requeue_missing") == 1


@pytest.mark.parametrize("event,epoch,rank", [
    ("transfer_receipt", 1, None), ("restore_completed", 2, 0), ("first_compute", 1, 1),
    ("recovery_admitted", 2, None), ("restore_submitted", 1, 1)])
def test_duplicated_stage_is_seen_once_and_counted(fork, event, epoch, rank):
    clean = restore_shape(run(chains.recovery_chain(), fork))
    fork.exporter.clear()
    for r in fork.readers:
        r.get_metrics_data()
    spans = run(chains.duplicated_stage(event, epoch=epoch, rank=rank), fork)
    assert restore_shape(spans) == clean
    assert fork.metric_total("kvobs.observer.anomalies", kind="duplicate_record") >= 1


def test_roster_at_and_over_the_cap(fork, caplog):
    assert kvobs_otel.instrument(SETTINGS)
    v2.replay(chains.at_cap_admission())
    with caplog.at_level(logging.ERROR, logger=v2.__name__):
        v2.replay(chains.over_cap_admission())  # the host refuses it before dispatch
    assert [r.getMessage() for r in caplog.records if r.name == v2.__name__] == [
        "Invalid correlated KV observation; leaving serving unchanged"]
    kvobs_otel.uninstrument()
    assert fork.metric_total("kvobs.host.refused") == 0  # never reached the adapter
    (root,) = fork.spans("kv.recovery")
    # The attribute is capped (KVOBS_OTEL_ROSTER_CAP); the rest is counted.
    assert len(root.attributes["kvobs.restore.job_ids"]) == SETTINGS.roster_cap
    assert root.attributes["kvobs.restore.job_ids.dropped"] == (
        v2.MAX_CORRELATED_ROSTER - SETTINGS.roster_cap)


def test_records_the_host_would_refuse_are_counted_never_raised(fork):
    """Records that reach the adapter anyway (a host without validation, a
    newer host): each is refused by our own validation and counted."""
    assert kvobs_otel.instrument(SETTINGS)
    (observer,) = list(v2._observers.values())  # what the fork would call
    bad = chains.malformed_v2_records()
    for record in bad.values():
        assert observer(record) is None
    observer(chains.over_cap_admission())
    observer("not a record")
    kvobs_otel.uninstrument()
    refused = fork.metric_total("kvobs.host.refused")
    assert refused == len(bad) + 2
    assert fork.metric_total("kvobs.host.refused", reason="record_roster_over_cap") >= 2
    assert not fork.spans()


def test_v1_only_host_joins_within_each_process(monkeypatch, fork):
    install(monkeypatch, v1_module=v1, v2_module=None)
    spans = run(chains.v1_recovery_chain(), fork)
    assert v1.effective_evidence_requests() == ()  # never asks for host evidence
    assert fork.metric_total("kvobs.host.refused") == 0
    episodes = rebuild(file_spans(spans))
    assert [(e.epoch, e.outcome, e.join_scope) for e in episodes] == [
        (1, "recovered", "process"), (2, "recovered", "process")]
    assert all(e.complete for e in episodes), [e.problems for e in episodes]
    for e in episodes:
        (job,) = e.named("kv.job")
        assert job.attributes["kvobs.receipt.ranks"] == [0, 1]
        assert not e.named("kv.transfer")  # not joinable: they stay in their process
    traces = by_trace(spans)
    transfers = [view(s) for s in fork.spans("kv.transfer")]
    assert len(transfers) == 4
    for t in transfers:
        assert t.parent_id is None and t.attrs["kvobs.join.scope"] == "process"
        assert len(traces[t.trace_id]) == 1
        assert t.attrs["kvobs.bytes"] > 0 and t.attrs["kvobs.direction"] == "h2d"
    # Descriptors hold raw offsets: nothing of them leaves the process.
    assert not any("descriptor" in k for s in spans for k in s.attributes)


def test_v1_shutdown_cancel_is_an_error_transfer(monkeypatch, fork):
    install(monkeypatch, v1_module=v1, v2_module=None)
    e = chains.v1_shutdown_cancel()
    submitted = chains.Emission(e.process, KVTransferObservation(
        KVTransferEvent.TRANSFER_SUBMITTED, e.record.observed_at_ns - 10,
        operation=TransferOperation.D2H_PRESERVE, job_id=e.record.job_id, rank=0,
        request_id=chains.REQUEST_ID, block_count=8))
    run((submitted, e), fork)
    (t,) = fork.spans("kv.transfer")
    assert t.attributes["kvobs.outcome"] == "cancelled" and t.attributes["kvobs.direction"] == "d2h"


@pytest.mark.parametrize("which", ["v2", "v1", "both"])
def test_unknown_contract_version_is_refused_fail_closed(monkeypatch, fork, caplog, which):
    odd_v2 = chains.unknown_version_module(v2)
    odd_v1 = chains.unknown_version_module(v1, "vllm.kv-transfer.observer.v1", "1.7")
    install(monkeypatch, v1_module=odd_v1 if which in ("v1", "both") else v1,
            v2_module=odd_v2 if which in ("v2", "both") else v2)
    with caplog.at_level(logging.ERROR, logger="kvobs_otel"):
        on = kvobs_otel.instrument(SETTINGS)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == (2 if which == "both" else 1)
    assert not instrumentor.is_patched()  # the fork is there: never patch it
    if which == "v2":  # falls back to v1, honestly
        assert on and v1.kv_transfer_observers_configured()
    elif which == "v1":
        assert on and v2.correlated_observers_configured()
    else:
        assert not on
        assert not v1.kv_transfer_observers_configured()
        assert not v2.correlated_observers_configured()
    kvobs_otel.uninstrument()
    reason = "contract_unknown" if which == "v2" else "contract_unknown_api_version"
    assert fork.metric_total("kvobs.host.refused", reason=reason) >= 1


def test_a_broken_fork_module_is_refused_not_raised(monkeypatch, fork):
    broken = ModuleType(contracts.V2.module)
    broken.KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT = contracts.V2.name
    broken.KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION = "2.0"  # but no register()
    install(monkeypatch, v1_module=None, v2_module=broken)
    assert not kvobs_otel.instrument(SETTINGS)
    kvobs_otel.uninstrument()
    assert fork.metric_total("kvobs.host.refused", reason="contract_missing_api") == 1


def test_a_raising_registry_never_reaches_vllm(monkeypatch, fork):
    angry = chains.unknown_version_module(v2, contracts.V2.name, "2.0")

    def register(_observer):
        raise RuntimeError("registry down")

    angry.register_correlated_observer = register
    install(monkeypatch, v1_module=None, v2_module=angry)
    assert not kvobs_otel.instrument(SETTINGS)  # logged, stays off


def test_the_three_hosts_give_equivalent_traces(fork, monkeypatch):
    """Stock vLLM and the vllm-ascend-shaped connector through the real-vLLM
    CPU harness, and vLLM-HUST's canonical v2 chain: per recovered episode,
    the restore chain (what every host can report) has the same spans, the
    same parentage, on the same ranks, with the same outcomes."""
    from test_vllm_ascend_shaped import ASCEND
    from test_vllm_ascend_shaped import run as run_harness

    # The stand-in fork is installed by the fixture; the harness hosts are
    # stock vLLM, so take the fork away for them.
    install(monkeypatch, v1_module=None, v2_module=None)
    assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                          drain_interval_s=0.02))
    stock = run_harness(fork)
    ascend = run_harness(fork, **ASCEND)
    kvobs_otel.uninstrument()
    fork.exporter.clear()
    install(monkeypatch)
    epoch1 = tuple(e for e in chains.recovery_chain() if e.record.recovery_epoch == 1)
    hust = run(epoch1, fork)

    shapes = {name: restore_shape(spans) for name, spans in
              (("vllm", stock), ("vllm-ascend", ascend), ("vllm-hust", hust))}
    assert shapes["vllm"] == shapes["vllm-ascend"] == shapes["vllm-hust"], shapes
    for spans in (stock, ascend, hust):
        episodes = rebuild(file_spans(spans))
        assert episodes and all(e.complete for e in episodes)


def test_forked_worker_registers_anew_and_joins_the_trace(monkeypatch, tmp_path):
    """The fork drops observers in a forked child; the plugin runs again in
    the child (as vLLM loads plugins in each worker) and registers anew. The
    child's rank exports with its own pid and joins the scheduler's trace."""
    import os

    from kvobs_otel.tools.otlp_file import read_spans
    out = export_to_file(monkeypatch, tmp_path)
    install(monkeypatch)
    epoch1 = [e for e in chains.recovery_chain() if e.record.recovery_epoch == 1]
    in_child = [e for e in epoch1 if e.process.rank == 1]
    try:
        assert kvobs_otel.instrument(SETTINGS)

        def child() -> None:
            assert not v2.correlated_observers_configured()  # dropped by the fork
            assert kvobs_otel.instrument(SETTINGS)  # the plugin, run in the worker
            emit(tuple(in_child))
            kvobs_otel.uninstrument()
            os._exit(0)

        child_pid = run_forked(child)
        emit(tuple(e for e in epoch1 if e.process.rank != 1))
    finally:
        kvobs_otel.uninstrument()
        v2.reset_correlated_observers()
    spans = read_spans(str(out))
    assert assert_traces_hold(chain_truth(epoch1), set(chains.RANKS), spans) == 1
    (episode,) = rebuild(spans)
    pids = {s.resource["process.pid"] for s in episode.spans
            if s.resource.get("kvobs.rank") == 1}
    assert pids == {child_pid} and child_pid != os.getpid()


def test_doctor_names_the_host_and_its_contract(monkeypatch, fork):
    from kvobs_otel.tools.doctor import FAIL, OK, WARN, check_host

    f = check_host()
    assert (f.status, "vllm.kv-transfer.observer.v2" in f.detail) == (OK, True)
    install(monkeypatch, v2_module=chains.unknown_version_module(v2))
    f = check_host()
    assert f.status == WARN and "observer.v1" in f.detail and "v2 refused" in f.detail
    install(monkeypatch, v1_module=None, v2_module=chains.unknown_version_module(v2))
    assert check_host().status == FAIL
    install(monkeypatch, v1_module=None, v2_module=None)
    assert "stock vLLM" in check_host().detail


def test_v2_receipt_missing_a_rank_is_an_error_and_counted(fork):
    chain = list(chains.recovery_chain())
    i = next(i for i, e in enumerate(chain) if e.record.event == "transfer_receipt"
             and e.record.recovery_epoch == 2)
    short = dataclasses.replace(chain[i].record, workers=chain[i].record.workers[:1])
    chain[i] = chains.Emission(chain[i].process, short)
    spans = run(tuple(chain), fork)
    eps = {e.epoch: e for e in rebuild(file_spans(spans))}
    assert eps[1].complete and not eps[2].complete
    (job,) = eps[2].named("kv.job")
    assert job.error and job.attributes["kvobs.receipt.missing_ranks"] == [1]
    assert eps[2].root.attributes["kvobs.incomplete.job_ids"] == [chains.JOB_IDS[2]]
    assert fork.metric_total("kvobs.receipts.incomplete", kind="load",
                             outcome="receipt_incomplete") == 1
    # The admission roster still named rank 1: the disagreement is counted.
    assert fork.metric_total("kvobs.observer.anomalies", kind="roster_mismatch") == 1


# ------------------------------------------- facts read in the fork's source


def _v1_run(monkeypatch, fork, chain) -> list:
    install(monkeypatch, v1_module=v1, v2_module=None)
    return run(chain, fork)


def test_v1_str_enum_members_are_read_by_value(monkeypatch, fork):
    """observability.py: event, operation, reason, requeue_reason and
    compute_kind are ``str`` Enum members; they come out as plain strings."""
    for e in chains.v1_recovery_chain() + (chains.v1_shutdown_cancel(),):
        got, reason = R.check_v1(e.record)
        assert reason is None, (e.record, reason)
        for name in ("event", "operation", "reason", "requeue_reason", "compute_kind"):
            value = getattr(e.record, name)
            if value is None:
                assert got[name] is None
            else:
                assert isinstance(value, Enum) and type(got[name]) is str
                assert got[name] == value.value
    spans = _v1_run(monkeypatch, fork, chains.v1_recovery_chain())
    assert fork.metric_total("kvobs.host.refused") == 0
    kinds = [s.attributes["kvobs.compute.kind"] for s in fork.spans("kv.first_compute")]
    assert sorted(kinds) == ["decode", "decode", "prefill", "prefill"]
    assert all(type(k) is str for k in kinds)
    assert {s.attributes["kvobs.direction"] for s in fork.spans("kv.transfer")} == {"h2d"}
    assert all(e.complete for e in rebuild(file_spans(spans)))


def test_v1_region_descriptors_are_counted_not_refused(monkeypatch, fork):
    """observability.py: descriptors are ``KVRegionDescriptor`` objects, at
    most MAX_DESCRIPTOR_REGIONS, the rest counted in dropped_descriptors."""
    (descs, *_) = [e for e in chains.v1_recovery_chain()
                   if e.record.event is KVTransferEvent.TRANSFER_DESCRIPTORS]
    got, reason = R.check_v1(descs.record)
    assert reason is None and got["descriptor_count"] == chains.BLOCKS[1]
    full = dataclasses.replace(descs.record, dropped_descriptors=5, descriptors=tuple(
        KVRegionDescriptor(0, 0, i, i, 1) for i in range(v1.MAX_DESCRIPTOR_REGIONS)))
    got, reason = R.check_v1(full)
    assert reason is None
    assert (got["descriptor_count"], got["dropped_descriptors"]) == (4096, 5)
    _v1_run(monkeypatch, fork, (descs, chains.Emission(descs.process, full)))
    assert fork.metric_total("kvobs.host.refused") == 0
    assert not fork.spans()  # nothing of the regions leaves the process


def test_v1_first_compute_without_a_compute_kind_is_accepted(monkeypatch, fork):
    """worker.py: with an unknown kind the worker warns and emits
    ``compute_kind=None``."""
    chain = tuple(
        chains.Emission(e.process, dataclasses.replace(e.record, compute_kind=None))
        if e.record.event is KVTransferEvent.FIRST_COMPUTE else e
        for e in chains.v1_recovery_chain())
    _v1_run(monkeypatch, fork, chain)
    assert fork.metric_total("kvobs.host.refused") == 0
    computes = fork.spans("kv.first_compute")
    assert len(computes) == 4
    assert not any("kvobs.compute.kind" in s.attributes for s in computes)
    assert {s.attributes["kvobs.rank"] for s in computes} == set(chains.RANKS)


def test_v1_receipt_without_an_open_recovery_is_an_ordinary_load(monkeypatch, fork):
    """scheduler.py update_connector_output: the v1 receipt comes for every
    exact load, plain prefix-cache loads included."""
    request = "chatcmpl-prefix-hit"
    sched, w0, w1 = chains.SCHEDULER, chains.WORKERS[0], chains.WORKERS[1]
    op, job, t = TransferOperation.H2D_RESTORE, 3, 5_000_000
    chain: list[chains.Emission] = []
    for p in (w0, w1):
        chain += [
            chains.Emission(p, KVTransferObservation(
                KVTransferEvent.TRANSFER_SUBMITTED, t, operation=op, job_id=job, rank=p.rank,
                request_id=request, block_count=4)),
            chains.Emission(p, KVTransferObservation(
                KVTransferEvent.TRANSFER_COMPLETED, t + 10, operation=op, job_id=job,
                rank=p.rank, request_id=request, success=True, bytes_moved=4 * 65536,
                duration_ns=9))]
    chain.append(chains.Emission(sched, KVTransferObservation(
        KVTransferEvent.TRANSFER_RECEIPT, t + 20, operation=op, job_id=job, rank=None,
        request_id=request, success=True, ranks=[0, 1])))
    _v1_run(monkeypatch, fork, tuple(chain))
    (kv_job,) = fork.spans("kv.job")
    assert kv_job.attributes["kvobs.job.id"] == job
    assert list(kv_job.attributes["kvobs.receipt.ranks"]) == [0, 1]
    assert kv_job.attributes["kvobs.outcome"] == "complete"
    assert kv_job.attributes["kvobs.request.id"] == request  # joined at once, not left over
    assert not fork.spans("kv.recovery")
    assert fork.metric_total("kvobs.observer.anomalies") == 0
    assert fork.metric_total("kvobs.host.refused") == 0
    assert fork.metric_total("kvobs.jobs", kind="load", outcome="complete") == 1


def test_a_v1_host_without_fork_reset_hands_the_child_a_dead_observer(monkeypatch, tmp_path):
    """observability.py @ 115e5f6 has no fork hook: a forked child keeps the
    parent's v1 observer. It must do nothing there; the plugin, run again in
    the child, registers anew and that registration carries the child's spans."""
    import os

    from kvobs_otel import pipeline as pipeline_module
    from kvobs_otel.tools.otlp_file import read_spans
    out = export_to_file(monkeypatch, tmp_path)
    install(monkeypatch, v1_module=v1, v2_module=None)
    epoch1 = [e for e in chains.v1_recovery_chain() if e.record.event not in (
        KVTransferEvent.RECOVERY_ADMITTED, KVTransferEvent.FIRST_COMPUTE)
        and e.record.recovery_epoch in (None, 1) and e.record.job_id in (None, 7)]
    in_child = [e for e in epoch1 if e.process.rank == 1]
    assert in_child
    previous = v1.set_fork_reset(False)
    try:
        assert kvobs_otel.instrument(SETTINGS)
        inherited = pipeline_module.current_pipeline()
        assert inherited is not None

        def child() -> None:
            assert v1.kv_transfer_observers_configured()  # kept: no fork reset
            accepted = inherited.buffer.accepted
            assert kvobs_otel.instrument(SETTINGS)  # the plugin, run in the worker
            assert len(v1._observers) == 2  # the parent's and the child's
            emit(tuple(in_child))
            assert inherited.buffer.accepted == accepted  # the inherited one did nothing
            kvobs_otel.uninstrument()
            os._exit(0)

        child_pid = run_forked(child)
    finally:
        v1.set_fork_reset(previous)
        kvobs_otel.uninstrument()
        v1.reset_kv_transfer_observers()
    spans = read_spans(str(out))
    transfers = [s for s in spans if s.name == "kv.transfer"]
    assert len(transfers) == 1  # rank 1's restore, once
    assert transfers[0].attributes["kvobs.rank"] == 1
    assert transfers[0].resource["process.pid"] == child_pid != os.getpid()


def test_the_v2_module_is_admitted_by_its_real_constant_names(monkeypatch, fork, caplog):
    """correlated_observability.py names its constants
    KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT / ..._API_VERSION; a v2 module
    naming them as v1 does is not the contract we know."""
    assert contracts.check_module(contracts.V2, v2) is None
    assert contracts.check_module(contracts.V1, v1) is None
    old_named = ModuleType(contracts.V2.module)
    for name in dir(v2):
        if not name.startswith("__") and not name.startswith("KV_TRANSFER_CORRELATED_"):
            setattr(old_named, name, getattr(v2, name))
    old_named.KV_TRANSFER_OBSERVER_CONTRACT = "vllm.kv-transfer.observer.v2"
    old_named.KV_TRANSFER_OBSERVABILITY_API_VERSION = "2.0"
    install(monkeypatch, v1_module=v1, v2_module=old_named)
    with caplog.at_level(logging.ERROR, logger="kvobs_otel"):
        assert kvobs_otel.instrument(SETTINGS)  # falls back to v1
    assert not v2.correlated_observers_configured()
    assert v1.kv_transfer_observers_configured()
    assert any("v2 refused (contract_unknown)" in r.getMessage() for r in caplog.records)
    kvobs_otel.uninstrument()
    assert fork.metric_total("kvobs.host.refused", reason="contract_unknown") == 1


def test_the_adapter_refuses_v2_records_the_host_constructor_refuses():
    """correlated_observability.py checks types exactly; so does the adapter
    for a record object (the JSON form cannot carry these types)."""
    bad = chains.malformed_v2_records()
    for name in ("event_plain_str", "event_v1_enum", "receipt_workers_list",
                 "receipt_workers_none", "receipt_workers_plain_tuples"):
        assert R.check_v2(bad[name])[0] is None, name
    requeued = chains.recovery_chain()[0].record
    for changes in ({"job_id": ()}, {"compute_kind": ()}, {"workers": None},
                    {"request_id": TransferOperation.H2D_RESTORE}):
        odd = v2.unchecked(**{**v2.fields_of(requeued), **changes})
        with pytest.raises(ValueError):
            v2.validate_correlated_observation(odd)
        assert R.check_v2(odd)[0] is None, changes
    first = next(e.record for e in chains.recovery_chain()
                 if e.record.event == "first_compute")
    # compute_kind is a plain str in v2, checked by value only: the host's
    # constructor takes a ComputeKind member, and so does the adapter
    as_member = dataclasses.replace(first, compute_kind=ComputeKind.PREFILL)
    assert R.check_v2(as_member)[0]["compute_kind"] == "prefill"
    assert type(R.check_v2(as_member)[0]["compute_kind"]) is str
    got, reason = R.check_v2(first)
    assert reason is None and got["event"] == "first_compute" and type(got["event"]) is str
    assert got["roster"] == ((chains.JOB_IDS[1], tuple(sorted(
        chains.WORKER_GENERATIONS.items()))),)
