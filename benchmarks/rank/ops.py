"""The benchmark's op table: the engine's ops (kernels or twins) plus what one rank of a TP8
deployment does that a single GPU would otherwise skip, with no change to engine or model code.

1. Cross-rank reductions. Each target layer's o_proj partials and expert output are summed over
   8 ranks by the attention / MoE tails, which read N partial buffers [N, R, H] with NaN
   readiness (kernels/tails.py). Here the local producer writes the first S slots of a per-layer
   buffer [S + 7, R, H] FP32 whose last 7 slots are peer partials written once at construction
   (zeros: finite, so readiness passes, and x + 0 = x keeps the numbers of a single rank); the
   tails read all S + 7, so a rank's reduction traffic (7 · n · H · 4 bytes per tail) is paid.
   The draft's reductions are not emulated (its o_proj and MoE outputs are plain; 2 × 7 · n · H
   · 4 bytes per depth, < 0.1 % of a round's bytes).
2. Routing from traces. The target's router still runs inside the attention tail (its 3 MB of
   FP32 weights are read), but the ids handed to the experts are the trace table's
   (benchmarks/rank/traces.py): at the first MoE layer of each target forward one index_select
   copies the next step's ids [L, R, K] into a fixed buffer and a device counter advances, so
   the override is capturable and costs 3 small launches per forward. The router's weights
   (not ids) are kept: they only scale expert outputs. The draft routes with its own router.
3. reduce="table" (kernels only): the tails read the same S + 7 partials through a table of
   addresses (kernels/peer_partials.py), the 7 peers in separate allocations as peers' memory
   would be, and re-arm a spare [S, R, H] slot each call — what `--tp-reduce peer` does on a
   rank (iquestrt/tp/peer_ring.py), so the table's and the re-arm's costs are paid.
4. reduce="ring" (kernels only, `--tp N` under torchrun): the partials go through a real TP ring
   (iquestrt/tp/peer_ring.py): the local producer writes this rank's slot, the tails read the N
   real ranks' slots in peer memory — polling until the peers' writes arrive — plus 8 − N
   emulated ranks (zero partials of their own) and re-arm, so the cross-GPU reads, the waits for
   the slowest rank and the re-arms are real. Every rank holds the same random weights and runs
   the same request, so all ranks agree on every token and stay in step.
Which layer a call belongs to is found from the identity of its weight tensor (o_proj weight,
router, expert stack), never from call order.

Dimension letters: S local split-K partials, P = 7 peers, R rows, H hidden, L MoE layers,
K top-k, T table steps.
"""

from __future__ import annotations

import torch

from benchmarks.rank.spec import REDUCES
from iquestrt.launch_overrides import LaunchOverrides
from iquestrt.ops import KernelOps, Live, TwinOps
from iquestrt.tp.peer_ring import TPRings
from iquestrt.weights import Fp8Linear, MoeWeights, Weights
from kernels import linear as k_linear
from kernels import moe as k_moe
from kernels.peer_partials import PeerPartials, RingRead

PEERS = 7  # the other ranks of TP8


