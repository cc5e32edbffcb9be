"""Dataset building and summaries on hand-made records (no model): distinct-expert windows against
brute force, padding, depth-0 decodes, bad inputs."""

import math
import xml.etree.ElementTree as ET

import pytest
import torch

from iquestrt.report.dataset import build_dataset, distinct_experts
from iquestrt.report.decode import Decoded
from iquestrt.report.prompts import Prompt
from iquestrt.report.summary import blocks, write_summary
from reference.depth import DraftInfo
from reference.speculative import GenerationResult, RoundRecord


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


ATTRS = {"experts_per_token": 4, "timing": "t", "routing": "r", "policies": "p"}


def test_padding_and_depth_zero():
    a = _decoded("fixed-3", [([0.9, 0.5, 0.2], 2, 3), ([0.8, 0.1, 0.1], 3, 4), ([0.3] * 3, 0, 1)])
    z = _decoded("fixed-0", [([], 0, 1)] * 5)
    ds = build_dataset([a, z], 24, list(range(1, 8)), ATTRS)
    assert ds.sizes == {"request": 2, "round": 5, "depth": 3, "layer": 7, "rows": 8}
    assert ds.accepted_drafts[0].values.tolist() == [2, 3, 0, -1, -1]
    assert ds.draft_accepted[0, 0].values.tolist() == [1, 1, 0]
    assert ds.depth_acceptance[0].values.tolist() == [2 / 3, 2 / 3, 1 / 3]
    assert ds.depth_acceptance_conditional[0].values.tolist() == [2 / 3, 1.0, 1 / 2]
    assert (ds.chosen_depth[1] == 0).all() and ds.depth_acceptance[1].isnull().all()
    assert (ds.draft_token[1] == -1).all()
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


def test_round_times_must_match_rounds():
    a = _decoded("fixed-3", [([0.9, 0.5, 0.2], 2, 3)])
    a.round_end_s.append(1.0)
    with pytest.raises(ValueError, match="1 rounds but 2 round times"):
        build_dataset([a], 24, list(range(1, 8)), ATTRS)
    with pytest.raises(ValueError, match="no decoded requests"):
        build_dataset([], 24, [1], ATTRS)
