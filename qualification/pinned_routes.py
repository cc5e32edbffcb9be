"""The matched reference taking a candidate's expert choices and keys: gate 1's comparison
without the reach of a flip.

A kernel's other summation order moves a router score across a near-tie now and then; the
position then takes another expert and every later position that attends to it moves too —
by more than any rounding band, on the trained mini model. Comparing the kernels with the
matched reference is only sharp once both take the same experts. `PinnedRoutes` is the matched
reference whose target routers take the candidate's ids [T, K] at every (position, layer); the
weights are the reference's own router probabilities of those ids (in the candidate's order),
renormalized as `ops.route` does, so pins equal to its own choice give the plain matched
reference bit for bit. Every pin that differs from its own top-k is recorded with its gap:

  gap(p, l) = max s over own∖pin − min s over pin∖own   (router logits s, FP64, of this model)

which gate 1 judges as a near-tie (routing_flips' rule: gap ≤ m · δ + floor). A wrong expert
that is no near-tie is a defect; a pinned near-tie is not.

`ForcedKV` does the same for attention: a reference cache whose rows at earlier positions are the
candidate's own keys and values (recorded from its KV writes), so each position is computed
from the candidate's context — one E4M3 flip at position q (a legal rounding event, amplified
through the layers) then moves q alone instead of every later position that attends to it,
and the positions become independent samples of the candidate's per-row error.

Dimension letters: T positions, K experts per token, E experts, H hidden, Hkv KV heads, D head
dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import ops
from reference.model import KVCache, ReferenceModel

TARGET_PREFIX = "model.layers."


@dataclass(frozen=True)
class Pinned:
    position: int
    layer: int
    gap: float  # ≥ 0: how far the pin is below the model's own top-k


class PinnedRoutes(ReferenceModel):
    """Matched precision; target routers take `pins` {layer: ids [T, K]} at positions < T."""

    def __init__(self, cfg, params, pins: dict[int, torch.Tensor]):
        super().__init__(cfg, params, "matched")
        self.pins = {layer: ids.long().cpu() for layer, ids in pins.items()}
        self.position = -1  # of the row being computed (matched mode runs one row at a time)
        self.differing: list[Pinned] = []

    def _target(self, tokens, positions, cache):
        self.position = int(positions[0])
        return super()._target(tokens, positions, cache)

    def _moe(self, pre, x, top_k, router_in=None):
        if not pre.startswith(TARGET_PREFIX):  # the draft routes itself
            return super()._moe(pre, x, top_k, router_in)
        layer = int(pre[len(TARGET_PREFIX):].split(".")[0])
        pin = self.pins.get(layer)
        if pin is None or self.position >= pin.shape[0]:
            return super()._moe(pre, x, top_k, router_in)
        src = x if router_in is None else router_in  # [1, H]
        scores = ops.gemm(src, self.p[pre + "mlp.router.weight"])[0]  # [E] FP64
        _, own = ops.route(src, self.p[pre + "mlp.router.weight"], top_k)
        ids = pin[self.position][None]  # [1, K]
        mine, theirs = set(own[0].tolist()), set(ids[0].tolist())
        if mine != theirs:
            gap = float(max(scores[e] for e in mine - theirs)
                        - min(scores[e] for e in theirs - mine))
            self.differing.append(Pinned(self.position, layer, max(gap, 0.0)))
        probs = torch.softmax(scores, dim=-1).float()  # as ops.route: FP64 softmax, FP32 probs
        w = probs[ids[0]].double()
        w = (w / w.sum()).float()[None]  # [1, K]
        if self.route_trace is not None:
            self.route_trace.append((layer, src.float(), ids))
        return self._moe_matched(pre, x, w, ids)


class ForcedKV(KVCache):
    """A target cache for one forward from position 0: the row at position p attends to the
    candidate's K/V at positions < p and to its own k/v at p. kv: {layer: (K, V)}, each
    [≥ T, Hkv, D] in the cache dtype, row i = position i."""

    def __init__(self, n_layers: int, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(n_layers, start=0)
        missing = sorted(set(range(n_layers)) - set(kv))
        if missing:
            raise ValueError(f"ForcedKV: no candidate keys for layers {missing}")
        self.kv = kv

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        n = 0 if self.k[layer] is None else self.k[layer].shape[0]  # = the row's position
        ck, cv = self.kv[layer]
        if ck.shape[0] <= n:
            raise ValueError(f"ForcedKV: layer {layer} holds {ck.shape[0]} candidate rows, "
                             f"position {n} reached")
        self.k[layer], self.v[layer] = ck[: n + 1], cv[: n + 1]  # what later rows see
        return torch.cat([ck[:n], k]), torch.cat([cv[:n], v])


class KVRecorder:
    """Stands in front of an engine's ops and keeps the live rows of every KV write (made by
    qk_rope with the layer's cache); `kv(caches)` → {layer: (K, V)} [T, Hkv, D] on the CPU
    (row = position) for the target caches of a prefill (Engine.prefill_logits returns them)."""

    def __init__(self, inner):
        self.inner = inner
        self.rows: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # id(cache) →

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def qk_rope(self, parts, q_norm, k_norm, positions, table, live, *, num_q_heads,
                num_kv_heads, eps, cache=None):
        q, k, v = self.inner.qk_rope(parts, q_norm, k_norm, positions, table, live,
                                     num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                     eps=eps, cache=cache)
        self._record(cache, positions, live, k, v)
        return q, k, v

    def qkv_rope(self, x, lin, q_norm, k_norm, positions, table, live, *, num_q_heads,
                 num_kv_heads, eps, xq=None, cache=None):
        out = self.inner.qkv_rope(x, lin, q_norm, k_norm, positions, table, live,
                                  num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps,
                                  xq=xq, cache=cache)
        self._record(cache, positions, live, out[2], out[3])
        return out

    def _record(self, cache, positions, live, k, v) -> None:
        if cache is not None:  # k, v [R, Hkv, D]: the rows just written
            n = live.n
            rows = self.rows.setdefault(id(cache), {})
            for p, kr, vr in zip(positions[:n].tolist(), k[:n].cpu(), v[:n].cpu(), strict=True):
                rows[p] = (kr, vr)

    def kv(self, caches) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for layer, cache in enumerate(caches.target):
            rows = self.rows.get(id(cache), {})
            ps = sorted(rows)
            if not ps or ps != list(range(len(ps))):
                raise ValueError(f"KVRecorder: layer {layer} wrote positions {ps[:4]}…, not 0…")
            out[layer] = (torch.stack([rows[p][0] for p in ps]),
                          torch.stack([rows[p][1] for p in ps]))
        return out
