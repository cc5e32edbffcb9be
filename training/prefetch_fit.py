"""Fit the expert-prefetch predictor of a checkpoint on the request set and write its files.

    python -m training.prefetch_fit fit --checkpoint models/mini --out models/mini/prefetch

The runtime reads them from the checkpoint's prefetch/ folder (iquestrt/prefetch.py).

Prompts: requests of data/requests/v1, split held-out by source file (`split_requests`),
tokenized with the checkpoint's tokenizer (the corpus default when it has none) and truncated to
`--max-tokens`. Traces, the ridge fit, coverage and the predictor files: reference/prefetch.py.

In training/ rather than reference/: like training/depth_study.py it reads the request sets and
the tokenizer of corpus/ and writes artifacts beside a checkpoint; reference/ stays the model
oracle and the predictor's file format.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import asdict
from pathlib import Path

import torch

from corpus.requests import load_requests
from corpus.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from reference.checkpoint import INDEX, load_checkpoint
from reference.model import ReferenceModel
from reference.prefetch import (
    FORMAT,
    TENSORS,
    FitSpec,
    PrefetchError,
    fit_predictors,
    save_predictors,
)
from reference.twins.prefetch import SCORE_CHUNK


def split_requests(reqs: list[dict], n_fit: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Held-out by file: a request evaluates iff sha256(its source path) ≡ 0 mod 3, so no source
    file feeds both sides; kinds interleaved round-robin, then capped."""
    def held(r):
        return int(hashlib.sha256(r["path"].encode()).hexdigest()[:8], 16) % 3 == 0

    def interleave(rs):
        kinds = sorted({r["kind"] for r in rs})
        per = [[r for r in rs if r["kind"] == k] for k in kinds]
        return [q[i] for i in range(max(map(len, per), default=0)) for q in per if i < len(q)]

    fit, ev = interleave([r for r in reqs if not held(r)]), interleave([r for r in reqs if held(r)])
    if len(fit) < n_fit or len(ev) < n_eval:
        raise PrefetchError(f"requests: {len(fit)} fit / {len(ev)} held-out available, "
                            f"asked for {n_fit} / {n_eval}")
    return fit[:n_fit], ev[:n_eval]


def fit_checkpoint(checkpoint, requests, spec: FitSpec) -> tuple[dict, dict]:
    """→ ({sliding layer: P [H, E] BF16}, the prefetch.json metadata) for save_predictors."""
    ck = load_checkpoint(checkpoint)
    model = ReferenceModel(ck.cfg, ck.dequantized(), spec.precision)
    tok_path = Path(checkpoint) / "tokenizer.json"
    tok = load_tokenizer(tok_path if tok_path.is_file() else DEFAULT_TOKENIZER)
    fit, ev = split_requests(load_requests(Path(requests)), spec.fit_prompts, spec.eval_prompts)

    def encode(rs):
        return [torch.tensor(tok.encode(r["prompt"], add_special_tokens=False).ids[
            : spec.max_tokens]) for r in rs]

    preds, report = fit_predictors(model, encode(fit), encode(ev), spec)
    t = ck.cfg.target
    meta = {"format": FORMAT, "hidden": t.hidden_size, "experts": t.num_experts,
            "top_k": t.num_experts_per_tok, "layers": list(t.sliding_layers),
            "m": spec.check(ck.cfg), "min_rows": min(spec.rows), "max_rows": max(spec.rows),
            "score_chunk": SCORE_CHUNK, "fit": {**asdict(spec), "rows": list(spec.rows)},
            "checkpoint_index_sha256": hashlib.sha256(
                (Path(checkpoint) / INDEX).read_bytes()).hexdigest(),
            "fit_requests": [r["id"] for r in fit], "held_out_requests": [r["id"] for r in ev],
            "coverage": {str(i): {str(w): r for w, r in v.items()} for i, v in report.items()}}
    return preds, meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.prefetch_fit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit the expert-prefetch predictor of a checkpoint")
    f.add_argument("--checkpoint", type=Path, required=True)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--requests", type=Path, default=Path("data/requests/v1"))
    d = FitSpec()
    for name in ("fit_prompts", "eval_prompts", "max_tokens", "m"):
        f.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    f.add_argument("--ridge", type=float, default=d.ridge)
    a = ap.parse_args(argv)
    spec = FitSpec(a.fit_prompts, a.eval_prompts, a.max_tokens, a.m, d.rows, a.ridge)
    preds, meta = fit_checkpoint(a.checkpoint, a.requests, spec)
    save_predictors(a.out, preds, meta)
    print(f"{a.out / TENSORS}: m = {meta['m']} of {meta['experts']} experts, held-out coverage "
          f"(predictor / router on the incoming hidden / static most-frequent / uniform m/E):")
    for i, per in meta["coverage"].items():
        for w, r in per.items():
            print(f"  layer {i}, {w} rows: {r['coverage']:.3f} / {r['router_coverage']:.3f} / "
                  f"{r['static_coverage']:.3f} / {meta['m'] / meta['experts']:.3f}  "
                  f"(fit {r['fit_coverage']:.3f}, precision {r['precision']:.3f}, "
                  f"{r['distinct']:.1f} distinct experts, {r['steps']} steps)")


if __name__ == "__main__":
    main()
