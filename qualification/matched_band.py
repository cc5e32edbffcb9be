"""Gate 1's matched band: the kernels against the matched reference (the same quantization
points), within the matched reference's own variation under legal rounding.

On the trained mini model one E4M3 flip — a value on a rounding boundary that another legal
summation order puts on the other side — moves its position's logits by ~1e-3 and, through
attention, every later position by up to ~3e-2 (as much as FP8 quantization itself): a
plain per-position comparison is chaotic, and where a candidate's first flip falls decides it.
So the reference is computed position by position in the candidate's context
(pinned_routes.PinnedRoutes with ForcedKV): the candidate's experts at every (position, layer)
and its keys and values at earlier positions. Each position's difference is then its own
computation's, and the positions are exchangeable samples of it. For one prompt (T positions)
and the candidate's logits [T, V], routes and K/V:

  clean      = that reference, exact;  draw_j = the same under rounding_noise.noisy(eps, seed + j)
               for j ∈ `draws` (appending tokens changes no bit of the FP64 reference — rows do
               not depend on the row count — so the variation is drawn as rounding noise)
  d          = the pooled rel_rms(draw_j[p], clean[p]) over every draw and position
  cand(p)    = rel_rms(candidate[p], clean[p])
  pass      ⇔ every cand(p) ≤ m · max(d) + floor        (the band; positions outside listed)
             and median(cand) ≤ m · median(d) + floor   (a small error at every position)
             and every pinned expert difference is a near-tie (gap ≤ m · δ + router_floor, δ:
             how far the matched design's rounding moved that router's scores from FP32)

The band is never derived from the candidate.

Dimension letters: T judged positions, V vocabulary, K experts per token, E experts, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualification import rounding_noise
from qualification.pinned_routes import ForcedKV, PinnedRoutes
from qualification.stability import rel_rms
from qualification.tolerances import tolerance
from reference.model import ReferenceModel


@dataclass(frozen=True)
class MatchedBandConfig:
    draws: tuple[int, ...] = (0, 1, 2)  # rounding-noise draws (seed + j)
    multiple: float = 3.0  # m, as the FP32 band's
    floor: float = 1e-4  # absolute slack on rel_rms
    router_floor: float = 0.0  # slack of a near-tie beyond m · δ (runtime_gate.FLIP_FLOOR)
    seed: int = 29
    eps: float | None = None  # relative rounding noise; None: the tolerance table's row

    @property
    def noise(self) -> float:
        """Relative rounding noise per FP64 → FP32 rounding (`runtime.rounding_noise`)."""
        return self.eps if self.eps is not None else tolerance(
            "runtime.rounding_noise", "fp32").max_rel


@dataclass
class MatchedBand:
    ok: bool
    worst: float  # the largest cand / allowed over the positions
    outside: list[int]  # positions outside the band, worst first
    illegal: list[str]  # pins that are no near-tie
    pins: int  # pins that differ from the reference's own choice
    evidence: list[str]


class BandReference:
    """The candidate-independent part for one prompt: the router variation δ of the matched
    design (matched vs FP32 router scores at every position and layer), from the two
    references' routes (routing_flips.reference_routes on the judged tokens)."""

    def __init__(self, matched: ReferenceModel, m_routes: dict, f_routes: dict, full: torch.Tensor):
        self.matched, self.full = matched, full
        self.length = next(iter(m_routes.values()))[1].shape[0]
        self.delta: dict[int, torch.Tensor] = {}  # {layer: [T]}
        for layer, (m_in, _) in m_routes.items():
            w = matched.p[f"model.layers.{layer}.mlp.router.weight"].double()  # [E, H]
            s_m, s_f = m_in.double() @ w.t(), f_routes[layer][0].double() @ w.t()  # [T, E]
            self.delta[layer] = (s_m - s_f).abs().amax(-1)


def run(ref: BandReference, cand_logits: torch.Tensor, cand_routes: dict[int, torch.Tensor],
        cand_kv: dict, cfg: MatchedBandConfig | None = None) -> MatchedBand:
    cfg = cfg or MatchedBandConfig()
    T, toks = ref.length, ref.full[: ref.length]
    if cand_logits.shape[0] != T:
        raise ValueError(f"matched_band.run: candidate logits for {cand_logits.shape[0]} "
                         f"positions, {T} judged")
    model = PinnedRoutes(ref.matched.cfg, ref.matched.p, cand_routes)
    layers = ref.matched.cfg.target.num_hidden_layers

    def forward():
        return model.target(toks, torch.arange(T), ForcedKV(layers, cand_kv)).logits

    clean = forward()
    illegal = []
    for d in model.differing:
        allowed = cfg.multiple * float(ref.delta[d.layer][d.position]) + cfg.router_floor
        if d.gap > allowed:
            illegal.append(f"p{d.position} L{d.layer}: gap {d.gap:.2e} > {allowed:.2e}")
    pins = len(model.differing)
    pooled = []
    for j in cfg.draws:
        with rounding_noise.noisy(cfg.noise, cfg.seed + j):
            pooled.append(rel_rms(forward(), clean))
    d = torch.cat(pooled)
    cand = rel_rms(cand_logits, clean)
    band = cfg.multiple * float(d.max()) + cfg.floor
    mid = cfg.multiple * float(d.median()) + cfg.floor
    order = cand.argsort(descending=True)
    outside = [int(p) for p in order if cand[p] > band]
    w = int(order[0])
    # the 90 % quantile is reported, not judged: how many positions flip differs by prompt
    # (the draws' q90 was 1.7e-2 on one mini prompt, 3e-5 on another), so a legal kernel that
    # flips more often than the draws on a quiet prompt would fail it
    c90, d90 = float(cand.quantile(0.9)), float(d.quantile(0.9))
    worst = max(float(cand[w]) / band, float(cand.median()) / mid)
    ok = not outside and float(cand.median()) <= mid and not illegal
    ev = [f"vs matched in the candidate's context: worst position {w}: {float(cand[w]):.2e} vs "
          f"band {band:.2e} (m · max of {len(cfg.draws)}×{T} draws {float(d.max()):.2e} + "
          f"floor); median {float(cand.median()):.2e} vs {mid:.2e} (draws' median "
          f"{float(d.median()):.2e}); 90 % quantile {c90:.2e} (draws' {d90:.2e}, reported); "
          f"{pins} pinned expert differences"
          + (f", {len(illegal)} NOT near-ties: {illegal[:6]}" if illegal else " (near-ties)")
          + (f"; outside the band: {len(outside)} positions, worst first {outside[:16]}"
             if outside else "")]
    return MatchedBand(ok, worst, outside, illegal, pins, ev)
