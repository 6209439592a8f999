"""Another KV connector beside the OffloadingConnector in vLLM's
MultiConnector: a stand-in for the connectors that cannot run here (Nixl,
LMCache, Mooncake...) that serve a request's KV from elsewhere.

It is vLLM's own DecodeBenchConnector
(``vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py``:
its scheduler claims every uncomputed token but the last, synchronously, and
its worker fills the claimed blocks with constant values), loaded the way
vLLM loads any out-of-tree connector (``kv_connector`` = the class name,
``kv_connector_module_path`` = this module). Stock DecodeBench serves a
request once, on its first scheduling; with ``serve`` (extra config
``companion_serve``) it serves:

- ``"readmissions"``: only preempted requests scheduled again (never a new
  one, so the OffloadingConnector stores every request as without it);
- ``"all"``: new requests and re-admissions.

``served`` (scheduler role) counts what it claimed per request, for tests;
with ``companion_ledger`` (extra config: a file path) each claim is also
appended there as a JSON line (a real engine's scheduler runs in the
EngineCore process, out of a test's reach).
"""

from __future__ import annotations

import json
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
    DecodeBenchConnectorScheduler,
)

SERVE_KEY = "companion_serve"
LEDGER_KEY = "companion_ledger"
SERVE_MODES = ("readmissions", "all")
CLASS_NAME = "CompanionConnector"
MODULE_PATH = __name__


class _Scheduler(DecodeBenchConnectorScheduler):
    def __init__(self, vllm_config: Any, kv_cache_config: Any, serve: str,
                 ledger: str | None) -> None:
        super().__init__(vllm_config, kv_cache_config)
        self.serve = serve
        self.ledger = ledger
        # req_id -> the preemption count it was last served at
        self._served_at: dict[str, int] = {}
        # req_id -> tokens claimed, summed over its schedulings (tests read it)
        self.served: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        r, n = request.request_id, request.num_preemptions
        if not n and self.serve == "readmissions":
            return 0, False
        if n and self._served_at.get(r) != n:
            self._filled_requests.discard(r)  # a new scheduling: serve it again
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            r = request.request_id
            self._served_at[r] = request.num_preemptions
            self.served[r] = self.served.get(r, 0) + num_external_tokens
            if self.ledger:
                with open(self.ledger, "a") as f:
                    f.write(json.dumps({"request": r, "preemptions": request.num_preemptions,
                                        "tokens": num_external_tokens}) + "\n")


class CompanionConnector(DecodeBenchConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Worker role: the harness rank sets this to write the true KV of
        # what was claimed (its integrity check reads it); elsewhere the
        # claimed blocks get DecodeBench's constant fill.
        self.fill_true_kv: Any = None
        kv = vllm_config.kv_transfer_config
        serve = kv.get_from_extra_config(SERVE_KEY, "readmissions")
        if serve not in SERVE_MODES:
            raise ValueError(f"{SERVE_KEY} must be one of {SERVE_MODES}, not {serve!r}")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = _Scheduler(vllm_config, kv_cache_config, serve,
                                                  kv.get_from_extra_config(LEDGER_KEY, None))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.fill_true_kv is None:
            return super().start_load_kv(forward_context, **kwargs)
        for req_id, (_blocks, num_tokens) in self._connector_metadata.reqs_to_fill.items():
            self.fill_true_kv(req_id, num_tokens)
        return None


def config(serve: str = "readmissions", ledger: str | None = None) -> dict[str, Any]:
    """Its entry in the MultiConnector's ``connectors`` list."""
    extra: dict[str, Any] = {SERVE_KEY: serve}
    if ledger:
        extra[LEDGER_KEY] = ledger
    return {"kv_connector": CLASS_NAME, "kv_connector_module_path": MODULE_PATH,
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
