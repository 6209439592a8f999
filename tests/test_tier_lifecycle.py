"""The secondary-tier and wait rules of the scheduler lifecycle on hand-made
event sequences (end to end on vLLM's real tiering manager: test_vllm_tiers.py)."""

from __future__ import annotations

from test_lifecycle import ListSink, S, output, receipts, step

from kvobs_otel.lifecycle import events as ev
from kvobs_otel.lifecycle import records as rec
from kvobs_otel.lifecycle.scheduler_state import SchedulerLifecycle

FS = ("fs", "storage", "")


def tiered(deadline: float = 1.0) -> tuple[SchedulerLifecycle, ListSink]:
    sink = ListSink()
    return SchedulerLifecycle("g" * 32, 2, deadline, sink, tiers=[FS], tokens_per_chunk=16), sink


def send(lc, kind, t, *fields):
    lc.handle((lc, kind, t, *fields))


def preempted_and_promoting(lc, req="r"):
    step(lc, 0, stores=[(1, req, 4)])
    receipts(lc, 5, [(0, "a", (1,)), (1, "b", (1,))])
    step(lc, 10, preempted=[(req, 1, 64)])
    send(lc, ev.S_WAIT, 20, req)
    send(lc, ev.S_TIER_JOB, 21, 0, 1, True, req, 4)  # tier job id 1, as the connector's


def test_a_promotion_and_the_wait_belong_to_the_open_episode_and_admission_starts_at_the_answer():
    lc, sink = tiered()
    preempted_and_promoting(lc)
    send(lc, ev.S_TIER_DONE, 40, 1, True, None, 4096, 0.01, False)
    send(lc, ev.S_WAIT_END, 45, "r", 3, True)
    # 96 tokens loaded from CPU: 4 promoted chunks of 16, the rest in CPU all along.
    step(lc, 50, admitted=[("r", 1, "prefill", 96, 96)])
    output(lc, 60, [("r", 1)])
    (tier,) = sink.of(rec.TierJobRecord)
    assert (tier.kind, tier.outcome, tier.episode_epoch, tier.tier_type) == (
        "promotion", "ok", 1, "fs")
    assert (tier.start_ns, tier.end_ns, tier.chunks_ok, tier.size_bytes) == (21, 40, 4, 4096)
    (wait,) = sink.of(rec.WaitRecord)
    assert (wait.passes, wait.reasons, wait.tiers, wait.episode_epoch, wait.outcome) == (
        3, ["promotion"], [0], 1, "answered")
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.RECOVERED and ep.tier_jobs == [1] and ep.promoted_chunks == {0: 4}
    assert ep.ready_ns == 45  # the wait's answer, not the preemption (10)
    assert ep.tokens_restored == 96 and ep.tokens_restored_by_tier == {0: 64}


def test_a_failed_promotion_makes_the_episode_recomputed_with_its_reason():
    lc, sink = tiered()
    preempted_and_promoting(lc)
    send(lc, ev.S_TIER_DONE, 40, 1, False, 1, None, None, True)
    send(lc, ev.S_WAIT_END, 45, "r", 3, True)
    step(lc, 50, admitted=[("r", 1, "prefill", 16, 0)])
    output(lc, 60, [("r", 1)])
    (tier,) = sink.of(rec.TierJobRecord)
    assert (tier.outcome, tier.chunks_ok, tier.release_deferred) == ("partial", 1, True)
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.RECOMPUTED and ep.recompute_reason == "promotion_failed"
    assert ep.promoted_chunks == {0: 1}


def test_no_free_cpu_chunk_is_an_episode_event_and_the_recompute_reason():
    lc, sink = tiered()
    step(lc, 10, preempted=[("r", 1, 64)])
    send(lc, ev.S_TIER_NO_ROOM, 15, 0, "r")
    step(lc, 50, admitted=[("r", 1, "prefill", 0, 0)])
    output(lc, 60, [("r", 1)])
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.recompute_reason == "promotion_allocation_failed"
    assert [e.name for e in ep.events if e.name == "kv.tier.no_room"] == ["kv.tier.no_room"]
    assert lc.tier.no_room_count == {0: 1}


