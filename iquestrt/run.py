"""`iquestrt generate`, built on the Python API (iquestrt/api.py): load a checkpoint, run a
backend, stream progress or text, print a summary whose times are phase by phase."""

from __future__ import annotations

import os
import re
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from iquestrt import assets
from iquestrt.api import LLM, RequestOutput, SamplingParams
from iquestrt.engine_options import EngineOptions
from iquestrt.files import checkpoint_tokenizer

CLI_FLAGS = {  # fields named in the API's messages → the flags that set them
    "EngineOptions.max_model_len": "--max-new-tokens",
    "SamplingParams.max_tokens": "--max-new-tokens",
    "SamplingParams.stop_token_ids": "--stop-ids",
}


def cli_message(message: str) -> str:
    """An API error in the CLI's terms: EngineOptions.tp_reduce → --tp-reduce, …"""
    for field, flag in CLI_FLAGS.items():
        message = message.replace(field, flag)
    return re.sub(r"\b(?:EngineOptions|SamplingParams)\.(\w+)",
                  lambda m: "--" + m.group(1).replace("_", "-"), message)


def summary_lines(out: RequestOutput, load_s: float) -> list[str]:
    """The request's numbers, each phase on its own: the decode clock excludes loading,
    prefill (which includes Triton's compilation on an engine's first request) and set-up
    (graph capture)."""
    t, sp = out.timing, out.spec
    tpot = t.time_per_output_token_s
    lines = [
        f"tokens {len(out.token_ids)} | finish: {out.finish_reason}",
        f"load {load_s:.2f} s | prefill {1e3 * t.prefill_s:.1f} ms ({len(out.prompt_token_ids)} "
        f"prompt tokens) | set-up {1e3 * t.setup_s:.1f} ms"
        + (" (round graphs captured)" if t.captured else ""),
        f"decode {1e3 * t.decode_s:.1f} ms: "
        + (f"{1e3 * tpot:.2f} ms per output token after the first, " if tpot else "")
        + f"{t.rounds} rounds"
        + (f", {t.tokens_per_round:.2f} tokens per round" if t.tokens_per_round else ""),
    ]
    if sp.num_drafts:
        per = " ".join(f"{r:.2f}" for r in sp.acceptance_rate_per_position())
        lines.append(f"speculative: {sp.num_drafts} drafts, {sp.num_draft_tokens} draft tokens, "
                     f"{sp.num_accepted_tokens} accepted; mean acceptance length "
                     f"{sp.mean_acceptance_length:.2f} (vLLM's: 1 + accepted / drafts); "
                     f"acceptance per position {per}")
    return lines


def _round_table(console: Console, out: RequestOutput) -> None:
    rounds = out.result.rounds
    if not any(r.drafts for r in rounds):
        return
    if len(rounds) > 40:
        console.print("accepted per round: " + " ".join(str(r.accepted) for r in rounds))
        return
    table = Table(title="rounds")
    for col in ("round", "position", "drafted", "accepted", "emitted", "bonus"):
        table.add_column(col, justify="right")
    for i, r in enumerate(rounds):
        table.add_row(str(i), str(r.position), str(len(r.drafts)), str(r.accepted),
                      " ".join(map(str, r.emitted)), "yes" if r.bonus else "")
    console.print(table)


class _Ticker:
    """Progress for long runs: a live bar on a terminal, else a line every `every_s` seconds."""

    def __init__(self, console: Console, total: int, quiet: bool, every_s: float = 10.0):
        self.console, self.total, self.quiet, self.every_s = console, total, quiet, every_s
        self.done, self.last = 0, time.perf_counter()
        self.bar = None
        if not quiet and console.is_terminal:
            self.bar = Progress(
                TextColumn("decoding"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} tokens"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
            self.task = self.bar.add_task("decode", total=self.total)
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
        elif not self.quiet and time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            self.console.print(f"decoded {min(done, self.total)}/{self.total} tokens")
        self.done = done


def tp_rank(a) -> int:
    """This process's rank under `--tp N` (0 otherwise): only rank 0 prints."""
    return int(os.environ.get("RANK", "0")) if getattr(a, "tp", 1) > 1 else 0


def _prompt_ids(a, tokenizer) -> list[int]:
    if a.prompt is None:
        return a.prompt_ids
    if tokenizer is None:
        raise ValueError(f"--prompt: {a.checkpoint} has no tokenizer.json; pass --prompt-ids "
                         f"instead")
    return tokenizer.encode(a.prompt).ids


def generate_from_args(a) -> int:
    try:
        return _generate(a)
    except ValueError as e:
        raise ValueError(cli_message(str(e))) from None


def _generate(a) -> int:
    if a.checkpoint is None:
        a.checkpoint = assets.default_model()
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1, got {a.max_new_tokens}")
    prompt = _prompt_ids(a, checkpoint_tokenizer(a.checkpoint))
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            max_tokens=a.max_new_tokens, seed=a.seed,
                            stop_token_ids=tuple(a.stop_ids), ignore_eos=a.ignore_eos)
    opts = EngineOptions(backend=a.backend, ops=a.ops, graphs=a.graphs, loop=a.loop, pdl=a.pdl,
                         ring_pad=a.ring_pad, draft_depth=a.draft_depth, precision=a.precision,
                         max_model_len=len(prompt) + a.max_new_tokens, tp=a.tp,
                         tp_reduce=a.tp_reduce)
    llm = LLM(a.checkpoint, opts)
    llm.request(prompt, params)  # every check before the request starts
    err = Console(stderr=True)
    quiet = tp_rank(a) != 0  # other ranks decode the same tokens silently
    try:
        if a.stream and not quiet:
            with llm.stream(prompt, params) as s:
                for delta in s:
                    sys.stdout.write(delta if isinstance(delta, str)
                                     else " ".join(map(str, delta)) + " ")
                    sys.stdout.flush()
            print()
            out = s.output
        elif a.quiet or quiet:
            out = llm.generate(prompt, params)
        else:
            with _Ticker(err, a.max_new_tokens, False) as ticker, \
                    llm.stream(prompt, params) as s:
                for _ in s:
                    ticker.update(s.tokens)
            out = s.output
    finally:
        if a.tp > 1:
            llm.close()  # the round graphs hold the NCCL communicator
    if quiet:
        return 0
    if not a.stream:
        print(" ".join(map(str, out.token_ids)))
        if out.text is not None:
            print(out.text)
    sys.stdout.flush()
    _round_table(err, out)
    for line in summary_lines(out, llm.load_s):
        err.print(line, soft_wrap=True)
    return 0
