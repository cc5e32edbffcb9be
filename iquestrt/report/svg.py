"""A tiny SVG chart writer (no plotting library is installed): grouped bars and lines with
axes, ticks, labels and a legend. Each function returns one self-contained <svg> element.
NaN values are left out (a gap in a line, no bar)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")


@dataclass(frozen=True)
class Frame:
    width: int = 560
    height: int = 320
    left: int = 64
    right: int = 160  # room for the legend
    top: int = 34
    bottom: int = 52

    @property
    def plot_w(self) -> int:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> int:
        return self.height - self.top - self.bottom


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = [round(first, 10)]
    while ticks[-1] < hi - step * 1e-9:  # computed from `first`: no accumulated error
        ticks.append(round(first + len(ticks) * step, 10))
    return ticks


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


class _Canvas:
    def __init__(self, frame: Frame, title: str, xlabel: str, ylabel: str):
        f = self.f = frame
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{f.height}" '
            f'viewBox="0 0 {f.width} {f.height}" font-family="sans-serif" font-size="11">',
            f'<rect width="{f.width}" height="{f.height}" fill="white"/>',
            self.text(f.width / 2, 18, title, size=13, anchor="middle", bold=True),
            self.text(f.left + f.plot_w / 2, f.height - 10, xlabel, anchor="middle"),
            self.text(14, f.top + f.plot_h / 2, ylabel, anchor="middle", rotate=True),
        ]

    @staticmethod
    def text(x, y, s, size=11, anchor="start", bold=False, rotate=False) -> str:
        extra = ' font-weight="bold"' if bold else ""
        if rotate:
            extra += f' transform="rotate(-90 {x:.1f} {y:.1f})"'
        return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"'
                f'{extra}>{escape(str(s))}</text>')

    def y_axis(self, ticks: list[float]) -> None:
        f, lo, hi = self.f, ticks[0], ticks[-1]
        self.ylo, self.yhi = lo, hi
        for t in ticks:
            y = self.y(t)
            self.parts.append(f'<line x1="{f.left}" x2="{f.left + f.plot_w}" y1="{y:.1f}" '
                              f'y2="{y:.1f}" stroke="#e5e5e5"/>')
            self.parts.append(self.text(f.left - 6, y + 4, _fmt(t), anchor="end"))
        self.parts.append(f'<line x1="{f.left}" x2="{f.left}" y1="{f.top}" '
                          f'y2="{f.top + f.plot_h}" stroke="black"/>')
        self.parts.append(f'<line x1="{f.left}" x2="{f.left + f.plot_w}" y1="{f.top + f.plot_h}" '
                          f'y2="{f.top + f.plot_h}" stroke="black"/>')

    def y(self, v: float) -> float:
        f = self.f
        return f.top + f.plot_h * (1 - (v - self.ylo) / (self.yhi - self.ylo))

    def legend(self, names: list[str], dashed: set[str]) -> None:
        x0 = self.f.left + self.f.plot_w + 14
        for i, name in enumerate(names):
            y, c = self.f.top + 8 + 16 * i, COLORS[i % len(COLORS)]
            dash = ' stroke-dasharray="4 3"' if name in dashed else ""
            self.parts.append(f'<line x1="{x0}" x2="{x0 + 18}" y1="{y}" y2="{y}" stroke="{c}" '
                              f'stroke-width="3"{dash}/>')
            self.parts.append(self.text(x0 + 24, y + 4, name))

    def done(self) -> str:
        return "\n".join(self.parts + ["</svg>"]) + "\n"


def _y_ticks(values: list[float], zero: bool) -> list[float]:
    vals = _finite(values) or [0.0, 1.0]
    lo = min(vals + [0.0]) if zero else min(vals)
    return nice_ticks(lo, max(vals))


def bar_chart(title: str, categories: list[str], series: dict[str, list[float]], xlabel: str,
              ylabel: str, frame: Frame = Frame()) -> str:
    """Grouped bars: one group per category, one bar per series (series[name][i] ↔ category i)."""
    for name, vals in series.items():
        if len(vals) != len(categories):
            raise ValueError(f"bar_chart {title!r}: series {name!r} has {len(vals)} values for "
                             f"{len(categories)} categories")
    c = _Canvas(frame, title, xlabel, ylabel)
    c.y_axis(_y_ticks([v for vals in series.values() for v in vals], zero=True))
    f, n = frame, max(len(series), 1)
    group_w = f.plot_w / max(len(categories), 1)
    bar_w = group_w * 0.8 / n
    base = c.y(max(c.ylo, 0.0))
    for i, cat in enumerate(categories):
        gx = f.left + i * group_w
        c.parts.append(c.text(gx + group_w / 2, f.top + f.plot_h + 14, cat, anchor="middle"))
        for j, vals in enumerate(series.values()):
            v = float(vals[i])
            if not math.isfinite(v):
                continue
            x, top = gx + group_w * 0.1 + j * bar_w, c.y(v)
            c.parts.append(f'<rect x="{x:.1f}" y="{min(top, base):.1f}" width="{bar_w:.1f}" '
                           f'height="{abs(base - top):.1f}" fill="{COLORS[j % len(COLORS)]}">'
                           f'<title>{escape(cat)}: {v:.4g}</title></rect>')
    c.legend(list(series), set())
    return c.done()


def line_chart(title: str, x: list[float], series: dict[str, list[float]], xlabel: str,
               ylabel: str, dashed: frozenset[str] = frozenset(), frame: Frame = Frame(),
               y_from_zero: bool = True) -> str:
    """Lines over shared x values with point markers; NaN breaks a line."""
    if not x:
        raise ValueError(f"line_chart {title!r}: no x values")
    c = _Canvas(frame, title, xlabel, ylabel)
    c.y_axis(_y_ticks([v for vals in series.values() for v in vals], zero=y_from_zero))
    f, x0, x1 = frame, min(x), max(x)
    span = (x1 - x0) or 1.0

    def px(v: float) -> float:
        return f.left + 10 + (f.plot_w - 20) * (v - x0) / span

    for t in x:
        c.parts.append(c.text(px(t), f.top + f.plot_h + 14, _fmt(t), anchor="middle"))
    for j, (name, vals) in enumerate(series.items()):
        if len(vals) != len(x):
            raise ValueError(f"line_chart {title!r}: series {name!r} has {len(vals)} values for "
                             f"{len(x)} x values")
        col, dash = COLORS[j % len(COLORS)], ' stroke-dasharray="4 3"' if name in dashed else ""
        runs, run = [], []
        for t, v in zip(x, vals, strict=True):
            if v is not None and math.isfinite(float(v)):
                run.append((px(t), c.y(float(v))))
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        for r in runs:
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in r)
            c.parts.append(f'<polyline points="{pts}" fill="none" stroke="{col}" '
                           f'stroke-width="2"{dash}/>')
            c.parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{col}"/>' for a, b in r]
    c.legend(list(series), set(dashed))
    return c.done()
