"""training/card.py on the tiny "correlated" checkpoint (its draft agrees with the target often
but not always, so rounds stop at every depth): acceptance counts recomputed here from round
records, distinct experts against a brute-force set union, and the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpus.requests import FIELDS, KINDS
from reference.checkpoint import load_checkpoint
from reference.depth import DraftInfo
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, RoundRecord, generate
from tests.helpers.engine_setup import GREEDY, SAMPLING, make_ckpt
from training import card

PROMPT = [5, 17, 300, 42, 42, 9, 111, 7, 250, 3, 64, 18]
DEPTH = 4


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("card") / "ckpt", "correlated")


@pytest.fixture(scope="module")
def model(ckpt_dir):
    c = load_checkpoint(ckpt_dir)
    return ReferenceModel(c.cfg, c.dequantized(), precision="bf16")


def expected_counts(rounds, depth):
    """Round with a accepted drafts (of `depth`): reaches depths 1 … min(a+1, depth), accepts
    1 … a."""
    reached = [sum(min(r.accepted + 1, depth) >= j for r in rounds) for j in range(1, depth + 1)]
    accepted = [sum(r.accepted >= j for r in rounds) for j in range(1, depth + 1)]
    return reached, accepted


def unconditional(rounds, depth):
    """Broken: accepted at depth j among all rounds that drafted j tokens."""
    return [sum(r.accepted >= j for r in rounds) / sum(len(r.drafts) >= j for r in rounds)
            for j in range(1, depth + 1)]


@pytest.mark.parametrize("sampling,seed", [(SAMPLING, 0), (SAMPLING, 1), (GREEDY, 0)])
@pytest.mark.slow
def test_acceptance_matches_round_records(model, sampling, seed):
    cfg = card.CardConfig(tokens=40, depths=(DEPTH,), seeds=(seed,))
    tallies = card.decode_tallies(model, PROMPT, cfg)
    mode = "greedy" if sampling is GREEDY else f"sampling-seed{seed}"
    got = tallies[DEPTH, mode].summary()
    res = generate(model, GenerationRequest(tuple(PROMPT), 40, sampling, seed), depth=DEPTH)
    reached, accepted = expected_counts(res.rounds, DEPTH)
    assert (got["reached"], got["accepted"]) == (reached, accepted)
    assert got["rounds"] == len(res.rounds)
    assert got["mean_accepted_length"] == res.mean_accepted_length
    rates = got["acceptance"]
    assert all(x is None or 0.0 <= x <= 1.0 for x in rates)
    assert rates == [a / n if n else None for n, a in zip(reached, accepted, strict=True)]
    # the correlated draft is rejected at some depth and accepted at another
    assert 0 < accepted[0] < reached[0] and reached[-1] < len(res.rounds)
    assert unconditional(res.rounds, DEPTH) != rates  # the broken variant differs


def test_depth_counts_of_partial_rounds():
    mk = RoundRecord
    d = [DraftInfo(1, 0.5, 1.0)] * 3
    rounds = [mk(0, d, 0, [1], False), mk(1, d, 2, [1, 1, 2], False), mk(4, d, 3, [1] * 4, True),
              mk(8, d[:1], 1, [1, 1], True)]  # a round that drafted only one token
    assert card.depth_counts(rounds, 3) == ([4, 2, 2], [3, 2, 1])
    tl = card.Tally.of(rounds, 3)
    assert (tl + tl).summary()["acceptance"] == card.rates([8, 4, 4], [6, 4, 2])
    assert tl.summary()["mean_accepted_length"] == 10 / 4


def brute_union(ids: torch.Tensor, r: int) -> float:
    rows = [set(x) for x in ids.tolist()]
    wins = [set().union(*rows[t : t + r]) for t in range(len(rows) - r + 1)]
    return sum(map(len, wins)) / len(wins)


def test_distinct_experts(model):
    t = model.cfg.target
    e, k = t.num_experts, t.num_experts_per_tok
    plain = model.target(torch.tensor(PROMPT), torch.arange(len(PROMPT)))
    routes = card.target_routes(model, PROMPT)
    assert "_moe" not in vars(model)  # the recorder is removed again
    again = model.target(torch.tensor(PROMPT), torch.arange(len(PROMPT)))
    assert torch.equal(plain.logits, again.logits)
    assert sorted(routes) == list(range(1, t.num_hidden_layers))  # layer 0 is dense
    for ids in routes.values():
        assert ids.shape == (len(PROMPT), k)
        assert all(len(set(row)) == k and 0 <= min(row) and max(row) < e for row in ids.tolist())
        sums = card.union_sizes(ids, e, 8)
        mean = [s / w for s, w in sums]
        assert [w for _, w in sums] == [len(PROMPT) - r + 1 for r in range(1, 9)]
        assert mean == pytest.approx([brute_union(ids, r) for r in range(1, 9)], abs=0)
        assert mean[0] == k
        assert all(a <= b for a, b in zip(mean, mean[1:], strict=False))
        assert all(m <= min(r * k, e) for r, m in enumerate(mean, 1))
    # broken: per-row counts added without the union pass no brute-force check and break the
    # bound once r·k > E
    no_union = [k * r for r in range(1, 9)]
    assert no_union != [brute_union(routes[1], r) for r in range(1, 9)]
    assert not all(m <= min(r * k, e) for r, m in enumerate(no_union, 1))
    assert card.uniform_union(e, k, 1) == k and card.uniform_union(e, k, 50) <= e


def _request_set(path, prompts: dict[str, list[str]]):
    path.mkdir()
    for kind in KINDS:
        lines = []
        for i, text in enumerate(prompts[kind]):
            vals = (f"{kind}:x.py:f@{i}", kind, "x.py", "0" * 64, "f", 1, 0, len(text), "",
                    0, 0, 0, text)
            lines.append(json.dumps(dict(zip(FIELDS, vals, strict=True))) + "\n")
        (path / f"{kind}.jsonl").write_text("".join(lines))


def _report():
    return {"command": "python -m training.train --fake", "steps": 3, "total_steps": 3,
            "stopped_by": "steps", "tokens": 96, "epochs": 1.0, "train_seconds": 2.0,
            "tokens_per_s": 48.0, "device": "cpu", "torch": "x", "seed": 0,
            "checkpoint_bytes": 1000, "data": {"train_tokens": 96, "heldout_tokens": 10},
            "params": {"total": 10**6, "target_active_per_token": 10**5},
            "train_config": {"batch_size": 1, "seq_len": 32, "lr": 0.1},
            "train_loss": {"target": 5.0, "draft": [6.0] * 7, "step": 3, "steps": 2},
            "heldout_loss": {"target": 5.5, "draft": [6.5] * 7, "tokens": 10}}


@pytest.mark.slow
def test_cli_end_to_end(ckpt_dir, tmp_path, capsys):
    text = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(ckpt_dir / "tokenizer.json"))
    (ckpt_dir / "training_report.json").write_text(json.dumps(_report()))
    reqs = tmp_path / "reqs"
    _request_set(reqs, {k: [text, text[:20]] for k in KINDS})
    out = tmp_path / "out"
    argv = ["--checkpoint", str(ckpt_dir), "--out", str(out), "--requests", "1", "--tokens", "6",
            "--request-set", str(reqs)]
    threads = torch.get_num_threads()
    try:
        assert card.main(argv) == 0
        assert card.main(argv[:-2] + ["--request-set", str(tmp_path / "none")]) == 2
    finally:
        torch.set_num_threads(threads)  # main sets one thread for the process
    assert "[1/1] completion" in capsys.readouterr().out
    c = json.loads((out / "card.json").read_text())
    ev = c["evaluation"]
    n = len(tok.encode(text[:20], add_special_tokens=False).ids)  # the 2nd of 2: the midpoint
    assert ev["requests"] == [{"id": "completion:x.py:f@1", "kind": "completion",
                               "prompt_tokens": n, "used_tokens": n}]
    assert c["training"]["heldout_loss"] == _report()["heldout_loss"]  # cited as is
    assert sorted(ev["by_depth"]) == ["3", "5", "7"]
    md = (out / "MODEL_CARD.md").read_text()
    s7 = ev["by_depth"]["7"]["sampling"]
    assert f"| 1 | {card._f(s7['acceptance'][0])} | {s7['reached'][0]} |" in md
    assert "| held-out (10 tokens) | 5.500 |" in md
    assert "| train (mean of steps 2–3) | 5.000 |" in md


def test_pick_requests_spreads_kinds(tmp_path):
    _request_set(tmp_path / "r", {k: [f"{k}{i}" for i in range(5)] for k in KINDS})
    got = card.pick_requests(tmp_path / "r", 4)
    assert [r["kind"] for r in got] == ["completion", "completion", "docstring", "edit"]
    assert [r["prompt"] for r in got[:2]] == ["completion1", "completion3"]
    with pytest.raises(ValueError, match="has 5 completion prompts, 6 needed"):
        card.pick_requests(tmp_path / "r", 18)


class _Ids:
    def __init__(self, ids):
        self.ids = ids


class _StubTokenizer:
    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return _Ids(PROMPT)


def test_measure_truncates_to_last_tokens(model):
    cfg = card.CardConfig(requests=1, tokens=4, max_prompt=8, depths=(2,), seeds=(0,), rows=3)
    rec = {"id": "completion:a", "kind": "completion", "prompt": "unused"}
    ev = card.measure(model, _StubTokenizer(), [rec], cfg, log=lambda *a, **k: None)
    assert ev["requests"][0]["used_tokens"] == 8 and ev["routing"]["positions"] == 8
    e = model.cfg.target.num_experts
    for layer, ids in card.target_routes(model, PROMPT[-8:]).items():
        want = [s / w for s, w in card.union_sizes(ids, e, 3)]
        assert ev["routing"]["distinct_experts"][str(layer)] == want
    res = generate(model, GenerationRequest(tuple(PROMPT[-8:]), 4, GREEDY, 0), depth=2)
    assert ev["by_depth"]["2"]["greedy"]["rounds"] == len(res.rounds)
