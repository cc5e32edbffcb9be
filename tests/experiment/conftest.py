"""Shared inputs of the experiment tests: the tiny correlated checkpoint (drafts accepted often
but not always) and a JSONL file of two short token-id prompts."""

import json

import pytest

from tests.helpers.engine_setup import make_ckpt

PROMPTS = ((5, 17, 300, 22, 9, 411, 78, 150, 3, 64, 200, 7), (40, 41, 42, 43, 44, 45, 46, 47, 48))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("tiny-corr"), "correlated")


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "ids.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": list(p)}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path
