"""Benchmarks of kvobs-otel's cost on vLLM's serving path (``python -m benchmarks``).

Every figure is a ratio (or a difference) of variants measured side by side
in the same run, interleaved, repeated, and reported as a median with its
spread: the machines this runs on are small and noisy, so no absolute timing
is ever compared with a goal. See docs/benchmarks.md.
"""
