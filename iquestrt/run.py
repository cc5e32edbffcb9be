"""`iquestrt generate`: load a checkpoint, run a backend, stream progress, print a summary."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from iquestrt.files import checkpoint_tokenizer
from reference.checkpoint import load_checkpoint
from reference.depth import policy_from_spec
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, ReferenceGenerator


def _request(a, cfg, tokenizer) -> GenerationRequest:
    prompt_ids = a.prompt_ids
    if a.prompt is not None:
        if tokenizer is None:
            raise ValueError(
                f"--prompt: {a.checkpoint} has no tokenizer.json; pass --prompt-ids instead"
            )
        prompt_ids = tokenizer.encode(a.prompt).ids
    s = cfg.sampling
    for flag, value in (("temperature", a.temperature), ("top_k", a.top_k), ("top_p", a.top_p)):
        if value is not None:
            s = replace(s, **{flag: value})
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=a.max_new_tokens,
        sampling=s,
        seed=a.seed,
        stop_ids=tuple(a.stop_ids),
    )


def _summary(console: Console, res: GenerationResult, seconds: float, depth: int) -> None:
    if depth > 0 and len(res.rounds) <= 40:
        table = Table(title="rounds")
        for col in ("round", "position", "drafted", "accepted", "emitted", "bonus"):
            table.add_column(col, justify="right")
        for i, r in enumerate(res.rounds):
            table.add_row(
                str(i),
                str(r.position),
                str(len(r.drafts)),
                str(r.accepted),
                " ".join(map(str, r.emitted)),
                "yes" if r.bonus else "",
            )
        console.print(table)
    elif depth > 0:
        console.print("accepted per round: " + " ".join(str(r.accepted) for r in res.rounds))
    n = len(res.tokens)
    console.print(
        f"tokens {n} | rounds {len(res.rounds)} | mean accepted length "
        f"{res.mean_accepted_length:.2f} | {1e3 * seconds / max(n, 1):.1f} ms/token | "
        f"stop: {res.stop_reason}",
        soft_wrap=True,
    )


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

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.advance(self.task, n)
        elif not self.quiet and time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            self.console.print(f"decoded {min(self.done, self.total)}/{self.total} tokens")


def _runtime(a, ckpt, req, policy):
    """The IQuestRT engine for `--backend runtime`, imported late: on a CPU the Triton
    interpreter must be on before the first kernels module is imported."""
    if a.precision is not None:
        raise ValueError("--precision: applies to --backend reference only (compare the runtime "
                         "with --backend reference --precision matched)")
    gpu = torch.cuda.is_available()
    ops = a.ops if a.ops != "auto" else ("kernels" if gpu else "twins")
    if ops == "kernels" and not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.graphs and not gpu:
        raise ValueError("--graphs: CUDA graphs need a GPU (none is visible)")
    if a.loop == "device" and not a.graphs:
        raise ValueError("--loop device: the device loop replays the round's CUDA graph; add "
                         "--graphs")
    if a.pdl and not (gpu and ops == "kernels"):
        raise ValueError(f"--pdl: programmatic dependent launch needs the compiled kernels on a "
                         f"GPU (ops {ops}, {'a GPU' if gpu else 'no GPU'} visible)")
    from iquestrt.config import KERNEL_WIDTH, RuntimeConfig
    from iquestrt.engine import Engine

    _check_tp(a)
    rcfg = RuntimeConfig(
        ops=ops,
        device="cuda" if gpu else "cpu",
        ring_pad=a.ring_pad,
        max_positions=len(req.prompt_ids) + req.max_new_tokens + KERNEL_WIDTH,
        policy=policy,
        graphs=a.graphs,
        loop=a.loop,
        tp_reduce=a.tp_reduce,
        pdl=a.pdl,
    )
    if a.tp > 1:
        engine = _tp_engine(ckpt, rcfg)
    else:
        engine = Engine.from_checkpoint(ckpt.directory, rcfg)
    engine.validate(req)
    return engine


def _check_tp(a) -> None:
    """--tp N needs N processes started by torchrun (before any loading)."""
    if not isinstance(a.tp, int) or not 1 <= a.tp <= 8:
        raise ValueError(f"--tp: must be in [1, 8], got {a.tp}")
    if a.tp == 1:
        if a.tp_reduce != "gather":
            raise ValueError(f"--tp-reduce {a.tp_reduce}: applies to --tp N >= 2 (one rank has "
                             "no partials to reduce)")
        return
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise ValueError(f"--tp {a.tp}: start the command under torchrun with {a.tp} processes: "
                         f"torchrun --nproc-per-node {a.tp} -m iquestrt.cli generate --tp {a.tp} …")
    if world != str(a.tp):
        raise ValueError(f"--tp {a.tp}: torchrun started {world} processes (WORLD_SIZE)")
    if a.loop == "device":
        raise ValueError("--tp with --loop device: the device loop with tensor parallelism is "
                         "not supported (NCCL kernels inside a WHILE node); use the host loop")


def _tp_engine(ckpt, rcfg):
    from iquestrt.tp.engine import TPEngine
    from iquestrt.tp.group import init_group
    from iquestrt.weights import load_weights

    group = init_group()  # the torchrun environment; multicast switched off first
    return TPEngine(load_weights(ckpt.directory, rcfg.device, rcfg.max_positions), rcfg, group)


def tp_rank(a) -> int:
    """This process's rank under `--tp N` (0 otherwise): only rank 0 prints."""
    return int(os.environ.get("RANK", "0")) if getattr(a, "tp", 1) > 1 else 0


