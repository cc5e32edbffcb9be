"""Engine-level mutants on the twins engine (trained mini model), each applied by patching inside
a context manager that restores on exit; iquestrt/ itself is never edited.

  draft_depth_state_not_advanced → gate 7 (acceptance). Depths ≥ 2 of a round are fed depth 1's
    input row — the draft y_1 and depth 0's hidden — at their own (advancing) positions: the
    recursive state (token, hidden) is not advanced. Every draft is still sampled from the
    served q that verification reads, so outputs keep the target's law (greedy tokens are
    unchanged, tested): only acceptance falls. Patched per round on the engine's DraftModel:
    the round's first draft forward is depth 0, the second depth 1, the rest depths ≥ 2.
  rollback_skipped_after_ring_wrap → gate 4b (engine cache settlement). TwinOps.rollback does
    nothing on a ring once a write has gone past its last slot (written > capacity): rejected
    rows keep their labels.
  stale_rope_position_after_rollback → gate 4b. After a round with rejected drafts, the next
    round's RoPE angles use the unsettled position (m + d + 1 instead of m + a + 1): every
    position given to TwinOps.qk_rope is shifted by the d − a rejected rows, while cache slots
    and masks use the right positions. The K rows written then carry the wrong rotation.
  draft_rope_offset_ignored → gate 4b (its public-convention run). The twins' qk_rope rotates
    draft rows at their own position, ignoring the table's draft_position_offset −1: the draft
    K rows the runtime writes carry the mini's rotation, not the configured one.
  draft_kv_settle_ignored → gate 4b (its public-convention run). DraftConfig.recompute_settled
    reads False for everyone: reference and runtime both keep the accepted deeper rows under
    draft_kv_settle "recompute", so they agree with each other; only the check against a
    fresh draft prefill over the committed tokens can see it.
  padding_row_leaks_into_live_rows → gate 3c (padded vs exact width). Layer 0's attention tail
    averages the last live row's residual with the next row's — a padding row whenever the
    buffer is wider than the live rows (padding embeds token 0, so the leak is finite and no
    fault fires). An exact-width buffer has no such row.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from iquestrt.ops import TwinOps
from iquestrt.round import RoundProgram
from negative_controls.control import Control, gated, patched
from qualification import acceptance_gate, engine_cache_gate, width_gate
from reference.config import DraftConfig
from reference.twins.kv_cache import write_ref


@contextmanager
def draft_depth_state_not_advanced():
    real_call = RoundProgram.__call__

    def call(self):
        draft = self.e.draft
        real_entry = draft.forward_entry
        inputs = []  # (tokens_src, tok_base, tok_max, hid_src, hid_base) of each depth's entry

        def forward_entry(tokens_src, tok_base, tok_max, hid_src, hid_base, *rest, **kw):
            inputs.append((tokens_src, tok_base, tok_max, hid_src, hid_base))
            if len(inputs) >= 3:  # depth ≥ 2: depth 1's token and hidden again
                tokens_src, tok_base, tok_max, hid_src, hid_base = inputs[1]
            return real_entry(tokens_src, tok_base, tok_max, hid_src, hid_base, *rest, **kw)

        draft.forward_entry = forward_entry  # instance attribute, shadows the method
        try:
            real_call(self)
        finally:
            del draft.forward_entry
        if self.depth > 0 and not inputs:
            raise RuntimeError("draft_depth_state_not_advanced: the round never called "
                               "DraftModel.forward_entry; the mutation no longer reaches the draft")

    with patched(RoundProgram, __call__=call):
        yield


@contextmanager
def rollback_skipped_after_ring_wrap():
    real = TwinOps.rollback

    def rollback(self, cache, keep, written):
        if cache.layout.ring and int(written) > cache.layout.capacity:
            return
        real(self, cache, keep, written)

    with patched(TwinOps, rollback=rollback):
        yield


@contextmanager
def stale_rope_position_after_rollback():
    real_call, real_rope = RoundProgram.__call__, TwinOps.qk_rope
    shift = [0]  # rejected rows of the previous round, while a round runs

    def call(self):
        st = self.st
        done = int(st.round[0])
        if done > 0:
            _, a, _, d, _ = (int(x) for x in st.head[done - 1])  # (m, a, bonus, d, emitted)
            shift[0] = d - a
        try:
            real_call(self)
        finally:
            shift[0] = 0

    def qk_rope(self, parts, q_norm, k_norm, positions, table, live, *, cache=None, **kw):
        stale = torch.where(positions >= 0, positions + shift[0], positions)
        q, k, v = real_rope(self, parts, q_norm, k_norm, stale, table, live, **kw)
        if cache is not None:  # the write at the right slots, of K rows rotated at stale ones
            write_ref(cache, k, v, positions, live.n)
        return q, k, v

    with patched(RoundProgram, __call__=call), patched(TwinOps, qk_rope=qk_rope):
        yield


@contextmanager
def draft_rope_offset_ignored():
    real = TwinOps.qk_rope

    def qk_rope(self, parts, q_norm, k_norm, positions, table, *rest, **kw):
        return real(self, parts, q_norm, k_norm, positions, dataclasses.replace(table, offset=0),
                    *rest, **kw)

    with patched(TwinOps, qk_rope=qk_rope):
        yield


@contextmanager
def draft_kv_settle_ignored():
    with patched(DraftConfig, recompute_settled=property(lambda self: False)):
        yield


@contextmanager
def padding_row_leaks_into_live_rows():
    real = TwinOps.attn_tail

    def attn_tail(self, parts, base, *args, **kw):
        n, rows = args[2].n, base.shape[0]  # args: attn_out_norm, ffn_norm, live, flag
        if kw.get("router_w") is None and n < rows:  # layer 0: base is the raw residual x
            base = base.clone()
            base[n - 1] = ((base[n - 1].float() + base[n].float()) / 2).to(base.dtype)
        return real(self, parts, base, *args, **kw)

    with patched(TwinOps, attn_tail=attn_tail):
        yield




def _public_conventions_only():
    """Gate 4b's run under the public conventions: the one both draft-convention mutants reach
    (the mini's own run uses offset 0 and "keep", where neither mutation changes anything). The
    whole gate's unmutated run holds this one (each convention runs on its own): it is these
    controls' baseline, shared with the rollback and RoPE controls."""
    public = engine_cache_gate.EngineCacheGateConfig(conventions=((-1, "recompute"),))
    return engine_cache_gate.run(public)


CONTROLS = (
    Control(
        "draft_depth_state_not_advanced",
        "7 acceptance",
        "draft depths >= 2 are fed depth 1's input (y_1 and depth 0's hidden) at their own "
        "positions: the recursive draft state is not advanced (acceptance-only)",
        gated(acceptance_gate.run, draft_depth_state_not_advanced),
    ),
    Control(
        "rollback_skipped_after_ring_wrap",
        "4b engine cache settlement",
        "KV rollback does nothing on a ring once a write has gone past its last slot",
        gated(engine_cache_gate.run, rollback_skipped_after_ring_wrap),
    ),
    Control(
        "stale_rope_position_after_rollback",
        "4b engine cache settlement",
        "after a round with rejections, the next round's RoPE positions come from the unsettled "
        "m + d + 1 instead of m + a + 1 (slots and masks right)",
        gated(engine_cache_gate.run, stale_rope_position_after_rollback),
    ),
    Control(
        "draft_rope_offset_ignored",
        "4b engine cache settlement",
        "the runtime rotates draft rows at their own position, ignoring "
        "draft_position_offset -1",
        gated(_public_conventions_only, draft_rope_offset_ignored, baseline=engine_cache_gate.run),
    ),
    Control(
        "draft_kv_settle_ignored",
        "4b engine cache settlement",
        "draft_kv_settle 'recompute' is ignored by runtime and reference alike: both keep the "
        "accepted deeper draft rows",
        gated(_public_conventions_only, draft_kv_settle_ignored, baseline=engine_cache_gate.run),
    ),
    Control(
        "padding_row_leaks_into_live_rows",
        "3c padded vs exact width",
        "layer 0's attention tail averages the last live row's residual with the next buffer "
        "row (a padding row whenever the buffer is wider than the live rows)",
        gated(width_gate.run, padding_row_leaks_into_live_rows),
    ),
)
