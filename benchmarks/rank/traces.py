"""Routing that looks like real requests: top-k traces of the trained mini model (24 experts,
top-4) on held-out requests, mapped onto a rank's experts (256, top-8), as a table the
benchmark's ops read instead of the random router's choice (benchmarks/rank/ops.py).

Recording: reference.prefetch.collect_traces over the held-out side of
training.prefetch_fit.split_requests (files disjoint from the predictor's fit prompts), each prompt
truncated to `max_tokens`, precision "bf16-fold" (the runtime's routing semantics). A step is a
window of `rows` consecutive positions of one prompt (windows do not overlap).

Mapping (E_m mini experts, top-k_m → E experts, top-k; p = k / k_m picks per mini expert):
  * mini expert j owns the group {x : ⌊x·E_m / E⌋ = j} (sizes ⌊E/E_m⌋ or ⌈E/E_m⌉: 10 or 11);
  * a row routed to mini expert j at position t in rank layer l gets p distinct experts of j's
    group, chosen by a seeded splitmix64 hash (no RNG state). Mode "position": every pick
    hashes (seed, l, t, j). Mode "primary": the first pick hashes (seed, l, j) only — j's
    primary expert, shared by every row that routes to j — and the others hash (seed, l, t, j);
  * rank layer l ≥ 1 reads mini MoE layer 1 + ⌊(l − 1)·L_m / L⌋ (relative depth).
Rows sharing a mini expert draw from the same small group, so the mini model's cross-row
correlation survives as group-level sharing; a row's k ids stay distinct (groups are disjoint).

Dimension letters: S steps, L MoE layers of the rank, R rows per step, K top-k, E experts,
T traced positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from corpus.requests import load_requests
from corpus.tokenizer import load_tokenizer
from iquestrt import assets
from reference.checkpoint import load_checkpoint
from reference.model import ReferenceModel
from reference.prefetch import collect_traces
from training.prefetch_fit import split_requests

MINI = assets.default_model()
REQUESTS = assets.data("requests", "v1")
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class MiniTraces:
    """ids[j] [T, k_m] int64: mini MoE layer j + 1's routing, positions of all prompts
    concatenated; starts: where each prompt begins in T."""

    ids: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]
    experts: int
    top_k: int
    request_ids: tuple[str, ...]


def record_mini_traces(prompts: int = 8, max_tokens: int = 384, checkpoint: Path = MINI,
                       requests: Path = REQUESTS) -> MiniTraces:
    ck = load_checkpoint(checkpoint)
    cfg = ck.cfg
    layers = tuple(i for i in range(1, cfg.target.num_hidden_layers))
    model = ReferenceModel(cfg, ck.dequantized(), "bf16-fold")
    tok = load_tokenizer(Path(checkpoint) / "tokenizer.json")
    _, held = split_requests(load_requests(requests), 1, prompts)
    toks = [torch.tensor(tok.encode(r["prompt"], add_special_tokens=False).ids[:max_tokens])
            for r in held]
    with torch.no_grad():
        tr = collect_traces(model, toks, layers)
    starts, at = [], 0
    for t in toks:
        starts.append(at)
        at += t.shape[0]
    return MiniTraces(tuple(torch.cat(tr[i].ids) for i in layers), tuple(starts),
                      cfg.target.num_experts, cfg.target.num_experts_per_tok,
                      tuple(r["id"] for r in held))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic; >> on negatives masked to logical)."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def group_bounds(mini_experts: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first expert, size) of each mini expert's group: {x : ⌊x·E_m/E⌋ = j}."""
    owner = torch.arange(experts) * mini_experts // experts
    size = torch.bincount(owner, minlength=mini_experts)
    first = torch.cumsum(size, 0) - size
    return first, size


MODES = ("primary", "position")


