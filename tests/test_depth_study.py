"""training/depth_study.py: fitting prompts only from the train split, the shared prefill equals
a plain decode bit for bit, paired runs (identical requests for every policy), the modeled time
per token recomputed independently from the decoded rounds, the bootstrap (deterministic, and
recomputed here by loops). Model pieces run on the tiny correlated checkpoint (matched)."""

import dataclasses
import json
import math

import pytest
import torch

from corpus.requests import load_requests
from corpus.stdlib import load_split
from corpus.tokenizer import load_tokenizer
from reference.checkpoint import load_checkpoint
from reference.config import SamplingDefaults
from reference.depth import AdaptiveDepth, FixedDepth
from reference.model import ReferenceModel
from reference.speculative import ReferenceGenerator
from tests.helpers.engine_setup import make_ckpt, rounds_key
from training.depth_fit import CostModel
from training.depth_study_config import StudyConfig as Cfg
from training.depth_study_prompts import Prompt, check_disjoint, heldout_prompts, train_prompts
from training.depth_study_runs import SharedPrefill, run_pairs
from training.depth_study_stats import (
    BENCH,
    bootstrap_ratio,
    by_policy,
    cost_from_benchmark,
    heldout_summary,
    pair_arrays,
)

SEEDS, NEW = (0, 1), 8
# The correlated tiny draft is near one-hot at T = 1 (q = 1, h = 0 in every round): at T = 8 its
# features vary, so the adaptive rule below (another depth iff q(y_j) >= 0.6) varies its depth.
SAMPLING = SamplingDefaults(temperature=8.0, top_k=20, top_p=0.95)
ADAPTIVE = AdaptiveDepth(((0.0, 0.0, 1.0, 0.0, 0.0, 0.0),) * 4, 0.6)
# dyadic costs: every modeled time below is an exact binary sum, so comparisons are exact
COST = CostModel(depth=128.0, round=512.0, row=64.0)


@pytest.fixture(scope="module")
def split():
    return load_split()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ck = load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))
    return ReferenceModel(ck.cfg, ck.dequantized(), "matched")


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(7)
    v = model.cfg.target.vocab_size
    return [Prompt(f"p{i}", f"synthetic{i}.py", tuple(torch.randint(2, v, (n,), generator=g)
                                                       .tolist())) for i, n in enumerate((6, 9))]


POLICIES = {"adaptive": ADAPTIVE} | {f"fixed-{k}": FixedDepth(k) for k in range(3, 8)}


@pytest.fixture(scope="module")
def paired(model, prompts):
    calls = []

    def spy(m, pol, req):
        calls.append((next(k for k, p in POLICIES.items() if p is pol), req))
        return ReferenceGenerator(m, pol).generate(req)

    shared = SharedPrefill(model)
    rows, results = run_pairs(shared, prompts, SEEDS, POLICIES, SAMPLING, NEW, lambda s: None,
                              spy)
    return rows, results, calls, shared


# --- prompts ---------------------------------------------------------------------------------


def test_fit_prompts_come_from_train_files_only(split, tok):
    ps = train_prompts(split, tok, 3, 128, 256)
    assert ps == train_prompts(split, tok, 3, 128, 256)  # deterministic
    train = {f.rel: f for f in split.train}
    assert len({p.path for p in ps}) == 3
    for p in ps:
        assert p.path in train and not split.rule.is_heldout(p.path)
        assert 128 <= len(p.ids) <= 256
        start = int(p.id.rsplit("@", 1)[1])
        whole = tok.encode(train[p.path].text(), add_special_tokens=False).ids
        assert list(p.ids) == whole[start : start + len(p.ids)]
    leak = split.heldout[5]
    bad = dataclasses.replace(split, train=split.train[:40] + (leak,) + split.train[40:])
    with pytest.raises(ValueError, match=f"{leak.rel} is a held-out file"):
        train_prompts(bad, tok, 3, 128, 256)


