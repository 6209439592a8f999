"""Finished lifecycle records: what the state machines hand to the span and
metric builders. Times are ``time.monotonic_ns()`` of the recording process."""

from __future__ import annotations

from dataclasses import dataclass, field

# Outcomes ------------------------------------------------------------------
COMPLETE = "complete"
RECEIPT_INCOMPLETE = "receipt_incomplete"
ABANDONED = "abandoned"
# Why something was abandoned (``end_cause``): its process stopped before it
# could finish. None of them is a failure of the KV chain itself.
END_CONNECTOR_SHUTDOWN = "connector_shutdown"  # vLLM shut the connector down
END_PROCESS_EXIT = "process_exit"  # the process exited without that (atexit)
# The vLLM process ended without a word to its sidecar (SIGKILL, os._exit):
# what it recorded after its last hand-over never left it.
END_PROCESS_KILLED = "process_killed"
END_CAUSES = (END_CONNECTOR_SHUTDOWN, END_PROCESS_EXIT, END_PROCESS_KILLED)
# Not a process stop: imported evidence (kvobs-otel import-hust) ended while
# a job or episode was open. Nobody can say it would have finished: still an
# incomplete chain (ERROR, counted, alerted), as before these causes existed.
END_EVIDENCE_ENDED = "evidence_ended"


def stopped(outcome: str, cause: str | None) -> bool:
    """Abandoned because its process stopped: no failure of the chain."""
    return outcome == ABANDONED and cause in END_CAUSES
# Every rank reported, and at least one rank's transfer failed (vLLM 0.34+).
JOB_FAILED = "failed"

RECOVERED = "recovered"
FINISHED_BEFORE_RESUME = "finished_before_resume"
ABORTED_BEFORE_RESUME = "aborted_before_resume"
PREEMPTED_AGAIN = "preempted_again"
FIRST_COMPUTE_INCOMPLETE = "first_compute_incomplete"
# A restore failed and vLLM ended the request with an error
# (kv_load_failure_policy "fail").
RESTORE_FAILED = "restore_failed"
# A restore failed and vLLM computed the request again from scratch
# (kv_load_failure_policy "recompute"); the episode ends at that first compute.
RECOMPUTED = "recomputed"

TRANSFER_OK = "ok"
TRANSFER_FAILED = "failed"
TRANSFER_REJECTED = "rejected"
TRANSFER_CANCELLED = "cancelled"
# Imported evidence ended before the transfer's result was recorded.
TRANSFER_UNFINISHED = "unfinished"

# How far a record's ids join: "cluster" (scheduler and every rank share one
# trace) or "process" (a host whose records cannot be joined across processes,
# vLLM-HUST contract v1: spans stay in the process that saw them).
JOIN_CLUSTER = "cluster"
JOIN_PROCESS = "process"

# Roles of a job within an episode
PRESERVE = "preserve"
RESTORE = "restore"

# Secondary tiers (TieringOffloadingSpec) ------------------------------------
PROMOTION = "promotion"  # secondary tier -> CPU
CASCADE = "cascade"  # CPU -> secondary tier
TIER_OK = "ok"
TIER_FAILED = "failed"  # no chunk made it
TIER_PARTIAL = "partial"  # some chunks made it (promotions only)
# Still unfinished past the deadline while the engine stepped: reported now,
# while it hangs (a result that comes later is counted late).
TIER_HUNG = "hung"
# An episode whose promotion or wait hung: it ends then, as an error.
TIER_STALLED = "tier_stalled"
# Why a request waited for the connector's answer (kv.wait).
WAIT_TRANSFER = "transfer_in_flight"  # its own offload job was still running
WAIT_PROMOTION = "promotion"  # a secondary tier promoted its KV to CPU
WAIT_LOOKUP = "lookup"  # the connector could not answer yet (an async tier lookup)
# Every reason, in the order the main one is picked.
WAIT_REASONS = (WAIT_PROMOTION, WAIT_TRANSFER, WAIT_LOOKUP)


def main_wait_reason(reasons: list[str]) -> str:
    """The one reason a wait is counted under (a metric label)."""
    for reason in WAIT_REASONS:
        if reason in reasons:
            return reason
    return WAIT_LOOKUP


WAIT_ANSWERED = "answered"
WAIT_REQUEST_ENDED = "request_ended"
# Why KV that was offloaded did not come back (kvobs.recompute.reason).
RECOMPUTE_PROMOTION_FAILED = "promotion_failed"
RECOMPUTE_NO_ROOM = "promotion_allocation_failed"
# A cascade of the episode's KV failed, or back-pressure kept it off the tier:
# named only when the episode then recomputed and nothing else explains it.
RECOMPUTE_CASCADE_FAILED = "cascade_failed"
RECOMPUTE_CASCADE_DROPPED = "cascade_dropped"
# Its KV was cascaded to a tier, yet no tier gave it back (vLLM 0.32/0.33's
# fs tier keeps a request's first "absent" answer).
RECOMPUTE_NOT_FOUND = "not_found"


@dataclass(slots=True)
class JobRecord:
    sched_gen: str
    job_id: int
    req_id: str | None  # None: the host never said whose job (metrics only)
    kind: str  # "store" | "load"
    sync: bool
    blocks: int
    expected_ranks: int
    receipt_ranks: list[int]
    missing_ranks: list[int]
    duplicate_receipts: int
    outcome: str
    start_ns: int
    end_ns: int
    flushed: bool = False
    episode_epoch: int = 0  # 0: ordinary traffic
    episode_role: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    # The rank(s) whose receipt came last, and how long after the first.
    last_ranks: list[int] = field(default_factory=list)
    receipt_spread_ns: int = 0
    # Store jobs: host-tier chunks written (dropped again when the store failed).
    host_chunks: int = 0
    end_cause: str | None = None  # ABANDONED: END_*


