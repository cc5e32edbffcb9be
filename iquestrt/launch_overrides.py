"""Overrides of the kernels' pinned launch configurations for the "kernels" op table
(iquestrt/ops_kernels.py), so that a benchmark can time launch choices side by side in one
process (`python -m benchmarks.rank --launch moe.down_rows=1`).

Empty (the default) means the pinned configuration of every shape, unchanged:
kernels/moe_launch.py `moe_launch`, kernels/sampler `sampler_launch`, kernels/tails_launch.py
`tail_launch`, kernels/qk_rope.py `qkv_launch`, kernels/linear_launch.py `linear_fp8_launch`.
An override replaces named fields of the pinned configuration at each call
(dataclasses.replace, so the configuration's own checks run). Most fields change no bit
(channel tiles, warps, stages, sampler tiles and selection, the MoE's moved launches, the
packed top-k, the router's prefetched weights, the tails' column chunks, the QKV launch's
folded qk_rope, the hoisted scale loads, the early loads, the weight prefetch before the PDL
wait and the MoE tail's early release — the last two need `--pdl on`);
MoeLaunch.gate_up_k_blocks and LinearLaunch.split_k
do (they move a K split), within the tolerance rows; of AttentionConfig (family attention,
over pick_config of each cache's layout) num_stages, num_warps and combine_warps change no bit,
the others move the split boundaries or the combine's order, within the tolerance rows.

Covered calls: KernelOps.moe (and the rank ops' MoE partials), attn_tail, moe_tail, sample,
qkv_rope, attention, attention_q, linear_fp8, linear_fp8_partials (and the rank ops' O
partials; family linear: over each shape's pinned FP8 launch). The TP shard sampling steps
(iquestrt/tp/sampling.py) keep the pinned configuration.

Text form: comma-separated `family.field=value`, families moe / sampler / tails / qkv /
linear / attention, e.g. `moe.down_rows=1,sampler.tile=2048,sampler.scan_warps=4`; booleans as
0/1/true/false/on/off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kernels.attention import AttentionConfig, pick_config
from kernels.linear_launch import LinearLaunch, linear_fp8_launch
from kernels.moe_launch import MoeLaunch, moe_launch
from kernels.qk_rope import QkvLaunch, qkv_launch
from kernels.sampler import SamplerLaunch, sampler_launch
from kernels.tails_launch import TailLaunch, tail_launch

FAMILIES = {"moe": MoeLaunch, "sampler": SamplerLaunch, "tails": TailLaunch, "qkv": QkvLaunch,
            "linear": LinearLaunch, "attention": AttentionConfig}
_BOOLS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}

Fields = tuple[tuple[str, object], ...]  # (field, value) pairs in the order given


class LaunchOverrideError(ValueError):
    """An override names an unknown family or field, or a value its configuration rejects."""


def _probes() -> dict:
    """A pinned configuration of each family (real TP8-rank shapes), to check overrides on."""
    return {"moe": moe_launch(3072, 192), "sampler": sampler_launch(20000),
            "tails": tail_launch(3072, 256), "qkv": qkv_launch(),
            "linear": linear_fp8_launch(1024, 3072),
            "attention": pick_config(128, 131072, False)}


def _value(family: str, name: str, text: str) -> object:
    types = {f.name: f.type for f in dataclasses.fields(FAMILIES[family])}
    if name not in types:
        raise LaunchOverrideError(f"launch override {family}.{name}: unknown field; "
                                  f"{FAMILIES[family].__name__} has {sorted(types)}")
    kind = types[name] if isinstance(types[name], str) else types[name].__name__
    t = text.strip().lower()
    if kind == "bool":
        if t not in _BOOLS:
            raise LaunchOverrideError(f"launch override {family}.{name}={text!r}: expected one "
                                      f"of {sorted(_BOOLS)}")
        return _BOOLS[t]
    if kind == "int":
        try:
            return int(t)
        except ValueError:
            raise LaunchOverrideError(f"launch override {family}.{name}={text!r}: expected an "
                                      "integer") from None
    return text.strip()


@dataclass(frozen=True)
class LaunchOverrides:
    moe: Fields = ()  # over moe_launch(hidden, inter, device type)
    sampler: Fields = ()  # over sampler_launch(vocabulary columns per row)
    tails: Fields = ()  # over tail_launch(hidden[, experts])
    qkv: Fields = ()  # over qkv_launch()
    linear: Fields = ()  # over linear_fp8_launch(N, K) of each FP8 projection
    attention: Fields = ()  # over pick_config(head dim, capacity, ring) of each cache

    def __post_init__(self) -> None:
        probes = _probes()
        for family in FAMILIES:
            fields = getattr(self, family)
            names = [n for n, _ in fields]
            if len(set(names)) != len(names):
                raise LaunchOverrideError(f"launch override {family}: a field is named twice: "
                                          f"{names}")
            try:
                dataclasses.replace(probes[family], **dict(fields))
            except (TypeError, ValueError) as e:
                raise LaunchOverrideError(f"launch override {family} {dict(fields)}: {e}") from None

    @classmethod
    def parse(cls, text: str) -> LaunchOverrides:
        """`family.field=value[,…]` (module docstring) → overrides; "" → none."""
        out: dict[str, list] = {f: [] for f in FAMILIES}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, eq, value = item.partition("=")
            family, dot, name = key.strip().partition(".")
            if not eq or not dot or family not in FAMILIES:
                raise LaunchOverrideError(f"launch override {item!r}: expected family.field=value "
                                          f"with family one of {sorted(FAMILIES)}")
            out[family].append((name.strip(), _value(family, name.strip(), value)))
        return cls(**{f: tuple(v) for f, v in out.items()})

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in FAMILIES)

    def label(self) -> str:
        """The text form (parse(label()) == self); "" when empty."""
        return ",".join(f"{f}.{n}={int(v) if isinstance(v, bool) else v}"
                        for f in FAMILIES for n, v in getattr(self, f))

    def moe_config(self, hidden: int, inter: int, device_type: str) -> MoeLaunch | None:
        """None when nothing overrides the MoE (the wrapper pins its own configuration)."""
        if not self.moe:
            return None
        return dataclasses.replace(moe_launch(hidden, inter, device_type), **dict(self.moe))

    def sampler_config(self, columns: int) -> SamplerLaunch | None:
        if not self.sampler:
            return None
        return dataclasses.replace(sampler_launch(columns), **dict(self.sampler))

    def qkv_config(self) -> QkvLaunch:
        return dataclasses.replace(qkv_launch(), **dict(self.qkv))

    def linear_config(self, n: int, k: int) -> LinearLaunch | None:
        if not self.linear:
            return None
        return dataclasses.replace(linear_fp8_launch(n, k), **dict(self.linear))

    def attention_config(self, head_dim: int, capacity: int, ring: bool) -> AttentionConfig:
        """The cache's pinned config, or a copy with the overridden fields (on every attention
        call, so nothing is copied when nothing is overridden)."""
        cfg = pick_config(head_dim, capacity, ring)
        return dataclasses.replace(cfg, **dict(self.attention)) if self.attention else cfg

    def tail_config(self, hidden: int, experts: int = 0) -> TailLaunch | None:
        if not self.tails:
            return None
        return dataclasses.replace(tail_launch(hidden, experts), **dict(self.tails))
