"""The runtime's KV caches for one request: per target layer a full cache (F layers) or a ring
(S layers), and the draft's ring. Containers are reference.kv_layout.LayerKV; writes and
rollbacks go through the ops table (kernels or twins), so no slot arithmetic lives here.

Invariants (the argument is in kernels/kv_cache.py):
  * Full cache: capacity = the request's largest position + 1, slot(p) = p. Ring: window + pad
    slots, slot(p) = p mod C, pad ≥ max_width − 1, so the ≤ max_width rows a forward writes
    before reading never evict a position some live row's window still needs.
  * `target_len` = committed target positions: 0 … target_len − 1 hold settled K/V; the newest
    emitted token (position target_len) is in no target cache yet.
  * The draft's ring starts at position 1 (position 0 has no previous hidden state);
    `draft_next` = the next draft position to write: draft rows 1 … draft_next − 1 are settled.
  * A round writes target positions m … m+D and draft positions up to m+D−1, then settles to
    m+a+1 (a accepted drafts). Rollback only relabels the slots of the rejected positions EMPTY:
    in a ring those writes overwrote positions ≤ m+D−C ≤ m−W, older than any future window start,
    and the next round writes its rows before reading them, so no later read sees rejected data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iquestrt.config import RuntimeConfig
from reference.config import FULL, ModelConfig
from reference.kv_layout import EMPTY, KVLayout, LayerKV

DRAFT_START = 1


@dataclass
class RuntimeCaches:
    target: list[LayerKV]  # one per target layer
    draft: LayerKV
    target_len: int = 0
    draft_next: int = DRAFT_START

    @staticmethod
    def nbytes(cfg: ModelConfig, rcfg: RuntimeConfig, capacity: int) -> int:
        """The bytes `create` allocates (one rank holding every head): K and V in BF16 plus
        the int32 slot labels, per target layer and for the draft ring."""
        t = cfg.target
        slots = [capacity if kind == FULL else t.sliding_window + rcfg.ring_pad
                 for kind in t.layer_types] + [cfg.draft.sliding_window + rcfg.ring_pad]
        per_slot = 2 * t.num_key_value_heads * t.head_dim * 2 + 4
        return sum(slots) * per_slot

    @classmethod
    def create(
        cls, cfg: ModelConfig, rcfg: RuntimeConfig, capacity: int, device: torch.device,
        draft_kv_heads: int | None = None,
    ) -> RuntimeCaches:
        """capacity: positions the request can reach (full caches); rings depend on windows.
        draft_kv_heads: the draft ring's heads when they differ from cfg's (a tensor-parallel
        rank: target caches hold the rank's heads, the replicated draft all of them)."""
        t = cfg.target
        layers = []
        for kind in t.layer_types:
            if kind == FULL:
                lay = KVLayout.make_full(capacity, t.num_key_value_heads, t.head_dim)
            else:
                lay = KVLayout.make_ring(t.sliding_window, rcfg.ring_pad, t.num_key_value_heads,
                                         t.head_dim)
            layers.append(LayerKV.empty(lay, device))
        dlay = KVLayout.make_ring(cfg.draft.sliding_window, rcfg.ring_pad,
                                  draft_kv_heads or t.num_key_value_heads, t.head_dim,
                                  start=DRAFT_START)
        return cls(layers, LayerKV.empty(dlay, device))

    def settle_target(self, ops, keep: int, written: int) -> None:
        """Keep positions < keep; positions keep … written−1 were written and are rejected."""
        if not 0 <= keep <= written:
            raise ValueError(f"settle_target: keep {keep} outside [0, written={written}]")
        ops.rollback_layers(self.target, keep, written)
        self.target_len = keep

    def settle_draft(self, ops, keep: int) -> None:
        """Keep draft positions < keep (clamped to what was written)."""
        keep = max(DRAFT_START, min(keep, self.draft_next))
        ops.rollback(self.draft, keep, self.draft_next)
        self.draft_next = keep

    def reset(self) -> None:
        """Empty, in place, for a new request on the same tensors: every label EMPTY. K/V bytes
        stay (an unlabelled slot is never read, as after a rollback)."""
        for layer in [*self.target, self.draft]:
            layer.slot_pos.fill_(EMPTY)
        self.target_len, self.draft_next = 0, DRAFT_START

    def clone(self) -> RuntimeCaches:
        return RuntimeCaches([c.clone() for c in self.target], self.draft.clone(),
                             self.target_len, self.draft_next)
