"""Fit the adaptive draft-depth rule on a checkpoint and test it on held-out prompts.

    python -m training.depth_study --checkpoint models/mini --out reports/depth/mini-v1

1. Fitting prompts come from train-split stdlib files only (corpus/stdlib.py): files in order
   of sha256(salt + path), one window of 128–256 tokens each, at an offset from the same hash.
   Rounds are recorded at FixedDepth(7) with the reference model (Precision "matched", what the
   runtime computes) → reference.depth_fit.fit → <checkpoint>/depth_policy.json.
2. Held-out: request prompts from data/requests/v1 (held-out files; their last 256 tokens),
   every (prompt, seed) decoded once per policy — the stored adaptive rule read back from the
   file, and fixed depths 3 … 7. Same request, so same position-keyed uniforms for all.
3. Cost model (time units: µs on the H200, CUDA-graph rounds of the mini model): a round with
   d drafts costs base + d·marginal. Tokens of a round are a + 1 (accepted drafts plus the
   replacement or bonus), before budget trimming, so a run's last round counts in full.

Matched mode evaluates every row on its own, so a prompt's prefill rows do not depend on what
follows; `SharedPrefill` computes them once per prompt and copies them into later requests.

In training/ rather than reference/: like training/card.py it reads the corpus split, the
request sets and a shipped checkpoint and writes artifacts beside them; reference/ stays the
model oracle.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from reference.depth import FixedDepth, load_policy, policy_to_json, save_policy
from reference.depth_fit import CostModel, Evaluation, evaluate, fit, records_from_rounds
from reference.model import KVCache, Output, ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, ReferenceGenerator

SALT = "iquestrt-depth-study-v1:"
FIXED = (3, 4, 5, 6, 7)
REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "reports/benchmarks/h200-2026-11-29/session2/bench_round_mini.json"


@dataclass(frozen=True)
class StudyConfig:
    fit_prompts: int = 12
    fit_lo: int = 128  # fitting windows: tokens, at least / at most
    fit_hi: int = 256
    fit_seeds: tuple[int, ...] = (100, 101, 102)
    fit_tokens: int = 64  # new tokens per fitting decode
    eval_prompts: int = 9  # spread over the request kinds
    eval_max_tokens: int = 256  # held-out prompts keep their last this many tokens
    eval_seeds: tuple[int, ...] = tuple(range(10))
    eval_tokens: int = 40
    boot: int = 2000
    boot_seed: int = 0

    def validate(self) -> None:
        for name in ("fit_prompts", "fit_lo", "fit_tokens", "eval_prompts", "eval_max_tokens",
                     "eval_tokens", "boot"):
            if getattr(self, name) < 1:
                raise ValueError(f"StudyConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.fit_hi < self.fit_lo:
            raise ValueError(f"StudyConfig.fit_hi={self.fit_hi} < fit_lo={self.fit_lo}")
        if not self.fit_seeds or not self.eval_seeds:
            raise ValueError("StudyConfig: fit_seeds and eval_seeds must be non-empty")


@dataclass(frozen=True)
class Prompt:
    id: str
    path: str  # stdlib-relative source file
    ids: tuple[int, ...]


def _h(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def cost_from_benchmark(path: Path = BENCH) -> tuple[CostModel, dict]:
    """base + d·marginal through the graph rounds at depths 3 and 5 of a bench_round JSON."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        us = {r["depth"]: r["round_us"] for r in rows if r.get("graphs") is True}
        r3, r5 = float(us["3"]), float(us["5"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: need graph rows of depths '3' and '5' with round_us ({e!r})") from None
    marginal = (r5 - r3) / 2
    base = r3 - 3 * marginal
    path = Path(path).resolve()
    path = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    text = (f"graph round {r3:.0f} µs at depth 3, {r5:.0f} µs at depth 5 ({path}) → "
            f"({r5:.0f} − {r3:.0f}) / 2 = {marginal:.1f} µs per extra depth incl. its "
            f"verification row; base = {r3:.0f} − 3·{marginal:.1f} = {base:.1f} µs")
    # depth_fit only uses depth + row: the benchmark cannot split the two, so row = 0
    return CostModel(depth=marginal, round=base), {"source": str(path), "round_us_d3": r3,
                                                   "round_us_d5": r5, "text": text}


def train_prompts(split, tok, n: int, lo: int, hi: int, salt: str = SALT) -> list[Prompt]:
    held = {f.rel for f in split.heldout}
    for f in split.train:
        if f.rel in held or split.rule.is_heldout(f.rel):
            raise ValueError(f"train_prompts: {f.rel} is a held-out file of the split; fitting "
                             f"prompts may come from train files only")
    out = []
    for f in sorted(split.train, key=lambda f: _h(salt + f.rel)):
        ids = tok.encode(f.text(), add_special_tokens=False).ids
        if len(ids) < lo:
            continue
        k = min(hi, len(ids))
        start = int(_h(salt + f.rel)[16:32], 16) % (len(ids) - k + 1)
        out.append(Prompt(f"train:{f.rel}@{start}", f.rel, tuple(ids[start : start + k])))
        if len(out) == n:
            return out
    raise ValueError(f"train_prompts: only {len(out)} train files have >= {lo} tokens, {n} needed")


def heldout_prompts(records: Sequence[dict], tok, max_tokens: int) -> list[Prompt]:
    return [Prompt(r["id"], r["path"],
                   tuple(tok.encode(r["prompt"], add_special_tokens=False).ids[-max_tokens:]))
            for r in records]


def check_disjoint(fit_p: Sequence[Prompt], eval_p: Sequence[Prompt], split) -> None:
    train = {f.rel for f in split.train}
    bad = [p.path for p in fit_p if p.path not in train]
    bad += [p.path for p in eval_p if p.path in train or not split.rule.is_heldout(p.path)]
    if bad:
        raise ValueError(f"prompts cross the train/held-out split: {sorted(set(bad))[:5]}")


class SharedPrefill:
    """A matched ReferenceModel that computes each prompt's target prefill (rows 0 … n−1) and
    the draft catch-up rows 1 … n−1 once, then copies them into an empty cache."""

    def __init__(self, model: ReferenceModel):
        if not model.precision.matched:
            raise ValueError(f"SharedPrefill: needs Precision 'matched' (rows computed one at a "
                             f"time), got {model.precision.name!r}")
        self.model, self.cfg, self.hits = model, model.cfg, 0
        self._target: dict[tuple, tuple[Output, KVCache]] = {}
        self._draft: dict[tuple, tuple[torch.Tensor, Output, KVCache]] = {}

    def new_target_cache(self) -> KVCache:
        return self.model.new_target_cache()

    def new_draft_cache(self) -> KVCache:
        return self.model.new_draft_cache()

    @staticmethod
    def _fill(cache: KVCache, stored: KVCache) -> None:
        cache.k = [None if t is None else t.clone() for t in stored.k]
        cache.v = [None if t is None else t.clone() for t in stored.v]

    def target(self, tokens, positions, cache=None) -> Output:
        if cache is None or cache.length or int(positions[0]) != cache.start:
            return self.model.target(tokens, positions, cache)
        key = tuple(tokens.tolist())
        if key in self._target:
            self.hits += 1
        else:
            c = self.new_target_cache()
            self._target[key] = (self.model.target(tokens, positions, c), c)
        out, stored = self._target[key]
        self._fill(cache, stored)
        return Output(out.logits.clone(), out.hidden.clone())

    def draft(self, tokens, hprev, positions, cache=None) -> Output:
        # the last catch-up row holds the first sampled token (seed-dependent): never shared
        if cache is None or cache.length or int(positions[0]) != cache.start or len(tokens) < 2:
            return self.model.draft(tokens, hprev, positions, cache)
        key = tuple(tokens[:-1].tolist())
        hit = self._draft.get(key)
        if hit is not None and torch.equal(hit[0], hprev[:-1]):
            self.hits += 1
            self._fill(cache, hit[2])
            head = hit[1]
        else:
            head = self.model.draft(tokens[:-1], hprev[:-1], positions[:-1], cache)
            self._draft[key] = (hprev[:-1].clone(), head, cache.clone())
        last = self.model.draft(tokens[-1:], hprev[-1:], positions[-1:], cache)
        return Output(torch.cat([head.logits, last.logits]), torch.cat([head.hidden, last.hidden]))


def decode(model, policy, req: GenerationRequest) -> GenerationResult:
    return ReferenceGenerator(model, policy).generate(req)


def run_pairs(model, prompts: Sequence[Prompt], seeds: Sequence[int], policies: dict,
              sampling, new_tokens: int, log: Callable[[str], None] = print,
              run: Callable = decode) -> tuple[list[dict], list[GenerationResult]]:
    """Every (prompt, seed) decoded by every policy with one request object → per-run rows
    (depths d and accepted a of each round) and the results, in (prompt, seed, policy) order."""
    rows, results, t0 = [], [], time.process_time()
    total, i = len(prompts) * len(seeds) * len(policies), 0
    for p in prompts:
        for s in seeds:
            req = GenerationRequest(p.ids, new_tokens, sampling, s)
            for label, pol in policies.items():
                res = run(model, pol, req)
                d = [len(r.drafts) for r in res.rounds]
                a = [r.accepted for r in res.rounds]
                rows.append({"prompt": p.id, "seed": s, "policy": label,
                             "depths": "".join(map(str, d)), "accepted": "".join(map(str, a))})
                results.append(res)
                i += 1
                log(f"[{i}/{total}] {p.id} seed {s} {label}: {len(d)} rounds, "
                    f"{(sum(a) + len(a)) / len(a):.2f} tokens/round, cpu "
                    f"{time.process_time() - t0:.0f}s")
    return rows, results


def run_totals(row: dict, cost: CostModel) -> tuple[float, int, int, int]:
    """(modeled time, tokens = Σ(a+1), rounds, drafts run) of one run row."""
    d = [int(c) for c in row["depths"]]
    a = [int(c) for c in row["accepted"]]
    return len(d) * cost.round + sum(d) * cost.marginal, sum(a) + len(a), len(d), sum(d)


def by_policy(rows: Sequence[dict], cost: CostModel) -> dict[str, dict]:
    acc: dict[str, list] = {}
    for r in rows:
        acc.setdefault(r["policy"], []).append(run_totals(r, cost))
    out = {}
    for label, xs in acc.items():
        t, n, k, d = (sum(x[i] for x in xs) for i in range(4))
        out[label] = {"time_per_token": t / n, "tokens_per_round": n / k,
                      "drafts_per_round": d / k, "rounds": k, "tokens": n, "time": t}
    return out


def pair_arrays(rows: Sequence[dict], cost: CostModel, label: str):
    """[P] modeled time and [P] tokens of one policy, pairs in (prompt, seed) order."""
    xs = sorted(((r["prompt"], r["seed"]), run_totals(r, cost)) for r in rows
                if r["policy"] == label)
    return (torch.tensor([x[1][0] for x in xs], dtype=torch.float64),
            torch.tensor([x[1][1] for x in xs], dtype=torch.float64))


def bootstrap_ratio(ta, na, fixed: dict, boot: int, seed: int) -> dict:
    """Ratio of time per token, adaptive (ta, na [P]) over each fixed policy's (fixed: label →
    (t, n) [P], same pair order): the point estimate, a percentile 95% CI resampling pairs, and
    the CI against the best fixed policy re-chosen in every replicate."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, ta.shape[0], (boot, ta.shape[0]), generator=g)  # [B, P]
    rate_a = ta[idx].sum(1) / na[idx].sum(1)  # [B]
    rates = {k: t[idx].sum(1) / n[idx].sum(1) for k, (t, n) in fixed.items()}

    def ci(x: torch.Tensor) -> list[float]:
        s = torch.sort(x).values
        return [float(s[round(0.025 * (boot - 1))]), float(s[round(0.975 * (boot - 1))])]

    point = {k: float((ta.sum() / na.sum()) / (t.sum() / n.sum())) for k, (t, n) in fixed.items()}
    best = torch.stack(list(rates.values())).min(0).values
    return {"point": point, "ci95": {k: ci(rate_a / r) for k, r in rates.items()},
            "ci95_best_rechosen": ci(rate_a / best), "boot": boot, "seed": seed}


def replay(results: Sequence[GenerationResult], policies: dict, cost: CostModel) -> dict:
    """Policies replayed on depth-7 rounds (reference.depth_fit.evaluate): µs per token."""
    rec = records_from_rounds([r for res in results for r in res.rounds], 7)
    ev: dict[str, Evaluation] = {k: evaluate(p, rec, cost) for k, p in policies.items()}
    return {k: {"time_per_token": 1 / e.throughput, "mean_depth": e.mean_depth}
            for k, e in ev.items()}


def heldout_summary(rows: list[dict], results: list, adaptive, cost: CostModel,
                    cfg: StudyConfig) -> dict:
    agg = by_policy(rows, cost)
    fixed = [f"fixed-{k}" for k in FIXED]
    best = min(fixed, key=lambda k: (agg[k]["time_per_token"], k))
    ta, na = pair_arrays(rows, cost, "adaptive")
    arrays = {k: pair_arrays(rows, cost, k) for k in fixed}
    ratio = bootstrap_ratio(ta, na, arrays, cfg.boot, cfg.boot_seed)
    ra, rb = ta / na, arrays[best][0] / arrays[best][1]  # [P] per-pair time per token
    d7 = [res for row, res in zip(rows, results, strict=True) if row["policy"] == "fixed-7"]
    pols = {f"fixed-{k}": FixedDepth(k) for k in range(1, 8)} | {"adaptive": adaptive}
    return {"by_policy": agg, "best_fixed": best, "ratio": ratio, "pairs": int(ta.shape[0]),
            "vs_best_pairs": {"faster": int((ra < rb).sum()), "equal": int((ra == rb).sum()),
                              "slower": int((ra > rb).sum())},
            "replay_on_fixed7_rounds": replay(d7, pols, cost)}


def verdict(h: dict) -> str:
    b = h["best_fixed"]
    r, (lo, hi) = h["ratio"]["point"][b], h["ratio"]["ci95"][b]
    how = ("faster than" if hi < 1 else "slower than" if lo > 1 else
           "not distinguishable from")
    return (f"adaptive / best fixed ({b}) modeled time per token = {r:.3f} "
            f"(95% CI {lo:.3f} … {hi:.3f}): the adaptive rule is {how} the best fixed depth "
            f"on these held-out pairs")


def render(res: dict) -> str:
    f, h, c = res["fit"], res["heldout"], res["cost"]
    us = lambda x: f"{x:.0f}"  # noqa: E731
    fit_rows = "\n".join(f"| fixed {k} | {us(1 / v)} |" for k, v in
                         f["summary"]["fixed_tokens_per_time"].items())
    pol = f["policy"]
    weights = "\n".join(f"| {j} | " + " | ".join(f"{x:.4g}" for x in w) + " |"
                        for j, w in pol.get("weights", {}).items())
    b = h["best_fixed"]
    best_t = h["by_policy"][b]["time_per_token"]
    ho_rows = "\n".join(
        f"| {k} | {v['tokens_per_round']:.3f} | {v['drafts_per_round']:.2f} | "
        f"{us(v['time_per_token'])} | {v['time_per_token'] / best_t:.3f} | "
        + (" – |" if k == "adaptive" else
           "{:.3f} ({:.3f} … {:.3f}) |".format(h["ratio"]["point"][k], *h["ratio"]["ci95"][k]))
        for k, v in h["by_policy"].items())
    rp = "\n".join(f"| {k} | {us(v['time_per_token'])} | {v['mean_depth']:.2f} |"
                   for k, v in h["replay_on_fixed7_rounds"].items())
    lo, hi = h["ratio"]["ci95_best_rechosen"]
    t = res["time"]
    rpt, v = h["replay_on_fixed7_rounds"], h["vs_best_pairs"]
    low = min(("fixed-1", "fixed-2"), key=lambda k: rpt[k]["time_per_token"])
    floor = "" if rpt[low]["time_per_token"] >= min(
        rpt[f"fixed-{k}"]["time_per_token"] for k in FIXED) else (
        f"\n\nBelow the adaptive range: in this replay {low} ({us(rpt[low]['time_per_token'])} "
        f"µs/token) beats every depth the adaptive rule can choose (it always runs 3).")
    return f"""# Adaptive draft depth on `mini` (study v1)

Generated by `{res['command']}`
at revision `{res['environment']['revision']}` (uncommitted changes to tracked files:
{res['environment']['tracked_changes']}); every number is in `results.json`. CPU time
{t['cpu_s']:.0f} s (fit {t['fit_cpu_s']:.0f} s, held-out {t['eval_cpu_s']:.0f} s), wall
{t['wall_s']:.0f} s, torch threads: {res['environment']['torch_threads']}.

**Result: {verdict(h)}.**

## Cost model

{c['text']}. Modeled time of a round with d drafts = {c['base']:.1f} + d·{c['marginal']:.1f} µs;
tokens of a round = accepted drafts + 1 (replacement or bonus, before budget trimming).
Depths 1, 2 (replay table below) extrapolate below the measured range.

## Fit (train split only)

{len(f['prompts'])} windows of {res['config']['fit_lo']}–{res['config']['fit_hi']} tokens from
train-split files (order sha256(salt + path)): {', '.join(f"`{p['path']}`" for p in f['prompts'])}.
Decoded at FixedDepth(7), reference model in Precision "matched", sampling T=1 / top-k 20 /
top-p 0.95, seeds {list(f['seeds'])}, {f['new_tokens']} new tokens each:
{f['summary']['rounds']} rounds. `reference.depth_fit.fit` on them (replay on the same rounds):

| policy | µs/token |
| --- | --- |
{fit_rows}
| adaptive (fitted) | {us(1 / f['summary']['adaptive_tokens_per_time'])} |

Mean adaptive depth {f['summary']['adaptive_mean_depth']:.2f}; gain vs best fixed
({f['summary']['best_fixed']}) on the fitting rounds {f['summary']['gain_vs_best_fixed']:+.2%}.
{f['note']} Stored as `{f['policy_file']}` (threshold {pol.get('threshold', '–')}):

| after j drafts | bias | cum | q | h | cum·q | cum·h |
| --- | --- | --- | --- | --- | --- | --- |
{weights}

## Held-out, paired

{len(h['prompts'])} request prompts from `data/requests/v1` (held-out files; last
{res['config']['eval_max_tokens']} tokens): {', '.join(f"`{p['id']}`" for p in h['prompts'])}.
Seeds {list(h['seeds'])}, {h['new_tokens']} new tokens; every (prompt, seed) pair decoded by
every policy ({h['pairs']} pairs per policy); adaptive = the rule read back from
`depth_policy.json`.

| policy | tokens/round | drafts/round | µs/token | vs best | adaptive / this, 95% CI |
| --- | --- | --- | --- | --- | --- |
{ho_rows}

Bootstrap: {h['ratio']['boot']} resamples of the pairs (torch.Generator seed
{h['ratio']['seed']}), ratio of sums; percentile intervals. Against the best fixed depth
re-chosen in each resample: {lo:.3f} … {hi:.3f}. Per pair against {b}, the adaptive rule was
faster in {v['faster']}, equal in {v['equal']} and slower in {v['slower']} of {h['pairs']}
pairs.

Replay of the held-out FixedDepth(7) rounds (`depth_fit.evaluate`; rounds from other
trajectories, so an estimate, not a decode):

| policy | modeled µs/token | mean drafts |
| --- | --- | --- |
{rp}{floor}

## Limitations

- Modeled time, not measured: one H200 benchmark's two graph-round times fix the cost line;
  the draft's share of a depth and the verification row's share are not separated.
- {len(h['prompts'])} prompts × {len(h['seeds'])} seeds × {h['new_tokens']} tokens (CPU budget);
  pairs of one prompt share its context, so the pair bootstrap understates prompt-to-prompt
  variation.
- Bits depend on the torch build and thread count (recorded in results.json).
"""


def main(argv: list[str] | None = None) -> int:
    from corpus.requests import DEFAULT_REQUESTS
    from corpus.stdlib import load_split
    from corpus.tokenizer import load_tokenizer
    from reference.checkpoint import load_checkpoint
    from reference.config import SamplingDefaults
    from reference.depth_fit import fixed_as_adaptive
    from training.card import environment, pick_requests

    d = StudyConfig()
    ap = argparse.ArgumentParser(description="fit and test the adaptive draft-depth rule")
    ap.add_argument("--checkpoint", type=Path, default=Path("models/mini"))
    ap.add_argument("--out", type=Path, default=Path("reports/depth/mini-v1"))
    ap.add_argument("--bench", type=Path, default=BENCH, help="bench_round JSON of the cost model")
    ap.add_argument("--requests", type=Path, default=DEFAULT_REQUESTS)
    for name in ("fit_prompts", "fit_tokens", "eval_prompts", "eval_tokens", "boot"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--fit-seeds", type=int, default=len(d.fit_seeds))
    ap.add_argument("--eval-seeds", type=int, default=len(d.eval_seeds))
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, a.threads))
    cfg = StudyConfig(fit_prompts=a.fit_prompts, fit_tokens=a.fit_tokens,
                      fit_seeds=tuple(range(100, 100 + a.fit_seeds)),
                      eval_prompts=a.eval_prompts, eval_tokens=a.eval_tokens,
                      eval_seeds=tuple(range(a.eval_seeds)), boot=a.boot)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        cfg.validate()
        cost, cost_info = cost_from_benchmark(a.bench)
        split = load_split()
        tok = load_tokenizer(a.checkpoint / "tokenizer.json")
        fit_p = train_prompts(split, tok, cfg.fit_prompts, cfg.fit_lo, cfg.fit_hi)
        eval_p = heldout_prompts(pick_requests(a.requests, cfg.eval_prompts), tok,
                                 cfg.eval_max_tokens)
        check_disjoint(fit_p, eval_p, split)
        ck = load_checkpoint(a.checkpoint)
    except ValueError as e:
        print(f"training.depth_study: error: {e}", file=sys.stderr)
        return 2
    sampling = SamplingDefaults(temperature=1.0, top_k=20, top_p=0.95)
    model = SharedPrefill(ReferenceModel(ck.cfg, ck.dequantized(), "matched"))
    log = lambda s: print(s, flush=True)  # noqa: E731

    log(f"fit: {len(fit_p)} train prompts × {len(cfg.fit_seeds)} seeds at FixedDepth(7)")
    _, fres = run_pairs(model, fit_p, cfg.fit_seeds, {"fixed-7": FixedDepth(7)}, sampling,
                        cfg.fit_tokens, log)
    rep = fit([r for res in fres for r in res.rounds], cost)
    fallback = rep.policy == fixed_as_adaptive(rep.best_fixed)
    cost_info |= {"base": cost.round, "marginal": cost.marginal}
    fit_info = rep.summary() | {
        "study": "training/depth_study.py", "report": str(a.out), "precision": "matched",
        "cost_model": cost_info["text"], "prompts": [p.id for p in fit_p],
        "seeds": list(cfg.fit_seeds), "new_tokens": cfg.fit_tokens}
    path = save_policy(a.checkpoint, rep.policy, fit_info)
    adaptive = load_policy(a.checkpoint)  # evaluate what ships, read back from the file
    if adaptive != rep.policy:
        raise RuntimeError(f"{path}: read back {adaptive}, stored {rep.policy}")
    c_fit = time.process_time() - c0
    log(rep.table())

    policies = {"adaptive": adaptive} | {f"fixed-{k}": FixedDepth(k) for k in FIXED}
    log(f"held-out: {len(eval_p)} prompts × {len(cfg.eval_seeds)} seeds × {len(policies)} "
        f"policies")
    rows, eres = run_pairs(model, eval_p, cfg.eval_seeds, policies, sampling, cfg.eval_tokens,
                           log)
    h = heldout_summary(rows, eres, adaptive, cost, cfg)
    c_all = time.process_time() - c0
    save_policy(a.checkpoint, adaptive, fit_info | {"heldout": {
        "verdict": verdict(h), "ratio_vs_best_fixed": h["ratio"]["point"][h["best_fixed"]],
        "ci95": h["ratio"]["ci95"][h["best_fixed"]]}})
    res = {
        "format": "iquestrt.depth_study", "version": 1,
        "command": "python -m training.depth_study " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "environment": environment(), "config": asdict(cfg), "cost": cost_info,
        "fit": {"prompts": [{"id": p.id, "path": p.path, "tokens": len(p.ids)} for p in fit_p],
                "seeds": list(cfg.fit_seeds), "new_tokens": cfg.fit_tokens,
                "summary": rep.summary(), "policy": policy_to_json(rep.policy),
                "policy_file": str(path), "note": (
                    "The fit found no score beating the best fixed depth on its rounds: the "
                    "stored rule is that fixed depth written as an adaptive rule."
                    if fallback else "")},
        "heldout": {"prompts": [{"id": p.id, "path": p.path, "tokens": len(p.ids)}
                                for p in eval_p],
                    "seeds": list(cfg.eval_seeds), "new_tokens": cfg.eval_tokens, **h,
                    "runs": rows},
        "time": {"cpu_s": c_all, "fit_cpu_s": c_fit, "eval_cpu_s": c_all - c_fit,
                 "wall_s": time.perf_counter() - t0},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    runs = res["heldout"].pop("runs")  # one line per run keeps the file small and diffable
    text = json.dumps(res, indent=1)[:-2] + ',\n "runs": [\n' + ",\n".join(
        "  " + json.dumps(r) for r in runs) + "\n ]\n}\n"
    (a.out / "results.json").write_text(text)
    (a.out / "report.md").write_text(render(res))
    log(verdict(h))
    log(f"wrote {a.out / 'report.md'}, {a.out / 'results.json'}, {path} "
        f"(cpu {c_all:.0f}s, wall {res['time']['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
