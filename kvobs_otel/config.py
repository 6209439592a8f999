"""Settings, read once from the environment and validated as a whole.

Observation is default-off. A bad value raises ``ConfigError`` naming the
setting; callers then keep observation off rather than half on.
Exporter settings are the standard ``OTEL_*`` variables, read by the
OpenTelemetry SDK and exporters themselves (see ``telemetry/providers.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

ENV_ENABLED = "KVOBS_OTEL_ENABLED"
ENV_RECEIPT_DEADLINE = "KVOBS_OTEL_RECEIPT_DEADLINE_S"
ENV_TIER_DEADLINE = "KVOBS_OTEL_TIER_DEADLINE_S"
ENV_BUFFER_SIZE = "KVOBS_OTEL_BUFFER_SIZE"
ENV_TRAFFIC_RATIO = "KVOBS_OTEL_TRAFFIC_SAMPLE_RATIO"
ENV_ROSTER_CAP = "KVOBS_OTEL_ROSTER_CAP"
ENV_DRAIN_INTERVAL = "KVOBS_OTEL_DRAIN_INTERVAL_S"
ENV_DEVICE_TYPE = "KVOBS_OTEL_DEVICE_TYPE"
ENV_REQUEST_ID_KEY = "KVOBS_OTEL_REQUEST_ID_KEY"
ENV_REQUEST_ID_KEY_FILE = "KVOBS_OTEL_REQUEST_ID_KEY_FILE"
ENV_EXPORT = "KVOBS_OTEL_EXPORT"
EXPORT_SIDECAR = "sidecar"
EXPORT_IN_PROCESS = "in-process"
MIN_KEY_BYTES = 16

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names it."""


@dataclass(frozen=True)
class Settings:
    enabled: bool = False
    # A job still missing ranks this long after creation ends as ERROR.
    receipt_deadline_s: float = 5.0
    # A secondary-tier job or a wait for the connector's answer still open
    # this long (the engine stepping) ends as ERROR ("hung"). Longer than the
    # receipt deadline: a loaded filesystem or object store lookup takes
    # seconds, and a new request waiting for one is no fault.
    tier_deadline_s: float = 30.0
    # Bound of the serving-path buffer, in events; when full, events drop.
    buffer_size: int = 65536
    # Share of per-request traces of ordinary offload traffic that is kept.
    # Recovery episodes are always kept (the Collector's tail sampling
    # decides what the trace stores retain).
    traffic_sample_ratio: float = 1.0
    # Longest id list put on one attribute; the rest is counted.
    roster_cap: int = 64
    # Every wake of the drain thread costs vLLM a GIL handoff (~0.1 ms of CPU
    # measured here), whatever it carries: few wakes, each carrying more.
    drain_interval_s: float = 0.2
    # "auto" asks vLLM's platform; cuda/npu/cpu/xpu force it.
    device_type: str = "auto"
    # When set, request ids are exported only as a keyed hash (HMAC-SHA256);
    # every process of a deployment must share the key so traces still join.
    request_id_key: bytes | None = field(default=None, repr=False)
    # Where events become spans and OTLP: a sidecar process per vLLM process
    # (the default: the export work then never competes with vLLM for its
    # GIL), or the vLLM process's own drain thread (where a child process is
    # unwelcome).
    export: str = EXPORT_SIDECAR


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of true/false/1/0/yes/no/on/off")


def _number(env: Mapping[str, str], name: str, default: float, kind: type,
            low: float, high: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a {kind.__name__}") from None
    if not (low <= value <= high):
        raise ConfigError(f"{name}={raw!r}: must be between {low} and {high}")
    return value


def request_id_key(env: Mapping[str, str]) -> bytes | None:
    raw = env.get(ENV_REQUEST_ID_KEY, "")
    path = env.get(ENV_REQUEST_ID_KEY_FILE, "").strip()
    if raw and path:
        raise ConfigError(f"{ENV_REQUEST_ID_KEY} and {ENV_REQUEST_ID_KEY_FILE} are both set: "
                          "use one")
    name = ENV_REQUEST_ID_KEY
    if path:
        name = ENV_REQUEST_ID_KEY_FILE
        try:
            with open(path, "rb") as fh:
                key = fh.read().strip()
        except OSError as e:
            raise ConfigError(f"{name}={path!r}: cannot read the key ({e.strerror})") from None
    elif raw:
        key = raw.strip().encode("utf-8")
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        # The value itself is never echoed: it is a secret.
        raise ConfigError(f"{name}: the key must be at least {MIN_KEY_BYTES} bytes")
    return key


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every setting; raise ConfigError on the first bad one."""
    env = os.environ if env is None else env
    device = env.get(ENV_DEVICE_TYPE, "auto").strip().lower() or "auto"
    if device not in {"auto", "cuda", "npu", "cpu", "xpu", "rocm"}:
        raise ConfigError(f"{ENV_DEVICE_TYPE}={device!r}: expected auto/cuda/npu/cpu/xpu/rocm")
    export = env.get(ENV_EXPORT, EXPORT_SIDECAR).strip().lower() or EXPORT_SIDECAR
    if export not in (EXPORT_SIDECAR, EXPORT_IN_PROCESS):
        raise ConfigError(f"{ENV_EXPORT}={export!r}: expected {EXPORT_SIDECAR} or "
                          f"{EXPORT_IN_PROCESS}")
    return Settings(
        export=export,
        enabled=_bool(env, ENV_ENABLED, False),
        receipt_deadline_s=_number(env, ENV_RECEIPT_DEADLINE, 5.0, float, 0.01, 3600.0),
        tier_deadline_s=_number(env, ENV_TIER_DEADLINE, 30.0, float, 0.01, 3600.0),
        buffer_size=int(_number(env, ENV_BUFFER_SIZE, 65536, int, 16, 1 << 24)),
        traffic_sample_ratio=_number(env, ENV_TRAFFIC_RATIO, 1.0, float, 0.0, 1.0),
        roster_cap=int(_number(env, ENV_ROSTER_CAP, 64, int, 1, 4096)),
        drain_interval_s=_number(env, ENV_DRAIN_INTERVAL, 0.2, float, 0.001, 10.0),
        device_type=device,
        request_id_key=request_id_key(env),
    )
