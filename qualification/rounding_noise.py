"""Rounding-order noise: the matched reference with its reductions perturbed as a legal kernel's
other summation order perturbs them — the yardstick of gate 1's matched band on the GPU.

Every reduction of the reference (GEMM, attention, norm: reference/ops.py) is computed in FP64
and rounded once by `ops.round_to`, so appending tokens changes none of its bits (each row's
sums do not depend on the row count). A kernel's FP32 accumulation in another order lands a few
FP32 ulps away from that correctly rounded value, and where the value sits near a BF16 or E4M3
rounding boundary the output flips one ulp, which later layers amplify. `noisy(eps, seed)`
replaces `ops.round_to` for the duration of a block with

    round_to(y · (1 + eps · u)),   u ~ U(−1, 1) per element, drawn in call order from one
                                    torch.Generator seeded with `seed`

so one seed is one legal draw of rounding order. The elementwise steps a kernel computes in the
same order (residual adds, the FP32 head norm, quantize_act) are not rounded through round_to
and stay exact. eps comes from the tolerance table (`runtime.rounding_noise`), measured as the
kernels' FP32 deviation from their twins on the GPU.
"""

from __future__ import annotations

import contextlib

import torch

from reference import ops as ref_ops


@contextlib.contextmanager
def noisy(eps: float, seed: int):
    """Within the block, reference.ops.round_to perturbs its FP64 input by a relative eps · u."""
    if not 0.0 < eps < 2.0**-8:
        raise ValueError(f"rounding_noise.noisy: eps must be in (0, 2^-8), got {eps}")
    real = ref_ops.round_to
    gen = torch.Generator().manual_seed(seed)

    def perturbed(y: torch.Tensor, dtype) -> torch.Tensor:
        yd = y.double()
        u = torch.rand(yd.shape, generator=gen, dtype=torch.float64).mul_(2.0).sub_(1.0)
        return real(yd * (1.0 + eps * u), dtype)

    ref_ops.round_to = perturbed
    try:
        yield
    finally:
        ref_ops.round_to = real
