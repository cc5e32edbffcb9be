"""Draft-depth policies: after each draft depth, decide whether to run another.

A policy sees only the drafts generated so far in this round (their served probabilities and
entropies); it never discards a draft already generated — its only output is "one more depth or
stop". `FixedDepth` always runs N depths; `AdaptiveDepth` always runs `min_depth` (3), then after
each further depth scores the drafts so far against a cost threshold, up to `max_depth` (7).

Adaptive score after j drafts, from three fp32 features
  cum = q(y_1)·…·q(y_j)   (the draft's own estimate that all j drafts survive)
  q   = q(y_j),  h = entropy of the served distribution at depth j (nats):
  s_j = b_j + w1·cum + w2·q + w3·h + w4·(cum·q) + w5·(cum·h)     (a linear estimate of
        P(drafts 1 … j+1 all accepted) = the expected extra accepted tokens of depth j+1)
and another depth runs iff s_j ≥ threshold (= tokens per unit time × time of one more depth;
training/depth_fit.py fits both offline).

Bit-exact host vs device. `more()` (host, Python floats) and `more_batch()` (torch fp32, runs on
the device without a host sync) evaluate the same IEEE fp32 operations in the same order, each
rounded once: the host rounds every binary64 result to fp32, which is exact for products of two
fp32 values (48 ≤ 53 bits) and correctly rounded for sums (binary64 ≥ 2·24+2 bits makes double
rounding innocuous). A fused device port must keep that order and disable FMA contraction
(Triton: enable_fp_fusion=False). Clamps keep every value normal or zero — probabilities to
[2^-40, 1] (NaN reads as 2^-40), entropies below 2^-40 (or NaN) to 0 and above 64 to 64, weights
0 or of magnitude [2^-20, 2^20] — so flush-to-zero hardware decides the same.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

MIN_DEPTH, MAX_DEPTH = 3, 7  # the adaptive range: depths 1–3 always run, 8 verify rows at most
N_WEIGHTS = 6  # per decision depth: bias, cum, q, h, cum·q, cum·h
P_FLOOR = 2.0**-40
H_CEIL = 64.0
W_MIN, W_MAX = 2.0**-20, 2.0**20


@dataclass(frozen=True)
class DraftInfo:
    token: int
    prob: float  # q(token): the draft's served probability of its own sample
    entropy: float  # of the served distribution q at this depth, in nats


class DepthPolicy(Protocol):
    max_depth: int

    def more(self, drafts: list[DraftInfo]) -> bool:
        """After len(drafts) depths have run: launch another depth?"""
        ...


@dataclass(frozen=True)
class FixedDepth:
    """Always exactly `depth` drafts (0 = plain decoding, no speculation)."""

    depth: int

    def __post_init__(self) -> None:
        if not 0 <= self.depth <= 16:
            raise ValueError(f"draft depth must be in [0, 16], got {self.depth}")

    @property
    def max_depth(self) -> int:
        return self.depth

    def more(self, drafts: list[DraftInfo]) -> bool:
        return len(drafts) < self.depth


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (ties to even; overflow to ±inf)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _prob(x: float) -> float:
    x = x if x >= P_FLOOR else P_FLOOR  # NaN fails the comparison: reads as the floor
    return x if x <= 1.0 else 1.0


def _entropy(x: float) -> float:
    x = x if x >= P_FLOOR else 0.0
    return x if x <= H_CEIL else H_CEIL


def host_features(drafts: list[DraftInfo]) -> tuple[float, float, float]:
    """(cum, q, h) after len(drafts) ≥ 1 depths, as fp32 values in Python floats."""
    cum = 1.0
    for d in drafts:  # one rounded product per depth, in depth order (as the device does)
        cum = _prob(f32(cum * _prob(f32(d.prob))))
    last = drafts[-1]
    return cum, _prob(f32(last.prob)), _entropy(f32(last.entropy))


def init_features(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Features before depth 1: cum = 1 (q and h are overwritten by the first push). → [B, 3]"""
    f = torch.zeros(n, 3, dtype=torch.float32, device=device)
    f[:, 0] = 1.0
    return f


