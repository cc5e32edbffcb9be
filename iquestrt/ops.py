"""The one table of device ops the runtime model calls, in two implementations of identical
semantics: "kernels" (iquestrt/ops_kernels.py: the Triton wrappers of kernels/, compiled on a
GPU, interpreted on the CPU) and "twins" (iquestrt/ops_twins.py: their reference twins). Nothing
outside these files knows which one runs.

Conventions (the kernels'): every op works on a padded buffer of R rows (R = max_width), of which
the first n are live; `Live` carries n as a device int32 [1] (what kernels read) and as a host int
(what twins and the torch parts read). Outputs are [R, …]; padding rows are never read. Twins
return live rows only; their adapters write them into padded outputs whose padding rows hold
NaN (ids −1), so a read of padding shows.

Dimension letters: R rows (buffer), n live rows, S split-K partials, N/K GEMM out/in, H hidden,
Hq/Hkv heads, D head dim, E experts, K top-k, V vocabulary, W served width, Db draft buffer.
"""

from __future__ import annotations

import torch

from iquestrt.live import Live, host_seed
from iquestrt.ops_kernels import ROLLBACK_ROWS, KernelOps
from iquestrt.ops_twins import TwinOps

__all__ = ["ROLLBACK_ROWS", "KernelOps", "Live", "TwinOps", "host_seed", "make_ops"]


def make_ops(name: str, device, max_polls: int, pdl: bool = False):
    table = {"kernels": KernelOps, "twins": TwinOps}
    if name not in table:
        raise ValueError(f"ops: unknown backend {name!r}; choose one of {sorted(table)}")
    if name == "kernels":
        return KernelOps(torch.device(device), max_polls, pdl=pdl)
    if pdl:
        raise ValueError("ops: pdl (programmatic dependent launch) needs the 'kernels' backend")
    return TwinOps(torch.device(device), max_polls)
