"""Span names and attribute keys: fixed, low-cardinality names; ids go in
attributes. Every key the project defines starts with ``kvobs.``."""

SPAN_RECOVERY = "kv.recovery"
SPAN_REQUEST = "kv.request"
SPAN_JOB = "kv.job"
SPAN_TRANSFER = "kv.transfer"
SPAN_ADMISSION = "kv.admission"
SPAN_FIRST_COMPUTE = "kv.first_compute"
# A vLLM process that ended without a word to its sidecar (killed): its own
# trace, one per observed role of that process.
SPAN_PROCESS_END = "kv.process.end"
# vLLM's secondary tiers (TieringOffloadingSpec): a promotion or cascade, and
# the window in which the connector told the scheduler "not yet".
SPAN_TIER_JOB = "kv.tier.job"
SPAN_WAIT = "kv.wait"

REQUEST_ID = "kvobs.request.id"
EPOCH = "kvobs.recovery.epoch"
OUTCOME = "kvobs.outcome"
SCHED_GEN = "kvobs.scheduler.generation"
WORKER_GEN = "kvobs.worker.generation"
RANK = "kvobs.rank"
JOB_ID = "kvobs.job.id"
JOB_KIND = "kvobs.job.kind"
JOB_SYNC = "kvobs.job.sync"
JOB_FLUSHED = "kvobs.job.flushed"
JOB_ROLE = "kvobs.job.role"
BLOCKS = "kvobs.blocks"
BYTES = "kvobs.bytes"
DIRECTION = "kvobs.direction"
DEVICE_DURATION = "kvobs.device.duration_s"
EXPEDITED = "kvobs.expedited"
RECEIPT_EXPECTED = "kvobs.receipt.expected_ranks"
RECEIPT_RANKS = "kvobs.receipt.ranks"
RECEIPT_MISSING = "kvobs.receipt.missing_ranks"
RECEIPT_DUPLICATES = "kvobs.receipt.duplicates"
RECEIPT_FAILED = "kvobs.receipt.failed_ranks"
# The rank(s) whose receipt arrived last, and seconds from the first receipt.
RECEIPT_LAST = "kvobs.receipt.last_ranks"
RECEIPT_SPREAD = "kvobs.receipt.spread_s"
HOST_CHUNKS = "kvobs.host_tier.chunks"
HOST_DROPPED = "kvobs.host_tier.dropped_chunks"
RESTORE_FAILED_JOBS = "kvobs.restore.failed_job_ids"
RESTORE_FAILED_RANKS = "kvobs.restore.failed_ranks"
# Where a recovered request's KV came from, in tokens, by source
# (EpisodeRecord.tokens()): kvobs.tokens.discarded, .restored, .resident,
# .recomputed, .other_connector (inside vLLM's MultiConnector only).
TOKENS = {source: f"kvobs.tokens.{source}"
          for source in ("discarded", "restored", "resident", "recomputed", "other_connector")}
PRESERVE_JOBS = "kvobs.preserve.job_ids"
RESTORE_JOBS = "kvobs.restore.job_ids"
ROSTER = "kvobs.admission.roster"
ROSTER_DROPPED = "kvobs.admission.roster_dropped"
COMPUTE_KIND = "kvobs.compute.kind"
FIRST_COMPUTE_RANKS = "kvobs.first_compute.ranks"
FIRST_COMPUTE_MISSING = "kvobs.first_compute.missing_ranks"
INCOMPLETE_JOBS = "kvobs.incomplete.job_ids"
JOBS = "kvobs.jobs"
# Set only when spans could not be joined across processes (value "process").
JOIN_SCOPE = "kvobs.join.scope"
# Why an abandoned job, episode or request (or a cancelled transfer) ended:
# its process stopped first (records.END_CAUSES).
END_CAUSE = "kvobs.end.cause"
# kv.process.end: events the process accepted that never reached its sidecar.
UNSENT_EVENTS = "kvobs.process.unsent_events"
LIST_DROPPED_SUFFIX = ".dropped"
# Secondary tiers, as vLLM names them (tier index = order in secondary_tiers).
TIER_INDEX = "kvobs.tier.index"
TIER_TYPE = "kvobs.tier.type"
TIER_MEDIUM = "kvobs.tier.medium"
TIER_LOCALITY = "kvobs.tier.locality"
TIER_JOB_ID = "kvobs.tier.job.id"  # the tiering manager's ids, not kvobs.job.id's
TIER_JOB_KIND = "kvobs.tier.job.kind"  # promotion | cascade
TIER_CHUNKS = "kvobs.tier.chunks"
TIER_CHUNKS_OK = "kvobs.tier.chunks_ok"
TIER_IO_DURATION = "kvobs.tier.io.duration_s"  # the tier's own measure of its I/O
TIER_RELEASE_DEFERRED = "kvobs.tier.release_deferred"
TIER_JOB_IDS = "kvobs.tier.job_ids"  # an episode's tier jobs
TIER_JOBS = "kvobs.tier.jobs"  # a request's tier jobs (count)
TIER_PROMOTED = "kvobs.tier.promoted_chunks"  # an episode's, summed over tiers
TIER_PROMOTED_BY = "kvobs.tier.promoted_chunks.by_tier"  # [chunks of tier 0, tier 1, ...]
RECOMPUTE_REASON = "kvobs.recompute.reason"
# Of kvobs.tokens.restored: those a secondary tier promoted for the episode
# (a list by tier index) and those already in the CPU tier.
TOKENS_RESTORED_BY_TIER = "kvobs.tokens.restored.by_tier"
TOKENS_RESTORED_CPU = "kvobs.tokens.restored.cpu"
WAIT_PASSES = "kvobs.wait.passes"
WAIT_REASONS = "kvobs.wait.reasons"
TIER_INDEXES = "kvobs.tier.indexes"  # a wait's promoting tiers

ERROR_TYPE = "error.type"  # standard name

# Resource attributes
RES_ROLE = "kvobs.role"
RES_ENGINE = "kvobs.engine.id"
RES_RANK = "kvobs.rank"
RES_TP_RANK = "kvobs.tp.rank"
RES_PP_RANK = "kvobs.pp.rank"
RES_DP_RANK = "kvobs.dp.rank"
RES_DEVICE = "kvobs.device.type"
RES_VLLM_VERSION = "kvobs.vllm.version"
RES_HOST_ADAPTER = "kvobs.host.adapter"
RES_HOST_CONTRACT = "kvobs.host.contract"
RES_PROCESS_START_ID = "kvobs.process.start_id"
RES_EXPORT = "kvobs.export"  # the process meter: sidecar or in-process
