"""`run_acceptance` end to end on the mini model (reference backend, bf16): the Dataset against
an independent re-decode of every request, per-depth acceptance (with its Wilson intervals) and
distinct experts recomputed here from first principles, the summary files, the netCDF round trip
(naive means over padded variables), provenance attributes, atomic output."""

import argparse
import hashlib
import json
import math
import os
import shlex

import numpy as np
import pytest
import torch
import xarray as xr
from tokenizers import Tokenizer

import reference.ops as ref_ops
from iquestrt.report import acceptance as acc_mod
from iquestrt.report.acceptance import (
    NC_NAME,
    AcceptanceSpec,
    run_acceptance,
    spec_command,
    spec_from_args,
)
from iquestrt.report.args import add_acceptance_arguments
from iquestrt.report.prompts import load_prompts
from iquestrt.report.provenance import revision
from reference.checkpoint import load_checkpoint
from reference.depth import policy_from_spec
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, ReferenceGenerator
from tests.report.conftest import wilson95

SEEDS, DEPTHS, PROMPT_TOKENS, NEW_TOKENS = (0, 1), ("adaptive", "3"), 24, 12


def _spec(mini, prompts, out, **kw):
    base = dict(checkpoint=mini, prompts=prompts, out=out, seeds=SEEDS, depths=DEPTHS,
                max_prompt_tokens=PROMPT_TOKENS, max_new_tokens=NEW_TOKENS)
    return AcceptanceSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def report(mini, two_prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("rep") / "r"
    seen = []
    run_acceptance(_spec(mini, two_prompts, out), lambda i, n, d: seen.append((i, n)))
    return out, xr.load_dataset(out / NC_NAME, engine="scipy"), seen


@pytest.fixture(scope="module")
def redecoded(mini, two_prompts):
    """Every (prompt, seed, policy) decoded again here, straight from the reference."""
    ck = load_checkpoint(mini)
    model = ReferenceModel(ck.cfg, ck.dequantized(), precision="bf16")
    tok = Tokenizer.from_file(str(mini / "tokenizer.json"))
    out = {}
    for line in two_prompts.read_text().splitlines():
        r = json.loads(line)
        ids = tuple(tok.encode(r["prompt"], add_special_tokens=False).ids[-PROMPT_TOKENS:])
        for spec in DEPTHS:
            gen = ReferenceGenerator(model, policy_from_spec(spec, mini))
            label = "adaptive" if spec == "adaptive" else f"fixed-{spec}"
            for seed in SEEDS:
                req = GenerationRequest(ids, NEW_TOKENS, ck.cfg.sampling, seed)
                out[(r["id"], seed, label)] = (ids, gen.generate(req))
    return model, out


def _index(ds):
    return {(str(r), int(s), str(p)): i for i, (r, s, p) in enumerate(
        zip(ds.request_id.values, ds.seed.values, ds.policy.values, strict=True))}


@pytest.mark.slow
def test_dims_variables_and_progress(report):
    _, ds, seen = report
    assert set(ds.dims) == {"request", "round", "depth", "layer", "rows"}
    assert ds.sizes["request"] == 2 * len(SEEDS) * len(DEPTHS)
    assert seen == [(i, 8) for i in range(8)]
    for name in ("accepted_length", "chosen_depth", "round_latency_s"):
        assert ds[name].dims == ("request", "round")
    for name in ("draft_prob", "draft_entropy", "draft_token", "draft_accepted"):
        assert ds[name].dims == ("request", "round", "depth")
    assert ds.depth_acceptance.dims == ("request", "depth")
    assert ds.distinct_experts.dims == ("request", "layer", "rows")
    assert list(ds.layer.values) == list(range(1, 8))  # layer 0 of the mini model is dense
    assert list(ds.rows.values) == list(range(1, 9))


@pytest.mark.slow
def test_rounds_match_an_independent_decode(report, redecoded):
    _, ds, _ = report
    _, runs = redecoded
    idx = _index(ds)
    assert sorted(idx) == sorted(runs)
    for key, (ids, res) in runs.items():
        d = ds.isel(request=idx[key])
        n = len(res.rounds)
        assert int(d.n_rounds) == n and int(d.new_tokens) == len(res.tokens)
        assert int(d.prompt_tokens) == len(ids) == PROMPT_TOKENS
        assert str(d.stop_reason.values) == res.stop_reason
        assert float(d.tokens_per_round) == res.mean_accepted_length
        for k, r in enumerate(res.rounds):
            assert int(d.round_position[k]) == r.position
            assert int(d.accepted_drafts[k]) == r.accepted
            assert int(d.accepted_length[k]) == len(r.emitted)
            assert int(d.chosen_depth[k]) == len(r.drafts)
            assert int(d.bonus[k]) == int(r.bonus)
            for j, info in enumerate(r.drafts):
                assert int(d.draft_token[k, j]) == info.token
                assert float(d.draft_prob[k, j]) == info.prob
                assert float(d.draft_entropy[k, j]) == info.entropy
                assert int(d.draft_accepted[k, j]) == (1 if j < r.accepted else 0)
            pad = slice(len(r.drafts), None)
            assert d.draft_token[k, pad].isnull().all() and d.draft_prob[k, pad].isnull().all()
        assert d.chosen_depth[n:].isnull().all() and d.round_latency_s[n:].isnull().all()


def test_per_depth_acceptance_recomputed(report, redecoded):
    _, ds, _ = report
    _, runs = redecoded
    idx = _index(ds)
    for key, (_, res) in runs.items():
        got = ds.depth_acceptance.isel(request=idx[key]).values
        cond = ds.depth_acceptance_conditional.isel(request=idx[key]).values
        for j in range(1, ds.sizes["depth"] + 1):
            drafted = [r for r in res.rounds if len(r.drafts) >= j]
            reached = [r for r in drafted if r.accepted >= j - 1]
            want = sum(r.accepted >= j for r in drafted) / len(drafted) if drafted else math.nan
            want_c = sum(r.accepted >= j for r in reached) / len(reached) if reached else math.nan
            assert got[j - 1] == want or (math.isnan(want) and math.isnan(got[j - 1]))
            assert cond[j - 1] == want_c or (math.isnan(want_c) and math.isnan(cond[j - 1]))
    assert np.isfinite(ds.depth_acceptance.sel(depth=1).values).all()


def _brute_distinct(ids: list[list[int]], r: int) -> float:
    counts = [len({e for row in ids[s : s + r] for e in row}) for s in range(len(ids) - r + 1)]
    return sum(counts) / len(counts)


def test_distinct_experts_recomputed(report, redecoded, monkeypatch):
    _, ds, _ = report
    model, runs = redecoded
    calls = []
    real = ref_ops.route

    def spy(x, w, k):
        out = real(x, w, k)
        calls.append(out[1])
        return out

    monkeypatch.setattr(ref_ops, "route", spy)
    idx = _index(ds)
    key = sorted(runs)[0]
    ids, res = runs[key]
    seq = torch.tensor(list(ids) + res.tokens)
    model.target(seq, torch.arange(seq.shape[0]))
    assert len(calls) == 7  # one router call per MoE layer, in layer order
    got = ds.distinct_experts.isel(request=idx[key])
    for li, layer_ids in enumerate(calls):
        gen = layer_ids[len(ids):].tolist()
        for r in range(1, 9):
            assert float(got[li, r - 1]) == _brute_distinct(gen, r), (li, r)
        # broken variant: the prompt's last rows instead of the generated ones must differ
        wrong = layer_ids[len(ids) - len(gen): len(ids)].tolist()
        assert any(float(got[li, r - 1]) != _brute_distinct(wrong, r) for r in range(2, 9))
    assert (ds.distinct_experts.sel(rows=1) == 4).all()  # top-4 routing


def test_latencies(report):
    _, ds, _ = report
    for i in range(ds.sizes["request"]):
        d = ds.isel(request=i)
        n = int(d.n_rounds)
        ends = d.round_end_s.values[:n]
        assert (np.diff(ends) >= 0).all() and ends[-1] <= float(d.wall_s)
        assert np.array_equal(d.round_latency_s.values[1:n], np.diff(ends))
        assert math.isnan(float(d.round_latency_s[0]))
        assert float(d.first_round_s) == ends[0]


def test_naive_means_of_the_reopened_file_match_the_decodes(report, redecoded):
    out, _, _ = report
    _, runs = redecoded
    rounds = [r for _, res in runs.values() for r in res.rounds]
    drafts = [(j < r.accepted, d.prob) for r in rounds for j, d in enumerate(r.drafts)]
    with xr.open_dataset(out / NC_NAME) as ds:
        assert ds.accepted_length.isnull().any()  # some decode has fewer rounds: padding
        want = {"accepted_length": np.mean([len(r.emitted) for r in rounds]),
                "accepted_drafts": np.mean([r.accepted for r in rounds]),
                "chosen_depth": np.mean([len(r.drafts) for r in rounds]),
                "draft_prob": np.mean([p for _, p in drafts])}
        for name, value in want.items():
            assert float(ds[name].mean()) == pytest.approx(value, rel=1e-12), name
        # stored as int8, read back as float32: its mean is good to float32
        assert float(ds.draft_accepted.mean()) == pytest.approx(
            np.mean([a for a, _ in drafts]), rel=1e-6)
        assert ds.accepted_length.attrs["units"] == "tokens"
        assert ds.round_latency_s.attrs["units"] == "s"


def test_provenance_attributes(report, mini, two_prompts):
    out, ds, _ = report
    a = ds.attrs
    rev = revision()  # checked against git itself in test_report_provenance.py
    assert (a["code_revision"], a["code_worktree"]) == (rev["commit"], rev["worktree"])
    files = sorted(p for p in mini.rglob("*") if p.suffix in (".json", ".safetensors"))
    manifest = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  "
                       f"{p.relative_to(mini).as_posix()}\n" for p in files)
    assert a["checkpoint_sha256_manifest"] == manifest and "config.json" in manifest
    assert a["checkpoint_sha256"] == hashlib.sha256(manifest.encode()).hexdigest()
    assert "*.safetensors" in a["checkpoint_sha256_covers"]
    # the command, parsed by the real CLI parser, gives back the spec that ran
    words = shlex.split(a["command"])
    assert words[:3] == ["iquestrt", "report", "acceptance"]
    parser = argparse.ArgumentParser()
    add_acceptance_arguments(parser)
    assert spec_from_args(parser.parse_args(words[3:])) == _spec(mini, two_prompts, out)
    assert a["checkpoint_sha256"] in (out / "summary.md").read_text()


