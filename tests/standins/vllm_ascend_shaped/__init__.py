"""STAND-IN for vllm-ascend's offloading connector (an NPU cannot run here).

Shaped like vllm-ascend's ``AscendOffloadingConnector``: a subclass of vLLM's
``OffloadingConnector`` whose worker role is an
``AscendOffloadingConnectorWorker``, a subclass of
``OffloadingConnectorWorker`` that overrides only ``register_kv_caches``
(there it would lay out NPU caches) and still ends in ``_init_worker``. The
package name starts with ``vllm_ascend`` as the real one's does, which is
how kvobs-otel tells the host adapter apart. The copy engine is the
harness's CPU backend (the NPU one comes from the spec on real hardware).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)


class AscendOffloadingConnectorWorker(OffloadingConnectorWorker):
    register_calls = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # The real one prepares NPU tensors, then takes the same path.
        type(self).register_calls += 1
        super().register_kv_caches(kv_caches)


class AscendOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            # Swapped in after the base __init__, as vllm-ascend does.
            base = self.connector_worker
            self.connector_worker = AscendOffloadingConnectorWorker(
                base.spec, vllm_config, base.kv_cache_config)
