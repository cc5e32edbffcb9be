"""Partials that are not one tensor: N buffers [R, H] addressed through a device table of base
addresses, for the tails' reduction over peer buffers.

Under tensor parallelism each rank writes its O-projection / expert partials into its own
buffer, and every rank's tails read all N ranks' buffers directly (GPU peer memory, e.g. the
buffers of a torch symmetric-memory allocation mapped into this rank's address space): the
all-reduce is the tail's own read, with NaN readiness (kernels/readiness.py) as the only
synchronization. Peer buffers sit at unrelated addresses, so the kernels take a table [N] of
int64 base addresses instead of one base and a partial stride; the sum runs over n = 0 … N−1
in table order either way, so the same partials give the same bits as the [N, R, H] tensor.

The table is made once per ring slot (its addresses never change), so a captured CUDA graph
replays it like any other argument.

Dimension letters: N partials, R rows, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.checks import check_tensor

PARTIAL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PeerPartials:
    buffers: tuple[torch.Tensor, ...]  # N × [R, H]: same shape, dtype, device and row stride
    table: torch.Tensor  # [N] int64 on the buffers' device: buffers[n].data_ptr()

    @classmethod
    def of(cls, buffers) -> PeerPartials:
        """The table of `buffers` (each [R, H], unit column stride; views of peer memory are
        fine: only their addresses and this device's access to them matter)."""
        buffers = tuple(buffers)
        check_buffers(buffers)
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        return cls(buffers, table.to(buffers[0].device))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.buffers), *self.buffers[0].shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def row_stride(self) -> int:
        return self.buffers[0].stride(0)


@dataclass(frozen=True)
class RingRead:
    """A tail's read of one ring slot (iquestrt/tp/peer_ring.py): the slot's partials, the
    consumer's own re-arm target of the previous step, and its poll bound."""

    partials: PeerPartials
    rearm: torch.Tensor  # [S, R, H]
    max_polls: int


def check_peer_partials(p: PeerPartials) -> None:
    """Host metadata only (no device read: the tails are launched inside captured rounds): the
    buffers agree and the table is [N] int64 on their device. Its contents are what `of` wrote."""
    if not isinstance(p, PeerPartials):
        raise ValueError(f"partials: expected a torch.Tensor or PeerPartials, got "
                         f"{type(p).__name__}")
    check_buffers(p.buffers)
    check_tensor("PeerPartials.table", p.table, shape=(len(p.buffers),), dtypes=(torch.int64,),
                 device=p.device)


def check_buffers(buffers: tuple[torch.Tensor, ...]) -> None:
    """ValueError naming the buffer that differs from buffers[0] (or is not [R, H] with unit
    column stride in fp32 / bf16)."""
    if not buffers:
        raise ValueError("PeerPartials: expected at least one buffer, got none")
    first = buffers[0]
    check_tensor("PeerPartials.buffers[0]", first, dims=2, dtypes=PARTIAL_DTYPES)
    for i, b in enumerate(buffers):
        name = f"PeerPartials.buffers[{i}]"
        check_tensor(name, b, shape=tuple(first.shape), dtypes=(first.dtype,),
                     device=first.device)
        if b.stride(1) != 1 or b.stride(0) != first.stride(0):
            raise ValueError(f"{name}: expected unit column stride and row stride "
                             f"{first.stride(0)} (buffers[0]'s), got strides {b.stride()}")


def span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a strided tensor can touch."""
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@dataclass(frozen=True)
class PartialsArg:
    """What the kernels take for the partials: a [N, R, H] tensor (one base, partial stride) or
    a PeerPartials (its address table; TABLE)."""

    arg: torch.Tensor  # the partials tensor, or the table
    stride_n: int
    stride_r: int
    table: bool
    shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    spans: tuple[tuple[int, int], ...]  # byte ranges read (the re-arm must not overlap them)


def partials_arg(partials) -> PartialsArg:
    """A tails wrapper's `partials` → its kernel arguments; ValueError naming what is wrong."""
    if isinstance(partials, torch.Tensor):
        check_tensor("partials", partials, dims=3, dtypes=PARTIAL_DTYPES)
        return PartialsArg(partials, partials.stride(0), partials.stride(1), False,
                           tuple(partials.shape), partials.dtype, partials.device,
                           (span(partials),))
    check_peer_partials(partials)
    return PartialsArg(partials.table, 0, partials.row_stride, True, partials.shape,
                       partials.dtype, partials.device, tuple(span(b) for b in partials.buffers))
