"""Fit the adaptive draft-depth rule on a checkpoint and test it on held-out prompts.

    python -m training.depth_study --checkpoint models/mini --out reports/depth/mini-v1

1. Fitting prompts come from train-split stdlib files only (corpus/stdlib.py): files in order
   of sha256(salt + path), one window of 128–256 tokens each, at an offset from the same hash.
   Rounds are recorded at FixedDepth(7) with the reference model (Precision "matched", what the
   runtime computes) → training.depth_fit.fit → <checkpoint>/depth_policy.json.
2. Held-out: request prompts from data/requests/v1 (held-out files; their last 256 tokens),
   every (prompt, seed) decoded once per policy — the stored adaptive rule read back from the
   file, and fixed depths 3 … 7. Same request, so same position-keyed uniforms for all.
3. Modeled time per token, the paired bootstrap against the best fixed depth and the verdict:
   training/depth_study_stats.py (its docstring states the cost model).

Prompts: training/depth_study_prompts.py; decoding: training/depth_study_runs.py; report.md:
training/depth_study_report.py.

In training/ rather than reference/: like training/card.py it reads the corpus split, the
request sets and a shipped checkpoint and writes artifacts beside them; reference/ stays the
model oracle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from reference.depth import FixedDepth, load_policy, policy_to_json, save_policy
from reference.model import ReferenceModel
from training.depth_fit import fit
from training.depth_study_config import StudyConfig
from training.depth_study_prompts import check_disjoint, heldout_prompts, train_prompts
from training.depth_study_report import render
from training.depth_study_runs import SharedPrefill, run_pairs
from training.depth_study_stats import BENCH, FIXED, cost_from_benchmark, heldout_summary, verdict


def main(argv: list[str] | None = None) -> int:
    from corpus.requests import DEFAULT_REQUESTS
    from corpus.stdlib import load_split
    from corpus.tokenizer import load_tokenizer
    from reference.checkpoint import load_checkpoint
    from reference.config import SamplingDefaults
    from training.card import environment, pick_requests
    from training.depth_fit import fixed_as_adaptive

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
