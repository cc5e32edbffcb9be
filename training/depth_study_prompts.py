"""Prompts of the depth study (training/depth_study.py): fitting windows from train-split
files, held-out request prompts, and the check that neither set crosses the split."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

SALT = "iquestrt-depth-study-v1:"


@dataclass(frozen=True)
class Prompt:
    id: str
    path: str  # stdlib-relative source file
    ids: tuple[int, ...]


def _h(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def train_prompts(split, tok, n: int, lo: int, hi: int, salt: str = SALT) -> list[Prompt]:
    held = {f.rel for f in split.heldout}
    for f in split.train:
        if f.rel in held or split.rule.is_heldout(f.rel):
            raise ValueError(f"train_prompts: {f.rel} is a held-out file of the split; fitting "
                             f"prompts may come from train files only")
    out = []
    for f in sorted(split.train, key=lambda f: _h(salt + f.rel)):
        ids = tok.encode(f.text(), add_special_tokens=False).ids
        if len(ids) < lo:
            continue
        k = min(hi, len(ids))
        start = int(_h(salt + f.rel)[16:32], 16) % (len(ids) - k + 1)
        out.append(Prompt(f"train:{f.rel}@{start}", f.rel, tuple(ids[start : start + k])))
        if len(out) == n:
            return out
    raise ValueError(f"train_prompts: only {len(out)} train files have >= {lo} tokens, {n} needed")


def heldout_prompts(records: Sequence[dict], tok, max_tokens: int) -> list[Prompt]:
    return [Prompt(r["id"], r["path"],
                   tuple(tok.encode(r["prompt"], add_special_tokens=False).ids[-max_tokens:]))
            for r in records]


def check_disjoint(fit_p: Sequence[Prompt], eval_p: Sequence[Prompt], split) -> None:
    train = {f.rel for f in split.train}
    bad = [p.path for p in fit_p if p.path not in train]
    bad += [p.path for p in eval_p if p.path in train or not split.rule.is_heldout(p.path)]
    if bad:
        raise ValueError(f"prompts cross the train/held-out split: {sorted(set(bad))[:5]}")
