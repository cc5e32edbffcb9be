"""`iquestrt experiment`: arguments, setup, and the record of one paired experiment.

Heavy imports (torch engines, Triton) happen inside run_from_args: on a CPU with --ops kernels
the Triton interpreter must be switched on before the first kernels module is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import sys
from pathlib import Path

DEFAULT_OUT = Path("reports") / "experiments"


def add_experiment_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--prompts", type=Path, required=True,
                   help="a request-set directory (completion/docstring/edit.jsonl) or one JSONL "
                        "file with 'prompt' or 'prompt_ids' per line")
    p.add_argument("--n-prompts", type=int, help="use N prompts, taking the kinds in turn "
                                                 "(default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="request seeds (default 0)")
    p.add_argument("--control", required=True, help="control arm, key=value pairs, e.g. depth=3")
    p.add_argument("--candidate", required=True,
                   help="candidate arm, e.g. 'depth=adaptive' or 'depth=3,graphs=on'; keys: "
                        "depth, graphs, prefetch, sync_rounds, max_width, pdl")
    p.add_argument("--aa", action="store_true",
                   help="add an A/A′ arm: a second control engine built like the candidate's")
    p.add_argument("--out", type=Path, required=True,
                   help=f"record directory, e.g. {DEFAULT_OUT}/NAME (written atomically)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="token budget (default 32)")
    p.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="keep the last N tokens of each prompt (default 256)")
    p.add_argument("--greedy", action="store_true", help="temperature 0 (default: the model's "
                                                         "sampling defaults)")
    p.add_argument("--ops", choices=("auto", "kernels", "twins"), default="auto",
                   help="runtime ops (auto = kernels on a GPU, twins on a CPU)")
    p.add_argument("--ring-pad", type=int, default=64, help="ring slots beyond each window")
    p.add_argument("--threads", type=int,
                   help="torch intra-op CPU threads (default: torch's own choice)")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="bootstrap RNG seed")
    p.add_argument("--verify-all", action="store_true",
                   help="check replay == real prefill on every prompt for every arm (default: "
                        "every prompt for the control, the first prompt for the others)")
    p.add_argument("--snapshot-dir", type=Path,
                   help="save prefill snapshots here and reuse the ones already there")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _take(prompts, n: int | None):
    """The first n prompts, taking the kinds in turn."""
    if n is None:
        return prompts
    if n < 1:
        raise ValueError(f"--n-prompts: must be >= 1, got {n}")
    kinds: dict[str, list] = {}
    for p in prompts:
        kinds.setdefault(p.kind, []).append(p)
    out, queues = [], list(kinds.values())
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def run_and_record(plan, engines, *, out: Path, checkpoint: Path, command: str,
                   resamples: int, boot_seed: int, level: float = 0.95, force: bool = False,
                   log=None, limits=None, inputs=()) -> dict:
    """Run the experiment, summarize it, write DIR/record.{json,md}; → the record. `limits`
    (iquestrt/experiment/trust.py, default TrustLimits()) decide the record's warnings."""
    from iquestrt.experiment.arms import describe
    from iquestrt.experiment.record import environment, write_record
    from iquestrt.experiment.runner import Experiment
    from iquestrt.experiment.signature import compare
    from iquestrt.experiment.summary import markdown, summarize
    from iquestrt.experiment.trust import MachineLoad, TrustLimits, own_threads, sample_load
    from iquestrt.experiment.trust import warnings as trust_warnings
    from iquestrt.report.provenance import revision

    lines: list[str] = []

    def say(msg: str) -> None:
        lines.append(msg)
        if log is not None:
            log(msg)

    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    limits = limits or TrustLimits()
    device = plan.rcfgs[0].device
    env = environment(device)
    load_start = sample_load()
    outcome = Experiment(plan, engines, say).run()
    cpus = os.cpu_count() or 1
    load = MachineLoad(cpus, own_threads(device, env["torch_threads"], cpus), load_start,
                       sample_load())
    labels = [a.label for a in plan.arms]
    summary = summarize(outcome.runs, labels, resamples=resamples, seed=boot_seed, level=level)
    sig = outcome.signatures
    checks = {f"{b} vs {labels[0]}": compare(plan.rcfgs[0].torch_device.type, sig[labels[0]],
                                             sig[b]) for b in labels[1:]}
    record = {
        "format": "iquestrt-experiment", "version": 2, "name": Path(out).name,
        "created_utc": started, "revision": revision(), "environment": env,
        "command": command,
        "warnings": trust_warnings(load, len(plan.pairs()), device, limits),
        "load": load.as_dict(limits),
        "plan": {"checkpoint": str(checkpoint),
                 "prompts": [{"id": p.id, "tokens": len(p.ids)} for p in plan.prompts],
                 "seeds": list(plan.seeds), "max_new_tokens": plan.max_new_tokens,
                 "sampling": dataclasses.asdict(plan.sampling), "verify_all": plan.verify_all,
                 "arms": [{"label": a.label, "flag": a.flag, "spec": a.text,
                           "runtime": describe(r)} for a, r in zip(plan.arms, plan.rcfgs,
                                                                   strict=True)],
                 "order": "pair i: arms in order on even i, reversed on odd i",
                 "bootstrap": {"resamples": resamples, "seed": boot_seed, "level": level,
                               "unit": "(prompt, seed) pair", "interval": "percentile"}},
        "snapshots": outcome.snapshots, "replay_checks": outcome.checks,
        "program_signatures": {k: (v.as_dict() if v else None) for k, v in sig.items()},
        "program_check": checks, "summary": summary,
        "runs": [r.as_dict() for r in outcome.runs], "log": lines,
    }
    write_record(Path(out), record, markdown(record), force, inputs)
    if log is not None:
        for w in record["warnings"]:
            log(f"warning: {w}")
        log(f"wrote {out}/record.json and record.md")
    return record


