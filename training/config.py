"""Training hyperparameters (one frozen dataclass; a resumed run must use the same values) and
the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from reference.config import PRESETS


class TrainConfigError(ValueError):
    """A training hyperparameter is out of range; the message names it."""


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "mini"  # reference.config preset to train
    seq_len: int = 512  # positions per training sequence (targets: the next 512 tokens)
    batch_size: int = 32  # sequences per step
    lr: float = 3e-3  # AdamW peak learning rate
    min_lr_ratio: float = 0.1  # cosine floor as a share of lr
    warmup_steps: int = 200  # linear warm-up; also bounds the timing calibration (train.py)
    weight_decay: float = 0.1  # on matrices only (not norms, sinks, embeddings, routers)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global gradient-norm clip
    # loss = target CE + draft_loss_weight · Σ_j w_j CE_j + aux_loss_weight · aux, where CE_j is
    # draft depth j's CE (j = 0 … D−1), w_j = draft_depth_decay^j / Σ_i draft_depth_decay^i
    # (early depths count more: a draft is only useful if every depth before it was accepted),
    # and aux the Switch load-balancing loss averaged over the target and draft MoE calls
    draft_loss_weight: float = 0.3
    draft_depth_decay: float = 0.8
    aux_loss_weight: float = 0.01
    draft_grad_to_target: bool = True  # False: the draft reads a detached target hidden
    max_epochs: float = 4.0  # caps a time-calibrated schedule (not an explicit --max-steps)
    log_every: int = 50
    ckpt_every: int = 500
    eval_tokens: int = 1_000_000  # held-out inputs evaluated at the end
    seed: int = 0  # initialization and data order

    def validate(self, num_draft_slots: int) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise TrainConfigError(f"train config {name}={getattr(self, name)!r}: {msg}")

        need(self.preset in PRESETS, "preset", f"must be one of {PRESETS}")
        need(self.seq_len > num_draft_slots + 1, "seq_len",
             f"must exceed num_draft_slots + 1 = {num_draft_slots + 1} (deepest draft rows)")
        for name in ("batch_size", "warmup_steps", "log_every", "ckpt_every", "eval_tokens"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name,
                 "must be an integer >= 1")
        need(math.isfinite(self.lr) and self.lr > 0, "lr", "must be > 0")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(0.0 <= self.beta1 < 1.0, "beta1", "must be in [0, 1)")
        need(0.0 <= self.beta2 < 1.0, "beta2", "must be in [0, 1)")
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(self.draft_loss_weight >= 0, "draft_loss_weight", "must be >= 0")
        need(0.0 < self.draft_depth_decay <= 1.0, "draft_depth_decay", "must be in (0, 1]")
        need(self.aux_loss_weight >= 0, "aux_loss_weight", "must be >= 0")
        need(self.max_epochs > 0, "max_epochs", "must be > 0")
        need(isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed", "must be in [0, 2^63)")


def lr_at(cfg: TrainConfig, step: int, total: int | None) -> float:
    """Learning rate of update `step` (0-based): linear warm-up over warmup_steps, then cosine
    from lr to min_lr_ratio·lr at `total`. total None (not yet calibrated) is only asked for
    during warm-up, where the schedule does not depend on it."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    if total is None or step < cfg.warmup_steps:
        return cfg.lr * warm
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos)


def depth_weights(cfg: TrainConfig, depths: int) -> list[float]:
    """w_j of the draft loss (sum 1)."""
    w = [cfg.draft_depth_decay**j for j in range(depths)]
    return [x / sum(w) for x in w]
