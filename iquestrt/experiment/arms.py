"""Experiment arms: a label and key=value settings applied to a base RuntimeConfig.

Spec text: pairs separated by commas or spaces, e.g. "depth=3", "depth=adaptive,graphs=on".
Keys (each at most once):
  depth        "adaptive" (the checkpoint's fitted policy, else the default) or 0 … 7
  graphs       on/off (1/0, true/false, yes/no): replay one captured CUDA graph per round
  prefetch     on/off: expert prefetch where the checkpoint ships predictors
  sync_rounds  int in [1, 64]: rounds between two host reads of the result log
  max_width    int in [1, 8]: verification rows (the prefill's chunk width too)
  pdl          on/off: programmatic dependent launch of the kernels (GPU, ops kernels)
A key left out keeps the base value. Every problem raises ArmSpecError naming the flag, the
spec and the key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from iquestrt.config import RuntimeConfig, RuntimeConfigError
from reference.config import ModelConfig
from reference.depth import policy_from_spec, policy_to_json

KEYS = ("depth", "graphs", "prefetch", "sync_rounds", "max_width", "pdl")
_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


class ArmSpecError(ValueError):
    """An arm spec does not parse or gives an invalid RuntimeConfig."""


@dataclass(frozen=True)
class ArmSpec:
    label: str  # "control", "candidate", "control′"
    flag: str  # where it came from, for messages: "--control"
    text: str
    settings: tuple[tuple[str, str], ...]  # (key, value) in spec order

    @classmethod
    def parse(cls, label: str, flag: str, text: str) -> ArmSpec:
        where = f"{flag} {text!r}"
        parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
        if not parts:
            raise ArmSpecError(f"{where}: empty spec; give key=value pairs, keys {', '.join(KEYS)}")
        seen: dict[str, str] = {}
        for p in parts:
            key, eq, value = p.partition("=")
            key = key.strip().lower()
            if not eq or not value:
                raise ArmSpecError(f"{where}: {p!r} is not key=value")
            if key not in KEYS:
                raise ArmSpecError(f"{where}: unknown key {key!r}; allowed: {', '.join(KEYS)}")
            if key in seen:
                raise ArmSpecError(f"{where}: key {key!r} given twice")
            seen[key] = value.strip()
        return cls(label, flag, text, tuple(seen.items()))

    def runtime_config(self, base: RuntimeConfig, cfg: ModelConfig,
                       checkpoint: str | Path | None = None) -> RuntimeConfig:
        """base with this arm's settings, checked against the model."""
        where = f"{self.flag} {self.text!r}"
        fields = {}
        for key, value in self.settings:
            if key == "depth":
                try:
                    fields["policy"] = policy_from_spec(value, checkpoint)
                except ValueError as e:
                    raise ArmSpecError(f"{where}: depth: {e}") from None
            elif key in ("graphs", "prefetch", "pdl"):
                fields[key] = _bool(value, where, key)
            else:
                fields[key] = _int(value, where, key)
        try:
            rcfg = dataclasses.replace(base, **fields)
            rcfg.validate_for(cfg)
        except RuntimeConfigError as e:
            raise ArmSpecError(f"{where}: {e}") from None
        return rcfg


def _bool(value: str, where: str, key: str) -> bool:
    v = value.lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ArmSpecError(f"{where}: {key}={value!r}; expected on/off (1/0, true/false, yes/no)")


def _int(value: str, where: str, key: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ArmSpecError(f"{where}: {key}={value!r}; expected an integer") from None


def describe(rcfg: RuntimeConfig) -> dict:
    """The settings an arm can vary, as JSON values (for records)."""
    return {"policy": policy_to_json(rcfg.policy), "graphs": rcfg.graphs,
            "prefetch": rcfg.prefetch, "sync_rounds": rcfg.sync_rounds,
            "max_width": rcfg.max_width, "pdl": rcfg.pdl, "ops": rcfg.ops, "device": rcfg.device,
            "ring_pad": rcfg.ring_pad, "max_positions": rcfg.max_positions}
