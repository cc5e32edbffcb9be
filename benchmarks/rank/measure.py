"""Device measurements the floor and the breakdown need: the copy bandwidth of this GPU in this
run, and a per-kernel breakdown of one eager round (torch.profiler, CUDA time grouped by kernel
name) with its launch count (kernels + memcpy/memset)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch

# kernel-name fragments → family, first match wins (Triton kernels keep their function names)
FAMILIES = (
    ("tails", ("_attn_tail", "_moe_tail")),
    ("moe", ("_moe_",)),
    ("attention", ("_split_kernel", "_combine_kernel")),
    ("linear", ("_linear", "_reduce_splits", "_eh_proj", "_qkv_rope")),  # QKV with qk_rope
    ("act_quant", ("_act_quant",)),
    ("rows", ("_norm_rows", "_silu_mul", "_route_kernel", "_draft_entry")),
    ("qk_rope", ("_qk_rope",)),
    ("kv_cache", ("_write_kv", "_rollback")),
    ("sampler", ("_scan_kernel", "_merge_kernel", "_exp_kernel")),
    ("verify", ("_verify",)),
    ("round_record", ("_check_flags", "_check_logits", "_record_draft", "_settle_kernel")),
    ("round_scalars", ("_begin_kernel", "_target_rows_kernel", "_settle_bounds_kernel")),
    ("torch", ("at::", "void ", "Memcpy", "Memset", "memcpy", "memset")),
)


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def copy_bandwidth(device, gib: float = 2.0, reps: int = 10) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write (≈ 4.24e12
    on the H200); median of `reps` CUDA-event-timed copies."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


@dataclass
class Breakdown:
    launches: int  # device kernels + memcpy/memset of the round
    kernel_s: float  # sum of their device times
    by_kernel: dict[str, tuple[int, float]]  # name → (count, seconds)
    by_family: dict[str, tuple[int, float]]


def breakdown(events) -> Breakdown:
    """events: (name, device seconds) of every device activity of one round."""
    by_k: dict[str, list] = defaultdict(lambda: [0, 0.0])
    by_f: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, sec in events:
        for table, key in ((by_k, name), (by_f, family(name))):
            table[key][0] += 1
            table[key][1] += sec
    order = sorted(by_k.items(), key=lambda kv: -kv[1][1])
    return Breakdown(len(events), sum(s for _, s in events),
                     {k: (c, s) for k, (c, s) in order},
                     {k: (c, s) for k, (c, s) in sorted(by_f.items(), key=lambda kv: -kv[1][1])})


def profile_round(run_round) -> Breakdown:
    """Run `run_round()` once under torch.profiler (CUDA activity) → its breakdown."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_round()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.elapsed_us() / 1e6) for e in prof.events()
              if e.device_type.name == "CUDA"]
    return breakdown(events)
