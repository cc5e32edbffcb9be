"""`iquestrt` CLI: make-checkpoint, convert, generate; errors are one line with exit code 2."""

from __future__ import annotations

import pytest
import torch

from iquestrt.cli import main
from reference.checkpoint import load_checkpoint
from reference.config import SamplingDefaults
from reference.model import ReferenceModel
from reference.ops import quantize_block
from reference.speculative import GenerationRequest, generate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert main(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0
    return out


def _tokens(stdout: str) -> list[int]:
    return [int(x) for x in stdout.strip().splitlines()[0].split()]


def test_generate_prints_the_reference_tokens(ckpt, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3"]
    argv += ["--max-new-tokens", "12", "--seed", "4", "--draft-depth", "2", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr()
    loaded = load_checkpoint(ckpt)
    model = ReferenceModel(loaded.cfg, loaded.dequantized(), precision="bf16")
    want = generate(model, GenerationRequest((1, 2, 3), 12, loaded.cfg.sampling, 4), depth=2)
    assert _tokens(out.out) == want.tokens
    drafts = [r for r in want.rounds if r.drafts]
    mean = 1 + sum(r.accepted for r in drafts) / len(drafts)  # vLLM's definition
    assert f"mean acceptance length {mean:.2f} (vLLM's: 1 + accepted / drafts)" in out.err
    assert f"{len(want.rounds)} rounds" in out.err and "prefill" in out.err


def test_generate_sampling_flags_override_defaults(ckpt, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "5,6", "--max-new-tokens"]
    argv += ["8", "--temperature", "0", "--draft-depth", "0", "--precision", "fp32", "--quiet"]
    assert main(argv) == 0
    loaded = load_checkpoint(ckpt)
    model = ReferenceModel(loaded.cfg, loaded.dequantized(), precision="fp32")
    greedy = SamplingDefaults(temperature=0.0, top_k=20, top_p=0.95)
    want = generate(model, GenerationRequest((5, 6), 8, greedy, 0)).tokens
    assert _tokens(capsys.readouterr().out) == want


def test_convert_quantizes_a_bf16_checkpoint(tmp_path):
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    assert (
        main(["make-checkpoint", "--preset", "tiny", "--out", str(bf16), "--format", "bf16"]) == 0
    )
    assert main(["convert", "--checkpoint", str(bf16), "--out", str(fp8), "--quantize"]) == 0
    a, b = load_checkpoint(bf16), load_checkpoint(fp8)
    assert (a.fmt, b.fmt) == ("bf16", "fp8")
    name = "model.layers.1.mlp.experts.fc"
    assert b.tensors[name].dtype == torch.float8_e4m3fn
    q, scale = quantize_block(a.dequantized()[name])
    assert torch.equal(b.tensors[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(b.tensors[name + "_scale_inv"], scale)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate"], "required"),
        (["frobnicate"], "invalid choice"),
        (
            ["generate", "--checkpoint", "X", "--prompt-ids", "1,x", "--max-new-tokens", "3"],
            "comma-separated integers",
        ),
        (
            ["generate", "--checkpoint", "{ckpt}", "--prompt-ids", "1", "--max-new-tokens", "0"],
            "--max-new-tokens: must be >= 1, got 0",
        ),
        (
            [
                "generate",
                "--checkpoint",
                "{ckpt}",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "3",
                "--top-p",
                "1.5",
            ],
            "top_p",
        ),
        (
            [
                "generate",
                "--checkpoint",
                "{ckpt}",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "3",
                "--top-k",
                "-1",
            ],
            "top_k",
        ),
        (
            [
                "generate",
                "--checkpoint",
                "{ckpt}",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "3",
                "--draft-depth",
                "9",
            ],
            "draft-depth",
        ),
        (
            [
                "generate",
                "--checkpoint",
                "{ckpt}",
                "--prompt-ids",
                "99999",
                "--max-new-tokens",
                "3",
            ],
            "prompt_ids",
        ),
        (
            ["generate", "--checkpoint", "{ckpt}", "--prompt", "def f(", "--max-new-tokens", "3"],
            "tokenizer",
        ),
        (
            [
                "generate",
                "--checkpoint",
                "/nonexistent",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "3",
            ],
            "nonexistent",
        ),
        (["make-checkpoint", "--preset", "huge", "--out", "{tmp}/x"], "preset"),
        (
            ["generate", "--checkpoint", "{ckpt}", "--backend", "runtime", "--prompt-ids", "1",
             "--max-new-tokens", "3", "--loop", "device"],
            "--loop device: the device loop replays the round's CUDA graph; turn --graphs on",
        ),
        (
            ["generate", "--checkpoint", "{ckpt}", "--backend", "runtime", "--ops", "twins",
             "--prompt-ids", "1", "--max-new-tokens", "3", "--pdl"],
            "--pdl: programmatic dependent launch needs the compiled kernels on a GPU (ops twins",
        ),
    ],
)
def test_bad_arguments_one_line_exit_2(argv, message, ckpt, tmp_path, capsys):
    argv = [a.format(ckpt=ckpt, tmp=tmp_path) for a in argv]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("iquestrt: error:") and message in err


def test_help_explains_every_generate_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for opt in (
        "--checkpoint",
        "--prompt-ids",
        "--prompt",
        "--max-new-tokens",
        "--seed",
        "--temperature",
        "--top-k",
        "--top-p",
        "--backend",
        "--draft-depth",
        "--graphs",
        "--loop",
        "--pdl",
    ):
        assert opt in text


def test_prompt_text_uses_the_checkpoints_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    ckpt = tmp_path / "tok"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(ckpt)]) == 0
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def parse_args(argv):\n    return argv\n"] * 20, trainer)
    tok.save(str(ckpt / "tokenizer.json"))
    ids = tok.encode("def parse_args(").ids
    capsys.readouterr()
    argv = [
        "generate",
        "--checkpoint",
        str(ckpt),
        "--prompt",
        "def parse_args(",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--draft-depth",
        "0",
        "--quiet",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    loaded = load_checkpoint(ckpt)
    model = ReferenceModel(loaded.cfg, loaded.dequantized(), precision="bf16")
    greedy = SamplingDefaults(temperature=0.0, top_k=20, top_p=0.95)
    want = generate(model, GenerationRequest(tuple(ids), 6, greedy, 0)).tokens
    assert [int(x) for x in out[0].split()] == want
    assert out[1] == tok.decode(want)


def test_streamed_text_is_whole_utf8_characters(capsys):
    """Characters the mini tokenizer splits over byte tokens (ï, 😀, —, ü, ß) stream as whole
    UTF-8 characters, chunk by chunk, never as U+FFFD; the concatenation is the decoded text."""
    from iquestrt.api import _Text
    from iquestrt.files import checkpoint_tokenizer
    from qualification import mini_engine

    tok = checkpoint_tokenizer(mini_engine.MINI)
    text = "naïve 😀 — Grüße"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # the characters are split over several tokens
    stream = _Text(tok)
    pieces = [stream.push(ids[i : i + 2]) for i in range(0, len(ids), 2)]  # rounds of 2 tokens
    assert "".join(pieces) == text == tok.decode(ids) == stream.text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.slow
def test_generate_defaults_to_the_mini_model_and_streams_text(capsys):
    """No --checkpoint: the shipped mini model; --stream prints the decoded text as it comes,
    equal to the text of the same request without streaming (per backend: the runtime rounds
    like --precision matched, not like the reference's default bf16); --draft-depth adaptive is
    accepted."""
    base = ["generate", "--prompt", "def parse_args(", "--max-new-tokens", "16",
            "--temperature", "0", "--quiet", "--draft-depth", "adaptive"]
    for backend in ("reference", "runtime"):
        assert main(base + ["--backend", backend]) == 0
        plain = capsys.readouterr().out.splitlines()
        assert len(plain[0].split()) == 16
        assert main(base + ["--backend", backend, "--stream"]) == 0
        streamed = capsys.readouterr().out
        assert streamed.rstrip("\n") == "\n".join(plain[1:]), backend
    assert main(base + ["--draft-depth", "9"]) == 2
    assert "--draft-depth" in capsys.readouterr().err
