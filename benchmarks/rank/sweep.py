"""The sweep: weights, routing, bandwidth, every configuration timed through
RankEngine, the floor of each, the per-kernel breakdown where asked, eager launches at the
headline configuration, the BF16 torch baseline, then the record (benchmarks/rank/record.py).
A configuration that fails prints its full traceback, is recorded with its error, and the sweep
goes on."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.rank.baseline import baseline_params
from benchmarks.rank.baseline_run import BaselineRound
from benchmarks.rank.engine import RankEngine
from benchmarks.rank.floor import RoundShape, floor_terms
from benchmarks.rank.measure import copy_bandwidth, profile_round
from benchmarks.rank.record import OUTPUT, write_record
from benchmarks.rank.shapes import TP, rank_config
from benchmarks.rank.spec import CONTEXTS, SweepSpec
from benchmarks.rank.tp import TPBench, tp_bench
from benchmarks.rank.traces import (
    MODES,
    distinct_per_layer,
    record_mini_traces,
    trace_table,
    uniform_distinct,
    uniform_table,
)
from benchmarks.rank.weights import random_weights, weight_bytes
from iquestrt import outputs
from iquestrt.config import KERNEL_WIDTH, RuntimeConfig, pdl_available
from iquestrt.launch_overrides import LaunchOverrides
from iquestrt.tp.group import TPGroup
from reference.config import ModelConfig, layer_pattern
from reference.depth import FixedDepth, default_adaptive


class Progress:
    def __init__(self, quiet: bool = False):
        self.t0, self.quiet = time.perf_counter(), quiet  # quiet: a TP rank other than 0

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)


def routing(spec: SweepSpec, cfg: ModelConfig, say) -> tuple[torch.Tensor, dict]:
    """The route table the engine reads and the distinct-expert statistics of every option."""
    t = cfg.target
    n_moe, e, k = t.num_hidden_layers - 1, t.num_experts, t.num_experts_per_tok
    tr = record_mini_traces()
    say(f"mini traces: {len(tr.request_ids)} held-out requests, {tr.ids[0].shape[0]} positions")
    tables = {m: trace_table(tr, n_moe, KERNEL_WIDTH, e, k, spec.seed, m) for m in MODES}
    uni = uniform_table(tables[spec.mapping].steps, n_moe, KERNEL_WIDTH, e, k, spec.seed)
    stats = {"mini_requests": list(tr.request_ids), "steps": tables[spec.mapping].steps,
             "mapping": spec.mapping, "distinct": {}}
    for name, tab in [*((f"traces/{m}", tables[m]) for m in MODES), ("uniform", uni)]:
        stats["distinct"][name] = {str(w): float(distinct_per_layer(tab.ids, w, e).mean())
                                   for w in (1, 4, 6, 8)}
    stats["distinct"]["uniform_expected"] = {str(w): uniform_distinct(w, e, k)
                                             for w in (1, 4, 6, 8)}
    mini = torch.stack(tr.ids)  # [Lm, T, km]
    stats["distinct"]["mini_raw"] = {}
    for w in (4, 6, 8):
        n = mini.shape[1] // w * w
        steps = mini[:, :n].reshape(mini.shape[0], -1, w, mini.shape[2]).permute(1, 0, 2, 3)
        stats["distinct"]["mini_raw"][str(w)] = float(
            distinct_per_layer(steps.contiguous(), w, tr.experts).mean())
    for name, d in stats["distinct"].items():
        say(f"distinct experts per layer [{name}]: " + ", ".join(f"{w} rows {v:.1f}"
                                                                  for w, v in d.items()))
    table = tables[spec.mapping] if spec.routing == "traces" else uni
    return table.ids, stats


def round_shape(eng: RankEngine, context: int, peers: int) -> RoundShape:
    """Rows, depth, catch-up rows and distinct experts of the rounds the last _loop timed."""
    recs = eng.session.result.rounds[eng.hook_rounds :][: eng.timing.rounds]
    if not recs:
        raise RuntimeError("no timed rounds to take the round shape from")
    table = eng.ops.table.view(eng.ops.table.shape[0], -1, KERNEL_WIDTH,
                               eng.cfg.target.num_experts_per_tok).cpu()
    s0 = eng.step_span[0]
    rows = [len(r.drafts) + 1 for r in recs]
    distinct = []
    for i, n in enumerate(rows):
        ids = table[(s0 + i) % table.shape[0]][None]  # [1, L, R, K]
        distinct.append(float(distinct_per_layer(ids, n, eng.cfg.target.num_experts).mean()))
    # recompute: the next depth 0 rewrites the accepted rows and the new token
    if eng.cfg.draft.draft_kv_settle == "recompute":
        c0 = [1.0] + [float(r.accepted + 1) if r.drafts else 1.0 for r in recs[:-1]]
    else:
        c0 = [1.0] + [2.0 if r.accepted == len(r.drafts) and r.drafts else 1.0
                      for r in recs[:-1]]
    return RoundShape(rows=statistics.mean(rows), depth=statistics.mean(n - 1 for n in rows),
                      context=context, distinct=statistics.mean(distinct),
                      draft_rows0=statistics.mean(c0), peers=peers)


def run_config(eng: RankEngine, spec: SweepSpec, context: int, profile: bool, bw: float) -> dict:
    cfg = eng.cfg
    out: dict = {"reps": []}
    for rep in range(spec.reps):
        req = eng.request(context, spec.rounds, seed=spec.seed + rep)
        if profile and rep == 0:
            box = {}

            def hook(e, st, box=box):
                box["bd"] = profile_round(lambda: e.eager_round(st))
                return 1

            eng.profile_hook = hook
        eng.generate(req)
        tm = eng.timing
        shape = round_shape(eng, context, eng.ops.peers)
        out["reps"].append({"loop_s": tm.loop_s, "rounds": tm.rounds,
                            "round_gaps_s": tm.round_gaps_s, "per_round_s": tm.per_round_s,
                            "shape": dataclasses.asdict(shape)})
        if profile and rep == 0:
            bd = box["bd"]
            out["breakdown"] = {"launches": bd.launches, "kernel_s": bd.kernel_s,
                                "by_family": bd.by_family,
                                "top_kernels": dict(list(bd.by_kernel.items())[:25])}
    reps = out["reps"]
    out["round_s"] = statistics.median(r["per_round_s"] for r in reps)
    out["loop_round_s"] = statistics.median(r["loop_s"] / max(r["rounds"], 1) for r in reps)
    shape = RoundShape(**reps[0]["shape"])
    terms = floor_terms(cfg, shape)
    out["floor_terms"] = terms
    out["floor_bytes"] = sum(terms.values())
    out["floor_s"] = out["floor_bytes"] / bw
    out["ratio"] = out["round_s"] / out["floor_s"]
    out["shape"] = reps[0]["shape"]
    return out


@dataclass(frozen=True)
class Rig:
    """Where the sweep runs. The benchmark: one TP8 rank on CUDA with the Triton kernels and the
    bandwidth measured; CPU tests: a small rank on the twins with a given bandwidth."""

    cfg: ModelConfig
    device: str = "cuda"
    ops: str = "kernels"
    bandwidth: float | None = None  # None: measure (CUDA only)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"


def control_pdl(spec: SweepSpec, available: bool) -> bool:
    """The control's RuntimeConfig.pdl: --pdl on; auto where PDL can run (`available`) on one
    process (as the runtime: the peer ring's reads have not run under PDL on GPUs yet)."""
    return spec.pdl == "on" or (spec.pdl == "auto" and available and spec.tp == 1)


def variants(spec: SweepSpec, available: bool) -> list[tuple[str, bool, LaunchOverrides]]:
    """(row-name suffix, RuntimeConfig.pdl, launch overrides) of each variant every configuration
    runs in: the control first ("": --pdl off/on/auto, the pinned launches), then "+pdl" (--pdl
    ab) and "+<overrides>" per --launch (PDL as the control's). available: whether PDL can run
    on the rig (iquestrt.config.pdl_available)."""
    pdl = control_pdl(spec, available)
    out = [("", pdl, LaunchOverrides())]
    if spec.pdl == "ab":
        out.append(("+pdl", True, LaunchOverrides()))
    for text in spec.launch:
        o = LaunchOverrides.parse(text)
        out.append(("+" + o.label(), pdl, o))
    return out


def run_order(names: list[str], group: int, index: int) -> list[str]:
    """Names in groups of `group` adjacent variants (A, B); odd `index` runs each group in
    reverse (B, A), so neither variant always runs first."""
    if index % 2 == 0 or group == 1:
        return names
    return [n for i in range(0, len(names), group) for n in reversed(names[i:i + group])]


def make_engine(rig: Rig, weights, table, policy, graphs: bool, spec: SweepSpec,
                cap: int, pdl: bool = False, tp: TPBench | None = None,
                launches: LaunchOverrides | None = None) -> RankEngine:
    rc = RuntimeConfig(ops=rig.ops, device=rig.device, max_width=KERNEL_WIDTH, ring_pad=64,
                       max_positions=cap, policy=policy, graphs=graphs, sync_rounds=16,
                       loop=spec.loop if graphs else "host", prefetch=False, pdl=pdl)
    if tp is None:
        return RankEngine(weights, rc, table, seed=spec.seed, reduce=spec.reduce,
                          launches=launches)
    return RankEngine(weights, rc, table, seed=spec.seed, reduce="ring", rings=tp.rings,
                      group=tp.group, launches=launches)


def run_baseline(spec: SweepSpec, cfg: ModelConfig, table, context: int, say,
                 device: str = "cuda") -> dict:
    """BF16 torch rounds on a layer_pattern(1) subset at `context`, scaled to 88 layers."""
    depth = spec.headline_width - 1
    sub = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target,
                                                              layer_types=layer_pattern(1)))
    variants = {"all": ("eager-loop", "eager-gather", "compile-gather"),
                "eager": ("eager-loop",), "compile": ("compile-gather",), "none": ()}
    out = {"context": context, "depth": depth, "subset_layers": list(sub.target.layer_types),
           "scaled_to": cfg.target.num_hidden_layers, "variants": {}}
    if not variants[spec.baseline]:
        return out
    params = baseline_params(sub, device, spec.seed)
    for name in variants[spec.baseline]:
        say(f"baseline {name}: building (context {context}, depth {depth})")
        try:
            warmup = 2
            b = BaselineRound(sub, cfg.target.layer_types, device, spec.seed, context, depth,
                              table, name.split("-")[1], name.startswith("compile"),
                              margin=(spec.baseline_rounds + warmup + 1) * (depth + 1),
                              params=params)
            t0 = time.perf_counter()
            times = b.time(spec.baseline_rounds, warmup=warmup)
            res = {"round_s": times.round_s, "layer_s": times.layer_s, "kinds": times.kinds,
                   "scaled_round_s": times.scaled_round_s(),
                   "wall_s": time.perf_counter() - t0}
            say(f"baseline {name}: subset round {statistics.median(times.round_s) * 1e3:.2f} ms, "
                f"scaled to 88 layers {res['scaled_round_s'] * 1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001 — "where it compiles": record why not
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            say(f"baseline {name}: FAILED ({res['error'][:200]})")
        out["variants"][name] = res
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return out


def run_sweep(spec: SweepSpec, out_dir: Path, command: str, rig: Rig | None = None,
              group: TPGroup | None = None) -> dict:
    """group (`--tp N`): this rank's TP group; every rank runs the same sweep in step, rank 0
    alone prints, runs the baseline and writes the record. The output folder is checked first
    (iquestrt/outputs.py: only an earlier record is replaced) and again when it is written."""
    outputs.check(Path(out_dir), OUTPUT, force=True)
    say = Progress(quiet=group is not None and group.rank != 0)
    rig = rig or Rig(rank_config())
    cfg, dev = rig.cfg, torch.device(rig.device)
    where = torch.cuda.get_device_name() if rig.cuda else rig.device
    say(f"{where}, torch {torch.__version__}, ops {rig.ops}; rank config {cfg.name}: "
        f"{cfg.target.num_hidden_layers} layers, {cfg.target.num_experts} experts × "
        f"{cfg.target.moe_intermediate_size}, vocab shard {cfg.target.vocab_size}")
    table, trace_stats = routing(spec, cfg, say)
    bw = rig.bandwidth or copy_bandwidth(dev)
    say(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write, 2 GiB device copy)")
    contexts = spec.context_tokens()
    cap = max(contexts) + spec.rounds + 2 * KERNEL_WIDTH + 64
    weights = random_weights(cfg, dev, spec.seed, cap)
    if rig.cuda:
        torch.cuda.synchronize()
        say(f"weights: {weight_bytes(weights) / 1e9:.2f} GB on the device, "
            f"peak allocated {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    tp = None
    if group is not None:
        tp = tp_bench(group, weights, KERNEL_WIDTH, RuntimeConfig.peer_max_polls)
        say(f"TP ring: {group.world} ranks ({group.backend}) + {tp.emulated} emulated of TP{TP}; "
            f"slots O {tp.rings.o.policy.buffers}, MoE {tp.rings.moe.policy.buffers}")
    depths = [(f"W{w}", FixedDepth(w - 1)) for w in spec.widths]
    if spec.adaptive:
        depths.append(("adaptive", default_adaptive()))
    available = pdl_available(rig.ops, rig.device)
    pdl_on = control_pdl(spec, available)
    group_vars = variants(spec, available)
    policies = [(name + suffix, pol, pdl, o) for name, pol in depths
                for suffix, pdl, o in group_vars]  # a configuration's variants adjacent
    engines = {name: make_engine(rig, weights, table, pol, rig.cuda, spec, cap, pdl, tp, o)
               for name, pol, pdl, o in policies}
    results = []
    total, done = len(contexts) * len(policies), 0
    names = {v: k for k, v in CONTEXTS.items()}
    head = f"W{spec.headline_width}"
    for ci, ctx in enumerate(contexts):
        for name in run_order([p[0] for p in policies], len(group_vars), ci):
            done += 1
            key = rig.cuda and (spec.profile == "all"
                                or (spec.profile == "key" and (ci == 0 or name == head)))
            row = {"context": ctx, "context_name": names[ctx], "policy": name}
            try:
                row.update(run_config(engines[name], spec, ctx, key, bw))
                say(f"[{done}/{total}] {names[ctx]:>4} {name:>8}: round {row['round_s'] * 1e3:.3f}"
                    f" ms, floor {row['floor_s'] * 1e3:.3f} ms (×{row['ratio']:.2f}), loop "
                    f"{row['loop_round_s'] * 1e3:.3f} ms/round, {row['reps'][0]['rounds']} "
                    f"rounds, {row['shape']['distinct']:.1f} distinct experts/layer, rows "
                    f"{row['shape']['rows']:.2f}"
                    + (f", {row['breakdown']['launches']} launches" if "breakdown" in row else ""))
            except Exception as e:  # noqa: BLE001 — one failing configuration must not end it
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
                say(f"[{done}/{total}] {names[ctx]} {name}: FAILED ({row['error'][:200]})")
            results.append(row)
    eager = None
    if spec.eager and rig.cuda:
        say(f"eager launches (no graph) at {names[contexts[0]]} {head}")
        try:
            eng = make_engine(rig, weights, table, FixedDepth(spec.headline_width - 1), False,
                              spec, cap, pdl=pdl_on, tp=tp)
            eager = run_config(eng, dataclasses.replace(spec, rounds=min(spec.rounds, 12)),
                               contexts[0], False, bw)
            say(f"eager: {eager['round_s'] * 1e3:.2f} ms/round")
            del eng
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            eager = {"error": f"{type(e).__name__}: {e}"}
    peak = torch.cuda.max_memory_allocated() if rig.cuda else 0
    for eng in engines.values():
        eng.close()
    del engines, weights
    gc.collect()
    if rig.cuda:
        torch.cuda.empty_cache()
    tp_rec = tp.record(results) if tp is not None else None  # collective
    lead = group is None or group.rank == 0
    baseline = run_baseline(spec, cfg, table, contexts[0], say) if rig.cuda and lead else None
    record = {"spec": dataclasses.asdict(spec), "command": command, "bandwidth": bw,
              "rig": {"config": cfg.name, "device": rig.device, "ops": rig.ops, "pdl": pdl_on},
              "routing": trace_stats, "configs": results, "eager": eager, "baseline": baseline,
              "peak_allocated_bytes": peak,
              "peak_allocated_bytes_with_baseline":
                  torch.cuda.max_memory_allocated() if rig.cuda else 0,
              "wall_s": time.perf_counter() - say.t0, "tp": tp_rec}
    if lead:
        path = write_record(record, out_dir)
        say(f"wrote {path}")
    return record
