"""Gate 2 — stability bands: separate a candidate's error from the reference's own variation.

For each prompt (T tokens) the lower-precision reference (BF16) is run on the prompt and on the
prompt with 1 and with 8 extra tokens appended. Appending changes the row count of every GEMM
and of every expert GEMM, so rounding at the earlier positions changes too, and later routing
amplifies it. Per earlier position p:

  band(p)  = max over a ∈ {0, 1, 8} of rel_rms(BF16 reference with a appended at p, FP32 at p)
  cand(p)  = rel_rms(candidate at p, FP32 at p)
  pass(p) ⇔ cand(p) ≤ m · band(p) + floor

with rel_rms(x, y) = rms(x − y) / rms(y) over the vocabulary logits — the fp64-arbitrated
check of PyTorch's accuracy checker, torch._dynamo.utils.same (candidate error ≤ m × reference
error), the reference error taken as its whole envelope under appends. The band is never derived
from a candidate's own error. The candidate is the reference with the router folded into the
attention tail ("bf16-fold"), exactly the numerical change the runtime makes (gate 1 compares
the runtime itself with the references).

Model: qualify runs this gate's verdict on the synthetic tiny model (random prompts). On the
trained mini model the per-position criterion cannot pass a legal rounding change: its BF16
error without a routing flip is ~5e-3 relative RMS (tiny: ~5e-2), an expert flip at a router
near-tie moves a position by 2–7e-2, and two legal rounding choices (bf16 and bf16-fold) flip at
different positions, so each fails the other's band at a few positions in 160 — while appending
tokens, which should widen the band there, changes no bit on the CPU (its GEMMs give each row the
same bits at any row count). `cross_check` measures this on every qualify run (reported, not
gated), with routing flips named: the flips explain most out-of-band positions, every first flip
a near-tie but for the odd one downstream of another flip; the rest are positions attending to a
flipped one (routing_flips says why that reach is not excused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qualification import routing_flips
from reference.model import ReferenceModel


@dataclass(frozen=True)
class StabilityConfig:
    prompts: int = 3
    length: int = 32  # > tiny window 16: sliding layers wrap
    appends: tuple[int, ...] = (1, 8)
    multiple: float = 3.0  # m
    floor: float = 1e-3  # absolute slack on rel_rms, below BF16's unit roundoff 2^-8
    seed: int = 11


def rel_rms(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[T, V] vs [T, V] → [T] rms(x − y) / rms(y) per position, in float64."""
    x, y = x.double(), y.double()
    return (x - y).pow(2).mean(-1).sqrt() / y.pow(2).mean(-1).sqrt()


def _logits(model: ReferenceModel, tokens: torch.Tensor) -> torch.Tensor:
    return model.target(tokens, torch.arange(len(tokens)), model.new_target_cache()).logits


def run(
    fp32: ReferenceModel,
    lower: ReferenceModel,
    candidate: Callable[[torch.Tensor], torch.Tensor],  # tokens [T] → logits [T, V]
    cfg: StabilityConfig | None = None,
    prompts: Sequence[torch.Tensor] | None = None,  # each [≥ length + max(appends)]
    flips: Callable[[torch.Tensor], list[routing_flips.Flip]] | None = None,
    memo: dict | None = None,
) -> tuple[bool, float, list[str]]:
    """(all positions pass, worst cand/(m·band + floor), evidence lines). `lower` is the
    lower-precision reference whose envelope sets the band (BF16, or "matched" for the FP8
    runtime). `prompts`: given token sequences (real text) instead of cfg.prompts random ones;
    each one's first cfg.length tokens are judged, the rest are the appended tokens. `flips`:
    tokens [T] → the candidate's routing flips against `lower` (routing_flips.between); a
    position outside the band then passes when its first flip is a legal near-tie, and an
    illegal flip fails. The worst share excludes the excused positions. memo: per_position's."""
    cfg = cfg or StabilityConfig()
    extra = max(cfg.appends)
    if prompts is None:
        gen = torch.Generator().manual_seed(cfg.seed)
        vocab = fp32.cfg.target.vocab_size
        prompts = [torch.randint(0, vocab, (cfg.length + extra,), generator=gen)
                   for _ in range(cfg.prompts)]
    ok, worst, evidence = True, 0.0, []
    for i, toks in enumerate(prompts):
        if toks.shape[0] < cfg.length + extra:
            raise ValueError(f"stability.run: prompt {i} has {toks.shape[0]} tokens, "
                             f"StabilityConfig.length + max(appends) = {cfg.length + extra} wanted")
        cand, band, allowed = per_position(fp32, lower, candidate(toks[: cfg.length]), cfg, toks,
                                           memo)
        excused: set[int] = set()
        if flips is not None:
            found = flips(toks[: cfg.length])
            f_ok, lines = routing_flips.judge(cand, allowed, found)
            ok &= f_ok
            excused = {f.position for f in found if f.legal}
            evidence += [f"prompt {i}: {e}" for e in lines]
        keep = torch.tensor([q not in excused for q in range(cand.shape[0])])
        used = torch.where(keep, cand / allowed, torch.zeros_like(cand))
        p = int(used.argmax())
        worst = max(worst, float(used[p]))
        bad = ((cand > allowed) & keep).nonzero().flatten().tolist()
        ok &= not bad
        evidence.append(
            f"prompt {i}: worst position {p}: candidate {float(cand[p]):.2e} vs allowed "
            f"{float(allowed[p]):.2e} (band {float(band[p]):.2e}); median band "
            f"{float(band.median()):.2e}" + (f"; outside: positions {bad}" if bad else "")
            + (f"; {len(excused)} flipped positions excused" if excused else "")
        )
    return ok, worst, evidence


