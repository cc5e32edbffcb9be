"""Where the block-FP8 MoE kernel's output departs from its twin, stage by stage, on realistic
random inputs (not the tests' snapped values), compiled on a GPU or under the interpreter.

    python -m benchmarks.exp_moe_rounding [--shape tp8|small] [--json PATH]

Per live-row count: stage 1 (FP32 SiLU(gate)·up) kernel vs twin (relative L2, max relative);
the share of the intermediate's E4M3 codes that differ once each side's intermediate is
quantized (kernels/moe.py's requant, reference quantize_act); the whole op (bf16) vs the twin
(relative L2) and its `kernels.moe.e2e` margin; and a real error of about that size — one
routed expert's gate/up scales × 1.015 — against the unplanted twin, with the row's verdict.

Inputs: x ~ N(0, 1) bf16 [R, H]; E4M3 weights from uniform random bytes (exponent field ≤ 7,
benchmarks/rank/weights.py's rule) with 1 / (rms · √K) block scales; distinct top-K ids per
row; router weights softmax-like, positive, summing to 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

SHAPES = {"tp8": dict(hidden=3072, experts=256, top_k=8, inter=192),
          "small": dict(hidden=256, experts=16, top_k=4, inter=192)}


def _weights(g: torch.Generator, e: int, n: int, k: int):
    from benchmarks.rank.weights import E4M3_MASK, e4m3_code_rms

    raw = torch.randint(0, 256, (e, n, k), generator=g, dtype=torch.int32)
    w = raw.bitwise_and(E4M3_MASK).to(torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((e, -(-n // 128), -(-k // 128)), 1.0 / (e4m3_code_rms() * math.sqrt(k)))
    return w, s


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run(shape: str, rows: int, live: int, seed: int, device) -> dict:
    from kernels.moe import moe_fp8, moe_gate_up_fp8
    from qualification.tolerances import measure, tolerance
    from reference import ops
    from reference.twins.moe import moe_fp8_ref, moe_gate_up_fp8_ref

    sh = SHAPES[shape]
    h, e, k, i = sh["hidden"], sh["experts"], sh["top_k"], sh["inter"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).int()
    w = torch.rand(rows, k, generator=g) + 0.05
    w = w / w.sum(-1, keepdim=True)
    fc, fc_s = _weights(g, e, 2 * i, h)
    proj, proj_s = _weights(g, e, h, i)
    n = torch.tensor([live], dtype=torch.int32)
    dev = [t.to(device) for t in (x, w, ids, fc, fc_s, proj, proj_s, n)]
    a_k = moe_gate_up_fp8(dev[0], dev[2], dev[3], dev[4], dev[7]).cpu()[: live * k]
    a_t = moe_gate_up_fp8_ref(x, ids, fc, fc_s, n)
    q_k, _ = ops.quantize_act(a_k)
    q_t, _ = ops.quantize_act(a_t)
    flips = (q_k.view(torch.uint8) != q_t.view(torch.uint8)).float().mean().item()
    o_k = moe_fp8(*dev).cpu()[:live]
    o_t = moe_fp8_ref(x, w, ids, fc, fc_s, proj, proj_s, n)
    tol = tolerance("kernels.moe.e2e", "bf16")
    out = {"shape": shape, "rows": rows, "live": live, "device": str(device),
           "interpret": os.environ.get("TRITON_INTERPRET", ""),
           "gate_up_rel_l2": _rel_l2(a_k, a_t),
           "gate_up_max_rel": float((a_k - a_t).abs().max() / a_t.abs().max()),
           "requant_code_flips": flips,
           "e2e_rel_l2": _rel_l2(o_k, o_t), "e2e_margin": str(measure(o_k, o_t, tol))}
    planted = fc_s.clone()
    planted[int(ids[0, 0])] *= 1.015  # one routed expert's gate/up scales off by 1.5 %
    o_p = moe_fp8(dev[0], dev[1], dev[2], dev[3], planted.to(device), dev[5], dev[6],
                  dev[7]).cpu()[:live]
    m = measure(o_p, o_t, tol)
    out.update(planted_rel_l2=_rel_l2(o_p, o_t), planted_margin=str(m), planted_caught=not m.ok)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.exp_moe_rounding",
                                 description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tp8")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = []
    for live, seed in ((1, 11), (6, 12), (8, 13)):
        r = run(a.shape, 8, live, seed, device)
        res.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
