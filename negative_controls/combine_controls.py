"""Split-KV combine mutant, caught by gate 2 (stability bands).

The split-KV combine exists only in the production kernel (kernels/attention/): its twin,
reference.twins.attention.attention_ref, computes each row in one pass, so there is no combine there
to break. The control therefore runs gate 2's check on the gate's candidate (the folded-router BF16
reference) with its attention computed by the production kernels — kernels.attention.attention,
split programs then `attention_combine` (compiled on a GPU, interpreted on the CPU) — and the mutant
replaces `attention_combine` with one that adds the splits' normalised outputs with weight 1 instead
of exp(lse_s − M) (the sink still sees the true L). The band always comes from the unmutated FP32 /
BF16 references.

Why gate 2 and not gate 1: gate 1 on the CPU runs the twins (no split), and on a GPU its FP32
band is m × the E4M3 reference's envelope (~30 % relative RMS on the synthetic model), wide
enough to hide a combine error of this size; gate 2's BF16 envelope is ~4 %. Only positions whose
keys span two or more splits move (the interpreter's config deals 16-key tiles, so positions
≥ 16 of the 32-token prompt), which the evidence shows. On the synthetic tiny model, explicitly:
gate 2 takes its verdict there (on mini its unmutated candidate fails the per-position band;
qualification/stability.py says why), and the interpreter runs tiny's attention in seconds.

Dimension letters: S splits, R rows, L keys, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import kernels.attention as k_attention
from negative_controls.control import Control
from qualification import stability
from reference import ops
from reference.config import preset
from reference.kv_layout import KVLayout, LayerKV
from reference.model import ReferenceModel
from reference.synthetic import synthetic_params


def _kernel_attention(q, k, v, q_pos, k_pos, window, sink_k, scale, out_dtype=None):
    """reference.ops.attention's signature on kernels.attention.attention: the keys (at the
    consecutive positions k_pos) go into a full-layout cache; [R, Hq, D] back on the CPU."""
    lo, n = int(k_pos[0]), k_pos.shape[0]
    if not torch.equal(k_pos.cpu(), torch.arange(lo, lo + n)):
        raise ValueError("combine control: k_pos must be consecutive positions")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = LayerKV.empty(KVLayout.make_full(lo + n, k.shape[1], k.shape[2], window, start=lo),
                          dev)
    cache.k[lo:] = k.to(dev, torch.bfloat16)  # [L, Hkv, D]
    cache.v[lo:] = v.to(dev, torch.bfloat16)
    cache.slot_pos[lo:] = k_pos.to(dev, torch.int32)
    out = k_attention.attention(
        q.to(dev, torch.bfloat16).contiguous(), cache, q_pos.to(dev, torch.int32), q.shape[0],
        None if sink_k is None else sink_k.to(dev).contiguous(), scale,
        out_dtype=out_dtype or q.dtype,
    )
    return out.cpu()  # [R, Hq, D]


def combine_without_rescale(parts: k_attention.Partials, q, sink_k, n_live, scale, out, **launch):
    """attention_combine with every split's weight exp(lse_s − M) replaced by 1: the normalised
    split outputs are summed and divided by the number of splits that saw keys."""
    n = int(n_live.reshape(-1)[0]) if isinstance(n_live, torch.Tensor) else int(n_live)
    has = parts.lse[:, :n] > float("-inf")  # [S, n, Hq]
    o = torch.where(has[..., None], parts.o[:, :n], 0.0).sum(0)  # [n, Hq, D]
    o = o / has.sum(0).clamp_min(1)[..., None]
    if sink_k is not None:  # the sink as the real combine applies it, with the true L
        lse = torch.logsumexp(parts.lse[:, :n], dim=0)  # [n, Hq]
        group = q.shape[1] // sink_k.shape[0]
        sk = sink_k.float().repeat_interleave(group, dim=0)  # [Hq, D]
        s = (q[:n].float() * sk[None]).sum(-1) * scale  # [n, Hq]
        o = o * torch.sigmoid(lse - s)[..., None]
    out[:n] = o.to(out.dtype)
    return out


@contextmanager
def _attention_on_kernels(combine=None):
    """reference.ops.attention → the kernels (and attention_combine → `combine` when given),
    restored on exit."""
    real_attention, real_combine = ops.attention, k_attention.attention_combine
    ops.attention = _kernel_attention
    if combine is not None:
        k_attention.attention_combine = combine
    try:
        yield
    finally:
        ops.attention, k_attention.attention_combine = real_attention, real_combine


def _gate(mutated: bool):
    cfg = preset("tiny")
    params = synthetic_params(cfg, 0)
    fp32, bf16 = ReferenceModel(cfg, params, "fp32"), ReferenceModel(cfg, params, "bf16")
    cand = ReferenceModel(cfg, params, "bf16-fold")

    def logits(tokens):
        with _attention_on_kernels(combine_without_rescale if mutated else None):
            return cand.target(tokens, torch.arange(len(tokens)), cand.new_target_cache()).logits

    ok, _, evidence = stability.run(fp32, bf16, logits, stability.StabilityConfig(prompts=1))
    return ok, ["candidate: bf16-fold on the split-KV kernels; " + e for e in evidence]


CONTROLS = (
    Control(
        "combine_without_lse_rescale",
        "2 stability bands",
        "the split-KV combine sums the splits' normalised outputs with weight 1 instead of "
        "rescaling each by exp(lse_s − M)",
        _gate,
    ),
)