class RankOpsMixin:
    """Put before KernelOps / TwinOps in the bases; call `attach` once before the first round."""

    def attach(self, weights: Weights, rows: int, table: torch.Tensor | None,
               peers: int = PEERS, reduce: str = "stacked", rings: TPRings | None = None
               ) -> None:
        """table: [T, L, ≥rows, K] int32 trace ids (None: the router's own ids); reduce: how
        the tails read the partials (module docstring, 1, 3 and 4); rings: the TP rings of
        reduce "ring"."""
        if reduce not in REDUCES:
            raise ValueError(f"reduce: {reduce!r}; choose one of {list(REDUCES)}")
        if reduce in ("table", "ring") and not isinstance(self, KernelOps):
            raise ValueError(f"reduce {reduce!r}: the twins read partials as one tensor")
        if (reduce == "ring") != (rings is not None):
            raise ValueError(f"reduce {reduce!r}: rings are given exactly with reduce 'ring'")
        dev, h = weights.device, weights.cfg.target.hidden_size
        self.peers, self.rings = peers, rings
        self._moe_slot = None  # data_ptr of the ring slot the last experts wrote
        self.reads: dict[int, RingRead] = {}  # data_ptr of a stacked buffer → its table read
        self.o_layer: dict[int, int] = {}  # o_proj weight data_ptr → layer
        self.attn_buf: dict[int, torch.Tensor] = {}  # layer → [S + P, R, H]
        self.moe_layer: dict[int, int] = {}  # expert fc data_ptr → layer
        self.moe_buf: dict[int, torch.Tensor] = {}  # layer → [1 + P, R, H]
        self.router_layer: dict[int, int] = {}  # router data_ptr → layer
        for layer in weights.layers:
            o = layer.attn.o
            s = self._local_splits(o)
            self.o_layer[o.w.data_ptr()] = layer.index
            if rings is None:
                self.attn_buf[layer.index] = self._buffer(s, rows, h, dev)
            if layer.moe is not None:
                self.moe_layer[layer.moe.fc.data_ptr()] = layer.index
                self.router_layer[layer.moe.router.data_ptr()] = layer.index
                if rings is None:
                    self.moe_buf[layer.index] = self._buffer(1, rows, h, dev)
        if reduce == "table":
            for buf in [*self.attn_buf.values(), *self.moe_buf.values()]:
                self.reads[buf.data_ptr()] = self._table_read(buf)
        self.first_moe = min(self.router_layer.values(), default=None)
        self.table = self.route = self.step = None
        if table is not None:
            n_moe = len(self.router_layer)
            if table.dim() != 4 or table.shape[1] != n_moe or table.shape[2] < rows:
                raise ValueError(f"route table: expected [T, {n_moe}, >= {rows}, K], got "
                                 f"{tuple(table.shape)}")
            t = table[:, :, :rows].contiguous().to(dev, torch.int32)  # [T, L, R, K]
            self.table = t.reshape(t.shape[0], -1)  # [T, L·R·K]
            self.route = torch.empty(1, self.table.shape[1], dtype=torch.int32, device=dev)
            self.route_view = self.route.view(n_moe, rows, t.shape[3])  # [L, R, K]
            self.step = torch.zeros(1, dtype=torch.int64, device=dev)

    def _buffer(self, local: int, rows: int, h: int, dev) -> torch.Tensor:
        buf = torch.zeros(local + self.peers, rows, h, dtype=torch.float32, device=dev)
        buf[:local] = float("nan")  # unwritten local slots read as NaN (readiness)
        return buf

    def _table_read(self, buf: torch.Tensor) -> RingRead:
        """buf [S + P, R, H] → a RingRead of its S local slots and P peers copied into their own
        allocations, re-arming a spare [S, R, H]."""
        local = buf.shape[0] - self.peers
        peers = [buf[local + p].clone() for p in range(self.peers)]
        spare = torch.full_like(buf[:local], float("nan"))
        return RingRead(PeerPartials.of([*buf[:local], *peers]), spare, self.max_polls)

    def steps_taken(self) -> int:
        """Table steps consumed so far modulo T (a device read: outside any clock)."""
        return int(self.step[0]) if self.step is not None else 0

    # --- overrides ----------------------------------------------------------------------------
    def linear_fp8_partials(self, x, lin: Fp8Linear, live: Live, xq=None, out=None
                            ) -> torch.Tensor:
        layer = self.o_layer.get(lin.w.data_ptr())
        if layer is None or out is not None:  # a caller's own buffer: not an emulated reduction
            return super().linear_fp8_partials(x, lin, live, xq=xq, out=out)
        if self.rings is not None:
            self._partials_into(x, lin, live, self.rings.next_o(), xq)  # this rank's slot
            return self.rings.read_o()
        buf = self.attn_buf[layer]
        self._partials_into(x, lin, live, buf[: buf.shape[0] - self.peers], xq)
        return self.reads.get(buf.data_ptr(), buf)  # [S + P, R, H]: the tail sums all

    def moe(self, x, weights, ids, m: MoeWeights, live: Live, out_dtype, xq=None, out=None
            ) -> torch.Tensor:
        layer = self.moe_layer.get(m.fc.data_ptr())
        if layer is None or out is not None:
            return super().moe(x, weights, ids, m, live, out_dtype, xq=xq, out=out)
        if self.rings is not None:
            slot = self.rings.next_moe()  # [1, R, H] this rank's slot
            self._moe_into(x, weights, ids, m, live, slot[0], xq)
            self._moe_slot = slot.data_ptr()
            return slot[0]
        buf = self.moe_buf[layer]
        self._moe_into(x, weights, ids, m, live, buf[0], xq)
        return buf[0]  # the model passes f[None]: a view starting at buf's first byte

    def moe_tail(self, parts, h, next_norm, live: Live, flag, *, eps, ffn_out_scale,
                 quantize=False):
        if self.rings is not None and parts.data_ptr() == self._moe_slot and parts.shape[0] == 1:
            self._moe_slot = None
            parts = self.rings.read_moe()
        for buf in self.moe_buf.values():
            if buf.data_ptr() == parts.data_ptr() and parts.shape[0] == 1:
                parts = self.reads.get(buf.data_ptr(), buf)  # [1 + P, R, H]
                break
        return super().moe_tail(parts, h, next_norm, live, flag, eps=eps,
                                ffn_out_scale=ffn_out_scale, quantize=quantize)

    def attn_tail(self, parts, xn, attn_out_norm, ffn_norm, live: Live, flag, *, eps,
                  attn_out_scale, router_w=None, top_k=0, quantize=False):
        out = super().attn_tail(parts, xn, attn_out_norm, ffn_norm, live, flag, eps=eps,
                                attn_out_scale=attn_out_scale, router_w=router_w, top_k=top_k,
                                quantize=quantize)
        layer = None if router_w is None else self.router_layer.get(router_w.data_ptr())
        if layer is None or self.table is None:
            return out
        if layer == self.first_moe:
            torch.index_select(self.table, 0, self.step, out=self.route)
            self.step.add_(1).remainder_(self.table.shape[0])
        out.ids = self.route_view[layer - self.first_moe]
        return out


