"""A synthetic tiny checkpoint whose MTP draft agrees with its target often but not always —
the model the engine tests and `benchmarks/bench_round.py` decode.

Checkpoints. `make_synthetic_checkpoint("tiny")` has a draft unrelated to its target: at
temperature 0 it never accepts a draft, so rollback of partially accepted rounds, the bonus token
and two-row catch-up would go untested. The "correlated" checkpoint is the same synthetic model
with deterministic edits that make the draft agree with the target often but not always:
  * the target's layers ≥ 1 scale attn_out_norm and the experts' down projection by ALPHA, so
    the normalized residual keeps the current token's embedding direction to the last layer;
  * both lm_heads add GAMMA · embed[π⁻¹(v)] / √H to row v (π a fixed random permutation), so
    both models lean towards predicting π(current token);
  * the draft shares the target's embedding and its eh_proj passes the embedding half through
    (+ 3·I), so the draft sees the current token the same way.
On the tiny preset this gives greedy rounds with 0, 1, 2 and 3 accepted drafts (mean accepted
length ≈ 2.6 at depth 3) and a non-degenerate token stream.

Dimension letters: V vocabulary, H hidden.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reference.checkpoint import make_synthetic_checkpoint, save_checkpoint
from reference.config import preset
from reference.synthetic import synthetic_params

ALPHA, GAMMA = 0.35, 4.0


def correlated_params(seed: int = 0) -> dict[str, torch.Tensor]:
    cfg = preset("tiny")
    p = synthetic_params(cfg, seed)
    v, h = cfg.target.vocab_size, cfg.target.hidden_size
    perm = torch.randperm(v, generator=torch.Generator().manual_seed(seed + 1))  # [V]
    emb = p["model.embed_tokens.weight"]  # [V, H]
    succ = torch.empty(v, h)
    succ[perm] = emb  # row π(t) = embed[t]: logits of π(t) grow with the current token t
    for name in ("lm_head.weight", "mtp.lm_head.weight"):
        p[name] = p[name] + GAMMA * succ / h**0.5
    p["mtp.embed_tokens.weight"] = emb.clone()
    p["mtp.eh_proj.weight"][:, :h] += 3.0 * torch.eye(h)
    for i in range(1, cfg.target.num_hidden_layers):
        for name in ("attn_out_norm.weight", "mlp.experts.proj"):
            p[f"model.layers.{i}.{name}"] = p[f"model.layers.{i}.{name}"] * ALPHA
    return {k: t if t.dtype == torch.float32 and k.endswith("router.weight")
            else t.to(torch.bfloat16).float() for k, t in p.items()}


def make_ckpt(directory: Path, kind: str) -> Path:
    """kind "synthetic": make_synthetic_checkpoint("tiny", seed 0); otherwise the correlated
    checkpoint. FP8 weights either way."""
    if kind == "synthetic":
        make_synthetic_checkpoint(directory, "tiny", 0, fmt="fp8")
    else:
        save_checkpoint(directory, preset("tiny"), correlated_params(0), "fp8")
    return directory
