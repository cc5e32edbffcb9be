"""Shared setup of the engine tests (no tests here): the checkpoints (reference/correlated.py), a
plain prefill of a committed sequence, and the cache comparison.

Cache checks compare a runtime LayerKV with the rows a clean cache holds: the reference
generator's caches (plain truncation semantics), or a plain prefill of the committed tokens.

Dimension letters: V vocabulary, H hidden, T positions.
"""

from __future__ import annotations

from iquestrt.engine import Engine
from qualification.engine_cache_gate import layer_problems
from reference.config import SamplingDefaults
from reference.correlated import make_ckpt  # noqa: F401 — the engine tests' checkpoints
from reference.kv_layout import EMPTY

GREEDY = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0)
SAMPLING = SamplingDefaults(temperature=1.0, top_k=20, top_p=0.95)  # the model's defaults


def rounds_key(res) -> list:
    """Everything a round records: position, drafts (token, q(token), entropy), accepted, emitted,
    bonus."""
    return [(r.position, [(d.token, d.prob, d.entropy) for d in r.drafts], r.accepted, r.emitted,
             r.bonus) for r in res.rounds]


def prefill(engine: Engine, tokens: list[int]):
    """A plain prefill of `tokens` through the engine's target (chunks of max_width rows) →
    (logits [T, V] FP32, hidden [T, H] bf16, caches holding positions 0 … T−1)."""
    return engine.prefill_logits(tokens)


def held(cache) -> tuple:
    """(positions [L], K [L, Hkv, D], V [L, Hkv, D]) a runtime LayerKV labels as held."""
    lab = cache.slot_pos.cpu()
    keep = lab != EMPTY
    return lab[keep].long(), cache.k.cpu()[keep], cache.v.cpu()[keep]


def reference_held(cache, layer: int) -> tuple:
    """The same triple from a reference KVCache (plain rows start … start+L−1)."""
    return cache.positions(layer), cache.k[layer].cpu(), cache.v[layer].cpu()


def cache_problems(ours, committed: int, want: tuple) -> list[str]:
    """How a runtime LayerKV `ours` with positions < committed settled differs from a cache
    that never saw a rejected row, whose held rows are `want` (positions, K, V); [] if not —
    gate 4b's check (qualification/engine_cache_gate.layer_problems: no uncommitted label,
    bit-identical K/V of held positions, every readable position held)."""
    return layer_problems(ours, committed, *want)
