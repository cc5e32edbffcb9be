"""Launch overrides (iquestrt/launch_overrides.py): the text form, its checks, and that the
kernels op table hands the overridden configuration to each covered wrapper (and none when
nothing is overridden, so the wrappers pin their own)."""

import dataclasses

import pytest
import torch

from iquestrt import ops_kernels
from iquestrt.launch_overrides import LaunchOverrideError, LaunchOverrides
from iquestrt.live import Live
from kernels.attention import pick_config
from kernels.linear_launch import linear_fp8_launch
from kernels.moe_launch import moe_launch
from kernels.sampler import sampler_launch
from kernels.tails_launch import tail_launch


def test_parse_and_label_round_trip():
    o = LaunchOverrides.parse(" moe.down_rows=on, sampler.tile=2048,sampler.select=bitonic,"
                              "tails.packed_topk=0 ")
    assert o.moe == (("down_rows", True),)
    assert o.sampler == (("tile", 2048), ("select", "bitonic"))
    assert o.tails == (("packed_topk", False),)
    assert o.label() == ("moe.down_rows=1,sampler.tile=2048,sampler.select=bitonic,"
                         "tails.packed_topk=0")
    assert LaunchOverrides.parse(o.label()) == o
    assert not LaunchOverrides.parse("") and not LaunchOverrides() and o


@pytest.mark.parametrize("text, message", [
    ("moe.down_rows", "expected family.field=value"),
    ("down_rows=1", "expected family.field=value"),
    ("norm.tile=64", "family one of ['attention', 'linear', 'moe', 'qkv', 'sampler', 'tails']"),
    ("attention.tile=64", "attention.tile: unknown field; AttentionConfig has"),
    ("attention.num_stages=0", "AttentionConfig.num_stages: must be >= 1, got 0"),
    ("attention.num_warps=6", "AttentionConfig.num_warps: power of two >= 1, got 6"),
    ("linear.block_n=48", "LinearLaunch.block_n: expected a power of two"),
    ("moe.tile=64", "moe.tile: unknown field; MoeLaunch has"),
    ("moe.down_rows=maybe", "moe.down_rows='maybe': expected one of"),
    ("sampler.tile=big", "sampler.tile='big': expected an integer"),
    ("sampler.tile=3000", "SamplerLaunch.tile: power of two >= 16, got 3000"),
    ("sampler.select=heap", "SamplerLaunch.select: one of"),
    ("moe.silu_in_down=1,moe.fold_silu=1", "fold_silu and silu_in_down both move launch 3"),
    ("moe.down_warps=3", "MoeLaunch.down_warps: expected a power of two"),
    ("tails.block_e=2,tails.block_e=4", "a field is named twice"),
])
def test_bad_overrides_name_the_field(text, message):
    with pytest.raises(LaunchOverrideError) as e:
        LaunchOverrides.parse(text)
    assert message in str(e.value)


def test_configs_replace_only_the_named_fields_of_the_pinned_ones():
    o = LaunchOverrides.parse("moe.down_rows=1,sampler.tile=2048,sampler.scan_warps=4,"
                              "tails.unroll_k=1")
    assert o.moe_config(3072, 192, "cuda") == dataclasses.replace(moe_launch(3072, 192),
                                                                  down_rows=True)
    assert o.sampler_config(20000) == dataclasses.replace(sampler_launch(20000), tile=2048,
                                                          scan_warps=4)
    assert o.tail_config(3072, 256) == dataclasses.replace(tail_launch(3072, 256),
                                                           unroll_k=True)
    assert o.tail_config(3072) == dataclasses.replace(tail_launch(3072), unroll_k=True)
    lin = LaunchOverrides.parse("linear.hoist_scales=1")
    for shape in ((1024, 3072), (3072, 768), (100, 256)):  # pinned QKV, pinned O, a default
        assert lin.linear_config(*shape) == dataclasses.replace(linear_fp8_launch(*shape),
                                                                hoist_scales=True)
    att = LaunchOverrides.parse("attention.num_stages=4")
    for layout in ((128, 131072, False), (128, 4160, True), (64, 96, False)):
        assert att.attention_config(*layout) == dataclasses.replace(pick_config(*layout),
                                                                    num_stages=4)
        assert LaunchOverrides().attention_config(*layout) == pick_config(*layout)
    none = LaunchOverrides()
    assert (none.moe_config(3072, 192, "cuda"), none.sampler_config(20000),
            none.tail_config(3072), none.linear_config(1024, 3072)) == (None,) * 4


def _spy(monkeypatch, module, name, seen):
    def record(*args, config=None, **kw):
        seen[name] = config
        return None
    monkeypatch.setattr(module, name, record)


@pytest.mark.parametrize("text", ["", "moe.down_rows=1,sampler.tile=2048,tails.unroll_k=1,"
                                      "linear.hoist_scales=1,attention.num_stages=4"])
