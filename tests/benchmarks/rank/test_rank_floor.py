"""The floor recomputed by hand from IQuest-Q1's published shapes and sizes at the real
per-rank shapes (1K context, 6 rows, depth 5, 37.7 distinct experts: the seed's measurement)."""

import pytest

from benchmarks.rank.floor import (
    RoundShape,
    floor_bytes,
    floor_seconds,
    floor_terms,
    kv_growth_bytes,
)
from benchmarks.rank.shapes import rank_config

MB, GB = 1e6, 1e9
H200_COPY = 4.24e12  # measured H200 copy bandwidth (read + write)


def _hand(depth: int, rows: int = 6, context: int = 1024, distinct: float = 37.7) -> float:
    """Every term written out from the model's shapes (not from benchmarks.rank.floor)."""
    scale = 4  # FP32 inverse scale per 128×128 block
    qkv = 1024 * 3072 + (1024 // 128) * (3072 // 128) * scale  # 768 + 128 + 128 rows
    o = 3072 * 768 + (3072 // 128) * (768 // 128) * scale
    attn = qkv + o
    expert = 384 * 3072 + 3 * 24 * scale + 3072 * 192 + 24 * 2 * scale  # gate+up, down; 192 = 1.5
    dense = 2 * (1536 * 3072 + 12 * 24 * scale) + 3072 * 1536 + 24 * 12 * scale
    router = 256 * 3072 * 4
    kv_pos = 2 * 1 * 128 * 2  # K and V, one KV head, BF16
    kv = 25 * (context + rows) * kv_pos + 63 * min(4096 + rows - 1, context + rows) * kv_pos
    lm_head = 20000 * 3072 * 2
    draft_depth = lm_head + attn + 3072 * 6144 * 2 + router + min(512, context) * kv_pos
    draft = depth * draft_depth + depth * 8 * expert  # one row per depth (catch-up row 1)
    reductions = 7 * rows * 3072 * 4 * (88 + 87)
    small = 88 * (4 * 3072 * 2 + 2 * 128 * 2 + 128 * 2) + 3072 * 2 * (1 + 2 * rows)
    return (88 * attn + dense + 87 * distinct * expert + 87 * router + kv + lm_head + draft
            + reductions + small)


def test_floor_matches_the_hand_sum():
    cfg = rank_config()
    got = floor_bytes(cfg, RoundShape(rows=6, depth=5, context=1024, distinct=37.7))
    assert got == pytest.approx(_hand(5), rel=1e-12)


def test_terms_match_the_spec_figures():
    t = floor_terms(rank_config(), RoundShape(rows=6, depth=5, context=1024, distinct=37.7))
    assert t["attention"] / 88 == pytest.approx(5.5 * MB, rel=0.01)  # "≈ 5.5 MB per layer"
    assert t["experts"] / (87 * 37.7) == pytest.approx(1.77 * MB, rel=0.01)  # "≈ 1.77 MB"
    assert t["routers"] / 87 == pytest.approx(3.1 * MB, rel=0.02)  # "3 MB per layer"
    # the terms of the ≈ 6–7.5 GB estimate, which leaves out eh_proj, the peer reads, the norms
    spec_terms = sum(t.values()) - 5 * 3072 * 6144 * 2 - t["reductions"] - t["small"]
    assert 6 * GB <= spec_terms <= 7.5 * GB  # "≈ 6–7.5 GB"
    assert 1.5e-3 <= spec_terms / H200_COPY <= 1.8e-3  # "≈ 1.5–1.8 ms"


def test_one_more_depth_costs_one_draft_pass():
    cfg = rank_config()
    d5 = floor_bytes(cfg, RoundShape(6, 5, 1024, 37.7))
    d4 = floor_bytes(cfg, RoundShape(6, 4, 1024, 37.7))
    assert d5 - d4 == pytest.approx(_hand(5) - _hand(4), rel=1e-12)
    # the check is sensitive: a floor that read the lm_head once per round, not per depth,
    # would differ from the hand sum by 5 lm_head shards
    assert abs((d5 - 5 * 20000 * 3072 * 2) - _hand(5)) > 0.5 * GB


def test_kv_growth_to_192k_is_the_spec_figure():
    cfg = rank_config()
    full_only = 25 * (196608 - 1024) * 2 * 128 * 2
    assert full_only == pytest.approx(2.4 * GB, rel=0.05)  # "≈ 2.4 GB … over the 25 full layers"
    sliding = 63 * (4096 + 5 - 1030) * 2 * 128 * 2  # sliding layers fill their window 1K → 4K
    assert kv_growth_bytes(cfg, 6, 1024, 196608) == pytest.approx(full_only + sliding, rel=1e-12)


def test_bad_bandwidth_is_refused():
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        floor_seconds(rank_config(), RoundShape(6, 5, 1024, 37.7), 0.0)
