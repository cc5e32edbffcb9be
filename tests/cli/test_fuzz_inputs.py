"""Fuzzing what a user can type or ship (hypothesis): a tiny checkpoint's config.json fields and
tensors, the CLI's arguments, the API's SamplingParams and the server's request bodies. Every
case ends in a clean decode or one error line (CLI) / a documented exception (API) / a 400 JSON
body (HTTP); never a traceback, an internal error, a partial output or a changed input file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from iquestrt.cli import main
from tests.helpers.ckpt_helpers import tree_digest

FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
GEN = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--quiet"]


def outcome(argv, capsys) -> tuple[int, str]:
    """main's status and stderr, asserting the contract: 0, or one `iquestrt: error:` line
    with status 1 or 2 (70 is an internal error: a defect, whatever the input)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals (one line, exit 2: iquestrt/cli.py)
        code = e.code
    err = capsys.readouterr().err.strip()
    if code != 0:
        assert code in (1, 2), (argv, code, err)
        assert len(err.splitlines()) == 1 and err.startswith("iquestrt: error:"), (argv, err)
    return code, err


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
raw_numbers = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1e-400"])


def _config_fields(tiny: Path) -> list[str]:
    return sorted(json.loads((tiny / "config.json").read_text()))


@FUZZ
@given(data=st.data())
def test_config_json_fields(tiny, tmp_path_factory, capsys, data):
    ck = Path(shutil.copytree(tiny, tmp_path_factory.mktemp("cfg") / "ck"))
    part = data.draw(st.sampled_from(["config.json", "mtp/config.json"]))
    path = ck / part
    d = json.loads(path.read_text())
    key = data.draw(st.sampled_from(sorted(d)) | st.text(min_size=1, max_size=10))
    if data.draw(st.booleans()):
        d[key] = data.draw(json_values)
        path.write_text(json.dumps(d))
    else:  # a literal JSON cannot spell through json.dumps
        d[key] = "@"
        path.write_text(json.dumps(d).replace('"@"', data.draw(raw_numbers)))
    before = tree_digest(ck)
    backend = data.draw(st.sampled_from(["reference", "runtime"]))
    outcome(["generate", "--checkpoint", str(ck), "--backend", backend, *GEN], capsys)
    assert tree_digest(ck) == before


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_tensor_values(tiny, tmp_path_factory, capsys, data):
    ck = Path(shutil.copytree(tiny, tmp_path_factory.mktemp("tensor") / "ck"))
    shard = data.draw(st.sampled_from(sorted(ck.rglob("*.safetensors"))))
    tensors = load_file(str(shard))
    name = data.draw(st.sampled_from(sorted(tensors)))
    t = tensors[name].clone()
    value = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 3e38, 1e38,
                                       0.0, -1.0, 1e-30]))
    flat = t.view(-1)
    i = data.draw(st.integers(0, flat.numel() - 1))
    flat[i] = torch.tensor(value).to(t.dtype) if t.dtype.is_floating_point else 0
    tensors[name] = t
    save_file(tensors, str(shard), metadata={"format": "pt"})
    before = tree_digest(ck)
    backend = data.draw(st.sampled_from(["reference", "runtime"]))
    outcome(["generate", "--checkpoint", str(ck), "--backend", backend, *GEN], capsys)
    assert tree_digest(ck) == before


FLAGS = {
    "--max-new-tokens": st.sampled_from(["-5", "0", "1", "3", "5000", "9" * 30, "2.5"]),
    "--seed": st.integers(-2, 2**65).map(str),
    "--temperature": st.sampled_from(["0", "1", "-1", "nan", "inf", "1e308", "x"]),
    "--top-k": st.integers(-2, 100).map(str),
    "--top-p": st.sampled_from(["0", "0.5", "1", "1.5", "nan", "-0"]),
    "--ring-pad": st.integers(-2, 10**10).map(str),
    "--draft-depth": st.sampled_from(["0", "3", "7", "8", "-1", "adaptive", "x"]),
    "--stop-ids": st.sampled_from(["0", "1,2", "99999", "-1", "a"]),
    "--prompt-ids": st.sampled_from(["1,2,3", "", "-1", "99999", "1,,2", "1" + ",1" * 5000]),
}


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_generate_arguments(tiny, capsys, data):
    chosen = data.draw(st.lists(st.sampled_from(sorted(FLAGS)), unique=True, max_size=4))
    argv = ["generate", "--checkpoint", str(tiny),
            "--backend", data.draw(st.sampled_from(["reference", "runtime"]))]
    if "--prompt-ids" not in chosen:
        argv += ["--prompt-ids", "1,2,3"]
    if "--max-new-tokens" not in chosen:
        argv += ["--max-new-tokens", "2"]
    for flag in chosen:
        argv += [flag, data.draw(FLAGS[flag])]
    before = tree_digest(tiny)
    outcome([*argv, "--quiet"], capsys)
    assert tree_digest(tiny) == before


@settings(FUZZ, max_examples=15)
@given(kind=st.sampled_from(["report", "experiment", "make-checkpoint", "convert"]),
       where=st.sampled_from(["{ck}", "{ck}/mtp", "{ck}/..", "{ck}/model-00001-of-00001"
                                                            ".safetensors", "{tmp}/new"]),
       force=st.booleans())
def test_writer_outputs(tiny, tmp_path_factory, capsys, kind, where, force):
    tmp = tmp_path_factory.mktemp("writers")
    ck = Path(shutil.copytree(tiny, tmp / "ck"))
    out = where.format(ck=ck, tmp=tmp)
    (tmp / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    argv = {
        "report": ["report", "acceptance", "--checkpoint", str(ck), "--prompts",
                   str(tmp / "p.jsonl"), "--limit", "1", "--max-new-tokens", "2", "--quiet"],
        "experiment": ["experiment", "--checkpoint", str(ck), "--prompts", str(tmp / "p.jsonl"),
                       "--control", "depth=1", "--candidate", "depth=2", "--max-new-tokens",
                       "2", "--resamples", "10", "--quiet"],
        "make-checkpoint": ["make-checkpoint", "--preset", "tiny"],
        "convert": ["convert", "--checkpoint", str(ck), "--quantize"],
    }[kind] + ["--out", out] + (["--force"] if force and kind in ("report", "experiment")
                                else [])
    before = tree_digest(ck)
    code, err = outcome(argv, capsys)
    assert tree_digest(ck) == before, (argv, err)
    leftovers = [p.name for p in Path(out).parent.iterdir() if ".tmp-" in p.name] \
        if Path(out).parent.is_dir() else []
    assert not leftovers
    if kind == "convert" and code != 0:  # the tiny checkpoint is FP8: convert wants BF16
        assert "expected 'bf16'" in err or "the --checkpoint" in err, err


@FUZZ
@given(fields=st.dictionaries(
    st.sampled_from(["temperature", "top_k", "top_p", "max_tokens", "seed", "stop_token_ids",
                     "ignore_eos"]),
    json_values | st.integers(-3, 70) | st.floats(), max_size=4))
def test_sampling_params(fields):
    from iquestrt import SamplingParams

    try:
        SamplingParams(**fields)
    except ValueError:
        pass  # the documented type for every bad value (iquestrt/errors.py)