def test_spec_command_round_trips_every_setting(tmp_path):
    spec = AcceptanceSpec(checkpoint=tmp_path / "ck pt", prompts=tmp_path / "p.jsonl",
                          out=tmp_path / "o", seeds=(4, 9), depths=("2", "adaptive"),
                          per_kind=3, limit=2, max_prompt_tokens=77, max_new_tokens=5,
                          backend="runtime", ops="twins", precision="fp32", graphs="off",
                          force=True)
    parser = argparse.ArgumentParser()
    add_acceptance_arguments(parser)
    back = spec_from_args(parser.parse_args(shlex.split(spec_command(spec))[3:]))
    assert back == spec


def test_defaults_are_the_shipped_model_and_request_set(tmp_path, monkeypatch):
    from iquestrt import assets
    from iquestrt.report.args import DEFAULT_OUT
    parser = argparse.ArgumentParser()
    add_acceptance_arguments(parser)
    monkeypatch.chdir(tmp_path)
    spec = spec_from_args(parser.parse_args(["--limit", "1"]))
    assert spec.checkpoint == assets.default_model()
    assert spec.prompts == assets.data("requests", "v1")
    assert spec.out.name == DEFAULT_OUT and spec.limit == 1
    bad = _spec(spec.checkpoint, spec.prompts, tmp_path / "x", limit=0)
    with pytest.raises(ValueError, match="--limit: must be >= 1"):
        bad.validate()


