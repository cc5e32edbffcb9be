"""The tensor-parallel process group: one rank per process, started by torchrun (environment
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or with explicit arguments (tests).
NCCL on CUDA devices, gloo on the CPU. Every wait is bounded: init_process_group gets a timeout
and the process group applies it to each collective, so a rank that never arrives makes the
others fail with TPError instead of hanging (gloo bounds each operation by it; NCCL's watchdog
aborts a collective that outlives it, TORCH_NCCL_ASYNC_ERROR_HANDLING's default).

NVLink multicast stays off on the shared multi-GPU hosts (it can take the
host's GPUs out of service): `init_group` sets the three switches below before any process group
exists, and refuses to run when one of them is already set to another value.

Vocabulary split: rank r of N owns the contiguous rows [r·V/N, (r+1)·V/N) of the embedding and
lm_head (ModelConfig.per_rank(N).vocab rows each); V % N != 0 is refused.
"""

from __future__ import annotations

import gc
import math
import os
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from iquestrt.errors import RuntimeFault
from reference.config import ModelConfig

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 120.0
# (variable, required value): NCCL's NVLS, torch symmetric memory and NVSHMEM multicast off.
MULTICAST_OFF = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)


class TPError(RuntimeFault):
    """A process group could not be set up, or a collective failed or timed out."""


def disable_multicast(env: MutableMapping[str, str] | None = None) -> None:
    """Set the multicast switches in `env` (default os.environ); raise if one is set otherwise."""
    env = os.environ if env is None else env
    for name, want in MULTICAST_OFF:
        have = env.get(name)
        if have is not None and have != want:
            raise TPError(
                f"tp.group: environment {name}={have!r}, but NVLink multicast must stay off on "
                f"these hosts (it can take their GPUs out of service): unset it or set "
                f"{name}={want}"
            )
    for name, want in MULTICAST_OFF:
        env[name] = want


def vocab_slice(vocab: int, rank: int, world: int) -> range:
    """Global vocabulary ids [rank·V/N, (rank+1)·V/N) of one rank."""
    for name, v in (("vocab", vocab), ("rank", rank), ("world", world)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"tp.vocab_slice: {name} must be an int, got {v!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"tp.vocab_slice: need world >= 1 and 0 <= rank < world, got rank "
                         f"{rank}, world {world}")
    if vocab < 1 or vocab % world:
        raise ValueError(f"tp.vocab_slice: vocabulary {vocab} is not divisible by the "
                         f"world size {world} (each rank owns V/N contiguous rows)")
    rows = vocab // world
    return range(rank * rows, (rank + 1) * rows)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world: int
    backend: str  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    device: torch.device  # where this rank's tensors live
    timeout_s: float  # bound on init and on every collective

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"TPGroup.world must be an int >= 1, got {self.world!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not (
            0 <= self.rank < self.world
        ):
            raise ValueError(f"TPGroup.rank must be in [0, world={self.world}), got {self.rank!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"TPGroup.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.device, torch.device):
            raise ValueError(f"TPGroup.device must be a torch.device, got {self.device!r}")
        want = "cuda" if self.backend == "nccl" else "cpu"
        if self.device.type != want:
            raise ValueError(f"TPGroup: backend {self.backend} needs a {want} device, got "
                             f"{self.device}")
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:N
            object.__setattr__(self, "device", torch.device("cuda", torch.cuda.current_device()))
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise ValueError(f"TPGroup.timeout_s must be finite and > 0, got {self.timeout_s!r}")

    def vocab_slice(self, vocab: int) -> range:
        return vocab_slice(vocab, self.rank, self.world)

    def model_vocab_slice(self, cfg: ModelConfig) -> range:
        """This rank's rows of cfg's embedding / lm_head, sized by cfg.per_rank(world)."""
        rows = cfg.per_rank(self.world).vocab
        return range(self.rank * rows, (self.rank + 1) * rows)

    def require_initialized(self, what: str) -> None:
        if not dist.is_initialized():
            raise TPError(f"{what}: no process group: call iquestrt.tp.group.init_group first")
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world):
            raise TPError(f"{what}: TPGroup says rank {self.rank} of {self.world}, the process "
                          f"group is rank {dist.get_rank()} of {dist.get_world_size()}")


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world: int
    local_rank: int
    init_method: str  # "env://" under torchrun, "tcp://addr:port" with explicit arguments


