"""Extensions of vLLM's own step metadata (never a side channel).

scheduler -> workers: an attribute ``kvobs_step`` on the
``OffloadingConnectorMetadata`` object, pickled with it to every worker:
``(scheduler_generation, {req_id: epoch}, {req_id: (epoch, compute_kind)},
load_rows, store_rows, flushed_job_ids)`` - the episodes this step touches,
the requests admitted this step, and the rows every rank needs of the step's
jobs (the scheduler's own S_STEP rows, lifecycle/events.py: built once for
all ranks). Set only on a step with some of these; the others read the class
default, None (instrumentor.py), and pickle as vLLM's own.

workers -> scheduler: an attribute ``kvobs_receipts`` = ``reporters`` on
vLLM's own ``OffloadingWorkerMetadata`` object of a step the rank completed
jobs in (vLLM's worker hands that object over and starts a fresh one):
((rank, worker_generation, job_ids, failed_job_ids), ...), where the ids are
vLLM's own ``completed_jobs`` dict and ``failed_jobs`` set of that object
(pickled once with it, our reference costs a memo entry). vLLM's fields are
never touched and no object of ours replaces vLLM's: a step a rank reports
nothing in stays None, as vLLM made it. vLLM's ``aggregate()`` builds its
merged object from its own fields: ``merged`` joins the ranks' receipts onto
it (instrumentor.py wraps it).

A rank's first compute of a re-admitted request is not a receipt: the
scheduler confirms it when that step's output, from every rank, reaches
``Scheduler.update_from_output`` (seams.SchedulerSeams.on_step_output).
"""

from __future__ import annotations

from typing import Any

STEP_ATTR = "kvobs_step"
RECEIPTS_ATTR = "kvobs_receipts"

Receipts = tuple[tuple[Any, ...], ...]


def merged(mine: Receipts | None, theirs: Receipts | None) -> Receipts | None:
    """Two metadata objects' receipts as one (either may have none)."""
    if mine is None or theirs is None:
        return theirs if mine is None else mine
    return mine + theirs
