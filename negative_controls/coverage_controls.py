"""Mutants for the coverage gates (engine reuse, seed width, TP sharded sampling, depth policy),
each applied by patching inside a context manager that restores on exit; iquestrt/, kernels/
and reference/ themselves are never edited.

  reused_engine_keeps_sampling_values → reuse gate. DeviceSampling.update writes nothing: a
    reused engine samples every later request with the first request's temperature and top-p.
  reused_engine_keeps_stop_ids → reuse gate. DeviceState.begin leaves the previous request's
    stop ids in place (the new request's are written over them only where it has some).
  seed_low_32_bits → seed gate. reference.rng.split_seed keys Philox with the seed's low 32 bits
    only (the twins draw through it too): seeds differing in bit 32 or above collide.
  device_seed_bit_63_dropped → seed gate. DeviceState.begin stores the seed with bit 63 cleared
    (an int64 conversion that drops the sign): the engine's rounds of a seed ≥ 2^63 use another
    seed than its prefill and than the reference.
  sharded_merge_drops_last_shard → TP sampling gate. The merge (the steps' from_keys, kernels
    and twins) ignores the last rank's gathered keys.
  sharded_ties_to_higher_shard → TP sampling gate. The merge takes the global top-K in the order
    (z desc, shard desc, id asc): equal z of different shards go to the higher shard (the right
    order, id asc, is lower shard first for contiguous shards).
  device_depth_threshold_raised → depth policy gate. The device's control step
    (AdaptiveDepth.more_batch) compares with threshold + 1/16; the host's `more` is untouched.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from iquestrt.state import DeviceState
from iquestrt.tp.sampling import EMPTY, KernelShardSteps, TwinShardSteps, key_values, key_width
from kernels.sampler.values import DeviceSampling
from negative_controls.control import Control, gated, patched
from qualification import depth_policy_gate, reuse_gate, seed_gate, tp_sampling_gate
from reference import rng
from reference.depth import AdaptiveDepth

THRESHOLD_SHIFT = 1 / 16  # flips the mini decisions within 1/16 above the threshold




@contextmanager
def reused_engine_keeps_sampling_values():
    def update(self, params, vocab):
        pass

    with patched(DeviceSampling, update=update):
        yield


@contextmanager
def reused_engine_keeps_stop_ids():
    real = DeviceState.begin

    def begin(self, req, vocab):
        kept = self.stop.clone()
        real(self, req, vocab)
        self.stop.copy_(torch.where(self.stop == -2, kept, self.stop))

    with patched(DeviceState, begin=begin):
        yield


@contextmanager
def seed_low_32_bits():
    real = rng.split_seed

    def split_seed(seed):
        return real(seed)[0], 0

    with patched(rng, split_seed=split_seed):
        yield


@contextmanager
def device_seed_bit_63_dropped():
    real = DeviceState.begin

    def begin(self, req, vocab):
        real(self, req, vocab)
        self.seed.fill_(req.seed & (2**63 - 1))

    with patched(DeviceState, begin=begin):
        yield


def _merge_patch(edit):
    """Patch both steps classes' from_keys to see edit(keys [R, N, KP], params, vocab)."""
    steps = (TwinShardSteps, KernelShardSteps)
    real = {c: c.from_keys for c in steps}

    def make(cls):
        def from_keys(self, keys, params, *args, **kw):
            vocab = args[4]  # (seed, positions, purpose, index, vocab, live)
            return real[cls](self, edit(keys, params, vocab), params, *args, **kw)
        return from_keys

    @contextmanager
    def patch():
        try:
            for c in steps:
                c.from_keys = make(c)
            yield
        finally:
            for c in steps:
                c.from_keys = real[c]

    return patch()


def sharded_merge_drops_last_shard():
    def edit(keys, params, vocab):
        keys = keys.clone()
        keys[:, -1] = EMPTY
        return keys

    return _merge_patch(edit)


def _top_k_higher_shard_first(keys: torch.Tensor, params, vocab: int) -> torch.Tensor:
    """keys [R, N, KP] with every key outside the top-K of (z desc, shard desc, id asc) EMPTY."""
    R, N, KP = keys.shape
    k = key_width(params)[0]
    flat = keys.reshape(R, N * KP)  # rank r's slots at r·KP …: slot → shard
    shard = torch.arange(N, device=keys.device).repeat_interleave(KP).expand(R, -1)
    z = torch.where(flat == EMPTY, float("-inf"), key_values(flat))  # EMPTY reads as NaN
    order = flat.argsort(dim=1, descending=True, stable=True)  # (z desc, id asc)
    order = order.gather(1, shard.gather(1, order).argsort(dim=1, descending=True, stable=True))
    order = order.gather(1, z.gather(1, order).argsort(dim=1, descending=True, stable=True))
    empty = flat.gather(1, order) == EMPTY
    kept = torch.zeros_like(flat, dtype=torch.bool)
    kept.scatter_(1, order[:, :k], ~empty[:, :k])
    return torch.where(kept, flat, EMPTY).reshape(R, N, KP)


def sharded_ties_to_higher_shard():
    return _merge_patch(_top_k_higher_shard_first)


@contextmanager
def device_depth_threshold_raised():
    real = AdaptiveDepth.more_batch

    def more_batch(self, n, feat, table=None):
        shifted = dataclasses.replace(self, threshold=self.threshold + THRESHOLD_SHIFT)
        return real(shifted, n, feat, table)

    with patched(AdaptiveDepth, more_batch=more_batch):
        yield




CONTROLS = (
    Control("reused_engine_keeps_sampling_values", "3f engine reuse",
            "a reused engine keeps the first request's temperature and top-p",
            gated(reuse_gate.run, reused_engine_keeps_sampling_values)),
    Control("reused_engine_keeps_stop_ids", "3f engine reuse",
            "a reused engine keeps the previous request's stop ids",
            gated(reuse_gate.run, reused_engine_keeps_stop_ids)),
    Control("seed_low_32_bits", "6b seed width",
            "the Philox key takes the seed's low 32 bits only",
            gated(seed_gate.run, seed_low_32_bits)),
    Control("device_seed_bit_63_dropped", "6b seed width",
            "the device state stores the seed with bit 63 cleared",
            gated(seed_gate.run, device_seed_bit_63_dropped)),
    Control("sharded_merge_drops_last_shard", "6c TP sharded sampling (engine)",
            "the sharded sampler's merge ignores the last rank's candidates",
            gated(tp_sampling_gate.run, sharded_merge_drops_last_shard)),
    Control("sharded_ties_to_higher_shard", "6c TP sharded sampling (engine)",
            "the sharded sampler's merge breaks ties of equal z toward the higher shard",
            gated(tp_sampling_gate.run, sharded_ties_to_higher_shard)),
    Control("device_depth_threshold_raised", "7b adaptive depth decisions",
            "the device's adaptive-depth control step compares with threshold + 1/16",
            gated(depth_policy_gate.run, device_depth_threshold_raised)),
)
