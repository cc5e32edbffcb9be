"""Model card of a trained checkpoint: training numbers cited from its training_report.json,
draft acceptance and distinct experts measured on CPU with the reference model (BF16).

    python -m training.card --checkpoint models/mini --out models/mini [--requests N] [--tokens T]

Acceptance. Each held-out prompt is decoded with ReferenceGenerator (what `iquestrt generate
--backend reference` runs) at FixedDepth 7, 3 and 5, sampling with the model's defaults (seeds
0 and 1) and greedily. At depth j, a round *reaches* draft j when it drafted ≥ j tokens and
accepted drafts 1 … j−1; the rate is accepted-at-j / reached-j, i.e. P(draft j accepted |
drafts 1 … j−1 accepted). Mean accepted length is GenerationResult's: tokens emitted per round
(replacement or bonus included; the budget trims the last round), pooled over requests.

Routing. The reference exposes no routing hook, so `recorded_routes` wraps the instance's MoE
call and re-derives the top-k ids with ops.route from the same router input the model uses
(x, or router_in when folded). Distinct experts for r rows: over every window of r consecutive
prompt positions, the size of the union of their top-k ids, averaged (pooled over prompts).

Defaults (12 prompts cut to their last 512 tokens, 64 new tokens, 9 decodes each) take ≈ 2 min
of CPU on one thread. Bits depend on the torch build and thread count (recorded): CPU GEMM
blocking changes BF16 roundings, and one flipped sample changes a whole trajectory.

Dimension letters: T positions, K top-k, E experts, D draft depth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from corpus.requests import DEFAULT_REQUESTS, KINDS, load_requests
from reference import ops
from reference.config import SamplingDefaults
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, RoundRecord, generate

SAMPLING = SamplingDefaults(temperature=1.0, top_k=20, top_p=0.95)
GREEDY = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0)
TARGET_PREFIX = "model.layers."


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


# --- routing ------------------------------------------------------------------------------

@contextmanager
def recorded_routes(model: ReferenceModel):
    """Yields {prefix: [ids [R, K] per MoE call]} filled while the block runs."""
    log: dict[str, list[torch.Tensor]] = {}
    inner = model._moe

    def moe(pre, x, top_k, router_in=None):
        src = x if router_in is None else router_in  # the router input ReferenceModel._moe uses
        _, ids = ops.route(src, model.p[pre + "mlp.router.weight"], top_k)
        log.setdefault(pre, []).append(ids)
        return inner(pre, x, top_k, router_in)

    model._moe = moe
    try:
        yield log
    finally:
        del model._moe  # back to the class method


def target_routes(model: ReferenceModel, prompt: list[int]) -> dict[int, torch.Tensor]:
    """{MoE layer: ids [T, K]} of the target over one prompt (one prefill)."""
    n = len(prompt)
    with recorded_routes(model) as log:
        model.target(torch.tensor(prompt), torch.arange(n), model.new_target_cache())
    return {int(pre[len(TARGET_PREFIX):].rstrip(".")): torch.cat(ids)
            for pre, ids in log.items() if pre.startswith(TARGET_PREFIX)}


def union_sizes(ids: torch.Tensor, n_experts: int, rows: int) -> list[tuple[int, int]]:
    """(Σ union size, windows) over windows of r = 1 … rows consecutive positions; ids [T, K]."""
    hit = torch.zeros(ids.shape[0], n_experts, dtype=torch.bool)  # [T, E]
    hit.scatter_(1, ids, True)
    acc, out = hit, []
    for r in range(1, rows + 1):
        if r > 1:
            acc = acc[:-1] | hit[r - 1 :]  # acc[t] = experts of positions t … t+r−1
        out.append((int(acc.sum()), acc.shape[0]))
    return out


def uniform_union(n_experts: int, top_k: int, r: int) -> float:
    """E[union size] when each of r rows picks top_k distinct experts uniformly, independently."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** r)


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


