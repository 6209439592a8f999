"""Facts about the serving platform that every host adapter puts on its resource."""

from __future__ import annotations

from kvobs_otel.config import Settings


def vllm_version() -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except Exception:
        return "unknown"


def device_type(settings: Settings) -> str:
    if settings.device_type != "auto":
        return settings.device_type
    try:
        from vllm.platforms import current_platform
        return str(current_platform.device_type or "cpu")
    except Exception:
        return "unknown"