def push_features(feat: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Fold one more depth into the features. feat [B, 3] fp32, q/h [B] → [B, 3] fp32."""
    lo = torch.full((), P_FLOOR, dtype=torch.float32, device=feat.device)  # a fill: capturable
    q = q.to(torch.float32)
    q = torch.where(q >= lo, q, lo).clamp(max=1.0)
    cum = feat[:, 0] * q
    cum = torch.where(cum >= lo, cum, lo).clamp(max=1.0)
    h = h.to(torch.float32)
    h = torch.where(h >= lo, h, torch.zeros_like(h)).clamp(max=H_CEIL)
    return torch.stack([cum, q, h], dim=1)


def _check(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {msg}")


@dataclass(frozen=True)
class AdaptiveDepth:
    """weights[j − min_depth] = (bias, w_cum, w_q, w_h, w_cum·q, w_cum·h) decides after j drafts,
    for min_depth ≤ j < max_depth. Parameters are fp32 (rounded on construction)."""

    weights: tuple[tuple[float, ...], ...]
    threshold: float
    min_depth: int = MIN_DEPTH
    max_depth: int = MAX_DEPTH

    def __post_init__(self) -> None:
        w = "AdaptiveDepth"
        for name in ("min_depth", "max_depth"):
            v = getattr(self, name)
            _check(type(v) is int, w, f"{name} must be an int, got {v!r}")
        _check(
            MIN_DEPTH <= self.min_depth <= MAX_DEPTH,
            w,
            f"min_depth must be in [{MIN_DEPTH}, {MAX_DEPTH}], got {self.min_depth}",
        )
        _check(
            self.min_depth <= self.max_depth <= MAX_DEPTH,
            w,
            f"max_depth must be in [min_depth={self.min_depth}, {MAX_DEPTH}], got {self.max_depth}",
        )
        n = self.max_depth - self.min_depth
        _check(
            len(self.weights) == n,
            w,
            f"weights needs one row per decision depth {self.min_depth} … {self.max_depth - 1} "
            f"({n} rows), got {len(self.weights)}",
        )
        rows = []
        for i, row in enumerate(self.weights):
            j = self.min_depth + i
            _check(
                len(row) == N_WEIGHTS,
                w,
                f"weights[depth {j}] needs {N_WEIGHTS} values, got {len(row)}",
            )
            rows.append(
                tuple(_param(x, f"{w}: weights[depth {j}][{k}]") for k, x in enumerate(row))
            )
        object.__setattr__(self, "weights", tuple(rows))
        object.__setattr__(self, "threshold", _param(self.threshold, f"{w}: threshold"))

    def score(self, n: int, cum: float, q: float, h: float) -> float:
        """s_n in fp32 (host). n in [min_depth, max_depth)."""
        b, w1, w2, w3, w4, w5 = self.weights[n - self.min_depth]
        s = f32(b + f32(w1 * cum))
        s = f32(s + f32(w2 * q))
        s = f32(s + f32(w3 * h))
        s = f32(s + f32(w4 * f32(cum * q)))
        return f32(s + f32(w5 * f32(cum * h)))

    def more(self, drafts: list[DraftInfo]) -> bool:
        n = len(drafts)
        if n < self.min_depth:
            return True
        if n >= self.max_depth:
            return False
        return self.score(n, *host_features(drafts)) >= self.threshold

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Weights by depth run so far: row n used after n drafts (zeros outside the decision
        range). → [MAX_DEPTH + 1, 6] fp32; build once and keep on the device."""
        t = torch.zeros(MAX_DEPTH + 1, N_WEIGHTS, dtype=torch.float64)
        for i, row in enumerate(self.weights):
            t[self.min_depth + i] = torch.tensor(row, dtype=torch.float64)
        return t.to(device=device, dtype=torch.float32)  # exact: values are fp32 already

    def more_batch(
        self, n: torch.Tensor | int, feat: torch.Tensor, table: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Device form of `more`: n [B] int (drafts so far), feat [B, 3] fp32 from push_features,
        table from `table()` → [B] bool. With the table passed in (build it once) nothing here
        syncs with the host, so it can sit in a captured graph."""
        if feat.dtype != torch.float32 or feat.dim() != 2 or feat.shape[1] != 3:
            raise ValueError(
                f"more_batch: feat must be [B, 3] float32, got {tuple(feat.shape)} {feat.dtype}"
            )
        if isinstance(n, int):
            n = torch.full((feat.shape[0],), n, dtype=torch.int32, device=feat.device)
        t = self.table(feat.device) if table is None else table
        w = t[n.clamp(0, MAX_DEPTH).long()]  # [B, 6]
        cum, q, h = feat.unbind(1)
        s = w[:, 0] + w[:, 1] * cum
        s = s + w[:, 2] * q
        s = s + w[:, 3] * h
        s = s + w[:, 4] * (cum * q)
        s = s + w[:, 5] * (cum * h)
        go = s >= self.threshold
        return (n < self.min_depth) | ((n < self.max_depth) & go)


def _param(x: object, where: str) -> float:
    """A policy parameter: finite, 0 or magnitude in [2^-20, 2^20], rounded to fp32."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{where}: must be a number, got {x!r}")
    v = f32(float(x))
    if not math.isfinite(v) or not (v == 0.0 or W_MIN <= abs(v) <= W_MAX):
        raise ValueError(f"{where}: must be 0 or of magnitude in [2^-20, 2^20], got {x!r}")
    return v


def legal_param(x: float) -> float:
    """The nearest legal parameter (for fitters): tiny → 0, huge → ±2^20, rounded to fp32."""
    if not math.isfinite(x):
        raise ValueError(f"legal_param: {x!r} is not finite")
    if abs(x) < W_MIN:
        return 0.0
    return f32(math.copysign(min(abs(x), W_MAX), x))


# --- storage: <checkpoint>/depth_policy.json ------------------------------------------------

POLICY_FILE = "depth_policy.json"
FORMAT = "iquestrt.depth_policy"
DEFAULT_FIXED = 5  # without a depth_policy.json: IQuest-Q1's recommended MTP depth (8×H200, TP8)


def default_adaptive() -> AdaptiveDepth:
    """The unfitted prior for `policy_from_spec("adaptive")` when no depth_policy.json ships:
    a calibrated draft's guess s_j = cum·q_j of P(drafts 1 … j+1 accepted), against the
    threshold 1/8 ≈ 3.24 tokens per round (seed report) × a depth costing ~4% of a round (a
    guess from the round's memory floor: one lm_head shard + one layer + a sampler per depth).
    Not fitted to anything: fit a real one with training.depth_fit and save it with the
    checkpoint."""
    row = (0.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    return AdaptiveDepth((row,) * (MAX_DEPTH - MIN_DEPTH), 0.125)


def policy_to_json(policy: FixedDepth | AdaptiveDepth, fit: dict | None = None) -> dict:
    if isinstance(policy, FixedDepth):
        out = {"format": FORMAT, "version": 1, "kind": "fixed", "depth": policy.depth}
    elif isinstance(policy, AdaptiveDepth):
        out = {
            "format": FORMAT,
            "version": 1,
            "kind": "adaptive",
            "min_depth": policy.min_depth,
            "max_depth": policy.max_depth,
            "threshold": policy.threshold,
            "weights": {str(policy.min_depth + i): list(r) for i, r in enumerate(policy.weights)},
        }
    else:
        raise TypeError(f"policy_to_json: cannot store a {type(policy).__name__}")
    if fit is not None:
        out["fit"] = fit  # informational (how it was fitted, measured gains); not read back
    return out


def policy_from_json(d: object, where: str = "depth policy") -> FixedDepth | AdaptiveDepth:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"{where}: {msg}")

    def integer(key: str) -> int:
        v = d.get(key)
        need(type(v) is int, f"field {key!r} must be an integer, got {v!r}")
        return v

    need(isinstance(d, dict), f"top level must be a JSON object, got {type(d).__name__}")
    need(d.get("format") == FORMAT, f"field 'format' must be {FORMAT!r}, got {d.get('format')!r}")
    need(d.get("version") == 1, f"field 'version' must be 1, got {d.get('version')!r}")
    kind = d.get("kind")
    base = {"format", "version", "kind", "fit"}
    if kind == "fixed":
        allowed = base | {"depth"}
    elif kind == "adaptive":
        allowed = base | {"min_depth", "max_depth", "threshold", "weights"}
    else:
        raise ValueError(f"{where}: field 'kind' must be 'fixed' or 'adaptive', got {kind!r}")
    extra = sorted(set(d) - allowed)
    need(not extra, f"unknown fields {extra} for kind {kind!r}")
    need("fit" not in d or isinstance(d["fit"], dict), "field 'fit' must be an object")
    try:
        if kind == "fixed":
            depth = integer("depth")
            need(0 <= depth <= MAX_DEPTH, f"field 'depth' must be in [0, {MAX_DEPTH}], got {depth}")
            return FixedDepth(depth)
        lo, hi = integer("min_depth"), integer("max_depth")
        need(
            MIN_DEPTH <= lo <= hi <= MAX_DEPTH,
            f"fields 'min_depth' ≤ 'max_depth' must lie in "
            f"[{MIN_DEPTH}, {MAX_DEPTH}], got {lo}, {hi}",
        )
        w = d.get("weights")
        need(isinstance(w, dict), f"field 'weights' must be an object keyed by depth, got {w!r}")
        keys = [str(j) for j in range(lo, hi)]
        need(
            sorted(w) == sorted(keys),
            f"field 'weights' needs exactly the keys {keys}, got {sorted(w)}",
        )
        for k in keys:
            need(isinstance(w[k], list), f"field 'weights.{k}' must be a list, got {w[k]!r}")
        return AdaptiveDepth(tuple(tuple(w[k]) for k in keys), d.get("threshold"), lo, hi)
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: {e}") from None


def save_policy(
    checkpoint_dir: str | Path, policy: FixedDepth | AdaptiveDepth, fit: dict | None = None
) -> Path:
    path = Path(checkpoint_dir) / POLICY_FILE
    path.write_text(json.dumps(policy_to_json(policy, fit), indent=1) + "\n")
    return path


def load_policy(checkpoint_dir: str | Path) -> FixedDepth | AdaptiveDepth:
    """<checkpoint_dir>/depth_policy.json, else FixedDepth(DEFAULT_FIXED)."""
    from reference.checkpoint_validate import optional_file

    path = optional_file(checkpoint_dir, Path(checkpoint_dir) / POLICY_FILE)
    if path is None:
        return FixedDepth(DEFAULT_FIXED)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return policy_from_json(d, str(path))


def policy_from_spec(
    spec: str, checkpoint_dir: str | Path | None = None
) -> FixedDepth | AdaptiveDepth:
    """CLI form: "adaptive" (the checkpoint's fitted policy, else `default_adaptive()`) or a
    fixed depth "0" … "7"."""
    s = spec.strip().lower()
    if s == "adaptive":
        if checkpoint_dir is not None:
            p = load_policy(checkpoint_dir)
            if isinstance(p, AdaptiveDepth):
                return p
        return default_adaptive()
    if s in {str(j) for j in range(MAX_DEPTH + 1)}:
        return FixedDepth(int(s))
    raise ValueError(
        f"draft depth policy {spec!r}: expected 'adaptive' or a fixed depth 0 … {MAX_DEPTH}"
    )
