"""training/train.py on the CPU with the tiny preset: a short run exports a checkpoint that
reference/checkpoint.py loads and reference/model.py runs; an interrupted run resumed from its
state ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from reference.checkpoint import load_checkpoint
from reference.config import preset
from reference.model import ReferenceModel
from training.config import TrainConfigError
from training.model import init_params
from training.train import STATE, ResumeError, main

VOCAB = 512  # tiny


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    gen = np.random.Generator(np.random.PCG64(7))
    gen.integers(0, VOCAB, 4000).astype(np.uint16).tofile(d / "train.bin")
    gen.integers(0, VOCAB, 600).astype(np.uint16).tofile(d / "heldout.bin")
    words = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    Tokenizer(WordLevel(words, unk_token="<|endoftext|>")).save(str(d / "tokenizer.json"))
    return d


def _argv(data, out, *extra):
    return ["--data", str(data), "--out", str(out), "--preset", "tiny", "--device", "cpu",
            "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "64", "--log-every", "1",
            *extra]


def _state(out):
    return torch.load(out / STATE, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_short_run_exports_a_loadable_checkpoint(data_dir, tmp_path):
    out = tmp_path / "run"
    report = main(_argv(data_dir, out, "--max-steps", "3"))
    cfg = preset("tiny")
    assert report["steps"] == 3 and report["tokens"] == 3 * 2 * 32
    assert report["stopped_by"] == "steps"
    on_disk = json.loads((out / "checkpoint" / "training_report.json").read_text())
    assert on_disk["heldout_loss"]["target"] == report["heldout_loss"]["target"]
    for loss in (report["train_loss"], report["heldout_loss"]):
        assert len(loss["draft"]) == cfg.draft.num_draft_slots
        assert all(np.isfinite([loss["target"], *loss["draft"]]))
    assert (out / "checkpoint" / "tokenizer.json").read_bytes() == (
        data_dir / "tokenizer.json").read_bytes()

    trained = _state(out)["model"]
    init = init_params(cfg, 0)
    assert any(not torch.equal(trained[n], init[n]) for n in init)  # the steps changed weights
    bf16 = load_checkpoint(out / "checkpoint-bf16")
    assert bf16.fmt == "bf16" and set(bf16.tensors) == set(trained)
    for name, t in trained.items():  # the export holds the trained weights, rounded once
        want = t if bf16.tensors[name].dtype == torch.float32 else t.to(torch.bfloat16)
        assert torch.equal(bf16.tensors[name], want), name

    ck = load_checkpoint(out / "checkpoint")
    assert ck.fmt == "fp8" and ck.tensors["model.layers.1.mlp.experts.fc"].dtype == (
        torch.float8_e4m3fn)
    ref = ReferenceModel(ck.cfg, ck.dequantized(), "fp32")
    tokens = torch.tensor([0, 5, 17, 300])
    out_t = ref.target(tokens, torch.arange(4))
    out_d = ref.draft(tokens[1:], out_t.hidden[:-1], torch.arange(1, 4))
    assert out_t.logits.shape == (4, VOCAB) and torch.isfinite(out_t.logits).all()
    assert torch.isfinite(out_d.logits).all()


@pytest.mark.slow
def test_resume_is_bit_identical(data_dir, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    main(_argv(data_dir, whole, "--max-steps", "4", "--ckpt-every", "3"))
    part = main(_argv(data_dir, split, "--max-steps", "4", "--stop-after", "2"))
    assert part == {"stopped_by": "stop_after", "step": 2}
    assert not (split / "checkpoint").exists()
    at_step_2 = _state(split)
    with pytest.raises(ResumeError, match="already exists"):
        main(_argv(data_dir, split, "--max-steps", "4"))
    with pytest.raises(ResumeError, match=r"different settings for \['lr'\]"):
        main(_argv(data_dir, split, "--resume", "--lr", "1e-3"))
    main(_argv(data_dir, split, "--resume"))
    a, b = _state(whole), _state(split)
    assert a["step"] == b["step"] == 4 and a["cursor"] == b["cursor"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(),
                      strict=True):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    # sensitivity: the same resume with the data cursor lost (batch 3 = batch 1 again) diverges
    torch.save({**at_step_2, "cursor": {"epoch": 0, "offset": 0}}, split / STATE)
    main(_argv(data_dir, split, "--resume"))
    c = _state(split)
    assert any(not torch.equal(a["model"][n], c["model"][n]) for n in a["model"])


def test_bad_settings_are_named(data_dir, tmp_path):
    with pytest.raises(TrainConfigError, match="seq_len=8: must exceed num_draft_slots"):
        main(_argv(data_dir, tmp_path / "x", "--seq-len", "8", "--max-steps", "1"))
    with pytest.raises(TrainConfigError, match="warmup_steps=5: without --max-steps"):
        main(_argv(data_dir, tmp_path / "x", "--warmup-steps", "5"))
    with pytest.raises(FileNotFoundError, match="nope.json: tokenizer JSON missing"):
        main(_argv(data_dir, tmp_path / "x", "--tokenizer", str(tmp_path / "nope.json"),
                   "--max-steps", "1"))
