"""Prompts of an acceptance report: a request-set directory (corpus/requests.py, one JSONL file
per kind) or one JSONL file whose lines hold "prompt" (text) or "prompt_ids" (token ids), with
optional "id" and "kind". Each prompt keeps its last max_tokens tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from corpus.requests import KINDS, load_requests


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    ids: tuple[int, ...]  # after truncation to the last max_tokens tokens
    full_tokens: int  # before truncation


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {path}:{i}: not JSON: {e}") from None
        if not isinstance(r, dict) or ("prompt" in r) == ("prompt_ids" in r):
            raise ValueError(f"--prompts {path}:{i}: expected an object with exactly one of "
                             "'prompt' (text) or 'prompt_ids' (list of token ids)")
        r.setdefault("id", f"{path.stem}:{i}")
        r.setdefault("kind", path.stem)
        out.append(r)
    return out


def _encode(r: dict, tokenizer, where: str) -> list[int]:
    if "prompt_ids" in r:
        ids = r["prompt_ids"]
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError(f"{where}: 'prompt_ids' must be a list of integers")
        return ids
    if not isinstance(r["prompt"], str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    if tokenizer is None:
        raise ValueError(f"{where}: a text prompt needs the checkpoint's tokenizer.json "
                         "(give 'prompt_ids' instead)")
    return tokenizer.encode(r["prompt"], add_special_tokens=False).ids


def load_prompts(path: Path, tokenizer, max_tokens: int, per_kind: int | None = None,
                 vocab_size: int | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts in file order (a request-set directory: kinds in KINDS order); per_kind keeps the
    first per_kind of each kind, then limit the first limit of those."""
    path = Path(path)
    if max_tokens < 1:
        raise ValueError(f"--max-prompt-tokens: must be >= 1, got {max_tokens}")
    if per_kind is not None and per_kind < 1:
        raise ValueError(f"--per-kind: must be >= 1, got {per_kind}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit: must be >= 1, got {limit}")
    if path.is_dir():
        if not any((path / f"{k}.jsonl").is_file() for k in KINDS):
            raise ValueError(f"--prompts {path}: a directory needs the request files "
                             f"{', '.join(k + '.jsonl' for k in KINDS)}")
        records = load_requests(path)
    elif path.is_file():
        records = _read_jsonl(path)
    else:
        raise FileNotFoundError(f"--prompts {path}: no such file or directory")
    if not records:
        raise ValueError(f"--prompts {path}: no prompts (the file is empty)")
    taken: dict[str, int] = {}
    out = []
    for r in records:
        if limit is not None and len(out) >= limit:
            break
        kind = str(r["kind"])
        if per_kind is not None and taken.get(kind, 0) >= per_kind:
            continue
        taken[kind] = taken.get(kind, 0) + 1
        where = f"--prompts {path}: prompt {r['id']!r}"
        if any(p.id == str(r["id"]) for p in out):
            raise ValueError(f"{where}: the id appears twice")
        ids = _encode(r, tokenizer, where)
        if not ids:
            raise ValueError(f"{where}: the prompt has no tokens")
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{where}: token ids {bad[:5]} outside [0, {vocab_size})")
        out.append(Prompt(str(r["id"]), kind, tuple(ids[-max_tokens:]), len(ids)))
    return out
