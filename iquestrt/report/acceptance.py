"""`iquestrt report acceptance`: decode a prompt set under one or more depth policies and seeds,
write DIR/acceptance.nc (iquestrt/report/dataset.py) and DIR/summary.{md,html} + DIR/plots/.
The dataset's global attributes name the code revision, the checkpoint's content hash
(iquestrt/report/provenance.py) and a command line that repeats the run.

Output (iquestrt/outputs.py): DIR may not touch the checkpoint, the prompts (file or folder) or the
source tree; it is written beside itself and renamed into place after the last file is complete,
and --force replaces only an earlier report (a folder holding acceptance.nc).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from iquestrt import assets, outputs
from iquestrt.files import checkpoint_tokenizer
from iquestrt.report.dataset import MAX_ROWS, build_dataset, write_netcdf
from iquestrt.report.decode import BackendSpec, Decoded, Decoders, policy_label
from iquestrt.report.prompts import Prompt, load_prompts
from iquestrt.report.provenance import CHECKPOINT_SHA256_SHELL, checkpoint_hash, revision
from iquestrt.report.summary import write_summary
from reference.checkpoint import load_checkpoint
from reference.depth import policy_from_spec
from reference.speculative import GenerationRequest

NC_NAME = "acceptance.nc"
OUTPUT = outputs.OutputSpec("--out", NC_NAME, need_bytes=64 << 20)
TIMING = ("round_end_s is host wall time from the generate() call to each round's on_round "
          "record; round 0 includes the prefill (first_round_s), round_latency_s is the "
          "difference of consecutive records. The engine reads its log after every round when "
          "a callback watches, so on a GPU each round also pays one device-to-host read; on a "
          "CPU all of it is host work. With graphs on (attribute graphs; the default with the "
          "compiled kernels on a GPU) each round is one CUDA graph replay and round 0 also "
          "includes capturing it.")
ROUTING = ("Routing is recomputed by the reference target over prompt + generated tokens "
           "(rows of the generated positions); with the runtime backend in bf16-fold precision, "
           "so near-ties may differ from the runtime's own choices.")


@dataclass(frozen=True)
class AcceptanceSpec:
    checkpoint: Path
    prompts: Path
    out: Path
    seeds: tuple[int, ...] = (0,)
    depths: tuple[str, ...] = ("adaptive",)  # policy specs: "adaptive" or "0" … "7"
    per_kind: int | None = None
    limit: int | None = None  # the first N prompts (after per_kind)
    max_prompt_tokens: int = 512
    max_new_tokens: int = 64
    backend: str = "reference"
    ops: str = "auto"
    precision: str | None = None
    graphs: str = "auto"  # runtime: "on" | "off" | "auto" (on with kernels on a GPU)
    force: bool = False

    def validate(self) -> Path:
        """Every setting checked before any work; → the real output folder."""
        if not Path(self.checkpoint).is_dir():
            raise FileNotFoundError(f"--checkpoint {self.checkpoint}: no such directory")
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed")
        bad = [s for s in self.seeds if not 0 <= s < 2**31]
        if bad:
            raise ValueError(f"--seeds {bad}: must be in [0, 2^31) (stored as netCDF3 int32)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds {list(self.seeds)}: a seed appears twice")
        if not self.depths:
            raise ValueError("--depth: give at least one policy: 'adaptive' or 0 … 7")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit: must be >= 1, got {self.limit}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: must be >= 1, got {self.max_new_tokens}")
        if self.backend not in ("reference", "runtime"):
            raise ValueError(f"--backend: 'reference' or 'runtime', got {self.backend!r}")
        if self.backend == "runtime" and self.precision is not None:
            raise ValueError("--precision: applies to --backend reference only")
        if self.graphs not in ("auto", "on", "off"):
            raise ValueError(f"--graphs: 'auto', 'on' or 'off', got {self.graphs!r}")
        if self.graphs == "on" and self.backend != "runtime":
            raise ValueError("--graphs on: applies to --backend runtime")
        if self.graphs == "on" and not torch.cuda.is_available():
            raise ValueError("--graphs on: CUDA graphs need a GPU (none is visible)")
        return outputs.check(Path(self.out), OUTPUT, force=self.force, inputs={
            "--checkpoint": Path(self.checkpoint),
            "--prompts": Path(self.prompts)})


def resolve_policies(spec: AcceptanceSpec, num_draft_slots: int) -> dict:
    """{label: policy} in --depth order; every depth within the draft's slots."""
    out = {}
    for s in spec.depths:
        try:
            p = policy_from_spec(str(s), spec.checkpoint)
        except ValueError as e:
            raise ValueError(f"--depth {s}: {e}") from None
        if p.max_depth > num_draft_slots:
            raise ValueError(f"--depth {s}: needs {p.max_depth} draft depths, the checkpoint's "
                             f"draft has num_draft_slots={num_draft_slots}")
        label = policy_label(p)
        if label in out:
            raise ValueError(f"--depth: policy {label} given twice")
        out[label] = p
    return out


