"""Where two greedy runs (TP-N and one rank) part, the token they part at must be a near-tie:
the matched reference's logit gap between the two tokens at that position within m × how far
the matched design's own rounding moved that gap from FP32's (gate 1's band, for this gap)."""

from __future__ import annotations

import torch

from reference.model import ReferenceModel

MULTIPLE = 3.0


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def near_tie(ck, prefix: list[int], x: int, y: int) -> tuple[float, float]:
    """(|gap| of tokens x, y after prefix in the matched reference, allowed)."""
    params = ck.dequantized()
    toks = torch.tensor(prefix)
    lg = {p: ReferenceModel(ck.cfg, params, p).target(toks, torch.arange(len(prefix)),
                                                      None).logits[-1].double()
          for p in ("matched", "fp32")}
    gm, gf = lg["matched"][x] - lg["matched"][y], lg["fp32"][x] - lg["fp32"][y]
    return float(gm.abs()), MULTIPLE * float((gm - gf).abs())


def check_greedy(ck, prompt: list[int], got: list[int], want: list[int]) -> str:
    """'' when equal; else a description of the first flip, raising if it is not a near-tie."""
    i = first_difference(got, want)
    if i is None:
        assert len(got) == len(want), (len(got), len(want))
        return ""
    gap, allowed = near_tie(ck, prompt + want[:i], got[i], want[i])
    line = (f"greedy tokens part at {i}: {got[i]} vs {want[i]}, matched gap {gap:.4f} vs "
            f"allowed {allowed:.4f}")
    assert gap <= allowed, line
    return line
