"""The export sidecar: one child process per observed vLLM process.

``link.py`` runs in vLLM's process (start, write, watch, restart);
``main.py`` is the child (``python -m kvobs_otel.sidecar``); ``wire.py`` is
the pipe's framing, shared by both.
"""
