"""Arm specs (iquestrt/experiment/arms.py) and the CLI's refusals: every bad spec or argument
ends in one clear message naming the flag, the spec and the problem, before any decoding."""

from __future__ import annotations

import re

import pytest

from iquestrt.cli import main
from iquestrt.config import RuntimeConfig
from iquestrt.experiment.arms import ArmSpec, ArmSpecError
from reference.config import preset
from reference.depth import AdaptiveDepth, FixedDepth

TINY = preset("tiny")
BASE = RuntimeConfig(ops="twins", ring_pad=8, max_positions=256)


def _rcfg(text: str) -> RuntimeConfig:
    return ArmSpec.parse("candidate", "--candidate", text).runtime_config(BASE, TINY)


def test_specs_apply_to_the_base():
    r = _rcfg("depth=5, sync_rounds=8 prefetch=off")
    assert (r.policy, r.sync_rounds, r.prefetch, r.max_width) == (FixedDepth(5), 8, False, 8)
    assert (r.ops, r.ring_pad, r.max_positions) == ("twins", 8, 256)  # untouched base fields
    assert isinstance(_rcfg("depth=adaptive").policy, AdaptiveDepth)
    assert _rcfg("max_width=4,depth=3").max_width == 4
    assert _rcfg("graphs=off").graphs is False


@pytest.mark.parametrize(("text", "match"), [
    ("", "empty spec"),
    ("depht=3",
     "unknown key 'depht'; allowed: depth, graphs, prefetch, sync_rounds, max_width, pdl"),
    ("depth", "'depth' is not key=value"),
    ("depth=3,depth=4", "key 'depth' given twice"),
    ("depth=9", "depth: draft depth policy '9'"),
    ("prefetch=maybe", "prefetch='maybe'; expected on/off"),
    ("sync_rounds=x", "sync_rounds='x'; expected an integer"),
    ("sync_rounds=0", r"RuntimeConfig.sync_rounds: must be an int in \[1, 64\]"),
    ("max_width=9", r"RuntimeConfig.max_width: must be an int in \[1, 8\]"),
    ("depth=7,max_width=4", "draft depth 7 needs 8 verification rows; max_width is 4"),
    ("graphs=on", "RuntimeConfig.graphs: CUDA graphs need a CUDA device"),
    ("pdl=on", "RuntimeConfig.pdl: programmatic dependent launch needs ops='kernels' on a CUDA"),
    ("pdl=2", "pdl='2'; expected on/off"),
])
def test_bad_specs_are_named(text, match):
    with pytest.raises(ArmSpecError, match=match) as e:
        _rcfg(text)
    assert str(e.value).startswith(f"--candidate {text!r}: ")


def _cli(tiny_dir, prompts_file, out, *extra):
    return main(["experiment", "--checkpoint", str(tiny_dir), "--prompts", str(prompts_file),
                 "--out", str(out), "--seeds", "0", "1", "--control", "depth=3", *extra])


@pytest.mark.parametrize(("extra", "match"), [
    (["--candidate", "depht=3"], "--candidate 'depht=3': unknown key 'depht'"),
    (["--candidate", "depth=2", "--n-prompts", "0"], "--n-prompts: must be >= 1"),
    (["--candidate", "depth=2", "--max-new-tokens", "1"], "max_new_tokens must be >= 2"),
    (["--candidate", "depth=2", "--seeds", "4", "4"], r"seeds \[4, 4\] repeat a seed"),
])
def test_cli_refuses_bad_arguments(tiny_dir, prompts_file, tmp_path, capsys, extra, match):
    assert _cli(tiny_dir, prompts_file, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("iquestrt: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_existing_out_without_force(tiny_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    assert _cli(tiny_dir, prompts_file, out, "--candidate", "depth=2") == 2
    assert "already exists (pass --force to replace it)" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "previous"
