"""State and clock of the BF16 torch baseline (benchmarks/rank/baseline.py): weights and static
caches at a synthetic context, one speculative round at a time, CUDA events around every round
and every target layer, and the scaling of the layer subset to the full layer count."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from benchmarks.rank.baseline import (
    LayerWeights,
    baseline_params,
    dense_layer,
    draft_layer,
    experts_gather,
    experts_loop,
    moe_layer,
    probs,
    rope_tables,
)
from reference import ops
from reference.config import FULL, ModelConfig
from reference.params import DRAFT_PREFIX


def _layer_weights(p: dict, pre: str, moe: bool) -> dict[str, torch.Tensor]:
    a = pre + "self_attn."
    w = {"attention_norm": p[pre + "attention_norm.weight"], "qkv": p[a + "qkv_proj.weight"],
         "o": p[a + "o_proj.weight"], "q_norm": p[a + "q_norm.weight"],
         "k_norm": p[a + "k_norm.weight"], "sink": p[a + "sink_k"],
         "attn_out_norm": p[pre + "attn_out_norm.weight"],
         "ffn_norm": p[pre + "feed_forward_norm.weight"]}
    if moe:
        w.update(router=p[pre + "mlp.router.weight"], fc=p[pre + "mlp.experts.fc"],
                 proj=p[pre + "mlp.experts.proj"])
    return w


@dataclass
class BaselineTimes:
    round_s: list[float]  # per timed round
    layer_s: list[list[float]]  # [rounds][layers] target layer times
    kinds: list[str]  # per layer: "dense" | "full" | "sliding"
    scale_to: dict[str, int]  # layers of each kind in the full model

    def scaled_round_s(self) -> float:
        """Median round with the subset's layers replaced by the full model's count."""
        med = statistics.median
        per = {k: med([sum(t for t, kk in zip(r, self.kinds, strict=True) if kk == k)
                       / self.kinds.count(k) for r in self.layer_s]) for k in set(self.kinds)}
        subset = med([sum(r) for r in self.layer_s])
        rest = med(self.round_s) - subset
        return rest + sum(per[k] * n for k, n in self.scale_to.items())


class BaselineRound:
    def __init__(self, cfg: ModelConfig, full_layers: tuple[str, ...], device, seed: int,
                 context: int, depth: int, route_ids: torch.Tensor | None, experts: str,
                 compiled: bool, margin: int = 64, params: dict | None = None):
        """cfg: the subset model (its layer_types); full_layers: the layer_types to scale to;
        route_ids [T, L, ≥R, K] or None (the router's own ids); params: baseline_params(cfg,
        …) to share between variants (built here when None)."""
        t, d = cfg.target, cfg.draft
        self.cfg, self.t, self.d, self.dev = cfg, t, d, torch.device(device)
        self.depth, self.rows = depth, depth + 1
        self.p = p = params if params is not None else baseline_params(cfg, self.dev, seed)
        cap = context + margin
        g = torch.Generator(device=self.dev)
        g.manual_seed(seed + 1)
        self.gen = g
        shape = (cap, t.num_key_value_heads, t.head_dim)
        self.kv = []
        for _ in range(t.num_hidden_layers + 1):  # last: the draft's
            k, v = (torch.zeros(shape, dtype=torch.bfloat16, device=self.dev) for _ in range(2))
            k[:context].normal_(generator=g)
            v[:context].normal_(generator=g)
            self.kv.append((k, v))
        self.kpos = torch.arange(cap, device=self.dev)
        self.ropes = {th: rope_tables(cap, t.rotary_dim, th, self.dev)
                      for th in {t.rope_theta, t.swa_rope_theta, d.swa_rope_theta}}
        self.layers = []
        for i, kind in enumerate(t.layer_types):
            pre = f"model.layers.{i}."
            w = _layer_weights(p, pre, i > 0)
            if i == 0:
                w.update(gate=p[pre + "mlp.gate_proj.weight"], up=p[pre + "mlp.up_proj.weight"],
                         down=p[pre + "mlp.down_proj.weight"],
                         ffn_out_norm=p[pre + "ffn_out_norm.weight"])
            full = kind == FULL
            self.layers.append(LayerWeights("dense" if i == 0 else kind, w,
                                            None if full else t.sliding_window,
                                            t.rope_theta if full else t.swa_rope_theta))
        dp = DRAFT_PREFIX
        dw = _layer_weights(p, dp + "layer.", True)
        dw.update(embed=p[dp + "embed_tokens.weight"], enorm=p[dp + "enorm.weight"],
                  hnorm=p[dp + "hnorm.weight"], eh_proj=p[dp + "eh_proj.weight"],
                  ffn_out_norm=p[dp + "layer.ffn_out_norm.weight"], norm=p[dp + "norm.weight"],
                  lm_head=p[dp + "lm_head.weight"])
        self.draft_w = dw
        self.route_ids = None if route_ids is None else route_ids.to(self.dev, torch.int64)
        self.step = 0
        self.experts = experts_gather if experts == "gather" else experts_loop
        self.moe_fn, self.dense_fn, self.draft_fn = moe_layer, dense_layer, draft_layer
        if compiled:
            self.moe_fn = torch.compile(moe_layer, dynamic=False)
            self.dense_fn = torch.compile(dense_layer, dynamic=False)
            self.draft_fn = torch.compile(draft_layer, dynamic=False)
        self.full_layers = full_layers
        self.m = context
        self.x_m = torch.randint(0, t.vocab_size, (1,), device=self.dev, generator=g)
        self.hprev = torch.empty(1, t.hidden_size, dtype=torch.bfloat16,
                                 device=self.dev).normal_(generator=g)

    def target(self, tokens: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor | None,
               marks: list | None = None):
        """tokens [R] at pos [R] → (logits [R, V] FP32, hidden [R, H]); ids [L, R, K] or None.
        marks: a list that receives a CUDA event before each layer and after the last."""
        t, p = self.t, self.p
        x = p["model.embed_tokens.weight"][tokens]
        for i, lw in enumerate(self.layers):
            if marks is not None:
                marks.append(_event())
            k, v = self.kv[i]
            cos, sin = self.ropes[lw.theta]
            if lw.kind == "dense":
                x = self.dense_fn(t, x, lw.w, k, v, pos, cos, sin, self.kpos)
            else:
                lid = None if ids is None else ids[i - 1, : x.shape[0]]
                x = self.moe_fn(t, x, lw.w, k, v, pos, cos, sin, self.kpos, lw.window, lid,
                                self.experts)
        if marks is not None:
            marks.append(_event())
        hidden = ops.rms_norm(x, p["model.norm.weight"], t.rms_norm_eps)
        return torch.nn.functional.linear(hidden, p["lm_head.weight"]).float(), hidden

    def round(self, marks: list | None = None) -> int:
        """One speculative round; → accepted drafts."""
        t, d, s, g, dev = self.t, self.d, self.cfg.sampling, self.gen, self.dev
        m, depth = self.m, self.depth
        tok, hprev, toks, qs = self.x_m, self.hprev, [self.x_m], []
        k, v = self.kv[-1]
        cos, sin = self.ropes[d.swa_rope_theta]
        for j in range(depth):
            pos = torch.tensor([m + j], device=dev)
            logits, hprev = self.draft_fn(t, d, tok, hprev, self.draft_w, k, v, pos, cos, sin,
                                          self.kpos, self.experts)
            q = probs(logits, s)
            tok = torch.multinomial(q, 1, generator=g)[:, 0]
            qs.append(q)
            toks.append(tok)
        tokens = torch.cat(toks)  # [R]
        ids = None
        if self.route_ids is not None:
            ids = self.route_ids[self.step % self.route_ids.shape[0]]
        self.step += 1
        logits, hidden = self.target(tokens, torch.arange(m, m + depth + 1, device=dev), ids,
                                     marks)
        p = probs(logits, s)  # [R, V]
        u = torch.rand(depth + 1, generator=g, device=dev)
        if depth:
            y = tokens[1:]
            q_y = torch.stack([qs[j][0, y[j]] for j in range(depth)])
            ratio = (p[torch.arange(depth, device=dev), y] / q_y).tolist()
        a = 0
        for j in range(depth):
            if float(u[j]) >= min(1.0, ratio[j]):
                break
            a += 1
        if a < depth:
            resid = (p[a] - qs[a][0]).clamp(min=0)
            nxt = torch.multinomial(resid / resid.sum(), 1, generator=g)
        else:
            nxt = torch.multinomial(p[depth], 1, generator=g)
        self.m, self.x_m, self.hprev = m + a + 1, nxt, hidden[a : a + 1]
        return a

    def time(self, rounds: int, warmup: int) -> BaselineTimes:
        """CUDA events around every round and target layer (needs a GPU)."""
        for _ in range(warmup):
            self.round()
        torch.cuda.synchronize()
        spans, layers = [], []
        for _ in range(rounds):
            marks: list = []
            start = _event()
            self.round(marks)
            end = _event()
            spans.append((start, end))
            layers.append(marks)
        torch.cuda.synchronize()
        full = {"dense": 1, "full": self.full_layers.count(FULL) - 1,
                "sliding": self.full_layers.count("sliding")}
        return BaselineTimes(
            [a.elapsed_time(b) / 1e3 for a, b in spans],
            [[a.elapsed_time(b) / 1e3 for a, b in zip(mk, mk[1:], strict=False)] for mk in layers],
            [lw.kind for lw in self.layers], full)


def _event():
    if not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
