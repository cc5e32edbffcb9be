"""Gate 4b — engine cache settlement: after every round the runtime's caches hold exactly the rows
of caches that never saw a rejected row.

Gate 4 checks the rings' kernels in isolation; this one runs the whole engine (twins ops on the
CPU) on the trained mini model, where drafts are accepted 0 … D at a time, and compares after each
round (Engine.generate's on_round) with the reference generator in Precision "matched" — the same
rounding points, bit for bit — whose caches only ever append and truncate. The prompt is long
enough that the target's sliding rings (window 128 + 8 slots) wrap during the decode and the
draft's ring (64 + 8) during the prefill, so settlement is checked before and after a wrap.

Per round: committed lengths (target, draft) equal; then for each target layer and the draft:
  (1) no slot is labelled with an uncommitted position;
  (2) every labelled slot holds a position of the reference cache, with bit-identical K and V
      (a RoPE angle off by one position changes K);
  (3) every position the next query may read (full layers: all committed; rings: the window of
      the newest token) is held.
Slots whose positions rejected rows overwrote in a ring read EMPTY: those positions are older
than any future window (iquestrt/cache.py), so (3) does not ask for them.

Both draft conventions run (reference/config.py DraftConfig): the mini's own (RoPE at the
token's position, accepted deeper rows kept) and the public integrations' (RoPE at the hidden
state's position, accepted rows recomputed from the target's hidden states by the next depth
0), the latter on the same weights — what a checkpoint with the public config runs. In the
"recompute" run the draft cache must also hold, at every committed position, exactly the row
a draft prefill over the committed tokens and target hidden states would write.

Dimension letters: C slots, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qualification import mini_engine
from reference.depth import FixedDepth
from reference.kv_layout import EMPTY
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, ReferenceGenerator


@dataclass(frozen=True)
class EngineCacheGateConfig:
    prompt_tokens: int = 128  # + new tokens > 136 target ring slots: the decode wraps the rings
    new_tokens: int = 24
    depth: int = 3
    seed: int = 1
    kind: str = "completion"  # the request kind whose median prompt is used
    # (draft_position_offset, draft_kv_settle): the mini's own, then the public integrations'
    conventions: tuple[tuple[int, str], ...] = ((0, "keep"), (-1, "recompute"))


def _held(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions [L], K [L, Hkv, D], V [L, Hkv, D]) a runtime LayerKV labels as held."""
    lab = layer.slot_pos.cpu()
    keep = lab != EMPTY
    return lab[keep].long(), layer.k.cpu()[keep], layer.v.cpu()[keep]


def layer_problems(ours, committed: int, ref_pos, ref_k, ref_v) -> list[str]:
    """How runtime LayerKV `ours`, settled to positions < committed, differs from a clean cache
    holding rows ref_pos with ref_k / ref_v; [] if it does not."""
    out = []
    pos, k, v = _held(ours)
    stale = sorted(pos[pos >= committed].tolist())
    if stale:
        out.append(f"slots labelled with uncommitted positions {stale[:5]} (committed < "
                   f"{committed})")
    index = {p: i for i, p in enumerate(ref_pos.tolist())}
    rows = [index.get(p, -1) for p in pos.tolist()]
    if -1 in rows:
        out.append(f"holds position {pos[rows.index(-1)].item()}, which the clean cache lacks")
    else:
        r = torch.tensor(rows, dtype=torch.long)
        bad = ~((k == ref_k[r]).flatten(1).all(1) & (v == ref_v[r]).flatten(1).all(1))
        if bad.any():
            out.append(f"K/V differ from the clean cache at positions "
                       f"{sorted(pos[bad].tolist())[:5]}")
    lay = ours.layout
    lo = lay.start if lay.window is None else max(lay.start, committed - lay.window + 1)
    missing = sorted(set(range(lo, committed)) - set(pos.tolist()))
    if missing:
        out.append(f"readable positions {missing[:5]} not held")
    return out


def settlement_problems(ours, ref_t, ref_d) -> list[str]:
    """ours: RuntimeCaches after a round; ref_t / ref_d: the reference's KVCaches then."""
    if (ours.target_len, ours.draft_next) != (ref_t.next_position, ref_d.next_position):
        return [f"committed target {ours.target_len} / draft {ours.draft_next}, reference "
                f"{ref_t.next_position} / {ref_d.next_position}"]
    out = []
    for i, layer in enumerate(ours.target):
        out += [f"target layer {i}: {p}" for p in layer_problems(
            layer, ours.target_len, ref_t.positions(i), ref_t.k[i].cpu(), ref_t.v[i].cpu())]
    return out + [f"draft: {p}" for p in layer_problems(
        ours.draft, ours.draft_next, ref_d.positions(0), ref_d.k[0].cpu(), ref_d.v[0].cpu())]


