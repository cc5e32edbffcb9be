"""Warnings for an experiment record whose numbers deserve less trust than their intervals say:
the machine was busy with other work while it ran, or there are too few pairs for the bootstrap.

Load. os.getloadavg()'s 1-minute value (runnable threads, damped over about a minute) is sampled
after the engines are built, before the first decode, and again after the last pair; both are
compared with os.cpu_count(). The end sample contains the experiment's own threads (torch's
intra-op threads on a CPU device, the host thread on a GPU), which are taken off; the start
sample may still hold some of the engine loading just before it. Other work per CPU above
TrustLimits.high_load_per_cpu gives a warning. A load average counts threads waiting for a core
as well as running ones and says nothing about memory bandwidth, so this is a coarse flag: its
absence does not prove an idle machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Above half the CPUs' worth of other runnable threads, a CPU run's intra-op threads were likely
# descheduled at times (its timings then carry the other work's noise), and a GPU run's host
# thread may have waited for a core between launches.
HIGH_LOAD_PER_CPU = 0.5
# The intervals are percentile bootstraps over pairs. For normally distributed pair values the
# percentile interval of a mean is about mean ± z·√((n−1)/n)·s/√n, which covers the true mean with
# probability 2·F_t(z·√((n−1)/n); n − 1) − 1 instead of 95 %: 90 % at 10 pairs, 85 % at 5, 60 % at
# 2. Below 10 pairs an interval stated at 95 % misses more than twice as often as it says.
MIN_PAIRS = 10


@dataclass(frozen=True)
class TrustLimits:
    min_pairs: int = MIN_PAIRS
    high_load_per_cpu: float = HIGH_LOAD_PER_CPU


def sample_load() -> float | None:
    """The 1-minute load average; None where the platform has none (Windows)."""
    if not hasattr(os, "getloadavg"):
        return None
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class MachineLoad:
    cpus: int
    own_threads: int  # the experiment's runnable threads while it decodes
    start_1m: float | None
    end_1m: float | None

    def other_per_cpu(self) -> tuple[float | None, float | None]:
        """Other work per CPU at start and end (own threads taken off the end sample)."""
        start = None if self.start_1m is None else self.start_1m / self.cpus
        end = None if self.end_1m is None else \
            max(0.0, self.end_1m - self.own_threads) / self.cpus
        return start, end

    def as_dict(self, limits: TrustLimits) -> dict:
        start, end = self.other_per_cpu()

        def r(v):
            return None if v is None else round(v, 3)

        return {"cpus": self.cpus, "own_threads": self.own_threads,
                "load_1m_start": r(self.start_1m), "load_1m_end": r(self.end_1m),
                "other_per_cpu_start": r(start), "other_per_cpu_end": r(end),
                "high_load_per_cpu": limits.high_load_per_cpu}


def own_threads(device: str, torch_threads: int, cpus: int) -> int:
    return 1 if device.startswith("cuda") else max(1, min(torch_threads, cpus))


def warnings(load: MachineLoad, pairs: int, device: str,
             limits: TrustLimits = TrustLimits()) -> list[str]:
    """The record's warnings, most important first; [] when nothing calls for one."""
    if load.cpus < 1 or pairs < 0:
        raise ValueError(f"trust warnings: need cpus >= 1 and pairs >= 0, got {load.cpus} cpus, "
                         f"{pairs} pairs")
    out = []
    start, end = load.other_per_cpu()
    busy = [v for v in (start, end) if v is not None]
    if not busy:
        out.append("machine load not measured (no os.getloadavg on this platform): other work "
                   "on the machine may have shared the cores with the timed decodes")
    elif max(busy) > limits.high_load_per_cpu:
        gpu = device.startswith("cuda")
        out.append(
            f"high machine load: other work of {max(busy):.2f} runnable threads per CPU "
            f"(1-minute load {_f(load.start_1m)} at start, {_f(load.end_1m)} at end, "
            f"{load.cpus} CPUs, the experiment's own {load.own_threads} thread(s) taken off the "
            f"end) exceeds {limits.high_load_per_cpu:g}; "
            + ("on a GPU run only the host thread competes for the cores (launches, log "
               "reads), so the timings are less exposed, but" if gpu else
               "the timed decodes likely shared cores with it, so")
            + " the timings may hold that work's noise; repeat on an idle machine to trust them")
    if pairs < limits.min_pairs:
        out.append(f"few pairs: {pairs} (prompt, seed) pairs, fewer than {limits.min_pairs}; the "
                   "bootstrap intervals cover less than their stated level (for normal data "
                   "about 90 % instead of 95 % at 10 pairs, 60 % at 2): add prompts or seeds")
    return out


def _f(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.2f}"
