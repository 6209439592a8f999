"""What every benchmark shares: goals and results, robust statistics,
progress on stderr, and the clean process environment a run needs."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_T0 = time.monotonic()


def progress(message: str) -> None:
    """One progress line on stderr (stdout is for the results)."""
    sys.stderr.write(f"[{time.monotonic() - _T0:7.1f}s] {message}\n")
    sys.stderr.flush()


# -- statistics ------------------------------------------------------------------------
def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """Median and spread of a repeated measurement."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan, 0)
        return cls(quantile(vals, 0.5), quantile(vals, 0.25), quantile(vals, 0.75),
                   min(vals), max(vals), len(vals))

    def text(self, fmt: str = ".3f", unit: str = "") -> str:
        f = f"{{:{fmt}}}"
        return (f"{f.format(self.median)}{unit} (IQR {f.format(self.p25)}-{f.format(self.p75)}, "
                f"min-max {f.format(self.min)}-{f.format(self.max)}, n={self.n})")


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a[i] / b[i] for samples taken side by side (same round)."""
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated by ``k``: each round starts with another variant, so
    no variant always runs first (cold caches) or last."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


# -- goals and results -------------------------------------------------------------------
@dataclass
class Goal:
    """One goal of the issue: ``value`` (the median of ``spread``) against
    ``target`` with ``op`` (``<=`` or ``>=``)."""

    name: str
    spread: Spread
    op: str
    target: float
    unit: str = "x"
    fmt: str = ".3f"
    note: str = ""

    @property
    def value(self) -> float:
        return self.spread.median

    @property
    def met(self) -> bool:
        v = self.value
        if math.isnan(v):
            return False
        return v <= self.target if self.op == "<=" else v >= self.target

    def line(self, bench: str) -> str:
        target = f"{self.op} {self.target:g}{self.unit}"
        verdict = "MET" if self.met else "NOT MET"
        return (f"{bench} {self.name}: {self.spread.text(self.fmt, self.unit)}; "
                f"goal {target}: {verdict}")

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit, "op": self.op,
                "target": self.target, "met": self.met, "spread": asdict(self.spread),
                "note": self.note, "fmt": self.fmt}


class Unavailable(Exception):
    """A benchmark that cannot run on this machine (a tool it needs is not
    installed): the run records it as skipped, with the reason."""


@dataclass
class Result:
    """What a benchmark module's ``run(quick)`` returns."""

    bench: str
    title: str
    goals: list[Goal] = field(default_factory=list)
    # Figures without a goal of their own, printed as "info" lines.
    info: list[str] = field(default_factory=list)
    # Everything else worth keeping (settings, raw samples, counters).
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "seconds": round(self.seconds, 1),
                "goals": [g.as_json() for g in self.goals], "info": self.info,
                "data": self.data}


# -- processes ---------------------------------------------------------------------------
def clean_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measured process: no user KVOBS_OTEL_/OTEL_
    settings (a KVOBS_OTEL_ENABLED=1 in the shell would instrument the
    "uninstrumented" variant), quiet vLLM, and this checkout first on the
    import path (not an installed copy of kvobs_otel)."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if not k.startswith(("KVOBS_OTEL_", "OTEL_"))}
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    # One hash seed for every measured process: the same dict and set
    # orders everywhere, so every variant does exactly the same work.
    env["PYTHONHASHSEED"] = "0"
    # Nothing is exported anywhere: the benchmarks plug their own processors.
    env["OTEL_TRACES_EXPORTER"] = "none"
    env["OTEL_METRICS_EXPORTER"] = "none"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def apply_clean_env() -> None:
    """``clean_env`` applied to this process (before vLLM is imported)."""
    env = clean_env()
    for k in list(os.environ):
        if k not in env:
            del os.environ[k]
    os.environ.update(env)


def single_thread_torch() -> None:
    """One intra-op torch thread. The harness' CPU copy engine and KV writes
    are torch ops; with two OpenMP threads on a 2-core machine they spin
    against each other and vLLM, giving 100 ms stalls that would swamp any
    overhead being measured. (A GPU's copies do not run on the CPU at all.)"""
    import torch

    torch.set_num_threads(1)


def protocol_stream() -> IO[str]:
    """A child's private copy of stdout for its JSON replies; fd 1 itself goes
    to stderr, so whatever vLLM prints cannot corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def reply(stream: IO[str], obj: dict[str, Any]) -> None:
    stream.write(json.dumps(obj) + "\n")
    stream.flush()


def read_status_kib(field_name: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` field in KiB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)
