"""The training objective (weights documented on TrainConfig) and the held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.config import TrainConfig, depth_weights
from training.model import TrainModel


@dataclass
class Losses:
    total: torch.Tensor  # scalar, the optimized objective
    target: torch.Tensor  # scalar CE of the target's next-token prediction (nats)
    draft: torch.Tensor  # [D] CE of depth j = 0 … D−1: the token j+1 past the target's prediction
    aux: torch.Tensor  # scalar load-balancing loss (1 = uniform routing)


def compute_losses(model: TrainModel, batch: torch.Tensor, cfg: TrainConfig) -> Losses:
    """batch [B, T+1] token ids: inputs are the first T, labels the last T."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    depths = model.cfg.draft.num_draft_slots
    t = model.target(inputs)
    hidden = t.hidden if cfg.draft_grad_to_target else t.hidden.detach()
    d = model.draft(inputs, hidden, depths)
    v = t.logits.shape[-1]
    target = F.cross_entropy(t.logits.reshape(-1, v), labels.reshape(-1))
    # depth j's row at p predicts labels[:, p]; rows p ≤ j have no defined input (model.py)
    draft = torch.stack(
        [F.cross_entropy(lg[:, j + 1 :].reshape(-1, v), labels[:, j + 1 :].reshape(-1))
         for j, lg in enumerate(d.logits)]
    )
    aux = 0.5 * (t.aux + d.aux)
    w = torch.tensor(depth_weights(cfg, depths), device=draft.device)
    total = target + cfg.draft_loss_weight * (w * draft).sum() + cfg.aux_loss_weight * aux
    return Losses(total, target, draft, aux)


@torch.no_grad()
def evaluate(model: TrainModel, batches, cfg: TrainConfig, autocast) -> dict:
    """Row-weighted mean target and per-depth draft CE over the given batches."""
    sums, rows = None, None
    for batch in batches:
        with autocast():
            loss = compute_losses(model, batch, cfg)
        b, t = batch.shape[0], batch.shape[1] - 1
        n = torch.tensor([b * t] + [b * (t - j - 1) for j in range(len(loss.draft))],
                         dtype=torch.float64)
        vals = torch.cat([loss.target[None], loss.draft]).double().cpu() * n
        sums = vals if sums is None else sums + vals
        rows = n if rows is None else rows + n
    if sums is None:
        raise ValueError("evaluate: no held-out batches")
    mean = (sums / rows).tolist()
    return {"target": mean[0], "draft": mean[1:], "tokens": int(rows[0])}
