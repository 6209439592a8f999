"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
here, of the fork's plugin (``vllm-hust-kv-transfer-observability``): the host
records it was handed to write a set of JSONL lines.

``host_records(lines)`` runs the plugin's mapping (``native.py`` @ 4757ef7af3d0,
host record -> line) backwards, so a fixture can be replayed through the live
adapter with ``chains.play`` and the spans compared with its import:

- a ``vllm-hust.kv-transfer-correlated-host.v2`` line is a v2
  ``CorrelatedObservation``, field for field (rosters as ``WorkerReceipt`` /
  ``JobReceipt``);
- a ``vllm-hust.kv-transfer-event.v2`` line is a v1 transfer record:
  ``preserve_started``/``restore_started`` <- ``transfer_submitted``
  (``d2h_preserve``/``h2d_restore``); ``*_completed`` <- ``transfer_completed``
  with ``success=True`` and the host's ``duration_ns`` as the line's
  ``device_duration_ns`` (None when absent); ``transfer_failed`` <-
  ``transfer_completed`` with ``success=False``; ``transfer_cancelled`` <-
  ``transfer_cancelled`` (``host_shutdown``). The host's job id is the number
  in the transfer id (``<process uuid>:t:<job id>``);
- a ``vllm-hust.kv-transfer-host-fact.v1`` line is the v1 record of its event
  (the plugin writes a receipt only for a successful restore: ``h2d_restore``,
  ``success=True``, ``rank=None``).

The event schema's own recovery events (requeue, admission, first compute)
come from no host record (the plugin's binding never writes them): refused.
"""

from __future__ import annotations

from typing import Any

from . import correlated_observability as v2
from . import observability as v1

CORRELATED = "vllm-hust.kv-transfer-correlated-host.v2"
EVENT = "vllm-hust.kv-transfer-event.v2"
HOST_FACT = "vllm-hust.kv-transfer-host-fact.v1"

_OPERATION = {"d2h": v1.TransferOperation.D2H_PRESERVE, "h2d": v1.TransferOperation.H2D_RESTORE}


def _workers(items: list[dict[str, Any]]) -> tuple[v2.WorkerReceipt, ...]:
    return tuple(v2.WorkerReceipt(w["rank"], w["worker_generation"]) for w in items)


def _correlated(line: dict[str, Any]) -> v2.CorrelatedObservation:
    fields = {k: v for k, v in line.items() if k != "schema"}
    fields["event"] = v2.CorrelatedEvent(fields["event"])
    if "workers" in fields:
        fields["workers"] = _workers(fields["workers"])
    if "roster" in fields:
        fields["roster"] = tuple(v2.JobReceipt(j["job_id"], _workers(j["workers"]))
                                 for j in fields["roster"])
    return v2.CorrelatedObservation(**fields)


def _event(line: dict[str, Any]) -> v1.KVTransferObservation:
    ident, event = line["identity"], line["event"]
    common = dict(observed_at_ns=line["observed_at_ns"], rank=ident["rank"],
                  request_id=ident["request_id"],
                  operation=_OPERATION[line["direction"]],
                  job_id=int(line["transfer_id"].rsplit(":", 1)[1]))
    if event in ("preserve_started", "restore_started"):
        return v1.KVTransferObservation(v1.KVTransferEvent.TRANSFER_SUBMITTED,
                                        block_count=line["block_count"], **common)
    if event in ("preserve_completed", "restore_completed", "transfer_completed"):
        return v1.KVTransferObservation(v1.KVTransferEvent.TRANSFER_COMPLETED, success=True,
                                        bytes_moved=line["bytes_moved"],
                                        duration_ns=line.get("device_duration_ns"), **common)
    if event == "transfer_failed":
        return v1.KVTransferObservation(v1.KVTransferEvent.TRANSFER_COMPLETED, success=False,
                                        **common)
    if event == "transfer_cancelled":
        return v1.KVTransferObservation(v1.KVTransferEvent.TRANSFER_CANCELLED,
                                        reason=v1.TransferCancellationReason.HOST_SHUTDOWN,
                                        **common)
    raise ValueError(f"no host record becomes an event-v2 {event!r} line")


def _fact(line: dict[str, Any]) -> v1.KVTransferObservation:
    event, t, req = line["event"], line["observed_at_ns"], line["request_id"]
    if event == "transfer_receipt":
        return v1.KVTransferObservation(
            v1.KVTransferEvent.TRANSFER_RECEIPT, t, operation=v1.TransferOperation.H2D_RESTORE,
            job_id=line["job_id"], request_id=req, success=True, ranks=tuple(line["ranks"]))
    if event == "recovery_requeued":
        return v1.KVTransferObservation(
            v1.KVTransferEvent.RECOVERY_REQUEUED, t, request_id=req,
            recovery_epoch=line["recovery_epoch"],
            requeue_reason=v1.RecoveryRequeueReason(line["requeue_reason"]))
    if event == "recovery_admitted":
        return v1.KVTransferObservation(
            v1.KVTransferEvent.RECOVERY_ADMITTED, t, request_id=req,
            recovery_epoch=line["recovery_epoch"], job_ids=tuple(line["job_ids"]))
    return v1.KVTransferObservation(
        v1.KVTransferEvent.FIRST_COMPUTE, t, rank=line["rank"], request_id=req,
        recovery_epoch=line["recovery_epoch"], job_ids=tuple(line["job_ids"]),
        compute_kind=v1.ComputeKind(line["compute_kind"]))


def host_records(lines: list[dict[str, Any]]) -> list[Any]:
    """The host records behind ``lines``, in line order."""
    read = {CORRELATED: _correlated, EVENT: _event, HOST_FACT: _fact}
    return [read[line["schema"]](line) for line in lines]
