"""kvobs-otel: OpenTelemetry spans and metrics for vLLM's KV offload and
recovery lifecycle.

    import kvobs_otel
    kvobs_otel.instrument()      # honours KVOBS_OTEL_ENABLED (default off)
    kvobs_otel.uninstrument()    # restores vLLM's original classes

Importing this package imports neither vLLM nor the OpenTelemetry SDK.
"""

from kvobs_otel.instrumentation import instrument, is_instrumented, uninstrument
from kvobs_otel.package import __version__

__all__ = ["__version__", "instrument", "uninstrument", "is_instrumented"]
