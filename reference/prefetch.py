"""Expert prefetch predictor: routing traces → one matrix P [H, E] per sliding layer → the experts
a verification step of 4–5 rows will probably route to, known before the layer's attention runs.

Prediction (reference/twins/prefetch.py, the twin of kernels/prefetch.py):
  part[j, r, e] = Σ_{h in chunk j, ascending} x[r, h] · P[h, e]   (FP32, each product and each
                  add rounded; chunks of SCORE_CHUNK hidden columns)
  score[r, e]   = ((0 + part[0]) + part[1]) + …                   (chunks in order)
  agg[e]        = ((0 + score[0]) + score[1]) + …                 (live rows in order)
  ids           = the m experts of largest agg (NaN counts as −inf; ties: lower index first).
Summing scores over rows ranks experts by the expected number of rows routed to them (the fit
targets the selection indicator), i.e. by expected coverage.

Fit (deterministic): the incoming hidden state xn of each sliding layer (its attention input)
and the experts the layer's router then picks are traced from ReferenceModel (hooks on the
instance, the model file is untouched) over the token prompts given; per layer a ridge least
squares of the top-k indicator on xn in float64, rounded to BF16 for storage (the runtime's
dtype; BF16 · BF16 products are exact in FP32). Coverage = the share of the routed (row, expert)
pairs of a step whose expert was predicted, over steps of consecutive prompt rows of held-out
prompts. Prompt rows are teacher-forced text, not draft tokens: real verification rows are a
slightly different distribution. Choosing the prompts from data/requests (held-out by source
file), tokenizing them and the CLI: training/prefetch_fit.py.

Files (the checkpoint's prefetch/ folder): prefetch.safetensors (`layers.{i}.predictor` [H, E]
BF16) and prefetch.json (format, shapes, defaults m / rows, fit settings, prompt ids, coverage).

Dimension letters: T traced rows, S steps, W rows per step, R rows, H hidden, E experts,
K top-k, M predicted experts, J score chunks.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from reference import ops
from reference.config import ModelConfig
from reference.twins.prefetch import aggregate_ref, scores_ref, select_ref

FORMAT = "iquestrt-prefetch-v1"
TENSORS, META = "prefetch.safetensors", "prefetch.json"


class PrefetchError(ValueError):
    """A predictor file or fit setting is unusable; the message names the file or field."""


# --- traces --------------------------------------------------------------------------------


@dataclass
class Trace:
    xn: list[torch.Tensor]  # per prompt [T, H]: the layer's attention input
    ids: list[torch.Tensor]  # per prompt [T, K] int64: the experts its router picked


class _Stop(Exception):
    """Raised after the last traced layer's routing: later layers and lm_head are not needed."""


@contextmanager
def recording(model, layers: tuple[int, ...]):
    """While active, model.target(...) fills {layer: Trace} and stops after layers[-1]'s router.
    The router input is recomputed exactly as ReferenceModel._moe chooses it (folded or not)."""
    traces = {i: Trace([], []) for i in layers}
    real_attn, real_moe = model._attn, model._moe

    def attn(pre, xn, positions, cache, layer, window, theta):
        if pre.startswith("model.layers.") and layer in traces:
            traces[layer].xn.append(xn.detach().clone())
        return real_attn(pre, xn, positions, cache, layer, window, theta)

    def moe(pre, x, top_k, router_in=None):
        layer = int(pre.split(".")[2]) if pre.startswith("model.layers.") else -1
        if layer in traces:
            src = x if router_in is None else router_in
            traces[layer].ids.append(ops.route(src, model.p[pre + "mlp.router.weight"], top_k)[1])
            if layer == layers[-1]:
                raise _Stop
        return real_moe(pre, x, top_k, router_in)

    model._attn, model._moe = attn, moe
    try:
        yield traces
    finally:
        del model._attn, model._moe  # the class methods show through again


