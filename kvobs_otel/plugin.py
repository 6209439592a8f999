"""vLLM general plugin: runs once in every vLLM process (API server, engine
core, each worker) before connectors are built. Default-off: it patches only
when KVOBS_OTEL_ENABLED is true, and never raises into vLLM."""

from __future__ import annotations


def register() -> None:
    try:
        from kvobs_otel.instrumentation import instrument

        instrument()
    except Exception:  # a plugin must never take vLLM down
        import logging

        logging.getLogger("kvobs_otel").exception("kvobs-otel: plugin failed; observation off")
