"""The CPython standard library's `.py` files as a corpus, and its recorded train/held-out split.

Rule (recorded in `data/corpus_split.json`, applied on load from the record, not from code):
a file is held out iff int(sha256(salt + relative_path)[:16], 16) % 1000 < heldout_per_mille.
Relative paths are POSIX paths under the stdlib root (e.g. `email/utils.py`), so the split
does not depend on where Python is installed. Whole packages are not kept together.

Eligible files: `*.py` under `sysconfig.get_paths()["stdlib"]`, skipping the directories in
`SKIP_DIRS` (third-party installs, bytecode), the build-configuration directory `config-*`,
the machine-specific `_sysconfigdata_*.py`, files larger than `max_bytes`, and files that are
not valid UTF-8 (a few encoding test fixtures).

Another Python patch version ships slightly different files: `load_split` warns with counts of
missing and changed held-out files and of the train-set difference, and raises only when more
than `max_missing_frac` of either side is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sysconfig
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from iquestrt import assets

DEFAULT_SPLIT = assets.data("corpus_split.json")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
SPLIT_FORMAT = 1


class SplitError(ValueError):
    """The recorded split cannot be used with this machine's stdlib; the message says why."""


class SplitMismatchWarning(UserWarning):
    """This machine's stdlib differs from the recorded one (another patch version, usually)."""


@dataclass(frozen=True)
class SourceFile:
    rel: str  # POSIX path relative to the stdlib root
    path: Path
    sha256: str
    size: int  # bytes

    def text(self) -> str:
        return self.path.read_bytes().decode("utf-8")


@dataclass(frozen=True)
class SplitRule:
    salt: str = "iquestrt-corpus-split-v1:"
    heldout_per_mille: int = 50  # ~5% held out
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0 < self.heldout_per_mille < 1000:
            raise SplitError(
                f"heldout_per_mille must be in (0, 1000), got {self.heldout_per_mille}"
            )
        if self.max_bytes <= 0:
            raise SplitError(f"max_bytes must be positive, got {self.max_bytes}")

    def is_heldout(self, rel: str) -> bool:
        h = hashlib.sha256((self.salt + rel).encode("utf-8")).hexdigest()
        return int(h[:16], 16) % 1000 < self.heldout_per_mille

    def describe(self) -> str:
        return (
            f"held out iff int(sha256(salt + relative_path)[:16], 16) % 1000 < "
            f"{self.heldout_per_mille}; *.py under the stdlib root, skipping {list(SKIP_DIRS)}, "
            f"config-*/ and _sysconfigdata_*.py, files > {self.max_bytes} bytes and files that "
            f"are not valid UTF-8"
        )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("config-") or name.startswith(".")


