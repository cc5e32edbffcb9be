"""The depth study's settings (training/depth_study.py): prompt counts, seeds, tokens and the
bootstrap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StudyConfig:
    fit_prompts: int = 12
    fit_lo: int = 128  # fitting windows: tokens, at least / at most
    fit_hi: int = 256
    fit_seeds: tuple[int, ...] = (100, 101, 102)
    fit_tokens: int = 64  # new tokens per fitting decode
    eval_prompts: int = 9  # spread over the request kinds
    eval_max_tokens: int = 256  # held-out prompts keep their last this many tokens
    eval_seeds: tuple[int, ...] = tuple(range(10))
    eval_tokens: int = 40
    boot: int = 2000
    boot_seed: int = 0

    def validate(self) -> None:
        for name in ("fit_prompts", "fit_lo", "fit_tokens", "eval_prompts", "eval_max_tokens",
                     "eval_tokens", "boot"):
            if getattr(self, name) < 1:
                raise ValueError(f"StudyConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.fit_hi < self.fit_lo:
            raise ValueError(f"StudyConfig.fit_hi={self.fit_hi} < fit_lo={self.fit_lo}")
        if not self.fit_seeds or not self.eval_seeds:
            raise ValueError("StudyConfig: fit_seeds and eval_seeds must be non-empty")
