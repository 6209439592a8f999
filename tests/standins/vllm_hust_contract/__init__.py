"""STAND-IN for the vLLM-HUST fork's observer contract (the fork cannot be installed here);
written from facts read in the fork's source (each module names the fork file
and commit of every fact it relies on).

Modules:

- ``observability``            contract v1 (``vllm.kv-transfer.observer.v1``, API "1.0"),
                               the fork's observability.py @ 65cc5678b0d5
- ``correlated_observability`` contract v2 (``vllm.kv-transfer.observer.v2``, API "2.0"),
                               the fork's correlated_observability.py @ 65cc5678b0d5
- ``chains``                   canonical and deliberately broken event sequences
- ``jsonl``                    the plugin's mapping, backwards: the host records behind its lines

The real modules live in the fork at
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/{observability,
correlated_observability}.py``. The host's call sites are played by the real
emit functions (``emit_kv_*``, ``emit_correlated_observation``), driven by the
STAND-IN-ONLY ``replay``/``chains.play`` helpers.
"""
