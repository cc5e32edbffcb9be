"""What one rank-round sweep runs (`SweepSpec`) and the values its options may take, checked
when the spec is built (before any GPU work). Read by the CLI (benchmarks/rank/main.py), the
sweep, and the rank ops (their reduction modes)."""

from __future__ import annotations

from dataclasses import dataclass

CONTEXTS = {"1K": 1024, "4K": 4096, "16K": 16384, "64K": 65536, "128K": 131072, "192K": 196608}
WIDTHS = (4, 5, 6, 7, 8)
BASELINES = ("all", "eager", "compile", "none")
PDL_MODES = ("auto", "off", "on", "ab")  # auto: as the runtime (on where it can run); ab: every
# configuration with and without, runs alternating
# how the tails read the partials (benchmarks/rank/ops.py); "ring": --tp N only
REDUCES = ("stacked", "table", "ring")


class BenchArgsError(ValueError):
    """A benchmark option is out of range; the message names it and the allowed values."""


@dataclass(frozen=True)
class SweepSpec:
    widths: tuple[int, ...] = WIDTHS
    adaptive: bool = True
    contexts: tuple[str, ...] = tuple(CONTEXTS)
    rounds: int = 32  # token budget per timed request (≈ rounds: random weights accept ~0)
    reps: int = 1  # timed requests per configuration
    baseline: str = "all"
    baseline_rounds: int = 6
    routing: str = "traces"  # or "uniform"
    mapping: str = "primary"  # benchmarks/rank/traces.py MODES
    profile: str = "key"  # "all", "key" (first context × widths, width 6 × contexts), "none"
    eager: bool = True  # also time eager launches (no graph) at the headline configuration
    loop: str = "host"  # RuntimeConfig.loop for the graph runs: "host" or "device" (WHILE node)
    seed: int = 0
    headline_width: int = 6
    reduce: str = "stacked"  # "ring" with tp > 1 (benchmarks/rank/tp.py)
    pdl: str = "auto"  # "on": kernels with programmatic dependent launch; "auto": as the runtime's
    # default (on with compiled kernels on compute capability >= 9.0); "ab": both, side by side
    tp: int = 1  # processes under torchrun, one GPU each
    # launch-override variants (iquestrt/launch_overrides.py text form), each run beside the
    # control on the same weights, alternating: rows "<policy>+<overrides>"
    launch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [w for w in self.widths if not (isinstance(w, int) and WIDTHS[0] <= w <= WIDTHS[-1])]
        if bad or not self.widths:
            raise BenchArgsError(f"--widths: {list(self.widths)}: each width must be an integer "
                                 f"in {WIDTHS[0]}..{WIDTHS[-1]} (verification rows; depth = "
                                 "width − 1)")
        unknown = [c for c in self.contexts if c not in CONTEXTS]
        if unknown or not self.contexts:
            raise BenchArgsError(f"--contexts: unknown {unknown or 'empty list'}; choose from "
                                 f"{list(CONTEXTS)}")
        for name, lo, hi in (("rounds", 4, 4096), ("reps", 1, 100), ("baseline_rounds", 1, 100)):
            v = getattr(self, name)
            if not (isinstance(v, int) and lo <= v <= hi):
                raise BenchArgsError(f"--{name.replace('_', '-')}: {v!r} outside {lo}..{hi}")
        for name, allowed in (("baseline", BASELINES), ("routing", ("traces", "uniform")),
                              ("mapping", ("primary", "position")), ("loop", ("host", "device")),
                              ("profile", ("all", "key", "none")), ("reduce", REDUCES),
                              ("pdl", PDL_MODES)):
            if getattr(self, name) not in allowed:
                raise BenchArgsError(f"--{name}: {getattr(self, name)!r}; choose one of "
                                     f"{list(allowed)}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or not 1 <= self.tp <= 8:
            raise BenchArgsError(f"--tp: {self.tp!r}; must be an integer in 1..8")
        if (self.tp > 1) != (self.reduce == "ring"):
            raise BenchArgsError(f"--reduce {self.reduce} with --tp {self.tp}: 'ring' is the real "
                                 "ring of --tp N >= 2 and --tp N >= 2 reduces through it; "
                                 "'stacked' and 'table' emulate the peers on one GPU")

        self._check_launch()

    def _check_launch(self) -> None:
        from iquestrt.launch_overrides import LaunchOverrideError, LaunchOverrides

        labels = []
        for text in self.launch:
            try:
                o = LaunchOverrides.parse(text)
            except LaunchOverrideError as e:
                raise BenchArgsError(f"--launch {text!r}: {e}") from None
            if not o:
                raise BenchArgsError(f"--launch {text!r}: overrides nothing (the control runs "
                                     "anyway)")
            labels.append(o.label())
        if len(set(labels)) != len(labels):
            raise BenchArgsError(f"--launch: the same overrides twice: {labels}")

    def context_tokens(self) -> list[int]:
        return [CONTEXTS[c] for c in self.contexts]
