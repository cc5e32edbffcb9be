"""Arguments of `iquestrt report acceptance` (kept free of heavy imports: the CLI builds its
parser on every call)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = "acceptance-report"


def add_acceptance_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint directory (default: the shipped mini model)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="a request-set directory (completion/docstring/edit.jsonl) or one JSONL "
                        "file with 'prompt' or 'prompt_ids' per line (default: the shipped "
                        "request set data/requests/v1)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="request seeds (default 0)")
    p.add_argument("--depth", nargs="+", default=["adaptive"],
                   help="depth policies: 'adaptive' and/or fixed depths 0 … 7, e.g. "
                        "--depth adaptive 3 (default adaptive)")
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT),
                   help=f"report directory, written atomically (default ./{DEFAULT_OUT})")
    p.add_argument("--per-kind", type=int, help="first N prompts of each kind (default: all)")
    p.add_argument("--limit", type=int,
                   help="the first N prompts in file order, after --per-kind (default: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="keep the last N tokens of each prompt (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token budget (default 64)")
    p.add_argument("--backend", choices=("reference", "runtime"), default="reference",
                   help="decode implementation (default reference)")
    p.add_argument("--ops", choices=("auto", "kernels", "twins"), default="auto",
                   help="runtime ops (auto = kernels on a GPU, twins on a CPU)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="runtime: replay one CUDA graph per round (auto = on with the compiled "
                        "kernels on a GPU, whose timing is otherwise launch-bound; off on a CPU)")
    p.add_argument("--precision", choices=("fp32", "bf16", "matched"), default=None,
                   help="reference precision (default bf16)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.add_argument("--quiet", action="store_true", help="no progress display")