def test_limit_keeps_the_first_prompts_in_file_order(mini):
    from iquestrt import assets
    tok = Tokenizer.from_file(str(mini / "tokenizer.json"))
    reqs = assets.data("requests", "v1")
    every = load_prompts(reqs, tok, PROMPT_TOKENS, per_kind=2)
    assert load_prompts(reqs, tok, PROMPT_TOKENS, per_kind=2, limit=3) == every[:3]
    assert len(every) > 3


def test_summary_and_adaptive_vs_fixed(report, redecoded):
    out, ds, _ = report
    md = (out / "summary.md").read_text()
    html = (out / "summary.html").read_text()
    assert "| adaptive − fixed-3 | 4 |" in md  # 2 prompts × 2 seeds paired
    assert "<table>" in html and "<code>" in html
    assert not [line for line in html.splitlines() if line.startswith(("|", "#"))]
    _, runs = redecoded
    depth_section = md.split("## Per-depth acceptance")[1].split("\n## ")[0]
    for policy in ("adaptive", "fixed-3"):
        rounds = [r for (_, _, p), (_, res) in runs.items() if p == policy for r in res.rounds]
        for j in range(1, ds.sizes["depth"] + 1):
            n = sum(len(r.drafts) >= j for r in rounds)
            k = sum(len(r.drafts) >= j and r.accepted >= j for r in rounds)
            if n == 0:
                assert f"| {policy} | {j} |" not in depth_section
                continue
            ci = wilson95(k, n)
            few = "yes" if n < 20 else ""
            row = (f"| {policy} | {j} | {n} | {k} | {k / n:.3f} | [{ci[0]:.3f}, "
                   f"{ci[1]:.3f}] | {few} |")
            assert row in md, row
    for name in ("chosen_depth", "accepted_length", "depth_acceptance", "tokens_per_round",
                 "time_per_token", "distinct_experts"):
        assert f"(plots/{name}.svg)" in md and (out / "plots" / f"{name}.svg").is_file()
    assert html.count("<svg") == 6 and "adaptive − fixed-3" in html
    assert sorted(p.name for p in out.iterdir()) == [NC_NAME, "plots", "summary.html",
                                                     "summary.md"]
    assert not list(out.parent.glob(".r.tmp-*"))