class RankKernelOps(RankOpsMixin, KernelOps):
    name = "rank-kernels"

    def _local_splits(self, lin: Fp8Linear) -> int:
        n, k = lin.w.shape
        return k_linear.linear_fp8_splits(n, k, self.launches.linear_config(n, k))

    def _partials_into(self, x, lin: Fp8Linear, live: Live, out: torch.Tensor,
                       xq=None) -> None:
        k_linear.linear_fp8_partials(x, lin.w, lin.s, live.t, out=out, quantized=xq,
                                     pdl=self.pdl, config=self.launches.linear_config(*lin.w.shape))

    def _moe_into(self, x, weights, ids, m: MoeWeights, live: Live, out: torch.Tensor,
                  xq=None) -> None:
        k_moe.moe_fp8(x, weights, ids, m.fc, m.fc_s, m.proj, m.proj_s, live.t, out=out,
                      out_dtype=torch.float32, quantized=xq, scratch=self.moe_scratch,
                      pdl=self.pdl, config=self._moe_config(x, m))


class RankTwinOps(RankOpsMixin, TwinOps):
    name = "rank-twins"

    def _local_splits(self, lin: Fp8Linear) -> int:
        return 1  # the twin is one GEMM

    def _partials_into(self, x, lin: Fp8Linear, live: Live, out: torch.Tensor,
                       xq=None) -> None:
        out.copy_(TwinOps.linear_fp8_partials(self, x, lin, live))

    def _moe_into(self, x, weights, ids, m: MoeWeights, live: Live, out: torch.Tensor,
                  xq=None) -> None:
        out.copy_(TwinOps.moe(self, x, weights, ids, m, live, torch.float32))


def make_rank_ops(backend: str, device, max_polls: int, weights: Weights, rows: int,
                  table: torch.Tensor | None, peers: int = PEERS, reduce: str = "stacked",
                  pdl: bool = False, rings: TPRings | None = None,
                  launches: LaunchOverrides | None = None):
    """launches: the kernels' launch overrides (iquestrt/launch_overrides.py); kernels only."""
    kinds = {"kernels": RankKernelOps, "twins": RankTwinOps}
    if backend not in kinds:
        raise ValueError(f"ops: unknown backend {backend!r}; choose one of {sorted(kinds)}")
    if backend == "kernels":
        ops = RankKernelOps(torch.device(device), max_polls, pdl=pdl, launches=launches)
    elif pdl or launches:
        raise ValueError("ops: pdl (programmatic dependent launch) and launch overrides need the "
                         "'kernels' backend")
    else:
        ops = RankTwinOps(torch.device(device), max_polls)
    ops.attach(weights, rows, table, peers, reduce, rings)
    return ops