class _Stream:
    """Prints new tokens as they arrive: text through the tokenizer's incremental decoder when
    there is one (a character split over tokens is printed once complete, never as U+FFFD), else
    the ids."""

    def __init__(self, tokenizer, enabled: bool):
        from tokenizers.decoders import DecodeStream

        self.tok, self.enabled = tokenizer, enabled
        self.decoder = DecodeStream(skip_special_tokens=True)  # as Tokenizer.decode's default

    def __call__(self, new: list[int]) -> None:
        if not self.enabled:
            return
        if self.tok is None:
            sys.stdout.write(" ".join(map(str, new)) + " ")
        else:
            for i in new:
                piece = self.decoder.step(self.tok, i)  # None until a piece is complete
                if piece:
                    sys.stdout.write(piece)
        sys.stdout.flush()


def generate_from_args(a) -> int:
    ckpt = load_checkpoint(a.checkpoint)
    cfg = ckpt.cfg
    tokenizer = checkpoint_tokenizer(a.checkpoint)
    req = _request(a, cfg, tokenizer)
    req.validate(cfg.target.vocab_size, cfg.target.max_position_embeddings)
    try:
        policy = policy_from_spec(str(a.draft_depth), a.checkpoint)
    except ValueError as e:
        raise ValueError(f"--draft-depth: {e}") from None
    if policy.max_depth > cfg.draft.num_draft_slots:
        raise ValueError(f"--draft-depth: must be in [0, {cfg.draft.num_draft_slots}] or "
                         f"'adaptive', got {a.draft_depth}")
    err = Console(stderr=True)
    quiet = tp_rank(a) != 0  # other ranks decode the same tokens silently
    stream = _Stream(tokenizer, a.stream and not quiet)
    if getattr(a, "tp", 1) > 1 and getattr(a, "backend", "reference") != "runtime":
        raise ValueError("--tp: applies to --backend runtime only")
    if getattr(a, "backend", "reference") == "runtime":
        runtime = _runtime(a, ckpt, req, policy)

        def run(req, sink):
            return runtime.generate(req, on_tokens=sink)
    else:
        model = ReferenceModel(cfg, ckpt.dequantized(), precision=a.precision or "bf16")

        def run(req, sink):
            return ReferenceGenerator(model, policy).generate(req, on_tokens=sink)

    t0 = time.perf_counter()
    with _Ticker(err, req.max_new_tokens, a.quiet or a.stream or quiet) as ticker:
        def sink(new):
            ticker.advance(len(new))
            stream(new)

        res = run(req, sink)
    seconds = time.perf_counter() - t0
    if getattr(a, "tp", 1) > 1:
        from iquestrt.tp.group import close_group

        runtime.close()  # its graphs hold the NCCL communicator
        close_group()
    if quiet:
        return 0
    if a.stream:
        print()
    else:
        print(" ".join(map(str, res.tokens)))
        if tokenizer is not None:
            print(tokenizer.decode(res.tokens))
    sys.stdout.flush()
    _summary(err, res, seconds, policy.max_depth)
    return 0
