"""The public instrument()/uninstrument() surface (opentelemetry-contrib style)."""

from __future__ import annotations

import logging
import threading

from kvobs_otel.config import ConfigError, Settings, load_settings

logger = logging.getLogger("kvobs_otel")
_lock = threading.Lock()

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
            import vllm  # noqa: F401  (vLLM missing: say so below)
        except ImportError as e:
            logger.error("kvobs-otel: observation stays off: vLLM not importable (%s)", e)
            return False
        try:
            if instrumentor.refusal() is not None:
                return False  # refused once in this process: said and counted then
            release = instrumentor.choose_release(settings)
            if release is None:
                return False
            instrumentor.patch_classes(settings, release)
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