def _env_int(env: Mapping[str, str], name: str, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None:
        raise TPError(f"tp.group: environment variable {name} is not set (start the ranks with "
                      "torchrun, or pass rank/world/master_addr/master_port explicitly)")
    try:
        v = int(raw)
    except ValueError:
        raise TPError(f"tp.group: environment {name}={raw!r} is not an integer") from None
    if not lo <= v <= hi:
        raise TPError(f"tp.group: environment {name}={v} outside [{lo}, {hi}]")
    return v


def rendezvous_from_env(env: Mapping[str, str]) -> Rendezvous:
    """The torchrun variables; MASTER_ADDR / MASTER_PORT are required (env:// reads them)."""
    world = _env_int(env, "WORLD_SIZE", 1, 1 << 16)
    rank = _env_int(env, "RANK", 0, world - 1)
    if not env.get("MASTER_ADDR"):
        raise TPError("tp.group: environment variable MASTER_ADDR is not set")
    _env_int(env, "MASTER_PORT", 1, 65535)
    local = _env_int(env, "LOCAL_RANK", 0, world - 1) if "LOCAL_RANK" in env else rank
    return Rendezvous(rank, world, local, "env://")


def rendezvous_explicit(rank: int, world: int, master_addr: str, master_port: int) -> Rendezvous:
    TPGroup(rank, world, "gloo", torch.device("cpu"), 1.0)  # validates rank and world
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"init_group: master_addr must be a host name, got {master_addr!r}")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not (
        1 <= master_port <= 65535
    ):
        raise ValueError(f"init_group: master_port must be in [1, 65535], got {master_port!r}")
    return Rendezvous(rank, world, rank, f"tcp://{master_addr}:{master_port}")


def all_gather(group: TPGroup, x: torch.Tensor, where: str, what: str) -> torch.Tensor:
    """[*S] on each rank → [N, *S] in rank order (one bounded collective; `where` and `what`
    name it in the error a missing or dead peer gives)."""
    if group.world == 1:
        return x[None]
    group.require_initialized(where)
    out = torch.empty(group.world * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    # all_gather_single replaces all_gather_into_tensor in torch >= 2.13; the H200 has 2.11
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        gather(out, x.contiguous())
    except RuntimeError as e:
        raise TPError(
            f"{where}: rank {group.rank} of {group.world}: the all-gather of {what} "
            f"{tuple(x.shape)} {x.dtype} failed or timed out (bound {group.timeout_s:g} s): a "
            f"peer rank did not reach it or died: {e}"
        ) from e
    return out.view(group.world, *x.shape)


def settle(group: TPGroup, where: str) -> None:
    """Every rank's queued kernels have finished (its device synchronized) and every rank got
    here: a bounded barrier, named in its error."""
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    if group.world == 1:
        return
    group.require_initialized(where)
    try:
        dist.barrier()
    except RuntimeError as e:
        raise TPError(f"{where}: rank {group.rank} of {group.world}: the barrier failed or timed "
                      f"out (bound {group.timeout_s:g} s): a peer rank did not reach it or "
                      f"died: {e}") from e


def init_group(
    rank: int | None = None,
    world: int | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,  # default: nccl when CUDA is available, else gloo
    device: torch.device | str | None = None,  # default: cuda:LOCAL_RANK (nccl) or cpu (gloo)
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the default process group: from the torchrun environment when rank, world,
    master_addr and master_port are all None, else from those four arguments."""
    explicit = (rank, world, master_addr, master_port)
    if all(v is None for v in explicit):
        rv = rendezvous_from_env(os.environ)
    elif any(v is None for v in explicit):
        raise ValueError("init_group: pass all of rank, world, master_addr, master_port, or none "
                         "of them (then the torchrun environment is read)")
    else:
        rv = rendezvous_explicit(rank, world, master_addr, master_port)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if device is None and backend == "nccl":
        gpus = torch.cuda.device_count()
        if rv.local_rank >= gpus:  # NCCL refuses two ranks on one GPU ("duplicate GPU")
            raise TPError(f"tp.group: rank {rv.rank} (local rank {rv.local_rank}) has no GPU of "
                          f"its own: {gpus} visible; NCCL needs one per rank (fewer --tp ranks, "
                          f"or CUDA_VISIBLE_DEVICES= for gloo on the CPU)")
        device = f"cuda:{rv.local_rank}"
    elif device is None:
        device = "cpu"
    group = TPGroup(rv.rank, rv.world, backend, torch.device(device), float(timeout_s))
    if not dist.is_available():
        raise TPError("tp.group: this torch build has no torch.distributed")
    if dist.is_initialized():
        raise TPError("tp.group: a default process group already exists in this process")
    disable_multicast()  # before any NCCL communicator can exist
    if backend == "nccl":
        torch.cuda.set_device(group.device)
    try:
        dist.init_process_group(
            backend, init_method=rv.init_method, rank=rv.rank, world_size=rv.world,
            timeout=timedelta(seconds=group.timeout_s),
            device_id=group.device if backend == "nccl" else None,
        )
    except (RuntimeError, TimeoutError, OSError) as e:
        raise TPError(
            f"tp.group: rank {rv.rank} of {rv.world}: init_process_group({backend}) via "
            f"{rv.init_method} did not complete within {group.timeout_s:g} s (did every rank "
            f"start and reach the same address?): {e}"
        ) from e
    return group


def close_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Destroy the default process group, waiting at most timeout_s. NCCL's communicator
    teardown waits until every CUDA graph that captured one of its collectives is freed (close
    the engines first: Engine.close()); a teardown still running then is reported, not waited
    for."""
    if not dist.is_initialized():
        return
    gc.collect()  # graphs only referenced from collectable cycles
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="tp-close-group", daemon=True).start()
    if not done.wait(timeout_s):
        raise TPError(f"tp.group: destroy_process_group did not finish within {timeout_s:g} s; a "
                      f"live CUDA graph that captured NCCL collectives holds the communicator "
                      f"(call Engine.close() before close_group)")
