"""`iquestrt …` commands. Every failure prints one line `iquestrt: …` (see _fail for the exit
statuses); the exception families are in iquestrt/errors.py."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 1, 2, 70
EXIT_INTERRUPTED, EXIT_PIPE, EXIT_TERMINATED = 130, 141, 143  # 128 + SIGINT / SIGPIPE / SIGTERM


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage dump
        sys.stderr.write(f"iquestrt: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _build() -> argparse.ArgumentParser:
    p = _Parser(prog="iquestrt", description="IQuestRT: IQuest-Q1 decode runtime and tools.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mk = sub.add_parser(
        "make-checkpoint",
        help="write a deterministic synthetic checkpoint",
        description="Write a synthetic IQuest-Q1 checkpoint (HF layout, safetensors, mtp/ draft) "
        "whose weights keep activations healthy through every layer.",
    )
    mk.add_argument("--preset", required=True, help="architecture preset: tiny | iquest-q1")
    mk.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    mk.add_argument("--out", type=Path, required=True, help="output directory (created)")
    mk.add_argument(
        "--format",
        choices=("fp8", "bf16"),
        default="fp8",
        help="fp8: E4M3 block weights with 128x128 inverse scales (default); bf16: BF16 weights",
    )

    cv = sub.add_parser(
        "convert",
        help="convert a BF16 checkpoint to E4M3 128x128 block FP8",
        description="Read a BF16 checkpoint and write it as E4M3 with FP32 128x128 inverse "
        "block scales (routers, norms, sink keys, embeddings and eh_proj stay unquantized).",
    )
    cv.add_argument("--checkpoint", type=Path, required=True, help="BF16 checkpoint directory")
    cv.add_argument("--out", type=Path, required=True, help="output directory")
    cv.add_argument("--quantize", action="store_true", required=True, help="quantize to E4M3")

    g = sub.add_parser(
        "generate",
        help="generate tokens from a checkpoint",
        description="Generate with speculative decoding (recursive MTP draft, rejection "
        "sampling). Prints the new tokens and, per round, drafted/accepted counts.",
    )
    g.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint directory (default: the shipped trained mini model, "
                   "models/mini; $IQUESTRT_DATA/models/mini when that is set)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", type=_int_list, help="prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the checkpoint)")
    g.add_argument("--max-new-tokens", type=int, required=True, help="token budget (>= 1)")
    g.add_argument("--seed", type=int, default=0,
                   help="request seed in [0, 2^64): the counter RNG's 64-bit key, every bit used "
                        "by both backends (default 0)")
    g.add_argument("--temperature", type=float, help="0 = greedy (default: model's)")
    g.add_argument("--top-k", type=int,
                   help="0 = off (the whole vocabulary: reference backend only); the runtime "
                        "serves 1 … 64 when temperature > 0 (default: model's)")
    g.add_argument("--top-p", type=float, help="1.0 = off (default: model's)")
    g.add_argument("--stop-ids", type=_int_list, default=[], help="stop token ids, e.g. 0,2 "
                   "(the checkpoint's end-of-sequence ids stop it too)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's end-of-sequence ids")
    g.add_argument(
        "--backend",
        choices=("reference", "runtime"),
        default="reference",
        help="decode implementation: the slow reference, or the IQuestRT engine",
    )
    g.add_argument(
        "--precision",
        choices=("fp32", "bf16", "matched"),
        default=None,
        help="reference precision mode (default bf16); matched = the runtime's rounding points",
    )
    g.add_argument(
        "--ops",
        choices=("auto", "kernels", "twins"),
        default="auto",
        help="runtime ops: kernels (Triton; interpreted on a CPU, slow) or twins (torch, same "
        "semantics); auto = kernels on a GPU, twins on a CPU",
    )
    g.add_argument(
        "--ring-pad", type=int, default=64,
        help="runtime: ring slots beyond each window, in [max width - 1, 4096] (default 64)"
    )
    g.add_argument(
        "--draft-depth", default="3",
        help="fixed MTP draft depth 0 … 7 (0 = no speculation), or 'adaptive' (the checkpoint's "
        "depth_policy.json, else an unfitted default rule)",
    )
    g.add_argument("--graphs", action="store_true",
                   help="runtime on a GPU: replay one CUDA graph per round")
    g.add_argument("--loop", choices=("host", "device"), default="host",
                   help="runtime with --graphs: 'device' loops rounds in a WHILE graph node on "
                        "the GPU (no host round trip between rounds)")
    g.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="runtime: programmatic dependent launch of the compiled kernels "
                        "(kernels/launch.py; ~1 %% faster rounds, the same bits). Default: on "
                        "where it can run (a Hopper or newer GPU), off elsewhere; --pdl "
                        "requires it, --no-pdl turns it off")
    g.add_argument("--tp", type=int, default=1,
                   help="runtime: tensor-parallel ranks; start under torchrun with as many "
                        "processes (`torchrun --nproc-per-node N -m iquestrt.cli generate --tp "
                        "N …`); rank 0 prints")
    g.add_argument("--tp-reduce", choices=("gather", "peer"), default="gather",
                   help="runtime with --tp: 'gather' all-gathers the partials; 'peer': the tails "
                        "read every rank's ring slot directly (GPU symmetric memory; needs "
                        "--ops kernels)")
    g.add_argument("--stream", action="store_true",
                   help="print tokens (text with a tokenizer) as they are decoded")
    g.add_argument("--quiet", action="store_true", help="no progress display")

    rp = sub.add_parser("report", help="decode a prompt set and write a report")
    rsub = rp.add_subparsers(dest="report", required=True, parser_class=_Parser)
    ra = rsub.add_parser(
        "acceptance",
        help="acceptance statistics of speculative decoding (netCDF + summary with plots)",
        description="Decode a prompt set under depth policies and seeds; write DIR/acceptance.nc "
        "(dims request, round, depth) and DIR/summary.{md,html} with SVG plots.",
    )
    from iquestrt.report.args import add_acceptance_arguments

    add_acceptance_arguments(ra)

    ex = sub.add_parser(
        "experiment",
        help="paired performance experiment: control vs candidate runtime settings",
        description="Control and candidate (and with --aa a second control engine) alternate "
        "over the same prompts and seeds, each request from the same prefill snapshot; writes "
        "OUT/record.{json,md} with bootstrap intervals of the time-per-token and round-latency "
        "ratios and the acceptance difference.",
    )
    from iquestrt.experiment.main import add_experiment_arguments

    add_experiment_arguments(ex)

    sv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve one checkpoint over HTTP: POST /v1/completions and "
        "/v1/chat/completions (stream: true as server-sent events), GET /v1/models, /health, "
        "/metrics (Prometheus). One request at a time, a bounded queue, 429 when it is full.",
    )
    from iquestrt.server.main import add_serve_arguments

    add_serve_arguments(sv)

    bn = sub.add_parser("bench", help="benchmarks on a GPU")
    bsub = bn.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    br = bsub.add_parser(
        "round",
        help="per-rank IQuest-Q1 round benchmark vs its memory floor (one H200)",
        description="One TP8 rank of the full model at real shapes with random E4M3 weights: "
        "speculative rounds timed through the engine over widths, depths and contexts, against "
        "the memory floor and a BF16 torch baseline; writes OUT/record.json, summary.md and "
        "plots (benchmarks/rank/).",
    )
    from benchmarks.rank.main import add_arguments as add_bench_arguments

    add_bench_arguments(br)
    return p


def _checkpoint_output(out: Path, cfg, fmt: str, inputs=()) -> Path:
    """A new checkpoint folder (iquestrt/outputs.py): new or empty, never an input, with room
    for the shards."""
    from iquestrt import outputs
    from reference.checkpoint_validate import stored_bytes

    spec = outputs.OutputSpec("--out", "config.json", stored_bytes(cfg, fmt) + (16 << 20))
    return outputs.check(out, spec, inputs=inputs)


def _cmd_make_checkpoint(a) -> int:
    from iquestrt import outputs
    from reference import config
    from reference.checkpoint import make_synthetic_checkpoint

    real = _checkpoint_output(a.out, config.preset(a.preset), a.format)
    with outputs.writing(real) as tmp:
        cfg = make_synthetic_checkpoint(tmp, a.preset, a.seed, fmt=a.format)
    print(f"wrote {cfg.name} checkpoint ({a.format}, seed {a.seed}) to {a.out}")
    return 0


def _cmd_convert(a) -> int:
    from iquestrt import outputs
    from reference.checkpoint import quantize_checkpoint
    from reference.config import ModelConfig

    if not a.checkpoint.is_dir():
        raise FileNotFoundError(f"--checkpoint {a.checkpoint}: no such directory")
    cfg = ModelConfig.load(a.checkpoint)
    real = _checkpoint_output(a.out, cfg, "fp8", {"--checkpoint": a.checkpoint})
    with outputs.writing(real) as tmp:
        quantize_checkpoint(a.checkpoint, tmp)
    print(f"wrote E4M3 128x128 checkpoint to {a.out}")
    return 0


def _cmd_generate(a) -> int:
    from iquestrt.run import generate_from_args

    return generate_from_args(a)


def _cmd_report(a) -> int:
    from iquestrt.report.acceptance import run_from_args

    return run_from_args(a)


def _cmd_experiment(a) -> int:
    from iquestrt.experiment.main import run_from_args

    return run_from_args(a)


def _cmd_serve(a) -> int:
    from iquestrt.server.main import run_from_args

    return run_from_args(a)


def _cmd_bench(a) -> int:
    from benchmarks.rank.main import run_from_args

    return run_from_args(a, prog="iquestrt")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build().parse_args(argv)
        return HANDLERS[args.command](args)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 — every failure ends in one line (see _fail)
        return _fail(e)


def _fail(e: BaseException) -> int:
    """One line on stderr for any failure, and its exit status: 2 bad input (ValueError, a
    missing file), 1 a fault while running (RuntimeFault, an OS error such as a full or
    read-only disk), 130 / 143 interrupted, 141 a closed pipe, 70 anything else (an internal
    error: IQUESTRT_TRACEBACK=1 shows its traceback)."""
    from iquestrt.errors import RuntimeFault
    from iquestrt.outputs import Terminated

    def say(line: str) -> None:
        with contextlib.suppress(OSError):
            sys.stderr.write(f"iquestrt: {line}\n")
            sys.stderr.flush()

    if isinstance(e, BrokenPipeError):  # `… | head`: stop quietly, as shell tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    if isinstance(e, KeyboardInterrupt | Terminated):
        say("interrupted")
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    if isinstance(e, ValueError | FileNotFoundError | RecursionError):
        say(f"error: {e}")  # includes ConfigError, CheckpointError, OutputError, SamplingError
        return EXIT_USAGE
    if isinstance(e, RuntimeFault):
        say(f"error: {e}")
        return EXIT_FAILED
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        say(f"error: {where}{e.strerror or e}")
        return EXIT_FAILED
    if os.environ.get("IQUESTRT_TRACEBACK") == "1":
        raise e
    say(f"internal error: {type(e).__name__}: {e} (IQUESTRT_TRACEBACK=1 shows the traceback)")
    return EXIT_INTERNAL


HANDLERS = {
    "bench": _cmd_bench,
    "make-checkpoint": _cmd_make_checkpoint,
    "convert": _cmd_convert,
    "generate": _cmd_generate,
    "report": _cmd_report,
    "experiment": _cmd_experiment,
    "serve": _cmd_serve,
}


if __name__ == "__main__":
    raise SystemExit(main())
