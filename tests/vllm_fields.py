"""The fields of vLLM's worker metadata in the installed release (0.34 added
``failed_jobs``, the mark of a vLLM that reports failed transfers)."""

from __future__ import annotations

from dataclasses import fields

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)

VLLM_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(OffloadingWorkerMetadata))