def _key(fp32: ReferenceModel, lower: ReferenceModel, cfg: StabilityConfig, toks: torch.Tensor):
    return id(fp32), id(lower), cfg, tuple(toks.tolist())


def remember_matched(memo: dict, fp32: ReferenceModel, lower: ReferenceModel,
                     cfg: StabilityConfig, toks: torch.Tensor, lower_logits: torch.Tensor) -> None:
    """Fill per_position's memo for one prompt from the row-at-a-time `lower` reference's logits
    [≥ T, V] of a forward the caller already ran over toks (its first T = cfg.length rows are the
    band's at every append: a row's bits ignore later rows)."""
    if not lower.precision.matched:
        raise ValueError("stability.remember_matched: only a row-at-a-time (matched) reference's "
                         "rows ignore the appended tokens")
    ref = _logits(fp32, toks[: cfg.length])
    memo[_key(fp32, lower, cfg, toks)] = ref, rel_rms(lower_logits[: cfg.length], ref)


def per_position(fp32: ReferenceModel, lower: ReferenceModel, cand_logits: torch.Tensor,
                 cfg: StabilityConfig, toks: torch.Tensor, memo: dict | None = None):
    """(cand, band, allowed), each [T = cfg.length] float64, for one prompt toks [≥ T +
    max(appends)] and the candidate's logits [T, V] on its first T tokens. memo: a dict that
    keeps the candidate-independent FP32 logits and band per prompt across calls."""
    key = _key(fp32, lower, cfg, toks)
    if memo is None or key not in memo:
        prompt = toks[: cfg.length]
        ref = _logits(fp32, prompt)  # [T, V]
        if lower.precision.matched:  # one row at a time: a row's bits ignore later rows
            longest = _logits(lower, toks[: cfg.length + max(cfg.appends, default=0)])
            band = rel_rms(longest[: cfg.length], ref)
        else:
            band = rel_rms(_logits(lower, prompt), ref)
            for a in cfg.appends:
                band = torch.maximum(
                    band, rel_rms(_logits(lower, toks[: cfg.length + a])[: cfg.length], ref)
                )
        if memo is not None:
            memo[key] = ref, band
    else:
        ref, band = memo[key]
    cand = rel_rms(cand_logits, ref)
    return cand, band, cfg.multiple * band + cfg.floor


def cross_check(
    fp32: ReferenceModel,
    a: ReferenceModel,
    b: ReferenceModel,
    cfg: StabilityConfig,
    prompts: Sequence[torch.Tensor] | None = None,
    with_flips: bool = False,
) -> list[str]:
    """Two legal rounding choices judged by each other's band (reported, never a verdict): when
    both fail, the criterion cannot tell either from reference variation on this model.
    with_flips: positions explained by a legal routing flip are excused (routing_flips). On the
    mini model in BF16 that leaves a few positions that took no other expert themselves but
    attend to one that did (the band, ~0.5 %, is narrower than a flip's reach through attention;
    the FP8 runtime's band, ~3 %, is not) — why gate 2's verdict stays on tiny."""

    def logits_of(model):
        return lambda t: _logits(model, t)

    out = []
    for cand, lower in ((b, a), (a, b)):
        flips = routing_flips.between(cand, lower, fp32, cfg.multiple) if with_flips else None
        ok, worst, ev = run(fp32, lower, logits_of(cand), cfg, prompts, flips)
        name, band = cand.precision.name, lower.precision.name
        out.append(f"{name} within {band}'s band: {'passes' if ok else 'FAILS'} "
                   f"({worst:.0%} of allowed); " + "; ".join(ev))
    return out
