"""The lifecycle state machines on hand-made event sequences.

These pin the receipt, deadline and episode rules independently of vLLM; the
end-to-end behaviour on real vLLM is in test_vllm_*.py.
"""

from __future__ import annotations

import time

from kvobs_otel.lifecycle import events as ev
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.lifecycle.scheduler_state import SchedulerLifecycle
from kvobs_otel.lifecycle.worker_state import WorkerLifecycle

S = 1_000_000_000


class ListSink:
    def __init__(self) -> None:
        self.records: list[object] = []

    def emit(self, record: object) -> None:
        self.records.append(record)

    def of(self, cls: type) -> list:
        return [r for r in self.records if isinstance(r, cls)]


def sched(world: int = 2, deadline: float = 1.0) -> tuple[SchedulerLifecycle, ListSink]:
    sink = ListSink()
    return SchedulerLifecycle("g" * 32, world, deadline, sink), sink


def _pad(rows, defaults):
    # Short rows in these tests: the trailing fields a test does not care about.
    return tuple(tuple(r) + tuple(defaults[len(r):]) for r in rows)


def step(lc, t, preempted=(), loads=(), stores=(), flushed=(), admitted=(), steps=0):
    """Rows as in events.S_STEP; trailing fields may be left out:
    preempted (req, epoch[, discarded]), stores (job, req, blocks[, chunks]),
    admitted (req, epoch, kind[, held, restored, other]). ``steps``: the
    host's step count stamped on the event (read only when stepped)."""
    stores = tuple(tuple(r) + (r[2],) if len(r) == 3 else tuple(r) for r in stores)
    lc.handle((lc, ev.S_STEP, t, steps, _pad(preempted, (None, None, None)), tuple(loads),
               stores, tuple(flushed), _pad(admitted, (None, None, None, None, 0, None))))


def receipts(lc, t, reporters=(), steps=0):
    """reporters: (rank, worker_gen, job_ids[, failed_job_ids])."""
    lc.handle((lc, ev.S_RECEIPTS, t, steps, _pad(reporters, (None, None, None, ()))))


def output(lc, t, admitted, steps=0):
    """The output of the step that admitted ``admitted`` ((req_id, epoch[,
    compute_kind]), ...) came back from every rank."""
    lc.handle((lc, ev.S_COMPUTED, t, steps,
               {r: (e, k[0] if k else "decode") for r, e, *k in admitted}))


def test_receipt_completes_only_when_every_rank_reported_once():
    lc, sink = sched(world=2)
    step(lc, 0, stores=[(7, "r1", 4)])
    receipts(lc, 10, [(0, "w0", (7,))])
    receipts(lc, 11, [(0, "w0", (7,))])  # duplicate from rank 0
    assert not sink.of(rec.JobRecord)
    receipts(lc, 20, [(1, "w1", (7,))])
    (job,) = sink.of(rec.JobRecord)
    assert job.outcome == rec.COMPLETE
    assert job.receipt_ranks == [0, 1] and job.missing_ranks == []
    assert job.duplicate_receipts == 1 and job.end_ns == 20


def test_deadline_runs_out_only_while_the_engine_steps():
    """With the host's step count: past the deadline, a job still waits for
    STEPS_PAST_DEADLINE more engine steps, since ranks only report inside
    steps. Idle time (no step for 8 s) and the processing clock count for
    nothing."""
    from kvobs_otel.lifecycle.scheduler_state import STEPS_PAST_DEADLINE

    sink = ListSink()
    lc = SchedulerLifecycle("g" * 32, 2, 1.0, sink, stepped=True)
    step(lc, 0, stores=[(1, "idle", 2)], loads=[(2, "stuck", False, 2)], steps=1)
    receipts(lc, 1, [(0, "w0", (2,))], steps=1)  # rank 1 never reports job 2
    for t in range(2, 10):  # idle: no step for 8 s; the processing clock runs
        lc.tick(t * S)
        lc.advance(t * S, 1)
    assert not sink.of(rec.JobRecord)
    # The engine steps again; its first step reports the store from both ranks.
    for n in range(1, STEPS_PAST_DEADLINE + 2):
        if n == 1:
            receipts(lc, 10 * S, [(0, "w0", (1,)), (1, "w1", (1,))], steps=2)
        lc.advance(10 * S + n * 20_000_000, 1 + n)
        done = {j.job_id: j.outcome for j in sink.of(rec.JobRecord)}
        assert done.get(1) == rec.COMPLETE
        # The withheld load ends once the engine took STEPS_PAST_DEADLINE
        # steps since the deadline ran out (at step 1).
        assert (2 in done) == (n >= STEPS_PAST_DEADLINE), (n, done)
    assert done[2] == rec.RECEIPT_INCOMPLETE


