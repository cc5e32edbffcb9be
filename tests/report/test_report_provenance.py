"""Provenance of a report: the git revision (this checkout against git itself; a directory that
is no checkout, or only a folder inside one, or a machine without git → "unknown") and the
checkpoint hash (against coreutils' sha256sum and against a manifest built here by hand)."""

import hashlib
import shutil
import subprocess

import pytest

from iquestrt.report.provenance import (
    CHECKPOINT_SHA256_SHELL,
    PACKAGE_PARENT,
    checkpoint_hash,
    revision,
)

HAVE_GIT = shutil.which("git") is not None
needs_git = pytest.mark.skipif(not HAVE_GIT, reason="needs git")
UNKNOWN = {"commit": "unknown", "worktree": "unknown", "dirty": []}


def _git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout


@needs_git
def test_revision_of_this_checkout_is_what_git_says():
    try:
        head = _git(PACKAGE_PARENT, "rev-parse", "HEAD").strip()
        status = _git(PACKAGE_PARENT, "status", "--porcelain")
    except subprocess.CalledProcessError:
        pytest.skip("not run from a git checkout")
    rev = revision()
    assert rev["commit"] == head and len(head) == 40
    assert rev["worktree"] == ("dirty" if status.strip() else "clean")
    assert len(rev["dirty"]) == len([line for line in status.splitlines() if line.strip()])


@needs_git
def test_revision_of_a_fresh_repository_clean_then_dirty(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "HEAD").strip()
    assert revision(tmp_path) == {"commit": head, "worktree": "clean", "dirty": []}
    (tmp_path / "a.txt").write_text("two\n")
    (tmp_path / "b.txt").write_text("new\n")
    assert revision(tmp_path) == {"commit": head, "worktree": "dirty",
                                  "dirty": ["?? b.txt", "M a.txt"]}


@needs_git
def test_revision_is_unknown_outside_a_checkout_or_inside_another_one(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert revision(plain) == UNKNOWN
    # an installed package whose site-packages lies inside some other repository (a venv in a
    # checkout): that repository's HEAD is not the installed code's revision
    repo = tmp_path / "repo"
    site = repo / "venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "x").write_text("x")
    _git(repo, "add", "x")
    _git(repo, "commit", "-q", "-m", "x")
    assert revision(site) == UNKNOWN


def test_revision_without_git_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    assert revision() == UNKNOWN


def _tree(root):
    files = {"config.json": b'{"a": 1}', "model-00001.safetensors": bytes(range(256)) * 9,
             "mtp/config.json": b"{}", "mtp/w.safetensors": b"draft weights",
             "MODEL_CARD.md": b"# card", "training.log": b"log"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_checkpoint_hash_against_a_manifest_built_by_hand(tmp_path):
    files = _tree(tmp_path)
    covered = sorted(r for r in files if r.endswith((".json", ".safetensors")))
    manifest = "".join(f"{hashlib.sha256(files[r]).hexdigest()}  {r}\n" for r in covered)
    got = checkpoint_hash(tmp_path)
    assert got.manifest == manifest
    assert got.sha256 == hashlib.sha256(manifest.encode()).hexdigest()
    assert checkpoint_hash(tmp_path, chunk_bytes=7) == got  # streamed in chunks: same value


def test_checkpoint_hash_follows_weights_and_configs_only(tmp_path):
    _tree(tmp_path)
    base = checkpoint_hash(tmp_path).sha256
    (tmp_path / "MODEL_CARD.md").write_text("# another card")
    assert checkpoint_hash(tmp_path).sha256 == base  # not covered
    w = tmp_path / "model-00001.safetensors"
    data = bytearray(w.read_bytes())
    data[1000] ^= 1
    w.write_bytes(bytes(data))
    changed = checkpoint_hash(tmp_path).sha256
    assert changed != base
    (tmp_path / "mtp" / "config.json").rename(tmp_path / "mtp" / "cfg.json")
    assert checkpoint_hash(tmp_path).sha256 != changed  # a renamed file counts


@pytest.mark.skipif(not all(shutil.which(t) for t in ("find", "sort", "xargs", "sha256sum")),
                    reason="needs find, sort, xargs and sha256sum")
def test_checkpoint_hash_equals_the_documented_shell_pipeline(mini):
    out = subprocess.run(["bash", "-c", CHECKPOINT_SHA256_SHELL], cwd=mini, capture_output=True,
                         text=True, check=True).stdout
    assert out.split()[0] == checkpoint_hash(mini).sha256


def test_checkpoint_hash_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        checkpoint_hash(tmp_path / "nowhere")
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match=r"holds no \*.safetensors or \*.json file"):
        checkpoint_hash(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        checkpoint_hash(tmp_path, chunk_bytes=0)


def _write_files(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_source_digest_is_the_manifest_hash_of_the_code_dirs(tmp_path):
    from iquestrt.report.provenance import source_digest

    files = {"kernels/a.py": "x = 1\n", "kernels/sub/b.py": "y = 2\n", "iquestrt/c.py": "z\n"}
    _write_files(tmp_path, files)
    _write_files(tmp_path, {"kernels/notes.md": "ignored", "docs/d.py": "ignored: not a code dir"})
    manifest = "".join(f"{hashlib.sha256(files[rel].encode()).hexdigest()}  {rel}\n"
                       for rel in sorted(files))
    assert source_digest(tmp_path) == hashlib.sha256(manifest.encode()).hexdigest()
    (tmp_path / "kernels/notes.md").write_text("changed")  # not covered
    (tmp_path / "docs/d.py").write_text("changed")
    assert source_digest(tmp_path) == hashlib.sha256(manifest.encode()).hexdigest()
    (tmp_path / "kernels/sub/b.py").write_text("y = 3\n")  # covered: one byte moves it
    assert source_digest(tmp_path) != hashlib.sha256(manifest.encode()).hexdigest()
    assert source_digest(tmp_path / "kernels") == "unknown"  # no code dir below it


def test_code_identity_keeps_the_runners_claim(tmp_path, monkeypatch):
    from iquestrt.report.provenance import REVISION_ENV, code_identity, source_digest

    _write_files(tmp_path, {"kernels/a.py": "x = 1\n"})
    monkeypatch.delenv(REVISION_ENV, raising=False)
    ident = code_identity(tmp_path)
    assert ident["claimed_revision"] is None and ident["commit"] == "unknown"
    assert ident["source_digest"] == source_digest(tmp_path)
    monkeypatch.setenv(REVISION_ENV, "05e0eb9")
    assert code_identity(tmp_path)["claimed_revision"] == "05e0eb9"
