"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
reproduces its documented public surface; see shared/design/hust-contract.md.

Modules:

- ``observability``            contract v1 (``vllm.kv-transfer.observer.v1``, API "1.0")
- ``correlated_observability`` contract v2 (``vllm.kv-transfer.observer.v2``, API "2.0")
- ``chains``                   canonical and deliberately broken event sequences
- ``jsonl``                    the fork plugin's three JSONL file schemas (layout assumed)

The real modules live in the fork at
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/{observability,
correlated_observability}.py``. The ``emit_v1``/``emit_v2`` functions stand in
for the host's internal call sites; they are not part of the fork's public
surface an adapter may use.
"""
