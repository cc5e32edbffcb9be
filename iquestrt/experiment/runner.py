"""A paired experiment: control and candidate (and optionally A′, a second control engine built
the same way as the candidate) decode the same prompts and seeds, alternating in one process,
every request from the same prefill snapshot.

Steps:
  1. engines: one fresh ExperimentEngine per arm, each loading the checkpoint itself.
  2. snapshots: the target prefill of each prompt runs once per distinct snapshot key (arms that
     differ in max_width prefill in other chunks and get their own), or is loaded from
     `snapshot_dir`.
  3. replay check (also each arm's warm-up, and where its round program is recorded): for the
     first seed, generation from the snapshot must equal Engine.generate with real prefill bit
     for bit — tokens, round records, cache digests — on every prompt for the control arm (every
     arm with verify_all), on the first prompt for the others. A difference stops the experiment.
  4. timed pairs, one per (prompt, seed): the arms run in order A B (A′) on even pairs and in
     reverse on odd pairs, so a linear drift of the machine adds the same to every arm.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from iquestrt.config import RuntimeConfig
from iquestrt.errors import RuntimeFault
from iquestrt.experiment.arms import ArmSpec
from iquestrt.experiment.engine import ExperimentEngine
from iquestrt.experiment.signature import ProgramSignature
from iquestrt.snapshot import PrefillSnapshot, SnapshotKey, caches_digest, result_key
from reference.config import SamplingDefaults
from reference.speculative import GenerationRequest, GenerationResult


class ExperimentError(RuntimeFault):
    """The experiment cannot be trusted (replay differs from real prefill) or cannot run."""


@dataclass(frozen=True)
class PromptCase:
    id: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    prompts: tuple[PromptCase, ...]
    seeds: tuple[int, ...]
    arms: tuple[ArmSpec, ...]  # control, candidate[, control′]
    rcfgs: tuple[RuntimeConfig, ...]  # one per arm
    max_new_tokens: int
    sampling: SamplingDefaults
    verify_all: bool = False
    snapshot_dir: Path | None = None

    def __post_init__(self) -> None:
        if len(self.arms) not in (2, 3) or len(self.rcfgs) != len(self.arms):
            raise ValueError("experiment: needs control and candidate (and optionally A′) arms, "
                             "each with its RuntimeConfig")
        if not self.prompts or not self.seeds:
            raise ValueError("experiment: needs at least one prompt and one seed")
        if len(self.prompts) * len(self.seeds) < 2:
            raise ValueError(f"experiment: {len(self.prompts)} prompt(s) x {len(self.seeds)} "
                             "seed(s) give one pair; a confidence interval needs at least 2")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"experiment: seeds {list(self.seeds)} repeat a seed")
        if self.max_new_tokens < 2:
            raise ValueError(f"experiment: max_new_tokens must be >= 2 (the first token comes "
                             f"from prefill), got {self.max_new_tokens}")

    def request(self, prompt: PromptCase, seed: int) -> GenerationRequest:
        return GenerationRequest(prompt.ids, self.max_new_tokens, self.sampling, seed)

    def pairs(self) -> list[tuple[PromptCase, int]]:
        return [(p, s) for p in self.prompts for s in self.seeds]

    def order(self, i: int) -> tuple[int, ...]:
        """Arm indices of pair i: forward on even pairs, reversed on odd ones."""
        idx = tuple(range(len(self.arms)))
        return idx if i % 2 == 0 else idx[::-1]


@dataclass(frozen=True)
class Run:
    pair: int
    slot: int  # position of this run within its pair (0 = first)
    arm: str
    prompt: str
    seed: int
    tokens: int
    rounds: int
    accepted: float  # mean accepted length: tokens emitted per round, bonus included
    decode_s: float
    output_sha256: str

    @property
    def tpot_ms(self) -> float:
        return 1e3 * self.decode_s / (self.tokens - 1)  # the first token comes from prefill

    @property
    def round_ms(self) -> float:
        return 1e3 * self.decode_s / self.rounds

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"tpot_ms": self.tpot_ms, "round_ms": self.round_ms}


@dataclass
class Outcome:
    runs: list[Run]
    checks: list[dict]  # replay checks
    signatures: dict[str, ProgramSignature | None]  # arm → its recorded round program
    snapshots: list[dict]


def _tokens_sha(res: GenerationResult) -> str:
    return hashlib.sha256(",".join(map(str, res.tokens)).encode()).hexdigest()


class Experiment:
    def __init__(self, plan: Plan, engines: list[ExperimentEngine],
                 log: Callable[[str], None] = print):
        if len(engines) != len(plan.arms):
            raise ValueError(f"experiment: {len(engines)} engines for {len(plan.arms)} arms")
        self.plan, self.engines, self.log = plan, engines, log
        self.snaps: dict[tuple[str, SnapshotKey], PrefillSnapshot] = {}

    def snapshot(self, arm: int, prompt: PromptCase) -> PrefillSnapshot:
        eng = self.engines[arm]
        key = eng.snapshot_key(prompt.ids)
        if (prompt.id, key) in self.snaps:
            return self.snaps[prompt.id, key]
        d = self.plan.snapshot_dir
        path = None if d is None else Path(d) / (
            f"{key.prompt_sha256[:16]}-{key.weights_sha256[:12]}-w{key.max_width}"
            f"-p{key.ring_pad}-{key.ops}-{key.device_type}")
        if path is not None and path.exists():
            snap, how = PrefillSnapshot.load(path), f"loaded {path}"
        else:
            snap = eng.take_snapshot(prompt.ids)
            how = "prefill"
            if path is not None:
                snap.save(path)
                how += f", saved {path}"
        self.log(f"snapshot {prompt.id} ({len(prompt.ids)} tokens, max_width "
                 f"{key.max_width}): {how}")
        self.snaps[prompt.id, key] = snap
        return snap

    def verify(self, arm: int, prompt: PromptCase, record: bool) -> dict:
        plan, eng, label = self.plan, self.engines[arm], self.plan.arms[arm].label
        req = plan.request(prompt, plan.seeds[0])
        snap = self.snapshot(arm, prompt)
        real = eng.generate(req)
        real_caches = caches_digest(eng.session.caches)
        eng.record_next = record
        replay = eng.generate_from_snapshot(req, snap)
        eng.record_next = False
        check = {"arm": label, "prompt": prompt.id, "seed": req.seed,
                 "tokens_equal": real.tokens == replay.tokens,
                 "rounds_equal": result_key(real) == result_key(replay),
                 "caches_equal": real_caches == caches_digest(eng.session.caches),
                 "tokens": len(real.tokens), "rounds": len(real.rounds)}
        ok = check["tokens_equal"] and check["rounds_equal"] and check["caches_equal"]
        self.log(f"replay check {label} {prompt.id} seed {req.seed}: "
                 f"{'bit-exact' if ok else 'DIFFERS'} ({check['tokens']} tokens, "
                 f"{check['rounds']} rounds)")
        if not ok:
            raise ExperimentError(
                f"replay from the prefill snapshot differs from real prefill ({label}, prompt "
                f"{prompt.id}, seed {req.seed}): tokens equal {check['tokens_equal']}, round "
                f"records equal {check['rounds_equal']}, caches equal {check['caches_equal']}; "
                "no comparison is made on a replay that does not reproduce generation")
        return check

    def run(self) -> Outcome:
        plan = self.plan
        checks = []
        for a in range(len(plan.arms)):
            prompts = plan.prompts if a == 0 or plan.verify_all else plan.prompts[:1]
            for j, p in enumerate(prompts):
                checks.append(self.verify(a, p, record=j == 0))
        runs = []
        pairs = plan.pairs()
        for i, (p, s) in enumerate(pairs):
            req = plan.request(p, s)
            line = []
            for slot, a in enumerate(plan.order(i)):
                eng, label = self.engines[a], plan.arms[a].label
                res = eng.generate_from_snapshot(req, self.snapshot(a, p))
                r = Run(i, slot, label, p.id, s, len(res.tokens), len(res.rounds),
                        res.mean_accepted_length, eng.last_decode_s, _tokens_sha(res))
                runs.append(r)
                line.append(f"{label} {r.tpot_ms:.2f} ms/token {r.rounds} rounds "
                            f"acc {r.accepted:.2f}")
            self.log(f"pair {i + 1}/{len(pairs)} {p.id} seed {s}: " + " | ".join(line))
        sigs = {plan.arms[a].label: e.signature for a, e in enumerate(self.engines)}
        snaps = [{"prompt": pid, **dataclasses.asdict(key)} for (pid, key) in self.snaps]
        return Outcome(runs, checks, sigs, snaps)