def map_ids(mini_ids: torch.Tensor, positions: torch.Tensor, layer: int, mini_experts: int,
            experts: int, top_k: int, seed: int, mode: str = "primary") -> torch.Tensor:
    """mini_ids [T, k_m], positions [T] → [T, K] int64 rank expert ids (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"trace mapping: mode {mode!r}; choose one of {MODES}")
    t, k_m = mini_ids.shape
    if top_k % k_m:
        raise ValueError(f"trace mapping: top_k={top_k} is not a multiple of the mini model's "
                         f"top-k {k_m}")
    picks = top_k // k_m
    first, size = group_bounds(mini_experts, experts)
    if int(size.min()) < picks:
        raise ValueError(f"trace mapping: {experts} experts give groups of {int(size.min())} per "
                         f"mini expert; {picks} picks need at least that many (experts >= "
                         f"{picks * mini_experts})")
    j = mini_ids.long()  # [T, k_m]
    base = _mix(torch.full_like(j, seed) ^ layer)
    key = _mix(_mix(base ^ positions.long()[:, None]) ^ j)  # [T, k_m] per (l, t, j)
    fixed = _mix(_mix(base) ^ j)  # per (l, j)
    g0, gs = first[j], size[j]  # [T, k_m]
    out = torch.empty(t, k_m, picks, dtype=torch.int64)
    taken = torch.zeros(t, k_m, 0, dtype=torch.int64)
    for q in range(picks):
        # the q-th pick: the (h mod (gs − q))-th member not yet taken, in group order
        key = _mix(key + q + 1)
        h = _mix(fixed + 1) if q == 0 and mode == "primary" else key
        r = (h & 0x7FFFFFFFFFFFFFFF) % (gs - q)
        for prev in torch.sort(taken, dim=2).values.unbind(2):
            r = r + (r >= prev).long()
        out[:, :, q] = g0 + r
        taken = torch.cat([taken, r[..., None]], dim=2)
    return out.reshape(t, top_k)


@dataclass(frozen=True)
class RouteTable:
    ids: torch.Tensor  # [S, L, R, K] int32: step s, MoE layer l (rank layer l + 1), row r
    source: str  # "mini-traces/<mode>" or "uniform"

    @property
    def steps(self) -> int:
        return self.ids.shape[0]


def trace_table(tr: MiniTraces, moe_layers: int, rows: int, experts: int, top_k: int,
                seed: int = 0, mode: str = "primary") -> RouteTable:
    """Steps of `rows` consecutive positions from each traced prompt, for every rank MoE layer."""
    lm = len(tr.ids)
    total = tr.ids[0].shape[0]
    ends = tr.starts[1:] + (total,)
    windows = [s0 for a, b in zip(tr.starts, ends, strict=True)
               for s0 in range(a, b - rows + 1, rows)]
    if not windows:
        raise ValueError(f"trace table: no prompt holds {rows} positions")
    idx = torch.tensor(windows)[:, None] + torch.arange(rows)  # [S, R] traced rows
    pos = torch.cat([torch.arange(b - a) for a, b in zip(tr.starts, ends, strict=True)])  # [T]
    layers = []
    for l in range(moe_layers):
        src = tr.ids[l * lm // moe_layers]
        mapped = map_ids(src, pos, l + 1, tr.experts, experts, top_k, seed, mode)  # [T, K]
        layers.append(mapped[idx])  # [S, R, K]
    return RouteTable(torch.stack(layers, 1).to(torch.int32), f"mini-traces/{mode}")


def uniform_table(steps: int, moe_layers: int, rows: int, experts: int, top_k: int,
                  seed: int = 0) -> RouteTable:
    """Independent uniform top-k per row (what a random router gives)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(steps, moe_layers, rows, experts, generator=g)
    return RouteTable(keys.topk(top_k, dim=-1).indices.to(torch.int32), "uniform")


def distinct_per_layer(ids: torch.Tensor, rows: int, experts: int) -> torch.Tensor:
    """ids [S, L, R, K] → [S, L] float: distinct experts among the first `rows` rows."""
    s, l, _, k = ids.shape
    hit = torch.zeros(s, l, experts, dtype=torch.bool)
    hit.scatter_(2, ids[:, :, :rows].reshape(s, l, rows * k).long(), True)
    return hit.sum(-1).float()


def uniform_distinct(rows: int, experts: int, top_k: int) -> float:
    """Expected distinct experts of `rows` independent uniform top-k rows:
    E·(1 − (1 − k/E)^rows)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)
