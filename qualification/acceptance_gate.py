"""Gate 7 — draft acceptance on the trained mini model against a stored baseline.

    python -m qualification.acceptance_gate                      # run the gate
    python -m qualification.acceptance_gate --update --why "…"   # measure and store the baseline

The runtime (twins ops on the CPU) decodes a fixed prompt set
(qualification/mini_engine.py: one median prompt per request kind, its last 96 tokens) for 64
new tokens each at FixedDepth(7) — every depth is measured — with the model's sampling defaults
(T = 1, top-k 20, top-p 0.95) and one fixed seed per prompt. Pooled over the rounds:
  mean accepted length  L = Σ (a + 1) / rounds: tokens a round produces (accepted drafts + the
                        replacement or bonus; before the budget trims the last round)
  acceptance at depth j = P(draft j accepted | drafts 1 … j−1 accepted): accepted_j / reached_j.
Verdict against qualification/baselines/acceptance_mini.json: |L − L₀| ≤ band_L (two-sided: a
change in either direction needs a new baseline and a reason), and rate_j ≥ rate₀_j − band_j for
every depth (one-sided: improvements pass; a depth the baseline reached but the run never reaches
fails).

Bands (source: sampling noise of the two runs). The run is deterministic on one machine, so an
unchanged runtime reproduces the baseline exactly there; a legitimate change (another rounding
that flips one token) — or another processor, whose CPU float kernels sum in another order (seen:
the H200 host's CPU) — replaces the run by another realization of the same random process. The
verdict is a two-sample comparison with z = 3 (one-sided normal tail 1.3e-3 per check, ≤ 1.1 %
over the 8 checks):
  band_L = z·√(SE_L₀² + SE_L²),  SE_L = sd(a + 1) / √rounds of each run
  band_j = z·√(p̄(1 − p̄)·(1/reached₀_j + 1/reached_j)),  p̄ = (accepted₀_j + accepted_j + 1) /
           (reached₀_j + reached_j + 2)   (pooled; the +1/+2 keeps it off 0 and 1)
so a depth the new run reaches rarely gets the wide band its few rounds deserve. The baseline
file stores `bands` = the same formulas for a run of the baseline's own size (z·√2·SE₀ with
p̃ = (accepted + 1)/(reached + 2)), for reading. Rounds are treated as independent: serial
correlation within a request is ignored, so the bands are somewhat optimistic. Where
band_j ≥ rate₀_j the floor is ≤ 0 and cannot fail (reported as uninformative).

Dimension letters: D draft depth.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qualification import mini_engine
from qualification.gates import revision
from reference.speculative import GenerationRequest, RoundRecord

BASELINE = Path(__file__).resolve().parent / "baselines" / "acceptance_mini.json"
COMMAND = "python -m qualification.acceptance_gate --update --why '…'"


@dataclass(frozen=True)
class AcceptanceGateConfig:
    prompt_tokens: int = 96
    new_tokens: int = 64
    depth: int = 7
    seeds: tuple[int, ...] = (0, 1, 2)  # one per prompt (one prompt per request kind)
    z: float = 3.0
    baseline: Path = BASELINE

    def key(self) -> dict:
        """What a baseline must have been measured with (the checkpoint digest is added)."""
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "depth": self.depth, "seeds": list(self.seeds),
                "sampling": vars(mini_engine.SAMPLING), "ops": "twins",
                "ring_pad": mini_engine.RING_PAD}


@dataclass(frozen=True)
class Tally:
    """Pooled round statistics: rounds, Σ(a+1), Σ(a+1)², and per depth j = 1 … D the rounds
    reaching draft j and accepting it."""

    rounds: int
    tokens: int
    squares: int
    reached: tuple[int, ...]  # [D]
    accepted: tuple[int, ...]  # [D]

    @classmethod
    def of(cls, rounds: list[RoundRecord], depth: int) -> Tally:
        reached, accepted = [0] * depth, [0] * depth
        for r in rounds:
            for j in range(min(len(r.drafts), depth)):  # draft j+1 reached: j accepted before
                if r.accepted < j:
                    break
                reached[j] += 1
                accepted[j] += r.accepted > j
        n = [r.accepted + 1 for r in rounds]
        return cls(len(rounds), sum(n), sum(x * x for x in n), tuple(reached), tuple(accepted))

    @property
    def mean(self) -> float:
        return self.tokens / self.rounds

    @property
    def se_mean(self) -> float:
        var = (self.squares - self.rounds * self.mean**2) / max(self.rounds - 1, 1)
        return math.sqrt(max(var, 0.0) / self.rounds)

    def rate(self, j: int) -> float | None:
        return self.accepted[j] / self.reached[j] if self.reached[j] else None

    def se_rate(self, j: int) -> float:
        p = (self.accepted[j] + 1) / (self.reached[j] + 2)
        return math.sqrt(p * (1 - p) / max(self.reached[j], 1))


@dataclass(frozen=True)
class Measurement:
    tally: Tally
    streams: dict[str, list[int]]  # prompt id → its emitted tokens
    seconds: float


def measure(g: AcceptanceGateConfig, ckpt=None) -> Measurement:
    ckpt = ckpt or mini_engine.load_mini()
    eng = mini_engine.engine(ckpt, g.depth)
    ps = mini_engine.prompts(g.prompt_tokens)
    if len(ps) != len(g.seeds):
        raise ValueError(f"AcceptanceGateConfig.seeds: {len(g.seeds)} seeds for {len(ps)} prompts")
    t0, rounds, streams = time.perf_counter(), [], {}
    for p, seed in zip(ps, g.seeds, strict=True):
        res = eng.generate(GenerationRequest(p.ids, g.new_tokens, mini_engine.SAMPLING, seed))
        rounds += res.rounds
        streams[p.id] = res.tokens
    return Measurement(Tally.of(rounds, g.depth), streams, time.perf_counter() - t0)


def bands(t: Tally, z: float) -> dict:
    k = z * math.sqrt(2.0)
    return {"mean": k * t.se_mean, "acceptance": [k * t.se_rate(j) for j in range(len(t.reached))]}


def two_sample_bands(t0: Tally, t: Tally, z: float) -> dict:
    """The verdict's bands for run t against baseline t0 (module docstring); a depth t never
    reached gets None."""
    acc = []
    for j in range(len(t0.reached)):
        if t.reached[j] == 0 or t0.reached[j] == 0:
            acc.append(None)
            continue
        p = (t0.accepted[j] + t.accepted[j] + 1) / (t0.reached[j] + t.reached[j] + 2)
        acc.append(z * math.sqrt(p * (1 - p) * (1 / t0.reached[j] + 1 / t.reached[j])))
    return {"mean": z * math.hypot(t0.se_mean, t.se_mean), "acceptance": acc}


def tally_of(base: dict) -> Tally:
    return Tally(**{k: tuple(v) if isinstance(v, list) else v
                    for k, v in base["measured"]["tally"].items()})


def judge(t: Tally, base: dict, z: float = 3.0) -> tuple[bool, str, list[str]]:
    """(ok, margin, evidence) of a tally against a stored baseline's numbers; the first evidence
    line names what is outside its band."""
    b, band = base["measured"], two_sample_bands(tally_of(base), t, z)
    dm = t.mean - b["mean"]
    worst, fails = abs(dm) / band["mean"], []
    if abs(dm) > band["mean"]:
        fails.append(f"mean accepted length {t.mean:.3f} outside {b['mean']:.3f} ± "
                     f"{band['mean']:.3f}")
    rows = []
    for j, (r0, bj) in enumerate(zip(b["acceptance"], band["acceptance"], strict=True)):
        if r0 is None:
            rows.append(f"{j + 1}: baseline never reached")
            continue
        r = t.rate(j)
        if bj is None:
            rows.append(f"{j + 1}: never reached (baseline {r0:.2f})")
            fails.append(f"depth {j + 1} acceptance never reached")
            continue
        floor = r0 - bj
        if floor <= 0:
            rows.append(f"{j + 1}: {_rate(t, j)} (floor ≤ 0, uninformative)")
            continue
        worst = max(worst, max(0.0, r0 - (r or 0.0)) / bj)
        rows.append(f"{j + 1}: {_rate(t, j)} vs floor {floor:.2f} (baseline {r0:.2f})")
        if r < floor:
            fails.append(f"depth {j + 1} acceptance {_rate(t, j)} below floor {floor:.2f}")
    ev = ["FAILS: " + "; ".join(fails) if fails else "within every band",
          f"mean accepted length {t.mean:.3f} over {t.rounds} rounds vs baseline {b['mean']:.3f}"
          f" ± {band['mean']:.3f} (Δ {dm:+.3f})",
          "acceptance by depth (accepted/reached): " + "; ".join(rows)]
    return not fails, f"{worst:.0%} of band", ev


def _rate(t: Tally, j: int) -> str:
    r = t.rate(j)
    return f"{t.accepted[j]}/{t.reached[j]} = {r:.2f}" if r is not None else "never reached"


def load_baseline(g: AcceptanceGateConfig) -> dict:
    if not g.baseline.is_file():
        raise FileNotFoundError(f"{g.baseline}: no acceptance baseline; measure one with {COMMAND}")
    return json.loads(g.baseline.read_text())


def baseline_mismatch(g: AcceptanceGateConfig, base: dict) -> list[str]:
    want = {**g.key(), "checkpoint_sha256": mini_engine.checkpoint_digest()}
    got = base.get("config", {})
    return [f"baseline {g.baseline.name} was measured with {k} = {got.get(k)!r}, this run uses "
            f"{v!r}; re-measure with {COMMAND}" for k, v in want.items() if got.get(k) != v]


def run(g: AcceptanceGateConfig | None = None) -> tuple[bool, str, list[str]]:
    g = g or AcceptanceGateConfig()
    base = load_baseline(g)
    stale = baseline_mismatch(g, base)
    if stale:
        return False, "-", stale
    m = measure(g)
    ok, margin, ev = judge(m.tally, base, g.z)
    same = m.streams == base["streams"]
    ev.append("token streams identical to the baseline's (no noise: the runtime is unchanged "
              "for this set)" if same else "token streams differ from the baseline's (judged "
              "by the sampling-noise bands)")
    ev.append(f"{len(m.streams)} prompts × {g.new_tokens} tokens, FixedDepth({g.depth}), "
              f"seeds {list(g.seeds)}, {m.seconds:.0f} s; baseline {base['revision']}: "
              f"{base['why']}")
    return ok, margin, ev


def update(g: AcceptanceGateConfig, why: str) -> dict:
    if not why.strip():
        raise ValueError("--why: say why the baseline changes (it is stored with the numbers)")
    m = measure(g)
    t = m.tally
    out = {
        "gate": "7 acceptance",
        "why": why,
        "command": COMMAND.replace("'…'", json.dumps(why)),
        "revision": revision(),
        "config": {**g.key(), "checkpoint_sha256": mini_engine.checkpoint_digest(),
                   "prompts": [p.id for p in mini_engine.prompts(g.prompt_tokens)]},
        "measured": {"rounds": t.rounds, "mean": t.mean, "se_mean": t.se_mean,
                     "acceptance": [t.rate(j) for j in range(g.depth)],
                     "se_acceptance": [t.se_rate(j) for j in range(g.depth)],
                     "tally": asdict(t)},
        "bands": {**bands(t, g.z), "z": g.z,
                  "source": "band = z·√2·SE of the baseline: a legitimate change yields another "
                            "realization of the same sampling process, and two independent "
                            "realizations differ with SE √2·SE; z = 3 one-sided (1.3e-3 per "
                            "check). SE of the mean: sd(a+1)/√rounds; SE of depth j: "
                            "√(p̃(1−p̃)/reached_j), p̃ = (accepted+1)/(reached+2). Rounds treated "
                            "as independent (serial correlation ignored)."},
        "streams": m.streams,
        "seconds": m.seconds,
    }
    g.baseline.parent.mkdir(parents=True, exist_ok=True)
    tmp = g.baseline.with_suffix(".json.partial")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(g.baseline)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qualification.acceptance_gate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", action="store_true", help="measure and store the baseline")
    ap.add_argument("--why", default="", help="reason for --update (stored in the baseline)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    g = AcceptanceGateConfig()
    if a.update:
        if not a.why.strip():
            ap.error("--update needs --why \"…\" (the reason is stored with the numbers)")
        out = update(g, a.why)
        print(f"wrote {g.baseline}: mean {out['measured']['mean']:.3f} ± "
              f"{out['bands']['mean']:.3f}, acceptance "
              f"{[None if r is None else round(r, 3) for r in out['measured']['acceptance']]}")
        return 0
    ok, margin, ev = run(g)
    print(("pass" if ok else "FAIL") + f" ({margin})", *ev, sep="\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
