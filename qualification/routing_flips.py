"""Routing flips: which positions of a candidate chose other experts than the matched reference,
and whether each first flip is a near-tie that legal rounding explains (gate 1 on the GPU).

Why: the per-position stability band cannot pass a legal rounding change on the trained mini
model (stability.py): a kernel's other summation order moves a router score across a near-tie,
the position takes another expert, and its logits move by 2–7e-2 relative RMS. Such a position is
excused from the band only when the flip is explained:

  s(p, l)   = the matched reference's router logits at position p, layer l (float64, [E])
  δ(p, l)   = max_e |s(p, l)[e] − s_fp32(p, l)[e]|: how far the matched design's own rounding moved
              this router's scores away from FP32 (the reference's variation, never the
              candidate's error)
  gap(p, l) = max s over ref∖cand − min s over cand∖ref: how far the candidate's ranking moved
  legal ⇔ gap ≤ m · δ + floor

Only the first differing layer of a position is judged; later layers at that position see another
hidden state (consequences, counted). A position whose first flip is not legal fails the gate, as
does a position without any flip that leaves the band.

Dimension letters: T positions, E experts, K experts per token, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.model import ReferenceModel


@dataclass(frozen=True)
class Flip:
    position: int
    layer: int
    gap: float  # in the matched reference's router logits
    allowed: float  # m · δ + floor
    later: int  # further differing layers at this position (consequences)

    @property
    def legal(self) -> bool:
        return self.gap <= self.allowed

    def line(self) -> str:
        return (f"p{self.position} L{self.layer}: gap {self.gap:.2e} "
                f"{'≤' if self.legal else '>'} {self.allowed:.2e}"
                + (f" (+{self.later} later layers)" if self.later else ""))


def _by_layer(trace: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for item in trace:
        out.setdefault(item[0], []).append(item[1:])
    return out


def reference_routes(model: ReferenceModel, tokens: torch.Tensor, with_logits: bool = False):
    """{layer: (router input [T, H] FP32, ids [T, K])} of one plain forward over tokens [T];
    with_logits: (that, the forward's logits [T, V])."""
    model.route_trace = []
    try:
        logits = model.target(tokens, torch.arange(len(tokens)), None).logits
        parts = _by_layer(model.route_trace)
    finally:
        model.route_trace = None
    routes = {i: (torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) for i, v in
              parts.items()}
    return (routes, logits) if with_logits else routes


def runtime_routes(engine, tokens: list[int]):
    """A plain prefill (chunks of the engine's width) → ({layer: ids [T, K] its router chose},
    its logits [T, V] FP32 on the CPU, the caches it filled)."""
    engine.target.route_trace = []
    try:
        logits, _, caches = engine.prefill_logits(tokens)
        parts = _by_layer(engine.target.route_trace)
    finally:
        engine.target.route_trace = None
    return {i: torch.cat([a for (a,) in v]) for i, v in parts.items()}, logits.cpu(), caches


def find(cand: dict[int, torch.Tensor], matched: dict[int, tuple], fp32: dict[int, tuple],
         router_w: dict[int, torch.Tensor], multiple: float, floor: float) -> list[Flip]:
    """The first flip of every position where cand's expert set differs from matched's."""
    layers = sorted(matched)
    if sorted(cand) != layers or sorted(fp32) != layers:
        raise ValueError(f"routing_flips.find: traced layers differ: candidate {sorted(cand)}, "
                         f"matched {layers}, fp32 {sorted(fp32)}")
    T = matched[layers[0]][1].shape[0]
    first: dict[int, Flip] = {}
    for layer in layers:
        c_ids, (m_in, m_ids), (f_in, _) = cand[layer], matched[layer], fp32[layer]
        if c_ids.shape != m_ids.shape:
            raise ValueError(f"routing_flips.find: layer {layer}: candidate ids "
                             f"{tuple(c_ids.shape)} vs matched {tuple(m_ids.shape)}")
        w = router_w[layer].double()  # [E, H]
        for p in range(T):
            a, b = set(m_ids[p].tolist()), set(c_ids[p].tolist())
            if a == b:
                continue
            if p in first:
                f = first[p]
                first[p] = Flip(f.position, f.layer, f.gap, f.allowed, f.later + 1)
                continue
            s = m_in[p].double() @ w.t()  # [E]
            delta = float((s - f_in[p].double() @ w.t()).abs().max())
            gap = float(max(s[e] for e in a - b) - min(s[e] for e in b - a))
            first[p] = Flip(p, layer, gap, multiple * delta + floor, 0)
    return [first[p] for p in sorted(first)]


def between(cand: ReferenceModel, lower: ReferenceModel, fp32: ReferenceModel, multiple: float,
            floor: float = 0.0):
    """tokens [T] → flips of reference `cand` (e.g. bf16-fold) against `lower` (e.g. bf16), δ from
    lower vs fp32: the flip judgement of stability.run for two reference precisions."""
    router = {i: lower.p[f"model.layers.{i}.mlp.router.weight"]
              for i in range(lower.cfg.target.num_hidden_layers)
              if f"model.layers.{i}.mlp.router.weight" in lower.p}

    def flips(tokens: torch.Tensor) -> list[Flip]:
        c = {i: ids for i, (_, ids) in reference_routes(cand, tokens).items()}
        return find(c, reference_routes(lower, tokens), reference_routes(fp32, tokens), router,
                    multiple, floor)

    return flips


def judge(cand: torch.Tensor, allowed: torch.Tensor, flips: list[Flip]) -> tuple[bool, list[str]]:
    """Per position (cand, allowed [T]): inside the band, or excused by a legal first flip.
    → (ok, evidence lines)."""
    by_pos = {f.position: f for f in flips}
    outside = (cand > allowed).nonzero().flatten().tolist()
    unexplained = [p for p in outside if p not in by_pos]
    illegal = [f for f in flips if not f.legal]
    excused = [p for p in outside if p in by_pos and by_pos[p].legal]
    lines = [
        f"routing flips vs matched: {len(flips)} positions ({len(illegal)} not near-ties); "
        f"outside the band: {len(outside)} ({len(excused)} excused by a legal flip, "
        f"{len(unexplained)} without a flip)"
    ]
    if flips:
        lines.append("flips: " + "; ".join(f.line() for f in flips[:12])
                     + (" …" if len(flips) > 12 else ""))
    if unexplained:
        lines.append(f"outside the band without a flip: positions {unexplained[:20]}")
    return not illegal and not unexplained, lines
