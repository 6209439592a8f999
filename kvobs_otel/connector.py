"""The explicit way in: a connector class for ``kv_connector_module_path``.

    --kv-transfer-config '{"kv_connector": "KvobsOffloadingConnector",
        "kv_connector_module_path": "kvobs_otel.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {...same as OffloadingConnector...}}'

Choosing this class is the opt-in, so observation is on unless
KVOBS_OTEL_ENABLED says otherwise. It behaves exactly like OffloadingConnector
and drives the same seams as the plugin (it instruments the class on first
use), so enabling both never observes an event twice.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvobs_otel.instrumentation import instrument


class KvobsOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        instrument(default_enabled=True)
        # Resolved at call time: the instrumented __init__ when observation is on.
        super().__init__(vllm_config, role, kv_cache_config)
