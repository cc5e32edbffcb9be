"""Gate 1b at the real per-rank shapes: the lockstep (qualification/lockstep.py) on one TP8 rank
of IQuest-Q1 with random E4M3 weights, a few layers of each kind.

The rank model (benchmarks/rank/shapes.py `rank_config`: 6 query heads / 1 KV head, hidden
3072, 256 experts × 192 channels, a 20000-row vocabulary shard) is cut to the shortest legal
layer pattern with both kinds, `[F] + [F, S, S, S] + [F, F, F]` (layer 0 dense, full-attention
and sliding-window MoE layers), with the draft block and the lm_head shard; the weights are
benchmarks/rank/weights.py's (uniform E4M3 codes, unit-gain block scales). A random prompt is
prefilled and decoded at width 8 with a fixed draft depth, and every kernel call is replayed by
its twin on the identical inputs and judged by its row. The sampler is then judged alone at the
full vocabulary (`vocabs`: the 20000 shard and the unsharded 160000): kernel vs twin on the same
random logits, exact ids, tokens and probabilities rows.

GPU only at these shapes (an expert stack is 453 MB of E4M3; the twins dequantize on the
device). `CPU` keeps the structure at test size (`small_rank_config`, one round, ≈ 1 min
under the interpreter).

Dimension letters: R rows, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qualification.lockstep import Lockstep, Verdict


@dataclass(frozen=True)
class RankLockstepConfig:
    repeats: int = 1  # layer pattern [F] + [F, S, S, S] · repeats + [F, F, F] (1: both kinds)
    prompt_tokens: int = 24
    new_tokens: int = 12
    width: int = 8
    depth: int = 3
    vocabs: tuple[int, ...] = (20000, 160000)  # the sampler alone at these vocabularies
    seed: int = 3
    small: bool = False  # small_rank_config: the structure at CPU-test size

    def __post_init__(self) -> None:
        if not 1 <= self.repeats <= 4:
            raise ValueError(f"RankLockstepConfig.repeats: 1 … 4 (sliding layers need ≥ 1), "
                             f"got {self.repeats}")


# the interpreter: the rank's structure at test size, the sampler at the shard's width too
CPU = RankLockstepConfig(prompt_tokens=8, new_tokens=2, width=4, depth=1, vocabs=(640, 20000),
                         small=True)


def rank_model(cfg: RankLockstepConfig):
    from benchmarks.rank.shapes import rank_config, small_rank_config
    from reference.config import layer_pattern

    full = small_rank_config() if cfg.small else rank_config()
    t = dataclasses.replace(full.target, layer_types=layer_pattern(cfg.repeats))
    return dataclasses.replace(full, target=t, name=f"{full.name}-{len(t.layer_types)}-layers")


def _sampler(lock: Lockstep, vocab: int, cfg: RankLockstepConfig, device) -> None:
    from iquestrt.live import Live
    from reference.config import SamplingDefaults
    from reference.rng import Purpose

    g = torch.Generator().manual_seed(cfg.seed * 7 + vocab)
    logits = (torch.randn(cfg.width, vocab, generator=g) * 3.0).to(device)  # [R, V]
    positions = torch.arange(100, 100 + cfg.width, device=device)
    for params in (SamplingDefaults(1.0, 20, 0.95), SamplingDefaults(0.7, 50, 0.9)):
        lock.sample(logits, params, cfg.seed, positions, Purpose.TARGET_SAMPLE,
                    Live.of(cfg.width, device))


def verdict(cfg: RankLockstepConfig | None = None) -> Verdict:
    from benchmarks.rank.weights import random_weights
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from reference.depth import FixedDepth
    from reference.speculative import GenerationRequest

    gpu = torch.cuda.is_available()
    cfg = cfg or (RankLockstepConfig() if gpu else CPU)
    device = "cuda" if gpu else "cpu"
    model = rank_model(cfg)
    cap = cfg.prompt_tokens + cfg.new_tokens + 2 * cfg.width + 8
    w = random_weights(model, device, cfg.seed, cap)
    rcfg = RuntimeConfig(ops="kernels", device=device, max_width=cfg.width, ring_pad=8,
                         max_positions=cap, policy=FixedDepth(cfg.depth), sync_rounds=1)
    eng = Engine(w, rcfg)
    lock = Lockstep(eng)
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(0, model.target.vocab_size, (cfg.prompt_tokens,), generator=g)
    req = GenerationRequest(tuple(prompt.tolist()), cfg.new_tokens, model.sampling, cfg.seed)
    rounds = lock.decode(req)
    for vocab in cfg.vocabs:
        _sampler(lock, vocab, cfg, device)
    worst = max(lock.findings.values(), key=lambda f: f.used)
    margin = worst.margin()
    t = model.target
    kinds = "".join(k[0].upper() for k in t.layer_types)
    ev = [f"{model.name}: hidden {t.hidden_size}, {t.num_attention_heads}/"
          f"{t.num_key_value_heads} heads, {t.num_experts} experts × {t.moe_intermediate_size}, "
          f"vocab {t.vocab_size}, layers {kinds}; width {cfg.width}, depth "
          f"{cfg.depth}, {cfg.prompt_tokens}-token prompt, {rounds} rounds; the sampler alone at "
          f"V = {list(cfg.vocabs)}; {lock.compared} comparisons, "
          f"{'all within their rows' if lock.ok else 'OUTSIDE their rows'}"]
    ev += [f"  {line}" for line in lock.report(limit=8 if lock.ok else 14)]
    if lock.stopped:
        ev.append(f"  {lock.stopped[:300]}")
    used = None if worst.used == float("inf") else worst.used
    return Verdict(lock.ok, margin, ev, used, frozenset(f.op for f in lock.findings.values()))
