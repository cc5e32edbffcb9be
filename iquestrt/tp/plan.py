"""Block-FP8 sharding plan: which checkpoint channels each tensor-parallel rank holds, and where
they sit among 128 × 128 scale blocks.

A rank's share of a weight dimension is a few contiguous runs of checkpoint indices: its query
heads, its KV heads' k and v rows (QKV output), its gate and up channels of each expert (fc
output) and the same channels as the down projection's input, its vocabulary rows. A checkpoint
scale covers 128 consecutive indices, so a run that starts or ends inside a block shares that
block's scale with a neighbouring rank: IQuest-Q1 at TP8 gives each rank 192 of an expert's 1536
channels (1.5 blocks), and the trained mini model at TP2 gives each rank 64 of 128.

The padded layout keeps plain 128-blocks for the kernels: each run starts in a fresh block of the
rank's tensor at its offset inside its first checkpoint block (start mod 128), the rest of those
blocks is zero. Every rank block then holds indices of exactly one checkpoint block, so its scale
is that block's scale and a dequantized rank tensor equals the checkpoint's rows bit for bit. The
price is the zero channels: an output dimension gets junk channels (zero; a consumer reads the
runs through `gather`), an input dimension needs its activation scattered into the same layout
(`scatter`; zeros meet zero weights); gate and up halves are laid out alike (`paired`) so the
SwiGLU pairs channel j with channel j and the down projection's input plan is the half's.
`overhead` states the extra bytes — for IQuest-Q1's experts
at TP8 +33 % per rank, which is why a kernel-side scale offset (scale row (i + start mod 128) //
128, no extra bytes) is the layout to aim for once the FP8 kernels take it.

Dimension letters: N output channels, K input channels, B = 128 (the scale block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.config import ModelConfig

BLOCK = 128
KINDS = ("q", "kv", "qkv", "o_in", "expert", "expert_fc", "dense", "dense_fc", "vocab")


@dataclass(frozen=True)
class Run:
    start: int  # checkpoint index of the first channel
    stop: int
    at: int  # its index in the rank's (padded) tensor

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class DimPlan:
    runs: tuple[Run, ...]
    size: int  # the rank tensor's length along the dimension (a multiple of BLOCK)

    @property
    def dense(self) -> int:
        return sum(r.length for r in self.runs)

    @property
    def overhead(self) -> float:
        """Extra channels (bytes) of the padded layout over the dense share."""
        return self.size / self.dense - 1.0

    def source_blocks(self) -> list[int]:
        """The checkpoint block of each rank block ([size / BLOCK]): its scale's row."""
        out = [-1] * (self.size // BLOCK)
        for r in self.runs:
            for i in range(r.length):
                b, src = (r.at + i) // BLOCK, (r.start + i) // BLOCK
                if out[b] not in (-1, src):
                    raise AssertionError(f"rank block {b} mixes checkpoint blocks {out[b]}, {src}")
                out[b] = src
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] in the rank layout → [..., dense]: the runs in order."""
        return torch.cat([x[..., r.at : r.at + r.length] for r in self.runs], dim=-1)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dense] (the runs in order) → [..., size] with zeros between them."""
        out = x.new_zeros(*x.shape[:-1], self.size)
        i = 0
        for r in self.runs:
            out[..., r.at : r.at + r.length] = x[..., i : i + r.length]
            i += r.length
        return out


