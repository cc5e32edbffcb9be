"""Model card of a trained checkpoint: training numbers cited from its training_report.json,
draft acceptance and distinct experts measured on CPU with the reference model (BF16).

    python -m training.card --checkpoint models/mini --out models/mini [--requests N] [--tokens T]

Acceptance. Each held-out prompt is decoded with ReferenceGenerator (what `iquestrt generate
--backend reference` runs) at FixedDepth 7, 3 and 5, sampling with the model's defaults (seeds
0 and 1) and greedily. At depth j, a round *reaches* draft j when it drafted ≥ j tokens and
accepted drafts 1 … j−1; the rate is accepted-at-j / reached-j, i.e. P(draft j accepted |
drafts 1 … j−1 accepted). Mean accepted length is GenerationResult's: tokens emitted per round
(replacement or bonus included; the budget trims the last round), pooled over requests.

Defaults (12 prompts cut to their last 512 tokens, 64 new tokens, 9 decodes each) take ≈ 2 min
of CPU on one thread. Bits depend on the torch build and thread count (recorded): CPU GEMM
blocking changes BF16 roundings, and one flipped sample changes a whole trajectory.

Routing (distinct experts): training/card_routing.py; the MODEL_CARD.md text:
training/card_render.py. Dimension letters: D draft depth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from corpus.requests import DEFAULT_REQUESTS, KINDS, load_requests
from reference.config import SamplingDefaults
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, RoundRecord, generate
from training.card_render import _f, render
from training.card_routing import target_routes, uniform_union, union_sizes

SAMPLING = SamplingDefaults(temperature=1.0, top_k=20, top_p=0.95)
GREEDY = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0)


@dataclass(frozen=True)
class CardConfig:
    requests: int = 12  # prompts in all, spread over the kinds (4 each by default)
    tokens: int = 64  # new tokens per decode
    max_prompt: int = 512  # longer prompts keep their last max_prompt tokens
    depths: tuple[int, ...] = (7, 3, 5)
    seeds: tuple[int, ...] = (0, 1)  # sampling seeds; greedy runs once (seed 0)
    rows: int = 8  # distinct experts for 1 … rows consecutive positions

    def validate(self) -> None:
        for name, lo in (("requests", 1), ("tokens", 1), ("max_prompt", 1), ("rows", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"card: {name} must be >= {lo}, got {getattr(self, name)}")
        if not self.seeds or not self.depths or min(self.depths) < 1:
            raise ValueError(f"card: need seeds and depths >= 1, got {self.seeds}, {self.depths}")


# --- acceptance ---------------------------------------------------------------------------

def depth_counts(rounds: list[RoundRecord], depth: int) -> tuple[list[int], list[int]]:
    """(reached [D], accepted [D]): rounds reaching draft j (≥ j drafted, 1 … j−1 accepted) and
    rounds accepting it, for j = 1 … depth."""
    reached, accepted = [0] * depth, [0] * depth
    for r in rounds:
        for j in range(1, min(len(r.drafts), depth) + 1):
            if r.accepted < j - 1:
                break
            reached[j - 1] += 1
            accepted[j - 1] += r.accepted >= j
    return reached, accepted


def rates(reached: list[int], accepted: list[int]) -> list[float | None]:
    return [a / n if n else None for n, a in zip(reached, accepted, strict=True)]


@dataclass
class Tally:
    """Pooled round statistics of one (depth, mode)."""

    rounds: int
    emitted: int
    reached: list[int]
    accepted: list[int]

    @classmethod
    def of(cls, rounds: list[RoundRecord], depth: int) -> Tally:
        return cls(len(rounds), sum(len(r.emitted) for r in rounds), *depth_counts(rounds, depth))

    def __add__(self, o: Tally) -> Tally:
        return Tally(self.rounds + o.rounds, self.emitted + o.emitted,
                     [a + b for a, b in zip(self.reached, o.reached, strict=True)],
                     [a + b for a, b in zip(self.accepted, o.accepted, strict=True)])

    def summary(self) -> dict:
        return {"rounds": self.rounds, "emitted": self.emitted, "reached": self.reached,
                "accepted": self.accepted, "acceptance": rates(self.reached, self.accepted),
                "mean_accepted_length": self.emitted / self.rounds if self.rounds else None}


def modes(cfg: CardConfig) -> list[tuple[str, SamplingDefaults, int]]:
    return [(f"sampling-seed{s}", SAMPLING, s) for s in cfg.seeds] + [("greedy", GREEDY, 0)]


def decode_tallies(model: ReferenceModel, prompt: list[int], cfg: CardConfig) -> dict:
    """{(depth, mode): Tally} for one prompt."""
    out = {}
    for d in cfg.depths:
        for name, sampling, seed in modes(cfg):
            req = GenerationRequest(tuple(prompt), cfg.tokens, sampling, seed)
            out[d, name] = Tally.of(generate(model, req, depth=d).rounds, d)
    return out


# --- the run ------------------------------------------------------------------------------

def pick_requests(path: Path, n: int) -> list[dict]:
    """n prompts spread over KINDS; within a kind (sorted by length) the midpoints of c strata."""
    out = []
    for i, kind in enumerate(KINDS):
        recs, c = load_requests(path, kind), n // len(KINDS) + (i < n % len(KINDS))
        if c > len(recs):
            raise ValueError(f"--requests: {path} has {len(recs)} {kind} prompts, {c} needed")
        out += [recs[int((s + 0.5) * len(recs) / c)] for s in range(c)]
    return out


def measure(model: ReferenceModel, tokenizer, recs: list[dict], cfg: CardConfig,
            log=print) -> dict:
    t, e, k = model.cfg.target, model.cfg.target.num_experts, model.cfg.target.num_experts_per_tok
    tallies: dict = {}
    unions: dict[int, list[list[int]]] = {}
    used, t0, c0 = [], time.perf_counter(), time.process_time()
    for i, r in enumerate(recs, 1):
        ids = tokenizer.encode(r["prompt"], add_special_tokens=False).ids
        prompt = ids[-cfg.max_prompt:]
        used.append({"id": r["id"], "kind": r["kind"], "prompt_tokens": len(ids),
                     "used_tokens": len(prompt)})
        for layer, lid in target_routes(model, prompt).items():
            acc = unions.setdefault(layer, [[0, 0] for _ in range(cfg.rows)])
            for a, (s, w) in zip(acc, union_sizes(lid, e, cfg.rows), strict=True):
                a[0], a[1] = a[0] + s, a[1] + w
        one = decode_tallies(model, prompt, cfg)
        for key, tl in one.items():
            tallies[key] = tallies[key] + tl if key in tallies else tl
        d = cfg.depths[0]
        mal = ", ".join(f"{m.removeprefix('sampling-')} "
                        f"{_f(one[d, m].summary()['mean_accepted_length'], 2)}"
                        for m, _, _ in modes(cfg))
        log(f"[{i}/{len(recs)}] {r['kind']:<10} {len(prompt):>4} of {len(ids):>4} prompt tokens "
            f"| depth {d} tokens/round: {mal} | {time.perf_counter() - t0:.0f}s", flush=True)
    acc = {}
    for d in cfg.depths:
        acc[str(d)] = {m: tallies[d, m].summary() for m, _, _ in modes(cfg)}
        pooled = [tallies[d, f"sampling-seed{s}"] for s in cfg.seeds]
        acc[str(d)]["sampling"] = sum(pooled[1:], pooled[0]).summary()
    layers = sorted(unions)
    return {
        "requests": used,
        "tokens": cfg.tokens,
        "max_prompt_tokens": cfg.max_prompt,
        "precision": "bf16",
        "sampling": vars(SAMPLING), "greedy": vars(GREEDY), "seeds": list(cfg.seeds),
        "by_depth": acc,
        "routing": {
            "layers": layers, "rows": list(range(1, cfg.rows + 1)), "num_experts": e,
            "top_k": k, "positions": sum(u["used_tokens"] for u in used),
            "distinct_experts": {str(li): [s / w if w else None for s, w in unions[li]]
                                 for li in layers},
            "independent_uniform": [uniform_union(e, k, r) for r in range(1, cfg.rows + 1)],
            "layer_types": list(t.layer_types),
        },
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,  # all threads; wall time grows under load
    }


# --- citation, environment ------------------------------------------------------------------

CITED = ("command", "steps", "total_steps", "stopped_by", "tokens", "epochs", "train_seconds",
         "tokens_per_s", "device", "torch", "seed", "checkpoint_bytes", "data", "params",
         "train_config", "train_loss", "heldout_loss")


def cite_training(report_path: Path) -> dict:
    """The training numbers as training_report.json states them (not recomputed)."""
    if not report_path.is_file():
        raise ValueError(f"{report_path}: no training report (training/train.py writes it)")
    rep = json.loads(report_path.read_text())
    missing = [k for k in CITED if k not in rep]
    if missing:
        raise ValueError(f"{report_path}: missing fields {missing}")
    return {k: rep[k] for k in CITED}


def environment() -> dict:
    root = Path(__file__).resolve().parents[1]

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    return {"revision": git("rev-parse", "HEAD"),
            "tracked_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write MODEL_CARD.md and card.json of a checkpoint")
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=CardConfig.requests,
                    help="held-out prompts in all, spread over the kinds (default 12)")
    ap.add_argument("--tokens", type=int, default=CardConfig.tokens, help="new tokens per decode")
    ap.add_argument("--request-set", type=Path, default=DEFAULT_REQUESTS)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the GEMMs are tiny, and two threads "
                         "spin-wait badly on a loaded machine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, a.threads))
    from tokenizers import Tokenizer

    from reference.checkpoint import load_checkpoint

    cfg = CardConfig(requests=a.requests, tokens=a.tokens)
    try:
        cfg.validate()
        training = cite_training(a.checkpoint / "training_report.json")
        tok_path = a.checkpoint / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(f"{tok_path}: the checkpoint has no tokenizer")
        recs = pick_requests(a.request_set, cfg.requests)
        ckpt = load_checkpoint(a.checkpoint)
    except ValueError as e:
        print(f"training.card: error: {e}", file=sys.stderr)
        return 2
    model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), precision="bf16")
    ev = measure(model, Tokenizer.from_file(str(tok_path)), recs, cfg)
    args = argv if argv is not None else sys.argv[1:]
    card = {
        "format": "iquestrt.model_card", "version": 1,
        "command": "python -m training.card " + " ".join(args),
        "environment": environment(),
        "config": {"target": ckpt.cfg.target_json(), "draft": ckpt.cfg.draft_json()},
        "training": training, "evaluation": ev,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (a.out / "MODEL_CARD.md").write_text(render(card))
    print(f"wrote {a.out / 'card.json'} and {a.out / 'MODEL_CARD.md'} ({ev['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
