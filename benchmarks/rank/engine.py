"""The engine the benchmark times: iquestrt's Engine with the rank op table
(benchmarks/rank/ops.py), a synthetic prefill, and a decode clock.

Synthetic prefill of a context of C tokens (C random prompt ids, seeded): instead of running the
target over the prompt, every target layer's cache gets K, V ~ N(0, 1) BF16 at the slots of the
positions a real prefill leaves there (a full layer 0 … C−1; a ring the last window + pad
positions), with their slot labels; the draft ring likewise for positions 1 … C−1 (the draft
starts at 1). The last logits row [1, V] and the target's final hidden state of position C − 1
([1, H]: the only row the first round reads) are random too. Everything after that is the
engine's own path: it samples the first token, builds the device state and captures the round
graph (its prepare phase), launches rounds and reads the log (its loop phase). Prefill, capture
and the first-token sample stay outside the clock.

Clock: CUDA events around the engine's loop phase (every round of the request, the host's log
reads and the request's final settlement; on a CPU host wall time, for tests only), plus one
event after each round when the launcher exposes `one_round` (host loop): the median interval
between consecutive rounds is the steady-state round time (an interval that spans a log read
includes that read; the rounds launched after the request ended, which run every kernel with 0
live rows, are left out).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.rank.ops import PEERS, make_rank_ops
from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.engine_parts import EngineObserver, EngineParts
from iquestrt.launch_overrides import LaunchOverrides
from iquestrt.round import RoundProgram
from iquestrt.session import Session
from iquestrt.tp.group import TPGroup
from iquestrt.tp.peer_ring import TPRings
from iquestrt.tp.ring_resets import RingResets
from iquestrt.weights import Weights
from reference.config import SamplingDefaults
from reference.kv_layout import LayerKV
from reference.speculative import GenerationRequest


def fill_cache(cache: LayerKV, n: int, g: torch.Generator) -> None:
    """Positions start … n−1 as a prefill of n tokens leaves them: K, V ~ N(0, 1) where those
    positions live (a ring keeps the last `capacity` of them), slots labelled."""
    lay = cache.layout
    lo = lay.start if not lay.ring else max(lay.start, n - lay.capacity)
    if not lay.ring and n > lay.capacity:
        raise ValueError(f"fill_cache: {n} positions exceed the full cache's {lay.capacity} slots")
    if n <= lo:
        return
    pos = torch.arange(lo, n, device=cache.k.device)
    slots = pos % lay.capacity if lay.ring else pos
    if lay.ring:
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
    else:
        cache.k[lo:n].normal_(generator=g)
        cache.v[lo:n].normal_(generator=g)
    cache.slot_pos[slots] = pos.to(torch.int32)


@dataclass
class Timing:
    loop_s: float  # the engine's loop phase, wall time (CUDA events on a GPU)
    rounds: int
    round_gaps_s: list[float] = field(default_factory=list)  # consecutive-round intervals

    @property
    def per_round_s(self) -> float:
        """Median round interval when per-round events exist, else loop time / rounds."""
        if len(self.round_gaps_s) >= 3:
            return statistics.median(self.round_gaps_s)
        return self.loop_s / max(self.rounds, 1)


class SyntheticPrefill:
    """The engine's prefill part (module docstring): seeded random caches, logits and hidden
    state instead of the models over the prompt."""

    def __init__(self, seed: int):
        self.seed = seed

    def generator(self, device, salt: int) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed * 7919 + salt)
        return g

    def target(self, eng: Engine, st: Session) -> tuple[torch.Tensor, torch.Tensor]:
        n, t, dev = len(st.tokens), eng.cfg.target, eng.w.device
        g = self.generator(dev, n)
        for cache in st.caches.target:
            fill_cache(cache, n, g)
        st.caches.settle_target(eng.ops, n, n)  # as the real prefill does (no-op rollback)
        logits = torch.empty(1, t.vocab_size, device=dev).normal_(0.0, 2.0, generator=g)
        hidden = torch.empty(1, t.hidden_size, dtype=torch.bfloat16, device=dev)
        return logits, hidden.normal_(generator=g)  # hidden of position n − 1 only

    def draft(self, eng: Engine, st: Session, hidden: torch.Tensor) -> None:
        n = len(st.tokens)
        fill_cache(st.caches.draft, n, self.generator(eng.w.device, n + 1))
        st.caches.draft_next = n  # draft rows 1 … n−1 settled


class RoundClock(EngineObserver):
    """The decode clock (module docstring): an event after each round of the host loop, CUDA
    events around the loop, and the profile hook's rounds before it."""

    def __init__(self):
        self.timing: Timing | None = None
        # callable(engine, session) → rounds it ran, called once before the next loop's clock
        self.profile_hook = None
        self.hook_rounds = 0  # rounds the last hook ran (their records come first)
        self.step_span = (0, 0)  # route-table steps (mod T) before and after the last clock
        self._round_events: list = []

    @staticmethod
    def _cuda(eng: Engine) -> bool:
        return eng.w.device.type == "cuda"

    def prepare(self, eng: Engine, st: Session, run):
        launcher = run()
        if self._cuda(eng) and getattr(launcher, "one_round", None) is not None:
            # a launcher reused by a later request keeps its first, unwrapped round
            inner = launcher.__dict__.setdefault("unwrapped_round", launcher.one_round)
            events = []

            def one_round() -> None:
                inner()
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                events.append(ev)

            launcher.one_round = one_round
            self._round_events = events
        else:
            self._round_events = []
        return launcher

    def loop(self, eng: Engine, st: Session, run) -> None:
        self.hook_rounds = 0
        if self.profile_hook is not None:
            hook, self.profile_hook = self.profile_hook, None
            self.hook_rounds = hook(eng, st)
        first_round = len(st.result.rounds) + self.hook_rounds  # hook rounds are logged later
        s0 = eng.ops.steps_taken()
        t0 = time.perf_counter()
        cuda = self._cuda(eng)
        if cuda:
            torch.cuda.synchronize()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        run()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        rounds = len(st.result.rounds) - first_round
        self.step_span = (s0, eng.ops.steps_taken())
        if not cuda:  # host wall time (twins / interpreter: not a performance figure)
            self.timing = Timing(time.perf_counter() - t0, rounds)
            return
        ev = self._round_events[:rounds]  # later launches ran after the request ended (no-ops)
        gaps = [a.elapsed_time(b) / 1e3 for a, b in zip(ev, ev[1:], strict=False)]
        self.timing = Timing(start.elapsed_time(end) / 1e3, rounds, gaps)


