"""Dataset building and summaries on hand-made records (no model): distinct-expert windows against
brute force, padding, depth-0 decodes, the netCDF file's fill values and units, the HTML
rendering, bad inputs."""

import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
import xarray as xr

from iquestrt.report.dataset import build_dataset, distinct_experts, write_netcdf
from iquestrt.report.decode import Decoded
from iquestrt.report.prompts import Prompt
from iquestrt.report.summary import blocks, write_summary
from reference.depth import DraftInfo
from reference.speculative import GenerationResult, RoundRecord
from tests.report.conftest import wilson95


def _brute(ids: list[list[int]], r: int) -> float:
    if len(ids) < r:
        return math.nan
    c = [len({e for row in ids[s : s + r] for e in row}) for s in range(len(ids) - r + 1)]
    return sum(c) / len(c)


@pytest.mark.parametrize("t", [0, 1, 3, 9, 40])
def test_distinct_experts_against_brute_force(t):
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(t)]) if t else (
        torch.zeros(0, 3, dtype=torch.int64))
    got = distinct_experts(ids, 12)
    want = [_brute(ids.tolist(), r) for r in range(1, 9)]
    for a, b in zip(got, want, strict=True):
        assert a == b or (math.isnan(a) and math.isnan(b))


def _decoded(policy: str, rounds: list[tuple[list[float], int, int]], seed=0, pid="p0"):
    """rounds: (draft probs, accepted, emitted count) each."""
    recs, tokens, pos = [], [], 5
    for probs, a, n in rounds:
        drafts = [DraftInfo(10 + j, p, 0.5 * j) for j, p in enumerate(probs)]
        recs.append(RoundRecord(pos, drafts, a, list(range(n)), a == len(probs)))
        tokens += list(range(n))
        pos += n
    res = GenerationResult(tokens=tokens, rounds=recs)
    routing = torch.arange(7 * len(tokens) * 4).reshape(7, len(tokens), 4) % 24
    ends = [0.5 + 0.1 * k for k in range(len(recs))]
    return Decoded(Prompt(pid, "completion", (1, 2, 3), 3), seed, policy, res, ends,
                   ends[-1] + 0.01, routing)


NS = "{http://www.w3.org/2000/svg}"
ATTRS = {"experts_per_token": 4, "timing": "t", "routing": "r", "policies": "p"}


def test_padding_and_depth_zero():
    a = _decoded("fixed-3", [([0.9, 0.5, 0.2], 2, 3), ([0.8, 0.1, 0.1], 3, 4), ([0.3] * 3, 0, 1)])
    z = _decoded("fixed-0", [([], 0, 1)] * 5)
    ds = build_dataset([a, z], 24, list(range(1, 8)), ATTRS)
    assert ds.sizes == {"request": 2, "round": 5, "depth": 3, "layer": 7, "rows": 8}
    assert ds.accepted_drafts[0].values[:3].tolist() == [2, 3, 0]
    assert ds.accepted_drafts[0].isnull().values.tolist() == [False] * 3 + [True] * 2
    assert ds.draft_accepted[0, 0].values.tolist() == [1, 1, 0]
    assert ds.depth_acceptance[0].values.tolist() == [2 / 3, 2 / 3, 1 / 3]
    assert ds.depth_acceptance_conditional[0].values.tolist() == [2 / 3, 1.0, 1 / 2]
    assert (ds.chosen_depth[1] == 0).all() and ds.depth_acceptance[1].isnull().all()
    assert ds.draft_token[1].isnull().all()
    tp = ds.time_per_output_token_s.values  # (end of last − end of round 0) / tokens after it
    assert tp[0] == (0.5 + 0.2 - 0.5) / 5 and tp[1] == (0.5 + 0.4 - 0.5) / 4
    text = "\n".join(str(b) for b in blocks(ds))
    assert "Only one kind of policy" in text