def collect_traces(model, prompts: list[torch.Tensor], layers: tuple[int, ...]):
    """prompts: token tensors [T] (positions 0 … T−1, no cache) → {layer: Trace}."""
    layers = tuple(sorted(layers))
    with recording(model, layers) as traces:
        for toks in prompts:
            try:
                model.target(toks, torch.arange(toks.shape[0]))
            except _Stop:
                pass
    return traces


# --- fit and coverage ----------------------------------------------------------------------


def fit_layer(xn: torch.Tensor, ids: torch.Tensor, experts: int, ridge: float) -> torch.Tensor:
    """xn [N, H], ids [N, K] → P [H, E] FP32: argmin ‖xn·P − Y‖² + λ‖P‖², Y the top-k indicator,
    λ = ridge · mean diagonal of xnᵀxn."""
    x = xn.double()
    y = torch.zeros(x.shape[0], experts, dtype=torch.float64)
    y.scatter_(1, ids.long(), 1.0)
    a = x.T @ x
    a = a + ridge * a.diagonal().mean() * torch.eye(a.shape[0], dtype=torch.float64)
    return torch.linalg.solve(a, x.T @ y).float()


def _steps(tr: Trace, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive rows of each prompt cut into steps of w (a short tail dropped) → xn [S, W, H],
    ids [S, W, K]."""
    xs, ids = [], []
    for x, i in zip(tr.xn, tr.ids, strict=True):
        s = x.shape[0] // w
        xs.append(x[: s * w].reshape(s, w, -1))
        ids.append(i[: s * w].reshape(s, w, -1))
    return torch.cat(xs), torch.cat(ids)


def step_coverage(pred: torch.Tensor, ids: torch.Tensor) -> dict:
    """pred [S, M], ids [S, W, K] → coverage, precision (predicted experts some row used) and the
    mean number of distinct routed experts per step."""
    hit = (ids[..., None] == pred[:, None, None, :]).any(-1)  # [S, W, K]
    used = (pred[:, :, None] == ids.flatten(1)[:, None, :]).any(-1)  # [S, M]
    distinct = [len(set(s.flatten().tolist())) for s in ids]
    return {"coverage": hit.double().mean().item(), "precision": used.double().mean().item(),
            "distinct": sum(distinct) / len(distinct), "steps": ids.shape[0]}


def coverage(p: torch.Tensor, tr: Trace, w: int, m: int) -> dict:
    """Coverage of the twin's predictions (prefetch_experts_ref per step, batched)."""
    xs, ids = _steps(tr, w)
    s, _, hidden = xs.shape
    scores = scores_ref(xs.reshape(s * w, hidden), p).reshape(s, w, -1)
    return step_coverage(select_ref(aggregate_ref(scores), m), ids)


@dataclass(frozen=True)
class FitSpec:
    fit_prompts: int = 24
    eval_prompts: int = 12
    max_tokens: int = 384  # prompts truncated to their first max_tokens tokens
    m: int = 0  # experts predicted per step; 0: 2 · top-k
    rows: tuple[int, ...] = (4, 5)  # live verification rows that prefetch
    ridge: float = 1e-3
    precision: str = "bf16-fold"  # the runtime's routing semantics (folded FP32 router input)

    def check(self, cfg: ModelConfig) -> int:
        e = cfg.target.num_experts
        m = self.m or min(e, 2 * cfg.target.num_experts_per_tok)
        for name, v, lo in (("fit_prompts", self.fit_prompts, 1), ("eval_prompts",
                            self.eval_prompts, 1), ("max_tokens", self.max_tokens, 2)):
            if v < lo:
                raise PrefetchError(f"FitSpec.{name}: expected >= {lo}, got {v}")
        if not 1 <= m <= e:
            raise PrefetchError(f"FitSpec.m: expected 1..num_experts={e}, got {m}")
        if not self.rows or min(self.rows) < 1 or list(self.rows) != sorted(set(self.rows)):
            raise PrefetchError(f"FitSpec.rows: expected increasing ints >= 1, got {self.rows}")
        if not self.ridge > 0:
            raise PrefetchError(f"FitSpec.ridge: expected > 0, got {self.ridge}")
        return m


def fit_predictors(model, fit: list[torch.Tensor], held_out: list[torch.Tensor], spec: FitSpec):
    """→ ({layer: P [H, E] BF16}, {layer: {rows: coverage dict}}) over the sliding layers."""
    cfg = model.cfg
    m, layers = spec.check(cfg), cfg.target.sliding_layers
    if not layers:
        raise PrefetchError(f"{cfg.name}: no sliding-window layers to predict for")
    tr_fit, tr_eval = collect_traces(model, fit, layers), collect_traces(model, held_out, layers)
    preds, report = {}, {}
    for i in layers:
        f = tr_fit[i]
        p = fit_layer(torch.cat(f.xn), torch.cat(f.ids), cfg.target.num_experts, spec.ridge)
        preds[i] = p.to(torch.bfloat16)
        router_t = model.p[f"model.layers.{i}.mlp.router.weight"].float().T.contiguous()
        freq = torch.bincount(torch.cat(f.ids).flatten(), minlength=cfg.target.num_experts)
        static = select_ref(freq.double(), m)
        report[i] = {}
        for w in spec.rows:
            r = coverage(preds[i], tr_eval[i], w, m)
            r["router_coverage"] = coverage(router_t, tr_eval[i], w, m)["coverage"]
            ids = _steps(tr_eval[i], w)[1]
            r["static_coverage"] = step_coverage(static.expand(ids.shape[0], m), ids)["coverage"]
            r["fit_coverage"] = coverage(preds[i], f, w, m)["coverage"]
            report[i][w] = r
    return preds, report


# --- files ---------------------------------------------------------------------------------


def save_predictors(directory, preds: dict[int, torch.Tensor], meta: dict) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.{i}.predictor": p.to(torch.bfloat16).contiguous()
               for i, p in sorted(preds.items())}
    save_file(tensors, str(d / TENSORS), metadata={"format": FORMAT})
    (d / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def load_predictors(directory, cfg: ModelConfig) -> tuple[dict[int, torch.Tensor], dict]:
    """→ ({sliding layer: P [H, E] BF16}, metadata), checked against cfg."""
    d = Path(directory)
    for f in (TENSORS, META):
        if not (d / f).is_file():
            raise PrefetchError(f"{d / f}: no such file (fit: python -m training.prefetch_fit fit)")
    try:
        meta = json.loads((d / META).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise PrefetchError(f"{d / META}: not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise PrefetchError(f"{d / META}: must hold a JSON object")
    if meta.get("format") != FORMAT:
        raise PrefetchError(f"{d / META}: format {meta.get('format')!r}, expected {FORMAT!r}")
    t = cfg.target
    want = {"hidden": t.hidden_size, "experts": t.num_experts, "layers": list(t.sliding_layers)}
    for k, v in want.items():
        if meta.get(k) != v:
            raise PrefetchError(f"{d / META}: {k} = {meta.get(k)!r}, the model has {v!r} (refit)")
    try:
        tensors = load_file(str(d / TENSORS))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise PrefetchError(f"{d / TENSORS}: unreadable safetensors file: {e}") from None
    preds = {}
    for i in t.sliding_layers:
        name = f"layers.{i}.predictor"
        p = tensors.get(name)
        if p is None or p.shape != (t.hidden_size, t.num_experts) or p.dtype != torch.bfloat16:
            got = None if p is None else (tuple(p.shape), str(p.dtype))
            raise PrefetchError(f"{d / TENSORS}: {name} is {got}, expected "
                                f"({t.hidden_size}, {t.num_experts}) bfloat16")
        preds[i] = p
    return preds, meta