# --- citation, environment, rendering ---------------------------------------------------------

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


def _f(x, nd=3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def render(card: dict) -> str:
    t, d, tr = card["config"]["target"], card["config"]["draft"], card["training"]
    ev, ro = card["evaluation"], card["evaluation"]["routing"]
    hl, tl, p = tr["heldout_loss"], tr["train_loss"], tr["params"]
    deep = str(max(int(k) for k in ev["by_depth"]))
    seeds = [f"sampling-seed{s}" for s in ev["seeds"]]
    arch = _table(["field", "value"], [
        ["layers", f"{len(t['layer_types'])}: " + " ".join(x[0].upper() for x in t["layer_types"])],
        ["vocab / hidden", f"{t['vocab_size']} / {t['hidden_size']}"],
        ["attention", f"{t['num_attention_heads']} q / {t['num_key_value_heads']} kv heads of "
                      f"{t['head_dim']}, rotary {t['rotary_dim']}, window {t['sliding_window']}, "
                      f"sink {t['attention_sink']}, qk-norm {t['qk_norm']}"],
        ["layer 0", f"dense SwiGLU, intermediate {t['intermediate_size']}"],
        ["layers ≥ 1", f"MoE {t['num_experts']} experts, top-{t['num_experts_per_tok']}, "
                       f"intermediate {t['moe_intermediate_size']}"],
        ["MTP draft", f"1 layer × {d['num_draft_slots']} slots, window {d['sliding_window']}, "
                      f"MoE {d['num_experts']} top-{d['num_experts_per_tok']}"],
        ["max positions", t["max_position_embeddings"]],
        ["parameters", f"{p['total'] / 1e6:.2f} M; {p['target_active_per_token'] / 1e6:.2f} M "
                       "touched per target token (embeddings excluded)"],
        ["checkpoint", f"E4M3 128×128 blocks (lm_head quantized: {t['quantize_lm_head']}), "
                       f"{tr['checkpoint_bytes'] / 1e6:.2f} MB"]])
    train = _table(["field", "value"], [
        ["command", f"`{tr['command']}`"], ["device / torch", f"{tr['device']} / {tr['torch']}"],
        ["steps", f"{tr['steps']} (stopped by {tr['stopped_by']})"],
        ["tokens", f"{tr['tokens']:,} ({tr['epochs']:.2f} epochs of "
                   f"{tr['data']['train_tokens']:,})"],
        ["seconds", f"{tr['train_seconds']:.1f} ({tr['tokens_per_s'] / 1e3:.1f} k tokens/s)"],
        ["batch × seq, lr", f"{tr['train_config']['batch_size']} × {tr['train_config']['seq_len']}"
                            f", {tr['train_config']['lr']}"]])
    nd = len(hl["draft"])
    loss = _table(["loss (nats/token)", "target"] + [f"draft {j}" for j in range(1, nd + 1)], [
        [f"held-out ({hl['tokens']:,} tokens)", _f(hl["target"])] + [_f(x) for x in hl["draft"]],
        [f"train (mean of steps {tl['step'] - tl['steps'] + 1}–{tl['step']})", _f(tl["target"])]
        + [_f(x) for x in tl["draft"]]])
    s7, g7 = ev["by_depth"][deep]["sampling"], ev["by_depth"][deep]["greedy"]
    accept = _table(["draft j", "sampling P(accept)", "reached", "greedy P(accept)", "reached"], [
        [j + 1, _f(s7["acceptance"][j]), s7["reached"][j], _f(g7["acceptance"][j]),
         g7["reached"][j]] for j in range(int(deep))])
    mal = _table(["depth"] + seeds + ["sampling (pooled)", "greedy"], [
        [k] + [_f(ev["by_depth"][k][m]["mean_accepted_length"], 2)
               for m in seeds + ["sampling", "greedy"]]
        for k in sorted(ev["by_depth"], key=int)])
    experts = _table(["layer"] + [f"r={r}" for r in ro["rows"]], [
        [f"{li} ({ro['layer_types'][int(li)]})"] + [_f(x, 2) for x in v]
        for li, v in ro["distinct_experts"].items()]
        + [["independent uniform"] + [_f(x, 2) for x in ro["independent_uniform"]]])
    kinds = sorted({r["kind"] for r in ev["requests"]})
    cut = sum(r["used_tokens"] < r["prompt_tokens"] for r in ev["requests"])
    minutes = tr["train_seconds"] / 60
    return f"""# Model card: `{card['config']['target']['name']}`

Generated by `{card['command']}`
at revision `{card['environment']['revision']}` (uncommitted changes to tracked files:
{card['environment']['tracked_changes']}); every number is also in `card.json`.

## Intended use

Tests and reports of IQuestRT: a toy code model with the IQuest-Q1 structure (MoE target +
recursive MTP draft), trained {minutes:.1f} minutes on CPython's standard library. It gives
the runtime real weights whose draft agrees with its target often but not always. It is not a
useful code model.

## Architecture

{arch}

## Training (cited from training_report.json)

{train}

## Loss

Held-out: the trained weights before E4M3 export, teacher-forced on held-out stdlib files, as
`training/loss.py` evaluates them; draft j is the j-th recursive draft depth. Train: the mean
over the last logged window of steps.

{loss}

## Draft acceptance per depth (FixedDepth({deep}))

P(draft j accepted | drafts 1 … j−1 accepted); "reached" counts the rounds the rate is over.
Sampling: temperature {ev['sampling']['temperature']}, top-k {ev['sampling']['top_k']}, top-p
{ev['sampling']['top_p']}, seeds {ev['seeds']} pooled. Greedy: temperature 0.

{accept}

## Mean accepted length (tokens per round, bonus/replacement included)

{mal}

## Distinct experts vs consecutive rows

Mean size of the union of the target's top-{ro['top_k']} expert ids over r consecutive prompt
positions, per MoE layer ({ro['positions']:,} prompt positions; {ro['num_experts']} experts).
"independent uniform" = E·(1 − (1 − k/E)^r), for comparison.

{experts}

## How this was measured

- Prompts: {len(ev['requests'])} held-out requests from `data/requests/v1` ({', '.join(kinds)}),
  the midpoints of equal strata of each kind's length-sorted list, encoded without special
  tokens. To bound CPU time, prompts longer than {ev['max_prompt_tokens']} tokens keep their
  last {ev['max_prompt_tokens']} tokens ({cut} of {len(ev['requests'])} were cut).
- Decoding: {ev['tokens']} new tokens per run with the reference model (`reference/`,
  {ev['precision']} precision, E4M3 weights dequantized) and `ReferenceGenerator` at fixed
  draft depths {sorted(map(int, ev['by_depth']))}, as `iquestrt generate --backend reference`.
- Routing: one target prefill of each (cut) prompt.
- Wall time {ev['seconds']:.0f} s, process CPU time {ev['cpu_seconds']:.0f} s, on
  {card['environment']['cpus']} CPUs.

## Limitations

- {p['total'] / 1e6:.1f} M parameters trained on {tr['data']['train_tokens'] / 1e6:.1f} M tokens
  of one code base ({tr['epochs']:.1f} epochs): its continuations look like Python but are not
  correct code.
- Acceptance comes from {len(ev['requests'])} prompts × {ev['tokens']} tokens; the "reached"
  column is each rate's sample size, and deep rates rest on few rounds.
- Measured with the BF16 reference, not the runtime's matched FP8 rounding; cut prompts start
  mid-file, unlike the request set's prompts.
- Reproducible bit for bit only with the same torch build and thread count (in `card.json`):
  another CPU GEMM blocking changes BF16 roundings, and one flipped sample changes a whole
  sampling trajectory: per-seed tokens/round can move by a tenth or more.
- Tokenizer and corpus cover CPython's standard library only.
"""


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
