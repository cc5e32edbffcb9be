"""`iquestrt generate`: load a checkpoint, run a backend, stream progress, print a summary."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from reference.checkpoint import load_checkpoint
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, generate


def _request(a, cfg) -> GenerationRequest:
    if a.prompt is not None:
        raise ValueError(
            f"--prompt: {a.checkpoint} has no tokenizer.json; pass --prompt-ids instead"
        )
    s = cfg.sampling
    for flag, value in (("temperature", a.temperature), ("top_k", a.top_k), ("top_p", a.top_p)):
        if value is not None:
            s = replace(s, **{flag: value})
    return GenerationRequest(
        prompt_ids=tuple(a.prompt_ids),
        max_new_tokens=a.max_new_tokens,
        sampling=s,
        seed=a.seed,
        stop_ids=tuple(a.stop_ids),
    )


def _summary(console: Console, res: GenerationResult, seconds: float, depth: int) -> None:
    table = Table(title="rounds", show_lines=False)
    for col in ("round", "position", "drafted", "accepted", "emitted", "bonus"):
        table.add_column(col, justify="right")
    for i, r in enumerate(res.rounds):
        table.add_row(
            str(i), str(r.position), str(len(r.drafts)), str(r.accepted),
            " ".join(map(str, r.emitted)), "yes" if r.bonus else "",
        )
    if depth > 0:
        console.print(table)
    n = len(res.tokens)
    console.print(
        f"tokens {n} | rounds {len(res.rounds)} | mean accepted length "
        f"{res.mean_accepted_length:.2f} | {1e3 * seconds / max(n, 1):.1f} ms/token | "
        f"stop: {res.stop_reason}"
    )


def generate_from_args(a) -> int:
    ckpt = load_checkpoint(a.checkpoint)
    cfg = ckpt.cfg
    req = _request(a, cfg)
    req.validate(cfg.target.vocab_size, cfg.target.max_position_embeddings)
    if not 0 <= a.draft_depth <= cfg.draft.num_draft_slots:
        raise ValueError(
            f"--draft-depth: must be in [0, {cfg.draft.num_draft_slots}], got {a.draft_depth}"
        )
    model = ReferenceModel(cfg, ckpt.dequantized(), precision=a.precision)
    err = Console(stderr=True)
    progress = Progress(
        TextColumn("decoding"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
        TimeElapsedColumn(), console=err, transient=True, disable=a.quiet or not err.is_terminal,
    )
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("decode", total=req.max_new_tokens)
        res = generate(
            model, req, depth=a.draft_depth,
            on_round=lambda r: progress.advance(task, len(r.emitted)),
        )
    seconds = time.perf_counter() - t0
    print(" ".join(map(str, res.tokens)))
    sys.stdout.flush()
    _summary(Console(stderr=True), res, seconds, a.draft_depth)
    return 0