def test_a_receipt_that_reaches_us_late_is_judged_by_when_it_happened():
    """Events can reach the lifecycle in one late backlog (a starved drain
    thread, a sidecar behind): the job's creation, 8 s of engine steps, and
    the withheld rank's receipt, with no processing-clock tick between. The
    job was overdue at its deadline in event time: it ends incomplete then,
    naming the rank, and the receipt counts as late."""
    sink = ListSink()
    lc = SchedulerLifecycle("g" * 32, 2, 1.0, sink, stepped=True)
    step(lc, 0, loads=[(2, "stuck", False, 2)], steps=1)
    receipts(lc, S // 10, [(0, "w0", (2,))], steps=2)
    for n in range(3, 80):  # the engine keeps stepping (other requests' stores)
        step(lc, n * S // 10, stores=[(100 + n, "other", 1)], steps=n)
        receipts(lc, n * S // 10 + 1, [(0, "w0", (100 + n,)), (1, "w1", (100 + n,))], steps=n)
    receipts(lc, 8 * S, [(1, "w1", (2,))], steps=80)
    (job,) = [j for j in sink.of(rec.JobRecord) if j.job_id == 2]
    assert job.outcome == rec.RECEIPT_INCOMPLETE and job.missing_ranks == [1]
    assert S < job.end_ns < 2 * S, job.end_ns  # at its deadline, in event time
    assert lc.anomalies()["late_receipt"] == 1
    others = [j for j in sink.of(rec.JobRecord) if j.job_id != 2]
    assert others and all(j.outcome == rec.COMPLETE for j in others)


def test_a_backlog_of_steps_without_the_engine_stepping_is_no_deadline():
    """The same backlog shape, but the step count does not move (one long
    first forward pass): time alone is no missing receipt."""
    sink = ListSink()
    lc = SchedulerLifecycle("g" * 32, 2, 1.0, sink, stepped=True)
    step(lc, 0, loads=[(2, "slow", False, 2)], steps=1)
    receipts(lc, S // 10, [(0, "w0", (2,))], steps=1)
    lc.advance(5 * S, 2)
    receipts(lc, 8 * S, [(1, "w1", (2,))], steps=3)
    (job,) = sink.of(rec.JobRecord)
    assert job.outcome == rec.COMPLETE and lc.anomalies()["late_receipt"] == 0


def test_deadline_names_missing_rank_and_late_receipt_is_counted():
    lc, sink = sched(world=2, deadline=1.0)
    step(lc, 0, loads=[(3, "r1", False, 2)])
    receipts(lc, 5, [(0, "w0", (3,))])
    lc.tick(S // 2)
    assert not sink.of(rec.JobRecord)
    lc.tick(S + 1)
    (job,) = sink.of(rec.JobRecord)
    assert job.outcome == rec.RECEIPT_INCOMPLETE and job.missing_ranks == [1]
    receipts(lc, 2 * S, [(1, "w1", (3,))])
    assert lc.open_receipts == 0
    assert lc.anomalies() == {"late_receipt": 1, "unknown_job_receipt": 0,
                              "duplicate_receipt": 0}


def test_episode_chain_preserve_restore_admission_first_compute():
    lc, sink = sched(world=2)
    step(lc, 0, stores=[(1, "r", 4)])
    step(lc, 10, preempted=[("r", 1)], flushed=[1])
    receipts(lc, 20, [(0, "a", (1,)), (1, "b", (1,))])
    step(lc, 30, loads=[(2, "r", False, 4)])
    receipts(lc, 40, [(0, "a", (2,)), (1, "b", (2,))])
    step(lc, 50, admitted=[("r", 1, "decode")])
    assert not sink.of(rec.EpisodeRecord)
    output(lc, 60, [("r", 2)])  # another epoch's: not this episode
    assert not sink.of(rec.EpisodeRecord)
    output(lc, 70, [("r", 1)])
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.RECOVERED and ep.epoch == 1
    assert ep.preserve_jobs == [1] and ep.restore_jobs == [2]
    assert (ep.start_ns, ep.ready_ns, ep.admitted_ns, ep.end_ns) == (10, 40, 50, 70)
    assert ep.first_compute_ranks == [0, 1]
    assert [e.name for e in ep.events] == ["kv.requeued", "kv.preserve"]
    roles = {j.job_id: j.episode_role for j in sink.of(rec.JobRecord)}
    assert roles == {1: rec.PRESERVE, 2: rec.RESTORE}


def test_second_preemption_closes_first_episode_and_opens_epoch_two():
    lc, sink = sched(world=1)
    step(lc, 0, preempted=[("r", 1)])
    step(lc, 5, admitted=[("r", 1, "prefill")])
    step(lc, 10, preempted=[("r", 2)])
    (first,) = sink.of(rec.EpisodeRecord)
    assert first.epoch == 1 and first.outcome == rec.PREEMPTED_AGAIN
    assert lc.episodes["r"].epoch == 2


def test_incomplete_restore_ends_episode_with_error_and_abort_before_resume():
    lc, sink = sched(world=2, deadline=1.0)
    step(lc, 0, preempted=[("a", 1), ("b", 1)])
    step(lc, 1, loads=[(9, "a", False, 1)])
    receipts(lc, 2, [(0, "w", (9,))])
    lc.tick(2 * S)
    lc.handle((lc, ev.S_FINISHED, 3 * S, "b", ev.FINISHED_ABORTED))
    eps = {e.req_id: e for e in sink.of(rec.EpisodeRecord)}
    assert eps["a"].outcome == rec.RECEIPT_INCOMPLETE and eps["a"].incomplete_jobs == [9]
    assert eps["b"].outcome == rec.ABORTED_BEFORE_RESUME


def test_failed_restore_under_policy_fail_ends_the_episode_as_restore_failed():
    # vLLM 0.34, kv_load_failure_policy="fail": the step that reports the failed
    # load finishes the request with an error, then hands the receipts over.
    lc, sink = sched(world=2)
    step(lc, 0, preempted=[("r", 1, 40)])
    step(lc, 10, loads=[(5, "r", False, 3)])
    lc.handle((lc, ev.S_FINISHED, 20, "r", ev.FINISHED_ERROR))
    assert not sink.of(rec.EpisodeRecord)  # waits for the restore's receipts
    receipts(lc, 20, [(0, "a", (5,), ()), (1, "b", (5,), (5,))])
    (job,) = sink.of(rec.JobRecord)
    assert job.outcome == rec.JOB_FAILED and job.failed_ranks == [1]
    assert job.missing_ranks == [] and job.receipt_ranks == [0, 1]
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.RESTORE_FAILED
    assert ep.failed_restore_jobs == [5] and ep.failed_ranks == [1]
    assert ep.admitted_ns is None and ep.tokens_discarded == 40
    (req,) = sink.of(rec.RequestRecord)
    assert req.outcome == ev.FINISHED_ERROR


def test_failed_restore_under_policy_recompute_follows_the_request_to_its_prefill():
    lc, sink = sched(world=2)
    step(lc, 0, preempted=[("r", 1, 48)])
    step(lc, 10, loads=[(5, "r", False, 3)])
    receipts(lc, 20, [(0, "a", (5,), (5,)), (1, "b", (5,), ())])
    assert not sink.of(rec.EpisodeRecord)
    # Recomputed from scratch: 16 tokens found in the device prefix cache, the
    # planned restore (48) brought nothing back.
    step(lc, 30, admitted=[("r", 1, "prefill", 16, 48)])
    output(lc, 40, [("r", 1)])
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.RECOMPUTED and ep.compute_kind == "prefill"
    assert ep.failed_restore_jobs == [5] and ep.failed_ranks == [0]
    assert (ep.tokens_discarded, ep.tokens_restored, ep.tokens_resident,
            ep.tokens_recomputed) == (48, 0, 16, 32)
    assert ep.first_compute_ranks == [0, 1]


def test_failed_store_is_a_complete_receipt_of_a_failed_job():
    lc, sink = sched(world=2)
    step(lc, 0, stores=[(7, "r", 4, 2)])
    receipts(lc, 5, [(0, "a", (7,), (7,))])
    receipts(lc, 9, [(1, "b", (7,), ())])
    (job,) = sink.of(rec.JobRecord)
    assert job.outcome == rec.JOB_FAILED and job.failed_ranks == [0]
    assert job.host_chunks == 2 and lc.open_receipts == 0
    # Which rank reported last, and how long after the first.
    assert job.last_ranks == [1] and job.receipt_spread_ns == 4


def test_recovery_accounting_restored_resident_recomputed():
    lc, sink = sched(world=1)
    step(lc, 0, preempted=[("r", 1, 100)])
    step(lc, 10, loads=[(5, "r", False, 4)])
    receipts(lc, 20, [(0, "a", (5,))])
    # 64 restored + 32 still in the device prefix cache; 4 computed again.
    step(lc, 30, admitted=[("r", 1, "prefill", 96, 64)])
    output(lc, 40, [("r", 1)])
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.RECOVERED
    assert (ep.tokens_discarded, ep.tokens_restored, ep.tokens_resident,
            ep.tokens_recomputed) == (100, 64, 32, 4)
    (job,) = sink.of(rec.JobRecord)
    assert job.last_ranks == [0] and job.receipt_spread_ns == 0


def test_accounting_inside_a_multiconnector_tells_other_connectors_tokens_apart():
    # Composed with another connector that brought 48 tokens back (this one
    # nothing): 16 in the device prefix cache, 48 the other's, 36 computed again.
    lc, sink = sched(world=1)
    step(lc, 0, preempted=[("r", 1, 100)])
    step(lc, 30, admitted=[("r", 1, "prefill", 64, 0, 48)])
    output(lc, 40, [("r", 1)])
    (ep,) = sink.of(rec.EpisodeRecord)
    assert (ep.tokens_discarded, ep.tokens_restored, ep.tokens_resident,
            ep.tokens_other_connector, ep.tokens_recomputed) == (100, 0, 16, 48, 36)
    assert ("other_connector", 48) in ep.tokens()


def test_accounting_inside_a_multiconnector_it_cannot_measure_leaves_resident_unset():
    lc, sink = sched(world=1)
    step(lc, 0, preempted=[("r", 1, 100)])
    step(lc, 30, admitted=[("r", 1, "prefill", 64, 0, ev.OTHER_UNKNOWN)])
    output(lc, 40, [("r", 1)])
    (ep,) = sink.of(rec.EpisodeRecord)
    # What the request held and what it computed again stay exact.
    assert (ep.tokens_resident, ep.tokens_other_connector, ep.tokens_recomputed) == (
        None, None, 36)


def test_error_finish_without_a_restore_out_is_finished_before_resume():
    lc, sink = sched(world=1)
    step(lc, 0, preempted=[("r", 1)])
    lc.handle((lc, ev.S_FINISHED, 5, "r", ev.FINISHED_ERROR))
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.FINISHED_BEFORE_RESUME


def test_shutdown_abandons_open_jobs_and_episodes():
    lc, sink = sched(world=2)
    step(lc, 0, stores=[(1, "r", 1)], preempted=[("q", 1)])
    lc.handle((lc, ev.S_SHUTDOWN, 50))
    assert [j.outcome for j in sink.of(rec.JobRecord)] == [rec.ABANDONED]
    assert [e.outcome for e in sink.of(rec.EpisodeRecord)] == [rec.ABANDONED]
    (req,) = sink.of(rec.RequestRecord)
    assert req.req_id == "r" and req.outcome == rec.ABANDONED
    # Each says why: vLLM shut the connector down.
    assert {r.end_cause for r in sink.records} == {rec.END_CONNECTOR_SHUTDOWN}


def test_a_process_end_abandons_with_its_cause_and_nothing_twice():
    """What a stop cuts short ends once, saying how the process stopped (the
    export side calls shutdown(t, cause) at its close); a later shutdown
    finds nothing open."""
    lc, sink = sched(world=2)
    step(lc, 0, stores=[(1, "r", 1)], preempted=[("q", 1)])
    lc.shutdown(50, rec.END_PROCESS_KILLED)
    lc.handle((lc, ev.S_SHUTDOWN, 60))
    assert len(sink.records) == 3
    assert {r.end_cause for r in sink.records} == {rec.END_PROCESS_KILLED}
    w_sink = ListSink()
    w = WorkerLifecycle(rank=1, worker_gen="w1", sink=w_sink)
    w.handle((w, ev.W_STEP, 0, ("g", {"r": 2}, {}, ((5, "r", False, 3),), (), ())))
    w.handle((w, ev.W_SUBMIT, 10, 5, True, True, False))
    w.shutdown(20, rec.END_PROCESS_EXIT)
    (t,) = w_sink.of(rec.TransferRecord)
    assert (t.outcome, t.end_cause) == (rec.TRANSFER_CANCELLED, rec.END_PROCESS_EXIT)


def test_an_in_process_close_ends_open_work_as_abandoned_not_error(telemetry):
    """KVOBS_OTEL_EXPORT=in-process: closing the pipeline (atexit,
    uninstrument) without a connector shutdown still exports what was open,
    as abandoned with cause process_exit, and none of it is ERROR."""
    from kvobs_otel.config import Settings
    from kvobs_otel.pipeline import Pipeline

    p = Pipeline(Settings(enabled=True), in_process=True)
    key = p.register((SchedulerLifecycle, {"sched_gen": "g" * 32, "world_size": 2,
                                           "deadline_s": 60.0}), {"kvobs.role": "scheduler"})
    p.offer((key, ev.S_STEP, time.monotonic_ns(), 1, (("q", 1, 32),), ((7, "q", False, 2),), (),
             (), ()))
    p.close()
    spans = {s.name: s for s in telemetry.exporter.get_finished_spans()}
    assert spans["kv.recovery"].attributes["kvobs.outcome"] == "abandoned"
    for name in ("kv.recovery", "kv.job"):
        assert spans[name].attributes["kvobs.end.cause"] == "process_exit", name
        assert spans[name].status.status_code.name == "UNSET", name
