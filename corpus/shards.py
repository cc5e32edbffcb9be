"""Flat uint16 token arrays of the train and held-out files (generated, not committed).

Layout of `train.bin` / `heldout.bin` ([T] little-endian uint16, read with
`np.fromfile(path, dtype="<u2")`):
documents in sorted relative-path order, joined by one `<|endoftext|>` id (0) between
consecutive documents (none before the first or after the last). `manifest.json` records the
counts, the sha256 of each array's bytes, and the sha256 of the tokenizer and split files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from corpus.stdlib import DEFAULT_SPLIT, SourceFile, load_split
from corpus.tokenizer import DEFAULT_TOKENIZER, EOT, file_sha256, load_tokenizer


class ShardError(ValueError):
    """A document cannot be written into a shard; the message names the file."""


def encode_documents(tok: Tokenizer, texts: Sequence[str], names: Sequence[str]) -> np.ndarray:
    """[T] uint16: the documents' ids joined by the EOT id."""
    if len(texts) != len(names):
        raise ShardError(f"{len(texts)} texts but {len(names)} names")
    eot = tok.token_to_id(EOT)
    if eot is None:
        raise ShardError(f"tokenizer has no {EOT!r} token")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > 1 << 16:
        raise ShardError(f"vocabulary {vocab} does not fit uint16")
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    for text, name in zip(texts, names, strict=True):
        for s in specials:
            if s in text:
                raise ShardError(f"{name}: contains the special token string {s!r}")
    parts: list[np.ndarray] = []
    for i, enc in enumerate(tok.encode_batch(list(texts), add_special_tokens=False)):
        if i:
            parts.append(np.array([eot], dtype=np.uint16))
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def split_documents(ids: np.ndarray, eot: int) -> list[np.ndarray]:
    """Inverse of the join: the per-document id arrays."""
    if ids.size == 0:
        return []  # zero documents and one empty document look alike; the manifest counts
    parts = np.split(ids, np.flatnonzero(ids == eot))
    return [parts[0]] + [p[1:] for p in parts[1:]]  # drop each separator


def _shard(tok: Tokenizer, files: Sequence[SourceFile], out: Path) -> dict:
    ids = encode_documents(tok, [f.text() for f in files], [f.rel for f in files])
    raw = ids.astype("<u2", copy=False).tobytes()
    out.write_bytes(raw)
    return {
        "file": out.name,
        "documents": len(files),
        "tokens": int(ids.size),
        "text_bytes": sum(f.size for f in files),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }


def write_shards(out: Path, tokenizer_path: Path, split_path: Path, root: Path | None = None):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_path)
    split = load_split(split_path, root)
    manifest = {
        "dtype": "uint16",
        "byteorder": "little",
        "eot_id": tok.token_to_id(EOT),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "tokenizer_sha256": file_sha256(tokenizer_path),
        "split_sha256": file_sha256(split_path),
        "train": _shard(tok, split.train, out / "train.bin"),
        "heldout": _shard(tok, split.heldout, out / "heldout.bin"),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="tokenize the stdlib split into uint16 shards")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--split", type=Path, default=DEFAULT_SPLIT)
    ap.add_argument("--root", type=Path, default=None, help="stdlib root (default: this Python's)")
    a = ap.parse_args(argv)
    m = write_shards(a.out, a.tokenizer, a.split, a.root)
    for part in ("train", "heldout"):
        p = m[part]
        print(f"{a.out / p['file']}: {p['documents']} docs, {p['tokens']} tokens, "
              f"{2 * p['tokens']} bytes")


if __name__ == "__main__":
    main()
