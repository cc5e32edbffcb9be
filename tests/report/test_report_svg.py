"""The tiny SVG writer: ticks cover the data, bars and lines land where the axes say, NaN
leaves gaps, error bars span their intervals, counts and hollow markers show, bad series and
bad intervals are rejected."""

import math
import re
import xml.etree.ElementTree as ET

import pytest

from iquestrt.report.svg import ErrorStyle, Frame, PointErrors, bar_chart, line_chart, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("lo, hi", [(0, 1), (0, 0.37), (3.2, 17.9), (0, 24), (-2.5, 0.1),
                                     (0, 1e-4), (5, 5)])
def test_ticks_cover_the_range(lo, hi):
    t = nice_ticks(lo, hi)
    assert t[0] <= lo and t[-1] >= hi and 2 <= len(t) <= 12
    steps = {round(b - a, 9) for a, b in zip(t, t[1:], strict=False)}
    assert len(steps) == 1  # evenly spaced


def test_bar_heights_follow_the_axis():
    f = Frame()
    svg = ET.fromstring(bar_chart("t", ["a", "b"], {"s": [1.0, 0.5], "u": [0.25, math.nan]},
                                  "x", "y", f))
    bars = [r for r in svg.iter(NS + "rect") if r.find(NS + "title") is not None]
    assert len(bars) == 3  # the NaN bar is left out
    heights = [float(r.get("height")) for r in bars]
    # the ticks run 0 … 1, so a bar of 1.0 spans the plot and 0.5 half of it
    assert heights[0] == pytest.approx(f.plot_h, abs=0.1)
    assert heights[1] == pytest.approx(f.plot_h / 4, abs=0.1)  # series u, category a
    assert heights[2] == pytest.approx(f.plot_h / 2, abs=0.1)  # series s, category b


def test_nan_breaks_a_line_and_legend_lists_series():
    svg = ET.fromstring(line_chart("t", [1, 2, 3, 4, 5], {"a": [1, 2, math.nan, 4, 5],
                                                          "b": [1, 1, 1, 1, 1]}, "x", "y",
                                   dashed=frozenset({"b"})))
    lines = list(svg.iter(NS + "polyline"))
    assert len(lines) == 3  # a: two runs, b: one
    assert [len(p.get("points").split()) for p in lines] == [2, 2, 5]
    assert lines[2].get("stroke-dasharray") is not None
    texts = [t.text for t in svg.iter(NS + "text")]
    assert "a" in texts and "b" in texts and "t" in texts


def test_mismatched_series_are_rejected():
    with pytest.raises(ValueError, match="series 's' has 1 values for 2 categories"):
        bar_chart("t", ["a", "b"], {"s": [1.0]}, "x", "y")
    with pytest.raises(ValueError, match="series 's' has 3 values for 2 x values"):
        line_chart("t", [1, 2], {"s": [1, 2, 3]}, "x", "y")
    with pytest.raises(ValueError, match="no x values"):
        line_chart("t", [], {}, "x", "y")


def _numbers(d: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", d)]


def test_error_bars_counts_and_hollow_points():
    f, style = Frame(), ErrorStyle(min_n=20, hollow="n < 20 rounds")
    errs = {"a": PointErrors((0.0, 0.25, math.nan), (1.0, 0.75, math.nan), (40, 8, 0)),
            "b": PointErrors((0.1, 0.2, 0.3), (0.5, 0.6, 0.7), (30, 30, 30))}
    svg_text = line_chart("t", [1, 2, 3], {"a": [0.5, 0.5, math.nan], "b": [0.3, 0.4, 0.5]},
                          "x", "y", errors=errs, style=style)
    svg = ET.fromstring(svg_text)
    assert int(svg.get("height")) == f.height + 2 * style.row_h  # one count row per series
    bars = [p for p in svg.iter(NS + "path") if p.get("class") == "errorbar"]
    assert len(bars) == 2 + 3  # a's third point is missing
    # ticks run 0 … 1, so v sits at top + plot_h · (1 − v); the bar goes from lo up to hi
    for bar, (lo, hi) in zip(bars, [(0.0, 1.0), (0.25, 0.75), (0.1, 0.5), (0.2, 0.6),
                                    (0.3, 0.7)], strict=True):
        nums = _numbers(bar.get("d"))
        assert nums[1] == pytest.approx(f.top + f.plot_h * (1 - lo), abs=0.06)
        assert nums[2] == pytest.approx(f.top + f.plot_h * (1 - hi), abs=0.06)
    points = [c for c in svg.iter(NS + "circle") if (c.get("class") or "").startswith("point")]
    assert [c.get("class") for c in points] == ["point", "point hollow", "point", "point",
                                                "point"]
    assert points[1].get("fill") == "white" and points[0].get("fill") != "white"
    # a and b are dodged apart at the same x
    assert float(points[0].get("cx")) < float(points[2].get("cx"))
    counts = [t.text for t in svg.iter(NS + "text") if t.get("class") == "count"]
    assert counts == ["40", "8", "0", "30", "30", "30"]
    texts = [t.text for t in svg.iter(NS + "text")]
    assert "n < 20 rounds" in texts and "95 % interval" in texts
    # no hollow point, no hollow note
    quiet = ET.fromstring(line_chart("t", [1, 2, 3], {"b": [0.3, 0.4, 0.5]}, "x", "y",
                                     errors={"b": errs["b"]}, style=style))
    assert "n < 20 rounds" not in [t.text for t in quiet.iter(NS + "text")]


def test_error_bars_widen_the_axis():
    svg = ET.fromstring(line_chart("t", [1, 2], {"a": [2.0, 3.0]}, "x", "y",
                                   errors={"a": PointErrors((1.0, 2.5), (2.5, 7.2), (5, 5))}))
    ticks = [float(t.text) for t in svg.iter(NS + "text") if t.get("text-anchor") == "end"
             and t.text.replace(".", "").isdigit()]
    assert max(ticks) >= 7.2


@pytest.mark.parametrize("errors, match", [
    ({"a": PointErrors((0.0,), (1.0,), (1,))}, "have 1/1/1 lo/hi/n for 2 x values"),
    ({"z": PointErrors((0.0, 0.0), (1.0, 1.0), (1, 1))}, "errors for 'z', which is no series"),
    ({"a": PointErrors((0.0, 0.6), (1.0, 0.5), (1, 1))}, "outside its interval"),
    ({"a": PointErrors((0.0, 0.1), (1.0, 0.4), (1, 1))}, "value 0.5 outside its interval"),
])
def test_bad_errors_are_rejected(errors, match):
    with pytest.raises(ValueError, match=match):
        line_chart("t", [1, 2], {"a": [0.5, 0.5]}, "x", "y", errors=errors)
