"""Versioned request (prompt) sets built from held-out stdlib files only.

Three kinds; every prompt is `source[char_start:char_end] + suffix`, cut on line boundaries,
and `source[target_start:target_end]` is the original continuation (for acceptance studies):
- completion: the file up to and including a `def` header (decorators too) of a function with
  a body of >= min_body_lines lines; target = the body.
- docstring: the file up to and including the last line of a function's or class's docstring,
  when statements follow it; target = the rest of the node.
- edit: context around a function (the file before it, the function, then up to
  edit_after_lines lines after it), followed by the suffix
  `<indent># TODO(edit): rework <words of the name> (<qualname> above)\\n<original header>`:
  the continuation is a rewritten body. No other instruction text is added.
The beginning of a long file is dropped, at a line start, until the prompt has at most
max_tokens tokens; a candidate whose site would be cut, or shorter than bounds[0], is skipped.

Selection per kind is deterministic: candidates are visited in order of sha256(salt + id),
each is placed in its token-length bucket [bounds[i], bounds[i+1]) (the last bucket includes
max) until every bucket holds per_kind / n_buckets, with at most per_file_cap per file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer

from corpus.sites import Site, find_sites, line_starts, next_line_start
from corpus.stdlib import DEFAULT_SPLIT, SourceFile, load_split
from corpus.tokenizer import DEFAULT_TOKENIZER, file_sha256, load_tokenizer
from iquestrt import assets

DEFAULT_REQUESTS = assets.data("requests", "v1")
KINDS = ("completion", "docstring", "edit")
FIELDS = ("id", "kind", "path", "source_sha256", "qualname", "line", "char_start", "char_end",
          "suffix", "target_start", "target_end", "prompt_tokens", "prompt")


class RequestError(ValueError):
    """A request set cannot be built or read; the message names the file, kind or field."""


@dataclass(frozen=True)
class RequestSpec:
    version: str = "v1"
    per_kind: int = 24
    bounds: tuple[int, ...] = (300, 512, 1024, 2048, 3000)  # token buckets; min and max
    per_file_cap: int = 2  # per kind
    min_body_lines: int = 3
    edit_after_lines: int = 24
    salt: str = "iquestrt-requests-v1:"

    def __post_init__(self) -> None:
        nb = len(self.bounds) - 1
        if nb < 1 or list(self.bounds) != sorted(set(self.bounds)) or self.bounds[0] < 1:
            raise RequestError(f"bounds must be >= 2 increasing positive ints, got {self.bounds}")
        if self.per_kind <= 0 or self.per_kind % nb:
            raise RequestError(f"per_kind={self.per_kind} must be a positive multiple of {nb}")

    def bucket(self, n: int) -> int | None:
        if not self.bounds[0] <= n <= self.bounds[-1]:
            return None
        return min(bisect_right(self.bounds, n) - 1, len(self.bounds) - 2)


@dataclass(frozen=True)
class Candidate:
    id: str
    kind: str
    file: SourceFile
    site: Site
    end: int  # prompt's source span ends here
    suffix: str
    target: tuple[int, int]


def describe(site: Site) -> str:
    name = site.qualname.rsplit(".", 1)[-1]
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).replace("_", " ").lower().split()
    return f"rework {' '.join(words) or name} ({site.qualname} above)"


def candidates(f: SourceFile, text: str, spec: RequestSpec) -> list[Candidate]:
    starts = line_starts(text)
    out: list[Candidate] = []
    for s in find_sites(text):
        if s.body_lines < spec.min_body_lines:
            continue
        base = f"{f.rel}:{s.qualname}@{s.line}"
        if s.kind == "def":
            out.append(Candidate(f"completion:{base}", "completion", f, s, s.header_end, "",
                                 (s.header_end, s.end)))
            after = starts[min(s.end_line + spec.edit_after_lines, len(starts) - 1)]
            suffix = f"{s.indent}# TODO(edit): {describe(s)}\n" + text[s.start : s.header_end]
            out.append(Candidate(f"edit:{base}", "edit", f, s, after, suffix,
                                 (s.header_end, s.end)))
        if s.doc_end is not None and s.doc_end < s.end:
            out.append(Candidate(f"docstring:{base}", "docstring", f, s, s.doc_end, "",
                                 (s.doc_end, s.end)))
    return out


def fit_window(tok: Tokenizer, text: str, offsets: list[int], c: Candidate, max_tokens: int):
    """(char_start, n_tokens) of a line-aligned window ending at c.end with <= max_tokens
    tokens (the whole prefix if it fits, else about its last max_tokens), or None if the
    window would have to start after the site."""
    starts = line_starts(text)
    j = bisect_left(offsets, c.end)  # tokens of the whole-file encoding that start before end
    k = j - (max_tokens - len(tok.encode(c.suffix, add_special_tokens=False).ids))
    start = next_line_start(starts, offsets[k] if k > 0 else 0)
    # The whole-file token boundaries only approximate the window's; step forward until exact.
    while start <= c.site.start:
        n = len(tok.encode(text[start : c.end] + c.suffix, add_special_tokens=False).ids)
        if n <= max_tokens:
            return start, n
        start = next_line_start(starts, start + 1)
    return None


def select(files, tok: Tokenizer, spec: RequestSpec) -> dict[str, list[dict]]:
    texts, offsets, cands = {}, {}, []
    for f in files:
        text = f.text()
        try:
            cands += candidates(f, text, spec)
        except (SyntaxError, ValueError):
            continue  # not parseable by this Python (test fixtures): no sites
        texts[f.rel] = text
    nb = len(spec.bounds) - 1
    per_bucket = spec.per_kind // nb
    key = {c.id: hashlib.sha256((spec.salt + c.id).encode("utf-8")).hexdigest() for c in cands}
    out: dict[str, list[dict]] = {}
    for kind in KINDS:
        fill, per_file, chosen = [0] * nb, {}, []
        pool = sorted((c for c in cands if c.kind == kind), key=lambda c: key[c.id])
        for c in pool:
            if per_file.get(c.file.rel, 0) >= spec.per_file_cap:
                continue
            text = texts[c.file.rel]
            if c.file.rel not in offsets:
                enc = tok.encode(text, add_special_tokens=False)
                offsets[c.file.rel] = [a for a, _ in enc.offsets]
            w = fit_window(tok, text, offsets[c.file.rel], c, spec.bounds[-1])
            b = spec.bucket(w[1]) if w else None
            if b is None or fill[b] >= per_bucket:
                continue
            fill[b] += 1
            per_file[c.file.rel] = per_file.get(c.file.rel, 0) + 1
            chosen.append(_record(c, text, *w))
            if min(fill) == per_bucket:
                break
        if min(fill) < per_bucket:
            raise RequestError(
                f"kind {kind}: buckets {list(spec.bounds)} filled {fill} of {per_bucket} each "
                f"from {len(pool)} candidates in {len(texts)} parseable held-out files"
            )
        out[kind] = sorted(chosen, key=lambda r: (r["prompt_tokens"], r["id"]))
    return out


def _record(c: Candidate, text: str, start: int, n: int) -> dict:
    vals = (c.id, c.kind, c.file.rel, c.file.sha256, c.site.qualname, c.site.line, start, c.end,
            c.suffix, c.target[0], c.target[1], n, text[start : c.end] + c.suffix)
    return dict(zip(FIELDS, vals, strict=True))


def write_requests(out: Path, tokenizer_path: Path, split_path: Path,
                   spec: RequestSpec = RequestSpec()) -> dict:
    tok = load_tokenizer(tokenizer_path)
    split = load_split(split_path)
    sets = select(split.heldout, tok, spec)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "version": spec.version,
        "python": platform.python_version(),
        "tokenizer_sha256": file_sha256(tokenizer_path),
        "split_sha256": file_sha256(split_path),
        "spec": asdict(spec),
        "fields": list(FIELDS),
        "files": {},
    }
    for kind, recs in sets.items():
        path = out / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
        manifest["files"][path.name] = {"records": len(recs), "sha256": file_sha256(path)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def load_requests(path: Path = DEFAULT_REQUESTS, kind: str | None = None) -> list[dict]:
    """Records of one kind (or all kinds in KINDS order); checks fields and the prompt rule."""
    kinds = KINDS if kind is None else (kind,)
    if kind is not None and kind not in KINDS:
        raise RequestError(f"kind {kind!r} not in {KINDS}")
    out = []
    for k in kinds:
        p = Path(path) / f"{k}.jsonl"
        if not p.is_file():
            raise RequestError(f"{p}: no such request file")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise RequestError(f"{p}:{i}: not JSON: {e}") from None
            if tuple(r) != FIELDS:
                raise RequestError(f"{p}:{i}: fields {list(r)}, expected {list(FIELDS)}")
            if r["kind"] != k:
                raise RequestError(f"{p}:{i}: kind {r['kind']!r} in the {k} file")
            out.append(r)
    return out


def check_request(r: dict, source: str, tok: Tokenizer, spec: RequestSpec = RequestSpec()):
    """Problems of one record against its source text (empty: consistent)."""
    probs = []
    sha = hashlib.sha256(source.encode("utf-8")).hexdigest()
    if sha != r["source_sha256"]:
        probs.append(f"{r['id']}: source sha256 {sha[:12]} != recorded {r['source_sha256'][:12]}")
    if r["prompt"] != source[r["char_start"] : r["char_end"]] + r["suffix"]:
        probs.append(f"{r['id']}: prompt is not source[char_start:char_end] + suffix")
    n = len(tok.encode(r["prompt"], add_special_tokens=False).ids)
    if n != r["prompt_tokens"]:
        probs.append(f"{r['id']}: prompt has {n} tokens, recorded {r['prompt_tokens']}")
    f = SourceFile(r["path"], Path(r["path"]), sha, len(source.encode("utf-8")))
    try:
        c = {c.id: c for c in candidates(f, source, spec)}.get(r["id"])
    except (SyntaxError, ValueError) as e:
        return probs + [f"{r['id']}: source does not parse: {e}"]
    if c is None:
        return probs + [f"{r['id']}: no such {r['kind']} site in the source under {spec}"]
    if (r["char_end"], r["suffix"], (r["target_start"], r["target_end"])) != (
        c.end, c.suffix, c.target
    ):
        probs.append(f"{r['id']}: char_end, suffix or target differ from the {c.kind} rule")
    if r["char_start"] not in line_starts(source) or r["char_start"] > c.site.start:
        probs.append(f"{r['id']}: char_start={r['char_start']} is not a line start before the site")
    if spec.bucket(n) is None:
        probs.append(f"{r['id']}: {n} tokens outside {spec.bounds[0]}..{spec.bounds[-1]}")
    return probs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="build the versioned request sets")
    ap.add_argument("--out", type=Path, default=DEFAULT_REQUESTS)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--split", type=Path, default=DEFAULT_SPLIT)
    a = ap.parse_args(argv)
    m = write_requests(a.out, a.tokenizer, a.split)
    for name, info in m["files"].items():
        print(f"{a.out / name}: {info['records']} records")


if __name__ == "__main__":
    main()
