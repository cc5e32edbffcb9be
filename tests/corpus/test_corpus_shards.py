"""Token shards: layout (documents joined by EOT), manifest hashes, and bad input."""

import hashlib
import json

import numpy as np
import pytest

from corpus.shards import ShardError, encode_documents, split_documents, write_shards
from corpus.stdlib import SplitRule, build_split, write_split
from corpus.tokenizer import DEFAULT_TOKENIZER, EOT

DOCS = ["def f(x):\n    return x\n", "", "caf\u00e9 = '\u65e5\u672c'\r\n", "class A:\n    pass"]


def test_documents_are_joined_by_one_eot(tok):
    ids = encode_documents(tok, DOCS, [f"d{i}" for i in range(len(DOCS))])
    assert ids.dtype == np.uint16 and tok.token_to_id(EOT) == 0
    assert int((ids == 0).sum()) == len(DOCS) - 1
    expected = []
    for i, d in enumerate(DOCS):  # built independently from per-document encodes
        expected += ([0] if i else []) + tok.encode(d).ids
    assert ids.tolist() == expected
    parts = split_documents(ids, 0)
    assert [tok.decode(p.tolist()) for p in parts] == DOCS


def test_special_token_text_is_refused_with_the_file_name(tok):
    with pytest.raises(ShardError, match=r"evil\.py: contains the special token string"):
        encode_documents(tok, ["x = 1\n", f"s = '{EOT}'\n"], ["ok.py", "evil.py"])


def test_write_shards_on_a_small_tree(tmp_path, tok):
    root = tmp_path / "python3.99"
    texts = {f"m{i}.py": f"def f{i}(x):\n    return x * {i}\n" * (i + 1) for i in range(40)}
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    rule = SplitRule(heldout_per_mille=200)
    split_path = tmp_path / "split.json"
    write_split(build_split(root, rule), split_path)
    m = write_shards(tmp_path / "out", DEFAULT_TOKENIZER, split_path, root)
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk == m and m["eot_id"] == 0 and m["vocab_size"] == 8192
    assert m["tokenizer_sha256"] == hashlib.sha256(DEFAULT_TOKENIZER.read_bytes()).hexdigest()
    for part, held in (("train", False), ("heldout", True)):
        rels = sorted(r for r in texts if rule.is_heldout(r) == held)
        raw = (tmp_path / "out" / f"{part}.bin").read_bytes()
        ids = np.frombuffer(raw, dtype="<u2")
        assert m[part]["sha256"] == hashlib.sha256(raw).hexdigest()
        assert m[part]["tokens"] == ids.size and m[part]["documents"] == len(rels) > 0
        assert [tok.decode(p.tolist()) for p in split_documents(ids, 0)] == [texts[r] for r in rels]