def test_eval_prompts_are_held_out_and_disjoint(split, tok):
    fit_p = train_prompts(split, tok, 2, 128, 256)
    ev = heldout_prompts(load_requests(kind="edit")[:2], tok, 256)
    check_disjoint(fit_p, ev, split)
    assert all(len(p.ids) == 256 for p in ev)  # v1 prompts have >= 300 tokens: cut to the tail
    crossed = Prompt("x", split.heldout[0].rel, (1, 2))
    with pytest.raises(ValueError, match="cross the train/held-out split"):
        check_disjoint(fit_p + [crossed], ev, split)
    with pytest.raises(ValueError, match="cross the train/held-out split"):
        check_disjoint(fit_p, ev + [dataclasses.replace(fit_p[0], id="y")], split)


# --- shared prefill and pairing ----------------------------------------------------------------


@pytest.mark.slow
def test_shared_prefill_decodes_bit_identically(model, prompts, paired):
    rows, results, calls, shared = paired
    assert shared.hits > 0  # the cache was used, so the comparison below covers it
    for (label, req), res in zip(calls, results, strict=True):
        if label not in ("adaptive", "fixed-7"):
            continue  # CPU time: the other fixed depths take the same code path
        plain = ReferenceGenerator(model, POLICIES[label]).generate(req)
        assert rounds_key(plain) == rounds_key(res) and plain.tokens == res.tokens
    with pytest.raises(ValueError, match="needs Precision 'matched'"):
        SharedPrefill(ReferenceModel(model.cfg, model.p, "bf16"))


def pairing_problems(calls) -> list[str]:
    """Policies that did not see exactly the same (prompt, seed, budget, sampling) requests."""
    by = {}
    for label, req in calls:
        by.setdefault(label, []).append(req)
    ref = sorted(next(iter(by.values())), key=lambda r: (r.prompt_ids, r.seed))
    return [k for k, v in by.items() if sorted(v, key=lambda r: (r.prompt_ids, r.seed)) != ref]


def test_every_policy_decodes_the_same_pairs(prompts, paired):
    rows, _, calls, _ = paired
    assert {k for k, _ in calls} == set(POLICIES)
    assert pairing_problems(calls) == []
    want = {(p.ids, s) for p in prompts for s in SEEDS}
    for label in POLICIES:
        reqs = [r for k, r in calls if k == label]
        assert len(reqs) == len(want) and {(r.prompt_ids, r.seed) for r in reqs} == want
        assert all(r.max_new_tokens == NEW and r.sampling == SAMPLING for r in reqs)
        assert sorted((r["prompt"], r["seed"]) for r in rows if r["policy"] == label) == sorted(
            (p.id, s) for p in prompts for s in SEEDS)
    # the check catches a runner that shifts one policy's seeds
    broken = [(k, dataclasses.replace(r, seed=r.seed + 1) if k == "fixed-5" else r)
              for k, r in calls]
    assert pairing_problems(broken) == ["fixed-5"]


# --- modeled time ------------------------------------------------------------------------------


def _independent(results, labels, label, marginal):
    t = n = k = d = 0.0
    for lab, res in zip(labels, results, strict=True):
        if lab != label:
            continue
        for r in res.rounds:
            t += COST.round + len(r.drafts) * marginal
            n += r.accepted + 1
            k += 1
            d += len(r.drafts)
    return t, n, k, d


def test_modeled_time_per_token_matches_an_independent_recount(paired):
    rows, results, calls, _ = paired
    labels = [k for k, _ in calls]
    agg = by_policy(rows, COST)
    for label in POLICIES:
        t, n, k, d = _independent(results, labels, label, COST.depth + COST.row)
        a = agg[label]
        assert (a["time"], a["tokens"], a["rounds"]) == (t, n, k)
        assert a["time_per_token"] == t / n and a["tokens_per_round"] == n / k
        assert a["drafts_per_round"] == d / k
        ta, na = pair_arrays(rows, COST, label)
        assert float(ta.sum()) == t and float(na.sum()) == n
        # broken variant: a cost that forgets the verification row per draft
        wrong, _, _, _ = _independent(results, labels, label, COST.depth)
        assert wrong != a["time"]
    # the adaptive runs chose different depths, so per-round depths (not a constant) are summed
    assert len({c for r in rows if r["policy"] == "adaptive" for c in r["depths"]}) > 1