def test_the_kernels_table_passes_the_overridden_configs(monkeypatch, text):
    """Each covered op reaches its wrapper with the overrides applied to the configuration the
    wrapper would pin for that shape (hidden 256, I 64, 512-column logits, 16 experts)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    o = LaunchOverrides.parse(text)
    ops = ops_kernels.KernelOps(torch.device("cpu"), 1, launches=o)
    seen: dict = {}
    _spy(monkeypatch, ops_kernels.k_moe, "moe_fp8", seen)
    _spy(monkeypatch, ops_kernels.k_sampler, "sample", seen)
    _spy(monkeypatch, ops_kernels.k_tails, "attn_tail", seen)
    _spy(monkeypatch, ops_kernels.k_tails, "moe_tail", seen)
    _spy(monkeypatch, ops_kernels.k_linear, "linear_fp8", seen)
    _spy(monkeypatch, ops_kernels.k_linear, "linear_fp8_partials", seen)
    live = Live.of(2, "cpu")
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    moe = type("M", (), {"fc": torch.zeros(16, 128, 256), "fc_s": None, "proj": None,
                         "proj_s": None})()
    ops.moe(x, None, None, moe, live, torch.float32)
    ops.sample(torch.zeros(2, 512), None, 0, None, None, live)
    ops.attn_tail(torch.zeros(8, 2, 256), x, None, None, live, None, eps=1e-6,
                  attn_out_scale=1.0, router_w=torch.zeros(16, 256), top_k=4)
    ops.moe_tail(torch.zeros(8, 2, 256), x, None, live, None, eps=1e-6, ffn_out_scale=1.0)
    lin = type("L", (), {"w": torch.empty(512, 256, device="meta"), "s": None})()
    ops.linear_fp8(x, lin, live, torch.bfloat16)
    ops.linear_fp8_partials(x, lin, live)
    # attention over a cache of 1 KV head of D 128 (6 query heads: the combine quantizes)
    cache = type("C", (), {"layout": type("Y", (), {"head_dim": 128, "capacity": 4160,
                                                    "ring": True})()})()
    attn: list = []
    monkeypatch.setattr(ops_kernels.k_attention, "attention",
                        lambda *a, config=None, **kw: attn.append(config))
    ops.attention(torch.zeros(2, 6, 128), cache, None, live, None, 1.0)
    ops.attention_q(torch.zeros(2, 6, 128), cache, None, live, None, 1.0)
    ring = pick_config(128, 4160, True)
    assert attn == ([dataclasses.replace(ring, num_stages=4)] * 2 if o else [ring, ring])
    if not o:
        assert seen == {"moe_fp8": None, "sample": None, "attn_tail": None, "moe_tail": None,
                        "linear_fp8": None, "linear_fp8_partials": None}
        return
    assert seen["linear_fp8"] == seen["linear_fp8_partials"] == dataclasses.replace(
        linear_fp8_launch(512, 256), hoist_scales=True)
    assert seen["moe_fp8"] == dataclasses.replace(moe_launch(256, 64, "cpu"), down_rows=True)
    assert seen["sample"] == dataclasses.replace(sampler_launch(512), tile=2048)
    assert seen["attn_tail"] == dataclasses.replace(tail_launch(256, 16), unroll_k=True)
    assert seen["moe_tail"] == dataclasses.replace(tail_launch(256), unroll_k=True)


@pytest.mark.parametrize("fold", [False, True])
def test_qkv_fold_picks_the_launch(monkeypatch, fold):
    """qkv.fold_rope=1: KernelOps.qkv_rope is the one folded launch (with the table's scratch,
    the producer's quantization and the linear family's overrides); pinned:
    linear_fp8_partials then qk_rope."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    o = LaunchOverrides.parse("qkv.fold_rope=1,linear.hoist_scales=1" if fold else "")
    assert o.qkv_config().fold_rope is fold
    ops = ops_kernels.KernelOps(torch.device("cpu"), 1, launches=o)
    calls: list = []

    def folded(*args, scratch=None, quantized=None, config=None, **kw):
        calls.append(("qkv_rope", scratch, quantized, config))
        return "parts", "q", "k", "v"

    monkeypatch.setattr(ops_kernels.k_qk, "qkv_rope", folded)
    monkeypatch.setattr(ops_kernels.k_linear, "linear_fp8_partials",
                        lambda *a, quantized=None, **kw: calls.append(("linear", quantized))
                        or "parts")
    monkeypatch.setattr(ops_kernels.k_qk, "qk_rope",
                        lambda parts, *a, **kw: calls.append(("qk_rope", parts)) or ("q", "k", "v"))
    lin = type("L", (), {"w": torch.empty(1024, 3072, device="meta"), "s": None})()
    xq = ("xq", "sx")
    got = ops.qkv_rope(None, lin, None, None, None, None, Live.of(2, "cpu"), num_q_heads=2,
                       num_kv_heads=1, eps=1e-6, xq=xq)
    assert got == ("parts", "q", "k", "v")
    if fold:
        hoisted = dataclasses.replace(linear_fp8_launch(1024, 3072), hoist_scales=True)
        assert calls == [("qkv_rope", ops.qkv_scratch, xq, hoisted)]  # the linear family too
    else:
        assert calls == [("linear", xq), ("qk_rope", "parts")]