def test_interrupt_leaves_no_report(mini, two_prompts, tmp_path):
    out = tmp_path / "r"

    def stop(i, n, d):
        assert (tmp_path / f".r.tmp-{os.getpid()}").is_dir()  # the loop writes there
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_acceptance(_spec(mini, two_prompts, out, seeds=(0,), depths=("3",)), stop)
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_the_previous_report(mini, two_prompts, tmp_path, monkeypatch):
    out = tmp_path / "r"
    out.mkdir()
    (out / NC_NAME).write_text("previous report")  # an earlier report: --force may replace it

    def boom(ds, folder):
        raise RuntimeError("summary failed")

    monkeypatch.setattr(acc_mod, "write_summary", boom)
    spec = _spec(mini, two_prompts, out, seeds=(0,), depths=("3",), max_new_tokens=2,
                 force=True)
    with pytest.raises(RuntimeError, match="summary failed"):
        run_acceptance(spec)
    assert [p.name for p in tmp_path.iterdir()] == ["r"]
    assert (out / NC_NAME).read_text() == "previous report"


def test_prompt_truncation_keeps_the_last_tokens(mini, two_prompts):
    tok = Tokenizer.from_file(str(mini / "tokenizer.json"))
    full = load_prompts(two_prompts, tok, 10**6)
    cut = load_prompts(two_prompts, tok, 7)
    for f, c in zip(full, cut, strict=True):
        assert c.ids == f.ids[-7:] and c.full_tokens == len(f.ids) > 7


def test_runtime_backend_matches_the_engine(mini, tmp_path):
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from reference.depth import FixedDepth

    prompts = tmp_path / "ids.jsonl"
    prompts.write_text(json.dumps({"id": "ids", "prompt_ids": list(range(40, 52))}) + "\n")
    out = tmp_path / "r"
    run_acceptance(_spec(mini, prompts, out, seeds=(2,), depths=("2",), max_new_tokens=6,
                         backend="runtime", ops="twins"))
    ds = xr.load_dataset(out / NC_NAME, engine="scipy")
    ck = load_checkpoint(mini)
    rcfg = RuntimeConfig(ops="twins", max_positions=12 + 6 + 8, policy=FixedDepth(2))
    res = Engine.from_checkpoint(mini, rcfg).generate(
        GenerationRequest(tuple(range(40, 52)), 6, ck.cfg.sampling, 2), on_round=lambda r: None)
    assert ds.attrs["backend"] == "runtime" and ds.attrs["routing_precision"] == "bf16-fold"
    assert ds.attrs["graphs"] == "off"  # auto on a CPU
    assert "backend runtime (ops twins, graphs off)" in (out / "summary.md").read_text()
    assert int(ds.new_tokens[0]) == len(res.tokens) and int(ds.n_rounds[0]) == len(res.rounds)
    for k, r in enumerate(res.rounds):
        assert int(ds.accepted_drafts[0, k]) == r.accepted
        assert [int(t) for t in ds.draft_token[0, k, : len(r.drafts)]] == [
            d.token for d in r.drafts]
        assert [float(p) for p in ds.draft_prob[0, k, : len(r.drafts)]] == [
            d.prob for d in r.drafts]


@pytest.mark.parametrize(("kw", "match"), [
    (dict(graphs="on"), "--graphs on: applies to --backend runtime"),
    (dict(graphs="maybe"), "--graphs: 'auto', 'on' or 'off'"),
])
def test_graphs_setting_is_checked_before_decoding(mini, two_prompts, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        run_acceptance(_spec(mini, two_prompts, tmp_path / "r", **kw))
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
def test_graphs_on_without_a_gpu_is_refused(mini, two_prompts, tmp_path):
    with pytest.raises(ValueError, match="--graphs on: CUDA graphs need a GPU"):
        run_acceptance(_spec(mini, two_prompts, tmp_path / "r", graphs="on", backend="runtime"))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_auto_on_a_gpu_replays_graphs_with_the_same_decodes(mini, two_prompts, tmp_path):
    """With the compiled kernels on a GPU the report replays one graph per round by default;
    every decode (tokens, drafts, acceptance) equals the eager run's."""
    runs = {}
    for graphs in ("auto", "off"):
        out = tmp_path / graphs
        run_acceptance(_spec(mini, two_prompts, out, backend="runtime", ops="kernels",
                             graphs=graphs))
        runs[graphs] = xr.load_dataset(out / NC_NAME, engine="scipy")
    assert runs["auto"].attrs["graphs"] == "on" and runs["off"].attrs["graphs"] == "off"
    for var in ("new_tokens", "n_rounds", "accepted_drafts", "draft_token", "chosen_depth"):
        assert runs["auto"][var].equals(runs["off"][var]), var
