"""Real-vLLM CPU harness: vLLM's scheduler, KV cache manager and KV connector
roles driven without a GPU or a model (see engine.py).

Importing this package does not import vLLM; that happens when a harness is
built (process-mode ranks set their environment first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Harness",
    "HarnessConfig",
    "JobEvent",
    "KVIntegrityError",
    "PromptSpec",
    "StepRecord",
    "make_prompts",
    "pressure_workload",
]

_EXPORTS = {
    "Harness": "kvobs_otel.tools.harness.engine",
    "HarnessConfig": "kvobs_otel.tools.harness.engine",
    "JobEvent": "kvobs_otel.tools.harness.engine",
    "StepRecord": "kvobs_otel.tools.harness.engine",
    "KVIntegrityError": "kvobs_otel.tools.harness.runner",
    "PromptSpec": "kvobs_otel.tools.harness.workload",
    "make_prompts": "kvobs_otel.tools.harness.workload",
    "pressure_workload": "kvobs_otel.tools.harness.workload",
}

if TYPE_CHECKING:
    from kvobs_otel.tools.harness.engine import Harness, HarnessConfig, JobEvent, StepRecord
    from kvobs_otel.tools.harness.runner import KVIntegrityError
    from kvobs_otel.tools.harness.workload import PromptSpec, make_prompts, pressure_workload


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