def test_summary_svgs_are_well_formed(tmp_path):
    a = _decoded("adaptive", [([0.9, 0.5, 0.2, 0.7], 4, 5), ([0.8, 0.1, 0.1], 1, 2)])
    f = _decoded("fixed-3", [([0.9, 0.5, 0.2], 3, 4), ([0.8, 0.1, 0.1], 1, 2)])
    ds = build_dataset([a, f], 24, list(range(1, 8)), ATTRS)
    files = write_summary(ds, tmp_path)
    svgs = [p for p in files if p.suffix == ".svg"]
    assert len(svgs) == 6
    for p in svgs:
        ET.fromstring(p.read_text())  # parses as XML
    md = (tmp_path / "summary.md").read_text()
    assert ds.tokens_per_round.values.tolist() == [7 / 2, 6 / 2]
    assert "| adaptive − fixed-3 | 1 | 0.500 | 1/0/0 |" in md  # the one (prompt, seed) pair
    # per depth: n rounds drafting ≥ j, k accepting ≥ j, k/n, Wilson 95 % (scipy), few-rounds
    for policy, j, n, k in (("adaptive", 1, 2, 2), ("adaptive", 4, 1, 1), ("fixed-3", 2, 2, 1),
                            ("fixed-3", 3, 2, 1)):
        ci = wilson95(k, n)
        row = f"| {policy} | {j} | {n} | {k} | {k / n:.3f} | [{ci[0]:.3f}, {ci[1]:.3f}] | yes |"
        assert row in md, row
    depth_section = md.split("## Per-depth acceptance")[1].split("\n## ")[0]
    assert "| fixed-3 | 4 |" not in depth_section  # no round of fixed-3 drafted 4
    assert "Resting on fewer than 20 rounds" in md and "adaptive j=4 (1 rounds)" in md
    svg = ET.fromstring((tmp_path / "plots" / "depth_acceptance.svg").read_text())
    hollow = [c for c in svg.iter(NS + "circle") if c.get("class") == "point hollow"]
    assert len(hollow) == 4 + 3  # every drawn point rests on < 20 rounds


def test_html_is_the_markdown_rendered(tmp_path):
    a = _decoded("adaptive", [([0.9, 0.5], 2, 3)] * 25)  # 25 rounds: depth 1, 2 not flagged
    f = _decoded("fixed-3", [([0.9, 0.5, 0.2], 1, 2)] * 3)
    ds = build_dataset([a, f], 24, list(range(1, 8)), ATTRS | {"checkpoint": "models/x_y"})
    write_summary(ds, tmp_path)
    html = (tmp_path / "summary.html").read_text()
    md = (tmp_path / "summary.md").read_text()
    assert md.count("\n| ") > 10 and md.startswith("# Acceptance report")  # Markdown source
    tables = sum(line.startswith("|---") for line in md.splitlines())
    assert html.count("<table>") == tables == 4
    assert not [line for line in html.splitlines() if line.startswith(("|", "#"))]
    assert "<h1>Acceptance report</h1>" in html and "<h2>Per-depth acceptance</h2>" in html
    assert "<code>models/x_y</code>" in html and "![" not in html
    assert "<td>fixed-3</td>" in html
    figures = re.findall(r"<figure>\n(.*?)\n</figure>", html, re.S)
    assert len(figures) == 6 and html.count("<svg") == 6
    for svg in figures:
        ET.fromstring(svg)  # inline and well formed


def test_depth_points_on_many_rounds_are_not_flagged(tmp_path):
    a = _decoded("adaptive", [([0.9, 0.5], 2, 3)] * 19 + [([0.9, 0.5], 0, 1)])
    ds = build_dataset([a], 24, list(range(1, 8)), ATTRS)
    write_summary(ds, tmp_path)
    md = (tmp_path / "summary.md").read_text()
    ci = wilson95(19, 20)
    assert f"| adaptive | 2 | 20 | 19 | 0.950 | [{ci[0]:.3f}, {ci[1]:.3f}] |  |" in md
    assert "Every point rests on at least 20 rounds." in md
    svg = ET.fromstring((tmp_path / "plots" / "depth_acceptance.svg").read_text())
    assert not [c for c in svg.iter(NS + "circle") if "hollow" in (c.get("class") or "")]