def command_line(a: argparse.Namespace) -> str:
    """The command, rebuilt from the parsed arguments (however the CLI was invoked)."""
    words = ["iquestrt", "experiment"]
    for key, value in vars(a).items():
        flag = "--" + key.replace("_", "-")
        if key in ("command", "func") or value is None or value is False:
            continue
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def run_from_args(a) -> int:
    import torch

    from iquestrt.experiment.record import check_out
    inputs = {"--checkpoint": a.checkpoint, "--prompts": a.prompts,
              "--snapshot-dir": a.snapshot_dir}
    check_out(a.out, a.force, inputs)
    if a.threads is not None:
        if a.threads < 1:
            raise ValueError(f"--threads: must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    gpu = torch.cuda.is_available()
    ops = a.ops if a.ops != "auto" else ("kernels" if gpu else "twins")
    if ops == "kernels" and not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from iquestrt.config import KERNEL_WIDTH, RuntimeConfig
    from iquestrt.engine import EngineError
    from iquestrt.experiment.arms import ArmSpec
    from iquestrt.experiment.engine import ExperimentEngine
    from iquestrt.experiment.runner import ExperimentError, Plan, PromptCase
    from iquestrt.files import checkpoint_tokenizer
    from iquestrt.report.prompts import load_prompts
    from reference.config import ModelConfig, SamplingDefaults

    cfg = ModelConfig.load(a.checkpoint)
    prompts = _take(load_prompts(a.prompts, checkpoint_tokenizer(a.checkpoint), a.max_prompt_tokens,
                                 vocab_size=cfg.target.vocab_size), a.n_prompts)
    longest = max(len(p.ids) for p in prompts)
    base = RuntimeConfig(ops=ops, device="cuda" if gpu else "cpu", ring_pad=a.ring_pad,
                         max_positions=min(longest + a.max_new_tokens + KERNEL_WIDTH,
                                           cfg.target.max_position_embeddings))
    arms = [ArmSpec.parse("control", "--control", a.control),
            ArmSpec.parse("candidate", "--candidate", a.candidate)]
    if a.aa:
        arms.append(ArmSpec.parse("control′", "--control", a.control))
    rcfgs = tuple(arm.runtime_config(base, cfg, a.checkpoint) for arm in arms)
    sampling = SamplingDefaults(0.0, 0, 1.0) if a.greedy else cfg.sampling
    plan = Plan(tuple(PromptCase(p.id, p.ids) for p in prompts), tuple(a.seeds), tuple(arms),
                rcfgs, a.max_new_tokens, sampling, a.verify_all, a.snapshot_dir)
    for p in plan.prompts:
        plan.request(p, plan.seeds[0]).validate(cfg.target.vocab_size,
                                                cfg.target.max_position_embeddings)
    engines = [ExperimentEngine.from_checkpoint(a.checkpoint, r) for r in rcfgs]
    command = command_line(a)
    log = None if a.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        run_and_record(plan, engines, out=a.out, checkpoint=a.checkpoint, command=command,
                       resamples=a.resamples, boot_seed=a.bootstrap_seed, force=a.force, log=log,
                       inputs=inputs)
    except (ExperimentError, EngineError) as e:
        sys.stderr.write(f"iquestrt: experiment stopped: {e}\n")
        return 1
    return 0
