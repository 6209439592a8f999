"""Small inline-SVG drawing helpers for the HTML report (standard library only).

Scales (linear and log10) with readable tick positions, axis drawing and
number formatting. Every string that reaches the markup goes through ``esc``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape


def esc(value: object) -> str:
    """Text or attribute value, escaped for HTML/SVG (quotes included)."""
    return escape(str(value), quote=True)



def f1(x: float) -> str:
    """A coordinate with at most one decimal."""
    s = f"{x:.1f}"
    return s[:-2] if s.endswith(".0") else s


def nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw``."""
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * mag >= raw * (1 - 1e-9):
            return m * mag
    return 10 * mag


def fmt_num(x: float) -> str:
    """Compact tick label: 0, 0.05, 12.5, 300, 12k, 3.5M."""
    if x == 0:
        return "0"
    ax = abs(x)
    if ax >= 1e9:
        return _trim(x / 1e9) + "G"
    if ax >= 1e6:
        return _trim(x / 1e6) + "M"
    if ax >= 1e4:
        return _trim(x / 1e3) + "k"
    if ax >= 1:
        return _trim(x)
    return f"{x:.6g}"


def _trim(x: float) -> str:
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return s or "0"


def fmt_bytes(n: float) -> str:
    """Decimal units (kB = 1000 bytes), as MB/s is."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{_trim(n / size)} {unit}"
    return f"{_trim(n)} B"


def fmt_ms(ms: float) -> str:
    if abs(ms) >= 100:
        return f"{ms:.1f} ms"
    if abs(ms) >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


class LinearScale:
    """``lo..hi`` onto ``px0..px1``. The domain is widened to whole tick steps,
    unless ``tight`` (then ticks are the step multiples inside it)."""

    def __init__(self, lo: float, hi: float, px0: float, px1: float, ticks: int = 8,
                 tight: bool = False) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = 0.0, 1.0
        if hi <= lo:
            hi = lo + (abs(lo) * 0.1 or 1.0)
        self.step = nice_step((hi - lo) / max(ticks, 1))
        if tight:
            self.lo, self.hi = lo, hi
        else:
            self.lo = math.floor(lo / self.step + 1e-9) * self.step
            self.hi = math.ceil(hi / self.step - 1e-9) * self.step
        self.px0, self.px1 = px0, px1

    def __call__(self, v: float) -> float:
        return self.px0 + (v - self.lo) / (self.hi - self.lo) * (self.px1 - self.px0)

    def ticks(self) -> list[float]:
        first = math.ceil(self.lo / self.step - 1e-9)
        last = math.floor(self.hi / self.step + 1e-9)
        return [round(i * self.step, 12) for i in range(first, last + 1)]


class LogScale:
    """log10 scale over decades that cover [lo, hi] (both > 0)."""

    def __init__(self, lo: float, hi: float, px0: float, px1: float) -> None:
        lo = lo if lo > 0 and math.isfinite(lo) else 1.0
        hi = hi if hi > 0 and math.isfinite(hi) else lo
        self.d0 = math.floor(math.log10(lo))
        self.d1 = math.ceil(math.log10(hi))
        if self.d1 <= self.d0:
            self.d1 = self.d0 + 1
        self.lo, self.hi = 10.0 ** self.d0, 10.0 ** self.d1
        self.px0, self.px1 = px0, px1

    def __call__(self, v: float) -> float:
        v = max(v, 1e-300)
        frac = (math.log10(v) - self.d0) / (self.d1 - self.d0)
        return self.px0 + frac * (self.px1 - self.px0)

    def ticks(self) -> list[float]:
        decades = self.d1 - self.d0
        every = 1 if decades <= 8 else math.ceil(decades / 8)
        mults = (1, 2, 5) if decades <= 2 else (1,)
        out = []
        for d in range(self.d0, self.d1 + 1, every):
            for m in mults:
                v = m * 10.0 ** d
                if v <= self.hi * (1 + 1e-9):
                    out.append(v)
        return out


def x_axis(scale: LinearScale | LogScale, y: float, y_grid_top: float,
           fmt: Callable[[float], str], title: str, title_y: float | None = None) -> str:
    """Bottom axis with gridlines up to ``y_grid_top`` and tick labels below ``y``."""
    parts = [f'<line class="axis" x1="{f1(scale.px0)}" y1="{f1(y)}" '
             f'x2="{f1(scale.px1)}" y2="{f1(y)}"/>']
    for t in scale.ticks():
        x = f1(scale(t))
        parts.append(f'<line class="grid" x1="{x}" y1="{f1(y_grid_top)}" x2="{x}" y2="{f1(y)}"/>')
        parts.append(f'<line class="axis" x1="{x}" y1="{f1(y)}" x2="{x}" y2="{f1(y + 4)}"/>')
        parts.append(f'<text class="tick" x="{x}" y="{f1(y + 15)}" '
                     f'text-anchor="middle">{esc(fmt(t))}</text>')
    if title:
        ty = title_y if title_y is not None else y + 31
        parts.append(f'<text class="axis-title" x="{f1((scale.px0 + scale.px1) / 2)}" '
                     f'y="{f1(ty)}" text-anchor="middle">{esc(title)}</text>')
    return "".join(parts)


def y_axis(scale: LinearScale | LogScale, x: float, x_grid_right: float,
           fmt: Callable[[float], str], title: str) -> str:
    """Left axis (``scale`` maps values to y pixels) with horizontal gridlines."""
    parts = [f'<line class="axis" x1="{f1(x)}" y1="{f1(scale.px0)}" '
             f'x2="{f1(x)}" y2="{f1(scale.px1)}"/>']
    for t in scale.ticks():
        y = f1(scale(t))
        parts.append(f'<line class="grid" x1="{f1(x)}" y1="{y}" x2="{f1(x_grid_right)}" y2="{y}"/>')
        parts.append(f'<line class="axis" x1="{f1(x - 4)}" y1="{y}" x2="{f1(x)}" y2="{y}"/>')
        parts.append(f'<text class="tick" x="{f1(x - 7)}" y="{y}" text-anchor="end" '
                     f'dominant-baseline="middle">{esc(fmt(t))}</text>')
    if title:
        cy = (scale.px0 + scale.px1) / 2
        parts.append(f'<text class="axis-title" x="{f1(x - 48)}" y="{f1(cy)}" '
                     f'text-anchor="middle" transform="rotate(-90 {f1(x - 48)} {f1(cy)})">'
                     f'{esc(title)}</text>')
    return "".join(parts)


MARKERS = ("circle", "square", "triangle", "diamond", "triangle-down", "cross")


def marker(shape: str, x: float, y: float, r: float, attrs: str, title: str = "") -> str:
    """A point marker; ``attrs`` is trusted markup (class/fill), ``title`` is escaped."""
    t = f"<title>{esc(title)}</title>" if title else ""
    if shape == "circle":
        return f'<circle cx="{f1(x)}" cy="{f1(y)}" r="{f1(r)}" {attrs}>{t}</circle>'
    if shape == "square":
        return (f'<rect x="{f1(x - r * .9)}" y="{f1(y - r * .9)}" width="{f1(r * 1.8)}" '
                f'height="{f1(r * 1.8)}" {attrs}>{t}</rect>')
    if shape == "cross":
        a, b = r * 1.1, r * 0.4
        pts = [(-b, -a), (b, -a), (b, -b), (a, -b), (a, b), (b, b), (b, a), (-b, a),
               (-b, b), (-a, b), (-a, -b), (-b, -b)]
    elif shape == "diamond":
        pts = [(0, -r * 1.25), (r * 1.25, 0), (0, r * 1.25), (-r * 1.25, 0)]
    elif shape == "triangle-down":
        pts = [(-r * 1.15, -r * .8), (r * 1.15, -r * .8), (0, r * 1.2)]
    else:  # triangle
        pts = [(-r * 1.15, r * .8), (r * 1.15, r * .8), (0, -r * 1.2)]
    p = " ".join(f"{f1(x + dx)},{f1(y + dy)}" for dx, dy in pts)
    return f'<polygon points="{p}" {attrs}>{t}</polygon>'