def test_round_times_must_match_rounds():
    a = _decoded("fixed-3", [([0.9, 0.5, 0.2], 2, 3)])
    a.round_end_s.append(1.0)
    with pytest.raises(ValueError, match="1 rounds but 2 round times"):
        build_dataset([a], 24, list(range(1, 8)), ATTRS)
    with pytest.raises(ValueError, match="no decoded requests"):
        build_dataset([], 24, [1], ATTRS)


# units written out here, not read from the code: a change in the file format shows up as a diff
UNITS = {"prompt_tokens": "tokens", "prompt_tokens_full": "tokens", "new_tokens": "tokens",
         "n_rounds": "rounds", "tokens_per_round": "tokens/round", "wall_s": "s",
         "first_round_s": "s", "time_per_output_token_s": "s/token", "round_position": "tokens",
         "accepted_length": "tokens", "accepted_drafts": "drafts", "chosen_depth": "drafts",
         "round_end_s": "s", "round_latency_s": "s", "draft_prob": "1", "draft_entropy": "nats",
         "depth_acceptance": "1", "depth_acceptance_conditional": "1",
         "distinct_experts": "experts"}
NO_UNITS = {"stop_reason", "bonus", "draft_token", "draft_accepted"}  # a category, flags, ids


def test_netcdf_declares_fill_values_and_units(tmp_path):
    rounds_a = [([0.9, 0.5, 0.2], 2, 3), ([0.8, 0.1, 0.1], 3, 4), ([0.3] * 3, 0, 1)]
    rounds_b = [([0.7], 1, 2)] * 6
    recs = [_decoded("fixed-3", rounds_a), _decoded("fixed-1", rounds_b, pid="p1")]
    ds = build_dataset(recs, 24, list(range(1, 8)), ATTRS)
    write_netcdf(ds, tmp_path / "a.nc")
    with xr.open_dataset(tmp_path / "a.nc") as back:
        assert set(back.data_vars) == set(UNITS) | NO_UNITS
        for name, var in back.data_vars.items():
            assert var.attrs.get("units") == UNITS.get(name), name
        # the naive mean skips what was padded: 3 + 4 + 1 + 6 × 2 emitted over 9 real rounds
        real = [n for _, _, n in rounds_a] + [n for _, _, n in rounds_b]
        assert float(back.accepted_length.mean()) == pytest.approx(sum(real) / len(real),
                                                                   rel=1e-12)
        probs = [p for r in rounds_a + rounds_b for p in r[0]]
        assert float(back.draft_prob.mean()) == pytest.approx(sum(probs) / len(probs), rel=1e-12)
        accepted = [int(j < a) for probs_, a, _ in rounds_a + rounds_b for j in range(len(probs_))]
        assert float(back.draft_accepted.mean()) == pytest.approx(
            sum(accepted) / len(accepted), rel=1e-6)  # int8 on disk reads back as float32
    with xr.open_dataset(tmp_path / "a.nc", mask_and_scale=False) as raw:
        for name, var in raw.data_vars.items():
            padded = bool({"round", "depth", "rows"} & set(var.dims))
            assert ("_FillValue" in var.attrs) == (padded or name in (
                "first_round_s", "time_per_output_token_s")), name
        acc = raw.accepted_length
        assert acc.dtype == np.int32 and int(acc.attrs["_FillValue"]) == -1
        assert acc.values[1].tolist() == [2] * 6 and acc.values[0, 3:].tolist() == [-1] * 3
        assert raw.draft_accepted.dtype == np.int8
        assert np.isnan(raw.draft_prob.attrs["_FillValue"])
        # what an undeclared −1 would do to a naive mean
        assert float(acc.mean()) < sum(real) / len(real) - 0.5
    assert ds.bonus.attrs["flag_meanings"].split() == ["target_row_not_used",
                                                       "extra_target_row"]