class RankEngine(Engine):
    """An Engine of the rank op table, the synthetic prefill, ring resets and the round clock
    (its timing, profile_hook, hook_rounds and step_span are the clock's)."""

    def __init__(self, weights: Weights, rcfg: RuntimeConfig, table: torch.Tensor | None,
                 seed: int = 0, peers: int = PEERS, reduce: str = "stacked",
                 rings: TPRings | None = None, group: TPGroup | None = None,
                 launches: LaunchOverrides | None = None):
        """rings, group: reduce "ring" (`--tp N`): the TP rings every rank's engines share and
        this rank's group (the rings are reset through it). launches: the kernels' launch
        overrides (iquestrt/launch_overrides.py; `--launch`)."""
        if (rings is None) != (group is None):
            raise ValueError("RankEngine: rings and group come together (reduce 'ring')")
        ops = make_rank_ops(rcfg.ops, rcfg.device, rcfg.max_polls, weights, rcfg.max_width,
                            table, peers, reduce, rcfg.pdl, rings, launches)
        self.clock = RoundClock()
        parts = dataclasses.replace(EngineParts.default(weights, rcfg, ops=ops),
                                    prefill=SyntheticPrefill(seed),
                                    observers=(RingResets(rings, group), self.clock))
        super().__init__(weights, rcfg, parts=parts)
        self.rings, self.group, self.seed = rings, group, seed

    @property
    def timing(self) -> Timing | None:
        return self.clock.timing

    @property
    def hook_rounds(self) -> int:
        return self.clock.hook_rounds

    @property
    def step_span(self) -> tuple[int, int]:
        return self.clock.step_span

    @property
    def profile_hook(self):
        return self.clock.profile_hook

    @profile_hook.setter
    def profile_hook(self, hook) -> None:
        self.clock.profile_hook = hook

    def request(self, context: int, rounds: int, sampling: SamplingDefaults | None = None,
                seed: int = 0) -> GenerationRequest:
        """A request at `context` prompt tokens whose budget ends it after at most `rounds`
        rounds (every round emits ≥ 1 token)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + context)
        prompt = torch.randint(0, self.cfg.target.vocab_size, (context,), generator=g)
        return GenerationRequest(tuple(prompt.tolist()), rounds, sampling or self.cfg.sampling,
                                 seed)

    def eager_round(self, st: Session) -> None:
        """One real round of the request, launched eagerly (the profiler's round)."""
        RoundProgram(self, st.device, self.rcfg.policy)()
