"""Where a report's numbers came from: the code's git revision and a checkpoint's content hash.

Revision. `git rev-parse HEAD` and `git status --porcelain` of the checkout this package was
imported from. Only a checkout whose top level is the package's parent directory counts: an
installed wheel lives in site-packages, which may sit inside some other git repository (a venv
inside a checkout), and that repository's HEAD says nothing about the installed code. Outside a
checkout, or without a usable git, the commit is "unknown" and the worktree state "unknown".

Source digest. The sha256 of a `sha256sum`-format manifest of every *.py file under the code
directories (SOURCE_DIRS) of the package's parent, sorted by path: what the measured code was
even where git cannot say — a copy whose git metadata is older than its files (a device machine
given a working tree). Anyone can recompute it at a commit (`python -m
iquestrt.report.provenance` in a checkout of it) and compare. IQUESTRT_REVISION, when set,
is the commit the runner says it copied; records keep it beside git's answer and the digest.

Checkpoint hash. The sha256 of a manifest in `sha256sum` format: one line
"<sha256 of the file>  <path relative to the checkpoint>\\n" per covered file, sorted by path.
Covered: every file named *.safetensors or *.json anywhere under the checkpoint directory
(weights, configs, index, tokenizer, depth policy, prefetch predictors; also cards and training
reports, which change the hash without changing the model). The same value comes from
CHECKPOINT_SHA256_SHELL, run in the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the checkout root when run from one
UNKNOWN = "unknown"
COVERED_SUFFIXES = (".safetensors", ".json")
CHUNK_BYTES = 1 << 20
SOURCE_DIRS = ("benchmarks", "iquestrt", "kernels", "negative_controls", "qualification",
               "reference")
REVISION_ENV = "IQUESTRT_REVISION"
CHECKPOINT_SHA256_SHELL = (
    "find -L . -type f \\( -name '*.safetensors' -o -name '*.json' \\) -printf '%P\\n' "
    "| LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum")


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                             timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def revision(root: Path = PACKAGE_PARENT) -> dict:
    """{"commit": HEAD or "unknown", "worktree": "clean" | "dirty" | "unknown", "dirty": the
    `git status --porcelain` lines, stripped ("M path", "?? path")}; the measured code is HEAD
    plus those."""
    root = Path(root)
    top = _git(root, "rev-parse", "--show-toplevel")
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain")
    if top is None or Path(top.strip()).resolve() != root.resolve() or not head or \
            status is None:
        return {"commit": UNKNOWN, "worktree": UNKNOWN, "dirty": []}
    dirty = sorted(line.strip() for line in status.splitlines() if line.strip())
    return {"commit": head.strip(), "worktree": "dirty" if dirty else "clean", "dirty": dirty}


def source_digest(root: Path = PACKAGE_PARENT) -> str:
    """The sha256 of the manifest of SOURCE_DIRS' *.py files under root (module docstring);
    "unknown" when root holds none of them."""
    root = Path(root)
    files = sorted((p.relative_to(root).as_posix(), p) for d in SOURCE_DIRS
                   for p in (root / d).rglob("*.py") if p.is_file())
    if not files:
        return UNKNOWN
    manifest = "".join(f"{file_sha256(p)}  {rel}\n" for rel, p in files)
    return hashlib.sha256(manifest.encode()).hexdigest()


def code_identity(root: Path = PACKAGE_PARENT) -> dict:
    """revision() + {"source_digest", "claimed_revision": $IQUESTRT_REVISION or None}."""
    return {**revision(root), "source_digest": source_digest(root),
            "claimed_revision": os.environ.get(REVISION_ENV) or None}


@dataclass(frozen=True)
class CheckpointHash:
    sha256: str  # of `manifest`
    manifest: str  # sha256sum lines of the covered files, sorted by path


def file_sha256(path: Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def checkpoint_hash(directory: Path, chunk_bytes: int = CHUNK_BYTES) -> CheckpointHash:
    """The checkpoint directory's content hash (module docstring), files read in chunks."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint hash: {d}: no such directory")
    if chunk_bytes < 1:
        raise ValueError(f"checkpoint hash: chunk_bytes must be >= 1, got {chunk_bytes}")
    files = sorted((p.relative_to(d).as_posix(), p) for p in d.rglob("*")
                   if p.suffix in COVERED_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"checkpoint hash: {d} holds no *.safetensors or *.json file")
    manifest = "".join(f"{file_sha256(p, chunk_bytes)}  {rel}\n" for rel, p in files)
    return CheckpointHash(hashlib.sha256(manifest.encode()).hexdigest(), manifest)


if __name__ == "__main__":
    print(source_digest())
