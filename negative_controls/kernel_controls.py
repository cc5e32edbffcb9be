"""Kernel-level negative controls: one-line mutations inside the production Triton kernels of
kernels/ (never in the twins or the reference), each caught by gate 1b (the lockstep,
qualification/lockstep.py) with a margin: the row it breaks measures ≥ MARGIN × its band, or an
exact row mismatches.

Mechanism: a copy of kernels/ in a temporary folder with the one line replaced (the line must
occur exactly once in its file), and the gate run in a fresh Python process whose import path
puts that copy first — so every user of the kernel, the engine and the twins' output types
included, gets the mutant, and nothing is left patched in this process. The baseline runs the
same way on the unmutated copy. Under the interpreter a run takes about a minute (the gate's
CPU configuration); on a GPU the kernels compile.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from negative_controls.control import Control

REPO = Path(__file__).resolve().parents[1]
MARGIN = 3.0  # what the gate measured must be ≥ 3 × its row's band (or an exact mismatch)
TIMEOUT_S = 900

GATE = """
import json, os, sys, torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)
import kernels
from qualification import lockstep
v = lockstep.verdict()
print(json.dumps({"ok": v.ok, "margin": v.margin, "worst": v.worst_used,
                  "evidence": v.evidence, "kernels": kernels.__file__}))
"""


@dataclass(frozen=True)
class KernelMutation:
    name: str
    file: str  # under kernels/
    old: str  # one whole line, exactly once in the file
    new: str
    mutation: str  # what is broken, in one sentence


def _run_gate(mutation: KernelMutation | None) -> dict:
    """The lockstep gate in a fresh process on a copy of kernels/ (mutated when given)."""
    with tempfile.TemporaryDirectory(prefix="kernel-control-") as tmp:
        dst = Path(tmp) / "kernels"
        shutil.copytree(REPO / "kernels", dst, ignore=shutil.ignore_patterns("__pycache__"))
        if mutation is not None:
            path = dst / mutation.file
            text = path.read_text()
            if text.count(mutation.old + "\n") != 1:
                raise ValueError(f"{mutation.name}: the line {mutation.old.strip()!r} occurs "
                                 f"{text.count(mutation.old + chr(10))} times in "
                                 f"kernels/{mutation.file} (exactly once wanted)")
            path.write_text(text.replace(mutation.old + "\n", mutation.new + "\n"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(REPO)])}
        res = subprocess.run([sys.executable, "-c", GATE], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"gate process exited {res.returncode}: {res.stderr[-1500:]}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        if not out["kernels"].startswith(tmp):
            raise RuntimeError(f"the gate imported {out['kernels']}, not the copy in {tmp}")
        return out


class _Runs:
    """Gate processes started ahead (`prepare`): {mutation name or None: Future of its output}.
    The runs are independent processes, so several share a GPU (the twins' replay is CPU work,
    the host has the cores); a run not prepared starts when it is asked for."""

    def __init__(self):
        self.futures: dict[str | None, Future] = {}
        self.pool: ThreadPoolExecutor | None = None

    def prepare(self, names: list[str], jobs: int) -> None:
        by_name = {m.name: m for m in MUTATIONS}
        todo = [None, *(n for n in names if n in by_name)]
        if jobs <= 1 or len(todo) <= 2:
            return
        self.pool = ThreadPoolExecutor(max_workers=jobs)
        for n in todo:
            if n not in self.futures:
                self.futures[n] = self.pool.submit(_run_gate, by_name.get(n))

    def get(self, m: KernelMutation | None) -> dict:
        key = None if m is None else m.name
        if key not in self.futures:
            return _run_gate(m)
        return self.futures[key].result()


@lru_cache(maxsize=1)
def _runs() -> _Runs:
    return _Runs()


def prepare(names: list[str], jobs: int) -> None:
    """Start the baseline and the named kernel controls' gate runs, `jobs` at a time."""
    _runs().prepare(names, jobs)


@lru_cache(maxsize=1)
def _baseline() -> tuple[bool, tuple[str, ...]]:
    out = _runs().get(None)
    return out["ok"], tuple(out["evidence"])


def _control(m: KernelMutation) -> Control:
    def run(mutated: bool) -> tuple[bool, list[str]]:
        if not mutated:
            ok, ev = _baseline()
            return ok, list(ev)
        out = _runs().get(m)
        worst = out["worst"]
        strong = worst is None or worst >= MARGIN  # None: an exact row mismatched (inf)
        if out["ok"]:
            return True, [f"gate passed the mutant: {out['margin']}"]
        share = ("mismatch (an exact row, or non-finite values)" if worst is None
                 else f"{worst:.1f}× its band")
        if not strong:
            return True, [f"FAILED the gate but below the {MARGIN:g}× margin: {share}; "
                          f"{out['margin']}"]
        return False, [f"FAILS: {share} ({out['margin']})"]

    return Control(m.name, "1b lockstep kernels vs twins", m.mutation, run)