def reference_snapshots(model: ReferenceModel, req: GenerationRequest, depth: int):
    """The reference generator's result and its (target, draft) caches after each round."""
    made = {}
    model.new_target_cache = lambda: made.setdefault("t", ReferenceModel.new_target_cache(model))
    model.new_draft_cache = lambda: made.setdefault("d", ReferenceModel.new_draft_cache(model))
    snaps = []
    res = ReferenceGenerator(model, FixedDepth(depth)).generate(
        req, on_round=lambda rec: snaps.append((made["t"].clone(), made["d"].clone())))
    return res, snaps


def with_conventions(ckpt, offset: int, settle: str):
    """The checkpoint's weights under another draft convention."""
    draft = dataclasses.replace(ckpt.cfg.draft, draft_position_offset=offset,
                                draft_kv_settle=settle)
    return dataclasses.replace(ckpt, cfg=dataclasses.replace(ckpt.cfg, draft=draft))


def run(g: EngineCacheGateConfig | None = None) -> tuple[bool, str, list[str]]:
    g = g or EngineCacheGateConfig()
    base = mini_engine.load_mini()
    ev, failed = [], []
    for offset, settle in g.conventions:
        c_ok, c_ev = run_convention(g, with_conventions(base, offset, settle))
        label = f"offset {offset:+d}, {settle}"
        failed += [] if c_ok else [label]
        ev += [f"{label}: {e}" for e in c_ev]
    if failed:  # the failing conventions first, headed by the first problem
        ev = sorted(ev, key=lambda e: not e.startswith(tuple(failed)))
        every = " under every convention" if len(failed) == len(g.conventions) else ""
        ev = [f"FAILS{every} — {ev[0]}"] + ev[1:]
    return not failed, "exact", ev


def recomputed_problems(ckpt, final_d, tokens: list[int], target_hidden) -> list[str]:
    """"recompute": every committed draft row equals a fresh draft prefill's row at that position
    (token p, the target's hidden state of p − 1), K and V bit for bit."""
    model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), "matched")
    n = final_d.next_position
    fresh = model.new_draft_cache()
    pos = torch.arange(fresh.next_position, n)
    model.draft(torch.tensor(tokens)[pos], target_hidden[pos - 1], pos, fresh)
    same_k = (fresh.k[0] == final_d.k[0]).flatten(1).all(1)
    same_v = (fresh.v[0] == final_d.v[0]).flatten(1).all(1)
    bad = pos[~(same_k & same_v)].tolist()
    return [f"draft rows at positions {bad[:5]} differ from a prefill over the committed "
            f"tokens ({len(bad)} of {len(pos)})"] if bad else []


def run_convention(g: EngineCacheGateConfig, ckpt) -> tuple[bool, list[str]]:
    (prompt,) = mini_engine.prompts(g.prompt_tokens, kinds=(g.kind,))
    req = GenerationRequest(prompt.ids, g.new_tokens, mini_engine.SAMPLING, g.seed)
    eng = mini_engine.engine(ckpt, g.depth)
    ours = []
    res = eng.generate(req, on_round=lambda rec: ours.append(eng.session.caches.clone()))
    ref_model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), "matched")
    ref, theirs = reference_snapshots(ref_model, req, g.depth)
    ev, first_bad = [], None
    for i, (c, (t, d)) in enumerate(zip(ours, theirs, strict=False)):
        probs = settlement_problems(c, t, d)
        if probs and first_bad is None:
            first_bad = i
            ev.append(f"round {i} (m = {res.rounds[i].position}, {len(res.rounds[i].drafts)} "
                      f"drafted, {res.rounds[i].accepted} accepted): " + "; ".join(probs[:4]))
    if len(ours) != len(theirs):
        ev.append(f"{len(ours)} runtime rounds, {len(theirs)} reference rounds")
    if res.tokens != ref.tokens:
        flip = mini_engine.first_difference(res.tokens, ref.tokens)
        ev.append(f"tokens differ from the matched reference (first at token {flip})")
    # the convention by its config value: the check must not rest on the code it checks
    recompute = ckpt.cfg.draft.draft_kv_settle == "recompute"
    if recompute and theirs:
        seq = list(prompt.ids) + ref.tokens
        hidden = ref_model.target(torch.tensor(seq), torch.arange(len(seq))).hidden
        ev += recomputed_problems(ckpt, theirs[-1][1], seq, hidden)
    ok = not ev
    slots = eng.rcfg.target_ring_slots(eng.cfg)
    rejected = sum(len(r.drafts) - r.accepted for r in res.rounds)
    wrapped = sum(r.position + len(r.drafts) >= slots for r in res.rounds)
    ev.append(f"{len(ours)} rounds of {prompt.id} ({g.prompt_tokens} prompt tokens): accepted "
              f"{sorted({r.accepted for r in res.rounds})}, {rejected} drafts rejected, "
              f"{wrapped} rounds write past the target ring's {slots} slots"
              + ("; after every round the caches equal the never-rejected caches" if ok else "")
              + ("; the committed draft rows equal a prefill's" if ok and recompute else ""))
    return ok, ev
