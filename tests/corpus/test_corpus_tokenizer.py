"""The byte-level BPE: determinism, exact round trip, and the committed tokenizer file."""

import json

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from corpus.stdlib import SplitRule, enumerate_stdlib
from corpus.tokenizer import (
    DEFAULT_TOKENIZER,
    EOT,
    PAD,
    TokenizerError,
    TokenizerSpec,
    load_tokenizer,
    train_tokenizer,
)

TRICKY = [
    "def f(x):\n    return x\n",
    "  leading spaces, trailing tab\t\n",
    "crlf\r\nand lone cr\r and form feed\x0c\n",
    "caf\u00e9 \u65e5\u672c \U0001f600 \u200b zero width",
    "",
    "no newline at end",
]


@pytest.fixture(scope="module")
def subset():
    """~60 train files in path order: enough text for a 1024 vocabulary, fast to train."""
    rule = SplitRule()
    files = [f for f in enumerate_stdlib() if not rule.is_heldout(f.rel)][:60]
    return [f.text() for f in files]


def test_training_is_deterministic_with_exact_vocab(subset):
    spec = TokenizerSpec(vocab_size=1024)
    a, b = train_tokenizer(subset, spec), train_tokenizer(subset, spec)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 1024
    assert a.token_to_id(EOT) == 0 and a.token_to_id(PAD) == 1
    for i in range(256):  # every byte has a symbol, so no input is unencodable
        assert a.token_to_id(pre_tokenizers.ByteLevel.alphabet()[i]) is not None


def test_round_trip_is_exact_and_the_check_can_fail(subset):
    tok = train_tokenizer(subset, TokenizerSpec(vocab_size=1024))
    for s in TRICKY + subset[:5]:
        assert tok.decode(tok.encode(s).ids) == s
    # Broken variant: a prefix space added by the pre-tokenizer survives decoding.
    bad = Tokenizer.from_str(tok.to_str())
    bad.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert bad.decode(bad.encode(TRICKY[0]).ids) != TRICKY[0]


def test_spec_and_loader_errors(tmp_path, subset):
    with pytest.raises(TokenizerError, match="vocab_size"):
        TokenizerSpec(vocab_size=258)
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="bad.json: not a valid tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json")
    small = tmp_path / "small.json"
    train_tokenizer(subset[:20], TokenizerSpec(vocab_size=512)).save(str(small))
    with pytest.raises(TokenizerError, match="512 entries, expected 8192"):
        load_tokenizer(small)
    with pytest.raises(TokenizerError, match="fewer merges"):  # too little text for the vocab
        train_tokenizer(["ab"], TokenizerSpec(vocab_size=1024))


def test_committed_tokenizer_is_standard_and_round_trips_heldout(tok, split):
    assert DEFAULT_TOKENIZER.stat().st_size < 1 << 20
    raw = json.loads(DEFAULT_TOKENIZER.read_text())
    assert raw["model"]["type"] == "BPE" and raw["pre_tokenizer"]["type"] == "ByteLevel"
    assert raw["decoder"]["type"] == "ByteLevel" and raw["normalizer"] is None
    assert Tokenizer.from_file(str(DEFAULT_TOKENIZER)).get_vocab_size() == 8192
    texts = [f.text() for f in split.heldout]
    encs = tok.encode_batch(texts)
    assert [tok.decode(e.ids) for e in encs] == texts
    n_chars, n_tokens = sum(map(len, texts)), sum(len(e.ids) for e in encs)
    assert n_chars / n_tokens > 2.5, "an 8K code BPE should compress held-out source"


@pytest.mark.slow
def test_committed_tokenizer_is_the_train_split_retrained(tok, split, subset):
    retrained = train_tokenizer(f.text() for f in split.train)
    assert json.loads(retrained.to_str()) == json.loads(tok.to_str())
    # Broken variant (on the subset, to save a second full training): adding a few held-out
    # files to the training text changes the tokenizer, so the equality pins the training set.
    spec = TokenizerSpec(vocab_size=1024)
    clean = train_tokenizer(subset, spec)
    leaky = train_tokenizer(subset + [f.text() for f in split.heldout[:3]], spec)
    assert json.loads(leaky.to_str()) != json.loads(clean.to_str())
