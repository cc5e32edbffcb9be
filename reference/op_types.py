"""The result and argument types of the device op table (iquestrt/ops.py), one home for the
kernels (kernels/) and their reference twins alike: a kernel and its twin take and return the
same types, so a caller — the runtime model, the lockstep gate — never knows which one ran.

Dimension letters: R rows (buffer; rows past the live count are padding: NaN, ids −1, probs 0),
H hidden, K top-k experts, W served sampling width, D drafts, V vocabulary, P token slots,
S hidden rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class SampleOut(NamedTuple):
    """What `sample` returns."""

    tokens: torch.Tensor  # [R] int64, the drawn token of each live row
    ids: torch.Tensor  # [R, W] int64, served candidates in draw order (served desc, id asc)
    probs: torch.Tensor  # [R, W] fp32 served probabilities, 0 after the kept prefix


class VerifyOut(NamedTuple):
    """What `verify` returns: one request's rejection-sampling decision over its drafts."""

    n_accepted: torch.Tensor  # [1] int32
    next_token: torch.Tensor  # [1] int64: the replacement, or the bonus token
    bonus: torch.Tensor  # [1] int32: 1 when every live draft was accepted
    emitted: torch.Tensor  # [D+1] int64: accepted drafts, next_token, then -1


@dataclass
class AttnTailOut:
    """What `attn_tail` returns (the fused O reduction + residual + norms, optionally the
    folded router and the expert input's FP8 quantization)."""

    h: torch.Tensor  # [R, H] bf16 residual carried to the MoE tail
    f_in: torch.Tensor  # [R, H] bf16 expert input
    ids: torch.Tensor | None = None  # [R, K] int32, (probability desc, index asc); −1 on failure
    weights: torch.Tensor | None = None  # [R, K] fp32, renormalized over the top K
    fq: torch.Tensor | None = None  # [R, H] E4M3 quantize_act(f_in), when the tail quantizes
    sf: torch.Tensor | None = None  # [R, ⌈H/128⌉] fp32 its scales


@dataclass
class MoeTailOut:
    """What `moe_tail` returns (the fused expert reduction + residual + next norm)."""

    xn: torch.Tensor  # [R, H] bf16 next layer's normalized input (or the final hidden state)
    x: torch.Tensor | None = None  # [R, H] bf16 layer output (optional)
    xq: torch.Tensor | None = None  # [R, H] E4M3 quantize_act(xn), when the tail quantizes
    sx: torch.Tensor | None = None  # [R, ⌈H/128⌉] fp32 its scales


@dataclass(frozen=True)
class EntrySource:
    """Where the draft's entry rows come from (`draft_entry`, `eh_proj`): row r < n takes the
    token tokens[clamp(tok_base + r, 0, tok_max)] (its id clamped to [0, V − 1]) and the hidden
    row hidden[clamp(hid_base + r, 0, S − 1)], at position pos_base + r. The bases are host ints
    or device [1] tensors (a captured round reads them on the device, never on the host)."""

    tokens: torch.Tensor  # [P] int64 token slots
    tok_base: int | torch.Tensor
    tok_max: int  # the last readable slot of tokens
    hidden: torch.Tensor  # [S, H] bf16 target hidden states
    hid_base: int | torch.Tensor
    pos_base: int | torch.Tensor


@dataclass(frozen=True)
class EntryNorms:
    """The draft's entry weights: the token embedding and the two RMS norms of its halves."""

    embed: torch.Tensor  # [V, H] bf16
    enorm: torch.Tensor  # [H] the embedding half's norm weight
    hnorm: torch.Tensor  # [H] the hidden half's norm weight
    eps: float


class FaultLog(NamedTuple):
    """Where a round records the request's first fault (iquestrt/state.py lists the codes):
    written once, by the first fault; code 0 means none."""

    fault: torch.Tensor  # [4] int64 (code, round, where, value)
    round_no: torch.Tensor  # [1] int32 the round being run (the recorded round)


