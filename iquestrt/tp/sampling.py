"""Sharded sampling without a token broadcast: every rank holds the logits of its
vocabulary slice [R, Vs] (Vs = V/N), extracts its top-K order keys with global ids, the keys are
all-gathered once ([R, KP] per rank → [R, N, KP]), and every rank runs the same final selection
(global top-K, softmax, top-p, renormalization, draw) on the same gathered keys with the same
(seed, position, purpose, index) counter-based uniforms. All ranks therefore hold the same token,
and it equals the single-process sampler's, with no broadcast and no rank-dependent input.

Why the split is exact: the order key (z desc, id asc) is a total order, the global top-K is a
subset of the union of the shards' top-K, and everything after the pick depends only on that
ordered set (kernels/sampler/ docstring). Both steps exist twice, with identical semantics:
  kernels — kernels.sampler.topk_candidates / sample_from_candidates;
  twins   — torch: the reference order (reference.sampling.order_desc) over z = x / T gives the
            same int64 keys bit for bit; the final step writes the gathered z at their ids into
            a row of −inf and runs reference.twins.sampler.sample_ref on it with T = 1
            (z / 1 = z exactly). Values outside the union cannot enter the top-K, and when fewer
            than K finite z exist every z outside the union is −inf already, so this row has the
            same top-K as the full one and sample_ref returns the unsharded twin's bits.
`ShardedSampler.sample` has the signature of the ops table's `sample` (iquestrt/ops.py), so a
caller holds one object and never branches on the backend.

Dimension letters: R rows (buffer), n live rows, N ranks, V vocabulary, Vs = V/N, K = top_k
(1 when greedy), KP = next power of two ≥ max(K, 2), W served width (K).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from iquestrt.ops import Live, host_seed
from iquestrt.tp.group import TPGroup, all_gather
from kernels import sampler as k_sampler
from kernels.sampler.values import DeviceSampling
from reference.config import ConfigError, SamplingDefaults
from reference.op_types import SampleOut
from reference.rng import MASK32, Purpose
from reference.sampling import SamplingError, order_desc
from reference.twins.sampler import sample_ref

EMPTY = -(2**63) + 1  # kernels.sampler.device.EMPTY: below every real key
ID_BITS = 2**31 - 1


def key_width(params: SamplingDefaults | DeviceSampling) -> tuple[int, int]:
    """(K, KP): candidates kept per rank and the padded slot count of a key row."""
    greedy = params.greedy if isinstance(params, DeviceSampling) else params.temperature == 0.0
    k = 1 if greedy else params.top_k
    return k, max(2, 1 << (k - 1).bit_length())


def order_keys(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """kernels.sampler.device.order_key in torch: (m(z) << 32) | (2^31 − 1 − id), −0.0 as +0.0.
    z [..] fp32, ids [..] int64 → [..] int64."""
    z = torch.where(z == 0.0, torch.zeros_like(z), z)
    b = z.view(torch.int32).to(torch.int64)
    m = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (m << 32) | (ID_BITS - ids)


def key_values(keys: torch.Tensor) -> torch.Tensor:
    m = (keys >> 32).to(torch.int32)
    return torch.where(m < 0, m ^ 0x7FFFFFFF, m).view(torch.float32)


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    return ID_BITS - (keys & ID_BITS)


class KernelShardSteps:
    name = "kernels"

    def local_keys(self, logits, params, vocab_offset: int, vocab: int, live: Live):
        return k_sampler.topk_candidates(logits, params, vocab_offset, vocab, n_live=live.t)

    def from_keys(self, keys, params, seed, positions, purpose, index: int, vocab: int,
                  live: Live) -> SampleOut:
        return k_sampler.sample_from_candidates(keys, params, seed, positions, purpose, index,
                                                vocab=vocab, n_live=live.t)


class TwinShardSteps:
    """Rows ≥ n: keys EMPTY, tokens / ids −1, probs 0 (as TwinOps.sample pads)."""

    name = "twins"

    def local_keys(self, logits, params, vocab_offset: int, vocab: int, live: Live):
        params = _host_params(params)
        R, Vs = logits.shape
        n = live.n
        k, kp = key_width(params)
        keys = torch.full((R, kp), EMPTY, dtype=torch.int64)  # [R, KP]
        x = logits[:n].detach().cpu()  # [n, Vs]
        if torch.isnan(x).any() or (x == float("inf")).any():
            raise SamplingError("logits contain NaN or +inf")
        z = x if params.temperature == 0.0 else x / torch.tensor(params.temperature,
                                                                  dtype=torch.float32)
        if (z == float("inf")).any():
            raise SamplingError(
                f"sampling.temperature={params.temperature}: logits / temperature overflows fp32")
        ids = torch.arange(vocab_offset, vocab_offset + Vs).expand(n, Vs)  # [n, Vs] global ids
        perm = order_desc(z, ids)[:, :k]  # [n, min(K, Vs)] (z desc, id asc)
        keys[:n, : perm.shape[1]] = order_keys(z.gather(1, perm), ids.gather(1, perm))
        return keys.to(logits.device)

    def from_keys(self, keys, params, seed, positions, purpose, index: int, vocab: int,
                  live: Live) -> SampleOut:
        params, seed = _host_params(params), host_seed(seed)
        R = keys.shape[0]
        n = live.n
        kk = keys[:n].cpu().reshape(n, -1)  # [n, N·KP]
        rows, cols = torch.nonzero(kk != EMPTY, as_tuple=True)
        dense = torch.full((n, vocab), float("-inf"), dtype=torch.float32)  # [n, V] z
        dense[rows, key_ids(kk[rows, cols])] = key_values(kk[rows, cols])
        unit = params if params.temperature == 0.0 else dataclasses.replace(params,
                                                                           temperature=1.0)
        tok, ids, probs = sample_ref(dense, unit, seed, positions[:n], purpose, index)
        dev = keys.device
        out = SampleOut(torch.full((R,), -1, dtype=torch.int64, device=dev),
                        torch.full((R, ids.shape[1]), -1, dtype=torch.int64, device=dev),
                        torch.zeros(R, probs.shape[1], dtype=torch.float32, device=dev))
        out.tokens[:n], out.ids[:n], out.probs[:n] = tok, ids, probs
        return out


STEPS = {"kernels": KernelShardSteps, "twins": TwinShardSteps}


def _host_params(params) -> SamplingDefaults:
    """The twins sample on the host: a DeviceSampling's request parameters (kernel steps read
    its device values instead)."""
    return params.params if isinstance(params, DeviceSampling) else params


def _fail(msg: str):
    raise ValueError(f"tp.sampling: {msg}")


def _check_tensor(name, t, dims: int, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims or t.dtype not in dtypes or t.device != device:
        _fail(f"{name} must be a {dims}-D tensor of dtype in {[str(d) for d in dtypes]} on "
              f"{device}, got shape {tuple(t.shape)} {t.dtype} on {t.device}")


def gather_keys(group: TPGroup, keys: torch.Tensor) -> torch.Tensor:
    """The one collective: [R, KP] int64 per rank → [R, N, KP] (rank order; slot stride 1)."""
    return all_gather(group, keys, "tp.sampling", "candidate keys").permute(1, 0, 2)


@dataclass(frozen=True)
class ShardedSampler:
    group: TPGroup
    vocab: int  # the full vocabulary V
    steps: KernelShardSteps | TwinShardSteps

    def __post_init__(self) -> None:
        self.group.vocab_slice(self.vocab)  # V % N == 0, else a named error
        if not isinstance(self.steps, (KernelShardSteps, TwinShardSteps)):
            raise ValueError(f"ShardedSampler.steps: one of {sorted(STEPS)}, got {self.steps!r}")

    @property
    def shard(self) -> range:
        return self.group.vocab_slice(self.vocab)

    def check(self, logits, params, seed, positions, purpose, live, index) -> None:
        """Every argument, before the collective: a rank that raises here raises on every rank
        given the same shapes and parameters, so no rank is left waiting in the all-gather."""
        dev, sh = self.group.device, self.shard
        _check_tensor("logits", logits, 2, (torch.float32,), dev)
        R = logits.shape[0]
        if R < 1 or logits.shape[1] != len(sh) or logits.stride(1) != 1:
            _fail(f"logits must be [R >= 1, Vs={len(sh)}] with unit column stride (rank "
                  f"{self.group.rank}'s slice [{sh.start}, {sh.stop}) of V={self.vocab}), got "
                  f"shape {tuple(logits.shape)} strides {logits.stride()}")
        if not isinstance(live, Live):
            _fail(f"live must be an iquestrt.ops.Live, got {type(live).__name__}")
        _check_tensor("live.t", live.t, 1, (torch.int32,), dev)
        if live.t.numel() != 1 or (live.known is not None and not 1 <= live.known <= R):
            _fail(f"live rows must be one count in [1, R={R}], got {live.known} "
                  f"(live.t shape {tuple(live.t.shape)})")
        if isinstance(params, DeviceSampling):
            _check_tensor("params.values", params.values, 1, (torch.float32,), dev)
            params = params.params  # validated when written; checked again here, host only
        if not isinstance(params, SamplingDefaults):
            _fail(f"params must be a SamplingDefaults or a DeviceSampling, got "
                  f"{type(params).__name__}")
        try:
            params.validate(self.vocab, where="params")
        except ConfigError as e:
            _fail(str(e))
        if params.temperature > 0 and not 1 <= params.top_k <= k_sampler.MAX_TOP_K:
            _fail(f"params.top_k={params.top_k}: sharded sampling needs 1 <= top_k <= "
                  f"{k_sampler.MAX_TOP_K} when temperature > 0 (each rank sends its top-K)")
        if isinstance(seed, torch.Tensor):
            _check_tensor("seed", seed, 1, (torch.int64,), dev)
            if seed.numel() != 1:
                _fail(f"seed tensor must hold one element, got shape {tuple(seed.shape)}")
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            _fail(f"seed must be an int in [0, 2^64) or an int64 tensor [1], got {seed!r}")
        _check_tensor("positions", positions, 1, (torch.int64, torch.int32), dev)
        if positions.shape[0] != R:
            _fail(f"positions must be [R={R}], got {tuple(positions.shape)}")
        if not isinstance(purpose, Purpose):
            _fail(f"purpose must be a reference.rng.Purpose, got {purpose!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MASK32:
            _fail(f"index must be an int in [0, 2^32), got {index!r}")

    def sample(self, logits, params, seed, positions, purpose, live: Live,
               index: int = 0) -> SampleOut:
        """logits [R, Vs] fp32 (this rank's slice) → SampleOut(tokens [R], ids [R, W],
        probs [R, W]), the same on every rank; rows ≥ n as the steps leave them."""
        self.check(logits, params, seed, positions, purpose, live, index)
        keys = self.steps.local_keys(logits, params, self.shard.start, self.vocab, live)
        gathered = gather_keys(self.group, keys)  # [R, N, KP]
        return self.steps.from_keys(gathered, params, seed, positions, purpose, index,
                                    self.vocab, live)


def make_sharded_sampler(ops: str, group: TPGroup, vocab: int) -> ShardedSampler:
    if ops not in STEPS:
        raise ValueError(f"tp.sampling: unknown ops {ops!r}; choose one of {sorted(STEPS)}")
    if ops == "kernels" and group.device.type == "cpu" and os.environ.get(
        "TRITON_INTERPRET"
    ) != "1":
        raise ValueError("tp.sampling: ops='kernels' on the CPU needs TRITON_INTERPRET=1 set "
                         "before the first import of a kernels module (or use ops='twins')")
    return ShardedSampler(group, vocab, STEPS[ops]())