def test_a_hung_promotion_ends_as_an_error_at_the_deadline_and_its_late_result_is_counted():
    lc, sink = tiered(deadline=1.0)
    preempted_and_promoting(lc)
    lc.tick(S // 2)
    assert not sink.of(rec.TierJobRecord)
    lc.tick(S + 100)
    (tier,) = sink.of(rec.TierJobRecord)
    assert tier.outcome == rec.TIER_HUNG
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.TIER_STALLED and ep.end_ns == S + 100
    (wait,) = sink.of(rec.WaitRecord)
    assert wait.outcome == rec.TIER_HUNG
    send(lc, ev.S_TIER_DONE, 2 * S, 1, True, None, 4096, 0.01, False)
    assert len(sink.of(rec.TierJobRecord)) == 1
    assert lc.anomalies()["late_tier_result"] == 1
    assert lc.tier.open_state()[("fs", "promotion")] == (0, 0.0)


def test_a_hung_promotion_that_reaches_us_late_is_judged_by_when_it_happened():
    """Stepped (the vLLM host): the promotion, the engine's next 5 s of steps
    (nothing to record but the seam's periodic step marks: the request waits)
    and the promotion's late result arrive in one backlog, with no
    processing-clock tick. It hung in event time: reported at its deadline,
    and the result counts as late."""
    sink = ListSink()
    lc = SchedulerLifecycle("g" * 32, 2, 1.0, sink, tiers=[FS], tokens_per_chunk=16,
                            stepped=True)
    preempted_and_promoting(lc)
    for n in range(1, 50):
        send(lc, ev.S_MARK, n * S // 10, n * ev.MARK_EVERY_STEPS)
    send(lc, ev.S_TIER_DONE, 5 * S, 1, True, None, 4096, 0.01, False)
    (tier,) = sink.of(rec.TierJobRecord)
    assert tier.outcome == rec.TIER_HUNG and S < tier.end_ns < 2 * S
    (ep,) = sink.of(rec.EpisodeRecord)
    assert ep.outcome == rec.TIER_STALLED
    assert lc.anomalies()["late_tier_result"] == 1


def test_a_wait_for_the_requests_own_transfer_says_so_and_the_request_trace_holds_it():
    lc, sink = tiered()
    step(lc, 0, stores=[(1, "r", 4)])
    send(lc, ev.S_WAIT, 5, "r")
    receipts(lc, 8, [(0, "a", (1,)), (1, "b", (1,))])
    send(lc, ev.S_WAIT_END, 9, "r", 2, True)
    send(lc, ev.S_TIER_JOB, 10, 0, 1, False, "r", 4)
    lc.handle((lc, ev.S_FINISHED, 11, "r", ev.FINISHED_OK))
    assert not sink.of(rec.RequestRecord)  # its cascade is still out
    send(lc, ev.S_TIER_DONE, 20, 1, True, None, 4096, 0.01, False)
    (wait,) = sink.of(rec.WaitRecord)
    assert wait.reasons == ["transfer_in_flight"] and wait.episode_epoch == 0
    (req,) = sink.of(rec.RequestRecord)
    assert (req.jobs, req.tier_jobs, req.waits, req.end_ns) == (1, 1, 1, 20)
    (tier,) = sink.of(rec.TierJobRecord)
    assert tier.kind == "cascade" and tier.episode_epoch == 0


def test_shutdown_abandons_open_tier_jobs_and_waits_with_the_cause():
    lc, sink = tiered()
    preempted_and_promoting(lc)
    lc.shutdown(30, rec.END_PROCESS_EXIT)
    (tier,) = sink.of(rec.TierJobRecord)
    (wait,) = sink.of(rec.WaitRecord)
    assert (tier.outcome, tier.end_cause) == (rec.ABANDONED, rec.END_PROCESS_EXIT)
    assert (wait.outcome, wait.end_cause) == (rec.ABANDONED, rec.END_PROCESS_EXIT)


def test_without_tiers_there_are_no_tier_anomalies():
    sink = ListSink()
    lc = SchedulerLifecycle("g" * 32, 2, 1.0, sink)
    assert "late_tier_result" not in lc.anomalies()