class DraftRecord(NamedTuple):
    """A round's record of its draft steps (iquestrt/round.py): step j writes row j of q_ids,
    q_probs and drafts, and adds its live flag to n_d."""

    q_ids: torch.Tensor  # [Db, W] int64 the draft's served ids at each depth (−1: not run)
    q_probs: torch.Tensor  # [Db, W] fp32 their probabilities (0: not run)
    drafts: torch.Tensor  # [Db] int64 the drafts y_1 … y_Db (clamped into the vocabulary)
    n_d: torch.Tensor  # [1] int32 drafts run so far


class RoundBegin(NamedTuple):
    """What a round's first launch (begin_round) derives from the request state for its draft
    depths (iquestrt/round.py); buffers the round program keeps, written every round."""

    go: torch.Tensor  # [1] int32 1 − done: the round runs
    c: torch.Tensor  # [1] int32 depth 0's catch-up rows (m − draft_next + 1)·go
    hid_base: torch.Tensor  # [1] int32 draft_next − 1 − hidden_at: depth 0's first hidden row
    last: torch.Tensor  # [1] int64 depth 0's last live row, max(c − 1, 0)
    # [Db] int32 draft_next + c + j: depth j samples its draft at pos[j]; depth j ≥ 1 runs its
    # one-row forward at pos[j − 1] (a depth that does not run leaves its entry unread)
    pos: torch.Tensor
    feat: torch.Tensor  # [1, 3] fp32 the control features before depth 1 (init_features)


class TargetRows(NamedTuple):
    """The verification forward's rows, written by target_rows after the draft depths."""

    n_t: torch.Tensor  # [1] int32 verification rows (n_d + 1)·go
    tokens: torch.Tensor  # [R] int64 x_m, then the drafts y_1 … y_{R−1} (rows ≥ n_t unread)
    pos: torch.Tensor  # [R] int32 m + r for r < n_t, −1 for padding rows
    sample_pos: torch.Tensor  # [R] int64 m + 1 + r: the target's draws
    first: torch.Tensor  # [1] int64 m + 1: the first draft's position (verification)
    # [1] int32 the draft cache's next position after the depths that ran: pos[0] + n_d − 1
    # (begin_round's pos), or draft_next when none ran
    nxt: torch.Tensor


class SettleBounds(NamedTuple):
    """The caches' rollback bounds of a verified round (settle_bounds)."""

    keep: torch.Tensor  # [1] int32 m + (a + 1)·go: the target caches keep positions < keep
    written: torch.Tensor  # [1] int32 m + n_t: the target caches were written through here
    keep_d: torch.Tensor  # [1] int32 the draft cache's next position (settled_draft_next, capped)


class RoundState(NamedTuple):
    """The request state and result log a round's settlement writes (iquestrt/state.py
    DeviceState, whose docstring defines each field; slot P of tokens and row L of the log are
    dump targets for rounds that commit nothing)."""

    tokens: torch.Tensor  # [P + 1] int64
    stop: torch.Tensor  # [S] int64
    m: torch.Tensor  # [1] int32
    draft_next: torch.Tensor  # [1] int32
    hidden: torch.Tensor  # [R, H] bf16
    hidden_at: torch.Tensor  # [1] int32
    n_new: torch.Tensor  # [1] int32
    max_new: torch.Tensor  # [1] int32
    done: torch.Tensor  # [1] int32
    round_no: torch.Tensor  # [1] int32
    fault: torch.Tensor  # [4] int64
    head: torch.Tensor  # [L + 1, 5] int32
    emitted: torch.Tensor  # [L + 1, R] int64
    drafts: torch.Tensor  # [L + 1, Db] int64
    q_ids: torch.Tensor  # [L + 1, Db, W] int64
    q_probs: torch.Tensor  # [L + 1, Db, W] fp32
