"""Sharded sampling on N virtual tensor-parallel ranks in one process, as an op table for the
engine (qualification/tp_sampling_gate.py).

iquestrt/tp/sampling.py's ShardedSampler.sample runs, on each rank: `check` the arguments, the
steps' `local_keys` of the rank's vocabulary slice, the one all-gather of the keys
(`gather_keys`, which needs a torch.distributed process group), then the steps' `from_keys` on the
gathered keys. `VirtualShardOps.sample` runs exactly those functions of the TP code for every
virtual rank r of N — each with its own ShardedSampler (TPGroup rank r of N, the same steps
class the TP engine's make_sharded_sampler picks) on the contiguous logits columns
[r·V/N, (r+1)·V/N) — and replaces only the collective: the N key rows are stacked in rank order
and laid out as gather_keys lays them ([N, R, KP] permuted to [R, N, KP]). Each rank then runs
from_keys itself (no token broadcast); rank 0's SampleOut goes back to the engine.

Beyond the TP engine, which shards only the target's logits (the draft is replicated and samples
its full rows with the base op), every sample call is sharded here: the draft's rows too.

Each call is also compared with the base op on the whole rows (the unsharded sampler): tokens,
served ids and probabilities of the live rows, bit for bit, and every rank with rank 0. The
first mismatch is kept with its call, and per call the rows whose served candidates come from
more than one shard and the rows whose top-K cut falls between two equal z of different shards
(the order key's id tie-break decides which one is served) are counted.

Dimension letters: R rows, n live rows, N virtual ranks, V vocabulary, Vs = V/N, KP key slots,
W served width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iquestrt.ops import Live
from iquestrt.tp.group import TPGroup
from iquestrt.tp.sampling import EMPTY, key_ids, key_values, key_width, make_sharded_sampler
from reference.op_types import SampleOut

RANK_TIMEOUT_S = 60.0  # TPGroup needs a bound; no collective runs here


@dataclass
class ShardLog:
    calls: int = 0
    rows: int = 0
    straddling: int = 0  # live rows whose served candidates come from >= 2 shards
    cut_ties: int = 0  # live rows whose K-th and (K+1)-th merged keys tie across shards
    mismatch: str | None = None  # the first call whose sharded result differs
    idle: int = 0  # calls with no live row (rounds after the request's end, on a GPU)


def _differs(a: SampleOut, b: SampleOut, n: int) -> str | None:
    for name in ("tokens", "ids", "probs"):
        x, y = getattr(a, name)[:n].cpu(), getattr(b, name)[:n].cpu()
        if x.shape != y.shape:
            return f"{name} of shape {tuple(x.shape)} vs {tuple(y.shape)}"
        bad = (x != y).reshape(n, -1).any(1).nonzero().flatten().tolist()
        if bad:
            return f"{name} differ at live row {bad[0]} of {n}"
    return None


class VirtualShardOps:
    """`base`'s op table with `sample` on `world` virtual ranks (module docstring)."""

    def __init__(self, base, ops: str, world: int, vocab: int, device: torch.device):
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.base, self.vocab = base, vocab
        self.ranks = [make_sharded_sampler(ops, TPGroup(r, world, backend, device,
                                                        RANK_TIMEOUT_S), vocab)
                      for r in range(world)]
        self.log = ShardLog()

    def __getattr__(self, name):
        return getattr(self.base, name)

    def sample(self, logits, params, seed, positions, purpose, live: Live) -> SampleOut:
        shards = [logits[:, s.shard.start:s.shard.stop].contiguous() for s in self.ranks]
        for s, x in zip(self.ranks, shards, strict=True):
            s.check(x, params, seed, positions, purpose, live, 0)
        keys = [s.steps.local_keys(x, params, s.shard.start, self.vocab, live)
                for s, x in zip(self.ranks, shards, strict=True)]  # N × [R, KP]
        gathered = torch.stack(keys).permute(1, 0, 2)  # [R, N, KP]: gather_keys' layout
        outs = [s.steps.from_keys(gathered, params, seed, positions, purpose, 0, self.vocab,
                                  live) for s in self.ranks]
        self._observe(logits, params, seed, positions, purpose, live, gathered, outs)
        return outs[0]

    def _observe(self, logits, params, seed, positions, purpose, live, gathered, outs) -> None:
        log, n = self.log, live.n
        if n == 0:  # a round the device ran after the request ended: nothing live to compare
            log.idle += 1
            return
        whole = self.base.sample(logits, params, seed, positions, purpose, live)
        where = f"call {log.calls} ({purpose.name}, {n} live rows)"
        if log.mismatch is None:
            for r, out in enumerate(outs):
                bad = _differs(out, outs[0], n)
                if bad:
                    log.mismatch = f"{where}: rank {r}'s result differs from rank 0's: {bad}"
                    break
            bad = _differs(outs[0], whole, n)
            if log.mismatch is None and bad:
                log.mismatch = f"{where}: sharded vs unsharded sampler: {bad}"
        log.calls += 1
        log.rows += n
        width = len(self.ranks[0].shard)
        ids, probs = outs[0].ids[:n].cpu(), outs[0].probs[:n].cpu()  # [n, W]
        for row_ids, row_p in zip(ids, probs, strict=True):
            log.straddling += len(set((row_ids[row_p > 0] // width).tolist())) > 1
        log.cut_ties += cut_ties(gathered[:n].cpu(), key_width(params)[0], width)


def cut_ties(keys: torch.Tensor, k: int, width: int) -> int:
    """Rows of gathered keys [n, N, KP] whose K-th and (K+1)-th keys in the merged order hold
    equal z from different shards of `width` ids."""
    flat = keys.reshape(keys.shape[0], -1).sort(dim=1, descending=True).values  # [n, N·KP]
    if flat.shape[1] <= k:
        return 0
    a, b = flat[:, k - 1], flat[:, k]
    live = (a != EMPTY) & (b != EMPTY)
    tie = key_values(a) == key_values(b)
    other = key_ids(a) // width != key_ids(b) // width
    return int((live & tie & other).sum())