def enumerate_stdlib(root: Path | None = None, max_bytes: int = SplitRule.max_bytes):
    """Eligible source files under `root`, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise SplitError(f"stdlib root {root} is not a directory")
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("_sysconfigdata_"):
                continue
            path = Path(dirpath) / name
            if not path.is_file() or path.stat().st_size > max_bytes:
                continue
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            rel = path.relative_to(root).as_posix()
            out.append(SourceFile(rel, path, hashlib.sha256(data).hexdigest(), len(data)))
    out.sort(key=lambda f: f.rel)
    return out


def train_digest(files) -> str:
    """sha256 over the sorted `path sha256` lines: detects any change to the train set."""
    lines = "".join(f"{f.rel} {f.sha256}\n" for f in sorted(files, key=lambda f: f.rel))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def build_split(root: Path | None = None, rule: SplitRule = SplitRule()) -> dict:
    root = Path(root) if root is not None else stdlib_root()
    files = enumerate_stdlib(root, rule.max_bytes)
    held = [f for f in files if rule.is_heldout(f.rel)]
    train = [f for f in files if not rule.is_heldout(f.rel)]
    return {
        "format": SPLIT_FORMAT,
        "python": platform.python_version(),
        "stdlib_root": root.name,
        "rule": {**asdict(rule), "text": rule.describe()},
        "train": {
            "files": len(train),
            "bytes": sum(f.size for f in train),
            "digest": train_digest(train),
        },
        "heldout": {
            "files": len(held),
            "bytes": sum(f.size for f in held),
            "entries": [{"path": f.rel, "sha256": f.sha256, "bytes": f.size} for f in held],
        },
    }


def write_split(record: dict, out: Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Split:
    rule: SplitRule
    train: tuple[SourceFile, ...]  # local files the rule keeps for training
    heldout: tuple[SourceFile, ...]  # local files whose path is in the record
    missing: tuple[str, ...]  # recorded held-out paths absent here
    changed: tuple[str, ...]  # recorded held-out paths whose sha256 differs here
    train_matches: bool  # local train set has the recorded count, bytes and digest


def _read_record(path: Path) -> dict:
    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SplitError(f"{path}: cannot read split record: {e}") from None
    for key in ("format", "python", "stdlib_root", "rule", "train", "heldout"):
        if key not in rec:
            raise SplitError(f"{path}: missing key {key!r}")
    if rec["format"] != SPLIT_FORMAT:
        raise SplitError(f"{path}: format {rec['format']}, this code reads {SPLIT_FORMAT}")
    return rec


def load_split(
    path: Path = DEFAULT_SPLIT, root: Path | None = None, max_missing_frac: float = 0.10
) -> Split:
    path = Path(path)
    rec = _read_record(path)
    r = rec["rule"]
    rule = SplitRule(r["salt"], r["heldout_per_mille"], r["max_bytes"])
    entries = rec["heldout"]["entries"]
    bad = [e["path"] for e in entries if not rule.is_heldout(e["path"])]
    if bad or len(entries) != rec["heldout"]["files"]:
        raise SplitError(
            f"{path}: held-out list disagrees with its own rule ({len(bad)} paths the rule "
            f"keeps for training, e.g. {bad[:3]}; {len(entries)} entries vs files="
            f"{rec['heldout']['files']})"
        )
    root = Path(root) if root is not None else stdlib_root()
    local = {f.rel: f for f in enumerate_stdlib(root, rule.max_bytes)}
    missing = tuple(e["path"] for e in entries if e["path"] not in local)
    changed = tuple(
        e["path"] for e in entries if e["path"] in local and local[e["path"]].sha256 != e["sha256"]
    )
    heldout = tuple(local[e["path"]] for e in entries if e["path"] in local)
    train = tuple(f for rel, f in local.items() if not rule.is_heldout(rel))
    t = rec["train"]
    t_bytes = sum(f.size for f in train)
    train_matches = (
        len(train) == t["files"] and t_bytes == t["bytes"] and train_digest(train) == t["digest"]
    )
    where = (
        f"{path} (recorded Python {rec['python']}, {rec['stdlib_root']}) vs {root} "
        f"(running Python {platform.python_version()})"
    )
    train_short = max(0, t["files"] - len(train))
    if len(missing) > max_missing_frac * len(entries) or train_short > max_missing_frac * t[
        "files"
    ]:
        raise SplitError(
            f"{where}: {len(missing)} of {len(entries)} held-out files and {train_short} of "
            f"{t['files']} train files are missing (limit {max_missing_frac:.0%}); "
            f"regenerate with `python -m corpus.stdlib --out {path}`"
        )
    if missing or changed or not train_matches:
        warnings.warn(
            SplitMismatchWarning(
                f"{where}: held-out: {len(missing)} missing, {len(changed)} changed (sha256), "
                f"{len(heldout) - len(changed)} identical of {len(entries)}; train: recorded "
                f"{t['files']} files / {t['bytes']} bytes, here {len(train)} files / {t_bytes} "
                f"bytes, digest {'matches' if train_matches else 'differs'}"
            ),
            stacklevel=2,
        )
    return Split(rule, train, heldout, missing, changed, train_matches)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="record the stdlib train/held-out split")
    ap.add_argument("--out", type=Path, default=DEFAULT_SPLIT)
    ap.add_argument("--root", type=Path, default=None, help="stdlib root (default: this Python's)")
    a = ap.parse_args(argv)
    rec = build_split(a.root)
    write_split(rec, a.out)
    print(
        f"{a.out}: train {rec['train']['files']} files / {rec['train']['bytes']} bytes, "
        f"held out {rec['heldout']['files']} files / {rec['heldout']['bytes']} bytes"
    )


if __name__ == "__main__":
    main()
