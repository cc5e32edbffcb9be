"""Tensor-parallel sharded sampling equals unsharded sampling end to end, through the engine.

iquestrt/tp/sampling.py samples without a token broadcast: each rank takes the top-K order keys
(z desc, id asc) of its contiguous vocabulary slice, the keys are all-gathered, and every rank
runs the same final selection and draw. Running that needs a process group; this gate drives the
TP code's own functions on N virtual ranks in one process instead (qualification/virtual_tp.py:
the thinnest adapter — per rank ShardedSampler.check, the steps' local_keys and from_keys; only
the all-gather is replaced by stacking the ranks' keys in rank order).

The trained mini model decodes one request with the engine's sampler replaced by that adapter at
N = 2, 4 and 8 virtual ranks (every sample call: the draft's and the target's rows), and once
with the plain sampler; the sharded decodes must equal the plain one bit for bit — tokens, stop
reason, every round record, caches — and, call by call, each rank's SampleOut must equal the
unsharded sampler's on the same logits (tokens, served ids and probabilities of the live rows).

Two cases:
  shipped  the model as trained, its sampling defaults (top-k 20, top-p 0.95): the served
           candidates of almost every row come from several shards (counted);
  tied     lm_head rows V/2 … V−1 replaced by copies of rows 0 … V/2−1 (target: the E4M3 rows
           with their 128-row block scales; the draft's bf16 head likewise), so every logit
           equals the logit V/2 ids away — in another shard for N = 2, 4, 8. With an odd top-k
           (19) and top-p 1 every row's top-K cut falls between two equal z of different shards:
           which twin is served is decided by the id tie-break alone (the lower id, i.e. the
           lower shard), and every such row straddles a shard boundary.
The gate fails when a case does not exercise what it is for (no straddling row; in the tied
case, no row with a tie at the cut).

Ops: twins on the CPU (TwinShardSteps); kernels on a GPU (KernelShardSteps, eager launches: the
adapter reads live-row counts on the host).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qualification import device_engine, mini_engine
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest


@dataclass(frozen=True)
class TPSamplingGateConfig:
    worlds: tuple[int, ...] = (2, 4, 8)
    prompt_tokens: int = 20
    new_tokens: int = 20
    depth: int = 3
    seed: int = 7
    kind: str = "docstring"
    tied_sampling: SamplingDefaults = SamplingDefaults(1.0, 19, 1.0)  # odd K: a tie at the cut


def twinned(w):
    """Weights w with the second half of both lm_heads a copy of the first half."""
    from iquestrt.weights import Fp8Linear

    h = w.cfg.target.vocab_size // 2
    lm = w.lm_head
    if isinstance(lm, Fp8Linear):
        rows = lm.w.shape[0] // lm.s.shape[0]  # 128: rows per scale block
        if h % rows:
            raise ValueError(f"tied case: V/2 = {h} is not a multiple of the {rows}-row scale "
                             "blocks of the E4M3 lm_head")
        wt, s = lm.w.clone(), lm.s.clone()  # [V, H] E4M3, [V/128, H/128] FP32
        wt[h:], s[h // rows:] = wt[:h], s[: h // rows]
        lm = Fp8Linear(wt, s)
    else:
        lm = lm.clone()
        lm[h:] = lm[:h]
    d = w.draft.lm_head.clone()  # [V, H] bf16
    d[h:] = d[:h]
    return dataclasses.replace(w, lm_head=lm, draft=dataclasses.replace(w.draft, lm_head=d))


def _sharded(w, policy, world: int):
    from qualification.virtual_tp import VirtualShardOps

    eng = device_engine.engine(w, policy)
    eng.ops = VirtualShardOps(eng.ops, eng.rcfg.ops, world, w.cfg.target.vocab_size,
                              w.device)
    return eng


def check_case(name: str, w, req: GenerationRequest, g: TPSamplingGateConfig,
               need_ties: bool) -> tuple[list[str], str]:
    """(problems, summary) of one case at every world size."""
    policy = FixedDepth(g.depth)
    want = device_engine.outcome(device_engine.engine(w, policy), req)
    ev, stats = [], []
    for n in g.worlds:
        eng = _sharded(w, policy, n)
        got = device_engine.outcome(eng, req)
        log = eng.ops.log
        bad = device_engine.differences(got, want, " from the unsharded decode's")
        if log.mismatch:
            bad.insert(0, f"first differing sample {log.mismatch}")
        if not log.straddling:
            bad.append("no sampled row had served candidates from two shards")
        if need_ties and not log.cut_ties:
            bad.append("no sampled row had a cross-shard tie at the top-K cut")
        if bad:
            ev.append(f"{name}, N={n}: " + "; ".join(bad))
        stats.append(f"N={n} {log.straddling}/{log.rows} rows straddle, {log.cut_ties} cut ties")
    s = req.sampling
    return ev, (f"{name} (top-k {s.top_k}, top-p {s.top_p}; {len(want.tokens)} tokens, "
                f"{len(want.records)} rounds, {log.calls} sample calls): " + ", ".join(stats))


def run(g: TPSamplingGateConfig | None = None) -> tuple[bool, str, list[str]]:
    g = g or TPSamplingGateConfig()
    w = device_engine.weights(mini_engine.load_mini())
    (prompt,) = mini_engine.prompts(g.prompt_tokens, kinds=(g.kind,))
    cases = (("shipped", w, mini_engine.SAMPLING, False),
             ("tied", twinned(w), g.tied_sampling, True))
    ev, summaries = [], []
    for name, weights, sampling, ties in cases:
        req = GenerationRequest(prompt.ids, g.new_tokens, sampling, g.seed)
        bad, summary = check_case(name, weights, req, g, ties)
        ev += bad
        summaries.append(summary)
    ok = not ev
    ev.append(f"{device_engine.backend()[0]}, {prompt.id}, depth {g.depth}: "
              + "; ".join(summaries) + ("; sharded == unsharded at every N (tokens, records, "
                                        "caches, every sample call)" if ok else ""))
    return ok, "exact" if ok else "differs", ev
