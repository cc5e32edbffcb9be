"""Shared inputs of the report tests: the committed mini model and a two-prompt JSONL file cut
from the committed request set (text prompts, so the checkpoint's tokenizer is exercised)."""

import json
from pathlib import Path

import pytest

from corpus.requests import load_requests

REPO = Path(__file__).resolve().parents[2]
MINI = REPO / "models" / "mini"


@pytest.fixture(scope="session")
def mini() -> Path:
    return MINI


@pytest.fixture(scope="session")
def two_prompts(tmp_path_factory) -> Path:
    recs = load_requests(kind="completion")[:1] + load_requests(kind="docstring")[:1]
    path = tmp_path_factory.mktemp("prompts") / "two.jsonl"
    lines = [json.dumps({"id": r["id"], "kind": r["kind"], "prompt": r["prompt"]}) for r in recs]
    path.write_text("\n".join(lines) + "\n")
    return path
