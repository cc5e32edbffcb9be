"""training/reproduce.py on the CPU with the tiny preset: a reproduction of a short run repeats
it bit for bit (pass, Δ = 0); a report whose held-out loss is off by more than the tolerance
fails with exit status 1 and says so in its record; data of another size and a broken report are
refused before any training."""

from __future__ import annotations

import json

import pytest

from tests.training.test_train import _argv, data_dir  # noqa: F401  (fixture)
from training.reproduce import main as reproduce
from training.train import main as train


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("card") / "run"
    train(_argv(data_dir, out, "--max-steps", "3"))
    return out / "training_report.json"


def _reproduce(report, data, out, *extra) -> int:
    return reproduce(["--report", str(report), "--data", str(data), "--out", str(out),
                      "--tokenizer", str(data / "tokenizer.json"), "--device", "cpu", *extra])


@pytest.mark.slow
def test_a_rerun_is_bit_identical(trained, data_dir, tmp_path):  # noqa: F811
    assert _reproduce(trained, data_dir, tmp_path) == 0
    rec = json.loads((tmp_path / "reproduce.json").read_text())
    assert [r["delta"] for r in rec["rows"]] == [0.0] * len(rec["rows"])
    assert rec["run"]["steps"] == 3
    assert "bit-identical" in (tmp_path / "reproduce.md").read_text()


@pytest.mark.slow
def test_a_card_off_by_more_than_the_tolerance_fails(trained, data_dir, tmp_path):  # noqa: F811
    rep = json.loads(trained.read_text())
    rep["heldout_loss"]["draft"][2] += 0.05
    bad = tmp_path / "training_report.json"
    bad.write_text(json.dumps(rep))
    assert _reproduce(bad, data_dir, tmp_path / "out") == 1
    rows = json.loads((tmp_path / "out" / "reproduce.json").read_text())["rows"]
    assert [r["within"] for r in rows].count(False) == 1 and not rows[3]["within"]
    assert "FAIL" in (tmp_path / "out" / "reproduce.md").read_text()


def test_bad_inputs_are_named_before_training(trained, data_dir, tmp_path, capsys):  # noqa: F811
    rep = json.loads(trained.read_text())
    rep["data"]["train_tokens"] += 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps(rep))
    assert _reproduce(other, data_dir, tmp_path / "a") == 2
    assert "train.bin: 4000 tokens" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{}")
    assert _reproduce(tmp_path / "broken.json", data_dir, tmp_path / "b") == 2
    assert "has no 'train_config'" in capsys.readouterr().err
    assert _reproduce(trained, tmp_path, tmp_path / "c") == 2
    assert "missing; build the shards" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
