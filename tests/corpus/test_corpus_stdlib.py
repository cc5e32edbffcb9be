"""Stdlib enumeration, the split rule, and detection of a stdlib that differs from the record."""

import hashlib
import json
import warnings

import pytest

from corpus.stdlib import (
    DEFAULT_SPLIT,
    SplitError,
    SplitMismatchWarning,
    SplitRule,
    build_split,
    enumerate_stdlib,
    stdlib_root,
    write_split,
)


def _write(root, rel, data: bytes):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


def test_enumerate_skips_ineligible_files(tmp_path):
    _write(tmp_path, "a.py", b"x = 1\n")
    _write(tmp_path, "pkg/b.py", "s = 'h\u00e9'\n".encode())
    _write(tmp_path, "pkg/notes.txt", b"not python\n")
    _write(tmp_path, "site-packages/third.py", b"x = 1\n")
    _write(tmp_path, "pkg/__pycache__/c.py", b"x = 1\n")
    _write(tmp_path, "config-3.11-x86_64-linux-gnu/python-config.py", b"x = 1\n")
    _write(tmp_path, "_sysconfigdata__linux.py", b"build = {}\n")
    _write(tmp_path, "latin1.py", "s = 'h\u00e9'\n".encode("latin-1"))
    _write(tmp_path, "big.py", b"#" * 99 + b"\n")  # 100 bytes: over max_bytes=99
    files = enumerate_stdlib(tmp_path, max_bytes=99)
    assert [f.rel for f in files] == ["a.py", "pkg/b.py"]
    assert files[1].sha256 == hashlib.sha256("s = 'h\u00e9'\n".encode()).hexdigest()
    assert files[1].size == len("s = 'h\u00e9'\n".encode())
    bigger = enumerate_stdlib(tmp_path, max_bytes=100)
    assert [f.rel for f in bigger] == ["a.py", "big.py", "pkg/b.py"]


def test_rule_is_a_hash_of_the_path_only():
    rule = SplitRule()
    for rel in ("abc.py", "email/utils.py", "test/test_os.py", "x/y/z.py"):
        h = hashlib.sha256(("iquestrt-corpus-split-v1:" + rel).encode()).hexdigest()
        assert rule.is_heldout(rel) == (int(h[:16], 16) % 1000 < 50)
    with pytest.raises(SplitError, match="heldout_per_mille"):
        SplitRule(heldout_per_mille=1000)


def test_committed_split_matches_this_stdlib(split):
    rec = json.loads(DEFAULT_SPLIT.read_text())
    assert rec["stdlib_root"] == stdlib_root().name
    assert not split.missing and not split.changed and split.train_matches
    assert len(split.heldout) == rec["heldout"]["files"] == len(rec["heldout"]["entries"])
    assert len(split.train) == rec["train"]["files"]
    assert {f.rel for f in split.train}.isdisjoint(f.rel for f in split.heldout)
    total = len(split.train) + len(split.heldout)
    assert total == len(enumerate_stdlib())  # every eligible file is on one side
    assert 0.035 < len(split.heldout) / total < 0.065, "the rule should hold out about 5%"
    assert rec == build_split()  # regenerating gives the committed record


@pytest.fixture
def fake(tmp_path):
    """A fake stdlib of 200 files, its split (10% rule) recorded beside it."""
    root = tmp_path / "python3.99"
    for i in range(200):
        _write(root, f"pkg{i % 7}/m{i}.py", f"x = {i}\n".encode())
    rule = SplitRule(heldout_per_mille=100)
    rec = build_split(root, rule)
    path = tmp_path / "split.json"
    write_split(rec, path)
    held = [e["path"] for e in rec["heldout"]["entries"]]
    train = sorted({f.rel for f in enumerate_stdlib(root)} - set(held))
    assert 10 <= len(held) <= 30
    return root, path, held, train


def _load(path, root):
    from corpus.stdlib import load_split

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = load_split(path, root)
    return s, [str(w.message) for w in caught if w.category is SplitMismatchWarning]


def test_identical_stdlib_loads_silently(fake):
    root, path, held, train = fake
    s, warned = _load(path, root)
    assert warned == [] and s.train_matches
    assert [f.rel for f in s.heldout] == held and sorted(f.rel for f in s.train) == train


def test_changed_and_missing_files_warn_with_counts(fake):
    root, path, held, train = fake
    (root / held[0]).write_bytes(b"x = 'changed'\n")
    (root / held[1]).unlink()
    (root / train[0]).unlink()
    s, warned = _load(path, root)
    assert s.changed == (held[0],) and s.missing == (held[1],) and not s.train_matches
    assert len(warned) == 1
    msg = warned[0]
    assert "1 missing, 1 changed" in msg and f"of {len(held)}" in msg
    assert f"recorded {len(train)} files" in msg and f"here {len(train) - 1} files" in msg


def test_train_content_change_is_detected(fake):
    root, path, held, train = fake
    (root / train[3]).write_bytes(b"x = 'same size?'\n")
    s, warned = _load(path, root)
    assert not s.train_matches and "digest differs" in warned[0]


def test_too_many_missing_is_an_error(fake):
    root, path, held, train = fake
    n = int(0.10 * len(held))  # exactly 10% missing is still allowed
    for rel in held[:n]:
        (root / rel).unlink()
    _, warned = _load(path, root)
    assert f"{n} missing" in warned[0]
    (root / held[n]).unlink()
    with pytest.raises(SplitError, match=rf"{n + 1} of {len(held)} held-out files"):
        _load(path, root)


def test_too_many_missing_train_files_is_an_error(fake):
    root, path, held, train = fake
    for rel in train[: len(train) // 10 + 1]:
        (root / rel).unlink()
    with pytest.raises(SplitError, match="train files are missing"):
        _load(path, root)


def test_inconsistent_record_is_rejected(fake):
    root, path, held, train = fake
    rec = json.loads(path.read_text())
    rec["heldout"]["entries"].append({"path": train[0], "sha256": "0" * 64, "bytes": 1})
    rec["heldout"]["files"] += 1
    path.write_text(json.dumps(rec))
    with pytest.raises(SplitError, match="disagrees with its own rule"):
        _load(path, root)
    path.write_text("{")
    with pytest.raises(SplitError, match="cannot read split record"):
        _load(path, root)