def padded(runs: list[range]) -> DimPlan:
    """Each run in fresh blocks from offset start mod BLOCK; runs in the given order."""
    placed, at = [], 0
    for run in runs:
        if len(run) < 1 or run.step != 1:
            raise ValueError(f"tp.plan.padded: runs must be non-empty and contiguous, got {run}")
        begin = at + run.start % BLOCK
        placed.append(Run(run.start, run.stop, begin))
        at = -(-(begin + len(run)) // BLOCK) * BLOCK
    return DimPlan(tuple(placed), at)


def paired(runs: list[range]) -> DimPlan:
    """Gate / up halves (expert_fc, dense_fc): each half in `size/2` channels with the same
    layout as the first run's own padded plan — what the SwiGLU pairing of channel j of the
    gate half with channel j of the up half needs, and what the down projection's input plan
    (`padded([runs[0]])`) then matches. A later run takes the first run's in-block offset;
    that keeps one checkpoint block per rank block when its start has the same residue mod
    BLOCK, or when it lies inside one checkpoint block and one rank block (tiny's 32-channel
    shares); otherwise ValueError."""
    first = padded([runs[0]])
    off = first.runs[0].at
    placed = [Run(r.start, r.stop, i * first.size + off) for i, r in enumerate(runs)]
    plan = DimPlan(tuple(placed), first.size * len(runs))
    for r in runs[1:]:
        if len(r) != len(runs[0]):
            raise ValueError(f"tp.plan.paired: runs of unequal length {len(runs[0])}, {len(r)}")
    try:
        plan.source_blocks()
    except AssertionError as e:
        raise ValueError(f"tp.plan.paired: runs {runs} cannot share one layout: {e}") from e
    return plan


def rank_runs(cfg: ModelConfig, tp: int, rank: int, kind: str) -> list[range]:
    """Checkpoint index runs of rank `rank` of `tp` along one dimension:
    q / kv / qkv (QKV output rows), o_in (O projection input), expert (one expert's intermediate:
    down projection input), expert_fc (fc output: gate half then up half), dense / dense_fc (the
    same for layer 0's dense FFN), vocab (embedding / lm_head rows)."""
    if kind not in KINDS:
        raise ValueError(f"tp.plan.rank_runs: kind must be one of {KINDS}, got {kind!r}")
    if not 0 <= rank < tp:
        raise ValueError(f"tp.plan.rank_runs: rank {rank} outside [0, tp={tp})")
    t, rs = cfg.target, cfg.per_rank(tp)  # per_rank refuses a tp that does not divide
    d = t.head_dim
    q = range(rank * rs.q_heads * d, (rank + 1) * rs.q_heads * d)
    k0 = t.num_attention_heads * d
    k = range(k0 + rank * rs.kv_heads * d, k0 + (rank + 1) * rs.kv_heads * d)
    v0 = k0 + t.num_key_value_heads * d
    v = range(v0 + rank * rs.kv_heads * d, v0 + (rank + 1) * rs.kv_heads * d)
    e = range(rank * rs.expert_intermediate, (rank + 1) * rs.expert_intermediate)
    f = range(rank * rs.dense_intermediate, (rank + 1) * rs.dense_intermediate)
    return {
        "q": [q], "kv": [k, v], "qkv": [q, k, v], "o_in": [q],
        "expert": [e],
        "expert_fc": [e, range(t.moe_intermediate_size + e.start,
                               t.moe_intermediate_size + e.stop)],
        "dense": [f],
        "dense_fc": [f, range(t.intermediate_size + f.start, t.intermediate_size + f.stop)],
        "vocab": [range(rank * rs.vocab, (rank + 1) * rs.vocab)],
    }[kind]


def shard_rows(w: torch.Tensor, s: torch.Tensor, plan: DimPlan
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] E4M3 with scales s [..., ⌈N/B⌉, ⌈K/B⌉] → the rank's rows in the padded layout
    ([..., size, K], scales [..., size/B, ⌈K/B⌉]); zero rows carry their block's scale."""
    out = w.new_zeros(*w.shape[:-2], plan.size, w.shape[-1])
    for r in plan.runs:
        out[..., r.at : r.at + r.length, :] = w[..., r.start : r.stop, :]
    return out, s[..., plan.source_blocks(), :].clone()


def shard_cols(w: torch.Tensor, s: torch.Tensor, plan: DimPlan
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] with scales [..., ⌈N/B⌉, ⌈K/B⌉] → the rank's input columns in the padded
    layout ([..., N, size], scales [..., ⌈N/B⌉, size/B])."""
    out = w.new_zeros(*w.shape[:-1], plan.size)
    for r in plan.runs:
        out[..., r.at : r.at + r.length] = w[..., r.start : r.stop]
    return out, s[..., plan.source_blocks()].clone()


def overheads(cfg: ModelConfig, tp: int) -> dict[str, float]:
    """The padded layout's worst extra bytes over the ranks, per dimension kind."""
    def plan(r: int, kind: str) -> DimPlan:
        runs = rank_runs(cfg, tp, r, kind)
        return paired(runs) if kind.endswith("_fc") else padded(runs)

    return {kind: max(plan(r, kind).overhead for r in range(tp)) for kind in KINDS}
