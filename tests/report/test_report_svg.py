"""The tiny SVG writer: ticks cover the data, bars and lines land where the axes say, NaN
leaves gaps, bad series are rejected."""

import math
import xml.etree.ElementTree as ET

import pytest

from iquestrt.report.svg import Frame, bar_chart, line_chart, nice_ticks

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
