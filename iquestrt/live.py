"""The live-row count of a padded row buffer (host int and device scalar) and seeds given as
host ints or device tensors: what every op of iquestrt/ops.py and the tensor-parallel sampler
take."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Live:
    known: int | None  # live rows when the host knows them; None inside a device-resident round
    t: torch.Tensor  # [1] int32 on the device

    @classmethod
    def of(cls, n: int, device) -> Live:
        return cls(n, torch.tensor([n], dtype=torch.int32, device=device))

    @classmethod
    def on_device(cls, t: torch.Tensor) -> Live:
        return cls(None, t)

    @property
    def n(self) -> int:
        """The host count; reads the device copy when unknown (a sync: twins, CPU and test
        harnesses only — refused while a CUDA graph is being captured)."""
        if self.known is not None:
            return self.known
        if self.t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("Live.n: the live-row count is device-resident here (no host "
                               "reads inside a captured device round)")
        return int(self.t[0])


def host_seed(seed) -> int:
    """A seed given as an int, or as the int64 device tensor [1] of its bits → the uint64."""
    return int(seed.reshape(-1)[0]) % 2**64 if isinstance(seed, torch.Tensor) else seed
