"""The acceptance report's xarray Dataset: dims (request, round, depth) plus (layer, rows) for
the expert counts. A "request" is one decode: (prompt, seed, depth policy). Integer variables
hold −1 where a request has no such round or depth; float ones hold NaN. Stored as netCDF3
(scipy), so integers are at most 32 bits.

Per-depth acceptance of depth j (1-based): rounds whose `accepted` ≥ j over rounds that drafted
≥ j drafts (`depth_acceptance`), and the same over rounds that drafted ≥ j and accepted ≥ j − 1
(`depth_acceptance_conditional`: the chance that draft j survives once it is reached). Both use
the verifier's accepted count, before the last round's budget/stop trimming.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from iquestrt.report.decode import Decoded

MAX_ROWS = 8  # verification rows of one round (1 committed + up to 7 drafts)


def distinct_experts(ids: torch.Tensor, n_experts: int, max_rows: int = MAX_ROWS) -> np.ndarray:
    """ids [T, K] → [max_rows]: for r = 1 … max_rows, the mean over the T − r + 1 windows of r
    consecutive positions of the number of distinct experts they use (NaN when T < r)."""
    t = ids.shape[0]
    hot = torch.zeros(t, n_experts, dtype=torch.int64)
    if t:
        hot.scatter_(1, ids.long(), 1)
    csum = torch.cat([torch.zeros(1, n_experts, dtype=torch.int64), hot.cumsum(0)])  # [T+1, E]
    out = np.full(max_rows, np.nan)
    for r in range(1, max_rows + 1):
        if t >= r:
            used = (csum[r:] - csum[:-r]) > 0  # [T−r+1, E]: expert used inside window
            out[r - 1] = used.sum(1).double().mean().item()
    return out


def _per_depth(accepted: np.ndarray, chosen: np.ndarray, depth: int):
    """accepted/chosen [N, Rd] (−1 padding) → (acceptance, conditional) [N, depth]."""
    n = accepted.shape[0]
    acc, cond = np.full((n, depth), np.nan), np.full((n, depth), np.nan)
    for j in range(1, depth + 1):
        drafted = chosen >= j
        reached = drafted & (accepted >= j - 1)
        hit = (accepted >= j) & drafted
        with np.errstate(invalid="ignore", divide="ignore"):
            acc[:, j - 1] = np.where(drafted.sum(1) > 0, hit.sum(1) / drafted.sum(1), np.nan)
            cond[:, j - 1] = np.where(reached.sum(1) > 0, hit.sum(1) / reached.sum(1), np.nan)
    return acc, cond


def build_dataset(decoded: list[Decoded], n_experts: int, moe_layers: list[int],
                  attrs: dict) -> xr.Dataset:
    if not decoded:
        raise ValueError("build_dataset: no decoded requests")
    n = len(decoded)
    rounds = max(1, max(len(d.result.rounds) for d in decoded))
    depth = max(1, max((len(r.drafts) for d in decoded for r in d.result.rounds), default=1))
    i32 = np.int32

    def grid(shape, fill, dtype):
        return np.full(shape, fill, dtype=dtype)

    position, acc_len, accepted, chosen = (grid((n, rounds), -1, i32) for _ in range(4))
    bonus = grid((n, rounds), -1, np.int8)
    end_s, lat_s = grid((n, rounds), np.nan, float), grid((n, rounds), np.nan, float)
    tok = grid((n, rounds, depth), -1, i32)
    prob, ent = grid((n, rounds, depth), np.nan, float), grid((n, rounds, depth), np.nan, float)
    d_acc = grid((n, rounds, depth), -1, np.int8)
    experts = grid((n, len(moe_layers), MAX_ROWS), np.nan, float)
    tpot = grid(n, np.nan, float)
    for i, d in enumerate(decoded):
        recs = d.result.rounds
        if len(d.round_end_s) != len(recs):
            raise ValueError(f"build_dataset: request {i} has {len(recs)} rounds but "
                             f"{len(d.round_end_s)} round times")
        for k, r in enumerate(recs):
            position[i, k], acc_len[i, k] = r.position, len(r.emitted)
            accepted[i, k], chosen[i, k], bonus[i, k] = r.accepted, len(r.drafts), int(r.bonus)
            end_s[i, k] = d.round_end_s[k]
            if k:
                lat_s[i, k] = d.round_end_s[k] - d.round_end_s[k - 1]
            for j, info in enumerate(r.drafts):
                tok[i, k, j], prob[i, k, j], ent[i, k, j] = info.token, info.prob, info.entropy
                d_acc[i, k, j] = int(j < r.accepted)
        after_first = len(d.result.tokens) - (len(recs[0].emitted) if recs else 0)
        if len(recs) > 1 and after_first > 0:
            tpot[i] = (d.round_end_s[-1] - d.round_end_s[0]) / after_first
        if d.routing.shape[0] != len(moe_layers):
            raise ValueError(f"build_dataset: request {i} routing has {d.routing.shape[0]} "
                             f"layers, expected {len(moe_layers)}")
        for li in range(len(moe_layers)):
            experts[i, li] = distinct_experts(d.routing[li], n_experts)
    dep_acc, dep_cond = _per_depth(accepted, chosen, depth)
    req, rnd, dep = ("request",), ("request", "round"), ("request", "round", "depth")
    v = {
        "prompt_tokens": (req, np.array([len(d.prompt.ids) for d in decoded], i32),
                          "prompt tokens decoded (after --max-prompt-tokens truncation)"),
        "prompt_tokens_full": (req, np.array([d.prompt.full_tokens for d in decoded], i32),
                               "prompt tokens before truncation"),
        "new_tokens": (req, np.array([len(d.result.tokens) for d in decoded], i32),
                       "tokens generated"),
        "n_rounds": (req, np.array([len(d.result.rounds) for d in decoded], i32),
                     "verification rounds"),
        "stop_reason": (req, np.array([d.result.stop_reason for d in decoded]), "stop | length"),
        "tokens_per_round": (req, np.array([d.result.mean_accepted_length for d in decoded]),
                             "new tokens per round (mean accepted length)"),
        "wall_s": (req, np.array([d.wall_s for d in decoded]), "seconds of the generate() call"),
        "first_round_s": (req, end_s[:, 0], "seconds from generate() to round 0's record: "
                          "prefill + the first round"),
        "time_per_output_token_s": (req, tpot, "seconds per token after round 0: (end of the "
                                    "last round − end of round 0) / tokens of rounds ≥ 1"),
        "round_position": (rnd, position, "position m of the committed token the round verifies"),
        "accepted_length": (rnd, acc_len, "tokens the round emitted (accepted drafts + "
                            "replacement or bonus, after budget/stop trimming)"),
        "accepted_drafts": (rnd, accepted, "drafts the verifier accepted"),
        "chosen_depth": (rnd, chosen, "drafts generated (the depth policy's choice)"),
        "bonus": (rnd, bonus, "1: the last token came from the extra target row"),
        "round_end_s": (rnd, end_s, "seconds from generate() to the round's record (host)"),
        "round_latency_s": (rnd, lat_s, "seconds between this round's record and the previous "
                            "one's (NaN for round 0, which includes the prefill)"),
        "draft_token": (dep, tok, "drafted token"),
        "draft_prob": (dep, prob, "the draft's served probability of its own token"),
        "draft_entropy": (dep, ent, "entropy (nats) of the draft's served distribution"),
        "draft_accepted": (dep, d_acc, "1 accepted, 0 drafted but not accepted"),
        "depth_acceptance": (("request", "depth"), dep_acc,
                             "rounds accepting ≥ j drafts / rounds drafting ≥ j"),
        "depth_acceptance_conditional": (("request", "depth"), dep_cond,
                                         "rounds accepting ≥ j / rounds drafting ≥ j that "
                                         "accepted ≥ j − 1"),
        "distinct_experts": (("request", "layer", "rows"), experts,
                             "mean distinct target experts over `rows` consecutive generated "
                             "positions"),
    }
    data = {k: xr.Variable(dims, a, {"description": desc}) for k, (dims, a, desc) in v.items()}
    coords = {
        "request": np.arange(n, dtype=i32),
        "round": np.arange(rounds, dtype=i32),
        "depth": np.arange(1, depth + 1, dtype=i32),
        "layer": np.array(moe_layers, i32),
        "rows": np.arange(1, MAX_ROWS + 1, dtype=i32),
        "request_id": ("request", np.array([d.prompt.id for d in decoded])),
        "kind": ("request", np.array([d.prompt.kind for d in decoded])),
        "seed": ("request", np.array([d.seed for d in decoded], i32)),
        "policy": ("request", np.array([d.policy for d in decoded])),
    }
    return xr.Dataset(data, coords=coords, attrs={"n_experts": n_experts, **attrs})
