"""`python -m qualification.qualify`: run the gates, print the gate table, write reports.

Exit status: 0 when every built gate passes, 1 when one fails. A gate that is not built
appears in the table as "not built" and is never counted as a pass.

Models: gates 0 and 1 run on `--model` (default mini: models/mini and real prompts from its
request sets, longer than its target window 128 so sliding layers wrap; tiny: the synthetic
preset, weights seed 0). Gate 2's verdict and gate 3's goldens stay on tiny (stability.py says
why gate 2 does; the goldens are tiny's); the engine-level gates use mini (mini_engine.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # kernels run under the interpreter; set before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from qualification import (
    acceptance_gate,
    bitexact_gate,
    depth_policy_gate,
    distribution,
    distribution_e2e,
    engine_cache_gate,
    gate_pool,
    goldens,
    lockstep,
    lockstep_rank,
    prefetch_gate,
    readiness_gate,
    reuse_gate,
    ring_gate,
    runtime_gate,
    sampler_gate,
    schedule_gate,
    seed_gate,
    stability,
    tp_sampling_gate,
    width_gate,
)
from qualification.gate_models import MODELS, GateModels, QualifyConfig, _models, _tiny
from qualification.gates import (
    FAIL,
    GPU_ONLY,
    NOT_BUILT,
    NOT_RUN,
    PASS,
    GateResult,
    environment,
    revision,
    table,
    write_reports,
)
from qualification.tolerances import measure, tolerance
from reference.model import ReferenceModel


def gate_reference_consistency(q: QualifyConfig, models: GateModels) -> GateResult:
    """Multi-row verification vs one-row decode, and cached decode vs no-cache recompute."""
    evidence, ok, worst = [], True, 0.0
    widths = (1, 8) if q.quick else (1, 2, 4, 6, 8)
    prompts = models.prompts[:1] if q.quick else models.prompts
    n, prefix = models.length, models.prefix
    for k, prompt in enumerate(prompts):
        toks = prompt[:n]
        for prec in ("fp32", "bf16"):
            m = models.refs[prec]
            full = m.target(toks, torch.arange(n), None).logits  # [T, V]
            for r in widths:
                c1, c2 = m.new_target_cache(), m.new_target_cache()
                m.target(toks[:prefix], torch.arange(prefix), c1)
                m.target(toks[:prefix], torch.arange(prefix), c2)
                span = torch.arange(prefix, prefix + r)
                multi = m.target(toks[span], span, c1).logits
                single = torch.cat(
                    [
                        m.target(toks[i : i + 1], span[j : j + 1], c2).logits
                        for j, i in enumerate(span.tolist())
                    ]
                )
                for op, got, want in (
                    ("reference.verify_vs_decode", multi, single),
                    ("reference.cache_vs_recompute", multi, full[span]),
                ):
                    mg = measure(got, want, tolerance(op, prec))
                    worst = max(worst, mg.band_used)
                    ok &= mg.ok
                    if not mg.ok or r == widths[-1]:
                        pos = prefix + mg.worst_index[0]
                        evidence.append(f"{models.name} prompt {k} {prec} R={r} {op}: {mg} "
                                        f"(worst position {pos})")
    return GateResult(
        "0 reference consistency", PASS if ok else FAIL, f"{worst:.0%} of band", evidence
    )


def gate_goldens(q: QualifyConfig, models: GateModels) -> GateResult:
    """Rerun bit-exactness and the golden digests of the CPU reference path (always tiny: the
    committed digests are the tiny model's)."""
    tiny = models.refs if models.name == "tiny" else None  # None: goldens builds tiny itself
    first = goldens.digests(tiny)
    again = goldens.digests(tiny)
    evidence = [f"rerun: {p}" for p in goldens.compare(again, first)]
    where = ""
    try:
        stored, key = goldens.load(), goldens.platform_key()
        want, where = goldens.expected(stored, key)
        diff = [f"golden: {p}" for p in goldens.compare(first, want)]
        evidence += diff
        if diff and goldens.hint(stored, key):
            evidence.append(goldens.hint(stored, key))
    except FileNotFoundError as e:
        evidence.append(str(e))
    n = len(first)
    verdict = FAIL if evidence else PASS
    if not evidence:
        evidence.append(f"{n} cases: rerun identical, goldens match ({goldens.GOLDEN_FILE.name}, "
                        f"{where})")
    return GateResult("3 bit-exactness (reference CPU)", verdict, f"{n} cases", evidence)


def gate_bitexact_runtime(q: QualifyConfig, models) -> GateResult:
    """The twins engine (CPU, on every machine) == the matched reference, bit for bit."""
    ok, evidence = bitexact_gate.run()
    return GateResult("3b bit-exactness (runtime twins vs matched)", PASS if ok else FAIL,
                      "exact", evidence)


def gate_lockstep(q: QualifyConfig, models) -> GateResult:
    """Every production kernel call of the engine vs its twin on the identical inputs: the mini
    model, then one TP8 rank's shapes (a few layers of random E4M3 weights; at test size under
    the interpreter). Quick: the mini model's CPU shape with one round fewer, on either device."""
    if q.quick:
        ok, margin, evidence = lockstep.run(lockstep.LockstepConfig(new_tokens=2))
        return GateResult("1b lockstep kernels vs twins", PASS if ok else FAIL, margin, evidence)
    mini, rank = lockstep.verdict(), lockstep_rank.verdict()
    ok, margin = mini.ok and rank.ok, f"mini {mini.margin}; rank shapes {rank.margin}"
    evidence = ["mini model:", *mini.evidence, "rank shapes:", *rank.evidence]
    return GateResult("1b lockstep kernels vs twins", PASS if ok else FAIL, margin, evidence)


def gate_width(q: QualifyConfig, models) -> GateResult:
    """The twins engine at width 8 (padding rows) == at the exact width 4, bit for bit."""
    ok, margin, evidence = width_gate.run()
    return GateResult("3c padded vs exact width", PASS if ok else FAIL, margin, evidence)


def gate_prefetch(q: QualifyConfig, models) -> GateResult:
    """Expert prefetch on vs off on the mini model: the same bits."""
    ok, margin, evidence = prefetch_gate.run()
    return GateResult("3d prefetch on vs off", PASS if ok else FAIL, margin, evidence)


def gate_schedule(q: QualifyConfig, models) -> GateResult:
    """Eager = graph = device loop, log intervals, streaming, rerun: bit for bit (GPU)."""
    ok, margin, evidence = schedule_gate.run()
    verdict = GPU_ONLY if ok is None else PASS if ok else FAIL
    return GateResult("3e scheduling pairs (GPU)", verdict, margin, evidence)


def gate_reuse(q: QualifyConfig, models) -> GateResult:
    """A reused engine serving other sampling values, budget, stop ids and seed == a fresh one."""
    ok, margin, evidence = reuse_gate.run()
    return GateResult("3f engine reuse", PASS if ok else FAIL, margin, evidence)


def gate_seed_width(q: QualifyConfig, models) -> GateResult:
    """Seeds differing only in bit 32, 48 or 63 give different streams; a seed reproduces."""
    ok, margin, evidence = seed_gate.run()
    return GateResult("6b seed width", PASS if ok else FAIL, margin, evidence)


def gate_tp_sampling(q: QualifyConfig, models) -> GateResult:
    """Sharded sampling on 2, 4, 8 virtual ranks (quick: 8) == unsharded, through the engine."""
    quick = tp_sampling_gate.TPSamplingGateConfig(worlds=(8,)) if q.quick else None
    ok, margin, evidence = tp_sampling_gate.run(quick)
    return GateResult("6c TP sharded sampling (engine)", PASS if ok else FAIL, margin, evidence)


def gate_depth_policy(q: QualifyConfig, models) -> GateResult:
    """The adaptive depth decisions on the device == the reference policy's, every round (quick:
    one prompt)."""
    ok, margin, evidence = depth_policy_gate.run(depth_policy_gate.QUICK if q.quick else None)
    return GateResult("7b adaptive depth decisions", PASS if ok else FAIL, margin, evidence)


def gate_engine_caches(q: QualifyConfig, models) -> GateResult:
    """After every round the engine's caches equal caches that never saw a rejected row."""
    ok, margin, evidence = engine_cache_gate.run()
    return GateResult("4b engine cache settlement", PASS if ok else FAIL, margin, evidence)


def gate_acceptance(q: QualifyConfig, models) -> GateResult:
    """Mean accepted length and per-depth acceptance on the mini model vs the stored baseline."""
    try:
        ok, margin, evidence = acceptance_gate.run()
    except FileNotFoundError as e:
        return GateResult("7 acceptance", FAIL, "-", [str(e)])
    return GateResult("7 acceptance", PASS if ok else FAIL, margin, evidence)


def gate_readiness(q: QualifyConfig, models) -> GateResult:
    """The readiness ring's schedule, every interleaving of small cases (kernels/readiness.py)."""
    ok, evidence = readiness_gate.run()
    return GateResult("8 readiness protocol", PASS if ok else FAIL, "exhaustive", evidence)


def gate_runtime(q: QualifyConfig, models: GateModels) -> GateResult:
    """The engine (twins on CPU, kernels on GPU) vs the matched and FP32 references."""
    base = runtime_gate.RuntimeGateConfig() if models.name == "mini" else runtime_gate.TINY
    cfg = replace(base, prompts=1 if q.quick else 2)
    ok, margin, evidence = runtime_gate.run(cfg)
    return GateResult("1 runtime vs reference", PASS if ok else FAIL, margin, evidence)


def gate_stability(q: QualifyConfig, models: GateModels) -> GateResult:
    """Candidate: the reference's folded-router BF16 mode (the runtime's numerical change; gate
    1 compares the runtime itself). The verdict is the tiny model's; on mini the same check is
    reported (stability.py says why the per-position band cannot pass a legal rounding change
    there)."""
    tiny = models if models.name == "tiny" else _tiny(q)
    fold = ReferenceModel(tiny.refs["bf16"].cfg, tiny.params, "bf16-fold")

    def candidate(tokens):
        return fold.target(tokens, torch.arange(len(tokens)), fold.new_target_cache()).logits

    cfg = stability.StabilityConfig(prompts=1 if q.quick else 3)
    ok, worst, evidence = stability.run(tiny.refs["fp32"], tiny.refs["bf16"], candidate, cfg)
    evidence.insert(
        0, f"verdict on tiny; candidate: bf16-fold; m = {cfg.multiple}, floor = {cfg.floor}, "
        f"appends {cfg.appends}"
    )
    if models.name == "mini":
        mini_fold = ReferenceModel(models.refs["bf16"].cfg, models.params, "bf16-fold")
        mini_cfg = replace(cfg, length=models.length)
        lines = stability.cross_check(models.refs["fp32"], models.refs["bf16"], mini_fold,
                                      mini_cfg, models.prompts[: 1 if q.quick else 3],
                                      with_flips=True)
        evidence += [f"mini (reported, not gated): {e}" for e in lines]
    return GateResult(
        "2 stability bands", PASS if ok else FAIL, f"{worst:.0%} of allowed (tiny)", evidence
    )


def gate_rings(q: QualifyConfig, models) -> GateResult:
    """On the kernels' rings (kernels/kv_cache.py + kernels/attention/); the engine's caches
    are gate 4b's (engine_cache_gate.py)."""
    ok, evidence = ring_gate.run()
    return GateResult("4 ring boundaries", PASS if ok else FAIL, "exact windows", evidence)


def gate_sampler(q: QualifyConfig, models) -> GateResult:
    ok, evidence = sampler_gate.run()
    return GateResult("6 sampler gates", PASS if ok else FAIL, "exact", evidence)


def gate_distribution(q: QualifyConfig, models) -> GateResult:
    """Rejection sampling preserves the target law: G-tests against the exact block law."""
    out = distribution.run(distribution.gate_config(q.quick, torch.cuda.is_available()))
    return GateResult(
        "5 rejection-sampling distribution", PASS if out.ok else FAIL, out.margin, out.evidence
    )


def gate_distribution_e2e(q: QualifyConfig, models) -> GateResult:
    """The mini model's first emitted tokens under speculation vs plain target sampling."""
    g = distribution_e2e.E2EConfig(n=120 if q.quick else 400)
    ok, margin, evidence = distribution_e2e.run(g)
    return GateResult("5b end-to-end first tokens", PASS if ok else FAIL, margin, evidence)


def _not_built(name: str, why: str) -> Callable:
    def gate(q, models) -> GateResult:
        return GateResult(name, NOT_BUILT, "-", [why])

    gate.__name__ = f"gate {name} (not built)"
    return gate


GATES: tuple[Callable, ...] = (
    gate_reference_consistency,
    gate_runtime,
    gate_lockstep,
    gate_stability,
    gate_goldens,
    gate_bitexact_runtime,
    gate_width,
    gate_prefetch,
    gate_schedule,
    gate_rings,
    gate_reuse,
    gate_engine_caches,
    gate_distribution,
    gate_distribution_e2e,
    gate_sampler,
    gate_seed_width,
    gate_tp_sampling,
    gate_acceptance,
    gate_depth_policy,
    gate_readiness,
)


GATE_NAMES = tuple(g.__name__.removeprefix("gate_") for g in GATES)


def parse(argv: list[str] | None = None) -> QualifyConfig:
    ap = argparse.ArgumentParser(prog="python -m qualification.qualify", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer cases, for development")
    ap.add_argument("--out", type=Path, default=Path("reports/qualify"), help="report folder")
    ap.add_argument("--model", choices=MODELS, default="mini",
                    help="model of gates 0 and 1 (gate 2's verdict and gate 3 stay on tiny)")
    ap.add_argument("--only", nargs="+", metavar="GATE", choices=GATE_NAMES,
                    help="run only these gates (a subset report, titled so; never a "
                         f"qualification): {', '.join(GATE_NAMES)}")
    ap.add_argument("--jobs", type=int, default=gate_pool.default_jobs(),
                    help="gates run side by side, each in its own process (default: one per "
                         "core, at most 4; 1: one after another in this process)")
    ap.add_argument("--gate-timeout", type=float, default=1800.0, metavar="S",
                    help="with --jobs > 1: a gate still running after S seconds is killed and "
                         "fails")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs must be ≥ 1, got {a.jobs}")
    if a.gate_timeout <= 0:
        ap.error(f"--gate-timeout must be > 0, got {a.gate_timeout}")
    return QualifyConfig(quick=a.quick, out=a.out, model=a.model, only=tuple(a.only or ()),
                         jobs=a.jobs, gate_timeout_s=a.gate_timeout)


def run_gate(gate: Callable, q: QualifyConfig, models: GateModels) -> GateResult:
    """One gate in this process, timed; a crash is a FAIL naming the exception."""
    t0 = time.perf_counter()
    try:
        res = gate(q, models)
    except Exception as e:  # a crashed gate fails; the others still run and report
        tb = traceback.format_exception(e)
        res = GateResult(gate.__name__.removeprefix("gate_"), FAIL,
                         f"crashed: {type(e).__name__}",
                         [f"{type(e).__name__}: {e}", "".join(tb[-3:])[-1500:]])
    res.seconds = time.perf_counter() - t0
    return res


def _in_turn(q: QualifyConfig, models: GateModels, names: list[str]) -> dict[str, GateResult]:
    out = {}
    for i, gate in enumerate(GATES):
        name = gate.__name__.removeprefix("gate_")
        if name not in names:
            continue
        print(f"[{i + 1}/{len(GATES)}] {gate.__name__}…", flush=True)
        res = out[name] = run_gate(gate, q, models)
        print(f"      {res.verdict} in {res.seconds:.0f} s", flush=True)
        if res.verdict == FAIL:  # now: a run stopped later by a time limit still shows why
            print("\n".join(f"      | {e[:400]}" for e in res.evidence[:6]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    q = parse(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    models = _models(q)
    every = [g.__name__.removeprefix("gate_") for g in GATES]
    names = [n for n in every if not q.only or n in q.only]
    if q.jobs > 1 and len(names) > 1:
        print(f"{len(names)} gates, {q.jobs} at a time, each in its own process", flush=True)
        options = ["--model", q.model, *(["--quick"] if q.quick else [])]
        done = gate_pool.run(names, options, q.jobs, q.gate_timeout_s,
                             lambda t: print(t, flush=True))
    else:
        done = _in_turn(q, models, names)
    results = [done.get(n) or GateResult(n, NOT_RUN, "-", ["left out by --only"])
               for n in every]
    print(table(results))
    wall = time.perf_counter() - t0
    meta = {
        "revision": revision(),
        "command": " ".join(["python -m qualification.qualify", *(argv or sys.argv[1:])]),
        "model": models.description,
        "models per gate": f"0, 1: {models.name}; 1b: mini; 2: tiny (mini reported); 3, 3b: tiny; "
                           "3c, 3d, "
                           "3e, 3f, 4b, 5b, 6b, 6c, 7, 7b: mini",
        "seeds": {"weights": q.weights_seed, "tokens": q.tokens_seed},
        "gate processes": (f"{q.jobs} at a time" if q.jobs > 1 and len(names) > 1
                           else "one process, in turn"),
        "wall seconds": round(wall, 1),
        "environment": environment(),
    }
    if q.only:
        meta["subset"] = f"only {', '.join(q.only)}: NOT a qualification run"
    json_path, md_path = write_reports(q.out, results, meta)
    built = [r for r in results if r.verdict not in (NOT_BUILT, GPU_ONLY, NOT_RUN)]
    print(f"{len(built)} of {len(results)} gates built and run here in {wall:.0f} s; reports: "
          f"{json_path}, {md_path}")
    return 1 if any(r.verdict == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
