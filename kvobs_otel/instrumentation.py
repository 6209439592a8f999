"""The public instrument()/uninstrument() surface (opentelemetry-contrib style)."""

from __future__ import annotations

import logging
import threading

from kvobs_otel.config import ConfigError, Settings, load_settings

logger = logging.getLogger("kvobs_otel")
_lock = threading.Lock()

TESTED_VLLM = "0.33.0"
# The seams rely on 0.33's OffloadingConnector shape: per-job TransferJob with
# `sync`, jobs_to_flush, OffloadingWorkerMetadata, submit_load(expedited=).
MIN_VLLM = (0, 33, 0)


def vllm_version_supported(version: str) -> bool:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= MIN_VLLM


def _check_settings(settings: Settings) -> None:
    from kvobs_otel.telemetry.providers import validate_exporter_env

    try:
        validate_exporter_env()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def instrument(settings: Settings | None = None, *, default_enabled: bool = False) -> bool:
    """Patch vLLM's OffloadingConnector classes when observation is enabled.

    Returns True when instrumentation is active. Never raises: a bad setting
    or a missing vLLM logs one line and leaves vLLM untouched.
    """
    with _lock:
        from kvobs_otel.hosts.hust import adapter as hust
        from kvobs_otel.hosts.vllm import instrumentor

        if instrumentor.is_patched() or hust.current() is not None:
            return is_instrumented()
        try:
            if settings is None:
                import os

                from kvobs_otel.config import ENV_ENABLED
                env = dict(os.environ)
                if default_enabled and ENV_ENABLED not in env:
                    env[ENV_ENABLED] = "1"
                settings = load_settings(env)
            if not settings.enabled:
                return False
            _check_settings(settings)
        except ConfigError as e:
            logger.error("kvobs-otel: observation stays off: %s", e)
            return False
        if _attach_hust(settings):
            return is_instrumented()
        try:
            import vllm

            if not vllm_version_supported(vllm.__version__):
                logger.error("kvobs-otel: observation stays off: vLLM %s is older than the "
                             "oldest supported %s", vllm.__version__,
                             ".".join(map(str, MIN_VLLM)))
                return False
            instrumentor.patch_classes(settings)
        except ImportError as e:
            logger.error("kvobs-otel: observation stays off: vLLM not importable (%s)", e)
            instrumentor.unpatch_classes()
            return False
        except Exception:
            logger.exception("kvobs-otel: observation stays off: patching failed")
            instrumentor.unpatch_classes()
            return False
        return True


def _attach_hust(settings: Settings) -> bool:
    """True when the vLLM-HUST fork is present: its own observer contracts are
    then used (or, for unknown versions, refused) and nothing is patched, so
    no event is observed twice."""
    from kvobs_otel.hosts.hust import adapter, contracts

    detection = contracts.detect()
    if not detection.present:
        return False
    try:
        adapter.attach(settings, detection)
    except Exception:
        logger.exception("kvobs-otel: observation stays off: vLLM-HUST registration failed")
        adapter.detach()
    return True


def uninstrument() -> None:
    """Restore vLLM's original methods, unregister from vLLM-HUST, and detach
    every observed connector."""
    with _lock:
        from kvobs_otel.hosts.hust import adapter as hust
        from kvobs_otel.hosts.vllm import instrumentor

        hust.detach()
        instrumentor.unpatch_classes()


def is_instrumented() -> bool:
    from kvobs_otel.hosts.hust import adapter as hust
    from kvobs_otel.hosts.vllm import instrumentor

    a = hust.current()
    return instrumentor.is_patched() or (a is not None and a.observing)
