"""`iquestrt report acceptance` on the command line: a run with a line of progress per decode,
and bad arguments rejected with one clear line (exit 2) before any decoding."""

import json

import pytest

from iquestrt.cli import main


def _argv(ckpt, prompts, out, *extra):
    return ["report", "acceptance", "--checkpoint", str(ckpt), "--prompts", str(prompts),
            "--out", str(out), "--max-prompt-tokens", "16", "--max-new-tokens", "4", *extra]


def test_cli_run_prints_progress_and_writes_the_report(mini, two_prompts, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(_argv(mini, two_prompts, out, "--seeds", "3", "--depth", "2")) == 0
    cap = capsys.readouterr()
    lines = [x for x in cap.err.splitlines() if x.startswith("[")]
    assert len(lines) == 2 and lines[0].startswith("[1/2] fixed-2 seed 3 ")
    assert "wrote" in cap.out and (out / "acceptance.nc").is_file()
    assert "Only one kind of policy" in (out / "summary.md").read_text()


@pytest.fixture
def empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    return p


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing checkpoint", "--checkpoint"),
        ("empty prompts", "no prompts"),
        ("missing prompts", "no such file or directory"),
        ("depth 9", "--depth 9"),
        ("depth word", "--depth deep"),
        ("same seed twice", "appears twice"),
        ("existing out", "already exists"),
        ("bad prompt line", "exactly one of 'prompt'"),
        ("zero budget", "--max-new-tokens"),
    ],
)
def test_bad_arguments(case, message, mini, two_prompts, empty_file, tmp_path, capsys):
    out, ckpt, prompts, extra = tmp_path / "rep", mini, two_prompts, []
    if case == "missing checkpoint":
        ckpt = tmp_path / "nowhere"
    elif case == "empty prompts":
        prompts = empty_file
    elif case == "missing prompts":
        prompts = tmp_path / "none.jsonl"
    elif case == "depth 9":
        extra = ["--depth", "adaptive", "9"]
    elif case == "depth word":
        extra = ["--depth", "deep"]
    elif case == "same seed twice":
        extra = ["--seeds", "1", "1"]
    elif case == "existing out":  # an empty folder would be taken
        out.mkdir()
        (out / "notes.txt").write_text("x")
    elif case == "bad prompt line":
        prompts = tmp_path / "bad.jsonl"
        prompts.write_text(json.dumps({"id": "x", "text": "def f():"}) + "\n")
    elif case == "zero budget":
        extra = ["--max-new-tokens", "0"]
    capsys.readouterr()
    assert main(_argv(ckpt, prompts, out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("iquestrt: error:") and message in err, err
    assert not out.exists() or case == "existing out"
    assert not list(tmp_path.glob(".rep.tmp-*"))
