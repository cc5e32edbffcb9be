"""Twin of kernels/eh_proj.py: the composition the fused kernel replaces — the draft's entry
(reference/twins/draft_entry.py), then eh_proj's BF16 linear with an FP32 sum, one live row at
a time.

Dimension letters: R rows, H hidden.
"""

from __future__ import annotations

import torch

from reference.twins.draft_entry import draft_entry_ref
from reference.twins.linear import linear_bf16_f32_ref
from reference.twins.rows import NAN, live_count


def eh_proj_ref(tokens_src, tok_base, tok_max: int, hid_src, hid_base, pos_base, n_live,
                embed, enorm, hnorm, eps: float, weight: torch.Tensor, pos_out: torch.Tensor):
    """→ (x [R, H] bf16, padding rows NaN; pos_out [R] int32)."""
    rows, dev = pos_out.shape[0], pos_out.device
    eh = torch.zeros(rows, 2 * embed.shape[1], dtype=torch.bfloat16, device=dev)  # [R, 2H]
    draft_entry_ref(tokens_src, tok_base, tok_max, hid_src, hid_base, pos_base, n_live, embed,
                    enorm, hnorm, eps, eh, pos_out)
    n = live_count(n_live, rows)
    x = torch.full((rows, weight.shape[0]), NAN, dtype=torch.bfloat16, device=dev)
    for r in range(n):
        x[r : r + 1] = linear_bf16_f32_ref(eh[r : r + 1], weight, out_dtype=torch.bfloat16)
    return x, pos_out
