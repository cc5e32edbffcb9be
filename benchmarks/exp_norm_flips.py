"""Where the norms' bf16 outputs flip against their twins at one TP8 rank's shapes: gate 1b's rank
model (qualification/lockstep_rank.py) decoded once with the kernels' attention tails and row
norms recorded, then per recorded call the flipped elements counted three ways — kernel vs
twin, kernel vs an FP32 torch emulation of the kernel's formula on the same device, twin vs
that emulation — and each flipped attention-tail row diagnosed (its mean square, both inverse
norms, the distinct values that flipped).

    python -m benchmarks.exp_norm_flips [--out DIR] [--keep N]

Output: a table per op (calls, elements, flips of each pair, the largest grid distance), and
DIR/norm_flips.pt: the outputs (kernel and twin) of the N calls of each op with the most
kernel-vs-twin flips, on the CPU (the rank calls' inputs are too large to fetch from a device).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qualification.tolerances import grid_steps


def _cpu(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().cpu().clone()


def _inv_rms_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:  # [R, H] → [R, 1] in FP32
    ms = (x.float() * x.float()).sum(-1, keepdim=True) / x.shape[-1]
    return 1.0 / torch.sqrt(ms + eps)


def _bits(x: float) -> int:
    """Significant bits of an FP32 value's mantissa (trailing zeros dropped)."""
    m = torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0x7FFFFF | 0x800000
    return 24 - (m & -m).bit_length() + 1


def _row_diag(h, f, tf, w, eps: float, layer) -> list[str]:
    """Per row with flips of f: the count, the row's mean square against eps, the FP64 and FP32
    inverse norms and the FP32 one's significant bits, distinct |h| among the flipped."""
    out = []
    for r in range(h.shape[0]):
        bad = (f[r].float() != tf[r].float()).nonzero().flatten()
        if bad.numel() == 0:
            continue
        hd = h[r].double()
        ms = float(hd.pow(2).mean())
        inv64 = 1.0 / (ms + eps) ** 0.5
        inv32 = float(_inv_rms_fp32(h[r : r + 1], eps).cpu())
        vals = h[r, bad].float().abs().unique().numel()
        out.append(f"  flips {layer} row {r}: {bad.numel()} of {h.shape[1]}, distinct |h| {vals}; "
                   f"ms {ms:.3e} (eps {eps:g}); inv fp64 {inv64:.9e} fp32 {inv32:.9e} "
                   f"({_bits(inv32)} significant bits); w distinct {w.float().unique().numel()}; "
                   f"first {bad[:4].tolist()}: h {h[r, bad[:4]].float().tolist()} kernel "
                   f"{f[r, bad[:4]].float().tolist()} twin {tf[r, bad[:4]].float().tolist()}")
    return out


def _flips(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    s = grid_steps(a.cpu(), b.cpu(), "bf16")
    return int((s > 0).sum()), float(s.max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.exp_norm_flips", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("norm_flips"))
    ap.add_argument("--keep", type=int, default=2, help="calls per op whose outputs are saved")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from qualification import lockstep as ls
    from qualification import lockstep_rank

    calls: dict[str, list[dict]] = {"attn_tail": [], "norm_rows": []}
    real_tail, real_rows = ls.Lockstep.attn_tail, ls.Lockstep.norm_rows

    def attn_tail(self, parts, xn, aon, ffn, live, flag, **kw):
        got = real_tail(self, parts, xn, aon, ffn, live, flag, **kw)
        want = self.t.attn_tail(parts, xn, aon, ffn, live, flag.clone(), **kw)
        n = live.n
        h, f = got.h[:n], got.f_in[:n]
        emul = (h.float() * _inv_rms_fp32(h, kw["eps"]) * ffn.float()).to(torch.bfloat16)
        diag = _row_diag(h, f, want.f_in[:n], ffn, kw["eps"], self.layer)
        if diag:
            print("\n".join(diag), flush=True)
        calls["attn_tail"].append(dict(
            layer=self.layer, n=n, hidden=h.shape[-1], h=_cpu(h), f_in=_cpu(f),
            twin_h=_cpu(want.h[:n]), twin_f_in=_cpu(want.f_in[:n]),
            pairs={"h kernel vs twin": _flips(h, want.h[:n]),
                   "f kernel vs twin": _flips(f, want.f_in[:n]),
                   "f kernel vs fp32 emulation": _flips(f, emul),
                   "f twin vs fp32 emulation (kernel's h)": _flips(want.f_in[:n], emul)}))
        return got

    def norm_rows(self, x, w, live, eps, **kw):
        got = real_rows(self, x, w, live, eps, **kw)
        want = self.t.norm_rows(x, w, live, eps, **{**kw, "y_out": None})
        n = live.n
        pairs = {}
        if got[1] is not None and got[1].dtype == torch.bfloat16 and kw.get("b") is None:
            y, ty = got[1][:n], want[1][:n]
            emul = (x[:n].float() * _inv_rms_fp32(x[:n], eps) * w.float()).to(torch.bfloat16)
            pairs = {"y kernel vs twin": _flips(y, ty), "y kernel vs fp32 emulation":
                     _flips(y, emul), "y twin vs fp32 emulation": _flips(ty, emul)}
        elif got[1] is not None and got[1].dtype == torch.bfloat16:
            pairs = {"y kernel vs twin (with b)": _flips(got[1][:n], want[1][:n])}
        calls["norm_rows"].append(dict(
            layer=self.layer, n=n, hidden=x.shape[-1], eps=eps, out=[_cpu(t) for t in got],
            twin=[_cpu(t) for t in want], x_dtype=str(x.dtype), pairs=pairs))
        return got

    ls.Lockstep.attn_tail, ls.Lockstep.norm_rows = attn_tail, norm_rows
    try:
        v = lockstep_rank.verdict()
    finally:
        ls.Lockstep.attn_tail, ls.Lockstep.norm_rows = real_tail, real_rows
    print(f"gate 1b at the rank shapes: {'pass' if v.ok else 'FAIL'} ({v.margin})")
    keep = {}
    for op, rows in calls.items():
        totals: dict[str, list] = {}
        elements = 0
        for c in rows:
            elements += c["n"] * c["hidden"]
            for name, (k, ulps) in c["pairs"].items():
                t = totals.setdefault(name, [0, 0.0, 0])
                t[0], t[1], t[2] = t[0] + k, max(t[1], ulps), t[2] + 1
        print(f"\n{op}: {len(rows)} calls, {elements} live elements")
        print("| pair | calls | flips | share | max grid steps |\n| --- | --- | --- | --- | --- |")
        for name, (k, ulps, nc) in totals.items():
            print(f"| {name} | {nc} | {k} | {k / max(elements, 1):.2e} | {ulps:g} |")
        first = next(iter(rows[0]["pairs"])) if rows and rows[0]["pairs"] else None
        ranked = sorted(rows, key=lambda c: -c["pairs"].get(first, (0, 0))[0]) if first else rows
        keep[op] = ranked[: a.keep]
        for c in keep[op]:
            print(f"  {c['layer']} n={c['n']} {c['pairs']}")
    a.out.mkdir(parents=True, exist_ok=True)
    torch.save(keep, a.out / "norm_flips.pt")
    print(f"\nsaved {a.out / 'norm_flips.pt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
