"""Byte-level BPE tokenizer trained on the stdlib train split (Hugging Face `tokenizers` JSON).

No normalizer, ByteLevel pre-tokenizer without prefix space (GPT-2 regex), ByteLevel decoder:
decode(encode(s)) == s for any text without special-token strings. Special tokens take the
first ids: `<|endoftext|>` = 0 (document separator), `<|pad|>` = 1. The initial alphabet is all
256 byte symbols, so every byte is encodable. Training is deterministic for a fixed file order
(sorted relative paths) and library version; a library change that alters the result shows up
as a different tokenizer sha256 in the shard and request manifests.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpus.stdlib import DEFAULT_SPLIT, load_split
from iquestrt import assets

DEFAULT_TOKENIZER = assets.data("tokenizer.json")
EOT = "<|endoftext|>"
PAD = "<|pad|>"


class TokenizerError(ValueError):
    """A tokenizer file or spec is unusable; the message names the file and the problem."""


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 8192  # including the special tokens
    special_tokens: tuple[str, ...] = (EOT, PAD)  # ids 0, 1, ... in this order
    min_frequency: int = 2

    def __post_init__(self) -> None:
        n_min = 256 + len(self.special_tokens)
        if not n_min < self.vocab_size <= 65536:
            raise TokenizerError(
                f"vocab_size must be in ({n_min}, 65536] (256 bytes + specials; uint16 shards), "
                f"got {self.vocab_size}"
            )
        if not self.special_tokens or self.special_tokens[0] != EOT:
            raise TokenizerError(
                f"special_tokens must start with {EOT!r}, got {self.special_tokens}"
            )


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], spec: TokenizerSpec = TokenizerSpec()) -> Tokenizer:
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    check_tokenizer(tok, spec, where="trained tokenizer")
    return tok


def check_tokenizer(tok: Tokenizer, spec: TokenizerSpec, where: str) -> None:
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != spec.vocab_size:
        raise TokenizerError(
            f"{where}: vocabulary has {n} entries, expected {spec.vocab_size} "
            f"(too little training text reaches fewer merges)"
        )
    for i, s in enumerate(spec.special_tokens):
        if tok.token_to_id(s) != i:
            raise TokenizerError(f"{where}: {s!r} has id {tok.token_to_id(s)}, expected {i}")


def load_tokenizer(path: Path = DEFAULT_TOKENIZER, spec: TokenizerSpec = TokenizerSpec()):
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such tokenizer file (build: python -m corpus.tokenizer)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types
        raise TokenizerError(f"{path}: not a valid tokenizers JSON file: {e}") from None
    check_tokenizer(tok, spec, where=str(path))
    return tok


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="train the byte-level BPE on the stdlib train split")
    ap.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--split", type=Path, default=DEFAULT_SPLIT)
    ap.add_argument("--vocab-size", type=int, default=TokenizerSpec.vocab_size)
    a = ap.parse_args(argv)
    spec = TokenizerSpec(vocab_size=a.vocab_size)
    split = load_split(a.split)
    tok = train_tokenizer((f.text() for f in split.train), spec)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(a.out), pretty=True)
    size = a.out.stat().st_size
    print(f"{a.out}: vocab {spec.vocab_size}, {len(split.train)} train files, {size} bytes")


if __name__ == "__main__":
    main()