def spec_command(spec: AcceptanceSpec) -> str:
    """A command line that runs `spec` again (every setting spelled out)."""
    w = ["iquestrt", "report", "acceptance", "--checkpoint", str(spec.checkpoint),
         "--prompts", str(spec.prompts), "--out", str(spec.out),
         "--seeds", *map(str, spec.seeds), "--depth", *map(str, spec.depths)]
    if spec.per_kind is not None:
        w += ["--per-kind", str(spec.per_kind)]
    if spec.limit is not None:
        w += ["--limit", str(spec.limit)]
    w += ["--max-prompt-tokens", str(spec.max_prompt_tokens),
          "--max-new-tokens", str(spec.max_new_tokens), "--backend", spec.backend,
          "--ops", spec.ops, "--graphs", spec.graphs]
    if spec.precision is not None:
        w += ["--precision", spec.precision]
    return shlex.join(w + (["--force"] if spec.force else []))


def spec_from_args(a) -> AcceptanceSpec:
    """The spec of parsed `iquestrt report acceptance` arguments (iquestrt/report/args.py)."""
    return AcceptanceSpec(
        checkpoint=assets.default_model() if a.checkpoint is None else a.checkpoint,
        prompts=assets.data("requests", "v1") if a.prompts is None else a.prompts,
        out=a.out, seeds=tuple(a.seeds), depths=tuple(a.depth), per_kind=a.per_kind,
        limit=a.limit, max_prompt_tokens=a.max_prompt_tokens,
        max_new_tokens=a.max_new_tokens, backend=a.backend, ops=a.ops, precision=a.precision,
        graphs=a.graphs, force=a.force)


def provenance_attrs(spec: AcceptanceSpec) -> dict:
    """Global attributes saying which code, checkpoint and command produced the report."""
    rev, ck = revision(), checkpoint_hash(spec.checkpoint)
    return {
        "code_revision": rev["commit"], "code_worktree": rev["worktree"],
        "code_worktree_changes": "; ".join(rev["dirty"]),
        "checkpoint_sha256": ck.sha256,
        "checkpoint_sha256_covers": (
            "sha256 of checkpoint_sha256_manifest: one sha256sum line per *.safetensors and "
            "*.json file under the checkpoint directory, sorted by path; in that directory, "
            f"{CHECKPOINT_SHA256_SHELL} prints the same value"),
        "checkpoint_sha256_manifest": ck.manifest,
        "command": spec_command(spec),
    }


def _attrs(spec: AcceptanceSpec, cfg, decoders: Decoders, policies: dict) -> dict:
    s = cfg.sampling
    desc = {k: (f"fixed depth {p.depth}" if k != "adaptive" else
                f"adaptive depth {p.min_depth}…{p.max_depth}, threshold {p.threshold:g}")
            for k, p in policies.items()}
    return {
        "checkpoint": str(spec.checkpoint), "model": cfg.name, "prompts": str(spec.prompts),
        "backend": spec.backend,
        "ops": spec.ops if spec.backend == "runtime" else "",
        "graphs": decoders.graphs_used if spec.backend == "runtime" else "",
        "precision": (spec.precision or "bf16") if spec.backend == "reference" else "",
        "routing_precision": decoders.routing_precision,
        "max_new_tokens": spec.max_new_tokens, "max_prompt_tokens": spec.max_prompt_tokens,
        "sampling": f"temperature {s.temperature:g}, top_k {s.top_k}, top_p {s.top_p:g}",
        "policies": "; ".join(f"{k}: {v}" for k, v in desc.items()),
        "experts_per_token": cfg.target.num_experts_per_tok,
        "timing": TIMING, "routing": ROUTING,
        "host": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__} "
                f"({torch.get_num_threads()} threads)"
                f"{' cuda ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}",
        "created_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **provenance_attrs(spec),
    }


