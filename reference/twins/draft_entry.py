"""Twin of kernels/draft_entry.py: the composition the draft's entry launch replaces — gather
with the launch's clamps (token slot to [0, tok_max], token id to [0, V − 1], hidden row to
[0, S − 1]), embed, the two norm_rows twins into eh_out's halves (live rows only), and the
positions pos_base + r, −1 for padding rows.

Dimension letters: P token slots, S hidden rows, R rows, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from reference.twins.kv_cache import as_int
from reference.twins.rows import live_count, norm_rows_ref


def draft_entry_ref(tokens_src: torch.Tensor, tok_base, tok_max: int, hid_src: torch.Tensor,
                    hid_base, pos_base, n_live, embed: torch.Tensor, enorm: torch.Tensor,
                    hnorm: torch.Tensor, eps: float, eh_out: torch.Tensor,
                    pos_out: torch.Tensor):
    """tokens_src [P], hid_src [S, H] → (eh_out [R, 2H] bf16, pos_out [R] int32), written in
    place as the kernel writes them."""
    rows, h_size = eh_out.shape[0], embed.shape[1]
    n = live_count(n_live, rows)
    ar = torch.arange(rows, device=tokens_src.device)  # [R]
    slot = (as_int(tok_base) + ar).clamp(0, tok_max)
    tok = tokens_src[slot].clamp(0, embed.shape[0] - 1)  # [R]
    hrow = (as_int(hid_base) + ar).clamp(0, hid_src.shape[0] - 1).to(hid_src.device)
    norm_rows_ref(embed[tok.to(embed.device)], enorm, n, eps, y_out=eh_out[:, :h_size])
    norm_rows_ref(hid_src[hrow], hnorm, n, eps, y_out=eh_out[:, h_size:])
    ar = ar.to(pos_out.device)
    pos_out.copy_(torch.where(ar < n, as_int(pos_base) + ar, -1))
    return eh_out, pos_out