@dataclass(slots=True)
class TransferRecord:
    sched_gen: str
    job_id: int
    req_id: str | None  # None when the job's metadata was never seen
    direction: str  # "d2h" | "h2d"
    blocks: int
    size_bytes: int | None
    device_time_s: float | None
    rank: int
    worker_gen: str
    outcome: str
    start_ns: int
    end_ns: int
    episode_epoch: int = 0
    expedited: bool = False
    join_scope: str = JOIN_CLUSTER
    end_cause: str | None = None  # TRANSFER_CANCELLED: END_*


@dataclass(slots=True)
class FirstComputeRecord:
    sched_gen: str
    req_id: str
    epoch: int
    rank: int
    worker_gen: str
    compute_kind: str | None  # None: a v1 host that did not know it
    start_ns: int
    end_ns: int
    join_scope: str = JOIN_CLUSTER


@dataclass(slots=True)
class EpisodeEvent:
    name: str
    t_ns: int
    attributes: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class EpisodeRecord:
    sched_gen: str
    req_id: str
    epoch: int
    start_ns: int
    end_ns: int
    outcome: str
    traceparent: str | None
    preserve_jobs: list[int]
    restore_jobs: list[int]
    events: list[EpisodeEvent]
    expected_ranks: int
    # Admission: None when the request never came back.
    ready_ns: int | None = None
    admitted_ns: int | None = None
    compute_kind: str | None = None
    first_compute_ranks: list[int] = field(default_factory=list)
    missing_first_compute_ranks: list[int] = field(default_factory=list)
    incomplete_jobs: list[int] = field(default_factory=list)
    # False when the host reports first compute only on the ranks (vLLM-HUST):
    # the episode then ends at admission and its trace holds the evidence.
    first_compute_observed: bool = True
    join_scope: str = JOIN_CLUSTER
    failed_restore_jobs: list[int] = field(default_factory=list)
    failed_ranks: list[int] = field(default_factory=list)
    # Where the request's KV came back from, in tokens (None: not observed).
    tokens_discarded: int | None = None  # computed tokens the preemption dropped
    tokens_restored: int | None = None  # loaded from the host tier
    tokens_resident: int | None = None  # still in the device prefix cache
    tokens_recomputed: int | None = None  # computed again
    # brought by the other connectors of vLLM's MultiConnector (None: alone)
    tokens_other_connector: int | None = None
    end_cause: str | None = None  # ABANDONED: END_*
    # Secondary tiers: tier jobs of this episode, the chunks each tier
    # promoted for it ({tier_index: chunks}), and why KV did not come back.
    tier_jobs: list[int] = field(default_factory=list)
    promoted_chunks: dict[int, int] = field(default_factory=dict)
    recompute_reason: str | None = None
    # Of tokens_restored: those a secondary tier promoted to CPU for this
    # episode ({tier_index: tokens}); the rest were in the CPU tier already.
    tokens_restored_by_tier: dict[int, int] = field(default_factory=dict)

    def tokens(self) -> tuple[tuple[str, int | None], ...]:
        """(source, tokens) of the accounting: the span's attributes and the
        kvobs.recovery.tokens{source} counter say the same."""
        return (("discarded", self.tokens_discarded), ("restored", self.tokens_restored),
                ("resident", self.tokens_resident), ("recomputed", self.tokens_recomputed),
                ("other_connector", self.tokens_other_connector))


@dataclass(slots=True)
class RequestRecord:
    """The root of a request's ordinary offload-traffic trace."""

    sched_gen: str
    req_id: str
    start_ns: int
    end_ns: int
    outcome: str  # "finished" | "aborted" | "abandoned"
    traceparent: str | None
    jobs: int
    end_cause: str | None = None  # ABANDONED: END_*
    tier_jobs: int = 0
    waits: int = 0


@dataclass(slots=True)
class TierJobRecord:
    """A promotion (secondary tier -> CPU) or cascade (CPU -> secondary tier)
    of vLLM's tiering manager."""

    sched_gen: str
    tier_job_id: int  # the tiering manager's own id space
    tier_index: int
    tier_type: str
    medium: str
    locality: str
    kind: str  # PROMOTION | CASCADE
    req_id: str
    chunks: int
    outcome: str  # TIER_*
    start_ns: int
    end_ns: int
    chunks_ok: int | None = None
    size_bytes: int | None = None
    io_time_s: float | None = None  # the tier's own measure of its I/O
    release_deferred: bool = False  # failed chunks released later (0.34)
    episode_epoch: int = 0
    end_cause: str | None = None  # ABANDONED: END_*


@dataclass(slots=True)
class WaitRecord:
    """From the connector's first "not yet" for a request to its answer."""

    sched_gen: str
    req_id: str
    start_ns: int
    end_ns: int
    passes: int  # scheduling passes told "not yet"
    reasons: list[str]
    outcome: str  # WAIT_ANSWERED | WAIT_REQUEST_ENDED | TIER_HUNG | ABANDONED
    tiers: list[int] = field(default_factory=list)  # tiers that promoted for it
    episode_epoch: int = 0
    end_cause: str | None = None


@dataclass(slots=True)
class ProcessEndRecord:
    """A vLLM process ended without a word to its sidecar (killed): the
    window in which what it recorded may never have left it."""

    role: str
    rank: int | None
    sched_gen: str  # the scheduler generation it last worked for ("" unknown)
    last_event_ns: int  # its newest event the sidecar got (0: none)
    end_ns: int  # when the sidecar saw its pipe end
    unsent_events: int  # events it accepted that never reached the sidecar
    cause: str = END_PROCESS_KILLED
