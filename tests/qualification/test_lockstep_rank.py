"""Gate 1b at the rank's shapes (qualification/lockstep_rank.py): the rank model cut to a few
layers keeps the TP8 rank's dimensions, the configuration refuses a pattern without sliding
layers, and at test size under the interpreter every kernel call of a decode and the sampler at
the shard's vocabulary are judged, and pass."""

import pytest

from qualification import lockstep_rank as lr


def test_the_cut_rank_model_keeps_the_rank_shapes():
    m = lr.rank_model(lr.RankLockstepConfig())
    t = m.target
    assert t.layer_types == ("full",) * 2 + ("sliding",) * 3 + ("full",) * 3
    assert (t.hidden_size, t.num_attention_heads, t.num_key_value_heads) == (3072, 6, 1)
    assert (t.num_experts, t.moe_intermediate_size, t.vocab_size) == (256, 192, 20000)
    assert m.draft.moe_intermediate_size == 192


def test_the_layer_pattern_must_hold_sliding_layers():
    with pytest.raises(ValueError, match="sliding layers need"):
        lr.RankLockstepConfig(repeats=0)


@pytest.mark.slow
def test_rank_lockstep_at_test_size_passes_with_every_op_judged():
    v = lr.verdict(lr.CPU)
    assert v.ok, v.evidence
    for op in ("kernels.moe.e2e", "kernels.attention", "kernels.qk_rope", "kernels.kv_write",
               "kernels.router.ids", "kernels.sampler.token", "kernels.verify",
               "kernels.linear_fp8", "kernels.quantize_act"):
        assert op in v.ops, (op, sorted(v.ops))
    assert "V = [640, 20000]" in v.evidence[0], v.evidence[0]
