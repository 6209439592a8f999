"""The offline tools: what runs on a laptop or in CI, never inside vLLM.

The ``kvobs-otel`` command (``cli``) and its commands (``demo``, ``doctor``,
``check``, ``hust_import``, ``report/``), the readers of recorded spans
(``otlp_file``, ``sources``), the episode analysis (``analysis/``) and the
real-vLLM CPU harness (``harness/``: tests, the demo and the benchmarks).

Imports flow one way: these modules import the runtime (the rest of
``kvobs_otel``), the runtime never imports them (``tests/test_layout.py``).
"""
