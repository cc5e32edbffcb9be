"""One round of the benchmark's engine on the Triton kernels (interpreted on a CPU): the rank op
table's peer buffers and routing override pass the kernels' own checks (shapes, strides, the
tails' partial count) through the same code path as the GPU benchmark."""

import pytest
import torch

from benchmarks.rank.engine import RankEngine
from benchmarks.rank.shapes import small_rank_config
from benchmarks.rank.traces import uniform_table
from benchmarks.rank.weights import random_weights
from iquestrt.config import RuntimeConfig
from reference.depth import FixedDepth


@pytest.mark.slow
def test_one_round_on_the_kernels(device):
    cfg = small_rank_config(experts=16, top_k=2)  # fewer MoE programs: interpreter time
    t = cfg.target
    w = random_weights(cfg, device, 0, 256)
    table = uniform_table(4, t.num_hidden_layers - 1, 8, t.num_experts, t.num_experts_per_tok).ids
    rc = RuntimeConfig(ops="kernels", device=str(device), max_width=4, ring_pad=8,
                       max_positions=256, policy=FixedDepth(3), prefetch=False,
                       sync_rounds=1)  # more would launch finished rounds, stepping the table
    eng = RankEngine(w, rc, table, seed=0)
    assert eng.ops.name == "rank-kernels"
    res = eng.generate(eng.request(60, 2))
    assert len(res.rounds) == 1 and len(res.rounds[0].drafts) == 3
    assert all(0 <= tok < t.vocab_size for tok in res.tokens)
    assert eng.ops.steps_taken() == 1
    s = eng.ops.attn_buf[3].shape[0] - eng.ops.peers  # the O projection's split-K partials
    assert s >= 1 and torch.isfinite(eng.ops.attn_buf[3][:s, :4]).all()  # the live rows
    assert (eng.ops.attn_buf[3][s:] == 0).all()  # peers untouched
