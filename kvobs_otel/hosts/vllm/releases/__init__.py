"""The vLLM releases kvobs-otel supports, and what differs between them.

One module per release series (``v0_32``, ``v0_33``, ``v0_34``), each a
``Release``: the shape of vLLM the seams rely on (classes, methods and their
parameters, dataclass fields) and the few facts that differ (readers the
seams call instead of testing versions). The seams, lifecycles, span and
metric builders never look at a version number; a new vLLM release costs one
module here (and one CI environment).

At patch time ``select()`` picks the release of the installed vLLM and
``check_shape()`` compares its declared shape with what is installed: any
difference refuses observation (one log line, ``kvobs.host.refused``, vLLM
untouched) rather than exporting wrong or partial traces.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# (re-exported: the seams and tests name them from the package)
from kvobs_otel.hosts.vllm.releases.shape import (  # noqa: F401
    BASE_CONNECTOR,
    COMMON,
    CONNECTOR,
    CONNECTOR_WORKER,
    MULTI,
    OFFLOAD_BASE,
    SCHEDULER,
    TIERING,
    Release,
    blocks,
    check_shape,
    parameters,
    resolve,
)

# Refusal reasons (the ``reason`` of kvobs.host.refused).
REFUSED_VERSION = "vllm_version_unsupported"
REFUSED_UNTESTED = "vllm_version_untested"
REFUSED_SHAPE = "vllm_shape_changed"
REFUSAL_REASONS = (REFUSED_VERSION, REFUSED_UNTESTED, REFUSED_SHAPE)

# Newer vLLM than the newest tested release: refused unless this is set, as
# opentelemetry-instrument refuses library versions outside an
# instrumentation's declared range. Even then the shape check must pass.
ENV_ALLOW_UNTESTED = "KVOBS_OTEL_ALLOW_UNTESTED_VLLM"


def supported() -> tuple[Release, ...]:
    from kvobs_otel.hosts.vllm.releases import v0_32, v0_33, v0_34

    return (v0_32.RELEASE, v0_33.RELEASE, v0_34.RELEASE)


def window() -> str:
    """The supported range as a requirement specifier: ``>=0.32.0,<0.35``."""
    rels = supported()
    low, high = rels[0], rels[-1]
    return f">={low.tested},<{high.series[0]}.{high.series[1] + 1}"


def parse_version(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string: "0.34.1rc2" -> (0, 34, 1)."""
    parts = [int(m.group()) if (m := re.match(r"\d+", piece)) else 0
             for piece in version.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


@dataclass
class Selection:
    """What ``select`` decided for an installed vLLM version."""

    version: str
    release: Release | None
    untested: bool = False
    reason: str | None = None  # a REFUSED_* reason when release is None
    detail: str = ""


def select(version: str, env: Mapping[str, str] | None = None) -> Selection:
    """The release adapter for ``version``, or why there is none."""
    env = os.environ if env is None else env
    v = parse_version(version)
    rels = supported()
    for r in rels:
        if v[:2] == r.series:
            return Selection(version, r)
    if v[:2] < rels[0].series:
        return Selection(version, None, reason=REFUSED_VERSION,
                         detail=f"vLLM {version} is older than the oldest supported "
                                f"{rels[0].tested} (supported: vllm{window()})")
    newest = rels[-1]
    if env.get(ENV_ALLOW_UNTESTED, "").strip().lower() in ("1", "true", "yes", "on"):
        return Selection(version, newest, untested=True)
    return Selection(version, None, reason=REFUSED_UNTESTED,
                     detail=f"vLLM {version} is newer than the newest tested "
                            f"{newest.tested} (supported: vllm{window()}); set "
                            f"{ENV_ALLOW_UNTESTED}=1 to try the {newest.name} seams "
                            "(they still refuse if vLLM's shape changed)")


def decide(version: str, env: Mapping[str, str] | None = None) -> Selection:
    """``select``, then the shape check: the release whose seams fit the
    installed vLLM, or why observation must stay off. The one decision
    ``instrument()`` acts on and ``kvobs-otel doctor`` reports."""
    sel = select(version, env)
    if sel.release is not None:
        problems = check_shape(sel.release)
        if problems:
            return Selection(version, None, reason=REFUSED_SHAPE,
                             detail=f"vLLM {version} differs from the {sel.release.name} seams "
                                    f"in {len(problems)} place(s): " + "; ".join(problems))
    return sel