def test_heldout_summary_best_fixed_and_wins(paired):
    rows, results, _, _ = paired
    h = heldout_summary(rows, results, ADAPTIVE, COST, Cfg(boot=64))
    agg = by_policy(rows, COST)
    best = min((f"fixed-{k}" for k in range(3, 8)), key=lambda k: agg[k]["time_per_token"])
    assert h["best_fixed"] == best and h["pairs"] == len(SEEDS) * 2
    ta, na = pair_arrays(rows, COST, "adaptive")
    tb, nb = pair_arrays(rows, COST, best)
    per = [(float(ta[i] / na[i]), float(tb[i] / nb[i])) for i in range(len(ta))]
    assert h["vs_best_pairs"] == {"faster": sum(a < b for a, b in per),
                                  "equal": sum(a == b for a, b in per),
                                  "slower": sum(a > b for a, b in per)}
    # the replay of fixed-7 rounds at depth 7 is those rounds themselves
    t7 = 1 / (agg["fixed-7"]["tokens"] / agg["fixed-7"]["time"])
    assert h["replay_on_fixed7_rounds"]["fixed-7"]["time_per_token"] == t7


def test_cost_model_from_benchmark(tmp_path):
    cost, info = cost_from_benchmark(BENCH)
    assert abs(cost.marginal - 194) < 1 and abs(cost.round - 568) < 1  # the study's brief
    p = tmp_path / "b.json"
    rows = [{"depth": "3", "graphs": True, "round_us": 1000.0},
            {"depth": "5", "graphs": False, "round_us": 9e9},
            {"depth": "5", "graphs": True, "round_us": 1400.0}]
    p.write_text(json.dumps({"rows": rows}))
    cost, info = cost_from_benchmark(p)
    assert (cost.marginal, cost.round) == (200.0, 400.0)
    assert cost.time(torch.tensor([3, 5])).tolist() == [1000.0, 1400.0]
    p.write_text(json.dumps({"rows": rows[:2]}))
    with pytest.raises(ValueError, match=r"b\.json: need graph rows of depths '3' and '5'"):
        cost_from_benchmark(p)


# --- bootstrap ---------------------------------------------------------------------------------


def _loop_bootstrap(ta, na, fixed, boot, seed):
    """The same resampling written with loops (the indices drawn as the study draws them)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(ta), (boot, len(ta)), generator=g).tolist()
    out = {k: [] for k in fixed}
    best = []
    for row in idx:
        ra = math.fsum(ta[i] for i in row) / math.fsum(na[i] for i in row)
        rs = {k: math.fsum(t[i] for i in row) / math.fsum(n[i] for i in row)
              for k, (t, n) in fixed.items()}
        for k in fixed:
            out[k].append(ra / rs[k])
        best.append(ra / min(rs.values()))
    q = lambda xs: [sorted(xs)[round(0.025 * (boot - 1))], sorted(xs)[round(0.975 * (boot - 1))]]  # noqa: E731
    return {k: q(v) for k, v in out.items()}, q(best)


def test_bootstrap_is_deterministic_and_recomputes():
    g = torch.Generator().manual_seed(3)
    n = 30
    na = torch.randint(20, 40, (n,), generator=g).double()
    ta = na * 500 + torch.randint(0, 4000, (n,), generator=g).double()
    fixed = {f"fixed-{k}": (na * (480 + 10 * k) + torch.randint(0, 4000, (n,), generator=g),
                            na.clone()) for k in (3, 4, 5)}
    a = bootstrap_ratio(ta, na, fixed, 500, 11)
    assert a == bootstrap_ratio(ta, na, fixed, 500, 11)
    other = bootstrap_ratio(ta, na, fixed, 500, 12)
    assert other["ci95"] != a["ci95"] and other["point"] == a["point"]
    per, best = _loop_bootstrap(ta.tolist(), na.tolist(),
                                {k: (t.tolist(), m.tolist()) for k, (t, m) in fixed.items()},
                                500, 11)
    for k, (t, m) in fixed.items():
        assert a["point"][k] == (math.fsum(ta.tolist()) / math.fsum(na.tolist())) / (
            math.fsum(t.tolist()) / math.fsum(m.tolist()))
        assert a["ci95"][k] == per[k]  # integer data: every sum exact, same division order
        assert a["ci95"][k][0] <= a["point"][k] <= a["ci95"][k][1]
    assert a["ci95_best_rechosen"] == best
    same = bootstrap_ratio(ta, na, {"x": (ta, na)}, 200, 0)
    assert same["point"]["x"] == 1.0 and same["ci95"]["x"] == [1.0, 1.0]