MUTATIONS = (
    KernelMutation(
        "kq_quantizer_divides_by_240", "fp8.py",
        "    scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),"
        " 1.0)",
        "    scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 240.0, tl.float32)),"
        " 1.0)",
        "the activation quantizer's scale is amax / 240 instead of amax / 448"),
    KernelMutation(
        "kq_moe_gate_scale_from_next_k_block", "moe.py",
        "        sg = tl.load(s_e + (c // 128) * stride_sn + (k0 // 128) * stride_sk, mask=cm"
        " & bm,",
        "        sg = tl.load(s_e + (c // 128) * stride_sn + (k0 // 128 + 1) * stride_sk, mask=cm"
        " & bm,",
        "MoE gate/up: the gate weights' scale read from the next 128-column block"),
    KernelMutation(
        "kq_attention_causal_boundary_off_by_one", "attention/__init__.py",
        "    ok = (p[None, :] >= lo[:, None]) & (p[None, :] <= pos[:, None]) & live[:, None]",
        "    ok = (p[None, :] >= lo[:, None]) & (p[None, :] < pos[:, None]) & live[:, None]",
        "split-KV attention: a row does not see its own key (causal boundary < instead of <=)"),
    KernelMutation(
        "kq_combine_sink_of_next_kv_group", "attention/combine.py",
        "        sk = tl.load(sink_ptr + (h // G)[:, None] * s_sk + d[None, :], mask=hmask[:,"
        " None],",
        "        sk = tl.load(sink_ptr + ((h // G) ^ 1)[:, None] * s_sk + d[None, :],"
        " mask=hmask[:, None],",
        "split-KV combine: query head h takes the sink key of the other KV group (h // G xor 1)"),
    KernelMutation(
        "kq_kv_write_ring_slot_shifted", "kv_cache.py",
        "        slot = pos % C",
        "        slot = (pos + 1) % C",
        "KV write: a ring position lands one slot further on"),
    KernelMutation(
        "kq_combine_rescale_dropped", "attention/combine.py",
        "        w = tl.exp2((lse - mx[None, :]) * LOG2E)",
        "        w = tl.exp2((lse - lse) * LOG2E)",
        "split-KV combine: the splits are averaged without the exp(lse − M) rescale"),
    KernelMutation(
        "kq_attn_tail_norm_weight_swapped", "tails.py",
        "    an = _bf16(_rms(a, w_aon, eps, HIDDEN))",
        "    an = _bf16(_rms(a, w_ffn, eps, HIDDEN))",
        "attention tail: the attention output normalized with feed_forward_norm's weight instead "
        "of attn_out_norm's (attn_out_scale itself is 1.0 on the mini model: dropping it is an "
        "equivalent mutant there)"),
    KernelMutation(
        "kq_tail_norm_eps_doubled", "tails.py",
        "    return tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(ms + eps))",
        "    return tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(ms + 1e-2))",
        "residual/norm tails: RMSNorm with eps 1e-2 instead of the model's"),
    KernelMutation(
        "kq_moe_tail_scale_dropped", "tails.py",
        "    x = _bf16(h + f * scale)",
        "    x = _bf16(h + f)",
        "MoE tail: the experts' output added without ffn_out_scale"),
    KernelMutation(
        "kq_verify_replacement_from_p", "verify.py",
        "    dist = tl.where(bonus, p, resid)",
        "    dist = p",
        "verify: after a rejection the replacement is drawn from p instead of the residual "
        "max(p − q, 0)"),
    KernelMutation(
        "kq_sampler_top_p_cut_drops_crossing_token", "sampler/device.py",
        "    keep = valid & ((rp <= first) | ~cut)  # a cut keeps the token that crosses top_p",
        "    keep = valid & ((rp < first) | ~cut)  # a cut keeps the token that crosses top_p",
        "sampler: the top-p cut drops the token that crosses top_p"),
    KernelMutation(
        "kq_rope_rotation_sign_flipped", "qk_rope.py",
        "        signed = tl.where(d < half, -xp, xp)  # first half: x1·cos − x2·sin",
        "        signed = tl.where(d < half, xp, -xp)  # first half: x1·cos − x2·sin",
        "qk-norm/RoPE: the rotation's sine terms take the wrong sign (a rotation by −θ)"),
    KernelMutation(
        "kq_router_weights_not_renormalized", "router.py",
        "    w = tl.div_rn(top_p, tl.broadcast_to(wsum[:, None], top_p.shape))",
        "    w = top_p",
        "router: the top-k probabilities are not renormalized to sum to 1"),
    KernelMutation(
        "kq_router_chosen_expert_not_masked", "router.py",
        "        p = tl.where(ea[None, :] == idx[:, None], -2.0, p)",
        "        p = tl.where(ea[None, :] == idx[:, None], p, p)",
        "router: a chosen expert is not masked out, so every top-k slot takes the best one"),
    KernelMutation(
        "kq_eh_proj_norm_factors_swapped", "eh_proj.py",
        "        inv = tl.where(in_e[:, None], inv_e[None, :], inv_h[None, :])",
        "        inv = tl.where(in_e[:, None], inv_h[None, :], inv_e[None, :])",
        "fused draft entry + eh_proj: the embedding and hidden halves take each other's rms "
        "factors"),
)

CONTROLS = tuple(_control(m) for m in MUTATIONS)
