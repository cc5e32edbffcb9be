"""The decode engine on one tensor-parallel rank: iquestrt.engine.Engine with the rank's target
(iquestrt/tp/model.py), sharded sampling of the target's vocabulary slices, and the draft
replicated (every rank runs the whole draft on the same inputs, so its tokens agree without a
broadcast). Every rank runs the same request and, since sampling picks the same token on every
rank (iquestrt/tp/sampling.py), the same rounds: tokens, acceptance and cache settlement agree.

RuntimeConfig.tp_reduce = "peer": the O and expert partials go through rings the tails read on
every rank (iquestrt/tp/peer_ring.py) instead of all-gathers; same bits.

CUDA graphs (RuntimeConfig.graphs, host loop): a round is captured with its collectives (the
sharded sampler's candidate all-gather, layer 0's dense partials, with tp_reduce "gather" every
reduction) and, with tp_reduce "peer", its ring slots: each ring takes a fixed number of
reductions per forward and has a number of slots that divides it (peer_ring.ring_buffers), so
every forward — eager prefill chunk, capture, replay — starts at slot 0 and a replay's fixed
slots are the ones the protocol expects. Capture's warm-up runs with 0 live rows (empty steps:
no poll, no re-arm), so the rings are reset (armed, every rank, synchronized) at each request's
start and, with graphs, again before its rounds. The device loop (a WHILE node around NCCL
kernels) is refused. Graphs need GPUs: on two H200s graphed decodes equal eager ones with both
reductions (tests/tp/test_tp_engine.py). Close the engine (Engine.close) before destroying the
group: NCCL's communicator teardown waits for every graph that captured its collectives.
"""

from __future__ import annotations

import dataclasses

from iquestrt.cache import RuntimeCaches
from iquestrt.config import RuntimeConfig
from iquestrt.draft import DraftModel
from iquestrt.engine import Engine
from iquestrt.engine_parts import EngineParts
from iquestrt.graphs import RoundPrograms
from iquestrt.ops import Live, make_ops
from iquestrt.tp.group import TPGroup
from iquestrt.tp.model import TPTargetModel, reduction_steps
from iquestrt.tp.peer_ring import make_rings, ring_buffers
from iquestrt.tp.ring_resets import RingResets
from iquestrt.tp.sampling import ShardedSampler, make_sharded_sampler
from iquestrt.tp.shard import shard_weights
from iquestrt.weights import Weights
from kernels.linear import linear_fp8_splits


class TPOps:
    """The rank's op table: `base` for everything, except that logits of this rank's target
    vocabulary slice ([R, V/N]) are sampled by the sharded sampler; full-vocabulary rows (the
    replicated draft's) by the base sampler."""

    def __init__(self, base, sampler: ShardedSampler):
        self.base, self.sampler = base, sampler
        self.local_vocab = len(sampler.shard)

    def __getattr__(self, name):
        return getattr(self.base, name)

    def sample(self, logits, params, seed, positions, purpose, live: Live):
        if logits.shape[-1] != self.local_vocab:
            return self.base.sample(logits, params, seed, positions, purpose, live)
        return self.sampler.sample(logits.contiguous(), params, seed, positions, purpose, live)


class TPEngine(Engine):
    """An Engine of this rank's parts: the rank's target, TPOps (sharded sampling), the
    replicated draft, caches with the full model's draft KV heads, and RingResets."""

    def __init__(self, weights: Weights, rcfg: RuntimeConfig, group: TPGroup):
        """weights: the full model (each rank cuts its share); group: this rank's TPGroup."""
        if rcfg.loop == "device":
            raise ValueError("TPEngine: RuntimeConfig.loop 'device' is not supported with tensor "
                             "parallelism (NCCL kernels inside a WHILE node's body are untried);"
                             " use the host loop")
        if rcfg.pdl:
            raise ValueError("TPEngine: RuntimeConfig.pdl is not supported with tensor "
                             "parallelism yet (the sharded sampler launches without it)")
        if group.world < 2:
            raise ValueError(f"TPEngine: a group of {group.world} rank; use Engine")
        full = weights.cfg
        rank_w, plans = shard_weights(weights, group.world, group.rank)
        rcfg.validate_for(rank_w.cfg)
        ops = TPOps(make_ops(rcfg.ops, rcfg.device, rcfg.max_polls, rcfg.pdl),
                    make_sharded_sampler(rcfg.ops, group, full.target.vocab_size))
        rings = None
        if rcfg.tp_reduce == "peer":
            o_w = rank_w.layers[0].attn.o.w  # [H, Po]: every layer's O projection has this shape
            steps = reduction_steps(rank_w)
            if rcfg.graphs and None in map(ring_buffers, steps):
                raise ValueError(f"TPEngine: graphs with tp_reduce 'peer' need at least 3 "
                                 f"reductions of each kind per forward (a ring of >= 3 slots "
                                 f"dividing them); this model has {steps}")
            rings = make_rings(group, rcfg.max_width, full.target.hidden_size,
                               linear_fp8_splits(*o_w.shape), rcfg.peer_max_polls, *steps)
        draft_kv = full.target.num_key_value_heads
        resets = RingResets(rings, group)
        parts = EngineParts(
            ops=ops,
            target=TPTargetModel(rank_w, plans, ops, rcfg.max_width, group, rings),
            # the draft is whole on every rank: it reads the full model's head counts
            draft=DraftModel(dataclasses.replace(rank_w, cfg=full), ops, rcfg.max_width),
            programs=RoundPrograms(rcfg.graphs, rcfg.loop),
            new_caches=lambda capacity: RuntimeCaches.create(
                rank_w.cfg, rcfg, capacity, rank_w.device, draft_kv_heads=draft_kv),
            observers=(resets,),
            tensor_parallel=True,
        )
        super().__init__(rank_w, rcfg, parts=parts)
        self.group, self.full_cfg, self.ring_resets = group, full, resets
