"""A tiny SVG chart writer (no plotting library is installed): grouped bars and lines with
axes, ticks, labels and a legend. Each function returns one self-contained <svg> element.
NaN values are left out (a gap in a line, no bar).

A line chart can carry, per series, an interval and a count behind every point (PointErrors):
vertical bars with caps, a row of counts under the x axis per series, and hollow markers for
points whose count is below ErrorStyle.min_n, with a legend note saying so. Series with errors
are dodged sideways a few pixels so that their bars do not hide each other. Elements carry a
class ("point", "point hollow", "errorbar", "count") for tests and style sheets.
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class PointErrors:
    """One series' uncertainty: per x value the interval [lo, hi] and the count n behind it
    (NaN bounds where the point is missing)."""
    lo: tuple[float, ...]
    hi: tuple[float, ...]
    n: tuple[int, ...]


@dataclass(frozen=True)
class ErrorStyle:
    interval: str = "95 % interval"  # legend text of the bars
    count: str = "n"  # label of the count rows under the x axis
    min_n: int = 0  # points with n < min_n are drawn hollow
    hollow: str = ""  # legend text of a hollow point; default "n < {min_n}"
    dodge: float = 5.0  # px between the x positions of neighbouring series
    row_h: int = 12  # px per count row


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
    def text(x, y, s, size=11, anchor="start", bold=False, rotate=False, fill="",
             cls="") -> str:
        extra = ' font-weight="bold"' if bold else ""
        extra += f' fill="{fill}"' if fill else ""
        extra += f' class="{cls}"' if cls else ""
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

    def legend(self, names: list[str], dashed: set[str], notes: tuple[str, ...] = ()) -> None:
        """One entry per series; then notes: ("bar", text) | ("hollow", text) keys in grey."""
        x0 = self.f.left + self.f.plot_w + 14
        for i, name in enumerate(names):
            y, c = self.f.top + 8 + 16 * i, COLORS[i % len(COLORS)]
            dash = ' stroke-dasharray="4 3"' if name in dashed else ""
            self.parts.append(f'<line x1="{x0}" x2="{x0 + 18}" y1="{y}" y2="{y}" stroke="{c}" '
                              f'stroke-width="3"{dash}/>')
            self.parts.append(self.text(x0 + 24, y + 4, name))
        for i, (kind, text) in enumerate(notes):
            y, xm = self.f.top + 8 + 16 * (len(names) + i) + 6, x0 + 9
            if kind == "bar":
                self.parts.append(f'<line x1="{xm}" x2="{xm}" y1="{y - 6}" y2="{y + 6}" '
                                  'stroke="#555"/>')
            else:
                self.parts.append(f'<circle cx="{xm}" cy="{y}" r="3.5" fill="white" '
                                  'stroke="#555" stroke-width="1.5"/>')
            self.parts.append(self.text(x0 + 24, y + 4, text))

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


def _check_errors(title: str, x: list[float], errors: dict[str, PointErrors],
                  series: dict[str, list[float]]) -> None:
    for name, e in errors.items():
        if name not in series:
            raise ValueError(f"line_chart {title!r}: errors for {name!r}, which is no series")
        if not len(e.lo) == len(e.hi) == len(e.n) == len(x):
            raise ValueError(f"line_chart {title!r}: errors of {name!r} have {len(e.lo)}/"
                             f"{len(e.hi)}/{len(e.n)} lo/hi/n for {len(x)} x values")
        for lo, hi, v in zip(e.lo, e.hi, series[name], strict=True):
            v = float(v)
            if lo > hi or (math.isfinite(lo) and math.isfinite(v) and not lo <= v <= hi):
                raise ValueError(f"line_chart {title!r}: {name!r} has value {v} outside its "
                                 f"interval [{lo}, {hi}]")


def line_chart(title: str, x: list[float], series: dict[str, list[float]], xlabel: str,
               ylabel: str, dashed: frozenset[str] = frozenset(), frame: Frame = Frame(),
               y_from_zero: bool = True, errors: dict[str, PointErrors] | None = None,
               style: ErrorStyle = ErrorStyle()) -> str:
    """Lines over shared x values with point markers; NaN breaks a line. `errors` (some or all
    series): intervals, counts and hollow markers (module docstring)."""
    if not x:
        raise ValueError(f"line_chart {title!r}: no x values")
    for name, vals in series.items():
        if len(vals) != len(x):
            raise ValueError(f"line_chart {title!r}: series {name!r} has {len(vals)} values for "
                             f"{len(x)} x values")
    errors = errors or {}
    _check_errors(title, x, errors, series)
    if errors:  # room for one count row per series with errors
        extra = style.row_h * len(errors)
        frame = dataclasses.replace(frame, height=frame.height + extra,
                                    bottom=frame.bottom + extra)
    c = _Canvas(frame, title, xlabel, ylabel)
    bounds = [v for e in errors.values() for v in (*e.lo, *e.hi)]
    c.y_axis(_y_ticks([v for vals in series.values() for v in vals] + bounds,
                      zero=y_from_zero))
    f, x0, x1 = frame, min(x), max(x)
    span = (x1 - x0) or 1.0

    def px(v: float) -> float:
        return f.left + 10 + (f.plot_w - 20) * (v - x0) / span

    for t in x:
        c.parts.append(c.text(px(t), f.top + f.plot_h + 14, _fmt(t), anchor="middle"))
    with_err = [name for name in series if name in errors]
    hollow_seen = False
    for j, (name, vals) in enumerate(series.items()):
        col, dash = COLORS[j % len(COLORS)], ' stroke-dasharray="4 3"' if name in dashed else ""
        e = errors.get(name)
        dx = 0.0 if e is None else style.dodge * (with_err.index(name) - (len(with_err) - 1) / 2)
        runs, run = [], []
        for i, (t, v) in enumerate(zip(x, vals, strict=True)):
            if v is not None and math.isfinite(float(v)):
                run.append((i, px(t) + dx, c.y(float(v))))
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        for r in runs:
            pts = " ".join(f"{a:.1f},{b:.1f}" for _, a, b in r)
            c.parts.append(f'<polyline points="{pts}" fill="none" stroke="{col}" '
                           f'stroke-width="2"{dash}/>')
            for i, a, b in r:
                if e is None:
                    c.parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{col}"/>')
                    continue
                lo, hi, n = e.lo[i], e.hi[i], e.n[i]
                if math.isfinite(lo) and math.isfinite(hi):
                    ylo, yhi = c.y(lo), c.y(hi)
                    c.parts.append(
                        f'<path class="errorbar" d="M{a:.1f},{ylo:.1f}V{yhi:.1f}M{a - 3:.1f},'
                        f'{ylo:.1f}h6M{a - 3:.1f},{yhi:.1f}h6" stroke="{col}" fill="none"/>')
                few = n < style.min_n
                hollow_seen |= few
                fill = ' fill="white" stroke-width="1.5"' if few else f' fill="{col}"'
                c.parts.append(
                    f'<circle class="point{" hollow" if few else ""}" cx="{a:.1f}" '
                    f'cy="{b:.1f}" r="3.5" stroke="{col}"{fill}><title>'
                    f'{escape(name)} at {_fmt(x[i])}: {float(vals[i]):.4g} [{lo:.4g}, {hi:.4g}]'
                    f', {style.count} = {n}</title></circle>')
    for row, name in enumerate(with_err):
        col = COLORS[list(series).index(name) % len(COLORS)]
        y = f.top + f.plot_h + 14 + style.row_h * (row + 1)
        c.parts.append(c.text(f.left - 6, y, style.count, anchor="end", fill=col))
        for t, n in zip(x, errors[name].n, strict=True):
            c.parts.append(c.text(px(t), y, int(n), size=9, anchor="middle", fill=col,
                                  cls="count"))
    notes = (("bar", style.interval),) if errors else ()
    if hollow_seen:
        notes += (("hollow", style.hollow or f"{style.count} < {style.min_n}"),)
    c.legend(list(series), set(dashed), notes)
    return c.done()
