"""Shared inputs of the report tests: the committed mini model and a two-prompt JSONL file cut
from the committed request set (text prompts, so the checkpoint's tokenizer is exercised); and a
reference Wilson interval for the summary tests."""

import json
import math
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


def wilson95(k: int, n: int) -> tuple[float, float]:
    """Wilson's 95 % score interval of k / n, from its closed form (the report takes scipy's)."""
    z = 1.959963984540054
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)  # rounding at k = 0 or n
