"""Event kinds recorded on the serving path.

An event is a plain tuple ``(consumer, kind, t_ns, *fields)``: ``consumer``
is the lifecycle object that will interpret it on the drain thread, ``t_ns``
is ``time.monotonic_ns()`` at the seam. Tuples, not objects, because the
serving thread must only pay for one small allocation per event.
"""

from __future__ import annotations

# Scheduler role ------------------------------------------------------------
# (req_id, traceparent | None)
S_REQUEST = 1
# Step and receipt events begin with ``steps``: the host's count of
# schedule() calls when it recorded them (deadlines run in event time,
# scheduler_state.py).
# (steps, preempted: ((req_id, epoch, discarded_tokens | None), ...),
#  loads: ((job_id, req_id, sync, blocks), ...),
#  stores: ((job_id, req_id, blocks, host_chunks), ...), flushed: (job_id, ...),
#  admitted: ((req_id, epoch, compute_kind, held_tokens | None, restored_tokens,
#              other_tokens | None), ...))
# discarded: computed tokens the preemption dropped; held: tokens the request
# holds on the device when it is scheduled again (prefix-cache hit + restored
# + other); other: what the other connectors of vLLM's MultiConnector brought
# (None: the OffloadingConnector is not composed; OTHER_UNKNOWN: composed, not
# measurable).
S_STEP = 2
OTHER_UNKNOWN = -1
# (steps, reporters: ((rank, worker_gen, job_ids, failed_job_ids), ...));
# job_ids and failed_job_ids are collections of ints (vLLM's own dict and
# set, read by iteration and membership only)
S_RECEIPTS = 3
# The output of a step that re-admitted requests came back from every rank:
# their first compute ran on all of them. (steps, {req_id: (epoch,
# compute_kind)}: the step's admitted, as S_STEP's rows were built from)
S_COMPUTED = 20
# (req_id, status: FINISHED_*)
S_FINISHED = 4
# ()
S_RESET = 5
# ()
S_SHUTDOWN = 6
# The connector told the scheduler "not yet" for a request that was not
# waiting: (req_id,)
S_WAIT = 7
# It answered again (or the request finished while waiting): (req_id, passes,
# answered: bool)
S_WAIT_END = 8
# Secondary tiers (TieringOffloadingSpec), in the scheduler process only.
# A tier job registered, just before its submit: (tier_idx, tier_job_id,
# is_promotion, req_id, chunks). Tier job ids are the tiering manager's own.
S_TIER_JOB = 9
# (tier_job_id, success, ok_chunks | None, bytes | None, io_time_s | None,
#  release_deferred: bool)
S_TIER_DONE = 10
# A secondary hit whose promotion found no free CPU chunk: (tier_idx, req_id)
S_TIER_NO_ROOM = 16
# A cascade the tier's back-pressure detector declined: (tier_idx,
# req_id | None, chunks)
S_TIER_SKIP = 17
# A tier's back-pressure turned on or off: (tier_idx, on: bool)
S_TIER_PRESSURE = 18
# Every MARK_EVERY_STEPS engine steps: (steps,). Keeps event time moving while
# the engine steps with nothing to record (a request waiting on a hung tier),
# so that a deadline is judged when it ran out, however late the events
# reach the export side.
S_MARK = 19
MARK_EVERY_STEPS = 16  # a power of two (a mask test per step)

# Worker role ----------------------------------------------------------------
# (step,): the scheduler's step extension as every rank received it
# (hosts/vllm/metadata.py): (sched_gen, episodes: {req_id: epoch}, admitted:
# {req_id: (epoch, compute_kind)}, loads and stores: the rows of S_STEP, as the
# scheduler built them, flushed: (job_id, ...))
W_STEP = 11
# (job_id, is_load, accepted)
W_SUBMIT = 12
# (job_id, success, size_bytes | None, device_time_s | None)
W_RESULT = 13
# The forward of a step that re-admitted requests ran on this rank:
# (start_ns: when the rank bound that step, sched_gen, admitted: {req_id:
# (epoch, compute_kind)} as in W_STEP)
W_FIRST_COMPUTE = 14
# ()
W_SHUTDOWN = 15

# How a request ended (S_FINISHED)
FINISHED_OK = "finished"
FINISHED_ABORTED = "aborted"
FINISHED_ERROR = "error"

COMPUTE_PREFILL = "prefill"
COMPUTE_DECODE = "decode"
