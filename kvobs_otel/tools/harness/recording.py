"""A stock OffloadingConnector that logs the worker-side calls it receives.

For tests of the harness itself: name it in the harness config
(``connector="RecordingOffloadingConnector",
connector_module_path="kvobs_otel.tools.harness.recording"``) and read the call
sequence of a rank with ``harness.rank_call(rank, "calls")``. Behaviour is
unchanged; each call is logged as ``(method, details)`` before delegating.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)


class RecordingOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple[str, Any]] = []

    def _log(self, name: str, details: Any = None) -> None:
        self.calls.append((name, details))

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        flush = kv_connector_metadata.jobs_to_flush
        self._log("handle_preemptions", sorted(flush) if flush else [])
        super().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._log("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        has_attn = getattr(forward_context, "attn_metadata", None) is not None
        self._log("start_load_kv", {"kwargs": sorted(kwargs), "attn_metadata": has_attn})
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log("wait_for_layer_load", layer_name)
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        self._log("save_kv_layer", layer_name)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kw)

    def finish_forward(self) -> None:
        self._log("finish_forward")
        super().finish_forward()

    def wait_for_save(self) -> None:
        self._log("wait_for_save")
        super().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        result = super().get_finished(finished_req_ids)
        self._log("get_finished", sorted(result[1]))
        return result

    def build_connector_worker_meta(self) -> Any:
        self._log("build_connector_worker_meta")
        return super().build_connector_worker_meta()

    def clear_connector_metadata(self) -> None:
        self._log("clear_connector_metadata")
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        self._log("shutdown")
        super().shutdown()