OnRequest = Callable[[int, int, Decoded], None]


def run_acceptance(spec: AcceptanceSpec, on_request: OnRequest | None = None) -> Path:
    """Decode every (prompt, seed, policy); on_request(i, total, decoded) after each. → DIR."""
    real_out = spec.validate()
    ckpt = load_checkpoint(spec.checkpoint)
    cfg = ckpt.cfg
    policies = resolve_policies(spec, cfg.draft.num_draft_slots)
    prompts: list[Prompt] = load_prompts(spec.prompts, checkpoint_tokenizer(spec.checkpoint),
                                         spec.max_prompt_tokens, spec.per_kind,
                                         cfg.target.vocab_size, spec.limit)
    longest = max(len(p.ids) for p in prompts)
    decoders = Decoders(ckpt, BackendSpec(spec.backend, spec.ops, spec.precision,
                                          longest + spec.max_new_tokens + MAX_ROWS, spec.graphs))
    # policies innermost: a drifting host load then touches every policy alike
    jobs = [(label, pr, seed) for pr in prompts for seed in spec.seeds for label in policies]
    for pr in prompts:  # a bad request fails before any decoding
        GenerationRequest(pr.ids, spec.max_new_tokens, cfg.sampling, spec.seeds[0]).validate(
            cfg.target.vocab_size, cfg.target.max_position_embeddings)
    with outputs.writing(real_out) as tmp:
        runners = {label: decoders.runner(p) for label, p in policies.items()}
        decoded = []
        for i, (label, pr, seed) in enumerate(jobs):
            req = GenerationRequest(pr.ids, spec.max_new_tokens, cfg.sampling, seed)
            decoded.append(decoders.decode(runners[label], pr, seed, label, req))
            if on_request is not None:
                on_request(i, len(jobs), decoded[-1])
        moe = list(range(1, cfg.target.num_hidden_layers))  # layer 0 is dense
        ds = build_dataset(decoded, cfg.target.num_experts, moe,
                           _attrs(spec, cfg, decoders, policies))
        write_netcdf(ds, tmp / NC_NAME)
        write_summary(ds, tmp)
    return Path(spec.out)


def _progress_line(i: int, total: int, d: Decoded) -> str:
    r = d.result
    return (f"[{i + 1}/{total}] {d.policy} seed {d.seed} {d.prompt.id}: {len(r.tokens)} tokens, "
            f"{len(r.rounds)} rounds, {r.mean_accepted_length:.2f} tokens/round, {d.wall_s:.1f} s")


def run_from_args(a) -> int:
    spec = spec_from_args(a)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    t0 = time.perf_counter()
    if a.quiet or not err.is_terminal:
        def show(i, total, d):
            if not a.quiet:
                err.print(_progress_line(i, total, d), soft_wrap=True, highlight=False,
                          markup=False)
        out = run_acceptance(spec, show)
    else:
        with Progress(TextColumn("decoding"), BarColumn(), TextColumn("{task.completed}/"
                      "{task.total} decodes"), TimeElapsedColumn(), console=err) as bar:
            task = bar.add_task("decode", total=None)

            def show(i, total, d):
                bar.update(task, total=total, completed=i + 1)
                bar.console.print(_progress_line(i, total, d), soft_wrap=True,
                                  highlight=False, markup=False)
            out = run_acceptance(spec, show)
    print(f"wrote {out / NC_NAME}, {out / 'summary.md'}, {out / 'summary.html'} "
          f"({time.perf_counter() - t0:.0f} s)")
    sys.stdout.flush()
    return 0

