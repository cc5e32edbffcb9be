"""The acceptance report's xarray Dataset: dims (request, round, depth) plus (layer, rows) for
the expert counts. A "request" is one decode: (prompt, seed, depth policy).

Missing entries (a request with fewer rounds or drafts than the longest, a rate with nothing to
count) are NaN in the Dataset, so `.mean()` and friends skip them. Stored as netCDF3 (scipy):
the integer variables keep their integer type on disk (at most 32 bits) with −1 for missing and
`_FillValue = -1` declared, the float ones hold NaN with `_FillValue = NaN`; xarray.open_dataset
turns both back into NaN. Variables without missing entries declare no fill value. Every
variable with a unit carries it in `units` ("1": dimensionless); token ids, flags and the stop
reason have none (flags carry `flag_values`/`flag_meanings`).

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
MISSING = -1  # a missing entry of an integer grid while it is filled, and its _FillValue on disk
# integer variables that can miss entries → their dtype on disk
PADDED_INT = {"round_position": np.int32, "accepted_length": np.int32,
              "accepted_drafts": np.int32, "chosen_depth": np.int32, "bonus": np.int8,
              "draft_token": np.int32, "draft_accepted": np.int8}
PADDED_FLOAT = frozenset({"first_round_s", "time_per_output_token_s", "round_end_s",
                          "round_latency_s", "draft_prob", "draft_entropy", "depth_acceptance",
                          "depth_acceptance_conditional", "distinct_experts"})
FLAGS = {"bonus": "target_row_not_used extra_target_row",
         "draft_accepted": "rejected accepted"}


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


def _stored(name: str, var: xr.Variable) -> xr.Variable:
    """The variable as the Dataset holds it (NaN for missing) with its netCDF encoding."""
    if name in PADDED_INT:
        dtype = PADDED_INT[name]
        values = np.where(var.values == MISSING, np.nan, var.values.astype(float))
        return xr.Variable(var.dims, values, var.attrs,
                           encoding={"dtype": np.dtype(dtype), "_FillValue": dtype(MISSING)})
    if name in PADDED_FLOAT:
        return xr.Variable(var.dims, var.values, var.attrs, encoding={"_FillValue": np.nan})
    if var.dtype.kind == "f":  # xarray would declare NaN for every float variable
        return xr.Variable(var.dims, var.values, var.attrs, encoding={"_FillValue": None})
    return var


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

    position, acc_len, accepted, chosen = (grid((n, rounds), MISSING, i32) for _ in range(4))
    bonus = grid((n, rounds), MISSING, np.int8)
    end_s, lat_s = grid((n, rounds), np.nan, float), grid((n, rounds), np.nan, float)
    tok = grid((n, rounds, depth), MISSING, i32)
    prob, ent = grid((n, rounds, depth), np.nan, float), grid((n, rounds, depth), np.nan, float)
    d_acc = grid((n, rounds, depth), MISSING, np.int8)
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
    # name: (dims, values, units or None where none applies, description)
    v = {
        "prompt_tokens": (req, np.array([len(d.prompt.ids) for d in decoded], i32), "tokens",
                          "prompt tokens decoded (after --max-prompt-tokens truncation)"),
        "prompt_tokens_full": (req, np.array([d.prompt.full_tokens for d in decoded], i32),
                               "tokens", "prompt tokens before truncation"),
        "new_tokens": (req, np.array([len(d.result.tokens) for d in decoded], i32), "tokens",
                       "tokens generated"),
        "n_rounds": (req, np.array([len(d.result.rounds) for d in decoded], i32), "rounds",
                     "verification rounds"),
        "stop_reason": (req, np.array([d.result.stop_reason for d in decoded]), None,
                        "stop | length"),
        "tokens_per_round": (req, np.array([d.result.mean_accepted_length for d in decoded]),
                             "tokens/round", "new tokens per round (mean accepted length)"),
        "wall_s": (req, np.array([d.wall_s for d in decoded]), "s",
                   "seconds of the generate() call"),
        "first_round_s": (req, end_s[:, 0], "s", "seconds from generate() to round 0's record: "
                          "prefill + the first round"),
        "time_per_output_token_s": (req, tpot, "s/token", "seconds per token after round 0: "
                                    "(end of the last round − end of round 0) / tokens of "
                                    "rounds ≥ 1; missing for decodes of one round"),
        "round_position": (rnd, position, "tokens",
                           "position m of the committed token the round verifies"),
        "accepted_length": (rnd, acc_len, "tokens", "tokens the round emitted (accepted drafts "
                            "+ replacement or bonus, after budget/stop trimming)"),
        "accepted_drafts": (rnd, accepted, "drafts", "drafts the verifier accepted"),
        "chosen_depth": (rnd, chosen, "drafts", "drafts generated (the depth policy's choice)"),
        "bonus": (rnd, bonus, None, "1: the last token came from the extra target row"),
        "round_end_s": (rnd, end_s, "s", "seconds from generate() to the round's record (host)"),
        "round_latency_s": (rnd, lat_s, "s", "seconds between this round's record and the "
                            "previous one's (missing for round 0, which includes the prefill)"),
        "draft_token": (dep, tok, None, "drafted token id"),
        "draft_prob": (dep, prob, "1", "the draft's served probability of its own token"),
        "draft_entropy": (dep, ent, "nats", "entropy of the draft's served distribution"),
        "draft_accepted": (dep, d_acc, None, "1 accepted, 0 drafted but not accepted"),
        "depth_acceptance": (("request", "depth"), dep_acc, "1",
                             "rounds accepting ≥ j drafts / rounds drafting ≥ j"),
        "depth_acceptance_conditional": (("request", "depth"), dep_cond, "1",
                                         "rounds accepting ≥ j / rounds drafting ≥ j that "
                                         "accepted ≥ j − 1"),
        "distinct_experts": (("request", "layer", "rows"), experts, "experts",
                             "mean distinct target experts over `rows` consecutive generated "
                             "positions"),
    }
    data = {}
    for k, (dims, a, units, desc) in v.items():
        meta = {"description": desc} | ({"units": units} if units is not None else {})
        if k in FLAGS:
            meta |= {"flag_values": np.array([0, 1], np.int8), "flag_meanings": FLAGS[k]}
        data[k] = _stored(k, xr.Variable(dims, a, meta))
    coords = {
        "request": np.arange(n, dtype=i32),
        "round": np.arange(rounds, dtype=i32),
        "depth": ("depth", np.arange(1, depth + 1, dtype=i32),
                  {"description": "draft depth j: the j-th draft of a round (1-based)"}),
        "layer": ("layer", np.array(moe_layers, i32), {"description": "target MoE layer"}),
        "rows": ("rows", np.arange(1, MAX_ROWS + 1, dtype=i32),
                 {"units": "rows", "description": "consecutive generated positions (rows)"}),
        "request_id": ("request", np.array([d.prompt.id for d in decoded])),
        "kind": ("request", np.array([d.prompt.kind for d in decoded])),
        "seed": ("request", np.array([d.seed for d in decoded], i32)),
        "policy": ("request", np.array([d.policy for d in decoded])),
    }
    return xr.Dataset(data, coords=coords, attrs={"n_experts": n_experts, **attrs})


def write_netcdf(ds: xr.Dataset, path) -> None:
    """ds → netCDF3 (64-bit offsets) through scipy: the format the report ships."""
    ds.to_netcdf(path, engine="scipy", format="NETCDF3_64BIT")
