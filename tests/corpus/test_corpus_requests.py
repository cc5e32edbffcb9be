"""The committed request sets: provenance, prompt rules per kind, lengths, exact regeneration."""

import ast
import json
import textwrap
from collections import Counter

import pytest

from corpus.requests import (
    DEFAULT_REQUESTS,
    FIELDS,
    KINDS,
    RequestError,
    RequestSpec,
    check_request,
    load_requests,
    write_requests,
)
from corpus.sites import line_starts
from corpus.stdlib import DEFAULT_SPLIT, stdlib_root
from corpus.tokenizer import DEFAULT_TOKENIZER


@pytest.fixture(scope="module")
def records():
    return load_requests()


def _source(r):
    return (stdlib_root() / r["path"]).read_bytes().decode("utf-8")


def test_counts_lengths_and_buckets(records, tok):
    spec = RequestSpec()
    assert len({r["id"] for r in records}) == len(records) == 3 * spec.per_kind
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        n = [len(tok.encode(r["prompt"]).ids) for r in rs]
        assert n == [r["prompt_tokens"] for r in rs]
        assert min(n) >= 300 and max(n) <= 3000
        assert sum(x > 512 for x in n) >= 12, "half the prompts must exceed a 512 window"
        b = spec.bounds
        per = Counter(next(i for i in range(4) if x < b[i + 1] or i == 3) for x in n)
        assert per == {i: 6 for i in range(4)}
        assert max(Counter(r["path"] for r in rs).values()) <= spec.per_file_cap


@pytest.mark.slow
def test_sources_are_heldout_and_records_consistent(records, split, tok):
    held = {f.rel: f.sha256 for f in split.heldout}
    for r in records:
        assert held.get(r["path"]) == r["source_sha256"], r["id"]
        assert check_request(r, _source(r), tok) == [], r["id"]


def _header_parse(r, src, end):
    """The site's text from its def/class line to `end`, dedented, must parse as one header
    followed by a stub body: proof that the prompt ends right where the rule says."""
    start = line_starts(src)[r["line"] - 1]
    text = textwrap.dedent(src[start:end])
    (node,) = ast.parse(text + "\n    ...\n").body
    assert node.name == r["qualname"].rsplit(".", 1)[-1], r["id"]
    return node


def test_prompt_rules_per_kind(records, split):
    for r in records:
        src = _source(r)
        assert r["prompt"].startswith(src[r["char_start"] : r["char_end"]])
        if r["kind"] == "completion":
            node = _header_parse(r, src, r["char_end"])
            assert len(node.body) == 1 and r["suffix"] == ""  # nothing of the body in the prompt
            assert src[r["target_start"] : r["target_end"]].strip()
        elif r["kind"] == "docstring":
            node = _header_parse(r, src, r["char_end"])
            assert len(node.body) == 2 and isinstance(node.body[0].value.value, str)
            assert src[r["target_start"] : r["target_end"]].strip()  # statements follow
        else:
            marker, _, header = r["suffix"].partition("\n")
            assert marker.strip().startswith("# TODO(edit): rework ") and r["qualname"] in marker
            _header_parse(r, src, r["target_start"])
            assert header == src[r["target_start"] - len(header) : r["target_start"]]
            site = src[line_starts(src)[r["line"] - 1] : r["target_end"]]
            assert site in r["prompt"][: -len(r["suffix"])]  # the whole function is context


def test_check_request_catches_tampering(records, split, tok):
    r = next(x for x in records if x["kind"] == "edit")
    src = _source(r)
    assert check_request(r, src, tok) == []
    starts = line_starts(src)
    nxt = starts[starts.index(r["char_end"]) + 1]
    broken = [
        ({**r, "prompt": r["prompt"][:-2] + "x\n"}, "prompt is not source"),
        ({**r, "prompt_tokens": r["prompt_tokens"] + 1}, "tokens, recorded"),
        ({**r, "char_end": nxt, "prompt": src[r["char_start"] : nxt] + r["suffix"]}, "differ"),
        ({**r, "suffix": r["suffix"].replace("rework", "fix")}, "differ from the edit rule"),
        ({**r, "target_end": r["target_end"] - 1}, "differ from the edit rule"),
        ({**r, "id": r["id"].replace("edit:", "completion:")}, "differ from the completion"),
        ({**r, "char_start": r["char_start"] + 1}, "is not a line start"),
    ]
    for b, why in broken:
        assert any(why in p for p in check_request(b, src, tok)), (why, b["id"])
    other = src.replace("def ", "def  ", 1)  # another version of the file
    assert any("source sha256" in p for p in check_request(r, other, tok))


def test_load_errors(tmp_path):
    with pytest.raises(RequestError, match="kind 'chat'"):
        load_requests(tmp_path, "chat")
    with pytest.raises(RequestError, match="completion.jsonl: no such request file"):
        load_requests(tmp_path, "completion")
    rec = dict.fromkeys(FIELDS, 0) | {"kind": "edit"}
    (tmp_path / "completion.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(RequestError, match=r"completion.jsonl:1: kind 'edit'"):
        load_requests(tmp_path, "completion")
    del rec["suffix"]
    (tmp_path / "completion.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(RequestError, match=r"completion.jsonl:1: fields"):
        load_requests(tmp_path, "completion")


@pytest.mark.slow
def test_regeneration_reproduces_the_committed_files(tmp_path, split):
    m = write_requests(tmp_path, DEFAULT_TOKENIZER, DEFAULT_SPLIT)
    for name in [f"{k}.jsonl" for k in KINDS] + ["manifest.json"]:
        assert (tmp_path / name).read_bytes() == (DEFAULT_REQUESTS / name).read_bytes(), name
    assert set(m["files"]) == {f"{k}.jsonl" for k in KINDS}
